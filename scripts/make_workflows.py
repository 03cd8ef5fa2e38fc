"""Regenerate the shipped workflows from the package `workflow_graphs/`.

Writes, for every workflow in WORKFLOWS:

* `example_workflows/api/wanvace_<name>.json`: the API-format graph (what `/prompt` takes);
* `example_workflows/<title>.json`: the same graph in the graph editor's UI (litegraph) format, which
  ComfyUI lists in its template browser under this package. The frontend (1.32 and 1.49) shows a
  custom node pack's template with its file name as title and `<title>.jpg` beside it as thumbnail,
  so the files are named after WORKFLOW_TITLES ("02 Image to Video.json").
* with `--thumbnails`: `example_workflows/<title>.jpg`, a screenshot of the workflow in the real graph
  editor (headless Chromium, tests/browser/check_workflows.mjs), 512 px wide.

The UI conversion needs each node's input and output layout, so a real ComfyUI (the tree of
scripts/comfy_server.py: `$WANVACE_COMFY_DIR`, else .cache/comfyui-current; with this package
installed) is started in a temporary base directory to fetch `/object_info`. Only the structure of
that answer is used (input types and order, output names and types), never the combo options, so the
result does not depend on which models or input files a server happens to have; running the script
twice, or against ComfyUI 0.3.75 and 0.33, gives identical files.

    .venvs/current/bin/python scripts/make_workflows.py               # write the JSON files
    .venvs/current/bin/python scripts/make_workflows.py --thumbnails  # and the thumbnails
    .venvs/current/bin/python scripts/make_workflows.py --check       # exit 1 if a file is out of date

The conversion mirrors what ComfyUI's frontends save (1.32 adds `extra.workflowRendererVersion`,
1.49 `widgets_values_named` and drops the groups' `font_size`; both load either, and 1.49 restores
widgets by name from `widgets_values_named`, which is written too):

* `inputs` lists the sockets (link-only inputs, required then optional) first, then one entry
  per widget input (`widget: {"name": ...}`), in `input_order`; a link's target slot is the
  index in that list.
* `widgets_values` holds one value per widget in `input_order` (required, then optional), plus
  the frontend's own widgets: "fixed" after an INT with `control_after_generate` (or named
  seed/noise_seed) so the seed stays put, and "image" for the upload button of a combo with
  `image_upload` or `video_upload` (LoadImage, LoadImageMask, LoadVideo), after all other widgets.
* What ComfyUI 0.3.75 and 0.33 declare differently is left for the frontend to fill in (see
  `_NodeLayout`), so both give the same file.

Beyond the API graph, the UI file has what only the graph editor knows (`UiLayout`):

* the frontend's primitive nodes for width, height and length, linked to every input that takes them
  (the frontend writes their values into those inputs when it queues, so the API twin has constants),
  and a muted WanVACE Offload Options for the user to switch on;
* ComfyUI's model metadata: `properties.models` on each node that picks a model file, and the
  workflow's `models`, with the file's download address and folder, for the missing-models dialog.

Layout: the nodes sit in titled groups (size, model, inputs, prompt, sampling, output, ...) placed as
`UiLayout.page` and `UiLayout.above` say, beside a Markdown note; the nodes of a group's column share
its width, and the sampler and SaveVideo get room below them for what a run adds (RUN_PREVIEW_HEIGHT).
Every link whose direct curve would cross a node or a group's title bar goes through native reroutes
(`extra.reroutes`, `extra.linkExtensions`) on a path found around them (scripts/workflow_layout.py);
generation fails when a link has no clean path. The saved view (`extra.ds`) puts the graph's top
left corner below the frontends' tab bar and breadcrumb and right of their sidebar, at the largest zoom
(at most 100%) that keeps the nodes, note and group titles in a 1600x1000 window and out of the corners
where the frontends draw the minimap and canvas info.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from scripts.workflow_layout import SOCKET_RUN, Box, Router, crossings, link_points  # noqa: E402
from workflow_graphs import (  # noqa: E402
    GROUP_COLORS,
    MODEL_FILES,
    REAL_MODEL,
    WORKFLOW_TITLES,
    WORKFLOWS,
    ModelFile,
    UiLayout,
    UiNode,
    build_api_workflow,
    build_ui_layout,
)

API_DIR = REPO_ROOT / "example_workflows" / "api"
UI_DIR = REPO_ROOT / "example_workflows"

# Input types the frontend draws as a widget (unless `forceInput`); every other type is a socket.
# ComfyUI 0.33 declares some combos (SaveVideo's format, codec) as dynamic combos, 0.3.75 as plain
# combos; both are saved as COMBO so the file does not depend on the ComfyUI it was made with.
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", DYNAMIC_COMBO})
# Combo options that make the frontend add an upload button widget, and the value it stores for it.
UPLOAD_WIDGET_VALUES = {"image_upload": "image", "video_upload": "image"}
UPLOAD_INPUT_TYPE = "IMAGEUPLOAD"
# What the frontend does to a seed widget after each queued prompt; "fixed" keeps it as shipped.
SEED_CONTROL_WIDGET, SEED_CONTROL_VALUE = "control_after_generate", "fixed"
SEED_NAMES = ("seed", "noise_seed")
# LiteGraph's RenderShape.HOLLOW_CIRCLE, which the frontend gives every optional input slot.
OPTIONAL_INPUT_SHAPE = 7

# Layout, in canvas units. LiteGraph draws a node's title bar above `pos`.
NODE_WIDTH = 270
# Core helper nodes (ImageScale, SolidMask, ...) are narrower: their labels fit.
NODE_WIDTH_HELPER = 230
NODE_WIDTH_NO_WIDGETS = 220
NODE_WIDTH_MULTILINE = 400
SLOT_HEIGHT = 20
WIDGET_HEIGHT = 24
MULTILINE_HEIGHT = 70
# Where frontend 1.49 draws the slots, below the title bar: the first socket row's centre, the gap before the
# widgets, a widget's socket below the top of its row, a multiline widget's row; outputs' x from the right edge,
# inputs' from the left one.
SLOT_Y = 14
WIDGET_TOP = 6
WIDGET_SOCKET_Y = 10
MULTILINE_ROW_HEIGHT = 74
OUTPUT_SLOT_INSET = 9
INPUT_SLOT_X = 10
# The frontend's primitive node (an INT one: its value and the "control after generate" widget), and LiteGraph's
# mode "never", which the frontend leaves out of the prompt with its links.
PRIMITIVE_TYPE = "PrimitiveNode"
PRIMITIVE_SIZE = (210, 82)
MUTED_MODE = 2
# What a run adds below a node, measured in frontend 1.49 (tests/integration/test_browser.py runs a workflow and
# checks): the sampler's live preview (310 -> 522 px) and SaveVideo's player (106 -> 301 px).
RUN_PREVIEW_HEIGHT = {"WanVACESampler": 230, "SaveVideo": 210}
# Room for the upload nodes' preview: the frontends draw a loaded image in what is left of the node
# (they grow LoadImage to 326 px at least) and give a video at least 256 px. An output node's
# preview (SaveVideo) appears after a run; its group leaves room below it.
PREVIEW_HEIGHT = {"image_upload": 224, "video_upload": 270}
NODE_PADDING = 14
TITLE_HEIGHT = 30
# Sizes the frontends (1.32, 1.49) grow these nodes to on loading (wider labels, 0.33's extra
# outputs and widgets), so the layout leaves them room.
SIZE_FLOORS = {
    "CreateVideo": (270, 102),
    "GetVideoComponents": (220, 106),
    "ImageBatch": (235, 54),
    "WanVACECacheOptions": (301, 250),
    # Measured in frontend 1.49: the boolean toggle row and the file-name combos take more than the estimate.
    "WanVACEModelLoader": (270, 140),
    "WanVACELoraLoader": (280, 130),
    # The frontends grow a LoadImage that shows its image to 314 (1.49) or 326 (1.32) px.
    "LoadImage": (270, 326),
    "WanVACEExpertsLoader": (300, 290),
}
# Groups: LiteGraph draws the title in a bar of font_size * 1.4 at the top of `bounding`.
GROUP_FONT_SIZE = 24
GROUP_TITLE_HEIGHT = 34
GROUP_PADDING = 10
# Between a group's title bar and its first node's title: room for the frontend's node badges.
NODE_TOP_GAP = 18
# Gaps wide enough for links (and their reroutes) to run between nodes and groups, clear of both.
NODE_GAP = 40
COLUMN_GAP = 80
GROUP_GAP = 80
ROUTE_MARGIN = 40
NOTE_TYPE = "MarkdownNote"
NOTE_TITLE = "Read me"
NOTE_WIDTH = 400
NOTE_LINE_HEIGHT = 12
NOTE_CHARS_PER_LINE = 68
NOTE_COLOR, NOTE_BGCOLOR = "#432", "#653"
# The saved view, in screen pixels of a 1600x1000 window. The frontends' panels cover the top
# (1.49: tab bar to y=38, breadcrumb and Run bar to y=85; 1.32: a dismissible banner to y=40, tab bar
# to y=78, breadcrumb and Run bar to y=130) and the left (sidebar to x=59), so the graph starts at
# VIEW_LEFT, VIEW_TOP. Both draw a minimap and the zoom controls in the bottom right corner and the
# canvas info (FPS, node count) in the bottom left one: no group or note may reach into KEEP_OUT
# (x0, y0, x1, y1). The saved zoom is the largest (at most MAX_SCALE, in steps of 0.01) that keeps
# everything in the window and out of those corners.
VIEW_LEFT, VIEW_TOP = 80, 140
WINDOW = (1600, 1000)
WINDOW_MARGIN = 12
KEEP_OUT = ((0, 912, 150, 1000), (1330, 728, 1600, 1000))
MAX_SCALE, MIN_SCALE = 1.0, 0.5
# Thumbnails: width of the JPEG, and its largest allowed size.
THUMBNAIL_WIDTH = 512
THUMBNAIL_MAX_BYTES = 100_000


def api_path(task: str) -> Path:
    return API_DIR / f"wanvace_{task}.json"


def ui_path(task: str) -> Path:
    return UI_DIR / f"{WORKFLOW_TITLES[task]}.json"


def thumbnail_path(task: str) -> Path:
    return UI_DIR / f"{WORKFLOW_TITLES[task]}.jpg"


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _input_type(spec: list) -> str:
    kind = spec[0]
    return "COMBO" if isinstance(kind, list) or kind == DYNAMIC_COMBO else str(kind)


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
    """The UI shape of one node: input slots, widgets and outputs as the frontend builds them.

    What ComfyUI versions disagree on is left out, so 0.3.75 and 0.33 give the same file and both
    frontends fill in the rest from the node definition when loading (checked in
    tests/integration/test_browser.py): optional widgets after the last one the graph sets (0.33's
    CreateVideo.bit_depth), outputs after the last linked one (0.33's extra GetVideoComponents and
    SaveVideo outputs), and the optional-slot shape of widget inputs (SaveVideo.codec is optional
    only in 0.33).
    """

    def __init__(self, class_type: str, info: dict, api_inputs: dict):
        self.class_type = class_type
        self.info = info
        inputs = _ordered_inputs(info)
        self.specs = {name: spec for name, spec, _optional in inputs}
        optional = {name for name, _spec, is_optional in inputs if is_optional}
        self.sockets = [name for name, spec, _optional in inputs if not _is_widget(spec)]
        widgets = [name for name, spec, _optional in inputs if _is_widget(spec)]
        kept = [i for i, name in enumerate(widgets) if name not in optional or name in api_inputs]
        self.widget_inputs = widgets[: kept[-1] + 1] if kept else []
        # Our nodes are the same in every ComfyUI version, so their trailing optional widgets, which the frontend
        # adds when loading, are counted in the size (the file still leaves their values out).
        self.sized_widgets = widgets if class_type.startswith("WanVACE") else self.widget_inputs
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
        self.slots += [_Slot(n, _input_type(self.specs[n]), True, False) for n in self.widget_inputs]
        if self.upload:
            self.slots.append(_Slot("upload", UPLOAD_INPUT_TYPE, True, False))
        self.slot_index = {slot.name: i for i, slot in enumerate(self.slots)}
        self.output_types = [("COMBO" if isinstance(t, list) else t) for t in info.get("output", [])]
        self.output_names = list(info.get("output_name", self.output_types))
        self.multiline = sum(1 for n in self.widget_inputs if _input_options(self.specs[n]).get("multiline", False))

    def _widget_values(self, inputs: dict) -> list[tuple[str, object]]:
        """(widget name, value) in the frontend's widget order, its own widgets included."""
        values = []
        for name in self.widget_inputs:
            spec = self.specs[name]
            value = inputs.get(name)
            if value is None or _is_link(value):
                # A widget fed by a link keeps a value the frontend ignores; use the default.
                value = _input_options(spec).get("default")
                if value is None:
                    raise ValueError(f"{self.class_type}.{name}: no value and no default")
            values.append((name, value))
            if _has_seed_control(name, spec):
                values.append((SEED_CONTROL_WIDGET, SEED_CONTROL_VALUE))
        if self.upload:
            values.append(("upload", UPLOAD_WIDGET_VALUES[self.upload]))
        return values

    def widgets_values(self, inputs: dict) -> list:
        return [value for _name, value in self._widget_values(inputs)]

    def widgets_values_named(self, inputs: dict) -> dict:
        return dict(self._widget_values(inputs))

    def input_y(self, name: str, outputs: int) -> float:
        """Where the frontend (1.49) puts input `name` below the node's title: sockets in rows of SLOT_HEIGHT, a
        widget's socket on its widget's row, which start below the sockets and outputs."""
        if name in self.sockets:
            return SLOT_Y + SLOT_HEIGHT * self.sockets.index(name)
        y = SLOT_HEIGHT * max(len(self.sockets), outputs) + WIDGET_TOP
        for widget in self.widget_inputs:
            if widget == name:
                return y + WIDGET_SOCKET_Y
            multiline = _input_options(self.specs[widget]).get("multiline", False)
            y += MULTILINE_ROW_HEIGHT if multiline else WIDGET_HEIGHT
            if _has_seed_control(widget, self.specs[widget]):
                y += WIDGET_HEIGHT
        raise KeyError(f"{self.class_type} has no input {name}")

    def size(self, outputs: int) -> list[int]:
        widget_rows = len(self.sized_widgets) - self.multiline + (1 if self.upload else 0)
        widget_rows += sum(1 for n in self.sized_widgets if _has_seed_control(n, self.specs[n]))
        height = NODE_PADDING + SLOT_HEIGHT * max(len(self.sockets), outputs)
        height += WIDGET_HEIGHT * widget_rows + MULTILINE_HEIGHT * self.multiline
        if self.upload:
            height += PREVIEW_HEIGHT[self.upload]
        if self.multiline:
            width = NODE_WIDTH_MULTILINE
        elif self.class_type.startswith("WanVACE") or self.upload or self.info.get("output_node"):
            width = NODE_WIDTH
        elif self.widget_inputs:
            width = NODE_WIDTH_HELPER
        else:
            width = NODE_WIDTH_NO_WIDGETS
        floor = SIZE_FLOORS.get(self.class_type, (0, 0))
        return [max(width, floor[0]), max(height, floor[1])]


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


