"""Peak host memory and time of one sampling step of a long video, with the 81-frame context windows or without, each
case in a fresh forked process (bench/rss.py) on experts with the real head size and FFN ratio.
tests/test_windows_memory.py holds the windowed peaks to the 81-frame one; bench/bench_windows.py prints them beside the
windowless ones, with the time per step.

    .venvs/current/bin/python bench/windows_memory.py TINY_FOLDER FRAMES[:windowed] ...   # the figures as JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZE = 256  # pixels square: 256 tokens per latent frame, so one 81-frame window is 5,376 tokens
WINDOWS = {"context_length": 81, "context_overlap": 16, "schedule": "standard_static", "freenoise": False}


def measure(folder: str, frames: int, windowed: bool) -> dict:
    """One sampling step of a `frames`-frame video (with or without the 81-frame windows): the peak host memory
    above what the process held before the step, and the step's time."""
    import ctypes
    import dataclasses
    import gc
    import time

    import torch

    from bench.rss import PeakSampler, sampler_experts
    from wanvace_core import ContextWindowOptions, SamplerSettings, VACEInputs, load_pipeline, prepare_conditioning
    from wanvace_core import sample as run_sampler
    from wanvace_core.runtime.plan import RuntimePlan, apply_plan

    torch.set_num_threads(2)
    model = load_pipeline(folder, "fp32")
    model.transformer, model.transformer_2 = sampler_experts(model)
    model._helper = None  # the diffusers helper is rebuilt over the new experts
    apply_plan(model, RuntimePlan())
    # The tiny VAE's encode of a long clip is not what is measured: the conditioning is prepared at 16 x 16 and its
    # control latents drawn at the run's size.
    small = prepare_conditioning(model, VACEInputs("a bird flies over the sea", "blurry", 16, 16, frames))
    shape = (*small.conditioning_latents.shape[:3], SIZE // 8, SIZE // 8)
    control = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    cond = dataclasses.replace(small, conditioning_latents=control, width=SIZE, height=SIZE)
    settings = SamplerSettings(seed=0, steps=1, cfg=1.0, cfg_low_noise=1.0)
    windows = ContextWindowOptions(**WINDOWS) if windowed else None
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with PeakSampler() as peak:
        start = time.perf_counter()
        latents = run_sampler(model, cond, settings, windows=windows).latents
        seconds = time.perf_counter() - start
    return {
        "frames": frames,
        "windowed": windowed,
        "peak_private_mib": peak.private_above_baseline / 2**20,
        "seconds": seconds,
        "latent_frames": latents.shape[2],
    }


def measure_in_forks(folder: str, cases: list[tuple[int, bool]]) -> list[dict]:
    # Imported before any fork, so no case pays for them; nothing may compute before the forks.
    import diffusers  # noqa: F401
    import torch  # noqa: F401

    import wanvace_core  # noqa: F401
    from bench.rss import run_forked

    results = [run_forked(measure, folder, frames, windowed) for frames, windowed in cases]
    failed = [case for case, result in zip(cases, results, strict=True) if result is None]
    if failed:
        raise SystemExit(f"cases {failed} failed (tracebacks above)")
    return results


def measured_in_a_subprocess(folder: Path, cases: list[tuple[int, bool]]) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "2",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    arguments = [f"{frames}:{'windowed' if windowed else 'whole'}" for frames, windowed in cases]
    command = [sys.executable, str(Path(__file__).resolve()), str(folder), *arguments]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    parsed = []
    for argument in sys.argv[2:]:
        frames, _, how = argument.partition(":")
        parsed.append((int(frames), how == "windowed"))
    print(json.dumps(measure_in_forks(sys.argv[1], parsed)))
