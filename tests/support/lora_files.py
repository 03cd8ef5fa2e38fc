"""Writes tiny LoRA files for the tiny experts, in every key layout users' LoRAs come in, and merges them by hand.

Test-side only. A `LoraContent` is what a LoRA means, in diffusers names: low-rank pairs per Linear
(A [rank, in], B [out, rank], delta = alpha / rank * B @ A) and full differences per parameter. The
same content written in each format must give the same model:

- "comfy": ComfyUI / kohya on the original Wan names with the `diffusion_model.` prefix
  (`diffusion_model.blocks.0.self_attn.q.lora_up.weight`, `.lora_down.weight`, `.alpha`), full
  differences as `.diff` (weights) and `.diff_b` (biases), `blocks.N.modulation.diff`, `head.modulation.diff`;
- "lightx2v": the same keys (lightx2v's distillation LoRAs are ComfyUI-named, with diff/diff_b/norm diffs);
- "comfy_unprefixed": "comfy" without the prefix;
- "kohya": `lora_unet_blocks_0_self_attn_q.lora_up.weight` (musubi-tuner / kohya underscore names);
- "peft": diffusers' own `save_lora_weights` layout, `transformer.blocks.0.attn1.to_q.lora_A.weight` /
  `lora_B.weight` (alpha folded into B, bias differences as `lora_B.bias`; no other full differences);
- "peft_original": `lora_A` / `lora_B` on the prefixed original names, alpha kept as `.alpha`.

Original names come from `bench/expert_files.py` (the inverse of diffusers' weight-name converter).
`hand_merged` edits a model's weights directly with `W + strength * alpha / rank * B @ A` and
`p + strength * diff`, independently of `wanvace_core.runtime.lora`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.expert_files import original_key

LORA_FORMATS = ("comfy", "lightx2v", "comfy_unprefixed", "kohya", "peft", "peft_original")
COMFY_PREFIX = "diffusion_model."


@dataclass
class LoraContent:
    """A LoRA's tensors in diffusers names: `low_rank[module] = (A, B)`, `diffs[parameter] = delta`."""

    low_rank: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    diffs: dict[str, torch.Tensor] = field(default_factory=dict)
    alpha: float | None = None

    def scale(self, module: str) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.low_rank[module][0].shape[0]


def _expert(model_or_expert) -> torch.nn.Module:
    return getattr(model_or_expert, "reference_expert", model_or_expert)


def linear_names(model_or_expert) -> list[str]:
    """Names of every Linear of an expert (nn.Linear and the pack's QuantizedLinear)."""
    from wanvace_core.load.quantized import QuantizedLinear

    return [
        name
        for name, module in _expert(model_or_expert).named_modules()
        if isinstance(module, (torch.nn.Linear, QuantizedLinear))
    ]


def _linear_shape(module: torch.nn.Module) -> tuple[int, int]:
    return module.out_features, module.in_features


