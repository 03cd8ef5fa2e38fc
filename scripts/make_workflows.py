"""Regenerate the shipped workflows from `tests/workflow_graphs.py`.

Writes, for every task in WORKFLOWS:

* `tests/api_workflows/wanvace_<task>.json`: the API-format graph (what `/prompt` takes);
* `workflows/wanvace_<task>.json`: the same graph in the graph editor's UI (litegraph) format,
  which ComfyUI lists under Workflow > Browse Templates for this package.

The UI conversion needs each node's input and output layout, so a real ComfyUI (from
.cache/comfyui, with this package installed) is started in a temporary base directory to
fetch `/object_info`. Only the structure of that answer is used (input types and order,
output names and types), never the combo options, so the result does not depend on which
models or input files a server happens to have; running the script twice gives identical files.

    .venv/bin/python scripts/make_workflows.py           # write all files
    .venv/bin/python scripts/make_workflows.py --check   # exit 1 if a file is out of date

The conversion mirrors what ComfyUI's frontend (1.32) saves:

* `inputs` lists the sockets (link-only inputs, required then optional) first, then one entry
  per widget input (`widget: {"name": ...}`), in `input_order`; a link's target slot is the
  index in that list.
* `widgets_values` holds one value per widget in `input_order` (required, then optional), plus
  the frontend's own widgets: "fixed" after an INT with `control_after_generate` (or named
  seed/noise_seed) so the seed stays put, and "image" for the upload button of a combo with
  `image_upload` or `video_upload` (LoadImage, LoadImageMask, LoadVideo), after all other widgets.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = REPO_ROOT / "tests"
for _p in (str(TESTS_DIR), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from workflow_graphs import WORKFLOWS, build_api_workflow  # noqa: E402

API_DIR = TESTS_DIR / "api_workflows"
UI_DIR = REPO_ROOT / "workflows"

# Input types the frontend draws as a widget (unless `forceInput`); every other type is a socket.
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
# Combo options that make the frontend add an upload button widget, and the value it stores for it.
UPLOAD_WIDGET_VALUES = {"image_upload": "image", "video_upload": "image"}
UPLOAD_INPUT_TYPE = "IMAGEUPLOAD"
# What the frontend does to a seed widget after each queued prompt; "fixed" keeps it as shipped.
SEED_CONTROL_VALUE = "fixed"
SEED_NAMES = ("seed", "noise_seed")
# LiteGraph's RenderShape.HOLLOW_CIRCLE, which the frontend gives every optional input slot.
OPTIONAL_INPUT_SHAPE = 7

# Layout, in canvas units. LiteGraph draws a node's title bar above `pos`.
NODE_WIDTH = 270
NODE_WIDTH_NO_WIDGETS = 220
NODE_WIDTH_MULTILINE = 400
SLOT_HEIGHT = 20
WIDGET_HEIGHT = 24
MULTILINE_HEIGHT = 100
# The frontend grows a video node to at least 256 px of preview; images are drawn inside the node.
PREVIEW_HEIGHT = 270
NODE_PADDING = 14
TITLE_HEIGHT = 30
ORIGIN = (50, 80)
COLUMN_GAP = 100
ROW_GAP = 60


def api_path(task: str) -> Path:
    return API_DIR / f"wanvace_{task}.json"


def ui_path(task: str) -> Path:
    return UI_DIR / f"wanvace_{task}.json"


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _input_type(spec: list) -> str:
    kind = spec[0]
    return "COMBO" if isinstance(kind, list) else str(kind)


def _input_options(spec: list) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def _is_widget(spec: list) -> bool:
    return _input_type(spec) in WIDGET_TYPES and not _input_options(spec).get("forceInput", False)


def _has_seed_control(name: str, spec: list) -> bool:
    if _input_type(spec) != "INT":
        return False
    control = _input_options(spec).get("control_after_generate")
    return bool(control) if control is not None else name in SEED_NAMES


def _ordered_inputs(info: dict) -> list[tuple[str, list, bool]]:
    """(name, spec, optional) of every required, then optional input, in the node's input_order."""
    order = info.get("input_order", {})
    specs = info.get("input", {})
    ordered = []
    for section in ("required", "optional"):
        section_specs = specs.get(section, {})
        for name in order.get(section, list(section_specs)):
            ordered.append((name, section_specs[name], section == "optional"))
    return ordered


class _Slot(NamedTuple):
    name: str
    type: str
    widget: bool
    optional: bool


