"""The parallel workers on CUDA (NCCL): with one GPU, the sharded path at world size 1 through the launcher."""

from __future__ import annotations

import pytest
import torch

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    SamplerSettings,
    VACEInputs,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.parallel import ParallelOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SETTINGS = SamplerSettings(seed=3, steps=6, cfg=5.0, cfg_low_noise=4.0)
CACHE = CacheOptions(residual_diff_threshold=0.3, high_noise=ExpertCacheLimits(1), low_noise=ExpertCacheLimits(1))


@pytest.mark.parametrize("cache", [None, CACHE], ids=["uncached", "cached"])
def test_sharded_world_one_on_cuda_matches_the_single_device_path(tiny_folder, cache):
    reference = load_pipeline(tiny_folder, "fp32", device="cuda:0")
    cond = prepare_conditioning(
        reference, VACEInputs(positive=PROMPT, negative=NEGATIVE, width=WIDTH, height=HEIGHT, length=LENGTH)
    )
    expected = sample(reference, cond, SETTINGS, cache=cache)
    parallel = load_pipeline(tiny_folder, "fp32", device="cuda:0", parallel=ParallelOptions.from_text("cuda:0"))
    try:
        got = sample(parallel, cond, SETTINGS, cache=cache)
        again = sample(parallel, cond, SETTINGS, cache=cache)
    finally:
        parallel.remote.close()
    difference = (got.latents.cpu() - expected.latents.cpu()).abs().max().item()
    print(f"[parallel gpu] sharded world 1 vs single device, cache={cache is not None}: max abs diff {difference:.3g}")
    assert difference < 1e-4
    assert torch.equal(got.latents, again.latents)
    assert got.cache_report == expected.cache_report
