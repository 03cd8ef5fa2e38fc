"""Refusals at POST /prompt name their input once: one node_errors entry, under that input, naming it and the value.

NaN and Infinity go through the real HTTP path as the JSON literals Python's json.dumps writes (requests'
`json=` refuses them), which ComfyUI's prompt parser accepts.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from workflow_graphs import for_tiny_model

pytestmark = pytest.mark.integration

API_DIR = Path(__file__).resolve().parents[1] / "api_workflows"
NAN, INF = float("nan"), float("inf")


def _t2v() -> dict:
    return for_tiny_model(json.loads((API_DIR / "wanvace_t2v.json").read_text()))


def _node_id(workflow: dict, class_type: str) -> str:
    (node_id,) = [key for key, node in workflow.items() if node["class_type"] == class_type]
    return node_id


def _with(workflow: dict, class_type: str, **values) -> tuple[dict, str]:
    node_id = _node_id(workflow, class_type)
    workflow[node_id]["inputs"].update(values)
    return workflow, node_id


def _with_offload(**values) -> tuple[dict, str]:
    workflow = _t2v()
    offload = {"mode": "model", "prefetch_blocks": 1, "max_pinned_mb": 0, **values}
    workflow["600"] = {"class_type": "WanVACEOffloadOptions", "inputs": offload}
    workflow[_node_id(workflow, "WanVACEModelLoader")]["inputs"]["offload"] = ["600", 0]
    return workflow, "600"


def _with_cache(**values) -> tuple[dict, str]:
    workflow = _t2v()
    cache = {
        "mode": "DBCache",
        "Fn_compute_blocks": 1,
        "Bn_compute_blocks": 0,
        "residual_diff_threshold": 0.08,
        "max_warmup_steps": 2,
        "max_cached_steps": -1,
        "low_noise_max_warmup_steps": 2,
        "low_noise_max_cached_steps": -1,
        "taylorseer_order": 1,
        **values,
    }
    workflow["700"] = {"class_type": "WanVACECacheOptions", "inputs": cache}
    workflow[_node_id(workflow, "WanVACESampler")]["inputs"]["cache"] = ["700", 0]
    return workflow, "700"


def _post(server, workflow: dict) -> tuple[int, dict, str]:
    """POST /prompt with NaN/Infinity written as JSON literals; returns status, parsed body and the request text."""
    text = json.dumps({"prompt": workflow, "client_id": uuid.uuid4().hex})
    response = server.http.post(
        f"{server.url}/prompt", data=text, headers={"Content-Type": "application/json"}, timeout=120
    )
    return response.status_code, json.loads(response.text), text


def _only_error(body: dict, node_id: str) -> dict:
    node_errors = body.get("node_errors", {})
    assert list(node_errors) == [node_id], node_errors
    errors = node_errors[node_id]["errors"]
    assert len(errors) == 1, json.dumps(errors, indent=1)
    return errors[0]


def _refused_once(server, workflow: dict, node_id: str, name: str, *fragments: str) -> dict:
    code, body, _ = _post(server, workflow)
    assert code == 400, body
    error = _only_error(body, node_id)
    assert error["extra_info"]["input_name"] == name, error
    text = f"{error['message']}: {error['details']}"
    # The entry names its input: ComfyUI's details are the name ("cfg"), or start with it ("steps, nan, ...",
    # "dtype: 'fp8' not in ..."); ours follow ComfyUI's "name - " with a message that starts with "name=".
    details = error["details"]
    assert details == name or details.startswith((f"{name}, ", f"{name}: ", f"{name} - {name}=")), error
    for fragment in fragments:
        assert fragment in text, error
    return error


FLOAT_CASES = [
    # (class_type, input, value, fragment of ComfyUI's range-check message)
    ("WanVACESampler", "cfg", NAN, "Value nan smaller than min of 1.0"),
    ("WanVACESampler", "cfg", INF, "Value inf bigger than max of 30.0"),
    ("WanVACESampler", "cfg", -INF, "Value -inf smaller than min of 1.0"),
    ("WanVACESampler", "cfg_low_noise", NAN, "Value nan smaller than min of 1.0"),
    ("WanVACESampler", "boundary_ratio", NAN, "Value nan smaller than min of -1.0"),
    ("WanVACESampler", "shift", NAN, "Value nan smaller than min of 0.0"),
    ("WanVACESampler", "shift", INF, "Value inf bigger than max of 100.0"),
    ("WanVACEConditioning", "strength", NAN, "Value nan smaller than min of 0.0"),
    ("WanVACEConditioning", "strength", INF, "Value inf bigger than max of 10.0"),
]


@pytest.mark.parametrize(("class_type", "name", "value", "fragment"), FLOAT_CASES)
def test_non_finite_float_is_refused_once_under_its_input(class_type, name, value, fragment, comfy_server):
    workflow, node_id = _with(_t2v(), class_type, **{name: value})
    error = _refused_once(comfy_server, workflow, node_id, name, fragment)
    assert error["type"] in ("value_smaller_than_min", "value_bigger_than_max")


def test_nan_really_travels_as_a_json_literal(comfy_server):
    workflow, node_id = _with(_t2v(), "WanVACESampler", cfg=NAN)
    code, body, text = _post(comfy_server, workflow)
    assert '"cfg": NaN' in text
    assert code == 400 and node_id in body["node_errors"]


@pytest.mark.parametrize("value", [NAN, INF])
def test_non_finite_cache_threshold_is_refused_once(value, comfy_server):
    workflow, node_id = _with_cache(residual_diff_threshold=value)
    bound = "smaller than min of 0.001" if value != INF else "bigger than max of 1.0"
    _refused_once(comfy_server, workflow, node_id, "residual_diff_threshold", f"Value {value} {bound}")


def test_unknown_cache_mode_is_refused_once_with_our_message(comfy_server):
    workflow, node_id = _with_cache(mode="FBCache")
    _refused_once(comfy_server, workflow, node_id, "mode", "mode='FBCache' is unknown; choose one of DBCache")


def test_out_of_range_cache_count_is_refused_once_by_comfyui(comfy_server):
    # validate_inputs no longer takes every input, so ComfyUI's own range check applies again.
    workflow, node_id = _with_cache(Fn_compute_blocks=65)
    _refused_once(comfy_server, workflow, node_id, "Fn_compute_blocks", "Value 65 bigger than max of 64")


def test_nan_for_an_integer_input_is_refused_once_by_comfyui(comfy_server):
    workflow, node_id = _with(_t2v(), "WanVACESampler", steps=NAN)
    error = _refused_once(comfy_server, workflow, node_id, "steps")
    assert error["type"] == "invalid_input_type"


def test_missing_model_is_refused_once_under_model_name(comfy_server):
    workflow, node_id = _with(_t2v(), "WanVACEModelLoader", model_name="does-not-exist")
    _refused_once(comfy_server, workflow, node_id, "model_name", "model_name='does-not-exist' is not a pipeline folder")


def _comfyui_checks_v3_combos(server) -> bool:
    """ComfyUI 0.3.75 does not check a V3 Combo's value against its options (0.33 does)."""
    version = server.system_stats()["system"]["comfyui_version"]
    return tuple(int(part) for part in version.split(".")[:2]) > (0, 3)


