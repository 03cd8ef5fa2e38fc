"""Host-memory (RSS) measurement for the load tests and benchmarks (Linux `/proc`).

Resident memory is split the way the kernel reports it in `/proc/<pid>/status`:

- private (`RssAnon`): anonymous pages only this process holds, e.g. a tensor cast to another dtype;
- file-backed (`RssFile`): pages of memory-mapped files (safetensors weights used in place, shared
  libraries). The kernel can drop them under pressure and re-read them from the file;
- `VmHWM`: the kernel's exact peak of the total; writing "5" to `/proc/<pid>/clear_refs` resets it.

The kernel keeps no peak of the private and file-backed parts separately, so `PeakSampler` polls them
from a thread. Polling `/proc` of another process (`pid=...`) avoids sharing that process's GIL.

`file_mappings` reads `/proc/<pid>/smaps` for which files below a folder a process has mapped, where and how much
of them is resident: whether a ComfyUI server holds the weights it uses in place from their files.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
_MAPPING_HEADER = re.compile(r"[0-9a-f]+-[0-9a-f]+ ")


def read_status(pid: int | str = "self") -> dict[str, int]:
    """`VmRSS`, `VmHWM`, `RssAnon`, `RssFile`, `RssShmem` of `pid` in bytes."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name in _FIELDS:
                values[name] = int(rest.split()[0]) * 1024
    return values


@dataclass(frozen=True)
class FileMapping:
    """One file's memory mappings in a process (`/proc/<pid>/smaps`): address ranges, mapped and resident bytes."""

    path: str
    ranges: tuple[tuple[int, int], ...]
    size: int
    rss: int


def file_mappings(pid: int | str, under: str | os.PathLike) -> dict[str, FileMapping]:
    """The files below the folder `under` (symlinks resolved) that `pid` has memory-mapped, by path."""
    root = os.path.realpath(under).rstrip("/") + "/"
    found: dict[str, list] = {}
    current = None
    with open(f"/proc/{pid}/smaps") as handle:
        for line in handle:
            fields = line.split(maxsplit=5)
            if _MAPPING_HEADER.match(line):
                # "start-end perms offset dev inode [path]": anonymous mappings have no path.
                path = fields[5].rstrip("\n") if len(fields) > 5 else ""
                current = None
                if path.startswith(root):
                    start, end = (int(value, 16) for value in fields[0].split("-"))
                    current = found.setdefault(path, [[], 0, 0])
                    current[0].append((start, end))
                    current[1] += end - start
            elif current is not None and fields[0] == "Rss:":
                current[2] += int(fields[1]) * 1024
    return {path: FileMapping(path, tuple(ranges), size, rss) for path, (ranges, size, rss) in found.items()}


def reset_peak(pid: int | str = "self") -> bool:
    """Resets the kernel's `VmHWM` to the current RSS. False where the kernel refuses (not Linux, no access)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    status = read_status(pid)
    return status["VmHWM"] <= status["VmRSS"] + 1024 * 1024


@dataclass
class MemoryPeak:
    """Peaks over a sampled window, in bytes, next to the values at its start."""

    baseline: dict[str, int]
    peak_private: int = 0
    peak_file: int = 0
    peak_rss: int = 0
    peak_hwm: int = 0
    samples: int = 0
    hwm_reset: bool = False

    @property
    def private_above_baseline(self) -> int:
        return self.peak_private - self.baseline["RssAnon"]

    @property
    def file_above_baseline(self) -> int:
        return self.peak_file - self.baseline["RssFile"]

    @property
    def total_above_baseline(self) -> int:
        """From the kernel's exact `VmHWM` where it could be reset, else from the samples."""
        peak = max(self.peak_hwm, self.peak_rss) if self.hwm_reset else self.peak_rss
        return peak - self.baseline["VmRSS"]

    def as_dict(self) -> dict[str, int]:
        return {
            "baseline_private": self.baseline["RssAnon"],
            "baseline_file": self.baseline["RssFile"],
            "baseline_rss": self.baseline["VmRSS"],
            "peak_private": self.peak_private,
            "peak_file": self.peak_file,
            "peak_rss": self.peak_rss,
            "peak_hwm": self.peak_hwm,
            "private_above_baseline": self.private_above_baseline,
            "file_above_baseline": self.file_above_baseline,
            "total_above_baseline": self.total_above_baseline,
            "samples": self.samples,
            "hwm_reset": int(self.hwm_reset),
        }


