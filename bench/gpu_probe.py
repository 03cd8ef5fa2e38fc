"""A one-minute probe of the GPU machine: the ceilings every later figure is read against, and the kernels the
fast path chooses between, at A14B shapes.

    python3 bench/gpu_probe.py [--json PATH]               # CUDA: about 30 s on an H200 (estimates below)
    python3 bench/gpu_probe.py --device cpu --tiny         # CPU check of the logic (times mean nothing)

- bf16 GEMM 8192^3 (random data, never zeros) and a device-to-device copy (bytes read + written): the measured
  ceilings. The GEMM rate is the MFU denominator of bench_fast_path_gpu.py (gpu_check.sh passes it on), not the
  datasheet's 989 TFLOP/s; KINDS.md measured 769-798 TFLOP/s and ~4.3 TB/s on such a machine. ~1 s.
- Host to device, one A14B transformer block's bytes (what layerwise offload moves per block): from pageable
  memory, from memory registered with cudaHostRegister (what the offload ring's staging buffers are), and the
  ring's host-side copy into a registered buffer; registering itself is timed too. ~3 s.
- Attention at the 480p and 720p A14B shapes (1 x 32760 and 1 x 75600 tokens, 40 heads of 128, bf16) for each
  backend of diffusers' dispatcher that our `attention` option offers and that is installed, and SageAttention's
  own `sageattn` (what ComfyUI's --use-sage-attention runs); a backend whose requirements fail says why.
  `_native_math` and `flex` (uncompiled) are left out: they materialise the 75600^2 x 40 scores (~0.9 TB). ~10 s.
- fp8 `_scaled_mm` against bf16 at the FFN shapes of one 480p pass (32760 x 5120 -> 13824 and 13824 -> 5120):
  bf16 F.linear; e4m3 with and without `use_fast_accum`; bf16 out with the bias fused; fp32 out without a bias;
  fp32 out WITH a bias (refused by CUDA's kernel: the message is recorded); and our fp8 matmul layer
  (wanvace_core.runtime.fp8_matmul, activation quantisation included) with bf16 and with fp32 activations and a
  bias. Each against an fp32 product of the unquantised operands (relative error). ~3 s.

Every measurement is a median of timed repeats after warm-ups, with CUDA events on a GPU. `--json PATH` writes
bench/gpu_check.sh's rows and the ceilings as it goes. Exits 1 if a ceiling, a copy or our fp8 layer failed (a
backend that cannot run is a row, not a failure).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_offload_gpu import A14B, TINY  # noqa: E402

HEADS, HEAD_DIM = A14B["num_attention_heads"], A14B["attention_head_dim"]
# Latent tokens of one A14B pass: 21 latent frames x (H/16) x (W/16).
TOKENS = {"480p": 21 * 30 * 52, "720p": 21 * 45 * 80}
TINY_TOKENS = {"tiny-a": 256, "tiny-b": 512}
# diffusers' dispatcher backends our `attention` option offers that can run 75600 tokens (see the docstring).
ATTENTION = ("native", "_native_flash", "_native_cudnn", "_native_efficient", "sage", "flash", "_flash_3", "xformers")
CPU_ATTENTION = ("native", "_native_math", "_native_flash", "_native_efficient")
FP8 = torch.float8_e4m3fn


def _version(distribution: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


class Probe:
    def __init__(self, device: torch.device, tiny: bool, json_path: str | None) -> None:
        self.device, self.tiny, self.json_path = device, tiny, json_path
        self.rows: list[dict] = []
        self.ceilings: dict[str, float] = {}
        self.failures: list[str] = []

    def seconds(self, fn, warmup: int = 2, reps: int = 10) -> float:
        """Median seconds of `fn()` over `reps` timed calls after `warmup` (CUDA events on a GPU)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
        return statistics.median(times)

    def host_seconds(self, fn, reps: int = 5) -> float:
        """Median wall seconds of `fn()` with the device synchronized around it (host-driven copies)."""
        times = []
        for _ in range(reps):
            self.sync()
            begin = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - begin)
        return statistics.median(times)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, section: str, row: str, seconds: float | None, note: str = "", failed: str | None = None) -> None:
        entry = {"row": f"{section}: {row}", "seconds": seconds, "note": note}
        if failed:
            entry["failed"] = failed
        self.rows.append(entry)
        shown = f"{seconds * 1e3:9.3f} ms" if seconds is not None else f"{'-':>12}"
        print(f"[probe] {section:9} {row:46} {shown}  {failed or note}", flush=True)
        self.write()

    def fail(self, section: str, row: str, error: BaseException) -> None:
        """A measurement that must work did not: a row marked failed, and the probe exits 1."""
        message = _first_line(error)
        self.failures.append(f"{section}: {row}: {message}")
        traceback.print_exc()
        self.add(section, row, None, failed=message)

    def write(self) -> None:
        if self.json_path:
            report = {
                "bench": "machine probe",
                "device": self.device.type,
                "config": "medians of timed repeats after warm-ups"
                + ("; tiny shapes (the logic only)" if self.tiny else "; A14B shapes"),
                "time_unit": "per call",
                "ceilings": self.ceilings,
                "rows": self.rows,
            }
            Path(self.json_path).write_text(json.dumps(report, indent=1))


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=torch.float32).to(dtype)


