"""Single-file loading: every layout ComfyUI users have, written from one tiny diffusers model.

The files come from `tests/support/single_files.py` (checked against ComfyUI's own loaders in
tests/integration/test_comfy_accepts_files.py). The reference is the folder loader over a diffusers
folder of the same weights. Plain float layouts must give bitwise-equal latents; fp8 and GGUF give
weights within the format's rounding error and latents within the tolerances below (measured on
this tiny model, 3 steps, CFG 3: fp8 max |diff| 0.04 of latents of max 4; Q8_0 0.005; Q6_K 0.02).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.support.offload_probes import attach_offload, units_of
from tests.support.original_release import wan_t5_state_dict, write_original_release
from tests.support.single_files import (
    PREFIX,
    expert_files,
    fp8_tolerance,
    non_wan_file,
    truncate_copy,
    write_expert,
    write_umt5,
    write_vae,
)
from wanvace_core import (
    ExpertFiles,
    OffloadOptions,
    SamplerSettings,
    VACEInputs,
    WanVACEModelFolderError,
    inspect_expert_files,
    load_expert_files,
    load_pipeline,
    prepare_conditioning,
    sample,
)
from wanvace_core.load.original_release import find_original_folders, original_folder_files
from wanvace_core.load.quantized import QuantizedLinear
from wanvace_core.load.tiny import COMFY_SHAPED, TinyModelSpec, sentencepiece_model_bytes
from wanvace_core.runtime.offload import tensor_bytes

pytestmark = pytest.mark.slow

INPUTS = VACEInputs(positive="a cat walks on the grass", negative="blurry", width=64, height=64, length=5)
SETTINGS = SamplerSettings(seed=7, steps=3, cfg=3.0, cfg_low_noise=3.0)
FP8_LATENT_TOLERANCE = 0.1
GGUF_LATENT_TOLERANCE = {"Q8_0": 0.02, "Q6_K": 0.05}


def run(model) -> torch.Tensor:
    return sample(model, prepare_conditioning(model, INPUTS), SETTINGS).latents


def rehomed(model):
    """`model` with every weight in a fresh allocation. CPU GEMM kernels pick their path by operand address
    alignment, and weights used in place from a file sit at that file's offsets (another header length,
    another alignment: ~1e-6 apart in fp32). Re-homing both sides compares what was loaded, not where it lies."""
    with torch.no_grad():
        for module in model.components.values():
            for tensor in [*module.parameters(), *module.buffers()]:
                tensor.data = tensor.data.clone()
    return model


@pytest.fixture(scope="module")
def components(comfy_components_default):
    return comfy_components_default


@pytest.fixture(scope="module")
def folder(comfy_shaped_folder):
    return comfy_shaped_folder


@pytest.fixture(scope="module")
def bf16_folder(folder, tmp_path_factory):
    """The same folder with every float tensor stored in bf16, as a bf16 release holds it (norms included)."""
    from safetensors.torch import load_file

    copy = shutil.copytree(folder, tmp_path_factory.mktemp("diffusers-bf16") / folder.name)
    for path in copy.glob("*/*.safetensors"):
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
        save_file(state, str(path))
    return copy


@pytest.fixture(scope="module")
def reference(folder, bf16_folder):
    cache = {}

    def get(dtype: str):
        if dtype not in cache:
            model = rehomed(load_pipeline(folder if dtype == "fp32" else bf16_folder, dtype))
            cache[dtype] = (model, run(model))
        return cache[dtype]

    return get


@pytest.fixture(scope="module")
def models_dir(comfy_model_files):
    """(root, written) of the session's models/ tree: shared, so the bad-file tests below cut and edit copies."""
    return comfy_model_files


