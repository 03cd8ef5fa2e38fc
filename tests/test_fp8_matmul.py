"""fp8 matmul on fp8-kept expert weights: `torch._scaled_mm` runs on every fp8 layer (counted), its numerics stay
within a stated distance of dequantising the weights, LoRA and offload compose with it, off is today's forward
bitwise, and it is refused where it cannot run or has no fp8 weights to use.

PyTorch's CPU kernel for `_scaled_mm` runs here (torch 2.8 and 2.11), so these are the numerics a GPU computes up
to its own accumulation order. The CPU kernel accepts arguments CUDA's refuses (a bias with an fp32 output, a bias of
another dtype than the output), so `cuda_argument_rules` puts CUDA's checks in front of it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.lora_files import lora_content, write_lora
from tests.support.offload_probes import attach_offload
from tests.support.single_files import expert_files
from wanvace_core import (
    LoraPatch,
    OffloadOptions,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    load_expert_files,
    prepare_conditioning,
    sample,
)
from wanvace_core.runtime import fp8_matmul as fp8_module
from wanvace_core.runtime.fp8_matmul import apply_fp8_matmul, fp8_linears
from wanvace_core.runtime.transfer import SynchronousTransfer

pytestmark = pytest.mark.slow

INPUTS = VACEInputs(positive="a cat walks on the grass", negative="blurry", width=32, height=32, length=5)
# The prompts' rows of the text context: their tokens (16 and 6) without the zero padding to 512 rows. Where oneDNN
# runs CPU fp8 matmul with its reference kernel (11 to 16 million multiply-adds a second on an AMX / AVX512-FP16 Xeon),
# the padding alone made each expert forward take over a minute (the text embedding's 512x4096x256 product: 36 s).
CONTEXT_ROWS = 16
SETTINGS = SamplerSettings(seed=7, steps=3, cfg=3.0, cfg_low_noise=3.0)
# Sampling runs with fp8 matmul on: one set only. With the reference kernel each test still takes 45 to 110 s on
# the short context; the oldest set keeps the tests of the kernel's argument rules and distances, layer by layer.
SAMPLING_WITH_FP8 = pytest.mark.one_set
# bf16 compute on the COMFY_SHAPED tiny experts, against dequantising the same fp8 weights. Measured (torch 2.11): the
# expert output's relative RMS difference 0.036, 0.035 with fp32 activations (the activations rounded to e4m3's 3
# mantissa bits); the sampled latents' max abs difference 0.16 of latents up to 3.5, relative RMS 0.046 (0.045 with a
# LoRA, whose own effect is 0.55).
FORWARD_RELATIVE_RMS = 0.06
LATENT_TOLERANCE = 0.3
LATENT_RELATIVE_RMS = 0.08


@pytest.fixture(scope="module")
def fp8_files(comfy_model_files):
    return expert_files(comfy_model_files.written, "fp8_scaled")


@pytest.fixture(scope="module")
def model(fp8_files):
    return load_expert_files(fp8_files, "bf16", "auto")


def _conditioning(model):
    cond = prepare_conditioning(model, INPUTS)
    for embeds in (cond.prompt_embeds, cond.negative_prompt_embeds):
        assert not embeds[:, CONTEXT_ROWS:].any(), "the cut would drop prompt tokens"
    return dataclasses.replace(
        cond,
        prompt_embeds=cond.prompt_embeds[:, :CONTEXT_ROWS],
        negative_prompt_embeds=cond.negative_prompt_embeds[:, :CONTEXT_ROWS],
    )


@pytest.fixture(scope="module")
def cond(model):
    return _conditioning(model)


def _expert_inputs(model, cond) -> dict:
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 2, 4, 4, generator=generator)
    return {
        "hidden_states": latents.to(model.transformer_dtype),
        "timestep": torch.tensor([700]),
        "encoder_hidden_states": cond.prompt_embeds,
        "control_hidden_states": torch.randn(1, 96, 2, 4, 4, generator=generator).to(model.transformer_dtype),
        "control_hidden_states_scale": torch.ones(len(model.vace_layers)),
        "return_dict": False,
    }


@torch.no_grad()
def _forward(model, cond, fp8: bool) -> tuple[torch.Tensor, list[int], int]:
    """The high-noise expert's output, the fp8 layers (ids) that ran, and how many `_scaled_mm` calls were made."""
    expert = model.transformer
    apply_fp8_matmul(expert, fp8)
    calls: list[int] = []
    handles = [
        layer.register_forward_hook(lambda module, _a, _o: calls.append(id(module))) for layer in fp8_linears(expert)
    ]
    scaled_mm = torch._scaled_mm
    counted = []

    def counting(*args, **kwargs):
        counted.append(1)
        return scaled_mm(*args, **kwargs)

    torch._scaled_mm = counting
    try:
        out = expert(**_expert_inputs(model, cond))[0]
    finally:
        torch._scaled_mm = scaled_mm
        for handle in handles:
            handle.remove()
        apply_fp8_matmul(expert, False)
    return out, calls, len(counted)


