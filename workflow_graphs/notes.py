"""The Markdown note beside each shipped workflow in the graph editor: the model and where to get it, the inputs to
replace, the GPU memory it needs (from the sampler's own activation estimate), and what comes out."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from .catalog import (
    CACHE_VARIANT,
    COMFY_SAMPLER_VARIANT,
    CONTEXT_WINDOWS,
    EXAMPLE_INPUTS,
    EXAMPLE_VIDEO_FRAMES,
    EXTENSION_GIVEN_FRAMES,
    FOLDER_GIGABYTES,
    FP8_VARIANT,
    GGUF_VARIANT,
    HEIGHT,
    LENGTH,
    LIGHTNING_VARIANT,
    LONG_LENGTH,
    LONG_VARIANT,
    LORA_FILES,
    MODEL_FILES,
    MODEL_REPO,
    MODEL_URL,
    QUANTSTACK_REPO,
    REAL_MODEL,
    SINGLE_FILES,
    STYLE_LORA_VARIANT,
    WIDTH,
    WORKFLOW_TITLES,
    length_of,
    task_of,
    variant_of,
)


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
            f"GGUF Q8_0, ~{_gb(total)}): the experts from [QuantStack's repository]({QUANTSTACK_REPO}) "
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


def note(name: str) -> str:
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
