"""Cache-DiT through a real ComfyUI: settings changes between queued prompts take effect, results match runs alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.api_graphs import nodes_of_type
from wanvace_core import (
    CacheOptions,
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
CACHE_WIDGETS = {
    "mode": "DBCache+TaylorSeer",
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "residual_diff_threshold": 0.2,
    "max_warmup_steps": 1,
    "max_cached_steps": -1,
    "low_noise_max_warmup_steps": 1,
    "low_noise_max_cached_steps": -1,
    "taylorseer_order": 1,
}
CACHE_OPTIONS = CacheOptions(
    mode="DBCache+TaylorSeer",
    residual_diff_threshold=0.2,
    high_noise=ExpertCacheLimits(max_warmup_steps=1),
    low_noise=ExpertCacheLimits(max_warmup_steps=1),
)


def _workflow(seed: int, steps: int, cached: bool, prefix: str) -> dict:
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_t2v.json").read_text()))
    (sampler_id,) = [key for key, node in workflow.items() if node["class_type"] == "WanVACESampler"]
    sampler = workflow[sampler_id]["inputs"]
    sampler.update(seed=seed, steps=steps)
    if cached:
        workflow["700"] = {"class_type": "WanVACECacheOptions", "inputs": dict(CACHE_WIDGETS)}
        sampler["cache"] = ["700", 0]
    workflow["900"] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler_id, 0], "filename_prefix": prefix}}
    return workflow


def _reference(comfy_base: Path, workflow: dict, seed: int, steps: int, cached: bool):
    """The same generation in this process on a freshly loaded model: the run 'alone'."""
    model = load_pipeline(comfy_base / "models" / "diffusers" / TINY_MODEL, "bf16")
    inputs = nodes_of_type(workflow, "WanVACEConditioning")[0]["inputs"]
    cond = prepare_conditioning(
        model,
        VACEInputs(inputs["positive"], inputs["negative"], inputs["width"], inputs["height"], inputs["length"]),
    )
    result = sample(
        model,
        cond,
        SamplerSettings(seed=seed, steps=steps, cfg=5.0, cfg_low_noise=5.0),
        cache=CACHE_OPTIONS if cached else None,
    )
    return to_vae_space(model, result.latents), result.cache_report


def test_cache_on_off_and_step_changes_between_prompts_match_runs_alone(comfy_server, comfy_base):
    sequence = [(41, 20, True), (42, 20, False), (43, 12, True), (44, 20, True)]
    for index, (seed, steps, cached) in enumerate(sequence):
        workflow = _workflow(seed, steps, cached, prefix=f"cache_sequence/{index}")
        result = comfy_server.run_prompt(workflow)
        assert result.status == "success", (index, result.error)
        (latent_file,) = [path for path in result.output_files() if path.suffix == ".latent"]
        served = load_file(str(latent_file))["latent_tensor"]
        expected, report = _reference(comfy_base, workflow, seed, steps, cached)
        assert torch.equal(served, expected), f"prompt {index} differs from the same run alone"

        sampler_id = next(key for key, node in workflow.items() if node["class_type"] == "WanVACESampler")
        texts = [
            event["output"].get("text", [])
            for event in result.events_of("executed")
            if event.get("node") == sampler_id and event.get("output")
        ]
        if cached:
            assert report is not None and any(expert.cached_steps for expert in report.experts)
            assert texts == [[report.text()]]
            assert report.text() in comfy_server.log_text()
        else:
            assert texts == []


def test_invalid_cache_settings_are_refused_at_queue_time(comfy_server):
    workflow = _workflow(51, 8, True, prefix="cache_invalid")
    workflow["700"]["inputs"]["mode"] = "FBCache"
    result = comfy_server.run_prompt(workflow)
    assert result.status == "rejected"
    assert "mode='FBCache'" in json.dumps(result.node_errors["700"])


def test_block_counts_the_model_cannot_honour_fail_before_sampling(comfy_server):
    workflow = _workflow(52, 8, True, prefix="cache_bn")
    workflow["700"]["inputs"]["Bn_compute_blocks"] = 3
    result = comfy_server.run_prompt(workflow)
    assert result.status == "error"
    assert "Bn_compute_blocks=3 reaches back over VACE layer" in result.error["exception_message"]
    assert comfy_server.run_prompt(_workflow(53, 8, True, prefix="cache_after_error")).status == "success"
