"""LoRAs on the tiny experts: equal to merging them by hand, per expert, in every key layout, and gone afterwards.

The hand merge (`tests/lora_files.hand_merged`) edits a copy of the model's weights directly. Applied on
the fly, a LoRA adds `(x A^T) B^T` to a Linear's output instead of using `W + B A`: the same sum in
another order, so latents agree to fp32 rounding (`ON_THE_FLY_TOLERANCE`, relative to the latents'
largest value). Merged in place (`merge=True`) the arithmetic is the hand merge's, and latents are
bitwise equal.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from tests.support.lora_files import LORA_FORMATS, LoraContent, hand_merged, lora_content, rehomed, write_lora
from tests.support.offload_probes import attach_offload
from tests.support.simulated_streams import SimulatedStreamOps
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
from wanvace_core.load.lora_files import load_lora
from wanvace_core.runtime.lora import LoraPatch, applied_loras, check_lora
from wanvace_core.runtime.offload import SynchronousTransfer

INPUTS = VACEInputs(positive="a bird flies over the sea", negative="blurry", width=64, height=48, length=5)
# 3 steps at the tiny model's shift 3: timesteps 999 (high-noise expert, CFG) then 857 and 600 (low-noise).
SETTINGS = SamplerSettings(seed=5, steps=3, cfg=3.0, cfg_low_noise=1.0)
ON_THE_FLY_TOLERANCE = 1e-5
ALPHA = 2.0  # rank 4: scale 0.5, a power of two, so folding it into B (PEFT) is exact


@pytest.fixture(scope="module")
def base(tiny_folder):
    return rehomed(load_pipeline(tiny_folder, "fp32"))


@pytest.fixture(scope="module")
def cond(base):
    return prepare_conditioning(base, INPUTS)


@pytest.fixture(scope="module")
def plain(base, cond):
    return sample(base, cond, SETTINGS).latents


@pytest.fixture(scope="module")
def content(base) -> LoraContent:
    """Low-rank pairs on every Linear plus lightx2v's full differences (biases, norms, Conv3d, modulation)."""
    return lora_content(base, rank=4, seed=1, alpha=ALPHA, diffs=True)


@pytest.fixture(scope="module")
def lora_path(content, tmp_path_factory):
    return write_lora(tmp_path_factory.mktemp("loras") / "lightx2v_style.safetensors", content, "lightx2v")


def run(model, cond, patches=(), settings=SETTINGS, **kwargs):
    return sample(model.with_loras(*patches), cond, settings, **kwargs)


def hand_run(tiny_folder, cond, content, high: float, low: float):
    model = rehomed(load_pipeline(tiny_folder, "fp32"))
    hand_merged(model.transformer, content, high)
    hand_merged(model.transformer_2, content, low)
    return sample(model, cond, SETTINGS).latents


def _close(actual, expected) -> float:
    error = (actual - expected).abs().max().item()
    assert error <= ON_THE_FLY_TOLERANCE * expected.abs().max().item(), error
    return error


def _weights(model) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": tensor.clone()
        for name in ("transformer", "transformer_2")
        for key, tensor in getattr(model, name).state_dict().items()
    }


def _hook_counts(model) -> list[int]:
    return [
        len(module._forward_hooks) + len(module._forward_pre_hooks)
        for expert in model.experts
        for module in expert.modules()
    ]


def test_strength_zero_on_both_experts_is_the_plain_model_bitwise_with_no_hooks(base, cond, plain, lora_path):
    hooks = _hook_counts(base)
    patch = LoraPatch(lora_path, strength_high_noise=0.0, strength_low_noise=0.0)
    with applied_loras(base, [patch]):
        assert _hook_counts(base) == hooks
        latents = sample(base, cond, SETTINGS).latents
    assert torch.equal(latents, plain)


