"""The shipped workflows, one per VACE task, as API-format graphs built from this package's nodes and core nodes.

`scripts/make_workflows.py` writes these to `tests/api_workflows/*.json` (API format) and
`workflows/*.json` (the graph editor's UI format). `for_tiny_model` shrinks a workflow to the
tiny test model so it runs in seconds on a CPU.
"""

from __future__ import annotations

import copy

REAL_MODEL = "Wan2.2-VACE-Fun-A14B-Diffusers"
TINY_MODEL = "wanvace-tiny"
WIDTH, HEIGHT, LENGTH, STEPS = 832, 480, 81, 20
OUTPAINT_INNER_WIDTH, OUTPAINT_PAD = 576, 128
EXTENSION_GIVEN_FRAMES = 17
GREY, WHITE = 0x808080, 0xFFFFFF
NEGATIVE = "blurry, low quality, static, overexposed, jpeg artifacts, deformed, extra fingers, watermark, subtitles"

TASK_PROMPTS = {
    "t2v": "a small blue bird takes off from a branch, flapping its wings, blue sky with white clouds",
    "i2v": "the scene comes alive: leaves sway in the wind and the camera slowly pushes in",
    "flf2v": "a smooth camera move that turns the first frame into the last frame",
    "r2v": "the two subjects from the reference images walk together along a beach at sunset",
    "v2v": "a dancer in a red dress on a stage, following the motion of the control video",
    "inpaint": "a bright red balloon floats in the masked area",
    "outpaint": "a wide landscape that continues the scene to the left and right",
    "extension": "the video continues naturally from its first frames",
}
TASKS = tuple(TASK_PROMPTS)
CACHE_VARIANT = "_cache"
# Every shipped workflow: one per task, plus variants with the Cache-DiT node.
WORKFLOWS = (*TASKS, "v2v" + CACHE_VARIANT)

# Widget values that scale with the video size, and what they become for the tiny model.
_TINY_VALUES = {
    "model_name": {REAL_MODEL: TINY_MODEL},
    "width": {WIDTH: 64, OUTPAINT_INNER_WIDTH: 32},
    "height": {HEIGHT: 48},
    "length": {LENGTH: 9, EXTENSION_GIVEN_FRAMES: 5},
    "batch_size": {LENGTH - 2: 7},
    "steps": {STEPS: 4},
    "left": {OUTPAINT_PAD: 16},
    "right": {OUTPAINT_PAD: 16},
}


class _Graph:
    def __init__(self) -> None:
        self.nodes: dict[str, dict] = {}

    def add(self, class_type: str, title: str | None = None, **inputs) -> str:
        node_id = str(len(self.nodes) + 1)
        node = {"class_type": class_type, "inputs": inputs}
        if title:
            node["_meta"] = {"title": title}
        self.nodes[node_id] = node
        return node_id


def _out(node_id: str, slot: int = 0) -> list:
    return [node_id, slot]


def _scaled_image(graph: _Graph, file: str, title: str) -> str:
    loaded = graph.add("LoadImage", title, image=file)
    return graph.add(
        "ImageScale", image=_out(loaded), upscale_method="lanczos", width=WIDTH, height=HEIGHT, crop="center"
    )


def _video_frames(graph: _Graph, file: str, title: str, frames: int = LENGTH, width: int = WIDTH) -> str:
    video = graph.add("LoadVideo", title, file=file)
    components = graph.add("GetVideoComponents", video=_out(video))
    trimmed = graph.add("ImageFromBatch", image=_out(components), batch_index=0, length=frames)
    return graph.add(
        "ImageScale", image=_out(trimmed), upscale_method="lanczos", width=width, height=HEIGHT, crop="center"
    )


def _keep_mask(graph: _Graph) -> str:
    """A single all-zero mask: keep every given pixel."""
    return graph.add("SolidMask", "keep given frames", value=0.0, width=WIDTH, height=HEIGHT)


