"""Latent space conversions and VAE decoding, with the same arithmetic as WanVACEPipeline."""

from __future__ import annotations

import torch

from ..errors import WanVACEInputError
from ..runtime.model import WanVACEModel
from .tiling import VAETiling, vae_tiling


def _latent_statistics(model: WanVACEModel, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config = model.vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
    return mean, inverse_std


def to_vae_space(model: WanVACEModel, latents: torch.Tensor) -> torch.Tensor:
    """Normalised sampler latents -> raw VAE latents (ComfyUI's LATENT convention), stored as fp32.

    The arithmetic runs in the VAE dtype exactly as the pipeline's decode path does, so decoding
    the result is bitwise equal to the pipeline; the fp32 copy holds bf16/fp16 values losslessly.
    """
    latents = latents.to(model.device, model.vae.dtype)
    mean, inverse_std = _latent_statistics(model, latents)
    return (latents / inverse_std + mean).float()


@torch.no_grad()
def decode(
    model: WanVACEModel, vae_latents: torch.Tensor, tiling: VAETiling | None = None, free_bytes: int | None = None
) -> torch.Tensor:
    """Raw VAE latents `[B, C, T, h, w]` -> frames `[B*T', H, W, 3]` in `[0, 1]` (fp32).

    `tiling` splits the frames into tiles with diffusers' VAE tiling (`wanvace_core.generation.tiling`); `free_bytes`
    is the device memory free for the decode, which `tiling` "auto" weighs. None leaves the VAE as it is.
    """
    channels = model.vae.config.z_dim
    if vae_latents.ndim != 5 or vae_latents.shape[1] != channels:
        raise WanVACEInputError(
            f"samples has shape {tuple(vae_latents.shape)}; expected a Wan video latent [batch, {channels}, frames, "
            "height/8, width/8] such as WanVACESampler's output."
        )
    latents = vae_latents.to(model.device, model.vae.dtype)
    model.activate("vae")
    stride = model.helper.vae_scale_factor_spatial
    latent_frames, height, width = latents.shape[2], latents.shape[3] * stride, latents.shape[4] * stride
    with vae_tiling(model, tiling, latent_frames, height, width, free_bytes, encode=False):
        video = model.vae.decode(latents, return_dict=False)[0]
    frames = model.helper.video_processor.postprocess_video(video, output_type="pt")  # [B, T, C, H, W]
    return frames.flatten(0, 1).permute(0, 2, 3, 1).float().cpu()