def _note_height(text: str, width: float = NOTE_WIDTH) -> int:
    """Body height for the note's Markdown at `width`: wrapped lines at NOTE_LINE_HEIGHT, headings taller."""
    chars_per_line = NOTE_CHARS_PER_LINE * width / NOTE_WIDTH
    lines = 0.0
    for line in text.splitlines():
        if not line.strip():
            lines += 0.6
        elif line.startswith("#"):
            lines += 1.8
        else:
            lines += math.ceil(len(line) / chars_per_line)
    # One line more than counted: the renderer wraps at word boundaries.
    return round((lines + 1) * NOTE_LINE_HEIGHT + 2 * NODE_PADDING)


def _group_content(
    members: dict[int, list[int]], sizes: dict[int, list[int]], room: dict[int, int]
) -> tuple[dict[int, tuple], float, float]:
    """Node offsets inside a group (columns left to right, nodes stacked in placement order, each with `room` below
    it) and its inner size."""
    offsets: dict[int, tuple] = {}
    x, height = 0.0, 0.0
    for column in sorted(members):
        nodes = members[column]
        y = 0.0
        for node in nodes:
            offsets[node] = (x, y + TITLE_HEIGHT)
            y += TITLE_HEIGHT + sizes[node][1] + room.get(node, 0) + NODE_GAP
        height = max(height, y - NODE_GAP)
        x += max(sizes[n][0] for n in nodes) + COLUMN_GAP
    return offsets, x - COLUMN_GAP, height


