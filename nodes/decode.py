"""WanVACEDecode: a video LATENT -> IMAGE frames for ComfyUI's video nodes."""

from __future__ import annotations

from comfy_api.latest import io

from ..wanvace_core import decode
from .types import CATEGORY, WanVACEModelType


class WanVACEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEDecode",
            display_name="WanVACE Decode",
            category=CATEGORY,
            description="Decodes a WanVACE video latent with the pipeline's VAE into frames [T, H, W, 3] in [0, 1], "
            "ready for CreateVideo/SaveVideo or SaveAnimatedWEBP.",
            inputs=[
                WanVACEModelType.Input("model", tooltip="The pipeline whose VAE decodes the latent."),
                io.Latent.Input("samples", tooltip="The video latent from WanVACE Sampler."),
            ],
            outputs=[io.Image.Output(display_name="frames", tooltip="The decoded video frames.")],
        )

    @classmethod
    def execute(cls, model, samples) -> io.NodeOutput:
        return io.NodeOutput(decode(model, samples["samples"]))
