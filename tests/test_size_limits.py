"""The largest video a model runs (`generation/limits.py`), against diffusers' own RoPE as the oracle, and refused
before anything slow: before the text encoder and the VAE (`prepare_conditioning`), before the first step (`sample`),
and by the offline command before it loads the model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from wanvace_core import ContextWindowOptions, SamplerSettings, VACEInputs, WanVACEInputError, generate
from wanvace_core.generation.limits import (
    SizeLimits,
    check_frames,
    check_size,
    latent_frames,
    size_limits_of,
    size_limits_of_folder,
)

TINY = SizeLimits(rope_max_seq_len=32)  # the tiny test model's transformer: rope_max_seq_len 32, patch (1, 2, 2)


def _diffusers_rope_runs(limits: SizeLimits, width: int, height: int, latent: int) -> bool:
    """Whether diffusers' WanRotaryPosEmbed (what the experts call first) takes a latent of this size."""
    rope = WanRotaryPosEmbed(16, limits.patch_size, limits.rope_max_seq_len)
    hidden = torch.zeros(1, 1, latent, height // limits.vae_spatial, width // limits.vae_spatial)
    try:
        rope(hidden)
    except RuntimeError:
        return False
    return True


def _accepted(limits: SizeLimits, width: int, height: int, length: int, references: int = 0, windows=None) -> bool:
    try:
        check_size(limits, width, height, length, references, windows)
    except WanVACEInputError:
        return False
    return True


@pytest.mark.parametrize("rope", [32, 16])
def test_the_rule_accepts_exactly_what_diffusers_rope_runs(rope):
    limits = SizeLimits(rope_max_seq_len=rope)
    side = limits.max_width
    for width, height in [(side, 64), (side + 16, 64), (64, side), (64, side + 16), (side, side), (832, 480)]:
        assert _accepted(limits, width, height, 9) == _diffusers_rope_runs(limits, width, height, 3), (width, height)
    for length in (limits.max_frames() - 4, limits.max_frames(), limits.max_frames() + 4, limits.max_frames() + 40):
        expected = _diffusers_rope_runs(limits, 64, 48, latent_frames(length))
        assert _accepted(limits, 64, 48, length) == expected, length
    # Reference frames sit in front of the video in the same call.
    for references in (1, 3):
        length = limits.max_frames(references)
        assert _accepted(limits, 64, 48, length, references)
        assert _diffusers_rope_runs(limits, 64, 48, references + latent_frames(length))
        assert not _accepted(limits, 64, 48, length + 4, references)
        assert not _diffusers_rope_runs(limits, 64, 48, references + latent_frames(length + 4))


def test_the_tiny_models_limits_are_512_px_and_125_frames():
    assert (TINY.max_width, TINY.max_height, TINY.max_frames()) == (512, 512, 125)


def test_a_refusal_names_the_input_the_limit_and_the_largest_size_that_works():
    with pytest.raises(WanVACEInputError) as error:
        check_size(TINY, 832, 480, 81)
    assert str(error.value).startswith("width=832 is more than this model can run: its rope_max_seq_len 32")
    assert "at most 512; use 512 or less." in str(error.value)
    with pytest.raises(WanVACEInputError, match=r"^height=528 .* at most 512"):
        check_size(TINY, 512, 528, 9)
    with pytest.raises(WanVACEInputError) as error:
        check_frames(TINY, 161)
    message = str(error.value)
    assert message.startswith("length=161 gives 41 latent frames per transformer call")
    assert "use length 125 or less, or connect WanVACE Context Windows with context_length 125 or less" in message


def test_with_windows_one_window_counts_and_the_refusal_names_context_length():
    check_frames(TINY, 241, 0, ContextWindowOptions(context_length=81, context_overlap=16))  # 21 latent per window
    with pytest.raises(WanVACEInputError) as error:
        check_frames(TINY, 241, 0, ContextWindowOptions(context_length=161, context_overlap=16))
    assert str(error.value).startswith("context_length=161 gives 41 latent frames per window")
    assert "use context_length 125 or less" in str(error.value)
    with pytest.raises(WanVACEInputError, match=r"plus 2 reference frame\(s\).* use context_length 117 or less beside"):
        check_frames(TINY, 241, 2, ContextWindowOptions(context_length=125, context_overlap=16))


def test_the_limits_are_read_from_the_folders_config_files_and_equal_the_loaded_models(tiny_folder, loaded_models):
    assert size_limits_of_folder(tiny_folder) == TINY
    assert size_limits_of(loaded_models("fp32")) == TINY
    real = json.loads((tiny_folder / "transformer" / "config.json").read_text())
    assert real["rope_max_seq_len"] == 32, "the oracle above tests the tiny model's own table size"


def test_prepare_conditioning_refuses_a_too_wide_video_before_the_text_encoder_runs(loaded_models, monkeypatch):
    from wanvace_core import prepare_conditioning

    model = loaded_models("fp32")
    encoded = []
    monkeypatch.setattr(type(model), "encode_prompt", lambda self, text: encoded.append(text))
    monkeypatch.setattr(type(model), "activate", lambda self, name: encoded.append(name))
    with pytest.raises(WanVACEInputError, match=r"^width=832 .* at most 512"):
        prepare_conditioning(model, VACEInputs("a cat", "", 832, 480, 9))
    assert encoded == [], "nothing may be encoded before the size is checked"


def test_sample_refuses_too_many_frames_per_call_before_the_first_step(loaded_models, monkeypatch):
    from wanvace_core import prepare_conditioning, sample

    model = loaded_models("fp32")
    cond = prepare_conditioning(model, VACEInputs("a cat", "", 64, 48, 9))
    long = dataclasses.replace(cond, length=161)
    calls = []
    monkeypatch.setattr(model.transformer, "forward", lambda *args, **kwargs: calls.append(1))
    settings = SamplerSettings(seed=0, steps=2, cfg=1.0, cfg_low_noise=1.0)
    with pytest.raises(WanVACEInputError, match=r"^length=161 gives 41 latent frames"):
        sample(model, long, settings)
    with pytest.raises(WanVACEInputError, match=r"^context_length=161 gives 41 latent frames per window"):
        sample(model, long, settings, windows=ContextWindowOptions(context_length=161, context_overlap=16))
    assert calls == []


def test_the_offline_command_refuses_the_shipped_size_on_the_tiny_model_before_loading(
    tiny_folder, tmp_path, capsys, monkeypatch
):
    flags = ["--model", str(tiny_folder), "--prompt", "a cat", "--output", str(tmp_path / "o.mp4")]
    loaded = []
    monkeypatch.setattr(generate, "load_pipeline", lambda *args, **kwargs: loaded.append(args))
    assert generate.main([*flags, "--width", "832", "--height", "480", "--num-frames", "81"]) == 2
    assert generate.main([*flags, "--width", "64", "--height", "48", "--num-frames", "161"]) == 2
    windows = ["--context-length", "161", "--context-overlap", "16"]
    assert generate.main([*flags, "--width", "64", "--height", "48", "--num-frames", "241", *windows]) == 2
    assert loaded == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: --width=832 is more than this model can run: its rope_max_seq_len 32 holds 32 patches of 16 px per "
        "side, so --width can be at most 512; use 512 or less.",
        "error: --num-frames=161 gives 41 latent frames per transformer call, more than this model runs (its "
        "rope_max_seq_len 32 holds 32); use --num-frames 125 or less, or add --context-length 125 or less.",
        "error: --context-length=161 gives 41 latent frames per window, more than this model runs per call (its "
        "rope_max_seq_len 32 holds 32); use --context-length 125 or less.",
    ]
