"""The built-in noise schedules and solvers: diffusers' flow-matching schedulers, one fresh per run.

A schedule here is a scheduler object set to a run's steps (or to a given list of sigmas, ComfyUI's SIGMAS), and
its timesteps (`sigma * num_train_timesteps`). Every scheduler runs in flow-matching mode (`x_t = (1 - sigma) x0 +
sigma noise`, the expert predicts the velocity), so the denoised estimate at a step is `x_t - sigma * v`.
"""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import torch
from diffusers import (
    DEISMultistepScheduler,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchLCMScheduler,
    UniPCMultistepScheduler,
)

from ..errors import WanVACEInputError
from ..runtime.model import default_shift

SCHEDULERS = ("unipc", "euler", "dpm++", "dpm++_sde", "deis", "lcm", "distill")
"""unipc: the model's own (UniPC multistep). euler: flow-matching Euler (ComfyUI's `normal` curve). dpm++ / dpm++_sde:
DPM-Solver++ 2M, deterministic / SDE. deis: DEIS multistep. lcm: flow-matching LCM (re-noises after every step).
distill: Euler on the evenly spaced timesteps 1000, 1000 - 1000/steps, ... shifted once, the schedule the 4-step
lightx2v Wan2.2 distillations were trained on (1000/750/500/250 at shift 5 = ComfyUI's `simple` curve)."""

# The schedulers that draw fresh noise in `step` (from a generator seeded from the run's seed).
STOCHASTIC_SCHEDULERS = ("dpm++_sde", "lcm")


def validate_scheduler(name: str) -> None:
    if name not in SCHEDULERS:
        raise WanVACEInputError(f"scheduler={name!r} is unknown; choose one of {', '.join(SCHEDULERS)}.")


def validate_sigmas(sigmas) -> tuple[float, ...]:
    """A SIGMAS schedule as a tuple of floats: at least two, finite, strictly decreasing from at most 1 to 0."""
    values = tuple(float(value) for value in sigmas)
    if len(values) < 2:
        raise WanVACEInputError(
            f"sigmas has {len(values)} value(s); a schedule needs at least 2 (one step from the first sigma to 0). "
            "Check the scheduler node's steps and denoise (denoise 0 gives an empty schedule)."
        )
    if not all(np.isfinite(values)):
        raise WanVACEInputError(f"sigmas {list(values)} holds a NaN or an infinity; connect a finite schedule.")
    if any(later >= earlier for earlier, later in itertools.pairwise(values)):
        raise WanVACEInputError(
            f"sigmas {_shown(values)} must fall strictly at every step (FlipSigmas or a custom list in the wrong "
            "order gives a rising schedule); connect a schedule that falls from noise to 0."
        )
    if values[0] > 1.0 + 1e-6:
        raise WanVACEInputError(
            f"sigmas start at {values[0]:.4g}, above 1.0, the pure-noise end of a flow-matching model; use a schedule "
            "made for this model (WanVACE Scheduler)."
        )
    if values[-1] != 0.0:
        raise WanVACEInputError(
            f"sigmas end at {values[-1]:.4g}, not 0: the sampler would return a still-noisy video. Connect the whole "
            "schedule, or SplitSigmas' low half (which ends at 0)."
        )
    return values


def _shown(values: tuple[float, ...]) -> str:
    text = ", ".join(f"{value:.4g}" for value in values[:6])
    return f"[{text}{', ...' if len(values) > 6 else ''}]"


def scheduler_from_config(scheduler_config: dict, name: str, shift: float | None):
    """A fresh flow-matching scheduler (schedulers are stateful: one per run) for a pipeline's scheduler config
    (`shift` None: the config's)."""
    shift = default_shift(scheduler_config) if shift is None else shift
    num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
    flow = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": shift}
    if name == "unipc":
        config = dict(scheduler_config)
        if config.get("_class_name") != "UniPCMultistepScheduler":
            config = {"num_train_timesteps": num_train_timesteps}
        config.update(flow)
        return UniPCMultistepScheduler.from_config(config)
    if name in ("dpm++", "dpm++_sde"):
        algorithm = "dpmsolver++" if name == "dpm++" else "sde-dpmsolver++"
        return DPMSolverMultistepScheduler(
            num_train_timesteps=num_train_timesteps, algorithm_type=algorithm, solver_order=2, **flow
        )
    if name == "deis":
        return DEISMultistepScheduler(num_train_timesteps=num_train_timesteps, **flow)
    if name == "lcm":
        return FlowMatchLCMScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)


def takes_sigmas(name: str) -> bool:
    """Whether this scheduler can step a given list of sigmas (diffusers' `set_timesteps(sigmas=...)`)."""
    if name == "distill":
        return False
    return "sigmas" in inspect.signature(type(scheduler_from_config({}, name, 1.0)).set_timesteps).parameters


def timesteps_for(scheduler_config: dict, settings, device: torch.device | str = "cpu"):
    """A fresh scheduler set to `settings` (its steps, or its `sigmas`), and its timesteps; refuses a schedule that
    repeats timesteps. Works from a scheduler config alone (the offline command checks before it loads a model).

    diffusers finds a scheduler's position from the timestep value, so a repeated timestep (a large
    shift pushes the first ones onto 999, a tiny one the last ones onto 0) makes UniPC fail a bare
    `assert` on its last step, Euler raise an IndexError, or silently step with the wrong sigmas.
    """
    if settings.sigmas is not None:
        if not takes_sigmas(settings.scheduler):
            usable = ", ".join(name for name in SCHEDULERS if takes_sigmas(name))
            raise WanVACEInputError(
                f"scheduler={settings.scheduler!r} cannot step a given list of sigmas with this diffusers; set the "
                f"scheduler to one of {usable}, or connect a SAMPLER (KSamplerSelect) to step them."
            )
        # The sigmas are the schedule as given: diffusers shifts what it is handed, and a shift of 1 is the identity.
        scheduler = scheduler_from_config(scheduler_config, settings.scheduler, 1.0)
        scheduler.set_timesteps(sigmas=np.array(settings.sigmas[:-1], dtype=np.float64), device=device)
    elif settings.scheduler == "distill":
        scheduler = scheduler_from_config(scheduler_config, settings.scheduler, settings.shift)
        evenly_spaced = np.linspace(1.0, 1.0 / settings.steps, settings.steps)
        scheduler.set_timesteps(sigmas=evenly_spaced, device=device)
    else:
        scheduler = scheduler_from_config(scheduler_config, settings.scheduler, settings.shift)
        scheduler.set_timesteps(settings.steps, device=device)
    timesteps = scheduler.timesteps
    if len(timesteps) != settings.steps or bool((timesteps[1:] >= timesteps[:-1]).any()):
        shift = (
            f"shift={settings.shift}"
            if settings.shift is not None
            else f"shift=None (the model's {default_shift(scheduler_config)})"
        )
        distinct = len(torch.unique(timesteps))
        raise WanVACEInputError(
            f"{shift} with steps={settings.steps} makes the {settings.scheduler} scheduler repeat timesteps "
            f"({distinct} distinct of {settings.steps}); use a shift nearer 3.0 (480p) or 5.0 (720p), or fewer steps."
        )
    return scheduler, timesteps


def step_sigmas(scheduler) -> torch.Tensor:
    """The sigma at every step of a set scheduler, then the final one (fp32, on the CPU)."""
    return scheduler.sigmas.detach().to("cpu", torch.float32)
