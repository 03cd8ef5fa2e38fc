"""How one step's prediction is made from an expert: both CFG passes here, or (CFG parallel) each branch on its
own half of the worker devices; and how the two are combined (plain CFG, CFG-Zero*, APG), once, on the whole video.

The combination rules, each checked against an outside formula in tests/test_guidance.py:
- plain CFG: `uncond + scale * (cond - uncond)`.
- CFG-Zero* (Fan et al. 2025, arXiv 2503.18886, Eq. 6-8, the form diffusers' `ClassifierFreeZeroStarGuidance`
  computes): the unconditional velocity is first scaled by `alpha = <cond, uncond> / |uncond|^2` (per sample), and
  the first `zero_init_steps` steps predict zero velocity.
- TCFG (Kwon et al. 2025, arXiv 2503.18137, as diffusers' `TangentialClassifierFreeGuidance`): the unconditional
  velocity keeps only its part along the first right-singular vector of the two stacked predictions.
- APG (Sadat et al. 2024, arXiv 2410.02416, Alg. 1, as ComfyUI's APG node and diffusers' `normalized_guidance` with
  `use_original_formulation`): on the denoised estimates `x0 = x - sigma v`, the guidance difference is
  accumulated with `momentum`, clamped to `norm_threshold`, split into its parts parallel and orthogonal to the
  conditional estimate (norms over each channel's frames, height and width), the parallel part weighted by `eta`,
  and added `scale` times to the conditional estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import WanVACEInputError
from ..runtime.attention_guidance import NAGOptions, SkipLayerOptions
from ..validation import validate_finite, validate_integer
from .conditioning import VACEConditioning


@dataclass(frozen=True)
class APGOptions:
    """Adaptive projected guidance for one expert."""

    eta: float = 1.0
    norm_threshold: float = 5.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        validate_finite("apg_eta", self.eta, "use a value like 1.0 (0 drops the parallel part)")
        threshold = validate_finite("apg_norm_threshold", self.norm_threshold, "use 0 (off) or a value like 5.0")
        if threshold < 0:
            raise WanVACEInputError(f"apg_norm_threshold={self.norm_threshold} must be 0 (no clamp) or positive.")
        momentum = validate_finite("apg_momentum", self.momentum, "use a value in [-1, 1), like -0.5, or 0 (off)")
        if not -1.0 <= momentum < 1.0:
            raise WanVACEInputError(f"apg_momentum={self.momentum} must lie in [-1, 1); 0 turns momentum off.")


@dataclass(frozen=True)
class ExpertGuidance:
    """How one expert's two predictions combine; the defaults are plain CFG."""

    cfg_zero_star: bool = False
    zero_init_steps: int = 0
    apg: APGOptions | None = None
    tcfg: bool = False

    def __post_init__(self) -> None:
        steps = validate_integer("zero_init_steps", self.zero_init_steps, "use a whole number, 0 or more (1 typical)")
        if steps < 0:
            raise WanVACEInputError(f"zero_init_steps={self.zero_init_steps} must be 0 or more.")
        if sum((self.cfg_zero_star, self.apg is not None, self.tcfg)) > 1:
            raise WanVACEInputError(
                "more than one of CFG-Zero*, APG and TCFG is on for one expert; they are different rules for the "
                "same combination: keep one."
            )

    @property
    def plain(self) -> bool:
        return not self.cfg_zero_star and self.apg is None and not self.tcfg and self.zero_init_steps == 0

    @classmethod
    def from_plain(cls, fields: dict) -> ExpertGuidance:
        apg = fields.get("apg")
        return cls(**{**fields, "apg": None if apg is None else APGOptions(**apg)})


