"""The single-file writers of bench/expert_files.py and tests/support/single_files.py are self-consistent: names invert
diffusers' own converters, quantised weights come back within their quantisation error, GGUF files read back with
gguf-py. That ComfyUI itself accepts the files is tests/integration/test_comfy_accepts_files.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from bench import expert_files as ef
from tests.support import single_files as sf


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with ef.single_thread():  # tiny tensors: on a busy machine a thread pool only adds contention
        yield


@pytest.fixture(scope="module")
def components(comfy_components_default):
    return comfy_components_default


@pytest.fixture(scope="module")
def transformer(components):
    return components["transformer"]


@pytest.fixture(scope="module")
def source(transformer):
    """The high-noise expert's fp32 tensors under original Wan names."""
    return {k: v.detach().float() for k, v in ef.original_wan_state_dict(transformer).items()}


def _metadata(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


# --------------------------------------------------------------------------------------------------
# Key layouts


def test_original_wan_keys_are_the_exact_inverse_of_diffusers_converter(transformer):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    diffusers_sd = transformer.state_dict()
    original = ef.original_wan_state_dict(transformer)
    assert len(original) == len(diffusers_sd)
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert set(back) == set(diffusers_sd)
    for key, value in diffusers_sd.items():
        assert back[key] is value or torch.equal(back[key], value), key


def test_original_wan_keys_are_named_as_the_wan_release(transformer, source):
    sd = transformer.state_dict()
    pairs = {
        "blocks.1.self_attn.q.weight": "blocks.1.attn1.to_q.weight",
        "blocks.1.self_attn.o.bias": "blocks.1.attn1.to_out.0.bias",
        "blocks.1.cross_attn.norm_k.weight": "blocks.1.attn2.norm_k.weight",
        "blocks.1.norm3.weight": "blocks.1.norm2.weight",
        "blocks.1.ffn.0.weight": "blocks.1.ffn.net.0.proj.weight",
        "blocks.1.ffn.2.weight": "blocks.1.ffn.net.2.weight",
        "blocks.1.modulation": "blocks.1.scale_shift_table",
        "head.head.weight": "proj_out.weight",
        "head.modulation": "scale_shift_table",
        "time_embedding.2.weight": "condition_embedder.time_embedder.linear_2.weight",
        "text_embedding.0.weight": "condition_embedder.text_embedder.linear_1.weight",
        "time_projection.1.weight": "condition_embedder.time_proj.weight",
        "vace_blocks.0.before_proj.weight": "vace_blocks.0.proj_in.weight",
        "vace_blocks.1.after_proj.bias": "vace_blocks.1.proj_out.bias",
        "vace_patch_embedding.weight": "vace_patch_embedding.weight",
    }
    for original, diffusers_key in pairs.items():
        assert torch.equal(source[original], sd[diffusers_key]), original
    assert "vace_blocks.1.before_proj.weight" not in source  # only VACE block 0 has it
    assert not [k for k in source if "norm2" in k or "attn1" in k or "scale_shift_table" in k]


def test_original_wan_vae_keys_are_the_exact_inverse_of_diffusers_converter(components):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    vae_sd = components["vae"].state_dict()
    original = sf.original_wan_vae_state_dict(components["vae"])
    assert len(original) == len(vae_sd)
    for key in ("decoder.middle.0.residual.0.gamma", "decoder.head.0.gamma", "decoder.upsamples.4.shortcut.weight"):
        assert key in original
    assert "decoder.upsamples.0.upsamples.0.residual.2.weight" not in original  # that would be a 2.2 VAE
    back = convert_wan_vae_to_diffusers(dict(original))
    assert set(back) == set(vae_sd)
    for key, value in vae_sd.items():
        assert torch.equal(back[key], value), key


# --------------------------------------------------------------------------------------------------
# Safetensors experts


@pytest.mark.parametrize("prefix", ["", ef.PREFIX])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_expert_holds_every_tensor_in_one_dtype(tmp_path, transformer, source, prefix, dtype):
    path = ef.write_expert(tmp_path / "expert.safetensors", transformer, dtype=dtype, prefix=prefix)
    written = load_file(str(path))
    assert set(written) == {prefix + k for k in source}
    for key, value in source.items():
        assert written[prefix + key].dtype == dtype
        assert torch.equal(written[prefix + key], value.to(dtype)), key
    assert _metadata(path) == {}


def test_base_and_vace_parts_split_the_expert(tmp_path, transformer, source):
    base = load_file(str(ef.write_expert(tmp_path / "t2v.safetensors", transformer, parts="base")))
    vace = load_file(str(ef.write_expert(tmp_path / "vace.safetensors", transformer, parts="vace")))
    assert set(base).isdisjoint(vace) and set(base) | set(vace) == set(source)
    assert set(vace) == {k for k in source if k.startswith(("vace_blocks.", "vace_patch_embedding."))}
    assert "head.modulation" in base and "vace_patch_embedding.weight" in vace


@pytest.mark.parametrize("prefix", ["", ef.PREFIX])
def test_scaled_fp8_expert_is_the_legacy_comfy_scheme(tmp_path, transformer, source, prefix):
    path = ef.write_expert(tmp_path / "fp8.safetensors", transformer, quant="scaled_fp8", prefix=prefix)
    written = load_file(str(path))
    marker = written[prefix + "scaled_fp8"]
    assert marker.dtype == torch.float8_e4m3fn and marker.numel() == 0
    linears = ef.linear_weight_keys(source)
    assert "text_embedding.0.weight" in linears and "blocks.0.ffn.2.weight" in linears
    assert "vace_blocks.0.before_proj.weight" in linears and "patch_embedding.weight" not in linears
    for key, value in source.items():
        stored = written[prefix + key]
        if key in linears:
            layer = prefix + key[: -len(".weight")]
            scale = written[f"{layer}.scale_weight"]
            assert stored.dtype == torch.float8_e4m3fn
            assert scale.dtype == torch.float32 and scale.shape == ()
            assert torch.isclose(scale, value.abs().max() / ef.FP8_MAX)
            assert torch.equal(written[f"{layer}.scale_input"], torch.tensor(1.0))
            error = (sf.dequantize_fp8(stored, scale) - value).abs()
            assert (error <= sf.fp8_tolerance(value, scale)).all(), key
        else:
            assert stored.dtype == torch.bfloat16 and torch.equal(stored, value.to(torch.bfloat16)), key
    assert len(written) == len(source) + 2 * len(linears) + 1
    dequantized = sf.dequantized_expert(written)
    assert set(dequantized) == set(source)


def test_scaled_fp8_options(tmp_path, transformer, source):
    path = ef.write_expert(
        tmp_path / "fp8.safetensors",
        transformer,
        quant="scaled_fp8",
        fp8_layers="blocks",
        scale_input=False,
        marker=torch.float32,
    )
    written = load_file(str(path))
    assert written["scaled_fp8"].dtype == torch.float32 and written["scaled_fp8"].numel() == 0
    assert written["text_embedding.0.weight"].dtype == torch.bfloat16
    assert written["blocks.3.cross_attn.v.weight"].dtype == torch.float8_e4m3fn
    assert not [k for k in written if k.endswith(".scale_input")]
    assert {k[: -len(".scale_weight")] for k in written if k.endswith(".scale_weight")} == {
        k[: -len(".weight")] for k in ef.linear_weight_keys(source, blocks_only=True)
    }
    two = ef.expert_state_dict(transformer, quant="scaled_fp8", marker="fp32x2")[0]["scaled_fp8"]
    assert two.dtype == torch.float32 and two.numel() == 2


@pytest.mark.parametrize("prefix", ["", ef.PREFIX])
def test_mixed_fp8_expert_carries_both_forms_of_the_layer_list(tmp_path, transformer, source, prefix):
    path = ef.write_expert(tmp_path / "mixed.safetensors", transformer, quant="mixed_fp8", prefix=prefix)
    written = load_file(str(path))
    header = json.loads(_metadata(path)["_quantization_metadata"])
    quantised = [k[: -len(".weight")] for k in ef.linear_weight_keys(source, blocks_only=True)]
    assert header["format_version"] == "1.0"
    assert header["layers"] == {layer: {"format": "float8_e4m3fn"} for layer in quantised}  # unprefixed
    assert "scaled_fp8" not in written and prefix + "scaled_fp8" not in written
    for layer in quantised:
        assert sf.read_comfy_quant(written[f"{prefix}{layer}.comfy_quant"]) == {"format": "float8_e4m3fn"}
        weight, scale = written[f"{prefix}{layer}.weight"], written[f"{prefix}{layer}.weight_scale"]
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == ()
        value = source[f"{layer}.weight"]
        assert ((sf.dequantize_fp8(weight, scale) - value).abs() <= sf.fp8_tolerance(value, scale)).all(), layer
    assert written[prefix + "text_embedding.0.weight"].dtype == torch.bfloat16
    assert written[prefix + "head.head.weight"].dtype == torch.bfloat16
    assert set(sf.dequantized_expert(written)) == set(source)


def test_mixed_fp8_forms(tmp_path, transformer):
    header_only = ef.write_expert(tmp_path / "h.safetensors", transformer, quant="mixed_fp8", mixed_form="header")
    assert "_quantization_metadata" in _metadata(header_only)
    assert not [k for k in load_file(str(header_only)) if k.endswith(".comfy_quant")]
    tensors_only = ef.write_expert(
        tmp_path / "t.safetensors", transformer, quant="mixed_fp8", mixed_form="tensors", scale_input=True
    )
    assert _metadata(tensors_only) == {}
    written = load_file(str(tensors_only))
    assert "blocks.0.ffn.0.comfy_quant" in written
    assert torch.equal(written["blocks.0.ffn.0.input_scale"], torch.tensor(1.0))
    with pytest.raises(ValueError):
        ef.write_expert(tmp_path / "x.safetensors", transformer, quant="mixed_fp8", mixed_form="neither")


# --------------------------------------------------------------------------------------------------
# GGUF


def test_q6_k_packing_round_trips_through_gguf_dequantize():
    import gguf

    rng = np.random.default_rng(0)
    data = rng.normal(0.0, 0.05, size=(6, 512)).astype(np.float32)
    data[1] *= np.linspace(0.0, 8.0, 512, dtype=np.float32)  # sub-blocks of very different size
    data[2, :256] = 0.0  # an all-zero block
    data[3, 10] = 3.0  # an outlier
    packed = ef.quantize_q6_k(data)
    assert packed.dtype == np.uint8 and packed.shape == (6, 2 * 210)
    assert gguf.quants.quant_shape_from_byte_shape(packed.shape, gguf.GGMLQuantizationType.Q6_K) == data.shape
    values = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q6_K)
    # Bit-exact: gguf-py decodes the very values the quantiser meant.
    np.testing.assert_array_equal(values, sf.dequantize_q6_k_reference(data))
    assert not values[2, :256].any()
    # Within a step of the 6-bit grid of each block's largest sub-block.
    amax = np.abs(data.reshape(-1, 256)).max(axis=1, keepdims=True)
    error = np.abs(values - data).reshape(-1, 256)
    assert (error <= amax / 31 * 0.55 + 1e-9).all()
    assert error.mean() < 0.05 * np.abs(data).mean()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_gguf_expert_reads_back_with_city96s_types(tmp_path, transformer, source, qtype):
    import gguf

    types = gguf.GGMLQuantizationType
    path = ef.write_gguf_expert(tmp_path / f"expert-{qtype}.gguf", transformer, qtype)
    reader = gguf.GGUFReader(str(path))
    field = reader.get_field("general.file_type")
    assert int(field.parts[field.data[-1]][0]) == getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}")
    assert {t.name for t in reader.tensors} == set(source)
    arch, tensors = sf.read_gguf(path)
    assert arch == "wan"
    expected_type = {
        "blocks.0.modulation": types.F32,
        "head.modulation": types.F32,
        "blocks.0.self_attn.norm_q.weight": types.F32,
        "blocks.0.ffn.0.bias": types.F32,
        "patch_embedding.weight": types.F32,  # 5-D, kept whole
        "vace_patch_embedding.weight": types.F32,
        "text_embedding.0.weight": types.BF16,
        "time_embedding.0.weight": types.BF16,
        "time_projection.1.weight": types.BF16,
        "head.head.weight": types.BF16,
        "blocks.0.self_attn.q.weight": getattr(types, qtype),
        "vace_blocks.0.before_proj.weight": getattr(types, qtype),
        "vace_blocks.1.after_proj.weight": getattr(types, qtype),
        # rows of 64 are no multiple of Q6_K's 256: city96's fallback is F16
        "blocks.0.ffn.2.weight": types.F16 if qtype == "Q6_K" else types.Q8_0,
    }
    for key, ggml_type in expected_type.items():
        assert tensors[key][0] == ggml_type, (key, tensors[key][0])
    assert not reader.get_field("comfy.gguf.orig_shape.patch_embedding.weight")
    for key, value in source.items():
        ggml_type, values = tensors[key]
        assert values.shape == tuple(value.shape), key
        bf16 = value.to(torch.bfloat16).float().numpy()
        if ggml_type in (types.F32, types.BF16):
            np.testing.assert_array_equal(values, bf16, err_msg=key)
        elif ggml_type == types.F16:
            np.testing.assert_array_equal(values, bf16.astype(np.float16).astype(np.float32), err_msg=key)
        else:
            block = 32 if ggml_type == types.Q8_0 else 256
            amax = np.abs(bf16.reshape(-1, block)).max(axis=1, keepdims=True)
            step = amax / (127 if ggml_type == types.Q8_0 else 31)
            assert (np.abs(values - bf16).reshape(-1, block) <= step * 0.55 + 1e-9).all(), key


