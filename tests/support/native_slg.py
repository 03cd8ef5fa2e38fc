"""Our SLG (skip-layer guidance, both forms) against ComfyUI's own SkipLayerGuidanceDiTSimple node on the same
weights: the node applied to ComfyUI's VaceWanModel (holding our two experts' weights) on both experts'
KSamplerAdvanced, against our sampler stepped by ComfyUI's euler with `GuidanceOptions(slg=...)`, from the same seed
and inputs as tests/test_native_sampling.py (whose helpers build both sides).

The two sides name the steps differently: ComfyUI maps its percents through the model's `percent_to_sigma` and skips
on the steps whose sigma lies in [sigma(end), sigma(start)]; ours skips on step i where start <= i / steps <= end.
Each case's percents select the same steps on both sides with a margin (the 4 steps' sigmas at shift 8 are 1, 0.96,
0.889, 0.727), and each side's skipped steps are observed in its model, not read from its settings.

`slg_runs` runs in test_native_sampling.py's subprocess inside the ComfyUI tree of the set (one subprocess, one
model build for both); the `check_*` functions are that module's tests.
"""

from __future__ import annotations

import time

import torch

from tests.support.in_comfyui import relative
from tests.test_native_sampling import (
    CFG,
    CFG_LOW,
    SEED,
    SHIFT,
    STEPS,
    _both_models,
    _comfy_conditioning,
    _native_pair,
    _schedule,
)

# Measured max |ours - native| / max |native| over the final latents with SLG (fp32, CPU), over the four cases:
# 6.4e-7 to 1.02e-6 (0.33.0) and 7.8e-7 to 1.13e-6 (0.3.75), as test_native_sampling.py's plain run (8.3e-7, 1.05e-6)
# and for the same causes: ComfyUI's forward (time embedding, attention, norms), CFG on x0 against CFG on the velocity,
# its latent format at the split and the VACE frames, and on the steps SLG does not cover its cond and uncond in one
# batch against our two calls (on the covered steps both sides make two calls of batch 1).
SLG_RTOL = 1e-5

# name: (block, start_percent, end_percent, the steps both sides must skip on). The tiny experts have 4 blocks
# with VACE hints after blocks 0 and 2: block 1 has none, block 2 has one (both sides still add it when the block
# is skipped). Percent -> sigma at shift 8: 0.2 -> 0.970, 0.4 -> 0.923, 0.55 -> 0.867; step fraction i / 4.
CASES = {
    "block1_all_steps": (1, 0.0, 1.0, [0, 1, 2, 3]),
    "block1_steps_1_2": (1, 0.2, 0.55, [1, 2]),  # inside the high-noise expert
    "block1_steps_2_3": (1, 0.4, 1.0, [2, 3]),  # across the expert switch (after step 2)
    "block2_all_steps": (2, 0.0, 1.0, [0, 1, 2, 3]),  # the block before a VACE hint
}

# The extra-pass form (slg_scale > 0; ComfyUI's SkipLayerGuidanceDiT): block 1 on every step.
EXTRA_PASS_CASE = (1, 0.0, 1.0)
EXTRA_PASS_SCALE = 3.0


# --- the ComfyUI side (runs in the subprocess) -------------------------------------------------------------


class _ComfySkips:
    """Per call of ComfyUI's diffusion models while entered: sigma, batch size, whether `block` ran and whether the
    VACE block whose hint follows `block` ran (None where no hint follows it)."""

    def __init__(self, patchers, block: int) -> None:
        self.calls: list[dict] = []
        self.handles = []
        self.hinted = block in patchers[0].model.diffusion_model.vace_layers_mapping
        for patcher in patchers:
            model = patcher.model.diffusion_model
            hint = model.vace_layers_mapping.get(block)
            self.handles.append(model.register_forward_pre_hook(self._call, with_kwargs=True))
            self.handles.append(model.blocks[block].register_forward_pre_hook(self._mark("block_ran")))
            if hint is not None:
                self.handles.append(model.vace_blocks[hint].register_forward_pre_hook(self._mark("hint_ran")))

    def _call(self, _module, args, kwargs):
        x, timestep = args[0], args[1]
        call = {"sigma": float(timestep.reshape(-1)[0]) / 1000.0, "batch": x.shape[0], "block_ran": False}
        call["hint_ran"] = False if self.hinted else None
        self.calls.append(call)

    def _mark(self, key: str):
        def mark(_module, _args):
            self.calls[-1][key] = True

        return mark

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


