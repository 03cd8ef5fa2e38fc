"""The shipped UI workflows load cleanly in ComfyUI's real graph editor and queue exactly their API twins.

`scripts/make_workflows.py` writes `workflows/wanvace_<task>.json` (UI format) and
`tests/api_workflows/wanvace_<task>.json` (API format) from `tests/workflow_graphs.py`. Here the
frontend (headless Chromium) loads every UI workflow, and what it would queue
(`app.graphToPrompt().output`) must be the API twin.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from comfy_server import PACKAGE_DIR_NAME, REPO_ROOT, check_workflows_in_browser
from workflow_graphs import WORKFLOWS, build_api_workflow

pytestmark = pytest.mark.integration

WORKFLOWS_DIR = REPO_ROOT / "workflows"
API_DIR = REPO_ROOT / "tests" / "api_workflows"

# Inputs the frontend (1.32.9) puts into the prompt although the node does not declare them, with
# the value it sends. LoadVideo gets a "video-preview" DOM widget once its video has loaded; the
# widget opts out of the saved workflow but not of graphToPrompt, and the server ignores it.
FRONTEND_ONLY_INPUTS = {"LoadVideo": {"video-preview": ""}}


def _load_make_workflows():
    spec = importlib.util.spec_from_file_location("make_workflows", REPO_ROOT / "scripts" / "make_workflows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_workflows = _load_make_workflows()


def _ui_file(task: str) -> Path:
    return WORKFLOWS_DIR / f"wanvace_{task}.json"


def _api_file(task: str) -> Path:
    return API_DIR / f"wanvace_{task}.json"


def _canonical(value):
    """JSON numbers as the browser has them: JavaScript cannot tell 16.0 from 16, so integral floats become ints."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _comparable(prompt: dict, from_frontend: bool) -> str:
    """A prompt without `_meta` (and, from the frontend, its known extra inputs) as canonical JSON text.

    Comparing JSON text keeps types strict apart from the int/float case above (no "16" == 16, True == 1).
    """
    nodes = {}
    for node_id, node in prompt.items():
        inputs = dict(node["inputs"])
        if from_frontend:
            for name, sent in FRONTEND_ONLY_INPUTS.get(node["class_type"], {}).items():
                if name in inputs:
                    assert inputs.pop(name) == sent, f"node {node_id}: unexpected {name}={node['inputs'][name]!r}"
        nodes[node_id] = {"class_type": node["class_type"], "inputs": inputs}
    return json.dumps(_canonical(nodes), indent=1, sort_keys=True)


# --- without a browser -------------------------------------------------------


@pytest.mark.parametrize("task", WORKFLOWS)
def test_api_twin_matches_graph_builder(task):
    assert _api_file(task).read_text(encoding="utf-8") == make_workflows.dumps(build_api_workflow(task)), (
        f"{_api_file(task).name} is stale; run `.venv/bin/python scripts/make_workflows.py`"
    )


@pytest.mark.parametrize("task", WORKFLOWS)
def test_ui_workflow_matches_converter(comfy_server, task):
    ui = make_workflows.api_to_ui(build_api_workflow(task), comfy_server.object_info())
    assert _ui_file(task).read_text(encoding="utf-8") == make_workflows.dumps(ui), (
        f"{_ui_file(task).name} is stale; run `.venv/bin/python scripts/make_workflows.py`"
    )


def test_workflows_dir_holds_the_tasks_with_registered_nodes_only(comfy_server):
    assert sorted(p.name for p in WORKFLOWS_DIR.iterdir()) == sorted(_ui_file(t).name for t in WORKFLOWS)
    registered = set(comfy_server.object_info())
    for task in WORKFLOWS:
        wf = json.loads(_ui_file(task).read_text(encoding="utf-8"))
        types = {node["type"] for node in wf["nodes"]}
        assert types <= registered, f"{task}: node types unknown to the server: {sorted(types - registered)}"


def test_workflows_are_listed_as_templates(comfy_server):
    r = comfy_server.get("/api/workflow_templates")
    r.raise_for_status()
    listed = r.json()
    assert sorted(listed.get(PACKAGE_DIR_NAME, [])) == sorted(f"wanvace_{t}" for t in WORKFLOWS), listed
    # The template browser then fetches each file from the package's static route.
    for task in WORKFLOWS:
        served = comfy_server.get(f"/api/workflow_templates/{PACKAGE_DIR_NAME}/wanvace_{task}.json")
        served.raise_for_status()
        assert served.json() == json.loads(_ui_file(task).read_text(encoding="utf-8"))


def test_ui_workflow_layout_has_no_overlaps():
    for task in WORKFLOWS:
        nodes = json.loads(_ui_file(task).read_text(encoding="utf-8"))["nodes"]
        # pos is the body's top-left; the title bar sits above it.
        boxes = {
            n["id"]: (n["pos"][0], n["pos"][1] - make_workflows.TITLE_HEIGHT, n["size"][0], n["size"][1]) for n in nodes
        }
        for a, (ax, ay, aw, ah) in boxes.items():
            for b, (bx, by, bw, bh) in boxes.items():
                if a < b:
                    overlap = ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah
                    assert not overlap, f"{task}: nodes {a} and {b} overlap"


# --- in the graph editor -----------------------------------------------------


@pytest.fixture(scope="module")
def browser_results(comfy_server, tmp_path_factory) -> dict[str, dict]:
    report = tmp_path_factory.mktemp("browser") / "check_workflows.json"
    results = check_workflows_in_browser(comfy_server.url, [_ui_file(t) for t in WORKFLOWS], report)
    by_task = {Path(r["file"]).stem.removeprefix("wanvace_"): r for r in results}
    assert sorted(by_task) == sorted(WORKFLOWS)
    return by_task


@pytest.mark.browser
@pytest.mark.parametrize("task", WORKFLOWS)
def test_workflow_loads_cleanly(browser_results, task):
    res = browser_results[task]
    assert res["load_error"] is None, res["load_error"]
    assert res["missing_types"] == [], res["missing_types"]
    assert res["raw_broken_links"] == [], res["raw_broken_links"]
    assert res["broken_links"] == [], res["broken_links"]
    assert res["dialogs"] == [], res["dialogs"]
    assert res["console_errors"] == [], res["console_errors"]


@pytest.mark.browser
@pytest.mark.parametrize("task", WORKFLOWS)
def test_graph_to_prompt_equals_api_twin(browser_results, task):
    queued = browser_results[task]["api_prompt"]
    assert queued, f"graphToPrompt gave nothing: {browser_results[task]['load_error']}"
    twin = json.loads(_api_file(task).read_text(encoding="utf-8"))
    assert _comparable(queued, from_frontend=True) == _comparable(twin, from_frontend=False)
