"""WanVACE Experts Loader and the original release folder inside a real ComfyUI, through POST /prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.api_graphs import node_id_of, nodes_of_type
from tests.support.comfy_models import BAD_EXPERT, ORIGINAL_RELEASE, TRUNCATED_EXPERT
from workflow_graphs import SINGLE_FILES, for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"


def _workflow(name: str, prefix: str, latents_only: bool = False, **loader_inputs) -> dict:
    """The shipped workflow `name` with its sampler's latents saved; `latents_only`: without the decode and video
    nodes after the sampler (the latents are what a comparison needs)."""
    workflow = for_tiny_model(json.loads((API_DIR / f"wanvace_{name}.json").read_text()))
    sampler = node_id_of(workflow, "WanVACESampler")
    if latents_only:
        for class_type in ("WanVACEDecode", "CreateVideo", "SaveVideo"):
            del workflow[node_id_of(workflow, class_type)]
    workflow["900"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": [sampler, 0], "filename_prefix": f"wanvace_experts/{prefix}"},
    }
    for node in nodes_of_type(workflow, "WanVACEExpertsLoader") + nodes_of_type(workflow, "WanVACEModelLoader"):
        node["inputs"].update(loader_inputs)
    return workflow


def _run(server, workflow: dict):
    """Runs `workflow`, whose sampler must really sample (not come from ComfyUI's output cache)."""
    result = server.run_prompt(workflow)
    assert result.status == "success", result.error or result.response
    return result.assert_ran(node_id_of(workflow, "WanVACESampler"))


def _latent(result) -> torch.Tensor:
    (path,) = [p for p in result.output_files() if p.suffix == ".latent"]
    return load_file(str(path))["latent_tensor"]


def _loader_errors(result, workflow) -> str:
    (loader,) = [key for key, node in workflow.items() if node["class_type"].endswith("Loader")]
    return json.dumps(result.node_errors[loader]["errors"])


def test_experts_loader_lists_gguf_and_the_comfy_folders(comfy_server):
    inputs = comfy_server.object_info("WanVACEExpertsLoader")["WanVACEExpertsLoader"]["input"]
    experts = inputs["required"]["high_noise_model"][1]["options"]
    for files in SINGLE_FILES.values():
        assert files["high_noise_model"] in experts and files["low_noise_model"] in experts
        assert files["text_encoder"] in inputs["required"]["text_encoder"][1]["options"]
        assert files["vae"] in inputs["required"]["vae"][1]["options"]
    assert inputs["optional"]["high_noise_vace_module"][1]["options"][0] == "none"


def test_fp8_and_gguf_prompts_repeat_bitwise_and_reattach_on_offload_change(comfy_server):
    first = comfy_server.run_prompt(_workflow("i2v_fp8", "fp8_a", latents_only=True))
    assert first.status == "success", first.error

    gguf = comfy_server.run_prompt(_workflow("t2v_gguf", "gguf_a", latents_only=True))
    assert gguf.status == "success", gguf.error
    workflow = _workflow("t2v_gguf", "gguf_b", latents_only=True)
    nodes_of_type(workflow, "WanVACEOffloadOptions")[0]["inputs"]["mode"] = "model"
    log_before = comfy_server.log_text()
    changed = _run(comfy_server, workflow)
    assert torch.equal(_latent(gguf), _latent(changed)), "every offload mode computes the same"
    # The pack's own account: whether the loader re-read the files or re-attached to the experts it holds shows in
    # no measurement from outside (a re-read maps the same files again, possibly at the same addresses).
    new_log = comfy_server.log_text()[len(log_before) :]
    assert "reusing the loaded experts (offload 'model'" in new_log
    assert "Loaded WanVACE single files" not in new_log

    # The fp8 prompt once more, after the GGUF ones took the place of its outputs in ComfyUI's cache: its sampler
    # samples again (`_run` checks that it was not served from the cache).
    again = _run(comfy_server, _workflow("i2v_fp8", "fp8_b", latents_only=True))
    assert torch.equal(_latent(first), _latent(again))


@pytest.mark.parametrize(
    ("inputs", "fragments"),
    [
        ({"low_noise_model": "wan2.2_t2v_low_noise_14B_fp16.safetensors"}, ["low_noise_model=", "VACE module"]),
        ({"high_noise_model": BAD_EXPERT}, [BAD_EXPERT, "is not a Wan model"]),
        ({"high_noise_model": TRUNCATED_EXPERT}, [TRUNCATED_EXPERT, "re-download"]),
        ({"vae": BAD_EXPERT}, [f"vae={BAD_EXPERT} is not a Wan VAE"]),
        (
            {"high_noise_vace_module": "Wan2_2_Fun_VACE_module_A14B_HIGH_bf16.safetensors"},
            ["already has VACE blocks"],
        ),
    ],
)
def test_bad_files_are_refused_at_queue_time_naming_the_file(inputs, fragments, comfy_server):
    workflow = _workflow("i2v_fp8", "refused", **inputs)
    result = comfy_server.run_prompt(workflow)
    assert result.status == "rejected", result.response
    errors = _loader_errors(result, workflow)
    assert all(fragment in errors for fragment in fragments), errors


def test_t2v_experts_with_vace_modules_run(comfy_server):
    workflow = _workflow(
        "i2v_fp8",
        "split",
        high_noise_model="wan2.2_t2v_high_noise_14B_fp16.safetensors",
        high_noise_vace_module="Wan2_2_Fun_VACE_module_A14B_HIGH_bf16.safetensors",
        low_noise_model="wan2.2_t2v_low_noise_14B_fp16.safetensors",
        low_noise_vace_module="Wan2_2_Fun_VACE_module_A14B_LOW_bf16.safetensors",
    )
    result = comfy_server.run_prompt(workflow)
    assert result.status == "success", result.error


def test_original_release_folder_needs_the_pth_opt_in(comfy_server):
    options = comfy_server.object_info("WanVACEModelLoader")["WanVACEModelLoader"]["input"]["required"]
    assert ORIGINAL_RELEASE in options["model_name"][1]["options"]
    refused = _workflow("t2v", "original_refused", model_name=ORIGINAL_RELEASE)
    result = comfy_server.run_prompt(refused)
    assert result.status == "rejected"
    assert "allow_pth_weights" in _loader_errors(result, refused)
    allowed = comfy_server.run_prompt(_workflow("t2v", "original", model_name=ORIGINAL_RELEASE, allow_pth_weights=True))
    assert allowed.status == "success", allowed.error