def probe_ceilings(probe: Probe) -> None:
    device = probe.device
    size = 512 if probe.tiny else 8192
    try:
        a, b = _randn(size, size, device=device), _randn(size, size, device=device)
        seconds = probe.seconds(lambda: a @ b, warmup=3, reps=20)
        tflops = 2 * size**3 / seconds / 1e12
        probe.ceilings["gemm_tflops"] = tflops
        probe.add("ceiling", f"bf16 GEMM {size}^3 (random data)", seconds, f"{tflops:.0f} TFLOP/s")
    except Exception as error:  # a ceiling that cannot be measured fails the probe
        probe.fail("ceiling", "bf16 GEMM", error)
    try:
        count = (2**24 if probe.tiny else 2**31) // 2
        source = torch.empty(count, dtype=torch.bfloat16, device=device).normal_()
        target = torch.empty_like(source)
        seconds = probe.seconds(lambda: target.copy_(source), warmup=3, reps=20)
        moved = 2 * source.numel() * source.element_size()
        probe.ceilings["copy_tbps"] = moved / seconds / 1e12
        probe.add(
            "ceiling",
            f"device copy {source.numel() * 2 / 2**30:.2f} GiB",
            seconds,
            f"{moved / seconds / 1e12:.2f} TB/s (read + written)",
        )
    except Exception as error:  # a ceiling that cannot be measured fails the probe
        probe.fail("ceiling", "device copy", error)


def block_bytes(config: dict) -> int:
    """Bytes of one transformer block of `config` in bf16 (its fp32-kept norms in fp32), counted on meta."""
    from accelerate import init_empty_weights
    from diffusers import WanVACETransformer3DModel

    with init_empty_weights(include_buffers=False):
        model = WanVACETransformer3DModel(**{**config, "num_layers": 1, "vace_layers": [0]})
    keep = set(model._keep_in_fp32_modules)
    return sum(
        param.numel() * (4 if keep & set(name.split(".")) else 2) for name, param in model.blocks[0].named_parameters()
    )


def probe_host_copies(probe: Probe) -> None:
    if probe.device.type != "cuda":
        probe.add("host", "host-to-device copies", None, "left out: no CUDA device (pageable = registered on a CPU)")
        return
    try:
        nbytes = block_bytes(TINY if probe.tiny else A14B)
        gib = nbytes / 2**30
        weights = torch.empty(nbytes, dtype=torch.uint8).fill_(7)  # pages touched: no zero-page shortcut
        staging = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        target = torch.empty(nbytes, dtype=torch.uint8, device=probe.device)
        seconds = probe.host_seconds(lambda: target.copy_(weights))
        probe.add("host", f"H2D pageable, one A14B block {gib:.2f} GiB", seconds, f"{nbytes / seconds / 1e9:.1f} GB/s")
        cudart = torch.cuda.cudart()
        begin = time.perf_counter()
        error = int(cudart.cudaHostRegister(staging.data_ptr(), nbytes, 0))
        register_s = time.perf_counter() - begin
        if error != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {error}")
        try:
            probe.add("host", f"cudaHostRegister of {gib:.2f} GiB", register_s, "once per offload slot")
            seconds = probe.host_seconds(lambda: target.copy_(staging, non_blocking=True))
            probe.add(
                "host", f"H2D registered, one A14B block {gib:.2f} GiB", seconds, f"{nbytes / seconds / 1e9:.1f} GB/s"
            )
            seconds = probe.host_seconds(lambda: staging.copy_(weights))
            probe.add(
                "host",
                f"host copy into the registered buffer {gib:.2f} GiB",
                seconds,
                f"{nbytes / seconds / 1e9:.1f} GB/s (the offload ring's host step)",
            )
        finally:
            cudart.cudaHostUnregister(staging.data_ptr())
    except Exception as error:  # the offload figures rest on these: a failure fails the probe
        probe.fail("host", "host-to-device copies", error)


