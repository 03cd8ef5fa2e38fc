"""Loader inputs that choose how the experts run (the runtime plan's options), shared by both loaders, and the plan
they make: built once, from the loader's inputs, by `runtime_plan`."""

from __future__ import annotations

import asyncio
import threading

import comfy.model_management
from comfy_api.v0_0_2 import io

from ..wanvace_core import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION,
    DTYPES,
    OffloadOptions,
    RuntimePlan,
)
from ..wanvace_core.parallel import ParallelOptions
from .refusals import Refusal
from .types import WanVACEOffloadType, WanVACEParallelType


def dtype_input(tooltip: str) -> io.Combo.Input:
    return io.Combo.Input("dtype", options=list(DTYPES), default="bf16", tooltip=tooltip)


def placement_inputs() -> list:
    """The loader's optional offload and parallel inputs (the plan's placement of the weights)."""
    return [
        WanVACEOffloadType.Input(
            "offload", optional=True, tooltip="From WanVACE Offload Options; unconnected = everything on the GPU."
        ),
        WanVACEParallelType.Input(
            "parallel",
            optional=True,
            tooltip="From WanVACE Parallel Options: the experts run in worker processes; unconnected = here.",
        ),
    ]


def attention_input() -> io.Combo.Input:
    return io.Combo.Input(
        "attention",
        options=list(ATTENTION_BACKENDS),
        default=DEFAULT_ATTENTION,
        optional=True,
        tooltip="The experts' attention kernel: native is PyTorch SDPA, auto the fastest one installed here.",
    )


# The probes below (a tiny attention call, an fp8 matmul, a compiled kernel: up to a minute on a CPU for the compiler)
# run once per process and device each; one at a time, so that two prompts queued together do not probe twice.
_PROBING = threading.Lock()


def runtime_plan(
    offload: OffloadOptions | None = None,
    parallel: ParallelOptions | None = None,
    attention: str = DEFAULT_ATTENTION,
    fp8_matmul: bool = False,
    compile: bool = False,
) -> RuntimePlan:
    """The loader's runtime plan from its inputs (unconnected options are the plan's defaults)."""
    return RuntimePlan(
        offload=offload or OffloadOptions(),
        parallel=parallel,
        attention=attention,
        fp8_matmul=fp8_matmul,
        compile=compile,
    )


def _runtime_refusal(attention: str | None, compile: bool | None, fp8_matmul: bool | None) -> str | None:
    if None in (attention, compile, fp8_matmul):  # linked: known when the loader runs, and its plan checks them then
        return None
    with _PROBING, Refusal() as refusal:
        plan = runtime_plan(attention=attention, fp8_matmul=fp8_matmul, compile=compile)
        plan.check(comfy.model_management.get_torch_device())
    return refusal.message


async def runtime_refusal(
    attention: str | None, compile: bool | None = False, fp8_matmul: bool | None = False
) -> str | None:
    """Why the loader's runtime options cannot run on ComfyUI's device (the plan's own check), or None. For a
    loader's async `validate_inputs`: the probes run in a worker thread, so ComfyUI's server keeps answering every
    other request while a first probe runs (it answers this POST /prompt when the probe is done; later prompts get
    the cached answer)."""
    return await asyncio.to_thread(_runtime_refusal, attention, compile, fp8_matmul)


def fp8_matmul_input() -> io.Boolean.Input:
    return io.Boolean.Input(
        "fp8_matmul",
        default=False,
        optional=True,
        tooltip="fp8 experts (weight_dtype auto): multiply in fp8 on GPUs that have it (RTX 40xx, L40, H100 on).",
    )


def compile_input() -> io.Boolean.Input:
    return io.Boolean.Input(
        "compile",
        default=False,
        optional=True,
        tooltip="Compile each block with torch.compile: faster steps after a first one per video size that compiles.",
    )
