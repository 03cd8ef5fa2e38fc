"""Regional compile: every block runs its compiled forward (counted where inductor's compiled graphs are called),
within float rounding of eager; after warm-up nothing recompiles across seeds, prompts, tasks and the expert switch,
and a new size compiles once (dynamo's own counters); it works under cache-dit, LoRA hooks and layerwise offload;
turning it off is eager again bitwise; and a machine that cannot build kernels is refused before loading.

Compiling on a CPU is slow (inductor writes and builds C++), so one model is shared by the module's tests, in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.output_code import CompiledFxGraph

from tests.support.lora_files import lora_content, write_lora
from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    LoraPatch,
    OffloadOptions,
    RuntimePlan,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    load_pipeline,
    prepare_conditioning,
    replan,
    sample,
)
from wanvace_core.hooks import runs_forward
from wanvace_core.load.loaded import block_lists_of
from wanvace_core.runtime.regional_compile import compile_failure, compiled_forward

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# fp32 on CPU, the tiny pair, 4 guided steps: measured max abs difference of the latents (magnitude ~4.5) from eager,
# 2.1e-6 to 2.9e-6 (torch 2.8 and 2.11; with LoRA, cache-dit and layerwise offload alike): inductor fuses the
# elementwise work around each GEMM into other kernels.
LATENT_TOLERANCE = 2e-5
SETTINGS = SamplerSettings(seed=3, steps=4, cfg=5.0, cfg_low_noise=4.0)
CACHE_SETTINGS = SamplerSettings(seed=3, steps=8, cfg=5.0, cfg_low_noise=4.0)
CACHE = CacheOptions(
    residual_diff_threshold=0.3, high_noise=ExpertCacheLimits(max_warmup_steps=1), low_noise=ExpertCacheLimits(1)
)
NOTHING_CACHED = CacheOptions(
    high_noise=ExpertCacheLimits(max_warmup_steps=1000), low_noise=ExpertCacheLimits(max_warmup_steps=1000)
)


@contextlib.contextmanager
def compiled_graph_calls():
    """Counts the calls of inductor's compiled graphs (what runs when compiled code runs) while the block runs."""
    calls: Counter = Counter()
    original = CompiledFxGraph.__call__

    def counting(self, *args, **kwargs):
        calls["graphs"] += 1
        return original(self, *args, **kwargs)

    CompiledFxGraph.__call__ = counting
    try:
        yield calls
    finally:
        CompiledFxGraph.__call__ = original


