"""Spatially tiled VAE decode and encode through diffusers' own `AutoencoderKLWan` tiling.

diffusers' Wan VAE already works in time chunks in both its plain and tiled paths (diffusers 0.36 to
0.42, `AutoencoderKLWan._encode` / `_decode` / `tiled_encode` / `tiled_decode`): the decoder runs one
latent frame (4 video frames) at a time and the encoder one 4-frame chunk at a time, each with a causal
feature cache, and neither exposes a chunk size. So memory grows with the frame size, not the length,
and tiling is spatial only: `tile_size` is diffusers' `tile_sample_min_height/width` and
`tile_size - overlap` its `tile_sample_stride_height/width`, both in pixels. diffusers splits only a
frame larger than one tile; tiles overlap by `overlap` pixels and are blended linearly across it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import WanVACEInputError
from . import budget

logger = logging.getLogger(__name__)

TILING_MODES = ("auto", "on", "off")
# The Wan 2.1 VAE's spatial stride: diffusers divides tile sizes and strides by it to get latent tiles,
# so a tile or overlap that is not a multiple would put the pixel and latent tile grids out of step.
SPATIAL_STRIDE = 8
MIN_TILE_SIZE = 2 * SPATIAL_STRIDE
# The VAE attributes `enable_tiling` sets; saved and put back exactly after a tiled run.
_TILING_STATE = (
    "use_tiling",
    "tile_sample_min_height",
    "tile_sample_min_width",
    "tile_sample_stride_height",
    "tile_sample_stride_width",
)
_GIB = 2**30


@dataclass(frozen=True)
class VAETiling:
    """How the VAE splits frames: `mode` "auto" (tiled only when the untiled peak would not fit the free
    device memory), "on" or "off"; `tile_size` and `overlap` in pixels."""

    mode: str = "auto"
    tile_size: int = 256
    overlap: int = 64

    def __post_init__(self) -> None:
        if self.mode not in TILING_MODES:
            raise WanVACEInputError(
                f"tiled={self.mode!r} is not a tiling mode; choose one of {', '.join(TILING_MODES)}."
            )
        for name, value in (("tile_size", self.tile_size), ("tile_overlap", self.overlap)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise WanVACEInputError(f"{name}={value!r} is not a whole number of pixels; use a multiple of 8.")
            if value % SPATIAL_STRIDE:
                nearest = max(0, round(value / SPATIAL_STRIDE) * SPATIAL_STRIDE)
                raise WanVACEInputError(
                    f"{name}={value} is not a multiple of the VAE's stride {SPATIAL_STRIDE} pixels; use {nearest}."
                )
        if self.tile_size < MIN_TILE_SIZE:
            raise WanVACEInputError(
                f"tile_size={self.tile_size} is below {MIN_TILE_SIZE} pixels (two latent pixels); use 256."
            )
        if not 0 <= self.overlap < self.tile_size:
            raise WanVACEInputError(
                f"tile_overlap={self.overlap} must be at least 0 and below tile_size={self.tile_size}; "
                f"use {min(64, self.tile_size // 4 // SPATIAL_STRIDE * SPATIAL_STRIDE)}."
            )

    @property
    def stride(self) -> int:
        """Pixels from one tile's start to the next one's (diffusers' `tile_sample_stride_*`)."""
        return self.tile_size - self.overlap


def untiled_peak_bytes(model, frames: int, height: int, width: int, *, encode: bool) -> int:
    """Estimated device bytes of an untiled VAE pass (`frames`: of the VAE's input, latent frames for a decode)."""
    if encode:
        return budget.vae_encode_peak_bytes(model, frames, height, width)
    return budget.vae_decode_peak_bytes(model, frames, height, width)


def tiled_peak_bytes(model, tiling: VAETiling, frames: int, height: int, width: int, *, encode: bool) -> int:
    """Estimated device bytes of the same pass tiled with `tiling`'s tile size and overlap."""
    if encode:
        return budget.vae_tiled_encode_peak_bytes(model, frames, height, width, tiling.tile_size, tiling.overlap)
    return budget.vae_tiled_decode_peak_bytes(model, frames, height, width, tiling.tile_size, tiling.overlap)


def _check_vae(vae) -> None:
    ratio = getattr(vae, "spatial_compression_ratio", None)
    if not hasattr(vae, "enable_tiling") or ratio is None:
        raise WanVACEInputError(
            f"the pipeline's VAE ({type(vae).__name__}) has no diffusers tiling; set tiled to off, or load a Wan 2.1 "
            "VAE (AutoencoderKLWan)."
        )
    if SPATIAL_STRIDE % ratio:
        raise WanVACEInputError(
            f"the pipeline's VAE has spatial stride {ratio}, which tiles of multiples of {SPATIAL_STRIDE} pixels do "
            "not fit; set tiled to off."
        )


def _should_tile(model, tiling: VAETiling, frames, height, width, free_bytes, encode: bool) -> bool:
    what = f"VAE {'encode' if encode else 'decode'} of {frames} {'' if encode else 'latent '}frames at {width}x{height}"
    if tiling.mode != "auto":
        logger.info("WanVACE %s: tiled=%s", what, tiling.mode)
        return tiling.mode == "on"
    untiled = untiled_peak_bytes(model, frames, height, width, encode=encode)
    if free_bytes is None:
        logger.info("WanVACE %s: untiled (tiled=auto, free device memory unknown; ~%.2f GiB)", what, untiled / _GIB)
        return False
    if untiled <= free_bytes:
        logger.info(
            "WanVACE %s: untiled (tiled=auto; needs ~%.2f GiB, %.2f GiB free)", what, untiled / _GIB, free_bytes / _GIB
        )
        return False
    tiled = tiled_peak_bytes(model, tiling, frames, height, width, encode=encode)
    log = logger.warning if tiled > free_bytes else logger.info
    log(
        "WanVACE %s: tiled, %d px tiles overlapping %d px (tiled=auto; untiled needs ~%.2f GiB, %.2f GiB free, tiled "
        "~%.2f GiB%s)",
        what,
        tiling.tile_size,
        tiling.overlap,
        untiled / _GIB,
        free_bytes / _GIB,
        tiled / _GIB,
        "; it may still run out of memory: lower tile_size or free device memory" if tiled > free_bytes else "",
    )
    return True


def requested_peak_bytes(model, tiling: VAETiling | None, frames: int, height: int, width: int, *, encode: bool) -> int:
    """The VAE pass's peak to ask the device for: the tiled one when tiling is on, else the untiled one
    ("auto" asks room for the untiled pass and tiles only if, after that, it still does not fit)."""
    if tiling is not None and tiling.mode == "on":
        return tiled_peak_bytes(model, tiling, frames, height, width, encode=encode)
    return untiled_peak_bytes(model, frames, height, width, encode=encode)


@contextmanager
def vae_tiling(
    model, tiling: VAETiling | None, frames: int, height: int, width: int, free_bytes: int | None, *, encode: bool
) -> Iterator[bool]:
    """Sets diffusers' tiling of `model.vae` for the `with` block and puts the VAE's own setting back after.

    `frames` counts the VAE's input (latent frames for a decode, video frames for an encode); `height` and
    `width` are pixels. `tiling` None leaves the VAE as it is; "off" turns tiling off even if the VAE had it on.
    `free_bytes` is the device memory free for the pass ("auto" with None: untiled). Yields whether it tiles.
    """
    if tiling is None:
        yield bool(getattr(model.vae, "use_tiling", False))
        return
    vae = model.vae
    tile = _should_tile(model, tiling, frames, height, width, free_bytes, encode)
    if tile:
        _check_vae(vae)
    saved = {name: getattr(vae, name) for name in _TILING_STATE if hasattr(vae, name)}
    try:
        if tile:
            vae.enable_tiling(
                tile_sample_min_height=tiling.tile_size,
                tile_sample_min_width=tiling.tile_size,
                tile_sample_stride_height=tiling.stride,
                tile_sample_stride_width=tiling.stride,
            )
        elif saved.get("use_tiling"):
            vae.disable_tiling()
        yield tile
    finally:
        for name, value in saved.items():
            setattr(vae, name, value)
