"""Seconds per CFG step of A14B-shaped blocks with each fast-path option alone, all together, and ComfyUI's own Wan
VACE model at its best settings on the same weights (needs CUDA).

    python3 bench/bench_fast_path_gpu.py [--sizes 480x832x81,720x1280x81] [--layers 4] [--steps 3]
    python3 bench/bench_fast_path_gpu.py --device cpu --tiny      # CPU check of the logic (times mean nothing)

The expert has the Wan2.2-VACE-Fun-A14B block shape (dim 5120, 40 heads of 128, ffn 13824, text 4096) with
`--layers` main blocks (default 4 of 40) and the real VACE layout (a VACE block every 5 layers: 1 of 8 for 4
layers), random weights drawn on the device (`bench_single_file_gpu.build_expert`). Every figure is for those
blocks; the "x48/5" column scales a row to the full expert's 40 + 8 blocks by block count (embeddings and head,
under 1% of a step, are not scaled). Rows, each a CFG step (two passes) after `--warmup` untimed steps (compile
compiles there), median of `--steps`:

- today: bf16 weights, attention `native`, separate passes, eager;
- one option each: `attention=auto`; `compile`; `fp8_matmul` (fp8 e4m3 weights with per-tensor scales, as the
  fp8_scaled files are kept); `batched_cfg` (one call of batch 2);
- all: fp8 weights + fp8_matmul + attention auto + compile + batched CFG;
- ComfyUI best: `comfy.ldm.wan.model.VaceWanModel` from the ComfyUI tree at `$WANVACE_COMFY_DIR` (gpu_check.sh
  points it at the copy `bench/gpu_wheels.sh` makes), the same bf16 weights, batched cond/uncond as its sampler
  does, attention SageAttention when `sageattention` imports (what `--use-sage-attention` runs), else PyTorch SDPA.

Ratios are measured side by side in this run: each row against today and against ComfyUI best; MFU is the blocks'
matmul FLOPs per second over `--peak-tflops` (dense bf16; 989 for an H100/H200 SXM). `--json PATH` writes
bench/gpu_check.sh's rows after each measurement. Without CUDA (and without `--device cpu`) it prints
"no CUDA device" and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_offload_gpu import A14B, TINY  # noqa: E402
from bench.bench_single_file_gpu import _inputs, _parse_size, _relative_error, _sync, build_expert  # noqa: E402
from bench.comfy_wan import ComfyWeightsRefused, comfy_vace_model  # noqa: E402
from wanvace_core.runtime.attention import apply_attention, resolve_attention  # noqa: E402
from wanvace_core.runtime.fp8_matmul import apply_fp8_matmul  # noqa: E402
from wanvace_core.runtime.regional_compile import apply_regional_compile  # noqa: E402

TODAY = "today"  # bf16, attention native, separate passes, eager
COMFY = "ComfyUI_best"
OPTIONS = {
    TODAY: {},
    "attention_auto": {"attention": "auto"},
    "compile": {"compile": True},
    "fp8_matmul": {"fp8": True},
    "batched_cfg": {"batched": True},
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


def _ours(expert, options: dict, device: torch.device) -> None:
    apply_fp8_matmul(expert, options.get("fp8", False))
    apply_attention(expert, resolve_attention(options.get("attention", "native"), device))
    apply_regional_compile(expert, options.get("compile", False))


def _step_fn(expert, inputs: dict, batched: bool):
    pair = {
        name: torch.cat([value, value]) if torch.is_tensor(value) and name != "control_hidden_states_scale" else value
        for name, value in inputs.items()
    }

    def step():
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

    def step():
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


def _measure(step, warmup: int, steps: int, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        first = time.perf_counter()
        for _ in range(warmup):
            output = step()
        _sync(device)
        warmup_s = time.perf_counter() - first
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            output = step()
            _sync(device)
            times.append(time.perf_counter() - start)
    return {
        "step_s": statistics.median(times),
        "warmup_s": warmup_s,
        "peak_vram": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "output": output.float().cpu(),
    }


def _comfy_model(expert, device: torch.device):
    """ComfyUI's VaceWanModel over the expert's weights (original Wan names), or the reason it cannot be built."""
    comfy_dir = os.environ.get("WANVACE_COMFY_DIR")
    if comfy_dir:
        sys.path.append(comfy_dir)
    try:
        from comfy.cli_args import args as comfy_args

        comfy_args.cpu = device.type != "cuda"
        import comfy.ldm.modules.attention as comfy_attention
        import comfy.ldm.wan.model as comfy_wan
    except ImportError as error:
        return None, f"ComfyUI's comfy package does not import ({error}); set WANVACE_COMFY_DIR to a ComfyUI tree"
    try:
        import sageattention  # noqa: F401

        comfy_wan.optimized_attention, attention = comfy_attention.attention_sage, "sage"
    except ImportError:
        comfy_wan.optimized_attention, attention = comfy_attention.attention_pytorch, "pytorch"
    try:
        model = comfy_vace_model(expert, dtype=torch.bfloat16, device=device)
    except ComfyWeightsRefused as error:
        return None, str(error)
    return model, f"batched, {attention} attention"


def _rows(results: dict, sizes, layers: int, mfu: dict) -> list[dict]:
    rows = []
    for size in sizes:
        today, comfy = results.get((TODAY, size)), results.get((COMFY, size))
        for name in [*OPTIONS, COMFY]:
            run = results.get((name, size))
            if run is None:
                continue
            ratios = {}
            if today is not None and name != TODAY:
                ratios["today/this"] = today["step_s"] / run["step_s"]
            if comfy is not None and name != COMFY:
                ratios["ComfyUI/this"] = comfy["step_s"] / run["step_s"]
            blocks = layers + len(range(0, layers, 5))
            note = f"x48/{blocks} {run['step_s'] * 48 / blocks:.1f} s"
            note += f"; MFU {mfu[size] / run['step_s']:.0%}; warm-up {run['warmup_s']:.1f} s"
            if today is not None and name != TODAY:
                note += f"; out rel err {_relative_error(run['output'], today['output']):.4f}"
            if run.get("how"):
                note += f"; {run['how']}"
            peak = run["peak_vram"] / 2**30 if run["peak_vram"] else None
            rows.append(
                {
                    "row": f"{'x'.join(map(str, size))} {name}",
                    "seconds": run["step_s"],
                    "peak_gib": peak,
                    "ratios": ratios,
                    "note": note,
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU check of the logic)")
    parser.add_argument("--sizes", default="480x832x81,720x1280x81", help="HxWxF, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="main blocks (of 40); VACE blocks every 5 layers")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--rows", default=",".join(OPTIONS), help="which of our rows to run, comma-separated")
    parser.add_argument("--no-comfy", action="store_true", help="leave out ComfyUI's model")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    config = _config(TINY if args.tiny else A14B, args.layers)
    sizes = [_parse_size(text) for text in args.sizes.split(",")]
    results, mfu = {}, {}
    experts = {fmt: build_expert(config, fmt, device) for fmt in ("bf16", "fp8")}
    comfy_model, comfy_how = (None, "left out") if args.no_comfy else _comfy_model(experts["bf16"], device)
    chosen = args.rows.split(",")
    unknown = set(chosen) - set(OPTIONS)
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; choose from {', '.join(OPTIONS)}")
    print(
        f"{'tiny' if args.tiny else 'A14B-shaped'} blocks: {args.layers} main + {len(config['vace_layers'])} VACE; "
        f"ComfyUI: {comfy_how}"
    )

    def write() -> None:
        if args.json:
            report = {
                "bench": "fast path vs ComfyUI",
                "device": device.type,
                "config": f"{'tiny' if args.tiny else 'A14B'} blocks, {args.layers} + {len(config['vace_layers'])} "
                f"VACE, bf16, 1 CFG step = 2 passes, median of {args.steps}",
                "time_unit": "s/step",
                "rows": _rows(results, sizes, args.layers, mfu),
            }
            Path(args.json).write_text(json.dumps(report, indent=1))

    for size in sizes:
        inputs = _inputs(config, size, device, 512 if not args.tiny else 16)
        tokens = inputs["hidden_states"][0, 0].numel() // 4  # 2x2 patches
        mfu[size] = (
            2 * _block_flops(config, tokens, inputs["encoder_hidden_states"].shape[1]) / (args.peak_tflops * 1e12)
        )
        for name in chosen:
            options = OPTIONS[name]
            expert = experts["fp8" if options.get("fp8") else "bf16"]
            _ours(expert, options, device)
            run = _measure(_step_fn(expert, inputs, options.get("batched", False)), args.warmup, args.steps, device)
            _ours(expert, {}, device)
            results[name, size] = run
            print(
                f"{'x'.join(map(str, size))} {name:40s} {run['step_s']:8.3f} s/step (warm-up {run['warmup_s']:.1f} s)"
            )
            write()
            gc.collect()
        if comfy_model is not None:
            run = _measure(_comfy_step(comfy_model, inputs), args.warmup, args.steps, device)
            results[COMFY, size] = {**run, "how": comfy_how}
            print(f"{'x'.join(map(str, size))} {COMFY:40s} {run['step_s']:8.3f} s/step")
            write()
    for row in _rows(results, sizes, args.layers, mfu):
        ratios = "  ".join(f"{label} {value:.2f}" for label, value in row["ratios"].items())
        print(f"  {row['row']:48s} {row['seconds']:8.3f} s  {ratios}  {row['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
