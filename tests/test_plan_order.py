"""The runtime plan runs its steps in the order `EXPERT_STEPS` and `RUN_STEPS` list, and where that order matters,
changing it breaks a run instead of silently dropping a step.

- `compiled_cache` after `cache`: the compiled forwards go onto the blocks cache-dit's functor patched. Before it,
  there is nothing to put them on; a run refuses rather than lose compile under the cache (tests/test_compile.py
  shows the listed order running every block compiled under cache-dit).
"""

from __future__ import annotations

import pytest
import torch

from tests.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH
from wanvace_core import (
    CacheOptions,
    RuntimePlan,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    load_pipeline,
    prepare_conditioning,
    replan,
    sample,
)
from wanvace_core.runtime import plan as runtime_plan

SETTINGS = SamplerSettings(seed=5, steps=2, cfg=5.0, cfg_low_noise=4.0)


@pytest.fixture(scope="module")
def model(tiny_folder):
    return load_pipeline(tiny_folder, "fp32")


def test_compile_before_the_cache_step_refuses_the_run(model, tiny_folder, monkeypatch):
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH))
    replan(model, RuntimePlan(compile=True))
    try:
        monkeypatch.setattr(runtime_plan, "RUN_STEPS", ("settle", "loras", "compiled_cache", "cache"))
        with pytest.raises(WanVACEInputError, match="cache-dit's WanVACE functor did not patch the blocks"):
            sample(model, cond, SETTINGS, cache=CacheOptions())
    finally:
        replan(model, RuntimePlan())
    monkeypatch.undo()
    # The refused run left nothing behind (cache-dit's patches and the compiled forwards are gone).
    assert torch.equal(
        sample(model, cond, SETTINGS).latents, sample(load_pipeline(tiny_folder, "fp32"), cond, SETTINGS).latents
    )
