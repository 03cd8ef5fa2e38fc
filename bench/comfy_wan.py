"""ComfyUI's own Wan VACE model (`comfy.ldm.wan.model.VaceWanModel`) over one of our experts' weights, for the
benches that compare the two on the same weights. ComfyUI's `comfy` package must import (its tree on sys.path)."""

from __future__ import annotations

import torch

from bench.expert_files import original_wan_state_dict


class ComfyWeightsRefused(RuntimeError):
    """ComfyUI's model did not take the expert's weights under their original Wan names."""


def comfy_vace_model(expert: torch.nn.Module, *, dtype: torch.dtype, device: torch.device | None = None):
    """A `VaceWanModel` of the expert's shape holding its weights, in eval mode without gradients."""
    import comfy.ldm.wan.model as comfy_wan
    import comfy.ops

    config = expert.config
    model = comfy_wan.VaceWanModel(
        patch_size=tuple(config["patch_size"]),
        in_dim=config["in_channels"],
        dim=config["num_attention_heads"] * config["attention_head_dim"],
        ffn_dim=config["ffn_dim"],
        freq_dim=config["freq_dim"],
        text_dim=config["text_dim"],
        out_dim=config["out_channels"],
        num_heads=config["num_attention_heads"],
        num_layers=config["num_layers"],
        eps=config["eps"],
        vace_layers=len(config["vace_layers"]),
        vace_in_dim=config["vace_in_channels"],
        operations=comfy.ops.disable_weight_init,
        device=device,
        dtype=dtype,
    )
    missing, unexpected = model.load_state_dict(original_wan_state_dict(expert), strict=False)
    if missing or unexpected:
        raise ComfyWeightsRefused(
            f"ComfyUI's model did not take the weights: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return model.eval().requires_grad_(False)


class ComfyAttentionCounter:
    """Counts, while entered, the calls of ComfyUI's SageAttention kernel (`sageattn` as `comfy.ldm.modules.attention`
    holds it) and of its PyTorch SDPA attention (which `attention_sage` falls back to on any error), so a bench
    says which attention ComfyUI really ran instead of which it was asked for."""

    def __init__(self, comfy_attention) -> None:
        self.module = comfy_attention
        self.sage = 0
        self.pytorch = 0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> ComfyAttentionCounter:
        def counting(name: str, attribute: str):
            original = getattr(self.module, name)

            def wrapper(*args, **kwargs):
                out = original(*args, **kwargs)  # counted only when it returned (sage may raise and fall back)
                setattr(self, attribute, getattr(self, attribute) + 1)
                return out

            self._saved[name] = original
            setattr(self.module, name, wrapper)

        if getattr(self.module, "sageattn", None) is not None:
            counting("sageattn", "sage")
        counting("attention_pytorch", "pytorch")
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(self.module, name, original)

    def ran(self) -> str:
        """'sage', 'pytorch', 'both' or 'none': what the counted calls show ran."""
        if self.sage and self.pytorch:
            return "both"
        return "sage" if self.sage else "pytorch" if self.pytorch else "none"

    def describe(self, sage_version: str | None) -> str:
        sage = f"SageAttention {sage_version}".strip() if sage_version is not None else None
        ran = self.ran()
        if ran == "sage":
            return f"{sage} ({self.sage} calls)"
        if ran == "pytorch":
            asked = f"; {sage} was asked for and fell back" if sage else "; sageattention not installed"
            return f"PyTorch SDPA ({self.pytorch} calls{asked})"
        if ran == "both":
            return f"{sage} for {self.sage} calls, PyTorch SDPA for {self.pytorch} (fallbacks or unsupported calls)"
        return "none counted (ComfyUI ran an attention this bench does not know)"