def _page_layout(
    layout: UiLayout, placement: dict[int, tuple[str, int]], sizes: dict[int, list[int]], room: dict[int, int]
) -> tuple[dict[int, list[float]], dict[str, Box], Box, list[int]]:
    """Positions of the nodes, group boxes, the note's box (title bar included) and its size: as wide as the
    widest group of its column, as tall as its text then needs."""
    members: dict[str, dict[int, list[int]]] = {}
    for node, (group, column) in placement.items():
        if group not in layout.groups:
            raise KeyError(f"node {node} is placed in group {group!r}, which the layout does not define")
        members.setdefault(group, {}).setdefault(column, []).append(node)
    above_start, above = layout.above
    placed = [key for column in layout.page for row in column for key in row] + list(above)
    missing = (set(members) | set(layout.groups)) - set(placed)
    if missing or len(placed) != len(set(placed)) or "note" not in placed:
        raise ValueError(f"the page must place the note and every group once: {layout.page}, {layout.above}")
    # The nodes of a group's column share its width, so every link leaves the column at its right edge.
    for columns in members.values():
        for nodes in columns.values():
            width = max(sizes[n][0] for n in nodes)
            for n in nodes:
                sizes[n][0] = width

    content = {key: _group_content(members.get(key, {}), sizes, room) for key in layout.groups}
    natural = {
        key: (w + 2 * GROUP_PADDING, GROUP_TITLE_HEIGHT + NODE_TOP_GAP + h + GROUP_PADDING)
        for key, (_offsets, w, h) in content.items()
    }
    (note_column,) = [column for column in layout.page if ["note"] in column]
    note_width = max([NOTE_WIDTH] + [natural[k][0] for row in note_column for k in row if k != "note"])
    note_size = [note_width, _note_height(layout.note, note_width)]
    natural["note"] = (note_size[0], TITLE_HEIGHT + note_size[1])

    boxes: dict[str, Box] = {}
    # A row of groups above the columns from `above_start` on, starting at that column's left edge.
    above_height = max((natural[k][1] for k in above), default=0)
    x = 0.0
    for index, column in enumerate(layout.page):
        if index == above_start and above:
            rx = x
            for key in above:
                boxes[key] = Box(rx, 0.0, natural[key][0], above_height)
                rx += natural[key][0] + GROUP_GAP
        rows = [(row, sum(natural[k][0] for k in row) + GROUP_GAP * (len(row) - 1)) for row in column]
        column_width = max(width for _row, width in rows)
        y = above_height + GROUP_GAP if above and index >= above_start else 0.0
        for row, _width in rows:
            row_height = max(natural[k][1] for k in row)
            rx = x
            for key in row:
                w, h = natural[key]
                if key != "note":
                    # Groups fill their row's height; a group alone in its row, the column's width.
                    h = row_height
                    if len(row) == 1:
                        w = column_width
                boxes[key] = Box(rx, y, w, h)
                rx += w + GROUP_GAP
            y += row_height + GROUP_GAP
        x += column_width + GROUP_GAP

    positions: dict[int, list[float]] = {}
    for key, (offsets, _w, _h) in content.items():
        box = boxes[key]
        for node, (dx, dy) in offsets.items():
            positions[node] = [box.x + GROUP_PADDING + dx, box.y + GROUP_TITLE_HEIGHT + NODE_TOP_GAP + dy]
    note = boxes.pop("note")
    return positions, boxes, note, note_size