@pytest.mark.slow
@pytest.mark.parametrize(("high", "low"), [(1.0, 1.0), (1.0, 0.0), (0.0, -0.7)])
def test_lora_equals_the_hand_merged_model_on_each_expert(
    high, low, base, cond, plain, content, lora_path, tiny_folder
):
    expected = hand_run(tiny_folder, cond, content, high, low)
    assert not torch.equal(expected, plain), "the LoRA must change the output for this test to mean anything"
    on_the_fly = run(base, cond, [LoraPatch(lora_path, high, low)]).latents
    error = _close(on_the_fly, expected)
    merged = run(base, cond, [LoraPatch(lora_path, high, low, merge=True)]).latents
    assert torch.equal(merged, expected), "merged in place: the hand merge's arithmetic, bit for bit"
    print(f"high={high} low={low}: on the fly vs hand merge max |diff| {error:.2e}")


@pytest.mark.slow
def test_two_loras_stack_in_order(base, cond, content, lora_path, tiny_folder, tmp_path):
    second = lora_content(base, rank=2, seed=7, modules=["blocks.1.attn1.to_v", "blocks.2.ffn.net.2"])
    second_path = write_lora(tmp_path / "style.safetensors", second, "kohya")
    model = rehomed(load_pipeline(tiny_folder, "fp32"))
    for expert, strengths in ((model.transformer, (1.0, 0.8)), (model.transformer_2, (0.5, 0.8))):
        hand_merged(expert, content, strengths[0])
        hand_merged(expert, second, strengths[1])
    expected = sample(model, cond, SETTINGS).latents
    patches = [LoraPatch(lora_path, 1.0, 0.5), LoraPatch(second_path, 0.8, 0.8)]
    _close(run(base, cond, patches).latents, expected)
    merged = [LoraPatch(lora_path, 1.0, 0.5, merge=True), LoraPatch(second_path, 0.8, 0.8, merge=True)]
    assert torch.equal(run(base, cond, merged).latents, expected)


@pytest.mark.slow
def test_every_key_format_gives_the_same_result(base, cond, plain, tmp_path):
    # PEFT files carry no full differences except the biases of LoRA layers: the common ground of all formats.
    shared = lora_content(base, rank=4, seed=3, alpha=ALPHA)
    shared.diffs = {
        f"{name}.bias": torch.randn(base.transformer.get_submodule(name).out_features) * 0.01
        for name in (
            "blocks.0.attn1.to_q",
            "vace_blocks.0.proj_in",
        )
    }
    results = {}
    for fmt in LORA_FORMATS:
        path = write_lora(tmp_path / f"{fmt}.safetensors", shared, fmt)
        weights = load_lora(path)
        assert weights.naming == ("diffusers" if fmt == "peft" else "original"), fmt
        assert set(weights.entries) == set(shared.low_rank), fmt  # every module found, VACE blocks included
        results[fmt] = run(base, cond, [LoraPatch(path)]).latents
    assert not torch.equal(results["comfy"], plain)
    for fmt, latents in results.items():
        assert torch.equal(latents, results["comfy"]), fmt


def _foreign_lora(path, width: int):
    generator = torch.Generator().manual_seed(0)
    content = LoraContent(
        low_rank={"blocks.0.attn1.to_q": (torch.randn(4, width, generator=generator), torch.randn(width, 4))}
    )
    return write_lora(path, content, "comfy")


def test_a_lora_for_another_model_is_refused_naming_file_and_key(base, tmp_path):
    for width, model_name in ((48, "a model of width 48"), (1536, "a Wan 1.3B model")):
        path = _foreign_lora(tmp_path / f"wan_{width}.safetensors", width)
        with pytest.raises(WanVACEInputError) as error:
            check_lora(base, LoraPatch(path))
        message = str(error.value)
        assert str(path) in message and model_name in message, message
        assert "diffusion_model.blocks.0.self_attn.q.lora_" in message, message
    # An unknown module: the tiny model has 4 blocks.
    unknown = LoraContent(low_rank={"blocks.9.attn1.to_q": (torch.zeros(2, 32), torch.zeros(32, 2))})
    path = write_lora(tmp_path / "deeper.safetensors", unknown, "comfy")
    with pytest.raises(WanVACEInputError, match=r"deeper\.safetensors.*blocks\.9\.self_attn\.q.*does not have"):
        check_lora(base, LoraPatch(path))
    # The same refusal from applied_loras, before anything is hooked.
    hooks = _hook_counts(base)
    with pytest.raises(WanVACEInputError, match=r"blocks\.9"), applied_loras(base, [LoraPatch(path)]):
        pass
    assert _hook_counts(base) == hooks


