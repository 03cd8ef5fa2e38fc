"""The VAE tiling inputs shared by the nodes that run the VAE (WanVACEDecode; the control-video encode)."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core.generation.tiling import TILING_MODES, VAETiling
from ..wanvace_core.validation import validate_range
from .inputs import int_input
from .memory import free_device_memory

_DEFAULT = VAETiling()
# Optional, so that prompts saved before these inputs existed (API prompts carry no value for them, and
# ComfyUI refuses a missing required input) still run, with the defaults.
TILED, TILE_SIZE, TILE_OVERLAP = "tiled", "tile_size", "tile_overlap"
# The widgets' ranges, checked again in check_tiling_inputs (validate_inputs arguments skip ComfyUI's check).
TILE_SIZE_RANGE = (64, 4096)
TILE_OVERLAP_RANGE = (0, 4088)


def tiling_inputs(prefix: str = "") -> list[io.Input]:
    """The `tiled`, `tile_size` and `tile_overlap` inputs (each name prefixed with `prefix`)."""
    return [
        io.Combo.Input(
            prefix + TILED,
            options=list(TILING_MODES),
            default=_DEFAULT.mode,
            optional=True,
            tooltip="Run the VAE on overlapping tiles of each frame: auto when the untiled pass would not fit.",
        ),
        int_input(
            prefix + TILE_SIZE,
            _DEFAULT.tile_size,
            TILE_SIZE_RANGE,
            "Tile width and height in pixels, a multiple of 8; smaller needs less memory and takes longer.",
            step=8,
            optional=True,
        ),
        int_input(
            prefix + TILE_OVERLAP,
            _DEFAULT.overlap,
            TILE_OVERLAP_RANGE,
            "Pixels neighbouring tiles share, a multiple of 8 below tile_size; more hides seams.",
            step=8,
            optional=True,
        ),
    ]


def tiling_from_inputs(
    tiled: str = _DEFAULT.mode, tile_size: int = _DEFAULT.tile_size, tile_overlap: int = _DEFAULT.overlap
) -> VAETiling:
    """The node inputs as `VAETiling`; raises `WanVACEInputError` naming the input."""
    return VAETiling(mode=tiled, tile_size=tile_size, overlap=tile_overlap)


def check_tiling_inputs(tiled=None, tile_size=None, tile_overlap=None) -> None:
    """For a node's `validate_inputs`: raises `WanVACEInputError` naming the input.

    None is an input linked (its value unknown until the prompt runs) or left out: the other is checked against the
    value that refuses none of it (the largest tile, no overlap), not against the default; the node checks again when
    it runs."""
    tiling = tiling_from_inputs(
        _DEFAULT.mode if tiled is None else tiled,
        TILE_SIZE_RANGE[1] if tile_size is None else tile_size,
        TILE_OVERLAP_RANGE[0] if tile_overlap is None else tile_overlap,
    )
    validate_range(TILE_SIZE, tiling.tile_size, *TILE_SIZE_RANGE)
    validate_range(TILE_OVERLAP, tiling.overlap, *TILE_OVERLAP_RANGE)


def free_device_bytes(model) -> int:
    """What ComfyUI reports free on the model's device (for a GPU also the memory torch caches but does not use)."""
    return free_device_memory(model)