def _fits(boxes: list[Box], scale: float) -> bool:
    for box in boxes:
        x0, y0 = VIEW_LEFT + box.x * scale, VIEW_TOP + box.y * scale
        x1, y1 = x0 + box.w * scale, y0 + box.h * scale
        if x1 > WINDOW[0] - WINDOW_MARGIN or y1 > WINDOW[1] - WINDOW_MARGIN:
            return False
        for kx0, ky0, kx1, ky1 in KEEP_OUT:
            if x0 < kx1 and kx0 < x1 and y0 < ky1 and ky0 < y1:
                return False
    return True


def _saved_view(boxes: list[Box]) -> dict:
    """extra.ds: the page (its top left corner at canvas 0, 0) in the visible part of the editor."""
    steps = range(round(MAX_SCALE * 100), round(MIN_SCALE * 100) - 1, -1)
    scale = next((step / 100 for step in steps if _fits(boxes, step / 100)), MIN_SCALE)
    return {"scale": scale, "offset": [round(VIEW_LEFT / scale, 1), round(VIEW_TOP / scale, 1)]}


def _num(value: float):
    """Integral floats as ints, so the JSON reads like the frontend's."""
    return int(value) if float(value).is_integer() else value


class _Link(NamedTuple):
    id: int
    origin: int
    origin_slot: int
    target: int
    target_slot: int
    type: str
    target_input: str


