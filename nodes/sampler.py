"""WanVACESampler: the dual-expert denoising loop with ComfyUI progress, live previews and cancel."""

from __future__ import annotations

import logging

import comfy.model_management
from comfy_api.v0_0_2 import io

from ..wanvace_core import SCHEDULERS, SamplerSettings, sample, to_vae_space
from ..wanvace_core.generation.budget import (
    BATCHED_CFG_MODES,
    batched_cfg_decision,
    sampling_activation_bytes,
    validate_batched_cfg,
)
from ..wanvace_core.generation.schedules import validate_scheduler
from ..wanvace_core.generation.windows import frames_per_call
from ..wanvace_core.runtime.model import default_shift
from ..wanvace_core.validation import nan_refusing_min
from .comfy_sampling import stepper_for
from .memory import free_device_memory, set_working_memory
from .preview import step_previewer
from .refusals import Refusal
from .types import (
    CATEGORY,
    WanVACECacheType,
    WanVACEConditioningType,
    WanVACEContextWindowsType,
    WanVACEGuidanceType,
    WanVACEModelType,
)

MODEL_DEFAULT = -1.0
logger = logging.getLogger(__name__)


class WanVACESampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACESampler",
            display_name="WanVACE Sampler",
            category=CATEGORY,
            description=(
                "Denoises with the high-noise expert while t >= boundary_ratio x 1000 and the low-noise expert after, "
                "each with its own guidance. Same seed, same noise as diffusers' WanVACEPipeline. Outputs a video "
                "LATENT in raw VAE space (reference frames removed)."
            ),
            inputs=[
                WanVACEModelType.Input("model", tooltip="The pipeline from WanVACE Model Loader."),
                WanVACEConditioningType.Input("conditioning", tooltip="From WanVACE Conditioning."),
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=0xFFFFFFFFFFFFFFFF,
                    control_after_generate=True,
                    tooltip="Noise seed; equals torch.Generator('cpu').manual_seed(seed) in diffusers.",
                ),
                io.Int.Input("steps", default=20, min=1, max=200, tooltip="Denoising steps; 20-40 is typical."),
                io.Float.Input(
                    "cfg",
                    default=5.0,
                    min=nan_refusing_min(1.0),
                    max=30.0,
                    step=0.1,
                    tooltip="Guidance of the high-noise expert (and of a single-expert Wan2.1 model). 1.0 skips the "
                    "negative pass and halves the cost of those steps.",
                ),
                io.Float.Input(
                    "cfg_low_noise",
                    default=5.0,
                    min=nan_refusing_min(1.0),
                    max=30.0,
                    step=0.1,
                    tooltip="Guidance of the low-noise expert (transformer_2). 1.0 skips its negative pass.",
                ),
                io.Float.Input(
                    "boundary_ratio",
                    display_name="boundary_ratio (-1 = model's)",
                    default=MODEL_DEFAULT,
                    min=nan_refusing_min(-1.0),
                    max=1.0,
                    step=0.005,
                    tooltip="Expert switch point as a fraction of 1000 timesteps. -1 uses the model's value (0.875 for "
                    "Wan2.2). 0.0 runs only the high-noise expert, 1.0 only the low-noise expert.",
                ),
                io.Float.Input(
                    "shift",
                    display_name="shift (0 = model's)",
                    default=0.0,
                    min=nan_refusing_min(0.0),
                    max=100.0,
                    step=0.1,
                    tooltip="Flow-matching sigma shift. 0 uses the model's scheduler value (3.0); 5.0 suits 720p.",
                ),
                io.Combo.Input(
                    "scheduler",
                    options=list(SCHEDULERS),
                    default="unipc",
                    tooltip="unipc: the model's default. euler: flow Euler (ComfyUI's normal curve). dpm++, dpm++_sde, "
                    "deis, lcm: diffusers' solvers. distill: the 4-step lightx2v schedule (use shift 5).",
                ),
                WanVACECacheType.Input(
                    "cache",
                    optional=True,
                    tooltip="Cache-DiT step caching from WanVACE Cache Options; unconnected = no caching.",
                ),
                io.Combo.Input(
                    "batched_cfg",
                    options=list(BATCHED_CFG_MODES),
                    default="off",
                    optional=True,
                    tooltip="Guided steps run the positive and negative pass as one call of batch 2: fewer, larger "
                    "kernels (faster where the GPU is not yet saturated) for twice the activation memory; results "
                    "differ from separate passes only by float rounding. auto: batch when ComfyUI reports the free "
                    "memory for it (the log says which ran and why). off: separate passes, as before.",
                ),
                WanVACEContextWindowsType.Input(
                    "context_windows",
                    optional=True,
                    tooltip="Overlapping context windows from WanVACE Context Windows, for videos longer than one "
                    "window; unconnected = the whole video at once.",
                ),
                io.Sigmas.Input(
                    "sigmas",
                    optional=True,
                    tooltip="A schedule (WanVACE Scheduler, SplitSigmas, custom sigmas) replacing steps, shift and "
                    "the scheduler's curve; the experts switch where it crosses boundary_ratio.",
                ),
                WanVACEGuidanceType.Input(
                    "guidance",
                    optional=True,
                    tooltip="How each expert combines its two predictions (WanVACE Guidance Options); unconnected = "
                    "plain cfg.",
                ),
                io.Sampler.Input(
                    "sampler",
                    optional=True,
                    tooltip="A ComfyUI sampler (KSamplerSelect, SamplerER_SDE, ...) stepping instead of the "
                    "scheduler, over the sigmas input or else the scheduler's own sigmas.",
                ),
            ],
            outputs=[io.Latent.Output(display_name="latent", tooltip="The denoised video latent.")],
        )

    @classmethod
    def validate_inputs(cls, scheduler: str | None = None, batched_cfg: str | None = None) -> bool | str:
        # The combos alone; the numbers keep ComfyUI's range check.
        with Refusal() as refusal:
            if scheduler is not None:
                validate_scheduler(scheduler)
            if batched_cfg is not None:
                validate_batched_cfg(batched_cfg)
        return refusal.message or True

    @classmethod
    def execute(
        cls,
        model,
        conditioning,
        seed: int,
        steps: int,
        cfg: float,
        cfg_low_noise: float,
        boundary_ratio: float,
        shift: float,
        scheduler: str,
        cache=None,
        batched_cfg: str = "off",
        context_windows=None,
        sigmas=None,
        sampler=None,
        guidance=None,
    ) -> io.NodeOutput:
        if sigmas is not None:
            steps = len(sigmas) - 1  # the schedule's own count; the steps widget is for the built-in schedule
        settings = SamplerSettings(
            seed=seed,
            steps=steps,
            cfg=cfg,
            cfg_low_noise=cfg_low_noise,
            boundary_ratio=None if boundary_ratio < 0 else boundary_ratio,
            shift=None if shift <= 0 else shift,
            scheduler=scheduler,
            sigmas=None if sigmas is None else tuple(sigmas.tolist()),
        )
        shift = settings.shift or default_shift(model.scheduler_config)
        stepper = None if sampler is None else stepper_for(sampler, shift)
        preview_step = step_previewer(model, conditioning, steps)

        def on_step(index: int, total: int, denoised) -> None:
            preview_step(index, total, denoised)
            comfy.model_management.throw_exception_if_processing_interrupted()

        comfy.model_management.throw_exception_if_processing_interrupted()
        frames = frames_per_call(
            context_windows, conditioning.conditioning_latents.shape[2], conditioning.num_reference_images
        )
        activation = sampling_activation_bytes(model, frames, conditioning.height, conditioning.width)
        free = free_device_memory(model)
        batched, reason = batched_cfg_decision(model, batched_cfg, activation, free)
        logger.info("WanVACE CFG: %s (%s)", "batched, one call of batch 2" if batched else "separate passes", reason)
        set_working_memory(model, 2 * activation if batched else activation)
        result = sample(
            model,
            conditioning,
            settings,
            callback=on_step,
            cache=cache,
            batched_cfg=batched,
            windows=context_windows,
            between_windows=comfy.model_management.throw_exception_if_processing_interrupted,
            stepper=stepper,
            rules=guidance,
        )
        latent = {"samples": to_vae_space(model, result.latents).cpu()}
        if result.cache_report is None:
            return io.NodeOutput(latent)
        return io.NodeOutput(latent, ui={"text": [result.cache_report.text()]})