class _OurSkips:
    """Per call of our experts while entered: the expert, timestep, whether its text is the negative prompt, whether
    `block` was skipped, seen as the next block's input equal to `block`'s input (None where a VACE hint is added
    between them), and whether the VACE block whose hint follows `block` ran (None where none follows it)."""

    def __init__(self, model, cond, block: int) -> None:
        self.calls: list[dict] = []
        self.handles = []
        self.hinted = block in model.vace_layers
        for name, expert in (("high", model.transformer), ("low", model.transformer_2)):
            self.handles.append(expert.register_forward_pre_hook(self._call(name, cond), with_kwargs=True))
            if self.hinted:
                hint = expert.vace_blocks[model.vace_layers.index(block)]
                self.handles.append(hint.register_forward_pre_hook(self._hint_ran))
            else:
                self.handles.append(expert.blocks[block].register_forward_pre_hook(self._keep))
                self.handles.append(expert.blocks[block + 1].register_forward_pre_hook(self._compare))

    def _call(self, name: str, cond):
        def record(_module, _args, kwargs):
            texts = kwargs["encoder_hidden_states"]
            self.calls.append(
                {
                    "expert": name,
                    "t": float(kwargs["timestep"].reshape(-1)[0]),
                    "negative": torch.equal(texts, cond.negative_prompt_embeds.to(texts.dtype)),
                    "skipped": None,
                    "hint_ran": False if self.hinted else None,
                }
            )

        return record

    def _hint_ran(self, _module, _args):
        self.calls[-1]["hint_ran"] = True

    def _keep(self, _module, args):
        self.calls[-1]["block_input"] = args[0].detach().clone()

    def _compare(self, _module, args):
        call = self.calls[-1]
        call["skipped"] = torch.equal(args[0], call.pop("block_input"))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def slg_runs(folder: str) -> dict:
    import comfy.samplers
    from comfy_extras.nodes_slg import SkipLayerGuidanceDiT, SkipLayerGuidanceDiTSimple
    from wanvace_pack.nodes.comfy_sampling import stepper_for
    from wanvace_pack.wanvace_core import SamplerSettings, sample
    from wanvace_pack.wanvace_core.generation.guidance import GuidanceOptions
    from wanvace_pack.wanvace_core.runtime.attention_guidance import SkipLayerOptions

    found: dict = {"timings": {}, "cases": {}}
    started = time.perf_counter()
    model, cond, high, low = _both_models(folder)
    sigmas, split = _schedule(model)
    positive, negative = _comfy_conditioning(high.model, cond)
    settings = SamplerSettings(
        seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, scheduler="euler", sigmas=tuple(sigmas.tolist())
    )
    stepper = stepper_for(comfy.samplers.sampler_object("euler"), SHIFT)
    found["sigmas"], found["split"] = sigmas, split
    found["timings"]["setup"] = time.perf_counter() - started

    started = time.perf_counter()
    with _ComfySkips((high, low), 1) as plain_calls:
        found["native_plain"] = _native_pair(high, low, positive, negative, split)
    found["plain_calls"] = plain_calls.calls
    found["timings"]["native_plain"] = time.perf_counter() - started

    for name, (block, start, end, _steps) in CASES.items():
        started = time.perf_counter()
        case: dict = {}
        # ComfyUI's node on both experts' models, as a graph wires it before each KSamplerAdvanced.
        patched = [SkipLayerGuidanceDiTSimple.execute(m, start, end, str(block), "").result[0] for m in (high, low)]
        sampling = high.get_model_object("model_sampling")
        case["sigma_range"] = (sampling.percent_to_sigma(end), sampling.percent_to_sigma(start))
        with _ComfySkips(patched, block) as comfy_calls:
            case["native"] = _native_pair(*patched, positive, negative, split)
        case["comfy_calls"] = comfy_calls.calls
        found["timings"][f"{name}_native"] = time.perf_counter() - started
        started = time.perf_counter()
        rules = GuidanceOptions(slg=SkipLayerOptions(blocks=(block,), start_percent=start, end_percent=end))
        with _OurSkips(model, cond, block) as our_calls:
            case["ours"] = sample(model, cond, settings, stepper=stepper, rules=rules).latents
        case["our_calls"] = our_calls.calls
        found["cases"][name] = case
        found["timings"][f"{name}_ours"] = time.perf_counter() - started

    # The extra-pass form: ComfyUI's SkipLayerGuidanceDiT (an extra cond pass without the block, scale times its
    # difference added after CFG) against ours with slg_scale.
    started = time.perf_counter()
    block, start, end = EXTRA_PASS_CASE
    patched = [
        SkipLayerGuidanceDiT.execute(m, EXTRA_PASS_SCALE, start, end, str(block), "", 0).result[0] for m in (high, low)
    ]
    found["extra_pass_native"] = _native_pair(*patched, positive, negative, split)
    options = SkipLayerOptions(blocks=(block,), start_percent=start, end_percent=end, scale=EXTRA_PASS_SCALE)
    rules = GuidanceOptions(slg=options)
    found["extra_pass_ours"] = sample(model, cond, settings, stepper=stepper, rules=rules).latents
    found["timings"]["extra_pass"] = time.perf_counter() - started
    return found