def node_box(pos: Sequence[float], size: Sequence[float]) -> Box:
    """A node with its title bar (LiteGraph draws it above `pos`)."""
    return Box(pos[0], pos[1] - TITLE_HEIGHT, size[0], size[1] + TITLE_HEIGHT)


def group_title_box(bounding: Sequence[float]) -> Box:
    return Box(bounding[0], bounding[1], bounding[2], GROUP_TITLE_HEIGHT)


def _link_ends(link: _Link, positions, sizes, layouts, shown_outputs) -> tuple[tuple, tuple]:
    """Where the frontend puts a link's output and input slot."""
    target = layouts[link.target]
    start = (
        positions[link.origin][0] + sizes[link.origin][0] - OUTPUT_SLOT_INSET,
        positions[link.origin][1] + SLOT_Y + SLOT_HEIGHT * link.origin_slot,
    )
    y = target.input_y(link.target_input, shown_outputs[link.target])
    end = (positions[link.target][0] + INPUT_SLOT_X, positions[link.target][1] + y)
    return start, end


def route_links(
    links: list[_Link], positions, sizes, layouts, shown_outputs, obstacles: dict[str, Box], bounds: Box
) -> tuple[dict[int, list[tuple]], list[str]]:
    """Reroute corners per link id for links whose direct curve would cross a node or a group title, and what
    could not be routed."""
    router = Router(bounds, obstacles.values())
    corners: dict[int, list[tuple]] = {}
    problems = []
    for link in links:
        start, end = _link_ends(link, positions, sizes, layouts, shown_outputs)
        own = {f"node {link.origin}", f"node {link.target}"}
        others = {k: v for k, v in obstacles.items() if k not in own}
        if end[0] - start[0] > 2 * SOCKET_RUN and not crossings(link_points(start, end), others):
            continue
        found = router.route(start, end)
        hit = ["no path"] if found is None else crossings(link_points(start, end, found), others)
        if hit:
            problems.append(f"link {link.id} ({link.origin} -> {link.target}.{link.target_input}: {', '.join(hit)})")
            continue
        corners[link.id] = found
    return corners, problems


def _primitive_node(node_id: int, key: str, ui_node: UiNode, position, links_out: list[int]) -> dict:
    first_input = ui_node.targets[0][1]
    return {
        "id": node_id,
        "type": PRIMITIVE_TYPE,
        "title": ui_node.title,
        "pos": [_num(v) for v in position],
        "size": list(PRIMITIVE_SIZE),
        "flags": {},
        "order": 0,
        "mode": 0,
        "inputs": [],
        "outputs": [{"name": "INT", "type": "INT", "widget": {"name": first_input}, "links": links_out}],
        "properties": {"Run widget replace on values": False},
        "widgets_values": [ui_node.value, SEED_CONTROL_VALUE],
        "widgets_values_named": {"value": ui_node.value, SEED_CONTROL_WIDGET: SEED_CONTROL_VALUE},
    }


def _model_entry(file: ModelFile) -> dict:
    return {"name": file.name, "url": file.url, "directory": file.directory}