def _param_shapes(expert: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for module_name, module in expert.named_modules():
        for attr, param in module._parameters.items():
            if param is None:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            linear = hasattr(module, "in_features") and attr == "weight"
            shapes[name] = _linear_shape(module) if linear else tuple(param.shape)
    return shapes


def lightx2v_diff_names(model_or_expert) -> list[str]:
    """The parameters lightx2v-style files carry full differences for: every bias, the affine norms, the
    patch embeddings (Conv3d), each block's and the head's modulation (`scale_shift_table`), the head's
    weight, and a VACE block's input projection weight."""
    names = []
    for name in _param_shapes(_expert(model_or_expert)):
        module, _, attr = name.rpartition(".")
        if (
            attr == "bias"
            or ".norm" in f".{module}"
            or module in ("patch_embedding", "vace_patch_embedding", "proj_out", "vace_blocks.0.proj_in")
            or attr == "scale_shift_table"
        ):
            names.append(name)
    return names


def lora_content(
    model_or_expert,
    rank: int = 4,
    seed: int = 0,
    *,
    alpha: float | None = None,
    modules: list[str] | None = None,
    diffs: bool | list[str] = False,
    std: float = 0.1,
) -> LoraContent:
    """Random LoRA tensors shaped for an expert (its shapes only: meta or quantised weights are fine).

    `modules` (default every Linear) get low-rank pairs; `diffs=True` adds `lightx2v_diff_names`, or pass
    the parameter names. Deltas are about `rank * std**2` per element, visible in the tiny model's output.
    """
    expert = _expert(model_or_expert)
    generator = torch.Generator().manual_seed(seed)
    content = LoraContent(alpha=alpha)
    for name in linear_names(expert) if modules is None else modules:
        out_features, in_features = _linear_shape(expert.get_submodule(name))
        down = torch.randn(rank, in_features, generator=generator) * std
        up = torch.randn(out_features, rank, generator=generator) * std
        content.low_rank[name] = (down, up)
    shapes = _param_shapes(expert)
    for name in lightx2v_diff_names(expert) if diffs is True else (diffs or []):
        content.diffs[name] = torch.randn(shapes[name], generator=generator) * (std * std)
    return content


def _original_module(module: str) -> str:
    return original_key(f"{module}.weight")[: -len(".weight")]


def _diff_key(parameter: str) -> str:
    """`blocks.0.norm2.weight` -> `blocks.0.norm3.diff`, a `.bias` -> `.diff_b`, `scale_shift_table` ->
    `head.modulation.diff`."""
    original = original_key(parameter)
    if original.endswith(".weight"):
        return original[: -len(".weight")] + ".diff"
    if original.endswith(".bias"):
        return original[: -len(".bias")] + ".diff_b"
    return original + ".diff"


def lora_state_dict(content: LoraContent, format: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The file's tensors for `content` in `format` (see the module docstring)."""
    if format not in LORA_FORMATS:
        raise ValueError(f"format must be one of {LORA_FORMATS}, not {format!r}")
    state: dict[str, torch.Tensor] = {}
    if format == "peft":
        for module, (down, up) in content.low_rank.items():
            state[f"transformer.{module}.lora_A.weight"] = down
            state[f"transformer.{module}.lora_B.weight"] = up * content.scale(module)
        for parameter, delta in content.diffs.items():
            module, _, attr = parameter.rpartition(".")
            if attr != "bias" or module not in content.low_rank:
                raise ValueError(f"PEFT files hold no full difference for {parameter!r}, only biases of LoRA layers")
            state[f"transformer.{module}.lora_B.bias"] = delta
    else:
        down_key, up_key = ("lora_A", "lora_B") if format == "peft_original" else ("lora_down", "lora_up")
        prefix = "" if format == "comfy_unprefixed" else COMFY_PREFIX

        def name(original: str) -> str:
            if format == "kohya":
                return "lora_unet_" + original.replace(".", "_")
            return prefix + original

        for module, (down, up) in content.low_rank.items():
            original = _original_module(module)
            state[f"{name(original)}.{down_key}.weight"] = down
            state[f"{name(original)}.{up_key}.weight"] = up
            if content.alpha is not None:
                state[f"{name(original)}.alpha"] = torch.tensor(float(content.alpha))
        for parameter, delta in content.diffs.items():
            original, _, suffix = _diff_key(parameter).rpartition(".")
            state[f"{name(original)}.{suffix}"] = delta
    return {key: value.to(dtype).contiguous() for key, value in state.items()}


def write_lora(path: str | Path, content: LoraContent, format: str = "comfy", dtype=torch.float32) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(lora_state_dict(content, format, dtype), str(path))
    return path


def write_lora_file(
    path: str | Path,
    model_or_expert,
    format: str = "comfy",
    rank: int = 4,
    seed: int = 0,
    *,
    alpha: float | None = None,
    modules: list[str] | None = None,
    diffs: bool | list[str] = False,
    std: float = 0.1,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Writes a random LoRA for the expert in `format`; `lora_content` with the same arguments gives its tensors."""
    content = lora_content(model_or_expert, rank, seed, alpha=alpha, modules=modules, diffs=diffs, std=std)
    return write_lora(path, content, format, dtype)


@torch.no_grad()
def hand_merged(expert: torch.nn.Module, content: LoraContent, strength: float) -> torch.nn.Module:
    """Adds `content` into `expert`'s plain float weights in place (low-rank first, then the differences)."""
    params = dict(expert.named_parameters())
    for module, (down, up) in content.low_rank.items():
        weight = params[f"{module}.weight"]
        weight.data = weight.data + strength * content.scale(module) * (up.float() @ down.float())
    for parameter, delta in content.diffs.items():
        params[parameter].data = params[parameter].data + strength * delta.float()
    return expert


def rehomed(model):
    """`model` with its experts' weights in fresh allocations, as the hand merge's are: CPU GEMM kernels pick
    their path by operand alignment, and weights used in place from a file sit at the file's offsets."""
    with torch.no_grad():
        for expert in model.experts:
            for tensor in expert.parameters():
                tensor.data = tensor.data.clone()
    return model