def cuda_argument_rules(scaled_mm, calls: list[dict]):
    """`torch._scaled_mm` behind the argument checks torch 2.11's CUDA kernel makes and its CPU kernel does not
    (aten/src/ATen/native/cuda/Blas.cpp, `_scaled_mm_out_cuda`); each call's arguments are recorded in `calls`."""

    def checked(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        out = out_dtype or mat1.dtype
        if mat1.shape[1] % 16 or mat2.shape[0] % 16 or mat2.shape[1] % 16:
            raise RuntimeError(f"mat1 {tuple(mat1.shape)} / mat2 {tuple(mat2.shape)}: K and N must be divisible by 16")
        if mat1.stride(1) != 1 or mat2.stride(0) != 1:
            raise RuntimeError("mat1 must be row-major and mat2 column-major")
        if bias is not None and bias.numel() != mat2.shape[1]:
            raise RuntimeError(f"Bias must be size {mat2.shape[1]} but got {bias.numel()}")
        if bias is not None:
            if out == torch.float32:
                raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
            if bias.dtype not in (torch.bfloat16, torch.float16):
                raise RuntimeError(f"Bias must be BFloat16 or Half, but got {bias.dtype}")
            if out == torch.bfloat16 and bias.dtype != torch.bfloat16:
                raise RuntimeError(f"Bias must be BFloat16 to compute {out} output, but got {bias.dtype}")
            if out == torch.float16 and bias.dtype != torch.float16:
                raise RuntimeError(f"Bias must be Float16 to compute {out} output, but got {bias.dtype}")
        if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
            raise RuntimeError("Both scale_a and scale_b must be float (fp32) tensors")
        calls.append({"out_dtype": out, "bias": None if bias is None else bias.dtype, "fast_accum": use_fast_accum})
        return scaled_mm(
            mat1,
            mat2,
            scale_a,
            scale_b,
            bias=bias,
            scale_result=scale_result,
            out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
        )

    return checked


@torch.no_grad()
def _forward_under_cuda_rules(expert, inputs: dict, monkeypatch, fast_accum: bool = False):
    """The expert's output with fp8 matmul on, `_scaled_mm` held to CUDA's argument rules; and the calls' arguments."""
    calls: list[dict] = []
    monkeypatch.setattr(torch, "_scaled_mm", cuda_argument_rules(torch._scaled_mm, calls))
    apply_fp8_matmul(expert, True, fast_accum=fast_accum)
    try:
        return expert(**inputs)[0], calls
    finally:
        apply_fp8_matmul(expert, False)
        monkeypatch.undo()


def _relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_every_fp8_layer_runs_scaled_mm_within_a_stated_distance_of_dequantising(model, cond):
    dequantized, _, no_calls = _forward(model, cond, fp8=False)
    fp8, ran, calls = _forward(model, cond, fp8=True)
    layers = fp8_linears(model.transformer)
    assert no_calls == 0 and layers
    assert sorted(ran) == sorted(id(layer) for layer in layers)  # each fp8 layer ran once...
    assert calls == len(layers)  # ...each through _scaled_mm
    distance = _relative_rms(fp8, dequantized)
    assert 0 < distance <= FORWARD_RELATIVE_RMS, distance


def test_the_cuda_argument_rules_refuse_what_cuda_refuses():
    calls: list[dict] = []
    checked = cuda_argument_rules(torch._scaled_mm, calls)
    a = torch.randn(16, 32).to(fp8_module.FP8)
    b = torch.randn(16, 32).to(fp8_module.FP8).t()
    one = torch.ones(())
    with pytest.raises(RuntimeError, match="Bias is not supported when out_dtype is set to Float32"):
        checked(a, b, one, one, bias=torch.zeros(16), out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Bias must be BFloat16 to compute"):
        checked(a, b, one, one, bias=torch.zeros(16, dtype=torch.float16), out_dtype=torch.bfloat16)
    # The CPU kernel itself accepts the first: the reason these rules are checked here.
    assert torch._scaled_mm(a, b, one, one, bias=torch.zeros(16), out_dtype=torch.float32).dtype == torch.float32
    assert not calls


def test_fp32_activations_with_a_bias_run_under_cudas_rules_close_to_dequantising(fp8_files, monkeypatch):
    """CUDA refuses a bias with an fp32 output: with fp32 activations the bias is added after the product."""
    fp32 = load_expert_files(fp8_files, "fp32", "auto")
    expert = fp32.transformer
    layers = fp8_linears(expert)
    assert layers and any(layer.bias is not None for layer in layers)
    inputs = _expert_inputs(fp32, _conditioning(fp32))
    with torch.no_grad():
        dequantized = expert(**inputs)[0]
    out, calls = _forward_under_cuda_rules(expert, inputs, monkeypatch)
    assert out.dtype == torch.float32 and len(calls) == len(layers)
    assert all(call["out_dtype"] == torch.float32 and call["bias"] is None for call in calls)
    assert 0 < _relative_rms(out, dequantized) <= FORWARD_RELATIVE_RMS


def test_bf16_activations_keep_the_bias_fused_under_cudas_rules(model, cond, monkeypatch):
    expert = model.transformer
    biased = sum(layer.bias is not None for layer in fp8_linears(expert))
    out, calls = _forward_under_cuda_rules(expert, _expert_inputs(model, cond), monkeypatch)
    assert out.dtype == torch.bfloat16 and biased > 0
    assert sum(call["bias"] == torch.bfloat16 for call in calls) == biased
    assert not any(call["fast_accum"] for call in calls)


def test_fast_accum_is_a_choice_and_off_takes_either_forward_away(model, cond, monkeypatch):
    expert = model.transformer
    inputs = _expert_inputs(model, cond)
    fast, calls = _forward_under_cuda_rules(expert, inputs, monkeypatch, fast_accum=True)
    assert calls and all(call["fast_accum"] for call in calls)
    plain, _ = _forward_under_cuda_rules(expert, inputs, monkeypatch)
    assert _relative_rms(fast, plain) <= 0.01  # the CPU kernel accumulates in fp32 either way
    apply_fp8_matmul(expert, True, fast_accum=True)
    apply_fp8_matmul(expert, True)  # switching replaces the fast forward
    assert all(layer.forward.__func__ is fp8_module._scaled_mm_forward for layer in fp8_linears(expert))
    apply_fp8_matmul(expert, True, fast_accum=True)
    apply_fp8_matmul(expert, False)
    assert all("forward" not in layer.__dict__ for layer in fp8_linears(expert))


def test_off_is_the_dequantising_forward_bitwise_after_on(model, cond):
    before, _, _ = _forward(model, cond, fp8=False)
    _forward(model, cond, fp8=True)
    after, _, _ = _forward(model, cond, fp8=False)
    assert torch.equal(after, before)


@SAMPLING_WITH_FP8
def test_loading_with_fp8_matmul_samples_close_to_dequantising(fp8_files, model, cond):
    fast = load_expert_files(fp8_files, "bf16", "auto", fp8_matmul=True)
    assert all(layer.forward.__func__ is fp8_module._scaled_mm_forward for layer in fp8_linears(fast.transformer_2))
    reference = sample(model, cond, SETTINGS).latents
    latents = sample(fast, cond, SETTINGS).latents
    assert (latents - reference).abs().max().item() <= LATENT_TOLERANCE


@SAMPLING_WITH_FP8
def test_a_lora_applies_on_top_of_fp8_matmul(model, cond, tmp_path):
    path = write_lora(tmp_path / "lora.safetensors", lora_content(model, rank=4, seed=2), "peft")
    patched = model.with_loras(LoraPatch(path, strength_high_noise=1.0, strength_low_noise=1.0))
    with torch.no_grad():
        for expert in model.experts:
            apply_fp8_matmul(expert, True)
        try:
            plain = sample(model, cond, SETTINGS).latents
            fast = sample(patched, cond, SETTINGS).latents
        finally:
            for expert in model.experts:
                apply_fp8_matmul(expert, False)
        dequantized = sample(patched, cond, SETTINGS).latents
    # The LoRA moves the result far more than fp8 matmul does, and fp8 matmul keeps the LoRA'd result as close to
    # dequantising as it keeps the plain one.
    without_lora = sample(model, cond, SETTINGS).latents
    assert _relative_rms(dequantized, without_lora) > 3 * LATENT_RELATIVE_RMS
    assert _relative_rms(fast, dequantized) <= LATENT_RELATIVE_RMS
    assert _relative_rms(fast, plain) > 3 * LATENT_RELATIVE_RMS


@SAMPLING_WITH_FP8
def test_fp8_matmul_under_layerwise_offload_is_bitwise_on_the_device(fp8_files, cond):
    on_device = load_expert_files(fp8_files, "bf16", "auto", fp8_matmul=True)
    reference = sample(on_device, cond, SETTINGS).latents
    attach_offload(on_device, OffloadOptions(mode="layerwise", prefetch_blocks=1), SynchronousTransfer())
    assert all(layer.forward.__func__ is fp8_module._scaled_mm_forward for layer in fp8_linears(on_device.transformer))
    assert torch.equal(sample(on_device, cond, SETTINGS).latents, reference)


def test_refused_without_fp8_weights_or_with_weights_dequantised(comfy_model_files, fp8_files):
    bf16 = expert_files(comfy_model_files.written, "bf16")
    with pytest.raises(WanVACEInputError, match=r"fp8_matmul is on but high_noise_model=.* holds no fp8"):
        load_expert_files(bf16, "bf16", "auto", fp8_matmul=True)
    with pytest.raises(WanVACEInputError, match=r"fp8_matmul is on but weight_dtype='bf16' dequantises"):
        load_expert_files(fp8_files, "bf16", "bf16", fp8_matmul=True)


def test_refused_where_the_kernel_does_not_run(fp8_files, monkeypatch):
    monkeypatch.setattr(fp8_module, "fp8_matmul_failure", lambda device: "RuntimeError: no fp8 kernel")
    with pytest.raises(WanVACEInputError, match=r"fp8 matmul does not run on cpu \(RuntimeError: no fp8 kernel\); "):
        load_expert_files(fp8_files, "bf16", "auto", fp8_matmul=True)


def test_the_probe_passes_on_this_cpu():
    assert fp8_module.fp8_matmul_failure("cpu") is None
