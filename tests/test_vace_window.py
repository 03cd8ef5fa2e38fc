"""vace_start_percent / vace_end_percent: the VACE hints apply only within that share of the steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.offload_probes import attach_offload
from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import SamplerSettings, VACEInputs, WanVACEInputError, load_pipeline, prepare_conditioning, sample
from wanvace_core.runtime.caching import CacheOptions, ExpertCacheLimits
from wanvace_core.runtime.offload import OffloadOptions, SynchronousTransfer

STEPS = 8
SETTINGS = SamplerSettings(seed=11, steps=STEPS, cfg=4.0, cfg_low_noise=3.0)
NEVER_CACHE = ExpertCacheLimits(max_warmup_steps=1000)


@pytest.fixture(scope="module")
def model(tiny_folder):
    return load_pipeline(tiny_folder, "fp32")


def _cond(model, **overrides):
    values = {"positive": PROMPT, "negative": NEGATIVE, "width": WIDTH, "height": HEIGHT, "length": LENGTH}
    values.update(build_task("v2v").ours)
    values.update(overrides)
    return prepare_conditioning(model, VACEInputs(**values))


def _trajectory(model, cond, cache=None):
    """The latents after every step, and at which steps the first VACE block of either expert ran."""
    steps, hint_steps, current = [], [], {"step": 0}
    handles = [
        expert.vace_blocks[0].register_forward_pre_hook(lambda *_: hint_steps.append(current["step"]))
        for expert in model.experts
    ]

    def record(index, _total, latents):
        steps.append(latents.clone())
        current["step"] = index + 1

    try:
        result = sample(model, cond, SETTINGS, callback=record, cache=cache)
    finally:
        for handle in handles:
            handle.remove()
    return result.latents, steps, hint_steps


def test_the_full_window_is_todays_behaviour_bitwise(model):
    default = _cond(model)
    explicit = _cond(model, vace_start_percent=0.0, vace_end_percent=1.0)
    latents, _, hint_steps = _trajectory(model, default)
    explicit_latents, _, explicit_hints = _trajectory(model, explicit)
    assert torch.equal(latents, explicit_latents)
    # cfg > 1 on both experts: the cond and the uncond call each run the VACE blocks.
    assert hint_steps == explicit_hints == [step for step in range(STEPS) for _ in range(2)]
    # The stock diffusers forward (all hints up front) gives the same numbers: the window adds nothing when full.
    stock = [type(expert).forward.__get__(expert) for expert in model.experts]
    interleaved = [expert.forward for expert in model.experts]
    try:
        for expert, forward in zip(model.experts, stock, strict=True):
            expert.forward = forward
        assert torch.equal(sample(model, default, SETTINGS).latents, latents)
    finally:
        for expert, forward in zip(model.experts, interleaved, strict=True):
            expert.forward = forward


def test_an_empty_window_equals_strength_zero_and_runs_no_vace_block(model):
    empty, empty_steps, empty_hints = _trajectory(model, _cond(model, vace_start_percent=0.0, vace_end_percent=0.0))
    zero, zero_steps, zero_hints = _trajectory(model, _cond(model, strength=0.0))
    assert empty_hints == []
    assert len(zero_hints) == 2 * STEPS  # strength 0 still computes the hints (and weighs them 0)
    assert torch.equal(empty, zero)
    assert all(torch.equal(a, b) for a, b in zip(empty_steps, zero_steps, strict=True))


def test_a_window_in_between_changes_only_the_steps_outside_it(model):
    start, end = 0.25, 0.75  # steps 2..5 of 8
    windowed, steps, hint_steps = _trajectory(model, _cond(model, vace_start_percent=start, vace_end_percent=end))
    _, zero_steps, _ = _trajectory(model, _cond(model, strength=0.0))
    full, full_steps, _ = _trajectory(model, _cond(model))
    inside = [step for step in range(STEPS) if start <= step / STEPS < end]
    assert inside == [2, 3, 4, 5]
    assert hint_steps == [step for step in inside for _ in range(2)]
    # Before the window the run is the strength-0 run, step for step; its first step inside departs from it.
    assert all(torch.equal(steps[step], zero_steps[step]) for step in range(inside[0]))
    assert not torch.equal(steps[inside[0]], zero_steps[inside[0]])
    assert not torch.equal(windowed, full)

    # A window that ends early leaves the steps before its end exactly as the full run has them.
    _, early_steps, early_hints = _trajectory(model, _cond(model, vace_end_percent=0.5))
    assert early_hints == [step for step in range(4) for _ in range(2)]
    assert all(torch.equal(early_steps[step], full_steps[step]) for step in range(4))
    assert not torch.equal(early_steps[4], full_steps[4])


def test_the_window_holds_with_caching_and_with_layerwise_offload(model, tiny_folder):
    cond = _cond(model, vace_start_percent=0.25, vace_end_percent=0.75)
    reference = sample(model, cond, SETTINGS).latents
    nothing_cached = CacheOptions(high_noise=NEVER_CACHE, low_noise=NEVER_CACHE)
    cached = sample(model, cond, SETTINGS, cache=nothing_cached)
    assert [len(expert.cached_steps) for expert in cached.cache_report.experts] == [0, 0]
    assert torch.equal(cached.latents, reference)

    streamed = load_pipeline(tiny_folder, "fp32")
    attach_offload(streamed, OffloadOptions(mode="layerwise", prefetch_blocks=2), SynchronousTransfer())
    assert torch.equal(sample(streamed, dataclasses.replace(cond), SETTINGS).latents, reference)


def test_layerwise_offload_streams_no_vace_block_outside_the_window(tiny_folder):
    streamed = load_pipeline(tiny_folder, "fp32")
    attach_offload(streamed, OffloadOptions(mode="layerwise", prefetch_blocks=1), SynchronousTransfer())
    onloads = []
    streamed.residency.observers.append(lambda event: onloads.append(event.unit) if event.kind == "onload" else None)
    vace_blocks = len(streamed.transformer.vace_blocks)
    for start, end, steps_inside in ((0.0, 0.0, 0), (0.25, 0.75, 4), (0.0, 1.0, STEPS)):
        onloads.clear()
        sample(streamed, _cond(streamed, vace_start_percent=start, vace_end_percent=end), SETTINGS)
        streamed_vace = [unit for unit in onloads if ".vace_blocks." in unit]
        # Each step inside the window streams every VACE block once per call (cond and uncond).
        assert len(streamed_vace) == steps_inside * 2 * vace_blocks, (start, end)


@pytest.mark.parametrize(
    ("start", "end", "message"),
    [
        (-0.1, 1.0, "vace_start_percent=-0.1 is outside"),
        (0.0, 1.5, "vace_end_percent=1.5 is outside"),
        (0.6, 0.4, "vace_start_percent=0.6 is after vace_end_percent=0.4"),
        (float("nan"), 1.0, "vace_start_percent"),
    ],
)
def test_bad_windows_are_refused_before_any_encoding(model, start, end, message):
    with pytest.raises(WanVACEInputError, match=message):
        _cond(model, vace_start_percent=start, vace_end_percent=end)