def test_files_without_lora_keys_are_refused(base, tmp_path):
    from safetensors.torch import save_file

    foreign = tmp_path / "checkpoint.safetensors"
    save_file({"model.diffusion_model.blocks.0.self_attn.q.weight": torch.zeros(32, 32)}, str(foreign))
    with pytest.raises(WanVACEInputError, match=r"checkpoint\.safetensors holds 'model\.diffusion_model.*no LoRA key"):
        check_lora(base, LoraPatch(foreign))
    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    with pytest.raises(WanVACEInputError, match=r"empty\.safetensors holds no tensors"):
        check_lora(base, LoraPatch(empty))
    pickle = tmp_path / "lora.pt"
    pickle.write_bytes(b"not read")
    with pytest.raises(WanVACEInputError, match=r"lora\.pt is not a \.safetensors file"):
        check_lora(base, LoraPatch(pickle))
    with pytest.raises(WanVACEInputError, match="cannot be read"):
        check_lora(base, LoraPatch(tmp_path / "missing.safetensors"))
    half = tmp_path / "half.safetensors"
    save_file({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 32)}, str(half))
    with pytest.raises(WanVACEInputError, match=r"half\.safetensors.*without its up"):
        check_lora(base, LoraPatch(half))


@pytest.mark.slow
def test_weights_are_bitwise_unchanged_after_runs_and_a_cancelled_run(base, cond, plain, lora_path):
    before, hooks = _weights(base), _hook_counts(base)

    class Cancelled(Exception):
        pass

    def cancel(index, _total, _latents):
        if index == 1:
            raise Cancelled

    for merge in (False, True):
        run(base, cond, [LoraPatch(lora_path, 1.0, 0.6, merge=merge)])
        with pytest.raises(Cancelled):
            run(base, cond, [LoraPatch(lora_path, 1.0, 0.6, merge=merge)], callback=cancel)
        after = _weights(base)
        assert all(torch.equal(after[key], value) for key, value in before.items()), merge
        assert _hook_counts(base) == hooks
    assert torch.equal(sample(base, cond, SETTINGS).latents, plain)


def test_a_merged_lora_survives_comfyui_unloading_the_model_mid_run(tiny_folder, cond, lora_path):
    """An unload between steps drops the merged weights; those read back at the next step are merged again."""
    model = load_pipeline(tiny_folder, "fp32")
    patch = LoraPatch(lora_path, 1.0, 0.6, merge=True)
    uninterrupted = run(model, cond, [patch]).latents
    released = []

    def unload_after_first_step(index, _total, _latents):
        if index == 0:
            released.append(model.release_device_memory())

    interrupted = run(model, cond, [patch], callback=unload_after_first_step).latents
    assert released and released[0] > 0
    _close(interrupted, uninterrupted)
    plain = sample(model, cond, SETTINGS).latents
    assert (plain - uninterrupted).abs().max() > 100 * (interrupted - uninterrupted).abs().max()