class _NodeLayout:
    """The UI shape of one node type: input slots, widgets and outputs as the frontend builds them."""

    def __init__(self, class_type: str, info: dict):
        self.class_type = class_type
        self.info = info
        inputs = _ordered_inputs(info)
        self.specs = {name: spec for name, spec, _optional in inputs}
        optional = {name for name, _spec, is_optional in inputs if is_optional}
        self.sockets = [name for name, spec, _optional in inputs if not _is_widget(spec)]
        self.widget_inputs = [name for name, spec, _optional in inputs if _is_widget(spec)]
        self.upload = None
        for name in self.widget_inputs:
            opts = _input_options(self.specs[name])
            flags = [key for key in UPLOAD_WIDGET_VALUES if opts.get(key)]
            if len(flags) > 1 or (flags and self.upload):
                raise NotImplementedError(f"{class_type}: more than one upload widget")
            if flags:
                self.upload = flags[0]
        # Input slots: sockets, then widget inputs, then the upload button's slot.
        self.slots = [_Slot(n, _input_type(self.specs[n]), False, n in optional) for n in self.sockets]
        self.slots += [_Slot(n, _input_type(self.specs[n]), True, n in optional) for n in self.widget_inputs]
        if self.upload:
            self.slots.append(_Slot("upload", UPLOAD_INPUT_TYPE, True, False))
        self.slot_index = {slot.name: i for i, slot in enumerate(self.slots)}
        self.output_types = [("COMBO" if isinstance(t, list) else t) for t in info.get("output", [])]
        self.output_names = list(info.get("output_name", self.output_types))
        self.multiline = sum(1 for n in self.widget_inputs if _input_options(self.specs[n]).get("multiline", False))

    def widgets_values(self, inputs: dict) -> list:
        values = []
        for name in self.widget_inputs:
            spec = self.specs[name]
            value = inputs.get(name)
            if value is None or _is_link(value):
                # A widget fed by a link keeps a value the frontend ignores; use the default.
                value = _input_options(spec).get("default")
                if value is None:
                    raise ValueError(f"{self.class_type}.{name}: no value and no default")
            values.append(value)
            if _has_seed_control(name, spec):
                values.append(SEED_CONTROL_VALUE)
        if self.upload:
            values.append(UPLOAD_WIDGET_VALUES[self.upload])
        return values

    def size(self) -> list[int]:
        widget_rows = len(self.widget_inputs) - self.multiline + (1 if self.upload else 0)
        widget_rows += sum(1 for n in self.widget_inputs if _has_seed_control(n, self.specs[n]))
        height = NODE_PADDING + SLOT_HEIGHT * max(len(self.sockets), len(self.output_types))
        height += WIDGET_HEIGHT * widget_rows + MULTILINE_HEIGHT * self.multiline
        if self.upload or self.info.get("output_node"):
            height += PREVIEW_HEIGHT
        if self.multiline:
            width = NODE_WIDTH_MULTILINE
        elif self.widget_inputs:
            width = NODE_WIDTH
        else:
            width = NODE_WIDTH_NO_WIDGETS
        return [width, height]


def _execution_order(ids: list[int], links: list[list]) -> list[int]:
    """Node ids in the order LiteGraph's computeExecutionOrder gives them (the nodes' `order`).

    Kahn's algorithm with a FIFO queue: nodes without input links in id order first, then each
    node's targets (by output slot, then link) as soon as all their input links are satisfied.
    """
    pending = dict.fromkeys(ids, 0)
    targets: dict[int, list[int]] = {i: [] for i in ids}
    for _link_id, origin, _origin_slot, target, _target_slot, _type in sorted(
        links, key=lambda link: (link[1], link[2], link[0])
    ):
        pending[target] += 1
        targets[origin].append(target)
    queue = [i for i in ids if pending[i] == 0]
    order: list[int] = []
    while queue:
        node = queue.pop(0)
        order.append(node)
        for target in targets[node]:
            pending[target] -= 1
            if pending[target] == 0:
                queue.append(target)
    if len(order) != len(ids):
        raise ValueError(f"cycle among nodes {sorted(set(ids) - set(order))}")
    return order


def _layout(order: list[int], parents: dict[int, set[int]], sizes: dict[int, list[int]]) -> dict[int, list[int]]:
    """Columns by dependency depth, each node as late (far right) as its consumers allow."""
    children: dict[int, set[int]] = {i: set() for i in order}
    for node, deps in parents.items():
        for dep in deps:
            children[dep].add(node)
    depth: dict[int, int] = {}
    for node in order:
        depth[node] = max((depth[p] + 1 for p in parents[node]), default=0)
    last = max(depth.values(), default=0)
    column: dict[int, int] = {}
    for node in reversed(order):
        column[node] = min((column[c] - 1 for c in children[node]), default=last)
    columns = [sorted(n for n in order if column[n] == c) for c in range(last + 1)]

    xs, x = [], ORIGIN[0]
    for members in columns:
        xs.append(x)
        x += max((sizes[n][0] for n in members), default=0) + COLUMN_GAP
    pos: dict[int, list[int]] = {}
    # Right to left: a node sits level with the mean height of its (already placed) consumers.
    for c in range(last, -1, -1):
        members = columns[c]
        wanted = {
            n: (sum(pos[k][1] for k in children[n]) / len(children[n]) if children[n] else ORIGIN[1]) for n in members
        }
        y_free = ORIGIN[1]
        for n in sorted(members, key=lambda n: (wanted[n], n)):
            y = max(round(wanted[n]), y_free)
            pos[n] = [xs[c], y]
            y_free = y + sizes[n][1] + TITLE_HEIGHT + ROW_GAP
    return pos


