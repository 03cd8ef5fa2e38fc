"""Writes small random-weight Wan VACE pipelines in the real diffusers on-disk layout.

Tests and the demo use these folders; the loader reads them through the same code path as the
real Wan2.2-VACE-Fun-A14B weights. Everything is built offline: the tokenizer is a sentencepiece
unigram model trained on a few sentences.
"""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .tokenizer import t5_tokenizer_from_sentencepiece, write_t5_tokenizer

_TOKENIZER_CORPUS = (
    "a cat walks on the grass in the morning light",
    "a bird flies over the sea at sunset, the camera follows it",
    "low quality, blurry, static, overexposed, worst quality",
    "the camera pans across a city at night with neon signs",
    "a person dances in a red dress, close-up, smooth motion",
    "ocean waves crash against black rocks under a grey sky",
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of a tiny pipeline. Defaults keep a 17-frame 64x64 run under a second per step on CPU."""

    two_experts: bool = True
    num_layers: int = 4
    vace_layers: tuple[int, ...] = (0, 2)
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    ffn_dim: int = 64
    text_dim: int = 32
    text_layers: int = 2
    text_max_distance: int = 32
    text_buckets: int = 8
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 1, 1, 1)
    vae_num_res_blocks: int = 1
    boundary_ratio: float = 0.875
    flow_shift: float = 3.0
    seed: int = 0
    extra_model_index: dict = field(default_factory=dict)


# Shaped as ComfyUI infers a Wan model from its keys (head dim 128, text dim 4096, a 2.1 VAE with
# dim_mult [1, 2, 4, 4] and 2 residual blocks, umt5's 32 relative-attention buckets and distance 128),
# so ComfyUI's own loaders accept the single files written from it.
COMFY_SHAPED = TinyModelSpec(
    attention_head_dim=128,
    text_dim=4096,
    text_max_distance=128,
    text_buckets=32,
    vae_dim_mult=(1, 2, 4, 4),
    vae_num_res_blocks=2,
)


def sentencepiece_model_bytes() -> bytes:
    """A tiny sentencepiece unigram model (the bytes of its `.model` file), the same on every run."""
    import sentencepiece as spm

    model_bytes = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TOKENIZER_CORPUS * 10),
        model_writer=model_bytes,
        vocab_size=96,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    return model_bytes.getvalue()


def write_tokenizer_files(folder: str | Path) -> Path:
    """Writes the tiny model's T5 tokenizer folder (`spiece.model`, `tokenizer.json`, `tokenizer_config.json`)."""
    return write_t5_tokenizer(folder, sentencepiece_model_bytes())


def _build_tokenizer():
    return t5_tokenizer_from_sentencepiece(sentencepiece_model_bytes())


def build_tiny_components(spec: TinyModelSpec = TinyModelSpec()) -> dict:
    """Builds the pipeline components in memory with the real diffusers/transformers classes."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanVACETransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _build_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=spec.text_dim,
                d_kv=16,
                d_ff=64,
                num_layers=spec.text_layers,
                num_heads=2,
                relative_attention_num_buckets=spec.text_buckets,
                relative_attention_max_distance=spec.text_max_distance,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id,
            )
        ).eval()
        vae = AutoencoderKLWan(
            base_dim=spec.vae_base_dim,
            z_dim=16,
            dim_mult=list(spec.vae_dim_mult),
            num_res_blocks=spec.vae_num_res_blocks,
            temperal_downsample=[False, True, True],
        ).eval()

        def make_transformer():
            transformer = WanVACETransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=spec.num_attention_heads,
                attention_head_dim=spec.attention_head_dim,
                in_channels=16,
                out_channels=16,
                text_dim=spec.text_dim,
                freq_dim=256,
                ffn_dim=spec.ffn_dim,
                num_layers=spec.num_layers,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32,
                vace_layers=list(spec.vace_layers),
                vace_in_channels=96,
            ).eval()
            # Zero-initialised projections would hide a lost VACE hint; give every tensor signal.
            with torch.no_grad():
                for param in transformer.parameters():
                    if param.abs().max() == 0:
                        param.normal_(0.0, 0.05)
            return transformer

        transformer = make_transformer()
        transformer_2 = make_transformer() if spec.two_experts else None
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=spec.flow_shift,
    )
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": scheduler,
        "transformer": transformer,
        "transformer_2": transformer_2,
        "boundary_ratio": spec.boundary_ratio if spec.two_experts else None,
    }


def write_tiny_pipeline(folder: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Writes a tiny `WanVACEPipeline` folder (safetensors only) and returns its path."""
    from diffusers import WanVACEPipeline

    folder = Path(folder)
    pipeline = WanVACEPipeline(**build_tiny_components(spec))
    pipeline.save_pretrained(folder, safe_serialization=True)
    # The tokenizer folder as the real Wan repositories ship it (spiece.model, tokenizer.json, class
    # T5TokenizerFast), the same bytes under transformers 4 and 5. transformers 5's own save would write no
    # spiece.model, a tokenizer_config.json transformers 4 cannot read, and class T5Tokenizer, which is
    # the sentencepiece tokenizer (another pre-tokenization) in transformers 4.
    shutil.rmtree(folder / "tokenizer")
    write_tokenizer_files(folder / "tokenizer")
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    index.update(spec.extra_model_index)
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random-weight WanVACE pipeline folder.")
    parser.add_argument("folder", help="Destination folder, e.g. ComfyUI/models/diffusers/wanvace-tiny")
    parser.add_argument("--single-expert", action="store_true", help="Write a Wan2.1-style one-transformer folder")
    args = parser.parse_args()
    path = write_tiny_pipeline(args.folder, TinyModelSpec(two_experts=not args.single_expert))
    print(path)


if __name__ == "__main__":
    main()
