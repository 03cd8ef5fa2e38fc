"""Cache-DiT speed-up on a tiny model large enough to be compute-bound on CPU, measured in one run.

    .venvs/current/bin/python bench/bench_cache.py [--steps 30] [--threshold 0.08] [--warmup 2]

Runs the same V2V control generation uncached, with DBCache and with DBCache+TaylorSeer
(interleaved, median of --repeats), and prints each mode's wall-time ratio against uncached, the
fraction of transformer block calls (main + VACE blocks) it skipped, and the PSNR of its latents
against the uncached latents.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cli import bench_arguments, parse
from bench.metrics import psnr
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    SamplerSettings,
    VACEInputs,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline


def _block_counter(model):
    counts = [0]
    handles = []
    for expert in model.experts:
        for block in [*expert.blocks, *expert.vace_blocks]:
            handles.append(block.register_forward_pre_hook(lambda *_: counts.__setitem__(0, counts[0] + 1)))
    return counts, handles


def main() -> None:
    parser = bench_arguments(__doc__, steps=30, width=160, height=128, length=17, repeats=2)
    parser.add_argument("--threshold", type=float, default=0.08, help="residual_diff_threshold of DBCache")
    parser.add_argument(
        "--taylorseer-threshold",
        type=float,
        default=None,
        help="residual_diff_threshold of DBCache+TaylorSeer (default: --threshold)",
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="max_warmup_steps for each expert")
    parser.add_argument("--Fn", type=int, default=1)
    parser.add_argument("--Bn", type=int, default=0)
    args = parse(parser)

    # 20 blocks with VACE layers every 5th, the same 5:1 ratio as the 40-layer A14B experts.
    spec = TinyModelSpec(
        num_layers=20,
        vace_layers=(0, 5, 10, 15),
        num_attention_heads=4,
        attention_head_dim=args.head_dim,
        ffn_dim=4 * 4 * args.head_dim,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = load_pipeline(write_tiny_pipeline(Path(tmp) / "bench-cache", spec), "fp32")
    control = torch.rand(args.length, args.height, args.width, 3, generator=torch.Generator().manual_seed(0))
    inputs = VACEInputs(
        "a dancer in a red dress", "blurry, static", args.width, args.height, args.length, control_video=control
    )
    cond = prepare_conditioning(model, inputs)
    settings = SamplerSettings(seed=1, steps=args.steps, cfg=5.0, cfg_low_noise=4.0)
    limits = ExpertCacheLimits(max_warmup_steps=args.warmup)
    modes = {
        "uncached": None,
        "DBCache": CacheOptions("DBCache", args.Fn, args.Bn, args.threshold, high_noise=limits, low_noise=limits),
        "DBCache+TaylorSeer": CacheOptions(
            "DBCache+TaylorSeer",
            args.Fn,
            args.Bn,
            args.taylorseer_threshold or args.threshold,
            high_noise=limits,
            low_noise=limits,
        ),
    }
    times = {name: [] for name in modes}
    results, block_calls = {}, {}
    for _ in range(args.repeats):
        for name, options in modes.items():
            counts, handles = _block_counter(model)
            start = time.perf_counter()
            results[name] = sample(model, cond, settings, cache=options)
            times[name].append(time.perf_counter() - start)
            for handle in handles:
                handle.remove()
            block_calls[name] = counts[0]

    tokens = ((args.length - 1) // 4 + 1) * (args.height // 16) * (args.width // 16)
    print(
        f"model: 20 blocks + 4 VACE blocks per expert, dim {4 * args.head_dim}, two experts; "
        f"{args.width}x{args.height}x{args.length} "
        f"({tokens} tokens); {args.steps} steps, CFG 5/4; Fn={args.Fn} Bn={args.Bn} threshold={args.threshold} "
        f"(TaylorSeer {args.taylorseer_threshold or args.threshold}) "
        f"warmup={args.warmup}; median of {args.repeats}; {args.threads} threads"
    )
    base_time = statistics.median(times["uncached"])
    reference = results["uncached"].latents
    for name in modes:
        elapsed = statistics.median(times[name])
        skipped = 1 - block_calls[name] / block_calls["uncached"]
        quality = "inf" if name == "uncached" else f"{psnr(reference, results[name].latents):.1f}"
        print(
            f"{name:20s} {elapsed:7.2f} s  speed-up {base_time / elapsed:4.2f}x  "
            f"block calls skipped {skipped:6.1%}  PSNR {quality} dB"
        )
        if results[name].cache_report is not None:
            print(f"{'':20s} {results[name].cache_report.text()}")


if __name__ == "__main__":
    main()
