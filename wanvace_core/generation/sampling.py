"""The dual-expert denoising loop.

The high-noise expert (`transformer`) runs while `t >= boundary_ratio * num_train_timesteps`,
the low-noise expert (`transformer_2`) after. Each expert has its own guidance scale, and
classifier-free guidance is skipped for an expert whose scale is 1.0. Latents stay in fp32 and
are cast to the transformer dtype for each call, as diffusers does, so results match
`WanVACEPipeline` bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.utils.torch_utils import randn_tensor

from ..errors import WanVACEInputError
from ..runtime.attention_guidance import ExpertHooks, SkipLayerPass, attention_guidance
from ..runtime.caching import CachedExperts, CacheOptions, CacheReport, ExpertRun
from ..runtime.model import WanVACEModel
from ..runtime.plan import planned_run
from ..validation import validate_finite, validate_integer
from . import stepping
from .conditioning import VACEConditioning
from .guidance import BatchedGuidance, Guidance, GuidanceOptions, combine
from .limits import check_frames, size_limits_of
from .schedules import (
    STOCHASTIC_SCHEDULERS,
    step_sigmas,
    timesteps_for,
    validate_scheduler,
    validate_sigmas,
)
from .windows import (
    ContextWindowOptions,
    check_schedule_with_cache,
    check_windows,
    frames_per_call,
    freenoise,
    plan_windows,
    windowed_prediction,
)

logger = logging.getLogger(__name__)

StepCallback = stepping.StepCallback


@dataclass(frozen=True)
class SamplerSettings:
    """How to denoise. `boundary_ratio`/`shift` of None mean the model's own values. `sigmas` (ComfyUI's SIGMAS, from
    the first sigma down to 0) replaces the scheduler's own schedule; `steps` is then `len(sigmas) - 1`."""

    seed: int
    steps: int
    cfg: float
    cfg_low_noise: float
    boundary_ratio: float | None = None
    shift: float | None = None
    scheduler: str = "unipc"
    sigmas: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.sigmas is not None:  # first: an empty schedule (denoise 0) has no steps to speak of
            object.__setattr__(self, "sigmas", validate_sigmas(self.sigmas))
        steps = validate_integer("steps", self.steps, "use a whole number of steps; 20-40 is typical")
        if steps < 1:
            raise WanVACEInputError(f"steps={self.steps} must be at least 1; 20-40 is typical.")
        seed = validate_integer("seed", self.seed, "use a whole number in [0, 2**64)")
        if not 0 <= seed < 2**64:
            raise WanVACEInputError(f"seed={self.seed} must lie in [0, 2**64).")
        for name in ("cfg", "cfg_low_noise"):
            fix = "use 1.0 or more (5.0 is typical; 1.0 disables guidance)"
            if validate_finite(name, getattr(self, name), fix) < 1.0:
                raise WanVACEInputError(f"{name}={getattr(self, name)} is below 1.0; use 1.0 to disable guidance.")
        ratio_fix = "use a value in [0, 1] (0.875 for Wan2.2), or None for the model's value"
        if (
            self.boundary_ratio is not None
            and not 0.0 <= validate_finite("boundary_ratio", self.boundary_ratio, ratio_fix) <= 1.0
        ):
            raise WanVACEInputError(
                f"boundary_ratio={self.boundary_ratio} must lie in [0, 1] (0.875 for Wan2.2); 1.0 runs only the "
                "low-noise expert, 0.0 only the high-noise expert."
            )
        shift_fix = "use a positive value (3.0 for 480p, 5.0 for 720p), or None for the model's value"
        if self.shift is not None and validate_finite("shift", self.shift, shift_fix) <= 0:
            raise WanVACEInputError(f"shift={self.shift} must be positive (3.0 for 480p, 5.0 for 720p).")
        validate_scheduler(self.scheduler)
        if self.sigmas is not None and steps != len(self.sigmas) - 1:
            raise WanVACEInputError(
                f"steps={self.steps} disagrees with the {len(self.sigmas)} sigmas ({len(self.sigmas) - 1} steps); "
                "with sigmas, steps is their count less one."
            )


