"""Peak host memory (private and file-backed) per offload mode, measured on the CPU.

    .venvs/current/bin/python bench/bench_offload_host.py [--layers 8 --heads 8 --steps 4 --prefetch 1]

Writes two random bf16 experts (diffusers layout), then for each mode starts a fresh process that
loads both with our loader (bf16 from bf16 files: the weights stay memory-mapped, used in place),
attaches the offloader and runs `--steps` CFG steps (high-noise expert for the first half). It prints,
above the process's memory before loading, the peak private (RssAnon) and file-backed (RssFile)
memory during the run, the median step time, and whether the outputs are bitwise equal to `none`.

On the CPU the "device" is host memory too: in `model` and `layerwise` the copies that a GPU would
hold show up as private memory here, which is what the figures compare. With a GPU, those copies
live in VRAM and the host keeps only the memory-mapped weights plus (layerwise) the pinned ring.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 2**20


def _worker(mode: str, folders: list[str], steps: int, prefetch: int, threads: int) -> dict:
    import torch
    from diffusers import WanVACETransformer3DModel

    from bench.rss import PeakSampler, read_status
    from wanvace_core.load.folder_layout import ComponentFiles, _weight_files
    from wanvace_core.load.pipeline_folder import load_component
    from wanvace_core.runtime.interleave import apply_interleaved_vace
    from wanvace_core.runtime.offload import EXPERTS, Offloader, OffloadOptions, SynchronousTransfer

    torch.set_num_threads(threads)
    before = read_status()
    experts = []
    for folder in map(Path, folders):
        files = ComponentFiles(name=folder.name, folder=folder, weight_files=_weight_files(folder.name, folder))
        expert = load_component(WanVACETransformer3DModel, files, torch.bfloat16, torch.device("cpu"))
        apply_interleaved_vace(expert.eval().requires_grad_(False))
        experts.append(expert)
    loaded = read_status()
    offloader = None
    if mode != "none":
        options = OffloadOptions(mode=mode, prefetch_blocks=prefetch)
        offloader = Offloader(dict(zip(EXPERTS, experts, strict=True)), options, SynchronousTransfer())
    generator = torch.Generator().manual_seed(0)
    config = experts[0].config
    frames, height, width = 3, 16, 16
    inputs = {
        "hidden_states": torch.randn(1, 16, frames, height, width, generator=generator).bfloat16(),
        "timestep": torch.tensor([900]),
        "encoder_hidden_states": torch.randn(1, 64, config.text_dim, generator=generator).bfloat16(),
        "control_hidden_states": torch.randn(1, 96, frames, height, width, generator=generator).bfloat16(),
        "control_hidden_states_scale": torch.ones(len(config.vace_layers), dtype=torch.bfloat16),
        "return_dict": False,
    }
    negative = torch.randn(1, 64, config.text_dim, generator=generator).bfloat16()
    step_times, output = [], None
    with PeakSampler() as peak, torch.no_grad():
        for step in range(steps):
            expert = experts[0] if step < (steps + 1) // 2 else experts[1]
            start = time.perf_counter()
            cond = expert(**inputs)[0]
            uncond = expert(**{**inputs, "encoder_hidden_states": negative})[0]
            output = (uncond.float() + 5.0 * (cond.float() - uncond.float())).contiguous()
            step_times.append(time.perf_counter() - start)
    if offloader is not None:
        offloader.close()

    def size(module) -> int:
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    blocks = [*experts[0].blocks, *experts[0].vace_blocks]
    return {
        "mode": mode,
        "expert_bytes": size(experts[0]),
        "block_bytes": max(map(size, blocks)),
        "non_block_bytes": size(experts[0]) - sum(map(size, blocks)),
        "load_private": loaded["RssAnon"] - before["RssAnon"],
        "load_file": loaded["RssFile"] - before["RssFile"],
        "run_private": peak.peak_private - before["RssAnon"],
        "run_file": peak.peak_file - before["RssFile"],
        "median_step_s": statistics.median(step_times[1:] or step_times),
        "output_sha256": hashlib.sha256(output.numpy().tobytes()).hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="attention heads of 128 channels")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default="none,model,layerwise")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, *folders = args.worker
        print(json.dumps(_worker(mode, folders, args.steps, args.prefetch, args.threads)))
        return

    from bench.rss import write_transformer_folder

    with tempfile.TemporaryDirectory() as tmp:
        folders = [
            str(
                write_transformer_folder(
                    Path(tmp) / name, num_layers=args.layers, num_attention_heads=args.heads, seed=s
                )
            )
            for s, name in enumerate(("high_noise", "low_noise"))
        ]
        results = {}
        for mode in args.modes.split(","):
            command = [sys.executable, __file__, "--steps", str(args.steps), "--prefetch", str(args.prefetch)]
            command += ["--threads", str(args.threads), "--worker", mode, *folders]
            done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO)
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    first = next(iter(results.values()))
    print(
        f"two bf16 experts of {first['expert_bytes'] / MIB:.0f} MiB each (largest block "
        f"{first['block_bytes'] / MIB:.1f} MiB, non-block weights {first['non_block_bytes'] / MIB:.1f} MiB), "
        f"{args.steps} CFG steps, prefetch {args.prefetch}, "
        f"{args.threads} threads; MiB above the process before loading:"
    )
    print(
        "| mode | private after load | file-backed after load | peak private in run | peak file-backed in run "
        "| median step | output equal to none |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        same = r["output_sha256"] == results["none"]["output_sha256"] if "none" in results else "n/a"
        print(
            f"| {mode} | {r['load_private'] / MIB:.0f} | {r['load_file'] / MIB:.0f} | {r['run_private'] / MIB:.0f} "
            f"| {r['run_file'] / MIB:.0f} | {r['median_step_s'] * 1000:.0f} ms | {same} |"
        )


if __name__ == "__main__":
    main()
