"""A videos-API job as a ComfyUI prompt: the shipped workflow of its task (`example_workflows/api/`), with the request's
values set on the nodes that hold them, its files read from the job's temp folder, and its video saved under the
job's own output prefix. Nothing here runs anything; the prompt goes through ComfyUI's `/prompt` like any other."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
from pathlib import Path

from ..nodes.cache import WanVACECacheOptions
from ..wanvace_core import ContextWindowOptions
from ..wanvace_core.generation.tasks import MODE_INPUTS
from .fields import ApiError, VideoRequest

WORKFLOW_DIR = Path(__file__).resolve().parents[1] / "example_workflows" / "api"
OUTPUT_PREFIX = "wanvace_api"
# Frames the extension task keeps from the given video unless extra_params.given_frames says otherwise.
DEFAULT_GIVEN_FRAMES = 17
# What each mode reads besides the prompt, as files (outpainting's padding is a number, not a file).
NEEDS = {mode: tuple(name for name in names if name != "outpaint") for mode, names in MODE_INPUTS.items()}
# The option nodes' inputs, at their defaults, which extra_params.cache / .context_windows override.
CACHE_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(WanVACECacheOptions.options_from).parameters.items()
}
WINDOW_DEFAULTS = dataclasses.asdict(ContextWindowOptions())


def temp_name(path: str, temp_dir: str) -> str:
    """A file in ComfyUI's temp folder as its loaders take it: relative, annotated `[temp]`."""
    return f"{Path(path).relative_to(temp_dir).as_posix()} [temp]"


