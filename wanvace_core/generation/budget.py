"""Device memory the work (not the weights) needs: what ComfyUI is told as `memory_required`.

An estimate, from the shapes alone: one transformer block's live activations at the token count of
the run (hidden state, q/k/v and attention output, the FFN's inner activation, the VACE hint and
control state, and the fp32 norm temporaries). Attention itself runs fused (SDPA), so no
tokens x tokens matrix is counted.
"""

from __future__ import annotations

from ..errors import WanVACEInputError
from ..load.loaded import EXPERT_NAMES
from ..runtime.model import WanVACEModel


def sampling_activation_bytes(model: WanVACEModel, latent_frames: int, height: int, width: int) -> int:
    """Peak activation bytes of one expert forward on a latent of `latent_frames` x `height` x `width` pixels."""
    config = model.reference_expert.config
    patch_t, patch_h, patch_w = config.patch_size
    stride = model.helper.vae_scale_factor_spatial
    tokens = (latent_frames // patch_t) * (height // stride // patch_h) * (width // stride // patch_w)
    dim = config.num_attention_heads * config.attention_head_dim
    itemsize = model.transformer_dtype.itemsize
    # The peak is in one of two phases of a block. Attention: hidden, q, k, v, attention out, the VACE hint, the
    # control state and the VACE input every VACE block reads (8 x dim), with three fp32 norm temporaries. FFN:
    # the same residents less q, k, v (7 x dim, counting the FFN's input) and two FFN-sized tensors (the linear's
    # output and GELU's). Plus the rotary cos/sin tables, fp32, per token. Checked in tests/test_budget.py.
    attention_phase = 8 * dim * itemsize + 3 * dim * 4
    ffn_phase = (7 * dim + 2 * config.ffn_dim) * itemsize
    return tokens * (max(attention_phase, ffn_phase) + 2 * config.attention_head_dim * 4)


BATCHED_CFG_MODES = ("off", "auto", "on")


def validate_batched_cfg(mode: str) -> None:
    if mode not in BATCHED_CFG_MODES:
        raise WanVACEInputError(f"batched_cfg={mode!r} is unknown; choose one of {', '.join(BATCHED_CFG_MODES)}.")


def batched_cfg_decision(model: WanVACEModel, mode: str, activation_bytes: int, free_bytes: int) -> tuple[bool, str]:
    """Whether to run both CFG passes as one batch-2 call, and why (for the log).

    `auto` batches when the device's free memory (`free_bytes`, as the host application reports it), less the
    larger expert unless its weights are already on the device, holds twice the activations of one call
    (`activation_bytes`, from `sampling_activation_bytes`). Experts in parallel workers are not measured here:
    `auto` keeps separate passes there.
    """
    validate_batched_cfg(mode)
    if mode != "auto":
        return mode == "on", f"batched_cfg={mode}"
    if model.remote is not None:
        return False, "batched_cfg=auto keeps separate passes with parallel workers (choose on to batch there)"
    experts = [name for name in EXPERT_NAMES if getattr(model, name) is not None]
    incoming = max(0, max(model.weight_bytes([name]) for name in experts) - model.device_bytes())
    needed = 2 * activation_bytes + incoming
    fits = free_bytes >= needed
    return fits, (
        f"batched_cfg=auto: {_gib(needed)} needed (twice the activations, plus {_gib(incoming)} of weights still to "
        f"move to the device), {_gib(free_bytes)} free"
    )


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


# --- The Wan VAE (AutoencoderKLWan) -------------------------------------------------------------------------
#
# Both directions run in time chunks (one latent frame = `chunk` video frames at a time, with a causal
# feature cache), so the activations grow with the frame area, not the length: per pixel, a multiple of
# (channels at full resolution x frames per chunk) elements, plus a fixed part. The multiples were fitted to
# the peak private memory of the real Wan 2.1 VAE architecture (AutoencoderKLWan() default config: 96
# channels at full resolution, 4-frame chunks; random weights, fp32, CPU, torch 2.11, 2 threads, allocator
# returning every freed block: the MALLOC_MMAP_THRESHOLD_ subprocess of bench/bench_vae_tiling.py), MiB above
# the process before the call:
#   decode, 2 latent frames:  64x64 107.6, 128x128 343.5 -> 20129 B = 5032 elements per pixel = 13.1 x 96 x 4
#                             (intercept 29 MiB); check: 3 latent frames 96x96 measured 211.8, fit 207.9.
#   encode, 5 video frames:   64x64  99.3, 128x128 243.0 -> 12262 B = 3065 elements per pixel = 8.0 x 96 x 4
#                             (intercept 51 MiB).
# The element counts are taken as dtype-independent (bf16 on a GPU: 2 bytes each). The copies of the whole
# clip are counted from the code, not fitted (they are under 1% of the fits above at those sizes).
_DECODE_ELEMENTS_PER_PIXEL = 13.1  # x full-resolution channels x chunk frames
_ENCODE_ELEMENTS_PER_PIXEL = 8.0
_VAE_FIXED_BYTES = 64 * 2**20  # the fitted intercepts (29 and 51 MiB), rounded up
# Whole decoded clips alive at the peak, in the VAE dtype: torch.cat's old and new output in the frame loop,
# then clamp's copy; after the VAE, the clip, VideoProcessor's denormalised copy and our fp32 copy (2 units).
_DECODE_CLIP_COPIES = 4
# After tiled_decode's loop: every decoded tile (the clip times the tiles' overlap factor), the blended rows,
# their concatenation and clamp's copy are alive together.
_TILED_DECODE_EXTRA_COPIES = 3


def _vae_shape(vae, encode: bool) -> tuple[int, int, int]:
    """(full-resolution channels, video frames per chunk, spatial stride) of a Wan VAE."""
    config = vae.config
    base = config.base_dim if encode else (getattr(config, "decoder_base_dim", None) or config.base_dim)
    chunk = 2 ** sum(bool(step) for step in config.temperal_downsample)
    return base * config.dim_mult[0], chunk, vae.spatial_compression_ratio


def _video_frames(latent_frames: int, chunk: int) -> int:
    return 1 + chunk * (latent_frames - 1)


def _tile_spans(size: int, tile: int, stride: int) -> list[int]:
    """Extents of diffusers' tiles along one axis of `size` (tiles start every `stride`, the last ones shorter)."""
    return [min(tile, size - start) for start in range(0, size, stride)]


def _decode_activation_bytes(vae, pixels: int) -> int:
    channels, chunk, _ = _vae_shape(vae, encode=False)
    return int(_DECODE_ELEMENTS_PER_PIXEL * channels * chunk * pixels * vae.dtype.itemsize)


def _encode_activation_bytes(vae, pixels: int) -> int:
    channels, chunk, _ = _vae_shape(vae, encode=True)
    return int(_ENCODE_ELEMENTS_PER_PIXEL * channels * chunk * pixels * vae.dtype.itemsize)


def _encode_clip_bytes(vae, frames: int, height: int, width: int) -> int:
    """The clip as prepare_conditioning and WanVACEPipeline.prepare_video_latents hold it on the device: fp32
    video and mask, their VAE-dtype copies, and the inactive and reactive halves (3+1 fp32, 10 VAE-dtype
    channels), plus the latents of both halves (mean and log-variance)."""
    _, chunk, stride = _vae_shape(vae, encode=True)
    pixels = frames * height * width
    latents = 2 * 2 * vae.config.z_dim * (1 + (frames - 1) // chunk) * (height // stride) * (width // stride)
    return pixels * (4 * 4 + 10 * vae.dtype.itemsize) + latents * 4


def vae_decode_peak_bytes(model: WanVACEModel, latent_frames: int, height: int, width: int) -> int:
    """Estimated device bytes of an untiled `decode` of `latent_frames` at `height` x `width` pixels."""
    vae = model.vae
    _, chunk, _ = _vae_shape(vae, encode=False)
    clip = 3 * _video_frames(latent_frames, chunk) * height * width * vae.dtype.itemsize
    return _VAE_FIXED_BYTES + _decode_activation_bytes(vae, height * width) + _DECODE_CLIP_COPIES * clip


def vae_tiled_decode_peak_bytes(
    model: WanVACEModel, latent_frames: int, height: int, width: int, tile_size: int, overlap: int
) -> int:
    """Estimated device bytes of the same decode through diffusers' tiled_decode (`tile_size`, `overlap` in pixels)."""
    vae = model.vae
    _, chunk, stride = _vae_shape(vae, encode=False)
    if height <= tile_size and width <= tile_size:  # diffusers tiles only a frame larger than one tile
        return vae_decode_peak_bytes(model, latent_frames, height, width)
    tile, step = tile_size // stride, (tile_size - overlap) // stride
    tile_area = sum(_tile_spans(height // stride, tile, step)) * sum(_tile_spans(width // stride, tile, step))
    pixel_frame = 3 * _video_frames(latent_frames, chunk) * vae.dtype.itemsize
    clip = pixel_frame * height * width
    tiles = pixel_frame * tile_area * stride * stride
    largest_tile = min(tile_size, height) * min(tile_size, width)
    after_vae = _DECODE_CLIP_COPIES * clip
    return (
        _VAE_FIXED_BYTES
        + _decode_activation_bytes(vae, largest_tile)
        + max(tiles + _TILED_DECODE_EXTRA_COPIES * clip, after_vae)
    )


def vae_encode_peak_bytes(model: WanVACEModel, frames: int, height: int, width: int) -> int:
    """Estimated device bytes of encoding a `frames`-frame control clip of `height` x `width` pixels, untiled."""
    vae = model.vae
    return (
        _VAE_FIXED_BYTES
        + _encode_activation_bytes(vae, height * width)
        + _encode_clip_bytes(vae, frames, height, width)
    )


def vae_tiled_encode_peak_bytes(
    model: WanVACEModel, frames: int, height: int, width: int, tile_size: int, overlap: int
) -> int:
    """Estimated device bytes of the same encode through diffusers' tiled_encode (the clip copies stay whole)."""
    vae = model.vae
    if height <= tile_size and width <= tile_size:
        return vae_encode_peak_bytes(model, frames, height, width)
    largest_tile = min(tile_size, height) * min(tile_size, width)
    return (
        _VAE_FIXED_BYTES + _encode_activation_bytes(vae, largest_tile) + _encode_clip_bytes(vae, frames, height, width)
    )