def api_to_ui(api: dict, object_info: dict, layout: UiLayout) -> dict:
    """Convert an API-format graph into the graph editor's UI workflow format, laid out as `layout` says."""
    ids = sorted(int(k) for k in api)
    # Graph-editor-only nodes after the API ones and the note, so the API twin's ids are the UI file's.
    note_id = max(ids, default=0) + 1
    ui_ids = {key: note_id + 1 + i for i, key in enumerate(layout.ui_nodes)}
    node_inputs: dict[int, dict] = {i: api[str(i)]["inputs"] for i in ids}
    class_types: dict[int, str] = {i: api[str(i)]["class_type"] for i in ids}
    for key, ui_node in layout.ui_nodes.items():
        if ui_node.class_type != PRIMITIVE_TYPE:
            node_inputs[ui_ids[key]] = dict(ui_node.inputs)
            class_types[ui_ids[key]] = ui_node.class_type
    layouts: dict[int, _NodeLayout] = {}
    for node_id, class_type in class_types.items():
        if class_type not in object_info:
            raise KeyError(f"node {node_id}: {class_type} is not in /object_info")
        layouts[node_id] = _NodeLayout(class_type, object_info[class_type], node_inputs[node_id])
        unknown = set(node_inputs[node_id]) - set(layouts[node_id].specs)
        if unknown:
            raise KeyError(f"node {node_id} ({class_type}): unknown inputs {sorted(unknown)}")

    # Links: the API graph's, numbered by target node then target slot, then the graph-editor-only nodes'.
    links: list[_Link] = []
    for target in ids:
        layout_of = layouts[target]
        for name in layout_of.slot_index:
            value = node_inputs[target].get(name)
            if not _is_link(value):
                continue
            origin, origin_slot = int(value[0]), value[1]
            if origin not in layouts:
                raise KeyError(f"node {target}.{name} links to missing node {origin}")
            origin_types = layouts[origin].output_types
            if origin_slot >= len(origin_types):
                raise IndexError(f"node {target}.{name} links to output {origin_slot} of node {origin}")
            links.append(
                _Link(
                    len(links) + 1,
                    origin,
                    origin_slot,
                    target,
                    layout_of.slot_index[name],
                    origin_types[origin_slot],
                    name,
                )
            )
    for key, ui_node in layout.ui_nodes.items():
        for target_id, name in ui_node.targets:
            target = int(target_id)
            if name not in layouts[target].slot_index:
                raise KeyError(f"{key} feeds {class_types[target]}.{name}, which has no such input")
            value_type = "INT" if ui_node.class_type == PRIMITIVE_TYPE else layouts[ui_ids[key]].output_types[0]
            links.append(
                _Link(len(links) + 1, ui_ids[key], 0, target, layouts[target].slot_index[name], value_type, name)
            )
    input_links = {(link.target, link.target_input): link.id for link in links}
    output_links: dict[tuple[int, int], list[int]] = {}
    for link in links:
        output_links.setdefault((link.origin, link.origin_slot), []).append(link.id)

    all_ids = [*ids, note_id, *ui_ids.values()]
    order = _execution_order(
        all_ids, [[lk.id, lk.origin, lk.origin_slot, lk.target, lk.target_slot, lk.type] for lk in links]
    )
    # Outputs up to the last linked one (see _NodeLayout).
    shown_outputs = {i: 1 + max((slot for (node, slot) in output_links if node == i), default=-1) for i in layouts}
    sizes = {i: layouts[i].size(shown_outputs[i]) for i in layouts}
    for key, ui_node in layout.ui_nodes.items():
        if ui_node.class_type == PRIMITIVE_TYPE:
            sizes[ui_ids[key]] = list(PRIMITIVE_SIZE)
    # Room below the nodes that grow in a run: the sampler's live preview, the saved video's player.
    room = {i: RUN_PREVIEW_HEIGHT[c] for i, c in class_types.items() if c in RUN_PREVIEW_HEIGHT}
    placement: dict[int, tuple[str, int]] = {}
    for key, at in layout.placement.items():
        placement[ui_ids[key] if key in ui_ids else int(key)] = at
    positions, boxes, note_box, note_size = _page_layout(layout, placement, sizes, room)

    # Links around nodes and group titles, through reroutes where a direct curve would cross one.
    obstacles = {f"node {i}": node_box(positions[i], sizes[i]) for i in positions}
    obstacles |= {
        f"room {i}": Box(positions[i][0], positions[i][1] + sizes[i][1], sizes[i][0], extra)
        for i, extra in room.items()
    }
    obstacles["note"] = note_box
    obstacles |= {f"title {key}": group_title_box(box) for key, box in boxes.items()}
    page = [*boxes.values(), note_box]
    bounds = Box(
        min(b.x for b in page) - ROUTE_MARGIN,
        min(b.y for b in page) - ROUTE_MARGIN,
        max(b.x + b.w for b in page) - min(b.x for b in page) + 2 * ROUTE_MARGIN,
        max(b.y + b.h for b in page) - min(b.y for b in page) + 2 * ROUTE_MARGIN,
    )
    corners, unrouted = route_links(links, positions, sizes, layouts, shown_outputs, obstacles, bounds)
    if unrouted:
        raise ValueError(f"no clean path for {', '.join(unrouted)}")

    nodes = []
    for node_id in ids + [ui_ids[k] for k in layout.ui_nodes]:
        key = next((k for k, v in ui_ids.items() if v == node_id), None)
        ui_node = layout.ui_nodes.get(key) if key else None
        if ui_node is not None and ui_node.class_type == PRIMITIVE_TYPE:
            primitive = _primitive_node(node_id, key, ui_node, positions[node_id], output_links.get((node_id, 0), []))
            primitive["order"] = order.index(node_id)
            nodes.append(primitive)
            continue
        layout_of = layouts[node_id]
        inputs_of = node_inputs[node_id]
        node: dict = {"id": node_id, "type": layout_of.class_type}
        title = ui_node.title if ui_node else api[str(node_id)].get("_meta", {}).get("title")
        if title:
            node["title"] = title
        inputs = []
        for slot in layout_of.slots:
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
            for slot, (name, out_type) in enumerate(zip(layout_of.output_names, layout_of.output_types, strict=True))
            if slot < shown_outputs[node_id]
        ]
        properties: dict = {"Node name for S&R": layout_of.class_type}
        models = layout.models.get(str(node_id))
        if models:
            properties["models"] = [_model_entry(file) for file in models]
        node.update(
            pos=[_num(v) for v in positions[node_id]],
            size=[_num(v) for v in sizes[node_id]],
            flags={},
            order=order.index(node_id),
            mode=MUTED_MODE if ui_node is not None and ui_node.muted else 0,
            inputs=inputs,
            outputs=outputs,
            properties=properties,
            widgets_values=layout_of.widgets_values(inputs_of),
        )
        if layout_of.widget_inputs or layout_of.upload:
            # What 1.49 saves and restores by name; 1.32 reads only widgets_values.
            node["widgets_values_named"] = layout_of.widgets_values_named(inputs_of)
        nodes.append(node)
    nodes.append(
        {
            "id": note_id,
            "type": NOTE_TYPE,
            "title": NOTE_TITLE,
            "pos": [_num(note_box.x), _num(note_box.y + TITLE_HEIGHT)],
            "size": note_size,
            "flags": {},
            "order": order.index(note_id),
            "mode": 0,
            "inputs": [],
            "outputs": [],
            "properties": {},
            "widgets_values": [layout.note],
            "widgets_values_named": {"text": layout.note},
            "color": NOTE_COLOR,
            "bgcolor": NOTE_BGCOLOR,
        }
    )
    nodes.sort(key=lambda n: n["id"])
    groups = [
        {
            "id": index,
            "title": layout.groups[key],
            "bounding": [_num(v) for v in boxes[key]],
            "color": GROUP_COLORS[key],
            "font_size": GROUP_FONT_SIZE,
            "flags": {},
        }
        for index, key in enumerate(layout.groups, start=1)
    ]
    reroutes, extensions = [], []
    for link_id in sorted(corners):
        parent = None
        for point in corners[link_id]:
            reroute = {"id": len(reroutes) + 1}
            if parent is not None:
                reroute["parentId"] = parent
            reroute |= {"pos": [_num(round(v, 1)) for v in point], "linkIds": [link_id]}
            reroutes.append(reroute)
            parent = reroute["id"]
        extensions.append({"id": link_id, "parentId": parent})
    # The saved view keeps the nodes, the note and the group titles out of the editors' panels; a group's empty
    # bottom (the room for previews) may go under the minimap.
    seen = [node_box(positions[i], sizes[i]) for i in positions] + [note_box]
    seen += [group_title_box(box) for box in boxes.values()]
    extra: dict = {"ds": _saved_view(seen)}
    if reroutes:
        extra |= {"reroutes": reroutes, "linkExtensions": extensions}
    workflow = {
        "last_node_id": max(all_ids),
        "last_link_id": len(links),
        "nodes": nodes,
        "links": [[lk.id, lk.origin, lk.origin_slot, lk.target, lk.target_slot, lk.type] for lk in links],
        "groups": groups,
        "config": {},
        "extra": extra,
        "version": 0.4,
    }
    files = {file.name: file for models in layout.models.values() for file in models}
    if files:
        # What the frontends' missing-models dialog offers to download (1.32 reads this list; both read the
        # per-node lists above, for the files the node's widgets pick).
        workflow["models"] = [_model_entry(files[name]) for name in sorted(files)]
    return workflow


