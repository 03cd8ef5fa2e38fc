"""Context windows: which latent frames each window denoises at a step, and how the windows' predictions are fused.

A video longer than one window is denoised as overlapping windows at every step; each frame's prediction is the
weighted mean of the windows that hold it. The options are in video frames, as users count them: `context_length`
4n+1 (n+1 latent frames: Wan's VAE keeps the first frame alone and packs each 4 after it into one latent frame) and
`context_overlap` a multiple of 4 (overlap / 4 latent frames).

The window index lists equal those of ComfyUI's `comfy.context_windows` for the same settings (its schedules
`standard_static`, `standard_uniform`, `looped_uniform`; tests/test_windows.py runs ComfyUI's own functions as the
oracle). Deliberate differences:
- the fused prediction is the sum of each window's prediction times its weight divided by the frame's weight total,
  where ComfyUI divides the weighted sum by the total at the end: so a window that covers the whole video gives back
  its prediction bit for bit (weight / total is exactly 1), which the windowless run must equal;
- `overlap-linear` with `context_overlap` 0 ramps nothing (ComfyUI fails on it);
- `looped_uniform` over a video exactly one window long is that one window, as the other schedules give; ComfyUI
  rotates it by a step-dependent offset (the last frames first), which no longer equals the windowless run;
- settings that would leave a frame in no window are refused up front.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import WanVACEInputError
from ..validation import validate_integer

SCHEDULES = ("standard_static", "standard_uniform", "looped_uniform")
FUSE_METHODS = ("pyramid", "flat", "overlap-linear")
VAE_FRAMES_PER_LATENT = 4
# A ramp's end weight: never 0, so that a frame that only one window's ramp end reaches still has a weight total.
_RAMP_END = 1e-37


@dataclass(frozen=True)
class ContextWindowOptions:
    """Context-window settings, in video frames. Validated once."""

    context_length: int = 81
    context_overlap: int = 16
    schedule: str = "standard_static"
    context_stride: int = 1
    closed_loop: bool = False
    fuse_method: str = "pyramid"
    freenoise: bool = True

    def __post_init__(self) -> None:
        length = validate_integer("context_length", self.context_length, "use 4n+1 video frames, e.g. 81")
        if length < 5 or (length - 1) % VAE_FRAMES_PER_LATENT:
            lower = max(1, (length - 1) // VAE_FRAMES_PER_LATENT * VAE_FRAMES_PER_LATENT + 1)
            raise WanVACEInputError(
                f"context_length={length} must be 4n+1 video frames and at least 5 (one latent frame is the first "
                f"video frame, each next one 4 frames); use {max(lower, 5)} or {max(lower, 1) + 4}."
            )
        overlap = validate_integer("context_overlap", self.context_overlap, "use a multiple of 4 video frames")
        if overlap < 0 or overlap % VAE_FRAMES_PER_LATENT:
            raise WanVACEInputError(
                f"context_overlap={overlap} must be a multiple of 4 video frames (4 per latent frame), 0 or more; "
                f"use {max(0, overlap // VAE_FRAMES_PER_LATENT * VAE_FRAMES_PER_LATENT)}."
            )
        if overlap >= length - 1:
            raise WanVACEInputError(
                f"context_overlap={overlap} must be less than context_length - 1 ({length - 1}) so that each window "
                f"moves on; use at most {length - 1 - VAE_FRAMES_PER_LATENT}."
            )
        stride = validate_integer("context_stride", self.context_stride, "use 1, or more for the uniform schedules")
        if stride < 1:
            raise WanVACEInputError(f"context_stride={stride} must be 1 or more; 1 is the usual choice.")
        if self.schedule not in SCHEDULES:
            raise WanVACEInputError(f"schedule={self.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}.")
        if self.fuse_method not in FUSE_METHODS:
            raise WanVACEInputError(
                f"fuse_method={self.fuse_method!r} is unknown; choose one of {', '.join(FUSE_METHODS)}."
            )

    @property
    def latent_length(self) -> int:
        return (self.context_length - 1) // VAE_FRAMES_PER_LATENT + 1

    @property
    def latent_overlap(self) -> int:
        return self.context_overlap // VAE_FRAMES_PER_LATENT


def check_schedule_with_cache(schedule: str) -> None:
    """Step caching needs windows that stay put: each window reuses residuals of its own earlier steps."""
    if schedule != "standard_static":
        raise WanVACEInputError(
            f"schedule={schedule!r}: the cache needs context windows with schedule standard_static, not {schedule!r}: "
            "the uniform schedules move the windows every step, so no window has a step before it whose residuals it "
            "could reuse. Set schedule to standard_static, or disconnect the cache input of the sampler."
        )


def frames_per_call(windows: ContextWindowOptions | None, latent_frames: int, references: int) -> int:
    """Latent frames one expert call sees: the whole video, or with `windows` one window and the reference frames
    in front of it (what the activation estimate and the Ulysses split are sized by)."""
    return latent_frames if windows is None else min(latent_frames, references + windows.latent_length)


def _van_der_corput(step: int) -> float:
    """`step`'s 64 bits mirrored, as a fraction of 2**64: 0, 1/2, 1/4, 3/4, 1/8, ... for steps 0, 1, 2, 3, 4, ...
    The uniform schedules start their windows at this fraction of the video, so successive steps put the window
    seams in different places."""
    mirrored = 0
    for bit in range(64):
        if step >> bit & 1:
            mirrored |= 1 << (63 - bit)
    return mirrored / 2**64


def _uniform_windows(options: ContextWindowOptions, frames: int, step: int, loop_back: bool) -> list[list[int]]:
    """Windows at a step-dependent offset, wrapping past the last frame to the first; with `context_stride` > 1
    also windows over every 2nd, 4th, ... frame."""
    length, overlap = options.latent_length, options.latent_overlap
    levels = min(options.context_stride, math.ceil(math.log2(frames / length)) + 1)
    offset = _van_der_corput(step)
    pad = round(frames * offset)
    end = frames + pad - (0 if loop_back else overlap)
    windows = []
    for level in range(levels):
        spacing = 1 << level
        first = int(offset * spacing) + pad
        for start in range(first, end, length * spacing - overlap):
            windows.append([index % frames for index in range(start, start + length * spacing, spacing)])
    return windows


def _wraps_at(window: list[int]) -> int | None:
    """The position where a window's frames go back to an earlier frame (it wrapped past the end), or None."""
    for position in range(1, len(window)):
        if window[position] < window[position - 1]:
            return position
    return None