def _write_set(root, components, dtype: torch.dtype, prefix: str = "") -> ExpertFiles:
    spiece = sentencepiece_model_bytes()
    return ExpertFiles(
        high_noise_model=write_expert(root / "high.safetensors", components["transformer"], dtype=dtype, prefix=prefix),
        low_noise_model=write_expert(root / "low.safetensors", components["transformer_2"], dtype=dtype, prefix=prefix),
        text_encoder=write_umt5(root / "umt5.safetensors", components["text_encoder"], spiece, dtype=dtype),
        vae=write_vae(root / "vae.safetensors", components["vae"], dtype=dtype),
    )


def _assert_same_weights(a, b) -> None:
    for name, module in a.components.items():
        ours, theirs = module.state_dict(), b.components[name].state_dict()
        assert ours.keys() == theirs.keys(), (name, sorted(set(ours) ^ set(theirs))[:5])
        unequal = [key for key in ours if not torch.equal(ours[key], theirs[key])]
        assert not unequal, (name, unequal[:5])


def _block_weight_bytes(model, name: str) -> int:
    expert = getattr(model, name)
    return tensor_bytes([*expert.blocks, *expert.vace_blocks], buffers=True)


# --------------------------------------------------------------------------------------------------
# Plain float layouts: bitwise equal to the folder loader


@pytest.mark.parametrize("prefix", ["", PREFIX])
def test_fp32_single_files_equal_the_folder_bitwise(tmp_path, components, reference, prefix):
    files = _write_set(tmp_path, components, torch.float32, prefix)
    model = load_expert_files(files, "fp32")
    ref_model, ref_latents = reference("fp32")
    _assert_same_weights(model, ref_model)
    assert torch.equal(run(rehomed(model)), ref_latents)


def test_bf16_single_files_equal_the_folder_bitwise(tmp_path, components, reference):
    model = load_expert_files(_write_set(tmp_path, components, torch.bfloat16), "bf16")
    ref_model, ref_latents = reference("bf16")
    _assert_same_weights(model, ref_model)
    assert torch.equal(run(rehomed(model)), ref_latents)


def test_t2v_expert_plus_vace_module_equals_the_whole_expert(tmp_path, components, reference):
    spiece = sentencepiece_model_bytes()
    files = ExpertFiles(
        high_noise_model=write_expert(
            tmp_path / "t2v_high.safetensors", components["transformer"], dtype=torch.float32, parts="base"
        ),
        high_noise_vace_module=write_expert(
            tmp_path / "vace_high.safetensors", components["transformer"], dtype=torch.float32, parts="vace"
        ),
        low_noise_model=write_expert(
            tmp_path / "t2v_low.safetensors", components["transformer_2"], dtype=torch.float32, parts="base"
        ),
        low_noise_vace_module=write_expert(
            tmp_path / "vace_low.safetensors", components["transformer_2"], dtype=torch.float32, parts="vace"
        ),
        text_encoder=write_umt5(tmp_path / "umt5.safetensors", components["text_encoder"], spiece, dtype=torch.float32),
        vae=write_vae(tmp_path / "vae.safetensors", components["vae"], dtype=torch.float32),
    )
    model = load_expert_files(files, "fp32")
    ref_model, ref_latents = reference("fp32")
    _assert_same_weights(model, ref_model)
    assert torch.equal(run(rehomed(model)), ref_latents)


def test_expert_labels_follow_diffusers_naming(tmp_path, components, folder):
    """high_noise_model is diffusers' `transformer` (VideoX-Fun calls it transformer_2), low_noise_model its
    `transformer_2`; swapping the files swaps the experts."""
    files = _write_set(tmp_path, components, torch.float32)
    model = load_expert_files(files, "fp32")
    diffusers_high = json.loads((folder / "model_index.json").read_text())["transformer"]
    assert diffusers_high == ["diffusers", "WanVACETransformer3DModel"]
    high = components["transformer"].state_dict()
    assert all(torch.equal(v, high[k]) for k, v in model.transformer.state_dict().items() if k in high)
    low = components["transformer_2"].state_dict()
    assert all(torch.equal(v, low[k]) for k, v in model.transformer_2.state_dict().items() if k in low)
    assert not torch.equal(high["blocks.0.attn1.to_q.weight"], low["blocks.0.attn1.to_q.weight"])
    assert model.boundary_ratio == 0.875


