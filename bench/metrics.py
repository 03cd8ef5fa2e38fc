"""Comparisons the cache tests and benchmarks make of results."""

from __future__ import annotations

import torch

from wanvace_core.runtime.caching import CacheOptions, CacheReport


def expected_block_calls(report: CacheReport, options: CacheOptions, num_layers: int) -> dict[str, int]:
    """Main-block calls per expert implied by a report: full passes run every block, cached ones Fn + Bn."""
    calls = {}
    for expert in report.experts:
        passes = expert.steps + expert.cfg_steps
        cached = len(expert.cached_steps) + len(expert.cfg_cached_steps)
        calls[expert.expert] = (passes - cached) * num_layers + cached * (
            options.Fn_compute_blocks + options.Bn_compute_blocks
        )
    return calls


def psnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of `other` against `reference`, in dB, peak = max |reference|."""
    mse = torch.mean((reference.float() - other.float()) ** 2)
    if mse == 0:
        return float("inf")
    return float(10 * torch.log10(reference.float().abs().max() ** 2 / mse))


def count_block_calls(model):
    """Forward calls of every main block and VACE block of both experts."""
    counts = {}
    handles = []
    for attribute, name in (("transformer", "high-noise"), ("transformer_2", "low-noise")):
        expert = getattr(model, attribute)
        for list_name in ("blocks", "vace_blocks"):
            key = (name, list_name)
            counts[key] = 0
            for block in getattr(expert, list_name):

                def hook(*_args, _key=key):
                    counts[_key] += 1

                handles.append(block.register_forward_pre_hook(hook))
    return counts, handles
