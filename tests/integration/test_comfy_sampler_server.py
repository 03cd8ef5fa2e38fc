"""ComfyUI's SAMPLER and SIGMAS into WanVACESampler through a real ComfyUI server: the shipped KSamplerSelect +
WanVACE Scheduler graph against the same run through the core in this process, cancel and re-queue on that path, the
CFG++ refusal, and the guidance options node (NAG, APG) on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.api_graphs import node_id_of, nodes_of_type
from wanvace_core import SamplerSettings, VACEInputs, load_pipeline, prepare_conditioning, sample, to_vae_space
from workflow_graphs import LIGHTNING_NAG, TINY_MODEL, for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
SHIFT, STEPS = 8.0, 4
# fp32 experts: in bf16 the float rounding below flips the bf16 cast of the experts' input here and there, and over
# 40 steps that grew to 2.8e-2 of the latent's largest value, which would hide a wrong schedule.
DTYPE = "fp32"
# The server steps with ComfyUI's euler (x0 = x - sigma v, then d = (x - x0) / sigma), the core with diffusers'
# flow-match Euler (x + (sigma_next - sigma) v): the same step in other float rounding. Measured max |diff| /
# max |ref| (fp32, CPU): 7.0e-7 over 4 steps, 2.8e-7 over 60 (0.33.0); a neighbouring schedule differs by far more.
SAMPLER_RTOL = 5e-6


@pytest.fixture(scope="module")
def tiny(comfy_base):
    """The tiny model as WanVACE Model Loader loads it (fp32) and the conditioning the t2v graph asks for."""
    model = load_pipeline(comfy_base / "models" / "diffusers" / TINY_MODEL, DTYPE)
    inputs = nodes_of_type(_graph(0, "x"), "WanVACEConditioning")[0]["inputs"]
    cond = prepare_conditioning(
        model, VACEInputs(inputs["positive"], inputs["negative"], inputs["width"], inputs["height"], inputs["length"])
    )
    return model, cond


def _graph(seed: int, prefix: str, steps: int = STEPS, sampler_name: str = "euler", **sampler_inputs) -> dict:
    """The shipped KSamplerSelect + WanVACE Scheduler (simple, shift 8) graph on the tiny model in fp32, its LATENT
    saved."""
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_t2v_comfy_sampler.json").read_text()))
    nodes_of_type(workflow, "WanVACEModelLoader")[0]["inputs"]["dtype"] = DTYPE
    nodes_of_type(workflow, "KSamplerSelect")[0]["inputs"]["sampler_name"] = sampler_name
    scheduler = nodes_of_type(workflow, "WanVACEScheduler")[0]["inputs"]
    assert (scheduler["scheduler"], scheduler["shift"]) == ("simple", SHIFT)
    scheduler["steps"] = steps
    sampler = node_id_of(workflow, "WanVACESampler")
    workflow[sampler]["inputs"].update(seed=seed, steps=steps, **sampler_inputs)
    workflow["900"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [sampler, 0], "filename_prefix": f"wanvace_test/comfy_sampler/{prefix}"},
    }
    return workflow


def _with_guidance(workflow: dict, **widgets) -> dict:
    """WanVACE Guidance Options into the sampler: the widgets of the Lightning workflow's node, NAG off, then
    `widgets`."""
    values = {**LIGHTNING_NAG, "nag_scale": 1.0, **widgets}
    workflow["800"] = {"class_type": "WanVACEGuidanceOptions", "inputs": values}
    workflow[node_id_of(workflow, "WanVACESampler")]["inputs"]["guidance"] = ["800", 0]
    return workflow


def _sampler_id() -> str:
    return node_id_of(_graph(0, "x"), "WanVACESampler")


def _saved_latent(result) -> torch.Tensor:
    (path,) = [p for p in result.output_files() if p.suffix == ".latent"]
    return load_file(str(path))["latent_tensor"]


def _simple_sigmas(shift: float, steps: int) -> tuple[float, ...]:
    """ComfyUI's `simple` schedule of a shifted flow model, from its definition: every (1000 / steps)-th entry, from
    the top, of the 1000-entry table sigma(t) = shift t / (1 + (shift - 1) t), t = i / 1000, then 0. (That the
    scheduler node gives exactly these values of ComfyUI's own calculate_sigmas is tests/test_comfy_sampling.py's.)"""
    t = (torch.arange(1, 1001, 1) / 1000) * 1000 / 1000
    table = shift * t / (1 + (shift - 1) * t)
    stride = len(table) / steps
    return (*(float(table[-(1 + int(x * stride))]) for x in range(steps)), 0.0)


def _core(tiny, seed: int, sigmas: tuple[float, ...], cfg: float = 5.0) -> torch.Tensor:
    """The same run through the core in this process: its built-in euler over the sigmas, as a raw VAE latent."""
    model, cond = tiny
    settings = SamplerSettings(
        seed=seed, steps=len(sigmas) - 1, cfg=cfg, cfg_low_noise=cfg, scheduler="euler", sigmas=sigmas
    )
    return to_vae_space(model, sample(model, cond, settings).latents)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def test_ksampler_select_euler_and_scheduler_node_equal_the_core_run(comfy_server, tiny):
    result = comfy_server.run_prompt(_graph(61, "parity"))
    assert result.status == "success", result.error
    served = _saved_latent(result.assert_ran(_sampler_id()))
    expected = _core(tiny, 61, _simple_sigmas(SHIFT, STEPS))
    assert served.shape == expected.shape and torch.isfinite(served).all()
    error = _relative(served, expected)
    print(f"ComfyUI euler SAMPLER through the server vs the core's euler: max |diff| / max |ref| = {error:.3g}")
    assert error < SAMPLER_RTOL, error
    # The tolerance tells schedules apart: our euler's own curve (ComfyUI's normal) at the same shift is far off.
    normal = _core(tiny, 61, _normal_sigmas(tiny, SHIFT, STEPS))
    assert _relative(served, normal) > 100 * SAMPLER_RTOL, _relative(served, normal)


def _normal_sigmas(tiny, shift: float, steps: int) -> tuple[float, ...]:
    from wanvace_core.generation.schedules import step_sigmas, timesteps_for

    model, _ = tiny
    settings = SamplerSettings(seed=0, steps=steps, cfg=1.0, cfg_low_noise=1.0, shift=shift, scheduler="euler")
    return tuple(step_sigmas(timesteps_for(model.scheduler_config, settings)[0]).tolist())


def test_cancel_on_the_sampler_path_then_a_new_seed_gives_the_uncancelled_result(comfy_server, tiny):
    # Long enough that the cancel, sent at the second progress message, lands mid-run (0.33 sends progress at most
    # every 100 ms).
    steps = 60
    cancelled = comfy_server.run_prompt(_graph(71, "cancel_a", steps=steps), interrupt_after_progress=2)
    assert cancelled.status == "interrupted"
    sampler = _sampler_id()
    seen = [event["value"] for event in cancelled.progress_events() if event.get("node") == sampler]
    assert seen and max(seen) < steps, seen

    after = comfy_server.run_prompt(_graph(72, "cancel_b", steps=steps))
    assert after.status == "success", after.error
    # The sampler ran again (not served from ComfyUI's cache, which did serve the unchanged loader and conditioning),
    # and its result is that of a run never cancelled.
    served = _saved_latent(after.assert_ran(sampler))
    graph = _graph(72, "x", steps=steps)
    unchanged = {node_id_of(graph, "WanVACEModelLoader"), node_id_of(graph, "WanVACEConditioning")}
    assert unchanged <= set(after.cached_nodes()), after.cached_nodes()
    error = _relative(served, _core(tiny, 72, _simple_sigmas(SHIFT, steps)))
    print(f"after the cancel, {steps} steps: max |diff| / max |ref| = {error:.3g}")
    assert error < SAMPLER_RTOL, error


def test_cfg_pp_sampler_without_a_negative_pass_is_a_node_error_naming_it_and_the_fix(comfy_server):
    # CFG++ reads each step's negative prediction, which the low-noise expert at cfg 1 never makes.
    result = comfy_server.run_prompt(_graph(81, "cfg_pp", sampler_name="euler_cfg_pp", cfg_low_noise=1.0))
    assert result.status == "error"
    assert result.error["node_type"] == "WanVACESampler"
    message = result.error["exception_message"]
    assert "euler_cfg_pp" in message and "choose euler" in message and "KSamplerSelect" in message, message
    assert "raise cfg and cfg_low_noise above 1" in message, message
    # The next prompt, with either fix the message names, runs.
    for name, fixed in (("plain", {}), ("guided", {"sampler_name": "euler_cfg_pp", "cfg_low_noise": 3.0})):
        after = comfy_server.run_prompt(_graph(82, f"after_cfg_pp_{name}", **fixed))
        assert after.status == "success", (name, after.error)
        assert torch.isfinite(_saved_latent(after.assert_ran(_sampler_id()))).all(), name


def test_nag_at_cfg_1_and_apg_at_cfg_5_run_and_change_the_result(comfy_server):
    runs = {}
    for name, cfg, widgets in (
        ("plain_cfg1", 1.0, None),
        ("nag_cfg1", 1.0, {"nag_scale": 11.0}),
        ("plain_cfg5", 5.0, None),
        ("apg_cfg5", 5.0, {"rule": "apg"}),
    ):
        workflow = _graph(91, name, cfg=cfg, cfg_low_noise=cfg)
        if widgets is not None:
            workflow = _with_guidance(workflow, **widgets)
        result = comfy_server.run_prompt(workflow)
        assert result.status == "success", (name, result.error)
        runs[name] = _saved_latent(result.assert_ran(_sampler_id()))
        assert torch.isfinite(runs[name]).all(), name
    for guided, plain in (("nag_cfg1", "plain_cfg1"), ("apg_cfg5", "plain_cfg5")):
        print(f"{guided} against {plain}: {_relative(runs[guided], runs[plain]):.3g}")
        assert _relative(runs[guided], runs[plain]) > 100 * SAMPLER_RTOL, (guided, _relative(runs[guided], runs[plain]))


def test_nag_with_both_experts_guided_is_a_node_error_naming_the_fix(comfy_server):
    result = comfy_server.run_prompt(_with_guidance(_graph(95, "nag_cfg5", cfg=5.0, cfg_low_noise=3.0), nag_scale=11.0))
    assert result.status == "error"
    assert result.error["node_type"] == "WanVACESampler"
    assert "set cfg or cfg_low_noise to 1" in result.error["exception_message"], result.error["exception_message"]
    after = comfy_server.run_prompt(_graph(96, "after_nag_cfg5"))
    assert after.status == "success", after.error
