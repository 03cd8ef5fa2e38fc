"""Every parallel mode through the real workers equals the single-process result, with caching on and off.

Two (or four) gloo CPU workers run the tiny pipeline in fp32. Sharding (FSDP, HSDP) and CFG parallel
reorder no reduction, so they are bitwise equal (CPU GEMM kernels pick their path by the weights' address
alignment: sharded weights are gathered into fresh buffers, so their reference holds its weights in fresh
allocations too, while workers holding whole experts use them in place from the file, as the reference
does; and by the thread count, so each reference runs on as many threads as each worker). Ulysses attends
over all-to-all'd head groups, whose sums may run in another order: within `ULYSSES_TOLERANCE` (max abs,
latents of magnitude ~4).
Cache decisions must be those of the single process, on every rank (cache-dit averages its residual
measure over each branch's ranks).

The workers of a world size are started once for the module and serve one mode's load after another
(`tests.support.distributed.ServingWorkers`: the local launcher's worker setup, kept up between loads as under
torchrun): starting two workers costs more than what a mode computes. How the local launcher starts and stops its own
workers is tests/test_parallel_workers.py; the same modes under both launchers, test_parallel_torchrun.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.distributed import ServingWorkers, threads_of_workers
from tests.support.lora_files import lora_content, write_lora
from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    OffloadOptions,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.parallel.launcher import cpu_threads_per_worker
from wanvace_core.runtime.lora import LoraPatch, check_lora

SETTINGS = SamplerSettings(seed=7, steps=6, cfg=5.0, cfg_low_noise=4.0)
CACHE = CacheOptions(residual_diff_threshold=0.3, high_noise=ExpertCacheLimits(1), low_noise=ExpertCacheLimits(1))
ULYSSES_TOLERANCE = 1e-4

MODES = {
    "fsdp": {"shard": "fsdp"},
    "ulysses2": {"shard": "none", "ulysses_degree": 2},
    "fsdp+ulysses2": {"shard": "fsdp", "ulysses_degree": 2},
    "fsdp+cfg": {"shard": "fsdp", "cfg_parallel": True},
}
# Offload per rank: FSDP2 keeps the shards in host memory and gathers a block at a time (shard on), or the
# layerwise block streamer runs in each rank (shard none); both beside Ulysses.
OFFLOAD_MODES = {
    "fsdp+ulysses2+offload": ({"shard": "fsdp", "ulysses_degree": 2}, OffloadOptions("layerwise")),
    "ulysses2+layerwise": ({"shard": "none", "ulysses_degree": 2}, OffloadOptions("layerwise")),
}
WORLD4_MODES = {
    "hsdp2x2": {"shard": "hsdp", "replicate_size": 2},
    "fsdp+ulysses2+cfg": {"shard": "fsdp", "ulysses_degree": 2, "cfg_parallel": True},
}


def _rehomed(model):
    with torch.no_grad():
        for module in model.components.values():
            for tensor in [*module.parameters(), *module.buffers()]:
                tensor.data = tensor.data.clone()
    return model


@pytest.fixture(scope="module")
def lora(tiny_folder, tmp_path_factory) -> LoraPatch:
    """A lightx2v-style LoRA (low-rank pairs on every Linear, full differences on biases, norms, the Conv3d patch
    embeddings and the modulation tables), at a different strength on each expert."""
    content = lora_content(load_pipeline(tiny_folder, "fp32"), rank=4, seed=3, alpha=2.0, diffs=True)
    path = write_lora(tmp_path_factory.mktemp("loras") / "lightx2v_style.safetensors", content, "lightx2v")
    return LoraPatch(path, strength_high_noise=0.8, strength_low_noise=1.2)


@pytest.fixture(scope="module")
def reference(tiny_folder, lora):
    """The conditioning, and the single-process results for a world size: computed once per intra-op thread
    count, on as many threads as each of that many workers has (see `threads_of_workers`); "lora" with the LoRA."""
    model = load_pipeline(tiny_folder, "fp32")
    cond = prepare_conditioning(
        model, VACEInputs(positive=PROMPT, negative=NEGATIVE, width=WIDTH, height=HEIGHT, length=LENGTH)
    )
    pipelines = {"file": model, "fresh": _rehomed(load_pipeline(tiny_folder, "fp32"))}
    by_threads = {}

    def expected_for(world_size: int) -> dict:
        threads = cpu_threads_per_worker(world_size)
        if threads not in by_threads:
            with threads_of_workers(world_size):
                expected = {
                    (layout, cache is not None): sample(pipeline, cond, SETTINGS, cache=cache)
                    for layout, pipeline in pipelines.items()
                    for cache in (None, CACHE)
                }
                for layout, pipeline in pipelines.items():
                    expected[layout, "lora"] = sample(pipeline.with_loras(lora), cond, SETTINGS)
            assert all(e.cached_steps for e in expected["file", True].cache_report.experts)  # the cache caches
            assert not torch.equal(expected["file", "lora"].latents, expected["file", False].latents)
            by_threads[threads] = expected
        return by_threads[threads]

    return cond, expected_for


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """`serving(world)`: this module's workers of that world size, running (started on first use, and again after a
    failed check stopped them)."""
    logs = tmp_path_factory.mktemp("serving-workers")
    workers: dict[int, ServingWorkers] = {}

    def running(world: int) -> ServingWorkers:
        if world not in workers:
            workers[world] = ServingWorkers(world, logs / f"world{world}")
        return workers[world].ensure_running()

    yield running
    for started in workers.values():
        started.stop()


def _check_mode(
    tiny_folder, reference, workers, mode: dict, lora: LoraPatch, offload: OffloadOptions | None = None
) -> None:
    cond, expected_for = reference
    all_expected = expected_for(workers.world)
    layout = "file" if mode["shard"] == "none" and offload is None else "fresh"
    expected = {key: all_expected[layout, key] for key in (False, True, "lora")}
    with workers.stopped_on_failure():
        model = load_pipeline(tiny_folder, "fp32", offload=offload, parallel=workers.options(**mode))
        try:
            _check_samples(model, cond, expected, mode, lora)
        finally:
            model.remote.close()


def _check_samples(model, cond, expected: dict, mode: dict, lora: LoraPatch) -> None:
    for cached in (False, True):
        got = sample(model, cond, SETTINGS, cache=CACHE if cached else None)
        _check_difference(got.latents, expected[cached].latents, mode, cached)
        assert got.cache_report == expected[cached].cache_report
    # The LoRA is applied on every rank (on the fly: hooks on each rank's whole, sharded or sequence-split experts).
    check_lora(model, lora)
    with_lora = sample(model.with_loras(lora), cond, SETTINGS).latents
    _check_difference(with_lora, expected["lora"].latents, mode, "lora")
    if mode["shard"] != "none":
        with pytest.raises(WanVACEInputError, match=f"shard={mode['shard']} keeps each expert weight in shards"):
            check_lora(model, dataclasses.replace(lora, merge=True))
    again = sample(model, cond, SETTINGS)
    assert torch.equal(again.latents, sample(model, cond, SETTINGS).latents)  # stable across prompts
    if mode.get("ulysses_degree", 1) > 1:
        # 48x48 gives 3 x 3 x 3 = 27 tokens per frame group: not splittable in two, refused before any work.
        odd = prepare_conditioning(
            model, VACEInputs(positive=PROMPT, negative=NEGATIVE, width=48, height=48, length=LENGTH)
        )
        with pytest.raises(WanVACEInputError, match="does not divide this video's 27 tokens"):
            sample(model, odd, SETTINGS)
        assert torch.equal(sample(model, cond, SETTINGS).latents, again.latents)


def _check_difference(got: torch.Tensor, expected: torch.Tensor, mode: dict, case) -> None:
    difference = (got - expected).abs().max().item()
    if mode.get("ulysses_degree", 1) > 1:
        assert difference <= ULYSSES_TOLERANCE, (mode, case, difference)
    else:
        assert difference == 0.0, (mode, case, difference)


@pytest.mark.parametrize("mode", list(MODES))
def test_two_workers_equal_one_process(tiny_folder, reference, serving, lora, mode):
    _check_mode(tiny_folder, reference, serving(2), MODES[mode], lora)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(WORLD4_MODES))
def test_four_workers_equal_one_process(tiny_folder, reference, serving, lora, mode):
    _check_mode(tiny_folder, reference, serving(4), WORLD4_MODES[mode], lora)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(OFFLOAD_MODES))
def test_offload_per_rank_composes_with_sharding_and_ulysses(tiny_folder, reference, serving, lora, mode):
    options, offload = OFFLOAD_MODES[mode]
    _check_mode(tiny_folder, reference, serving(2), options, lora, offload)


def test_single_files_shard_in_the_workers_bitwise(tmp_path, serving, comfy_components_default):
    """Comfy-style single files (original Wan keys), sharded by the workers from the files' rows."""
    from bench.expert_files import write_expert
    from tests.support.single_files import write_umt5, write_vae
    from wanvace_core import ExpertFiles, load_expert_files
    from wanvace_core.load.tiny import sentencepiece_model_bytes

    components = comfy_components_default  # COMFY_SHAPED, shaped as single files are read (head dim 128)
    files = ExpertFiles(
        high_noise_model=write_expert(tmp_path / "high.safetensors", components["transformer"], dtype=torch.float32),
        low_noise_model=write_expert(tmp_path / "low.safetensors", components["transformer_2"], dtype=torch.float32),
        text_encoder=write_umt5(
            tmp_path / "umt5.safetensors", components["text_encoder"], sentencepiece_model_bytes(), dtype=torch.float32
        ),
        vae=write_vae(tmp_path / "vae.safetensors", components["vae"], dtype=torch.float32),
    )
    single = _rehomed(load_expert_files(files, "fp32"))
    cond = prepare_conditioning(
        single, VACEInputs(positive=PROMPT, negative=NEGATIVE, width=WIDTH, height=HEIGHT, length=LENGTH)
    )
    with threads_of_workers(2):
        expected = sample(single, cond, SETTINGS).latents
    workers = serving(2)
    with workers.stopped_on_failure():
        model = load_expert_files(files, "fp32", parallel=workers.options(shard="fsdp"))
        try:
            assert torch.equal(sample(model, cond, SETTINGS).latents, expected)
        finally:
            model.remote.close()