@pytest.mark.slow
def test_lora_with_cache(base, cond, content, lora_path, tiny_folder):
    """Caching keeps the LoRA: with nothing cached the latents are the uncached LoRA run's, bit for bit; with steps
    cached they are the hand-merged model's under the same cache options (merged in place: bit for bit)."""
    settings = SamplerSettings(seed=5, steps=6, cfg=3.0, cfg_low_noise=1.0)
    high, low = 1.0, 0.8
    patches = [LoraPatch(lora_path, high, low)]
    uncached = run(base, cond, patches, settings).latents
    assert not torch.equal(uncached, sample(base, cond, settings).latents), "the LoRA must change the output"
    # A warm-up longer than the run: cache-dit attaches and measures residuals but never skips a step.
    never = ExpertCacheLimits(max_warmup_steps=1000)
    nothing_cached = run(base, cond, patches, settings, cache=CacheOptions(high_noise=never, low_noise=never))
    assert [len(expert.cached_steps) for expert in nothing_cached.cache_report.experts] == [0, 0]
    assert torch.equal(nothing_cached.latents, uncached)

    eager = CacheOptions(residual_diff_threshold=0.5, low_noise=ExpertCacheLimits(max_warmup_steps=1))
    hand = rehomed(load_pipeline(tiny_folder, "fp32"))
    hand_merged(hand.transformer, content, high)
    hand_merged(hand.transformer_2, content, low)
    expected = sample(hand, cond, settings, cache=eager)
    assert expected.cache_report.experts[-1].cached_steps, "the low-noise expert must cache for this test to mean it"
    merged = run(base, cond, [LoraPatch(lora_path, high, low, merge=True)], settings, cache=eager)
    assert merged.cache_report == expected.cache_report
    assert torch.equal(merged.latents, expected.latents)
    on_the_fly = run(base, cond, patches, settings, cache=eager)
    assert on_the_fly.cache_report == expected.cache_report
    error = _close(on_the_fly.latents, expected.latents)
    # A LoRA dropped under caching would give the plain model's cached run: far from the hand merge's.
    dropped = sample(base, cond, settings, cache=eager).latents
    assert (dropped - expected.latents).abs().max() > 100 * error
    print(f"cached LoRA on the fly vs cached hand merge max |diff| {error:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("options", ["none", "model", "layerwise", "layerwise-ring"])
def test_lora_with_each_offload_mode_equals_the_run_on_device(options, base, cond, lora_path, tiny_folder):
    patches = [LoraPatch(lora_path, 1.0, 0.8)]
    expected = run(base, cond, patches).latents
    model = rehomed(load_pipeline(tiny_folder, "fp32"))
    if options == "layerwise-ring":  # the ring's simulated streams poison a slot read before its copy landed
        attach_offload(model, OffloadOptions(mode="layerwise", prefetch_blocks=1), stream_ops=SimulatedStreamOps())
    else:
        attach_offload(model, OffloadOptions(mode=options), SynchronousTransfer())
    before = _weights(model)
    assert torch.equal(run(model, cond, patches).latents, expected)
    after = _weights(model)
    assert all(torch.equal(after[key], value) for key, value in before.items())
    if options != "none":
        with pytest.raises(
            WanVACEInputError, match=rf"merge on, but offload mode '{options.split('-')[0]}'.*set merge off"
        ):
            run(model, cond, [LoraPatch(lora_path, merge=True)])


@pytest.mark.slow
def test_lora_on_kept_fp8_weights_equals_the_hand_merged_dequantised_model(tmp_path):
    from bench.expert_files import write_expert
    from tests.support.single_files import comfy_components, write_umt5, write_vae
    from wanvace_core import ExpertFiles, load_expert_files
    from wanvace_core.load.quantized import QuantizedLinear
    from wanvace_core.load.tiny import sentencepiece_model_bytes

    components = comfy_components()
    files = ExpertFiles(
        high_noise_model=write_expert(tmp_path / "high.safetensors", components["transformer"], quant="scaled_fp8"),
        low_noise_model=write_expert(tmp_path / "low.safetensors", components["transformer_2"], quant="scaled_fp8"),
        text_encoder=write_umt5(tmp_path / "umt5.safetensors", components["text_encoder"], sentencepiece_model_bytes()),
        vae=write_vae(tmp_path / "vae.safetensors", components["vae"]),
    )
    kept = load_expert_files(files, "fp32", "auto")
    assert isinstance(kept.transformer.blocks[0].attn1.to_q, QuantizedLinear)
    content = lora_content(kept, rank=4, seed=2, alpha=ALPHA, diffs=True, std=0.05)
    path = write_lora(tmp_path / "lora.safetensors", content, "lightx2v", dtype=torch.bfloat16)
    content = load_lora_content_as_stored(path, content)
    dequantized = load_expert_files(files, "fp32", "fp32")
    hand_merged(dequantized.transformer, content, 1.0)
    hand_merged(dequantized.transformer_2, content, 0.5)
    cond = prepare_conditioning(kept, INPUTS)
    expected = sample(dequantized, cond, SETTINGS).latents
    assert not torch.equal(expected, sample(kept, cond, SETTINGS).latents)
    error = _close(run(kept, cond, [LoraPatch(path, 1.0, 0.5)]).latents, expected)
    print(f"fp8 kept + LoRA vs hand-merged dequantised: max |diff| {error:.2e}")
    assert kept.transformer.blocks[0].attn1.to_q.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(WanVACEInputError, match=r"merge on, but .* keeps its weights as stored.*set merge off"):
        run(kept, cond, [LoraPatch(path, merge=True)])


def load_lora_content_as_stored(path, content: LoraContent) -> LoraContent:
    """`content` rounded as the bf16 file stores it, so the hand merge uses the file's values."""
    return LoraContent(
        low_rank={
            name: (a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float())
            for name, (a, b) in content.low_rank.items()
        },
        diffs={name: d.to(torch.bfloat16).float() for name, d in content.diffs.items()},
        alpha=content.alpha,
    )


def test_parsed_files_are_cached_until_the_file_changes(lora_path, tmp_path, content):
    first = load_lora(lora_path)
    assert load_lora(lora_path) is first
    copy = write_lora(tmp_path / "copy.safetensors", content, "comfy")
    reread = load_lora(copy)
    os.utime(copy, ns=(1, 1))
    assert load_lora(copy) is not reread


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strength_high_noise": math.nan}, "strength_high_noise=nan is not a finite number"),
        ({"strength_low_noise": 11.0}, "strength_low_noise=11.0 is out of range"),
        ({"strength_low_noise": "1"}, "strength_low_noise='1' is not a number"),
        ({"merge": 1}, "merge=1 must be True or False"),
    ],
)
def test_invalid_patches_are_refused(kwargs, message, lora_path):
    with pytest.raises(WanVACEInputError, match=message):
        LoraPatch(lora_path, **kwargs)


