"""Linear layers whose weights stay stored as the file has them (fp8 + scale, GGUF blocks, another float).

`QuantizedLinear` holds the stored weight as its `weight` parameter (so offload, unload and the ring
move the stored bytes, e.g. fp8 = half of bf16) and, for scaled fp8, the per-tensor scale as the
`weight_scale` buffer. Each forward dequantises the weight for that layer only and computes in the
input's dtype. A `WeightFormat` says how stored values become weights; dequantising at load time
(`dequantize`) and at compute time use the same function, so both give bitwise-equal weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightFormat:
    """How a stored weight becomes a float weight: `kind` is "scaled_fp8", "gguf" or "cast"."""

    kind: str
    stored_dtype: torch.dtype
    quant: str | None = None  # GGUF quantisation type name

    def dequantize(self, stored: torch.Tensor, scale: torch.Tensor | None, shape) -> torch.Tensor:
        """Stored values -> fp32 weights of `shape` (fp32 math, so every path rounds once, at the final cast)."""
        if self.kind == "gguf":
            import gguf
            from diffusers.quantizers.gguf.utils import dequantize_functions

            qtype = gguf.GGMLQuantizationType[self.quant]
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            blocks = stored.reshape(-1, type_size)
            return dequantize_functions[qtype](blocks, block_size, type_size, dtype=torch.float32).reshape(shape)
        weights = stored.to(torch.float32)
        if self.kind == "scaled_fp8":
            weights = weights * scale.to(device=weights.device, dtype=torch.float32)
        return weights.reshape(shape)


class QuantizedLinear(torch.nn.Module):
    """nn.Linear over a stored weight that is dequantised per forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool, weight_format: WeightFormat) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight_format = weight_format
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=weight_format.stored_dtype), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        scaled = weight_format.kind == "scaled_fp8"
        self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32) if scaled else None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        weight = self.weight_format.dequantize(self.weight, self.weight_scale, shape).to(input.dtype)
        bias = None if self.bias is None else self.bias.to(input.dtype)
        return torch.nn.functional.linear(input, weight, bias)

    def extra_repr(self) -> str:
        format_name = self.weight_format.quant or self.weight_format.kind
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={format_name}"


def replace_linears(module: torch.nn.Module, formats: dict[str, WeightFormat]) -> None:
    """Puts a `QuantizedLinear` (parameters on meta, to be filled) in place of each nn.Linear named in `formats`."""
    for name, weight_format in formats.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        linear = getattr(owner, attr)
        with torch.device("meta"):
            replacement = QuantizedLinear(
                linear.in_features, linear.out_features, linear.bias is not None, weight_format
            )
        if linear.bias is not None:
            replacement.bias = torch.nn.Parameter(torch.empty_like(linear.bias, device="meta"), requires_grad=False)
        setattr(owner, attr, replacement)
