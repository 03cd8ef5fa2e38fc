"""Inspects a diffusers-format WanVACE pipeline folder without loading any weights.

Everything here is cheap (JSON and safetensors headers only), so ComfyUI can call it while it
validates a prompt and refuse a bad folder before any heavy work starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import WanVACEModelFolderError
from .tensor_files import read_safetensors_header

PIPELINE_CLASS = "WanVACEPipeline"
WEIGHT_COMPONENTS = ("text_encoder", "vae", "transformer", "transformer_2")
REQUIRED_COMPONENTS = ("text_encoder", "tokenizer", "vae", "scheduler")
TRANSFORMER_COMPONENTS = ("transformer", "transformer_2")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class ComponentFiles:
    """One weight-bearing component: its folder, config and safetensors shards."""

    name: str
    folder: Path
    weight_files: tuple[Path, ...]


@dataclass(frozen=True)
class PipelineFolder:
    """What a validated pipeline folder holds."""

    path: Path
    boundary_ratio: float | None
    components: dict[str, ComponentFiles]


def _listed_components(model_index: dict) -> set[str]:
    # model_index.json lists a missing optional component as [null, null].
    return {
        name
        for name, value in model_index.items()
        if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[0] is not None
    }


def check_safetensors_file(path: Path) -> None:
    """Raises if `path` is not a complete safetensors file (a truncated download, a pickle)."""
    data_start, header = read_safetensors_header(path)
    expected = data_start + max((entry["data_offsets"][1] for entry in header.values()), default=0)
    size = path.stat().st_size
    if size < expected:
        raise WanVACEModelFolderError(
            f"Weight file {path} is truncated: {size} bytes on disk, its header needs {expected}; "
            "re-download or re-convert this file."
        )


def _weight_files(component: str, folder: Path) -> tuple[Path, ...]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        index = json.loads(indexes[0].read_text())
        names = sorted(set(index.get("weight_map", {}).values()))
        files = tuple(folder / name for name in names)
        missing = [str(file) for file in files if not file.is_file()]
        if missing:
            raise WanVACEModelFolderError(
                f"Component '{component}' lists shards that are missing: {', '.join(missing)}; "
                "finish the download of this folder."
            )
        return files
    singles = sorted(folder.glob("*.safetensors"))
    if len(singles) == 1:
        return (singles[0],)
    if len(singles) > 1:
        raise WanVACEModelFolderError(
            f"Component '{component}' in {folder} has several .safetensors files "
            f"({', '.join(p.name for p in singles)}) but no *.safetensors.index.json; keep one file or add the index."
        )
    pickles = [p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES]
    if pickles:
        raise WanVACEModelFolderError(
            f"Component '{component}' in {folder} only has pickle weights ({', '.join(pickles)}). Pickle files can "
            "run code when loaded and are refused; download the .safetensors variant."
        )
    raise WanVACEModelFolderError(
        f"Component '{component}' in {folder} has no .safetensors weights; finish the download of this folder."
    )


def inspect_pipeline_folder(path: str | Path, *, check_weights: bool = True) -> PipelineFolder:
    """Validates a WanVACE pipeline folder and lists its weight files.

    Raises `WanVACEModelFolderError` naming the folder or file and the fix.
    """
    path = Path(path)
    if not path.is_dir():
        raise WanVACEModelFolderError(f"Model folder {path} does not exist; put the pipeline folder there.")
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise WanVACEModelFolderError(
            f"{path} is not a diffusers pipeline folder (no model_index.json); download a diffusers-format "
            "WanVACE pipeline such as Wan2.2-VACE-Fun-A14B-Diffusers."
        )
    try:
        model_index = json.loads(index_path.read_text())
    except ValueError as error:
        raise WanVACEModelFolderError(f"{index_path} is not valid JSON ({error}); re-download it.") from error
    class_name = model_index.get("_class_name")
    if class_name != PIPELINE_CLASS:
        raise WanVACEModelFolderError(
            f"{path} holds a {class_name!r} pipeline, not {PIPELINE_CLASS}; choose a WanVACE folder such as "
            "Wan2.2-VACE-Fun-A14B-Diffusers or Wan2.1-VACE-14B-diffusers."
        )
    listed = _listed_components(model_index)
    missing = [name for name in REQUIRED_COMPONENTS if name not in listed or not (path / name).is_dir()]
    if missing:
        raise WanVACEModelFolderError(
            f"{path} lacks the component folder(s) {', '.join(missing)}; finish the download of this folder."
        )
    transformers = [name for name in TRANSFORMER_COMPONENTS if name in listed]
    if not transformers:
        raise WanVACEModelFolderError(f"{path} has neither 'transformer' nor 'transformer_2'; it cannot denoise.")
    components: dict[str, ComponentFiles] = {}
    for name in WEIGHT_COMPONENTS:
        if name not in listed:
            continue
        folder = path / name
        if not (folder / "config.json").is_file():
            raise WanVACEModelFolderError(f"{folder / 'config.json'} is missing; finish the download of this folder.")
        files = _weight_files(name, folder)
        if check_weights:
            for file in files:
                check_safetensors_file(file)
        components[name] = ComponentFiles(name=name, folder=folder, weight_files=files)
    boundary_ratio = model_index.get("boundary_ratio")
    if boundary_ratio is not None and not 0.0 <= float(boundary_ratio) <= 1.0:
        raise WanVACEModelFolderError(f"{index_path} has boundary_ratio={boundary_ratio}; it must lie in [0, 1].")
    if len(transformers) == 2 and boundary_ratio is None:
        raise WanVACEModelFolderError(
            f'{index_path} lists two experts but no boundary_ratio; add "boundary_ratio": 0.875 (Wan2.2).'
        )
    return PipelineFolder(
        path=path,
        boundary_ratio=None if boundary_ratio is None else float(boundary_ratio),
        components=components,
    )


def walk_model_folders(roots: list[str | Path]):
    """`(root, relative name, file names)` for every folder under each of `roots`, following linked folders.

    Users link weights kept on another disk into ComfyUI's model folders, and `Path.glob` does not descend
    into linked folders. A folder reached twice (a link loop, or two links to one place) is walked once.
    """
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            continue
        seen: set[str] = set()
        for directory, subfolders, names in os.walk(root, followlinks=True):
            real = os.path.realpath(directory)
            if real in seen:
                subfolders[:] = []
                continue
            seen.add(real)
            yield root, Path(directory).relative_to(root).as_posix(), names


def find_pipeline_folders(roots: list[str | Path]) -> list[str]:
    """Names of sub-folders (relative to one of `roots`, linked folders included) that hold a model_index.json."""
    return sorted(
        {name for _root, name, files in walk_model_folders(roots) if name != "." and "model_index.json" in files}
    )