# --------------------------------------------------------------------------------------------------
# umt5 and VAE


def test_umt5_file_has_comfys_layout(tmp_path, components):
    from wanvace_core.load.tiny import sentencepiece_model_bytes

    encoder = components["text_encoder"]
    spiece = sentencepiece_model_bytes()
    path = sf.write_umt5(tmp_path / "umt5_xxl_fp16.safetensors", encoder, spiece, dtype=torch.float16)
    written = load_file(str(path))
    hf = {k: v for k, v in encoder.state_dict().items() if k != "encoder.embed_tokens.weight"}
    assert set(written) == set(hf) | {"spiece_model"}
    assert bytes(written["spiece_model"].tolist()) == spiece and written["spiece_model"].dtype == torch.uint8
    layers = encoder.config.num_layers
    assert all(
        f"encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight" in written for i in range(layers)
    )
    assert written["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[0] == 32
    for key, value in hf.items():
        assert written[key].dtype == torch.float16 and torch.equal(written[key], value.to(torch.float16)), key


def test_umt5_fp8_scaled_quantises_the_seven_linears_of_every_block(tmp_path, components):
    from wanvace_core.load.tiny import sentencepiece_model_bytes

    encoder = components["text_encoder"]
    path = sf.write_umt5(
        tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
        encoder,
        sentencepiece_model_bytes(),
        dtype=torch.float16,
        quant="scaled_fp8",
    )
    written = load_file(str(path))
    assert written["scaled_fp8"].dtype == torch.float8_e4m3fn
    fp8 = {k for k, v in written.items() if v.dtype == torch.float8_e4m3fn and k != "scaled_fp8"}
    assert len(fp8) == 7 * encoder.config.num_layers
    assert {k[: -len(".scale_weight")] + ".weight" for k in written if k.endswith(".scale_weight")} == fp8
    assert not [k for k in written if k.endswith(".scale_input")]
    assert written["shared.weight"].dtype == torch.float16
    source = encoder.state_dict()
    for key in fp8:
        scale = written[key[: -len(".weight")] + ".scale_weight"]
        value = source[key].float()
        assert ((sf.dequantize_fp8(written[key], scale) - value).abs() <= sf.fp8_tolerance(value, scale)).all(), key


def test_vae_file_has_original_keys(tmp_path, components):
    path = sf.write_vae(tmp_path / "wan_2.1_vae.safetensors", components["vae"])
    written = load_file(str(path))
    original = sf.original_wan_vae_state_dict(components["vae"])
    assert set(written) == set(original)
    assert all(torch.equal(written[k], v.to(torch.bfloat16)) for k, v in original.items())
    assert written["decoder.head.0.gamma"].shape[0] == components["vae"].config.base_dim


# --------------------------------------------------------------------------------------------------
# The models/ tree and broken files


def test_write_comfy_models_writes_the_real_file_names(tmp_path, components, comfy_model_files):
    root, written = comfy_model_files  # write_comfy_models(root, components), every format
    names = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert names == {
        "diffusion_models/wan2.2_fun_vace_high_noise_14B_bf16.safetensors",
        "diffusion_models/wan2.2_fun_vace_low_noise_14B_bf16.safetensors",
        "diffusion_models/wan2.2_fun_vace_high_noise_14B_fp8_scaled.safetensors",
        "diffusion_models/wan2.2_fun_vace_low_noise_14B_fp8_scaled.safetensors",
        "diffusion_models/wan2.2_fun_vace_high_noise_14B_fp8mixed.safetensors",
        "diffusion_models/wan2.2_fun_vace_low_noise_14B_fp8mixed.safetensors",
        "diffusion_models/wan2.2_t2v_high_noise_14B_fp16.safetensors",
        "diffusion_models/wan2.2_t2v_low_noise_14B_fp16.safetensors",
        "diffusion_models/Wan2_2_Fun_VACE_module_A14B_HIGH_bf16.safetensors",
        "diffusion_models/Wan2_2_Fun_VACE_module_A14B_LOW_bf16.safetensors",
        "diffusion_models/Wan2.2-VACE-Fun-A14B-high-noise-Q8_0.gguf",
        "diffusion_models/Wan2.2-VACE-Fun-A14B-low-noise-Q8_0.gguf",
        "diffusion_models/Wan2.2-VACE-Fun-A14B-high-noise-Q6_K.gguf",
        "diffusion_models/Wan2.2-VACE-Fun-A14B-low-noise-Q6_K.gguf",
        "text_encoders/umt5_xxl_fp16.safetensors",
        "text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
        "vae/wan_2.1_vae.safetensors",
    }
    assert written["split"]["low"]["vace"].name == "Wan2_2_Fun_VACE_module_A14B_LOW_bf16.safetensors"
    assert written["vae"].name == "wan_2.1_vae.safetensors"
    # high noise = diffusers `transformer`, low noise = `transformer_2`
    high, low = (load_file(str(written["bf16"][e])) for e in ("high", "low"))
    for expert, state in (("transformer", high), ("transformer_2", low)):
        reference = components[expert].state_dict()["blocks.0.attn1.to_q.weight"].to(torch.bfloat16)
        assert torch.equal(state["blocks.0.self_attn.q.weight"], reference)
    assert load_file(str(written["split"]["high"]["base"]))["head.head.weight"].dtype == torch.float16
    only = sf.write_comfy_models(tmp_path / "vae_only", components, formats=["vae"])
    assert set(only) == {"vae"}
    with pytest.raises(ValueError):
        sf.write_comfy_models(tmp_path / "bad", components, formats=["fp4"])


def test_truncated_and_foreign_files(tmp_path, transformer):
    from safetensors import SafetensorError

    whole = ef.write_expert(tmp_path / "whole.safetensors", transformer)
    cut = sf.truncate_copy(whole, tmp_path / "cut.safetensors")
    assert cut.stat().st_size == whole.stat().st_size // 2
    with pytest.raises(SafetensorError):
        load_file(str(cut))
    foreign = load_file(str(sf.non_wan_file(tmp_path / "sd_vae.safetensors")))
    assert "encoder.conv_in.weight" in foreign and not [k for k in foreign if k.startswith(("blocks.", "head."))]
