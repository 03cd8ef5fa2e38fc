"""Cost per step of each guidance option and of the denoised estimate (x0) the step callback gets, as ratios to the
plain step, measured side by side in one run on CPU.

    .venvs/current/bin/python bench/bench_guidance.py [--threads 2] [--steps 6] [--rounds 3]

The model is a random-weight WanVACE pipeline of the real classes, wider than the tests' tiny one (--heads x 64
channels per head, --layers blocks, the tiny text encoder) at --width x --height x --length, so that attention and
the projections, not Python, take the time; the ratios still depend on those sizes (the real model has 40 heads,
40 blocks and 512 text tokens): read them as the extra work each option adds, not as the A14B's. Each option runs
--rounds times interleaved with the others; the figure is the median per-step time of its runs.
"""

from __future__ import annotations

import itertools
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
from wanvace_core.generation.guidance import APGOptions, ExpertGuidance, GuidanceOptions  # noqa: E402
from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline  # noqa: E402
from wanvace_core.runtime.attention_guidance import NAGOptions, SkipLayerOptions  # noqa: E402


def _options() -> dict[str, tuple[float, GuidanceOptions | None, bool]]:
    """name -> (cfg, rules, with a step callback)."""
    both = lambda rule: GuidanceOptions(high_noise=rule, low_noise=rule)  # noqa: E731
    return {
        "plain cfg 5": (5.0, None, False),
        "x0 to the callback": (5.0, None, True),
        "CFG-Zero*": (5.0, both(ExpertGuidance(cfg_zero_star=True, zero_init_steps=0)), False),
        "APG (momentum -0.5)": (5.0, both(ExpertGuidance(apg=APGOptions(momentum=-0.5))), False),
        "TCFG": (5.0, both(ExpertGuidance(tcfg=True)), False),
        "SLG (1 block)": (5.0, GuidanceOptions(slg=SkipLayerOptions(blocks=(1,), start_percent=0.0)), False),
        "RIFLEx (auto)": (5.0, GuidanceOptions(riflex_index=-1), False),
        "plain cfg 1": (1.0, None, False),
        "NAG at cfg 1": (1.0, GuidanceOptions(nag=NAGOptions()), False),
    }


def main() -> None:
    parser = bench_arguments(__doc__, steps=6, width=256, height=160, length=33, rounds=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    args = parse(parser)
    spec = TinyModelSpec(
        num_layers=args.layers,
        vace_layers=(0, args.layers // 2),
        num_attention_heads=args.heads,
        attention_head_dim=64,
        ffn_dim=4 * 64 * args.heads,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = load_pipeline(write_tiny_pipeline(Path(tmp) / "bench-model", spec), "fp32")
        control = torch.rand(args.length, args.height, args.width, 3, generator=torch.Generator().manual_seed(0))
        inputs = VACEInputs("a bird", "blurry", args.width, args.height, args.length, control_video=control)
        cond = prepare_conditioning(model, inputs)
        options = _options()
        per_step: dict[str, list[float]] = {name: [] for name in options}
        for _ in range(args.rounds):
            for name, (cfg, rules, callback) in options.items():
                settings = SamplerSettings(seed=1, steps=args.steps, cfg=cfg, cfg_low_noise=cfg, scheduler="euler")
                stamps: list[float] = []

                def stamp(*_, stamps=stamps):
                    stamps.append(time.perf_counter())

                # The plain run's stamps come from a pre-hook on both experts' first call of each step instead, so
                # that it gets no callback (and computes no x0).
                hooks = []
                if not callback:
                    hooks = [
                        expert.register_forward_pre_hook(lambda *_, stamp=stamp: stamp()) for expert in model.experts
                    ]
                try:
                    sample(model, cond, settings, callback=stamp if callback else None, rules=rules)
                finally:
                    for hook in hooks:
                        hook.remove()
                calls = 2 if cfg > 1 and not callback else 1
                stamps = stamps[::calls] if not callback else stamps
                per_step[name] += [b - a for a, b in itertools.pairwise(stamps)]
    medians = {name: statistics.median(times) * 1000 for name, times in per_step.items()}
    print(f"torch {torch.__version__}, {args.threads} threads; {args.layers} blocks x {args.heads} heads x 64, ")
    print(f"{args.width}x{args.height}x{args.length} video, euler, {args.steps} steps, {args.rounds} rounds")
    for name, ms in medians.items():
        base = medians["plain cfg 1"] if "cfg 1" in name else medians["plain cfg 5"]
        print(f"  {name:22s} {ms:8.1f} ms/step  {ms / base:5.3f}x the plain step")


if __name__ == "__main__":
    main()
