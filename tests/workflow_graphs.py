"""The shipped workflows, one per VACE task, as API-format graphs built from this package's nodes and core nodes.

`scripts/make_workflows.py` writes these to `example_workflows/api/wanvace_<name>.json` (API format)
and `example_workflows/<title>.json` (the graph editor's UI format, with the layout hints, groups, note,
graph-editor-only nodes and model download metadata kept here). `for_tiny_model` shrinks a workflow to the
tiny test model so it runs in seconds on a CPU.

Width, height and length are set once per workflow in the graph editor: three of the frontend's primitive nodes
(group "Video size") feed every node input that takes them. The frontend resolves a primitive into the value of
each input it feeds when it queues the prompt, so the API twins carry them as plain constants on those nodes, which
is what ComfyUI's queue-time validation sees.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace

REAL_MODEL = "Wan2.2-VACE-Fun-A14B-Diffusers"
TINY_MODEL = "wanvace-tiny"
WIDTH, HEIGHT, LENGTH, STEPS = 832, 480, 81, 20
OUTPAINT_PAD = 128
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
COMFY_SAMPLER_VARIANT = "_comfy_sampler"
VARIANTS = (
    CACHE_VARIANT,
    FP8_VARIANT,
    GGUF_VARIANT,
    LIGHTNING_VARIANT,
    STYLE_LORA_VARIANT,
    LONG_VARIANT,
    COMFY_SAMPLER_VARIANT,
)
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
    "t2v" + COMFY_SAMPLER_VARIANT,
)


@dataclass(frozen=True)
class ModelFile:
    """A file a workflow picks, where ComfyUI's missing-models dialog downloads it from and to, and its size."""

    name: str
    url: str
    directory: str
    gigabytes: float  # decimal GB, as download pages give them


_COMFY_WAN22 = "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files"
_COMFY_WAN21 = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files"
_QUANTSTACK_REPO = "https://huggingface.co/QuantStack/Wan2.2-VACE-Fun-A14B-GGUF"
_QUANTSTACK = f"{_QUANTSTACK_REPO}/resolve/main"
# Sizes: Comfy-Org's files as Hugging Face lists them (umt5 6,735,906,897 and VAE 253,815,318 bytes; each fp8
# expert ~17.3 GB); the GGUF and LoRA files from their tensor shapes (17.3B parameters at Q8_0's 8.5 bits; rank 64
# bf16 pairs on every linear of an expert ~0.6 GB, rank 32 fp16 ~0.3 GB).
MODEL_FILES = {
    file.name: file
    for file in (
        ModelFile(
            "wan2.2_fun_vace_high_noise_14B_fp8_scaled.safetensors",
            f"{_COMFY_WAN22}/diffusion_models/wan2.2_fun_vace_high_noise_14B_fp8_scaled.safetensors",
            "diffusion_models",
            17.3,
        ),
        ModelFile(
            "wan2.2_fun_vace_low_noise_14B_fp8_scaled.safetensors",
            f"{_COMFY_WAN22}/diffusion_models/wan2.2_fun_vace_low_noise_14B_fp8_scaled.safetensors",
            "diffusion_models",
            17.3,
        ),
        ModelFile(
            "Wan2.2-VACE-Fun-A14B-high-noise-Q8_0.gguf",
            f"{_QUANTSTACK}/HighNoise/Wan2.2-VACE-Fun-A14B-high-noise-Q8_0.gguf",
            "diffusion_models",
            18.4,
        ),
        ModelFile(
            "Wan2.2-VACE-Fun-A14B-low-noise-Q8_0.gguf",
            f"{_QUANTSTACK}/LowNoise/Wan2.2-VACE-Fun-A14B-low-noise-Q8_0.gguf",
            "diffusion_models",
            18.4,
        ),
        ModelFile(
            "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
            f"{_COMFY_WAN21}/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
            "text_encoders",
            6.7,
        ),
        ModelFile("wan_2.1_vae.safetensors", f"{_COMFY_WAN21}/vae/wan_2.1_vae.safetensors", "vae", 0.25),
        ModelFile(
            "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
            f"{_COMFY_WAN22}/loras/wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
            "loras",
            0.6,
        ),
        ModelFile(
            "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors",
            f"{_COMFY_WAN22}/loras/wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors",
            "loras",
            0.6,
        ),
        ModelFile(
            "Wan21_T2V_14B_MoviiGen_lora_rank32_fp16.safetensors",
            "https://huggingface.co/Kijai/WanVideo_comfy/resolve/main/Wan21_T2V_14B_MoviiGen_lora_rank32_fp16.safetensors",
            "loras",
            0.3,
        ),
    )
}
# The files each single-file variant names (Comfy-Org's repackaged fp8 experts, umt5 and VAE; QuantStack's GGUF
# experts). The integration suite writes tiny files under these names.
SINGLE_FILES = {
    FP8_VARIANT: {
        "high_noise_model": "wan2.2_fun_vace_high_noise_14B_fp8_scaled.safetensors",
        "low_noise_model": "wan2.2_fun_vace_low_noise_14B_fp8_scaled.safetensors",
        "text_encoder": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
        "vae": "wan_2.1_vae.safetensors",
    },
    GGUF_VARIANT: {
        "high_noise_model": "Wan2.2-VACE-Fun-A14B-high-noise-Q8_0.gguf",
        "low_noise_model": "Wan2.2-VACE-Fun-A14B-low-noise-Q8_0.gguf",
        "text_encoder": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
        "vae": "wan_2.1_vae.safetensors",
    },
}
# The diffusers folder the other workflows pick: bf16 experts of ~17.3B parameters (34.6 GB each), the umt5-xxl
# encoder (11.4 GB) and the VAE. A folder is no single download, so ComfyUI's missing-models dialog cannot fetch it.
MODEL_REPO = "Pyros13/Wan2.2-VACE-Fun-A14B-Diffusers"
MODEL_URL = f"https://huggingface.co/{MODEL_REPO}"
FOLDER_GIGABYTES = 2 * 34.6 + 11.4 + 0.5


