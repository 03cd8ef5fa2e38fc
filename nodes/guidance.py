"""WanVACEGuidanceOptions: how each expert combines its two predictions, NAG and RIFLEx, for WanVACESampler's
`guidance` input."""

from __future__ import annotations

import dataclasses

from comfy_api.v0_0_2 import io

from ..wanvace_core import WanVACEInputError
from ..wanvace_core.generation.guidance import APGOptions, ExpertGuidance, GuidanceOptions
from ..wanvace_core.runtime.attention_guidance import NAGOptions, SkipLayerOptions
from ..wanvace_core.validation import nan_refusing_min
from .refusals import Refusal, check_choice
from .types import CATEGORY, WanVACEGuidanceType

RULES = ("cfg", "cfg_zero_star", "apg", "tcfg")
EXPERTS = ("both", "high_noise", "low_noise")


def expert_guidance(rule: str, zero_init_steps: int, apg_eta: float, apg_norm_threshold: float, apg_momentum: float):
    check_choice("rule", rule, RULES)
    apg = APGOptions(apg_eta, apg_norm_threshold, apg_momentum) if rule == "apg" else None
    return ExpertGuidance(
        cfg_zero_star=rule == "cfg_zero_star", zero_init_steps=zero_init_steps, apg=apg, tcfg=rule == "tcfg"
    )


def skip_layers(blocks: str, start_percent: float, end_percent: float, scale: float = 0.0) -> SkipLayerOptions | None:
    """SLG from the node's text of block indices ("" = off)."""
    names = [name.strip() for name in blocks.split(",") if name.strip()]
    if not names:
        return None
    if not all(name.isdigit() for name in names):
        raise WanVACEInputError(f"slg_blocks={blocks!r} must list block indices separated by commas, like 9 or 8,9.")
    return SkipLayerOptions(tuple(int(name) for name in names), start_percent, end_percent, scale)


class WanVACEGuidanceOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEGuidanceOptions",
            display_name="WanVACE Guidance Options",
            category=CATEGORY,
            description=(
                "How an expert combines its positive and negative predictions at cfg above 1 (cfg, CFG-Zero*, APG, "
                "TCFG), SLG, NAG for experts at cfg 1, and RIFLEx for long videos. Chain two for different rules "
                "per expert: the later one overrides the experts it names."
            ),
            inputs=[
                io.Combo.Input(
                    "rule",
                    options=list(RULES),
                    default="cfg",
                    tooltip="cfg: plain guidance. cfg_zero_star: CFG-Zero* (less over-saturation at high cfg). "
                    "apg: adaptive projected guidance on the denoised estimate, as ComfyUI's APG node. tcfg: "
                    "tangential damping of the negative prediction.",
                ),
                io.Combo.Input("experts", options=list(EXPERTS), default="both", tooltip="The experts it applies to."),
                io.Int.Input(
                    "zero_init_steps",
                    default=0,
                    min=0,
                    max=200,
                    tooltip="First steps that predict zero velocity (CFG-Zero*'s zero-init; 1 is typical; 0 = off).",
                ),
                io.Float.Input(
                    "apg_eta",
                    default=1.0,
                    min=nan_refusing_min(0.0),
                    max=1.0,
                    step=0.01,
                    tooltip="APG: weight of the guidance parallel to the prediction (0 drops it).",
                ),
                io.Float.Input(
                    "apg_norm_threshold",
                    default=5.0,
                    min=nan_refusing_min(0.0),
                    max=50.0,
                    step=0.1,
                    tooltip="APG: largest guidance norm per channel; 0 = no clamp.",
                ),
                io.Float.Input(
                    "apg_momentum",
                    default=0.0,
                    min=nan_refusing_min(-1.0),
                    max=0.99,
                    step=0.01,
                    tooltip="APG: running average of the guidance over steps (-0.5 in the paper; 0 = off).",
                ),
                io.Float.Input(
                    "nag_scale",
                    default=1.0,
                    min=nan_refusing_min(1.0),
                    max=50.0,
                    step=0.1,
                    tooltip="NAG: the negative prompt for experts at cfg 1 (Lightning LoRAs), applied in "
                    "cross-attention; 11 is typical, 1 = off.",
                ),
                io.Float.Input(
                    "nag_tau",
                    default=2.5,
                    min=nan_refusing_min(1.01),
                    max=10.0,
                    step=0.01,
                    tooltip="NAG: the most the guided attention's norm may grow over the prompt's (2.5 typical).",
                ),
                io.Float.Input(
                    "nag_alpha",
                    default=0.25,
                    min=nan_refusing_min(0.0),
                    max=1.0,
                    step=0.01,
                    tooltip="NAG: blend of the guided attention into the prompt's (0.25 typical).",
                ),
                io.String.Input(
                    "slg_blocks",
                    default="",
                    tooltip="SLG: blocks the negative pass skips, like 9 or 8,9 (empty = off). Needs cfg above 1.",
                ),
                io.Float.Input(
                    "slg_start_percent",
                    default=0.1,
                    min=nan_refusing_min(0.0),
                    max=1.0,
                    step=0.01,
                    tooltip="SLG: first step, as a fraction of the run.",
                ),
                io.Float.Input(
                    "slg_end_percent",
                    default=1.0,
                    min=nan_refusing_min(0.0),
                    max=1.0,
                    step=0.01,
                    tooltip="SLG: last step, as a fraction of the run.",
                ),
                io.Float.Input(
                    "slg_scale",
                    default=0.0,
                    min=nan_refusing_min(0.0),
                    max=20.0,
                    step=0.1,
                    tooltip="SLG: 0 skips the blocks in the negative pass (cached as usual); above 0, an extra pass "
                    "without them adds scale x its difference (ComfyUI's SkipLayerGuidanceDiT; 3 is typical).",
                ),
                io.Int.Input(
                    "riflex_index",
                    default=0,
                    min=-1,
                    max=64,
                    tooltip="RIFLEx against repeating long videos: the time frequency to slow; -1 = chosen from the "
                    "frame count, 6 as WanVideoWrapper, 0 = off.",
                ),
                WanVACEGuidanceType.Input(
                    "guidance", optional=True, tooltip="Earlier options; this node overrides the experts it names."
                ),
            ],
            outputs=[WanVACEGuidanceType.Output(display_name="guidance", tooltip="For WanVACE Sampler.")],
        )

    @classmethod
    def validate_inputs(
        cls,
        rule: str | None = None,
        experts: str | None = None,
        slg_blocks: str | None = None,
        slg_start_percent: float | None = None,
        slg_end_percent: float | None = None,
    ) -> bool | str:
        # The combos and SLG's text and percents (their order is checked across both, so both bounds and NaN are
        # checked here); the other numbers keep ComfyUI's range check.
        with Refusal() as refusal:
            for name, value, choices in (("rule", rule, RULES), ("experts", experts, EXPERTS)):
                if value is not None:
                    check_choice(name, value, choices)
            for name, value in (("slg_start_percent", slg_start_percent), ("slg_end_percent", slg_end_percent)):
                if value is not None and not 0.0 <= value <= 1.0:
                    raise WanVACEInputError(f"{name}={value} must lie in [0, 1] (a fraction of the run's steps).")
            if slg_blocks is not None and slg_start_percent is not None and slg_end_percent is not None:
                skip_layers(slg_blocks, slg_start_percent, slg_end_percent)
        return refusal.message or True

    @classmethod
    def execute(
        cls,
        rule: str,
        experts: str,
        zero_init_steps: int,
        apg_eta: float,
        apg_norm_threshold: float,
        apg_momentum: float,
        nag_scale: float = 1.0,
        nag_tau: float = 2.5,
        nag_alpha: float = 0.25,
        slg_blocks: str = "",
        slg_start_percent: float = 0.1,
        slg_end_percent: float = 1.0,
        slg_scale: float = 0.0,
        riflex_index: int = 0,
        guidance: GuidanceOptions | None = None,
    ) -> io.NodeOutput:
        chosen = expert_guidance(rule, zero_init_steps, apg_eta, apg_norm_threshold, apg_momentum)
        options = guidance or GuidanceOptions()
        # NAG, SLG and RIFLEx act on the whole run: a node that sets them overrides an earlier one's.
        slg = skip_layers(slg_blocks, slg_start_percent, slg_end_percent, slg_scale)
        if slg is not None:
            options = dataclasses.replace(options, slg=slg)
        if nag_scale > 1.0:
            options = dataclasses.replace(options, nag=NAGOptions(nag_scale, nag_tau, nag_alpha))
        if riflex_index:
            options = dataclasses.replace(options, riflex_index=riflex_index)
        if experts in ("both", "high_noise"):
            options = dataclasses.replace(options, high_noise=chosen)
        if experts in ("both", "low_noise"):
            options = dataclasses.replace(options, low_noise=chosen)
        return io.NodeOutput(options)
