"""ComfyUI's SAMPLER stepping the dual-expert denoiser (nodes/comfy_sampling.py) and WanVACEScheduler's SIGMAS
(nodes/scheduler.py), against ComfyUI's own functions.

Both modules run in a subprocess inside the ComfyUI tree of the set (this module is that subprocess's script),
loaded as the pack's package. The oracles are ComfyUI's: `calculate_sigmas` on its flow model_sampling, its
BasicScheduler node over its own Wan model patched by ModelSamplingSD3, and its samplers driving a reference
denoiser written here from diffusers' WanVACE transformer alone (`x - sigma * v` and CFG, no pack code between).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import types

import pytest
import torch

from tests.support.in_comfyui import enter_comfyui, relative, run_in_comfyui

WIDTH, HEIGHT, LENGTH = 32, 32, 5
STEPS, SEED, CFG, CFG_LOW = 4, 7, 5.0, 3.0
SCHEDULE_STEPS, SCHEDULE_SHIFTS = (1, 2, 8, 30), (1.0, 5.0, 8.0)
DENOISE_CASES = ((8, 0.5), (8, 0.75), (30, 0.3), (8, 0.0))
# Samplers compared with the same ComfyUI sampler over the reference denoiser. Seeded ones (ancestral, SDE) draw
# their noise from the seed in extra_args, the same in both runs.
REFERENCE_SAMPLERS = ("euler", "heun", "dpmpp_2m", "deis", "uni_pc", "lcm", "euler_ancestral", "er_sde", "dpmpp_2m_sde")
# CFG++ samplers, against ComfyUI's own cfg_function over the reference's two estimates.
CFG_PP_REFERENCE_SAMPLERS = ("euler_cfg_pp", "dpmpp_2m_cfg_pp", "res_multistep_cfg_pp")
# ComfyUI's cfg_function combines the estimates in x0 space, ours the velocities: rounding only. Measured in both
# sets: 4.0e-7 to 4.9e-7 (euler_cfg_pp), 2.7e-6 to 4.3e-6 (dpmpp_2m_cfg_pp), 1.5e-6 (res_multistep_cfg_pp).
CFG_PP_RTOL = 1e-5
# Measured over REFERENCE_SAMPLERS in both sets (fp32, CPU): 0, bitwise equal.
REFERENCE_RTOL = 1e-6
# ComfyUI's euler divides (x - x0) by sigma and multiplies back, diffusers' euler steps the velocity: measured
# max |diff| / max |x| = 2.8e-7 in both sets (fp32, CPU, 4 steps).
EULER_RTOL = 2e-6


# --- the ComfyUI side (runs in the subprocess) -------------------------------------------------------------


def _plain_flow_sampling(shift: float):
    """ComfyUI's flow model_sampling, built here without the pack (the ModelSamplingSD3 recipe)."""
    import comfy.model_sampling

    class Sampling(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
        pass

    sampling = Sampling()
    sampling.set_parameters(shift=shift)
    return sampling


def _schedules() -> dict:
    import comfy.samplers
    from wanvace_pack.nodes.scheduler import WanVACEScheduler
    from wanvace_pack.wanvace_core import WanVACEInputError

    model = types.SimpleNamespace(scheduler_config={"flow_shift": 5.0})
    found = {"names": list(comfy.samplers.SCHEDULER_NAMES), "cases": []}
    for name in comfy.samplers.SCHEDULER_NAMES:
        for steps in SCHEDULE_STEPS:
            for shift in SCHEDULE_SHIFTS:
                try:
                    ours = WanVACEScheduler.execute(model, name, steps, shift, 1.0).result[0]
                except WanVACEInputError as error:
                    ours = str(error)
                # The last steps + 1, as BasicScheduler takes them (ddim_uniform may give one more).
                theirs = comfy.samplers.calculate_sigmas(_plain_flow_sampling(shift), name, steps).cpu()[-(steps + 1) :]
                found["cases"].append((name, steps, shift, ours, theirs))
    # shift 0 is the model's (5.0 in the config above)
    found["model_shift"] = (
        WanVACEScheduler.execute(model, "simple", 8, 0.0, 1.0).result[0],
        comfy.samplers.calculate_sigmas(_plain_flow_sampling(5.0), "simple", 8).cpu(),
    )
    found["valid"] = WanVACEScheduler.validate_inputs(scheduler="beta")
    found["refused"] = WanVACEScheduler.validate_inputs(scheduler="bogus")
    schema = WanVACEScheduler.define_schema()
    found["node_id"] = schema.node_id
    found["tooltips"] = all(item.tooltip for item in schema.inputs)
    found["basic"] = _basic_scheduler_cases(WanVACEScheduler, model)
    return found


def _comfy_wan_model():
    """ComfyUI's own Wan VACE model (a tiny one: only its model_sampling matters) in a ModelPatcher."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = {
        "image_model": "wan2.1",
        "model_type": "vace",
        "dim": 32,
        "ffn_dim": 64,
        "num_heads": 2,
        "num_layers": 2,
        "vace_layers": 1,
        "vace_in_dim": 96,
        "in_dim": 16,
        "out_dim": 16,
        "text_dim": 32,
        "freq_dim": 256,
        "eps": 1e-6,
    }
    config = comfy.supported_models.WAN21_Vace(unet_config)
    base = config.get_model({})
    device = comfy.model_management.get_torch_device()
    return comfy.model_patcher.ModelPatcher(base, load_device=device, offload_device=device)


def _basic_scheduler_cases(scheduler_node, model) -> list:
    """(name, steps, shift, denoise, ours, BasicScheduler's) over ComfyUI's Wan model after ModelSamplingSD3."""
    import comfy.samplers
    from comfy_extras.nodes_custom_sampler import BasicScheduler
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    comfy_model = _comfy_wan_model()
    cases = []
    for shift in (8.0, 5.0):
        patched = ModelSamplingSD3().patch(comfy_model, shift)[0]
        for name in comfy.samplers.SCHEDULER_NAMES:
            for steps, denoise in ((8, 1.0), *DENOISE_CASES):
                theirs = BasicScheduler.execute(patched, name, steps, denoise).result[0]
                ours = scheduler_node.execute(model, name, steps, shift, denoise).result[0]
                cases.append((name, steps, shift, denoise, ours, theirs))
    return cases


class _ReferenceModel:
    """ComfyUI's samplers' view of a model, over a denoiser written from diffusers' transformer alone."""

    cfg = None

    def __init__(self, denoise, sampling) -> None:
        self.denoise = denoise
        self.inner_model = types.SimpleNamespace(model_sampling=sampling)
        self.model_patcher = types.SimpleNamespace(model=self, get_model_object=lambda _name: sampling)

    def __call__(self, x, sigma, model_options=None, seed=None):
        if not (model_options or {}).get("sampler_post_cfg_function"):
            return self.denoise(x, sigma)
        # A CFG++ sampler: ComfyUI's own cfg_function combines the two estimates and runs its post-CFG functions.
        import comfy.samplers

        cond_x0, uncond_x0, scale = self.denoise(x, sigma, parts=True)
        return comfy.samplers.cfg_function(self, cond_x0, uncond_x0, scale, x, sigma, model_options)


def _reference_denoiser(experts, cond, boundary: float):
    """x0 = x - sigma * v, v = uncond + s (cond - uncond) from the expert for t = 1000 sigma (high-noise at or above
    the boundary): Wan2.2's two-expert rule and CFG from their formulas."""

    def denoise(x, sigma, parts=False):
        sigma = sigma.reshape(-1)[0].to(torch.float32)
        t = sigma * 1000
        expert, scale = (experts[0], CFG) if t >= boundary * 1000 else (experts[1], CFG_LOW)
        common = {
            "hidden_states": x,
            "timestep": t.expand(x.shape[0]),
            "control_hidden_states": cond.conditioning_latents,
            "control_hidden_states_scale": cond.conditioning_scale,
            "return_dict": False,
        }
        positive = expert(encoder_hidden_states=cond.prompt_embeds, **common)[0]
        negative = expert(encoder_hidden_states=cond.negative_prompt_embeds, **common)[0]
        if parts:
            return x - sigma * positive.float(), x - sigma * negative.float(), scale
        velocity = negative + scale * (positive - negative)
        return x - sigma * velocity.float()

    return denoise


def _count_calls(model) -> tuple[dict, list]:
    counts = {"transformer": 0, "transformer_2": 0}
    handles = []
    for name in counts:

        def hook(*_args, _name=name):
            counts[_name] += 1

        handles.append(getattr(model, name).register_forward_pre_hook(hook))
    return counts, handles


def _through_the_core(folder: str) -> dict:
    import comfy.samplers
    from diffusers import WanVACETransformer3DModel
    from wanvace_pack.nodes.comfy_sampling import flow_model_sampling, stepper_for
    from wanvace_pack.nodes.scheduler import WanVACEScheduler
    from wanvace_pack.wanvace_core import (
        CacheOptions,
        ExpertCacheLimits,
        SamplerSettings,
        VACEInputs,
        WanVACEInputError,
        load_pipeline,
        prepare_conditioning,
        sample,
    )
    from wanvace_pack.wanvace_core.generation.schedules import timesteps_for

    model = load_pipeline(folder, "fp32")
    control = torch.rand(LENGTH, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(1))
    cond = prepare_conditioning(
        model, VACEInputs("a bird flies over the sea", "blurry", WIDTH, HEIGHT, LENGTH, control_video=control)
    )
    shift = 3.0
    found: dict = {"timings": {}}

    # ComfyUI's euler over our euler's sigmas against our euler.
    started = time.perf_counter()
    settings = SamplerSettings(seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, shift=shift, scheduler="euler")
    ours = sample(model, cond, settings).latents
    sigmas = timesteps_for(model.scheduler_config, settings)[0].sigmas.to(torch.float32)
    with_sigmas = SamplerSettings(
        seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, scheduler="euler", sigmas=tuple(sigmas.tolist())
    )
    steps_seen = []
    comfy_euler = sample(
        model,
        cond,
        with_sigmas,
        callback=lambda index, total, denoised: steps_seen.append((index, total, tuple(denoised.shape))),
        stepper=stepper_for(comfy.samplers.sampler_object("euler"), shift),
    ).latents
    found["euler"] = (ours, comfy_euler, sigmas, steps_seen)
    found["timings"]["euler"] = time.perf_counter() - started

    # Every sampler of this ComfyUI through the stepper; a subset also over the reference denoiser.
    started = time.perf_counter()
    reference_experts = [
        WanVACETransformer3DModel.from_pretrained(os.path.join(folder, sub)).eval()
        for sub in ("transformer", "transformer_2")
    ]
    reference = _reference_denoiser(reference_experts, cond, model.boundary_ratio)
    noise = torch.randn(ours.shape, generator=torch.Generator("cpu").manual_seed(SEED))
    found["samplers"] = {}
    # dpm_adaptive takes as many steps as its error control asks of a random-weight model (about 150 calls here):
    # without guidance, each costs one pass instead of two.
    unguided = dataclasses.replace(with_sigmas, cfg=1.0, cfg_low_noise=1.0)
    for name in comfy.samplers.SAMPLER_NAMES:
        found["timings"][name] = time.perf_counter()
        stepper = stepper_for(comfy.samplers.sampler_object(name), shift)
        steps_ours, steps_theirs = [], []
        try:
            latents = sample(
                model,
                cond,
                unguided if name == "dpm_adaptive" else with_sigmas,
                callback=lambda index, total, denoised, _steps=steps_ours: _steps.append((index, total, denoised)),
                stepper=stepper,
            ).latents
        except WanVACEInputError as error:
            found["samplers"][name] = ("refused", str(error))
            continue
        expected = None
        if name in REFERENCE_SAMPLERS + CFG_PP_REFERENCE_SAMPLERS:
            sampling = _plain_flow_sampling(shift)
            extra_args = {"model_options": {"transformer_options": {"sample_sigmas": sigmas}}, "seed": SEED}
            with torch.no_grad():
                expected = comfy.samplers.sampler_object(name).sample(
                    _ReferenceModel(reference, sampling),
                    sigmas.clone(),
                    extra_args,
                    lambda index, denoised, _x, total, _steps=steps_theirs: _steps.append((index, total, denoised)),
                    noise,
                    torch.zeros_like(noise),
                    disable_pbar=True,
                )
        found["samplers"][name] = ("ran", latents, expected, steps_ours, steps_theirs)
        found["timings"][name] = time.perf_counter() - found["timings"][name]
    found["timings"]["samplers"] = time.perf_counter() - started

    # Step caching needs each expert's call count before the run: heun's from the probe, over WanVACEScheduler's
    # simple schedule at shift 8 (three of its four steps at or above the boundary).
    started = time.perf_counter()
    simple = WanVACEScheduler.execute(model, "simple", STEPS, 8.0, 1.0).result[0]
    heun = stepper_for(comfy.samplers.sampler_object("heun"), 8.0)
    eager = ExpertCacheLimits(max_warmup_steps=1)
    cache = CacheOptions(residual_diff_threshold=0.2, high_noise=eager, low_noise=eager)
    counts, handles = _count_calls(model)
    try:
        cached = sample(
            model, cond, dataclasses.replace(with_sigmas, sigmas=tuple(simple.tolist())), cache=cache, stepper=heun
        )
    finally:
        for handle in handles:
            handle.remove()
    stepper_for(comfy.samplers.sampler_object("uni_pc"), shift).call_sigmas(sigmas)
    found["schedule_kept"] = float(sigmas[-1])  # uni_pc writes over a final 0 of the sigmas it is handed
    found["heun_cache"] = {
        "call_sigmas": heun.call_sigmas(simple),
        "sigmas": simple.tolist(),
        "expert_calls": counts,
        "report": [(expert.expert, expert.steps, len(expert.cached_steps)) for expert in cached.cache_report.experts],
        "boundary": model.boundary_ratio,
        "finite": bool(torch.isfinite(cached.latents).all()),
    }
    adaptive = stepper_for(comfy.samplers.sampler_object("dpm_adaptive"), shift)
    found["adaptive_call_sigmas"] = adaptive.call_sigmas(sigmas)
    try:
        sample(model, cond, with_sigmas, cache=cache, stepper=adaptive)
        found["adaptive_with_cache"] = None
    except WanVACEInputError as error:
        found["adaptive_with_cache"] = str(error)
    found["timings"]["cache"] = time.perf_counter() - started

    # Raising in the step callback stops the run; the next run is unchanged.
    def cancel(index, _total, _denoised):
        if index == 1:
            raise InterruptedError("cancelled")

    euler = stepper_for(comfy.samplers.sampler_object("euler"), shift)
    try:
        sample(model, cond, with_sigmas, callback=cancel, stepper=euler)
        found["cancelled"] = False
    except InterruptedError:
        found["cancelled"] = True
    found["after_cancel"] = sample(model, cond, with_sigmas, stepper=euler).latents

    # A CFG++ sampler needs a negative pass at every step: refused before the first when an expert is at cfg 1.
    low_at_one = dataclasses.replace(with_sigmas, cfg_low_noise=1.0)
    started_steps = []
    try:
        sample(
            model,
            cond,
            low_at_one,
            callback=lambda *step: started_steps.append(step),
            stepper=stepper_for(comfy.samplers.sampler_object("euler_cfg_pp"), shift),
        )
        found["cfg_pp_at_cfg_one"] = ("", len(started_steps))
    except WanVACEInputError as error:
        found["cfg_pp_at_cfg_one"] = (str(error), len(started_steps))

    # A Sampler that is not a KSAMPLER (it drives ComfyUI's own model).
    try:
        stepper_for(comfy.samplers.Sampler(), shift)
        found["not_ksampler"] = None
    except WanVACEInputError as error:
        found["not_ksampler"] = str(error)
    import comfy.model_sampling

    ours, theirs = flow_model_sampling(8.0), _plain_flow_sampling(8.0)
    found["flow_sampling"] = {
        "classes": [
            isinstance(ours, comfy.model_sampling.ModelSamplingDiscreteFlow),
            isinstance(ours, comfy.model_sampling.CONST),
        ],
        "table": torch.equal(ours.sigmas, theirs.sigmas),
        "percent_to_sigma": [(ours.percent_to_sigma(p), theirs.percent_to_sigma(p)) for p in (1e-4, 0.2, 0.5, 0.8)],
    }
    return found


def _in_comfyui(folder: str, out_file: str) -> None:
    enter_comfyui()
    started = time.perf_counter()
    found = {"schedules": _schedules()}
    found["schedule_seconds"] = time.perf_counter() - started
    found["core"] = _through_the_core(folder)
    from tests.support.comfy_guidance_nodes import guidance_node_cases

    found["guidance_nodes"] = guidance_node_cases()
    torch.save(found, out_file)


# --- the pytest side -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def comfy_run(tmp_path_factory, tiny_folder):
    return run_in_comfyui(__file__, tiny_folder, tmp_path_factory.mktemp("comfy_sampling"))


def test_scheduler_node_equals_calculate_sigmas_for_every_curve_steps_and_shift(comfy_run):
    schedules = comfy_run["schedules"]
    assert len(schedules["names"]) >= 9 and {"simple", "beta", "normal", "karras"} <= set(schedules["names"])
    assert len(schedules["cases"]) == len(schedules["names"]) * len(SCHEDULE_STEPS) * len(SCHEDULE_SHIFTS)
    refused = []
    for name, steps, shift, ours, theirs in schedules["cases"]:
        if not torch.isfinite(theirs).all():  # ComfyUI's kl_optimal at 1 step: refused, naming the input
            assert f"scheduler={name!r} with steps={steps}" in ours and "NaN" in ours
            refused.append((name, steps))
            continue
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (name, steps, shift)
        assert ours[-1] == 0 and len(ours) == steps + 1
    assert set(refused) == {("kl_optimal", 1)}  # ComfyUI divides by steps - 1 there
    assert torch.equal(*schedules["model_shift"])
    assert schedules["node_id"] == "WanVACEScheduler" and schedules["tooltips"]


def test_scheduler_node_equals_basic_scheduler_on_comfyuis_wan_model(comfy_run):
    cases = comfy_run["schedules"]["basic"]
    assert len(cases) == 2 * len(comfy_run["schedules"]["names"]) * (1 + len(DENOISE_CASES))
    for name, steps, shift, denoise, ours, theirs in cases:
        assert torch.equal(ours, theirs), (name, steps, shift, denoise)
        assert len(ours) == (0 if denoise == 0 else steps + 1)
    # ComfyUI's simple at shift 8 and 8 steps: 727 -> 533 -> 0 at the end (the example).
    simple = next(case[4] for case in cases if case[:4] == ("simple", 8, 8.0, 1.0))
    assert [round(float(s) * 1000, 1) for s in simple[-3:]] == [727.3, 533.3, 0.0]


def test_scheduler_node_refuses_an_unknown_curve_by_name(comfy_run):
    schedules = comfy_run["schedules"]
    assert schedules["valid"] is True
    assert "scheduler='bogus'" in schedules["refused"] and "simple" in schedules["refused"]


def test_flow_model_sampling_is_comfyuis_flow_class_at_the_shift(comfy_run):
    flow = comfy_run["core"]["flow_sampling"]
    assert flow["classes"] == [True, True] and flow["table"]
    assert all(ours == theirs for ours, theirs in flow["percent_to_sigma"])


def test_comfy_euler_over_our_euler_sigmas_equals_our_euler(comfy_run):
    ours, comfy_euler, sigmas, steps_seen = comfy_run["core"]["euler"]
    assert len(sigmas) == STEPS + 1 and sigmas[-1] == 0
    assert torch.isfinite(comfy_euler).all()
    assert not torch.equal(ours, torch.zeros_like(ours))
    assert relative(comfy_euler, ours) < EULER_RTOL, relative(comfy_euler, ours)
    assert [(index, total) for index, total, _ in steps_seen] == [(i, STEPS) for i in range(STEPS)]
    assert all(shape[:2] == (1, 16) for _, _, shape in steps_seen)


def test_every_comfy_sampler_runs_through_the_stepper(comfy_run):
    samplers = comfy_run["core"]["samplers"]
    assert len(samplers) >= 42 and sum("_cfg_pp" in name for name in samplers) >= 7
    for name, outcome in samplers.items():
        assert outcome[0] == "ran", (name, outcome[1])
        assert torch.isfinite(outcome[1]).all(), name


def test_a_cfg_pp_sampler_with_an_expert_at_cfg_one_is_refused_before_the_first_step(comfy_run):
    refusal, steps = comfy_run["core"]["cfg_pp_at_cfg_one"]
    assert "SAMPLER euler_cfg_pp" in refusal and "raise cfg and cfg_low_noise above 1" in refusal
    assert "choose euler, its plain variant" in refusal
    assert steps == 0


def test_samplers_match_the_same_comfy_sampler_over_a_reference_denoiser(comfy_run):
    samplers = comfy_run["core"]["samplers"]
    errors = {}
    for name in REFERENCE_SAMPLERS:
        outcome, latents, expected, steps_ours, steps_theirs = samplers[name]
        assert outcome == "ran" and expected is not None, name
        errors[name] = relative(latents, expected)
        # The step callback gets what ComfyUI's callback gets: the step, the total and the denoised estimate x0.
        assert [step[:2] for step in steps_ours] == [step[:2] for step in steps_theirs] != [], name
        for ours, theirs in zip(steps_ours, steps_theirs, strict=True):
            errors[name] = max(errors[name], relative(ours[2], theirs[2]))
    assert max(errors.values()) < REFERENCE_RTOL, errors
    cfg_pp_errors = {}
    for name in CFG_PP_REFERENCE_SAMPLERS:
        outcome, latents, expected, steps_ours, steps_theirs = samplers[name]
        assert outcome == "ran" and expected is not None, name
        assert [step[:2] for step in steps_ours] == [step[:2] for step in steps_theirs] != [], name
        cfg_pp_errors[name] = relative(latents, expected)
    assert max(cfg_pp_errors.values()) < CFG_PP_RTOL, cfg_pp_errors
    assert relative(samplers["euler"][1], samplers["euler_cfg_pp"][1]) > 10 * CFG_PP_RTOL, cfg_pp_errors
    # Different samplers give different results: the comparison can tell them apart.
    assert relative(samplers["euler"][1], samplers["heun"][1]) > 100 * REFERENCE_RTOL


def test_heun_with_step_caching_counts_each_experts_calls_from_the_probe(comfy_run):
    heun = comfy_run["core"]["heun_cache"]
    call_sigmas = heun["call_sigmas"]
    # Heun (Karras et al. 2022, algorithm 2): at each step's sigma, then at the next one unless that is 0.
    sigmas = heun["sigmas"]
    assert list(call_sigmas) == [sigmas[0]] + [sigma for sigma in sigmas[1:-1] for _ in range(2)]
    high = sum(sigma >= heun["boundary"] for sigma in call_sigmas)
    assert high == 5  # simple at shift 8: 1, 0.96, 0.889 above 0.875, 0.727 below
    # Every call runs the cond and the uncond pass (cfg above 1 for both experts).
    assert heun["expert_calls"] == {"transformer": 2 * high, "transformer_2": 2 * (len(call_sigmas) - high)}
    assert [report[:2] for report in heun["report"]] == [("high-noise", high), ("low-noise", len(call_sigmas) - high)]
    assert sum(cached for _, _, cached in heun["report"]) > 0  # the cache did skip steps
    assert heun["finite"]


def test_the_stepper_leaves_the_schedule_it_is_given_unchanged(comfy_run):
    assert comfy_run["core"]["schedule_kept"] == 0.0


def test_adaptive_sampler_has_no_call_sigmas_and_is_refused_with_caching(comfy_run):
    assert comfy_run["core"]["adaptive_call_sigmas"] is None
    assert "adaptive" in comfy_run["core"]["adaptive_with_cache"]


def test_raising_in_the_step_callback_cancels_and_the_next_run_is_unchanged(comfy_run):
    core = comfy_run["core"]
    assert core["cancelled"]
    assert torch.equal(core["after_cancel"], core["euler"][1])


def test_a_sampler_that_is_not_a_ksampler_is_refused_naming_its_fix(comfy_run):
    message = comfy_run["core"]["not_ksampler"]
    assert "Sampler" in message and "KSamplerSelect" in message


@pytest.mark.every_variant
@pytest.mark.parametrize("rule", ["apg", "tcfg"])
def test_our_guidance_rule_equals_comfyuis_node_on_the_denoised_estimates(rule, comfy_run):
    from tests.support.comfy_guidance_nodes import check_rule

    check_rule(rule, comfy_run["guidance_nodes"])


if __name__ == "__main__":
    _in_comfyui(sys.argv[1], sys.argv[2])