def test_inferred_config_is_the_model_config(tmp_path, components):
    files = _write_set(tmp_path, components, torch.bfloat16)
    layouts = inspect_expert_files(files)
    config = dict(components["transformer"].config)
    inferred = layouts["transformer"].config
    for key, value in inferred.items():
        if key != "rope_max_seq_len":  # Wan's 1024; the tiny model uses a shorter table (same values)
            assert list(value) == list(config[key]) if isinstance(value, (list, tuple)) else value == config[key], key
    text = components["text_encoder"].config
    for key, value in layouts["text_encoder"].config.items():
        if key != "feed_forward_proj":
            assert getattr(text, key) == value, key
    assert layouts["vae"].config == {"base_dim": components["vae"].config.base_dim, "z_dim": 16}


def test_real_file_names_load(models_dir):
    """The Comfy-Org bf16 experts with the fp16 umt5 file: the layout users download."""
    _root, written = models_dir
    model = load_expert_files(expert_files(written, "bf16"), "bf16")
    assert model.transformer_2 is not None and model.tokenizer("a cat")["input_ids"][-1] == 1


# --------------------------------------------------------------------------------------------------
# fp8 (both ComfyUI schemes) and GGUF


@pytest.mark.parametrize("fmt", ["fp8_scaled", "fp8mixed"])
def test_fp8_weights_stay_fp8_and_match_dequantising_at_load(models_dir, reference, fmt):
    _root, written = models_dir
    files = expert_files(written, fmt)
    kept = load_expert_files(files, "fp32", "auto")
    dequantized = load_expert_files(files, "fp32", "fp32")
    ref_model, ref_latents = reference("fp32")
    layer = kept.transformer.blocks[0].attn1.to_q
    assert isinstance(layer, QuantizedLinear) and layer.weight.dtype == torch.float8_e4m3fn
    assert type(dequantized.transformer.blocks[0].attn1.to_q) is torch.nn.Linear
    # Weights within e4m3fn's rounding of the source (the scale is applied, not dropped).
    source = ref_model.transformer.blocks[0].attn1.to_q.weight
    weight = dequantized.transformer.blocks[0].attn1.to_q.weight
    assert ((weight - source).abs() <= fp8_tolerance(source, layer.weight_scale)).all()
    assert (weight - source).abs().max() < 0.05 * source.abs().max()
    latents = run(kept)
    assert torch.equal(latents, run(dequantized)), "kept fp8 and fp8 dequantised at load compute the same weights"
    error = (latents - ref_latents).abs().max().item()
    print(f"{fmt}: max |latent diff| vs fp32 folder {error:.4f} (latents up to {ref_latents.abs().max():.2f})")
    assert 0 < error < FP8_LATENT_TOLERANCE


@pytest.mark.parametrize("fmt", ["fp8_scaled", "Q8_0"])
def test_bf16_weights_dequantised_at_load_equal_the_per_forward_dequantisation(models_dir, fmt):
    """At load, fp8 is cast into place and scaled in place, GGUF dequantised in small windows; per forward,
    `WeightFormat.dequantize` then a cast. Both must give the same bf16 weights, bit for bit."""
    _root, written = models_dir
    files = expert_files(written, fmt)
    kept = load_expert_files(files, "bf16", "auto")
    dequantized = dict(load_expert_files(files, "bf16", "bf16").transformer.named_modules())
    layers = [
        (name, module) for name, module in kept.transformer.named_modules() if isinstance(module, QuantizedLinear)
    ]
    assert len(layers) > 20
    for name, module in layers:
        weight = module.weight_format.dequantize(
            module.weight, module.weight_scale, (module.out_features, module.in_features)
        )
        assert torch.equal(weight.to(torch.bfloat16), dequantized[name].weight), name


def _linear_weight_bytes(model) -> int:
    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.transformer.modules()
        if isinstance(m, QuantizedLinear)
    )


