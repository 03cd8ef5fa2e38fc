"""Guidance inside the expert, attached for one run as module hooks (`hooks.py`): NAG in cross-attention, RIFLEx in
the rotary position embedding.

- NAG, normalized attention guidance (Chen et al. 2025, arXiv 2505.21179, Eq. 4-6): in every block's
  cross-attention, with `Z+` the attention output for the prompt and `Z-` for the negative prompt (the same queries,
  before the output projection), `Z~ = Z+ + (scale - 1)(Z+ - Z-)`, rescaled per token where its L1 norm exceeds
  `tau` times that of `Z+`, and blended `alpha Z~ + (1 - alpha) Z+`. It gives a negative prompt to a run without
  a negative pass (cfg 1, the distilled 4-step LoRAs), so it is attached only to experts that run at cfg 1.
- RIFLEx (Zhao et al. 2025, arXiv 2502.15894, Eq. 8): the time axis's intrinsic frequency component `index`
  (1-based) is set to `0.9 * 2 pi / frames` for a call over `frames` latent frames, so that a video longer than the
  training length does not repeat. `index` -1 picks, per call, the component whose period is nearest `frames`
  (`1 + argmin_j |2 pi / theta_j - frames|`, the rule of the authors' `identifying_k.py`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import WanVACEInputError
from ..hooks import ModuleHooks
from ..validation import validate_finite, validate_integer


@dataclass(frozen=True)
class NAGOptions:
    """NAG's strength; WanVideoWrapper's defaults."""

    scale: float = 11.0
    tau: float = 2.5
    alpha: float = 0.25

    def __post_init__(self) -> None:
        if validate_finite("nag_scale", self.scale, "use 1 (off) or more; 11 is typical") < 1.0:
            raise WanVACEInputError(f"nag_scale={self.scale} must be 1 or more; 11 is typical.")
        if validate_finite("nag_tau", self.tau, "use a value above 1; 2.5 is typical") <= 1.0:
            raise WanVACEInputError(f"nag_tau={self.tau} must be above 1 (the norm ratio allowed); 2.5 is typical.")
        if not 0.0 <= validate_finite("nag_alpha", self.alpha, "use a value in [0, 1]; 0.25 is typical") <= 1.0:
            raise WanVACEInputError(f"nag_alpha={self.alpha} must lie in [0, 1]; 0.25 is typical.")


def nag_attention(positive: torch.Tensor, negative: torch.Tensor, options: NAGOptions) -> torch.Tensor:
    """The guided attention output from the attention outputs `[B, L, D]` for the prompt and the negative prompt."""
    guided = positive + (options.scale - 1.0) * (positive - negative)
    norm_positive = positive.norm(p=1, dim=-1, keepdim=True)
    norm_guided = guided.norm(p=1, dim=-1, keepdim=True)
    ratio = norm_guided / norm_positive
    guided = torch.where(ratio > options.tau, guided * (options.tau / ratio), guided)
    return options.alpha * guided + (1.0 - options.alpha) * positive


RIFLEX_AUTO = -1


def check_riflex_index(expert, index: int) -> None:
    """Refuses a RIFLEx component the expert's time axis does not have."""
    validate_integer("riflex_index", index, "use 0 (off), -1 (auto) or the component, e.g. 6")
    components = expert.rope.t_dim // 2
    if not RIFLEX_AUTO <= index <= components:
        raise WanVACEInputError(
            f"riflex_index={index} is past the {components} frequency components of this model's time axis; use 0 "
            f"(off), -1 (from the frame count) or 1-{components} (6 is what WanVideoWrapper uses for Wan)."
        )


def time_frequencies(rope) -> torch.Tensor:
    """The time axis's frequencies theta_j (radians per latent frame), read from the module's own table: the angle
    of position 1 (every theta_j is below pi)."""
    return torch.atan2(rope.freqs_sin[1, 1 : rope.t_dim : 2], rope.freqs_cos[1, 0 : rope.t_dim : 2]).double()


def intrinsic_component(rope, frames: int) -> int:
    """The 1-based time component whose period is nearest `frames` latent frames."""
    periods = 2.0 * math.pi / time_frequencies(rope)
    return 1 + int((periods - frames).abs().argmin())


