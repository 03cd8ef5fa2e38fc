"""Per-step time and peak VRAM per GPU of the A14B expert on 1 GPU against N GPUs (needs CUDA).

    .venvs/current/bin/python bench/bench_parallel_gpu.py [--gpus N] [--height 720 --width 1280 --frames 81]
                                                          [--layers 40] [--steps 2]

One Wan2.2-VACE-Fun-A14B expert (dim 5120, 40 heads, ffn 13824, VACE blocks every fifth layer; `--layers`
shortens it for a quick look) with random bf16 weights, one CFG step = two forwards (cond, uncond). The
driver runs each configuration under `torch.distributed.run` on this machine, one after the other, and
prints the table and the speed-up over one GPU, measured in this one run:

- `1 GPU`: the plain expert on cuda:0 (the single-device path);
- `1 GPU, sharded`: the FSDP path at world size 1 (what every sharded rank runs), only with one GPU;
- `N GPUs, fsdp + ulysses N`: each rank holds 1/N of the blocks and 1/N of the tokens;
- `N GPUs, fsdp + cfg + ulysses N/2`: the two CFG branches on separate halves.

Weights are drawn on each rank for its own shard (no files: loading is measured by bench_load.py and
tested in tests/test_parallel_sharding.py).
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

from bench.bench_offload_gpu import A14B  # noqa: E402 - the one A14B config of the GPU benches


def _config(layers: int) -> dict:
    return {**A14B, "num_layers": layers, "vace_layers": list(range(0, layers, 5))}


def _rank_run(spec: dict) -> None:
    """One rank of one configuration (started by torch.distributed.run)."""
    import torch.distributed as dist
    from accelerate import init_empty_weights
    from diffusers import WanVACETransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh

    from wanvace_core.interleave import apply_interleaved_vace
    from wanvace_core.parallel.guidance import ParallelGuidance
    from wanvace_core.parallel.sequence import apply_ulysses
    from wanvace_core.parallel.sharding import local_shard_bytes, shard_expert

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    store, _, _ = next(dist.rendezvous("env://"))
    cfg_size = 2 if spec["cfg_parallel"] else 1
    branch_size = world // cfg_size
    branch, branch_rank = rank // branch_size, rank % branch_size
    dist.init_process_group(
        "nccl", store=dist.PrefixStore(f"branch{branch}/", store), rank=branch_rank, world_size=branch_size
    )
    dtype = torch.bfloat16
    config = _config(spec["layers"])
    if spec["shard"]:
        with init_empty_weights(include_buffers=False):
            expert = WanVACETransformer3DModel(**config)
        rope = {name: buffer for name, buffer in expert.named_buffers()}
        shard_expert(expert, init_device_mesh("cuda", (branch_size,)), dtype=dtype)
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
    shape = (1, 16, frames, spec["height"] // 8, spec["width"] // 8)
    generator = torch.Generator(device).manual_seed(0)  # the same inputs on every rank
    latents = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    control = torch.randn((1, 96, *shape[2:]), device=device, dtype=dtype, generator=generator)
    text = torch.randn(1, 512, 4096, device=device, dtype=dtype, generator=generator)
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
        from wanvace_core.sampling import Guidance

        guidance = Guidance()
    times = []
    with torch.no_grad():
        for step in range(spec["steps"] + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            guidance.predict(expert, 5.0, Cond, common)
            torch.cuda.synchronize()
            if step:
                times.append(time.perf_counter() - start)
    result = {
        "rank": rank,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "held_gib": held / 2**30,
        "step_s": statistics.median(times),
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


def _run(name: str, gpus: int, spec: dict, out_dir: Path) -> dict | None:
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
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        print(f"[parallel bench] {name}: FAILED (exit {done.returncode})\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return None
    ranks = json.loads(out.read_text())
    row = {
        "name": name,
        "gpus": gpus,
        "step_s": max(r["step_s"] for r in ranks),
        "peak_gib": [round(r["peak_gib"], 1) for r in ranks],
        "held_gib": [round(r["held_gib"], 1) for r in ranks],
        "wall_s": time.monotonic() - started,
    }
    print(
        f"[parallel bench] {name}: {row['step_s']:.2f} s/step, peak VRAM per GPU {row['peak_gib']} GiB "
        f"(weights held {row['held_gib']} GiB)",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for the parallel rows (default: all)")
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rank-run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        _rank_run(json.loads(args.rank_run))
        return
    if not torch.cuda.is_available():
        print("[parallel bench] no CUDA device: nothing measured")
        return
    gpus = args.gpus or torch.cuda.device_count()
    base = {
        "height": args.height,
        "width": args.width,
        "frames": args.frames,
        "layers": args.layers,
        "steps": args.steps,
    }
    tokens = ((args.frames - 1) // 4 + 1) * (args.height // 16) * (args.width // 16)
    print(
        f"[parallel bench] A14B expert, {args.layers} layers, {args.width}x{args.height}x{args.frames} "
        f"({tokens} tokens), bf16, one CFG step = 2 forwards; {gpus} GPU(s)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out_dir:
        out = Path(out_dir)
        rows = [_run("1 GPU", 1, {**base, "shard": False, "ulysses": 1, "cfg_parallel": False}, out)]
        if gpus == 1:
            rows.append(
                _run("1 GPU, sharded (world 1)", 1, {**base, "shard": True, "ulysses": 1, "cfg_parallel": False}, out)
            )
        else:
            rows.append(
                _run(
                    f"{gpus} GPUs, fsdp + ulysses {gpus}",
                    gpus,
                    {**base, "shard": True, "ulysses": gpus, "cfg_parallel": False},
                    out,
                )
            )
            if gpus % 2 == 0:
                rows.append(
                    _run(
                        f"{gpus} GPUs, fsdp + cfg + ulysses {gpus // 2}",
                        gpus,
                        {**base, "shard": True, "ulysses": gpus // 2, "cfg_parallel": True},
                        out,
                    )
                )
    baseline = rows[0]
    if baseline is None:
        sys.exit(1)
    for row in rows[1:]:
        if row is not None:
            print(
                f"[parallel bench] speed-up of '{row['name']}' over '1 GPU': {baseline['step_s'] / row['step_s']:.2f}x"
            )
    if any(row is None for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
