"""The shipped workflows as graphs: each one's API-format nodes, built from this package's nodes and ComfyUI's core
nodes in the order the steps below add them (the order gives the node ids), and how the graph editor shows it
(`UiLayout`: groups, placement, the note, the editor-only nodes), which scripts/make_workflows.py turns into the
UI-format file."""

from __future__ import annotations

from dataclasses import dataclass, field

from .catalog import (
    CACHE_VARIANT,
    COMFY_SAMPLER,
    COMFY_SAMPLER_VARIANT,
    COMFY_SCHEDULE,
    CONTEXT_WINDOWS,
    EXAMPLE_INPUTS,
    EXTENSION_GIVEN_FRAMES,
    GGUF_VARIANT,
    HEIGHT,
    LIGHTNING_NAG,
    LIGHTNING_SAMPLING,
    LIGHTNING_VARIANT,
    LONG_VARIANT,
    LORA_FILES,
    MODEL_FILES,
    NEGATIVE,
    OUTPAINT_PAD,
    REAL_MODEL,
    SINGLE_FILES,
    STEPS,
    TASK_PROMPTS,
    VAE_TILING,
    WIDTH,
    WORKFLOWS,
    ModelFile,
    length_of,
    task_of,
    variant_of,
)
from .notes import note

# Group colors of LiteGraph's palette (LGraphCanvas.node_colors[...].groupcolor).
GROUP_COLORS = {
    "size": "#b06634",
    "offload": "#444",
    "model": "#3f789e",
    "inputs": "#8A8",
    "options": "#3f789e",
    "lora": "#3f789e",
    "prompt": "#b58b2a",
    "sampling": "#88A",
    "output": "#a1309b",
}


@dataclass(frozen=True)
class UiNode:
    """A node that exists only in the graph editor's file, not in the API twin.

    `PrimitiveNode` (the frontend's primitive, `value` set into every input it feeds when the prompt is queued), or
    a node of this package kept muted (mode 2, "never": the frontend leaves it and its links out of the prompt) for
    the user to switch on.
    """

    class_type: str
    title: str
    # (API node id, input name) of every input it feeds.
    targets: tuple[tuple[str, str], ...]
    value: int | None = None
    inputs: dict = field(default_factory=dict)
    muted: bool = False


@dataclass
class UiLayout:
    """How the graph editor shows a workflow; used by scripts/make_workflows.py only."""

    # group key -> title, in drawing order.
    groups: dict[str, str] = field(default_factory=dict)
    # node id (API id, or a key of ui_nodes) -> (group key, column inside the group); a column's nodes stack in
    # the order they were added.
    placement: dict[str, tuple[str, int]] = field(default_factory=dict)
    # Page columns, left to right; each a list of rows, top to bottom; each row a list of group keys side by
    # side. "note" is the Markdown note.
    page: list[list[list[str]]] = field(default_factory=list)
    # Groups side by side in a row above the page columns from the given one on, starting at its left edge.
    above: tuple[int, list[str]] = (0, [])
    note: str = ""
    ui_nodes: dict[str, UiNode] = field(default_factory=dict)
    # API node id -> the model files its widgets pick (ComfyUI's `properties.models`).
    models: dict[str, tuple[ModelFile, ...]] = field(default_factory=dict)


class _Graph:
    def __init__(self) -> None:
        self.nodes: dict[str, dict] = {}
        self.layout = UiLayout()
        self.sized: dict[str, list[tuple[str, str]]] = {"width": [], "height": [], "length": []}

    def add(self, class_type: str, title: str | None = None, *, at: tuple[str, int], **inputs) -> str:
        node_id = str(len(self.nodes) + 1)
        node = {"class_type": class_type, "inputs": inputs}
        if title:
            node["_meta"] = {"title": title}
        self.nodes[node_id] = node
        self.layout.placement[node_id] = at
        return node_id

    def size_inputs(self, node_id: str, *names: str) -> None:
        """Feed these inputs of node_id from the workflow's one width / height / length."""
        for name in names:
            self.sized[name].append((node_id, name))


def _out(node_id: str, slot: int = 0) -> list:
    return [node_id, slot]


def _control_video(graph: _Graph, source: dict, column: int, length: int, use: str = "control", **masks) -> str:
    """WanVACE Control Video: the frames of `source` (video= or images=) fitted to the video size, cut to its length."""
    node = graph.add(
        "WanVACEControlVideo",
        **source,
        width=WIDTH,
        height=HEIGHT,
        length=length,
        use=use,
        **masks,
        at=("inputs", column),
    )
    graph.size_inputs(node, "width", "height", "length")
    return node