def _linear_weight_count(model) -> int:
    return sum(m.in_features * m.out_features for m in model.transformer.modules() if isinstance(m, QuantizedLinear))


def test_fp8_weights_take_about_half_of_bf16(models_dir):
    """At A14B size the Linear weights are > 99% of an expert's bytes; in the tiny model the fp32/bf16 norms,
    modulation and biases weigh more, so the whole-block ratio is printed and the Linear ratio asserted."""
    _root, written = models_dir
    bf16 = load_expert_files(expert_files(written, "bf16"), "bf16")
    fp8 = load_expert_files(expert_files(written, "fp8_scaled"), "bf16", "auto")
    ratio = _linear_weight_bytes(fp8) / (2 * _linear_weight_count(fp8))
    blocks = _block_weight_bytes(fp8, "transformer") / _block_weight_bytes(bf16, "transformer")
    print(f"fp8 kept / bf16: Linear weight bytes {ratio:.3f}, whole blocks {blocks:.3f}")
    assert ratio == 0.5
    assert blocks < 0.6


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_gguf_experts(models_dir, reference, qtype):
    _root, written = models_dir
    files = expert_files(written, qtype)
    kept = load_expert_files(files, "fp32", "auto")
    dequantized = load_expert_files(files, "fp32", "fp32")
    ref_model, ref_latents = reference("fp32")
    layer = kept.transformer.blocks[0].ffn.net[0].proj
    assert (
        isinstance(layer, QuantizedLinear) and layer.weight_format.quant == qtype and layer.weight.dtype == torch.uint8
    )
    source = ref_model.transformer.blocks[0].ffn.net[0].proj.weight
    weight = dequantized.transformer.blocks[0].ffn.net[0].proj.weight
    # Q8_0: 8-bit blocks of 32 (error <= half a step of amax/127); Q6_K: 6-bit, about 4x coarser.
    relative = (weight - source).abs().max() / source.abs().max()
    assert relative < (0.01 if qtype == "Q8_0" else 0.04), relative
    latents = run(kept)
    assert torch.equal(latents, run(dequantized))
    error = (latents - ref_latents).abs().max().item()
    print(f"{qtype}: max |latent diff| vs fp32 folder {error:.4f}; weight rel. error {relative:.4f}")
    assert 0 < error < GGUF_LATENT_TOLERANCE[qtype]
    ratio = _linear_weight_bytes(kept) / (2 * _linear_weight_count(kept))
    print(f"{qtype} kept / bf16 Linear weight bytes: {ratio:.3f}")
    assert ratio < 0.55


def test_kept_fp8_composes_with_every_offload_mode_and_unload(models_dir):
    _root, written = models_dir
    files = expert_files(written, "fp8_scaled")
    base = load_expert_files(files, "fp32", "auto")
    expected = run(base)
    for mode in ("model", "layerwise"):
        model = load_expert_files(files, "fp32", "auto", offload=OffloadOptions(mode=mode))
        if mode == "layerwise":
            units = units_of(model.residency, "transformer")
            block = next(unit for unit in units if unit.name.endswith("blocks.0"))
            # The ring moves the stored fp8 bytes: a block's unit is its fp8 weights plus small float tensors.
            fp8_bytes = sum(
                p.numel() for p in model.transformer.blocks[0].parameters() if p.dtype == torch.float8_e4m3fn
            )
            assert fp8_bytes > 0.5 * block.nbytes
        assert torch.equal(run(model), expected), mode
    released = base.release_device_memory()
    assert released > 0 and base.transformer.blocks[0].attn1.to_q.weight.is_meta
    assert torch.equal(run(base), expected), "weights read back from the files after an unload"


def _fp32_bytes(block) -> int:
    """What a block's parameters would take dequantised to fp32."""
    total = 0
    for module in block.modules():
        for name, param in module.named_parameters(recurse=False):
            stored = isinstance(module, QuantizedLinear) and name == "weight"
            total += 4 * (module.in_features * module.out_features if stored else param.numel())
    return total


