"""Context windows on the CPU: peak host memory and time of one sampling step at 81, 161 and 241 frames, with 81-frame
windows (overlap 16) and without, each case in a fresh forked process (bench/windows_memory.py measures them;
experts with the real head size and FFN ratio, 256 x 256 pixels), with the ratios.

    .venvs/current/bin/python bench/bench_windows.py [--frames 81,161,241]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.windows_memory import WINDOWS, measured_in_a_subprocess  # noqa: E402
from wanvace_core.load.tiny import write_tiny_pipeline  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", default="81,161,241", help="video lengths, 4n+1, comma-separated")
    args = parser.parse_args()
    lengths = [int(frames) for frames in args.frames.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_tiny_pipeline(Path(scratch) / "tiny")
        cases = [(frames, windowed) for frames in lengths for windowed in (True, False)]
        results = {(r["frames"], r["windowed"]): r for r in measured_in_a_subprocess(folder, cases)}
    print(f"windows: {WINDOWS}; one sampling step (cfg 1), 256 x 256, peak private memory above the step's start")
    print(f"{'frames':>7} {'windowed MiB':>13} {'whole MiB':>10} {'windowed s':>11} {'whole s':>8} {'time w/o':>9}")
    for frames in lengths:
        windowed, whole = results[frames, True], results[frames, False]
        print(
            f"{frames:>7} {windowed['peak_private_mib']:>13.1f} {whole['peak_private_mib']:>10.1f} "
            f"{windowed['seconds']:>11.2f} {whole['seconds']:>8.2f} {windowed['seconds'] / whole['seconds']:>8.2f}x"
        )
    first = results[lengths[0], True]["peak_private_mib"]
    for frames in lengths[1:]:
        ratio = results[frames, True]["peak_private_mib"] / first
        print(f"windowed peak at {frames} / at {lengths[0]} frames: {ratio:.3f}")


if __name__ == "__main__":
    main()
