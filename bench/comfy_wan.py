"""ComfyUI's own Wan VACE model (`comfy.ldm.wan.model.VaceWanModel`) over one of our experts' weights, for the
benches that compare the two on the same weights. ComfyUI's `comfy` package must import (its tree on sys.path)."""

from __future__ import annotations

import torch

from tests.single_files import original_wan_state_dict


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