@pytest.mark.parametrize("fmt", ["fp8_scaled", "Q6_K"])
def test_kept_weights_stream_through_the_cuda_ring_as_stored_bytes(models_dir, fmt):
    """The layerwise ring (simulated streams, tests/support/simulated_streams.py) stages the stored fp8/GGUF bytes:
    its slots are sized by the kept blocks, and the result equals the plain run bitwise."""
    from tests.support.simulated_streams import SimulatedStreamOps
    from wanvace_core.runtime.transfer import RingTransfer

    _root, written = models_dir
    files = expert_files(written, fmt)
    expected = run(load_expert_files(files, "fp32", "auto"))
    model = load_expert_files(files, "fp32", "auto", offload=OffloadOptions(mode="layerwise"))
    ops = SimulatedStreamOps()
    attach_offload(model, OffloadOptions(mode="layerwise", prefetch_blocks=1), stream_ops=ops)
    ring = model.residency.transfer
    assert isinstance(ring, RingTransfer)
    with ops.observing_compute():
        latents = run(model)
    assert torch.equal(latents, expected)
    assert ops.copies_run > 0
    stored = max(tensor_bytes([block]) for block in [*model.transformer.blocks, *model.transformer.vace_blocks])
    dequantized = max(_fp32_bytes(block) for block in [*model.transformer.blocks, *model.transformer.vace_blocks])
    assert stored <= ring.slot_bytes < 0.5 * dequantized, (stored, ring.slot_bytes, dequantized)


# --------------------------------------------------------------------------------------------------
# Tokenizer, original release folder


def test_tokenizer_comes_from_the_spiece_model_tensor(models_dir, reference):
    _root, written = models_dir
    model = load_expert_files(expert_files(written, "bf16"), "bf16")
    ref_model, _ = reference("fp32")
    for text in ("a cat walks on the grass", "  Neon signs,   at night!  ", "unknown wörds ünïcode"):
        assert model.tokenizer(text)["input_ids"] == ref_model.tokenizer(text)["input_ids"], text


def test_tokenizer_folder_beside_a_file_without_spiece(tmp_path, components, folder):
    files = _write_set(tmp_path, components, torch.float32)
    state = {k: v for k, v in _read(files.text_encoder).items() if k != "spiece_model"}
    bare = tmp_path / "umt5_bare.safetensors"
    save_file(state, str(bare))
    with pytest.raises(WanVACEModelFolderError, match="umt5_bare_tokenizer"):
        inspect_expert_files(ExpertFiles(**{**files.__dict__, "text_encoder": bare}))  # refused before any load
    shutil.copytree(folder / "tokenizer", tmp_path / "umt5_bare_tokenizer")
    model = load_expert_files(ExpertFiles(**{**files.__dict__, "text_encoder": bare}), "fp32")
    assert model.tokenizer("a cat")["input_ids"] == load_pipeline(folder, "fp32").tokenizer("a cat")["input_ids"]


def _read(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_wan_t5_feed_forward_names_mean_what_wan_computes(components):
    """Wan's T5FeedForward computes fc2(fc1(x) * gelu_tanh(gate.0(x))); our name mapping must make
    transformers' gated FFN compute exactly that (a swapped gate/fc1 would not)."""
    encoder = components["text_encoder"]
    wan = wan_t5_state_dict(encoder)
    x = torch.randn(1, 3, encoder.config.d_model)
    gate = torch.nn.functional.gelu(x @ wan["blocks.0.ffn.gate.0.weight"].T, approximate="tanh")
    expected = (x @ wan["blocks.0.ffn.fc1.weight"].T * gate) @ wan["blocks.0.ffn.fc2.weight"].T
    ffn = encoder.encoder.block[0].layer[1].DenseReluDense
    torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-6)


