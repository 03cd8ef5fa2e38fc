"""The ComfyUI model folders the integration suite's server gets besides the diffusers folders: the tiny
model's single files under their real names, an original release folder, bad files for error tests, and tiny
LoRA files under the names the shipped LoRA workflows use."""

from __future__ import annotations

from pathlib import Path

# The single files of the shipped fp8 and GGUF workflows (under their real names) and a few more layouts.
SINGLE_FILE_FORMATS = ("bf16", "fp8_scaled", "split", "Q8_0", "umt5_fp16", "umt5_fp8_scaled", "vae")


ORIGINAL_RELEASE = "Wan2.2-VACE-Fun-A14B"
BAD_EXPERT, TRUNCATED_EXPERT = "sd_vae_not_wan.safetensors", "wan2.2_fun_vace_high_noise_14B_truncated.safetensors"


def write_single_files(models_root: Path) -> dict:
    """ComfyUI's model folders with the tiny model's single files, an original release folder and bad files."""
    from tests.support.original_release import write_original_release
    from tests.support.single_files import comfy_components, non_wan_file, truncate_copy, write_comfy_models

    components = comfy_components()
    written = write_comfy_models(models_root, components, formats=SINGLE_FILE_FORMATS)
    experts = models_root / "diffusion_models"
    non_wan_file(experts / BAD_EXPERT)
    non_wan_file(models_root / "vae" / BAD_EXPERT)  # an SD VAE picked where the Wan VAE belongs
    truncate_copy(written["bf16"]["high"], experts / TRUNCATED_EXPERT)
    write_original_release(models_root / "diffusers" / ORIGINAL_RELEASE, components)
    return written


def write_lora_files(models_root: Path, tiny_folder: Path) -> dict[str, Path]:
    """models/loras with a tiny LoRA for the model in `tiny_folder` under each name a shipped workflow picks.

    The Lightning files are written the way lightx2v's are (ComfyUI names, low-rank pairs plus diff/diff_b and
    norm differences), the style LoRA as a kohya/ComfyUI file; each file gets its own random tensors.
    """
    from tests.support.lora_files import write_lora_file
    from wanvace_core import load_pipeline
    from workflow_graphs import LIGHTNING_VARIANT, LORA_FILES

    expert = load_pipeline(tiny_folder, "fp32").transformer
    written = {}
    for variant, uses in LORA_FILES.items():
        lightning = variant == LIGHTNING_VARIANT
        for seed, use in enumerate(uses, start=len(written)):
            written[use.lora_name] = write_lora_file(
                models_root / "loras" / use.lora_name,
                expert,
                "lightx2v" if lightning else "comfy",
                rank=4,
                seed=seed,
                alpha=4.0 if lightning else 2.0,
                diffs=lightning,
            )
    return written
