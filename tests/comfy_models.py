"""The ComfyUI model folders the integration suite's server gets besides the diffusers folders: the tiny
model's single files under their real names, an original release folder, and bad files for error tests."""

from __future__ import annotations

from pathlib import Path

# The single files of the shipped fp8 and GGUF workflows (under their real names) and a few more layouts.
SINGLE_FILE_FORMATS = ("bf16", "fp8_scaled", "split", "Q8_0", "umt5_fp16", "umt5_fp8_scaled", "vae")


ORIGINAL_RELEASE = "Wan2.2-VACE-Fun-A14B"
BAD_EXPERT, TRUNCATED_EXPERT = "sd_vae_not_wan.safetensors", "wan2.2_fun_vace_high_noise_14B_truncated.safetensors"


def write_single_files(models_root: Path) -> dict:
    """ComfyUI's model folders with the tiny model's single files, an original release folder and bad files."""
    from single_files import comfy_components, non_wan_file, truncate_copy, write_comfy_models

    from tests.original_release import write_original_release

    components = comfy_components()
    written = write_comfy_models(models_root, components, formats=SINGLE_FILE_FORMATS)
    experts = models_root / "diffusion_models"
    non_wan_file(experts / BAD_EXPERT)
    non_wan_file(models_root / "vae" / BAD_EXPERT)  # an SD VAE picked where the Wan VAE belongs
    truncate_copy(written["bf16"]["high"], experts / TRUNCATED_EXPERT)
    write_original_release(models_root / "diffusers" / ORIGINAL_RELEASE, components)
    return written
