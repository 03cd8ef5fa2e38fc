"""The original alibaba-pai/Wan2.2-VACE-Fun-A14B release layout (VideoX-Fun), written from a tiny diffusers model."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from bench.expert_files import original_wan_state_dict
from tests.support.single_files import original_wan_vae_state_dict
from wanvace_core.load.tiny import write_tokenizer_files


def wan_t5_state_dict(text_encoder) -> dict[str, torch.Tensor]:
    """transformers' UMT5 encoder -> the original Wan T5 names (wan/modules/t5.py: T5Encoder)."""
    inner = {
        "layer.0.layer_norm.weight": "norm1.weight",
        "layer.0.SelfAttention.q.weight": "attn.q.weight",
        "layer.0.SelfAttention.k.weight": "attn.k.weight",
        "layer.0.SelfAttention.v.weight": "attn.v.weight",
        "layer.0.SelfAttention.o.weight": "attn.o.weight",
        "layer.0.SelfAttention.relative_attention_bias.weight": "pos_embedding.embedding.weight",
        "layer.1.layer_norm.weight": "norm2.weight",
        "layer.1.DenseReluDense.wi_0.weight": "ffn.gate.0.weight",
        "layer.1.DenseReluDense.wi_1.weight": "ffn.fc1.weight",
        "layer.1.DenseReluDense.wo.weight": "ffn.fc2.weight",
    }
    out = {}
    for key, value in text_encoder.state_dict().items():
        if key == "shared.weight":
            out["token_embedding.weight"] = value
        elif key == "encoder.final_layer_norm.weight":
            out["norm.weight"] = value
        elif key.startswith("encoder.block."):
            index, rest = key[len("encoder.block.") :].split(".", 1)
            out[f"blocks.{index}.{inner[rest]}"] = value
    return {k: v.clone() for k, v in out.items()}


def write_original_release(root, components) -> None:
    """alibaba-pai/Wan2.2-VACE-Fun-A14B's layout: sharded expert folders in the original Wan names, the Wan
    T5 and VAE as .pth, the umt5 tokenizer under google/umt5-xxl."""
    for name, component in (("high_noise_model", "transformer"), ("low_noise_model", "transformer_2")):
        state = {k: v.clone().contiguous() for k, v in original_wan_state_dict(components[component]).items()}
        keys = sorted(state)
        half = len(keys) // 2
        expert = root / name
        expert.mkdir(parents=True)
        shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": keys[:half]}
        shards["diffusion_pytorch_model-00002-of-00002.safetensors"] = keys[half:]
        for shard, shard_keys in shards.items():
            save_file({k: state[k] for k in shard_keys}, str(expert / shard))
        weight_map = {k: shard for shard, shard_keys in shards.items() for k in shard_keys}
        (expert / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (expert / "config.json").write_text(json.dumps({"_class_name": "VaceWanTransformer3DModel"}))
    torch.save(wan_t5_state_dict(components["text_encoder"]), root / "models_t5_umt5-xxl-enc-bf16.pth")
    vae = {k: v.clone().contiguous() for k, v in original_wan_vae_state_dict(components["vae"]).items()}
    torch.save(vae, root / "Wan2.1_VAE.pth")
    write_tokenizer_files(root / "google" / "umt5-xxl")