_INPUT_GROUP_TITLES = {
    "i2v": "Input: first frame",
    "flf2v": "Inputs: first and last frame",
    "r2v": "Inputs: reference images",
    "v2v": "Input: control video",
    "inpaint": "Inputs: source video and mask",
    "outpaint": "Input: source video",
    "extension": "Input: clip to extend",
}
_OPTIONS_GROUP_TITLES = {
    CACHE_VARIANT: "Step cache (Cache-DiT)",
    LONG_VARIANT: "Context windows",
    LIGHTNING_VARIANT: "Guidance",
    COMFY_SAMPLER_VARIANT: "ComfyUI sampler and schedule",
}


def _build(name: str) -> _Graph:
    """One shipped workflow, step by step: the loader, the task's inputs, the conditioning, the sampler's options,
    the LoRAs, the sampler, decoding and saving; then what only the graph editor shows."""
    if name not in WORKFLOWS:
        raise KeyError(f"unknown workflow {name!r}; one of {', '.join(WORKFLOWS)}")
    task, variant, length = task_of(name), variant_of(name), length_of(name)
    graph = _Graph()
    loader, offload_target = _add_loader(graph, variant)
    inputs = _TASK_INPUTS[task](graph, length) if task in _TASK_INPUTS else {}
    conditioning = _add_conditioning(graph, loader, task, length, inputs)
    options = _add_sampler_options(graph, name, variant, loader)
    sampling_model = _add_loras(graph, variant, loader)
    sampler = _add_sampler(graph, variant, sampling_model, conditioning, options)
    _add_output(graph, name, loader, sampler)
    _add_editor_only_nodes(graph, length, offload_target)
    _name_groups(graph.layout, task, variant, has_options=bool(options))
    _page(graph.layout)
    return graph


def _add_loader(graph: _Graph, variant: str) -> tuple[str, str]:
    """The model loader, and the node the muted offload options feed ("" where the workflow has them already): the
    diffusers folder's WanVACE Model Loader, or the single-file variants' WanVACE Experts Loader."""
    files = SINGLE_FILES.get(variant)
    if files is None:
        loader = graph.add("WanVACEModelLoader", model_name=REAL_MODEL, dtype="bf16", at=("model", 0))
        return loader, loader
    offload = {}
    if variant == GGUF_VARIANT:
        options = graph.add(
            "WanVACEOffloadOptions", mode="layerwise", prefetch_blocks=1, max_pinned_mb=0, at=("offload", 0)
        )
        offload["offload"] = _out(options)
    loader = graph.add(
        "WanVACEExpertsLoader",
        **files,
        dtype="bf16",
        weight_dtype="auto",
        boundary_ratio=0.875,
        **offload,
        at=("model", 0),
    )
    # Frontend 1.32 neither downloads .gguf files nor sees them in the folder lists it checks (ComfyUI lists no
    # .gguf), so it would call them missing even when they are there: the GGUF experts carry no download entry,
    # the note gives their address.
    graph.layout.models[loader] = tuple(MODEL_FILES[file] for file in files.values() if not file.endswith(".gguf"))
    return loader, "" if offload else loader


# --- each task's inputs: the nodes that load and arrange them, and the conditioning inputs they feed ---------------


def _first_frame_inputs(graph: _Graph, length: int) -> dict:
    image = graph.add("LoadImage", "first frame", image=EXAMPLE_INPUTS["first"], at=("inputs", 0))
    control = _control_video(graph, {"images": _out(image)}, 1, length, use="keep")
    return {"control_video": _out(control, 0), "control_masks": _out(control, 1)}


def _first_and_last_frame_inputs(graph: _Graph, length: int) -> dict:
    first = graph.add("LoadImage", "first frame", image=EXAMPLE_INPUTS["first"], at=("inputs", 0))
    last = graph.add("LoadImage", "last frame", image=EXAMPLE_INPUTS["last"], at=("inputs", 0))
    frames = graph.add(
        "WanVACEFirstLastFrame",
        first_frame=_out(first),
        last_frame=_out(last),
        width=WIDTH,
        height=HEIGHT,
        length=length,
        at=("inputs", 1),
    )
    graph.size_inputs(frames, "width", "height", "length")
    return {"control_video": _out(frames, 0), "control_masks": _out(frames, 1)}


def _reference_inputs(graph: _Graph, length: int) -> dict:
    first = graph.add("LoadImage", "reference 1", image=EXAMPLE_INPUTS["ref1"], at=("inputs", 0))
    second = graph.add("LoadImage", "reference 2", image=EXAMPLE_INPUTS["ref2"], at=("inputs", 0))
    both = graph.add("ImageBatch", "both references", image1=_out(first), image2=_out(second), at=("inputs", 1))
    return {"reference_images": _out(both)}


def _control_video_inputs(graph: _Graph, length: int) -> dict:
    video = graph.add("LoadVideo", "control video", file=EXAMPLE_INPUTS["control"], at=("inputs", 0))
    control = _control_video(graph, {"video": _out(video)}, 1, length)
    return {"control_video": _out(control, 0)}


