"""The shipped workflows: templates, example inputs, and how they open in ComfyUI's real graph editor.

`scripts/make_workflows.py` writes `example_workflows/<title>.json` (UI format; the template browser of
frontends 1.32 and 1.49 titles a pack's template with its file name), its thumbnail
`example_workflows/<title>.jpg`, and `example_workflows/api/wanvace_<name>.json` (API format), all from
the package `workflow_graphs/`. The pack copies `example_inputs/` into ComfyUI's input folder when it
loads (`nodes/examples.py`), so the files the workflows name are there.

In the graph editor of the set under test (headless Chromium, tests/browser/check_workflows.mjs)
every UI workflow must load without missing node types or input files, red (error) nodes, dialogs or
error overlays, keep its nodes out of the editor's own panels at the saved view, run no link under a
node or across a group's title, follow its one width, height and length everywhere, and queue exactly
its API twin; the template browser lists the templates in order with no title cut off; two of them
run on the tiny model with the live preview on, and nothing overlaps after; on a ComfyUI without the
model files, the frontend's missing-models list offers each file with its folder. A screenshot per
workflow at the saved view goes to pytest's tmp dir and, with `$WANVACE_SCREENSHOT_DIR`, there too,
as `<set>_<name>.png`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from scripts.comfy_server import PACKAGE_DIR_NAME, REPO_ROOT, ComfyServer, check_workflows_in_browser
from tests.support.comfyui import require_comfyui
from workflow_graphs import (
    EXAMPLE_INPUTS,
    EXTENSION_GIVEN_FRAMES,
    MODEL_FILES,
    REAL_MODEL,
    SINGLE_FILES,
    TINY_MODEL,
    WORKFLOW_TITLES,
    WORKFLOWS,
    build_api_workflow,
    build_ui_layout,
    task_of,
    variant_of,
)

pytestmark = pytest.mark.integration

WORKFLOWS_DIR = REPO_ROOT / "example_workflows"
API_DIR = REPO_ROOT / "example_workflows" / "api"
EXAMPLE_DIR = REPO_ROOT / "example_inputs"
REGENERATE = "run `.venvs/current/bin/python scripts/make_workflows.py`"

# Inputs the frontend (1.32.9, 1.49.6) puts into the prompt although the node does not declare them,
# with the value it sends. LoadVideo gets a "video-preview" DOM widget once its video has loaded; the
# widget opts out of the saved workflow but not of graphToPrompt, and the server ignores it.
FRONTEND_ONLY_INPUTS = {"LoadVideo": {"video-preview": ""}}
# Loader combos whose value names a file in ComfyUI's input folder.
INPUT_FILE_WIDGETS = {("LoadImage", "image"), ("LoadImageMask", "image"), ("LoadVideo", "file")}
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_workflows = _load_module("make_workflows", REPO_ROOT / "scripts" / "make_workflows.py")
examples = _load_module("wanvace_examples", REPO_ROOT / "nodes" / "examples.py")


def _ui_file(task: str) -> Path:
    return WORKFLOWS_DIR / f"{WORKFLOW_TITLES[task]}.json"


def _thumbnail(task: str) -> Path:
    return WORKFLOWS_DIR / f"{WORKFLOW_TITLES[task]}.jpg"


def _api_file(task: str) -> Path:
    return API_DIR / f"wanvace_{task}.json"


def _ui(task: str) -> dict:
    return json.loads(_ui_file(task).read_text(encoding="utf-8"))


def _named_inputs(task: str) -> list[str]:
    """The input files a workflow's loaders open."""
    return [
        node["inputs"][widget]
        for node in build_api_workflow(task).values()
        for class_type, widget in INPUT_FILE_WIDGETS
        if node["class_type"] == class_type
    ]


def _canonical(value):
    """JSON numbers as the browser has them: JavaScript cannot tell 16.0 from 16, so integral floats become ints."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _spec_default(spec: list):
    """What ComfyUI uses for an input the prompt leaves out: its default, else a combo's first option."""
    kind, options = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
    if "default" in options:
        return options["default"]
    if isinstance(kind, list) and kind:
        return kind[0]
    if kind == DYNAMIC_COMBO and options.get("options"):
        return options["options"][0]["key"]
    if kind == "COMBO" and options.get("options"):
        return options["options"][0]
    raise KeyError("no default")