def test_original_release_folder_needs_the_pth_opt_in_and_then_equals_the_folder(
    tmp_path, components, folder, reference
):
    release = tmp_path / "models" / "Wan2.2-VACE-Fun-A14B"
    write_original_release(release, components)
    assert find_original_folders([tmp_path / "models"]) == ["Wan2.2-VACE-Fun-A14B"]
    with pytest.raises(WanVACEModelFolderError, match="allow_pth_weights"):
        original_folder_files(release, allow_pth=False)
    model = load_expert_files(original_folder_files(release, allow_pth=True), "fp32")
    ref_model, ref_latents = reference("fp32")
    _assert_same_weights(model, ref_model)
    assert torch.equal(run(rehomed(model)), ref_latents)


# --------------------------------------------------------------------------------------------------
# Bad files: a node error naming the file and the fix


def _with(files: ExpertFiles, **changes) -> ExpertFiles:
    return ExpertFiles(**{**files.__dict__, **changes})


@pytest.fixture(scope="module")
def good_files(models_dir):
    _root, written = models_dir
    return expert_files(written, "bf16")


def test_truncated_expert_is_refused(tmp_path, good_files):
    cut = truncate_copy(good_files.high_noise_model, tmp_path / "cut.safetensors")
    with pytest.raises(WanVACEModelFolderError, match=r"cut\.safetensors.*(truncated|corrupt).*re-download"):
        inspect_expert_files(_with(good_files, high_noise_model=cut))


def test_t2v_expert_without_vace_module_is_refused(models_dir, good_files):
    _root, written = models_dir
    with pytest.raises(WanVACEModelFolderError, match=r"text-to-video expert without VACE blocks.*VACE module"):
        inspect_expert_files(_with(good_files, low_noise_model=written["split"]["low"]["base"]))


def test_vace_module_alone_is_refused(models_dir, good_files):
    _root, written = models_dir
    with pytest.raises(WanVACEModelFolderError, match="VACE module only"):
        inspect_expert_files(_with(good_files, high_noise_model=written["split"]["high"]["vace"]))
    with pytest.raises(WanVACEModelFolderError, match="holds base blocks too"):
        inspect_expert_files(
            _with(
                good_files,
                high_noise_model=written["split"]["high"]["base"],
                high_noise_vace_module=good_files.high_noise_model,
            )
        )


def test_non_wan_files_are_refused(tmp_path, good_files):
    foreign = non_wan_file(tmp_path / "sd_vae.safetensors")
    with pytest.raises(WanVACEModelFolderError, match=r"sd_vae\.safetensors is not a Wan model"):
        inspect_expert_files(_with(good_files, high_noise_model=foreign))
    with pytest.raises(WanVACEModelFolderError, match="not a Wan VAE"):
        inspect_expert_files(_with(good_files, vae=foreign))
    with pytest.raises(WanVACEModelFolderError, match="not a umt5 text encoder"):
        inspect_expert_files(_with(good_files, text_encoder=foreign))
    pickle = tmp_path / "wan_vae.pth"
    pickle.write_bytes(b"not read")
    with pytest.raises(WanVACEModelFolderError, match=r"wan_vae\.pth is a pickle checkpoint.*allow_pth_weights"):
        inspect_expert_files(_with(good_files, vae=pickle))


def test_experts_of_two_sizes_are_refused(tmp_path, good_files):
    from wanvace_core.load.tiny import build_tiny_components

    bigger = build_tiny_components(TinyModelSpec(**{**COMFY_SHAPED.__dict__, "num_layers": 6, "vace_layers": (0, 3)}))
    other = write_expert(tmp_path / "other_low.safetensors", bigger["transformer_2"])
    with pytest.raises(WanVACEModelFolderError, match=r"two different models.*num_layers 4 vs 6"):
        inspect_expert_files(_with(good_files, low_noise_model=other))


