"""Offline generation from one command, with the flags of vLLM-Omni's Wan2.2 recipe, on the core the nodes use.

    python -m wanvace_core.generate --model /path/to/Wan2.2-VACE-Fun-A14B-diffusers --mode i2v --image in.png \\
        --height 480 --width 832 --num-frames 81 --num-inference-steps 30 --seed 42 --guidance-scale 5.0 \\
        --vae-use-tiling --output out.mp4

`--guidance-scale` is the low-noise stage's scale and `--guidance-scale-2` the high-noise stage's (as the recipe
has them; the high-noise stage takes `--guidance-scale` too when `--guidance-scale-2` is left out). Every VACE
mode runs through `--mode` with `--image` / `--last-image` / `--video` / `--mask` / `--reference` /
`--outpaint-*` (`generation/tasks.py` arranges them as the shipped workflows do), and the cache, offload, context
windows, LoRAs and parallel workers through their own flags. Images are read with Pillow and videos with PyAV
(which ComfyUI installs); the MP4 is written with PyAV (H.264, yuv420p). `--save-latent` also writes the raw VAE
latents as ComfyUI's SaveLatent does (`latent_tensor` in a .latent safetensors file), for LoadLatent.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from . import (
    CACHE_MODES,
    DTYPES,
    OFFLOAD_MODES,
    SCHEDULERS,
    CacheOptions,
    ContextWindowOptions,
    LoraPatch,
    OffloadOptions,
    SamplerSettings,
    VACEInputs,
    VAETiling,
    WanVACEError,
    decode,
    load_pipeline,
    prepare_conditioning,
    sample,
    to_vae_space,
    validate_generation_size,
)
from .generation.tasks import MODES, Outpaint, task_inputs
from .parallel import ParallelOptions

logger = logging.getLogger("wanvace_core.generate")

DEFAULT_NEGATIVE = ""


class GenerateError(WanVACEError, ValueError):
    """A file the command line names could not be read or written; the message names the flag and the path."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m wanvace_core.generate",
        description="Generate a video with Wan2.2-VACE-Fun on the ComfyUI-WanVACE core (no ComfyUI needed).",
    )
    parser.add_argument("--model", required=True, help="a diffusers pipeline folder (Wan2.2-VACE-Fun-A14B-diffusers)")
    parser.add_argument("--mode", choices=MODES, default="t2v", help="the VACE task (default t2v)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--negative-prompt", default=DEFAULT_NEGATIVE)
    parser.add_argument("--image", help="i2v / flf2v: the first frame")
    parser.add_argument("--last-image", help="flf2v: the last frame")
    parser.add_argument("--video", help="v2v (control video), inpaint, outpaint, extension: the source video")
    parser.add_argument("--mask", help="inpaint: an image (every frame) or a video of masks; white = generate")
    parser.add_argument("--reference", action="append", help="r2v: a reference image (repeat for more)")
    for side in ("left", "top", "right", "bottom"):
        parser.add_argument(f"--outpaint-{side}", type=int, default=0, help=f"outpaint: new pixels on the {side}")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--num-frames", type=int, default=81, help="4n+1")
    parser.add_argument("--fps", type=float, default=16.0)
    parser.add_argument("--num-inference-steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--guidance-scale", type=float, default=5.0, help="low-noise stage (and high without -2)")
    parser.add_argument("--guidance-scale-2", type=float, default=None, help="high-noise stage")
    parser.add_argument("--boundary-ratio", type=float, default=None, help="default: the model's (0.875)")
    parser.add_argument("--flow-shift", type=float, default=None, help="default: the model's")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="unipc")
    parser.add_argument("--strength", type=float, default=1.0, help="VACE strength")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--vae-use-tiling", action="store_true", help="decode and encode in tiles")
    parser.add_argument("--cache", choices=CACHE_MODES, default=None, help="Cache-DiT step caching")
    parser.add_argument("--cache-threshold", type=float, default=0.08, help="residual_diff_threshold")
    parser.add_argument("--offload", choices=OFFLOAD_MODES, default="none")
    parser.add_argument("--context-length", type=int, default=None, help="context windows of this many frames")
    parser.add_argument("--context-overlap", type=int, default=16)
    parser.add_argument("--lora", action="append", default=[], help="PATH or PATH:STRENGTH (repeat to stack)")
    parser.add_argument("--parallel-devices", default=None, help="experts in parallel workers, e.g. cuda:0,cuda:1")
    parser.add_argument("--cfg-parallel", action="store_true", help="with --parallel-devices: one CFG branch each")
    parser.add_argument("--ulysses-degree", type=int, default=1, help="with --parallel-devices: sequence parallel")
    parser.add_argument("--output", required=True, help="the MP4 to write")
    parser.add_argument("--save-latent", default=None, help="also write the raw latents for ComfyUI's LoadLatent")
    return parser


def _read_image(flag: str, path: str) -> torch.Tensor:
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            pixels = np.array(image.convert("RGB"))
    except (OSError, UnidentifiedImageError) as error:
        raise GenerateError(f"{flag} {path}: not a readable image ({error}); give a PNG or JPEG file.") from error
    return torch.from_numpy(pixels).float().div(255.0)[None]