@dataclass(frozen=True)
class LoraUse:
    """One WanVACE LoRA Loader of a LoRA variant: the file it names and its strength on each expert."""

    title: str
    lora_name: str
    strength_high_noise: float
    strength_low_noise: float


# The LoRA files each LoRA variant names. Lightning: lightx2v's Wan2.2-T2V-A14B 4-step LoRA (v1.1) as Comfy-Org
# repackages it, one file per expert (VACE-Fun A14B is built on the T2V experts). The style LoRA: Kijai's extract of
# MoviiGen 1.1 (a cinematic-look fine-tune of Wan2.1-T2V-14B), standing for the user's own. The integration suite
# writes tiny LoRA files under these names.
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
    STYLE_LORA_VARIANT: (
        LoraUse("LoRA: your style (here MoviiGen)", "Wan21_T2V_14B_MoviiGen_lora_rank32_fp16.safetensors", 0.8, 0.8),
    ),
}
# The VAE passes tile only when the untiled peak would not fit the free device memory.
VAE_TILING = {"tiled": "auto", "tile_size": 256, "tile_overlap": 64}
# What the Lightning LoRAs are distilled for: the 4 timesteps 1000/750/500/250 shifted by 5 (the distill schedule),
# without guidance (cfg 1 skips the negative pass); NAG puts the negative prompt back inside cross-attention.
LIGHTNING_SAMPLING = {"steps": 4, "cfg": 1.0, "cfg_low_noise": 1.0, "shift": 5.0, "scheduler": "distill"}
LIGHTNING_NAG = {
    "rule": "cfg",
    "experts": "both",
    "zero_init_steps": 0,
    "apg_eta": 1.0,
    "apg_norm_threshold": 5.0,
    "apg_momentum": 0.0,
    "nag_scale": 11.0,
    "nag_tau": 2.5,
    "nag_alpha": 0.25,
    "slg_blocks": "",
    "slg_start_percent": 0.1,
    "slg_end_percent": 1.0,
    "slg_scale": 0.0,
    "riflex_index": 0,
}
# ComfyUI's own sampler and schedule: what a native Wan2.2 graph runs (euler, simple, ModelSamplingSD3 shift 8).
COMFY_SAMPLER = {"sampler_name": "euler"}
COMFY_SCHEDULE = {"scheduler": "simple", "steps": STEPS, "shift": 8.0, "denoise": 1.0}


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


def length_of(name: str) -> int:
    return LONG_LENGTH if name.endswith(LONG_VARIANT) else LENGTH


