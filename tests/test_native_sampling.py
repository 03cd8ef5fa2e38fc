"""A native ComfyUI Wan2.2 graph against ours on the same weights: ComfyUI's own two KSamplerAdvanced nodes (euler,
simple, ModelSamplingSD3 shift 8, split where the expert switch falls) over ComfyUI's VaceWanModel holding our two
experts' weights, and our dual-expert sampler stepped by ComfyUI's euler (nodes/comfy_sampling.py) over WanVACE
Scheduler's sigmas (simple, shift 8), from the same seed.

Runs in a subprocess inside the ComfyUI tree of the set (this module is its script), as tests/test_comfy_sampling.py.
Both sides get the same inputs: our text embeddings as ComfyUI CONDITIONING (cfg 5 on the high-noise expert, 3 on the
low-noise one), and our VACE context for a t2v run without control, handed to ComfyUI under the conditioning keys its
WanVaceToVideo node sets (vace_frames in the VAE's latent space, vace_mask, vace_strength); ComfyUI's own VAE encode
of the control video is not part of the comparison (its VAE would need our VAE's weights).
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests.support.in_comfyui import enter_comfyui, relative, run_in_comfyui

WIDTH, HEIGHT, LENGTH = 32, 32, 5
STEPS, SEED, CFG, CFG_LOW, SHIFT = 4, 7, 5.0, 3.0, 8.0
# Measured max |ours - native| / max |native| over the final latents (fp32, CPU): 8.3e-7 (0.33.0) and 1.05e-6
# (0.3.75). The two sides round differently: ComfyUI's forward (its time embedding, attention and norms; ~4e-6 per
# call on these weights), its cond and uncond in one batch against our two passes, CFG on x0 against CFG on the
# velocity, and ComfyUI's latent format in and out at the split and at the VACE frames.
NATIVE_RTOL = 1e-5


# --- the ComfyUI side (runs in the subprocess) -------------------------------------------------------------


def _comfy_model(expert):
    """ComfyUI's Wan VACE model (its model_base, in a ModelPatcher) whose diffusion model is bench/comfy_wan.py's
    VaceWanModel over `expert`'s weights, fp32."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    from bench.comfy_wan import comfy_vace_model

    config = expert.config
    unet_config = {
        "image_model": "wan2.1",
        "model_type": "vace",
        "dim": config["num_attention_heads"] * config["attention_head_dim"],
        "ffn_dim": config["ffn_dim"],
        "num_heads": config["num_attention_heads"],
        "num_layers": config["num_layers"],
        "vace_layers": len(config["vace_layers"]),
        "vace_in_dim": config["vace_in_channels"],
        "in_dim": config["in_channels"],
        "out_dim": config["out_channels"],
        "text_dim": config["text_dim"],
        "freq_dim": config["freq_dim"],
        "eps": config["eps"],
    }
    base = comfy.supported_models.WAN21_Vace(unet_config).get_model({})
    base.diffusion_model = comfy_vace_model(expert, dtype=torch.float32)
    device = comfy.model_management.get_torch_device()
    return comfy.model_patcher.ModelPatcher(base, load_device=device, offload_device=device)


def _comfy_conditioning(base, cond, strength: float = 1.0) -> tuple[list, list]:
    """Our text embeddings and VACE context as ComfyUI CONDITIONING, as WanVaceToVideo sets it on both prompts:
    vace_frames in the VAE's latent space (ComfyUI's model normalises each 16 channels with process_latent_in),
    vace_mask, vace_strength."""
    context = cond.conditioning_latents.float()
    frames = context[:, :32].clone()
    for start in (0, 16):
        frames[:, start : start + 16] = base.process_latent_out(frames[:, start : start + 16])
    vace = {"vace_frames": [frames], "vace_mask": [context[:, 32:]], "vace_strength": [strength]}
    return [[cond.prompt_embeds.float(), dict(vace)]], [[cond.negative_prompt_embeds.float(), dict(vace)]]