class PeakSampler:
    """Context manager that polls `/proc/<pid>/status` every `interval` seconds and keeps the peaks.

    `with PeakSampler() as peak: load(...)`, then read `peak.private_above_baseline` etc. The window's
    first and last values are sampled on the calling thread, so a window shorter than `interval` counts too.
    """

    def __init__(self, pid: int | str = "self", interval: float = 0.001):
        self.pid = pid
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.result: MemoryPeak | None = None

    def _sample(self) -> None:
        try:
            status = read_status(self.pid)
        except (FileNotFoundError, ProcessLookupError):
            return
        result = self.result
        result.peak_private = max(result.peak_private, status["RssAnon"])
        result.peak_file = max(result.peak_file, status["RssFile"])
        result.peak_rss = max(result.peak_rss, status["VmRSS"])
        result.peak_hwm = max(result.peak_hwm, status["VmHWM"])
        result.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> MemoryPeak:
        hwm_reset = reset_peak(self.pid)
        self.result = MemoryPeak(baseline=read_status(self.pid), hwm_reset=hwm_reset)
        self._sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self.result

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def tensor_bytes(module) -> int:
    """Bytes held by `module`'s parameters and buffers (each storage counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        key = (tensor.untyped_storage().data_ptr(), tensor.data_ptr()) if not tensor.is_meta else (id(tensor), 0)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


# The sampler's experts: the real head size (128) and FFN ratio (13824 / 5120) at a width the CPU runs in seconds; two
# blocks, each with a VACE hint, so a hint, the control state and the VACE input are alive in a main block.
SAMPLER_EXPERT = {
    "num_attention_heads": 4,
    "attention_head_dim": 128,
    "ffn_dim": 1382,
    "num_layers": 2,
    "vace_layers": [0, 1],
}


def sampler_experts(model) -> list:
    """Two random experts (seeds 0 and 1) of `SAMPLER_EXPERT`'s shape, with the rest of `model`'s expert config: what
    the sampler's activation memory is measured on, on the CPU (tests/test_budget.py, bench/windows_memory.py)."""
    import torch
    from diffusers import WanVACETransformer3DModel

    config = model.reference_expert.config
    experts = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        experts.append(
            WanVACETransformer3DModel(
                patch_size=tuple(config.patch_size),
                in_channels=config.in_channels,
                out_channels=config.out_channels,
                text_dim=config.text_dim,
                freq_dim=config.freq_dim,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                vace_in_channels=config.vace_in_channels,
                **SAMPLER_EXPERT,
            )
            .eval()
            .requires_grad_(False)
        )
    return experts


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# --- Load measurement: a transformer-only folder and a worker process that loads it --------------------

LOADERS = ("ours", "diffusers")
# One expert loaded from a single file through the single-file loader (`wanvace_core.load.single_file`).
SINGLE_FILE_LOADER = "single"
# Single-file layouts `write_single_files` writes (bench/expert_files.py writers), by file name.
SINGLE_FILE_FORMATS = {
    "bf16": "expert_bf16.safetensors",  # original Wan keys, every tensor bf16
    "fp8_scaled": "expert_fp8_scaled.safetensors",  # legacy scaled fp8: every Linear weight e4m3fn + scale
    "Q8_0": "expert_Q8_0.gguf",  # city96-style GGUF
}


