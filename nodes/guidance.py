"""WanVACEGuidanceOptions: how each expert combines its two predictions, NAG and RIFLEx, for WanVACESampler's
`guidance` input."""

from __future__ import annotations

import dataclasses

from comfy_api.v0_0_2 import io

from ..wanvace_core import WanVACEInputError
from ..wanvace_core.generation.guidance import APGOptions, ExpertGuidance, GuidanceOptions
from ..wanvace_core.runtime.attention_guidance import NAGOptions, SkipLayerOptions
from .inputs import float_input, fraction_input, int_input
from .refusals import Refusal, check_choice
from .types import CATEGORY, WanVACEGuidanceType

RULES = ("cfg", "cfg_zero_star", "apg", "tcfg")
EXPERTS = ("both", "high_noise", "low_noise")
NAG_OFF = 1.0


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
                    tooltip="How the two predictions combine: plain cfg, CFG-Zero*, APG (as ComfyUI's) or TCFG.",
                ),
                io.Combo.Input("experts", options=list(EXPERTS), default="both", tooltip="The experts it applies to."),
                int_input(
                    "zero_init_steps",
                    ExpertGuidance.zero_init_steps,
                    (0, 200),
                    "CFG-Zero*: first steps that predict zero velocity (1 is typical; 0 = off).",
                ),
                fraction_input("apg_eta", APGOptions.eta, "APG: weight of the guidance parallel to the prediction."),
                float_input(
                    "apg_norm_threshold",
                    APGOptions.norm_threshold,
                    (0.0, 50.0),
                    0.1,
                    "APG: largest guidance norm per channel; 0 = no clamp.",
                ),
                float_input(
                    "apg_momentum",
                    APGOptions.momentum,
                    (-1.0, 0.99),
                    0.01,
                    "APG: running average of the guidance over steps (-0.5 in the paper; 0 = off).",
                ),
                float_input(
                    "nag_scale",
                    NAG_OFF,
                    (1.0, 50.0),
                    0.1,
                    "NAG: the negative prompt for experts at cfg 1, in cross-attention (11 is typical; 1 = off).",
                ),
                float_input(
                    "nag_tau",
                    NAGOptions.tau,
                    (1.01, 10.0),
                    0.01,
                    "NAG: the most the guided attention's norm may grow over the prompt's.",
                ),
                fraction_input("nag_alpha", NAGOptions.alpha, "NAG: blend of the guided attention into the prompt's."),
                io.String.Input(
                    "slg_blocks",
                    default="",
                    tooltip="SLG: blocks the negative pass skips, like 9 or 8,9 (empty = off; needs cfg above 1).",
                ),
                fraction_input(
                    "slg_start_percent", SkipLayerOptions.start_percent, "SLG: first step, as a fraction of the run."
                ),
                fraction_input(
                    "slg_end_percent", SkipLayerOptions.end_percent, "SLG: last step, as a fraction of the run."
                ),
                float_input(
                    "slg_scale",
                    SkipLayerOptions.scale,
                    (0.0, 20.0),
                    0.1,
                    "SLG: 0 skips the blocks in the negative pass; above 0, an extra pass without them (3 typical).",
                ),
                int_input(
                    "riflex_index",
                    GuidanceOptions.riflex_index,
                    (-1, 64),
                    "RIFLEx against repeating long videos: the time frequency to slow (-1 = auto, 0 = off).",
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
        nag_scale: float,
        nag_tau: float,
        nag_alpha: float,
        slg_blocks: str,
        slg_start_percent: float,
        slg_end_percent: float,
        slg_scale: float,
        riflex_index: int,
        guidance: GuidanceOptions | None = None,
    ) -> io.NodeOutput:
        chosen = expert_guidance(rule, zero_init_steps, apg_eta, apg_norm_threshold, apg_momentum)
        options = guidance or GuidanceOptions()
        # NAG, SLG and RIFLEx act on the whole run: a node that sets them overrides an earlier one's.
        slg = skip_layers(slg_blocks, slg_start_percent, slg_end_percent, slg_scale)
        if slg is not None:
            options = dataclasses.replace(options, slg=slg)
        if nag_scale > NAG_OFF:
            options = dataclasses.replace(options, nag=NAGOptions(nag_scale, nag_tau, nag_alpha))
        if riflex_index:
            options = dataclasses.replace(options, riflex_index=riflex_index)
        if experts in ("both", "high_noise"):
            options = dataclasses.replace(options, high_noise=chosen)
        if experts in ("both", "low_noise"):
            options = dataclasses.replace(options, low_noise=chosen)
        return io.NodeOutput(options)
