"""Conditioning semantics, input validation and the denoising loop's contract with the nodes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import SamplerSettings, VACEInputs, WanVACEInputError, prepare_conditioning, sample
from wanvace_core.generation.conditioning import full_length_video_and_mask


def sample_latents(*args, **kwargs) -> torch.Tensor:
    return sample(*args, **kwargs).latents


def _inputs(**overrides) -> VACEInputs:
    values = {"positive": PROMPT, "negative": NEGATIVE, "width": WIDTH, "height": HEIGHT, "length": LENGTH}
    values.update(overrides)
    return VACEInputs(**values)


def _settings(**overrides) -> SamplerSettings:
    values = {"seed": 5, "steps": 4, "cfg": 5.0, "cfg_low_noise": 5.0}
    values.update(overrides)
    return SamplerSettings(**values)


class _Cancelled(Exception):
    pass


def test_compact_i2v_inputs_expand_to_grey_padded_video_and_generate_mask():
    first = torch.rand(1, HEIGHT, WIDTH, 3)
    video, mask = full_length_video_and_mask(_inputs(control_video=first, control_masks=torch.zeros(1, HEIGHT, WIDTH)))
    assert video.shape == (LENGTH, HEIGHT, WIDTH, 3) and mask.shape == (LENGTH, HEIGHT, WIDTH)
    assert torch.equal(video[0], first[0])
    assert torch.all(video[1:] == 0.5)
    assert torch.all(mask[0] == 0) and torch.all(mask[1:] == 1)


def test_single_mask_applies_to_every_given_frame_only():
    given = torch.rand(3, HEIGHT, WIDTH, 3)
    single = torch.zeros(HEIGHT, WIDTH)
    single[:10] = 1.0
    _, mask = full_length_video_and_mask(_inputs(control_video=given, control_masks=single))
    assert all(torch.equal(mask[index], single) for index in range(3))
    assert torch.all(mask[3:] == 1)


def test_control_video_without_mask_is_a_control_signal_everywhere():
    given = torch.rand(LENGTH, HEIGHT, WIDTH, 3)
    video, mask = full_length_video_and_mask(_inputs(control_video=given))
    assert torch.equal(video, given) and torch.all(mask == 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"length": 10}, "length=10 frames is not of the form 4n+1"),
        ({"width": 70}, "width=70 is not a positive multiple of 16; use 64"),
        ({"height": 0}, "height=0"),
        ({"positive": "  "}, "positive prompt is empty"),
        ({"strength": -1.0}, "strength=-1.0"),
        ({"control_video": torch.rand(LENGTH + 4, HEIGHT, WIDTH, 3)}, "control_video has 13 frames but length=9"),
        ({"control_video": torch.rand(2, 32, 32, 3)}, "control_video is 32x32 but the video is 64x48"),
        ({"control_masks": torch.ones(2, 32, WIDTH)}, "control_masks is 64x32 but the video is 64x48"),
        (
            {"control_video": torch.rand(3, HEIGHT, WIDTH, 3), "control_masks": torch.ones(2, HEIGHT, WIDTH)},
            "control_masks has 2 frames but control_video has 3",
        ),
        ({"reference_images": torch.rand(HEIGHT, WIDTH, 3)}, "reference_images has shape"),
    ],
)
def test_bad_inputs_are_refused_before_any_encoding(overrides, message, loaded_models):
    model = loaded_models("fp32")
    calls = []
    handle = model.vae.register_forward_pre_hook(lambda *_: calls.append(1))
    encoder_handle = model.text_encoder.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(WanVACEInputError) as error:
            prepare_conditioning(model, _inputs(**overrides))
    finally:
        handle.remove()
        encoder_handle.remove()
    assert message in str(error.value)
    assert calls == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"steps": 0}, "steps=0"),
        ({"cfg": 0.5}, "cfg=0.5"),
        ({"boundary_ratio": 1.5}, "boundary_ratio=1.5"),
        ({"shift": -2.0}, "shift=-2.0"),
        ({"scheduler": "ddim"}, "scheduler='ddim'"),
    ],
)
def test_bad_sampler_settings_are_refused(overrides, message):
    with pytest.raises(WanVACEInputError, match=message.replace("(", r"\(")):
        _settings(**overrides)


def test_each_distinct_prompt_is_encoded_once(tiny_folder):
    from wanvace_core import load_pipeline

    model = load_pipeline(tiny_folder, "fp32")
    encoded = []
    handle = model.text_encoder.register_forward_pre_hook(lambda _module, args: encoded.append(args[0].shape[0]))
    try:
        prepare_conditioning(model, _inputs())
        prepare_conditioning(model, _inputs(width=32))
        prepare_conditioning(model, _inputs(negative=PROMPT))
    finally:
        handle.remove()
    assert len(encoded) == 2


def test_callback_reports_every_step_and_can_cancel_without_leaving_state(loaded_models):
    model = loaded_models("fp32")
    cond = prepare_conditioning(model, _inputs(**build_task("v2v").ours))
    seen = []
    first = sample_latents(model, cond, _settings(steps=6), callback=lambda i, n, _: seen.append((i, n)))
    assert seen == [(index, 6) for index in range(6)]

    def cancel_at_two(index, _total, _latents):
        if index == 2:
            raise _Cancelled

    with pytest.raises(_Cancelled):
        sample_latents(model, cond, _settings(steps=6), callback=cancel_at_two)
    assert torch.equal(sample_latents(model, cond, _settings(steps=6)), first)


def test_guidance_of_one_skips_the_negative_pass_per_expert(loaded_models):
    model = loaded_models("fp32")
    cond = prepare_conditioning(model, _inputs())
    calls = {"transformer": 0, "transformer_2": 0}

    def counter(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    handles = [getattr(model, name).register_forward_pre_hook(counter(name)) for name in calls]
    try:
        sample_latents(model, cond, _settings(steps=8, cfg=1.0, cfg_low_noise=4.0))
    finally:
        for handle in handles:
            handle.remove()
    high_steps = calls["transformer"]
    assert high_steps > 0
    assert calls["transformer_2"] == 2 * (8 - high_steps)


def test_model_defaults_are_used_for_boundary_and_shift(loaded_models):
    model = loaded_models("fp32")
    cond = prepare_conditioning(model, _inputs())
    default = sample_latents(model, cond, _settings(steps=6))
    explicit = sample_latents(model, cond, _settings(steps=6, boundary_ratio=0.875, shift=3.0))
    assert torch.equal(default, explicit)
    assert not torch.equal(default, sample_latents(model, cond, _settings(steps=6, shift=5.0)))
    assert not torch.equal(default, sample_latents(model, cond, _settings(steps=6, boundary_ratio=0.5)))


def test_strength_changes_the_result_and_zero_ignores_the_control(loaded_models):
    model = loaded_models("fp32")
    case = build_task("v2v")
    full = sample_latents(model, prepare_conditioning(model, _inputs(**case.ours)), _settings())
    half = sample_latents(model, prepare_conditioning(model, _inputs(strength=0.5, **case.ours)), _settings())
    assert not torch.equal(full, half)
    off = sample_latents(model, prepare_conditioning(model, _inputs(strength=0.0, **case.ours)), _settings())
    off_other = sample_latents(
        model,
        prepare_conditioning(model, _inputs(strength=0.0, control_video=torch.rand(LENGTH, HEIGHT, WIDTH, 3))),
        _settings(),
    )
    assert torch.equal(off, off_other)


def test_reference_images_add_latent_frames_that_are_removed_from_the_output(loaded_models):
    model = loaded_models("fp32")
    cond = prepare_conditioning(model, _inputs(**build_task("r2v").ours))
    assert cond.num_reference_images == 2
    assert cond.conditioning_latents.shape[2] == (LENGTH - 1) // 4 + 1 + 2
    assert sample_latents(model, cond, _settings()).shape[2] == (LENGTH - 1) // 4 + 1


def test_conditioning_from_another_model_is_refused(loaded_models, tiny_folder, tmp_path):
    from wanvace_core import load_pipeline
    from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline

    model = loaded_models("fp32")
    other = load_pipeline(write_tiny_pipeline(tmp_path / "wide", TinyModelSpec(text_dim=48)), "fp32")
    cond = prepare_conditioning(other, _inputs())
    with pytest.raises(WanVACEInputError, match="conditioning was encoded for another model"):
        sample_latents(model, cond, _settings())


def test_decode_refuses_a_latent_that_is_not_a_wan_video_latent(loaded_models):
    from wanvace_core import decode

    with pytest.raises(WanVACEInputError, match="samples has shape"):
        decode(loaded_models("fp32"), torch.zeros(1, 4, 8, 8))


def test_a_solver_call_counts_with_the_step_whose_interval_holds_its_sigma():
    from wanvace_core.generation.stepping import step_index_at

    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0])
    assert [step_index_at(sigmas, sigma) for sigma in (1.0, 0.9, 0.8, 0.80001, 0.79999, 0.6, 0.2, 0.1, 0.0)] == [
        0,
        0,
        1,
        1,
        1,
        1,
        3,
        3,
        3,
    ]


def test_a_schedule_starting_below_the_expert_switch_is_refused_unless_asked_for(loaded_models):
    model = loaded_models("fp32")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH))
    low_half = (0.6, 0.3, 0.0)  # SplitSigmas' low half of a schedule that crossed 0.875
    settings = SamplerSettings(seed=1, steps=2, cfg=4.0, cfg_low_noise=3.0, scheduler="euler", sigmas=low_half)
    with pytest.raises(WanVACEInputError, match=r"sigmas start at 0\.6, below the expert switch at 0\.875"):
        sample(model, cond, settings)
    alone = dataclasses.replace(settings, boundary_ratio=1.0)
    assert torch.isfinite(sample(model, cond, alone).latents).all()


@pytest.mark.parametrize(
    ("sigmas", "message"),
    [
        ((1.0,), "at least 2"),
        ((), "denoise 0 gives an empty schedule"),
        ((1.0, 0.5, 0.6, 0.0), "must fall strictly"),
        ((1.0, 0.5), "not 0"),
        ((1.5, 0.5, 0.0), "above 1.0"),
        ((1.0, float("nan"), 0.0), "NaN"),
    ],
)
def test_impossible_sigmas_are_refused_naming_the_fix(sigmas, message):
    with pytest.raises(WanVACEInputError, match=message):
        SamplerSettings(seed=1, steps=len(sigmas) - 1, cfg=4.0, cfg_low_noise=3.0, sigmas=sigmas)
