"""The one place a loaded pipeline's runtime is put together: the same function in ComfyUI's process and on
every parallel worker rank (torchtitan's `parallelize`, for a WanVACE pipeline).

Per expert, always in this order (`apply_plan`, in straight lines):

1. `interleaved_vace`: the forward that runs VACE block k right before main block `vace_layers[k]`
   (`interleave.apply_interleaved_vace`). It replaces `forward`, so it comes first and everything below
   sees the forward that really runs, and the block order the steps below follow is the interleaved one;
2. `ulysses` (worker ranks with `ulysses_degree` > 1): the self-attention split over the Ulysses group;
3. `fsdp` (worker ranks with `shard` != none): FSDP2 units over the meta-built expert, each rank's shards
   then streamed from the files (`parallel.sharding`), and each block prefetching the next in the
   interleaved order;
4. `residency`: where the weights live (`offload.make_residency`: all on the device, one component at a
   time, or block by block in the interleaved order; FSDP places sharded experts itself). Its hooks are
   module hooks: they survive (1) and run before any hook added later;
5. `fp8_matmul`: layers whose weights are kept in fp8 compute with `torch._scaled_mm` (`fp8_matmul.py`)
   instead of dequantising; a forward of the layer, so the module hooks of (4) and LoRA run around it;
6. `attention`: the attention kernel, through diffusers' dispatcher (`attention.py`); it is set on each
   attention processor, so it runs inside the Ulysses wrapper (2) too;
7. `compile`: each block's forward compiled (`regional_compile.py`). Last, because it traces what the steps
   before put inside a block (fp8 matmul, the attention backend, and per run the LoRA hooks), while the hooks
   of (2)-(4) sit around the block's forward and stay eager.

Steps 1-3 are structural (they stay for as long as the experts are loaded); `replan` applies 4-7 again. With
parallel options, ComfyUI's process keeps meta stand-ins of the experts and applies only 4, and the loader
(`runtime.loaders`) starts the workers, which run this same function on their experts with the plan it sends them.

Per sampling run, entered around `sample` in this order and left in reverse (`planned_run`), also on an
error or a cancel: `settle` (weights back to their resting place if the run fails), `loras` (hooks added
after the residency's, so a LoRA sees the weights the residency just bound), `guidance` (NAG, SLG and RIFLEx
hooks inside the experts), `cache` (cache-dit wraps the block lists the steps above prepared, for this run
only), `compiled_cache` (with compile and cache both on: the blocks cache-dit patched run the compiled forward
again). On a parallel worker rank the same steps run, with the LoRAs the request carries.

Every step attaches to the modules in one way (`wanvace_core.hooks`): torch module hooks, kept per step, and an
instance forward where the step changes the computation (1, 5, 7).

Changing the offload options re-plans (4) over the weights already loaded: nothing is read from the
files again except weights an unload had dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import WanVACEInputError
from ..load.loaded import EXPERT_NAMES, LoadedPipeline
from ..parallel.groups import ParallelGroups
from ..parallel.options import ParallelOptions
from ..parallel.sequence import apply_ulysses
from ..parallel.sharding import ShardSources, prefetch_in_order, shard_and_fill
from .attention import ATTENTION_BACKENDS, DEFAULT_ATTENTION, apply_attention, resolve_attention
from .fp8_matmul import apply_fp8_matmul, check_fp8_matmul
from .interleave import apply_interleaved_vace, current_execution_order
from .lora import applied_loras
from .model import WanVACEModel
from .offload import OffloadOptions, ShardedResidency, StreamOps, Transfer, make_residency
from .regional_compile import apply_regional_compile, check_regional_compile, compiled_cached_blocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimePlan:
    """How a loaded pipeline runs; validated once, by its parts. `parallel` None runs the experts here. Built once from
    the loader's inputs, it travels to the parallel workers as itself (`to_plain` / `from_plain`)."""

    offload: OffloadOptions = field(default_factory=OffloadOptions)
    parallel: ParallelOptions | None = None
    attention: str = DEFAULT_ATTENTION
    fp8_matmul: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise WanVACEInputError(
                f"attention={self.attention!r} is unknown; choose one of {', '.join(ATTENTION_BACKENDS)}."
            )

    def to_plain(self) -> dict:
        """The plan as plain values, for the workers' load request."""
        return dataclasses.asdict(self)

    @classmethod
    def from_plain(cls, fields: dict) -> RuntimePlan:
        parallel = fields["parallel"]
        return cls(
            offload=OffloadOptions(**fields["offload"]),
            parallel=None if parallel is None else ParallelOptions.from_plain(parallel),
            attention=fields["attention"],
            fp8_matmul=fields["fp8_matmul"],
            compile=fields["compile"],
        )

    def check(self, device: torch.device | str) -> None:
        """Refuses, before anything is read, a plan whose attention kernel cannot run where the experts will run:
        `device`, or the parallel workers' devices where they are on this machine (torchrun's workers elsewhere
        check it when they load)."""
        if self.parallel is not None and self.parallel.launcher != "local":
            return
        where = device if self.parallel is None else self.parallel.devices[0]
        resolve_attention(self.attention, where)
        if self.fp8_matmul:
            check_fp8_matmul(where)
        if self.compile:
            check_regional_compile(where)

    def load_device(self, device: torch.device | str) -> torch.device:
        """Where the loaders read weights to: the device itself without offload, else host memory."""
        return torch.device(device) if self.offload.mode == "none" else torch.device("cpu")


