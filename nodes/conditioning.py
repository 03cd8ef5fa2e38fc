"""WanVACEConditioning: prompts + optional control video, masks and reference images -> WANVACE_COND."""

from __future__ import annotations

from comfy_api.latest import io

from ..wanvace_core import (
    VACEInputs,
    WanVACEInputError,
    prepare_conditioning,
    validate_generation_size,
    validate_prompt,
)
from ..wanvace_core.validation import nan_refusing_min
from .types import CATEGORY, WanVACEConditioningType, WanVACEModelType


class WanVACEConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEConditioning",
            display_name="WanVACE Conditioning",
            category=CATEGORY,
            description=(
                "Encodes the prompts and the VACE inputs for every task. Nothing connected: text-to-video. "
                "control_video + control_masks: given frames are kept where the mask is 0 and generated where it is "
                "1 (I2V = one frame with a black mask; first/last frame; inpaint; outpaint; extension = the first "
                "frames). control_video alone: a control signal (depth, pose, ...). reference_images: subjects or "
                "style, each its own latent frame. Frames shorter than length are padded with grey and generated."
            ),
            inputs=[
                WanVACEModelType.Input("model", tooltip="The pipeline from WanVACE Model Loader."),
                io.String.Input(
                    "positive", multiline=True, default="", tooltip="What the video shows. Must not be empty."
                ),
                io.String.Input(
                    "negative",
                    multiline=True,
                    default="",
                    tooltip="What to steer away from (used when cfg > 1). May be empty.",
                ),
                io.Int.Input(
                    "width", default=832, min=16, max=4096, step=16, tooltip="Video width in pixels, a multiple of 16."
                ),
                io.Int.Input(
                    "height",
                    default=480,
                    min=16,
                    max=4096,
                    step=16,
                    tooltip="Video height in pixels, a multiple of 16.",
                ),
                io.Int.Input(
                    "length",
                    default=81,
                    min=1,
                    max=1025,
                    step=4,
                    tooltip="Number of frames, of the form 4n+1 (81 = 5 s at 16 fps).",
                ),
                io.Float.Input(
                    "strength",
                    default=1.0,
                    min=nan_refusing_min(0.0),
                    max=10.0,
                    step=0.01,
                    tooltip="How strongly the VACE inputs steer the video; 1.0 is the trained value, 0 ignores them.",
                ),
                io.Image.Input(
                    "control_video",
                    optional=True,
                    tooltip="Frames at width x height, at most length of them, covering the start of the video.",
                ),
                io.Mask.Input(
                    "control_masks",
                    optional=True,
                    tooltip="1 = generate, 0 = keep the control_video pixel. One mask per control frame, or a single "
                    "mask for all of them; frames past the masks are generated.",
                ),
                io.Image.Input(
                    "reference_images",
                    optional=True,
                    tooltip="One or more reference images (an IMAGE batch); each is fitted onto a white canvas of the "
                    "video size and becomes its own latent frame.",
                ),
            ],
            outputs=[WanVACEConditioningType.Output(display_name="conditioning", tooltip="Encoded VACE conditioning.")],
        )

    @classmethod
    def validate_inputs(
        cls, positive: str | None = None, width: int | None = None, height: int | None = None, length: int | None = None
    ) -> bool | str:
        # ComfyUI lists a refusal under every argument of validate_inputs, so each message names the input it
        # is about. Floats stay out of it: ComfyUI's own range check refuses NaN (nan_refusing_min) and +-inf
        # under that input alone.
        try:
            if None not in (width, height, length):
                validate_generation_size(width, height, length)
            if positive is not None:
                validate_prompt(positive)
        except WanVACEInputError as error:
            return str(error)
        return True

    @classmethod
    def execute(
        cls,
        model,
        positive: str,
        negative: str,
        width: int,
        height: int,
        length: int,
        strength: float,
        control_video=None,
        control_masks=None,
        reference_images=None,
    ) -> io.NodeOutput:
        inputs = VACEInputs(
            positive=positive,
            negative=negative,
            width=width,
            height=height,
            length=length,
            strength=strength,
            control_video=control_video,
            control_masks=control_masks,
            reference_images=reference_images,
        )
        return io.NodeOutput(prepare_conditioning(model, inputs))
