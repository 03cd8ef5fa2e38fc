"""VACE conditioning: text embeddings plus the encoded control video, mask and reference images.

Inputs arrive in ComfyUI's layout (frames `[T, H, W, 3]` and masks `[T, H, W]` in `[0, 1]`).
Given frames cover the start of the video; the rest is padded with mid-grey and masked as
"generate", as ComfyUI's own WanVaceToVideo does. A single mask frame applies to every given
frame. Masks are 1 where the model generates and 0 where it keeps the given pixels. With frames
but no mask, the frames are a control signal (depth, pose, ...) for the whole video.

A prompt may also arrive already encoded (`TextEmbeddings`, e.g. from ComfyUI's CLIPLoader(type wan) +
CLIPTextEncode); `prompt_embeds_from_text_embeddings` turns it into the prompt embeddings diffusers'
WanVACEPipeline builds from text: the real tokens' hidden states, then zero rows up to 512.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import WanVACEInputError
from ..runtime.model import WanVACEModel
from ..validation import validate_finite, validate_integer
from .limits import check_frame_size, check_frames, size_limits_of
from .tiling import VAETiling, vae_tiling

_PAD_GREY = 0.5
# The node inputs that carry an encoded prompt; refusals name them.
POSITIVE_EMBEDS_INPUT = "positive_conditioning"
NEGATIVE_EMBEDS_INPUT = "negative_conditioning"
_TEXT_ENCODER_FIX = "load umt5_xxl with CLIPLoader type wan and encode the prompt with CLIPTextEncode"


@dataclass(frozen=True)
class TextEmbeddings:
    """One prompt already run through a umt5 text encoder elsewhere (ComfyUI's CLIPTextEncode).

    `hidden_states` is `[1, tokens, dim]`. `attention_mask` (`[1, tokens]` or `[tokens]`, 1 = real token) is
    optional: ComfyUI's Wan text encoder reports none and zeroes the padded rows instead.
    """

    hidden_states: torch.Tensor
    attention_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class VACEInputs:
    """What the user asked for, in ComfyUI's tensor layout.

    `positive_embeds` / `negative_embeds`, when given, replace the `positive` / `negative` text (which may
    then be empty).
    """

    positive: str
    negative: str
    width: int
    height: int
    length: int
    strength: float = 1.0
    control_video: torch.Tensor | None = None
    control_masks: torch.Tensor | None = None
    reference_images: torch.Tensor | None = None
    positive_embeds: TextEmbeddings | None = None
    negative_embeds: TextEmbeddings | None = None
    vace_start_percent: float = 0.0
    vace_end_percent: float = 1.0


@dataclass(frozen=True)
class VACEConditioning:
    """Everything the sampler needs besides the model and the seed.

    The VACE hints apply at step `i` of `n` while `vace_start_percent <= i / n < vace_end_percent` (0 and 1: every
    step); at the other steps the experts run without the VACE blocks, which equals strength 0 there.
    """

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor
    conditioning_latents: torch.Tensor
    conditioning_scale: torch.Tensor
    num_reference_images: int
    width: int
    height: int
    length: int
    vace_start_percent: float = 0.0
    vace_end_percent: float = 1.0

    def applies_hints_at(self, step: int, steps: int) -> bool:
        return self.vace_start_percent <= step / steps < self.vace_end_percent


def validate_vace_window(start: float, end: float) -> None:
    """The share of the steps the VACE hints apply in: `0 <= start <= end <= 1`."""
    fix = "use a value in [0, 1]: 0 and 1 apply the VACE inputs at every step"
    for name, value in (("vace_start_percent", start), ("vace_end_percent", end)):
        if not 0.0 <= validate_finite(name, value, fix) <= 1.0:
            raise WanVACEInputError(f"{name}={value} is outside [0, 1]; 0 and 1 apply the VACE inputs at every step.")
    if start > end:
        raise WanVACEInputError(
            f"vace_start_percent={start} is after vace_end_percent={end}; the window must not end before it starts "
            f"(use vace_end_percent >= {start})."
        )


def validate_frame_side(name: str, value: int, multiple: int = 16, example: int = 832) -> None:
    """A width or height: a positive multiple of `multiple` (VAE stride x patch size)."""
    validate_integer(name, value, f"use a positive multiple of {multiple} such as {example}")
    if value <= 0 or value % multiple:
        nearest = max(multiple, round(value / multiple) * multiple)
        raise WanVACEInputError(f"{name}={value} is not a positive multiple of {multiple}; use {nearest}.")


def validate_length(name: str, value: int, temporal_stride: int = 4) -> None:
    """A frame count of the form `temporal_stride`n+1."""
    validate_integer(name, value, f"use a frame count of the form {temporal_stride}n+1 such as 81")
    if value < 1 or (value - 1) % temporal_stride:
        nearest = max(1, round((value - 1) / temporal_stride) * temporal_stride + 1)
        raise WanVACEInputError(
            f"{name}={value} frames is not of the form {temporal_stride}n+1 (e.g. 33, 49, 81); use {nearest}."
        )


def validate_generation_size(
    width: int,
    height: int,
    length: int,
    spatial_multiple: int = 16,
    temporal_stride: int = 4,
    names: tuple[str, str, str] = ("width", "height", "length"),
):
    """Checks the output size; raises `WanVACEInputError` with the nearest valid values, naming the inputs by
    `names` (the command line spells them `--width`, `--height`, `--num-frames`)."""
    width_name, height_name, length_name = names
    validate_frame_side(width_name, width, spatial_multiple)
    validate_frame_side(height_name, height, spatial_multiple, example=480)
    validate_length(length_name, length, temporal_stride)


def validate_prompt(positive: str, has_embeddings: bool = False) -> None:
    """The positive text must say something, unless an encoded prompt (`has_embeddings`) replaces it."""
    if not isinstance(positive, str):
        raise WanVACEInputError(f"positive={positive!r} is not a string; describe the video you want in text.")
    if not has_embeddings and not positive.strip():
        raise WanVACEInputError(
            f"positive prompt is empty and {POSITIVE_EMBEDS_INPUT} is not connected; describe the video you want "
            f"in positive, or connect a CLIPTextEncode output to {POSITIVE_EMBEDS_INPUT}."
        )


def _real_token_rows(name: str, embeds: TextEmbeddings, text_dim: int | None, max_sequence_length: int):
    """Validates an encoded prompt; returns the hidden states of its real tokens, `[tokens, dim]`."""
    if not isinstance(embeds, TextEmbeddings):
        raise WanVACEInputError(
            f"{name}={type(embeds).__name__} is not an encoded prompt; connect a CLIPTextEncode output."
        )
    hidden = embeds.hidden_states
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.ndim != 3:
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise WanVACEInputError(
            f"{name} holds {shape}, not text-encoder hidden states [1, tokens, width]; connect a CLIPTextEncode output."
        )
    batch, tokens, width = hidden.shape
    if batch != 1:
        raise WanVACEInputError(
            f"{name} holds a batch of {batch} prompts; WanVACE takes one prompt per input: encode one prompt with "
            "one CLIPTextEncode."
        )
    if text_dim is not None and width != text_dim:
        raise WanVACEInputError(
            f"{name} is {width} wide but this model needs {text_dim}-wide umt5 embeddings; {_TEXT_ENCODER_FIX}."
        )
    if not bool(torch.isfinite(hidden).all()):
        raise WanVACEInputError(f"{name} holds NaN or infinite values; encode the prompt again ({_TEXT_ENCODER_FIX}).")
    rows = hidden[0]
    if embeds.attention_mask is None:
        # ComfyUI's Wan encoder pads to at least 512 tokens and zeroes the padded rows (sd1_clip zero_out_masked);
        # a real token's hidden state (a final RMS norm's output) is never all zero.
        nonzero = rows.ne(0).any(dim=-1).nonzero()
        rows = rows[: int(nonzero[-1]) + 1 if len(nonzero) else 0]
    else:
        mask = embeds.attention_mask
        if not isinstance(mask, torch.Tensor) or mask.reshape(-1).shape[0] != tokens or mask.ndim > 2:
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise WanVACEInputError(
                f"{name} has an attention_mask of {shape} for {tokens} tokens; it must be [1, {tokens}] (1 = real "
                "token). Encode the prompt again with CLIPTextEncode."
            )
        rows = rows[mask.reshape(-1).to(rows.device) > 0]
    if rows.shape[0] > max_sequence_length:
        raise WanVACEInputError(
            f"{name} holds {rows.shape[0]} tokens but Wan reads at most {max_sequence_length} (diffusers cuts longer "
            "prompts); shorten the prompt."
        )
    return rows


def validate_text_embeddings(
    name: str, embeds: TextEmbeddings, text_dim: int | None = None, max_sequence_length: int = 512
) -> None:
    """Raises `WanVACEInputError` naming input `name` if `embeds` cannot be this model's prompt embeddings."""
    _real_token_rows(name, embeds, text_dim, max_sequence_length)


def prompt_embeds_from_text_embeddings(
    name: str,
    embeds: TextEmbeddings,
    text_dim: int,
    max_sequence_length: int = 512,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An encoded prompt -> `[1, max_sequence_length, text_dim]` as `WanVACEPipeline._get_t5_prompt_embeds` makes.

    diffusers keeps the hidden states of the real tokens (up to and including the end token) and fills the
    rest with zero rows; ComfyUI keeps its zeroed padding rows (at least 512). The real rows are the same
    numbers either way, so they are kept, cast to `dtype`, and zero-padded to `max_sequence_length`.
    """
    rows = _real_token_rows(name, embeds, text_dim, max_sequence_length).to(device=device, dtype=dtype)
    padding = rows.new_zeros(max_sequence_length - rows.shape[0], rows.shape[1])
    return torch.cat([rows, padding])[None]


def _check_frames(name: str, tensor: torch.Tensor, width: int, height: int, length: int, channels: bool) -> None:
    expected_ndim = 4 if channels else 3
    if tensor.ndim != expected_ndim or (channels and tensor.shape[-1] < 3):
        layout = "[frames, height, width, 3]" if channels else "[frames, height, width]"
        raise WanVACEInputError(f"{name} has shape {tuple(tensor.shape)}; expected {layout}.")
    frames, tensor_height, tensor_width = tensor.shape[:3]
    if (tensor_height, tensor_width) != (height, width):
        raise WanVACEInputError(
            f"{name} is {tensor_width}x{tensor_height} but the video is {width}x{height}; resize it first "
            f"(ImageScale to {width}x{height})."
        )
    if frames > length:
        raise WanVACEInputError(
            f"{name} has {frames} frames but length={length}; trim it (ImageFromBatch) or raise length."
        )


def validate_vace_inputs(
    inputs: VACEInputs,
    spatial_multiple: int = 16,
    temporal_stride: int = 4,
    text_dim: int | None = None,
    max_sequence_length: int = 512,
) -> None:
    """Validates everything before any encoding starts (`text_dim` None: encoded prompts' width unchecked)."""
    validate_generation_size(inputs.width, inputs.height, inputs.length, spatial_multiple, temporal_stride)
    validate_prompt(inputs.positive, has_embeddings=inputs.positive_embeds is not None)
    if not isinstance(inputs.negative, str):
        raise WanVACEInputError(f"negative={inputs.negative!r} is not a string; give a text prompt (it may be empty).")
    for name, embeds in (
        (POSITIVE_EMBEDS_INPUT, inputs.positive_embeds),
        (NEGATIVE_EMBEDS_INPUT, inputs.negative_embeds),
    ):
        if embeds is not None:
            validate_text_embeddings(name, embeds, text_dim, max_sequence_length)
    strength_fix = "use a value in [0, 10]; 1.0 is the trained value"
    if not 0.0 <= validate_finite("strength", inputs.strength, strength_fix) <= 10.0:
        raise WanVACEInputError(f"strength={inputs.strength} is outside [0, 10]; 1.0 is the trained value.")
    validate_vace_window(inputs.vace_start_percent, inputs.vace_end_percent)
    size = (inputs.width, inputs.height, inputs.length)
    if inputs.control_video is not None:
        _check_frames("control_video", inputs.control_video, *size, channels=True)
    if inputs.control_masks is not None:
        masks = inputs.control_masks
        if masks.ndim == 2:
            masks = masks[None]
        _check_frames("control_masks", masks, *size, channels=False)
        if inputs.control_video is not None and masks.shape[0] not in (1, inputs.control_video.shape[0]):
            raise WanVACEInputError(
                f"control_masks has {masks.shape[0]} frames but control_video has {inputs.control_video.shape[0]}; "
                "give one mask frame per video frame, or a single mask for all of them."
            )
    if inputs.reference_images is not None:
        refs = inputs.reference_images
        if refs.ndim != 4 or refs.shape[0] < 1 or refs.shape[-1] < 3:
            raise WanVACEInputError(
                f"reference_images has shape {tuple(refs.shape)}; expected an IMAGE batch [count, height, width, 3]."
            )


def full_length_video_and_mask(inputs: VACEInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole clip as `[length, H, W, 3]` frames and `[length, H, W]` masks in `[0, 1]`."""
    length, height, width = inputs.length, inputs.height, inputs.width
    video = torch.full((length, height, width, 3), _PAD_GREY, dtype=torch.float32)
    mask = torch.ones((length, height, width), dtype=torch.float32)
    given = 0
    if inputs.control_video is not None:
        given = inputs.control_video.shape[0]
        video[:given] = inputs.control_video[..., :3].float().cpu()
    if inputs.control_masks is not None:
        masks = inputs.control_masks.float().cpu()
        if masks.ndim == 2:
            masks = masks[None]
        if masks.shape[0] == 1 and given > 1:
            masks = masks.expand(given, -1, -1)
        mask[: masks.shape[0]] = masks
    return video, mask


def _reference_canvases(model: WanVACEModel, images: torch.Tensor, height: int, width: int) -> list[torch.Tensor]:
    """Fits each reference image into a white canvas of the video size, aspect kept (as diffusers does)."""
    processor = model.helper.video_processor
    canvases = []
    for image in images:
        image = processor.preprocess(image[..., :3].permute(2, 0, 1)[None].float().cpu(), None, None)
        image_height, image_width = image.shape[-2:]
        scale = min(height / image_height, width / image_width)
        new_height, new_width = int(image_height * scale), int(image_width * scale)
        resized = torch.nn.functional.interpolate(
            image, size=(new_height, new_width), mode="bilinear", align_corners=False
        ).squeeze(0)
        top, left = (height - new_height) // 2, (width - new_width) // 2
        canvas = torch.ones(3, height, width, dtype=torch.float32)
        canvas[:, top : top + new_height, left : left + new_width] = resized
        canvases.append(canvas.to(model.device))
    return canvases


def _prompt_embeds(model: WanVACEModel, text: str, embeds: TextEmbeddings | None, name: str) -> torch.Tensor:
    """The text's embeddings from our text encoder, or the already encoded prompt converted to them."""
    if embeds is None:
        return model.encode_prompt(text)
    return prompt_embeds_from_text_embeddings(
        name,
        embeds,
        model.reference_expert.config.text_dim,
        model.max_sequence_length,
        dtype=model.transformer_dtype,
        device=model.device,
    )


@torch.no_grad()
def prepare_conditioning(
    model: WanVACEModel, inputs: VACEInputs, tiling: VAETiling | None = None, free_bytes: int | None = None
) -> VACEConditioning:
    """Encodes prompts and VACE inputs exactly as diffusers' WanVACEPipeline does.

    `tiling` (None: the VAE as it is) tiles the control-video encode; `auto` decides from `free_bytes`.
    """
    text_dim = model.reference_expert.config.text_dim
    validate_vace_inputs(inputs, model.spatial_multiple, model.temporal_stride, text_dim, model.max_sequence_length)
    # Before the text encoder and the VAE run. The length is checked against the windows too when they are known
    # (`sample`); what the reference images alone leave is known here.
    limits = size_limits_of(model)
    check_frame_size(limits, inputs.width, inputs.height)
    reference_count = 0 if inputs.reference_images is None else inputs.reference_images.shape[0]
    check_frames(limits, 1, reference_count)
    pipeline = model.helper
    prompt_embeds = _prompt_embeds(model, inputs.positive, inputs.positive_embeds, POSITIVE_EMBEDS_INPUT)
    negative_prompt_embeds = _prompt_embeds(model, inputs.negative, inputs.negative_embeds, NEGATIVE_EMBEDS_INPUT)

    frames, masks = full_length_video_and_mask(inputs)
    # Same arithmetic as VideoProcessor.preprocess_video on PIL frames: [0,1] -> [-1,1].
    video = (2.0 * frames - 1.0).permute(3, 0, 1, 2)[None].to(model.device)
    mask = torch.clamp(((2.0 * masks - 1.0) + 1) / 2, min=0, max=1)[None, None].to(model.device)
    references = []
    if inputs.reference_images is not None:
        references = _reference_canvases(model, inputs.reference_images, inputs.height, inputs.width)

    model.activate("vae")
    # Reference images are encoded in the same call, so they are tiled too when their frames exceed a tile.
    with vae_tiling(model, tiling, inputs.length, inputs.height, inputs.width, free_bytes, encode=True):
        latents = pipeline.prepare_video_latents(video, mask, [references], None, model.device)
    packed_mask = pipeline.prepare_masks(mask, [references], None)
    conditioning_latents = torch.cat([latents, packed_mask], dim=1).to(model.transformer_dtype)
    scale = torch.tensor([float(inputs.strength)] * len(model.vace_layers))
    return VACEConditioning(
        prompt_embeds=prompt_embeds,
        negative_prompt_embeds=negative_prompt_embeds,
        conditioning_latents=conditioning_latents,
        conditioning_scale=scale.to(device=model.device, dtype=model.transformer_dtype),
        num_reference_images=len(references),
        width=inputs.width,
        height=inputs.height,
        length=inputs.length,
        vace_start_percent=float(inputs.vace_start_percent),
        vace_end_percent=float(inputs.vace_end_percent),
    )
