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
import contextlib
import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass
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
    inspect_pipeline_folder,
    load_pipeline,
    prepare_conditioning,
    sample,
    to_vae_space,
    validate_generation_size,
    validate_vace_inputs,
)
from .generation.limits import SizeNames, check_size, size_limits_of_folder
from .generation.schedules import timesteps_for
from .generation.tasks import MODES, Outpaint, task_inputs
from .generation.windows import check_schedule_with_cache
from .load.tensor_files import read_safetensors_header
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


# The core's names for what the flags set, as its refusals name them; the command line names the flag instead.
_FLAG_OF = {
    "width": "--width",
    "height": "--height",
    "length": "--num-frames",
    "steps": "--num-inference-steps",
    "seed": "--seed",
    "cfg_low_noise": "--guidance-scale",
    "boundary_ratio": "--boundary-ratio",
    "shift": "--flow-shift",
    "scheduler": "--scheduler",
    "strength": "--strength",
    "positive": "--prompt",
    "negative": "--negative-prompt",
    "residual_diff_threshold": "--cache-threshold",
    "context_length": "--context-length",
    "context_overlap": "--context-overlap",
    "devices": "--parallel-devices",
    "ulysses_degree": "--ulysses-degree",
    "cfg_parallel": "--cfg-parallel",
    "strength_high_noise": "--lora",
    "strength_low_noise": "--lora",
    "path": "--lora",
    "dtype": "--dtype",
    "control_video": "--video",
    "control_masks": "--mask",
    "reference_images": "--reference",
}
# What the VACE modes' refusals (generation/tasks.py) call the flags' files.
_TASK_FLAG_OF = {
    "image": "--image",
    "last_image": "--last-image",
    "video": "--video",
    "mask": "--mask",
    "references": "--reference",
}


def _flagged(message: str, flags: dict[str, str], bare: bool = False) -> str:
    """`message` with each core name followed by `=` spelled as its flag; with `bare`, also the names a VACE mode
    "needs" or "does not use"."""

    def spelled(text: str, ending: str) -> str:
        for name, flag in sorted(flags.items(), key=lambda item: -len(item[0])):
            text = re.sub(rf"(?<![\w-]){re.escape(name)}{ending}", flag, text)
        return text

    message = spelled(message, "(?==)")
    if bare:
        message = re.sub(r"(needs |does not use )([^;(]*)", lambda match: match[1] + spelled(match[2], r"\b"), message)
    return message


@contextlib.contextmanager
def _refusing(flag: str, flags: dict[str, str] | None = None, bare: bool = False):
    """Turns a core refusal raised inside into one naming the command line's flags; `flag` leads where none does."""
    try:
        yield
    except WanVACEError as error:
        message = _flagged(str(error), _FLAG_OF if flags is None else flags, bare)
        if message.startswith(flag.replace("--", "", 1) + " "):  # "mode i2v needs ..." -> "--mode i2v needs ..."
            message = "--" + message
        elif not message.startswith("--"):
            message = f"{flag}: {message}"
        raise GenerateError(message) from error


@dataclass(frozen=True)
class Job:
    """Everything the flags ask for, checked before the model loads."""

    inputs: VACEInputs
    settings: SamplerSettings
    cache: CacheOptions | None
    windows: ContextWindowOptions | None
    loras: list[LoraPatch]
    parallel: ParallelOptions | None
    device: str
    tiling: VAETiling
    offload: OffloadOptions


def job_from_args(args: argparse.Namespace) -> tuple[VACEInputs, SamplerSettings]:
    """The conditioning inputs and sampler settings the flags ask for, validated before any model loads."""
    validate_generation_size(args.width, args.height, args.num_frames, names=("--width", "--height", "--num-frames"))
    if not args.prompt.strip():
        raise GenerateError("--prompt is empty; describe the video you want.")
    outpaint = None
    sides = ("left", "top", "right", "bottom")
    if args.mode == "outpaint":
        pads = [getattr(args, f"outpaint_{side}") for side in sides]
        if not any(pads):
            raise GenerateError(
                "--mode outpaint pads no side; give at least one of "
                f"{', '.join(f'--outpaint-{side}' for side in sides)} in pixels."
            )
        with _refusing("--mode outpaint", {f"outpaint {side}": f"--outpaint-{side}" for side in sides}):
            outpaint = Outpaint(*pads)
    with _refusing(f"--mode {args.mode}", _TASK_FLAG_OF, bare=True):
        fields = task_inputs(
            args.mode,
            args.width,
            args.height,
            args.num_frames,
            image=_read_image("--image", args.image) if args.image else None,
            last_image=_read_image("--last-image", args.last_image) if args.last_image else None,
            video=_read_video("--video", args.video) if args.video else None,
            mask=_read_mask(args.mask) if args.mask else None,
            references=torch.cat([_read_image("--reference", path) for path in args.reference])
            if args.reference
            else None,
            outpaint=outpaint,
        )
    high = args.guidance_scale if args.guidance_scale_2 is None else args.guidance_scale_2
    with _refusing("--prompt"):
        inputs = VACEInputs(
            args.prompt,
            args.negative_prompt,
            args.width,
            args.height,
            args.num_frames,
            strength=args.strength,
            **fields,
        )
        validate_vace_inputs(inputs)
    # The high-noise stage's scale comes from --guidance-scale-2, or from --guidance-scale without it.
    with _refusing("--num-inference-steps", {**_FLAG_OF, "cfg": high_flag(args)}):
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


