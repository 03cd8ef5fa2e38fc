"""Cache-DiT on both experts: exact VACE hints, fresh state per run, and proof that what was enabled ran."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanVACEPipeline

from bench.metrics import count_block_calls, expected_block_calls, psnr
from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    SamplerSettings,
    VACEInputs,
    WanVACECacheError,
    WanVACEInputError,
    prepare_conditioning,
    sample,
)

STEPS = 16
NEVER_CACHE = ExpertCacheLimits(max_warmup_steps=1000)
EAGER = ExpertCacheLimits(max_warmup_steps=1)


def _settings(**overrides) -> SamplerSettings:
    values = {"seed": 3, "steps": STEPS, "cfg": 5.0, "cfg_low_noise": 4.0}
    values.update(overrides)
    return SamplerSettings(**values)


def _eager(**overrides) -> CacheOptions:
    values = {"residual_diff_threshold": 0.2, "high_noise": EAGER, "low_noise": EAGER}
    values.update(overrides)
    return CacheOptions(**values)


@pytest.fixture(scope="module")
def model(tiny_folder):
    from wanvace_core import load_pipeline

    return load_pipeline(tiny_folder, "fp32")


def _cond(model, task: str):
    return prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **build_task(task).ours))


@pytest.mark.parametrize("task", ["v2v", "r2v"])
@pytest.mark.parametrize("mode", ["DBCache", "DBCache+TaylorSeer"])
def test_caching_with_nothing_cached_is_bitwise_equal_to_uncached(task, mode, model):
    cond = _cond(model, task)
    uncached = sample(model, cond, _settings())
    options = CacheOptions(mode=mode, high_noise=NEVER_CACHE, low_noise=NEVER_CACHE)
    cached = sample(model, cond, _settings(), cache=options)
    assert uncached.cache_report is None
    assert [len(expert.cached_steps) for expert in cached.cache_report.experts] == [0, 0]
    assert torch.equal(cached.latents, uncached.latents)


def test_both_experts_cache_and_block_calls_drop_as_reported(model):
    cond = _cond(model, "v2v")
    options = _eager()
    counts, handles = count_block_calls(model)
    try:
        result = sample(model, cond, _settings(), cache=options)
    finally:
        for handle in handles:
            handle.remove()
    report = result.cache_report
    assert [expert.expert for expert in report.experts] == ["high-noise", "low-noise"]
    assert sum(expert.steps for expert in report.experts) == STEPS
    for expert in report.experts:
        assert expert.cached_steps, f"{expert.expert} expert cached nothing"
        assert expert.cfg_steps == expert.steps
    config = model.transformer.config
    expected = expected_block_calls(report, options, config.num_layers)
    for expert in report.experts:
        assert counts[(expert.expert, "blocks")] == expected[expert.expert]
        # VACE blocks are never skipped: every pass computes every hint.
        assert counts[(expert.expert, "vace_blocks")] == 2 * expert.steps * len(config.vace_layers)
    full = sum(2 * expert.steps * config.num_layers for expert in report.experts)
    assert sum(expected.values()) < full


def test_taylorseer_runs_changes_the_output_and_both_modes_are_deterministic(model):
    cond = _cond(model, "v2v")
    uncached = sample(model, cond, _settings()).latents
    plain = [sample(model, cond, _settings(), cache=_eager()) for _ in range(2)]
    taylor = [sample(model, cond, _settings(), cache=_eager(mode="DBCache+TaylorSeer")) for _ in range(2)]
    assert torch.equal(plain[0].latents, plain[1].latents)
    assert torch.equal(taylor[0].latents, taylor[1].latents)
    assert not torch.equal(plain[0].latents, taylor[0].latents)
    assert all(expert.calibrator is None for expert in plain[0].cache_report.experts)
    assert all(expert.calibrator == "TaylorSeer (order 1)" for expert in taylor[0].cache_report.experts)
    assert "calibrator: TaylorSeer (order 1)" in taylor[0].cache_report.text()
    # Both are approximations of the uncached run, not something else entirely.
    assert psnr(uncached, plain[0].latents) > 20 and psnr(uncached, taylor[0].latents) > 20


def test_settings_changes_between_runs_take_effect_and_match_fresh_runs(model, tiny_folder):
    from wanvace_core import load_pipeline

    cond = _cond(model, "r2v")
    sequence = [
        (_settings(steps=20), _eager()),
        (_settings(steps=20), None),
        (_settings(steps=12), _eager()),
        (_settings(steps=20, boundary_ratio=0.9), _eager(residual_diff_threshold=0.1)),
        (_settings(steps=20), _eager()),
    ]
    in_sequence = [sample(model, cond, settings, cache=cache) for settings, cache in sequence]
    for (settings, cache), result in zip(sequence, in_sequence, strict=True):
        fresh_model = load_pipeline(tiny_folder, "fp32")
        alone = sample(fresh_model, _cond(fresh_model, "r2v"), settings, cache=cache)
        assert torch.equal(result.latents, alone.latents)
        assert result.cache_report == alone.cache_report
    assert torch.equal(in_sequence[0].latents, in_sequence[4].latents)


def test_cancelled_cached_run_leaves_no_state_behind(model):
    cond = _cond(model, "v2v")
    expected = sample(model, cond, _settings(), cache=_eager())

    class Cancelled(Exception):
        pass

    def cancel(index, _total, _latents):
        if index == 9:
            raise Cancelled

    with pytest.raises(Cancelled):
        sample(model, cond, _settings(), callback=cancel, cache=_eager())
    assert not getattr(model.transformer, "_is_cached", False)
    after = sample(model, cond, _settings(), cache=_eager())
    assert torch.equal(after.latents, expected.latents)
    assert after.cache_report == expected.cache_report
    assert torch.equal(sample(model, cond, _settings()).latents, sample(model, cond, _settings()).latents)


def test_uncached_output_is_unchanged_after_caching_was_used(tiny_folder):
    from wanvace_core import load_pipeline

    fresh = load_pipeline(tiny_folder, "fp32")
    cond = _cond(fresh, "v2v")
    before = sample(fresh, cond, _settings()).latents
    sample(fresh, cond, _settings(), cache=_eager(mode="DBCache+TaylorSeer"))
    assert torch.equal(sample(fresh, cond, _settings()).latents, before)


def test_guidance_one_on_one_expert_caches_without_a_cfg_branch(model):
    cond = _cond(model, "v2v")
    result = sample(model, cond, _settings(cfg=1.0), cache=_eager())
    high, low = result.cache_report.experts
    assert high.cfg_steps == 0 and high.cfg_cached_steps == ()
    assert low.cfg_steps == low.steps
    assert high.cached_steps and low.cached_steps


@pytest.mark.parametrize(("boundary_ratio", "expert"), [(0.0, "high-noise"), (1.0, "low-noise")])
def test_one_expert_runs_gives_one_cached_expert(boundary_ratio, expert, model):
    result = sample(model, _cond(model, "t2v"), _settings(boundary_ratio=boundary_ratio), cache=_eager())
    assert [report.expert for report in result.cache_report.experts] == [expert]
    assert result.cache_report.experts[0].steps == STEPS


def test_single_expert_wan21_model_caches(tiny_single_folder):
    from wanvace_core import load_pipeline

    single = load_pipeline(tiny_single_folder, "fp32")
    cond = _cond(single, "v2v")
    result = sample(single, cond, _settings(), cache=_eager())
    assert [expert.expert for expert in result.cache_report.experts] == ["high-noise"]
    assert result.cache_report.experts[0].cached_steps


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(Bn_compute_blocks=2), "Bn_compute_blocks=2 reaches back over VACE layer 2"),
        (dict(Fn_compute_blocks=4, Bn_compute_blocks=1), "exceeds the model's 4 blocks"),
    ],
)
def test_block_counts_the_model_cannot_honour_are_refused(options, message, model):
    with pytest.raises(WanVACEInputError, match=message):
        sample(model, _cond(model, "t2v"), _settings(), cache=CacheOptions(**options))
    assert not getattr(model.transformer, "_is_cached", False)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CacheOptions(mode="FBCache"), "mode='FBCache'"),
        (lambda: CacheOptions(Fn_compute_blocks=0), "Fn_compute_blocks=0"),
        (lambda: CacheOptions(residual_diff_threshold=0.0), "residual_diff_threshold=0.0"),
        (lambda: CacheOptions(taylorseer_order=7), "taylorseer_order=7"),
        (lambda: ExpertCacheLimits(max_warmup_steps=-1), "max_warmup_steps=-1"),
        (lambda: ExpertCacheLimits(max_cached_steps=-5), "max_cached_steps=-5"),
    ],
)
def test_invalid_cache_options_are_refused(make, message):
    with pytest.raises(WanVACEInputError, match=message):
        make()


def test_a_cache_that_does_not_attach_fails_loudly(model, monkeypatch):
    import cache_dit

    monkeypatch.setattr(cache_dit, "enable_cache", lambda adapter, **_kwargs: adapter)
    with pytest.raises(WanVACECacheError, match="did not take the block-level path"):
        sample(model, _cond(model, "t2v"), _settings(), cache=_eager())


def test_a_dropped_calibrator_fails_loudly(model, monkeypatch):
    from wanvace_core.runtime import caching

    monkeypatch.setattr(caching.CachedExperts, "_calibrator_config", lambda self: None)
    with pytest.raises(WanVACECacheError, match="TaylorSeer was enabled"):
        sample(model, _cond(model, "t2v"), _settings(), cache=_eager(mode="DBCache+TaylorSeer"))
    assert not getattr(model.transformer, "_is_cached", False)


@pytest.mark.parametrize("mode", ["DBCache", "DBCache+TaylorSeer"])
def test_parity_with_cache_dit_on_diffusers_pipeline(mode, model, tiny_folder):
    """Same cache-dit settings on diffusers' own WanVACEPipeline: same cached steps, bitwise-equal latents."""
    import cache_dit
    from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern, ParamsModifier, TaylorSeerCalibratorConfig
    from cache_dit.caching.patch_functors import WanVACEPatchFunctor

    options = _eager(mode=mode)
    case = build_task("v2v")
    ours = sample(model, _cond(model, "v2v"), _settings(), cache=options)
    high, low = ours.cache_report.experts

    reference = WanVACEPipeline.from_pretrained(tiny_folder, torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    calibrator = TaylorSeerCalibratorConfig(taylorseer_order=1) if options.uses_taylorseer else None

    def config(steps: int) -> DBCacheConfig:
        return DBCacheConfig(
            Fn_compute_blocks=1,
            Bn_compute_blocks=0,
            residual_diff_threshold=options.residual_diff_threshold,
            max_warmup_steps=1,
            num_inference_steps=steps,
        )

    adapter = BlockAdapter(
        pipe=reference,
        transformer=[reference.transformer, reference.transformer_2],
        blocks=[reference.transformer.blocks, reference.transformer_2.blocks],
        forward_pattern=[ForwardPattern.Pattern_2, ForwardPattern.Pattern_2],
        patch_functor=WanVACEPatchFunctor(),
        has_separate_cfg=True,
        params_modifiers=[
            ParamsModifier(cache_config=config(high.steps), calibrator_config=calibrator),
            ParamsModifier(cache_config=config(low.steps), calibrator_config=calibrator),
        ],
    )
    cache_dit.enable_cache(adapter, cache_config=DBCacheConfig(num_inference_steps=None), calibrator_config=calibrator)
    try:
        theirs = reference(
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            height=HEIGHT,
            width=WIDTH,
            num_frames=LENGTH,
            num_inference_steps=STEPS,
            guidance_scale=5.0,
            guidance_scale_2=4.0,
            generator=torch.Generator("cpu").manual_seed(3),
            output_type="latent",
            **case.theirs,
        ).frames
        their_high = cache_dit.summary(reference.transformer, logging=False)[-1]
        their_low = cache_dit.summary(reference.transformer_2, logging=False)[-1]
    finally:
        cache_dit.disable_cache(adapter)
    assert list(high.cached_steps) == their_high.cached_steps
    assert list(low.cached_steps) == their_low.cached_steps
    assert list(low.cfg_cached_steps) == their_low.cfg_cached_steps
    assert torch.equal(ours.latents, theirs)


def test_a_failure_after_cache_dit_attached_leaves_the_model_as_it_was(model, monkeypatch):
    import cache_dit

    from wanvace_core.runtime.interleave import uses_interleaved_vace

    cond = _cond(model, "v2v")
    baseline = sample(model, cond, _settings()).latents
    real_enable = cache_dit.enable_cache

    def attach_then_fail(adapter, **kwargs):
        real_enable(adapter, **kwargs)
        raise ValueError("simulated failure after attaching")

    monkeypatch.setattr(cache_dit, "enable_cache", attach_then_fail)
    with pytest.raises(WanVACECacheError, match="simulated failure after attaching"):
        sample(model, cond, _settings(), cache=_eager())
    for expert in model.experts:
        assert not getattr(expert, "_is_cached", False)
        assert uses_interleaved_vace(expert)
    assert torch.equal(sample(model, cond, _settings()).latents, baseline)
