"""Per-step time and peak VRAM of one A14B expert with bf16, kept fp8 and kept GGUF Q8_0 weights (needs CUDA).

    .venvs/current/bin/python bench/bench_single_file_gpu.py [--sizes 480x832x81,720x1280x81] [--steps 3]
                                                    [--formats bf16,fp8,q8_0] [--max-seconds 120]
    .venvs/current/bin/python bench/bench_single_file_gpu.py --device cpu --tiny    # CPU check of the logic

Builds the Wan2.2-VACE-Fun-A14B expert architecture (dim 5120, 40 heads, 40 layers, ffn 13824, 8 VACE
blocks) on meta and fills every tensor directly on the device with random weights (no download, no host
copy): bf16 as diffusers loads it (its fp32-kept modules in fp32); "fp8": each Linear a `QuantizedLinear`
holding float8_e4m3fn weights with a per-tensor absmax scale (the scaled_fp8 `WeightFormat` the
single-file loader keeps with `weight_dtype="auto"`), quantised from the same random bf16 weights on the
device; "q8_0": the block Linears as `QuantizedLinear` over GGUF Q8_0 blocks (as city96's files store
them; embeddings, time projection and head stay bf16), quantised by `quantize_q8_0` below, a torch port
of gguf-py's Q8_0 quantiser (bit-exact with `gguf.quants.quantize`, checked in the CPU mode; gguf-py's
numpy one would take minutes for 17B parameters). Every format draws the same random bf16 weights, so the
outputs are comparable: the relative error of each format's output against bf16's is printed.

Each format runs `--warmup` untimed and `--steps` (>= 3) timed CFG steps (two expert calls per step) per size,
one format resident at a time; it prints the median step time and its spread, peak VRAM, the weight bytes resident
on the device, and the ratios to bf16 measured side by side in the same run. Sizes after the first run only if
all formats are predicted to fit `--max-seconds` (from the first size's step times, scaled by the square
of the token count). `--json PATH` also writes the table's rows (bench/gpu_check.sh's table), rewritten after
each measurement so a run stopped by its time limit keeps what it finished. Without CUDA (and without
`--device cpu`) it prints "no CUDA device" and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The one A14B config of the GPU benches, and its tiny twin (every Linear's input width a multiple of 32, as Q8_0
# blocks need).
from bench.bench_offload_gpu import A14B, TINY
from bench.rss import read_status, tensor_bytes
from bench.timing import row_timing, sync, timed_steps
from wanvace_core.load.quantized import QuantizedLinear, WeightFormat, replace_linears
from wanvace_core.load.tensor_files import set_tensor
from wanvace_core.runtime.interleave import apply_interleaved_vace

FORMATS = ("bf16", "fp8", "q8_0")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
Q8_0_BLOCK = 32
FP8_FORMAT = WeightFormat("scaled_fp8", FP8)
Q8_0_FORMAT = WeightFormat("gguf", torch.uint8, "Q8_0")
# city96's GGUF files keep these Wan Linears unquantised (BF16): text/time embeddings, time projection, head.
GGUF_PLAIN = ("condition_embedder", "proj_out")
TEXT_TOKENS = 512  # umt5's padded prompt length


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor absmax float8_e4m3fn (ComfyUI's scaled fp8): (fp8 weight, 0-dim fp32 scale)."""
    values = weight.float()
    amax = values.abs().max()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).reshape(())
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 blocks of a 2-D weight: uint8 (rows, cols // 32 * 34), each block an fp16 scale then 32 int8.

    gguf-py's `Q8_0.quantize_blocks` in torch, op for op in fp32 (d = amax / 127, q = roundf(x * (1 / d)),
    rounding half away from zero), so it gives the same bytes as `gguf.quants.quantize`.
    """
    rows, cols = weight.shape
    blocks = weight.float().reshape(-1, Q8_0_BLOCK)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    magnitude = scaled.abs()
    floored = magnitude.floor()
    q = torch.sign(scaled) * (floored + (2 * (magnitude - floored)).floor())
    packed = torch.cat([d.to(torch.float16).view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)
    return packed.reshape(rows, cols // Q8_0_BLOCK * (Q8_0_BLOCK + 2))


def _kept_formats(model: torch.nn.Module, fmt: str, keep_fp32: set[str]) -> dict[str, WeightFormat]:
    """Which Linear layers keep their weight stored in `fmt` (the single-file loader never keeps fp32-kept ones)."""
    if fmt == "bf16":
        return {}
    formats = {}
    for name, child in model.named_modules():
        if not isinstance(child, torch.nn.Linear) or keep_fp32 & set(name.split(".")):
            continue
        if fmt == "fp8":
            formats[name] = FP8_FORMAT
        elif name.split(".")[0] not in GGUF_PLAIN:
            formats[name] = Q8_0_FORMAT
    return formats


def build_expert(config: dict, fmt: str, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The expert built on meta, each tensor drawn (bf16, or fp32 where kept so) and quantised on `device`.

    Tensor i is drawn from seed + i, so every format quantises the same bf16 weights.
    """
    from accelerate import init_empty_weights
    from diffusers import WanVACETransformer3DModel

    with init_empty_weights(include_buffers=False):
        model = WanVACETransformer3DModel(**config)
    model.requires_grad_(False)
    keep_fp32 = set(model._keep_in_fp32_modules)
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    formats = _kept_formats(model, fmt, keep_fp32)
    replace_linears(model, formats)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for index, (name, shape) in enumerate(shapes.items()):
            generator.manual_seed(seed + index)
            dtype = torch.float32 if keep_fp32 & set(name.split(".")) else torch.bfloat16
            values = torch.empty(shape, dtype=dtype, device=device).normal_(0, 0.02, generator=generator)
            owner, _, leaf = name.rpartition(".")
            weight_format = formats.get(owner) if leaf == "weight" else None
            if weight_format is FP8_FORMAT:
                values, scale = quantize_fp8(values)
                set_tensor(model, f"{owner}.weight_scale", scale)
            elif weight_format is Q8_0_FORMAT:
                values = quantize_q8_0(values)
            set_tensor(model, name, values)
            del values
        for name, buffer in list(model.named_buffers()):
            if buffer.device != device:
                set_tensor(model, name, buffer.to(device))
    missing = [name for name, tensor in model.state_dict(keep_vars=True).items() if tensor.is_meta]
    if missing:
        raise RuntimeError(f"tensors left on meta: {missing[:5]}")
    apply_interleaved_vace(model)
    return model.eval()


