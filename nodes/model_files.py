"""File and folder inputs of the loaders: only a name the node lists for its ComfyUI folder type, resolved through
ComfyUI's `folder_paths` (which also covers extra_model_paths.yaml folders and links users make inside them).

A name is checked against the listing before anything is opened or stat-ed, so `..`, absolute paths and unlisted
names are refused without touching, or naming, anything outside the model folders.
"""

from __future__ import annotations

import os
from pathlib import Path

import folder_paths

from ..wanvace_core import WanVACEInputError
from ..wanvace_core.load.folder_layout import walk_model_folders

WEIGHT_SUFFIXES = (".safetensors", ".sft", ".gguf")


def folder_roots(folder_type: str) -> list[str]:
    if folder_type not in folder_paths.folder_names_and_paths:
        # ComfyUI releases without this folder type still get models/<folder_type>.
        folder_paths.add_model_folder_path(folder_type, os.path.join(folder_paths.models_dir, folder_type))
    return folder_paths.get_folder_paths(folder_type)


def list_weight_files(folder_type: str) -> list[str]:
    """Safetensors and GGUF files under a ComfyUI model folder type (ComfyUI's own lists leave .gguf out)."""
    return sorted(
        f"{name}/{file}" if name != "." else file
        for _root, name, files in walk_model_folders(folder_roots(folder_type))
        for file in files
        if file.lower().endswith(WEIGHT_SUFFIXES)
    )


_REPACKAGED_22 = "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged"
_REPACKAGED_21 = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged"
# Where the files of each folder type come from (README, "Weights"); a refusal of a name that is not there says it.
_DOWNLOADS = {
    "diffusers": "download the pipeline folder https://huggingface.co/Pyros13/Wan2.2-VACE-Fun-A14B-Diffusers into "
    "ComfyUI/models/diffusers/, keeping its folder (models/diffusers/Wan2.2-VACE-Fun-A14B-Diffusers/"
    "model_index.json), or use WanVACE Experts Loader with single files",
    "diffusion_models": f"download wan2.2_fun_vace_high_noise_14B_fp8_scaled.safetensors and "
    f"wan2.2_fun_vace_low_noise_14B_fp8_scaled.safetensors (or the bf16 ones) from {_REPACKAGED_22} "
    "(split_files/diffusion_models/) into ComfyUI/models/diffusion_models/",
    "text_encoders": f"download umt5_xxl_fp8_e4m3fn_scaled.safetensors (or umt5_xxl_fp16) from {_REPACKAGED_21} "
    "(split_files/text_encoders/) into ComfyUI/models/text_encoders/",
    "vae": f"download wan_2.1_vae.safetensors from {_REPACKAGED_21} (split_files/vae/) into ComfyUI/models/vae/",
    "loras": "put the LoRA file into ComfyUI/models/loras/ (the shipped Lightning workflow's two LoRAs are "
    f"wan2.2_t2v_lightx2v_4steps_lora_v1.1_{{high,low}}_noise.safetensors from {_REPACKAGED_22}, split_files/loras/)",
}
_VACE_MODULES = (
    "download Kijai's Wan2_2_Fun_VACE_module_A14B_{HIGH,LOW}_bf16.safetensors from "
    "https://huggingface.co/Kijai/WanVideo_comfy (Fun/VACE/) into ComfyUI/models/diffusion_models/, or choose none "
    "with a whole VACE expert"
)


def where_to_get(input_name: str, folder_type: str) -> str:
    """Where the files of input `input_name` (listing `folder_type`) come from and which folder they go into."""
    if input_name.endswith("_vace_module"):
        return _VACE_MODULES
    return _DOWNLOADS.get(folder_type, f"put the file into ComfyUI/models/{folder_type}/")


def refuse_unlisted(input_name: str, name: object, listed: list[str], folder_type: str) -> str:
    """`name` if it is one of `listed`; the refusal echoes only what the user sent, and says where to get the file."""
    if not isinstance(name, str) or name not in listed:
        raise WanVACEInputError(
            f"{input_name}={name!r} is not in ComfyUI's models/{folder_type} folder ({len(listed)} listed there); "
            f"{where_to_get(input_name, folder_type)}, then refresh ComfyUI (press R) and pick it."
        )
    return name


def resolve_listed_file(input_name: str, name: object, listed: list[str], folder_type: str) -> Path:
    """The full path of a listed file name, found through `folder_paths.get_full_path`."""
    name = refuse_unlisted(input_name, name, listed, folder_type)
    path = folder_paths.get_full_path(folder_type, name)
    if path is None:  # listed a moment ago, gone now
        raise WanVACEInputError(f"{input_name}={name!r} is no longer in models/{folder_type}; refresh and pick again.")
    return Path(path)


def resolve_listed_folder(
    input_name: str, name: object, listed: list[str], folder_type: str, markers: tuple[str, ...]
) -> Path:
    """The full path of a listed model folder, found through `folder_paths.get_full_path` of one of its `markers`."""
    name = refuse_unlisted(input_name, name, listed, folder_type)
    for marker in markers:
        path = folder_paths.get_full_path(folder_type, f"{name}/{marker}")
        if path is not None:
            return Path(path).parent
    raise WanVACEInputError(f"{input_name}={name!r} is no longer in models/{folder_type}; refresh and pick again.")