@dataclass(frozen=True)
class GuidanceOptions:
    """The guidance of both experts (a single-expert model uses `high_noise`), and the guidance inside the experts:
    NAG on the experts that run at cfg 1, SLG on those with a negative pass, RIFLEx's component (0 = off) on both."""

    high_noise: ExpertGuidance = field(default_factory=ExpertGuidance)
    low_noise: ExpertGuidance = field(default_factory=ExpertGuidance)
    nag: NAGOptions | None = None
    slg: SkipLayerOptions | None = None
    riflex_index: int = 0

    def __post_init__(self) -> None:
        index = validate_integer("riflex_index", self.riflex_index, "use 0 (off), -1 (auto) or a component like 6")
        if index < -1:
            raise WanVACEInputError(
                f"riflex_index={self.riflex_index} must be 0 (off), -1 (from the frame count) or a component like 6."
            )

    @classmethod
    def from_plain(cls, fields: dict) -> GuidanceOptions:
        nag = fields.get("nag")
        return cls(
            high_noise=ExpertGuidance.from_plain(fields["high_noise"]),
            low_noise=ExpertGuidance.from_plain(fields["low_noise"]),
            nag=None if nag is None else NAGOptions(**nag),
            slg=None if fields.get("slg") is None else SkipLayerOptions(**fields["slg"]),
            riflex_index=fields.get("riflex_index", 0),
        )


def combine(
    rule: ExpertGuidance,
    running: dict[str, torch.Tensor],
    expert: str,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    scale: float,
    step: int,
    latents: torch.Tensor,
    sigma: torch.Tensor,
) -> torch.Tensor:
    """The guided velocity from the two velocities of one step of `expert` (`latents` and `sigma` for the rules that
    work on the denoised estimate). `running` is what a rule keeps between one run's steps (APG's momentum)."""
    if rule.plain:
        return uncond + scale * (cond - uncond)
    if step < rule.zero_init_steps:
        return torch.zeros_like(cond)
    if rule.cfg_zero_star:
        return _cfg_zero_star(cond, uncond, scale)
    if rule.tcfg:
        return _tcfg(cond, uncond, scale)
    if rule.apg is not None:
        return _apg(rule.apg, running, expert, cond, uncond, scale, latents, sigma)
    return uncond + scale * (cond - uncond)


