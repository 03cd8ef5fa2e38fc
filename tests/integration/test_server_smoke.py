"""The real ComfyUI starts with this package installed and runs core graphs."""

from __future__ import annotations

import re

import pytest

from scripts.comfy_server import PACKAGE_DIR_NAME
from tests.support.comfyui import count_video_frames

pytestmark = pytest.mark.integration


def test_server_serves_core_video_nodes(comfy_server):
    info = comfy_server.object_info()
    for node in ("SaveVideo", "CreateVideo", "LoadVideo"):
        assert node in info, f"core node {node} missing from /object_info"


def test_package_imports_without_error(comfy_server):
    log = comfy_server.log_text()
    # Only our own folder under custom_nodes: ComfyUI's own optional imports may fail from a tree whose path
    # also contains the package name (a clone named ComfyUI-WanVACE holds .cache/comfyui-*/).
    ours = re.escape(f"custom_nodes/{PACKAGE_DIR_NAME}")
    failed = [
        line
        for line in log.splitlines()
        if re.search(r"Cannot import .* module for custom nodes", line) and re.search(ours + r"\b", line)
    ]
    assert not failed, f"ComfyUI failed to import {PACKAGE_DIR_NAME}:\n{comfy_server.log_tail(80)}"
    assert not re.search(rf"\(IMPORT FAILED\): .*{ours}", log)


def test_unknown_node_type_is_rejected_and_server_survives(comfy_server):
    prompt = {"1": {"class_type": "DefinitelyNotANode_WanVACE", "inputs": {}}}
    code, body = comfy_server.queue_prompt(prompt)
    assert code == 400, body
    assert body.get("error"), body
    assert comfy_server.system_stats()["system"]


def test_core_video_graph_runs_end_to_end(comfy_server):
    prompt = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 64, "batch_size": 9, "color": 0x3366CC},
        },
        "2": {"class_type": "CreateVideo", "inputs": {"images": ["1", 0], "fps": 8.0}},
        "3": {
            "class_type": "SaveVideo",
            "inputs": {
                "video": ["2", 0],
                "filename_prefix": "smoke/core_video",
                "format": "auto",
                "codec": "auto",
            },
        },
    }
    result = comfy_server.run_prompt(prompt, timeout=180)
    assert result.status == "success", (result.error, comfy_server.log_tail())
    files = result.output_files()
    assert len(files) == 1, result.outputs
    video = files[0]
    assert video.is_file() and video.stat().st_size > 0
    assert count_video_frames(video) == 9
