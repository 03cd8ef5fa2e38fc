"""Our APG and TCFG against ComfyUI's own APG and TCFG nodes (comfy_extras, both versions), on the same predictions.

ComfyUI's nodes patch a model with a pre-CFG function that rewrites the denoised estimates before its
`uncond + cfg * (cond - uncond)`; the test takes that function from the node (a model patcher that only records it),
feeds it the estimates `x - sigma * v` of random velocities over three falling sigmas, and compares its result with
`x - sigma * v_guided` from our `combine`. `guidance_node_cases` runs in test_comfy_sampling.py's subprocess inside
the ComfyUI tree; `check_rule` is that module's test.
"""

from __future__ import annotations

import torch

from tests.support.in_comfyui import relative

SHAPE = (1, 16, 3, 6, 8)
SIGMAS = (0.95, 0.8, 0.6)
SCALE = 4.0
APG_CASES = ((1.0, 5.0, 0.0), (0.0, 2.0, -0.5), (0.5, 0.0, 0.3))  # eta, norm_threshold, momentum
# APG: ComfyUI projects in fp32, ours in float64 (as diffusers): 1.95e-7 measured in both sets. TCFG: both take an fp32
# SVD, ComfyUI's of the sigma-scaled velocities in the other row order; the singular vector's rounding, amplified by
# the scale: 1.24e-5 measured (0.33). Rounding only.
RTOL = {"apg": 1e-5, "tcfg": 1e-4}


class _RecordingPatcher:
    """What ComfyUI's guidance nodes do with a model: clone it and set a pre-CFG function."""

    def clone(self):
        return self

    def set_model_sampler_pre_cfg_function(self, function, disable_cfg1_optimization=False):
        self.pre_cfg = function


def _comfy_combined(pre_cfg, cond_x0, uncond_x0, x, sigma):
    args = {
        "conds_out": [cond_x0, uncond_x0],
        "conds": [object(), object()],
        "cond_scale": SCALE,
        "sigma": torch.tensor([sigma]),
        "input": x,
        "timestep": torch.tensor([sigma]),
    }
    cond_x0, uncond_x0 = pre_cfg(args)[:2]
    return uncond_x0 + SCALE * (cond_x0 - uncond_x0)  # ComfyUI's cfg_function without a sampler_cfg_function


def guidance_node_cases() -> dict:
    """Ours against ComfyUI's node for each case: {(rule, case, step): (ours, ComfyUI's, plain CFG)}."""
    from comfy_extras.nodes_apg import APG
    from comfy_extras.nodes_tcfg import TCFG
    from wanvace_pack.wanvace_core.generation.guidance import APGOptions, ExpertGuidance, combine

    generator = torch.Generator().manual_seed(0)
    found = {}
    for case in APG_CASES:
        patcher = _RecordingPatcher()
        APG.execute(patcher, *case)
        rule, running = ExpertGuidance(apg=APGOptions(*case)), {}
        for step, sigma in enumerate(SIGMAS):
            cond, uncond, x = (torch.randn(SHAPE, generator=generator) for _ in range(3))
            theirs = _comfy_combined(patcher.pre_cfg, x - sigma * cond, x - sigma * uncond, x, sigma)
            ours = combine(rule, running, "transformer", cond, uncond, SCALE, step, x, torch.tensor(sigma))
            found[("apg", case, step)] = (x - sigma * ours, theirs, x - sigma * (uncond + SCALE * (cond - uncond)))
    patcher = _RecordingPatcher()
    TCFG.execute(patcher)
    for step, sigma in enumerate(SIGMAS):
        cond, uncond, x = (torch.randn(SHAPE, generator=generator) for _ in range(3))
        theirs = _comfy_combined(patcher.pre_cfg, x - sigma * cond, x - sigma * uncond, x, sigma)
        ours = combine(ExpertGuidance(tcfg=True), {}, "transformer", cond, uncond, SCALE, step, x, torch.tensor(sigma))
        found[("tcfg", None, step)] = (x - sigma * ours, theirs, x - sigma * (uncond + SCALE * (cond - uncond)))
    return found


def check_rule(rule: str, found: dict) -> None:
    cases = {key: value for key, value in found.items() if key[0] == rule}
    assert len(cases) == (len(APG_CASES) if rule == "apg" else 1) * len(SIGMAS)
    errors = {key: relative(ours, theirs) for key, (ours, theirs, _) in cases.items()}
    assert max(errors.values()) < RTOL[rule], errors
    for key, (_, theirs, plain) in cases.items():
        assert relative(plain, theirs) > 100 * RTOL[rule], (
            key
        )  # the rule changed the result: the comparison means something
