"""WanVACEScheduler: ComfyUI's sigma schedules (simple, beta, karras, ...) for the WanVACE model, as SIGMAS."""

from __future__ import annotations

import comfy.samplers
import torch
from comfy_api.v0_0_2 import io

from ..wanvace_core.errors import WanVACEInputError
from ..wanvace_core.runtime.model import default_shift
from ..wanvace_core.validation import nan_refusing_min
from .comfy_sampling import flow_model_sampling
from .refusals import Refusal, check_choice
from .types import CATEGORY, WanVACEModelType


class WanVACEScheduler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEScheduler",
            display_name="WanVACE Scheduler",
            category=CATEGORY,
            description=(
                "ComfyUI's BasicScheduler for the WanVACE model: the sigmas of a ComfyUI schedule for a shifted "
                "flow-matching model (what ModelSamplingSD3 at this shift gives a native Wan model). Connect to "
                "WanVACE Sampler's sigmas input, or through SplitSigmas and other sigma nodes."
            ),
            inputs=[
                WanVACEModelType.Input("model", tooltip="The pipeline from WanVACE Model Loader (for its shift)."),
                io.Combo.Input(
                    "scheduler",
                    options=list(comfy.samplers.SCHEDULER_NAMES),
                    default="simple",
                    tooltip="ComfyUI's sigma curve. simple: even steps of the shifted schedule (ComfyUI's Wan "
                    "default); normal: what the built-in euler scheduler uses.",
                ),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip="Denoising steps; 20-40 is typical."),
                io.Float.Input(
                    "shift",
                    display_name="shift (0 = model's)",
                    default=0.0,
                    min=nan_refusing_min(0.0),
                    max=100.0,
                    step=0.01,
                    tooltip="Flow-matching sigma shift, as ModelSamplingSD3's. 0 uses the model's scheduler value "
                    "(3.0); ComfyUI's Wan templates use 8.0.",
                ),
                io.Float.Input(
                    "denoise",
                    default=1.0,
                    min=nan_refusing_min(0.0),
                    max=1.0,
                    step=0.01,
                    tooltip="Fraction of the schedule to run, from its low-noise end (BasicScheduler's denoise). "
                    "1.0 runs it all.",
                ),
            ],
            outputs=[io.Sigmas.Output(display_name="sigmas", tooltip="The schedule, from the first sigma to 0.")],
        )

    @classmethod
    def validate_inputs(cls, scheduler: str | None = None) -> bool | str:
        with Refusal() as refusal:
            if scheduler is not None:
                check_choice("scheduler", scheduler, comfy.samplers.SCHEDULER_NAMES)
        return refusal.message or True

    @classmethod
    def execute(cls, model, scheduler: str, steps: int, shift: float, denoise: float) -> io.NodeOutput:
        if denoise <= 0.0:
            return io.NodeOutput(torch.FloatTensor([]))  # as BasicScheduler: nothing to denoise
        # BasicScheduler's denoise: the last `steps` of a schedule stretched to steps / denoise.
        total_steps = steps if denoise >= 1.0 else int(steps / denoise)
        model_sampling = flow_model_sampling(default_shift(model.scheduler_config) if shift <= 0 else shift)
        sigmas = comfy.samplers.calculate_sigmas(model_sampling, scheduler, total_steps).cpu()[-(steps + 1) :]
        if not bool(torch.isfinite(sigmas).all()):
            # ComfyUI's kl_optimal divides by steps - 1.
            raise WanVACEInputError(
                f"scheduler={scheduler!r} with steps={steps} gives a schedule with NaN in ComfyUI "
                f"({[round(float(sigma), 4) for sigma in sigmas[:6]]}); use more steps or another scheduler."
            )
        return io.NodeOutput(sigmas)
