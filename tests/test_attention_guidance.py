"""NAG and RIFLEx inside the experts, against their papers' formulas on the module's own weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.vace_tasks import HEIGHT, LENGTH, NEGATIVE, PROMPT, WIDTH, build_task
from wanvace_core import CacheOptions, SamplerSettings, VACEInputs, WanVACEInputError, prepare_conditioning, sample
from wanvace_core.generation.guidance import GuidanceOptions
from wanvace_core.runtime.attention_guidance import ExpertHooks, NAGOptions, SkipLayerOptions, attention_guidance


@pytest.fixture(scope="module")
def model(loaded_models):
    return loaded_models("fp32")


@pytest.fixture(scope="module")
def cond(model):
    case = build_task("v2v")
    return prepare_conditioning(model, VACEInputs(PROMPT, NEGATIVE, WIDTH, HEIGHT, LENGTH, **case.ours))


def _hooks(cond, **fields) -> ExpertHooks:
    embeds = torch.zeros(1, 1, 1) if cond is None else cond.prompt_embeds
    negative = torch.zeros(1, 1, 1) if cond is None else cond.negative_prompt_embeds
    return ExpertHooks(prompt_embeds=embeds, negative_embeds=negative, **fields)


def _paper_nag(positive, negative, scale, tau, alpha):
    """arXiv 2505.21179 Eq. 4-6: extrapolate, cap the L1 norm ratio per token at tau, blend with alpha."""
    extrapolated = positive + (scale - 1.0) * (positive - negative)
    ratio = extrapolated.abs().sum(-1, keepdim=True) / positive.abs().sum(-1, keepdim=True)
    capped = extrapolated * torch.clamp(ratio, max=tau) / ratio
    return alpha * capped + (1.0 - alpha) * positive


def _attention_by_hand(attn, hidden, context):
    """A Wan cross-attention before its output projection, from its own weights with torch's SDPA."""
    query = attn.norm_q(attn.to_q(hidden)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
    key = attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
    value = attn.to_v(context).unflatten(2, (attn.heads, -1)).transpose(1, 2)
    return F.scaled_dot_product_attention(query, key, value).transpose(1, 2).flatten(2, 3)


def test_every_blocks_cross_attention_is_the_papers_nag_of_both_prompts(model, cond):
    expert = model.transformer_2
    options = NAGOptions(scale=4.0, tau=1.2, alpha=0.5)
    seen = []
    handles = [block.attn2.register_forward_hook(lambda m, a, o: seen.append((m, a, o))) for block in expert.blocks]
    hidden = torch.randn(1, 16, 3, HEIGHT // 8, WIDTH // 8, generator=torch.Generator().manual_seed(0))
    inputs = {
        "hidden_states": hidden,
        "timestep": torch.tensor([400.0]),
        "encoder_hidden_states": cond.prompt_embeds,
        "control_hidden_states": cond.conditioning_latents,
        "control_hidden_states_scale": cond.conditioning_scale,
        "return_dict": False,
    }
    try:
        with (
            torch.no_grad(),
            attention_guidance(_hooks(cond, nag=options, nag_experts=(expert,))),
        ):
            expert(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == len(expert.blocks)
    with torch.no_grad():
        negative_context = expert.condition_embedder.text_embedder(cond.negative_prompt_embeds)
        for attn, args, output in seen:
            queries, positive_context = args[:2]
            assert queries.shape[0] == 2 and torch.equal(queries[0], queries[1])  # the same queries for both
            positive = _attention_by_hand(attn, queries[:1], positive_context[:1])
            negative = _attention_by_hand(attn, queries[:1], negative_context)
            expected = attn.to_out[0](_paper_nag(positive, negative, 4.0, 1.2, 0.5))
            assert output.shape[0] == 1
            torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-5)


def _settings(cfg_high=1.0, cfg_low=1.0):
    return SamplerSettings(seed=5, steps=4, cfg=cfg_high, cfg_low_noise=cfg_low, scheduler="distill", shift=5.0)


def test_nag_changes_a_cfg_one_run_and_leaves_nothing_behind(model, cond):
    plain = sample(model, cond, _settings()).latents
    nag = sample(model, cond, _settings(), rules=GuidanceOptions(nag=NAGOptions())).latents
    assert torch.isfinite(nag).all() and not torch.equal(nag, plain)
    assert torch.equal(sample(model, cond, _settings()).latents, plain)


def test_nag_only_on_the_expert_at_cfg_one(model, cond):
    rules = GuidanceOptions(nag=NAGOptions())
    calls = []
    handles = [
        expert.blocks[0]
        .attn2.to_out[0]
        .register_forward_pre_hook(lambda m, a, e=name: calls.append((e, a[0].shape[0])))
        for name, expert in (("high", model.transformer), ("low", model.transformer_2))
    ]
    try:
        sample(model, cond, _settings(cfg_high=3.0), rules=rules)
    finally:
        for handle in handles:
            handle.remove()
    assert {batch for name, batch in calls if name == "high"} == {1}
    assert {batch for name, batch in calls if name == "low"} == {2}  # both prompts, before NAG's hook reduces them


def test_nag_with_a_negative_pass_on_both_experts_is_refused(model, cond):
    with pytest.raises(WanVACEInputError, match="set cfg or cfg_low_noise to 1"):
        sample(model, cond, _settings(3.0, 3.0), rules=GuidanceOptions(nag=NAGOptions()))


def test_nag_runs_under_step_caching(model, cond):
    rules = GuidanceOptions(nag=NAGOptions())
    cache = CacheOptions(residual_diff_threshold=0.001)
    result = sample(model, cond, _settings(), rules=rules, cache=cache)
    plain = sample(model, cond, _settings(), rules=rules).latents
    torch.testing.assert_close(result.latents, plain)  # nothing was cached at this threshold, so NAG ran every step


@pytest.mark.parametrize(
    ("make", "message"), [(lambda: NAGOptions(tau=1.0), "nag_tau"), (lambda: NAGOptions(alpha=2), "nag_alpha")]
)
def test_bad_nag_options_are_refused_naming_the_input(make, message):
    with pytest.raises(WanVACEInputError, match=message):
        make()


def test_riflex_sets_the_intrinsic_time_component_to_the_papers_frequency(model):
    expert = model.transformer
    hidden = torch.zeros(1, 16, 5, HEIGHT // 8, WIDTH // 8)
    plain_cos, plain_sin = expert.rope(hidden)
    with attention_guidance(_hooks(None, riflex_index=2, riflex_experts=(expert,))):
        cos, sin = expert.rope(hidden)
    frames = 5 // expert.config.patch_size[0]
    per_frame = cos.shape[1] // frames
    angle = torch.arange(frames, dtype=torch.float64).repeat_interleave(per_frame) * (0.9 * 2 * math.pi / frames)
    for column in (2, 3):  # component 2 of the time axis (1-based): its cos/sin pair
        torch.testing.assert_close(cos[0, :, 0, column].double(), torch.cos(angle).to(cos.dtype).double())
        torch.testing.assert_close(sin[0, :, 0, column].double(), torch.sin(angle).to(sin.dtype).double())
    others = [c for c in range(cos.shape[-1]) if c not in (2, 3)]
    assert torch.equal(cos[..., others], plain_cos[..., others]) and torch.equal(
        sin[..., others], plain_sin[..., others]
    )
    assert torch.equal(expert.rope(hidden)[0], plain_cos), "the hook is gone after the run"


def test_riflex_past_the_time_components_is_refused(model, cond):
    components = model.transformer.rope.t_dim // 2
    with pytest.raises(WanVACEInputError, match=f"riflex_index={components + 1}"):
        sample(model, cond, _settings(), rules=GuidanceOptions(riflex_index=components + 1))
    changed = sample(model, cond, _settings(), rules=GuidanceOptions(riflex_index=1)).latents
    assert not torch.equal(changed, sample(model, cond, _settings()).latents)


def test_riflex_auto_picks_the_component_whose_period_is_nearest_the_frames(model):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    from wanvace_core.runtime.attention_guidance import intrinsic_component

    rope = WanRotaryPosEmbed(128, (1, 2, 2), 1024)  # Wan2.2-A14B's head dim: 22 time components, base 10000
    periods = [2 * math.pi * 10000 ** (2 * j / rope.t_dim) for j in range(rope.t_dim // 2)]
    for frames in (21, 41, 61):  # 81, 161, 241 video frames
        expected = 1 + min(range(len(periods)), key=lambda j: abs(periods[j] - frames))
        assert intrinsic_component(rope, frames) == expected
    assert [intrinsic_component(rope, frames) for frames in (21, 41, 61)] == [4, 5, 6]
    expert = model.transformer
    hidden = torch.zeros(1, 16, 5, HEIGHT // 8, WIDTH // 8)
    chosen = intrinsic_component(expert.rope, 5 // expert.config.patch_size[0])
    with attention_guidance(_hooks(None, riflex_index=chosen, riflex_experts=(expert,))):
        explicit = expert.rope(hidden)
    with attention_guidance(_hooks(None, riflex_index=-1, riflex_experts=(expert,))):
        auto = expert.rope(hidden)
    assert torch.equal(auto[0], explicit[0]) and torch.equal(auto[1], explicit[1])


def _block_inputs_and_outputs(model, cond, settings, rules, block):
    """Per expert call: (expert, the block's input, the next block's input, which is the block's output after every
    hook)."""
    inputs, seen = {}, []

    def before(name, position):
        def hook(_module, args):
            if position == 0:
                inputs[name] = args[0].clone()
            else:
                seen.append((name, inputs.pop(name), args[0].clone()))

        return hook

    handles = [
        expert.blocks[block + position].register_forward_pre_hook(before(name, position))
        for name, expert in (("high", model.transformer), ("low", model.transformer_2))
        for position in (0, 1)
    ]
    try:
        result = sample(model, cond, settings, rules=rules)
    finally:
        for handle in handles:
            handle.remove()
    return result.latents, seen


@pytest.mark.parametrize("batched", [False, True])
def test_slg_skips_the_blocks_on_the_negative_pass_only_in_its_steps(model, cond, batched):
    settings = SamplerSettings(seed=5, steps=4, cfg=4.0, cfg_low_noise=1.0, scheduler="euler", shift=5.0)
    slg = SkipLayerOptions(blocks=(1,), start_percent=0.2, end_percent=1.0)
    rules = GuidanceOptions(slg=slg)
    plain, _ = _block_inputs_and_outputs(model, cond, settings, None, 1)
    latents, seen = _block_inputs_and_outputs(model, cond, settings, rules, 1)
    assert not torch.equal(latents, plain)
    high = [(inp, out) for name, inp, out in seen if name == "high"]
    # euler, shift 5, boundary 0.875: steps 0 and 1 are the high-noise expert's, each a positive then a negative call.
    assert len(high) == 4
    for call, (inp, out) in enumerate(high):
        step, negative = divmod(call, 2)
        skipped = negative and step >= 1  # step 0 is at 0 % < 20 %
        assert torch.equal(out, inp) == skipped
    if batched:
        batched_latents = sample(model, cond, settings, rules=rules, batched_cfg=True).latents
        torch.testing.assert_close(batched_latents, latents, rtol=1e-4, atol=1e-4)


def test_slg_is_refused_past_the_models_blocks_or_without_a_negative_pass(model, cond):
    count = len(model.transformer.blocks)
    settings = SamplerSettings(seed=5, steps=4, cfg=4.0, cfg_low_noise=4.0, scheduler="euler")
    with pytest.raises(WanVACEInputError, match=f"slg_blocks=\\[{count}\\]"):
        sample(model, cond, settings, rules=GuidanceOptions(slg=SkipLayerOptions(blocks=(count,))))
    with pytest.raises(WanVACEInputError, match="no expert runs a negative pass"):
        sample(model, cond, _settings(), rules=GuidanceOptions(slg=SkipLayerOptions(blocks=(0,))))
    with pytest.raises(WanVACEInputError, match=r"slg_start_percent=0\.8 is after"):
        SkipLayerOptions(start_percent=0.8, end_percent=0.2)


def test_slg_under_step_caching_keeps_one_cached_unit_per_pass(model, cond):
    from wanvace_core import ExpertCacheLimits

    settings = SamplerSettings(seed=5, steps=6, cfg=4.0, cfg_low_noise=3.0, scheduler="euler", shift=5.0)
    rules = GuidanceOptions(slg=SkipLayerOptions(blocks=(1,), start_percent=0.0))
    eager = ExpertCacheLimits(max_warmup_steps=1)
    cache = CacheOptions(residual_diff_threshold=0.3, high_noise=eager, low_noise=eager)
    # cache-dit checks, when the run ends, that each expert made the calls it was told of: SLG adds none.
    result = sample(model, cond, settings, rules=rules, cache=cache)
    assert torch.isfinite(result.latents).all()
    assert any(expert.cached_steps for expert in result.cache_report.experts), result.cache_report


def test_nag_with_a_lora_and_with_layerwise_offload(model, cond, tmp_path):
    from tests.support.lora_files import lora_content, write_lora
    from wanvace_core.runtime.lora import LoraPatch
    from wanvace_core.runtime.offload import OffloadOptions
    from wanvace_core.runtime.plan import RuntimePlan, replan

    rules = GuidanceOptions(nag=NAGOptions())
    path = write_lora(tmp_path / "style.safetensors", lora_content(model, rank=4, seed=1, alpha=2.0), "lightx2v")
    with_lora = model.with_loras(LoraPatch(path, 1.0, 1.0))
    lora_alone = sample(with_lora, cond, _settings()).latents
    lora_and_nag = sample(with_lora, cond, _settings(), rules=rules).latents
    assert torch.isfinite(lora_and_nag).all() and not torch.equal(lora_and_nag, lora_alone)
    nag = sample(model, cond, _settings(), rules=rules).latents
    assert not torch.equal(lora_and_nag, nag)
    replan(model, RuntimePlan(offload=OffloadOptions("layerwise")))
    try:
        assert torch.equal(sample(model, cond, _settings(), rules=rules).latents, nag)
    finally:
        replan(model, RuntimePlan())


def test_slg_with_a_scale_adds_an_extra_pass_without_the_blocks_on_its_steps(model, cond):
    settings = SamplerSettings(seed=5, steps=4, cfg=4.0, cfg_low_noise=1.0, scheduler="euler", shift=5.0)
    rules = GuidanceOptions(slg=SkipLayerOptions(blocks=(1,), start_percent=0.2, end_percent=1.0, scale=3.0))
    latents, seen = _block_inputs_and_outputs(model, cond, settings, rules, 1)
    one_pass, _ = _block_inputs_and_outputs(
        model, cond, settings, GuidanceOptions(slg=rules.slg.__class__((1,), 0.2)), 1
    )
    assert not torch.equal(latents, one_pass)
    # Steps 0-1 are the high-noise expert's at cfg 4 (positive, negative, and from step 1 on the extra pass); steps 2-3
    # the low-noise expert's at cfg 1 (positive, then the extra pass).
    calls = [(name, torch.equal(inp, out)) for name, inp, out in seen]
    assert calls == [
        ("high", False),
        ("high", False),
        ("high", False),
        ("high", False),
        ("high", True),
        ("low", False),
        ("low", True),
        ("low", False),
        ("low", True),
    ]


def test_slg_with_a_scale_is_refused_with_step_caching(model, cond):
    rules = GuidanceOptions(slg=SkipLayerOptions(blocks=(1,), scale=3.0))
    with pytest.raises(WanVACEInputError, match="set slg_scale to 0"):
        sample(model, cond, _settings(3.0, 1.0), rules=rules, cache=CacheOptions())