def test_unknown_dtype_is_refused_once_naming_dtype(comfy_server):
    workflow, node_id = _with(_t2v(), "WanVACEModelLoader", dtype="fp8")
    if _comfyui_checks_v3_combos(comfy_server):
        _refused_once(comfy_server, workflow, node_id, "dtype", "'fp8' not in")
        return
    # 0.3.75 lets the value through; the loader refuses it when it runs, before reading any weight.
    result = comfy_server.run_prompt(workflow, timeout=120)
    assert result.status == "error", result.response
    assert result.error["node_id"] == node_id
    assert result.error["exception_message"].strip() == "dtype='fp8' is not supported; choose one of bf16, fp16, fp32."


def test_unknown_scheduler_is_refused_once_with_our_message(comfy_server):
    workflow, node_id = _with(_t2v(), "WanVACESampler", scheduler="ddim")
    _refused_once(comfy_server, workflow, node_id, "scheduler", "scheduler='ddim' is unknown; choose one of unipc")


def test_unknown_offload_mode_is_refused_once_under_mode(comfy_server):
    workflow, node_id = _with_offload(mode="sequential")
    _refused_once(comfy_server, workflow, node_id, "mode", "mode='sequential' is unknown; choose one of none")


@pytest.mark.parametrize(
    ("values", "name", "fragment"),
    [
        ({"mode": "layerwise", "prefetch_blocks": 17}, "prefetch_blocks", "Value 17 bigger than max of 16"),
        ({"mode": "layerwise", "max_pinned_mb": -1}, "max_pinned_mb", "Value -1 smaller than min of 0"),
    ],
)
def test_bad_offload_setting_is_refused_once_under_its_input(values, name, fragment, comfy_server):
    workflow, node_id = _with_offload(**values)
    _refused_once(comfy_server, workflow, node_id, name, fragment)


def test_shift_that_makes_the_scheduler_repeat_timesteps_fails_with_a_named_error(comfy_server):
    # Valid for the widgets (shift <= 100, steps <= 200) but unusable for UniPC: without the core's check this
    # ended in a bare AssertionError from diffusers on the last step.
    workflow, _ = _with(_t2v(), "WanVACESampler", shift=100.0, steps=20)
    result = comfy_server.run_prompt(workflow, timeout=300)
    assert result.status == "error", result.response
    error = result.error
    assert error["exception_type"].endswith("WanVACEInputError"), error
    assert error["exception_message"].startswith("shift=100.0 with steps=20 makes the unipc scheduler repeat")
