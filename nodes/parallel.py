"""WanVACEParallelOptions: run the experts across several devices (or machines) in parallel workers."""

from __future__ import annotations

import torch
from comfy_api.v0_0_2 import io

from ..wanvace_core.parallel import DEFAULT_ENDPOINT, LAUNCHERS, SHARD_MODES, ParallelOptions
from ..wanvace_core.validation import nan_refusing_min, validate_range
from .refusals import Refusal
from .types import CATEGORY, WanVACEParallelType

# The widgets' range for replicate_size and ulysses_degree, checked again in validate_inputs (whose arguments skip
# ComfyUI's range check).
DEGREE_RANGE = (1, 64)


def parallel_options(
    devices: str,
    shard: str,
    replicate_size: int,
    ulysses_degree: int,
    cfg_parallel: bool,
    launcher: str,
    endpoint: str,
    timeout_s: float = 600.0,
) -> ParallelOptions:
    options = ParallelOptions.from_text(
        devices,
        shard=shard,
        replicate_size=replicate_size,
        ulysses_degree=ulysses_degree,
        cfg_parallel=cfg_parallel,
        launcher=launcher,
        endpoint=endpoint,
        timeout_s=timeout_s,
    )
    options.check_devices(torch.cuda.device_count() if options.device_type == "cuda" else 0)
    return options


class WanVACEParallelOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEParallelOptions",
            display_name="WanVACE Parallel Options",
            category=CATEGORY,
            description=(
                "Runs the two experts on several GPUs (or machines) in worker processes: sharded weights (FSDP/HSDP), "
                "Ulysses sequence parallel and CFG parallel, combinable. Connect to a loader's parallel input. Text "
                "encoding and the VAE stay in ComfyUI; workers start with the model and stop when it is freed."
            ),
            inputs=[
                io.String.Input(
                    "devices",
                    default="cuda:0,cuda:1",
                    tooltip="One worker per entry: 'cuda:0,cuda:1,cuda:2,cuda:3' (each GPU once), or 'cpu,cpu' for "
                    "gloo CPU workers (to try it out on a CPU-only ComfyUI). With launcher=torchrun: one entry per "
                    "torchrun rank over all machines, in rank order.",
                ),
                io.Combo.Input(
                    "shard",
                    options=list(SHARD_MODES),
                    default="fsdp",
                    tooltip="fsdp: each expert's blocks are split over the devices (of each CFG branch), every rank "
                    "loads only its slices, and each block is gathered just for its forward; bitwise equal to one "
                    "device. hsdp: split over groups of devices, replicated across replicate_size groups (less "
                    "traffic between machines). none: every device holds the whole experts (Ulysses/CFG only).",
                ),
                io.Int.Input(
                    "replicate_size",
                    default=1,
                    min=DEGREE_RANGE[0],
                    max=DEGREE_RANGE[1],
                    tooltip="hsdp only: number of replicas (e.g. 2 machines x 4 GPUs: replicate_size 2 shards inside "
                    "each machine). Must divide the devices and leave at least two shards. 1 otherwise.",
                ),
                io.Int.Input(
                    "ulysses_degree",
                    default=1,
                    min=DEGREE_RANGE[0],
                    max=DEGREE_RANGE[1],
                    tooltip="Split each video's tokens over this many devices (Ulysses sequence parallel): the main "
                    "speed-up for one long video. Must divide the devices (of each CFG branch), the attention heads "
                    "(40 for A14B: 1, 2, 4, 5, 8) and the token count. Results equal one device within float "
                    "rounding. 1 = off.",
                ),
                io.Boolean.Input(
                    "cfg_parallel",
                    default=False,
                    tooltip="Half the devices compute the prompt's prediction, the other half the negative prompt's, "
                    "at the same time (needs an even device count and a guidance scale above 1.0). Bitwise equal to "
                    "one device; each half holds its own sharded copy of the experts.",
                ),
                io.Combo.Input(
                    "launcher",
                    options=list(LAUNCHERS),
                    default="local",
                    tooltip="local: ComfyUI starts one worker per device on this machine. torchrun: the workers were "
                    "started with torchrun on each machine (see docs/parallel.md); ComfyUI connects to rank 0 at "
                    "endpoint.",
                ),
                io.String.Input(
                    "endpoint",
                    default=DEFAULT_ENDPOINT,
                    tooltip="launcher=torchrun: rank 0's control address, the --serve host:port the workers were "
                    "started with. Set the same WANVACE_WORKER_KEY environment variable for ComfyUI and the workers. "
                    "Ignored for launcher=local.",
                ),
                io.Float.Input(
                    "timeout_s",
                    default=600.0,
                    min=nan_refusing_min(1.0),
                    max=86400.0,
                    tooltip="A worker that finishes no step (or no load) for this long is treated as hung: the prompt "
                    "fails with its log, the workers are stopped and the next prompt starts fresh ones.",
                ),
            ],
            outputs=[WanVACEParallelType.Output(display_name="parallel", tooltip="Parallel settings for a loader.")],
        )

    @classmethod
    def validate_inputs(
        cls,
        devices: str = "cuda:0,cuda:1",
        shard: str = "fsdp",
        replicate_size: int = 1,
        ulysses_degree: int = 1,
        cfg_parallel: bool = False,
        launcher: str = "local",
        endpoint: str = DEFAULT_ENDPOINT,
    ) -> bool | str:
        # The inputs the device-count checks combine (launcher decides whether endpoint matters); timeout_s keeps
        # ComfyUI's range check.
        with Refusal() as refusal:
            parallel_options(devices, shard, replicate_size, ulysses_degree, cfg_parallel, launcher, endpoint)
            validate_range("replicate_size", replicate_size, *DEGREE_RANGE)
            validate_range("ulysses_degree", ulysses_degree, *DEGREE_RANGE)
        return refusal.message or True

    @classmethod
    def execute(
        cls,
        devices: str,
        shard: str,
        replicate_size: int,
        ulysses_degree: int,
        cfg_parallel: bool,
        launcher: str,
        endpoint: str,
        timeout_s: float,
    ) -> io.NodeOutput:
        return io.NodeOutput(
            parallel_options(
                devices, shard, replicate_size, ulysses_degree, cfg_parallel, launcher, endpoint, timeout_s
            )
        )
