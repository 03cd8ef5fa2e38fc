"""Loader inputs that choose how the experts run (the runtime plan's options), shared by both loaders."""

from __future__ import annotations

import asyncio
import threading

import comfy.model_management
from comfy_api.v0_0_2 import io

from ..wanvace_core import ATTENTION_BACKENDS, DEFAULT_ATTENTION, WanVACEInputError, resolve_attention
from ..wanvace_core.runtime.fp8_matmul import check_fp8_matmul
from ..wanvace_core.runtime.regional_compile import check_regional_compile


def attention_input() -> io.Combo.Input:
    return io.Combo.Input(
        "attention",
        options=list(ATTENTION_BACKENDS),
        default=DEFAULT_ATTENTION,
        optional=True,
        tooltip="The experts' attention kernel: native is PyTorch SDPA, auto the fastest one installed here.",
    )


def attention_refusal(attention: str) -> str | None:
    """Why `attention` cannot run on ComfyUI's device (naming the package to install), or None."""
    try:
        resolve_attention(attention, comfy.model_management.get_torch_device())
    except WanVACEInputError as error:
        return str(error)
    return None


# The probes below (a tiny attention call, an fp8 matmul, a compiled kernel: up to a minute on a CPU for the compiler)
# run once per process and device each; one at a time, so that two prompts queued together do not probe twice.
_PROBING = threading.Lock()


def _runtime_refusal(attention: str, compile: bool, fp8_matmul: bool) -> str | None:
    with _PROBING:
        return attention_refusal(attention) or fp8_matmul_refusal(fp8_matmul) or compile_refusal(compile)


async def runtime_refusal(attention: str, compile: bool = False, fp8_matmul: bool = False) -> str | None:
    """Why the loader's runtime options cannot run on ComfyUI's device, or None. For a loader's async
    `validate_inputs`: the probes run in a worker thread, so ComfyUI's server keeps answering every other request
    while a first probe runs (it answers this POST /prompt when the probe is done; later prompts get the cached
    answer)."""
    return await asyncio.to_thread(_runtime_refusal, attention, compile, fp8_matmul)


def fp8_matmul_input() -> io.Boolean.Input:
    return io.Boolean.Input(
        "fp8_matmul",
        default=False,
        optional=True,
        tooltip="fp8 experts (weight_dtype auto): multiply in fp8 on GPUs that have it (RTX 40xx, L40, H100 on).",
    )


def fp8_matmul_refusal(fp8_matmul: bool) -> str | None:
    """Why fp8 matmul cannot run on ComfyUI's device, or None."""
    if not fp8_matmul:
        return None
    try:
        check_fp8_matmul(comfy.model_management.get_torch_device())
    except WanVACEInputError as error:
        return str(error)
    return None


def compile_input() -> io.Boolean.Input:
    return io.Boolean.Input(
        "compile",
        default=False,
        optional=True,
        tooltip="Compile each block with torch.compile: faster steps after a first one per video size that compiles.",
    )


def compile_refusal(compile: bool) -> str | None:
    """Why torch.compile cannot build kernels for ComfyUI's device, or None."""
    if not compile:
        return None
    try:
        check_regional_compile(comfy.model_management.get_torch_device())
    except WanVACEInputError as error:
        return str(error)
    return None
