"""Ulysses sequence parallelism on gloo CPU ranks: every rank computes what one process computes.

Each `_*_rank` function runs on spawned gloo ranks (the module's two ranks from `rank_pools`, spawned once;
the four-rank case on its own `tests.support.distributed.run_ranks`), so it lives at module level. The single-process
references are computed in the pytest process itself, where torch.distributed is not initialised (cache-dit
then makes its decisions without any all-reduce).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import run_ranks
from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task, expert_inputs
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline
from wanvace_core.parallel.sequence import apply_ulysses, remove_ulysses, ulysses_group
from wanvace_core.runtime.interleave import apply_interleaved_vace, uses_interleaved_vace

# fp32 on CPU. Measured max abs differences: Ulysses 2 on the 2-head model 0.0 for the expert forward and for
# 12 sampled steps; Ulysses 4 on the 4-head model 4.8e-7 for the forward and 2.5e-6 for the latents.
FORWARD_TOLERANCE = 1e-5
LATENT_TOLERANCE = 1e-4
STEPS = 12
EAGER = ExpertCacheLimits(max_warmup_steps=1)
# On the tiny pair at 12 steps this caches some steps of both experts and computes others.
CACHE = CacheOptions(residual_diff_threshold=0.05, high_noise=EAGER, low_noise=EAGER)
SETTINGS = SamplerSettings(seed=3, steps=STEPS, cfg=5.0, cfg_low_noise=4.0)


@pytest.fixture(scope="module")
def four_head_folder(tmp_path_factory):
    return write_tiny_pipeline(
        tmp_path_factory.mktemp("models") / "wanvace-tiny-4-heads",
        TinyModelSpec(num_attention_heads=4, attention_head_dim=8),
    )


@pytest.fixture(scope="module")
def three_head_folder(tmp_path_factory):
    return write_tiny_pipeline(
        tmp_path_factory.mktemp("models") / "wanvace-tiny-3-heads", TinyModelSpec(num_attention_heads=3)
    )


@torch.no_grad()
def _forward(expert, forward: str, inputs: dict) -> torch.Tensor:
    """One call through the module (so every hook runs) with the interleaved or diffusers' stock forward."""
    if forward == "stock":
        expert.forward = expert._wanvace_stock_forward
    try:
        return expert(**inputs)[0]
    finally:
        apply_interleaved_vace(expert)


def _hook_counts(expert) -> int:
    return sum(len(module._forward_pre_hooks) + len(module._forward_hooks) for module in expert.modules())


def _forward_rank(rank: int, world: int, folder: str) -> dict:
    model = load_pipeline(folder, "fp32")
    expert = model.transformer
    assert uses_interleaved_vace(expert)
    inputs = expert_inputs(expert)
    processors = [block.attn1.processor for block in [*expert.blocks, *expert.vace_blocks]]
    hooks_before = _hook_counts(expert)
    reference = {forward: _forward(expert, forward, inputs) for forward in ("interleaved", "stock")}
    apply_ulysses(expert, dist.group.WORLD)
    hooks_applied = _hook_counts(expert)
    apply_ulysses(expert, dist.group.WORLD)
    parallel = {forward: _forward(expert, forward, inputs) for forward in ("interleaved", "stock")}
    hooks_after_calls = _hook_counts(expert)
    remove_ulysses(expert)
    restored = {forward: _forward(expert, forward, inputs) for forward in ("interleaved", "stock")}
    return {
        "reference": reference,
        "parallel": parallel,
        "restored": restored,
        "hooks": (hooks_before, hooks_applied, _hook_counts(expert), hooks_after_calls),
        "processors_restored": all(
            block.attn1.processor is processor
            for block, processor in zip([*expert.blocks, *expert.vace_blocks], processors, strict=True)
        ),
        "group_after_remove": ulysses_group(expert),
    }


def _sample_rank(rank: int, world: int, folder: str, cond, cache_options: list) -> list:
    model = load_pipeline(folder, "fp32")
    for expert in model.experts:
        apply_ulysses(expert, dist.group.WORLD)
    hooks = [_hook_counts(expert) for expert in model.experts]
    results = [sample(model, cond, SETTINGS, cache=options) for options in cache_options]
    assert [_hook_counts(expert) for expert in model.experts] == hooks, "a run left hooks behind"
    return results