def test_attention_and_batched_cfg_reach_the_workers(tiny_folder, reference, serving):
    """The workers run the chosen kernel and batch the CFG passes: bitwise the single process doing both (FSDP
    reorders no reduction), which differs from the default kernel; cache-dit there saw one call per step."""
    cond, _ = reference
    workers = serving(2)
    with threads_of_workers(2):
        fresh = _rehomed(load_pipeline(tiny_folder, "fp32", attention="_native_math"))
        expected = sample(fresh, cond, SETTINGS, cache=CACHE, batched_cfg=True)
        native = sample(_rehomed(load_pipeline(tiny_folder, "fp32")), cond, SETTINGS, cache=CACHE, batched_cfg=True)
    assert not torch.equal(expected.latents, native.latents)
    with workers.stopped_on_failure():
        model = load_pipeline(tiny_folder, "fp32", parallel=workers.options(shard="fsdp"), attention="_native_math")
        try:
            got = sample(model, cond, SETTINGS, cache=CACHE, batched_cfg=True)
        finally:
            model.remote.close()
    assert torch.equal(got.latents, expected.latents)
    assert got.cache_report == expected.cache_report
    assert all(expert.cached_steps and expert.cfg_steps == 0 for expert in got.cache_report.experts), got.cache_report


@pytest.mark.slow
def test_compile_runs_in_the_workers_under_fsdp_and_ulysses(tiny_folder, reference, serving):
    """Each rank compiles its blocks (plan step 7: traced around Ulysses' all-to-all, inside FSDP2's hooks), with and
    without cache-dit: within Ulysses' tolerance of the single eager process, with its cache decisions."""
    cond, expected_for = reference
    expected = expected_for(2)
    workers = serving(2)
    with workers.stopped_on_failure():
        parallel = workers.options(shard="fsdp", ulysses_degree=2)
        model = load_pipeline(tiny_folder, "fp32", parallel=parallel, compile=True)
        blocks = sum(len(expert.blocks) + len(expert.vace_blocks) for expert in model.experts)  # meta stand-ins here
        try:
            for cached in (False, True):
                got = sample(model, cond, SETTINGS, cache=CACHE if cached else None)
                difference = (got.latents - expected["fresh", cached].latents).abs().max().item()
                assert difference <= ULYSSES_TOLERANCE, (cached, difference)
                assert got.cache_report == expected["fresh", cached].cache_report
        finally:
            model.remote.close()
        for rank in range(workers.world):
            assert f"WanVACE compile: {blocks} blocks" in workers.log(rank), workers.tails()