def _server_default(info: dict, name: str, inputs: dict):
    """The value the server gives input `name` of a node (object_info entry `info`) that the prompt omits.

    `a.b` is input b of the option that dynamic combo a has selected (ComfyUI 0.33's SaveVideo sends
    `format.codec`).
    """
    specs = {k: v for section in ("required", "optional") for k, v in info["input"].get(section, {}).items()}
    if "." in name:
        parent, child = name.split(".", 1)
        spec = specs[parent]
        chosen = inputs.get(parent, _spec_default(spec))
        (option,) = [o for o in spec[1]["options"] if o["key"] == chosen]
        sub = {k: v for section in ("required", "optional") for k, v in option["inputs"].get(section, {}).items()}
        return _spec_default(sub[child])
    return _spec_default(specs[name])


def _comparable(prompt: dict) -> str:
    """A prompt without `_meta` as canonical JSON text.

    Comparing JSON text keeps types strict apart from the int/float case above (no "16" == 16, True == 1).
    """
    nodes = {node_id: {"class_type": node["class_type"], "inputs": node["inputs"]} for node_id, node in prompt.items()}
    return json.dumps(_canonical(nodes), indent=1, sort_keys=True)


def _without_frontend_additions(queued: dict, twin: dict, object_info: dict) -> dict:
    """What the frontend queued, less the inputs it adds on its own: FRONTEND_ONLY_INPUTS, and inputs the
    twin leaves out that it sends at the server's default (ComfyUI 0.33's CreateVideo.bit_depth and
    SaveVideo's `format.codec`, which 0.3.75 does not have)."""
    cleaned = {}
    for node_id, node in queued.items():
        inputs = dict(node["inputs"])
        twin_inputs = twin.get(node_id, {}).get("inputs", {})
        for name in [n for n in inputs if n not in twin_inputs]:
            sent = inputs.pop(name)
            known = FRONTEND_ONLY_INPUTS.get(node["class_type"], {})
            if name in known:
                assert sent == known[name], f"node {node_id}: unexpected {name}={sent!r}"
                continue
            default = _server_default(object_info[node["class_type"]], name, inputs)
            assert _canonical(sent) == _canonical(default), (
                f"node {node_id} ({node['class_type']}): the frontend sends {name}={sent!r}, "
                f"not the server's default {default!r}"
            )
        cleaned[node_id] = {**node, "inputs": inputs}
    return cleaned


def _combo_options(spec: list) -> list:
    """A combo's options in either form of /object_info: [[...], {...}] or ["COMBO", {"options": [...]}]."""
    if isinstance(spec[0], list):
        return spec[0]
    return spec[1].get("options", []) if len(spec) > 1 else []


def _overlaps(a: tuple, b: tuple) -> bool:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


def _inside(inner: tuple, outer: tuple) -> bool:
    ix, iy, iw, ih = inner
    ox, oy, ow, oh = outer
    return ox <= ix and oy <= iy and ix + iw <= ox + ow and iy + ih <= oy + oh


def _node_box(node: dict) -> tuple:
    """The node with its title bar (LiteGraph draws it above `pos`)."""
    x, y = node["pos"]
    w, h = node["size"]
    return (x, y - make_workflows.TITLE_HEIGHT, w, h + make_workflows.TITLE_HEIGHT)


# --- without ComfyUI -----------------------------------------------------------


@pytest.mark.parametrize("task", WORKFLOWS)
def test_api_twin_matches_graph_builder(task):
    assert _api_file(task).read_text(encoding="utf-8") == make_workflows.dumps(build_api_workflow(task)), (
        f"{_api_file(task).name} is stale; {REGENERATE}"
    )


def _ui_ids(task: str) -> dict[str, int]:
    """Placement key (API node id, or a graph-editor-only node's key) -> node id in the UI file."""
    ui = _ui(task)
    layout = build_ui_layout(task)
    (note,) = [n for n in ui["nodes"] if n["type"] == make_workflows.NOTE_TYPE]
    ids = {key: int(key) for key in layout.placement if key not in layout.ui_nodes}
    return ids | {key: note["id"] + 1 + i for i, key in enumerate(layout.ui_nodes)}


