"""Our pipeline inside ComfyUI's model management, next to ComfyUI's own models, under its memory flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from comfy_server import ComfyServer
from safetensors.torch import load_file
from workflow_graphs import for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[1] / "api_workflows"
RELEASED = "WanVACE released"
LOADED = "Loaded WanVACE pipeline"


def _workflow(seed: int, prefix: str) -> dict:
    """Our T2V workflow, then a core VAE round trip of its frames in the same prompt.

    The core VAE goes through comfy.model_management.load_models_gpu, as every core model does, while our
    pipeline is registered there (the frames it encodes are ours, so it runs after our nodes).
    """
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_t2v.json").read_text()))
    ids = {node["class_type"]: key for key, node in workflow.items()}
    workflow[ids["WanVACESampler"]]["inputs"]["seed"] = seed
    workflow["900"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [ids["WanVACESampler"], 0], "filename_prefix": prefix},
    }
    workflow["901"] = {"class_type": "VAELoader", "inputs": {"vae_name": "pixel_space"}}
    workflow["902"] = {"class_type": "VAEEncode", "inputs": {"pixels": [ids["WanVACEDecode"], 0], "vae": ["901", 0]}}
    workflow["903"] = {"class_type": "VAEDecode", "inputs": {"samples": ["902", 0], "vae": ["901", 0]}}
    workflow["904"] = {"class_type": "SaveImage", "inputs": {"images": ["903", 0], "filename_prefix": prefix}}
    return workflow


def _latent(server, workflow) -> torch.Tensor:
    result = server.run_prompt(workflow)
    assert result.status == "success", (result.error or result.response, server.log_tail())
    files = result.output_files()
    assert [p for p in files if p.suffix == ".png"], "the core VAE round trip wrote no image"
    (path,) = [p for p in files if p.suffix == ".latent"]
    return load_file(str(path))["latent_tensor"]


def test_a_core_model_runs_after_our_workflow_and_unload_frees_ours(comfy_server):
    log_start = len(comfy_server.log_text())  # the session's server ran other tests' refusals before
    workflow = _workflow(71, "memory/first")
    first = _latent(comfy_server, workflow)
    releases = comfy_server.log_text().count(RELEASED)
    comfy_server.free(unload_models=True, free_memory=True, wake=workflow)
    assert comfy_server.log_text().count(RELEASED) > releases, "POST /free did not reach our patcher"
    assert torch.equal(_latent(comfy_server, _workflow(71, "memory/again")), first)
    assert "Traceback" not in comfy_server.log_text()[log_start:], comfy_server.log_tail(80)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [("--disable-smart-memory", "--cache-lru", "2"), ("--cache-none",)],
    ids=["no-smart-memory+lru", "cache-none"],
)
def test_memory_and_cache_flags_give_the_same_result_every_prompt(flags, fresh_comfy_base):
    with ComfyServer(fresh_comfy_base, extra_args=flags) as server:
        first = _latent(server, _workflow(72, "flags/first"))
        assert torch.equal(_latent(server, _workflow(72, "flags/second")), first)
        # "Unload models" while nothing else holds the pipeline (so under --cache-none): it dies inside ComfyUI's
        # unload, which must go on walking its list of loaded models with its prompt worker alive.
        loads = server.log_text().count(LOADED)
        server.free(unload_models=True, free_memory=False)
        assert torch.equal(_latent(server, _workflow(72, "flags/third")), first)
        if "--cache-none" in flags:
            assert server.log_text().count(LOADED) > loads, "Unload models did not release the pipeline"
        assert not torch.equal(_latent(server, _workflow(73, "flags/other")), first)  # really sampled again
        assert "Traceback" not in server.log_text(), server.log_tail(80)