def _inpaint_inputs(graph: _Graph, length: int) -> dict:
    video = graph.add("LoadVideo", "source video", file=EXAMPLE_INPUTS["source"], at=("inputs", 0))
    mask = graph.add(
        "LoadImageMask",
        "inpaint mask (white = repaint)",
        image=EXAMPLE_INPUTS["mask"],
        channel="red",
        at=("inputs", 0),
    )
    control = _control_video(graph, {"video": _out(video)}, 1, length, masks=_out(mask))
    return {"control_video": _out(control, 0), "control_masks": _out(control, 1)}


def _outpaint_inputs(graph: _Graph, length: int) -> dict:
    video = graph.add("LoadVideo", "source video", file=EXAMPLE_INPUTS["source"], at=("inputs", 0))
    canvas = graph.add(
        "WanVACEOutpaintCanvas",
        video=_out(video),
        width=WIDTH,
        height=HEIGHT,
        length=length,
        left=OUTPAINT_PAD,
        top=0,
        right=OUTPAINT_PAD,
        bottom=0,
        at=("inputs", 1),
    )
    graph.size_inputs(canvas, "width", "height", "length")
    return {"control_video": _out(canvas, 0), "control_masks": _out(canvas, 1)}


def _extension_inputs(graph: _Graph, length: int) -> dict:
    # Control Video's length here is how many of the clip's frames are kept (not the video's length, so not
    # linked to it): the conditioning generates the frames after them.
    video = graph.add("LoadVideo", "clip to extend", file=EXAMPLE_INPUTS["source"], at=("inputs", 0))
    control = graph.add(
        "WanVACEControlVideo",
        "given frames",
        video=_out(video),
        width=WIDTH,
        height=HEIGHT,
        length=EXTENSION_GIVEN_FRAMES,
        use="keep",
        at=("inputs", 1),
    )
    graph.size_inputs(control, "width", "height")
    return {"control_video": _out(control, 0), "control_masks": _out(control, 1)}


# Text to video has no inputs besides the prompt.
_TASK_INPUTS = {
    "i2v": _first_frame_inputs,
    "flf2v": _first_and_last_frame_inputs,
    "r2v": _reference_inputs,
    "v2v": _control_video_inputs,
    "inpaint": _inpaint_inputs,
    "outpaint": _outpaint_inputs,
    "extension": _extension_inputs,
}


def _add_conditioning(graph: _Graph, loader: str, task: str, length: int, inputs: dict) -> str:
    conditioning = graph.add(
        "WanVACEConditioning",
        model=_out(loader),
        positive=TASK_PROMPTS[task],
        negative=NEGATIVE,
        width=WIDTH,
        height=HEIGHT,
        length=length,
        strength=1.0,
        vace_start_percent=0.0,
        vace_end_percent=1.0,
        **VAE_TILING,
        **inputs,
        at=("prompt", 0),
    )
    graph.size_inputs(conditioning, "width", "height", "length")
    return conditioning


def _add_sampler_options(graph: _Graph, name: str, variant: str, loader: str) -> dict:
    """The option nodes of the variants (step cache, context windows, NAG, ComfyUI's sampler and schedule), as the
    sampler inputs they feed."""
    options = {}
    if name.endswith(CACHE_VARIANT):
        cache_options = graph.add(
            "WanVACECacheOptions",
            mode="DBCache+TaylorSeer",
            Fn_compute_blocks=1,
            Bn_compute_blocks=0,
            residual_diff_threshold=0.08,
            max_warmup_steps=2,
            max_cached_steps=-1,
            low_noise_max_warmup_steps=2,
            low_noise_max_cached_steps=-1,
            taylorseer_order=1,
            at=("options", 0),
        )
        options["cache"] = _out(cache_options)
    if name.endswith(LONG_VARIANT):
        windows = graph.add("WanVACEContextWindows", **CONTEXT_WINDOWS, at=("options", 0))
        options["context_windows"] = _out(windows)
    if variant == LIGHTNING_VARIANT:
        guidance = graph.add(
            "WanVACEGuidanceOptions", "NAG: the negative prompt at cfg 1", **LIGHTNING_NAG, at=("options", 0)
        )
        options["guidance"] = _out(guidance)
    if variant == COMFY_SAMPLER_VARIANT:
        sampler_select = graph.add("KSamplerSelect", **COMFY_SAMPLER, at=("options", 0))
        schedule = graph.add("WanVACEScheduler", model=_out(loader), **COMFY_SCHEDULE, at=("options", 0))
        options |= {"sampler": _out(sampler_select), "sigmas": _out(schedule)}
    return options