def _cfg_zero_star(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    flat_cond, flat_uncond = cond.flatten(1).float(), uncond.flatten(1).float()
    alpha = (flat_cond * flat_uncond).sum(1, keepdim=True) / (flat_uncond.pow(2).sum(1, keepdim=True) + 1e-8)
    alpha = alpha.view(-1, *([1] * (cond.dim() - 1))).to(uncond.dtype)
    uncond = uncond * alpha
    return uncond + scale * (cond - uncond)


def _tcfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    stacked = torch.stack([cond, uncond], dim=1).float().flatten(2)
    _, _, right = torch.linalg.svd(stacked, full_matrices=False)
    first = right[:, :1]
    flat_uncond = uncond.reshape(uncond.shape[0], 1, -1).float()
    uncond = ((flat_uncond @ first.transpose(-2, -1)) @ first).reshape(uncond.shape).to(cond.dtype)
    return uncond + scale * (cond - uncond)


def _apg(options, running, key, cond, uncond, scale, latents, sigma) -> torch.Tensor:
    sigma = sigma.to(latents.device, torch.float32)
    cond_x0 = latents - sigma * cond.float()
    uncond_x0 = latents - sigma * uncond.float()
    difference = cond_x0 - uncond_x0
    if options.momentum != 0.0:
        previous = running.get(key)
        difference = difference if previous is None else options.momentum * previous + difference
        running[key] = difference
    dims = (-1, -2, -3)  # each channel over frames, height and width
    if options.norm_threshold > 0:
        norm = difference.norm(p=2, dim=dims, keepdim=True)
        difference = difference * torch.minimum(torch.ones_like(norm), options.norm_threshold / norm)
    unit = torch.nn.functional.normalize(cond_x0.double(), dim=dims)
    parallel = (difference.double() * unit).sum(dim=dims, keepdim=True) * unit
    orthogonal = difference.double() - parallel
    update = (orthogonal + options.eta * parallel).to(cond_x0.dtype)
    guided_x0 = cond_x0 + scale * update
    return ((latents - guided_x0) / sigma).to(cond.dtype)


class Guidance:
    """How one step's predictions are made from the expert: cond, then uncond when the scale is above 1.0.

    `sample` asks this for every step and combines the two (`combine`); a CFG-parallel run replaces it
    (`ParallelGuidance`) with one that computes each branch on its own devices.
    """

    def calls_per_step(self, scale: float) -> int:
        """Expert calls this process makes per step (cache-dit's separate-CFG bookkeeping needs it)."""
        return 2 if scale > 1.0 else 1

    def predict(self, expert, scale: float, cond: VACEConditioning, common: dict) -> torch.Tensor:
        """The plain-CFG prediction (`branches`, combined)."""
        both = self.branches(expert, scale, cond, common)
        if scale <= 1.0:
            return both
        noise_pred, noise_uncond = both.chunk(2)
        return noise_uncond + scale * (noise_pred - noise_uncond)

    def branches(self, expert, scale: float, cond: VACEConditioning, common: dict) -> torch.Tensor:
        """The conditional prediction, and (scale above 1.0) the unconditional one after it on the batch dim."""
        with expert.cache_context("cond"):
            noise_pred = expert(encoder_hidden_states=cond.prompt_embeds, **common)[0]
        if scale <= 1.0:
            return noise_pred
        with expert.cache_context("uncond"):
            noise_uncond = expert(encoder_hidden_states=cond.negative_prompt_embeds, **common)[0]
        return torch.cat([noise_pred, noise_uncond])


class BatchedGuidance(Guidance):
    """Both CFG passes in one expert call of batch 2 (cond first, then uncond), split and combined as `Guidance`
    does: fewer, larger kernels for twice the activation memory. Every input that has a batch dimension is
    doubled; the per-layer VACE scale has none. Cache-dit sees one call per step (one cache state for both)."""

    def calls_per_step(self, scale: float) -> int:
        return 1

    def branches(self, expert, scale: float, cond: VACEConditioning, common: dict) -> torch.Tensor:
        if scale <= 1.0:
            return super().branches(expert, scale, cond, common)
        doubled = {
            name: torch.cat([value, value]) if name in _BATCHED_INPUTS and value is not None else value
            for name, value in common.items()
        }
        texts = torch.cat([cond.prompt_embeds, cond.negative_prompt_embeds])
        with expert.cache_context("cond"):
            return expert(encoder_hidden_states=texts, **doubled)[0]


_BATCHED_INPUTS = ("hidden_states", "timestep", "control_hidden_states")


class ParallelGuidance(Guidance):
    """Branch 0 computes the conditional prediction, branch 1 the unconditional one; peers swap them.

    Both halves then hold both predictions and combine them exactly as one device does, so the latents stay
    identical on every rank. At scale 1.0 there is no unconditional branch: both halves compute the
    conditional prediction (the same numbers, no exchange needed).
    """

    def __init__(self, branch: int, peers: dist.ProcessGroup) -> None:
        self.branch = branch
        self.peers = peers

    def calls_per_step(self, scale: float) -> int:
        return 1

    def branches(self, expert, scale: float, cond: VACEConditioning, common: dict) -> torch.Tensor:
        if scale <= 1.0 or self.branch == 0:
            with expert.cache_context("cond"):
                mine = expert(encoder_hidden_states=cond.prompt_embeds, **common)[0]
        else:
            with expert.cache_context("uncond"):
                mine = expert(encoder_hidden_states=cond.negative_prompt_embeds, **common)[0]
        if scale <= 1.0:
            return mine
        # The pair group is gloo (CPU tensors) whatever the compute device: see wanvace_core.worker.
        local = mine.to("cpu")
        both = [torch.empty_like(local), torch.empty_like(local)]
        self.peers.allgather([both], [local]).wait()
        return torch.cat(both).to(mine.device)
