"""Timing for the GPU benches: untimed warm-up steps, then at least three timed ones, reported as their median and
spread, so a reader can tell a ratio from noise (a difference smaller than the spread is noise)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

MIN_TIMED = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(
    step: Callable[[int], object],
    warmup: int,
    steps: int,
    device: torch.device,
    after_warmup: Callable[[], None] | None = None,
) -> dict:
    """Runs `step(i)` `warmup` times untimed, then `steps` (>= 3) times, each timed alone (the device synchronized
    before and after); returns the times, their median, min, max and spread ((max - min) / median), the warm-up's
    seconds and the last step's output. `after_warmup()` runs between the two (a counter's reading)."""
    if steps < MIN_TIMED:
        raise ValueError(f"steps={steps}: at least {MIN_TIMED} timed steps are needed for a median and a spread")
    output = None
    sync(device)
    first = time.perf_counter()
    for index in range(warmup):
        output = step(index)
    sync(device)
    warmup_s = time.perf_counter() - first
    if after_warmup is not None:
        after_warmup()
    times = []
    for index in range(warmup, warmup + steps):
        sync(device)
        start = time.perf_counter()
        output = step(index)
        sync(device)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "times": times,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "spread": (max(times) - min(times)) / median if median > 0 else 0.0,
        "warmup_s": warmup_s,
        "output": output,
    }


def row_timing(result: dict) -> dict:
    """The timing fields of a bench/gpu_check.sh row (`seconds` is the median)."""
    return {"seconds": result["median_s"], "spread": result["spread"], "timed": len(result["times"])}
