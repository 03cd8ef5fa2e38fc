"""Load benchmark: folder loader, diffusers' from_pretrained and the single-file loader (bf16, fp8, GGUF), in one run.

    .venvs/current/bin/python bench/bench_load.py [--quick] [--layers 8] [--vace-every 4] [--heads 12]
                                         [--head-dim 128] [--ffn-mult 4] [--dtypes bf16,fp32]
                                         [--formats bf16,fp8_scaled,Q8_0] [--repeats 1] [--folder DIR]

Writes one random-weight `WanVACETransformer3DModel` in bf16 to a temporary folder (or reuses `--folder
DIR`) as a diffusers component folder (`transformer/`) and as ComfyUI-style single files
(bench/expert_files.py writers: original Wan keys in bf16, legacy scaled fp8, GGUF Q8_0). Then, each in
a fresh subprocess so that every load starts from the same clean baseline, it loads:

- the folder into each target dtype with `wanvace_core.load.pipeline_folder.load_component` ("folder ours") and
  with `WanVACETransformer3DModel.from_pretrained(folder, torch_dtype=...)` ("folder diffusers");
- the bf16 single file into each target dtype through the single-file loader ("file bf16");
- the fp8 / Q8_0 files with `weight_dtype="auto"` (Linear weights kept as stored, "kept") and dequantised
  into each target dtype (`weight_dtype=dtype`, "-> bf16").

For each it prints the time, the peak private (RssAnon) and file-backed (RssFile) memory above the
baseline, the peak total (the kernel's VmHWM), each peak over the loaded component's size, and "used":
what stays resident (above the baseline) once every weight has been read once, as a first forward would
(weights used in place or kept as stored show up as file-backed). Then the ratios of every row to
"folder ours" at the same compute dtype. With several repeats, times are medians and
memory peaks maxima. `--quick`: a 2-layer model (282 MiB in bf16) and one repeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rss import (
    SINGLE_FILE_FORMATS,
    SINGLE_FILE_LOADER,
    measure_load_in_subprocess,
    random_transformer,
    write_single_files,
    write_transformer_folder,
)

MIB = 1024 * 1024
MEMORY_KEYS = ("private_above_baseline", "file_above_baseline", "total_above_baseline")


@dataclass(frozen=True)
class Row:
    label: str
    loader: str
    source: Path
    dtype: str
    weight_dtype: str = "auto"


def _rows(component: Path, files: dict[str, Path], dtypes: list[str]) -> list[Row]:
    rows = []
    for dtype in dtypes:
        rows.append(Row("folder ours", "ours", component, dtype))
        rows.append(Row("folder diffusers", "diffusers", component, dtype))
        if "bf16" in files:
            rows.append(Row("file bf16", SINGLE_FILE_LOADER, files["bf16"], dtype))
    for fmt in ("fp8_scaled", "Q8_0"):
        if fmt not in files:
            continue
        # Kept as stored: computed in the first dtype (bf16 by default), weights dequantised per layer.
        rows.append(Row(f"file {fmt} kept", SINGLE_FILE_LOADER, files[fmt], dtypes[0], "auto"))
        for dtype in dtypes:
            rows.append(Row(f"file {fmt} -> {dtype}", SINGLE_FILE_LOADER, files[fmt], dtype, dtype))
    return rows


def _summarise(runs: list[dict]) -> dict:
    summary = dict(runs[0])
    summary["seconds"] = statistics.median(run["seconds"] for run in runs)
    for key in MEMORY_KEYS:
        summary[key] = max(run[key] for run in runs)
    return summary


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"


def _write(root: Path, args, formats: list[str]) -> tuple[Path, dict[str, Path]]:
    component = root / "transformer"
    files = {fmt: root / SINGLE_FILE_FORMATS[fmt] for fmt in formats}
    missing = [fmt for fmt, path in files.items() if not path.is_file()]
    if (component / "config.json").is_file() and not missing:
        return component, files
    start = time.perf_counter()
    model = random_transformer(
        num_layers=args.layers,
        vace_every=args.vace_every,
        num_attention_heads=args.heads,
        attention_head_dim=args.head_dim,
        ffn_mult=args.ffn_mult,
    )
    # One model for every layout, so that the rows load the same weights.
    write_transformer_folder(root, model=model)
    files.update(write_single_files(root, formats, model=model))
    del model
    names = ", ".join(path.name for path in files.values())
    print(f"wrote {component} and {names} in {time.perf_counter() - start:.1f} s")
    return component, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model (one VACE block) and one repeat")
    parser.add_argument("--layers", type=int, default=8, help="num_layers of the transformer")
    parser.add_argument("--vace-every", type=int, default=4, help="a VACE block every N layers")
    parser.add_argument("--heads", type=int, default=12, help="num_attention_heads")
    parser.add_argument("--head-dim", type=int, default=128, help="attention_head_dim")
    parser.add_argument("--ffn-mult", type=int, default=4, help="ffn_dim = ffn_mult * heads * head_dim")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated target dtypes (bf16, fp16, fp32)")
    parser.add_argument(
        "--formats",
        default=",".join(SINGLE_FILE_FORMATS),
        help=f"comma-separated single-file layouts ({', '.join(SINGLE_FILE_FORMATS)}); empty: folder rows only",
    )
    parser.add_argument("--repeats", type=int, default=1, help="loads per row, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the loading processes")
    parser.add_argument("--folder", help="reuse (or create) this folder: its transformer/ and single files")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.vace_every, args.repeats = 2, 2, 1
    dtypes = args.dtypes.split(",")
    formats = [fmt for fmt in args.formats.split(",") if fmt]
    unknown = set(formats) - set(SINGLE_FILE_FORMATS)
    if unknown:
        parser.error(f"unknown --formats {sorted(unknown)}; known: {', '.join(SINGLE_FILE_FORMATS)}")

    with tempfile.TemporaryDirectory(prefix="wanvace-bench-load-") as scratch:
        root = Path(args.folder) if args.folder else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        component, files = _write(root, args, formats)
        sizes = [f"folder {sum(p.stat().st_size for p in component.glob('*.safetensors')) / MIB:.0f}"]
        sizes += [f"{fmt} {path.stat().st_size / MIB:.0f}" for fmt, path in files.items()]
        print(f"weights on disk (MiB): {', '.join(sizes)}; {args.threads} torch threads; peaks in MiB")

        rows = _rows(component, files, dtypes)
        runs: dict[Row, list[dict]] = {row: [] for row in rows}
        for _ in range(args.repeats):
            for row in rows:
                runs[row].append(
                    measure_load_in_subprocess(
                        row.loader, row.source, row.dtype, threads=args.threads, weight_dtype=row.weight_dtype
                    )
                )
        results = {row: _summarise(found) for row, found in runs.items()}

    header = (
        f"{'dtype':5} {'row':22} {'component':>9} {'time s':>7} {'private':>8} {'file':>6} {'total':>7} "
        f"{'private/comp':>12} {'total/comp':>10} {'used: private':>13} {'file':>6}"
    )
    print(header)
    print("-" * len(header))
    for row, run in results.items():
        size = run["component_bytes"]
        print(
            f"{row.dtype:5} {row.label:22} {size / MIB:9.0f} {run['seconds']:7.2f} "
            f"{run['private_above_baseline'] / MIB:8.0f} {run['file_above_baseline'] / MIB:6.0f} "
            f"{run['total_above_baseline'] / MIB:7.0f} {run['private_above_baseline'] / size:12.3f} "
            f"{run['total_above_baseline'] / size:10.3f} {run['private_after_use'] / MIB:13.0f} "
            f"{run['file_after_use'] / MIB:6.0f}"
        )
    print()
    print("each row / folder ours at the same dtype (lower is better; private '-': folder ours holds ~none)")
    print(f"{'dtype':5} {'row':22} {'component':>9} {'time':>7} {'private':>8} {'total':>7}")
    for row, run in results.items():
        if row.loader == "ours":
            continue
        base = next(results[other] for other in results if other.loader == "ours" and other.dtype == row.dtype)
        private = "private_above_baseline"
        used = base[private] > 0.1 * base["component_bytes"]  # else bf16 used in place: a ratio to a few MiB
        print(
            f"{row.dtype:5} {row.label:22} {_ratio(run['component_bytes'], base['component_bytes']):>9} "
            f"{_ratio(run['seconds'], base['seconds']):>7} {_ratio(run[private], base[private]) if used else '-':>8} "
            f"{_ratio(run['total_above_baseline'], base['total_above_baseline']):>7}"
        )


if __name__ == "__main__":
    main()
