"""Our pipeline inside ComfyUI's model management, next to ComfyUI's own models, under its memory flags.

What ComfyUI's unload does to our weights is measured in the server process: the tiny model's transformer weights
are used in place from their memory-mapped .safetensors files (bf16 files loaded in bf16), so `/proc/<pid>/smaps`
shows whether they are held, and the mappings disappear when the weights are dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.rss import file_mappings
from scripts.comfy_server import ComfyServer
from tests.support.api_graphs import node_id_of
from tests.support.comfyui import require_comfyui
from workflow_graphs import TINY_MODEL, for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"
LOADED = "Loaded WanVACE pipeline"
RELEASED = "Released WanVACE pipeline"
EXPERT_FILES = ("transformer", "transformer_2")


def _workflow(seed: int, prefix: str, model: str = TINY_MODEL) -> dict:
    """Our T2V workflow, then a core VAE round trip of its frames in the same prompt.

    The core VAE goes through comfy.model_management.load_models_gpu, as every core model does, while our
    pipeline is registered there (the frames it encodes are ours, so it runs after our nodes).
    """
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_t2v.json").read_text()), model_name=model)
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
    """The saved latent of `workflow`, whose sampler really sampled (was not served from ComfyUI's cache)."""
    result = server.run_prompt(workflow)
    assert result.status == "success", (result.error or result.response, server.log_tail())
    result.assert_ran(node_id_of(workflow, "WanVACESampler"))
    files = result.output_files()
    assert [p for p in files if p.suffix == ".png"], "the core VAE round trip wrote no image"
    (path,) = [p for p in files if p.suffix == ".latent"]
    return load_file(str(path))["latent_tensor"]


def _mapped_experts(server, folder: Path) -> set[str]:
    """Which expert weight files of the pipeline folder the server has mapped."""
    return {Path(path).parent.name for path in file_mappings(server.proc.pid, folder) if path.endswith(".safetensors")}


@pytest.fixture(scope="module")
def own_model(comfy_base) -> tuple[str, Path]:
    """A copy of the tiny pipeline under a name of this module's own: only its prompts map these files."""
    import shutil

    name = f"{TINY_MODEL}-memory"
    folder = comfy_base / "models" / "diffusers" / name
    shutil.copytree(comfy_base / "models" / "diffusers" / TINY_MODEL, folder)
    return name, folder


def test_a_core_model_runs_after_our_workflow_and_unload_frees_ours(comfy_server, own_model):
    name, folder = own_model
    log_start = len(comfy_server.log_text())  # the session's server ran other tests' refusals before
    first = _latent(comfy_server, _workflow(71, "memory/first", name))
    assert _mapped_experts(comfy_server, folder) == set(EXPERT_FILES)
    # The UI's "Free model and node cache".
    comfy_server.free(unload_models=True, free_memory=True)
    assert _mapped_experts(comfy_server, folder) == set(), "POST /free left our weights in memory"
    assert torch.equal(_latent(comfy_server, _workflow(71, "memory/again", name)), first)
    assert _mapped_experts(comfy_server, folder) == set(EXPERT_FILES)
    assert "Traceback" not in comfy_server.log_text()[log_start:], comfy_server.log_tail(80)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [("--disable-smart-memory", "--cache-lru", "2"), ("--cache-none",)],
    ids=["no-smart-memory+lru", "cache-none"],
)
def test_memory_and_cache_flags_give_the_same_result_every_prompt(flags, comfy_base, tmp_path):
    """A server of its own per flag set (flags are per process), on the session's model files."""
    folder = comfy_base / "models" / "diffusers" / TINY_MODEL
    smart_memory = "--disable-smart-memory" not in flags
    require_comfyui()
    with ComfyServer(tmp_path / "base", extra_args=flags, models_from=comfy_base) as server:
        first = _latent(server, _workflow(72, "flags/first"))
        # Without smart memory ComfyUI unloads every model at the end of each prompt, ours too.
        assert _mapped_experts(server, folder) == (set(EXPERT_FILES) if smart_memory else set())
        assert not torch.equal(_latent(server, _workflow(73, "flags/other")), first)
        assert torch.equal(_latent(server, _workflow(72, "flags/second")), first)
        # "Unload models" while nothing else holds the pipeline (so under --cache-none): it dies inside ComfyUI's
        # unload, which must go on walking its list of loaded models with its prompt worker alive.
        loads = server.log_text().count(LOADED)
        server.free(unload_models=True, free_memory=False)
        assert _mapped_experts(server, folder) == set(), "Unload models left our weights in memory"
        assert torch.equal(_latent(server, _workflow(72, "flags/third")), first)
        if "--cache-none" in flags:
            # The pipeline itself (text encoder, VAE: a few hundred KiB of the server's private memory) is no
            # measurable amount; that it was let go shows in its load being logged again.
            assert server.log_text().count(LOADED) > loads, "Unload models did not release the pipeline"
        assert "Traceback" not in server.log_text(), server.log_tail(80)
