"""The runtime plan runs its steps in the order `apply_plan` and `planned_run` write them, and where that order
matters, the other order breaks a run instead of silently dropping a step (the tests run the steps, the plan's own
private ones, in the other order).

- `compiled_cache` after `cache`: the compiled forwards go onto the blocks cache-dit's functor patched. Before it,
  there is nothing to put them on; a run refuses rather than lose compile under the cache (tests/test_compile.py
  shows the listed order running every block compiled under cache-dit).
- `fsdp` after `interleaved_vace`: each FSDP unit prefetches the block the installed forward runs next. Before
  it, the prefetch follows diffusers' forward (every VACE block first) while the interleaved one runs: still
  correct, only slower, so the test reads FSDP's own prefetch targets against the blocks a forward really ran.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, expert_inputs
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
from wanvace_core.generation import sampling
from wanvace_core.load.loaded import LoadedPipeline
from wanvace_core.parallel import ParallelOptions
from wanvace_core.parallel.groups import ParallelGroups
from wanvace_core.parallel.sharding import meta_experts
from wanvace_core.runtime import plan as runtime_plan
from wanvace_core.runtime.interleave import apply_interleaved_vace, execution_order
from wanvace_core.runtime.model import WanVACEModel
from wanvace_core.runtime.plan import RankContext, build_model

SETTINGS = SamplerSettings(seed=5, steps=2, cfg=5.0, cfg_low_noise=4.0)


@pytest.fixture(scope="module")
def model(tiny_folder):
    return load_pipeline(tiny_folder, "fp32")


def test_compile_before_the_cache_step_refuses_the_run(model, tiny_folder, monkeypatch):
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH))
    replan(model, RuntimePlan(compile=True))
    try:
        monkeypatch.setattr(sampling, "planned_run", _compiled_before_the_cache)
        with pytest.raises(WanVACEInputError, match="cache-dit's WanVACE functor did not patch the blocks"):
            sample(model, cond, SETTINGS, cache=CacheOptions())
    finally:
        replan(model, RuntimePlan())
    monkeypatch.undo()
    # The refused run left nothing behind (cache-dit's patches and the compiled forwards are gone).
    assert torch.equal(
        sample(model, cond, SETTINGS).latents, sample(load_pipeline(tiny_folder, "fp32"), cond, SETTINGS).latents
    )


@contextlib.contextmanager
def _compiled_before_the_cache(model, cache=None, guidance=None):
    """`planned_run`'s steps with the compiled forwards put on before cache-dit patches the blocks."""
    with contextlib.ExitStack() as run:
        run.enter_context(runtime_plan._settled_on_error(model))
        run.enter_context(runtime_plan._compiled_under_the_cache(model, cache))
        run.enter_context(cache)
        yield


def _sharded_before_interleaving(loaded, plan: RuntimePlan, rank: RankContext):
    """`build_model` with FSDP applied before the interleaved forward is installed."""
    model = WanVACEModel.from_loaded(loaded)
    model.device = torch.device("cpu")
    experts = runtime_plan._experts(model)
    runtime_plan._apply_fsdp(model, experts, plan, rank)
    for expert in experts.values():
        apply_interleaved_vace(expert)
    runtime_plan._apply_runtime(model, plan, rank, None, None)
    return model


def _prefetch_against_the_run(rank: int, world: int, folder: str, swapped: bool) -> dict:
    """On a worker rank: the experts sharded through the plan (`swapped`: FSDP before the interleaved forward); per
    expert, the blocks one forward ran, in order, and the block each one's FSDP unit prefetches."""
    options = ParallelOptions(devices=("cpu",) * world, shard="fsdp")
    groups = ParallelGroups.create(options.layout, torch.device("cpu"))
    whole = load_pipeline(folder, "fp32")  # its VAE and scheduler facts; the experts come from the files
    built = meta_experts(Path(folder), torch.float32)
    loaded = LoadedPipeline(
        source=Path(folder),
        dtype=torch.float32,
        device=torch.device("cpu"),
        tokenizer=None,
        text_encoder=None,
        vae=whole.vae,
        transformer=built["transformer"][0],
        transformer_2=built["transformer_2"][0],
        scheduler_config=whole.scheduler_config,
        boundary_ratio=whole.boundary_ratio,
        weights=whole.weights,
    )
    sources = {name: shard_sources for name, (_, shard_sources) in built.items()}
    plan, context = RuntimePlan(parallel=options), RankContext(groups, sources)
    if swapped:
        model = _sharded_before_interleaving(loaded, plan, context)
    else:
        model = build_model(loaded, plan, "cpu", rank=context)
    found = []
    for expert in model.experts:
        names = {module: name for name, module in expert.named_modules()}
        blocks = [
            (f"{kind}.{index}", block)
            for kind in ("vace_blocks", "blocks")
            for index, block in enumerate(getattr(expert, kind))
        ]
        ran = []
        handles = [
            block.register_forward_pre_hook(lambda *_, _name=name, _ran=ran: _ran.append(_name))
            for name, block in blocks
        ]
        with torch.no_grad():
            expert(**expert_inputs(expert))
        for handle in handles:
            handle.remove()
        prefetched = {
            name: [
                names[module]
                for state in block._get_fsdp_state()._states_to_forward_prefetch
                for module in state._modules
            ]
            for name, block in blocks
        }
        found.append({"ran": ran, "interleaved": execution_order(expert), "prefetched": prefetched})
    return {"experts": found}


def _prefetch_follows_the_run(result: dict) -> bool:
    return all(
        expert["prefetched"][current] == [following]
        for expert in result["experts"]
        for current, following in zip(expert["ran"], expert["ran"][1:], strict=False)
    )


def test_fsdp_prefetches_the_block_the_interleaved_forward_runs_next(rank_pools, tiny_folder):
    for result in rank_pools(2).run(_prefetch_against_the_run, str(tiny_folder), False):
        assert len(result["experts"]) == 2
        for expert in result["experts"]:
            # The interleaved forward ran: each VACE block right before the main block that takes its hint.
            assert expert["ran"] == expert["interleaved"], expert["ran"]
        assert _prefetch_follows_the_run(result), result
    # The same check fails when the plan shards before installing the interleaved forward.
    for result in rank_pools(2).run(_prefetch_against_the_run, str(tiny_folder), True):
        assert not _prefetch_follows_the_run(result), result
