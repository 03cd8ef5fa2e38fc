"""Load benchmark: our streaming loader vs diffusers' from_pretrained, peak host memory and time, in one run.

    .venvs/current/bin/python bench/bench_load.py [--layers 8] [--vace-every 4] [--heads 12] [--head-dim 128]
                                         [--ffn-mult 4] [--dtypes bf16,fp32] [--repeats 1] [--folder DIR]

Writes a random-weight `WanVACETransformer3DModel` in bf16 (diffusers layout, safetensors) to a temporary
folder (or reuses `--folder DIR` holding `transformer/`), then loads it into each target dtype with
`wanvace_core.loading.load_component` and with `WanVACETransformer3DModel.from_pretrained(folder,
torch_dtype=...)`, each in a fresh subprocess so that every load starts from the same clean baseline.
For each it prints the time, the peak private (RssAnon) and file-backed (RssFile) memory above the
baseline, the peak total (the kernel's VmHWM), each peak over the loaded component's size, and the
ratios ours/diffusers. "used" is what stays resident (above the baseline) once every weight has been
read once, as a first forward would: weights used in place from the file show up as file-backed.
With several repeats, times are medians and memory peaks maxima.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.rss import LOADERS, measure_load_in_subprocess, write_transformer_folder

MIB = 1024 * 1024
MEMORY_KEYS = ("private_above_baseline", "file_above_baseline", "total_above_baseline")


def _summarise(runs: list[dict]) -> dict:
    summary = dict(runs[0])
    summary["seconds"] = statistics.median(run["seconds"] for run in runs)
    for key in MEMORY_KEYS:
        summary[key] = max(run[key] for run in runs)
    return summary


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="num_layers of the transformer")
    parser.add_argument("--vace-every", type=int, default=4, help="a VACE block every N layers")
    parser.add_argument("--heads", type=int, default=12, help="num_attention_heads")
    parser.add_argument("--head-dim", type=int, default=128, help="attention_head_dim")
    parser.add_argument("--ffn-mult", type=int, default=4, help="ffn_dim = ffn_mult * heads * head_dim")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated target dtypes (bf16, fp16, fp32)")
    parser.add_argument("--repeats", type=int, default=1, help="loads per loader and dtype, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the loading processes")
    parser.add_argument("--folder", help="reuse (or create) this folder; its transformer/ is loaded")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="wanvace-bench-load-") as scratch:
        root = Path(args.folder) if args.folder else Path(scratch)
        component = root / "transformer"
        if not (component / "config.json").is_file():
            start = time.perf_counter()
            write_transformer_folder(
                root,
                num_layers=args.layers,
                vace_every=args.vace_every,
                num_attention_heads=args.heads,
                attention_head_dim=args.head_dim,
                ffn_mult=args.ffn_mult,
            )
            print(f"wrote {component} in {time.perf_counter() - start:.1f} s")
        file_bytes = sum(path.stat().st_size for path in component.glob("*.safetensors"))
        print(f"weights on disk: {file_bytes / MIB:.0f} MiB (bf16); {args.threads} torch threads; peaks in MiB")

        rows = []
        for dtype in args.dtypes.split(","):
            results: dict[str, list[dict]] = {loader: [] for loader in LOADERS}
            for _ in range(args.repeats):
                for loader in LOADERS:
                    results[loader].append(measure_load_in_subprocess(loader, component, dtype, threads=args.threads))
            rows.append((dtype, {loader: _summarise(runs) for loader, runs in results.items()}))

    header = (
        f"{'dtype':5} {'loader':9} {'component':>9} {'time s':>7} {'private':>8} {'file':>6} {'total':>7} "
        f"{'private/comp':>12} {'total/comp':>10} {'used: private':>13} {'file':>6}"
    )
    print(header)
    print("-" * len(header))
    for dtype, by_loader in rows:
        for loader, run in by_loader.items():
            size = run["component_bytes"]
            print(
                f"{dtype:5} {loader:9} {size / MIB:9.0f} {run['seconds']:7.2f} "
                f"{run['private_above_baseline'] / MIB:8.0f} {run['file_above_baseline'] / MIB:6.0f} "
                f"{run['total_above_baseline'] / MIB:7.0f} {run['private_above_baseline'] / size:12.3f} "
                f"{run['total_above_baseline'] / size:10.3f} {run['private_after_use'] / MIB:13.0f} "
                f"{run['file_after_use'] / MIB:6.0f}"
            )
    print()
    print("ours/diffusers (lower is better):")
    print(f"{'dtype':5} {'time':>7} {'private':>8} {'file':>7} {'total':>7}")
    for dtype, by_loader in rows:
        ours, theirs = by_loader["ours"], by_loader["diffusers"]
        widths = (8, 7, 7)
        memory = [f"{_ratio(ours[key], theirs[key]):>{width}}" for key, width in zip(MEMORY_KEYS, widths, strict=True)]
        print(f"{dtype:5} {_ratio(ours['seconds'], theirs['seconds']):>7} {' '.join(memory)}")


if __name__ == "__main__":
    main()