@dataclass(frozen=True)
class SkipLayerOptions:
    """SLG on the steps from `start_percent` to `end_percent` of the run (fractions of its steps). With `scale` 0, its
    one-pass form (WanVideoWrapper's, ComfyUI's SkipLayerGuidanceDiTSimple): the negative pass runs without `blocks`.
    With `scale` above 0, its extra-pass form (ComfyUI's SkipLayerGuidanceDiT, diffusers' SkipLayerGuidance): one
    more conditional pass runs without `blocks`, and `scale` times its difference to the conditional prediction is
    added to the guided one."""

    blocks: tuple[int, ...] = (9,)
    start_percent: float = 0.1
    end_percent: float = 1.0
    scale: float = 0.0

    def __post_init__(self) -> None:
        blocks = tuple(
            validate_integer("slg_blocks", block, "list block indices, like 9 or 8,9") for block in self.blocks
        )
        if not blocks or min(blocks) < 0:
            raise WanVACEInputError(f"slg_blocks={list(self.blocks)} must list block indices, 0 or more, like 9.")
        object.__setattr__(self, "blocks", blocks)
        for name in ("start_percent", "end_percent"):
            if not 0.0 <= validate_finite(f"slg_{name}", getattr(self, name), "use a value in [0, 1]") <= 1.0:
                raise WanVACEInputError(f"slg_{name}={getattr(self, name)} must lie in [0, 1].")
        if self.start_percent > self.end_percent:
            raise WanVACEInputError(
                f"slg_start_percent={self.start_percent} is after slg_end_percent={self.end_percent}; swap them."
            )
        if validate_finite("slg_scale", self.scale, "use 0 (skip in the negative pass) or a value like 3") < 0:
            raise WanVACEInputError(f"slg_scale={self.scale} must be 0 (the one-pass form) or positive, like 3.")

    @property
    def extra_pass(self) -> bool:
        return self.scale > 0.0

    def active_steps(self, steps: int) -> list[int]:
        return [index for index in range(steps) if self.start_percent <= index / steps <= self.end_percent]


class SkipLayerPass:
    """Set by the sampler around SLG's extra pass (its form with a scale), whose every row skips the blocks."""

    def __init__(self) -> None:
        self.on = False

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False


@dataclass(frozen=True)
class ExpertHooks:
    """What one run attaches inside the experts: NAG on `nag_experts` (those at cfg 1), SLG on `slg_experts` (those
    with a negative pass) at the timesteps `slg_timesteps`, RIFLEx (`riflex_index`, 0 = off) on `riflex_experts`."""

    prompt_embeds: torch.Tensor
    negative_embeds: torch.Tensor
    nag: NAGOptions | None = None
    nag_experts: tuple = ()
    slg: SkipLayerOptions | None = None
    slg_experts: tuple = ()
    slg_timesteps: tuple[float, ...] = ()
    slg_pass: SkipLayerPass = field(default_factory=lambda: SkipLayerPass())
    riflex_index: int = 0
    riflex_experts: tuple = ()


@contextlib.contextmanager
def attention_guidance(plan: ExpertHooks) -> Iterator[None]:
    """The hooks `plan` describes, on for the run inside the `with` and off after it (also on an error)."""
    hooks = ModuleHooks()
    try:
        for expert in plan.nag_experts if plan.nag is not None else ():
            _apply_nag(expert, plan.negative_embeds, plan.nag, hooks)
        for expert in plan.slg_experts if plan.slg is not None else ():
            check_slg_blocks(expert, plan.slg)
            _apply_skip_layers(expert, plan, hooks)
        for expert in plan.riflex_experts if plan.riflex_index else ():
            check_riflex_index(expert, plan.riflex_index)
            _apply_riflex(expert, plan.riflex_index, hooks)
        yield
    finally:
        hooks.remove()


def check_slg_blocks(expert, options: SkipLayerOptions) -> None:
    count = len(expert.blocks)
    if max(options.blocks) >= count:
        raise WanVACEInputError(
            f"slg_blocks={list(options.blocks)} names a block past this model's {count} (0-{count - 1}); "
            "9 or 10 are typical for Wan's 40 blocks."
        )


