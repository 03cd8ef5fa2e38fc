"""WanVACEConditioning: prompts (text, or ComfyUI CONDITIONING) + optional control video, masks and reference
images -> WANVACE_COND."""

from __future__ import annotations

import logging

from comfy_api.v0_0_2 import io

from ..wanvace_core import VACEInputs, WanVACEInputError, prepare_conditioning, validate_prompt
from ..wanvace_core.generation.conditioning import (
    NEGATIVE_EMBEDS_INPUT,
    POSITIVE_EMBEDS_INPUT,
    TextEmbeddings,
    validate_frame_side,
    validate_length,
    validate_vace_window,
)
from ..wanvace_core.generation.limits import size_limits_of
from ..wanvace_core.generation.tiling import VAETiling, requested_peak_bytes
from ..wanvace_core.validation import validate_range
from .graph_checks import check_conditioning_size, check_frames_at_run
from .inputs import LENGTH_RANGE, SIZE_RANGE, float_input, fraction_input, video_size_inputs
from .memory import set_working_memory
from .queued_prompt import this_node
from .refusals import NOT_CONNECTED, Refusal
from .tiling import check_tiling_inputs, free_device_bytes, tiling_from_inputs, tiling_inputs
from .types import CATEGORY, WanVACEConditioningType, WanVACEModelType

logger = logging.getLogger(__name__)

# Keys of a CONDITIONING entry's dict that say nothing the text embeddings do not: ComfyUI's text encoders set
# pooled_output (None for Wan's umt5) and, for some encoders, attention_mask (which the conversion reads).
_TEXT_ENCODER_KEYS = {"pooled_output", "attention_mask"}