def random_transformer(
    *,
    num_layers: int = 4,
    vace_every: int = 2,
    num_attention_heads: int = 12,
    attention_head_dim: int = 128,
    ffn_mult: int = 4,
    text_dim: int = 4096,
    seed: int = 0,
):
    """A random `WanVACETransformer3DModel` with bf16 weights, drawn straight in bf16 (seconds, little memory)."""
    import torch
    from diffusers import WanVACETransformer3DModel

    dim = num_attention_heads * attention_head_dim
    with torch.device("meta"):
        model = WanVACETransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            in_channels=16,
            out_channels=16,
            text_dim=text_dim,
            freq_dim=256,
            ffn_dim=ffn_mult * dim,
            num_layers=num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            vace_layers=list(range(0, num_layers, vace_every)),
            vace_in_channels=96,
        )
    generator = torch.Generator().manual_seed(seed)
    state = {
        name: (torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        for name, tensor in model.state_dict().items()
    }
    model.load_state_dict(state, assign=True)
    del state
    return model.eval().requires_grad_(False)


def write_transformer_folder(folder, *, model=None, **shape):
    """Writes a random `WanVACETransformer3DModel` (or `model`) in bf16 to `<folder>/transformer` (diffusers layout).

    Returns the component folder. `shape`: the keyword arguments of `random_transformer`.
    """
    from pathlib import Path

    model = random_transformer(**shape) if model is None else model
    out = Path(folder) / "transformer"
    model.save_pretrained(out, safe_serialization=True)
    return out


def write_single_files(folder, formats=tuple(SINGLE_FILE_FORMATS), *, model=None, **shape) -> dict:
    """Writes one expert (random, or `model`) as ComfyUI-style single files to `folder`, one per format.

    Formats are keys of `SINGLE_FILE_FORMATS`; returns {format: path}. Uses the writers of
    bench/expert_files.py, so the files are laid out as ComfyUI's are.
    """
    from pathlib import Path

    import torch

    from bench.expert_files import write_expert, write_gguf_expert

    model = random_transformer(**shape) if model is None else model
    folder = Path(folder)
    written = {}
    for fmt in formats:
        path = folder / SINGLE_FILE_FORMATS[fmt]
        if fmt == "bf16":
            written[fmt] = write_expert(path, model, dtype=torch.bfloat16)
        elif fmt == "fp8_scaled":
            written[fmt] = write_expert(path, model, dtype=torch.bfloat16, quant="scaled_fp8")
        elif fmt == "Q8_0":
            written[fmt] = write_gguf_expert(path, model, "Q8_0")
        else:
            raise ValueError(f"unknown single-file format {fmt!r}; known: {tuple(SINGLE_FILE_FORMATS)}")
    return written


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _import_single_file_loader() -> None:
    """The modules the single-file loader imports on first use, imported before a baseline as the folder loader's
    are (a running ComfyUI has them already)."""
    import diffusers.loaders.single_file_utils  # noqa: F401
    import gguf  # noqa: F401
    from diffusers.quantizers.gguf.utils import dequantize_functions  # noqa: F401

    import wanvace_core.load.single_file  # noqa: F401


def _run_script(arguments: list[str], timeout: float):
    """This file run as a script in a fresh Python with `arguments`: the JSON of its last line of output."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(Path(__file__).resolve()), *arguments]
    done = subprocess.run(command, env=env, cwd=repo, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)[:400]} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_load(loader: str, source: str, dtype_name: str, threads: int, weight_dtype: str = "auto") -> dict:
    """Runs in a fresh process: loads one component and reports time, memory and what was loaded."""
    import gc
    import sys
    from pathlib import Path

    import torch
    from diffusers import WanVACETransformer3DModel

    from wanvace_core.load.folder_layout import ComponentFiles, _weight_files
    from wanvace_core.load.pipeline_folder import DTYPES, load_component
    from wanvace_core.load.quantized import QuantizedLinear

    torch.set_num_threads(threads)
    sys.setswitchinterval(0.0005)  # let the sampler thread in often while the loader holds the GIL
    dtype = DTYPES[dtype_name]
    source = Path(source)
    if loader == SINGLE_FILE_LOADER:
        files = [source]
        _import_single_file_loader()
        from wanvace_core.load.single_file import load_expert
    else:
        if weight_dtype != "auto":
            raise ValueError(f"weight_dtype={weight_dtype!r} is a single-file option; the {loader} loader has none")
        files = _weight_files(source.name, source)
        component = ComponentFiles(name=source.name, folder=source, weight_files=files)
    gc.collect()
    _malloc_trim()
    with PeakSampler() as peak:
        start = time.perf_counter()
        if loader == SINGLE_FILE_LOADER:
            model = load_expert(source, dtype_name, weight_dtype)
        elif loader == "ours":
            model = load_component(WanVACETransformer3DModel, component, dtype, torch.device("cpu"))
        else:
            model = WanVACETransformer3DModel.from_pretrained(source, torch_dtype=dtype, use_safetensors=True)
        seconds = time.perf_counter() - start
    after = read_status()
    # The weight files' own pages: the rest of the file-backed growth is shared-library code that the load ran
    # for the first time (libtorch_cpu and libtorch_python: 63 MiB measured on an AMD EPYC), not a leftover.
    weight_paths = {os.path.realpath(path) for path in files}
    weights_file_after = sum(
        mapping.rss for path, mapping in file_mappings("self", source.parent).items() if path in weight_paths
    )
    # Read every byte once, as a first forward would: weights used in place from the file get paged in.
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.numel():
                tensor.reshape(-1).view(torch.uint8).max()  # no temporary the size of the tensor
    used = read_status()
    param_dtypes: dict[str, int] = {}
    for tensor in model.parameters():
        name = str(tensor.dtype).removeprefix("torch.")
        param_dtypes[name] = param_dtypes.get(name, 0) + 1
    kept = [child for child in model.modules() if isinstance(child, QuantizedLinear)]
    return {
        "loader": loader,
        "dtype": dtype_name,
        "weight_dtype": weight_dtype,
        "seconds": seconds,
        "kept_linears": len(kept),
        "kept_formats": sorted({child.weight_format.quant or child.weight_format.kind for child in kept}),
        "linears": sum(isinstance(child, torch.nn.Linear) for child in model.modules()) + len(kept),
        "component_bytes": tensor_bytes(model),
        "file_bytes": sum(path.stat().st_size for path in files),
        "meta_tensors": sum(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()]),
        "param_dtypes": param_dtypes,
        "private_after": after["RssAnon"] - peak.baseline["RssAnon"],
        "file_after": after["RssFile"] - peak.baseline["RssFile"],
        "weights_file_after": weights_file_after,
        "private_after_use": used["RssAnon"] - peak.baseline["RssAnon"],
        "file_after_use": used["RssFile"] - peak.baseline["RssFile"],
        **peak.as_dict(),
    }


def measure_load_in_subprocess(
    loader: str, source, dtype: str, *, threads: int = 2, timeout: float = 600, weight_dtype: str = "auto"
):
    """Loads one `WanVACETransformer3DModel` in a fresh Python process and returns what it measured.

    `loader` is "ours" (`load_component` of the component folder `source`), "diffusers"
    (`from_pretrained(source, torch_dtype=...)`) or "single" (`load_single_file_expert` of the single
    file `source`, with `weight_dtype`). The baseline is taken in the child after its imports, so every
    loader starts from the same clean state. Keys ending in `_above_baseline` are peaks during the load
    minus the baseline, in bytes.
    """
    return _run_script([loader, str(source), dtype, str(threads), weight_dtype], timeout)


def run_forked(function, *args) -> dict | None:
    """`function(*args)` (a dict, sent back as JSON) in a forked copy of this process: one that has the parent's
    imports but none of its later work. The parent must not have computed anything with torch before the fork
    (OpenMP's thread pool does not survive one). None if it failed; its traceback is on stderr."""
    import json
    import traceback

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        # The forked copy must never return into the parent's code: it reports, or prints why not, and exits.
        try:
            report = json.dumps(function(*args))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        with os.fdopen(write_end, "w") as out:
            out.write(report)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as incoming:
        text = incoming.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(text) if status == 0 and text else None


def measure_loads_in_forks(rows, *, threads: int = 2, timeout: float = 900) -> list[dict]:
    """`measure_load_in_subprocess` for each (loader, source, dtype, weight_dtype) row, paying for the imports once:
    one subprocess imports every loader's modules, then forks a fresh process per row, before any tensor work."""
    import json

    rows = [[loader, str(source), dtype, weight_dtype] for loader, source, dtype, weight_dtype in rows]
    return _run_script(["--forked", str(threads), json.dumps(rows)], timeout)


def _main_forked(threads: int, rows: list[list[str]]) -> None:
    import json

    # Every module any row's loader imports, before the baseline (as a running ComfyUI has them) and the forks.
    import torch  # noqa: F401
    from diffusers import WanVACETransformer3DModel  # noqa: F401

    import wanvace_core.load.folder_layout
    import wanvace_core.load.pipeline_folder
    import wanvace_core.load.quantized  # noqa: F401

    _import_single_file_loader()
    results = [
        run_forked(_measure_load, loader, source, dtype, threads, weight) for loader, source, dtype, weight in rows
    ]
    print(json.dumps(results))
    failed = [row for row, result in zip(rows, results, strict=True) if result is None]
    if failed:
        raise SystemExit(f"rows {failed} failed (tracebacks above)")


def _main(argv: list[str]) -> None:
    import json

    if argv[0] == "--forked":
        _main_forked(int(argv[1]), json.loads(argv[2]))
        return
    loader, source, dtype, threads, *rest = argv
    if loader not in (*LOADERS, SINGLE_FILE_LOADER):
        raise SystemExit(f"loader must be one of {(*LOADERS, SINGLE_FILE_LOADER)}")
    weight_dtype = rest[0] if rest else "auto"
    print(json.dumps(_measure_load(loader, source, dtype, int(threads), weight_dtype)))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
