"""The shipped workflows, one per VACE task, as API-format graphs built from this package's nodes and core nodes.

`scripts/make_workflows.py` writes these to `example_workflows/api/wanvace_<name>.json` (API format)
and `example_workflows/<title>.json` (the graph editor's UI format, with the layout hints, groups and note
kept here). `for_tiny_model` shrinks a workflow to the tiny test model so it runs in seconds on a CPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

REAL_MODEL = "Wan2.2-VACE-Fun-A14B-Diffusers"
TINY_MODEL = "wanvace-tiny"
WIDTH, HEIGHT, LENGTH, STEPS = 832, 480, 81, 20
OUTPAINT_INNER_WIDTH, OUTPAINT_PAD = 576, 128
EXTENSION_GIVEN_FRAMES = 17
# The long-video variants: 241 frames (15 s at 16 fps) as 81-frame context windows overlapping 16 frames.
LONG_LENGTH = 241
CONTEXT_WINDOWS = {
    "context_length": 81,
    "context_overlap": 16,
    "schedule": "standard_uniform",
    "context_stride": 1,
    "closed_loop": False,
    "fuse_method": "pyramid",
    "freenoise": True,
}
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
# Variants that load the single files ComfyUI users have with WanVACE Experts Loader.
FP8_VARIANT, GGUF_VARIANT = "_fp8", "_gguf"
# Variants that sample through WanVACE LoRA Loader: a 4-step distillation LoRA, a style LoRA.
LIGHTNING_VARIANT, STYLE_LORA_VARIANT = "_lightning", "_style_lora"
# Variants longer than one window, through WanVACE Context Windows.
LONG_VARIANT = "_long"
VARIANTS = (CACHE_VARIANT, FP8_VARIANT, GGUF_VARIANT, LIGHTNING_VARIANT, STYLE_LORA_VARIANT, LONG_VARIANT)
# Every shipped workflow: one per task, plus variants with the Cache-DiT node, the single-file loader and LoRAs.
WORKFLOWS = (
    *TASKS,
    "v2v" + CACHE_VARIANT,
    "i2v" + FP8_VARIANT,
    "t2v" + GGUF_VARIANT,
    "t2v" + LIGHTNING_VARIANT,
    "v2v" + STYLE_LORA_VARIANT,
    "v2v" + LONG_VARIANT,
    "extension" + LONG_VARIANT,
)
# The files each single-file variant names (Comfy-Org's repackaged fp8 experts, umt5 and VAE; city96-style
# GGUF experts as QuantStack publishes them). The integration suite writes tiny files under these names.
SINGLE_FILES = {
    FP8_VARIANT: {
        "high_noise_model": "wan2.2_fun_vace_high_noise_14B_fp8_scaled.safetensors",
        "low_noise_model": "wan2.2_fun_vace_low_noise_14B_fp8_scaled.safetensors",
        "text_encoder": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
        "vae": "wan_2.1_vae.safetensors",
    },
    GGUF_VARIANT: {
        "high_noise_model": "Wan2.2-VACE-Fun-A14B-HighNoise-Q8_0.gguf",
        "low_noise_model": "Wan2.2-VACE-Fun-A14B-LowNoise-Q8_0.gguf",
        "text_encoder": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
        "vae": "wan_2.1_vae.safetensors",
    },
}


@dataclass(frozen=True)
class LoraUse:
    """One WanVACE LoRA Loader of a LoRA variant: the file it names and its strength on each expert."""

    title: str
    lora_name: str
    strength_high_noise: float
    strength_low_noise: float


# The LoRA files each LoRA variant names. Lightning: lightx2v's Wan2.2-T2V-A14B 4-step LoRA (v1.1) as Comfy-Org
# repackages it, one file per expert (VACE-Fun A14B is built on the T2V experts). The style LoRA stands for the
# user's own. The integration suite writes tiny LoRA files under these names.
LORA_FILES = {
    LIGHTNING_VARIANT: (
        LoraUse(
            "LoRA: Lightning 4-step (high noise)",
            "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
            1.0,
            0.0,
        ),
        LoraUse(
            "LoRA: Lightning 4-step (low noise)", "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors", 0.0, 1.0
        ),
    ),
    STYLE_LORA_VARIANT: (LoraUse("LoRA: your style", "wan_style_lora.safetensors", 0.8, 0.8),),
}
# The VAE passes tile only when the untiled peak would not fit the free device memory.
VAE_TILING = {"tiled": "auto", "tile_size": 256, "tile_overlap": 64}
# What the Lightning LoRAs are distilled for: 4 steps without guidance (cfg 1 skips the negative pass), shift 5.
LIGHTNING_SAMPLING = {"steps": 4, "cfg": 1.0, "cfg_low_noise": 1.0, "shift": 5.0, "scheduler": "euler"}


def task_of(name: str) -> str:
    """The VACE task of a shipped workflow name (its variant suffix removed)."""
    for variant in VARIANTS:
        if name.endswith(variant):
            return name.removesuffix(variant)
    return name


def variant_of(name: str) -> str:
    return name[len(task_of(name)) :]


def loader_class(name: str) -> str:
    return "WanVACEExpertsLoader" if variant_of(name) in SINGLE_FILES else "WanVACEModelLoader"


# What the template browser shows: ComfyUI's frontend (1.32 and 1.49) titles a custom node pack's
# template with its file name, so the UI files are named `<title>.json` (thumbnail `<title>.jpg`).
WORKFLOW_TITLES = {
    "t2v": "WanVACE - Text to Video",
    "i2v": "WanVACE - Image to Video",
    "flf2v": "WanVACE - First and Last Frame",
    "r2v": "WanVACE - Reference to Video",
    "v2v": "WanVACE - Control Video",
    "inpaint": "WanVACE - Inpaint Video",
    "outpaint": "WanVACE - Outpaint Video",
    "extension": "WanVACE - Extend Video",
    "v2v" + CACHE_VARIANT: "WanVACE - Cached Control Video",
    "i2v" + FP8_VARIANT: "WanVACE - Image to Video (fp8 single files)",
    "t2v" + GGUF_VARIANT: "WanVACE - Text to Video (GGUF, low VRAM)",
    "t2v" + LIGHTNING_VARIANT: "WanVACE - Text to Video (Lightning 4-step LoRA)",
    "v2v" + STYLE_LORA_VARIANT: "WanVACE - Control Video with a style LoRA",
    "v2v" + LONG_VARIANT: "WanVACE - Long Control Video (context windows)",
    "extension" + LONG_VARIANT: "WanVACE - Long Extension (context windows)",
}
# The example input files each workflow names (shipped in example_inputs/).
EXAMPLE_INPUTS = {
    "first": "wanvace_example_first.png",
    "last": "wanvace_example_last.png",
    "ref1": "wanvace_example_ref1.png",
    "ref2": "wanvace_example_ref2.png",
    "mask": "wanvace_example_mask.png",
    "control": "wanvace_example_control.mp4",
    "source": "wanvace_example_source.mp4",
}
MODEL_URL = "https://huggingface.co/Pyros13/Wan2.2-VACE-Fun-A14B-Diffusers"

# Group colors of LiteGraph's palette (LGraphCanvas.node_colors[...].groupcolor).
GROUP_COLORS = {
    "model": "#3f789e",
    "inputs": "#8A8",
    "masks": "#8AA",
    "cache": "#3f789e",
    "windows": "#3f789e",
    "lora": "#3f789e",
    "prompt": "#b58b2a",
    "sampling": "#88A",
    "output": "#a1309b",
}

# Widget values that scale with the video size, and what they become for the tiny model.
_TINY_VALUES = {
    "model_name": {REAL_MODEL: TINY_MODEL},
    "width": {WIDTH: 64, OUTPAINT_INNER_WIDTH: 32},
    "height": {HEIGHT: 48},
    "length": {LENGTH: 9, EXTENSION_GIVEN_FRAMES: 5, LONG_LENGTH: 33},
    "context_length": {CONTEXT_WINDOWS["context_length"]: 17},
    "context_overlap": {CONTEXT_WINDOWS["context_overlap"]: 8},
    "batch_size": {LENGTH - 2: 7},
    "steps": {STEPS: 4},
    "left": {OUTPAINT_PAD: 16},
    "right": {OUTPAINT_PAD: 16},
}


@dataclass
class UiLayout:
    """How the graph editor shows a workflow; used by scripts/make_workflows.py only."""

    # group key -> title, in drawing order.
    groups: dict[str, str] = field(default_factory=dict)
    # node id -> (group key, column inside the group); nodes of a column stack in id order.
    placement: dict[str, tuple[str, int]] = field(default_factory=dict)
    # Page columns, left to right; each a list of rows, top to bottom; each row a list of group keys
    # side by side. "note" is the Markdown note.
    page: list[list[list[str]]] = field(default_factory=list)
    note: str = ""


class _Graph:
    def __init__(self) -> None:
        self.nodes: dict[str, dict] = {}
        self.layout = UiLayout()

    def add(self, class_type: str, title: str | None = None, *, at: tuple[str, int], **inputs) -> str:
        node_id = str(len(self.nodes) + 1)
        node = {"class_type": class_type, "inputs": inputs}
        if title:
            node["_meta"] = {"title": title}
        self.nodes[node_id] = node
        self.layout.placement[node_id] = at
        return node_id


def _out(node_id: str, slot: int = 0) -> list:
    return [node_id, slot]


def _scaled_image(
    graph: _Graph, file: str, title: str, group: str, column: int, scale_column: int | None = None
) -> str:
    """LoadImage, then ImageScale to the video size one column on (or in `scale_column`)."""
    loaded = graph.add("LoadImage", title, image=file, at=(group, column))
    return graph.add(
        "ImageScale",
        image=_out(loaded),
        upscale_method="lanczos",
        width=WIDTH,
        height=HEIGHT,
        crop="center",
        at=(group, column + 1 if scale_column is None else scale_column),
    )


def _video_frames(graph: _Graph, file: str, title: str, frames: int = LENGTH, width: int = WIDTH) -> str:
    video = graph.add("LoadVideo", title, file=file, at=("inputs", 0))
    components = graph.add("GetVideoComponents", video=_out(video), at=("inputs", 1))
    trimmed = graph.add("ImageFromBatch", image=_out(components), batch_index=0, length=frames, at=("inputs", 1))
    return graph.add(
        "ImageScale",
        image=_out(trimmed),
        upscale_method="lanczos",
        width=width,
        height=HEIGHT,
        crop="center",
        at=("inputs", 2),
    )


def _keep_mask(graph: _Graph, group: str, column: int) -> str:
    """A single all-zero mask: keep every given pixel."""
    return graph.add("SolidMask", "keep given frames", value=0.0, width=WIDTH, height=HEIGHT, at=(group, column))


def _note(name: str) -> str:
    """The Markdown note of a workflow: where the model goes, what to replace, what comes out."""
    task = task_of(name)
    ex = {key: f"`{file}`" for key, file in EXAMPLE_INPUTS.items()}
    replace = {
        "i2v": f"**first frame** ({ex['first']}): your start image.",
        "flf2v": f"**first frame** ({ex['first']}) and **last frame** ({ex['last']}): your two images.",
        "r2v": f"**reference 1** ({ex['ref1']}) and **reference 2** ({ex['ref2']}): your subjects; "
        "chain another **Batch Images** for more.",
        "v2v": f"**control video** ({ex['control']}, a pose video): your depth, pose or edge video.",
        "inpaint": f"**source video** ({ex['source']}) and **inpaint mask** ({ex['mask']}, white = repaint).",
        "outpaint": f"**source video** ({ex['source']}); **Pad Image for Outpainting** sets how far to extend.",
        "extension": f"**clip to extend** ({ex['source']}): its first {EXTENSION_GIVEN_FRAMES} frames are kept.",
    }
    files = SINGLE_FILES.get(variant_of(name))
    if files is None:
        model = (
            f"**1. Model:** put [{REAL_MODEL}]({MODEL_URL}) (safetensors) in "
            f"`ComfyUI/models/diffusers/{REAL_MODEL}/` with its `model_index.json`, `transformer/`, "
            "`transformer_2/`, `text_encoder/`, `tokenizer/`, `vae/` and `scheduler/`, then pick it in "
            "**WanVACE Model Loader** (a Wan2.1-VACE diffusers folder works too)."
        )
    else:
        kind = "fp8, Comfy-Org's repackaged files" if variant_of(name) == FP8_VARIANT else "GGUF"
        model = (
            f"**1. Model ({kind}):** put `{files['high_noise_model']}` and `{files['low_noise_model']}` in "
            f"`ComfyUI/models/diffusion_models/`, `{files['text_encoder']}` in `models/text_encoders/` and "
            f"`{files['vae']}` in `models/vae/` (the files ComfyUI's own Wan templates use), then pick them in "
            "**WanVACE Experts Loader**. bf16/fp16 experts, other GGUF quantisations (Q4_K_M, Q5_K_M, ...) and a "
            "Wan2.2-T2V expert plus Kijai's VACE module work too; `weight_dtype` auto keeps fp8/GGUF weights "
            "quantised in memory."
        )
    lines = [f"## {WORKFLOW_TITLES[name]}", "", model, ""]
    if task in replace:
        lines += [
            f"**2. Inputs:** replace the example files with yours: {replace[task]} The examples are tiny "
            "placeholders this pack copies into `ComfyUI/input`.",
            "",
            "**3. Prompt:** describe the video in **WanVACE Conditioning**, then Run.",
        ]
    else:
        lines += ["**2. Prompt:** describe the video in **WanVACE Conditioning**, then Run."]
    if variant_of(name) == GGUF_VARIANT:
        lines += [
            "",
            "**Offload:** **WanVACE Offload Options** (layerwise) streams the quantised blocks to the GPU one by one, "
            "for 12-16 GB cards; disconnect it when the experts fit.",
        ]
    else:
        lines += ["", "**Smaller GPU:** connect **WanVACE Offload Options** to the loader's `offload` input."]
    if name.endswith(CACHE_VARIANT):
        lines += ["", "**WanVACE Cache Options** skips steps with Cache-DiT: faster, slightly different."]
    if name.endswith(LONG_VARIANT):
        lines += [
            "",
            f"**Long video:** {LONG_LENGTH} frames as {CONTEXT_WINDOWS['context_length']}-frame context windows "
            f"overlapping {CONTEXT_WINDOWS['context_overlap']} (**WanVACE Context Windows**): memory follows the "
            "window, and each window gets its part of the control video and masks. Set the length in **WanVACE "
            "Conditioning**; the example clip is short, so use one of at least that many frames.",
        ]
    if variant_of(name) == LIGHTNING_VARIANT:
        high, low = (lora.lora_name for lora in LORA_FILES[LIGHTNING_VARIANT])
        lines += [
            "",
            f"**LoRA:** put lightx2v's Lightning 4-step LoRA files `{high}` and `{low}` in `ComfyUI/models/loras/`. "
            "Each **WanVACE LoRA Loader** puts one file on its own expert (strength 1 there, 0 on the other); the "
            "sampler then needs only 4 steps with cfg 1 (no negative pass), shift 5, euler: about 10x faster than "
            "20 steps with cfg 5. Lower a strength to soften the distillation's look.",
        ]
    if variant_of(name) == STYLE_LORA_VARIANT:
        (style,) = LORA_FILES[STYLE_LORA_VARIANT]
        lines += [
            "",
            f"**LoRA:** put a Wan2.1/2.2 14B style LoRA in `ComfyUI/models/loras/` and pick it instead of "
            f"`{style.lora_name}` in **WanVACE LoRA Loader**; set its strength per expert (a Wan2.2 LoRA made of a "
            "high-noise and a low-noise file takes two chained loaders, each with 0 on the other expert).",
        ]
    length = LONG_LENGTH if name.endswith(LONG_VARIANT) else LENGTH
    lines += ["", f"Output: `output/WanVACE/{name}_*.mp4`, {WIDTH}x{HEIGHT}, {length} frames at 16 fps."]
    return "\n".join(lines)


_INPUT_GROUP_TITLES = {
    "i2v": "Input: first frame",
    "flf2v": "Inputs: first and last frame",
    "r2v": "Inputs: reference images",
    "v2v": "Input: control video",
    "inpaint": "Input: source video",
    "outpaint": "Input: source video",
    "extension": "Input: clip to extend",
}
_MASK_GROUP_TITLES = {
    "flf2v": "Masks: keep the first and last frame",
    "inpaint": "Input: inpaint mask",
}


def _build(name: str) -> _Graph:
    if name not in WORKFLOWS:
        raise KeyError(f"unknown workflow {name!r}; one of {', '.join(WORKFLOWS)}")
    task = task_of(name)
    length = LONG_LENGTH if name.endswith(LONG_VARIANT) else LENGTH
    graph = _Graph()
    files = SINGLE_FILES.get(variant_of(name))
    if files is None:
        loader = graph.add("WanVACEModelLoader", model_name=REAL_MODEL, dtype="bf16", at=("model", 0))
    else:
        offload = {}
        if variant_of(name) == GGUF_VARIANT:
            options = graph.add(
                "WanVACEOffloadOptions", mode="layerwise", prefetch_blocks=1, max_pinned_mb=0, at=("model", 0)
            )
            offload["offload"] = _out(options)
        loader = graph.add(
            "WanVACEExpertsLoader",
            **files,
            dtype="bf16",
            weight_dtype="auto",
            boundary_ratio=0.875,
            **offload,
            at=("model", 1 if offload else 0),
        )
    optional: dict = {}
    if task == "i2v":
        optional["control_video"] = _out(_scaled_image(graph, EXAMPLE_INPUTS["first"], "first frame", "inputs", 0))
        optional["control_masks"] = _out(_keep_mask(graph, "inputs", 1))
    elif task == "flf2v":
        first = _scaled_image(graph, EXAMPLE_INPUTS["first"], "first frame", "inputs", 0, scale_column=2)
        last = _scaled_image(graph, EXAMPLE_INPUTS["last"], "last frame", "inputs", 1, scale_column=2)
        grey = graph.add(
            "EmptyImage",
            "frames to generate",
            width=WIDTH,
            height=HEIGHT,
            batch_size=LENGTH - 2,
            color=GREY,
            at=("inputs", 3),
        )
        head = graph.add("ImageBatch", "first + grey frames", image1=_out(first), image2=_out(grey), at=("inputs", 3))
        video = graph.add("ImageBatch", "+ last frame", image1=_out(head), image2=_out(last), at=("inputs", 3))
        black = graph.add("MaskToImage", mask=_out(_keep_mask(graph, "masks", 0)), at=("masks", 1))
        white = graph.add(
            "EmptyImage",
            "generate mask",
            width=WIDTH,
            height=HEIGHT,
            batch_size=LENGTH - 2,
            color=WHITE,
            at=("masks", 0),
        )
        mask_head = graph.add("ImageBatch", "keep + generate", image1=_out(black), image2=_out(white), at=("masks", 1))
        mask_video = graph.add("ImageBatch", "+ keep last", image1=_out(mask_head), image2=_out(black), at=("masks", 1))
        masks = graph.add("ImageToMask", image=_out(mask_video), channel="red", at=("masks", 1))
        optional["control_video"] = _out(video)
        optional["control_masks"] = _out(masks)
    elif task == "r2v":
        first = graph.add("LoadImage", "reference 1", image=EXAMPLE_INPUTS["ref1"], at=("inputs", 0))
        second = graph.add("LoadImage", "reference 2", image=EXAMPLE_INPUTS["ref2"], at=("inputs", 1))
        optional["reference_images"] = _out(
            graph.add("ImageBatch", "both references", image1=_out(first), image2=_out(second), at=("inputs", 2))
        )
    elif task == "v2v":
        optional["control_video"] = _out(
            _video_frames(graph, EXAMPLE_INPUTS["control"], "control video", frames=length)
        )
    elif task == "inpaint":
        optional["control_video"] = _out(_video_frames(graph, EXAMPLE_INPUTS["source"], "source video"))
        mask = graph.add(
            "LoadImageMask",
            "inpaint mask (white = repaint)",
            image=EXAMPLE_INPUTS["mask"],
            channel="red",
            at=("masks", 0),
        )
        mask_image = graph.add("MaskToImage", mask=_out(mask), at=("masks", 1))
        scaled = graph.add(
            "ImageScale",
            image=_out(mask_image),
            upscale_method="nearest-exact",
            width=WIDTH,
            height=HEIGHT,
            crop="center",
            at=("masks", 1),
        )
        optional["control_masks"] = _out(graph.add("ImageToMask", image=_out(scaled), channel="red", at=("masks", 1)))
    elif task == "outpaint":
        inner = _video_frames(graph, EXAMPLE_INPUTS["source"], "source video", width=OUTPAINT_INNER_WIDTH)
        padded = graph.add(
            "ImagePadForOutpaint",
            image=_out(inner),
            left=OUTPAINT_PAD,
            top=0,
            right=OUTPAINT_PAD,
            bottom=0,
            feathering=0,
            at=("inputs", 2),
        )
        optional["control_video"] = _out(padded, 0)
        optional["control_masks"] = _out(padded, 1)
    elif task == "extension":
        optional["control_video"] = _out(
            _video_frames(graph, EXAMPLE_INPUTS["source"], "clip to extend", frames=EXTENSION_GIVEN_FRAMES)
        )
        optional["control_masks"] = _out(_keep_mask(graph, "inputs", 2))
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
        **optional,
        at=("prompt", 0),
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
            at=("cache", 0),
        )
        cache["cache"] = _out(cache_options)
    if name.endswith(LONG_VARIANT):
        windows = graph.add("WanVACEContextWindows", **CONTEXT_WINDOWS, at=("windows", 0))
        cache["context_windows"] = _out(windows)
    # The LoRAs change only the sampling: conditioning and decoding use the loader's model directly.
    sampling_model = loader
    for column, lora in enumerate(LORA_FILES.get(variant_of(name), ())):
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
    sampling = {"steps": STEPS, "cfg": 5.0, "cfg_low_noise": 5.0, "shift": 0.0, "scheduler": "unipc"}
    if variant_of(name) == LIGHTNING_VARIANT:
        sampling = LIGHTNING_SAMPLING
    sampler = graph.add(
        "WanVACESampler",
        model=_out(sampling_model),
        conditioning=_out(conditioning),
        seed=42,
        steps=sampling["steps"],
        cfg=sampling["cfg"],
        cfg_low_noise=sampling["cfg_low_noise"],
        boundary_ratio=-1.0,
        shift=sampling["shift"],
        scheduler=sampling["scheduler"],
        **cache,
        at=("sampling", 0),
    )
    frames = graph.add("WanVACEDecode", model=_out(loader), samples=_out(sampler), **VAE_TILING, at=("sampling", 0))
    video = graph.add("CreateVideo", images=_out(frames), fps=16.0, at=("output", 0))
    graph.add(
        "SaveVideo",
        video=_out(video),
        filename_prefix=f"WanVACE/{name}",
        format="auto",
        codec="auto",
        at=("output", 0),
    )

    layout = graph.layout
    layout.note = _note(name)
    layout.groups["model"] = "Model"
    if name.endswith(CACHE_VARIANT):
        layout.groups["cache"] = "Step caching (Cache-DiT)"
    if name.endswith(LONG_VARIANT):
        layout.groups["windows"] = "Context windows (long video)"
    if variant_of(name) in LORA_FILES:
        layout.groups["lora"] = "LoRAs (sampling only)"
    if task in _INPUT_GROUP_TITLES:
        layout.groups["inputs"] = _INPUT_GROUP_TITLES[task]
    if task in _MASK_GROUP_TITLES:
        layout.groups["masks"] = _MASK_GROUP_TITLES[task]
    layout.groups["prompt"] = "Prompt and VACE conditioning"
    layout.groups["sampling"] = "Sampling"
    layout.groups["output"] = "Output"
    # The note and the model top left; the inputs top right of them with the output beside (the
    # Run button is above it), prompt and sampling below. The bottom right corner stays empty: both
    # frontends draw their minimap there.
    left = [["note"], ["model"], *([[key] for key in ("lora", "cache", "windows", "masks") if key in layout.groups])]
    if task == "t2v":
        layout.page = [left, [["prompt", "sampling", "output"]]]
    else:
        layout.page = [left, [["inputs", "output"], ["prompt", "sampling"]]]
    return graph


def build_api_workflow(name: str) -> dict:
    """The API-format graph of one shipped workflow (a task, optionally with the `_cache` variant)."""
    return _build(name).nodes


def build_ui_layout(name: str) -> UiLayout:
    """Groups, placement and note of one shipped workflow in the graph editor."""
    return _build(name).layout


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


def node_id_of(workflow: dict, class_type: str) -> str:
    """The id of the one node of `class_type` in `workflow`."""
    (node_id,) = [key for key, node in workflow.items() if node["class_type"] == class_type]
    return node_id
