"""A shipped workflow shrunk to the tiny random-weight model (`wanvace_core.load.tiny`), so it runs in seconds on a
CPU: the demo's run and the integration tests' prompts."""

from __future__ import annotations

import copy

from .catalog import (
    CONTEXT_WINDOWS,
    EXTENSION_GIVEN_FRAMES,
    HEIGHT,
    LENGTH,
    LONG_LENGTH,
    OUTPAINT_PAD,
    REAL_MODEL,
    STEPS,
    TINY_MODEL,
    WIDTH,
)

# Widget values that scale with the video size, and what they become for the tiny model.
_TINY_VALUES = {
    "model_name": {REAL_MODEL: TINY_MODEL},
    "width": {WIDTH: 64},
    "height": {HEIGHT: 48},
    "length": {LENGTH: 9, EXTENSION_GIVEN_FRAMES: 5, LONG_LENGTH: 33},
    "context_length": {CONTEXT_WINDOWS["context_length"]: 17},
    "context_overlap": {CONTEXT_WINDOWS["context_overlap"]: 8},
    "steps": {STEPS: 4},
    "left": {OUTPAINT_PAD: 16},
    "right": {OUTPAINT_PAD: 16},
}


def for_tiny_model(workflow: dict, **overrides) -> dict:
    """A copy of `workflow` sized for the tiny test model; `overrides` set inputs by name on every node."""
    shrunk = copy.deepcopy(workflow)
    for node in shrunk.values():
        for name, value in list(node["inputs"].items()):
            if isinstance(value, list):
                continue
            mapping = _TINY_VALUES.get(name, {})
            if value in mapping:
                node["inputs"][name] = mapping[value]
            if name in overrides:
                node["inputs"][name] = overrides[name]
    return shrunk
