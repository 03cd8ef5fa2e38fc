"""fp8 matmul for expert weights kept in fp8: `torch._scaled_mm` on the stored e4m3 weight with its per-tensor
scale from the file, and a per-tensor scale for the activations computed each call (their absolute maximum over
e4m3's range), instead of dequantising the weight to the compute dtype every forward.

It replaces the forward of each `QuantizedLinear` whose stored weight is e4m3 (ComfyUI's `fp8_scaled` and
`fp8mixed` files, and unscaled e4m3 files, whose scale is 1); GGUF and other layers keep dequantising. Module
hooks (LoRA, offload) stay on the module and run around it as before. The kernel needs fp8 support on the device
(CUDA sm89 and up; PyTorch's CPU kernel, so CI checks the numerics), which `fp8_matmul_failure` probes once.
"""

from __future__ import annotations

import functools

import torch

from ..errors import WanVACEInputError
from ..hooks import install_forward, remove_forward
from ..load.quantized import QuantizedLinear

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_PROBE = (16, 32, 16)  # rows, inner, outer: the smallest sizes every fp8 kernel takes


def fp8_linears(expert: torch.nn.Module) -> list[QuantizedLinear]:
    """The layers of `expert` whose stored weight fp8 matmul can use."""
    return [module for module in expert.modules() if isinstance(module, QuantizedLinear) and module.weight.dtype == FP8]


def _scaled_mm_forward(self: QuantizedLinear, input: torch.Tensor) -> torch.Tensor:
    rows = input.reshape(-1, self.in_features)
    # One scale for the whole activation: what a per-tensor weight scale pairs with in every fp8 GEMM kernel.
    input_scale = rows.abs().amax().float().clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    quantized = (rows.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    weight_scale = self.weight_scale if self.weight_scale is not None else torch.ones((), device=input.device)
    out = torch._scaled_mm(
        quantized,
        self.weight.reshape(self.out_features, self.in_features).t(),
        scale_a=input_scale,
        scale_b=weight_scale.float(),
        bias=None if self.bias is None else self.bias.to(input.dtype),
        out_dtype=input.dtype,
    )
    return out.reshape(*input.shape[:-1], self.out_features)


def apply_fp8_matmul(expert: torch.nn.Module, enabled: bool) -> int:
    """Has every fp8-stored layer of `expert` compute with fp8 matmul (`enabled`) or by dequantising (as loaded);
    returns how many layers that is."""
    layers = fp8_linears(expert)
    for layer in layers:
        if enabled:
            install_forward(layer, _scaled_mm_forward)
        else:
            remove_forward(layer, _scaled_mm_forward)
    return len(layers)


@functools.cache
def fp8_matmul_failure(device: str) -> str | None:
    """Why fp8 matmul cannot run on `device`, or None; tried once per device and process."""
    where = torch.device(device)
    rows, inner, outer = _PROBE
    generator = torch.Generator("cpu").manual_seed(0)
    activations = torch.randn(rows, inner, generator=generator).to(where, FP8)
    weight = torch.randn(outer, inner, generator=generator).to(where, FP8)
    one = torch.ones((), device=where)
    try:
        out = torch._scaled_mm(activations, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    if not bool(torch.isfinite(out).all()):
        return "its output on a probe input was not finite"
    return None


def check_fp8_matmul(device: torch.device | str) -> None:
    """Refuses fp8 matmul where its kernel does not run."""
    problem = fp8_matmul_failure(str(torch.device(device)))
    if problem is not None:
        raise WanVACEInputError(
            f"fp8_matmul is on but fp8 matmul does not run on {torch.device(device)} ({problem}); it needs a GPU with "
            "fp8 support (NVIDIA Ada or Hopper and later, compute capability 8.9+). Turn fp8_matmul off."
        )
