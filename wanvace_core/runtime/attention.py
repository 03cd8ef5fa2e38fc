"""Which attention kernel the experts run: chosen through diffusers' attention dispatcher, none written here.

`native` (diffusers' default: `torch.nn.functional.scaled_dot_product_attention`, which picks its own kernel)
is what runs when nothing is chosen, bitwise. The other names are the dispatcher's own backends; those that
download kernels at run time (`*_hub`) and the variable-length ones (for padded batches, which never occur
here) are not offered. `auto` takes the first backend of `AUTO_ORDER` that is installed and runs on the
device. A backend is checked before it is used: the dispatcher's requirement check (which names the package
to install), then one tiny attention call on the device, so a kernel that exists but cannot run there (flash
kernels on a CPU or an older GPU) is refused up front instead of failing the first step.

The choice lives on each attention processor (`ModelMixin.set_attention_backend`), so the Ulysses wrapper
(which forwards it to the stock processor) and cache-dit (which wraps the blocks, not the processors) run it
too.
"""

from __future__ import annotations

import functools
import logging

import torch
from diffusers.models.attention_dispatch import (
    AttentionBackendName,
    _AttentionBackendRegistry,
    _check_attention_backend_requirements,
    dispatch_attention_fn,
)

from ..errors import WanVACEInputError

DEFAULT_ATTENTION = "native"
ATTENTION_BACKENDS = (
    DEFAULT_ATTENTION,
    "auto",
    "_native_flash",
    "_native_efficient",
    "_native_cudnn",
    "_native_math",
    "sage",
    "flash",
    "_flash_3",
    "xformers",
    "flex",
)
# Fastest first (published kernel figures for video DiT attention: SageAttention's int8 QK, then FlashAttention
# 3 on Hopper, FlashAttention 2, cuDNN SDPA); on a CPU only `native` is worth having (flex runs there uncompiled).
AUTO_ORDER = {
    "cuda": ("sage", "_flash_3", "flash", "_native_cudnn", DEFAULT_ATTENTION),
    "cpu": (DEFAULT_ATTENTION,),
}
_PROBE_SHAPE = (1, 128, 2, 64)  # batch, tokens, heads, head dim: a shape every kernel takes


def _probe_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@functools.cache
def _failure(backend: str, device: str) -> str | None:
    """Why `backend` cannot run on `device` and what to do, or None; each pair is tried once per process."""
    try:
        _check_attention_backend_requirements(AttentionBackendName(backend))
    except (RuntimeError, ImportError) as error:
        return f"{error} Install it in ComfyUI's Python (and restart ComfyUI)"
    where = torch.device(device)
    generator = torch.Generator("cpu").manual_seed(0)
    query, key, value = (
        torch.randn(_PROBE_SHAPE, generator=generator).to(where, _probe_dtype(where)) for _ in range(3)
    )
    try:
        out = dispatch_attention_fn(query, key, value, backend=AttentionBackendName(backend))
    except Exception as error:  # any failure of the kernel means it cannot run here
        return f"its kernel does not run on this device ({type(error).__name__}: {error})"
    if out.shape != query.shape or not bool(torch.isfinite(out).all()):
        return "its output on a probe input was malformed or not finite"
    return None


def resolve_attention(attention: str, device: torch.device | str) -> str:
    """The dispatcher backend `attention` means on `device` (`auto` resolved); refuses one that cannot run there."""
    if attention not in ATTENTION_BACKENDS:
        raise WanVACEInputError(f"attention={attention!r} is unknown; choose one of {', '.join(ATTENTION_BACKENDS)}.")
    device = torch.device(device)
    if attention == "auto":
        for backend in AUTO_ORDER.get(device.type, (DEFAULT_ATTENTION,)):
            if _failure(backend, str(device)) is None:
                return backend
        return DEFAULT_ATTENTION
    problem = _failure(attention, str(device))
    if problem is not None:
        raise WanVACEInputError(
            f"attention={attention!r} cannot run on {device}: {problem}; or choose 'auto' or '{DEFAULT_ATTENTION}'."
        )
    return attention


def apply_attention(expert: torch.nn.Module, backend: str) -> None:
    """Has every attention processor of `expert` run `backend` (a resolved name from `resolve_attention`)."""
    # diffusers 0.42 also makes the backend the process-wide default, which would change the attention of other
    # diffusers models in the same process (another pack's): that default is put back.
    # Its "experimental feature" warning would be logged at every load and re-plan: said once in the README.
    previous = _AttentionBackendRegistry._active_backend
    model_logger = logging.getLogger("diffusers.models.modeling_utils")
    level = model_logger.level
    model_logger.setLevel(logging.ERROR)
    try:
        expert.set_attention_backend(backend)
    finally:
        model_logger.setLevel(level)
        _AttentionBackendRegistry._active_backend = previous