def test_applied_loras_logs_what_it_applied(base, lora_path, caplog):
    with (
        caplog.at_level(logging.INFO, logger="wanvace_core.runtime.lora"),
        applied_loras(base, [LoraPatch(lora_path, 1.0, 0.0)]),
    ):
        pass
    lines = [record.getMessage() for record in caplog.records if record.name == "wanvace_core.runtime.lora"]
    assert len(lines) == 1 and lora_path.name in lines[0] and "high-noise expert" in lines[0], lines


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lora_through_the_layerwise_ring_equals_the_lora_on_device(tiny_folder, lora_path):
    on_device = load_pipeline(tiny_folder, "bf16", device="cuda")
    cond = prepare_conditioning(on_device, INPUTS)
    patches = [LoraPatch(lora_path, 1.0, 0.8)]
    expected = run(on_device, cond, patches).latents
    before = _weights(on_device)
    merged = run(on_device, cond, [LoraPatch(lora_path, 1.0, 0.8, merge=True)]).latents
    after = _weights(on_device)
    assert all(torch.equal(after[key], value) for key, value in before.items())
    # bf16 weights: merged rounds W + delta once per weight, on the fly rounds each product; both near.
    assert (merged - expected).abs().max() < 0.05 * expected.abs().max()
    del on_device
    model = load_pipeline(
        tiny_folder, "bf16", device="cuda", offload=OffloadOptions(mode="layerwise", prefetch_blocks=1)
    )
    for _ in range(2):  # the second run reuses the ring's slots
        assert torch.equal(run(model, cond, patches).latents, expected)
    model.residency.release_all()
    assert model.residency.device_bytes() == 0
    model.close_residency()