@pytest.mark.parametrize("task", WORKFLOWS)
def test_ui_workflow_has_its_note_groups_and_a_readable_saved_view(task):
    ui = _ui(task)
    (note,) = [n for n in ui["nodes"] if n["type"] == make_workflows.NOTE_TYPE]
    text = note["widgets_values"][0]
    for file in _named_inputs(task):
        assert f"`{file}`" in text, f"the note does not say that {file} is an example to replace"
    files = SINGLE_FILES.get(variant_of(task))
    if files is None:
        assert f"ComfyUI/models/diffusers/{REAL_MODEL}/" in text and "transformer_2/" in text
        assert "cannot fetch a folder" in text
    else:
        # Each file the loader picks, and the ComfyUI folder it goes in.
        assert all(f"`{name}`" in text for name in files.values()), text
        assert all(folder in text for folder in ("models/diffusion_models/", "models/text_encoders/", "models/vae/"))
    # The download and the memory it needs; the offload node it mentions is in the graph.
    assert re.search(r"\*\*1\. Model\*\* \([^)]*~\d+ GB\)", text), text
    assert re.search(r"\*\*GPU memory\*\* .*~\d+ GB with", text), text
    assert "WanVACE Offload Options" in text
    assert any(n["type"] == "WanVACEOffloadOptions" for n in ui["nodes"])
    assert "**Video size**" in text

    layout = build_ui_layout(task)
    ids = _ui_ids(task)
    groups = {g["title"]: tuple(g["bounding"]) for g in ui["groups"]}
    assert sorted(groups) == sorted(layout.groups.values())
    assert {"Video size", "Model", "Prompt and VACE conditioning", "Sampling", "Decode and save"} <= set(groups)
    for key, (group, _column) in layout.placement.items():
        (node,) = [n for n in ui["nodes"] if n["id"] == ids[key]]
        title = layout.groups[group]
        assert _inside(_node_box(node), groups[title]), f"node {node['id']} sticks out of group {title!r}"
    boxes = [*groups.values(), _node_box(note)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not _overlaps(a, b), f"{a} and {b} overlap"

    # The saved view shows the page at a zoom where the editor still draws text (it switches to low-detail
    # rendering below 8 px / 14 px = 0.57), below its tab bar and right of its sidebar.
    ds = ui["extra"]["ds"]
    assert 0.6 <= ds["scale"] <= 1, ds
    left, top = (ds["offset"][0] * ds["scale"], ds["offset"][1] * ds["scale"])
    assert left >= 75 and top >= 135, "the graph starts under the editor's sidebar or tab bar"


def test_ui_workflow_layout_has_no_overlaps_also_after_a_run():
    """Nodes do not overlap, also counting the room below the nodes a run grows (the sampler's live preview, the
    saved video's player: make_workflows.RUN_PREVIEW_HEIGHT, measured by test_a_run_grows_nodes_into_their_room)."""
    for task in WORKFLOWS:
        boxes = {}
        for n in _ui(task)["nodes"]:
            x, y, w, h = _node_box(n)
            boxes[n["id"]] = (x, y, w, h + make_workflows.RUN_PREVIEW_HEIGHT.get(n["type"], 0))
        for a, box_a in boxes.items():
            for b, box_b in boxes.items():
                if a < b:
                    assert not _overlaps(box_a, box_b), f"{task}: nodes {a} and {b} overlap"


@pytest.mark.parametrize("task", WORKFLOWS)
def test_width_height_and_length_are_set_once(task):
    """One primitive each for width, height and length, feeding every input of that name in the workflow (but the
    extension's Control Video length: the clip's frames it keeps); in the API twin they are constants."""
    ui = _ui(task)
    nodes = {n["id"]: n for n in ui["nodes"]}
    primitives = {n["title"]: n for n in ui["nodes"] if n["type"] == make_workflows.PRIMITIVE_TYPE}
    assert sorted(primitives) == ["height", "length", "width"]
    fed = {}
    for _link_id, origin, _slot, target, target_slot, _type in ui["links"]:
        if nodes[origin]["type"] == make_workflows.PRIMITIVE_TYPE:
            fed[(target, nodes[target]["inputs"][target_slot]["name"])] = nodes[origin]["title"]
    twin = build_api_workflow(task)
    wanted = {
        (int(node_id), name)
        for node_id, node in twin.items()
        for name in ("width", "height", "length")
        if name in node["inputs"]
        and not (task_of(task) == "extension" and node["class_type"] == "WanVACEControlVideo" and name == "length")
    }
    assert set(fed) == wanted, (sorted(fed), sorted(wanted))
    assert all(fed[key] == key[1] for key in fed)
    for node_id, name in wanted:
        assert isinstance(twin[str(node_id)]["inputs"][name], int)
    if task_of(task) == "extension":
        (control,) = [n for n in twin.values() if n["class_type"] == "WanVACEControlVideo"]
        assert control["inputs"]["length"] == EXTENSION_GIVEN_FRAMES


@pytest.mark.parametrize("task", WORKFLOWS)
def test_model_files_carry_their_download(task):
    """Every model file a node picks is listed in its `properties.models` and the workflow's `models` with a Hugging
    Face address and its ComfyUI folder, for the frontends' missing-models dialog; but GGUF files (frontend 1.32
    downloads only .safetensors/.sft and cannot see .gguf in ComfyUI's folder lists)."""
    ui = _ui(task)
    picked = {}
    for node in ui["nodes"]:
        for value in node.get("widgets_values_named", {}).values():
            if isinstance(value, str) and value.endswith((".safetensors", ".gguf")):
                picked[value] = node
    assert set(picked) >= _files_of(task)
    listed = {entry["name"]: entry for entry in ui.get("models", [])}
    for name, node in picked.items():
        entries = {e["name"]: e for e in node["properties"].get("models", [])}
        if name.endswith(".gguf"):
            assert name not in entries and name not in listed
            continue
        expected = MODEL_FILES[name]
        assert entries[name] == listed[name] == {"name": name, "url": expected.url, "directory": expected.directory}
        assert expected.url.startswith("https://huggingface.co/") and expected.url.endswith(f"/{name}")
    assert set(listed) == {n for n in picked if not n.endswith(".gguf")}


def _files_of(task: str) -> set[str]:
    files = set(SINGLE_FILES.get(variant_of(task), {}).values())
    return files | {n["inputs"]["lora_name"] for n in build_api_workflow(task).values() if "lora_name" in n["inputs"]}


@pytest.mark.parametrize("task", WORKFLOWS)
def test_thumbnail_is_a_small_jpeg(task):
    data = _thumbnail(task).read_bytes()
    assert data[:3] == b"\xff\xd8\xff", f"{_thumbnail(task).name} is not a JPEG"
    assert len(data) <= make_workflows.THUMBNAIL_MAX_BYTES


def test_every_named_input_is_shipped_small_and_in_the_workflows_aspect():
    from PIL import Image

    named = {file for task in WORKFLOWS for file in _named_inputs(task)}
    assert named == set(EXAMPLE_INPUTS.values())
    assert sorted(p.name for p in EXAMPLE_DIR.iterdir()) == sorted(named)
    for file in named:
        path = EXAMPLE_DIR / file
        assert path.stat().st_size < 40_000, f"{file} is {path.stat().st_size} bytes"
        if path.suffix == ".png":
            with Image.open(path) as image:
                assert image.size == (208, 120), f"{file}: {image.size}"


def test_example_inputs_match_their_generator():
    generator = _load_module("make_example_inputs", REPO_ROOT / "scripts" / "make_example_inputs.py")
    assert generator.main(["--check"]) == 0, "run `.venvs/current/bin/python scripts/make_example_inputs.py`"


# --- the example-input copy (nodes/examples.py), without ComfyUI ---------------


def test_copy_fills_the_input_dir_and_keeps_what_is_there(tmp_path, caplog):
    input_dir = tmp_path / "input"
    input_dir.mkdir()
    mine = input_dir / EXAMPLE_INPUTS["first"]
    mine.write_bytes(b"the user's own picture")
    (input_dir / EXAMPLE_INPUTS["control"]).mkdir()  # a folder of that name is left alone too
    (input_dir / EXAMPLE_INPUTS["ref1"]).symlink_to(tmp_path / "dangling")

    with caplog.at_level(logging.INFO):
        copied = examples.copy_missing_examples(input_dir)
    kept = {EXAMPLE_INPUTS[k] for k in ("first", "control", "ref1")}
    assert sorted(copied) == sorted(set(EXAMPLE_INPUTS.values()) - kept)
    assert mine.read_bytes() == b"the user's own picture"
    assert (input_dir / EXAMPLE_INPUTS["control"]).is_dir()
    assert (input_dir / EXAMPLE_INPUTS["ref1"]).is_symlink()
    for name in copied:
        assert (input_dir / name).read_bytes() == (EXAMPLE_DIR / name).read_bytes()
    assert any("copied example inputs" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)

    assert examples.copy_missing_examples(input_dir) == []
    assert mine.read_bytes() == b"the user's own picture"


def test_copy_creates_a_missing_input_dir(tmp_path):
    copied = examples.copy_missing_examples(tmp_path / "new" / "input")
    assert sorted(copied) == sorted(EXAMPLE_INPUTS.values())


def test_an_unwritable_input_dir_only_logs_a_warning(tmp_path, monkeypatch, caplog):
    # Root may write anywhere, so the refusal is simulated where the copy opens its target.
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(examples.os, "open", refuse)
    input_dir = tmp_path / "input"
    input_dir.mkdir()
    with caplog.at_level(logging.WARNING):
        assert examples.copy_missing_examples(input_dir) == []
    assert list(input_dir.iterdir()) == []
    assert any(r.levelno == logging.WARNING and "Permission denied" in r.getMessage() for r in caplog.records)

    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    with caplog.at_level(logging.WARNING):
        assert examples.copy_missing_examples(a_file / "input") == []


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    real_fdopen = examples.os.fdopen

    class FullDisk:
        def __init__(self, fd, mode):
            self.file = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(examples.os, "fdopen", FullDisk)
    input_dir = tmp_path / "input"
    input_dir.mkdir()
    assert examples.copy_missing_examples(input_dir) == []
    assert list(input_dir.iterdir()) == []


def test_install_without_comfyui_only_logs_a_warning(monkeypatch, caplog):
    monkeypatch.setitem(__import__("sys").modules, "folder_paths", None)
    monkeypatch.setattr(examples, "_installed", False)
    with caplog.at_level(logging.WARNING):
        assert examples.install_example_inputs() == []
    assert any("example inputs not copied" in r.getMessage() for r in caplog.records)


# --- with ComfyUI --------------------------------------------------------------


@pytest.fixture(scope="module")
def object_info(comfy_server) -> dict:
    return comfy_server.object_info()


@pytest.mark.every_variant
@pytest.mark.parametrize("task", WORKFLOWS)
def test_ui_workflow_matches_converter(object_info, task):
    ui = make_workflows.build_ui_workflow(task, object_info)
    assert _ui_file(task).read_text(encoding="utf-8") == make_workflows.dumps(ui), (
        f"{_ui_file(task).name} is stale; {REGENERATE}"
    )


def test_workflows_dir_holds_the_workflows_and_thumbnails_with_registered_nodes_only(object_info):
    expected = [_ui_file(t).name for t in WORKFLOWS] + [_thumbnail(t).name for t in WORKFLOWS] + [API_DIR.name]
    assert sorted(p.name for p in WORKFLOWS_DIR.iterdir()) == sorted(expected)
    # The API twins sit in their own folder, which ComfyUI's template browser does not list.
    assert sorted(p.name for p in API_DIR.iterdir()) == sorted(_api_file(t).name for t in WORKFLOWS)
    registered = set(object_info) | {make_workflows.NOTE_TYPE, make_workflows.PRIMITIVE_TYPE}  # frontend-only types
    for task in WORKFLOWS:
        types = {node["type"] for node in _ui(task)["nodes"]}
        assert types <= registered, f"{task}: node types unknown to the server: {sorted(types - registered)}"


# What the template browser lists first: one template per task, in the order; the variants after them.
TASK_ORDER = ("t2v", "i2v", "flf2v", "r2v", "v2v", "inpaint", "outpaint", "extension")


def _in_task_order(names: list[str]) -> bool:
    by_title = {WORKFLOW_TITLES[t]: t for t in WORKFLOWS}
    tasks = [by_title[n] for n in names]
    return tasks[: len(TASK_ORDER)] == list(TASK_ORDER) and set(tasks) == set(WORKFLOWS)


def test_the_pack_sorts_only_its_own_template_list():
    ours = {"02 b", "01 a", "10 c"}
    listed = {"other-pack": ["z", "a"], "ComfyUI-WanVACE": ["10 c", "02 b", "01 a"], "renamed": ["01 a"]}
    assert examples.ordered_template_list(listed, ours) == {
        "other-pack": ["z", "a"],
        "ComfyUI-WanVACE": ["01 a", "02 b", "10 c"],
        "renamed": ["01 a"],
    }


def test_workflows_are_listed_as_templates_in_task_order_with_thumbnails(comfy_server):
    # ComfyUI lists a pack's files in file-system order; the pack's middleware sorts its own entry by name.
    for path in ("/api/workflow_templates", "/workflow_templates"):
        r = comfy_server.get(path)
        r.raise_for_status()
        listed = r.json()[PACKAGE_DIR_NAME]
        assert sorted(listed) == sorted(WORKFLOW_TITLES[t] for t in WORKFLOWS), listed
        assert _in_task_order(listed), listed
    # The template browser fetches /api/workflow_templates/<pack>/<name>.json and, for the card,
    # <name>.jpg (frontend 1.32 and 1.49: mediaType image, mediaSubtype jpg for a pack's template).
    for task in WORKFLOWS:
        served = comfy_server.get(f"/api/workflow_templates/{PACKAGE_DIR_NAME}/{WORKFLOW_TITLES[task]}.json")
        served.raise_for_status()
        assert served.json() == _ui(task)
        thumbnail = comfy_server.get(f"/api/workflow_templates/{PACKAGE_DIR_NAME}/{WORKFLOW_TITLES[task]}.jpg")
        assert thumbnail.status_code == 200, thumbnail.status_code
        assert thumbnail.headers["Content-Type"] == "image/jpeg"
        assert thumbnail.content == _thumbnail(task).read_bytes()


def test_loaders_offer_the_example_inputs(object_info):
    offered = {
        (class_type, widget): set(_combo_options(object_info[class_type]["input"]["required"][widget]))
        for class_type, widget in INPUT_FILE_WIDGETS
    }
    for task in WORKFLOWS:
        for node in build_api_workflow(task).values():
            for (class_type, widget), files in offered.items():
                if node["class_type"] == class_type:
                    assert node["inputs"][widget] in files, f"{task}: {class_type} does not offer {node['inputs']}"


def test_the_pack_copies_example_inputs_at_load_without_overwriting(tmp_path):
    """A fresh ComfyUI whose input folder holds a user's file of the same name as an example."""
    require_comfyui()
    server = ComfyServer(tmp_path / "base")
    server.prepare()
    mine = server.base_dir / "input" / EXAMPLE_INPUTS["first"]
    mine.write_bytes(b"the user's own picture")
    server.start(timeout=180)
    try:
        offered = set(_combo_options(server.object_info("LoadVideo")["LoadVideo"]["input"]["required"]["file"]))
    finally:
        server.stop()
    assert mine.read_bytes() == b"the user's own picture"
    for name in set(EXAMPLE_INPUTS.values()) - {mine.name}:
        assert (server.base_dir / "input" / name).read_bytes() == (EXAMPLE_DIR / name).read_bytes()
    assert {EXAMPLE_INPUTS["control"], EXAMPLE_INPUTS["source"]} <= offered
    log = server.log_text()
    assert "copied example inputs" in log and mine.name not in log.split("copied example inputs", 1)[1].split("\n")[0]


# --- in the graph editor -------------------------------------------------------


def _set_name(comfy_server) -> str:
    if os.environ.get("WANVACE_SET"):
        return os.environ["WANVACE_SET"]
    return f"comfyui-{comfy_server.system_stats()['system'].get('comfyui_version', 'unknown')}"


class _BrowserResults(dict):
    """Per task, what check_workflows.mjs found; `template_browser`: what the template browser showed."""

    template_browser: dict


@pytest.fixture(scope="module")
def browser_results(comfy_server, tmp_path_factory) -> _BrowserResults:
    tmp = tmp_path_factory.mktemp("browser")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHECK_WORKFLOWS_SCREENSHOTS", str(tmp / "raw"))
        mp.setenv("CHECK_WORKFLOWS_TEMPLATE_BROWSER", PACKAGE_DIR_NAME)
        results = check_workflows_in_browser(comfy_server.url, [_ui_file(t) for t in WORKFLOWS], tmp / "report.json")
    by_file = {Path(r["file"]).resolve(): r for r in results}
    by_task = _BrowserResults({task: by_file[_ui_file(task).resolve()] for task in WORKFLOWS})
    by_task.template_browser = json.loads((tmp / "report.json").read_text())["template_browser"]

    set_name = _set_name(comfy_server)
    targets = [tmp / "screenshots"]
    if os.environ.get("WANVACE_SCREENSHOT_DIR"):
        targets.append(Path(os.environ["WANVACE_SCREENSHOT_DIR"]))
    for target in targets:
        target.mkdir(parents=True, exist_ok=True)
        for task, res in by_task.items():
            if res.get("screenshot"):
                shutil.copyfile(res["screenshot"], target / f"{set_name}_{task}.png")
    print(f"screenshots at the saved view: {', '.join(str(t) for t in targets)}")
    return by_task


@pytest.mark.browser
@pytest.mark.every_variant
@pytest.mark.parametrize("task", WORKFLOWS)
def test_workflow_loads_cleanly(browser_results, task):
    res = browser_results[task]
    assert res["load_error"] is None, res["load_error"]
    assert res["missing_types"] == [], res["missing_types"]
    assert res["raw_broken_links"] == [], res["raw_broken_links"]
    assert res["broken_links"] == [], res["broken_links"]
    assert res["dialogs"] == [], res["dialogs"]
    assert res["red_nodes"] == [], res["red_nodes"]
    assert res["console_errors"] == [], res["console_errors"]
    assert res["screenshot"] and Path(res["screenshot"]).is_file()


@pytest.mark.browser
@pytest.mark.every_variant
@pytest.mark.parametrize("task", WORKFLOWS)
def test_no_link_runs_under_a_node_or_across_a_group_title(browser_results, task):
    """Checked on the curves the frontend drew (check_workflows.mjs samples each link as the frontend draws it and
    first checks the samples against the frontend's own path, so a frontend that draws otherwise fails here)."""
    res = browser_results[task]
    assert res["links_checked"] == len(_ui(task)["links"])
    assert res["link_unverified"] == [], res["link_unverified"]
    assert res["link_problems"] == [], res["link_problems"]


@pytest.mark.browser
@pytest.mark.parametrize("task", WORKFLOWS)
def test_every_node_follows_the_one_width_height_and_length(browser_results, task):
    """In the frontend, each primitive set to a new value: graphToPrompt gives every input it feeds that value."""
    follows = {f["primitive"]: f for f in browser_results[task]["size_follows"]}
    assert sorted(follows) == ["height", "length", "width"], follows
    for name, found in follows.items():
        assert found["targets"] and found["mismatches"] == [], (name, found)


@pytest.mark.browser
def test_template_browser_lists_the_templates_in_order_uncut(browser_results):
    shown = browser_results.template_browser
    assert "error" not in shown, shown
    assert shown["titles"] == sorted(WORKFLOW_TITLES[t] for t in WORKFLOWS), shown
    assert _in_task_order(shown["titles"])
    assert shown["cut"] == [], shown


@pytest.mark.browser
@pytest.mark.every_variant
@pytest.mark.parametrize("task", WORKFLOWS)
def test_workflow_opens_with_its_input_files(browser_results, task):
    # Every combo is among the server's options, but the model folder, which the user downloads.
    res = browser_results[task]
    invalid = [(c["type"], c["widget"], c["value"]) for c in res["invalid_combos"]]
    # The diffusers workflows name the real model folder, which the test server lacks; the single-file ones
    # name files it has (the tiny model's, under their real names).
    expected = [] if variant_of(task) in SINGLE_FILES else [("WanVACEModelLoader", "model_name", REAL_MODEL)]
    assert invalid == expected, res["invalid_combos"]
    # The check saw the loaders' file combos (so the frontend drew them as combos with the server's list).
    checked = {tuple(c) for c in res["combos_checked"]}
    wanted = {
        (node["class_type"], w)
        for node in build_api_workflow(task).values()
        for c, w in INPUT_FILE_WIDGETS
        if c == node["class_type"]
    }
    assert wanted <= checked, (wanted, checked)


@pytest.mark.browser
@pytest.mark.every_variant
@pytest.mark.parametrize("task", WORKFLOWS)
def test_saved_view_hides_nothing(browser_results, task):
    res = browser_results[task]
    assert res["hidden"] == [], "\n".join(res["hidden"])
    assert res["clipped_notes"] == [], res["clipped_notes"]
    assert res["view"]["scale"] == _ui(task)["extra"]["ds"]["scale"], "the frontend did not restore the saved view"
    assert sorted(res["groups"]) == sorted(g["title"] for g in _ui(task)["groups"])


@pytest.mark.browser
@pytest.mark.every_variant
@pytest.mark.parametrize("task", WORKFLOWS)
def test_nodes_keep_to_their_groups_as_the_frontend_sizes_them(browser_results, task):
    res = browser_results[task]
    layout = build_ui_layout(task)
    group_of = {ids: layout.placement[key][0] for key, ids in _ui_ids(task).items()}
    groups = {g["title"]: tuple(g["box"]) for g in res["group_boxes"]}
    nodes = {n["id"]: (n["type"], tuple(n["box"])) for n in res["node_boxes"]}
    for node_id, (node_type, box) in nodes.items():
        if node_type == make_workflows.NOTE_TYPE:
            continue
        title = layout.groups[group_of[int(node_id)]]
        assert _inside(box, groups[title]), f"node {node_id} ({node_type}) {box} sticks out of {title!r}"
    ids = sorted(nodes)
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            assert not _overlaps(nodes[a][1], nodes[b][1]), f"nodes {a} and {b} overlap: {nodes[a]} {nodes[b]}"


@pytest.mark.browser
@pytest.mark.parametrize("task", WORKFLOWS)
def test_graph_to_prompt_equals_api_twin(browser_results, object_info, task):
    queued = browser_results[task]["api_prompt"]
    assert queued, f"graphToPrompt gave nothing: {browser_results[task]['load_error']}"
    twin = json.loads(_api_file(task).read_text(encoding="utf-8"))
    assert _comparable(_without_frontend_additions(queued, twin, object_info)) == _comparable(twin)


# --- after a run, and without the model files ----------------------------------------------------------------------

# A run in the browser on the tiny model: its folder, the one width/height/length set small, fewer steps.
TINY_RUN = {
    "WanVACEModelLoader": {"model_name": TINY_MODEL},
    "PrimitiveNode:width": 64,
    "PrimitiveNode:height": 48,
    "PrimitiveNode:length": 9,
    "WanVACESampler": {"steps": 2},
}
RUN_TASKS = ("v2v",)  # the page layout every workflow shares, with an input loader; one run is enough


@pytest.fixture(scope="module")
def run_results(comfy_server, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("browser_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHECK_WORKFLOWS_SCREENSHOTS", str(tmp / "raw"))
        mp.setenv("CHECK_WORKFLOWS_RUN", json.dumps(TINY_RUN))
        results = check_workflows_in_browser(comfy_server.url, [_ui_file(t) for t in RUN_TASKS], tmp / "report.json")
    by_file = {Path(r["file"]).resolve(): r for r in results}
    targets = [Path(os.environ["WANVACE_SCREENSHOT_DIR"])] if os.environ.get("WANVACE_SCREENSHOT_DIR") else []
    for target in targets:
        target.mkdir(parents=True, exist_ok=True)
        for task in RUN_TASKS:
            shot = by_file[_ui_file(task).resolve()]["run"].get("screenshot")
            if shot:
                shutil.copyfile(shot, target / f"{_set_name(comfy_server)}_{task}_after_run.png")
    return {task: by_file[_ui_file(task).resolve()] for task in RUN_TASKS}


@pytest.mark.browser
@pytest.mark.parametrize("task", RUN_TASKS)
def test_a_run_grows_nodes_into_their_room(run_results, comfy_server, task):
    """Queued from the graph editor on the tiny model with the live preview on: the sampler (preview) and SaveVideo
    (player) grow into the room the layout left below them, and still nothing overlaps or crosses a link."""
    run = run_results[task]["run"]
    assert run["status"] == "success", run["status"]
    planned = {n["id"]: n for n in _ui(task)["nodes"]}
    grown = {}
    for found in run["node_boxes"]:
        node = planned[int(found["id"])]
        growth = found["box"][3] - make_workflows.TITLE_HEIGHT - node["size"][1]
        if growth > 1:
            grown[node["type"]] = growth
            assert growth <= make_workflows.RUN_PREVIEW_HEIGHT.get(node["type"], 0), (node["type"], growth)
    assert grown.get("SaveVideo", 0) > 100, grown  # the saved video's player
    # ComfyUI 0.33 takes the prompt's own preview method from the frontend; 0.3.75 only its --preview-method flag,
    # which the test server does not set.
    if comfy_server.system_stats()["system"].get("comfyui_version") != "0.3.75":
        assert grown.get("WanVACESampler", 0) > 100, grown
    boxes = {found["id"]: tuple(found["box"]) for found in run["node_boxes"]}
    for a, box_a in boxes.items():
        for b, box_b in boxes.items():
            if str(a) < str(b):
                assert not _overlaps(box_a, box_b), f"nodes {a} and {b} overlap after the run"
    groups = [tuple(g["box"]) for g in run["group_boxes"]]
    for found in run["node_boxes"]:
        if found["type"] != make_workflows.NOTE_TYPE:
            box = tuple(found["box"])
            assert any(_inside(box, group) for group in groups), f"{found} sticks out of its group after the run"
    assert run["link_unverified"] == [] and run["link_problems"] == [], (run["link_unverified"], run["link_problems"])
    assert run["red_nodes"] == []


# Workflows that pick model files in every folder the metadata names (diffusion_models, text_encoders, vae, loras);
# the others' metadata is checked without a browser (test_model_files_carry_their_download).
MISSING_TASKS = ("i2v_fp8", "t2v_lightning")


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """A ComfyUI with this package and no model files."""
    require_comfyui()
    server = ComfyServer(tmp_path_factory.mktemp("bare_comfy") / "base")
    server.start(timeout=180)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.browser
def test_missing_models_are_offered_for_download_with_their_folder(bare_server, tmp_path):
    """Frontend 1.49 lists them in its error overlay's details, 1.32 in its Missing Models dialog: each file of the
    workflow's `models` metadata, with its folder and a Download button."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHECK_WORKFLOWS_MISSING_MODELS", "1")
        results = check_workflows_in_browser(bare_server.url, [_ui_file(t) for t in MISSING_TASKS], tmp_path / "r.json")
    by_file = {Path(r["file"]).resolve(): r for r in results}
    for task in MISSING_TASKS:
        lines = by_file[_ui_file(task).resolve()]["missing_models"]
        for entry in _ui(task)["models"]:
            at = [i for i, line in enumerate(lines) if entry["name"] in line]
            assert at, (task, entry["name"], lines)
            # The folder on the file's line (1.32: "loras / name") or the next one (1.49), then its Download button.
            near = " ".join(lines[at[0] : at[0] + 3])
            assert entry["directory"] in near and "Download" in near, (task, entry, near)
