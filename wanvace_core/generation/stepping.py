"""An outside solver stepping the dual-expert denoiser: how ComfyUI's SAMPLER (adapted by the node layer, since the
core never imports ComfyUI) drives `sample`.

The solver sees the model as ComfyUI's samplers see every model, a denoiser `x0 = D(x, sigma)` of the flow-matching
latent `x = (1 - sigma) x0 + sigma noise`; behind it `sample` picks the expert by sigma, runs guidance, VACE, windows,
cache and LoRA as its own loop does, and turns the expert's velocity into `x - sigma * v`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch


class DenoisedParts(NamedTuple):
    """One denoiser call's estimates (fp32): the guided one, the conditional and, where the expert runs a negative
    pass, the unconditional one; and that expert's cfg. What CFG++ solvers recombine."""

    denoised: torch.Tensor
    cond_denoised: torch.Tensor
    uncond_denoised: torch.Tensor | None
    scale: float


class Denoiser(Protocol):
    """`(x, sigma) -> x0`: x fp32 `[1, C, T, h, w]` (reference frames first), sigma a 0-d or `[1]` tensor; x0 fp32.
    With `parts=True`, the call's `DenoisedParts`. `negative_pass_everywhere`: whether every step of the schedule
    runs a negative pass (cfg above 1 on its expert)."""

    negative_pass_everywhere: bool

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, parts: bool = False): ...


StepCallback = Callable[[int, int, torch.Tensor], None]
"""Called after every step with (step index, total steps, the denoised estimate x0 `[1, C, T, h, w]`, reference frames
first); raising stops the run."""


class Stepper(Protocol):
    """A solver that walks a schedule of sigmas with a `Denoiser`."""

    def call_sigmas(self, sigmas: torch.Tensor) -> tuple[float, ...] | None:
        """The sigma of every denoiser call a run over `sigmas` makes, in order, or None where that depends on the
        predictions (an adaptive solver). Step caching needs each expert's call count before the run."""
        ...

    def run(
        self, denoiser: Denoiser, noise: torch.Tensor, sigmas: torch.Tensor, seed: int, on_step: StepCallback
    ) -> torch.Tensor:
        """The clean latents from unit Gaussian `noise` (the run scales it to the first sigma) over `sigmas` (fp32,
        ending at 0). `seed` seeds any noise the solver adds; `on_step` after every step."""
        ...


def step_index_at(sigmas: torch.Tensor, sigma: float) -> int:
    """The schedule step a denoiser call at `sigma` belongs to: the step whose interval `[sigmas[i], sigmas[i+1])`
    holds it (its own sigma within float rounding included), so a solver's intermediate calls (heun, dpm_2) count
    with the step they start from, and an adaptive solver's (dpm_fast) with the step it has reached."""
    reached = (sigmas[:-1] >= float(sigma) * (1.0 - 1e-4)).nonzero()
    return int(reached[-1, 0]) if len(reached) else 0
