"""WanVACEScheduler: ComfyUI's sigma schedules (simple, beta, karras, ...) for the WanVACE model, as SIGMAS."""

from __future__ import annotations

import comfy.samplers
import torch
from comfy_api.v0_0_2 import io

from ..wanvace_core.errors import WanVACEInputError
from ..wanvace_core.runtime.model import default_shift
from .comfy_sampling import flow_model_sampling
from .inputs import MODEL_SHIFT, fraction_input, shift_input
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
                WanVACEModelType.Input("model", tooltip="The pipeline from a WanVACE loader (for its shift)."),
                io.Combo.Input(
                    "scheduler",
                    options=list(comfy.samplers.SCHEDULER_NAMES),
                    default="simple",
                    tooltip="ComfyUI's sigma curve; simple is ComfyUI's Wan default.",
                ),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip="Denoising steps; 20-40 is typical."),
                shift_input(0.01),
                fraction_input("denoise", 1.0, "Share of the schedule to run, from its low-noise end (1.0 = all)."),
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
        model_sampling = flow_model_sampling(default_shift(model.scheduler_config) if shift <= MODEL_SHIFT else shift)
        sigmas = comfy.samplers.calculate_sigmas(model_sampling, scheduler, total_steps).cpu()[-(steps + 1) :]
        if not bool(torch.isfinite(sigmas).all()):
            # ComfyUI's kl_optimal divides by steps - 1.
            raise WanVACEInputError(
                f"scheduler={scheduler!r} with steps={steps} gives a schedule with NaN in ComfyUI "
                f"({[round(float(sigma), 4) for sigma in sigmas[:6]]}); use more steps or another scheduler."
            )
        return io.NodeOutput(sigmas)
