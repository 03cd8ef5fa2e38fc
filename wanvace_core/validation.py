"""Checks shared by the core's settings and the nodes. Each refusal names the argument, the value and the fix."""

from __future__ import annotations

import math
import numbers

from .errors import WanVACEInputError


def validate_finite(name: str, value: object, fix: str) -> float:
    """`value` as a float; a non-number, NaN or +-inf raises `WanVACEInputError` naming `name`.

    Range checks alone let NaN through (every comparison with NaN is false), so call this first.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise WanVACEInputError(f"{name}={value!r} is not a number; {fix}.")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise WanVACEInputError(f"{name}={value} is not a finite number; {fix}.")
    return number


def validate_integer(name: str, value: object, fix: str) -> int:
    """`value` as an int; anything else (a float, NaN, a bool) raises `WanVACEInputError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise WanVACEInputError(f"{name}={value!r} is not an integer; {fix}.")
    return int(value)


class _NaNRefusingMin(float):
    """A lower bound that NaN fails too: `nan < bound` is True, every other comparison is a float's."""

    __slots__ = ()

    def __gt__(self, other: object) -> bool:
        if isinstance(other, float) and math.isnan(other):
            return True
        return float.__gt__(self, other)


def nan_refusing_min(bound: float) -> float:
    """`bound` for a ComfyUI FLOAT input's `min`, such that ComfyUI's own range check also refuses NaN.

    ComfyUI checks a widget value with `value < min` and `value > max` (execution.py `validate_inputs`);
    NaN compares false with everything, so a plain float `min` lets it through to `execute`. For
    `nan < bound` Python calls the reflected `bound.__gt__(nan)` first because `bound` is a float
    subclass, and that answers True, so ComfyUI refuses the prompt with one error under that input
    (`value_smaller_than_min`). +-inf already fail `min`/`max`. The bound is a plain float everywhere
    else (arithmetic, JSON in /object_info).
    """
    return _NaNRefusingMin(bound)


def validate_range(name: str, value: float, low: float, high: float) -> None:
    """Refuses `value` outside [low, high], naming `name` (a node input whose widget range ComfyUI does not check
    itself, because the node's `validate_inputs` takes it)."""
    if not low <= value <= high:
        raise WanVACEInputError(f"{name}={value} is outside its range {low} to {high}; choose a value within it.")
