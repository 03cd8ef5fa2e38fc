"""The VACE tasks as conditioning inputs: which frames are given, which are masked, for each mode.

The shipped workflows run these through their WanVACE Control Video, First/Last Frame and Outpaint Canvas nodes, so a
job given here and the same job queued through ComfyUI condition the model on the same pixels. The arrangements are
those ComfyUI's own nodes make (tests/integration/test_generate_server.py holds them to those): first/last-frame jobs
fill the frames between with `EmptyImage` grey (128/255) and mask them; outpainting pads with 0.5 grey as
`ImagePadForOutpaint` does; a single mask frame applies to every given frame. Images and videos arrive in
ComfyUI's layout (`[T, H, W, 3]`, `[0, 1]`); one of another size is centre-cropped to the output's aspect and resized
with antialiased bicubic interpolation (ComfyUI's ImageScale uses lanczos, so only same-size inputs are equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import WanVACEInputError

MODES = ("t2v", "i2v", "flf2v", "r2v", "v2v", "inpaint", "outpaint", "extension")
# What each mode takes besides the prompt (names as the command line and the videos API spell them).
MODE_INPUTS = {
    "t2v": (),
    "i2v": ("image",),
    "flf2v": ("image", "last_image"),
    "r2v": ("reference",),
    "v2v": ("video",),
    "inpaint": ("video", "mask"),
    "outpaint": ("video", "outpaint"),
    "extension": ("video",),
}
EMPTY_IMAGE_GREY = 128 / 255  # ComfyUI's EmptyImage colour 0x808080, as the first/last-frame workflow fills
OUTPAINT_GREY = 0.5


@dataclass(frozen=True)
class Outpaint:
    """Pixels of new canvas on each side of the source video; the output size is the padded size."""

    left: int = 0
    top: int = 0
    right: int = 0
    bottom: int = 0

    def __post_init__(self) -> None:
        for side in ("left", "top", "right", "bottom"):
            value = getattr(self, side)
            if not isinstance(value, int) or value < 0:
                raise WanVACEInputError(f"outpaint {side}={value!r} must be a whole number of pixels, 0 or more.")
        if not any((self.left, self.top, self.right, self.bottom)):
            raise WanVACEInputError("outpaint pads no side; give at least one of left, top, right, bottom in pixels.")


def fit(frames: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """`[T, H, W, 3]` frames centre-cropped to `width / height` and resized to it; unchanged when they match."""
    if frames.shape[1:3] == (height, width):
        return frames
    source_height, source_width = frames.shape[1:3]
    scale = max(width / source_width, height / source_height)
    crop_width, crop_height = round(width / scale), round(height / scale)
    top, left = (source_height - crop_height) // 2, (source_width - crop_width) // 2
    cropped = frames[:, top : top + crop_height, left : left + crop_width].permute(0, 3, 1, 2)
    resized = torch.nn.functional.interpolate(
        cropped.float(), size=(height, width), mode="bicubic", antialias=True, align_corners=False
    )
    return resized.clamp(0.0, 1.0).permute(0, 2, 3, 1)


def _one(name: str, value: torch.Tensor | None, mode: str) -> torch.Tensor:
    if value is None:
        raise WanVACEInputError(f"mode {mode} needs {name}; give it, or choose another mode ({', '.join(MODES)}).")
    return value


def task_inputs(
    mode: str,
    width: int,
    height: int,
    length: int,
    image: torch.Tensor | None = None,
    last_image: torch.Tensor | None = None,
    video: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    references: torch.Tensor | None = None,
    outpaint: Outpaint | None = None,
) -> dict:
    """The `VACEInputs` fields (`control_video`, `control_masks`, `reference_images`) of `mode`.

    `image` / `last_image` are `[1, H, W, 3]`, `video` `[T, H, W, 3]`, `mask` `[T or 1, H, W]` (1 = generate),
    `references` `[N, H, W, 3]`. Inputs the mode does not use are refused, so that a job is never silently run
    as another task. `width` / `height` are the output's; for outpainting the source is fitted inside the padding.
    """
    if mode not in MODES:
        raise WanVACEInputError(f"mode={mode!r} is unknown; choose one of {', '.join(MODES)}.")
    given = {
        "image": image,
        "last_image": last_image,
        "video": video,
        "mask": mask,
        "reference": references,
        "outpaint": outpaint,
    }
    unused = [name for name, value in given.items() if value is not None and name not in MODE_INPUTS[mode]]
    if unused:
        raise WanVACEInputError(
            f"mode {mode} does not use {', '.join(unused)}; leave it out, or choose the mode that takes it "
            + "("
            + "; ".join(f"{name}: {', '.join(m for m in MODES if name in MODE_INPUTS[m])}" for name in unused)
            + ")."
        )
    if mode == "t2v":
        return {}
    if mode == "i2v":
        first = fit(_one("image", image, mode)[:1], width, height)
        return {"control_video": first, "control_masks": torch.zeros(1, height, width)}
    if mode == "flf2v":
        first = fit(_one("image", image, mode)[:1], width, height)
        last = fit(_one("last_image", last_image, mode)[:1], width, height)
        if length < 3:
            raise WanVACEInputError(f"length={length}: a first and a last frame need at least 5 frames; use 81.")
        middle = torch.full((length - 2, height, width, 3), EMPTY_IMAGE_GREY)
        masks = torch.ones(length, height, width)
        masks[0] = masks[-1] = 0.0
        return {"control_video": torch.cat([first, middle, last]), "control_masks": masks}
    if mode == "r2v":
        return {"reference_images": _one("reference", references, mode)}
    frames = _one("video", video, mode)[:length]
    if mode == "v2v":
        return {"control_video": fit(frames, width, height)}
    if mode == "inpaint":
        masks = _one("mask", mask, mode)
        fitted = fit(masks[..., None].expand(*masks.shape, 3), width, height)[..., 0]
        return {"control_video": fit(frames, width, height), "control_masks": fitted[: len(frames)]}
    if mode == "extension":
        return {"control_video": fit(frames, width, height), "control_masks": torch.zeros(1, height, width)}
    pad = _one("outpaint", outpaint, mode)
    inner_width, inner_height = width - pad.left - pad.right, height - pad.top - pad.bottom
    if inner_width < 16 or inner_height < 16:
        raise WanVACEInputError(
            f"outpaint padding ({pad.left}, {pad.top}, {pad.right}, {pad.bottom}) leaves {inner_width}x{inner_height} "
            f"of the {width}x{height} output for the source video; pad less or raise width and height."
        )
    inner = fit(frames, inner_width, inner_height)
    canvas = torch.full((len(inner), height, width, 3), OUTPAINT_GREY)
    canvas[:, pad.top : pad.top + inner_height, pad.left : pad.left + inner_width] = inner
    masks = torch.ones(len(inner), height, width)
    masks[:, pad.top : pad.top + inner_height, pad.left : pad.left + inner_width] = 0.0
    return {"control_video": canvas, "control_masks": masks}