def probe_attention(probe: Probe) -> None:
    for label, tokens in (TINY_TOKENS if probe.tiny else TOKENS).items():
        _attention_at(probe, label, tokens)


def _attention_at(probe: Probe, label: str, tokens: int) -> None:
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
        dispatch_attention_fn,
    )

    heads, head_dim = (2, 64) if probe.tiny else (HEADS, HEAD_DIM)
    flops = 4 * tokens * tokens * heads * head_dim
    query, key, value = (_randn(1, tokens, heads, head_dim, device=probe.device) for _ in range(3))
    reference = None
    for backend in CPU_ATTENTION if probe.device.type != "cuda" else ATTENTION:
        row = f"{label} {tokens} tokens, {backend}"
        try:
            _check_attention_backend_requirements(AttentionBackendName(backend))
        except (RuntimeError, ImportError, ValueError) as error:
            probe.add("attention", row, None, f"not available: {str(error).strip().splitlines()[0]}")
            continue
        name = AttentionBackendName(backend)
        try:
            out = dispatch_attention_fn(query, key, value, backend=name)
            seconds = probe.seconds(
                functools.partial(dispatch_attention_fn, query, key, value, backend=name), warmup=1, reps=3
            )
        except Exception as error:  # a kernel that cannot run here is a finding, not a probe failure
            probe.add("attention", row, None, f"does not run here: {_first_line(error)}")
            continue
        reference = out.float() if reference is None else reference
        probe.add("attention", row, seconds, f"{flops / seconds / 1e12:.0f} TFLOP/s; {_error(out, reference)}")
    try:
        from sageattention import sageattn
    except ImportError as error:
        probe.add("attention", f"{label} {tokens} tokens, sageattn", None, f"not installed ({error})")
        return
    version = _version("sageattention")
    row = f"{label} {tokens} tokens, sageattn {version} (ComfyUI's)".replace("  ", " ")
    call = functools.partial(sageattn, query, key, value, tensor_layout="NHD", is_causal=False)
    try:
        out = call()
        seconds = probe.seconds(call, warmup=1, reps=3)
    except Exception as error:  # Triton-only SageAttention may not run everywhere: a finding
        probe.add("attention", row, None, f"does not run here: {_first_line(error)}")
        return
    probe.add("attention", row, seconds, f"{flops / seconds / 1e12:.0f} TFLOP/s; {_error(out, reference)}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _error(out: torch.Tensor, reference: torch.Tensor | None) -> str:
    if reference is None:
        return "the reference"
    distance = ((out.float() - reference).norm() / reference.norm().clamp_min(1e-30)).item()
    return f"rel err {distance:.4f} vs the first backend"


def probe_fp8(probe: Probe) -> None:
    rows = 256 if probe.tiny else TOKENS["480p"]
    dim, ffn = (128, 256) if probe.tiny else (A14B["num_attention_heads"] * A14B["attention_head_dim"], A14B["ffn_dim"])
    for name, inner, outer in (("FFN up", dim, ffn), ("FFN down", ffn, dim)):
        _fp8_at(probe, f"{name} {rows}x{inner}->{outer}", rows, inner, outer)


def _quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from wanvace_core.runtime.fp8_matmul import FP8_MAX

    scale = tensor.float().abs().amax().clamp(min=1e-12) / FP8_MAX
    return (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _fp8_at(probe: Probe, shape: str, rows: int, inner: int, outer: int) -> None:
    from wanvace_core.load.quantized import QuantizedLinear, WeightFormat
    from wanvace_core.runtime.fp8_matmul import apply_fp8_matmul

    device = probe.device
    flops = 2 * rows * inner * outer
    x = _randn(rows, inner, device=device)
    weight = _randn(outer, inner, device=device) * 0.02
    bias = _randn(outer, device=device)
    reference = x.float() @ weight.float().t() + bias.float()
    unbiased = reference - bias.float()

    def error(out: torch.Tensor, target: torch.Tensor) -> str:
        return f"rel err {((out.float() - target).norm() / target.norm()).item():.4f}"

    xq, x_scale = _quantize(x)
    wq, w_scale = _quantize(weight)
    scaled_mm = functools.partial(torch._scaled_mm, xq, wq.t(), x_scale, w_scale)
    cases = {
        "bf16 F.linear + bias": (functools.partial(torch.nn.functional.linear, x, weight, bias), reference),
        "fp8 -> bf16": (functools.partial(scaled_mm, out_dtype=torch.bfloat16), unbiased),
        "fp8 -> bf16, use_fast_accum": (
            functools.partial(scaled_mm, out_dtype=torch.bfloat16, use_fast_accum=True),
            unbiased,
        ),
        "fp8 -> bf16 + bf16 bias fused": (functools.partial(scaled_mm, bias=bias, out_dtype=torch.bfloat16), reference),
        "fp8 -> fp32": (functools.partial(scaled_mm, out_dtype=torch.float32), unbiased),
    }
    baseline = None
    for case, (call, target) in cases.items():
        try:
            out = call()
            seconds = probe.seconds(call)
        except Exception as failure:  # a kernel of torch's that refuses these operands: a finding
            probe.add("fp8", f"{shape}, {case}", None, f"refused here: {_first_line(failure)}")
            continue
        baseline = baseline or seconds
        note = f"{flops / seconds / 1e12:.0f} TFLOP/s; bf16/this {baseline / seconds:.2f}; {error(out, target)}"
        probe.add("fp8", f"{shape}, {case}", seconds, note)
    # CUDA refuses a bias with an fp32 output ("Bias is not supported when out_dtype is set to Float32").
    case = f"{shape}, fp8 -> fp32 + bias (raw _scaled_mm)"
    try:
        scaled_mm(bias=bias.float(), out_dtype=torch.float32)
        where = "CUDA was expected to refuse it" if device.type == "cuda" else "the CPU kernel accepts it"
        probe.add("fp8", case, None, f"accepted ({where})")
    except RuntimeError as refusal:
        probe.add("fp8", case, None, f"refused, as expected: {str(refusal).strip().splitlines()[0]}")
    # Our layer, activation quantisation included, with bf16 and with fp32 activations (bias added after).
    layer = QuantizedLinear(inner, outer, True, WeightFormat("scaled_fp8", FP8))
    layer.weight = torch.nn.Parameter(wq, requires_grad=False)
    layer.weight_scale = w_scale.reshape(())
    layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    holder = torch.nn.Sequential(layer)
    for fast_accum in (False, True):
        apply_fp8_matmul(holder, True, fast_accum=fast_accum)
        for dtype in (torch.bfloat16, torch.float32):
            activations = x.to(dtype)
            label = f"{shape}, our fp8 layer, {str(dtype).removeprefix('torch.')} in"
            label += ", fast accum" if fast_accum else ""
            try:
                out = layer(activations)
                seconds = probe.seconds(functools.partial(layer, activations))
            except Exception as failure:  # our fp8 path must run wherever fp8 runs: a failure fails the probe
                probe.fail("fp8", label, failure)
                continue
            note = f"{flops / seconds / 1e12:.0f} TFLOP/s; bf16/this {(baseline or seconds) / seconds:.2f}; "
            probe.add("fp8", label, seconds, note + error(out, reference))
    apply_fp8_matmul(holder, False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU check of the logic")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing probed")
        return 0
    probe = Probe(device, args.tiny, args.json)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        print(
            f"[probe] {properties.name}: {properties.multi_processor_count} SMs, "
            f"{properties.total_memory / 2**30:.0f} GiB; torch {torch.__version__} (CUDA {torch.version.cuda})"
        )
    started = time.perf_counter()
    for section in (probe_ceilings, probe_host_copies, probe_attention, probe_fp8):
        section_start = time.perf_counter()
        try:
            with torch.no_grad():
                section(probe)
        except Exception as error:  # one section's crash must not lose the others
            probe.fail(section.__name__.removeprefix("probe_"), "section", error)
        print(f"[probe] {section.__name__} took {time.perf_counter() - section_start:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    probe.write()
    print(f"[probe] done in {time.perf_counter() - started:.1f} s; ceilings {probe.ceilings}")
    if probe.failures:
        print("[probe] FAILED: " + "; ".join(probe.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
