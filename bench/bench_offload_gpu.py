"""Peak VRAM and per-step time of the A14B expert architecture under each offload mode (needs CUDA).

    .venvs/current/bin/python bench/bench_offload_gpu.py [--height 480 --width 832 --frames 81 --steps 3 --prefetch 1]
    .venvs/current/bin/python bench/bench_offload_gpu.py --device cpu --tiny    # CPU check of the logic, seconds

Builds two Wan2.2-VACE-Fun-A14B-sized experts (40 blocks + 8 VACE blocks, dim 5120) with random bf16
weights (no download; both experts share one host copy of the weights, so host RAM holds ~35 GB),
runs `--warmup` untimed and `--steps` (>= 3) timed CFG steps per mode (high-noise expert for the first half,
low-noise for the rest) and prints the median step time and its spread, peak VRAM, host RSS (private and
file-backed) and the layerwise/none overhead. Mode `group` is diffusers' `apply_group_offloading` (block level, one
block per group, side stream, next group prefetched) on the same experts: `group/layerwise` is the figure that
decides between it and our layerwise residency (wanvace_core/runtime/offload.py). With streams it pins a host copy
of the expert (~35 GB more host memory here; the experts share weights, so one expert under it runs every step);
`--group-low-cpu-mem` pins per transfer instead. `--json PATH` also writes the rows (bench/gpu_check.sh's table),
rewritten after each mode so a run stopped by its time limit keeps the modes it finished. `--device cpu --tiny`: a
tiny config of the same architecture on the CPU "device" (every mode, outputs compared bitwise; times mean nothing).
Without CUDA (and without `--device cpu`) it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rss import read_status
from bench.timing import row_timing, timed_steps
from wanvace_core.runtime.interleave import apply_interleaved_vace
from wanvace_core.runtime.offload import EXPERTS, Offloader, OffloadOptions

A14B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
    "vace_layers": list(range(0, 40, 5)),
    "vace_in_channels": 96,
}
# The same architecture, small enough for a CPU check of the benches' logic (bench/gpu_check.sh runs it).
TINY = {
    **A14B,
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "text_dim": 64,
    "freq_dim": 32,
    "ffn_dim": 128,
    "num_layers": 4,
    "vace_layers": [0, 2],
}
TEXT_TOKENS = 512  # umt5's padded prompt length


def _expert_pair(config: dict, dtype: torch.dtype, device: torch.device):
    """Two experts on the CPU whose parameters share one set of random host tensors."""
    from accelerate import init_empty_weights
    from diffusers import WanVACETransformer3DModel

    keep_fp32 = set(WanVACETransformer3DModel._keep_in_fp32_modules)
    with init_empty_weights(include_buffers=False):
        first = WanVACETransformer3DModel(**config)
        second = WanVACETransformer3DModel(**config)
    generator = torch.Generator(device).manual_seed(0)
    for (name, param), (_, twin) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        target = torch.float32 if keep_fp32 & set(name.split(".")) else dtype
        # Random numbers are drawn on the GPU (fast) and kept in host memory.
        host = torch.empty(param.shape, dtype=target, device=device).normal_(0, 0.02, generator=generator).cpu()
        param_host = torch.nn.Parameter(host, requires_grad=False)
        for module, leaf in ((first, name), (second, name)):
            owner = module.get_submodule(leaf.rpartition(".")[0]) if "." in leaf else module
            owner._parameters[leaf.rpartition(".")[2]] = param_host
        del twin
    for expert in (first, second):
        expert.eval().requires_grad_(False)
        apply_interleaved_vace(expert)
    return first, second


def _inputs(args, config: dict, dtype, device: torch.device, text_tokens: int):
    frames = (args.frames - 1) // 4 + 1
    shape = (1, config["in_channels"], frames, args.height // 8, args.width // 8)
    return {
        "hidden_states": torch.randn(shape, device=device, dtype=dtype),
        "timestep": torch.tensor([900], device=device),
        "encoder_hidden_states": torch.randn(1, text_tokens, config["text_dim"], device=device, dtype=dtype),
        "control_hidden_states": torch.randn((1, config["vace_in_channels"], *shape[2:]), device=device, dtype=dtype),
        "control_hidden_states_scale": torch.ones(len(config["vace_layers"]), device=device, dtype=dtype),
        "return_dict": False,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_mode(mode: str, experts, inputs, args, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    components = dict(zip(EXPERTS, experts, strict=True))
    offloader = None
    if mode == "none":
        for expert in experts:
            expert.to(device)
    elif mode == "group":
        # The two experts share their weights, so one expert under group offloading runs every step: one pinned
        # host copy (~35 GB at A14B size) instead of two.
        experts = (experts[0], experts[0])
        _apply_diffusers_group_offloading(experts[:1], args, device)
    else:
        options = OffloadOptions(mode=mode, prefetch_blocks=args.prefetch, max_pinned_mb=args.max_pinned_mb)
        offloader = Offloader(components, options, device=device)
    try:
        return _measure(experts, inputs, args, mode, device)
    finally:
        if offloader is not None:
            offloader.close()
        elif mode == "group":
            _remove_diffusers_group_offloading(experts[:1])
        else:
            for expert in experts:
                expert.to("cpu")


def _apply_diffusers_group_offloading(experts, args, device: torch.device) -> None:
    """diffusers' own block-level offloading, at the settings that make it fastest: one block per group, copies on a
    side stream with the next group prefetched (on CUDA), pinned host copies made once unless --group-low-cpu-mem."""
    from diffusers.hooks import apply_group_offloading

    for expert in experts:
        apply_group_offloading(
            expert,
            onload_device=device,
            offload_device="cpu",
            offload_type="block_level",
            num_blocks_per_group=1,
            non_blocking=device.type == "cuda",
            use_stream=device.type == "cuda",
            low_cpu_mem_usage=args.group_low_cpu_mem,
        )


def _remove_diffusers_group_offloading(experts) -> None:
    from diffusers.hooks import HookRegistry

    for expert in experts:
        registry = HookRegistry.check_if_exists_or_initialize(expert)
        # The hook names diffusers.hooks.group_offloading registers (0.36 and 0.42).
        for name in ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading"):
            registry.remove_hook(name, recurse=True)
        expert.to("cpu")


def _measure(experts, inputs, args, mode: str, device: torch.device) -> dict:
    """`--warmup` untimed then `--steps` timed CFG steps, the high-noise expert for the first half of them and the
    low-noise one for the rest (in `model` mode a timed step includes the swap)."""
    total = args.warmup + args.steps

    def step(index: int) -> torch.Tensor:
        expert = experts[0] if index < (total + 1) // 2 else experts[1]
        with torch.no_grad():
            cond = expert(**inputs)[0]
            uncond = expert(**inputs)[0]
            return (uncond + 5.0 * (cond - uncond)).float().cpu()

    timing = timed_steps(step, args.warmup, args.steps, device)
    return {
        "mode": mode,
        **timing,
        "peak_vram_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "host_private_gb": read_status()["RssAnon"] / 2**30,
        "host_file_gb": read_status()["RssFile"] / 2**30,
    }


def _rows(results: dict) -> list[dict]:
    """The rows of bench/gpu_check.sh's table: per mode, its step time and peak VRAM, and the ratios to `none`."""
    rows = []
    for mode, r in results.items():
        ratios, note = {}, ""
        if mode != "none" and "none" in results:
            ratios["step/none"] = r["median_s"] / results["none"]["median_s"]
            peak, base_peak = r["peak_vram_gb"], results["none"]["peak_vram_gb"]
            if peak is not None and base_peak:
                ratios["VRAM/none"] = peak / base_peak
            note = "bitwise = none" if torch.equal(r["output"], results["none"]["output"]) else "DIFFERS from none"
        if mode == "group" and "layerwise" in results:
            ratios["step/layerwise"] = r["median_s"] / results["layerwise"]["median_s"]
        rows.append({"row": mode, **row_timing(r), "peak_gib": r["peak_vram_gb"], "ratios": ratios, "note": note})
    return rows


