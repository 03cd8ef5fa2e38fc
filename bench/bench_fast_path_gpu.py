"""Seconds per CFG step of A14B-shaped blocks with each fast-path option alone, all together, and ComfyUI's own Wan
VACE model at its best settings on the same weights (needs CUDA).

    python3 bench/bench_fast_path_gpu.py [--sizes 480x832x81] [--layers 4] [--steps 3] [--peak-tflops T]
    python3 bench/bench_fast_path_gpu.py --device cpu --tiny      # CPU check of the logic (times mean nothing)

The expert has the Wan2.2-VACE-Fun-A14B block shape (dim 5120, 40 heads of 128, ffn 13824, text 4096) with
`--layers` main blocks (default 4 of 40) and the real VACE layout (a VACE block every 5 layers: 1 of 8 for 4
layers), random weights drawn on the device (`bench_single_file_gpu.build_expert`). Every figure is for those
blocks; the "x48/5" note scales a row to the full expert's 40 + 8 blocks by block count (embeddings and head,
under 1% of a step, are not scaled). Rows, each a CFG step (two passes), `--warmup` untimed steps (compile
compiles there) then `--steps` (>= 3) timed ones: their median and spread ((max - min) / median):

- today: bf16 weights, attention `native`, separate passes, eager;
- one option each: `attention=auto`; `fp8_matmul` (fp8 e4m3 weights with per-tensor scales, as the fp8_scaled
  files are kept), and the same with `use_fast_accum` (a measured option: the product leaves it off); `batched_cfg`
  (one call of batch 2); `compile` (regional: the graphs dynamo compiled in the warm-up are counted, and a
  recompile during the timed steps marks the row failed);
- all: fp8 weights + fp8_matmul + attention auto + compile + batched CFG;
- ComfyUI best, built after our rows: `comfy.ldm.wan.model.VaceWanModel` from the ComfyUI tree at
  `$WANVACE_COMFY_DIR` (gpu_check.sh points it at the copy `bench/gpu_wheels.sh` makes), the same bf16 weights,
  batched cond/uncond as its sampler does, `attention_sage` when `sageattention` imports (what
  `--use-sage-attention` runs), else `attention_pytorch`. Its attention calls are counted: the row says whether
  SageAttention really ran or ComfyUI fell back to PyTorch SDPA. Any exception there is that row's failure.

Ratios are measured side by side in this run: each row against today and against ComfyUI best. MFU is the blocks'
matmul FLOPs per second over `--peak-tflops`, the bf16 GEMM rate bench/gpu_probe.py measured on this machine
(gpu_check.sh passes it on; without it no MFU is shown). With several `--sizes`, dynamo is reset between sizes, so
each size's compile rows trace their graphs once, statically, as a first run at that size does (gpu_check.sh runs
one size per process). `--json PATH` writes bench/gpu_check.sh's rows after each measurement. Exits 1 if a row
failed (the others are kept). Without CUDA (and without `--device cpu`) it prints "no CUDA device" and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_offload_gpu import A14B, TINY  # noqa: E402
from bench.bench_single_file_gpu import _inputs, _parse_size, _relative_error, build_expert  # noqa: E402
from bench.comfy_wan import ComfyAttentionCounter, comfy_vace_model  # noqa: E402
from bench.timing import row_timing, timed_steps  # noqa: E402
from wanvace_core.runtime.attention import apply_attention, resolve_attention  # noqa: E402
from wanvace_core.runtime.fp8_matmul import apply_fp8_matmul  # noqa: E402
from wanvace_core.runtime.regional_compile import apply_regional_compile  # noqa: E402


def _version(distribution: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


TODAY = "today"  # bf16, attention native, separate passes, eager
COMFY = "ComfyUI_best"
OPTIONS = {
    TODAY: {},
    "attention_auto": {"attention": "auto"},
    "fp8_matmul": {"fp8": True},
    "fp8_fast_accum": {"fp8": True, "fast_accum": True},
    "batched_cfg": {"batched": True},
    "compile": {"compile": True},
    "all": {"attention": "auto", "compile": True, "fp8": True, "batched": True},
}


def _config(base: dict, layers: int) -> dict:
    return {**base, "num_layers": layers, "vace_layers": list(range(0, layers, 5))}


def _block_flops(config: dict, tokens: int, text_tokens: int) -> float:
    """Matmul FLOPs of one forward of the blocks (main and VACE) for one sample."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    ffn = config["ffn_dim"]
    self_attention = 2 * tokens * dim * dim * 4 + 4 * tokens * tokens * dim
    cross_attention = 2 * tokens * dim * dim * 2 + 2 * text_tokens * dim * dim * 2 + 4 * tokens * text_tokens * dim
    feed_forward = 2 * tokens * dim * ffn * 2
    block = self_attention + cross_attention + feed_forward
    vace_projections = 2 * tokens * dim * dim * 2  # proj_in and proj_out of each VACE block
    return config["num_layers"] * block + len(config["vace_layers"]) * (block + vace_projections)


