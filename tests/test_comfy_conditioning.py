"""ComfyUI's own Wan text encoder (CLIPLoader type wan + CLIPTextEncode) against ours.

ComfyUI's classes run in a subprocess inside its tree (importing `comfy` needs it; this module is that
subprocess's script) on the tiny COMFY_SHAPED model's text encoder, written as a ComfyUI umt5 file by
tests/support/single_files.py (HF T5 names, the sentencepiece model as a `spiece_model` tensor). COMFY_SHAPED
and not the default tiny spec: ComfyUI's T5 attention hard-codes 32 relative-attention buckets and max
distance 128 (comfy/text_encoders/t5.py), which the default spec's encoder (8 buckets, distance 32) does
not have, and Wan's umt5 is 4096 wide. Both sides run in fp32 on the same weights.

Measured on CPU (max |ComfyUI - ours| of the prompt embeddings, values up to ~4.6): 2.2e-6 with ComfyUI
0.33 / torch 2.11, 1.2e-6 with ComfyUI 0.3.75 / torch 2.8. The difference is the activation: ComfyUI
computes umt5's gated GELU with torch's tanh GELU, transformers with its own `gelu_new` formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts.comfy_server import DEFAULT_COMFY_DIR
from tests.support.comfyui import COMFY_SKIPPED
from tests.support.single_files import comfy_components, write_umt5
from tests.support.vace_tasks import HEIGHT, LENGTH, WIDTH
from wanvace_core import SamplerSettings, VACEInputs, WanVACEInputError, load_pipeline, prepare_conditioning, sample
from wanvace_core.generation.conditioning import (
    TextEmbeddings,
    prompt_embeds_from_text_embeddings,
    validate_text_embeddings,
)
from wanvace_core.load.tiny import COMFY_SHAPED, sentencepiece_model_bytes, write_tiny_pipeline

REPO = Path(__file__).resolve().parents[1]
TEXT_DIM = COMFY_SHAPED.text_dim
# Prompts whose text diffusers' prompt_clean leaves alone (up to whitespace, which both tokenizers collapse).
PROMPTS = (
    "a cat walks on the grass in the morning light",
    "a  bird flies over the sea,   at sunset!  the camera follows it.",
    "  low quality, blurry; static - overexposed: worst quality?  ",
    "the camera pans\nacross a city\tat night, with neon signs...",
    "OCEAN waves crash against black rocks under a grey sky",
    "",
)
# Where the two differ on purpose: diffusers unescapes HTML entities (prompt_clean) before tokenizing,
# ComfyUI reads "(word)" as a 1.1 weight on that word.
HTML_PROMPT = "fish &amp; chips on the sea"
WEIGHTED_PROMPT = "a (red) balloon"
EMBEDDING_ATOL = 1e-5
# The sampler on embeddings that differ by ~2e-6 (4 steps, CFG 5, fp32): measured max |latent diff| 3.7e-6
# (0.33; latents up to 4.0) and 3.8e-6 (0.3.75; up to 4.4).
LATENT_ATOL = 1e-4


# --- the ComfyUI side (runs in the subprocess) -------------------------------------------------------------


def _encode_with_comfyui(umt5_file: str, out_file: str, prompts: list[str]) -> None:
    """Loads `umt5_file` as CLIPLoader(type wan) does and encodes each prompt with CLIPTextEncode."""
    sys.path.insert(0, os.getcwd())  # the ComfyUI tree, ahead of this repository's own `nodes` package
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.sd
    import comfy.text_encoders.sd3_clip
    import comfy.text_encoders.wan
    import comfy.utils

    import nodes

    state = comfy.utils.load_torch_file(umt5_file, safe_load=True)

    # What comfy.sd.load_text_encoder_state_dicts builds for CLIPType.WAN. Its detection recognises only the
    # 24-block UMT5-XXL, so the tiny file's sizes go in through the per-encoder config override ComfyUI reads
    # ("<name>_model_config", sd1_clip.SDClipModel); everything else is ComfyUI's.
    target = SimpleNamespace(
        params={},
        clip=comfy.text_encoders.wan.te(**comfy.text_encoders.sd3_clip.t5_xxl_detect(state)),
        tokenizer=comfy.text_encoders.wan.WanT5Tokenizer,
    )

    heads = state["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
    sizes = {
        "vocab_size": state["shared.weight"].shape[0],
        "d_model": state["shared.weight"].shape[1],
        "num_layers": len({key.split(".")[2] for key in state if key.startswith("encoder.block.")}),
        "num_heads": heads,
        "d_kv": state["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // heads,
        "d_ff": state["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
    }
    tokenizer_data = {"spiece_model": state.pop("spiece_model")}
    clip = comfy.sd.CLIP(
        target,
        tokenizer_data=tokenizer_data,
        parameters=comfy.utils.calculate_parameters(state),
        model_options={"umt5xxl_model_config": sizes},
    )
    missing, unexpected = clip.load_sd(state)
    if missing or unexpected:
        raise RuntimeError(f"ComfyUI's umt5 did not take the file: missing {missing}, unexpected {unexpected}")
    results = []
    for prompt in prompts:
        tokens = clip.tokenize(prompt)["umt5xxl"]
        (conditioning,) = nodes.CLIPTextEncode().encode(clip, prompt)
        results.append(
            {
                "ids": torch.tensor([[token for token, _weight in batch] for batch in tokens]),
                "weights": torch.tensor([[weight for _token, weight in batch] for batch in tokens]),
                "conditioning": conditioning,  # CLIPTextEncode's output as it is
            }
        )
    torch.save(results, out_file)


# --- the pytest side -------------------------------------------------------------------------------------


def comfy_encode(umt5_file: Path, prompts, out_file: Path, comfy_dir: Path = DEFAULT_COMFY_DIR) -> list[dict]:
    """Runs ComfyUI's Wan text encoder on `umt5_file` in a subprocess; per prompt, `ids` / `weights` (ComfyUI's
    token batches) and `conditioning` (CLIPTextEncode's CONDITIONING)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(Path(__file__).resolve()), str(umt5_file), str(out_file), json.dumps(prompts)]
    done = subprocess.run(command, cwd=comfy_dir, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"ComfyUI's text encoder failed ({done.returncode}):\n{done.stderr[-4000:]}")
    # Tensors, lists, dicts and None only: what ComfyUI's LoadTrainingDataset also reads with weights_only.
    return torch.load(out_file, weights_only=True)


def write_comfy_shaped_pipeline(folder: Path) -> tuple[Path, dict]:
    """The COMFY_SHAPED tiny pipeline folder, and its components (built again from the same seed) for the
    single files ComfyUI loads."""
    write_tiny_pipeline(folder, COMFY_SHAPED)
    return folder, comfy_components(COMFY_SHAPED)


@pytest.fixture(scope="module")
def comfy_shaped(comfy_shaped_folder, comfy_components_default, tmp_path_factory):
    """The session's COMFY_SHAPED folder (our side) and its text encoder as an fp32 ComfyUI umt5 file."""
    umt5 = write_umt5(
        tmp_path_factory.mktemp("comfy-umt5") / "umt5_xxl_fp32.safetensors",
        comfy_components_default["text_encoder"],
        sentencepiece_model_bytes(),
        dtype=torch.float32,
    )
    return {"model": load_pipeline(comfy_shaped_folder, "fp32"), "umt5": umt5}


@pytest.fixture(scope="module")
def comfy_results(comfy_shaped, tmp_path_factory):
    if COMFY_SKIPPED or not (DEFAULT_COMFY_DIR / "comfy").is_dir():
        pytest.skip(f"SKIPPED: no ComfyUI tree for this dependency set ({COMFY_SKIPPED or DEFAULT_COMFY_DIR})")
    prompts = [*PROMPTS, HTML_PROMPT, WEIGHTED_PROMPT]
    encoded = comfy_encode(comfy_shaped["umt5"], prompts, tmp_path_factory.mktemp("comfy") / "encoded.pt")
    return dict(zip(prompts, encoded, strict=True))


def _embeds(result: dict) -> TextEmbeddings:
    ((hidden, extras),) = result["conditioning"]
    assert extras == {"pooled_output": None}  # no attention_mask: the padded rows are zeroed instead
    return TextEmbeddings(hidden)


def _real_token_count(ids: torch.Tensor) -> int:
    """Tokens up to and including the end token (1); ComfyUI pads with 0 after it."""
    return int((ids[0] == 1).nonzero()[0]) + 1


@pytest.mark.parametrize("prompt", PROMPTS)
def test_comfyui_tokenizes_like_our_tokenizer(prompt, comfy_results, comfy_shaped):
    result, tokenizer = comfy_results[prompt], comfy_shaped["model"].tokenizer
    ids = result["ids"]
    assert ids.shape == (1, 512)  # one batch, padded to min_length 512 (comfy/text_encoders/wan.py)
    count = _real_token_count(ids)
    assert torch.all(ids[0, count:] == 0) and torch.all(result["weights"] == 1.0)
    assert ids[0, :count].tolist() == tokenizer(prompt)["input_ids"]


def test_where_comfyui_and_diffusers_read_a_prompt_differently(comfy_results, comfy_shaped):
    from diffusers.pipelines.wan.pipeline_wan_vace import prompt_clean

    tokenizer = comfy_shaped["model"].tokenizer
    html = comfy_results[HTML_PROMPT]["ids"]
    # ComfyUI tokenizes the text as written; the pipeline encodes prompt_clean(text) ("&amp;" -> "&").
    assert html[0, : _real_token_count(html)].tolist() == tokenizer(HTML_PROMPT)["input_ids"]
    assert tokenizer(prompt_clean(HTML_PROMPT))["input_ids"] != tokenizer(HTML_PROMPT)["input_ids"]
    weighted = comfy_results[WEIGHTED_PROMPT]
    count = _real_token_count(weighted["ids"])
    # ComfyUI drops the brackets and weights "red" 1.1; diffusers would encode the brackets as text.
    assert weighted["ids"][0, :count].tolist() == tokenizer("a red balloon")["input_ids"]
    assert sorted(set(weighted["weights"][0, :count].tolist())) == [1.0, pytest.approx(1.1)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_comfyui_embeddings_convert_to_our_prompt_embeddings(prompt, comfy_results, comfy_shaped):
    model = comfy_shaped["model"]
    result = comfy_results[prompt]
    ((hidden, _extras),) = result["conditioning"]
    count = _real_token_count(result["ids"])
    # ComfyUI's CONDITIONING: [1, 512, 4096] fp32, every row after the end token zero (sd1_clip zero_out_masked).
    assert hidden.shape == (1, 512, TEXT_DIM) and hidden.dtype == torch.float32
    assert torch.all(hidden[0, count:] == 0) and bool(hidden[0, count - 1].ne(0).any())
    converted = prompt_embeds_from_text_embeddings(
        "positive_conditioning", _embeds(result), TEXT_DIM, dtype=model.transformer_dtype, device=model.device
    )
    ours = model.encode_prompt(prompt)
    assert converted.shape == ours.shape == (1, 512, TEXT_DIM) and converted.dtype == ours.dtype
    assert torch.all(converted[0, count:] == 0) and torch.all(ours[0, count:] == 0)
    assert (converted - ours).abs().max() <= EMBEDDING_ATOL


def _settings() -> SamplerSettings:
    return SamplerSettings(seed=3, steps=4, cfg=5.0, cfg_low_noise=5.0)


def _latents(model, **inputs) -> torch.Tensor:
    values = {"positive": "", "negative": "", "width": WIDTH, "height": HEIGHT, "length": LENGTH, **inputs}
    return sample(model, prepare_conditioning(model, VACEInputs(**values)), _settings()).latents


def test_comfyui_conditioning_samples_the_text_path_video(comfy_results, comfy_shaped):
    model = comfy_shaped["model"]
    positive, negative = PROMPTS[1], PROMPTS[2]
    text_path = _latents(model, positive=positive, negative=negative)
    from_comfy = _latents(
        model,
        positive_embeds=_embeds(comfy_results[positive]),
        negative_embeds=_embeds(comfy_results[negative]),
    )
    assert from_comfy.shape == text_path.shape
    assert (from_comfy - text_path).abs().max() <= LATENT_ATOL
    assert not torch.equal(_latents(model, positive=PROMPTS[0], negative=negative), text_path)  # prompts matter


def _variants(embeds: torch.Tensor, count: int) -> dict[str, TextEmbeddings]:
    """Our own prompt embeddings in the layouts an encoded prompt can arrive in."""
    junk = torch.randn(1, 600 - count, embeds.shape[-1])
    mask = torch.zeros(1, 600, dtype=torch.long)
    mask[0, :count] = 1
    return {
        "padded to 512": TextEmbeddings(embeds),
        "trimmed": TextEmbeddings(embeds[:, :count]),
        "zero-padded past 512": TextEmbeddings(torch.cat([embeds, embeds.new_zeros(1, 88, embeds.shape[-1])], 1)),
        "masked, junk after": TextEmbeddings(torch.cat([embeds[:, :count], junk], 1), mask),
        "1-d mask": TextEmbeddings(torch.cat([embeds[:, :count], junk], 1), mask[0]),
    }


def test_bitwise_equal_embeddings_give_bitwise_the_text_path(comfy_shaped):
    model = comfy_shaped["model"]
    positive, negative = PROMPTS[0], PROMPTS[2]
    tokens = len(model.tokenizer(positive)["input_ids"])
    ours, ours_negative = model.encode_prompt(positive), model.encode_prompt(negative)
    text_path = _latents(model, positive=positive, negative=negative)
    for name, embeds in _variants(ours, tokens).items():
        cond = prepare_conditioning(model, VACEInputs("", negative, WIDTH, HEIGHT, LENGTH, positive_embeds=embeds))
        assert torch.equal(cond.prompt_embeds, ours), name
        assert torch.equal(cond.negative_prompt_embeds, ours_negative), name
    negative_embeds = TextEmbeddings(ours_negative)
    latents = _latents(model, positive_embeds=TextEmbeddings(ours), negative_embeds=negative_embeds)
    assert torch.equal(latents, text_path)


def test_connected_conditioning_replaces_the_text_and_our_encoder_never_runs(comfy_shaped):
    model = comfy_shaped["model"]
    embeds = TextEmbeddings(model.encode_prompt(PROMPTS[0]))
    negative = TextEmbeddings(model.encode_prompt(PROMPTS[2]))
    runs = []
    handle = model.text_encoder.register_forward_pre_hook(lambda *_: runs.append(1))
    try:
        cond = prepare_conditioning(
            model,
            VACEInputs(
                "ignored text", "ignored too", WIDTH, HEIGHT, LENGTH, positive_embeds=embeds, negative_embeds=negative
            ),
        )
    finally:
        handle.remove()
    assert runs == []
    assert torch.equal(cond.prompt_embeds, embeds.hidden_states)
    assert torch.equal(cond.negative_prompt_embeds, negative.hidden_states)


def test_empty_positive_text_needs_positive_conditioning(comfy_shaped):
    model = comfy_shaped["model"]
    with pytest.raises(WanVACEInputError) as error:
        prepare_conditioning(model, VACEInputs("  ", "", WIDTH, HEIGHT, LENGTH))
    assert str(error.value) == (
        "positive prompt is empty and positive_conditioning is not connected; describe the video you want in "
        "positive, or connect a CLIPTextEncode output to positive_conditioning."
    )
    # The negative's conditioning does not stand in for the positive's.
    negative = TextEmbeddings(model.encode_prompt("blurry"))
    with pytest.raises(WanVACEInputError, match="positive prompt is empty"):
        prepare_conditioning(model, VACEInputs("", "", WIDTH, HEIGHT, LENGTH, negative_embeds=negative))


FIX = "load umt5_xxl with CLIPLoader type wan and encode the prompt with CLIPTextEncode"


@pytest.mark.parametrize(
    ("embeds", "text_dim", "message"),
    [
        (
            TextEmbeddings(torch.randn(1, 77, 768)),
            4096,
            f"positive_conditioning is 768 wide but this model needs 4096-wide umt5 embeddings; {FIX}.",
        ),
        (
            TextEmbeddings(torch.randn(1, 512, 4096)),
            32,
            f"positive_conditioning is 4096 wide but this model needs 32-wide umt5 embeddings; {FIX}.",
        ),
        (
            TextEmbeddings(torch.randn(2, 512, 4096)),
            4096,
            "positive_conditioning holds a batch of 2 prompts; WanVACE takes one prompt per input: encode one "
            "prompt with one CLIPTextEncode.",
        ),
        (
            TextEmbeddings(torch.randn(1, 600, 4096)),
            4096,
            "positive_conditioning holds 600 tokens but Wan reads at most 512 (diffusers cuts longer prompts); "
            "shorten the prompt.",
        ),
        (
            TextEmbeddings(torch.randn(512, 4096)),
            4096,
            "positive_conditioning holds (512, 4096), not text-encoder hidden states [1, tokens, width]; connect "
            "a CLIPTextEncode output.",
        ),
        (
            TextEmbeddings(torch.zeros(1, 512, 4096, dtype=torch.long)),
            4096,
            "positive_conditioning holds (1, 512, 4096), not text-encoder hidden states",
        ),
        (
            TextEmbeddings(torch.full((1, 512, 4096), float("nan"))),
            4096,
            f"positive_conditioning holds NaN or infinite values; encode the prompt again ({FIX}).",
        ),
        (
            TextEmbeddings(torch.randn(1, 512, 4096), torch.ones(1, 77)),
            4096,
            "positive_conditioning has an attention_mask of (1, 77) for 512 tokens; it must be [1, 512]",
        ),
    ],
    ids=["clip-l width", "wider than the model", "batch", "too long", "2-d", "integer", "nan", "mask length"],
)
def test_unusable_text_embeddings_are_refused_naming_the_input(embeds, text_dim, message):
    with pytest.raises(WanVACEInputError) as error:
        validate_text_embeddings("positive_conditioning", embeds, text_dim)
    assert str(error.value).startswith(message)


def test_refusals_come_before_any_encoding(comfy_shaped):
    model = comfy_shaped["model"]
    runs = []
    handles = [
        module.register_forward_pre_hook(lambda *_: runs.append(1)) for module in (model.text_encoder, model.vae)
    ]
    try:
        with pytest.raises(WanVACEInputError, match="negative_conditioning is 768 wide but this model needs 4096"):
            prepare_conditioning(
                model,
                VACEInputs("a cat", "", WIDTH, HEIGHT, LENGTH, negative_embeds=TextEmbeddings(torch.randn(1, 77, 768))),
            )
    finally:
        for handle in handles:
            handle.remove()
    assert runs == []


def test_a_zeroed_conditioning_is_all_zero_prompt_embeddings():
    # ConditioningZeroOut's output: no real row, so diffusers' layout is 512 zero rows too.
    embeds = prompt_embeds_from_text_embeddings("negative_conditioning", TextEmbeddings(torch.zeros(1, 512, 64)), 64)
    assert embeds.shape == (1, 512, 64) and not embeds.any()


if __name__ == "__main__":
    _encode_with_comfyui(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
