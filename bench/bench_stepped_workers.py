"""What a solver stepping in ComfyUI's process (its SAMPLER) costs against the built-in loop, in one process and with
the experts in two CFG-parallel CPU workers, where each of its denoiser calls is a round trip through rank 0: time
per step as ratios to the built-in euler's, measured side by side in one run.

    .venvs/current/bin/python bench/bench_stepped_workers.py [--threads 1] [--steps 6] [--rounds 3]

The outside solver is Euler on the denoised estimate (ComfyUI's `euler`, written here so that the bench needs no
ComfyUI tree): the same one call per step as the built-in euler, so the difference is the round trip (the latent to
the workers, the estimate back) and the solver's own arithmetic. The model is bench_guidance.py's wider random-weight
pipeline; the latent of a --width x --height x --length video is what travels, so the ratio falls as the model grows
(the real model computes far more per call than this one).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cli import bench_arguments, parse  # noqa: E402
from wanvace_core import SamplerSettings, VACEInputs, load_pipeline, prepare_conditioning, sample  # noqa: E402
from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline  # noqa: E402
from wanvace_core.parallel import ParallelOptions  # noqa: E402


class OutsideEuler:
    """Euler on the denoised estimate over the given sigmas, as a `stepping.Stepper`."""

    def call_sigmas(self, sigmas):
        return tuple(float(sigma) for sigma in sigmas[:-1])

    def run(self, denoiser, noise, sigmas, seed, on_step):
        x = noise * sigmas[0]
        for index in range(len(sigmas) - 1):
            denoised = denoiser(x, sigmas[index])
            x = x + (sigmas[index + 1] - sigmas[index]) * (x - denoised) / sigmas[index]
            on_step(index, len(sigmas) - 1, denoised)
        return x


def main() -> None:
    args = parse(bench_arguments(__doc__, steps=6, width=256, height=160, length=33, threads=1, rounds=3))
    spec = TinyModelSpec(num_layers=4, vace_layers=(0, 2), num_attention_heads=4, attention_head_dim=64, ffn_dim=1024)
    settings = SamplerSettings(seed=1, steps=args.steps, cfg=5.0, cfg_low_noise=5.0, scheduler="euler")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_pipeline(Path(tmp) / "bench-model", spec)
        local = load_pipeline(folder, "fp32")
        workers = load_pipeline(
            folder, "fp32", parallel=ParallelOptions(devices=("cpu", "cpu"), shard="none", cfg_parallel=True)
        )
        try:
            inputs = VACEInputs("a bird", "blurry", args.width, args.height, args.length)
            cond = prepare_conditioning(local, inputs)
            runs = {
                "one process, built-in euler": (local, None),
                "one process, outside euler": (local, OutsideEuler()),
                "2 workers, built-in euler": (workers, None),
                "2 workers, outside euler": (workers, OutsideEuler()),
            }
            sample(workers, cond, settings)  # the workers' first run (allocations, lazy imports) is not timed
            per_step: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, (model, stepper) in runs.items():
                    started = time.perf_counter()
                    sample(model, cond, settings, stepper=stepper)
                    per_step[name].append((time.perf_counter() - started) / args.steps)
        finally:
            workers.remote.close()
    latent = cond.conditioning_latents.shape
    megabytes = 4 * 16 * latent[2] * latent[3] * latent[4] / 1e6
    medians = {name: statistics.median(times) * 1000 for name, times in per_step.items()}
    print(f"torch {torch.__version__}, {args.threads} thread(s) per process; {args.width}x{args.height}x{args.length}")
    print(f"video ({megabytes:.2f} MB of latent each way per call), cfg 5, {args.steps} steps, {args.rounds} rounds")
    for name, ms in medians.items():
        base = medians[name.replace("outside", "built-in")]
        print(f"  {name:28s} {ms:8.1f} ms/step  {ms / base:5.3f}x the built-in loop's step")


if __name__ == "__main__":
    main()