def _ours(expert, options: dict, device: torch.device) -> str:
    """Sets the row's options on the expert; returns the attention backend that runs."""
    apply_fp8_matmul(expert, options.get("fp8", False), fast_accum=options.get("fast_accum", False))
    backend = resolve_attention(options.get("attention", "native"), device)
    apply_attention(expert, backend)
    apply_regional_compile(expert, options.get("compile", False))
    return backend


def _step_fn(expert, inputs: dict, batched: bool):
    pair = {
        name: torch.cat([value, value]) if torch.is_tensor(value) and name != "control_hidden_states_scale" else value
        for name, value in inputs.items()
    }

    def step(_index: int):
        if batched:
            cond, uncond = expert(**pair)[0].chunk(2)
        else:
            cond, uncond = expert(**inputs)[0], expert(**inputs)[0]
        return uncond + 5.0 * (cond - uncond)

    return step


def _comfy_step(comfy_model, inputs: dict):
    pair = {name: torch.cat([inputs[name], inputs[name]]) for name in ("hidden_states", "encoder_hidden_states")}
    control = torch.cat([inputs["control_hidden_states"]] * 2)
    timestep = torch.cat([inputs["timestep"]] * 2).float()

    def step(_index: int):
        out = comfy_model(
            pair["hidden_states"],
            timestep,
            pair["encoder_hidden_states"],
            vace_context=control[:, None],
            vace_strength=[1.0],
        )
        cond, uncond = out.chunk(2)
        return uncond + 5.0 * (cond - uncond)

    return step


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _measure(step, warmup: int, steps: int, device: torch.device) -> dict:
    """The step timed (`bench.timing.timed_steps`), with its peak VRAM and the dynamo graphs compiled in the warm-up
    and (never wanted) during the timed steps."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    marks = {"start": _graphs()}
    with torch.no_grad():
        result = timed_steps(step, warmup, steps, device, after_warmup=lambda: marks.update(warm=_graphs()))
    result["graphs_warmup"] = marks["warm"] - marks["start"]
    result["graphs_timed"] = _graphs() - marks["warm"]
    result["peak_vram"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    result["output"] = result["output"].float().cpu()
    return result


def _import_comfy(device: torch.device):
    """ComfyUI's attention and Wan model modules from the tree at $WANVACE_COMFY_DIR (or on sys.path)."""
    comfy_dir = os.environ.get("WANVACE_COMFY_DIR")
    if comfy_dir and comfy_dir not in sys.path:
        sys.path.append(comfy_dir)
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = device.type != "cuda"
    import comfy.ldm.modules.attention as comfy_attention
    import comfy.ldm.wan.model as comfy_wan

    return comfy_attention, comfy_wan


