"""Input declarations the nodes share: numbers with their range, and the video's size."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core.validation import nan_refusing_min

# The video size widgets' ranges, checked again in validate_inputs (whose arguments skip ComfyUI's range check).
SIZE_RANGE = (16, 4096)
LENGTH_RANGE = (1, 1025)
MODEL_SHIFT = 0.0  # a shift of 0 means the model's own


def float_input(
    name: str, default: float, bounds: tuple[float, float], step: float | None, tooltip: str, **options
) -> io.Float.Input:
    """A FLOAT widget whose range ComfyUI checks, NaN included (`nan_refusing_min`)."""
    low, high = bounds
    return io.Float.Input(
        name, default=default, min=nan_refusing_min(low), max=high, step=step, tooltip=tooltip, **options
    )


def fraction_input(name: str, default: float, tooltip: str, **options) -> io.Float.Input:
    """A FLOAT widget from 0 to 1 in steps of 0.01 (a share of the steps, a weight)."""
    return float_input(name, default, (0.0, 1.0), 0.01, tooltip, **options)


def int_input(name: str, default: int, bounds: tuple[int, int], tooltip: str, **options) -> io.Int.Input:
    """An INT widget from `bounds[0]` to `bounds[1]`."""
    low, high = bounds
    return io.Int.Input(name, default=default, min=low, max=high, tooltip=tooltip, **options)


def video_size_inputs(tooltip_end: str = "") -> list[io.Int.Input]:
    """`width`, `height` (multiples of 16) and `length` (4n+1 frames), as WanVACE Conditioning takes them; each
    tooltip ends with `tooltip_end`."""
    return [
        int_input("width", 832, SIZE_RANGE, f"Video width in pixels, a multiple of 16{tooltip_end}.", step=16),
        int_input("height", 480, SIZE_RANGE, f"Video height in pixels, a multiple of 16{tooltip_end}.", step=16),
        int_input("length", 81, LENGTH_RANGE, f"Number of frames, 4n+1 (81 = 5 s at 16 fps){tooltip_end}.", step=4),
    ]


def shift_input(step: float) -> io.Float.Input:
    """The flow-matching sigma shift, 0 for the model's own."""
    return float_input(
        "shift",
        MODEL_SHIFT,
        (0.0, 100.0),
        step,
        "Flow-matching sigma shift; 0 uses the model's (3.0).",
        display_name="shift (0 = model's)",
    )