def build_api_workflow(name: str) -> dict:
    """The API-format graph of one shipped workflow (a task, optionally with the `_cache` variant)."""
    if name not in WORKFLOWS:
        raise KeyError(f"unknown workflow {name!r}; one of {', '.join(WORKFLOWS)}")
    task = name.removesuffix(CACHE_VARIANT)
    graph = _Graph()
    loader = graph.add("WanVACEModelLoader", model_name=REAL_MODEL, dtype="bf16")
    optional: dict = {}
    if task == "i2v":
        optional["control_video"] = _out(_scaled_image(graph, "wanvace_example_first.png", "first frame"))
        optional["control_masks"] = _out(_keep_mask(graph))
    elif task == "flf2v":
        first = _scaled_image(graph, "wanvace_example_first.png", "first frame")
        last = _scaled_image(graph, "wanvace_example_last.png", "last frame")
        grey = graph.add(
            "EmptyImage", "frames to generate", width=WIDTH, height=HEIGHT, batch_size=LENGTH - 2, color=GREY
        )
        head = graph.add("ImageBatch", image1=_out(first), image2=_out(grey))
        video = graph.add("ImageBatch", image1=_out(head), image2=_out(last))
        black = graph.add("MaskToImage", mask=_out(_keep_mask(graph)))
        white = graph.add("EmptyImage", "generate mask", width=WIDTH, height=HEIGHT, batch_size=LENGTH - 2, color=WHITE)
        mask_head = graph.add("ImageBatch", image1=_out(black), image2=_out(white))
        mask_video = graph.add("ImageBatch", image1=_out(mask_head), image2=_out(black))
        masks = graph.add("ImageToMask", image=_out(mask_video), channel="red")
        optional["control_video"] = _out(video)
        optional["control_masks"] = _out(masks)
    elif task == "r2v":
        first = graph.add("LoadImage", "reference 1", image="wanvace_example_ref1.png")
        second = graph.add("LoadImage", "reference 2", image="wanvace_example_ref2.png")
        optional["reference_images"] = _out(graph.add("ImageBatch", image1=_out(first), image2=_out(second)))
    elif task == "v2v":
        optional["control_video"] = _out(_video_frames(graph, "wanvace_example_control.mp4", "control video"))
    elif task == "inpaint":
        optional["control_video"] = _out(_video_frames(graph, "wanvace_example_source.mp4", "source video"))
        mask = graph.add(
            "LoadImageMask", "inpaint mask (white = repaint)", image="wanvace_example_mask.png", channel="red"
        )
        mask_image = graph.add("MaskToImage", mask=_out(mask))
        scaled = graph.add(
            "ImageScale",
            image=_out(mask_image),
            upscale_method="nearest-exact",
            width=WIDTH,
            height=HEIGHT,
            crop="center",
        )
        optional["control_masks"] = _out(graph.add("ImageToMask", image=_out(scaled), channel="red"))
    elif task == "outpaint":
        inner = _video_frames(graph, "wanvace_example_source.mp4", "source video", width=OUTPAINT_INNER_WIDTH)
        padded = graph.add(
            "ImagePadForOutpaint",
            image=_out(inner),
            left=OUTPAINT_PAD,
            top=0,
            right=OUTPAINT_PAD,
            bottom=0,
            feathering=0,
        )
        optional["control_video"] = _out(padded, 0)
        optional["control_masks"] = _out(padded, 1)
    elif task == "extension":
        optional["control_video"] = _out(
            _video_frames(graph, "wanvace_example_source.mp4", "clip to extend", frames=EXTENSION_GIVEN_FRAMES)
        )
        optional["control_masks"] = _out(_keep_mask(graph))
    conditioning = graph.add(
        "WanVACEConditioning",
        model=_out(loader),
        positive=TASK_PROMPTS[task],
        negative=NEGATIVE,
        width=WIDTH,
        height=HEIGHT,
        length=LENGTH,
        strength=1.0,
        **optional,
    )
    cache = {}
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
        )
        cache["cache"] = _out(cache_options)
    sampler = graph.add(
        "WanVACESampler",
        model=_out(loader),
        conditioning=_out(conditioning),
        seed=42,
        steps=STEPS,
        cfg=5.0,
        cfg_low_noise=5.0,
        boundary_ratio=-1.0,
        shift=0.0,
        scheduler="unipc",
        **cache,
    )
    frames = graph.add("WanVACEDecode", model=_out(loader), samples=_out(sampler))
    video = graph.add("CreateVideo", images=_out(frames), fps=16.0)
    graph.add("SaveVideo", video=_out(video), filename_prefix=f"WanVACE/{name}", format="auto", codec="auto")
    return graph.nodes


def for_tiny_model(workflow: dict, **overrides) -> dict:
    """A copy of `workflow` sized for the tiny test model; `overrides` set inputs by name on every node."""
    shrunk = copy.deepcopy(workflow)
    for node in shrunk.values():
        for name, value in list(node["inputs"].items()):
            if isinstance(value, list):
                continue
            mapping = _TINY_VALUES.get(name, {})
            if value in mapping:
                node["inputs"][name] = mapping[value]
            if name in overrides:
                node["inputs"][name] = overrides[name]
    return shrunk


def nodes_of_type(workflow: dict, class_type: str) -> list[dict]:
    return [node for node in workflow.values() if node["class_type"] == class_type]
