"""What the shipped workflows are and what they name: their tasks and variants, titles, prompts and sizes, the
example inputs, the model and LoRA files with their download addresses, and the sampling presets of the variants."""

from __future__ import annotations

from dataclasses import dataclass

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
QUANTSTACK_REPO = "https://huggingface.co/QuantStack/Wan2.2-VACE-Fun-A14B-GGUF"
_QUANTSTACK = f"{QUANTSTACK_REPO}/resolve/main"
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
