"""Batched CFG: each guided step's two passes run as one expert call of batch 2, within float rounding of the
separate passes, in every mode that changes how an expert runs; `auto` batches only when the memory is there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support.lora_files import lora_content, write_lora
from tests.support.offload_probes import attach_offload
from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    LoraPatch,
    OffloadOptions,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.generation.budget import batched_cfg_decision, sampling_activation_bytes
from wanvace_core.runtime.transfer import SynchronousTransfer

# fp32 on CPU, the tiny pair, 12 steps, both experts guided (the tests run 6). Measured max abs difference of the
# latents, batched against separate passes: 1.6e-6 to 1.9e-6 by task and torch version (batch 2 changes the GEMMs'
# blocking).
LATENT_TOLERANCE = 1e-5
SETTINGS = SamplerSettings(seed=3, steps=6, cfg=5.0, cfg_low_noise=4.0)
NEVER_CACHE = ExpertCacheLimits(max_warmup_steps=1000)


@pytest.fixture(scope="module")
def model(tiny_folder):
    return load_pipeline(tiny_folder, "fp32")


def _cond(model, task: str = "v2v"):
    return prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **build_task(task).ours))


def _batch_sizes(model, run) -> list[int]:
    """The batch size of every expert call `run()` makes, in order."""
    sizes: list[int] = []
    handles = [
        expert.register_forward_pre_hook(
            lambda _m, _a, kwargs: sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        for expert in model.experts
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return sizes


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("task", ["v2v", "r2v"])
def test_batched_passes_match_separate_ones_with_one_call_per_step(task, model):
    cond = _cond(model, task)
    separate = {}
    batched = {}
    separate_sizes = _batch_sizes(model, lambda: separate.update(result=sample(model, cond, SETTINGS)))
    batched_sizes = _batch_sizes(model, lambda: batched.update(result=sample(model, cond, SETTINGS, batched_cfg=True)))
    assert separate_sizes == [1] * (2 * SETTINGS.steps)
    assert batched_sizes == [2] * SETTINGS.steps
    assert _max_diff(batched["result"].latents, separate["result"].latents) <= LATENT_TOLERANCE


def test_unguided_steps_make_one_batch_one_call_either_way(model):
    cond = _cond(model)
    settings = SamplerSettings(seed=3, steps=6, cfg=1.0, cfg_low_noise=1.0)
    runs = {}
    sizes = _batch_sizes(model, lambda: runs.update(batched=sample(model, cond, settings, batched_cfg=True)))
    assert sizes == [1] * 6
    assert torch.equal(runs["batched"].latents, sample(model, cond, settings).latents)


@pytest.mark.parametrize("mode", ["DBCache", "DBCache+TaylorSeer"])
def test_batched_with_nothing_cached_is_bitwise_batched_uncached(mode, model):
    cond = _cond(model)
    uncached = sample(model, cond, SETTINGS, batched_cfg=True)
    options = CacheOptions(mode=mode, high_noise=NEVER_CACHE, low_noise=NEVER_CACHE)
    cached = sample(model, cond, SETTINGS, cache=options, batched_cfg=True)
    assert [len(expert.cached_steps) for expert in cached.cache_report.experts] == [0, 0]
    assert torch.equal(cached.latents, uncached.latents)


def test_batched_with_cache_caches_steps_of_both_experts(model):
    eager = ExpertCacheLimits(max_warmup_steps=1)
    options = CacheOptions(residual_diff_threshold=0.2, high_noise=eager, low_noise=eager)
    result = sample(model, _cond(model), SETTINGS, cache=options, batched_cfg=True)
    for expert in result.cache_report.experts:
        assert expert.cached_steps, expert
        assert expert.cfg_steps == 0  # one call per step: cache-dit keeps no separate CFG state


@pytest.mark.parametrize("offload", ["model", "layerwise"])
def test_batched_under_offload_is_bitwise_batched_on_the_device(offload, tiny_folder):
    resident = load_pipeline(tiny_folder, "fp32")
    cond = _cond(resident)
    reference = sample(resident, cond, SETTINGS, batched_cfg=True).latents
    attach_offload(resident, OffloadOptions(mode=offload, prefetch_blocks=1), SynchronousTransfer())
    assert torch.equal(sample(resident, cond, SETTINGS, batched_cfg=True).latents, reference)


def test_batched_with_a_lora_matches_separate_passes_with_it(model, tmp_path):
    path = write_lora(tmp_path / "lora.safetensors", lora_content(model, rank=4, seed=1), "peft")
    patched = model.with_loras(LoraPatch(path, strength_high_noise=1.0, strength_low_noise=0.5))
    cond = _cond(model)
    separate = sample(patched, cond, SETTINGS).latents
    batched = sample(patched, cond, SETTINGS, batched_cfg=True).latents
    assert not torch.equal(separate, sample(model, cond, SETTINGS).latents)  # the LoRA did something
    assert _max_diff(batched, separate) <= LATENT_TOLERANCE


def _fake(model, device_bytes: int, remote=None):
    return SimpleNamespace(
        remote=remote,
        transformer=model.transformer,
        transformer_2=model.transformer_2,
        weight_bytes=model.weight_bytes,
        device_bytes=lambda: device_bytes,
    )


def test_auto_batches_only_when_twice_the_activations_and_the_weights_to_come_fit(model):
    activation = sampling_activation_bytes(model, 3, HEIGHT, WIDTH)
    expert_bytes = max(model.weight_bytes([name]) for name in ("transformer", "transformer_2"))
    on_device = _fake(model, device_bytes=model.weight_bytes())
    assert batched_cfg_decision(on_device, "auto", activation, 2 * activation)[0]
    assert not batched_cfg_decision(on_device, "auto", activation, 2 * activation - 1)[0]
    # Offloaded (nothing on the device yet): the larger expert must fit beside the activations.
    offloaded = _fake(model, device_bytes=0)
    assert not batched_cfg_decision(offloaded, "auto", activation, 2 * activation)[0]
    fits, reason = batched_cfg_decision(offloaded, "auto", activation, 2 * activation + expert_bytes)
    assert fits and "free" in reason
    assert not batched_cfg_decision(_fake(model, 0, remote=object()), "auto", activation, 1 << 50)[0]
    assert batched_cfg_decision(offloaded, "on", activation, 0)[0]
    assert not batched_cfg_decision(on_device, "off", activation, 1 << 50)[0]


def test_an_unknown_mode_is_refused_naming_the_choices(model):
    with pytest.raises(WanVACEInputError, match=r"batched_cfg='always' is unknown; choose one of off, auto, on\."):
        batched_cfg_decision(model, "always", 1, 1)
