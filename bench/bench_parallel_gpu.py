"""Per-step time and peak VRAM per GPU of the A14B expert on 1 GPU against N GPUs (needs CUDA).

    .venvs/current/bin/python bench/bench_parallel_gpu.py [--gpus N] [--height 720 --width 1280 --frames 81]
                                                          [--layers 40] [--steps 2]
    .venvs/current/bin/python bench/bench_parallel_gpu.py --device cpu --tiny    # CPU check of the logic (gloo)

One Wan2.2-VACE-Fun-A14B expert (dim 5120, 40 heads, ffn 13824, VACE blocks every fifth layer; `--layers`
shortens it for a quick look) with random bf16 weights, one CFG step = two forwards (cond, uncond). The
driver runs each configuration under `torch.distributed.run` on this machine, one after the other, and
prints the table and the speed-up over one GPU, measured in this one run:

- `1 GPU`: the plain expert on cuda:0 (the single-device path);
- `1 GPU, sharded`: the FSDP path at world size 1 (what every sharded rank runs), only with one GPU;
- `N GPUs, fsdp + ulysses N`: each rank holds 1/N of the blocks and 1/N of the tokens;
- `N GPUs, fsdp + cfg + ulysses N/2`: the two CFG branches on separate halves.

Each rank dies with its launcher (`bench.processes.die_with_parent`: torchrun starts ranks in their own sessions,
out of reach of a time limit's signal), and `--timeout` bounds each configuration. Each row is the median of
`--steps` timed CFG steps (each as long as its slowest rank) after one warm-up, with their spread.
Weights are drawn on each rank for its own shard (no files: loading is measured by bench_load.py and
tested in tests/test_parallel_sharding.py). `--json PATH` also writes the rows (bench/gpu_check.sh's table).
`--device cpu --tiny`: the same driver and ranks on one CPU worker over gloo with a tiny config of the
architecture (the `1 GPU` and `sharded (world 1)` rows; times mean nothing), to check the logic in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_offload_gpu import A14B, TEXT_TOKENS, TINY  # noqa: E402 - the one A14B config of the GPU benches
from bench.processes import die_with_parent  # noqa: E402
from bench.timing import sync  # noqa: E402


def _config(spec: dict) -> dict:
    if spec["tiny"]:
        return TINY
    layers = spec["layers"]
    return {**A14B, "num_layers": layers, "vace_layers": list(range(0, layers, 5))}


def _rank_run(spec: dict) -> None:
    """One rank of one configuration (started by torch.distributed.run)."""
    import torch.distributed as dist
    from accelerate import init_empty_weights
    from diffusers import WanVACETransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh

    from wanvace_core.generation.guidance import ParallelGuidance
    from wanvace_core.parallel.sequence import apply_ulysses
    from wanvace_core.parallel.sharding import local_shard_bytes, shard_expert
    from wanvace_core.runtime.interleave import apply_interleaved_vace

    die_with_parent()  # torchrun starts ranks in their own sessions: a killed launcher must take them along
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store, _, _ = next(dist.rendezvous("env://"))
    cfg_size = 2 if spec["cfg_parallel"] else 1
    branch_size = world // cfg_size
    branch, branch_rank = rank // branch_size, rank % branch_size
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore(f"branch{branch}/", store),
        rank=branch_rank,
        world_size=branch_size,
    )
    dtype = torch.bfloat16
    config = _config(spec)
    if spec["shard"]:
        with init_empty_weights(include_buffers=False):
            expert = WanVACETransformer3DModel(**config)
        rope = {name: buffer for name, buffer in expert.named_buffers()}
        shard_expert(expert, init_device_mesh(device.type, (branch_size,)), dtype=dtype)
        expert.to_empty(device=device)
        for name, buffer in rope.items():
            owner, _, attr = name.rpartition(".")
            expert.get_submodule(owner)._buffers[attr] = buffer.to(device)
        with torch.no_grad():
            for param in expert.parameters():
                local = param.to_local() if hasattr(param, "to_local") else param
                local.normal_(0, 0.02)
    else:
        with torch.device(device):
            expert = WanVACETransformer3DModel(**config).to(dtype)
    expert.eval().requires_grad_(False)
    if spec["ulysses"] > 1:
        apply_ulysses(expert, dist.new_group(list(range(branch_size))))
    apply_interleaved_vace(expert)
    held = (
        local_shard_bytes(expert) if spec["shard"] else sum(p.numel() * p.element_size() for p in expert.parameters())
    )

    frames = (spec["frames"] - 1) // 4 + 1
    shape = (1, config["in_channels"], frames, spec["height"] // 8, spec["width"] // 8)
    generator = torch.Generator(device).manual_seed(0)  # the same inputs on every rank
    latents = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    control = torch.randn((1, config["vace_in_channels"], *shape[2:]), device=device, dtype=dtype, generator=generator)
    text_tokens = 16 if spec["tiny"] else TEXT_TOKENS
    text = torch.randn(1, text_tokens, config["text_dim"], device=device, dtype=dtype, generator=generator)
    common = {
        "hidden_states": latents,
        "timestep": torch.tensor([900], device=device),
        "control_hidden_states": control,
        "control_hidden_states_scale": torch.ones(len(config["vace_layers"]), device=device),
        "return_dict": False,
    }

    class Cond:
        prompt_embeds = text
        negative_prompt_embeds = -text

    if spec["cfg_parallel"]:
        peers = dist.ProcessGroupGloo(dist.PrefixStore(f"peers{branch_rank}/", store), branch, 2)
        guidance = ParallelGuidance(branch, peers)
    else:
        from wanvace_core.generation.sampling import Guidance

        guidance = Guidance()
    times = []
    with torch.no_grad():
        for step in range(spec["steps"] + 1):  # the first is a warm-up
            sync(device)
            dist.barrier()
            start = time.perf_counter()
            guidance.predict(expert, 5.0, Cond, common)
            sync(device)
            if step:
                times.append(time.perf_counter() - start)
    result = {
        "rank": rank,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "held_gib": held / 2**30,
        "times": times,
    }
    if spec["cfg_parallel"]:
        # The branch worlds are separate; gather the peaks over the store.
        store.set(f"result{rank}", json.dumps(result))
        results = [json.loads(store.get(f"result{r}")) for r in range(world)] if rank == 0 else None
    else:
        results = [None] * world
        dist.all_gather_object(results, result)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.destroy_process_group()
    # Done and written: skip the interpreter's teardown of torch's distributed threads, as tests/support/distributed.py
    # does. A worker aborted once in a dry run on a loaded 2-core machine ("terminate called without an active
    # exception", not reproduced in 8 runs since), which the driver then counts as a failed configuration.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(name: str, gpus: int, spec: dict, out_dir: Path, timeout_s: float) -> dict | None:
    out = out_dir / f"{len(list(out_dir.iterdir()))}.json"
    spec = {**spec, "out": str(out)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        str(Path(__file__).resolve()),
        "--rank-run",
        json.dumps(spec),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    try:
        # On a timeout the launcher is killed, and each rank with it (die_with_parent).
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        print(f"[parallel bench] {name}: TIMED OUT after {timeout_s:.0f} s\n{(expired.stderr or '')[-3000:]}")
        return None
    if done.returncode != 0 or not out.exists():
        when = "after rank 0 wrote its results" if out.exists() else "before rank 0 wrote its results"
        print(
            f"[parallel bench] {name}: FAILED (exit {done.returncode}, {when})\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-3000:]}"
        )
        return None
    ranks = json.loads(out.read_text())
    peaks = [r["peak_gib"] for r in ranks if r["peak_gib"] is not None]
    # A step lasts as long as its slowest rank.
    steps = [max(times) for times in zip(*(r["times"] for r in ranks), strict=True)]
    median = statistics.median(steps)
    row = {
        "name": name,
        "gpus": gpus,
        "step_s": median,
        "spread": (max(steps) - min(steps)) / median if median else 0.0,
        "timed": len(steps),
        "peak_gib": [round(peak, 1) for peak in peaks],
        "max_peak_gib": max(peaks) if peaks else None,
        "held_gib": [round(r["held_gib"], 1) for r in ranks],
        "wall_s": time.monotonic() - started,
    }
    vram = f", peak VRAM per GPU {row['peak_gib']} GiB" if peaks else ""
    print(
        f"[parallel bench] {name}: {row['step_s']:.2f} s/step (spread {row['spread']:.1%}){vram} "
        f"(weights held {row['held_gib']} GiB)",
        flush=True,
    )
    return row


def _write_json(path: str | None, device: str, config: str, rows: list) -> None:
    """bench/gpu_check.sh's rows: per configuration, step time, the largest per-GPU peak and the speed-up."""
    if not path:
        return
    baseline = rows[0]
    table = []
    for row in rows:
        if row is None:
            continue
        ratios = {} if baseline is None or row is baseline else {"speed-up": baseline["step_s"] / row["step_s"]}
        table.append(
            {
                "row": row["name"],
                "seconds": row["step_s"],
                "spread": row["spread"],
                "timed": row["timed"],
                "peak_gib": row["max_peak_gib"],
                "ratios": ratios,
            }
        )
    report = {"bench": "parallel", "device": device, "config": config, "time_unit": "per CFG step", "rows": table}
    Path(path).write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: with --tiny, the logic")
    parser.add_argument("--tiny", action="store_true", help="a tiny config of the architecture (default 64x64x9)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for the parallel rows (default: all)")
    parser.add_argument("--height", type=int, default=None, help="pixels (default 720; --tiny 64)")
    parser.add_argument("--width", type=int, default=None, help="pixels (default 1280; --tiny 64)")
    parser.add_argument("--frames", type=int, default=None, help="4n+1 (default 81; --tiny 9)")
    parser.add_argument("--layers", type=int, default=40, help="A14B blocks (not with --tiny)")
    parser.add_argument("--steps", type=int, default=3, help="timed CFG steps (after one warm-up)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration (its ranks die too)")
    parser.add_argument("--json", help="also write the rows here as JSON (bench/gpu_check.sh's table)")
    parser.add_argument("--rank-run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        _rank_run(json.loads(args.rank_run))
        return
    for name, full, tiny in (("height", 720, 64), ("width", 1280, 64), ("frames", 81, 9)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("[parallel bench] no CUDA device: nothing measured")
        return
    # On the CPU one worker: the rows a one-GPU machine runs (several CPU workers are tests/test_parallel_*.py's).
    gpus = (args.gpus or torch.cuda.device_count()) if cuda else 1
    unit = "GPU" if cuda else "CPU worker"
    base = {
        "device": args.device,
        "tiny": args.tiny,
        "height": args.height,
        "width": args.width,
        "frames": args.frames,
        "layers": TINY["num_layers"] if args.tiny else args.layers,
        "steps": args.steps,
    }
    tokens = ((args.frames - 1) // 4 + 1) * (args.height // 16) * (args.width // 16)
    what = "tiny config" if args.tiny else "A14B expert"
    config = f"{what}, {base['layers']} layers, {args.width}x{args.height}x{args.frames}, {args.steps} CFG steps"
    print(
        f"[parallel bench] {what}, {base['layers']} layers, {args.width}x{args.height}x{args.frames} "
        f"({tokens} tokens), bf16, one CFG step = 2 forwards; {gpus} {unit}(s)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out_dir:
        out = Path(out_dir)
        rows = [_run(f"1 {unit}", 1, {**base, "shard": False, "ulysses": 1, "cfg_parallel": False}, out, args.timeout)]
        _write_json(args.json, args.device, config, rows)
        if gpus == 1:
            rows.append(
                _run(
                    f"1 {unit}, sharded (world 1)",
                    1,
                    {**base, "shard": True, "ulysses": 1, "cfg_parallel": False},
                    out,
                    args.timeout,
                )
            )
        else:
            rows.append(
                _run(
                    f"{gpus} GPUs, fsdp + ulysses {gpus}",
                    gpus,
                    {**base, "shard": True, "ulysses": gpus, "cfg_parallel": False},
                    out,
                    args.timeout,
                )
            )
            if gpus % 2 == 0:
                rows.append(
                    _run(
                        f"{gpus} GPUs, fsdp + cfg + ulysses {gpus // 2}",
                        gpus,
                        {**base, "shard": True, "ulysses": gpus // 2, "cfg_parallel": True},
                        out,
                        args.timeout,
                    )
                )
    baseline = rows[0]
    if baseline is None:
        sys.exit(1)
    _write_json(args.json, args.device, config, rows)
    for row in rows[1:]:
        if row is not None:
            print(
                f"[parallel bench] speed-up of '{row['name']}' over '{baseline['name']}': "
                f"{baseline['step_s'] / row['step_s']:.2f}x"
            )
    if any(row is None for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