def _text_embeddings(name: str, conditioning) -> TextEmbeddings | None:
    """ComfyUI's CONDITIONING (a list of [hidden states, dict] entries) -> the one encoded prompt it holds."""
    if conditioning is None:
        return None
    if not isinstance(conditioning, list) or not all(
        isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], dict) for entry in conditioning
    ):
        raise WanVACEInputError(
            f"{name} is a {type(conditioning).__name__}, not a ComfyUI CONDITIONING; connect a CLIPTextEncode output."
        )
    if len(conditioning) != 1:
        raise WanVACEInputError(
            f"{name} holds {len(conditioning)} conditioning entries (from ConditioningCombine or similar); WanVACE "
            "takes one prompt per input: connect a single CLIPTextEncode output."
        )
    hidden_states, extras = conditioning[0]
    ignored = sorted(set(extras) - _TEXT_ENCODER_KEYS)
    if ignored:
        logger.warning(
            "WanVACE uses only the text embeddings of %s; it ignores the %s set by other conditioning nodes.",
            name,
            ", ".join(ignored),
        )
    return TextEmbeddings(hidden_states, extras.get("attention_mask"))


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
                "1. control_video alone: a control signal (depth, pose, ...). reference_images: subjects or style."
            ),
            inputs=[
                WanVACEModelType.Input("model", tooltip="The pipeline from a WanVACE loader."),
                io.String.Input(
                    "positive",
                    multiline=True,
                    default="",
                    tooltip="What the video shows; may be empty only when positive_conditioning replaces it.",
                ),
                io.String.Input(
                    "negative",
                    multiline=True,
                    default="",
                    tooltip="What to steer away from at cfg above 1 (may be empty).",
                ),
                *video_size_inputs(),
                float_input(
                    "strength",
                    VACEInputs.strength,
                    (0.0, 10.0),
                    0.01,
                    "How strongly the VACE inputs steer the video (1.0 trained, 0 ignores them).",
                ),
                fraction_input(
                    "vace_start_percent",
                    VACEInputs.vace_start_percent,
                    "Share of the steps after which the VACE inputs start to apply.",
                    optional=True,
                ),
                fraction_input(
                    "vace_end_percent",
                    VACEInputs.vace_end_percent,
                    "Share of the steps after which the VACE inputs stop applying.",
                    optional=True,
                ),
                io.Image.Input(
                    "control_video",
                    optional=True,
                    tooltip="Frames at width x height, at most length of them, from the start of the video.",
                ),
                io.Mask.Input(
                    "control_masks",
                    optional=True,
                    tooltip="1 = generate, 0 = keep the control_video pixel; one mask per frame, or one for all.",
                ),
                io.Image.Input(
                    "reference_images",
                    optional=True,
                    tooltip="Subject or style images (an IMAGE batch), each its own latent frame.",
                ),
                io.Conditioning.Input(
                    POSITIVE_EMBEDS_INPUT,
                    optional=True,
                    tooltip="The positive prompt from ComfyUI's CLIPTextEncode (umt5_xxl, type wan), used instead "
                    "of the text.",
                ),
                io.Conditioning.Input(
                    NEGATIVE_EMBEDS_INPUT,
                    optional=True,
                    tooltip="The negative prompt from ComfyUI's CLIPTextEncode (umt5_xxl, type wan), used instead "
                    "of the text.",
                ),
                *tiling_inputs(),  # for the VAE encode of control_video (and masks)
            ],
            outputs=[WanVACEConditioningType.Output(display_name="conditioning", tooltip="Encoded VACE conditioning.")],
            # The graph, to check the length against the windows of the samplers this feeds before encoding.
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def validate_inputs(
        cls,
        positive: str | None = None,
        width: int | None = None,
        height: int | None = None,
        length: int | None = None,
        positive_conditioning=NOT_CONNECTED,
        vace_start_percent: float | None = None,
        vace_end_percent: float | None = None,
        tiled: str | None = None,
        tile_size: int | None = None,
        tile_overlap: int | None = None,
    ) -> bool | str:
        # Width and height (multiples of 16), length (4n+1), the empty prompt, the VACE window as a pair and the
        # tiling inputs; strength keeps ComfyUI's range check.
        with Refusal() as refusal:
            for name, value, bounds in (("width", width, SIZE_RANGE), ("height", height, SIZE_RANGE)):
                if value is not None:
                    validate_range(name, value, *bounds)
                    validate_frame_side(name, value)
            if length is not None:
                validate_range("length", length, *LENGTH_RANGE)
                validate_length("length", length)
            if positive is not None:
                validate_prompt(positive, has_embeddings=positive_conditioning is not NOT_CONNECTED)
            if vace_start_percent is not None or vace_end_percent is not None:
                # Both are named in a refusal: the window is wrong as a pair (start after end).
                validate_vace_window(
                    VACEInputs.vace_start_percent if vace_start_percent is None else vace_start_percent,
                    VACEInputs.vace_end_percent if vace_end_percent is None else vace_end_percent,
                )
            check_tiling_inputs(tiled, tile_size, tile_overlap)
            # The size against the model the graph loads (its RoPE table), once the rules above hold.
            graph = this_node()
            if graph is not None:
                check_conditioning_size(*graph)
        return refusal.message or True

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
        positive_conditioning=None,
        negative_conditioning=None,
        vace_start_percent: float = VACEInputs.vace_start_percent,
        vace_end_percent: float = VACEInputs.vace_end_percent,
        tiled: str = VAETiling.mode,
        tile_size: int = VAETiling.tile_size,
        tile_overlap: int = VAETiling.overlap,
    ) -> io.NodeOutput:
        tiling = tiling_from_inputs(tiled, tile_size, tile_overlap)
        graph = this_node(getattr(cls.hidden, "prompt", None))  # None outside ComfyUI's executor
        if graph is not None:  # the frames per call with the windows the samplers use, before anything is encoded
            references = 0 if reference_images is None else int(reference_images.shape[0])
            check_frames_at_run(graph[0], graph[1], size_limits_of(model), length, references)
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
            positive_embeds=_text_embeddings(POSITIVE_EMBEDS_INPUT, positive_conditioning),
            negative_embeds=_text_embeddings(NEGATIVE_EMBEDS_INPUT, negative_conditioning),
            vace_start_percent=vace_start_percent,
            vace_end_percent=vace_end_percent,
        )
        # ComfyUI makes room for the encode when the VAE's weights move to the device; what is free after that
        # decides "auto".
        set_working_memory(model, requested_peak_bytes(model, tiling, length, height, width, encode=True))
        model.activate("vae")
        free_bytes = free_device_bytes(model) if tiling.mode == "auto" else None
        return io.NodeOutput(prepare_conditioning(model, inputs, tiling, free_bytes))