def _parse_size(text: str) -> tuple[int, int, int]:
    height, width, frames = (int(part) for part in text.lower().split("x"))
    return height, width, frames


def _tokens(config: dict, size: tuple[int, int, int]) -> int:
    height, width, frames = size
    _, ph, pw = config["patch_size"]
    return ((frames - 1) // 4 + 1) * (height // 8 // ph) * (width // 8 // pw)


def _inputs(config: dict, size: tuple[int, int, int], device: torch.device, text_tokens: int) -> dict:
    height, width, frames = size
    latent_frames = (frames - 1) // 4 + 1
    shape = (1, config["in_channels"], latent_frames, height // 8, width // 8)
    generator = torch.Generator(device).manual_seed(1234)

    def randn(*dims):
        return torch.randn(dims, generator=generator, device=device, dtype=torch.bfloat16)

    return {
        "hidden_states": randn(*shape),
        "timestep": torch.tensor([900], device=device),
        "encoder_hidden_states": randn(1, text_tokens, config["text_dim"]),
        "control_hidden_states": randn(1, config["vace_in_channels"], *shape[2:]),
        "control_hidden_states_scale": torch.ones(len(config["vace_layers"]), device=device, dtype=torch.bfloat16),
        "return_dict": False,
    }


def measure(model, inputs: dict, warmup: int, steps: int, device: torch.device) -> dict:
    """`warmup` untimed then `steps` (>= 3) timed CFG steps (two calls each): their median and spread
    (`bench.timing.timed_steps`), peak VRAM, the last output."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def step(_index: int) -> torch.Tensor:
        with torch.no_grad():
            cond = model(**inputs)[0]
            uncond = model(**inputs)[0]
            return uncond + 5.0 * (cond - uncond)

    result = timed_steps(step, warmup, steps, device)
    result["peak_vram"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    result["output"] = result["output"].float().cpu()
    return result


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float((output - reference).norm() / reference.norm().clamp_min(1e-30))


def check_quantisers(device: torch.device) -> None:
    """The torch Q8_0 quantiser against gguf-py's (bytes), both kept formats against their bf16 weights."""
    import gguf
    import numpy as np

    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(64, 256, generator=generator) * 0.02).to(torch.bfloat16)
    weight[0, :32] = 0  # an all-zero block (d = 0)
    ours = quantize_q8_0(weight.to(device)).cpu().numpy()
    theirs = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    print(f"torch Q8_0 quantiser gives gguf.quants.quantize's bytes: {bool(np.array_equal(ours, theirs))}")
    if not np.array_equal(ours, theirs):
        raise SystemExit("the torch Q8_0 quantiser disagrees with gguf-py")
    shape = tuple(weight.shape)
    q8 = Q8_0_FORMAT.dequantize(torch.from_numpy(ours), None, shape)
    fp8, scale = quantize_fp8(weight)
    fp8_values = FP8_FORMAT.dequantize(fp8, scale, shape)
    for name, values in (("Q8_0", q8), ("fp8", fp8_values)):
        print(f"{name:4} dequantised vs bf16 weights: relative error {_relative_error(values, weight.float()):.4f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: checks the logic)")
    parser.add_argument("--tiny", action="store_true", help="a tiny config of the same architecture, 64x64x9")
    parser.add_argument("--sizes", help="comma-separated HxWxF (default 480x832x81,720x1280x81; --tiny 64x64x9)")
    parser.add_argument("--steps", type=int, default=3, help="timed CFG steps per format and size (>= 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed CFG steps before them")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated of {', '.join(FORMATS)}")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="sizes after the first must fit this")
    parser.add_argument("--json", help="also write the rows here as JSON (bench/gpu_check.sh's table)")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    formats = args.formats.split(",")
    if set(formats) - set(FORMATS) or "bf16" not in formats:
        parser.error(f"--formats: a comma-separated subset of {', '.join(FORMATS)} including bf16")
    formats = ["bf16"] + [fmt for fmt in formats if fmt != "bf16"]  # bf16 first: the reference
    config = TINY if args.tiny else A14B
    default_sizes = "64x64x9" if args.tiny else "480x832x81,720x1280x81"
    sizes = [_parse_size(text) for text in (args.sizes or default_sizes).split(",")]
    text_tokens = 16 if args.tiny else TEXT_TOKENS
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"device: {name}; {'tiny config' if args.tiny else 'A14B expert'} (dim "
        f"{config['num_attention_heads'] * config['attention_head_dim']}, {config['num_layers']} layers, "
        f"{len(config['vace_layers'])} VACE blocks); {args.steps} CFG steps (2 calls each) per format and size"
    )
    check_quantisers(device)

    results: dict[tuple, dict] = {}
    enabled = sizes[:1]
    for fmt in formats:
        build_start = time.perf_counter()
        model = build_expert(config, fmt, device)
        sync(device)
        build_s = time.perf_counter() - build_start
        kept = sum(isinstance(child, QuantizedLinear) for child in model.modules())
        weights = tensor_bytes(model)
        host = read_status()
        print(
            f"[{fmt}] built in {build_s:.1f} s: weights resident on {device.type} {_size(weights)}, "
            f"{kept} Linear weights kept quantised; host private {host['RssAnon'] / 2**30:.1f} GiB"
        )
        for size in sizes:
            if size not in enabled:
                continue
            inputs = _inputs(config, size, device, text_tokens)
            try:
                result = measure(model, inputs, args.warmup, args.steps, device)
            except torch.cuda.OutOfMemoryError:
                print(f"[{fmt}] {'x'.join(map(str, size))}: out of memory")
                continue
            finally:
                del inputs
            result.update(build_s=build_s, weights=weights, kept=kept)
            results[(fmt, size)] = result
            _write_json(args, device, results, formats, sizes)
            peak = result["peak_vram"]
            vram = f"peak VRAM {_size(peak)} (above the weights {_size(peak - weights)})" if peak else ""
            print(
                f"[{fmt}] {'x'.join(map(str, size))}: step {result['median_s']:7.3f} s (spread "
                f"{result['spread']:.1%}, warm-up {result['warmup_s']:.3f} s) {vram}"
            )
            if fmt == formats[0] and size == sizes[0] and len(sizes) > 1:
                enabled = _plan_sizes(config, sizes, result, formats, args, time.perf_counter() - started)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _print_table(results, formats, sizes)
    return 0