def _moved_to_the_end(window: list[int], frames: int) -> list[int]:
    """The window's frame pattern, relative to its first frame, moved so that it ends on the last frame."""
    relative = [(index - window[0]) % frames for index in window]
    shift = frames - 1 - relative[-1]
    return [index + shift for index in relative]


def _standard_uniform(options: ContextWindowOptions, frames: int, step: int) -> list[list[int]]:
    windows = _uniform_windows(options, frames, step, loop_back=False)
    position = 0
    while position < len(windows):
        wrap = _wraps_at(windows[position])
        if wrap is not None:
            wrapped_to = windows[position][wrap]
            windows[position] = _moved_to_the_end(windows[position], frames)
            if wrapped_to not in windows[(position + 1) % len(windows)]:
                windows.insert(position + 1, list(range(wrapped_to, wrapped_to + options.latent_length)))
        position += 1
    unique = []
    for window in windows:
        if window not in unique:
            unique.append(window)
    return unique


def _standard_static(options: ContextWindowOptions, frames: int) -> list[list[int]]:
    length, step_by = options.latent_length, options.latent_length - options.latent_overlap
    windows = []
    for start in range(0, frames, step_by):
        if start + length >= frames:
            windows.append(list(range(frames - length, frames)))
            break
        windows.append(list(range(start, start + length)))
    return windows


def window_frames(options: ContextWindowOptions, frames: int, step: int) -> list[list[int]]:
    """The latent frame indices of each window at sampling step `step` (0 first), for a video of `frames` latent
    frames. A video no longer than one window is one window."""
    if frames <= options.latent_length:
        return [list(range(frames))]
    if options.schedule == "standard_static":
        windows = _standard_static(options, frames)
    elif options.schedule == "standard_uniform":
        windows = _standard_uniform(options, frames, step)
    else:
        windows = _uniform_windows(options, frames, step, loop_back=options.closed_loop)
    uncovered = sorted(set(range(frames)) - {index for window in windows for index in window})
    if uncovered:
        raise WanVACEInputError(
            f"the context windows ({options.schedule}, context_length {options.context_length}, context_overlap "
            f"{options.context_overlap}, context_stride {options.context_stride}) leave latent frames {uncovered[:8]} "
            f"of {frames} in no window at step {step}; "
            + ("use context_stride 1, " if options.context_stride > 1 else "")
            + "raise context_overlap or use the standard_static schedule."
        )
    return windows


def check_windows(options: ContextWindowOptions, frames: int, steps: int) -> None:
    """Refuses, before sampling starts, settings that would leave a latent frame in no window at any of the
    `steps` steps (the uniform schedules move their windows every step)."""
    for step in range(1 if options.schedule == "standard_static" else steps):
        window_frames(options, frames, step)


