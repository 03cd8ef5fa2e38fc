"""The VACE tasks as test inputs: ComfyUI-shaped inputs for us, full-length inputs for diffusers.

Frames are synthetic uint8 images, so the float tensors ComfyUI would hold (uint8 / 255) and the
PIL images or float arrays diffusers takes describe exactly the same pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import PIL.Image
import torch

if TYPE_CHECKING:
    from wanvace_core import VACEInputs

WIDTH, HEIGHT, LENGTH = 64, 48, 9
PROMPT = "a bird flies over the sea at sunset"
NEGATIVE = "low quality, blurry, static"
LONG = 33  # video frames: 9 latent frames, so a 17-frame window (5 latent) overlapping 8 (2) gives 3 windows
TASKS = ("t2v", "i2v", "flf2v", "r2v", "v2v", "inpaint", "outpaint", "extension")


@dataclass
class TaskCase:
    ours: dict = field(default_factory=dict)
    theirs: dict = field(default_factory=dict)


def _frames(count: int, seed: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    generator = np.random.default_rng(seed)
    base = generator.integers(0, 256, size=(1, height, width, 3))
    drift = np.arange(count)[:, None, None, None] * 9
    return ((base + drift) % 256).astype(np.uint8)


def _as_comfy(frames: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(frames.astype(np.float32) / 255.0)


def _float_frames(frames: torch.Tensor) -> list[np.ndarray]:
    # One [frames, H, W, 3] float array: diffusers' list-of-videos form for numpy input.
    return [frames.numpy()]


def _mask_frames(masks: torch.Tensor) -> list[np.ndarray]:
    return [np.repeat(masks.numpy()[..., None], 3, axis=-1)]


def _grey(count: int) -> torch.Tensor:
    return torch.full((count, HEIGHT, WIDTH, 3), 0.5)


def build_task(name: str) -> TaskCase:
    """Inputs for one VACE task."""
    ones = torch.ones(1, HEIGHT, WIDTH)
    zeros = torch.zeros(1, HEIGHT, WIDTH)
    if name == "t2v":
        return TaskCase()
    if name == "i2v":
        first = _as_comfy(_frames(1, seed=1))
        video = torch.cat([first, _grey(LENGTH - 1)])
        mask = torch.cat([zeros, ones.expand(LENGTH - 1, -1, -1)])
        return TaskCase(
            ours={"control_video": first, "control_masks": zeros},
            theirs={"video": _float_frames(video), "mask": _mask_frames(mask)},
        )
    if name == "flf2v":
        first, last = _as_comfy(_frames(1, seed=2)), _as_comfy(_frames(1, seed=3))
        video = torch.cat([first, _grey(LENGTH - 2), last])
        mask = torch.cat([zeros, ones.expand(LENGTH - 2, -1, -1), zeros])
        return TaskCase(
            ours={"control_video": video, "control_masks": mask},
            theirs={"video": _float_frames(video), "mask": _mask_frames(mask)},
        )
    if name == "r2v":
        refs = [_frames(1, seed=4, height=32, width=48)[0], _frames(1, seed=5, height=32, width=48)[0]]
        return TaskCase(
            ours={"reference_images": _as_comfy(np.stack(refs))},
            theirs={"reference_images": [PIL.Image.fromarray(ref) for ref in refs]},
        )
    if name == "v2v":
        control = _as_comfy(_frames(LENGTH, seed=6))
        return TaskCase(ours={"control_video": control}, theirs={"video": _float_frames(control)})
    if name == "inpaint":
        source = _as_comfy(_frames(LENGTH, seed=7))
        mask = zeros.clone()
        mask[:, 16:40, 16:48] = 1.0
        return TaskCase(
            ours={"control_video": source, "control_masks": mask},
            theirs={"video": _float_frames(source), "mask": _mask_frames(mask.expand(LENGTH, -1, -1))},
        )
    if name == "outpaint":
        source = _as_comfy(_frames(LENGTH, seed=8))
        mask = ones.clone()
        mask[:, 8:40, 16:48] = 0.0
        padded = torch.where(mask[..., None].bool(), torch.tensor(0.5), source)
        return TaskCase(
            ours={"control_video": padded, "control_masks": mask},
            theirs={"video": _float_frames(padded), "mask": _mask_frames(mask.expand(LENGTH, -1, -1))},
        )
    if name == "extension":
        given = _as_comfy(_frames(3, seed=9))
        video = torch.cat([given, _grey(LENGTH - 3)])
        mask = torch.cat([zeros.expand(3, -1, -1), ones.expand(LENGTH - 3, -1, -1)])
        return TaskCase(
            ours={"control_video": given, "control_masks": zeros},
            theirs={"video": _float_frames(video), "mask": _mask_frames(mask)},
        )
    raise KeyError(name)


def expert_inputs(expert, frames: int = 3, height: int = 6, width: int = 8) -> dict:
    """Random inputs for one expert call on a `frames x height x width` latent video (the same on every rank)."""
    generator = torch.Generator().manual_seed(11)
    config = expert.config
    return {
        "hidden_states": torch.randn(1, config.in_channels, frames, height, width, generator=generator),
        "timestep": torch.tensor([700]),
        "encoder_hidden_states": torch.randn(1, 512, config.text_dim, generator=generator),
        "control_hidden_states": torch.randn(1, config.vace_in_channels, frames, height, width, generator=generator),
        "control_hidden_states_scale": torch.tensor([1.0, 0.7]),
        "return_dict": False,
    }


def long_inputs(task: str) -> VACEInputs:
    """A LONG-frame video task for the context-window tests: t2v, r2v (two references), v2v or inpaint."""
    from wanvace_core import VACEInputs

    generator = torch.Generator().manual_seed(9)
    video = torch.rand(LONG, HEIGHT, WIDTH, 3, generator=generator)
    fields = {}
    if task in ("v2v", "inpaint"):
        fields["control_video"] = video
    if task == "inpaint":
        masks = torch.zeros(LONG, HEIGHT, WIDTH)
        masks[:, 8:32, 16:48] = 1.0
        fields["control_masks"] = masks
    if task == "r2v":
        fields["reference_images"] = torch.rand(2, 32, 48, 3, generator=generator)
    return VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LONG, **fields)


def lossless_video(frames: int, seed: int, width: int = WIDTH, height: int = HEIGHT) -> bytes:
    """A PNG-coded MOV of random frames (rgb24, lossless), which both ComfyUI versions and the offline command read
    as the same 8-bit RGB over 255."""
    import io

    import av

    buffer = io.BytesIO()
    generator = np.random.default_rng(seed)
    with av.open(buffer, "w", format="mov") as container:
        stream = container.add_stream("png", rate=16)
        stream.width, stream.height, stream.pix_fmt = width, height, "rgb24"
        for _ in range(frames):
            pixels = generator.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()
