"""Context windows together with the rest of a run: the cache (a cache state per window), TaylorSeer, LoRAs, the
per-step preview of the fused video, and the tiled decode of the long result."""

from __future__ import annotations

import pytest
import torch

from bench.metrics import count_block_calls, expected_block_calls, psnr
from tests.support.lora_files import hand_merged, lora_content, rehomed, write_lora
from tests.support.vace_tasks import LONG, long_inputs
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    SamplerSettings,
    WanVACECacheError,
    WanVACEInputError,
    decode,
    load_pipeline,
    prepare_conditioning,
    sample,
    to_vae_space,
)
from wanvace_core.generation.tiling import VAETiling
from wanvace_core.generation.windows import ContextWindowOptions
from wanvace_core.runtime.caching import CachedExperts
from wanvace_core.runtime.lora import LoraPatch

# 17-frame windows overlapping 8 over LONG (33) frames: 3 windows of 5 latent frames at every step.
WINDOWS = ContextWindowOptions(context_length=17, context_overlap=8, schedule="standard_static")
WINDOW_COUNT = 3
# Enough steps for both experts to cache: at the tiny model's shift the high-noise expert takes the first few.
SETTINGS = SamplerSettings(seed=11, steps=8, cfg=5.0, cfg_low_noise=4.0)
NEVER = ExpertCacheLimits(max_warmup_steps=1000)
EAGER = ExpertCacheLimits(max_warmup_steps=1)


def _eager(mode: str = "DBCache") -> CacheOptions:
    return CacheOptions(mode=mode, residual_diff_threshold=0.3, high_noise=EAGER, low_noise=EAGER)


@pytest.fixture(scope="module")
def model(tiny_folder):
    return load_pipeline(tiny_folder, "fp32")


@pytest.fixture(scope="module")
def cond(model):
    return prepare_conditioning(model, long_inputs("inpaint"))


@pytest.fixture(scope="module")
def windowed(model, cond):
    return sample(model, cond, SETTINGS, windows=WINDOWS).latents


# --- the cache -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["DBCache", "DBCache+TaylorSeer"])
def test_windows_with_the_cache_and_nothing_cached_equal_uncached_windows_bitwise(model, cond, windowed, mode):
    result = sample(
        model, cond, SETTINGS, windows=WINDOWS, cache=CacheOptions(mode=mode, high_noise=NEVER, low_noise=NEVER)
    )
    assert torch.equal(result.latents, windowed)
    report = result.cache_report
    assert [expert.windows for expert in report.experts] == [WINDOW_COUNT, WINDOW_COUNT]
    assert sum(expert.steps for expert in report.experts) == SETTINGS.steps * WINDOW_COUNT
    assert all(expert.cached_steps == () and expert.cfg_cached_steps == () for expert in report.experts)
    calibrator = "TaylorSeer (order 1)" if mode == "DBCache+TaylorSeer" else None
    assert [expert.calibrator for expert in report.experts] == [calibrator, calibrator]
    assert f"({WINDOW_COUNT} windows)" in report.text()


def _record_contexts(model, calls: list, window: list):
    """Pre-hooks on each expert's first block (computed on cached steps too) that record, per pass, the window
    running and the cache-dit context its cached blocks set for that pass."""
    handles = []
    for attribute, name in (("transformer", "high-noise"), ("transformer_2", "low-noise")):
        expert = getattr(model, attribute)

        def hook(*_args, _expert=expert, _name=name):
            calls.append((_name, window[-1], _expert._context_manager.current_context))

        handles.append(expert.blocks[0].register_forward_pre_hook(hook))
    return handles


@pytest.mark.parametrize("mode", ["DBCache", "DBCache+TaylorSeer"])
def test_each_window_caches_with_its_own_state_and_block_calls_drop_as_reported(model, cond, windowed, mode):
    options = _eager(mode)
    calls, window = [], []
    handles = _record_contexts(model, calls, window)
    counts, count_handles = count_block_calls(model)
    try:
        result = sample(
            model,
            cond,
            SETTINGS,
            windows=WINDOWS,
            cache=options,
            between_windows=lambda: window.append(len(window) % WINDOW_COUNT),
        )
    finally:
        for handle in handles + count_handles:
            handle.remove()
    report = result.cache_report
    for expert in report.experts:
        assert expert.cached_steps and expert.cfg_cached_steps, f"{expert.expert} expert cached nothing"
    # Each (expert, window) pair used one cache-dit context for all its passes, and no two pairs shared one: one
    # window's residuals never decided another's.
    contexts = {}
    for expert, position, context in calls:
        contexts.setdefault((expert, position), set()).add(id(context))
    pairs = [(expert, position) for expert in ("high-noise", "low-noise") for position in range(WINDOW_COUNT)]
    assert sorted(contexts) == pairs
    assert all(len(ids) == 1 for ids in contexts.values()), contexts
    assert len({next(iter(ids)) for ids in contexts.values()}) == len(contexts)
    expected = expected_block_calls(report, options, model.transformer.config.num_layers)
    for expert in report.experts:
        assert counts[(expert.expert, "blocks")] == expected[expert.expert]
    assert not torch.equal(result.latents, windowed)


