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
from ..wanvace_core.load.folder import walk_model_folders

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


def refuse_unlisted(input_name: str, name: object, listed: list[str], folder_type: str) -> str:
    """`name` if it is one of `listed`; the refusal echoes only what the user sent."""
    if not isinstance(name, str) or name not in listed:
        raise WanVACEInputError(
            f"{input_name}={name!r} is not one of the {len(listed)} names listed for models/{folder_type}; pick one "
            f"from the list (put new files into ComfyUI's models/{folder_type} folder and refresh)."
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
