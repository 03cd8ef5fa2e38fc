"""Offload options through a real ComfyUI: same results as no offload, and ComfyUI's unload frees our memory."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from workflow_graphs import for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[1] / "api_workflows"
RELEASED = "WanVACE released"
RELOADED = "Reloaded WanVACE weights"
REUSED = "WanVACE: reusing the loaded"


def _workflow(seed: int, prefix: str, offload: dict | None) -> dict:
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_v2v.json").read_text()))
    ids = {node["class_type"]: key for key, node in workflow.items()}
    workflow[ids["WanVACESampler"]]["inputs"]["seed"] = seed
    if offload is not None:
        workflow["600"] = {"class_type": "WanVACEOffloadOptions", "inputs": offload}
        workflow[ids["WanVACEModelLoader"]]["inputs"]["offload"] = ["600", 0]
    workflow["900"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [ids["WanVACESampler"], 0], "filename_prefix": prefix},
    }
    return workflow


def _released_bytes(server, log_start: int) -> list[int]:
    return [int(count) for count in re.findall(rf"{RELEASED} ([0-9]+) bytes", server.log_text()[log_start:])]


def _latent(server, workflow) -> torch.Tensor:
    result = server.run_prompt(workflow)
    assert result.status == "success", result.error or result.response
    (path,) = [p for p in result.output_files() if p.suffix == ".latent"]
    return load_file(str(path))["latent_tensor"]


@pytest.mark.parametrize(
    "offload",
    [
        None,  # mode none: the weights are dropped on unload and read back from the files
        {"mode": "model", "prefetch_blocks": 1, "max_pinned_mb": 0},
        {"mode": "layerwise", "prefetch_blocks": 2, "max_pinned_mb": 0},
    ],
)
def test_offload_modes_match_no_offload_and_obey_comfyui_unload(offload, comfy_server):
    mode = "none" if offload is None else offload["mode"]
    plain = _latent(comfy_server, _workflow(61, f"offload_{mode}/plain", None))
    first_workflow = _workflow(61, f"offload_{mode}/first", offload)
    first = _latent(comfy_server, first_workflow)
    assert torch.equal(first, plain)

    log_start = len(comfy_server.log_text())
    # Woken by the same prompt, ComfyUI keeps the loaded model in its cache: it is our memory it unloads.
    comfy_server.free(unload_models=True, free_memory=False, wake=first_workflow)
    deadline = time.monotonic() + 30
    while not _released_bytes(comfy_server, log_start) and time.monotonic() < deadline:
        time.sleep(0.5)
    released = _released_bytes(comfy_server, log_start)
    assert released, "ComfyUI's unload did not reach our patcher"
    # The bytes our residency measured as freed: the whole pipeline without offload (weights dropped), the
    # component still on the device (the VAE, after decoding) with it.
    assert sum(released) > 0, released

    reloads = comfy_server.log_text().count(RELOADED)
    _latent(comfy_server, _workflow(62, f"offload_{mode}/other", offload))
    again = _latent(comfy_server, _workflow(61, f"offload_{mode}/again", offload))
    assert torch.equal(again, first)
    # Offload re-onloads from host memory; without it, the dropped weights are read back from the files.
    reloaded = comfy_server.log_text().count(RELOADED) - reloads
    assert reloaded > 0 if offload is None else reloaded == 0


def test_invalid_offload_options_are_refused_at_queue_time(comfy_server):
    workflow = _workflow(63, "offload_invalid", {"mode": "sequential", "prefetch_blocks": 1, "max_pinned_mb": 0})
    result = comfy_server.run_prompt(workflow)
    assert result.status == "rejected"
    assert "mode='sequential'" in json.dumps(result.node_errors["600"])


def test_changing_only_the_offload_options_reattaches_to_the_loaded_weights(comfy_server):
    def fp32(workflow: dict) -> dict:
        for node in workflow.values():
            if node["class_type"] == "WanVACEModelLoader":
                node["inputs"]["dtype"] = "fp32"  # a dtype no other test loads: this loader really runs
        return workflow

    plain = _latent(comfy_server, fp32(_workflow(64, "reattach/none", None)))
    for mode in ("model", "layerwise"):
        log_start = len(comfy_server.log_text())
        options = {"mode": mode, "prefetch_blocks": 1, "max_pinned_mb": 0}
        assert torch.equal(_latent(comfy_server, fp32(_workflow(64, f"reattach/{mode}", options))), plain)
        log = comfy_server.log_text()[log_start:]
        assert REUSED in log and "Loaded WanVACE pipeline" not in log, log
