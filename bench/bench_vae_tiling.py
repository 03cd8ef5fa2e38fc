"""Peak memory of an untiled vs a tiled Wan VAE decode, measured side by side, next to wanvace_core's estimates.

    .venvs/current/bin/python bench/bench_vae_tiling.py                      # CPU: 2 latent frames at 128x128
    .venvs/current/bin/python bench/bench_vae_tiling.py --device cuda        # GPU: 81 frames at 720x1280, bf16

The real Wan 2.1 VAE architecture (AutoencoderKLWan's default config, 96 channels at full resolution) with
random weights decodes random latents through `wanvace_core.decode`, once with tiling off and once on
(diffusers' tiling, `--tile-size` / `--overlap` pixels). CPU: each decode runs in a fresh subprocess whose
allocator returns every freed large block to the system (MALLOC_MMAP_THRESHOLD_), so resident memory follows
live tensors; the peak is VmHWM after /proc/self/clear_refs reset it, minus the RSS before the decode.
GPU: torch.cuda.max_memory_allocated during the decode minus what was allocated before it (the weights and
latents), both decodes in one process. Prints both peaks, their ratio, the estimates, time and the PSNR of
the tiled frames against the untiled ones; `--json PATH` also writes them as rows (bench/gpu_check.sh's table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("fp32", "bf16", "fp16")
MODES = ("off", "on")


def _model(device: str, dtype_name: str):
    """A stand-in WanVACEModel holding what `decode` uses: the real VAE architecture, random weights."""
    import torch
    from diffusers import AutoencoderKLWan
    from diffusers.video_processor import VideoProcessor

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    torch.manual_seed(0)
    if device == "meta":  # shapes only, for the estimates
        with torch.device("meta"):
            vae = AutoencoderKLWan().to(dtype)
    else:
        vae = AutoencoderKLWan().eval().requires_grad_(False).to(device=device, dtype=dtype)
    helper = SimpleNamespace(vae_scale_factor_spatial=8, video_processor=VideoProcessor(vae_scale_factor=8))
    return SimpleNamespace(vae=vae, device=torch.device(device), helper=helper, activate=lambda name: None)


def _latents(args, model):
    import torch

    generator = torch.Generator().manual_seed(1)
    shape = (1, 16, 1 + (args.frames - 1) // 4, args.height // 8, args.width // 8)
    return torch.randn(shape, generator=generator).to(model.device, model.vae.dtype)


def _estimates(args, model) -> dict:
    from wanvace_core.generation.tiling import VAETiling, tiled_peak_bytes, untiled_peak_bytes

    size = (1 + (args.frames - 1) // 4, args.height, args.width)
    tiling = VAETiling(mode="on", tile_size=args.tile_size, overlap=args.overlap)
    return {
        "off": untiled_peak_bytes(model, *size, encode=False),
        "on": tiled_peak_bytes(model, tiling, *size, encode=False),
    }


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _child(args) -> None:
    """One CPU decode in this (fresh) process; prints its figures as JSON and saves the frames."""
    import torch

    from wanvace_core import decode
    from wanvace_core.generation.tiling import VAETiling

    torch.set_num_threads(args.threads)
    model = _model("cpu", args.dtype)
    latents = _latents(args, model)
    tiling = VAETiling(mode=args.child, tile_size=args.tile_size, overlap=args.overlap)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = _rss_kb("VmRSS")
    start = time.perf_counter()
    frames = decode(model, latents, tiling)
    seconds = time.perf_counter() - start
    peak = (_rss_kb("VmHWM") - before) * 1024
    torch.save(frames, args.out)
    print(json.dumps({"peak": peak, "seconds": seconds}))


def _measure_cpu(args) -> tuple[dict, dict]:
    import torch

    results, frames = {}, {}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(args.threads),
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            out = Path(folder) / f"{mode}.pt"
            command = [sys.executable, __file__, *sys.argv[1:], "--child", mode, "--out", str(out)]
            done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{mode} decode failed ({done.returncode}):\n{done.stderr[-4000:]}")
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            frames[mode] = torch.load(out)
    return results, frames


def _measure_cuda(args, model) -> tuple[dict, dict]:
    import torch

    from wanvace_core import decode
    from wanvace_core.generation.tiling import VAETiling

    latents = _latents(args, model)
    results, frames = {}, {}
    for mode in MODES:
        tiling = VAETiling(mode=mode, tile_size=args.tile_size, overlap=args.overlap)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        frames[mode] = decode(model, latents, tiling)
        torch.cuda.synchronize()
        results[mode] = {"peak": torch.cuda.max_memory_allocated() - before, "seconds": time.perf_counter() - start}
    return results, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--frames", type=int, help="video frames, 4n+1 (default: 5 on cpu, 81 on cuda)")
    parser.add_argument("--height", type=int, help="pixels, a multiple of 8 (default: 128 on cpu, 720 on cuda)")
    parser.add_argument("--width", type=int, help="pixels, a multiple of 8 (default: 128 on cpu, 1280 on cuda)")
    parser.add_argument("--tile-size", type=int, help="tile pixels (default: 64 on cpu, 256 on cuda)")
    parser.add_argument("--overlap", type=int, help="tile overlap pixels (default: 16 on cpu, 64 on cuda)")
    parser.add_argument("--dtype", choices=DTYPES, help="VAE dtype (default: fp32 on cpu, bf16 on cuda)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each decode subprocess")
    parser.add_argument("--json", help="also write the rows here as JSON (bench/gpu_check.sh's table)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    defaults = (81, 720, 1280, 256, 64, "bf16") if cuda else (5, 128, 128, 64, 16, "fp32")
    for name, default in zip(("frames", "height", "width", "tile_size", "overlap", "dtype"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    sys.path.insert(0, str(REPO))
    if args.child:
        _child(args)
        return

    import torch

    if cuda and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return
    model = _model("cuda" if cuda else "meta", args.dtype)  # on cpu the estimates need only the config
    estimates = _estimates(args, model)
    results, frames = _measure_cuda(args, model) if cuda else _measure_cpu(args)
    mse = float(((frames["off"].double() - frames["on"].double()) ** 2).mean())
    psnr = float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()
    what = "torch.cuda.max_memory_allocated" if cuda else "peak private host memory (VmHWM)"
    print(
        f"Wan 2.1 VAE decode, {args.frames} frames at {args.width}x{args.height}, {args.dtype} on {args.device}; "
        f"tiles {args.tile_size} px overlapping {args.overlap} px; {what} above the start of the decode"
    )
    for mode, label in (("off", "untiled"), ("on", "tiled  ")):
        result = results[mode]
        print(
            f"{label}  measured {result['peak'] / 2**20:9.1f} MiB  estimate {estimates[mode] / 2**20:9.1f} MiB "
            f"(estimate/measured {estimates[mode] / result['peak']:.2f})  {result['seconds']:7.1f} s"
        )
    ratio = results["on"]["peak"] / results["off"]["peak"]
    print(
        f"tiled/untiled peak {ratio:.3f}; tiled frames vs untiled PSNR {psnr:.1f} dB, shape {tuple(frames['on'].shape)}"
    )
    if args.json:
        rows = []
        for mode, label in (("off", "untiled"), ("on", f"tiled {args.tile_size}/{args.overlap} px")):
            result = results[mode]
            ratios = {"estimate/measured": estimates[mode] / result["peak"]}
            note = ""
            if mode == "on":
                ratios["peak/untiled"] = ratio
                ratios["time/untiled"] = result["seconds"] / results["off"]["seconds"]
                note = f"PSNR {psnr:.1f} dB vs untiled"
            # On the CPU the peak is private host memory, not VRAM: the VRAM column leaves it out.
            peak = result["peak"] / 2**30 if cuda else None
            rows.append({"row": label, "seconds": result["seconds"], "peak_gib": peak, "ratios": ratios, "note": note})
        config = f"{args.frames} frames at {args.width}x{args.height}, {args.dtype}; peak above weights and latents"
        report = {"bench": "VAE tiling", "device": args.device, "config": config, "time_unit": "per decode"}
        report["rows"] = rows
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
