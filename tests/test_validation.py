"""The core's shared checks: NaN, infinities and non-numbers are refused naming the argument, never a bare error."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH
from wanvace_core import (
    CacheOptions,
    ExpertCacheLimits,
    SamplerSettings,
    VACEInputs,
    WanVACEInputError,
    prepare_conditioning,
    sample,
    validate_generation_size,
    validate_vace_inputs,
)
from wanvace_core.generation.sampling import scheduled_timesteps
from wanvace_core.validation import nan_refusing_min, validate_finite, validate_integer

NAN, INF = float("nan"), float("inf")
NOT_FINITE = [NAN, INF, -INF]


@pytest.mark.parametrize("value", NOT_FINITE)
def test_validate_finite_names_the_argument_the_value_and_the_fix(value):
    with pytest.raises(WanVACEInputError) as error:
        validate_finite("cfg", value, "use 1.0 or more")
    assert str(error.value) == f"cfg={value} is not a finite number; use 1.0 or more."


@pytest.mark.parametrize("value", ["5", None, True, torch.tensor(1.0), 10**400])
def test_validate_finite_refuses_what_is_not_a_finite_number(value):
    with pytest.raises(WanVACEInputError, match=r"^cfg=.* use 1\.0 or more\.$"):
        validate_finite("cfg", value, "use 1.0 or more")


@pytest.mark.parametrize("value", [0, 1, 2.5, -3.0, 1e300])
def test_validate_finite_returns_finite_numbers_as_floats(value):
    assert validate_finite("cfg", value, "fix") == float(value)
    assert type(validate_finite("cfg", value, "fix")) is float


@pytest.mark.parametrize("value", [NAN, 2.0, "3", True, None])
def test_validate_integer_refuses_what_is_not_an_integer(value):
    with pytest.raises(WanVACEInputError, match=r"^steps=.* is not an integer; use a whole number\.$"):
        validate_integer("steps", value, "use a whole number")


def test_nan_refusing_min_fails_nan_and_compares_like_a_float_otherwise():
    bound = nan_refusing_min(1.0)
    # ComfyUI's check is `value < min`: NaN and values below fail it, the bound itself and above pass.
    assert NAN < bound
    assert 0.5 < bound and -INF < bound
    assert not 1.0 < bound and not 2.0 < bound and not INF < bound
    assert bound == 1.0 and bound + 1 == 2.0 and type(bound + 1) is float
    assert repr(bound) == "1.0" and f"{bound}" == "1.0"
    assert json.dumps({"min": bound}) == '{"min": 1.0}'
    assert NAN < copy.deepcopy(bound)


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"cfg": NAN}, "cfg"),
        ({"cfg": INF}, "cfg"),
        ({"cfg_low_noise": NAN}, "cfg_low_noise"),
        ({"cfg_low_noise": -INF}, "cfg_low_noise"),
        ({"boundary_ratio": NAN}, "boundary_ratio"),
        ({"boundary_ratio": INF}, "boundary_ratio"),
        ({"shift": NAN}, "shift"),
        ({"shift": INF}, "shift"),
        ({"cfg": "5"}, "cfg"),
        ({"steps": NAN}, "steps"),
        ({"steps": 4.5}, "steps"),
        ({"seed": NAN}, "seed"),
    ],
)
def test_sampler_settings_refuse_non_finite_and_non_numbers_naming_the_argument(overrides, name):
    values = {"seed": 5, "steps": 4, "cfg": 5.0, "cfg_low_noise": 5.0, **overrides}
    with pytest.raises(WanVACEInputError) as error:
        SamplerSettings(**values)
    (value,) = overrides.values()
    assert str(error.value).startswith(f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}")


def _scheduler_model() -> SimpleNamespace:
    """What scheduled_timesteps reads of a model: the tiny and the A14B pipelines' UniPC flow scheduler."""
    config = {
        "_class_name": "UniPCMultistepScheduler",
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "num_train_timesteps": 1000,
        "flow_shift": 3.0,
    }
    return SimpleNamespace(scheduler_config=config, num_train_timesteps=1000, default_shift=3.0, device="cpu")