def window_weights(options: ContextWindowOptions, window: list[int], frames: int) -> torch.Tensor:
    """The fuse method's weight of each of the window's frames (before normalising over the windows), float32."""
    length = len(window)
    if options.fuse_method == "flat":
        return torch.ones(length)
    if options.fuse_method == "pyramid":
        # Rising by 1 from each edge to the middle: frames near a window's edge count least.
        return torch.tensor([min(position + 1, length - position) for position in range(length)], dtype=torch.float32)
    weights = torch.ones(length)
    ramp = min(options.latent_overlap, length)
    if ramp:
        if min(window) > 0:  # not the first window: fade in over the overlap
            weights[:ramp] = torch.linspace(_RAMP_END, 1.0, ramp)
        if max(window) < frames - 1:  # not the last window: fade out over the overlap
            weights[length - ramp :] = torch.linspace(1.0, _RAMP_END, ramp)
    return weights


@dataclass(frozen=True)
class ContextWindow:
    """One window at one step: its latent frames, and each frame's share of the fused prediction."""

    frames: tuple[int, ...]
    shares: torch.Tensor  # per frame: the weight divided by that frame's total over the step's windows


def plan_windows(options: ContextWindowOptions, frames: int, step: int) -> list[ContextWindow]:
    """The step's windows with their shares; every frame's shares sum to 1 over the windows that hold it."""
    indices = window_frames(options, frames, step)
    weights = [window_weights(options, window, frames) for window in indices]
    totals = torch.zeros(frames)
    for window, weight in zip(indices, weights, strict=True):
        totals.index_add_(0, torch.tensor(window), weight)
    return [
        ContextWindow(tuple(window), weight / totals[torch.tensor(window)])
        for window, weight in zip(indices, weights, strict=True)
    ]


def freenoise(noise: torch.Tensor, options: ContextWindowOptions, seed: int, dim: int = 2) -> torch.Tensor:
    """FreeNoise: after the first window, each next `context_length - context_overlap` latent frames of the noise
    take the noise of frames shuffled from the stretch before them, so that overlapping windows start from related
    noise. In place, and returned; a seeded CPU generator of its own, so the sampler's noise is unchanged."""
    generator = torch.Generator("cpu").manual_seed(seed)
    length, step_by = options.latent_length, options.latent_length - options.latent_overlap
    frames = noise.shape[dim]
    for start in range(0, frames - length, step_by):
        target = start + length
        count = min(step_by, frames - target)
        if count <= 0:
            break
        sources = torch.randperm(count, generator=generator) + start
        noise.narrow(dim, target, count).copy_(noise.index_select(dim, sources.to(noise.device)))
    return noise


# The expert inputs with a time axis (dim 2 of [batch, channels, time, height, width]); the timestep and the
# per-layer VACE scale have none.
_TEMPORAL_INPUTS = ("hidden_states", "control_hidden_states")


def windowed_prediction(
    predict: Callable[[dict], torch.Tensor],
    inputs: dict,
    windows: list[ContextWindow],
    references: int,
    before_each: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """One step's prediction from context windows: `predict` (the step's guided expert call) runs on each window's
    slice of `inputs` (the latents and the VACE context alike, with the `references` reference frames in front of
    every window, as the whole video has them), and each video frame's prediction is the sum of the windows'
    predictions times their shares. The reference frames, which every window holds, take the windows' mean.
    `before_each` runs before every window with its position in `windows` (ComfyUI's cancel check, so that a cancel
    stops between windows, and the switch to the window's own cache state).

    Accumulated in fp32 and returned in the prediction's dtype; a single window of shares 1 returns its
    prediction bit for bit."""
    hidden = inputs["hidden_states"]
    device = hidden.device
    leading = torch.arange(references, device=device)
    fused, dtype = None, None
    for position, window in enumerate(windows):
        if before_each is not None:
            before_each(position)
        frames = torch.tensor(window.frames, device=device) + references
        keep = torch.cat([leading, frames])
        sliced = {
            name: value.index_select(2, keep) if name in _TEMPORAL_INPUTS and value is not None else value
            for name, value in inputs.items()
        }
        prediction = predict(sliced)
        if fused is None:
            fused = torch.zeros(prediction.shape[:2] + hidden.shape[2:], dtype=torch.float32, device=device)
            dtype = prediction.dtype
        shares = window.shares.to(device).view(1, 1, -1, 1, 1)
        fused.index_add_(2, frames, prediction[:, :, references:].float() * shares)
        if references:
            fused[:, :, :references] += prediction[:, :, :references].float() / len(windows)
    return fused.to(dtype)
