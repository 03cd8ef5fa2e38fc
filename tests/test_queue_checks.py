"""nodes/queued_prompt.py without a server: which copies of a refusal it keeps, what it leaves alone, and how it reads
the graph. (tests/integration/test_validation_server.py shows both hooks in real ComfyUI servers.)"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "nodes" / "queued_prompt.py"


@pytest.fixture(scope="module")
def queued():
    # The module imports nothing of ComfyUI or of the package at import time (the nodes package's __init__ does).
    spec = importlib.util.spec_from_file_location("wanvace_queued_prompt_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _custom(name: str, message: str) -> dict:
    """An entry as ComfyUI writes one for a refusal of validate_inputs (execution.py, 0.3.75 and 0.33)."""
    return {
        "type": "custom_validation_failed",
        "message": "Custom validation failed for node",
        "details": f"{name} - {message}",
        "extra_info": {"input_name": name},
    }


def _answer(class_type: str, errors: list[dict]) -> dict:
    lines = "\n".join(f"{error['message']}: {error['details']}" for error in errors)
    return {
        "error": {
            "type": "prompt_outputs_failed_validation",
            "message": "Prompt outputs failed validation",
            "details": lines,
            "extra_info": {},
        },
        "node_errors": {"2": {"errors": errors, "dependent_outputs": ["6"], "class_type": class_type}},
    }


ARGUMENTS = ["positive", "width", "height", "length", "vace_start_percent", "vace_end_percent", "tiled", "tile_size"]


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        ("width=65 is not a positive multiple of 16; use 64.", "width"),
        ("height=70 is not a positive multiple of 16; use 64.", "height"),
        ("positive prompt is empty and positive_conditioning is not connected; ...", "positive"),
        ("vace_start_percent=0.8 is after vace_end_percent=0.2; ...", "vace_start_percent"),
        ("tile_size=4097 is not a multiple of the VAE's stride 8 pixels; use 4096.", "tile_size"),
    ],
)
def test_of_identical_refusals_of_our_node_the_one_under_the_input_named_first_is_kept(queued, message, kept):
    answer = _answer("WanVACEConditioning", [_custom(name, message) for name in ARGUMENTS])
    assert queued._collapse(answer)
    (error,) = answer["node_errors"]["2"]["errors"]
    assert error["extra_info"]["input_name"] == kept
    assert error["details"] == f"{kept} - {message}"
    assert answer["error"]["details"] == f"Custom validation failed for node: {kept} - {message}"


def test_other_errors_and_other_nodes_are_left_as_comfyui_wrote_them(queued):
    ours = [_custom(name, "width=65 is not a positive multiple of 16; use 64.") for name in ("width", "height")]
    range_error = {
        "type": "value_smaller_than_min",
        "message": "Value -1.0 smaller than min of 0.0",
        "details": "strength",
        "extra_info": {"input_name": "strength"},
    }
    answer = _answer("WanVACEConditioning", [*ours, range_error])
    theirs = [_custom(name, "width=65 is wrong") for name in ("width", "height")]
    answer["node_errors"]["9"] = {"errors": copy.deepcopy(theirs), "class_type": "SomeOtherPackNode"}
    assert queued._collapse(answer)
    assert [error["extra_info"]["input_name"] for error in answer["node_errors"]["2"]["errors"]] == [
        "width",
        "strength",
    ]
    assert answer["node_errors"]["9"]["errors"] == theirs


def test_a_refusal_that_names_none_of_its_inputs_first_keeps_every_copy(queued):
    message = "something went wrong with the files"
    answer = _answer("WanVACEModelLoader", [_custom(name, message) for name in ("model_name", "attention")])
    before = copy.deepcopy(answer)
    assert not queued._collapse(answer)
    assert answer == before


def test_a_name_only_counts_as_a_whole_word(queued):
    # "tile" is not "tile_size", nor is "model" "model_name".
    copies = [_custom("tile", "tile_size=4097 ..."), _custom("tile_size", "tile_size=4097 ...")]
    assert queued._named_first("tile_size=4097 ...", copies) is copies[1]
    copies = [_custom("model", "model_name='x' ..."), _custom("model_name", "model_name='x' ...")]
    assert queued._named_first("model_name='x' ...", copies) is copies[1]


GRAPH = {
    "1": {"class_type": "WanVACEModelLoader", "inputs": {"model_name": "tiny", "dtype": "bf16", "parallel": ["9", 0]}},
    "2": {"class_type": "WanVACELoraLoader", "inputs": {"model": ["1", 0], "lora_name": "a.safetensors"}},
    "3": {
        "class_type": "WanVACEConditioning",
        "inputs": {"model": ["1", 0], "width": ["7", 0], "height": 48, "length": ["8", 0]},
    },
    "4": {"class_type": "WanVACESampler", "inputs": {"model": ["2", 0], "conditioning": ["3", 0]}},
    "5": {"class_type": "WanVACESampler", "inputs": {"model": ["1", 0], "conditioning": ["3", 0]}},
    "7": {"class_type": "PrimitiveInt", "inputs": {"value": 832}},
    "8": {"class_type": "SomeOtherPackNode", "inputs": {"value": 81}},
    "9": {"class_type": "WanVACEParallelOptions", "inputs": {}},
}


def test_the_graph_readers(queued):
    assert queued.value_of(GRAPH, GRAPH["3"], "height") == 48
    assert queued.value_of(GRAPH, GRAPH["3"], "width") == 832, "a value through ComfyUI's PrimitiveInt is known"
    assert queued.value_of(GRAPH, GRAPH["3"], "length") is None, "another node's output is not known before it runs"
    assert [node_id for node_id, _ in queued.consumers(GRAPH, "3", "WanVACESampler", "conditioning")] == ["4", "5"]
    assert queued.model_source(GRAPH, GRAPH["4"])[0] == "1", "through the LoRA loader to the model loader"
    assert queued.linked_node(GRAPH, GRAPH["1"], "parallel")[0] == "9"
    assert queued.linked_node(GRAPH, GRAPH["1"], "dtype") is None


def test_the_remembered_prompt_is_seen_only_in_the_context_it_was_set_in(queued):
    import contextvars

    seen = contextvars.copy_context().run(lambda: (queued._remember_prompt({"prompt": GRAPH}), queued.queued_prompt()))
    assert seen[1] is GRAPH
    assert queued.queued_prompt() is None
