"""Offload options through a real ComfyUI: same results as no offload, and ComfyUI's unload frees our memory.

What the unload does to the weights is measured in the server process where it can be on a CPU-only ComfyUI: the
tiny model's transformer weights are used in place from their memory-mapped .safetensors files, so
`/proc/<pid>/smaps` shows whether they are held and where.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.rss import file_mappings
from tests.support.api_graphs import node_id_of
from workflow_graphs import TINY_MODEL, for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
RELEASED = "WanVACE released"
RELOADED = "Reloaded WanVACE weights"
REUSED = "WanVACE: reusing the loaded"
MODEL = f"{TINY_MODEL}-offload"
# fp32 latents of the tiny model's shipped v2v prompt: SDPA's math kernel against its default one. Measured max abs
# difference: 1.2e-5 (ComfyUI 0.33, torch 2.11) and 1.0e-5 (0.3.75, torch 2.8).
MATH_KERNEL_TOLERANCE = 1e-4


def _workflow(seed: int, prefix: str, offload: dict | None) -> dict:
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_v2v.json").read_text()), model_name=MODEL)
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


@pytest.fixture(scope="module")
def model_folder(comfy_base) -> Path:
    """A copy of the tiny pipeline under a name of this module's own: only its prompts map these files."""
    folder = comfy_base / "models" / "diffusers" / MODEL
    shutil.copytree(comfy_base / "models" / "diffusers" / TINY_MODEL, folder)
    return folder


def _released_bytes(server, log_start: int) -> list[int]:
    return [int(count) for count in re.findall(rf"{RELEASED} ([0-9]+) bytes", server.log_text()[log_start:])]


def _latent(server, workflow, sampled: bool = True) -> torch.Tensor:
    """The saved latent; `sampled`: the sampler really sampled in this prompt (not served from ComfyUI's cache)."""
    result = server.run_prompt(workflow)
    assert result.status == "success", result.error or result.response
    if sampled:
        result.assert_ran(node_id_of(workflow, "WanVACESampler"))
    (path,) = [p for p in result.output_files() if p.suffix == ".latent"]
    return load_file(str(path))["latent_tensor"]


def _expert_mappings(server, folder: Path) -> dict[str, tuple]:
    """Expert weight file -> the address ranges the server maps it at."""
    return {
        Path(path).parent.name: mapping.ranges
        for path, mapping in file_mappings(server.proc.pid, folder).items()
        if path.endswith(".safetensors")
    }


@pytest.mark.parametrize(
    "offload",
    [
        None,  # mode none: the weights are dropped on unload and read back from the files
        {"mode": "model", "prefetch_blocks": 1, "max_pinned_mb": 0},
        {"mode": "layerwise", "prefetch_blocks": 2, "max_pinned_mb": 0},
    ],
)
def test_offload_modes_match_no_offload_and_obey_comfyui_unload(offload, comfy_server, model_folder):
    mode = "none" if offload is None else offload["mode"]
    # May come from ComfyUI's cache (the previous case's last prompt): the no-offload result all the same.
    plain_workflow = _workflow(61, f"offload_{mode}/plain", None)
    plain = _latent(comfy_server, plain_workflow, sampled=False)
    if offload is None:
        first_workflow, first = plain_workflow, plain
    else:
        first_workflow = _workflow(61, f"offload_{mode}/first", offload)
        first = _latent(comfy_server, first_workflow)
        assert torch.equal(first, plain)
    held = _expert_mappings(comfy_server, model_folder)
    assert set(held) == {"transformer", "transformer_2"}, held

    log_start = len(comfy_server.log_text())
    # Woken by the same prompt, ComfyUI keeps the loaded model in its cache: it is our memory it unloads.
    comfy_server.free(unload_models=True, free_memory=False, wake=first_workflow)
    if offload is None:
        # The weights are dropped, though the pipeline stays in ComfyUI's cache.
        assert _expert_mappings(comfy_server, model_folder) == {}, "ComfyUI's unload did not reach our patcher"
    else:
        # On a CPU-only ComfyUI offloading keeps the weights where they are (host memory, mapped from the files):
        # those mappings stay, while those of the no-offload pipeline of `plain`, where ComfyUI still holds it, go.
        # What the unload frees of the offloaded pipeline is the few KiB copied to the device (the cpu): no
        # measurable amount, so the pack's account of it is the evidence that the unload reached it.
        kept = _expert_mappings(comfy_server, model_folder)
        assert set(kept) == set(held) and all(set(kept[name]) <= set(held[name]) for name in kept), (held, kept)
        assert sum(_released_bytes(comfy_server, log_start)) > 0, "ComfyUI's unload did not reach our patcher"

    reloads = comfy_server.log_text().count(RELOADED)
    _latent(comfy_server, _workflow(62, f"offload_{mode}/other", offload))
    again = _latent(comfy_server, _workflow(61, f"offload_{mode}/again", offload))
    assert torch.equal(again, first)
    # Without offload, the dropped weights were read back from the files (mapped again).
    assert set(_expert_mappings(comfy_server, model_folder)) == {"transformer", "transformer_2"}
    if offload is not None:
        # Offload re-onloads from host memory: still the same mappings. A re-read would map the files anew, possibly
        # at the same addresses, so the pack's account is the evidence that nothing was re-read.
        assert _expert_mappings(comfy_server, model_folder) == kept
        assert comfy_server.log_text().count(RELOADED) == reloads


def test_invalid_offload_options_are_refused_at_queue_time(comfy_server):
    workflow = _workflow(63, "offload_invalid", {"mode": "sequential", "prefetch_blocks": 1, "max_pinned_mb": 0})
    result = comfy_server.run_prompt(workflow)
    assert result.status == "rejected"
    assert "mode='sequential'" in json.dumps(result.node_errors["600"])


def test_changing_only_the_offload_options_reattaches_to_the_loaded_weights(comfy_server, model_folder):
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
        # Re-attaching or re-reading shows in no measurement (fp32 weights cast from the bf16 files are private
        # memory of the same size either way): the pack's account is the evidence.
        log = comfy_server.log_text()[log_start:]
        assert REUSED in log and "Loaded WanVACE pipeline" not in log, log


def test_changing_only_the_attention_reattaches_and_runs_that_kernel(comfy_server, model_folder):
    def with_attention(workflow: dict, attention: str | None) -> dict:
        loader = workflow[node_id_of(workflow, "WanVACEModelLoader")]["inputs"]
        loader["dtype"] = "fp32"  # bf16 would round the kernels' differences up to the latents' last bits
        if attention is not None:
            loader["attention"] = attention
        return workflow

    plain = _latent(comfy_server, with_attention(_workflow(65, "attention/plain", None), None))
    for attention, resolved in (("native", "native"), ("auto", "native"), ("_native_math", "_native_math")):
        log_start = len(comfy_server.log_text())
        latent = _latent(comfy_server, with_attention(_workflow(65, f"attention/{attention}", None), attention))
        log = comfy_server.log_text()[log_start:]
        assert REUSED in log and "Loaded WanVACE pipeline" not in log, log
        assert f"WanVACE attention: {resolved} (chosen: {attention})" in log, log
        if resolved == "native":
            assert torch.equal(latent, plain)  # naming today's kernel is today's result
        else:
            assert (latent - plain).abs().max().item() <= MATH_KERNEL_TOLERANCE
