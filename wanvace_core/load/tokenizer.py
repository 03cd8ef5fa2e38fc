"""T5 tokenizers built from a sentencepiece model, offline, identically under transformers 4 and 5.

ComfyUI's umt5 files carry their sentencepiece model as a `spiece_model` uint8 tensor; the tiny
model trains one. Either way the tokenizer is written as a folder (`spiece.model`, `tokenizer.json`,
`tokenizer_config.json`) and read back with `T5TokenizerFast.from_pretrained`, the path a real
pipeline folder's tokenizer takes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..errors import WanVACEModelFolderError


def write_t5_tokenizer(folder: str | Path, model_bytes: bytes, source: str = "the sentencepiece model") -> Path:
    """Writes a T5 tokenizer folder for the sentencepiece `model_bytes` and returns it.

    The `tokenizer.json` is built here with the pipeline transformers 5's `T5Tokenizer` rebuilds from any
    tokenizer.json (the file's charsmap normalizer and vocabulary, WhitespaceSplit + Metaspace "always",
    `$A </s>`), so transformers 4's `T5TokenizerFast`, which uses the file as it is, and transformers 5
    tokenize identically. Neither version can build a T5 tokenizer from a vocabulary list alone in the same way:
    4.x wants a `.model` file, and converts one with another pre-tokenizer (Metaspace "never") than 5.x.
    """
    from google.protobuf.message import DecodeError
    from sentencepiece import SentencePieceProcessor, sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(model_bytes)
        processor = SentencePieceProcessor(model_proto=model_bytes)
    except (DecodeError, RuntimeError) as error:
        raise WanVACEModelFolderError(
            f"{source} is not a valid sentencepiece model ({error}); re-download the text encoder file."
        ) from error
    specials = {
        "pad_token": processor.id_to_piece(processor.pad_id()) if processor.pad_id() >= 0 else None,
        "eos_token": processor.id_to_piece(processor.eos_id()) if processor.eos_id() >= 0 else None,
        "unk_token": processor.id_to_piece(processor.unk_id()) if processor.unk_id() >= 0 else None,
    }
    if None in specials.values():
        raise WanVACEModelFolderError(
            f"{source} lacks a pad, end-of-sequence or unknown piece, which a T5 tokenizer needs; it is not a "
            "T5/umt5 tokenizer."
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spiece.model").write_bytes(model_bytes)
    vocab = [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]
    byte_fallback = bool(proto.trainer_spec.byte_fallback)
    backend = Tokenizer(Unigram(vocab, unk_id=processor.unk_id(), byte_fallback=byte_fallback))
    if proto.normalizer_spec.precompiled_charsmap:
        backend.normalizer = normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
        ]
    )
    metaspace = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), metaspace]) if byte_fallback else metaspace
    eos = specials["eos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, processor.eos_id())]
    )
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in specials.values()])
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "T5Tokenizer",
        "extra_ids": 0,
        "additional_special_tokens": [],
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def t5_tokenizer_from_sentencepiece(model_bytes: bytes, source: str = "the sentencepiece model"):
    """A `T5TokenizerFast` for the sentencepiece `model_bytes`, read as a saved folder would be."""
    from transformers import T5TokenizerFast

    with tempfile.TemporaryDirectory() as folder:
        return T5TokenizerFast.from_pretrained(write_t5_tokenizer(folder, model_bytes, source))