@dataclass(frozen=True)
class SampleResult:
    """Normalised latents `[1, C, T, h, w]` (fp32, reference frames removed) and, with caching, what it did."""

    latents: torch.Tensor
    cache_report: CacheReport | None = None


@dataclass(frozen=True)
class _ExpertPlan:
    boundary_timestep: float | None

    def pick(self, model: WanVACEModel, t: torch.Tensor | float, settings: SamplerSettings):
        if self.boundary_timestep is None or t >= self.boundary_timestep:
            expert, guidance = model.transformer, settings.cfg
            if expert is None:
                expert, guidance = model.transformer_2, settings.cfg_low_noise
            return expert, guidance
        return model.transformer_2, settings.cfg_low_noise


def _plan(model: WanVACEModel, settings: SamplerSettings) -> _ExpertPlan:
    if model.transformer is None or model.transformer_2 is None:
        return _ExpertPlan(boundary_timestep=None)
    ratio = model.boundary_ratio if settings.boundary_ratio is None else settings.boundary_ratio
    return _ExpertPlan(boundary_timestep=ratio * model.num_train_timesteps)


def scheduled_timesteps(model: WanVACEModel, settings: SamplerSettings):
    """A fresh scheduler set to `settings`, and its timesteps; refuses a schedule that repeats timesteps."""
    return timesteps_for(model.scheduler_config, settings, model.device)


def initial_noise_shape(model: WanVACEModel, cond: VACEConditioning) -> tuple[int, ...]:
    stride = model.helper.vae_scale_factor_spatial
    num_frames = cond.length + cond.num_reference_images * model.temporal_stride
    return (
        1,
        model.reference_expert.config.in_channels,
        (num_frames - 1) // model.temporal_stride + 1,
        cond.height // stride,
        cond.width // stride,
    )


def initial_noise(model: WanVACEModel, cond: VACEConditioning, seed: int) -> torch.Tensor:
    """The starting noise, drawn like diffusers with `torch.Generator("cpu").manual_seed(seed)`."""
    shape = initial_noise_shape(model, cond)
    generator = torch.Generator("cpu").manual_seed(seed)
    return randn_tensor(shape, generator=generator, device=model.device, dtype=torch.float32)


