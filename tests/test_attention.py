"""The experts' attention kernel: what the user chose is what runs (counted at diffusers' dispatcher), the default
is today's forward bitwise, a kernel that cannot run here is refused up front naming its package, and the choice
reaches the attention inside Ulysses and under cache-dit.

Calls are counted by wrapping the dispatcher's registered function of each backend: every attention call of a
diffusers model goes through that registry, whichever backend a processor names.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task, expert_inputs
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    RuntimePlan,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    load_pipeline,
    prepare_conditioning,
    replan,
    resolve_attention,
    sample,
)
from wanvace_core.parallel.sequence import apply_ulysses

# The backends that run on a CPU; the others are refused there (below).
CPU_BACKENDS = ("native", "_native_flash", "_native_math", "flex")
# fp32 on CPU. Measured max abs difference from native for the tiny expert's forward: _native_flash 0.0 (on a CPU
# SDPA's default is that kernel), _native_math and flex 4.8e-7 (torch 2.11) and 6.0e-7 (torch 2.8).
KERNEL_TOLERANCE = 1e-5
EAGER = ExpertCacheLimits(max_warmup_steps=1)
CACHE = CacheOptions(residual_diff_threshold=0.05, high_noise=EAGER, low_noise=EAGER)


@contextlib.contextmanager
def counted_attention():
    """Counts the calls each dispatcher backend receives while the block runs."""
    counts: Counter = Counter()
    registry = _AttentionBackendRegistry._backends
    originals = dict(registry)

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name.value] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        registry[name] = counting(name, fn)
    try:
        yield counts
    finally:
        registry.update(originals)


@torch.no_grad()
def _forward(model) -> tuple[torch.Tensor, Counter]:
    expert = model.transformer
    with counted_attention() as counts:
        out = expert(**expert_inputs(expert, width=8))[0]
    return out, counts


def _attention_calls_per_forward(expert) -> int:
    """Self- and cross-attention of every block and VACE block: what one forward must dispatch."""
    return 2 * (len(expert.blocks) + len(expert.vace_blocks))


@pytest.fixture(scope="module")
def native_forward(tiny_folder):
    return _forward(load_pipeline(tiny_folder, "fp32"))


@pytest.mark.parametrize("attention", CPU_BACKENDS)
def test_the_chosen_backend_is_the_one_that_runs(attention, tiny_folder, native_forward):
    model = load_pipeline(tiny_folder, "fp32", attention=attention)
    out, counts = _forward(model)
    assert dict(counts) == {attention: _attention_calls_per_forward(model.transformer)}
    reference, _ = native_forward
    assert (out - reference).abs().max().item() <= KERNEL_TOLERANCE


def test_leaving_attention_out_is_todays_forward_bitwise(tiny_folder, native_forward):
    # Today's experts carried no backend of their own: the dispatcher's process-wide default (native) ran.
    today = load_pipeline(tiny_folder, "fp32")
    for module in today.transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = None
    out, counts = _forward(today)
    reference, reference_counts = native_forward
    assert torch.equal(out, reference)
    assert counts == reference_counts == Counter({"native": _attention_calls_per_forward(today.transformer)})


def test_the_process_wide_default_is_left_alone(tiny_folder):
    # diffusers 0.42's set_attention_backend also makes the backend every other diffusers model's default.
    before = _AttentionBackendRegistry._active_backend
    load_pipeline(tiny_folder, "fp32", attention="_native_math")
    assert _AttentionBackendRegistry._active_backend == before
    query = torch.randn(1, 16, 2, 8)
    with counted_attention() as counts:
        dispatch_attention_fn(query, query, query)
    assert dict(counts) == {"native": 1}


def test_auto_takes_native_on_a_cpu():
    assert resolve_attention("auto", "cpu") == "native"


@pytest.mark.parametrize(
    ("attention", "fragment"),
    [
        ("sage", "install `sageattention>="),
        ("flash", "install `flash-attn>="),
        ("_flash_3", "build FA3"),
        ("xformers", "xformers"),
        # Installed with torch, but their kernels do not run on a CPU: refused by the probe call.
        ("_native_efficient", "its kernel does not run on this device (RuntimeError: No viable backend"),
        ("_native_cudnn", "its kernel does not run on this device (RuntimeError: No viable backend"),
    ],
)
def test_a_backend_that_cannot_run_here_is_refused_before_loading(attention, fragment, tiny_folder, monkeypatch):
    def no_reading(*args, **kwargs):
        raise AssertionError("weights were read for a refused attention choice")

    monkeypatch.setattr("wanvace_core.runtime.loaders.read_pipeline_folder", no_reading)
    with pytest.raises(WanVACEInputError) as refused:
        load_pipeline(tiny_folder, "fp32", attention=attention)
    message = str(refused.value)
    assert message.startswith(f"attention={attention!r} cannot run on cpu: "), message
    assert fragment in message and message.endswith("; or choose 'auto' or 'native'."), message


def test_an_unknown_backend_is_refused_naming_the_choices():
    with pytest.raises(WanVACEInputError, match=r"attention='sage_hub' is unknown; choose one of native, auto, "):
        RuntimePlan(attention="sage_hub")


def test_replan_changes_the_kernel_over_the_loaded_weights(tiny_folder):
    model = load_pipeline(tiny_folder, "fp32")
    weights = [parameter.data_ptr() for parameter in model.transformer.parameters()]
    replan(model, RuntimePlan(attention="_native_math"))
    out, counts = _forward(model)
    assert set(counts) == {"_native_math"}
    assert [parameter.data_ptr() for parameter in model.transformer.parameters()] == weights
    fresh, _ = _forward(load_pipeline(tiny_folder, "fp32", attention="_native_math"))
    assert torch.equal(out, fresh)
    replan(model, RuntimePlan())
    assert set(_forward(model)[1]) == {"native"}


def _cond(model):
    return prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **build_task("v2v").ours))


def test_the_kernel_runs_under_cache_dit_in_both_experts(tiny_folder):
    model = load_pipeline(tiny_folder, "fp32", attention="_native_math")
    settings = SamplerSettings(seed=3, steps=12, cfg=5.0, cfg_low_noise=4.0)
    with counted_attention() as counts:
        result = sample(model, _cond(model), settings, cache=CACHE)
    assert set(counts) == {"_native_math"}, counts
    # Some steps of each expert were cached (their middle blocks skipped), and the rest ran the chosen kernel.
    report = result.cache_report
    assert all(len(expert.cached_steps) > 0 for expert in report.experts), report


def _ulysses_rank(rank: int, world: int, folder: str) -> dict:
    model = load_pipeline(folder, "fp32")
    for expert in model.experts:
        apply_ulysses(expert, dist.group.WORLD)
    # The plan's order: Ulysses (step 2) before the attention backend (step 5), which replan applies.
    replan(model, RuntimePlan(attention="_native_math"))
    out, counts = _forward(model)
    return {"out": out, "counts": dict(counts)}


def test_the_kernel_runs_inside_ulysses_attention(rank_pools, tiny_folder):
    single, single_counts = _forward(load_pipeline(tiny_folder, "fp32", attention="_native_math"))
    for result in rank_pools(2).run(_ulysses_rank, str(tiny_folder)):
        # Each rank runs every attention call of the forward, on its share of the heads.
        assert result["counts"] == dict(single_counts)
        assert (result["out"] - single).abs().max().item() <= KERNEL_TOLERANCE
