"""Context windows through a real ComfyUI: a window over the whole video is the windowless prompt bit for bit, a
longer video runs as windows and equals the same windowed run alone, bad settings are refused at queue time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.api_graphs import nodes_of_type
from wanvace_core import (
    CacheOptions,
    ContextWindowOptions,
    ExpertCacheLimits,
    SamplerSettings,
    VACEInputs,
    load_pipeline,
    prepare_conditioning,
    sample,
    to_vae_space,
)
from workflow_graphs import TINY_MODEL, for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
LONG = 33  # video frames: 9 latent frames
WINDOWS = {
    "context_length": 17,
    "context_overlap": 8,
    "schedule": "standard_uniform",
    "context_stride": 1,
    "closed_loop": False,
    "fuse_method": "pyramid",
    "freenoise": True,
}


# Eager TaylorSeer caching, so that the tiny model caches within 8 steps.
CACHE_WIDGETS = {
    "mode": "DBCache+TaylorSeer",
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "residual_diff_threshold": 0.3,
    "max_warmup_steps": 1,
    "max_cached_steps": -1,
    "low_noise_max_warmup_steps": 1,
    "low_noise_max_cached_steps": -1,
    "taylorseer_order": 1,
}


def _workflow(
    seed: int, prefix: str, windows: dict | None, length: int = LONG, steps: int = 4, cache: bool = False
) -> dict:
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_t2v.json").read_text()))
    ids = {node["class_type"]: key for key, node in workflow.items()}
    workflow[ids["WanVACEConditioning"]]["inputs"]["length"] = length
    sampler = workflow[ids["WanVACESampler"]]["inputs"]
    sampler.update(seed=seed, steps=steps)
    if cache:
        workflow["700"] = {"class_type": "WanVACECacheOptions", "inputs": dict(CACHE_WIDGETS)}
        sampler["cache"] = ["700", 0]
    if windows is not None:
        workflow["710"] = {"class_type": "WanVACEContextWindows", "inputs": dict(windows)}
        sampler["context_windows"] = ["710", 0]
    for class_type in ("WanVACEDecode", "CreateVideo", "SaveVideo"):
        del workflow[ids[class_type]]
    workflow["900"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [ids["WanVACESampler"], 0], "filename_prefix": prefix},
    }
    return workflow


def _latent(comfy_server, workflow: dict) -> torch.Tensor:
    result = comfy_server.run_prompt(workflow)
    assert result.status == "success", (result.status, result.error)
    (latent_file,) = [path for path in result.output_files() if path.suffix == ".latent"]
    return load_file(str(latent_file))["latent_tensor"]


def _alone(comfy_base, workflow: dict, settings: SamplerSettings, **options):
    """The same generation in this process on a freshly loaded model."""
    model = load_pipeline(comfy_base / "models" / "diffusers" / TINY_MODEL, "bf16")
    inputs = nodes_of_type(workflow, "WanVACEConditioning")[0]["inputs"]
    cond = prepare_conditioning(
        model, VACEInputs(inputs["positive"], inputs["negative"], inputs["width"], inputs["height"], inputs["length"])
    )
    return model, cond, sample(model, cond, settings, **options)


def test_a_window_over_the_whole_video_is_the_windowless_prompt_bitwise(comfy_server):
    plain = _latent(comfy_server, _workflow(61, "windows/plain", None))
    whole = _latent(comfy_server, _workflow(61, "windows/whole", {**WINDOWS, "context_length": LONG}))
    assert torch.equal(whole, plain)


def test_a_longer_video_runs_as_windows_and_equals_the_windowed_run_alone(comfy_server, comfy_base):
    workflow = _workflow(62, "windows/long", WINDOWS)
    served = _latent(comfy_server, workflow)
    settings = SamplerSettings(seed=62, steps=4, cfg=5.0, cfg_low_noise=5.0)
    model, cond, result = _alone(comfy_base, workflow, settings, windows=ContextWindowOptions(**WINDOWS))
    alone = to_vae_space(model, result.latents)
    assert torch.equal(served, alone)
    assert not torch.equal(alone, to_vae_space(model, sample(model, cond, settings).latents))


def test_windows_with_the_cache_equal_the_cached_windowed_run_alone_and_report_each_window(comfy_server, comfy_base):
    static = {**WINDOWS, "schedule": "standard_static"}
    workflow = _workflow(64, "windows/cached", static, steps=8, cache=True)
    result = comfy_server.run_prompt(workflow)
    assert result.status == "success", (result.status, result.error)
    (latent_file,) = [path for path in result.output_files() if path.suffix == ".latent"]
    served = load_file(str(latent_file))["latent_tensor"]
    limits = ExpertCacheLimits(max_warmup_steps=1)
    cache = CacheOptions(mode="DBCache+TaylorSeer", residual_diff_threshold=0.3, high_noise=limits, low_noise=limits)
    settings = SamplerSettings(seed=64, steps=8, cfg=5.0, cfg_low_noise=5.0)
    model, _, alone = _alone(comfy_base, workflow, settings, windows=ContextWindowOptions(**static), cache=cache)
    assert torch.equal(served, to_vae_space(model, alone.latents))
    assert any(expert.cached_steps for expert in alone.cache_report.experts)
    assert alone.cache_report.text() in json.dumps(result.outputs), "the sampler shows the per-window cache report"


def test_the_cache_with_moving_windows_fails_the_prompt_naming_the_schedule(comfy_server):
    # Refused when queued, under the windows node's schedule (nodes/graph_checks.py reads the graph).
    result = comfy_server.run_prompt(_workflow(65, "windows/moving", WINDOWS, cache=True))
    assert result.status == "rejected"
    (error,) = result.node_errors["710"]["errors"]
    assert error["extra_info"]["input_name"] == "schedule"
    assert "schedule standard_static, not 'standard_uniform'" in error["details"]


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("context_length", 19, "context_length=19 must be 4n+1"),
        ("context_overlap", 6, "context_overlap=6 must be a multiple of 4"),
        ("context_overlap", 16, "context_overlap=16 must be less than context_length - 1"),
    ],
)
def test_bad_window_settings_are_refused_at_queue_time_naming_the_input(comfy_server, field, value, fragment):
    result = comfy_server.run_prompt(_workflow(63, "windows/bad", {**WINDOWS, field: value}))
    assert result.status == "rejected"
    assert fragment in json.dumps(result.node_errors["710"])
