"""WanVACEParallelOptions: run the experts across several devices (or machines) in parallel workers."""

from __future__ import annotations

import torch
from comfy_api.v0_0_2 import io

from ..wanvace_core.parallel import LAUNCHERS, SHARD_MODES, ParallelOptions
from ..wanvace_core.validation import validate_range
from .inputs import float_input, int_input
from .refusals import Refusal
from .types import CATEGORY, WanVACEParallelType

# The widgets' range for replicate_size and ulysses_degree, checked again in validate_inputs (whose arguments skip
# ComfyUI's range check).
DEGREE_RANGE = (1, 64)
_DEFAULTS = ParallelOptions()
DEFAULT_DEVICES = "cuda:0,cuda:1"


def parallel_options(devices: str, **settings) -> ParallelOptions:
    """The node's inputs as `ParallelOptions`, checked against the GPUs of this machine."""
    options = ParallelOptions.from_text(devices, **settings)
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
                    default=DEFAULT_DEVICES,
                    tooltip="One worker per entry, like cuda:0,cuda:1 (cpu,cpu to try it out); torchrun: one per rank.",
                ),
                io.Combo.Input(
                    "shard",
                    options=list(SHARD_MODES),
                    default=_DEFAULTS.shard,
                    tooltip="fsdp: each expert split over the devices; hsdp: split in groups, replicated; none: whole.",
                ),
                int_input(
                    "replicate_size",
                    _DEFAULTS.replicate_size,
                    DEGREE_RANGE,
                    "hsdp only: number of replicas, e.g. 2 for 2 machines (1 otherwise).",
                ),
                int_input(
                    "ulysses_degree",
                    _DEFAULTS.ulysses_degree,
                    DEGREE_RANGE,
                    "Split each video's tokens over this many devices (Ulysses sequence parallel; 1 = off).",
                ),
                io.Boolean.Input(
                    "cfg_parallel",
                    default=_DEFAULTS.cfg_parallel,
                    tooltip="Half the devices compute the prompt's prediction, the other half the negative's.",
                ),
                io.Combo.Input(
                    "launcher",
                    options=list(LAUNCHERS),
                    default=_DEFAULTS.launcher,
                    tooltip="local: ComfyUI starts the workers; torchrun: it connects to workers started by torchrun.",
                ),
                io.String.Input(
                    "endpoint",
                    default=_DEFAULTS.endpoint,
                    tooltip="launcher=torchrun: rank 0's control address, the --serve host:port of the workers.",
                ),
                float_input(
                    "timeout_s",
                    _DEFAULTS.timeout_s,
                    (1.0, 86400.0),
                    None,
                    "Seconds without a finished step (or load) after which a worker counts as hung.",
                ),
            ],
            outputs=[WanVACEParallelType.Output(display_name="parallel", tooltip="Parallel settings for a loader.")],
        )

    @classmethod
    def validate_inputs(
        cls,
        devices: str | None = None,
        shard: str | None = None,
        replicate_size: int | None = None,
        ulysses_degree: int | None = None,
        cfg_parallel: bool | None = None,
        launcher: str | None = None,
        endpoint: str | None = None,
    ) -> bool | str:
        # The inputs the device-count checks combine (launcher decides whether endpoint matters), when none of them
        # is linked (a linked input arrives as None; the node checks them all when it runs); timeout_s keeps
        # ComfyUI's range check.
        combined = {
            "shard": shard,
            "replicate_size": replicate_size,
            "ulysses_degree": ulysses_degree,
            "cfg_parallel": cfg_parallel,
            "launcher": launcher,
            "endpoint": endpoint,
        }
        with Refusal() as refusal:
            if devices is not None and None not in combined.values():
                parallel_options(devices, **combined)
            for name, value in (("replicate_size", replicate_size), ("ulysses_degree", ulysses_degree)):
                if value is not None:
                    validate_range(name, value, *DEGREE_RANGE)
        return refusal.message or True

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return io.NodeOutput(parallel_options(**inputs))
