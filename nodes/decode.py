"""WanVACEDecode: a video LATENT -> IMAGE frames for ComfyUI's video nodes."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core import decode
from ..wanvace_core.generation.tiling import VAETiling, requested_peak_bytes
from .memory import set_working_memory
from .refusals import Refusal
from .tiling import check_tiling_inputs, free_device_bytes, tiling_from_inputs, tiling_inputs
from .types import CATEGORY, WanVACEModelType


class WanVACEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEDecode",
            display_name="WanVACE Decode",
            category=CATEGORY,
            description="Decodes a WanVACE video latent with the pipeline's VAE into frames [T, H, W, 3] in [0, 1], "
            "ready for CreateVideo/SaveVideo or SaveAnimatedWEBP. With tiled auto or on, large frames are decoded "
            "in overlapping tiles (diffusers' VAE tiling) to fit a smaller GPU.",
            inputs=[
                WanVACEModelType.Input("model", tooltip="The pipeline whose VAE decodes the latent."),
                io.Latent.Input("samples", tooltip="The video latent from WanVACE Sampler."),
                *tiling_inputs(),
            ],
            outputs=[io.Image.Output(display_name="frames", tooltip="The decoded video frames.")],
        )

    @classmethod
    def validate_inputs(cls, tiled=None, tile_size=None, tile_overlap=None) -> bool | str:
        with Refusal() as refusal:
            check_tiling_inputs(tiled, tile_size, tile_overlap)
        return refusal.message or True

    @classmethod
    def execute(
        cls,
        model,
        samples,
        tiled: str = VAETiling.mode,
        tile_size: int = VAETiling.tile_size,
        tile_overlap: int = VAETiling.overlap,
    ) -> io.NodeOutput:
        tiling = tiling_from_inputs(tiled, tile_size, tile_overlap)
        latents = samples["samples"]
        free_bytes = None
        if latents.ndim == 5:  # decode refuses anything else, naming the input
            # ComfyUI makes room for this when the VAE's weights move to the device; what is free after that
            # decides "auto".
            stride = model.helper.vae_scale_factor_spatial
            frames, height, width = latents.shape[2], latents.shape[3] * stride, latents.shape[4] * stride
            set_working_memory(model, requested_peak_bytes(model, tiling, frames, height, width, encode=False))
            model.activate("vae")
            free_bytes = free_device_bytes(model) if tiling.mode == "auto" else None
        return io.NodeOutput(decode(model, latents, tiling, free_bytes))
