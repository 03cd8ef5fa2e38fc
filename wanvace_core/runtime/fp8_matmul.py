"""fp8 matmul for expert weights kept in fp8: `torch._scaled_mm` on the stored e4m3 weight with its per-tensor
scale from the file, and a per-tensor scale for the activations computed each call (their absolute maximum over
e4m3's range), instead of dequantising the weight to the compute dtype every forward.

It replaces the forward of each `QuantizedLinear` whose stored weight is e4m3 (ComfyUI's `fp8_scaled` and
`fp8mixed` files, and unscaled e4m3 files, whose scale is 1); GGUF and other layers keep dequantising. Module
hooks (LoRA, offload) stay on the module and run around it as before. The kernel needs fp8 support on the device
(CUDA sm89 and up; PyTorch's CPU kernel, so CI checks the numerics), which `fp8_matmul_failure` probes once.

CUDA's kernel takes a bias only for bf16 or fp16 outputs of the bias's own dtype ("Bias is not supported when
out_dtype is set to Float32"; the CPU kernel accepts any), so with fp32 activations the bias is added after the
product, in fp32. `fast_accum` asks for Hopper's fast fp8 accumulation (`use_fast_accum`): faster, with more
rounding over long sums; off unless chosen (bench/gpu_probe.py measures both).
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


def fused_bias(bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The bias in the form CUDA's `_scaled_mm` takes it for `out_dtype`, or None where it must be added after."""
    if bias is None or out_dtype not in (torch.bfloat16, torch.float16):
        return None
    return bias.to(out_dtype)


def _fp8_linear(self: QuantizedLinear, input: torch.Tensor, fast_accum: bool) -> torch.Tensor:
    rows = input.reshape(-1, self.in_features)
    # One scale for the whole activation: what a per-tensor weight scale pairs with in every fp8 GEMM kernel.
    input_scale = rows.abs().amax().float().clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    quantized = (rows.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    weight_scale = self.weight_scale if self.weight_scale is not None else torch.ones((), device=input.device)
    bias = fused_bias(self.bias, input.dtype)
    out = torch._scaled_mm(
        quantized,
        self.weight.reshape(self.out_features, self.in_features).t(),
        scale_a=input_scale,
        scale_b=weight_scale.float(),
        bias=bias,
        out_dtype=input.dtype,
        use_fast_accum=fast_accum,
    )
    if bias is None and self.bias is not None:
        out = out + self.bias.to(input.dtype)
    return out.reshape(*input.shape[:-1], self.out_features)


def _scaled_mm_forward(self: QuantizedLinear, input: torch.Tensor) -> torch.Tensor:
    return _fp8_linear(self, input, fast_accum=False)


def _scaled_mm_forward_fast_accum(self: QuantizedLinear, input: torch.Tensor) -> torch.Tensor:
    return _fp8_linear(self, input, fast_accum=True)


_FORWARDS = (_scaled_mm_forward, _scaled_mm_forward_fast_accum)


def apply_fp8_matmul(expert: torch.nn.Module, enabled: bool, fast_accum: bool = False) -> int:
    """Has every fp8-stored layer of `expert` compute with fp8 matmul (`enabled`; with fast accumulation where
    `fast_accum`) or by dequantising (as loaded); returns how many layers that is."""
    layers = fp8_linears(expert)
    chosen = _scaled_mm_forward_fast_accum if fast_accum else _scaled_mm_forward
    for layer in layers:
        for forward in _FORWARDS:
            remove_forward(layer, forward)
        if enabled:
            install_forward(layer, chosen)
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
