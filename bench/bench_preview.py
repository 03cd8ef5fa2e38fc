"""Cost of WanVACESampler's live preview per step, beside the time of one tiny-model step, in one run.

    .venvs/current/bin/python bench/bench_preview.py [--comfy-dir .cache/comfyui-current] [--threads 2]

The preview is nodes/preview.py's step callback with ComfyUI's latent2rgb previewer, and with its LightTAE previewer
(`--preview-method taesd` with a random-weight `lighttaew2_1` of ComfyUI's own TAEHV class in a temporary
`vae_approx`; the weights do not change the cost), no server attached (the progress hook is a no-op), on a
realistic denoised estimate: 81 frames at 720p with one reference image,
[1, 16, 1 + 21, 90, 160] fp32. "encode" is what ComfyUI's server then does with it off the sampler
thread (fit to --preview-size, JPEG at quality 95), done here with PIL. The step is the core loop on the
tiny random-weight model (tests' default spec) at --width/--height/--length, timed from its callback.
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cli import bench_arguments, parse  # noqa: E402
from wanvace_core import SamplerSettings, VACEInputs, load_pipeline, prepare_conditioning, sample  # noqa: E402
from wanvace_core.load.tiny import write_tiny_pipeline  # noqa: E402

REAL_LATENT = (1, 16, 1 + 21, 90, 160)


def _median_ms(run, repeats: int) -> float:
    run()  # first call: lazy set-up (factor tensors moved to the latents' dtype)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _comfy_preview_module(comfy_dir: Path):
    sys.path.insert(0, str(comfy_dir))  # ComfyUI's own modules (and its `nodes`), ahead of this repository
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # what --cpu sets; ComfyUI's device pick runs when latent_preview is imported
    spec = importlib.util.spec_from_file_location("wanvace_preview", REPO / "nodes" / "preview.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return comfy.cli_args, module


def _random_lighttae(folder: Path) -> None:
    """A random-weight LightTAE for Wan 2.1 (ComfyUI's TAEHV, stored fp32: fp16 reads as HunyuanVideo's taehv)."""
    import comfy.taesd.taehv
    import folder_paths
    from safetensors.torch import save_file

    torch.manual_seed(0)
    module = comfy.taesd.taehv.TAEHV(latent_channels=16)
    save_file(
        {name: value.contiguous() for name, value in module.state_dict().items()},
        str(folder / "lighttaew2_1.safetensors"),
    )
    folder_paths.add_model_folder_path("vae_approx", str(folder))


def main() -> None:
    parser = bench_arguments(__doc__, steps=6, width=128, height=96, length=17, repeats=20)
    default_dir = os.environ.get("WANVACE_COMFY_DIR", str(REPO / ".cache" / "comfyui-current"))
    parser.add_argument("--comfy-dir", type=Path, default=Path(default_dir))
    args = parse(parser)
    cli_args, preview = _comfy_preview_module(args.comfy_dir.resolve())
    from PIL import ImageOps

    model = SimpleNamespace(device=torch.device("cpu"))
    conditioning = SimpleNamespace(num_reference_images=1)
    latents = torch.randn(REAL_LATENT, generator=torch.Generator().manual_seed(0))
    results = {}
    lighttae_folder = tempfile.TemporaryDirectory()
    _random_lighttae(Path(lighttae_folder.name))
    for method in ("latent2rgb", "taesd", "none"):
        cli_args.args.preview_method = cli_args.LatentPreviewMethod(method)
        step = preview.step_previewer(model, conditioning, steps=args.repeats + 1)
        # LightTAE decodes a full-size frame through a convolutional decoder: seconds per call on a CPU core.
        repeats = min(args.repeats, 3) if method == "taesd" else args.repeats
        results[method] = _median_ms(lambda step=step: step(0, args.repeats + 1, latents), repeats)

    cli_args.args.preview_method = cli_args.LatentPreviewMethod("latent2rgb")
    image_format, image, size = preview.latent_preview.get_previewer(
        model.device, preview.comfy.latent_formats.Wan21()
    ).decode_latent_to_preview_image(preview.PREVIEW_FORMAT, latents[:, :, 1:])

    def encode() -> None:
        ImageOps.contain(image, (size, size)).save(io.BytesIO(), format=image_format, quality=95)

    results["encode"] = _median_ms(encode, args.repeats)

    with tempfile.TemporaryDirectory() as tmp:
        tiny = load_pipeline(write_tiny_pipeline(Path(tmp) / "bench-model"), "fp32")
        control = torch.rand(args.length, args.height, args.width, 3, generator=torch.Generator().manual_seed(0))
        inputs = VACEInputs("a bird", "blurry", args.width, args.height, args.length, control_video=control)
        cond = prepare_conditioning(tiny, inputs)
        stamps = []
        sample(
            tiny,
            cond,
            SamplerSettings(seed=1, steps=args.steps, cfg=5.0, cfg_low_noise=5.0),
            callback=lambda *_: stamps.append(time.perf_counter()),
        )
        step_ms = statistics.median(b - a for a, b in itertools.pairwise(stamps)) * 1000

    print(f"ComfyUI {args.comfy_dir}, torch {torch.__version__}, {args.threads} threads")
    print(f"preview latent {list(REAL_LATENT)} fp32 (1 reference frame), preview image {image.size} -> {size}px")
    print(f"  latent2rgb preview per step: {results['latent2rgb']:.3f} ms")
    print(f"  LightTAE (taesd) preview per step: {results['taesd']:.3f} ms")
    print(f"  preview method none per step: {results['none']:.3f} ms")
    print(f"  server-side fit + JPEG encode: {results['encode']:.3f} ms")
    print(
        f"tiny-model step ({args.width}x{args.height}x{args.length}, CFG 5): {step_ms:.1f} ms -> "
        f"latent2rgb preview = {100 * results['latent2rgb'] / step_ms:.2f}% of it, "
        f"with encode {100 * (results['latent2rgb'] + results['encode']) / step_ms:.2f}%; "
        f"LightTAE = {100 * results['taesd'] / step_ms:.2f}%"
    )
    lighttae_folder.cleanup()


if __name__ == "__main__":
    main()