def _add_loras(graph: _Graph, variant: str, loader: str) -> str:
    """The LoRA variants' chain of WanVACE LoRA Loaders; the model the sampler takes. The LoRAs change only the
    sampling: conditioning and decoding use the loader's model directly."""
    sampling_model = loader
    for column, lora in enumerate(LORA_FILES.get(variant, ())):
        sampling_model = graph.add(
            "WanVACELoraLoader",
            lora.title,
            model=_out(sampling_model),
            lora_name=lora.lora_name,
            strength_high_noise=lora.strength_high_noise,
            strength_low_noise=lora.strength_low_noise,
            merge=False,
            at=("lora", column),
        )
        graph.layout.models[sampling_model] = (MODEL_FILES[lora.lora_name],)
    return sampling_model


def _add_sampler(graph: _Graph, variant: str, model: str, conditioning: str, options: dict) -> str:
    sampling = {"steps": STEPS, "cfg": 5.0, "cfg_low_noise": 5.0, "shift": 0.0, "scheduler": "unipc"}
    if variant == LIGHTNING_VARIANT:
        sampling = LIGHTNING_SAMPLING
    return graph.add(
        "WanVACESampler",
        model=_out(model),
        conditioning=_out(conditioning),
        seed=42,
        steps=sampling["steps"],
        cfg=sampling["cfg"],
        cfg_low_noise=sampling["cfg_low_noise"],
        boundary_ratio=-1.0,
        shift=sampling["shift"],
        scheduler=sampling["scheduler"],
        **options,
        at=("sampling", 0),
    )


def _add_output(graph: _Graph, name: str, loader: str, sampler: str) -> None:
    frames = graph.add("WanVACEDecode", model=_out(loader), samples=_out(sampler), **VAE_TILING, at=("output", 0))
    video = graph.add("CreateVideo", images=_out(frames), fps=16.0, at=("output", 1))
    graph.add(
        "SaveVideo",
        video=_out(video),
        filename_prefix=f"WanVACE/{name}",
        format="auto",
        codec="auto",
        at=("output", 2),
    )


def _add_editor_only_nodes(graph: _Graph, length: int, offload_target: str) -> None:
    """The three primitives that hold the video's width, height and length, and the offload options a user
    switches on (muted), beside the loader they feed."""
    layout = graph.layout
    values = {"width": WIDTH, "height": HEIGHT, "length": length}
    for key, targets in graph.sized.items():
        layout.ui_nodes[key] = UiNode("PrimitiveNode", key, tuple(targets), value=values[key])
        # width and height side by side, length below width.
        layout.placement[key] = ("size", 1 if key == "height" else 0)
    if offload_target:
        layout.ui_nodes["offload"] = UiNode(
            "WanVACEOffloadOptions",
            "WanVACE Offload Options",
            ((offload_target, "offload"),),
            inputs={"mode": "layerwise", "prefetch_blocks": 1, "max_pinned_mb": 0},
            muted=True,
        )
        layout.placement["offload"] = ("offload", 0)


def _name_groups(layout: UiLayout, task: str, variant: str, has_options: bool) -> None:
    """The groups' titles, in drawing order."""
    groups = layout.groups
    groups["size"] = "Video size"
    groups["offload"] = "Offload" if variant == GGUF_VARIANT else "Offload (off: Ctrl+M)"
    groups["model"] = "Model"
    if variant in LORA_FILES:
        groups["lora"] = "LoRAs (sampling only)"
    if task in _INPUT_GROUP_TITLES:
        groups["inputs"] = _INPUT_GROUP_TITLES[task]
    groups["prompt"] = "Prompt and VACE conditioning"
    if has_options:
        groups["options"] = _OPTIONS_GROUP_TITLES[variant]
    groups["sampling"] = "Sampling"
    groups["output"] = "Decode and save"


def _page(layout: UiLayout) -> None:
    """Where the groups go: the note, video size and offload options on the left; the model (and LoRAs), the
    inputs and the sampler's options; the prompt; the sampler; decoding and saving in a row above the last two (the
    bottom right corner stays free for the editors' minimap). The router in scripts/make_workflows.py draws the
    links around the groups."""
    groups = layout.groups
    layout.page = [
        [["note"], ["size"], ["offload"]],
        [[key] for key in ("model", "lora", "inputs", "options") if key in groups],
        [["prompt"]],
        [["sampling"]],
    ]
    layout.above = (2, ["output"])


def build_api_workflow(name: str) -> dict:
    """The API-format graph of one shipped workflow (a task, or a task with one of the variants)."""
    return _build(name).nodes


def build_ui_layout(name: str) -> UiLayout:
    """Groups, placement, note and graph-editor-only nodes of one shipped workflow in the graph editor."""
    layout = _build(name).layout
    layout.note = note(name)
    return layout
