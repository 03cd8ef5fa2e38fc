"""The original alibaba-pai/Wan2.2-VACE-Fun-A14B release (VideoX-Fun) as a pipeline folder: expert folders named by
noise level, the Wan T5 and VAE as .pth pickles, and the umt5 tokenizer. It is read as the single files it holds
(`single_file.read_expert_files`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import WanVACEModelFolderError
from .folder_layout import walk_model_folders
from .single_file import ExpertFiles

ORIGINAL_TEXT_ENCODER = "models_t5_umt5-xxl-enc-bf16.pth"
ORIGINAL_VAE = "Wan2.1_VAE.pth"
ORIGINAL_TOKENIZER = Path("google") / "umt5-xxl"


def is_original_folder(path: str | Path) -> bool:
    path = Path(path)
    return (
        (path / "high_noise_model").is_dir() and (path / "low_noise_model").is_dir() and (path / ORIGINAL_VAE).exists()
    )


def original_folder_files(path: str | Path, allow_pth: bool) -> ExpertFiles:
    """The `ExpertFiles` of an original Wan2.2-VACE-Fun-A14B folder; its .pth files are read only with `allow_pth`."""
    path = Path(path)
    text_encoders = sorted(path.glob("models_t5_*.pth")) or [path / ORIGINAL_TEXT_ENCODER]
    if not allow_pth:
        raise WanVACEModelFolderError(
            f"{path} is the original Wan2.2-VACE-Fun-A14B release, whose text encoder and VAE are .pth pickles "
            f"({text_encoders[0].name}, {ORIGINAL_VAE}). Turn on allow_pth_weights to read them weights-only (only "
            "for files from a source you trust), or use WanVACE Experts Loader with ComfyUI's umt5_xxl and "
            "wan_2.1_vae safetensors over this folder's expert folders."
        )
    return ExpertFiles(
        high_noise_model=path / "high_noise_model",
        low_noise_model=path / "low_noise_model",
        text_encoder=text_encoders[0],
        vae=path / ORIGINAL_VAE,
        tokenizer=path / ORIGINAL_TOKENIZER,
        allow_pth=True,
    )


def find_original_folders(roots) -> list[str]:
    """Names of sub-folders (relative to one of `roots`, linked folders included) that hold an original
    Wan2.2-VACE-Fun release, sorted."""
    return sorted(
        {
            name
            for root, name, files in walk_model_folders(roots)
            if name != "." and ORIGINAL_VAE in files and is_original_folder(root / name)
        }
    )