def _comfy_run(expert, inputs: dict, warmup: int, steps: int, device: torch.device) -> dict:
    """ComfyUI's VaceWanModel over the expert's weights at its best attention, timed; which attention really ran
    is read from counted calls. Raises whatever ComfyUI raises (the caller makes it the row's failure)."""
    comfy_attention, comfy_wan = _import_comfy(device)
    # What ComfyUI's --use-sage-attention would run: its own check that `sageattention` imports.
    if getattr(comfy_attention, "SAGE_ATTENTION_IS_AVAILABLE", False):
        best, version = "attention_sage", _version("sageattention")
    else:
        best, version = "attention_pytorch", None
    model = comfy_vace_model(expert, dtype=torch.bfloat16, device=device)
    previous = comfy_wan.optimized_attention
    try:
        with ComfyAttentionCounter(comfy_attention) as counter:
            # Chosen inside the counter: `attention_pytorch` is then the counting one (and what `attention_sage`
            # falls back to).
            comfy_wan.optimized_attention = getattr(comfy_attention, best)
            run = _measure(_comfy_step(model, inputs), warmup, steps, device)
    finally:
        comfy_wan.optimized_attention = previous
        del model
    run["how"] = "batched cond/uncond; attention " + counter.describe(version)
    run["attention"] = counter.ran()
    return run


