"""Device memory the work (not the weights) needs: what ComfyUI is told as `memory_required`.

An estimate, from the shapes alone: one transformer block's live activations at the token count of
the run (hidden state, q/k/v and attention output, the FFN's inner activation, the VACE hint and
control state, and the fp32 norm temporaries). Attention itself runs fused (SDPA), so no
tokens x tokens matrix is counted.
"""

from __future__ import annotations

from .model import WanVACEModel


def sampling_activation_bytes(model: WanVACEModel, latent_frames: int, height: int, width: int) -> int:
    """Peak activation bytes of one expert forward on a latent of `latent_frames` x `height` x `width` pixels."""
    config = model.reference_expert.config
    patch_t, patch_h, patch_w = config.patch_size
    stride = model.helper.vae_scale_factor_spatial
    tokens = (latent_frames // patch_t) * (height // stride // patch_h) * (width // stride // patch_w)
    dim = config.num_attention_heads * config.attention_head_dim
    itemsize = model.transformer_dtype.itemsize
    # hidden + q, k, v + attention out + VACE hint + control state, FFN inner; two fp32 norm temporaries.
    return tokens * ((7 * dim + config.ffn_dim) * itemsize + 2 * dim * 4)