@dataclass(frozen=True)
class RankContext:
    """What a worker rank adds to the plan: its process groups, and for `fsdp` the experts' weight sources."""

    groups: ParallelGroups
    shard_sources: dict[str, ShardSources] | None = None


def build_model(
    loaded: LoadedPipeline,
    plan: RuntimePlan,
    device: torch.device | str,
    *,
    rank: RankContext | None = None,
    transfer: Transfer | None = None,
    stream_ops: StreamOps | None = None,
) -> WanVACEModel:
    """The runnable model over `loaded` (components shared, not copied), with `plan` applied."""
    model = WanVACEModel.from_loaded(loaded)
    model.device = torch.device(device)
    apply_plan(model, plan, rank=rank, transfer=transfer, stream_ops=stream_ops)
    return model


def apply_plan(
    model: WanVACEModel,
    plan: RuntimePlan,
    *,
    rank: RankContext | None = None,
    transfer: Transfer | None = None,
    stream_ops: StreamOps | None = None,
) -> None:
    """The structural steps (1-3), which change the experts' forward or sharding for as long as they are loaded, then
    the runtime steps (4-7), which `replan` applies again over the same weights."""
    experts = _experts(model)
    for expert in experts.values():
        apply_interleaved_vace(expert)
    if rank is not None and rank.groups.ulysses_group is not None:
        for expert in experts.values():
            apply_ulysses(expert, rank.groups.ulysses_group)
    if _sharded(plan, rank):
        _apply_fsdp(model, experts, plan, rank)
    _apply_runtime(model, plan, rank, transfer, stream_ops)


def replan(
    model: WanVACEModel, plan: RuntimePlan, transfer: Transfer | None = None, *, stream_ops: StreamOps | None = None
) -> None:
    """Puts a loaded model (experts in this process) under another plan's runtime steps (offload, fp8 matmul,
    attention, compile), over the weights already in memory; the structural steps stay as applied."""
    _apply_runtime(model, plan, None, transfer, stream_ops)


def _apply_runtime(
    model: WanVACEModel,
    plan: RuntimePlan,
    rank: RankContext | None,
    transfer: Transfer | None,
    stream_ops: StreamOps | None,
) -> None:
    model.close_residency()  # the new residency must find the weights unhooked and off the ring
    # A worker holds only the experts; its VAE is a meta stand-in for the config.
    components = model.components if rank is None else _experts(model)
    if _sharded(plan, rank):
        model.residency = ShardedResidency(components)
    else:
        model.residency = make_residency(
            plan.offload, components, model.weights, model.device, transfer, stream_ops=stream_ops
        )
    # In ComfyUI's process with parallel workers the experts are meta stand-ins: the workers apply these.
    if rank is not None or plan.parallel is None:
        _apply_fp8_matmul(model, plan)
        _apply_attention(model, plan)
        _apply_compile(model, plan)
    model.plan = plan


