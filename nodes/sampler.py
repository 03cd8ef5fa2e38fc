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
from .comfy_sampling import stepper_for
from .inputs import MODEL_SHIFT, float_input, shift_input
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

MODEL_DEFAULT = -1.0  # a boundary_ratio of -1 means the model's own
CFG_RANGE = (1.0, 30.0)
BATCHED_CFG_OFF = "off"  # also what prompts saved before the input get
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
                WanVACEModelType.Input("model", tooltip="The pipeline from a WanVACE loader."),
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
                float_input(
                    "cfg",
                    5.0,
                    CFG_RANGE,
                    0.1,
                    "Guidance of the high-noise expert (and of a Wan2.1 model); 1.0 skips the negative pass.",
                ),
                float_input(
                    "cfg_low_noise",
                    5.0,
                    CFG_RANGE,
                    0.1,
                    "Guidance of the low-noise expert; 1.0 skips its negative pass.",
                ),
                float_input(
                    "boundary_ratio",
                    MODEL_DEFAULT,
                    (-1.0, 1.0),
                    0.005,
                    "Expert switch point as a fraction of 1000 timesteps; -1 uses the model's (0.875 for Wan2.2).",
                    display_name="boundary_ratio (-1 = model's)",
                ),
                shift_input(0.1),
                io.Combo.Input(
                    "scheduler",
                    options=list(SCHEDULERS),
                    default=SamplerSettings.scheduler,
                    tooltip="unipc is the model's own; distill is the 4-step lightx2v schedule (use shift 5).",
                ),
                WanVACECacheType.Input(
                    "cache", optional=True, tooltip="Step caching from WanVACE Cache Options; unconnected = none."
                ),
                io.Combo.Input(
                    "batched_cfg",
                    options=list(BATCHED_CFG_MODES),
                    default=BATCHED_CFG_OFF,
                    optional=True,
                    tooltip="Run the positive and negative pass as one call of batch 2 (twice the activation memory).",
                ),
                WanVACEContextWindowsType.Input(
                    "context_windows",
                    optional=True,
                    tooltip="From WanVACE Context Windows, for videos longer than one window.",
                ),
                io.Sigmas.Input(
                    "sigmas",
                    optional=True,
                    tooltip="A schedule (WanVACE Scheduler, SplitSigmas, ...) replacing steps, shift and scheduler.",
                ),
                WanVACEGuidanceType.Input(
                    "guidance", optional=True, tooltip="From WanVACE Guidance Options; unconnected = plain cfg."
                ),
                io.Sampler.Input(
                    "sampler",
                    optional=True,
                    tooltip="A ComfyUI sampler (KSamplerSelect, ...) stepping instead of the scheduler.",
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
        batched_cfg: str = BATCHED_CFG_OFF,
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
            shift=None if shift <= MODEL_SHIFT else shift,
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