def test_a_cache_state_shared_by_the_windows_is_refused_not_reported(model, cond, monkeypatch):
    monkeypatch.setattr(CachedExperts, "use_window", lambda self, position: None)
    # cache-dit restarts a context that passes its step count, so the count it reports wraps; any mismatch refuses.
    with pytest.raises(WanVACECacheError, match="steps of the high-noise expert but it ran 3"):
        sample(model, cond, SETTINGS, windows=WINDOWS, cache=_eager())


def test_a_window_over_the_whole_video_with_the_cache_equals_the_cache_without_windows(model, cond):
    expected = sample(model, cond, SETTINGS, cache=_eager())
    whole = ContextWindowOptions(context_length=LONG, context_overlap=8)
    result = sample(model, cond, SETTINGS, windows=whole, cache=_eager())
    assert torch.equal(result.latents, expected.latents)
    assert result.cache_report == expected.cache_report
    assert all(expert.cached_steps for expert in result.cache_report.experts)


@pytest.mark.parametrize("schedule", ["standard_uniform", "looped_uniform"])
def test_the_cache_refuses_windows_that_move_every_step(model, cond, schedule):
    moving = ContextWindowOptions(context_length=17, context_overlap=8, schedule=schedule)
    with pytest.raises(WanVACEInputError, match=f"schedule standard_static, not '{schedule}'"):
        sample(model, cond, SETTINGS, windows=moving, cache=_eager())


# --- LoRA, previews, decode ----------------------------------------------------------------------------------


def test_a_merged_lora_with_windows_equals_the_hand_merged_model_with_windows_bitwise(tiny_folder, cond, tmp_path):
    base = rehomed(load_pipeline(tiny_folder, "fp32"))
    content = lora_content(base, rank=4, seed=1, alpha=2.0, diffs=True)
    path = write_lora(tmp_path / "style.safetensors", content, "lightx2v")
    plain = sample(base, cond, SETTINGS, windows=WINDOWS).latents
    merged = sample(base.with_loras(LoraPatch(path, 1.0, 0.5, merge=True)), cond, SETTINGS, windows=WINDOWS).latents
    hand = rehomed(load_pipeline(tiny_folder, "fp32"))
    hand_merged(hand.transformer, content, 1.0)
    hand_merged(hand.transformer_2, content, 0.5)
    expected = sample(hand, cond, SETTINGS, windows=WINDOWS).latents
    assert not torch.equal(expected, plain), "the LoRA must change the output for this test to mean anything"
    assert torch.equal(merged, expected)
    assert torch.equal(sample(base, cond, SETTINGS, windows=WINDOWS).latents, plain), "the LoRA is gone afterwards"


def test_each_step_previews_the_whole_fused_video_once(model, cond, windowed):
    previews = []
    sample(
        model,
        cond,
        SETTINGS,
        windows=WINDOWS,
        callback=lambda index, total, latents: previews.append((index, total, latents.clone())),
    )
    assert [(index, total) for index, total, _ in previews] == [(i, SETTINGS.steps) for i in range(SETTINGS.steps)]
    references = cond.num_reference_images
    assert all(latents.shape[2] == references + windowed.shape[2] for _, _, latents in previews)
    assert torch.equal(previews[-1][2][:, :, references:], windowed)


def test_the_long_windowed_video_decodes_in_tiles(model, windowed):
    vae_latents = to_vae_space(model, windowed)
    untiled_calls, tiled_calls = [], []
    handle = model.vae.decoder.register_forward_hook(lambda *_: untiled_calls.append(None))
    try:
        untiled = decode(model, vae_latents)
        handle.remove()
        handle = model.vae.decoder.register_forward_hook(lambda *_: tiled_calls.append(None))
        tiled = decode(model, vae_latents, VAETiling(mode="on", tile_size=32, overlap=16))
    finally:
        handle.remove()
    assert tiled.shape == untiled.shape and tiled.shape[0] == LONG
    # The decoder runs once per latent frame untiled, and once per tile and latent frame tiled.
    assert len(untiled_calls) == windowed.shape[2]
    assert len(tiled_calls) > len(untiled_calls), "the decode ran untiled"
    assert len(tiled_calls) % len(untiled_calls) == 0
    assert psnr(untiled, tiled) > 20.0