def _step_of(sigmas: torch.Tensor, sigma: float) -> int:
    return int((sigmas[:-1] - sigma).abs().argmin())


def check_the_same_steps_are_skipped(slg_run: dict) -> None:
    sigmas = slg_run["sigmas"]
    assert slg_run["split"] == 3  # steps 0-2 on the high-noise expert, step 3 on the low-noise one
    # Without the node ComfyUI runs cond and uncond as one call of batch 2 per step, block 1 always running.
    plain = slg_run["plain_calls"]
    assert [call["batch"] for call in plain] == [2] * STEPS and all(call["block_ran"] for call in plain)
    for name, (block, start, end, steps) in CASES.items():
        case = slg_run["cases"][name]
        low_sigma, high_sigma = case["sigma_range"]
        print(f"{name}: ComfyUI sigma range [{low_sigma:.4g}, {high_sigma:.4g}], ours i/{STEPS} in [{start}, {end}]")
        # ComfyUI: on a covered step, cond alone (batch 1, the block runs), then uncond alone without the block; on
        # the other steps one call of batch 2.
        comfy_skipped = [_step_of(sigmas, call["sigma"]) for call in case["comfy_calls"] if not call["block_ran"]]
        assert comfy_skipped == steps, (name, comfy_skipped)
        batches = [(_step_of(sigmas, call["sigma"]), call["batch"]) for call in case["comfy_calls"]]
        expected = [pair for step in range(STEPS) for pair in ([(step, 1)] * 2 if step in steps else [(step, 2)])]
        assert batches == expected, (name, batches)
        if block == 2:  # on both sides the VACE block whose hint follows the skipped block runs on every call
            assert all(call["hint_ran"] for call in case["comfy_calls"] + case["our_calls"]), name
        # Ours: cond and uncond as two calls on every step; the block is skipped on the uncond call of the steps.
        ours = case["our_calls"]
        assert [call["negative"] for call in ours] == [False, True] * STEPS, name
        experts = [call["expert"] for call in ours[::2]]
        assert experts == ["high"] * slg_run["split"] + ["low"] * (STEPS - slg_run["split"]), (name, experts)
        if ours[0]["skipped"] is not None:
            our_skipped = [_step_of(sigmas, call["t"] / 1000.0) for call in ours if call["skipped"]]
            assert our_skipped == steps, (name, our_skipped)
            assert not any(call["skipped"] for call in ours if not call["negative"]), name


def check_equal_to_the_one_pass_node(slg_run: dict) -> None:
    plain = slg_run["native_plain"]
    print(f"timings {slg_run['timings']}")
    for name, case in slg_run["cases"].items():
        native, ours = case["native"], case["ours"]
        assert native.shape == ours.shape and torch.isfinite(native).all()
        error = relative(ours, native)
        # The control: ComfyUI without the node is far from our run with SLG (and from its own run with the node).
        control = relative(ours, plain)
        print(f"{name}: ours vs ComfyUI's node {error:.3g}; ours vs ComfyUI without SLG {control:.3g}")
        assert error < SLG_RTOL, (name, error)
        assert control > 100 * SLG_RTOL, (name, control)
        assert relative(native, plain) > 100 * SLG_RTOL, name
    # The tolerance also tells the cases apart: a different block, or SLG on different steps, is far off.
    names = list(slg_run["cases"])
    apart = {
        (one, other): relative(slg_run["cases"][one]["native"], slg_run["cases"][other]["native"])
        for index, one in enumerate(names)
        for other in names[index + 1 :]
    }
    print(f"ComfyUI's cases against each other: smallest {min(apart.values()):.3g}")
    assert min(apart.values()) > 100 * SLG_RTOL, apart


def check_equal_to_the_extra_pass_node(slg_run: dict) -> None:
    native, ours, plain = slg_run["extra_pass_native"], slg_run["extra_pass_ours"], slg_run["native_plain"]
    assert native.shape == ours.shape and torch.isfinite(native).all()
    assert relative(ours, native) < SLG_RTOL, relative(ours, native)
    assert relative(native, plain) > 100 * SLG_RTOL
    assert relative(native, slg_run["cases"]["block1_all_steps"]["native"]) > 100 * SLG_RTOL  # not the one-pass form
