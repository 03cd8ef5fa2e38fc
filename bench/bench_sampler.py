"""Per-step time of WanVACESampler's core loop against diffusers' WanVACEPipeline, same model, one run.

    .venvs/current/bin/python bench/bench_sampler.py [--steps 10] [--width 128 --height 96 --length 17]

Both sides denoise the same tiny random-weight model with the same inputs and seed; per-step times
come from each side's step callback, so prompt encoding and VAE work are excluded. The runs
interleave (ours, theirs, ours, ...) and the medians are compared. Also checks the latents agree.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import WanVACEPipeline

from bench.cli import bench_arguments, parse
from wanvace_core import SamplerSettings, VACEInputs, load_pipeline, prepare_conditioning, sample
from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline

PROMPT, NEGATIVE = "a bird flies over the sea at sunset", "low quality, blurry"


def _step_times(run) -> list[float]:
    stamps = [time.perf_counter()]
    run(lambda: stamps.append(time.perf_counter()))
    # The first interval includes set-up before step 0 (the pipeline encodes prompts and video there).
    return [later - earlier for earlier, later in itertools.pairwise(stamps[1:])]


def main() -> None:
    parser = bench_arguments(__doc__, steps=10, width=128, height=96, length=17, repeats=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parse(parser)

    spec = TinyModelSpec(
        num_layers=8, vace_layers=(0, 2, 4, 6), num_attention_heads=4, attention_head_dim=32, ffn_dim=256
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_pipeline(Path(tmp) / "bench-model", spec)
        ours = load_pipeline(folder, args.dtype)
        torch_dtype = ours.dtype
        theirs = WanVACEPipeline.from_pretrained(folder, torch_dtype=torch_dtype)
        theirs.set_progress_bar_config(disable=True)
        control = torch.rand(args.length, args.height, args.width, 3, generator=torch.Generator().manual_seed(0))
        inputs = VACEInputs(PROMPT, NEGATIVE, args.width, args.height, args.length, control_video=control)
        cond = prepare_conditioning(ours, inputs)
        settings = SamplerSettings(seed=1, steps=args.steps, cfg=5.0, cfg_low_noise=4.0)
        result = {}

        def run_ours(tick):
            result["ours"] = sample(ours, cond, settings, callback=lambda *_: tick()).latents

        def run_theirs(tick):
            def on_step(_pipe, _index, _t, kwargs):
                tick()
                return {}

            result["theirs"] = theirs(
                prompt=PROMPT,
                negative_prompt=NEGATIVE,
                video=[control.numpy()],
                width=args.width,
                height=args.height,
                num_frames=args.length,
                num_inference_steps=args.steps,
                guidance_scale=5.0,
                guidance_scale_2=4.0,
                generator=torch.Generator("cpu").manual_seed(1),
                output_type="latent",
                callback_on_step_end=on_step,
            ).frames

        ours_steps, theirs_steps = [], []
        for _ in range(args.repeats):
            ours_steps += _step_times(run_ours)
            theirs_steps += _step_times(run_theirs)
        ours_median = statistics.median(ours_steps)
        theirs_median = statistics.median(theirs_steps)
        tokens = (args.length - 1) // 4 + 1
        tokens *= (args.height // 16) * (args.width // 16)
        print(
            f"model: 8 layers, 4 VACE layers, dim 128; {args.width}x{args.height}x{args.length} ({tokens} tokens), "
            f"{args.dtype}, CFG on, {args.steps} steps x {args.repeats} runs, {args.threads} threads"
        )
        print(f"WanVACESampler core   median step {ours_median * 1000:8.1f} ms")
        print(f"diffusers pipeline    median step {theirs_median * 1000:8.1f} ms")
        print(f"ratio ours/diffusers  {ours_median / theirs_median:.3f}")
        print(f"latents max abs diff  {(result['ours'] - result['theirs']).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
