"""Why the runtime keeps its hooks as torch module hooks and not in diffusers' `HookRegistry` (wanvace_core/hooks.py):
under the cache a registry hook on an expert or a block silently stops running, a module hook does not. If a
cache-dit release changes that, this test fails and the choice can be made again."""

from __future__ import annotations

import pytest
from diffusers.hooks import HookRegistry, ModelHook

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH
from wanvace_core import CacheOptions, SamplerSettings, VACEInputs, load_pipeline, prepare_conditioning, sample
from wanvace_core.hooks import ModuleHooks

SETTINGS = SamplerSettings(seed=5, steps=4, cfg=5.0, cfg_low_noise=4.0)


class _CountingHook(ModelHook):
    def __init__(self, counts: dict) -> None:
        super().__init__()
        self.counts = counts

    def pre_forward(self, module, *args, **kwargs):
        self.counts["registry"] += 1
        return args, kwargs


@pytest.mark.parametrize("where", ["expert", "block"])
def test_a_registry_hook_stops_running_under_the_cache_and_a_module_hook_does_not(where, tiny_folder):
    model = load_pipeline(tiny_folder, "fp32")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH))
    module = model.transformer if where == "expert" else model.transformer.blocks[0]
    counts = {"registry": 0, "module": 0}
    HookRegistry.check_if_exists_or_initialize(module).register_hook(_CountingHook(counts), "count")
    before = dict(module._forward_pre_hooks)
    hooks = ModuleHooks()
    hooks.pre(module, lambda *_: counts.__setitem__("module", counts["module"] + 1))

    sample(model, cond, SETTINGS)
    uncached = dict(counts)
    counts.update(registry=0, module=0)
    sample(model, cond, SETTINGS, cache=CacheOptions())

    assert uncached["registry"] == uncached["module"] > 0, uncached
    assert counts == {"registry": 0, "module": uncached["module"]}, (uncached, counts)
    hooks.remove()
    assert dict(module._forward_pre_hooks) == before