def _write_json(path: str | None, config_text: str, device: torch.device, results: dict) -> None:
    if path:
        report = {
            "bench": "offload",
            "device": device.type,
            "config": config_text,
            "time_unit": "per CFG step",
            "rows": _rows(results),
        }
        Path(path).write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: with --tiny, the logic")
    parser.add_argument("--tiny", action="store_true", help="a tiny config of the same architecture (default 64x64x9)")
    parser.add_argument("--height", type=int, default=None, help="pixels (default 480; --tiny 64)")
    parser.add_argument("--width", type=int, default=None, help="pixels (default 832; --tiny 64)")
    parser.add_argument("--frames", type=int, default=None, help="4n+1 (default 81; --tiny 9)")
    parser.add_argument("--steps", type=int, default=3, help="timed CFG steps per mode (>= 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed CFG steps before them")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--max-pinned-mb", type=int, default=0)
    parser.add_argument(
        "--modes", default="none,model,layerwise,group", help="group: diffusers' apply_group_offloading, block level"
    )
    parser.add_argument(
        "--group-low-cpu-mem", action="store_true", help="group: pin per transfer instead of one pinned copy"
    )
    parser.add_argument("--json", help="also write the rows here as JSON (bench/gpu_check.sh's table)")
    args = parser.parse_args()
    for name, full, tiny in (("height", 480, 64), ("width", 832, 64), ("frames", 81, 9)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return
    config, text_tokens = (TINY, 16) if args.tiny else (A14B, TEXT_TOKENS)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    config_text = f"{args.width}x{args.height}x{args.frames}, {args.warmup} warm-up + median of {args.steps} CFG steps"
    config_text += ", tiny" if args.tiny else ""
    print(f"device: {name}; {config_text}")
    experts = _expert_pair(config, torch.bfloat16, device)
    inputs = _inputs(args, config, torch.bfloat16, device, text_tokens)
    expert_gb = sum(p.numel() * p.element_size() for p in experts[0].parameters()) / 2**30
    print(
        f"one expert's weights: {expert_gb:.1f} GB. The two experts share one set of weights here, so `none` "
        f"holds {expert_gb:.1f} GB of weights where a real pipeline holds {2 * expert_gb:.1f} GB."
    )
    results = {}
    for mode in args.modes.split(","):
        try:
            results[mode] = _run_mode(mode, experts, inputs, args, device)
        except torch.cuda.OutOfMemoryError:
            print(f"{mode:10s} out of memory")
            for expert in experts:
                expert.to("cpu")
            continue
        r = results[mode]
        vram = f"peak VRAM {r['peak_vram_gb']:6.1f} GB  " if r["peak_vram_gb"] is not None else ""
        print(
            f"{mode:10s} step {r['median_s']:7.2f} s (spread {r['spread']:.1%}, warm-up {r['warmup_s']:6.2f} s)  {vram}"
            f"host private {r['host_private_gb']:5.1f} GB  file-backed {r['host_file_gb']:5.1f} GB",
            flush=True,
        )
        _write_json(args.json, config_text, device, results)
    if "none" in results:
        for mode in ("model", "layerwise", "group"):
            if mode in results:
                ratio = results[mode]["median_s"] / results["none"]["median_s"]
                same = torch.equal(results[mode]["output"], results["none"]["output"])
                print(f"{mode}/none per-step time {ratio:.3f}; outputs bitwise equal: {same}")
    if "layerwise" in results and "group" in results:
        ratio = results["group"]["median_s"] / results["layerwise"]["median_s"]
        print(f"group/layerwise per-step time {ratio:.3f} (above 1: ours is faster)")


if __name__ == "__main__":
    main()
