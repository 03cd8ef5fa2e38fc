"""VACE hints computed where they are consumed: same numbers as diffusers, one hint alive at a time."""

from __future__ import annotations

import pytest
import torch

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import CacheOptions, ExpertCacheLimits, SamplerSettings, VACEInputs, prepare_conditioning, sample
from wanvace_core.runtime.interleave import execution_order, uses_interleaved_vace


def _forward_inputs(model):
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **build_task("v2v").ours))
    latents = torch.randn(
        (1, 16, cond.conditioning_latents.shape[2], HEIGHT // 8, WIDTH // 8), generator=torch.Generator().manual_seed(0)
    )
    return {
        "hidden_states": latents.to(model.transformer_dtype),
        "timestep": torch.tensor([900]),
        "encoder_hidden_states": cond.prompt_embeds,
        "control_hidden_states": cond.conditioning_latents,
        "control_hidden_states_scale": cond.conditioning_scale,
        "return_dict": False,
    }


def _block_order(expert, run):
    order = []
    handles = [
        block.register_forward_pre_hook(lambda *_, _name=f"{list_name}.{index}": order.append(_name))
        for list_name in ("vace_blocks", "blocks")
        for index, block in enumerate(getattr(expert, list_name))
    ]
    try:
        output = run()
    finally:
        for handle in handles:
            handle.remove()
    return order, output


def test_interleaved_forward_equals_stock_forward_and_runs_hints_where_consumed(loaded_models):
    for dtype in ("fp32", "bf16"):
        model = loaded_models(dtype)
        expert = model.transformer
        assert uses_interleaved_vace(expert)
        inputs = _forward_inputs(model)

        def interleaved(expert=expert, inputs=inputs):
            return expert(**inputs)[0]

        def stock_forward(expert=expert, inputs=inputs):
            return type(expert).forward(expert, **inputs)[0]

        with torch.no_grad():
            order, ours = _block_order(expert, interleaved)
            stock_order, stock = _block_order(expert, stock_forward)
        assert torch.equal(ours, stock), dtype
        assert order == execution_order(expert)
        assert order == ["vace_blocks.0", "blocks.0", "blocks.1", "vace_blocks.1", "blocks.2", "blocks.3"]
        assert stock_order == ["vace_blocks.0", "vace_blocks.1", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]

        # LoRA scaling through attention_kwargs differs between diffusers versions: it runs the stock forward.
        def with_attention_kwargs(expert=expert, inputs=inputs):
            return expert(**inputs, attention_kwargs={"scale": 1.0})[0]

        with torch.no_grad():
            kwargs_order, with_kwargs = _block_order(expert, with_attention_kwargs)
        assert kwargs_order == stock_order
        assert torch.equal(with_kwargs, stock), dtype


def test_interleaved_forward_is_restored_after_a_cached_run(loaded_models):
    model = loaded_models("fp32")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **build_task("r2v").ours))
    settings = SamplerSettings(seed=2, steps=8, cfg=5.0, cfg_low_noise=5.0)
    before = sample(model, cond, settings).latents
    eager = ExpertCacheLimits(max_warmup_steps=1)
    cached = sample(
        model, cond, settings, cache=CacheOptions(residual_diff_threshold=0.2, high_noise=eager, low_noise=eager)
    )
    assert any(expert.cached_steps for expert in cached.cache_report.experts)
    for expert in model.experts:
        assert uses_interleaved_vace(expert)
        assert not hasattr(expert, "_is_patched")
        assert all("forward" not in block.__dict__ for block in expert.blocks)
    assert torch.equal(sample(model, cond, settings).latents, before)


@pytest.mark.slow
@pytest.mark.one_set
def test_interleaving_lowers_the_activation_peak_by_several_hints():
    import importlib.util
    from argparse import Namespace
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_vace_memory.py"
    spec = importlib.util.spec_from_file_location("bench_vace_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = Namespace(tokens=2048, dim=512, layers=16, vace_layers=8)
    stock, ours = bench.measure(args)
    assert stock["checksum"] == ours["checksum"]
    hint_kb = stock["tokens"] * args.dim * 4 / 1024
    # Eight hints alive at once versus one: at least five hints' worth must be saved.
    assert stock["peak_above_kb"] - ours["peak_above_kb"] >= 5 * hint_kb, (stock, ours)