def test_fp8_without_scales_is_refused(tmp_path, components, good_files):
    state = _read(write_expert(tmp_path / "fp8.safetensors", components["transformer"], quant="scaled_fp8"))
    state.pop("blocks.1.self_attn.q.scale_weight")
    broken = tmp_path / "fp8_noscale.safetensors"
    save_file(state, str(broken))
    with pytest.raises(
        WanVACEModelFolderError, match=r"fp8_noscale.*'blocks\.1\.self_attn\.q\.weight' in fp8 but lists no scale"
    ):
        inspect_expert_files(_with(good_files, high_noise_model=broken))
    mixed = write_expert(tmp_path / "mixed.safetensors", components["transformer"], quant="mixed_fp8")
    from safetensors import safe_open

    with safe_open(str(mixed), "pt") as handle:
        metadata = handle.metadata()
        state = {key: handle.get_tensor(key) for key in handle.keys() if key != "blocks.0.ffn.0.weight_scale"}
    save_file(state, str(tmp_path / "mixed_noscale.safetensors"), metadata=metadata)
    with pytest.raises(WanVACEModelFolderError, match=r"without its scale 'blocks.0.ffn.0.weight_scale'"):
        inspect_expert_files(_with(good_files, high_noise_model=tmp_path / "mixed_noscale.safetensors"))


def test_a_prefixed_file_with_an_unprefixed_marker_keeps_its_scales(tmp_path, components, good_files):
    state = _read(
        write_expert(tmp_path / "p.safetensors", components["transformer"], quant="scaled_fp8", prefix=PREFIX)
    )
    state["scaled_fp8"] = state.pop(PREFIX + "scaled_fp8")
    moved = tmp_path / "prefixed_unprefixed_marker.safetensors"
    save_file(state, str(moved))
    reference = write_expert(tmp_path / "plain.safetensors", components["transformer"], quant="scaled_fp8")
    ours = load_expert_files(_with(good_files, high_noise_model=moved), "fp32", "fp32").transformer.state_dict()
    plain = load_expert_files(_with(good_files, high_noise_model=reference), "fp32", "fp32").transformer.state_dict()
    assert all(torch.equal(ours[key], plain[key]) for key in plain)


def test_fp8_scales_without_a_scheme_are_refused(tmp_path, components, good_files):
    state = _read(write_expert(tmp_path / "fp8.safetensors", components["transformer"], quant="scaled_fp8"))
    del state["scaled_fp8"]
    unmarked = tmp_path / "fp8_no_marker.safetensors"
    save_file(state, str(unmarked))
    with pytest.raises(WanVACEModelFolderError, match=r"fp8_no_marker.*no 'scaled_fp8' marker"):
        inspect_expert_files(_with(good_files, high_noise_model=unmarked))


def test_unknown_gguf_quantisation_is_refused(tmp_path, good_files):
    import gguf

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), arch="wan")
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    raw = torch.zeros(4, 256 // block_size * type_size, dtype=torch.uint8).numpy()
    writer.add_tensor(
        "blocks.0.self_attn.q.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WanVACEModelFolderError, match=r"iq\.gguf.*IQ2_XXS.*Q8_0"):
        inspect_expert_files(_with(good_files, high_noise_model=path))


def test_wrong_text_encoder_width_and_wan22_vae_are_refused(tmp_path, components, good_files):
    from wanvace_core.load.tiny import build_tiny_components

    narrow = build_tiny_components(TinyModelSpec(text_dim=32))["text_encoder"]
    path = write_umt5(tmp_path / "narrow.safetensors", narrow, sentencepiece_model_bytes())
    with pytest.raises(WanVACEModelFolderError, match="32-wide embeddings, the experts take 4096"):
        inspect_expert_files(_with(good_files, text_encoder=path))
    state = dict(_read(good_files.vae))
    state["decoder.upsamples.0.upsamples.0.residual.2.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "wan2.2_vae.safetensors"))
    with pytest.raises(WanVACEModelFolderError, match=r"Wan2\.2 VAE of the 5B model"):
        inspect_expert_files(_with(good_files, vae=tmp_path / "wan2.2_vae.safetensors"))
