"""Streams a diffusers-format WanVACE pipeline folder into memory.

Each weight-bearing component is built on the meta device (parameters only; buffers such as the
RoPE tables are computed normally) and then filled tensor by tensor from memory-mapped
safetensors, cast straight to its final dtype and device. No component ever exists twice in
memory, and pickle files are never opened.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open

from .errors import WanVACEModelFolderError
from .folder import ComponentFiles, inspect_pipeline_folder
from .model import WanVACEModel

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ALLOWED_LIBRARIES = {"diffusers", "transformers"}


def _component_class(model_index: dict, name: str):
    library, class_name = model_index[name]
    if library not in _ALLOWED_LIBRARIES:
        raise WanVACEModelFolderError(
            f"model_index.json names component '{name}' from library {library!r}; only diffusers and "
            "transformers classes are loaded."
        )
    try:
        return getattr(importlib.import_module(library), class_name)
    except AttributeError as error:
        raise WanVACEModelFolderError(
            f"model_index.json names {library}.{class_name} for '{name}', which this {library} version lacks; "
            f"upgrade {library}."
        ) from error


def _fp32_module_names(module: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """Module names the library keeps in fp32 at this dtype, mirroring diffusers/transformers."""
    names: set[str] = set()
    is_transformers_model = type(module).__module__.startswith("transformers")
    if dtype in (torch.float16, torch.bfloat16):
        names |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if not is_transformers_model or dtype == torch.float16:
            names |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
    return names


def _build_on_meta(cls, folder: Path) -> torch.nn.Module:
    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "from_config") and hasattr(cls, "config_name"):
            config = cls.load_config(folder)
            return cls.from_config(config)
        config_cls = cls.config_class
        return cls(config_cls.from_pretrained(folder))


def load_component(cls, files: ComponentFiles, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Builds `cls` on meta and fills every tensor from `files.weight_files`, cast to `dtype`."""
    module = _build_on_meta(cls, files.folder)
    fp32_names = _fp32_module_names(module, dtype)
    expected = set(module.state_dict(keep_vars=True).keys())
    seen: set[str] = set()
    for path in files.weight_files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                if key not in expected:
                    raise WanVACEModelFolderError(
                        f"{path} holds tensor '{key}', which {cls.__name__} does not have; this file belongs to "
                        "another model or version."
                    )
                tensor = handle.get_tensor(key)
                if tensor.is_floating_point():
                    keep_fp32 = any(part in fp32_names for part in key.split("."))
                    tensor = tensor.to(torch.float32 if keep_fp32 else dtype)
                set_module_tensor_to_device(module, key, device, value=tensor, dtype=tensor.dtype)
                seen.add(key)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    still_empty = [name for name, tensor in module.state_dict(keep_vars=True).items() if tensor.is_meta]
    if still_empty:
        shown = ", ".join(still_empty[:5]) + (" ..." if len(still_empty) > 5 else "")
        raise WanVACEModelFolderError(
            f"{files.folder} lacks {len(still_empty)} tensor(s) of {cls.__name__} ({shown}); the download is "
            "incomplete or the files belong to another model."
        )
    # Buffers (RoPE tables) were computed on the CPU at their library-chosen dtype; only move them.
    for name, buffer in list(module.named_buffers()):
        if buffer.device != device:
            set_module_tensor_to_device(module, name, device, value=buffer)
    return module.eval().requires_grad_(False)


def load_pipeline(path: str | Path, dtype: str = "bf16", device: str | torch.device = "cpu") -> WanVACEModel:
    """Loads a WanVACE pipeline folder (Wan2.2 two-expert or Wan2.1 single transformer)."""
    if dtype not in DTYPES:
        raise WanVACEModelFolderError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}.")
    torch_dtype = DTYPES[dtype]
    device = torch.device(device)
    layout = inspect_pipeline_folder(path)
    model_index = json.loads((layout.path / "model_index.json").read_text())
    modules = {
        name: load_component(_component_class(model_index, name), files, torch_dtype, device)
        for name, files in layout.components.items()
    }
    tokenizer_cls = _component_class(model_index, "tokenizer")
    tokenizer = tokenizer_cls.from_pretrained(layout.path / "tokenizer")
    scheduler_cls = _component_class(model_index, "scheduler")
    scheduler_config = scheduler_cls.load_config(layout.path / "scheduler")
    logger.info("Loaded WanVACE pipeline %s (%s, %s)", layout.path, dtype, ", ".join(modules))
    return WanVACEModel(
        source=layout.path,
        dtype=torch_dtype,
        device=device,
        tokenizer=tokenizer,
        text_encoder=modules["text_encoder"],
        vae=modules["vae"],
        transformer=modules.get("transformer"),
        transformer_2=modules.get("transformer_2"),
        scheduler_config=dict(scheduler_config),
        boundary_ratio=layout.boundary_ratio,
    )