def _both_models(folder: str):
    """Our fp32 pipeline, its conditioning for the test's prompt, and ComfyUI's model over each of its experts
    (high, low) patched by ModelSamplingSD3 at the test's shift."""
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3
    from wanvace_pack.wanvace_core import VACEInputs, load_pipeline, prepare_conditioning

    model = load_pipeline(folder, "fp32")
    cond = prepare_conditioning(model, VACEInputs("a bird flies over the sea", "blurry", WIDTH, HEIGHT, LENGTH))
    high, low = (ModelSamplingSD3().patch(_comfy_model(e), SHIFT)[0] for e in (model.transformer, model.transformer_2))
    return model, cond, high, low


def _schedule(model) -> tuple[torch.Tensor, int]:
    """Our scheduler node's sigmas (simple, the test's shift), and the number of steps of the high-noise expert
    (t >= boundary x 1000)."""
    from wanvace_pack.nodes.scheduler import WanVACEScheduler

    sigmas = WanVACEScheduler.execute(model, "simple", STEPS, SHIFT, 1.0).result[0]
    return sigmas, int((sigmas[:-1] >= model.boundary_ratio).sum())


def _empty_latent() -> torch.Tensor:
    return torch.zeros(1, 16, (LENGTH - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)


def _native_pair(high, low, positive, negative, split: int) -> torch.Tensor:
    """Two KSamplerAdvanced as ComfyUI's Wan2.2 templates chain them (the high-noise model over the steps before
    `split` with leftover noise, the low-noise one after), in the normalised latent space our sampler works in."""
    import nodes as comfy_nodes

    sampler = comfy_nodes.KSamplerAdvanced()
    with torch.no_grad():
        (leftover,) = sampler.sample(
            high,
            "enable",
            SEED,
            STEPS,
            CFG,
            "euler",
            "simple",
            positive,
            negative,
            {"samples": _empty_latent()},
            0,
            split,
            "enable",
        )
        (native,) = sampler.sample(
            low,
            "disable",
            SEED,
            STEPS,
            CFG_LOW,
            "euler",
            "simple",
            positive,
            negative,
            leftover,
            split,
            10000,
            "disable",
        )
    # Back with ComfyUI's own latent format.
    return high.model.process_latent_in(native["samples"].float())


def _native(folder: str) -> dict:
    import comfy.sample
    import comfy.samplers
    from comfy_extras.nodes_custom_sampler import BasicScheduler
    from wanvace_pack.nodes.comfy_sampling import stepper_for
    from wanvace_pack.wanvace_core import SamplerSettings, sample
    from wanvace_pack.wanvace_core.generation.sampling import initial_noise

    import nodes as comfy_nodes

    found: dict = {"timings": {}}
    started = time.perf_counter()
    model, cond, high, low = _both_models(folder)

    # The schedule: our scheduler node's sigmas and BasicScheduler's on ComfyUI's model at the same shift.
    sigmas, split = _schedule(model)
    found["sigmas"] = (sigmas, BasicScheduler.execute(high, "simple", STEPS, 1.0).result[0])
    found["split"], found["boundary"] = split, model.boundary_ratio

    # The same starting noise: ComfyUI's prepare_noise over the empty latent, and our initial noise.
    empty = _empty_latent()
    found["noise"] = (initial_noise(model, cond, SEED), comfy.sample.prepare_noise(empty, SEED))
    found["timings"]["setup"] = time.perf_counter() - started

    # Native: two KSamplerAdvanced as ComfyUI's Wan2.2 templates chain them.
    started = time.perf_counter()
    positive, negative = _comfy_conditioning(high.model, cond)
    sampler = comfy_nodes.KSamplerAdvanced()
    found["native"] = _native_pair(high, low, positive, negative, split)
    found["timings"]["native"] = time.perf_counter() - started

    # Ours: ComfyUI's euler stepping our dual-expert denoiser over the scheduler node's sigmas.
    started = time.perf_counter()
    settings = SamplerSettings(
        seed=SEED, steps=STEPS, cfg=CFG, cfg_low_noise=CFG_LOW, scheduler="euler", sigmas=tuple(sigmas.tolist())
    )
    stepper = stepper_for(comfy.samplers.sampler_object("euler"), SHIFT)
    found["ours"] = sample(model, cond, settings, stepper=stepper).latents
    found["timings"]["ours"] = time.perf_counter() - started
    started = time.perf_counter()
    # Our own sampler without ComfyUI's: the built-in euler over the same sigmas.
    found["ours_built_in"] = sample(model, cond, settings).latents
    found["timings"]["ours_built_in"] = time.perf_counter() - started

    # Controls the tolerance must tell apart: the native graph with the low-noise expert throughout (no switch),
    # and with the VACE context weighted 0.
    started = time.perf_counter()
    controls = {"unswitched": (low, CFG_LOW, positive, negative)}
    controls["no_vace"] = (high, CFG, *_comfy_conditioning(high.model, cond, strength=0.0))
    for name, (patcher, cfg, pos, neg) in controls.items():
        with torch.no_grad():
            (latent,) = sampler.sample(
                patcher,
                "enable",
                SEED,
                STEPS,
                cfg,
                "euler",
                "simple",
                pos,
                neg,
                {"samples": empty},
                0,
                10000,
                "disable",
            )
        found[name] = high.model.process_latent_in(latent["samples"].float())
    found["timings"]["controls"] = time.perf_counter() - started
    return found


def _in_comfyui(folder: str, out_file: str) -> None:
    enter_comfyui()
    from tests.support.native_slg import slg_runs

    torch.save({**_native(folder), "slg": slg_runs(folder)}, out_file)


# --- the pytest side -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def native_run(tmp_path_factory, tiny_folder):
    return run_in_comfyui(__file__, tiny_folder, tmp_path_factory.mktemp("native_sampling"))


def test_scheduler_node_sigmas_equal_basic_scheduler_on_comfyuis_model_with_our_weights(native_run):
    ours, theirs = native_run["sigmas"]
    assert torch.equal(ours, theirs)
    # simple at shift 8 over 4 steps: 1, 0.96, 0.889 at or above the 0.875 boundary, 0.727 below.
    assert native_run["boundary"] == 0.875 and native_run["split"] == 3


def test_comfyuis_starting_noise_is_our_initial_noise(native_run):
    ours, theirs = native_run["noise"]
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)


