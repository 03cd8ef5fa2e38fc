"""Context windows bound the sampler's memory by the window: the peak host memory of one sampling step at 81, 161
and 241 frames with 81-frame windows stays within 10% of the 81-frame figure, each measured in a fresh forked
process on experts with the real head size and FFN ratio (bench/windows_memory.py measures)."""

from __future__ import annotations

import pytest

from bench.windows_memory import measured_in_a_subprocess

FRAMES = (81, 161, 241)
FLAT_WITHIN = 0.10


@pytest.mark.slow
@pytest.mark.one_set
def test_the_sampling_peak_follows_the_window_not_the_video(tiny_folder):
    results = measured_in_a_subprocess(tiny_folder, [(frames, True) for frames in FRAMES])
    first = results[0]["peak_private_mib"]
    for result in results:
        assert result["latent_frames"] == (result["frames"] - 1) // 4 + 1
        assert abs(result["peak_private_mib"] - first) <= FLAT_WITHIN * first, results
