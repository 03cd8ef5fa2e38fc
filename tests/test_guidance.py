"""Guidance rules (CFG-Zero*, APG) against diffusers' guiders, and what a run with them does."""

from __future__ import annotations

import pytest
import torch
from diffusers.guiders import ClassifierFreeZeroStarGuidance
from diffusers.guiders import adaptive_projected_guidance as diffusers_apg

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import SamplerSettings, VACEInputs, WanVACEInputError, prepare_conditioning, sample
from wanvace_core.generation.guidance import APGOptions, ExpertGuidance, GuidanceOptions, combine
from wanvace_core.generation.windows import ContextWindowOptions

SHAPE = (1, 16, 3, 6, 8)


def _predictions(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(SHAPE, generator=generator) for _ in range(3))


@pytest.mark.parametrize("zero_init_steps", [0, 2])
def test_cfg_zero_star_equals_diffusers_guider_at_every_step(zero_init_steps):
    rule = ExpertGuidance(cfg_zero_star=True, zero_init_steps=zero_init_steps)
    guider = ClassifierFreeZeroStarGuidance(guidance_scale=5.0, zero_init_steps=zero_init_steps)
    for step in range(4):
        cond, uncond, latents = _predictions(step)
        guider.set_state(step=step, num_inference_steps=4, timestep=torch.tensor(900 - 100 * step))
        expected = guider.forward(cond, uncond).pred
        ours = combine(rule, {}, "transformer", cond, uncond, 5.0, step, latents, torch.tensor(0.7))
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
        if step < zero_init_steps:
            assert not ours.any()


def _diffusers_apg(cond_x0, uncond_x0, scale, buffer, options: APGOptions):
    """diffusers' normalized_guidance on the denoised estimates, its norms taken per channel (as ComfyUI's APG):
    each channel's frames x height x width as one row (diffusers 0.36 has no norm_dim)."""
    channels = cond_x0.shape[1]
    guided = diffusers_apg.normalized_guidance(
        cond_x0.reshape(channels, -1),
        uncond_x0.reshape(channels, -1),
        scale,
        buffer,
        eta=options.eta,
        norm_threshold=options.norm_threshold,
        use_original_formulation=True,
    )
    return guided.reshape(cond_x0.shape)


@pytest.mark.parametrize(
    "options", [APGOptions(), APGOptions(eta=0.0, norm_threshold=2.0, momentum=-0.5), APGOptions(norm_threshold=0.0)]
)
def test_apg_equals_diffusers_normalized_guidance_on_the_denoised_estimates(options):
    running = {}
    buffer = diffusers_apg.MomentumBuffer(options.momentum) if options.momentum else None
    rule = ExpertGuidance(apg=options)
    for step, sigma in enumerate((0.95, 0.8, 0.6)):
        cond, uncond, latents = _predictions(10 + step)
        sigma = torch.tensor(sigma)
        ours = combine(rule, running, "transformer", cond, uncond, 4.0, step, latents, sigma)
        expected_x0 = _diffusers_apg(latents - sigma * cond, latents - sigma * uncond, 4.0, buffer, options)
        torch.testing.assert_close(latents - sigma * ours, expected_x0, rtol=1e-5, atol=1e-5)


def test_apg_keeps_each_experts_momentum_apart():
    rule = ExpertGuidance(apg=APGOptions(momentum=0.5))
    cond, uncond, latents = _predictions(3)
    sigma = torch.tensor(0.9)
    running = {}
    first = combine(rule, running, "transformer", cond, uncond, 4.0, 0, latents, sigma)
    other_expert = combine(rule, running, "transformer_2", cond, uncond, 4.0, 0, latents, sigma)
    same_expert_again = combine(rule, running, "transformer", cond, uncond, 4.0, 1, latents, sigma)
    assert torch.equal(first, other_expert)
    assert not torch.equal(first, same_expert_again)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ExpertGuidance(cfg_zero_star=True, apg=APGOptions()), "keep one"),
        (lambda: ExpertGuidance(tcfg=True, apg=APGOptions()), "keep one"),
        (lambda: ExpertGuidance(zero_init_steps=-1), "zero_init_steps=-1"),
        (lambda: APGOptions(momentum=1.0), "apg_momentum=1.0"),
        (lambda: APGOptions(norm_threshold=-1.0), "apg_norm_threshold=-1.0"),
        (lambda: APGOptions(eta=float("nan")), "apg_eta"),
    ],
)
def test_impossible_guidance_options_are_refused_naming_the_input(make, message):
    with pytest.raises(WanVACEInputError, match=message.replace("*", r"\*")):
        make()


def test_guidance_options_travel_as_plain_values():
    import dataclasses

    options = GuidanceOptions(
        high_noise=ExpertGuidance(apg=APGOptions(eta=0.5, momentum=-0.25)),
        low_noise=ExpertGuidance(cfg_zero_star=True, zero_init_steps=1),
    )
    assert GuidanceOptions.from_plain(dataclasses.asdict(options)) == options


# --- runs on the tiny model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(loaded_models):
    model = loaded_models("fp32")
    case = build_task("v2v")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **case.ours))

    def go(rules=None, windows=None, cfg=5.0, batched_cfg=False):
        settings = SamplerSettings(seed=3, steps=4, cfg=cfg, cfg_low_noise=cfg, scheduler="euler")
        return sample(model, cond, settings, rules=rules, windows=windows, batched_cfg=batched_cfg).latents

    return go


def test_default_rules_run_bitwise_as_plain_cfg(run):
    assert torch.equal(run(GuidanceOptions()), run(None))


@pytest.mark.parametrize(
    "rule", [ExpertGuidance(cfg_zero_star=True, zero_init_steps=1), ExpertGuidance(apg=APGOptions(momentum=-0.5))]
)
def test_a_rule_on_one_expert_changes_the_run_and_batched_cfg_gives_the_same(rule, run):
    plain = run()
    high = run(GuidanceOptions(high_noise=rule))
    low = run(GuidanceOptions(low_noise=rule))
    assert not torch.equal(high, plain) and not torch.equal(low, plain) and not torch.equal(high, low)
    torch.testing.assert_close(run(GuidanceOptions(high_noise=rule), batched_cfg=True), high, rtol=1e-4, atol=1e-4)


def test_rules_do_nothing_at_cfg_one(run):
    rules = GuidanceOptions(ExpertGuidance(apg=APGOptions()), ExpertGuidance(cfg_zero_star=True))
    assert torch.equal(run(rules, cfg=1.0), run(None, cfg=1.0))


def test_a_video_in_one_window_combines_as_without_windows(run):
    rules = GuidanceOptions(high_noise=ExpertGuidance(apg=APGOptions(momentum=-0.5)))
    one_window = ContextWindowOptions(context_length=LENGTH + 16, context_overlap=8)
    assert torch.equal(run(rules, windows=one_window), run(rules))


def test_tcfg_equals_diffusers_tangential_guidance():
    from diffusers.guiders import tangential_classifier_free_guidance as diffusers_tcfg

    cond, uncond, latents = _predictions(21)
    ours = combine(ExpertGuidance(tcfg=True), {}, "transformer", cond, uncond, 5.0, 0, latents, torch.tensor(0.5))
    # The same projection summed in another order (u.v1 v1 against u.Vh then Vh with its second row zeroed): fp32
    # rounding of the SVD's vectors, amplified 5x by the scale; 1.4e-5 at most seen.
    torch.testing.assert_close(ours, diffusers_tcfg.normalized_guidance(cond, uncond, 5.0), rtol=1e-4, atol=1e-4)