def _read_video(flag: str, path: str) -> torch.Tensor:
    import numpy as np

    av = _pyav(flag)
    try:
        with av.open(path) as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    except (OSError, av.error.FFmpegError) as error:
        raise GenerateError(f"{flag} {path}: not a readable video ({error}); give an MP4 or WebM file.") from error
    if not frames:
        raise GenerateError(f"{flag} {path}: the video has no frames.")
    return torch.from_numpy(np.stack(frames)).float().div(255.0)


def _read_mask(path: str) -> torch.Tensor:
    if Path(path).suffix.lower() in (".mp4", ".webm", ".mkv", ".mov", ".gif"):
        return _read_video("--mask", path)[..., 0]
    return _read_image("--mask", path)[..., 0]


def _pyav(flag: str):
    try:
        import av
    except ImportError as error:
        raise GenerateError(f"{flag} needs PyAV to read and write videos; install it with `pip install av`.") from error
    return av


def write_mp4(path: str, frames: torch.Tensor, fps: float) -> None:
    """`[T, H, W, 3]` frames in `[0, 1]` as an H.264 MP4 (yuv420p)."""
    from fractions import Fraction

    av = _pyav("--output")
    pixels = (frames.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        with av.open(path, mode="w") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
            stream.width, stream.height, stream.pix_fmt = pixels.shape[2], pixels.shape[1], "yuv420p"
            for frame in pixels:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
    except (OSError, av.error.FFmpegError) as error:
        raise GenerateError(f"--output {path}: could not write the video ({error}).") from error


def _loras(specs: list[str]) -> list[LoraPatch]:
    """`PATH` or `PATH:STRENGTH` (both experts); a path may itself hold colons (Windows drives)."""
    patches = []
    for spec in specs:
        path, strength = spec, 1.0
        head, _, tail = spec.rpartition(":")
        if head:
            try:
                path, strength = head, float(tail)
            except ValueError:
                path = spec
        patches.append(LoraPatch(path, strength_high_noise=strength, strength_low_noise=strength))
    return patches


def job_from_args(args: argparse.Namespace) -> tuple[VACEInputs, SamplerSettings]:
    """The conditioning inputs and sampler settings the flags ask for, validated before any model loads."""
    validate_generation_size(args.width, args.height, args.num_frames, names=("--width", "--height", "--num-frames"))
    outpaint = None
    if args.mode == "outpaint":
        outpaint = Outpaint(args.outpaint_left, args.outpaint_top, args.outpaint_right, args.outpaint_bottom)
    fields = task_inputs(
        args.mode,
        args.width,
        args.height,
        args.num_frames,
        image=_read_image("--image", args.image) if args.image else None,
        last_image=_read_image("--last-image", args.last_image) if args.last_image else None,
        video=_read_video("--video", args.video) if args.video else None,
        mask=_read_mask(args.mask) if args.mask else None,
        references=torch.cat([_read_image("--reference", path) for path in args.reference]) if args.reference else None,
        outpaint=outpaint,
    )
    inputs = VACEInputs(
        args.prompt, args.negative_prompt, args.width, args.height, args.num_frames, strength=args.strength, **fields
    )
    high = args.guidance_scale if args.guidance_scale_2 is None else args.guidance_scale_2
    settings = SamplerSettings(
        seed=args.seed,
        steps=args.num_inference_steps,
        cfg=high,
        cfg_low_noise=args.guidance_scale,
        boundary_ratio=args.boundary_ratio,
        shift=args.flow_shift,
        scheduler=args.scheduler,
    )
    return inputs, settings


def run(args: argparse.Namespace) -> Path:
    """Runs the job the flags describe and returns the MP4's path."""
    inputs, settings = job_from_args(args)
    cache = None
    if args.cache is not None:
        cache = CacheOptions(mode=args.cache, residual_diff_threshold=args.cache_threshold)
    windows = None
    if args.context_length is not None:
        windows = ContextWindowOptions(context_length=args.context_length, context_overlap=args.context_overlap)
    loras = _loras(args.lora)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tiling = VAETiling(mode="on") if args.vae_use_tiling else VAETiling(mode="off")
    parallel = None
    if args.parallel_devices:
        parallel = ParallelOptions(
            devices=tuple(args.parallel_devices.split(",")),
            cfg_parallel=args.cfg_parallel,
            ulysses_degree=args.ulysses_degree,
        )
    started = time.perf_counter()
    model = load_pipeline(args.model, args.dtype, device, offload=OffloadOptions(mode=args.offload), parallel=parallel)
    if loras:
        model = model.with_loras(*loras)
    logger.info("loaded %s in %.1f s", args.model, time.perf_counter() - started)
    cond = prepare_conditioning(model, inputs, tiling=tiling)
    progress = _progress(settings.steps)
    try:
        result = sample(model, cond, settings, callback=lambda *_: progress.update(1), cache=cache, windows=windows)
    finally:
        progress.close()
    if result.cache_report is not None:
        print(result.cache_report.text(), file=sys.stderr)
    latents = to_vae_space(model, result.latents)
    if args.save_latent:
        from safetensors.torch import save_file

        # The version key tells ComfyUI's LoadLatent that the latents are not scaled by SD1's 0.18215.
        save_file(
            {"latent_tensor": latents.contiguous(), "latent_format_version_0": torch.tensor([])}, args.save_latent
        )
    frames = decode(model, latents, tiling)
    write_mp4(args.output, frames, args.fps)
    return Path(args.output)


def _progress(steps: int):
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc="denoising", unit="step")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        output = run(args)
    except WanVACEError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
