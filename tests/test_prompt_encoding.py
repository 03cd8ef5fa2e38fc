"""Prompt encoding: the tiny tokenizer tokenizes alike in every set, and diffusers' public
`WanVACEPipeline.encode_prompt` gives bitwise the numbers `WanVACEModel.encode_prompt` uses."""

from __future__ import annotations

import json

import pytest
import torch
from sentencepiece import SentencePieceProcessor
from transformers import T5TokenizerFast

from tests.support.vace_tasks import NEGATIVE, PROMPT
from wanvace_core.load.tiny import write_tokenizer_files

TEXTS = (
    PROMPT,
    NEGATIVE,
    "",
    "  A cat\twalks\n\non the GRASS ,  zebra Ünïcödé &amp; ﬁ ①  ",
    "the camera pans across a city at night " * 80,  # over 512 tokens: truncated
)
# What sentencepiece itself gives PROMPT with the tiny model: a fact of the trained model, not of any
# transformers version, so both sets must produce exactly these ids.
PROMPT_IDS = [6, 58, 23, 10, 16, 32, 65, 53, 33, 3, 8, 4, 13, 78, 3, 46, 13, 39, 55, 14, 1]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("tokenizer"))


def test_tiny_tokenizer_tokenizes_like_sentencepiece(tokenizer_folder, tiny_folder, loaded_models):
    processor = SentencePieceProcessor(model_file=str(tokenizer_folder / "spiece.model"))
    written = T5TokenizerFast.from_pretrained(tokenizer_folder)
    in_pipeline = T5TokenizerFast.from_pretrained(tiny_folder / "tokenizer")
    loaded = loaded_models("fp32").tokenizer
    # The pipeline folder holds exactly these files under every transformers version, named as a fast T5 tokenizer.
    written_files = {path.name: path.read_bytes() for path in tokenizer_folder.iterdir()}
    assert {path.name: path.read_bytes() for path in (tiny_folder / "tokenizer").iterdir()} == written_files
    assert sorted(written_files) == ["spiece.model", "tokenizer.json", "tokenizer_config.json"]
    index = json.loads((tiny_folder / "model_index.json").read_text())
    assert index["tokenizer"] == ["transformers", "T5TokenizerFast"]
    for tokenizer in (written, in_pipeline, loaded):
        assert len(tokenizer) == processor.get_piece_size()
        assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
        assert tokenizer(PROMPT).input_ids == PROMPT_IDS
        for text in TEXTS:
            assert tokenizer(text).input_ids == [*processor.encode(text), 1], text
        batch = tokenizer(
            list(TEXTS),
            padding="max_length",
            max_length=512,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        for row, mask, text in zip(batch.input_ids, batch.attention_mask, TEXTS, strict=True):
            ids = [*processor.encode(text)[:511], 1]  # truncation keeps the closing </s>
            assert row.tolist() == ids + [0] * (512 - len(ids)), text
            assert mask.tolist() == [1] * len(ids) + [0] * (512 - len(ids)), text


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@torch.no_grad()  # as in WanVACEPipeline.__call__
def test_public_encode_prompt_is_bitwise_our_prompt_embeddings(dtype, loaded_models):
    model = loaded_models(dtype)
    helper = model.helper
    for text in (*TEXTS, "a bird flies over the sea at sunset, &lt;b&gt;   <pad> </s>"):
        ours = model.encode_prompt(text)
        public, negative = helper.encode_prompt(
            prompt=text,
            negative_prompt=None,
            do_classifier_free_guidance=False,
            max_sequence_length=model.max_sequence_length,
            device=model.device,
        )
        assert negative is None
        private = helper._get_t5_prompt_embeds(
            prompt=text, max_sequence_length=model.max_sequence_length, device=model.device
        )
        assert public.dtype == private.dtype == model.text_encoder.dtype
        assert public.shape == (1, model.max_sequence_length, model.text_encoder.config.d_model)
        assert torch.equal(public, private), text
        assert ours.dtype == model.transformer_dtype
        assert torch.equal(public.to(model.transformer_dtype), ours), text


@torch.no_grad()
def test_public_encode_prompt_with_guidance_gives_the_negative_we_use(loaded_models):
    model = loaded_models("bf16")
    helper = model.helper
    kwargs = {"max_sequence_length": model.max_sequence_length, "device": model.device}
    positive, negative = helper.encode_prompt(PROMPT, NEGATIVE, do_classifier_free_guidance=True, **kwargs)
    assert torch.equal(positive.to(model.transformer_dtype), model.encode_prompt(PROMPT))
    assert torch.equal(negative.to(model.transformer_dtype), model.encode_prompt(NEGATIVE))
    # The pipeline's default negative (None) is the empty prompt.
    _, default_negative = helper.encode_prompt(PROMPT, None, do_classifier_free_guidance=True, **kwargs)
    assert torch.equal(default_negative.to(model.transformer_dtype), model.encode_prompt(""))