@pytest.mark.parametrize(
    ("scheduler", "steps", "shift"),
    [("unipc", 20, 100.0), ("unipc", 50, 99.9), ("unipc", 200, 100.0), ("euler", 20, 1e6), ("unipc", 20, 1e-4)],
)
def test_a_schedule_that_repeats_timesteps_is_refused_naming_shift_and_steps(scheduler, steps, shift):
    # Unchecked, these end in a bare AssertionError (UniPC) or IndexError (Euler) on a later step.
    settings = SamplerSettings(seed=0, steps=steps, cfg=5.0, cfg_low_noise=5.0, shift=shift, scheduler=scheduler)
    with pytest.raises(WanVACEInputError) as error:
        scheduled_timesteps(_scheduler_model(), settings)
    message = str(error.value)
    assert message.startswith(f"shift={shift} with steps={steps} makes the {scheduler} scheduler repeat timesteps")
    assert "use a shift nearer 3.0 (480p) or 5.0 (720p), or fewer steps." in message


@pytest.mark.parametrize("scheduler", ["unipc", "euler"])
@pytest.mark.parametrize(("steps", "shift"), [(1, None), (4, None), (20, None), (40, 5.0), (200, 3.0), (30, 12.0)])
def test_usual_schedules_pass_and_run_to_the_end(scheduler, steps, shift):
    settings = SamplerSettings(seed=0, steps=steps, cfg=5.0, cfg_low_noise=5.0, shift=shift, scheduler=scheduler)
    scheduler_object, timesteps = scheduled_timesteps(_scheduler_model(), settings)
    assert len(timesteps) == steps
    latents = torch.zeros(1, 2, 1, 2, 2)
    for t in timesteps:
        latents = scheduler_object.step(torch.ones_like(latents), t, latents, return_dict=False)[0]
    assert torch.isfinite(latents).all()


def test_sample_refuses_a_repeating_schedule_before_any_expert_runs(loaded_models):
    model = loaded_models("fp32")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH))
    calls = []
    handles = [expert.register_forward_pre_hook(lambda *_: calls.append(1)) for expert in model.experts]
    try:
        with pytest.raises(WanVACEInputError, match=r"^shift=100\.0 with steps=20 makes the unipc scheduler"):
            sample(model, cond, SamplerSettings(seed=0, steps=20, cfg=5.0, cfg_low_noise=5.0, shift=100.0))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == []


@pytest.mark.parametrize("strength", NOT_FINITE)
def test_conditioning_refuses_non_finite_strength(strength):
    with pytest.raises(WanVACEInputError) as error:
        validate_vace_inputs(VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, strength=strength))
    fix = "use a value in [0, 10]; 1.0 is the trained value"
    assert str(error.value) == f"strength={strength} is not a finite number; {fix}."


@pytest.mark.parametrize(
    ("size", "name"), [((64.0, 48, 9), "width"), ((64, NAN, 9), "height"), ((64, 48, 9.0), "length")]
)
def test_generation_size_must_be_integers(size, name):
    with pytest.raises(WanVACEInputError, match=rf"^{name}=.* is not an integer"):
        validate_generation_size(*size)


@pytest.mark.parametrize("field", ["positive", "negative"])
def test_prompts_must_be_strings(field):
    values = {"positive": PROMPT, "negative": NEGATIVE, field: None}
    with pytest.raises(WanVACEInputError, match=rf"^{field}=None is not a string"):
        validate_vace_inputs(VACEInputs(width=WIDTH, height=HEIGHT, length=LENGTH, **values))


@pytest.mark.parametrize("threshold", NOT_FINITE)
def test_cache_options_refuse_non_finite_threshold(threshold):
    with pytest.raises(WanVACEInputError) as error:
        CacheOptions(residual_diff_threshold=threshold)
    assert str(error.value) == (
        f"residual_diff_threshold={threshold} is not a finite number; use a value in (0, 1]; 0.04-0.12 is typical."
    )


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: CacheOptions(Fn_compute_blocks=1.5), "Fn_compute_blocks"),
        (lambda: CacheOptions(Bn_compute_blocks=NAN), "Bn_compute_blocks"),
        (lambda: CacheOptions(taylorseer_order=NAN), "taylorseer_order"),
        (lambda: ExpertCacheLimits(max_warmup_steps=NAN), "max_warmup_steps"),
        (lambda: ExpertCacheLimits(max_cached_steps=2.5), "max_cached_steps"),
    ],
)
def test_cache_counts_must_be_integers(build, name):
    with pytest.raises(WanVACEInputError, match=rf"^{name}=.* is not an integer"):
        build()


def test_finite_values_still_pass():
    SamplerSettings(seed=0, steps=1, cfg=1.0, cfg_low_noise=30.0, boundary_ratio=0.0, shift=1e-3)
    CacheOptions(residual_diff_threshold=1.0)
    validate_vace_inputs(VACEInputs(PROMPT, "", WIDTH, HEIGHT, LENGTH, strength=0.0))
    assert math.isfinite(validate_finite("x", 10**300, "fix"))
