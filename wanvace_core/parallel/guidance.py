"""CFG parallel: each branch's prediction on its own half of the devices, combined on both halves."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..conditioning import VACEConditioning
from ..sampling import Guidance


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
        # The pair group is gloo (CPU tensors) whatever the compute device: see parallel.rank.
        local = mine.to("cpu")
        both = [torch.empty_like(local), torch.empty_like(local)]
        self.peers.allgather([both], [local]).wait()
        noise_pred, noise_uncond = (tensor.to(mine.device) for tensor in both)
        return noise_uncond + scale * (noise_pred - noise_uncond)
