"""What the user asked for when running the experts on several devices, validated once.

`ParallelOptions` holds the choices; `ParallelLayout` is the arithmetic that turns them into rank groups:

- ranks `[0, world)` map one-to-one onto `devices`;
- with `cfg_parallel` the first half of the ranks computes the conditional branch and the second half the
  unconditional one (global rank r and r + world/2 are CFG peers). Each half is its own torch.distributed
  world (its own default group): cache-dit reduces its cache decision over the default group, and each
  branch must decide on its own residuals as it does on one device. The peers exchange predictions over
  a separate two-rank group. Without `cfg_parallel` there is one branch of all ranks;
- inside a branch, consecutive runs of `ulysses_degree` ranks form one sequence-parallel group;
- `fsdp` shards every expert over the ranks of a branch; `hsdp` shards over `branch / replicate_size`
  consecutive ranks and replicates over `replicate_size` such groups. Sharding is independent of the
  Ulysses split: every rank runs the same blocks in the same order, so the all-gathers line up.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import WanVACEInputError
from ..validation import validate_finite, validate_integer

SHARD_MODES = ("none", "fsdp", "hsdp")
LAUNCHERS = ("local", "torchrun")
DEFAULT_ENDPOINT = "127.0.0.1:29511"


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def parse_devices(text: str) -> tuple[str, ...]:
    """`"cuda:0, cuda:1"` -> `("cuda:0", "cuda:1")`; refuses empty entries and mixed kinds."""
    if not isinstance(text, str):
        raise WanVACEInputError(f"devices={text!r} is not text; list devices like 'cuda:0,cuda:1' or 'cpu,cpu'.")
    devices = tuple(part.strip() for part in text.split(",") if part.strip())
    if not devices:
        raise WanVACEInputError("devices is empty; list devices like 'cuda:0,cuda:1' or 'cpu,cpu'.")
    kinds = set()
    for device in devices:
        kind, _, index = device.partition(":")
        if kind not in ("cuda", "cpu") or (kind == "cuda" and not index.isdigit()) or (kind == "cpu" and index):
            raise WanVACEInputError(
                f"devices entry {device!r} is not a device; use 'cuda:N' (one per GPU) or 'cpu' (one per CPU worker)."
            )
        kinds.add(kind)
    if len(kinds) > 1:
        raise WanVACEInputError(f"devices={text!r} mixes CPU and GPU workers; list only cuda:N entries or only cpu.")
    return devices


def _refuse_repeated_gpus(devices: tuple[str, ...]) -> None:
    gpus = [device for device in devices if device.startswith("cuda")]
    repeated = sorted({device for device in gpus if gpus.count(device) > 1})
    if repeated:
        raise WanVACEInputError(
            f"devices={','.join(devices)!r} names {', '.join(repeated)} more than once; list each GPU once (one "
            "worker per GPU)."
        )


@dataclass(frozen=True)
class ParallelOptions:
    """How to spread the experts over devices. Validated on construction; `check_*` check it against a model/run."""

    devices: tuple[str, ...] = ("cpu", "cpu")
    shard: str = "fsdp"
    replicate_size: int = 1
    ulysses_degree: int = 1
    cfg_parallel: bool = False
    launcher: str = "local"
    endpoint: str = DEFAULT_ENDPOINT
    timeout_s: float = 600.0

    @classmethod
    def from_plain(cls, fields: dict) -> ParallelOptions:
        """The inverse of `dataclasses.asdict` (how the options travel to the workers)."""
        return cls(**{**fields, "devices": tuple(fields["devices"])})

    def __post_init__(self) -> None:
        devices = parse_devices(",".join(self.devices)) if not isinstance(self.devices, str) else None
        if devices is None:
            raise WanVACEInputError("devices must be a tuple of device names; use parse_devices on text input.")
        world = len(devices)
        if self.shard not in SHARD_MODES:
            raise WanVACEInputError(f"shard={self.shard!r} is unknown; choose one of {', '.join(SHARD_MODES)}.")
        if self.launcher not in LAUNCHERS:
            raise WanVACEInputError(f"launcher={self.launcher!r} is unknown; choose one of {', '.join(LAUNCHERS)}.")
        validate_integer("ulysses_degree", self.ulysses_degree, "use a whole number, 1 to turn it off")
        validate_integer("replicate_size", self.replicate_size, "use a whole number, 1 unless shard is hsdp")
        timeout_fix = "use a number of seconds above 0 (600 is the default)"
        if validate_finite("timeout_s", self.timeout_s, timeout_fix) <= 0:
            raise WanVACEInputError(f"timeout_s={self.timeout_s} must be above 0; {timeout_fix}.")
        cfg_size = 2 if self.cfg_parallel else 1
        if self.cfg_parallel and world % 2:
            raise WanVACEInputError(
                f"cfg_parallel needs an even number of devices (one half per CFG branch); {world} are listed. "
                f"Valid device counts: 2, 4, 6, 8, ..."
            )
        branch_ranks = world // cfg_size
        if self.ulysses_degree < 1 or branch_ranks % self.ulysses_degree:
            raise WanVACEInputError(
                f"ulysses_degree={self.ulysses_degree} must divide the {branch_ranks} device(s) "
                f"{'of each CFG branch' if self.cfg_parallel else 'listed'}; valid choices: "
                f"{', '.join(map(str, divisors(branch_ranks)))}."
            )
        if self.shard == "hsdp":
            valid = [size for size in divisors(branch_ranks) if 1 < size < branch_ranks]
            if self.replicate_size not in valid:
                choices = (
                    ", ".join(map(str, valid)) if valid else "none (hsdp needs at least 4 devices per branch; use fsdp)"
                )
                raise WanVACEInputError(
                    f"replicate_size={self.replicate_size} with shard=hsdp must divide the {branch_ranks} device(s) "
                    f"{'of each CFG branch' if self.cfg_parallel else 'listed'} and leave at least two shards and two "
                    f"replicas; valid choices: {choices}."
                )
        elif self.replicate_size != 1:
            raise WanVACEInputError(
                f"replicate_size={self.replicate_size} only applies to shard=hsdp (shard={self.shard!r}); set it to 1."
            )
        if world == 1 and self.shard == "none":
            raise WanVACEInputError(
                "one device with shard=none is the plain single-device path; disconnect the parallel options, or "
                "pick shard=fsdp to run the sharded path on one device."
            )
        if self.launcher == "local":
            _refuse_repeated_gpus(devices)
        if self.launcher == "torchrun":
            host, _, port = self.endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise WanVACEInputError(
                    f"endpoint={self.endpoint!r} is not host:port; give rank 0's control address, e.g. "
                    "127.0.0.1:29511 (the --serve address the torchrun workers were started with)."
                )
        object.__setattr__(self, "devices", devices)

    @classmethod
    def from_text(cls, devices: str, **kwargs) -> ParallelOptions:
        return cls(devices=parse_devices(devices), **kwargs)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def device_type(self) -> str:
        return "cuda" if self.devices[0].startswith("cuda") else "cpu"

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(
            world=self.world_size,
            cfg_size=2 if self.cfg_parallel else 1,
            ulysses_degree=self.ulysses_degree,
            shard=self.shard,
            replicate_size=self.replicate_size,
        )

    def check_devices(self, available_gpus: int) -> None:
        """Refuses GPUs that do not exist on this machine (local launcher only: torchrun places its own)."""
        if self.launcher != "local" or self.device_type != "cuda":
            return
        missing = [device for device in self.devices if int(device.split(":")[1]) >= available_gpus]
        if missing:
            present = ", ".join(f"cuda:{index}" for index in range(available_gpus)) or "none"
            raise WanVACEInputError(
                f"devices names {', '.join(missing)}, but this machine has {available_gpus} GPU(s) ({present}); "
                "list only GPUs that exist."
            )

    def check_heads(self, num_heads: int) -> None:
        if num_heads % self.ulysses_degree:
            raise WanVACEInputError(
                f"ulysses_degree={self.ulysses_degree} does not divide the model's {num_heads} attention heads; "
                f"valid choices: {', '.join(str(d) for d in divisors(num_heads) if d <= self.world_size)}."
            )

    def check_tokens(self, tokens: int) -> None:
        if tokens % self.ulysses_degree:
            valid = [d for d in divisors(tokens) if d <= self.world_size]
            raise WanVACEInputError(
                f"ulysses_degree={self.ulysses_degree} does not divide this video's {tokens} tokens "
                f"(latent frames x height/16 x width/16); change the size or length, or use one of: "
                f"{', '.join(map(str, valid))}."
            )

    def check_guidance(self, cfg: float, cfg_low_noise: float) -> None:
        if self.cfg_parallel and cfg <= 1.0 and cfg_low_noise <= 1.0:
            raise WanVACEInputError(
                "cfg_parallel is on but both guidance scales (cfg, cfg_low_noise) are 1.0, so there is no "
                "unconditional branch for half the devices; raise a guidance scale above 1.0 or turn cfg_parallel off."
            )


@dataclass(frozen=True)
class ParallelLayout:
    """Rank groups implied by the options (pure arithmetic; `groups.ParallelGroups` creates them)."""

    world: int
    cfg_size: int = 1
    ulysses_degree: int = 1
    shard: str = "fsdp"
    replicate_size: int = 1

    @property
    def branch_size(self) -> int:
        return self.world // self.cfg_size

    def branch_of(self, rank: int) -> int:
        """0: conditional branch, 1: unconditional (always 0 without cfg_parallel); `rank` is global."""
        return rank // self.branch_size

    def branch_rank(self, rank: int) -> int:
        """The rank inside its branch's world (its rank in the default process group)."""
        return rank % self.branch_size

    def ulysses_groups(self) -> list[list[int]]:
        """Sequence-parallel groups, as ranks of the branch world."""
        degree = self.ulysses_degree
        return [list(range(start, start + degree)) for start in range(0, self.branch_size, degree)]

    def shard_mesh_shape(self) -> tuple[int, ...]:
        """Over the branch world: (shards,) for fsdp, (replicas, shards) for hsdp; () without sharding."""
        if self.shard == "none":
            return ()
        if self.shard == "hsdp":
            return (self.replicate_size, self.branch_size // self.replicate_size)
        return (self.branch_size,)