def api_to_ui(api: dict, object_info: dict) -> dict:
    """Convert an API-format graph into the graph editor's UI workflow format."""
    ids = sorted(int(k) for k in api)
    layouts: dict[int, _NodeLayout] = {}
    for node_id in ids:
        class_type = api[str(node_id)]["class_type"]
        if class_type not in object_info:
            raise KeyError(f"node {node_id}: {class_type} is not in /object_info")
        layouts[node_id] = _NodeLayout(class_type, object_info[class_type])

    for node_id in ids:
        layout = layouts[node_id]
        unknown = set(api[str(node_id)]["inputs"]) - set(layout.specs)
        if unknown:
            raise KeyError(f"node {node_id} ({layout.class_type}): unknown inputs {sorted(unknown)}")

    # Links, numbered by target node then target slot.
    links: list[list] = []
    input_links: dict[tuple[int, str], int] = {}
    output_links: dict[tuple[int, int], list[int]] = {}
    parents: dict[int, set[int]] = {i: set() for i in ids}
    for target in ids:
        layout = layouts[target]
        inputs = api[str(target)]["inputs"]
        for name in layout.slot_index:
            value = inputs.get(name)
            if not _is_link(value):
                continue
            origin, origin_slot = int(value[0]), value[1]
            if origin not in layouts:
                raise KeyError(f"node {target}.{name} links to missing node {origin}")
            origin_types = layouts[origin].output_types
            if origin_slot >= len(origin_types):
                raise IndexError(f"node {target}.{name} links to output {origin_slot} of node {origin}")
            link_id = len(links) + 1
            links.append([link_id, origin, origin_slot, target, layout.slot_index[name], origin_types[origin_slot]])
            input_links[(target, name)] = link_id
            output_links.setdefault((origin, origin_slot), []).append(link_id)
            parents[target].add(origin)

    order = _execution_order(ids, links)
    sizes = {i: layouts[i].size() for i in ids}
    positions = _layout(order, parents, sizes)

    nodes = []
    for node_id in ids:
        api_node = api[str(node_id)]
        layout = layouts[node_id]
        node: dict = {"id": node_id, "type": layout.class_type}
        title = api_node.get("_meta", {}).get("title")
        if title:
            node["title"] = title
        inputs = []
        for slot in layout.slots:
            entry: dict = {"name": slot.name, "type": slot.type}
            if slot.optional:
                entry["shape"] = OPTIONAL_INPUT_SHAPE
            if slot.widget:
                entry["widget"] = {"name": slot.name}
            entry["link"] = input_links.get((node_id, slot.name))
            inputs.append(entry)
        outputs = [
            {
                "name": name,
                "type": out_type,
                "links": output_links.get((node_id, slot), []),
                "slot_index": slot,
            }
            for slot, (name, out_type) in enumerate(zip(layout.output_names, layout.output_types, strict=True))
        ]
        node.update(
            pos=positions[node_id],
            size=sizes[node_id],
            flags={},
            order=order.index(node_id),
            mode=0,
            inputs=inputs,
            outputs=outputs,
            properties={"Node name for S&R": layout.class_type},
            widgets_values=layout.widgets_values(api_node["inputs"]),
        )
        nodes.append(node)

    return {
        "last_node_id": max(ids, default=0),
        "last_link_id": len(links),
        "nodes": nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 1, "offset": [0, 0]}},
        "version": 0.4,
    }


def fetch_object_info() -> dict:
    """/object_info of a fresh ComfyUI with this package, in a throwaway base directory."""
    from comfy_server import ComfyServer

    with tempfile.TemporaryDirectory(prefix="wanvace-make-workflows-") as tmp:
        server = ComfyServer(Path(tmp))
        server.prepare()
        server.start()
        try:
            return server.object_info()
        finally:
            server.stop()


def expected_files(object_info: dict | None) -> dict[Path, str]:
    """path -> text of every generated file; without object_info only the API twins."""
    files: dict[Path, str] = {}
    for task in WORKFLOWS:
        api = build_api_workflow(task)
        files[api_path(task)] = dumps(api)
        if object_info is not None:
            files[ui_path(task)] = dumps(api_to_ui(api, object_info))
    return files


def main(argv: list[str] | None = None, get_object_info: Callable[[], dict] = fetch_object_info) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    parser.add_argument(
        "--object-info", type=Path, help="read /object_info from this JSON file instead of starting ComfyUI"
    )
    args = parser.parse_args(argv)
    object_info = json.loads(args.object_info.read_text()) if args.object_info else get_object_info()
    files = expected_files(object_info)
    stale = [p for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(REPO_ROOT)}")
        return 1 if stale else 0
    for p, text in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} files ({len(stale)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