def compiled_blocks(expert: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of `expert` whose forward is the compiled one right now."""
    blocks = [block for name in block_lists_of(expert) for block in getattr(expert, name)]
    return [block for block in blocks if runs_forward(block, compiled_forward(type(block)))]


def _unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _cond(model, task: str = "v2v", width: int = WIDTH, prompt: str = PROMPT):
    return prepare_conditioning(model, VACEInputs(prompt, NEGATIVE, width, HEIGHT, LENGTH, **build_task(task).ours))


def _set_compile(model, compile: bool) -> None:
    replan(model, dataclasses.replace(model.plan, compile=compile))


def _run(model, cond, settings=SETTINGS, **options):
    with compiled_graph_calls() as calls:
        latents = sample(model, cond, settings, **options)
    return latents, calls["graphs"]


def _blocks_per_forward(model) -> int:
    return len(model.transformer.blocks) + len(model.transformer.vace_blocks)


def _expert_calls(settings: SamplerSettings) -> int:
    return 2 * settings.steps  # both experts guided: a conditional and an unconditional pass per step


@pytest.fixture(scope="module")
def model(tiny_folder):
    return load_pipeline(tiny_folder, "fp32")


def test_every_block_runs_compiled_and_compiles_once_per_size(model):
    cond = _cond(model)
    eager, calls = _run(model, cond)
    assert calls == 0
    _set_compile(model, True)
    for expert in model.experts:
        every_block = {id(block) for block in [*expert.blocks, *expert.vace_blocks]}
        assert {id(block) for block in compiled_blocks(expert)} == every_block

    compiled, calls = _run(model, cond)
    assert calls == _expert_calls(SETTINGS) * _blocks_per_forward(model)  # one graph per block call: no breaks
    assert (compiled.latents - eager.latents).abs().max().item() <= LATENT_TOLERANCE
    warm = _unique_graphs()

    # Another seed, prompt and task at the same size, through both experts: nothing is traced again.
    other = SamplerSettings(seed=11, steps=6, cfg=4.0, cfg_low_noise=3.0)
    _, calls = _run(model, _cond(model, "inpaint", prompt="a red kite over a beach"), other)
    assert calls == _expert_calls(other) * _blocks_per_forward(model)
    assert _unique_graphs() == warm

    # A new size traces once (its sizes become dynamic); a third size reuses that.
    _run(model, _cond(model, "t2v", width=WIDTH + 16))
    resized = _unique_graphs()
    assert resized > warm
    _run(model, _cond(model, "t2v", width=WIDTH + 32))
    assert _unique_graphs() == resized

    _set_compile(model, False)
    again, calls = _run(model, cond)
    assert calls == 0
    assert torch.equal(again.latents, eager.latents)


def test_cache_dit_runs_the_same_compiled_blocks(model):
    cond = _cond(model)
    _set_compile(model, True)
    uncached, _ = _run(model, cond)
    warm = _unique_graphs()

    # Nothing cached: bitwise the uncached compiled run (cache-dit's blocks add each VACE hint as ours do).
    nothing_cached, calls = _run(model, cond, cache=NOTHING_CACHED)
    assert calls == _expert_calls(SETTINGS) * _blocks_per_forward(model)
    assert torch.equal(nothing_cached.latents, uncached.latents)

    cached, calls = _run(model, cond, CACHE_SETTINGS, cache=CACHE)
    assert all(expert.cached_steps for expert in cached.cache_report.experts), cached.cache_report
    assert 0 < calls < _expert_calls(CACHE_SETTINGS) * _blocks_per_forward(model)  # skipped blocks ran nothing
    # cache-dit's per-block forwards did not become graphs of their own.
    assert _unique_graphs() == warm

    _set_compile(model, False)
    eager_cached, _ = _run(model, cond, CACHE_SETTINGS, cache=CACHE)
    assert cached.cache_report == eager_cached.cache_report
    assert (cached.latents - eager_cached.latents).abs().max().item() <= LATENT_TOLERANCE


def test_loras_and_layerwise_offload_run_compiled(model, tmp_path):
    # Low-rank pairs on every Linear and full differences on norms and modulation tables (bound per call).
    lora = write_lora(tmp_path / "lora.safetensors", lora_content(model.transformer, 2, 1, diffs=True), "lightx2v")
    replan(model, RuntimePlan(offload=OffloadOptions("layerwise")))
    model.loras = [LoraPatch(lora, 1.0, 0.5)]
    try:
        cond = _cond(model)
        eager, _ = _run(model, cond)
        _set_compile(model, True)
        compiled, calls = _run(model, cond)
        assert calls > 0
        assert (compiled.latents - eager.latents).abs().max().item() <= LATENT_TOLERANCE
        warm = _unique_graphs()
        _run(model, cond, SamplerSettings(seed=4, steps=4, cfg=5.0, cfg_low_noise=4.0))
        assert _unique_graphs() == warm  # the next run's new LoRA hooks are traced already
        _set_compile(model, False)
        again, _ = _run(model, cond)
        assert torch.equal(again.latents, eager.latents)  # the LoRA left every weight as it was
    finally:
        model.loras = []
        replan(model, RuntimePlan())


def test_guidance_inside_the_experts_runs_compiled_and_traces_once(model):
    """NAG's hooks sit inside the compiled blocks (cross-attention), SLG's on them, RIFLEx's on the rope: compiled runs
    equal eager ones within rounding, and a second run with another seed and prompt traces nothing new."""
    from wanvace_core.generation.guidance import GuidanceOptions
    from wanvace_core.runtime.attention_guidance import NAGOptions, SkipLayerOptions

    rules = GuidanceOptions(nag=NAGOptions(), slg=SkipLayerOptions(blocks=(1,), start_percent=0.0), riflex_index=-1)
    settings = SamplerSettings(seed=3, steps=4, cfg=4.0, cfg_low_noise=1.0)
    cond = _cond(model)
    eager, _ = _run(model, cond, settings, rules=rules)
    _set_compile(model, True)
    try:
        compiled, calls = _run(model, cond, settings, rules=rules)
        assert calls > 0
        assert (compiled.latents - eager.latents).abs().max().item() <= LATENT_TOLERANCE
        warm = _unique_graphs()
        other = SamplerSettings(seed=9, steps=4, cfg=4.0, cfg_low_noise=1.0)
        _run(model, _cond(model, prompt="a red kite over a beach"), other, rules=rules)
        assert _unique_graphs() == warm
    finally:
        _set_compile(model, False)


def test_a_machine_that_cannot_build_kernels_is_refused_before_loading(tiny_folder, monkeypatch):
    def no_reading(*args, **kwargs):
        raise AssertionError("weights were read for a refused compile choice")

    monkeypatch.setattr("wanvace_core.runtime.loaders.read_pipeline_folder", no_reading)
    # The compiler is part of inductor's cache key, so no kernel built earlier answers from the disk cache.
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",)}):
        torch._dynamo.reset()  # nor the probe's code compiled earlier in this process
        compile_failure.cache_clear()
        try:
            with pytest.raises(WanVACEInputError) as refused:
                load_pipeline(tiny_folder, "fp32", compile=True)
        finally:
            compile_failure.cache_clear()
            torch._dynamo.reset()
    message = str(refused.value)
    assert message.startswith("compile is on but torch.compile cannot build kernels for cpu ("), message
    assert "C++ compiler" in message and message.endswith("Turn compile off."), message


@pytest.mark.slow
def test_torch_under_a_folder_with_a_space_is_refused_naming_that_folder(tmp_path):
    # This venv reached through a folder whose name has a space, as a ComfyUI installed under "My Apps" would be: the
    # probe compiles in that interpreter, where torch's C++ kernel build gets the folder's path unquoted.
    venv = Path(sys.prefix)
    spaced = tmp_path / "My Apps"
    spaced.mkdir()
    (spaced / "venv").symlink_to(venv, target_is_directory=True)
    script = (
        "from wanvace_core.errors import WanVACEInputError\n"
        "from wanvace_core.runtime.regional_compile import check_regional_compile\n"
        "try:\n    check_regional_compile('cpu')\nexcept WanVACEInputError as error:\n    print(error)\n"
        "else:\n    print('compiles')\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [str(spaced / "venv" / "bin" / "python"), "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip().splitlines()[-1]
    # A torch that quotes its paths compiles there; one that does not must say why, not ask for a compiler.
    if said != "compiles":
        assert "whose path has a space (" in said and str(spaced / "venv") in said, said
        assert said.endswith("or turn compile off."), said
