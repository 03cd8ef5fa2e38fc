"""WanVACE LoRA Loader inside a real ComfyUI: the shipped 4-step Lightning workflow, a branch without the LoRA in
the same prompt, strength 0, and a LoRA made for another model refused with the file and key named."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.api_graphs import node_id_of, nodes_of_type
from workflow_graphs import LIGHTNING_SAMPLING, LIGHTNING_VARIANT, for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
LIGHTNING = "t2v" + LIGHTNING_VARIANT


def _lightning() -> dict:
    return for_tiny_model(json.loads((API_DIR / f"wanvace_{LIGHTNING}.json").read_text()))


def _save_latent(workflow: dict, node_id: str, sampler: str, prefix: str) -> None:
    workflow[node_id] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [sampler, 0], "filename_prefix": f"wanvace_lora/{prefix}"},
    }


def _latents(result) -> dict[str, torch.Tensor]:
    """Saved latents by the prefix's last part."""
    return {
        path.name.split("_")[0]: load_file(str(path))["latent_tensor"]
        for path in result.output_files()
        if path.suffix == ".latent"
    }


def _loader_ids(workflow: dict) -> list[str]:
    return [key for key, node in workflow.items() if node["class_type"] == "WanVACELoraLoader"]


def _without_loras(workflow: dict) -> dict:
    """A copy of `workflow` whose sampler takes the loader's model directly, every LoRA loader removed."""
    plain = copy.deepcopy(workflow)
    plain[node_id_of(plain, "WanVACESampler")]["inputs"]["model"] = [node_id_of(plain, "WanVACEModelLoader"), 0]
    for loader in _loader_ids(plain):
        del plain[loader]
    return plain


@pytest.mark.slow
def test_a_branch_without_the_lora_samples_the_plain_model_in_the_same_prompt(comfy_server):
    workflow = _lightning()
    sampler = node_id_of(workflow, "WanVACESampler")
    base_loader = node_id_of(workflow, "WanVACEModelLoader")
    assert workflow[sampler]["inputs"]["model"][0] in _loader_ids(workflow)
    # A second sampler on the loader's own output, run after the LoRA branch in the same prompt.
    workflow["800"] = copy.deepcopy(workflow[sampler])
    workflow["800"]["inputs"]["model"] = [base_loader, 0]
    _save_latent(workflow, "801", sampler, "lora")
    _save_latent(workflow, "802", "800", "plain")
    result = comfy_server.run_prompt(workflow, timeout=600)
    assert result.status == "success", result.error
    latents = _latents(result)

    # The same sampling without any LoRA loader in the graph. Its sampler has the inputs of "800" above, so ComfyUI
    # would hand back that output: with the cache emptied, it samples again, on the pipeline the LoRA prompt used.
    plain = _without_loras(_lightning())
    _save_latent(plain, "801", node_id_of(plain, "WanVACESampler"), "alone")
    comfy_server.drop_cached_outputs()
    alone = comfy_server.run_prompt(plain, timeout=600)
    assert alone.status == "success", alone.error
    assert torch.equal(latents["plain"], _latents(alone.assert_ran(node_id_of(plain, "WanVACESampler")))["alone"])
    assert not torch.equal(latents["lora"], latents["plain"])
    assert nodes_of_type(workflow, "WanVACESampler")[0]["inputs"]["steps"] == LIGHTNING_SAMPLING["steps"]


@pytest.mark.slow
def test_strength_zero_on_both_experts_equals_no_lora(comfy_server):
    workflow = _lightning()
    for loader in _loader_ids(workflow):
        workflow[loader]["inputs"].update(strength_high_noise=0.0, strength_low_noise=0.0)
    sampler = node_id_of(workflow, "WanVACESampler")
    _save_latent(workflow, "801", sampler, "zero")
    zero = comfy_server.run_prompt(workflow, timeout=600)
    assert zero.status == "success", zero.error

    plain = _without_loras(workflow)
    _save_latent(plain, "801", sampler, "none")
    none = comfy_server.run_prompt(plain, timeout=600)
    assert none.status == "success", none.error
    # The samplers differ in their model input (a LoRA loader, the model loader), so the second samples too.
    assert torch.equal(_latents(zero)["zero"], _latents(none.assert_ran(sampler))["none"])


def test_a_lora_for_another_model_is_refused_naming_the_file_and_key(comfy_server, comfy_base, tmp_path):
    from tests.support.lora_files import write_lora_file
    from wanvace_core import load_pipeline
    from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline

    other = load_pipeline(write_tiny_pipeline(tmp_path / "wide", TinyModelSpec(text_dim=48)), "fp32").transformer
    name = "wan_lora_for_another_model.safetensors"
    path = write_lora_file(comfy_base / "models" / "loras" / name, other, "comfy", rank=2, seed=3)
    workflow = _lightning()
    (first, *_rest) = _loader_ids(workflow)
    workflow[first]["inputs"]["lora_name"] = name
    result = comfy_server.run_prompt(workflow, timeout=600)
    assert result.status == "error", result.response
    message = result.error["exception_message"]
    assert str(path) in message or name in message, message
    assert "diffusion_model." in message, message  # the first bad key, as the file spells it