# What the template browser shows. ComfyUI's frontends (1.32 and 1.49, read from their code and checked in the
# browser) take a custom node pack's templates from `/api/workflow_templates`, a list of file names per pack, and
# show each file name as the card's title (1.32 also as its description; 1.49 shows no description) with
# `<name>.jpg` as thumbnail. So the name is all a user reads before opening one: it says the task, fits the card,
# and starts with the template's place, which orders the list (the pack sorts its entry of that list by name,
# nodes/examples.py, and the frontends' "A-Z" sort gives the same order).
WORKFLOW_TITLES = {
    "t2v": "01 Text to Video",
    "i2v": "02 Image to Video",
    "flf2v": "03 First and Last Frame",
    "r2v": "04 Reference to Video",
    "v2v": "05 Control Video",
    "inpaint": "06 Inpaint Video",
    "outpaint": "07 Outpaint Video",
    "extension": "08 Extend Video",
    "t2v" + GGUF_VARIANT: "09 Text to Video, GGUF",
    "t2v" + LIGHTNING_VARIANT: "10 Text to Video in 4 steps",
    "i2v" + FP8_VARIANT: "11 Image to Video, fp8 files",
    "v2v" + CACHE_VARIANT: "12 Control Video, step cache",
    "v2v" + STYLE_LORA_VARIANT: "13 Control Video, style LoRA",
    "v2v" + LONG_VARIANT: "14 Long Control Video",
    "extension" + LONG_VARIANT: "15 Long Extension",
    "t2v" + COMFY_SAMPLER_VARIANT: "16 Text to Video, KSampler",
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
EXAMPLE_VIDEO_FRAMES = 81  # scripts/make_example_inputs.py

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

# Widget values that scale with the video size, and what they become for the tiny model.
_TINY_VALUES = {
    "model_name": {REAL_MODEL: TINY_MODEL},
    "width": {WIDTH: 64},
    "height": {HEIGHT: 48},
    "length": {LENGTH: 9, EXTENSION_GIVEN_FRAMES: 5, LONG_LENGTH: 33},
    "context_length": {CONTEXT_WINDOWS["context_length"]: 17},
    "context_overlap": {CONTEXT_WINDOWS["context_overlap"]: 8},
    "steps": {STEPS: 4},
    "left": {OUTPAINT_PAD: 16},
    "right": {OUTPAINT_PAD: 16},
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


# --- notes ---------------------------------------------------------------------------------------------------


def _gb(value: float) -> str:
    return f"{value:.0f} GB" if value >= 10 else f"{value:.1f} GB"


def _activation_gb(width: int, height: int, frames: int) -> float:
    """The sampler's activation estimate (wanvace_core/generation/budget.py, what ComfyUI is told) for A14B, bf16."""
    import torch

    from wanvace_core.generation.budget import sampling_activation_bytes

    # Wan2.2-VACE-Fun-A14B's expert: 40 heads of 128, FFN 13824, patch (1, 2, 2), and the VAE's 8x spatial and
    # 4x temporal compression.
    config = SimpleNamespace(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, ffn_dim=13824)
    model = SimpleNamespace(
        reference_expert=SimpleNamespace(config=config),
        helper=SimpleNamespace(vae_scale_factor_spatial=8),
        transformer_dtype=torch.bfloat16,
    )
    return sampling_activation_bytes(model, (frames - 1) // 4 + 1, height, width) / 1e9


@dataclass(frozen=True)
class _Weights:
    """GB on the GPU per part of the model, as the loader keeps them."""

    expert: float
    text_encoder: float
    vae: float

    def figures(self, activations: float) -> dict[str, float]:
        """GPU memory per offload mode (wanvace_core/runtime/offload.py): everything resident; one component at a
        time (an expert and the activations, or the text encoder); like `model` for the text encoder and VAE with
        the experts' blocks streamed (two of an expert's 40 blocks at prefetch 1, its non-block weights, well under
        a GB, and the activations)."""
        streamed = 2 * self.expert / 40 + 0.5 + activations
        return {
            "none": 2 * self.expert + self.text_encoder + self.vae + activations,
            "model": max(self.expert + activations, self.text_encoder),
            "layerwise": max(streamed, self.text_encoder),
        }


# bf16 experts (34.6 GB) and umt5 (11.4 GB); fp8 experts kept as stored (weight_dtype auto) at half of that, Q8_0 at
# 0.53x; the single-file text encoder is dequantised to bf16 at load.
_WEIGHTS = {
    "folder": _Weights(34.6, 11.4, 0.5),
    FP8_VARIANT: _Weights(17.3, 11.4, 0.25),
    GGUF_VARIANT: _Weights(18.4, 11.4, 0.25),
}


def _memory_lines(name: str) -> list[str]:
    variant = variant_of(name)
    activations = _activation_gb(WIDTH, HEIGHT, LENGTH)  # a context window is one 81-frame call too
    memory = _WEIGHTS.get(variant, _WEIGHTS["folder"]).figures(activations)
    estimate = (
        f"**GPU memory** (estimated for {WIDTH}x{HEIGHT}, {LENGTH} frames"
        + (" per window" if name.endswith(LONG_VARIANT) else "")
        + f": weights plus {_gb(activations)} of activations): "
    )
    if variant == GGUF_VARIANT:
        return [
            estimate
            + f"~{_gb(memory['layerwise'])} with the layerwise **WanVACE Offload Options** shown, which streams "
            f"the quantised blocks to the GPU one by one; disconnect it when {_gb(memory['none'])} fit "
            f"(`model`: ~{_gb(memory['model'])}).",
        ]
    return [
        estimate + f"~{_gb(memory['none'])} with everything on the GPU. On a smaller GPU switch on the muted "
        "**WanVACE Offload Options** beside the loader (select it, Ctrl+M): "
        f"`model` ~{_gb(memory['model'])}, `layerwise` ~{_gb(memory['layerwise'])} (the text encoder's turn).",
    ]


def _model_lines(name: str) -> list[str]:
    files = SINGLE_FILES.get(variant_of(name))
    if files is None:
        return [
            f"**1. Model** (~{_gb(FOLDER_GIGABYTES)}): the diffusers folder [{REAL_MODEL}]({MODEL_URL}) in "
            f"`ComfyUI/models/diffusers/{REAL_MODEL}/` (`model_index.json`, `transformer/`, `transformer_2/`, "
            "`text_encoder/`, `tokenizer/`, `vae/`, `scheduler/`), e.g. "
            f"`hf download {MODEL_REPO} --local-dir models/diffusers/{REAL_MODEL}`. ComfyUI's missing-models dialog "
            "cannot fetch a folder. Then pick it in **WanVACE Model Loader** (a Wan2.1-VACE folder works too)."
        ]
    total = sum(MODEL_FILES[file].gigabytes for file in files.values())
    if variant_of(name) == FP8_VARIANT:
        offered = (
            f"fp8, Comfy-Org's repackaged files, ~{_gb(total)}): ComfyUI's missing-models dialog offers each file with "
            "a Download button"
        )
    else:
        offered = (
            f"GGUF Q8_0, ~{_gb(total)}): the experts from [QuantStack's repository]({_QUANTSTACK_REPO}) "
            "(`HighNoise/`, `LowNoise/`); the missing-models dialog offers the text encoder and VAE"
        )
    return [
        f"**1. Model** ({offered}. Put `{files['high_noise_model']}` and `{files['low_noise_model']}` in "
        f"`ComfyUI/models/diffusion_models/`, `{files['text_encoder']}` in `models/text_encoders/` and "
        f"`{files['vae']}` in `models/vae/`, and pick them in **WanVACE Experts Loader**; other quantisations and "
        "bf16/fp16 experts work too."
    ]


def _input_lines(name: str) -> list[str]:
    task = task_of(name)
    ex = {key: f"`{file}`" for key, file in EXAMPLE_INPUTS.items()}
    frames = EXAMPLE_VIDEO_FRAMES
    replace = {
        "i2v": f"**first frame** ({ex['first']}): your start image.",
        "flf2v": f"**first frame** ({ex['first']}) and **last frame** ({ex['last']}): your two images.",
        "r2v": f"**reference 1** ({ex['ref1']}) and **reference 2** ({ex['ref2']}): your subjects; "
        "chain another **Batch Images** for more.",
        "v2v": f"**control video** ({ex['control']}, {frames} frames of a pose video): your depth, pose or edge video.",
        "inpaint": f"**source video** ({ex['source']}, {frames} frames) and **inpaint mask** ({ex['mask']}, "
        "white = repaint).",
        "outpaint": f"**source video** ({ex['source']}, {frames} frames); **WanVACE Outpaint Canvas** sets how far "
        "to extend each side.",
        "extension": f"**clip to extend** ({ex['source']}): its first {EXTENSION_GIVEN_FRAMES} frames are kept.",
    }
    if task not in replace:
        return []
    lines = [
        f"**2. Inputs:** replace the examples with yours: {replace[task]} They are small placeholders this pack "
        "copies into `ComfyUI/input`."
    ]
    if name.endswith(LONG_VARIANT) and task != "extension":
        lines[0] += (
            f" The example clip covers frames 1-{frames} of {LONG_LENGTH}; the later ones get no control, "
            f"so give a clip of at least {LONG_LENGTH} frames."
        )
    return lines


def _note(name: str) -> str:
    """The Markdown note of a workflow: the model and its download, inputs, memory, what comes out."""
    variant = variant_of(name)
    length = length_of(name)
    lines = [f"## {WORKFLOW_TITLES[name]}", "", *_model_lines(name), ""]
    inputs = _input_lines(name)
    if inputs:
        lines += [*inputs, "", "**3. Prompt:** describe the video in **WanVACE Conditioning**, then Run."]
    else:
        lines += ["**2. Prompt:** describe the video in **WanVACE Conditioning**, then Run."]
    lines += [
        "",
        "**Size:** width, height and length are set once, in **Video size**; every node that needs them follows "
        "(width and height multiples of 16, length 4n+1).",
        "",
        *_memory_lines(name),
    ]
    if name.endswith(CACHE_VARIANT):
        lines += ["", "**WanVACE Cache Options** skips steps with Cache-DiT: faster, slightly different."]
    if name.endswith(LONG_VARIANT):
        lines += [
            "",
            f"**Long video:** {LONG_LENGTH} frames as {CONTEXT_WINDOWS['context_length']}-frame context windows "
            f"overlapping {CONTEXT_WINDOWS['context_overlap']} (**WanVACE Context Windows**): memory follows the "
            "window, and each window gets its part of the control video and masks.",
        ]
    if variant == LIGHTNING_VARIANT:
        high, low = LORA_FILES[LIGHTNING_VARIANT]
        lines += [
            "",
            f"**LoRA** (~{_gb(2 * MODEL_FILES[high.lora_name].gigabytes)}, offered by the missing-models dialog): "
            f"lightx2v's Lightning 4-step files `{high.lora_name}` and `{low.lora_name}` in `ComfyUI/models/loras/`, "
            "one per expert (strength 1 there, 0 on the other). The sampler then needs the 4-step distill schedule "
            "at shift 5 and cfg 1 (no negative pass): about 10x faster than 20 steps with cfg 5. **WanVACE Guidance "
            "Options** gives the negative prompt its say again through NAG (scale 11), at a few percent of a step.",
        ]
    if variant == COMFY_SAMPLER_VARIANT:
        lines += [
            "",
            "**ComfyUI's sampler:** **KSamplerSelect** picks any of ComfyUI's samplers and **WanVACE Scheduler** any "
            "of its schedules (here euler, simple, shift 8: what ComfyUI's own Wan2.2 templates run); the sampler's "
            "steps, shift and scheduler then follow the schedule. SplitSigmas and the other sigma nodes work on it.",
        ]
    if variant == STYLE_LORA_VARIANT:
        (style,) = LORA_FILES[STYLE_LORA_VARIANT]
        lines += [
            "",
            f"**LoRA:** `{style.lora_name}` (~{_gb(MODEL_FILES[style.lora_name].gigabytes)}, a cinematic look; offered "
            "by the missing-models dialog) stands for your own Wan2.1/2.2 14B LoRA in `ComfyUI/models/loras/`. A "
            "Wan2.2 LoRA of a high-noise and a low-noise file takes two chained loaders, each 0 on the other expert.",
        ]
    lines += ["", f"Output: `output/WanVACE/{name}_*.mp4`, {WIDTH}x{HEIGHT}, {length} frames at 16 fps."]
    return "\n".join(lines)


_INPUT_GROUP_TITLES = {
    "i2v": "Input: first frame",
    "flf2v": "Inputs: first and last frame",
    "r2v": "Inputs: reference images",
    "v2v": "Input: control video",
    "inpaint": "Inputs: source video and mask",
    "outpaint": "Input: source video",
    "extension": "Input: clip to extend",
}


def _build(name: str) -> _Graph:
    if name not in WORKFLOWS:
        raise KeyError(f"unknown workflow {name!r}; one of {', '.join(WORKFLOWS)}")
    task = task_of(name)
    variant = variant_of(name)
    length = length_of(name)
    graph = _Graph()
    layout = graph.layout
    files = SINGLE_FILES.get(variant)
    offload_target: str
    if files is None:
        loader = graph.add("WanVACEModelLoader", model_name=REAL_MODEL, dtype="bf16", at=("model", 0))
        offload_target = loader
    else:
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
        layout.models[loader] = tuple(MODEL_FILES[file] for file in files.values() if not file.endswith(".gguf"))
        offload_target = "" if offload else loader
    optional: dict = {}
    if task == "i2v":
        image = graph.add("LoadImage", "first frame", image=EXAMPLE_INPUTS["first"], at=("inputs", 0))
        control = _control_video(graph, {"images": _out(image)}, 1, length, use="keep")
        optional |= {"control_video": _out(control, 0), "control_masks": _out(control, 1)}
    elif task == "flf2v":
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
        optional |= {"control_video": _out(frames, 0), "control_masks": _out(frames, 1)}
    elif task == "r2v":
        first = graph.add("LoadImage", "reference 1", image=EXAMPLE_INPUTS["ref1"], at=("inputs", 0))
        second = graph.add("LoadImage", "reference 2", image=EXAMPLE_INPUTS["ref2"], at=("inputs", 0))
        optional["reference_images"] = _out(
            graph.add("ImageBatch", "both references", image1=_out(first), image2=_out(second), at=("inputs", 1))
        )
    elif task == "v2v":
        video = graph.add("LoadVideo", "control video", file=EXAMPLE_INPUTS["control"], at=("inputs", 0))
        control = _control_video(graph, {"video": _out(video)}, 1, length)
        optional["control_video"] = _out(control, 0)
    elif task == "inpaint":
        video = graph.add("LoadVideo", "source video", file=EXAMPLE_INPUTS["source"], at=("inputs", 0))
        mask = graph.add(
            "LoadImageMask",
            "inpaint mask (white = repaint)",
            image=EXAMPLE_INPUTS["mask"],
            channel="red",
            at=("inputs", 0),
        )
        control = _control_video(graph, {"video": _out(video)}, 1, length, masks=_out(mask))
        optional |= {"control_video": _out(control, 0), "control_masks": _out(control, 1)}
    elif task == "outpaint":
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
        optional |= {"control_video": _out(canvas, 0), "control_masks": _out(canvas, 1)}
    elif task == "extension":
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
        optional |= {"control_video": _out(control, 0), "control_masks": _out(control, 1)}
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
    graph.size_inputs(conditioning, "width", "height", "length")
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
    # The LoRAs change only the sampling: conditioning and decoding use the loader's model directly.
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
        layout.models[sampling_model] = (MODEL_FILES[lora.lora_name],)
    sampling = {"steps": STEPS, "cfg": 5.0, "cfg_low_noise": 5.0, "shift": 0.0, "scheduler": "unipc"}
    if variant == LIGHTNING_VARIANT:
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
        **options,
        at=("sampling", 0),
    )
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

    # Graph-editor-only nodes: the three primitives, and the offload options a user switches on.
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

    layout.groups["size"] = "Video size"
    layout.groups["offload"] = "Offload" if variant == GGUF_VARIANT else "Offload (off: Ctrl+M)"
    layout.groups["model"] = "Model"
    if variant in LORA_FILES:
        layout.groups["lora"] = "LoRAs (sampling only)"
    if task in _INPUT_GROUP_TITLES:
        layout.groups["inputs"] = _INPUT_GROUP_TITLES[task]
    layout.groups["prompt"] = "Prompt and VACE conditioning"
    if options:
        layout.groups["options"] = {
            CACHE_VARIANT: "Step cache (Cache-DiT)",
            LONG_VARIANT: "Context windows",
            LIGHTNING_VARIANT: "Guidance",
            COMFY_SAMPLER_VARIANT: "ComfyUI sampler and schedule",
        }[variant]
    layout.groups["sampling"] = "Sampling"
    layout.groups["output"] = "Decode and save"
    _page(layout)
    return graph


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
    """The API-format graph of one shipped workflow (a task, optionally with the `_cache` variant)."""
    return _build(name).nodes


def build_ui_layout(name: str) -> UiLayout:
    """Groups, placement, note and graph-editor-only nodes of one shipped workflow in the graph editor."""
    layout = _build(name).layout
    layout.note = _note(name)
    return layout


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
