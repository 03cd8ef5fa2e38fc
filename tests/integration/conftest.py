"""Fixtures that run a real ComfyUI with this package installed as a custom node."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scripts.comfy_server import ComfyServer, write_example_inputs
from tests.support.comfy_models import write_lora_files, write_single_files
from tests.support.comfyui import require_comfyui

TINY_TWO_EXPERTS = "wanvace-tiny"
TINY_SINGLE_EXPERT = "wanvace21-tiny"
NOT_VACE = "not-a-vace-pipeline"
TRUNCATED = "wanvace-truncated"


def _write_models(models_dir: Path) -> None:
    from wanvace_core.load.tiny import TinyModelSpec, write_tiny_pipeline

    two = write_tiny_pipeline(models_dir / TINY_TWO_EXPERTS, TinyModelSpec(two_experts=True))
    write_tiny_pipeline(models_dir / TINY_SINGLE_EXPERT, TinyModelSpec(two_experts=False))

    not_vace = models_dir / NOT_VACE
    not_vace.mkdir(parents=True, exist_ok=True)
    (not_vace / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))

    truncated = models_dir / TRUNCATED
    shutil.copytree(two, truncated)
    weights = truncated / "transformer" / "diffusion_pytorch_model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)


@pytest.fixture(scope="session")
def comfy_base(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("comfy_base")
    # Going through ComfyServer.prepare keeps the layout in one place.
    ComfyServer(base).prepare()
    _write_models(base / "models" / "diffusers")
    write_single_files(base / "models")
    write_lora_files(base / "models", base / "models" / "diffusers" / TINY_TWO_EXPERTS)
    write_example_inputs(base / "input")
    return base


@pytest.fixture(scope="session")
def comfy_server(comfy_base):
    require_comfyui()
    server = ComfyServer(comfy_base)
    server.start(timeout=180)
    try:
        yield server
    finally:
        server.stop()