def _refusal_rank(rank: int, world: int, folder: str, three_head_folder: str) -> dict:
    model = load_pipeline(folder, "fp32")
    expert = model.transformer
    apply_ulysses(expert, dist.group.WORLD)
    outcome = {"tokens": "not refused", "heads": "not refused"}
    # 3 x 3 x 3 = 27 tokens: odd, so two ranks cannot share them evenly.
    try:
        _forward(expert, "interleaved", expert_inputs(expert, frames=3, height=6, width=6))
    except WanVACEInputError as error:
        outcome["tokens"] = str(error)
    # The refusal came before any collective: the ranks are still in step and compute correctly.
    inputs = expert_inputs(expert)
    parallel = _forward(expert, "interleaved", inputs)
    remove_ulysses(expert)
    outcome["after_refusal"] = (parallel - _forward(expert, "interleaved", inputs)).abs().max().item()
    three_heads = load_pipeline(three_head_folder, "fp32").transformer
    processors = [block.attn1.processor for block in three_heads.blocks]
    try:
        apply_ulysses(three_heads, dist.group.WORLD)
    except WanVACEInputError as error:
        outcome["heads"] = str(error)
    outcome["untouched"] = ulysses_group(three_heads) is None and all(
        block.attn1.processor is processor for block, processor in zip(three_heads.blocks, processors, strict=True)
    )
    return outcome


def _cond(model):
    return prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **build_task("v2v").ours))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def forward_results(rank_pools, tiny_folder):
    return rank_pools(2).run(_forward_rank, str(tiny_folder))


def _check_forward_matches_single_process(results: list, forward: str) -> None:
    for result in results:
        reference, parallel = result["reference"][forward], result["parallel"][forward]
        assert parallel.shape == reference.shape
        assert _max_diff(parallel, reference) <= FORWARD_TOLERANCE
    # The output is all-gathered, so the ranks agree bit for bit.
    assert all(torch.equal(result["parallel"][forward], results[0]["parallel"][forward]) for result in results)


@pytest.mark.parametrize("forward", ["interleaved", "stock"])
def test_every_rank_computes_the_single_process_expert_output(forward, forward_results):
    _check_forward_matches_single_process(forward_results, forward)


def test_apply_is_idempotent_and_remove_restores_the_expert_bitwise(forward_results):
    for result in forward_results:
        hooks_before, hooks_applied, hooks_removed, hooks_after_calls = result["hooks"]
        assert hooks_applied > hooks_before
        assert hooks_after_calls == hooks_applied  # the second apply and the calls added nothing
        assert hooks_removed == hooks_before
        assert result["processors_restored"] and result["group_after_remove"] is None
        for forward in ("interleaved", "stock"):
            assert torch.equal(result["restored"][forward], result["reference"][forward])


def _check_sampling_matches_single_process(results: list, references: list) -> None:
    # Every rank's cache report equals the single process's, so the ranks also agree with each other.
    for rank_results in results:
        for result, reference in zip(rank_results, references, strict=True):
            assert _max_diff(result.latents, reference.latents) <= LATENT_TOLERANCE
            assert result.cache_report == reference.cache_report


def test_sampling_with_and_without_cache_matches_single_process_on_two_ranks(rank_pools, tiny_folder, loaded_models):
    model = loaded_models("fp32")
    cond = _cond(model)
    references = [sample(model, cond, SETTINGS), sample(model, cond, SETTINGS, cache=CACHE)]
    cached = references[1].cache_report
    assert all(0 < len(expert.cached_steps) < expert.steps for expert in cached.experts)
    results = rank_pools(2).run(_sample_rank, str(tiny_folder), cond, [None, CACHE])
    _check_sampling_matches_single_process(results, references)


def _forward_and_sample_rank(rank: int, world: int, folder: str, cond, cache_options: list) -> tuple:
    # One spawn for both: starting four ranks on two cores costs more than what they compute.
    return _forward_rank(rank, world, folder), _sample_rank(rank, world, folder, cond, cache_options)


@pytest.mark.slow
def test_four_ranks_split_the_sequence_four_ways(four_head_folder):
    model = load_pipeline(four_head_folder, "fp32")
    cond = _cond(model)
    references = [sample(model, cond, SETTINGS, cache=CACHE)]
    assert all(expert.cached_steps for expert in references[0].cache_report.experts)
    results = run_ranks(4, _forward_and_sample_rank, str(four_head_folder), cond, [CACHE])
    forward_results = [forward_result for forward_result, _ in results]
    for forward in ("interleaved", "stock"):
        _check_forward_matches_single_process(forward_results, forward)
        assert all(torch.equal(result["restored"][forward], result["reference"][forward]) for result in forward_results)
    _check_sampling_matches_single_process([sample_results for _, sample_results in results], references)


def test_uneven_tokens_and_heads_are_refused_by_name(rank_pools, tiny_folder, three_head_folder):
    for outcome in rank_pools(2).run(_refusal_rank, str(tiny_folder), str(three_head_folder)):
        assert (
            "ulysses_degree=2 does not divide this video's 27 tokens (3 latent frames x 3 x 3 patches)"
            in outcome["tokens"]
        )
        assert "never padded" in outcome["tokens"]
        assert outcome["tokens"].endswith("the 2 heads: 1.")
        assert outcome["after_refusal"] <= FORWARD_TOLERANCE
        assert "ulysses_degree=2 does not divide the model's 3 attention heads" in outcome["heads"]
        assert outcome["heads"].endswith(": 1, 3.")
        assert outcome["untouched"]