def _plan_sizes(config, sizes, first: dict, formats, args, elapsed: float) -> list:
    """The sizes all formats are predicted to fit `--max-seconds` (the first always runs)."""
    per_format_first = first["build_s"] + args.steps * first["median_s"] + first["warmup_s"]
    predicted = elapsed + (len(formats) - 1) * per_format_first
    enabled = sizes[:1]
    for size in sizes[1:]:
        scale = (_tokens(config, size) / _tokens(config, sizes[0])) ** 2  # attention-bound: conservative
        cost = len(formats) * (args.steps + args.warmup) * first["median_s"] * scale
        label = "x".join(map(str, size))
        if predicted + cost <= args.max_seconds:
            enabled.append(size)
            predicted += cost
            print(f"{label}: predicted {cost:.0f} s for all formats; runs (budget {args.max_seconds:.0f} s)")
        else:
            print(f"{label}: skipped: predicted {cost:.0f} s for all formats, over the {args.max_seconds:.0f} s budget")
    return enabled


def _rows(results: dict, formats, sizes) -> list[dict]:
    """bench/gpu_check.sh's rows: per size and format, step time, peak VRAM and the ratios to bf16."""
    rows = []
    for size in sizes:
        base = results.get(("bf16", size))
        for fmt in formats:
            run = results.get((fmt, size))
            if run is None or base is None:
                continue
            ratios, note = {}, ""
            if fmt != "bf16":
                ratios["step/bf16"] = run["median_s"] / base["median_s"]
                if run["peak_vram"] and base["peak_vram"]:
                    ratios["VRAM/bf16"] = run["peak_vram"] / base["peak_vram"]
                ratios["weights/bf16"] = run["weights"] / base["weights"]
                note = f"out rel err {_relative_error(run['output'], base['output']):.4f}"
            peak = run["peak_vram"] / 2**30 if run["peak_vram"] else None
            label = f"{'x'.join(map(str, size))} {fmt}"
            rows.append({"row": label, **row_timing(run), "peak_gib": peak, "ratios": ratios, "note": note})
    return rows


