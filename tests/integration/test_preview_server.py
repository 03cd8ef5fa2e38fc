"""WanVACESampler's live previews through a real ComfyUI server's websocket, per `--preview-method`.

A frontend that declares the `supports_preview_metadata` feature flag gets PREVIEW_IMAGE_WITH_METADATA frames
(event 4: uint32 metadata length, metadata JSON, image bytes); any other client gets PREVIEW_IMAGE frames
(event 1: uint32 image type, 1 JPEG or 2 PNG, image bytes). Both ComfyUI versions send either.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass

import pytest
from PIL import Image

from scripts.comfy_server import ComfyServer
from tests.support.api_graphs import node_id_of, nodes_of_type
from tests.support.comfyui import require_comfyui
from workflow_graphs import build_api_workflow, for_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PREVIEW_IMAGE, PREVIEW_IMAGE_WITH_METADATA = 1, 4  # ComfyUI's protocol.BinaryEventTypes
IMAGE_TYPES = {1: "image/jpeg", 2: "image/png"}
PIL_FORMATS = {"image/jpeg": "JPEG", "image/png": "PNG"}
PREVIEW_SIZE = 256  # --preview-size: ComfyUI scales each preview to fit this square, keeping its aspect
CLIENTS = {"legacy client": None, "metadata client": {"supports_preview_metadata": True}}


@dataclass(frozen=True)
class Preview:
    event: int
    mimetype: str
    image: bytes
    metadata: dict | None


def _previews(messages: list[bytes]) -> list[Preview]:
    """The preview frames among the binary websocket messages, headers decoded."""
    previews = []
    for message in messages:
        (event,) = struct.unpack(">I", message[:4])
        if event == PREVIEW_IMAGE:
            (image_type,) = struct.unpack(">I", message[4:8])
            previews.append(Preview(event, IMAGE_TYPES[image_type], message[8:], None))
        elif event == PREVIEW_IMAGE_WITH_METADATA:
            (length,) = struct.unpack(">I", message[4:8])
            metadata = json.loads(message[8 : 8 + length])
            previews.append(Preview(event, metadata["image_type"], message[8 + length :], metadata))
    return previews


@pytest.fixture(scope="module", params=["latent2rgb", "none"])
def preview_server(request, comfy_base, tmp_path_factory):
    """The session's server for `none`, both versions' default `--preview-method`; for another method (0.3.75 takes
    it only as a process flag) a server of its own, on the session's model files."""
    require_comfyui()
    if request.param == "none":
        yield request.param, request.getfixturevalue("comfy_server")
        return
    flags = ["--preview-method", request.param, "--preview-size", str(PREVIEW_SIZE)]
    base = tmp_path_factory.mktemp(f"comfy_preview_{request.param}")
    with ComfyServer(base, extra_args=flags, models_from=comfy_base) as server:
        yield request.param, server


def _workflow(seed: int) -> tuple[dict, str, int]:
    """The tiny t2v workflow with its own seed (an unchanged prompt would come from ComfyUI's cache)."""
    workflow = for_tiny_model(build_api_workflow("t2v"), seed=seed)
    sampler_id = node_id_of(workflow, "WanVACESampler")
    return workflow, sampler_id, workflow[sampler_id]["inputs"]["steps"]


@pytest.mark.parametrize("client", list(CLIENTS))
def test_one_preview_per_sampler_step_unless_method_none(client, preview_server):
    method, server = preview_server
    workflow, sampler_id, steps = _workflow(seed=101 + list(CLIENTS).index(client))
    (conditioning,) = nodes_of_type(workflow, "WanVACEConditioning")
    log_start = len(server.log_text())  # the session's server ran other tests before
    result = server.run_prompt(workflow, timeout=600, feature_flags=CLIENTS[client])
    assert result.status == "success", (result.error, server.log_tail())
    result.assert_ran(sampler_id)  # a sampler served from ComfyUI's cache would send no progress and no preview
    progress = [event for event in result.progress_events() if event.get("node") == sampler_id]
    assert progress and progress[-1]["value"] == steps, progress
    previews = _previews(result.binary_messages)
    if method == "none":
        assert previews == []
        return
    assert len(previews) == steps, [(p.event, len(p.image)) for p in previews]
    expected_event = PREVIEW_IMAGE if CLIENTS[client] is None else PREVIEW_IMAGE_WITH_METADATA
    width, height = conditioning["inputs"]["width"], conditioning["inputs"]["height"]
    assert width >= height, "the tiny t2v workflow is landscape"
    shown_size = (PREVIEW_SIZE, PREVIEW_SIZE * height // width)
    for preview in previews:
        assert preview.event == expected_event
        if preview.metadata is not None:
            assert preview.metadata["node_id"] == sampler_id and preview.metadata["prompt_id"] == result.prompt_id
        image = Image.open(io.BytesIO(preview.image))
        assert image.format == PIL_FORMATS[preview.mimetype]
        image.load()  # a truncated or corrupt file fails here
        assert image.size == shown_size and image.mode == "RGB"
    assert "Traceback" not in server.log_text()[log_start:], server.log_tail(80)


def test_cancel_still_stops_the_sampler(preview_server):
    method, server = preview_server
    workflow, sampler_id, _steps = _workflow(seed=201)
    steps = 40
    nodes_of_type(workflow, "WanVACESampler")[0]["inputs"]["steps"] = steps
    result = server.run_prompt(workflow, timeout=600, interrupt_after_progress=2)
    assert result.status == "interrupted", (result.error, server.log_tail())
    values = [event["value"] for event in result.progress_events() if event.get("node") == sampler_id]
    assert values and values[-1] < steps, values
    previews = _previews(result.binary_messages)
    if method == "none":
        assert previews == []
    else:
        assert 0 < len(previews) < steps