def _rows(results: dict, sizes, layers: int, mfu: dict) -> list[dict]:
    rows = []
    blocks = layers + len(range(0, layers, 5))
    for size in sizes:
        today, comfy = results.get((TODAY, size)), results.get((COMFY, size))
        today = today if today and "failed" not in today else None
        comfy = comfy if comfy and "failed" not in comfy else None
        for name in [*OPTIONS, COMFY]:
            run = results.get((name, size))
            if run is None:
                continue
            label = f"{'x'.join(map(str, size))} {name}"
            if "failed" in run:
                rows.append({"row": label, "seconds": None, "failed": run["failed"]})
                continue
            ratios = {}
            if today is not None and name != TODAY:
                ratios["today/this"] = today["median_s"] / run["median_s"]
            if comfy is not None and name != COMFY:
                ratios["ComfyUI/this"] = comfy["median_s"] / run["median_s"]
            notes = [f"x48/{blocks} {run['median_s'] * 48 / blocks:.1f} s"]
            if mfu.get(size):
                notes.append(f"MFU {mfu[size] / run['median_s']:.0%}")
            notes.append(f"warm-up {run['warmup_s']:.1f} s")
            if run.get("graphs_warmup"):
                notes.append(f"{run['graphs_warmup']} graphs compiled")
            if today is not None and name != TODAY:
                notes.append(f"out rel err {_relative_error(run['output'], today['output']):.4f}")
            if run.get("backend"):
                notes.append(f"attention {run['backend']}")
            if run.get("how"):
                notes.append(run["how"])
            row = {
                "row": label,
                **row_timing(run),
                "peak_gib": run["peak_vram"] / 2**30 if run["peak_vram"] else None,
                "ratios": ratios,
                "note": "; ".join(notes),
            }
            if run.get("graphs_timed"):
                row["failed"] = f"dynamo compiled {run['graphs_timed']} graphs during the timed steps"
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU check of the logic)")
    parser.add_argument("--sizes", default="480x832x81", help="HxWxF, comma-separated (one per process is best)")
    parser.add_argument("--layers", type=int, default=4, help="main blocks (of 40); VACE blocks every 5 layers")
    parser.add_argument("--steps", type=int, default=3, help="timed CFG steps per row (>= 3)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--peak-tflops", type=float, help="the measured bf16 GEMM rate (MFU's denominator)")
    parser.add_argument("--rows", default=",".join(OPTIONS), help="which of our rows to run, comma-separated")
    parser.add_argument("--no-comfy", action="store_true", help="leave out ComfyUI's model")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    chosen = args.rows.split(",")
    unknown = set(chosen) - set(OPTIONS)
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; choose from {', '.join(OPTIONS)}")
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 timed steps (a median and a spread)")
    config = _config(TINY if args.tiny else A14B, args.layers)
    sizes = [_parse_size(text) for text in args.sizes.split(",")]
    results, mfu = {}, {}
    formats = {"fp8" if OPTIONS[name].get("fp8") else "bf16" for name in chosen} | {"bf16"}
    experts = {fmt: build_expert(config, fmt, device) for fmt in sorted(formats)}
    peak = f"; MFU against {args.peak_tflops:.0f} TFLOP/s (measured)" if args.peak_tflops else "; no MFU"
    print(
        f"{'tiny' if args.tiny else 'A14B-shaped'} blocks: {args.layers} main + {len(config['vace_layers'])} VACE{peak}"
    )

    def write() -> None:
        if args.json:
            report = {
                "bench": "fast path vs ComfyUI",
                "device": device.type,
                "config": f"{'tiny' if args.tiny else 'A14B'} blocks, {args.layers} + {len(config['vace_layers'])} "
                f"VACE, 1 CFG step = 2 passes, {args.warmup} warm-up + median of {args.steps}"
                + (f", MFU vs {args.peak_tflops:.0f} TFLOP/s measured" if args.peak_tflops else ""),
                "time_unit": "per CFG step",
                "rows": _rows(results, sizes, args.layers, mfu),
            }
            Path(args.json).write_text(json.dumps(report, indent=1))

    def failed(name: str, size, error: BaseException) -> None:
        traceback.print_exc()
        results[name, size] = {"failed": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"}
        print(f"{'x'.join(map(str, size))} {name:40s} FAILED: {results[name, size]['failed']}", flush=True)

    for index, size in enumerate(sizes):
        if index:
            torch._dynamo.reset()  # this size's compile rows trace once, statically, as a first run at it does
        inputs = _inputs(config, size, device, 512 if not args.tiny else 16)
        tokens = inputs["hidden_states"][0, 0].numel() // 4  # 2x2 patches
        if args.peak_tflops:
            flops = 2 * _block_flops(config, tokens, inputs["encoder_hidden_states"].shape[1])
            mfu[size] = flops / (args.peak_tflops * 1e12)
        for name in chosen:
            options = OPTIONS[name]
            expert = experts["fp8" if options.get("fp8") else "bf16"]
            try:
                backend = _ours(expert, options, device)
                run = _measure(_step_fn(expert, inputs, options.get("batched", False)), args.warmup, args.steps, device)
                results[name, size] = {**run, "backend": backend}
                print(
                    f"{'x'.join(map(str, size))} {name:40s} {run['median_s']:8.3f} s/step "
                    f"(spread {run['spread']:.1%}, warm-up {run['warmup_s']:.1f} s, "
                    f"{run['graphs_warmup']} graphs compiled)",
                    flush=True,
                )
            except Exception as error:  # one row's failure is that row's; the others still run
                failed(name, size, error)
            finally:
                _ours(expert, {}, device)
            write()
            gc.collect()
        if not args.no_comfy:
            try:
                run = _comfy_run(experts["bf16"], inputs, args.warmup, args.steps, device)
                results[COMFY, size] = run
                print(f"{'x'.join(map(str, size))} {COMFY:40s} {run['median_s']:8.3f} s/step; {run['how']}")
            except Exception as error:  # ComfyUI's failure (import, weights, kernels) is its row's only
                failed(COMFY, size, error)
            write()
            gc.collect()
    rows = _rows(results, sizes, args.layers, mfu)
    for row in rows:
        if "failed" in row and row.get("seconds") is None:
            print(f"  {row['row']:48s} FAILED: {row['failed']}")
            continue
        ratios = "  ".join(f"{label} {value:.2f}" for label, value in row["ratios"].items())
        print(f"  {row['row']:48s} {row['seconds']:8.3f} s (spread {row['spread']:.1%})  {ratios}  {row['note']}")
    return 1 if any("failed" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