def _apply_skip_layers(expert, plan: ExpertHooks, hooks: ModuleHooks) -> None:
    state = {"rows": None}
    active = torch.tensor(plan.slg_timesteps, dtype=torch.float64)

    def find_negative_rows(_module, args, kwargs):
        # The negative pass is the call (or, batched, the rows) whose text is the negative prompt's; in the extra-pass
        # form, the sampler's extra call is.
        state["rows"] = None
        if plan.slg.extra_pass:
            if plan.slg_pass.on:
                state["rows"] = torch.ones(kwargs["hidden_states"].shape[0], 1, 1, dtype=torch.bool)
            return None
        timestep = float(kwargs["timestep"].reshape(-1)[0])
        if not len(active) or not torch.isclose(active, torch.tensor(timestep, dtype=torch.float64)).any():
            return None
        texts = kwargs["encoder_hidden_states"]
        negative = plan.negative_embeds.to(texts.device, texts.dtype)
        positive = plan.prompt_embeds.to(texts.device, texts.dtype)
        rows = [torch.equal(row, negative[0]) and not torch.equal(row, positive[0]) for row in texts]
        state["rows"] = torch.tensor(rows, device=texts.device).view(-1, 1, 1) if any(rows) else None
        return None

    def skipped_on_negative_rows(_module, args, output):
        rows = state["rows"]
        return output if rows is None else torch.where(rows.to(output.device), args[0], output)

    hooks.pre(expert, find_negative_rows, with_kwargs=True)
    for index in plan.slg.blocks:
        hooks.post(expert.blocks[index], skipped_on_negative_rows)


def _apply_nag(expert, negative_embeds: torch.Tensor, options: NAGOptions, hooks: ModuleHooks) -> None:
    embedder = expert.condition_embedder.text_embedder
    context = {"negative": None, "projecting": False}

    def project_negative(module, _args, output):
        # The negative prompt goes through the expert's own text projection in the same forward (LoRA, offload and
        # sharding see an ordinary call); the guard keeps this hook from running on its own call.
        if context["projecting"]:
            return None
        context["projecting"] = True
        try:
            negative = negative_embeds.to(output.device, output.dtype)
            context["negative"] = module(negative.expand(output.shape[0], *negative.shape[1:]))
        finally:
            context["projecting"] = False
        return None

    def both_prompts(_module, args, kwargs):
        # diffusers' block calls attn2(hidden_states, encoder_hidden_states, None, None): the same queries attend
        # to the prompt and to the negative prompt, as a batch of two.
        hidden, positive, *rest = args
        negative = context["negative"].to(positive.dtype)
        return (torch.cat([hidden, hidden]), torch.cat([positive, negative]), *rest), kwargs

    def guided(_module, args):
        positive, negative = args[0].chunk(2)
        return (nag_attention(positive, negative, options),)

    hooks.post(embedder, project_negative)
    for block in expert.blocks:
        hooks.pre(block.attn2, both_prompts, with_kwargs=True)
        hooks.pre(block.attn2.to_out[0], guided)


def _apply_riflex(expert, index: int, hooks: ModuleHooks) -> None:
    rope = expert.rope

    def riflex(_module, args, output):
        freqs_cos, freqs_sin = output
        frames = args[0].shape[2] // rope.patch_size[0]
        component = intrinsic_component(rope, frames) if index == RIFLEX_AUTO else index
        columns = slice(2 * (component - 1), 2 * component)
        tokens_per_frame = freqs_cos.shape[1] // frames
        angle = 0.9 * 2.0 * math.pi / frames
        positions = torch.arange(frames, device=freqs_cos.device, dtype=torch.float64).repeat_interleave(
            tokens_per_frame
        )
        phase = (positions * angle).view(1, -1, 1, 1)
        freqs_cos, freqs_sin = freqs_cos.clone(), freqs_sin.clone()
        freqs_cos[..., columns] = torch.cos(phase).to(freqs_cos.dtype)
        freqs_sin[..., columns] = torch.sin(phase).to(freqs_sin.dtype)
        return freqs_cos, freqs_sin

    hooks.post(rope, riflex)