def _experts(model: WanVACEModel) -> dict[str, torch.nn.Module]:
    return {name: expert for name in EXPERT_NAMES if (expert := getattr(model, name)) is not None}


def _sharded(plan: RuntimePlan, rank: RankContext | None) -> bool:
    return rank is not None and plan.parallel is not None and plan.parallel.shard != "none"


def _apply_fsdp(model: WanVACEModel, experts: dict, plan: RuntimePlan, rank: RankContext) -> None:
    cpu_offload = plan.offload.mode != "none"
    for name, expert in experts.items():
        shard_and_fill(expert, rank.shard_sources[name], rank.groups.shard_mesh, model.device, cpu_offload)
        prefetch_in_order(expert, current_execution_order(expert))


def _apply_fp8_matmul(model: WanVACEModel, plan: RuntimePlan) -> None:
    if plan.fp8_matmul:
        check_fp8_matmul(model.device)
    layers = sum(apply_fp8_matmul(expert, plan.fp8_matmul) for expert in model.experts)
    if not plan.fp8_matmul:
        return
    if layers == 0:
        raise WanVACEInputError(
            "fp8_matmul is on but no expert weight is kept in fp8; it needs fp8 expert files (e.g. "
            "wan2.2_fun_vace_*_fp8_scaled.safetensors) loaded with weight_dtype auto. Turn fp8_matmul off."
        )
    logger.info("WanVACE fp8 matmul: %d layers", layers)
    if model.device.type == "cpu":
        # Measured with torch 2.11 on an AMX Xeon: oneDNN's reference kernel, 11-16 M multiply-adds a second.
        logger.warning(
            "WanVACE fp8 matmul on the CPU runs PyTorch's reference fp8 kernel, far slower than dequantising the "
            "weights; turn fp8_matmul off unless the experts run on a GPU."
        )


def _apply_attention(model: WanVACEModel, plan: RuntimePlan) -> None:
    backend = resolve_attention(plan.attention, model.device)
    for expert in model.experts:
        apply_attention(expert, backend)
    logger.info("WanVACE attention: %s (chosen: %s)", backend, plan.attention)


def _apply_compile(model: WanVACEModel, plan: RuntimePlan) -> None:
    if plan.compile:
        check_regional_compile(model.device)
    blocks = sum(apply_regional_compile(expert, plan.compile) for expert in model.experts)
    if plan.compile:
        logger.info("WanVACE compile: %d blocks (torch.compile per block; each new size compiles once)", blocks)


@contextlib.contextmanager
def planned_run(model: WanVACEModel, cache=None, guidance=None) -> Iterator[None]:
    """The per-run steps around one sampling run, entered in this order and left in reverse, also on an error or a
    cancel. `cache` is the run's `caching.CachedExperts` (or None); `guidance` the run's hooks inside the experts
    (`attention_guidance.attention_guidance`, or None)."""
    with contextlib.ExitStack() as run:
        run.enter_context(_settled_on_error(model))
        if model.loras:  # after the residency's hooks, so a LoRA sees the weights the residency just bound
            run.enter_context(applied_loras(model, model.loras))
        if guidance is not None:
            run.enter_context(guidance)
        if cache is not None:  # cache-dit wraps the block lists the steps above prepared, for this run only
            run.enter_context(cache)
            if model.plan is not None and model.plan.compile:
                run.enter_context(_compiled_under_the_cache(model, cache))
        yield


def _compiled_under_the_cache(model: WanVACEModel, cache):
    """With compile and cache both on: the blocks cache-dit patched run the compiled forward again."""
    return compiled_cached_blocks([getattr(model, run.attribute) for run in cache.runs])


@contextlib.contextmanager
def _settled_on_error(model: WanVACEModel) -> Iterator[None]:
    """A run that raises (cancel, OOM) must not leave weights on the device until the next prompt."""
    try:
        yield
    except BaseException:
        model.residency.settle()
        raise