def high_flag(args: argparse.Namespace) -> str:
    return "--guidance-scale" if args.guidance_scale_2 is None else "--guidance-scale-2"


def _check_lora_file(path: Path) -> None:
    if not path.is_file():
        raise GenerateError(f"--lora {path}: there is no such file; give a LoRA .safetensors file.")
    try:
        read_safetensors_header(path)
    except WanVACEError as error:
        raise GenerateError(f"--lora {path}: {error}") from error


def _device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise GenerateError(f"--device {name!r} is not a device name ({error}); use cpu, cuda or cuda:N.") from error
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise GenerateError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); use cpu.")
    return name


def prepare_job(args: argparse.Namespace) -> Job:
    """Every check the flags allow before the model loads (the model folder's config files included), so that a bad
    flag is refused in a second, naming the flag, and never after minutes of loading."""
    if not math.isfinite(args.fps) or args.fps <= 0:
        raise GenerateError(f"--fps {args.fps} must be a positive number of frames per second, e.g. 16.")
    inputs, settings = job_from_args(args)
    cache = windows = parallel = None
    if args.cache is not None:
        with _refusing("--cache", {**_FLAG_OF, "mode": "--cache"}):
            cache = CacheOptions(mode=args.cache, residual_diff_threshold=args.cache_threshold)
    if args.context_length is not None:
        with _refusing("--context-length"):
            windows = ContextWindowOptions(context_length=args.context_length, context_overlap=args.context_overlap)
            if cache is not None:
                check_schedule_with_cache(windows.schedule)
    with _refusing("--lora"):
        loras = _loras(args.lora)
    for patch in loras:
        _check_lora_file(patch.path)
    device = _device(args.device)
    if args.parallel_devices:
        with _refusing("--parallel-devices"):
            parallel = ParallelOptions(
                devices=tuple(args.parallel_devices.split(",")),
                cfg_parallel=args.cfg_parallel,
                ulysses_degree=args.ulysses_degree,
            )
            parallel.check_devices(torch.cuda.device_count() if parallel.device_type == "cuda" else 0)
        if loras:
            raise GenerateError("--lora does not run yet with --parallel-devices; leave one of them out.")
    with _refusing("--offload", {"mode": "--offload"}):
        offload = OffloadOptions(mode=args.offload)
    with _refusing("--model", {}):
        inspect_pipeline_folder(args.model)
        limits = size_limits_of_folder(args.model)
        scheduler_config = _scheduler_config(Path(args.model))
    references = 0 if inputs.reference_images is None else int(inputs.reference_images.shape[0])
    with _refusing("--num-frames"):
        check_size(limits, args.width, args.height, args.num_frames, references, windows, _FLAG_NAMES)
    with _refusing("--flow-shift", {**_FLAG_OF, "cfg": high_flag(args)}):
        timesteps_for(scheduler_config, settings)
    tiling = VAETiling(mode="on") if args.vae_use_tiling else VAETiling(mode="off")
    return Job(inputs, settings, cache, windows, loras, parallel, device, tiling, offload)


_FLAG_NAMES = SizeNames("--width", "--height", "--num-frames", "--context-length", "add --context-length {} or less")


def _scheduler_config(folder: Path) -> dict:
    path = folder / "scheduler" / "scheduler_config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise GenerateError(f"--model {folder}: {path} cannot be read ({error}); re-download the folder.") from error


def run(args: argparse.Namespace) -> Path:
    """Runs the job the flags describe and returns the MP4's path."""
    job = prepare_job(args)
    started = time.perf_counter()
    model = load_pipeline(args.model, args.dtype, job.device, offload=job.offload, parallel=job.parallel)
    if job.loras:
        model = model.with_loras(*job.loras)
    logger.info("loaded %s in %.1f s", args.model, time.perf_counter() - started)
    cond = prepare_conditioning(model, job.inputs, tiling=job.tiling)
    progress = _progress(job.settings.steps)
    try:
        result = sample(
            model, cond, job.settings, callback=lambda *_: progress.update(1), cache=job.cache, windows=job.windows
        )
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
    frames = decode(model, latents, job.tiling)
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
