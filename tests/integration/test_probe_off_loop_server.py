"""The first prompt with compile on probes torch.compile (a C++ build on a CPU, up to a minute here) while ComfyUI
validates it: the probe runs off ComfyUI's event loop, so the server answers every other request meanwhile.
(It ran inside POST /prompt's validation, and ComfyUI answered nothing, not even the page, for 17-52 s.)"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest

from scripts.comfy_server import ComfyServer
from tests.support.comfyui import require_comfyui
from workflow_graphs import for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[2] / "example_workflows" / "api"


@pytest.fixture
def fresh_server(comfy_base, tmp_path):
    """A server process of its own (no probe cached yet) and an empty inductor cache (no kernel built before)."""
    require_comfyui()
    server = ComfyServer(
        tmp_path / "base", models_from=comfy_base, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    )
    server.start(timeout=300)
    try:
        yield server
    finally:
        server.stop()


def test_the_server_answers_while_the_first_compile_prompt_is_validated(fresh_server):
    workflow = for_tiny_model(json.loads((API_DIR / "wanvace_t2v.json").read_text()))
    nodes = {node["class_type"]: node for node in workflow.values()}
    nodes["WanVACEModelLoader"]["inputs"]["compile"] = True
    # Refused after every node is validated (the probe included), so nothing runs afterwards.
    nodes["WanVACEConditioning"]["inputs"]["width"] = 65
    answer = {}

    def post() -> None:
        started = time.monotonic()
        response = fresh_server.http.post(
            f"{fresh_server.url}/prompt", json={"prompt": workflow, "client_id": uuid.uuid4().hex}, timeout=600
        )
        answer.update(status=response.status_code, body=response.json(), seconds=time.monotonic() - started)

    poster = threading.Thread(target=post)
    poster.start()
    answered_meanwhile = []
    while poster.is_alive():
        started = time.monotonic()
        stats = fresh_server.http.get(f"{fresh_server.url}/system_stats", timeout=600)
        finished = time.monotonic()
        if poster.is_alive():
            assert stats.status_code == 200
            answered_meanwhile.append(finished - started)
        time.sleep(0.2)
    poster.join()
    print(
        f"POST /prompt (first compile probe) answered after {answer['seconds']:.1f} s; meanwhile "
        f"{len(answered_meanwhile)} GET /system_stats, slowest {max(answered_meanwhile, default=0):.2f} s"
    )
    assert answer["status"] == 400, answer
    errors = answer["body"]["node_errors"]
    assert [error["extra_info"]["input_name"] for node in errors.values() for error in node["errors"]] == ["width"]
    assert len(answered_meanwhile) >= 3, (answer, answered_meanwhile)