def build_ui_workflow(task: str, object_info: dict) -> dict:
    return api_to_ui(build_api_workflow(task), object_info, build_ui_layout(task))


def _start_server(base: Path):
    from scripts.comfy_server import ComfyServer

    server = ComfyServer(base)
    server.prepare()
    server.start()
    return server


def fetch_object_info() -> dict:
    """/object_info of a fresh ComfyUI with this package, in a throwaway base directory."""
    with tempfile.TemporaryDirectory(prefix="wanvace-make-workflows-") as tmp:
        server = _start_server(Path(tmp))
        try:
            return server.object_info()
        finally:
            server.stop()


def expected_files(object_info: dict | None) -> dict[Path, str]:
    """path -> text of every generated file; without object_info only the API twins."""
    files: dict[Path, str] = {}
    for task in WORKFLOWS:
        files[api_path(task)] = dumps(build_api_workflow(task))
        if object_info is not None:
            files[ui_path(task)] = dumps(build_ui_workflow(task, object_info))
    return files


def unexpected_files() -> list[Path]:
    """Files in example_workflows/ and example_workflows/api/ that no workflow writes (renamed or removed ones)."""
    wanted = {api_path(t) for t in WORKFLOWS} | {ui_path(t) for t in WORKFLOWS} | {thumbnail_path(t) for t in WORKFLOWS}
    found = [p for d in (API_DIR, UI_DIR) if d.is_dir() for p in d.iterdir() if p.is_file()]
    return sorted(p for p in found if p not in wanted)