class _Graph:
    def __init__(self, workflow: dict) -> None:
        self.nodes = workflow

    def ids(self, class_type: str) -> list[str]:
        return [key for key, node in self.nodes.items() if node["class_type"] == class_type]

    def set(self, class_type: str, index: int = 0, **inputs) -> str:
        node_id = self.ids(class_type)[index]
        self.nodes[node_id]["inputs"].update(inputs)
        return node_id

    def set_all(self, class_type: str, **inputs) -> None:
        for node_id in self.ids(class_type):
            self.nodes[node_id]["inputs"].update(inputs)

    def add(self, class_type: str, **inputs) -> str:
        node_id = str(max(int(key) for key in self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": inputs}
        return node_id


def _files(request: VideoRequest, mode: str) -> None:
    missing = [name for name in NEEDS[mode] if not request.files.get(name)]
    if missing:
        where = {
            "image": "input_reference (an image)",
            "last_image": "extra_params.last_image",
            "reference": "extra_params.reference_images",
            "video": "input_reference (a video) or video_reference",
            "mask": "extra_params.mask",
        }
        raise ApiError(
            400,
            f"extra_params.mode {mode} needs {', '.join(where[name] for name in missing)}.",
            param=where[missing[0]].split(" ")[0],
        )
    unused = [name for name, value in request.files.items() if value and name not in NEEDS[mode]]
    if unused:
        raise ApiError(
            400, f"mode {mode} does not use {', '.join(unused)}; leave it out or choose another mode.", param=unused[0]
        )


def _option_node(graph: _Graph, class_type: str, defaults: dict, given: object, param: str) -> str:
    if not isinstance(given, dict):
        raise ApiError(400, f"{param} must be a JSON object of the {class_type} node's inputs.", param=param)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ApiError(
            400,
            f"{param} has unknown keys {unknown}; the keys are {', '.join(defaults)}.",
            param=f"{param}.{unknown[0]}",
        )
    return graph.add(class_type, **{**defaults, **given})


# The WanVACE Experts Loader's inputs a single-file set leaves at the shipped workflow's values.
EXPERTS_LOADER_DEFAULTS = {"dtype": "bf16", "weight_dtype": "auto", "boundary_ratio": 0.875}


def build_prompt(
    request: VideoRequest, job_id: str, model: str, temp_dir: str, single_files: dict | None = None
) -> tuple[dict, str, str]:
    """The prompt, its SaveVideo node's id and its sampler's id. `single_files`: the model is that single-file set,
    loaded by the WanVACE Experts Loader in place of the Model Loader."""
    mode = request.mode
    _files(request, mode)
    workflow = json.loads((WORKFLOW_DIR / f"wanvace_{mode}.json").read_text())
    graph = _Graph(copy.deepcopy(workflow))
    width, height, length = request.width, request.height, request.num_frames
    extra = request.extra
    if single_files is None:
        graph.set("WanVACEModelLoader", model_name=model)
    else:
        (loader_id,) = graph.ids("WanVACEModelLoader")
        graph.nodes[loader_id] = {
            "class_type": "WanVACEExpertsLoader",
            "inputs": {**EXPERTS_LOADER_DEFAULTS, **single_files},
        }
    conditioning = {
        "positive": request.prompt,
        "negative": request.negative_prompt,
        "width": width,
        "height": height,
        "length": length,
    }
    for name in ("strength", "vace_start_percent", "vace_end_percent"):
        if name in extra:
            conditioning[name] = extra[name]
    graph.set("WanVACEConditioning", **conditioning)
    sampler = {
        "seed": request.seed,
        "steps": request.steps,
        "cfg": request.guidance_high,
        "cfg_low_noise": request.guidance_low,
        "boundary_ratio": -1.0 if request.boundary_ratio is None else request.boundary_ratio,
        "shift": 0.0 if request.flow_shift is None else request.flow_shift,
    }
    if "scheduler" in extra:
        sampler["scheduler"] = extra["scheduler"]
    sampler_id = graph.set("WanVACESampler", **sampler)
    graph.set("CreateVideo", fps=request.fps)
    save_id = graph.set("SaveVideo", filename_prefix=f"{OUTPUT_PREFIX}/{job_id}")
    files = {name: value for name, value in request.files.items() if value}
    name = {key: (temp_name(value, temp_dir) if isinstance(value, str) else value) for key, value in files.items()}

    # The shipped workflows' nodes that arrange the inputs take the video's size and length, as the conditioning.
    for class_type in ("WanVACEControlVideo", "WanVACEFirstLastFrame", "WanVACEOutpaintCanvas"):
        graph.set_all(class_type, width=width, height=height, length=length)
    if mode in ("i2v", "flf2v"):
        graph.set("LoadImage", 0, image=name["image"])
    if mode == "flf2v":
        graph.set("LoadImage", 1, image=name["last_image"])
    elif mode == "r2v":
        _references(graph, [temp_name(path, temp_dir) for path in files["reference"]])
    elif mode in ("v2v", "inpaint", "outpaint", "extension"):
        graph.set("LoadVideo", file=name["video"])
        if mode == "extension":
            given = extra.get("given_frames", DEFAULT_GIVEN_FRAMES)
            if not isinstance(given, int) or not 1 <= given < length:
                raise ApiError(
                    400,
                    f"extra_params.given_frames={given!r} must be a whole number from 1 to num_frames - 1 "
                    f"({length - 1}): the frames kept from the video, before the generated ones.",
                    param="extra_params.given_frames",
                )
            # The workflow's WanVACE Control Video keeps that many of the clip's frames.
            graph.set("WanVACEControlVideo", length=given)
        if mode == "outpaint":
            pad = extra.get("outpaint")
            sides = ("left", "top", "right", "bottom")
            if not isinstance(pad, dict) or set(pad) - set(sides) or not any(pad.values()):
                raise ApiError(
                    400,
                    "mode outpaint needs extra_params.outpaint: pixels of new canvas per side, e.g. "
                    '{"left": 128, "right": 128}.',
                    param="extra_params.outpaint",
                )
            pads = {side: pad.get(side, 0) for side in sides}
            inner = (width - pads["left"] - pads["right"], height - pads["top"] - pads["bottom"])
            if min(inner) < 16:
                raise ApiError(
                    400, f"extra_params.outpaint leaves {inner[0]}x{inner[1]} for the video.", "extra_params.outpaint"
                )
            graph.set("WanVACEOutpaintCanvas", **pads)
        if mode == "inpaint":
            graph.set("LoadImageMask", image=name["mask"])

    if request.lora is not None:
        lora_name, strength = request.lora
        lora_id = graph.add(
            "WanVACELoraLoader",
            model=graph.nodes[sampler_id]["inputs"]["model"],
            lora_name=lora_name,
            strength_high_noise=strength,
            strength_low_noise=strength,
            merge=False,
        )
        graph.nodes[sampler_id]["inputs"]["model"] = [lora_id, 0]
    if "cache" in extra:
        cache_id = _option_node(graph, "WanVACECacheOptions", CACHE_DEFAULTS, extra["cache"], "extra_params.cache")
        graph.nodes[sampler_id]["inputs"]["cache"] = [cache_id, 0]
    if "context_windows" in extra:
        windows_id = _option_node(
            graph, "WanVACEContextWindows", WINDOW_DEFAULTS, extra["context_windows"], "extra_params.context_windows"
        )
        graph.nodes[sampler_id]["inputs"]["context_windows"] = [windows_id, 0]
    return graph.nodes, save_id, sampler_id


def _references(graph: _Graph, names: list[str]) -> None:
    """The reference images as a batch into the conditioning: the shipped graph holds two; others are added."""
    loads = graph.ids("LoadImage")
    for node_id in graph.ids("ImageBatch"):
        del graph.nodes[node_id]
    batch = None
    for index, name in enumerate(names):
        load_id = loads[index] if index < len(loads) else graph.add("LoadImage", image=name)
        graph.nodes[load_id]["inputs"]["image"] = name
        batch = [load_id, 0] if batch is None else [graph.add("ImageBatch", image1=batch, image2=[load_id, 0]), 0]
    for unused in loads[len(names) :]:
        del graph.nodes[unused]
    graph.set("WanVACEConditioning", reference_images=batch)