def _write_json(args, device: torch.device, results: dict, formats, sizes) -> None:
    if args.json:
        config = (
            f"{'tiny config' if args.tiny else 'A14B expert'}, {args.warmup} warm-up + median of {args.steps} CFG steps"
        )
        rows = _rows(results, formats, sizes)
        report = {
            "bench": "single-file formats",
            "device": device.type,
            "config": config,
            "time_unit": "per CFG step",
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))


def _print_table(results: dict, formats, sizes) -> None:
    print()
    print("format / bf16, measured side by side in this run (weights: bytes resident on the device)")
    header = (
        f"{'size':12} {'format':6} {'step s':>8} {'x bf16':>7} {'peak VRAM':>11} {'x bf16':>7} {'weights':>11} "
        f"{'x bf16':>7} {'out rel err':>11}"
    )
    print(header)
    print("-" * len(header))
    for size in sizes:
        base = results.get(("bf16", size))
        if base is None:
            continue
        for fmt in formats:
            run = results.get((fmt, size))
            if run is None:
                continue
            peak, base_peak = run["peak_vram"], base["peak_vram"]
            peak_text = f"{_size(peak):>11} {peak / base_peak:6.2f}x" if peak else f"{'n/a':>11} {'':>7}"
            print(
                f"{'x'.join(map(str, size)):12} {fmt:6} {run['median_s']:8.3f} "
                f"{run['median_s'] / base['median_s']:6.2f}x "
                f"{peak_text} {_size(run['weights']):>11} {run['weights'] / base['weights']:6.2f}x "
                f"{_relative_error(run['output'], base['output']):11.4f}"
            )


if __name__ == "__main__":
    sys.exit(main())
