"""Bitwise parity with diffusers' WanVACEPipeline for every VACE task, dtype and boundary."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, TASKS, WIDTH, build_task
from wanvace_core import (
    SamplerSettings,
    VACEInputs,
    decode,
    load_pipeline,
    prepare_conditioning,
    sample,
    to_vae_space,
)

STEPS = 4
CFG, CFG_LOW = 5.0, 3.0
SEED = 1234
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sample_latents(*args, **kwargs) -> torch.Tensor:
    return sample(*args, **kwargs).latents


@pytest.fixture(scope="module")
def reference_pipelines(tiny_folder):
    cache = {}

    def get(dtype: str) -> WanVACEPipeline:
        if dtype not in cache:
            pipeline = WanVACEPipeline.from_pretrained(tiny_folder, torch_dtype=TORCH_DTYPES[dtype])
            pipeline.set_progress_bar_config(disable=True)
            cache[dtype] = pipeline
        return cache[dtype]

    return get


def _count_expert_calls(model):
    counts = {"transformer": 0, "transformer_2": 0}
    handles = []
    for name in counts:
        expert = getattr(model, name)

        def hook(*_args, _name=name):
            counts[_name] += 1

        handles.append(expert.register_forward_pre_hook(hook))
    return counts, handles


def _run_reference(pipeline, case, boundary_ratio, scheduler=None, each_step: list | None = None):
    """diffusers' pipeline on the case: its last latents and frames; `each_step` gets the latents after every step."""
    pipeline.register_to_config(boundary_ratio=boundary_ratio)
    if scheduler is not None:
        pipeline.scheduler = scheduler
    captured = {}

    def keep_latents(_pipe, index, _t, kwargs):
        captured["latents"] = kwargs["latents"]
        if each_step is not None:
            each_step.append(kwargs["latents"])
        return {}

    output = pipeline(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=HEIGHT,
        width=WIDTH,
        num_frames=LENGTH,
        num_inference_steps=STEPS,
        guidance_scale=CFG,
        guidance_scale_2=None if boundary_ratio is None else CFG_LOW,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="pt",
        callback_on_step_end=keep_latents,
        **case.theirs,
    )
    return captured["latents"], output.frames[0]


def _parity_cases() -> list:
    """Each task once, the (dtype, boundary) pairs taken in turn, so that every task, dtype and boundary, and every
    pair of dtype and boundary, is covered (8 runs, not 48; all 48 passed in both sets at every
    stop that ran them). WANVACE_FULL=1 runs the full product."""
    pairs = list(itertools.product(["fp32", "bf16"], [0.0, 0.875, 1.0]))
    if os.environ.get("WANVACE_FULL") == "1":
        return [(task, dtype, boundary) for task in TASKS for dtype, boundary in pairs]
    return [(task, *pairs[index % len(pairs)]) for index, task in enumerate(TASKS)]


@pytest.mark.parametrize(("task", "dtype", "boundary_ratio"), _parity_cases())
def test_latents_and_frames_bitwise_equal_to_diffusers(task, dtype, boundary_ratio, loaded_models, reference_pipelines):
    model = loaded_models(dtype)
    reference = reference_pipelines(dtype)
    original_scheduler = reference.scheduler
    case = build_task(task)

    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, strength=1.0, **case.ours))
    counts, handles = _count_expert_calls(model)
    try:
        ours = sample_latents(
            model,
            cond,
            SamplerSettings(seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, boundary_ratio=boundary_ratio),
        )
    finally:
        for handle in handles:
            handle.remove()
    try:
        their_latents, their_frames = _run_reference(reference, case, boundary_ratio)
    finally:
        reference.scheduler = original_scheduler

    expected = their_latents[:, :, cond.num_reference_images :]
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() == 0.0

    if boundary_ratio == 0.0:
        assert counts == {"transformer": 2 * STEPS, "transformer_2": 0}
    elif boundary_ratio == 1.0:
        assert counts == {"transformer": 0, "transformer_2": 2 * STEPS}
    else:
        assert counts["transformer"] > 0 and counts["transformer_2"] > 0
        assert counts["transformer"] + counts["transformer_2"] == 2 * STEPS

    if boundary_ratio == 0.875:
        frames = decode(model, to_vae_space(model, ours))
        assert frames.shape == (LENGTH, HEIGHT, WIDTH, 3)
        assert torch.equal(frames, their_frames.permute(0, 2, 3, 1).float())


@pytest.mark.parametrize("task", ["v2v", "r2v"])
def test_euler_scheduler_bitwise_equal_to_diffusers(task, loaded_models, reference_pipelines):
    model = loaded_models("fp32")
    reference = reference_pipelines("fp32")
    case = build_task(task)
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **case.ours))
    ours = sample_latents(
        model,
        cond,
        SamplerSettings(seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, shift=5.0, scheduler="euler"),
    )
    original = reference.scheduler
    try:
        their_latents, _ = _run_reference(
            reference, case, 0.875, FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
        )
    finally:
        reference.scheduler = original
    assert torch.equal(ours, their_latents[:, :, cond.num_reference_images :])


def test_single_expert_wan21_folder_bitwise_equal(tiny_single_folder):
    model = load_pipeline(tiny_single_folder, "fp32")
    assert model.transformer_2 is None and model.boundary_ratio is None
    reference = WanVACEPipeline.from_pretrained(tiny_single_folder, torch_dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    case = build_task("i2v")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **case.ours))
    ours = sample_latents(model, cond, SamplerSettings(seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG))
    their_latents, _ = _run_reference(reference, case, None)
    assert torch.equal(ours, their_latents)


