"""How one step's prediction is made from an expert: both CFG passes here, or (CFG parallel) each branch on its
own half of the worker devices, combined on both halves."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .conditioning import VACEConditioning


class Guidance:
    """How one step's prediction is made from the expert: cond, then uncond when the scale is above 1.0.

    `sample` asks this for every step; a CFG-parallel run replaces it (`ParallelGuidance`) with one that
    computes each branch on its own devices. Both combine `uncond + scale * (cond - uncond)` in the same order.
    """

    def calls_per_step(self, scale: float) -> int:
        """Expert calls this process makes per step (cache-dit's separate-CFG bookkeeping needs it)."""
        return 2 if scale > 1.0 else 1

    def predict(self, expert, scale: float, cond: VACEConditioning, common: dict) -> torch.Tensor:
        with expert.cache_context("cond"):
            noise_pred = expert(encoder_hidden_states=cond.prompt_embeds, **common)[0]
        if scale > 1.0:
            with expert.cache_context("uncond"):
                noise_uncond = expert(encoder_hidden_states=cond.negative_prompt_embeds, **common)[0]
                noise_pred = noise_uncond + scale * (noise_pred - noise_uncond)
        return noise_pred


class BatchedGuidance(Guidance):
    """Both CFG passes in one expert call of batch 2 (cond first, then uncond), split and combined as `Guidance`
    does: fewer, larger kernels for twice the activation memory. Every input that has a batch dimension is
    doubled; the per-layer VACE scale has none. Cache-dit sees one call per step (one cache state for both)."""

    def calls_per_step(self, scale: float) -> int:
        return 1

    def predict(self, expert, scale: float, cond: VACEConditioning, common: dict) -> torch.Tensor:
        if scale <= 1.0:
            return super().predict(expert, scale, cond, common)
        doubled = {
            name: torch.cat([value, value]) if name in _BATCHED_INPUTS and value is not None else value
            for name, value in common.items()
        }
        texts = torch.cat([cond.prompt_embeds, cond.negative_prompt_embeds])
        with expert.cache_context("cond"):
            noise_pred, noise_uncond = expert(encoder_hidden_states=texts, **doubled)[0].chunk(2)
        return noise_uncond + scale * (noise_pred - noise_uncond)


_BATCHED_INPUTS = ("hidden_states", "timestep", "control_hidden_states")


class ParallelGuidance(Guidance):
    """Branch 0 computes the conditional prediction, branch 1 the unconditional one; peers swap them.

    Both halves then combine `uncond + scale * (cond - uncond)` exactly as one device does, so the latents
    stay identical on every rank. At scale 1.0 there is no unconditional branch: both halves compute the
    conditional prediction (the same numbers, no exchange needed).
    """

    def __init__(self, branch: int, peers: dist.ProcessGroup) -> None:
        self.branch = branch
        self.peers = peers

    def calls_per_step(self, scale: float) -> int:
        return 1

    def predict(self, expert, scale: float, cond: VACEConditioning, common: dict) -> torch.Tensor:
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
        noise_pred, noise_uncond = (tensor.to(mine.device) for tensor in both)
        return noise_uncond + scale * (noise_pred - noise_uncond)