def test_native_ksampler_advanced_pair_equals_our_sampler_with_comfyuis_euler(native_run):
    native, ours = native_run["native"], native_run["ours"]
    assert native.shape == ours.shape and torch.isfinite(native).all()
    error = relative(ours, native)
    print(f"ours (ComfyUI euler stepper) vs native KSamplerAdvanced x2: {error:.3g}; timings {native_run['timings']}")
    assert error < NATIVE_RTOL, error
    # Our built-in euler over the same sigmas agrees as closely.
    built_in = relative(native_run["ours_built_in"], native)
    print(f"ours (built-in euler over the sigmas) vs native: {built_in:.3g}")
    assert built_in < NATIVE_RTOL, built_in
    # The tolerance tells the experts apart, and sees the VACE context: the native graph without the switch, or
    # with VACE strength 0, is far off.
    for control in ("unswitched", "no_vace"):
        print(f"native {control} vs native: {relative(native_run[control], native):.3g}")
        assert relative(native_run[control], native) > 100 * NATIVE_RTOL, (
            control,
            relative(native_run[control], native),
        )


def test_our_slg_skips_its_blocks_on_the_steps_comfyuis_node_skips(native_run):
    from tests.support.native_slg import check_the_same_steps_are_skipped

    check_the_same_steps_are_skipped(native_run["slg"])


def test_our_one_pass_slg_equals_comfyuis_skip_layer_guidance_dit_simple(native_run):
    from tests.support.native_slg import check_equal_to_the_one_pass_node

    check_equal_to_the_one_pass_node(native_run["slg"])


def test_our_extra_pass_slg_equals_comfyuis_skip_layer_guidance_dit(native_run):
    from tests.support.native_slg import check_equal_to_the_extra_pass_node

    check_equal_to_the_extra_pass_node(native_run["slg"])


if __name__ == "__main__":
    _in_comfyui(sys.argv[1], sys.argv[2])