def thumbnail_problems() -> list[str]:
    problems = []
    for task in WORKFLOWS:
        path = thumbnail_path(task)
        if not path.is_file():
            problems.append(f"missing: {path.relative_to(REPO_ROOT)} (run with --thumbnails)")
        elif path.read_bytes()[:3] != b"\xff\xd8\xff":
            problems.append(f"not a JPEG: {path.relative_to(REPO_ROOT)}")
        elif path.stat().st_size > THUMBNAIL_MAX_BYTES:
            problems.append(f"over {THUMBNAIL_MAX_BYTES} bytes: {path.relative_to(REPO_ROOT)}")
    return problems


def to_thumbnail(png: bytes) -> bytes:
    """A screenshot as a THUMBNAIL_WIDTH-wide JPEG under THUMBNAIL_MAX_BYTES."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    height = round(image.height * THUMBNAIL_WIDTH / image.width)
    image = image.resize((THUMBNAIL_WIDTH, height), Image.LANCZOS)
    for quality in (88, 80, 70, 60, 50):
        out = io.BytesIO()
        image.save(out, "JPEG", quality=quality, optimize=True, progressive=True)
        if out.tell() <= THUMBNAIL_MAX_BYTES:
            return out.getvalue()
    raise ValueError("thumbnail stays over the size limit")


def write_thumbnails() -> list[Path]:
    """Screenshot every UI workflow in the real graph editor and write example_workflows/<title>.jpg."""
    import os

    from scripts.comfy_server import check_workflows_in_browser

    written = []
    with tempfile.TemporaryDirectory(prefix="wanvace-thumbnails-") as tmp:
        tmp = Path(tmp)
        # Stand-ins under the names the workflows pick (every model file, the LoRAs, the diffusers folder), so the
        # graph editor shows the workflows as a user with the files sees them: frontend 1.49 outlines a node whose
        # file is missing in red, 1.32 opens its missing-models dialog.
        for file in MODEL_FILES.values():
            stand_in = tmp / "base" / "models" / file.directory / file.name
            stand_in.parent.mkdir(parents=True, exist_ok=True)
            stand_in.touch()
        folder = tmp / "base" / "models" / "diffusers" / REAL_MODEL
        folder.mkdir(parents=True)
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanVACEPipeline"}))
        server = _start_server(tmp / "base")
        previous = os.environ.get("CHECK_WORKFLOWS_THUMBNAILS")
        os.environ["CHECK_WORKFLOWS_THUMBNAILS"] = str(tmp / "png")
        try:
            results = check_workflows_in_browser(server.url, [ui_path(t) for t in WORKFLOWS], tmp / "report.json")
        finally:
            if previous is None:
                os.environ.pop("CHECK_WORKFLOWS_THUMBNAILS", None)
            else:
                os.environ["CHECK_WORKFLOWS_THUMBNAILS"] = previous
            server.stop()
        for task, result in zip(WORKFLOWS, results, strict=True):
            if result["load_error"] or result["missing_types"]:
                raise RuntimeError(
                    f"{ui_path(task).name} did not load: {result['load_error'] or result['missing_types']}"
                )
            path = thumbnail_path(task)
            path.write_bytes(to_thumbnail(Path(result["thumbnail"]).read_bytes()))
            written.append(path)
    return written


def main(argv: list[str] | None = None, get_object_info: Callable[[], dict] = fetch_object_info) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    parser.add_argument(
        "--object-info", type=Path, help="read /object_info from this JSON file instead of starting ComfyUI"
    )
    parser.add_argument(
        "--thumbnails", action="store_true", help="also screenshot each workflow in the graph editor (needs Chromium)"
    )
    args = parser.parse_args(argv)
    object_info = json.loads(args.object_info.read_text()) if args.object_info else get_object_info()
    files = expected_files(object_info)
    stale = [p for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    extra = unexpected_files()
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(REPO_ROOT)}")
        for p in extra:
            print(f"not generated (remove it): {p.relative_to(REPO_ROOT)}")
        thumbnails = thumbnail_problems()
        for line in thumbnails:
            print(f"thumbnail {line}")
        return 1 if stale or extra or thumbnails else 0
    for p in extra:
        p.unlink()
    for p, text in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} files ({len(stale)} changed, {len(extra)} removed)")
    if args.thumbnails:
        for p in write_thumbnails():
            print(f"{p.relative_to(REPO_ROOT)}: {p.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