def sequence_length(model: WanVACEModel, cond: VACEConditioning, windows: ContextWindowOptions | None = None) -> int:
    """Tokens the experts see per call: latent frames (with `windows`, one window's and the reference frames) x
    latent height and width over the patch size."""
    _, frames, height, width = initial_noise_shape(model, cond)[1:]
    frames = frames_per_call(windows, frames, cond.num_reference_images)
    p_t, p_h, p_w = model.reference_expert.config.patch_size
    return (frames // p_t) * (height // p_h) * (width // p_w)


def _check_conditioning_matches(model: WanVACEModel, cond: VACEConditioning) -> None:
    config = model.reference_expert.config
    text_dim, control_channels = cond.prompt_embeds.shape[-1], cond.conditioning_latents.shape[1]
    if text_dim != config.text_dim or control_channels != config.vace_in_channels:
        raise WanVACEInputError(
            f"conditioning was encoded for another model (text dim {text_dim}, {control_channels} control channels; "
            f"this model has {config.text_dim} and {config.vace_in_channels}); connect the same model to "
            "WanVACEConditioning and WanVACESampler."
        )


def _expert_runs(
    model: WanVACEModel, plan: _ExpertPlan, call_timesteps, settings: SamplerSettings, guidance: Guidance
) -> list[ExpertRun]:
    """Each expert's calls of the run (one per entry of `call_timesteps`), for cache-dit's per-expert contexts."""
    counts: dict[str, int] = {}
    scales: dict[str, float] = {}
    for t in call_timesteps:
        expert, scale = plan.pick(model, t, settings)
        attribute = "transformer" if expert is model.transformer else "transformer_2"
        counts[attribute] = counts.get(attribute, 0) + 1
        scales[attribute] = scale
    return [
        ExpertRun(attribute, steps, guidance.calls_per_step(scales[attribute]) == 2)
        for attribute, steps in counts.items()
    ]


def _check_schedule_reaches_the_high_noise_expert(
    plan: _ExpertPlan, settings: SamplerSettings, timesteps, num_train_timesteps: int
) -> None:
    """A given schedule that starts below the expert switch would silently never run the high-noise expert."""
    if settings.sigmas is None or plan.boundary_timestep is None or settings.boundary_ratio is not None:
        return
    if float(timesteps[0]) < plan.boundary_timestep:
        boundary = plan.boundary_timestep / num_train_timesteps
        raise WanVACEInputError(
            f"sigmas start at {settings.sigmas[0]:.4g}, below the expert switch at {boundary:.4g}, so the high-noise "
            "expert would never run; connect a schedule that starts above it (the whole schedule, or SplitSigmas' "
            "high half first), or set boundary_ratio to 1.0 to run the low-noise expert alone on purpose."
        )


def _before_window(position: int, between_windows: Callable[[], None] | None, cached: CachedExperts | None) -> None:
    if between_windows is not None:
        between_windows()
    if cached is not None:
        cached.use_window(position)


@dataclass(frozen=True)
class _Predictor:
    """One run's expert prediction (the velocity) at a step: the expert for its timestep, guidance, the VACE hints of
    the step, and context windows. Both the built-in schedulers and an outside solver call it."""

    model: WanVACEModel
    cond: VACEConditioning
    settings: SamplerSettings
    plan: _ExpertPlan
    guidance: Guidance
    steps: int
    windows: ContextWindowOptions | None
    cached: CachedExperts | None
    between_windows: Callable[[], None] | None
    rules: GuidanceOptions
    slg_pass: SkipLayerPass
    slg_steps: frozenset[int] = frozenset()
    running: dict = dataclasses.field(default_factory=dict)

    def __call__(self, index: int, t: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.parts(index, t, latents, sigma)[0]

    def parts(self, index: int, t: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor):
        """(the guided velocity, the conditional one, the unconditional one or None at cfg 1, the expert's cfg)."""
        cond, cached = self.cond, self.cached
        expert, scale = self.plan.pick(self.model, t, self.settings)
        hints = cond.applies_hints_at(index, self.steps)
        scale_of_hints = cond.conditioning_scale if hints else torch.zeros_like(cond.conditioning_scale)
        common = {
            "hidden_states": latents.to(self.model.transformer_dtype),
            "timestep": t.expand(latents.shape[0]),
            # Outside the VACE window the interleaved forward skips the VACE blocks (no control input); cache-dit's
            # functor always runs them, so there the hints are weighted 0: both equal strength 0 bitwise.
            "control_hidden_states": cond.conditioning_latents if hints or cached is not None else None,
            "control_hidden_states_scale": scale_of_hints,
            "return_dict": False,
        }
        predictions = self._branches(expert, scale, common, index, latents)
        if scale <= 1.0:
            guided, noise_pred, noise_uncond = predictions, predictions, None
        else:
            high_noise = expert is self.model.transformer or self.model.transformer is None
            rule = self.rules.high_noise if high_noise else self.rules.low_noise
            noise_pred, noise_uncond = predictions.chunk(2)
            name = "transformer" if high_noise else "transformer_2"
            guided = combine(rule, self.running, name, noise_pred, noise_uncond, scale, index, latents, sigma)
        slg = self.rules.slg
        if slg is not None and slg.extra_pass and index in self.slg_steps:
            with self.slg_pass.running():
                skipped = self._branches(expert, 1.0, common, index, latents)
            guided = guided + slg.scale * (noise_pred - skipped)
        return guided, noise_pred, noise_uncond, scale

    def _branches(self, expert, scale: float, common: dict, index: int, latents: torch.Tensor) -> torch.Tensor:
        if self.windows is None:
            return self.guidance.branches(expert, scale, self.cond, common)
        # Each branch is fused over the windows first, then combined once on the whole video (as ComfyUI does): the
        # rules other than plain CFG do not commute with the fusion.
        references = self.cond.num_reference_images
        return windowed_prediction(
            lambda inputs: self.guidance.branches(expert, scale, self.cond, inputs),
            common,
            plan_windows(self.windows, latents.shape[2] - references, index),
            references,
            lambda position: _before_window(position, self.between_windows, self.cached),
        )

    def negative_pass_at(self, timesteps) -> bool:
        """Whether every step at these timesteps runs a negative pass (cfg above 1 on its expert)."""
        return all(self.plan.pick(self.model, t, self.settings)[1] > 1.0 for t in timesteps)


def _denoised(latents: torch.Tensor, sigma: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """The flow-matching estimate of the clean latents, `x - sigma * v` (fp32)."""
    return latents - sigma.to(latents.device, torch.float32) * velocity.float()


@torch.no_grad()
def sample(
    model: WanVACEModel,
    cond: VACEConditioning,
    settings: SamplerSettings,
    callback: StepCallback | None = None,
    cache: CacheOptions | None = None,
    guidance: Guidance | None = None,
    batched_cfg: bool = False,
    windows: ContextWindowOptions | None = None,
    between_windows: Callable[[], None] | None = None,
    stepper: stepping.Stepper | None = None,
    rules: GuidanceOptions | None = None,
) -> SampleResult:
    """Denoises `cond` with the dual-expert loop; `cache` turns on Cache-DiT for this run only (with `windows`, a
    cache state per window). `callback` gets the denoised estimate after every step.

    `batched_cfg` runs each guided step's two passes as one call of batch 2 (`BatchedGuidance`; a CFG-parallel
    `guidance` splits them over devices instead). A model whose experts run in parallel workers (`model.remote`)
    hands the whole run to them, its LoRAs included. `windows` denoises the video as overlapping context windows at
    every step (`windows.py`); a video no longer than one window runs as without them, bit for bit. `between_windows`
    runs before each window (raising stops the run). `stepper` (an outside solver, `stepping.Stepper`) steps instead of
    the built-in scheduler, over `settings.sigmas` or else the built-in scheduler's sigmas. `rules` says how each
    expert's two predictions combine (plain CFG where None).
    """
    if windows is not None and cache is not None:
        check_schedule_with_cache(windows.schedule)
    if cache is not None and rules is not None and rules.slg is not None and rules.slg.extra_pass:
        raise WanVACEInputError(
            "SLG with slg_scale above 0 adds an expert call to its steps, which step caching cannot count as one "
            "cached unit; set slg_scale to 0 (its one-pass form, which caches), or disconnect the cache input."
        )
    # Before the first step: a size the model's RoPE table cannot hold fails deep inside it.
    check_frames(size_limits_of(model), cond.length, cond.num_reference_images, windows)
    if model.remote is not None:
        run = {
            "cond": cond,
            "settings": settings,
            "cache": cache,
            "tokens": sequence_length(model, cond, windows),
            "batched_cfg": batched_cfg,
            "windows": windows,
            "rules": rules,
            "loras": model.loras,
        }
        if stepper is not None:
            return _outside_steps_in_workers(model, run, callback, stepper)
        latents, report = model.remote.sample(callback=callback, **run)
        return SampleResult(latents=latents, cache_report=None if report is None else CacheReport.from_plain(report))
    guidance = guidance or (BatchedGuidance() if batched_cfg else Guidance())
    _check_conditioning_matches(model, cond)
    scheduler, timesteps, sigmas = _schedule(model, settings, stepper)
    plan = _plan(model, settings)
    _check_schedule_reaches_the_high_noise_expert(plan, settings, timesteps, model.num_train_timesteps)
    call_timesteps = timesteps
    if stepper is not None:
        call_sigmas = _call_sigmas(stepper, sigmas, cache)
        call_timesteps = [sigma * model.num_train_timesteps for sigma in call_sigmas or ()]
    runs = _expert_runs(model, plan, call_timesteps, settings, guidance)
    cached = None if cache is None else CachedExperts(model, cache, runs)
    noise = initial_noise(model, cond, settings.seed)
    references = cond.num_reference_images
    if windows is not None:
        check_windows(windows, noise.shape[2] - references, len(timesteps))
        if windows.freenoise:
            freenoise(noise[:, :, references:], windows, settings.seed)
    rules = rules or GuidanceOptions()
    slg_pass = SkipLayerPass()
    slg_steps = frozenset(rules.slg.active_steps(len(timesteps))) if rules.slg is not None else frozenset()
    predict = _Predictor(
        model,
        cond,
        settings,
        plan,
        guidance,
        len(timesteps),
        windows,
        cached,
        between_windows,
        rules,
        slg_pass,
        slg_steps,
    )
    with planned_run(model, cached, _inside_experts(model, cond, settings, rules, timesteps, slg_pass)):
        if stepper is None:
            latents = _built_in_steps(predict, scheduler, timesteps, sigmas, noise, settings, callback)
        else:
            latents = _outside_steps(predict, stepper, sigmas, noise, settings, model.num_train_timesteps, callback)
        report = cached.report() if cached is not None else None
    if report is not None:
        logger.info("%s", report.text())
    return SampleResult(latents=latents[:, :, references:], cache_report=report)


def _schedule(model: WanVACEModel, settings: SamplerSettings, stepper: stepping.Stepper | None):
    """(the built-in scheduler or None, the step timesteps, the step sigmas ending at 0)."""
    if stepper is not None and settings.sigmas is not None:
        # The outside solver steps the given schedule itself: no built-in scheduler is set up for it.
        sigmas = torch.tensor(settings.sigmas, dtype=torch.float32)
        return None, (sigmas[:-1] * model.num_train_timesteps).to(model.device), sigmas
    scheduler, timesteps = scheduled_timesteps(model, settings)
    return scheduler, timesteps, step_sigmas(scheduler)


def _call_sigmas(stepper: stepping.Stepper, sigmas: torch.Tensor, cache: CacheOptions | None):
    call_sigmas = stepper.call_sigmas(sigmas)
    if call_sigmas is None and cache is not None:
        raise WanVACEInputError(
            "this SAMPLER decides its number of model calls as it runs (an adaptive solver), which step caching "
            "needs to know before the run; disconnect the cache input, or choose a fixed-step sampler."
        )
    return call_sigmas


def _outside_steps_in_workers(
    model: WanVACEModel, run: dict, callback: StepCallback | None, stepper: stepping.Stepper
) -> SampleResult:
    """The outside solver runs here and the experts in the workers (`run`: the request's fields): each of its denoiser
    calls is one round trip (`RemoteExperts.stepped`), where the workers' own `sample` answers it with the same
    predictor, so the run equals the one-process run as the workers' built-in loop does."""
    cond, settings = run["cond"], run["settings"]
    _, timesteps, sigmas = _schedule(model, settings, stepper)
    plan = _plan(model, settings)
    _check_schedule_reaches_the_high_noise_expert(plan, settings, timesteps, model.num_train_timesteps)
    call_sigmas = _call_sigmas(stepper, sigmas, run["cache"])
    negative_pass_everywhere = all(plan.pick(model, t, settings)[1] > 1.0 for t in timesteps)
    noise = initial_noise(model, cond, settings.seed)
    with model.remote.stepped(call_sigmas=call_sigmas, **run) as workers:
        denoiser = _WorkersDenoiser(workers, negative_pass_everywhere)
        latents = stepper.run(denoiser, noise, sigmas, settings.seed, callback or (lambda *_: None))
    report = workers.report
    return SampleResult(
        latents=latents[:, :, cond.num_reference_images :],
        cache_report=None if report is None else CacheReport.from_plain(report),
    )


class _WorkersDenoiser:
    """`stepping.Denoiser` over the workers' round trip (`(x, sigma, parts) -> x0 or its parts as a tuple`)."""

    def __init__(self, call, negative_pass_everywhere: bool) -> None:
        self.call = call
        self.negative_pass_everywhere = negative_pass_everywhere

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, parts: bool = False):
        answer = self.call(x, sigma, parts)
        return stepping.DenoisedParts(*answer) if parts else answer


def _inside_experts(
    model: WanVACEModel,
    cond: VACEConditioning,
    settings: SamplerSettings,
    rules: GuidanceOptions,
    timesteps,
    slg_pass: SkipLayerPass,
):
    """The run's guidance inside the experts (NAG on those at cfg 1, SLG on those with a negative pass, RIFLEx), or
    None."""
    if rules.nag is None and rules.slg is None and not rules.riflex_index:
        return None
    scales = ((model.transformer, settings.cfg), (model.transformer_2, settings.cfg_low_noise))
    unguided = tuple(expert for expert, scale in scales if expert is not None and scale <= 1.0)
    guided = tuple(expert for expert, scale in scales if expert is not None and scale > 1.0)
    if rules.nag is not None and not unguided:
        raise WanVACEInputError(
            "NAG is on but both experts run a negative pass (cfg and cfg_low_noise above 1), where NAG does nothing; "
            "set cfg or cfg_low_noise to 1 (the distilled 4-step LoRAs run at 1), or turn NAG off."
        )
    if rules.slg is not None and not rules.slg.extra_pass and not guided:
        raise WanVACEInputError(
            "SLG is on but no expert runs a negative pass (cfg and cfg_low_noise are 1), which is where SLG skips "
            "its blocks at slg_scale 0; raise cfg or cfg_low_noise above 1, set slg_scale above 0 (an extra pass), or "
            "turn SLG off."
        )
    active = () if rules.slg is None else rules.slg.active_steps(len(timesteps))
    return attention_guidance(
        ExpertHooks(
            prompt_embeds=cond.prompt_embeds,
            negative_embeds=cond.negative_prompt_embeds,
            nag=rules.nag,
            nag_experts=unguided,
            slg=rules.slg,
            slg_experts=tuple(model.experts) if rules.slg is not None and rules.slg.extra_pass else guided,
            slg_timesteps=tuple(float(timesteps[index]) for index in active),
            slg_pass=slg_pass,
            riflex_index=rules.riflex_index,
            riflex_experts=tuple(model.experts),
        )
    )


def _built_in_steps(predict, scheduler, timesteps, sigmas, latents, settings, callback):
    if settings.sigmas is not None:
        latents = latents * sigmas[0]  # ComfyUI starts a schedule below 1 from that much noise (x 1.0 is exact)
    extra = {}
    if settings.scheduler in STOCHASTIC_SCHEDULERS:
        extra["generator"] = torch.Generator("cpu").manual_seed((settings.seed + 1) % 2**64)
    for index, t in enumerate(timesteps):
        velocity = predict(index, t, latents, sigmas[index])
        denoised = None if callback is None else _denoised(latents, sigmas[index], velocity)
        latents = scheduler.step(velocity, t, latents, return_dict=False, **extra)[0]
        if callback is not None:
            callback(index, len(timesteps), denoised)
    return latents


class _DualExpertDenoiser:
    """The run as an outside solver sees it (`stepping.Denoiser`): x0 from x and sigma, and on request its parts."""

    def __init__(self, predict: _Predictor, sigmas: torch.Tensor, num_train_timesteps: int) -> None:
        self.predict = predict
        self.sigmas = sigmas
        self.num_train_timesteps = num_train_timesteps
        self.negative_pass_everywhere = predict.negative_pass_at(sigmas[:-1] * num_train_timesteps)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, parts: bool = False):
        sigma = sigma.reshape(-1)[0].to("cpu", torch.float32)
        t = (sigma * self.num_train_timesteps).to(x.device)
        index = stepping.step_index_at(self.sigmas, float(sigma))
        guided, cond, uncond, scale = self.predict.parts(index, t, x, sigma)
        if not parts:
            return _denoised(x, sigma, guided)
        uncond_denoised = None if uncond is None else _denoised(x, sigma, uncond)
        return stepping.DenoisedParts(_denoised(x, sigma, guided), _denoised(x, sigma, cond), uncond_denoised, scale)


def _outside_steps(predict, stepper, sigmas, noise, settings, num_train_timesteps, callback):
    def on_step(index: int, total: int, denoised: torch.Tensor) -> None:
        if callback is not None:
            callback(index, total, denoised)

    denoiser = _DualExpertDenoiser(predict, sigmas, num_train_timesteps)
    return stepper.run(denoiser, noise, sigmas, settings.seed, on_step)