def _diffusers_scheduler(name: str, shift: float):
    """The scheduler diffusers' own pipeline is given for each built-in name, built here from diffusers' classes."""
    from diffusers import DEISMultistepScheduler, DPMSolverMultistepScheduler, FlowMatchLCMScheduler

    flow = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": shift}
    return {
        "dpm++": lambda: DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, **flow),
        "dpm++_sde": lambda: DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++", solver_order=2, **flow),
        "deis": lambda: DEISMultistepScheduler(**flow),
        "lcm": lambda: FlowMatchLCMScheduler(shift=shift),
    }[name]()


def _with_generator(scheduler, seed: int):
    """diffusers' pipeline steps without a generator; ours seeds the solver's fresh noise with seed + 1."""
    generator = torch.Generator("cpu").manual_seed(seed + 1)
    step = scheduler.step
    scheduler.step = lambda *args, **kwargs: step(*args, generator=generator, **kwargs)
    return scheduler


@pytest.mark.parametrize("name", ["dpm++", "dpm++_sde", "deis", "lcm"])
def test_each_built_in_solver_bitwise_equal_to_diffusers_pipeline_with_that_scheduler(
    name, loaded_models, reference_pipelines
):
    model = loaded_models("fp32")
    reference = reference_pipelines("fp32")
    case = build_task("v2v")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **case.ours))
    settings = SamplerSettings(seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, shift=5.0, scheduler=name)
    ours = sample_latents(model, cond, settings)
    scheduler = _diffusers_scheduler(name, 5.0)
    if name in ("dpm++_sde", "lcm"):
        scheduler = _with_generator(scheduler, SEED)
    original = reference.scheduler
    try:
        their_latents, _ = _run_reference(reference, case, 0.875, scheduler)
    finally:
        reference.scheduler = original
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, their_latents[:, :, cond.num_reference_images :])


def test_each_step_reports_the_denoised_estimate_of_diffusers_trajectory(loaded_models, reference_pipelines):
    """Flow-matching Euler steps x_next = x + (sigma_next - sigma) v, so diffusers' own trajectory gives each step's
    velocity, and the estimate the callback must report is x - sigma v (the formula ComfyUI's CONST sampling uses)."""
    model = loaded_models("fp32")
    reference = reference_pipelines("fp32")
    case = build_task("t2v")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **case.ours))
    reported = []
    sample(
        model,
        cond,
        SamplerSettings(seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, shift=5.0, scheduler="euler"),
        callback=lambda index, total, denoised: reported.append(denoised.clone()),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    trajectory = [torch.randn(1, 16, 3, HEIGHT // 8, WIDTH // 8, generator=torch.Generator("cpu").manual_seed(SEED))]
    original = reference.scheduler
    try:
        _run_reference(reference, case, 0.875, scheduler, each_step=trajectory)
    finally:
        reference.scheduler = original
    sigmas = scheduler.sigmas
    assert len(reported) == STEPS and trajectory[0].shape == reported[0].shape
    for index, denoised in enumerate(reported):
        x, x_next = trajectory[index], trajectory[index + 1]
        velocity = (x_next - x) / (sigmas[index + 1] - sigmas[index])
        torch.testing.assert_close(denoised, x - sigmas[index] * velocity, rtol=1e-4, atol=1e-4)
    assert torch.equal(reported[-1], trajectory[-1]), "the last step lands on its own estimate (sigma 0)"


@pytest.mark.parametrize("windows", [False, True])
def test_euler_over_sigmas_equal_to_its_own_schedule_is_bitwise_the_built_in_euler(windows, loaded_models):
    """ComfyUI's SIGMAS input: a schedule equal to the built-in euler's own steps the same run, bit for bit."""
    from wanvace_core.generation.schedules import timesteps_for
    from wanvace_core.generation.windows import ContextWindowOptions

    model = loaded_models("fp32")
    case = build_task("v2v")
    cond = prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **case.ours))
    built_in = SamplerSettings(seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, shift=8.0, scheduler="euler")
    scheduler, _ = timesteps_for(model.scheduler_config, built_in)
    given = SamplerSettings(
        seed=SEED,
        steps=STEPS,
        cfg=CFG,
        cfg_low_noise=CFG_LOW,
        scheduler="euler",
        sigmas=tuple(scheduler.sigmas.tolist()),
    )
    options = ContextWindowOptions(context_length=5, context_overlap=0) if windows else None
    assert torch.equal(
        sample_latents(model, cond, given, windows=options), sample_latents(model, cond, built_in, windows=options)
    )


def test_distill_schedule_is_lightx2vs_four_timesteps_shifted_once():
    """lightx2v's Wan2.2 4-step distill configs: denoising_step_list [1000, 750, 500, 250], sample_shift 5, the shift
    applied once, sigma' = shift s / (1 + (shift - 1) s) with s = t / 1000."""
    from wanvace_core.generation.schedules import timesteps_for

    settings = SamplerSettings(seed=0, steps=4, cfg=1.0, cfg_low_noise=1.0, shift=5.0, scheduler="distill")
    scheduler, timesteps = timesteps_for({"num_train_timesteps": 1000, "flow_shift": 3.0}, settings)
    expected = [5 * s / (1 + 4 * s) for s in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    torch.testing.assert_close(
        scheduler.sigmas.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        timesteps.double(), torch.tensor(expected[:-1], dtype=torch.float64) * 1000, rtol=1e-6, atol=1e-4
    )
