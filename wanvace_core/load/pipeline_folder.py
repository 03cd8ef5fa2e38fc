"""Streams a diffusers-format WanVACE pipeline folder into memory.

Each weight-bearing component is built on the meta device (parameters only; buffers such as the
RoPE tables are computed normally) and then filled tensor by tensor from its safetensors files:

- a tensor whose file dtype is already its final dtype on the CPU is used in place, as a view of the
  memory-mapped (copy-on-write) file: it costs no private memory and is paged in on first use;
- every other tensor (cast to another dtype, or bound for an accelerator) is allocated once in its
  final dtype and device and cast into from 64 MiB memory-mapped windows of the file, each unmapped
  once used, so neither a copy in the file's dtype nor the file's pages stay resident.

No component ever exists twice in memory, and pickle files are never opened. While a component
loads, private memory grows by its size in its final dtype (less what is used in place) and
file-backed memory by at most one window; `tests/test_load_memory.py` checks this and
`bench/bench_load.py` compares it with diffusers' `from_pretrained`.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open

from ..errors import WanVACEModelFolderError
from .folder_layout import ComponentFiles, inspect_pipeline_folder
from .loaded import EXPERT_NAMES, LoadedPipeline
from .tensor_files import SAFETENSORS_DTYPES, read_safetensors_header, set_tensor, stream_into

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ALLOWED_LIBRARIES = {"diffusers", "transformers"}


def component_class(model_index: dict, name: str):
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


def fp32_module_names(module: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """Module names the library keeps in fp32 at this dtype, mirroring diffusers/transformers."""
    names: set[str] = set()
    is_transformers_model = type(module).__module__.startswith("transformers")
    if dtype in (torch.float16, torch.bfloat16):
        names |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if not is_transformers_model or dtype == torch.float16:
            names |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
    return names


def build_on_meta(cls, folder: Path) -> torch.nn.Module:
    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "from_config") and hasattr(cls, "config_name"):
            config = cls.load_config(folder)
            return cls.from_config(config)
        config_cls = cls.config_class
        return cls(config_cls.from_pretrained(folder))


def meta_stand_in(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` with meta parameters in `dtype`, for experts that live in parallel workers: it carries the config
    and `transformer_dtype` (what the conditioning is cast to) and costs no memory. Never run."""
    for name, param in list(module.named_parameters()):
        if param.is_floating_point():
            set_tensor(module, name, torch.empty_like(param, dtype=dtype, device="meta"))
    return module.eval().requires_grad_(False)


def _load_file(module, path: Path, cls, placeholders: dict, fp32_names: set[str], dtype, device) -> None:
    """Fills the tensors `path` holds into `module`; `placeholders` are its meta tensors by state-dict key."""
    data_start, header = read_safetensors_header(path)
    file_size = path.stat().st_size
    foreign = [key for key in header if key not in placeholders]
    if foreign:
        raise WanVACEModelFolderError(
            f"{path} holds tensor '{foreign[0]}', which {cls.__name__} does not have; this file belongs to "
            "another model or version."
        )
    mapped = None  # the whole file is memory-mapped only if some tensor is used in place
    try:
        with open(path, "rb", buffering=0) as handle:
            for key, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                source_dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
                if source_dtype is None:
                    raise WanVACEModelFolderError(
                        f"{path} stores '{key}' as {entry['dtype']}, which is not supported; convert it to BF16, "
                        "F16 or F32."
                    )
                shape = tuple(entry["shape"])
                begin, end = entry["data_offsets"]
                if end - begin != math.prod(shape) * source_dtype.itemsize or data_start + end > file_size:
                    raise WanVACEModelFolderError(
                        f"{path} has a corrupt entry for tensor '{key}'; re-download or re-convert this file."
                    )
                target_dtype = source_dtype
                if source_dtype.is_floating_point:
                    keep_fp32 = any(part in fp32_names for part in key.split("."))
                    target_dtype = torch.float32 if keep_fp32 else dtype
                placeholder = placeholders[key]
                if placeholder.shape != shape:
                    raise WanVACEModelFolderError(
                        f"{path} stores '{key}' with shape {list(shape)}, {cls.__name__} expects "
                        f"{list(placeholder.shape)}; this file belongs to another model size."
                    )
                if target_dtype == source_dtype and device.type == "cpu":
                    # Used in place: a view of the (copy-on-write) file mapping, no private copy at all.
                    if mapped is None:
                        mapped = safe_open(str(path), framework="pt", device="cpu")
                    tensor = mapped.get_tensor(key)
                else:
                    # Cast (or moved): allocated once in its final dtype and device and cast into from
                    # windows of the file, so neither a copy in the file's dtype nor the file's pages stay.
                    tensor = torch.empty(shape, dtype=target_dtype, device=device)
                    if end > begin:
                        stream_into(handle.fileno(), data_start + begin, end - begin, source_dtype, tensor)
                set_tensor(module, key, tensor)
    finally:
        mapped = None  # tensors used in place keep their mapping alive; the handle itself goes here


def load_component(cls, files: ComponentFiles, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Builds `cls` on meta and fills every tensor from `files.weight_files`, cast to `dtype`.

    A tensor whose file dtype already is its final dtype on the CPU is used in place from the memory-mapped
    file (no private memory). Every other tensor is allocated once in its final dtype and device and cast
    into from mapped windows of the file, so private memory grows by exactly the component's size in its
    final dtype and file-backed memory by at most one window.
    """
    device = torch.device(device)
    module = build_on_meta(cls, files.folder)
    _fill(module, files, dtype, device)
    # Buffers (RoPE tables) were computed on the CPU at their library-chosen dtype; only move them.
    for name, buffer in list(module.named_buffers()):
        if buffer.device != device:
            set_tensor(module, name, buffer.to(device))
    return module.eval().requires_grad_(False)


def _fill(module: torch.nn.Module, files: ComponentFiles, dtype: torch.dtype, device: torch.device) -> None:
    """Streams every tensor of `files` into `module`, whose parameters may be meta placeholders."""
    cls = type(module)
    fp32_names = fp32_module_names(module, dtype)
    placeholders = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for path in files.weight_files:
            _load_file(module, Path(path), cls, placeholders, fp32_names, dtype, device)
    finish_filling(module, str(files.folder), "the download is incomplete or the files belong to another model")


def finish_filling(module: torch.nn.Module, where: str, remedy: str) -> None:
    """Ties shared weights, then refuses a module that still has meta tensors (a file lacked them)."""
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    still_empty = [name for name, tensor in module.state_dict(keep_vars=True).items() if tensor.is_meta]
    if still_empty:
        shown = ", ".join(still_empty[:5]) + (" ..." if len(still_empty) > 5 else "")
        raise WanVACEModelFolderError(
            f"{where} lacks {len(still_empty)} tensor(s) of {type(module).__name__} ({shown}); {remedy}."
        )


def folder_file_stamps(layout) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every weight file of a pipeline folder, to tell later whether they changed."""
    stamps = {}
    for files in layout.components.values():
        for path in files.weight_files:
            status = Path(path).stat()
            stamps[str(path)] = (status.st_size, status.st_mtime_ns)
    return stamps


class FolderWeights:
    """The `WeightSource` of a pipeline folder: reads dropped weights back exactly as they were loaded.

    A reload must read the same weights: if a file's size or mtime changed since the load, it refuses.
    """

    def __init__(self, layout, dtype: torch.dtype) -> None:
        self.layout = layout
        self.dtype = dtype
        self.stamps = folder_file_stamps(layout)

    def refill(self, name: str, module: torch.nn.Module, device: torch.device) -> None:
        layout = inspect_pipeline_folder(self.layout.path, check_weights=False)
        if folder_file_stamps(layout) != self.stamps:
            raise WanVACEModelFolderError(
                f"The weight files in {self.layout.path} changed since this model was loaded, so its unloaded "
                "weights cannot be read back; load the model again (re-run the loader, or change one of its inputs)."
            )
        _fill(module, layout.components[name], self.dtype, torch.device(device))
        module.requires_grad_(False)
        logger.info("Reloaded WanVACE weights of %s (%s) onto %s", self.layout.path, name, device)


def read_pipeline_folder(
    path: str | Path, dtype: str = "bf16", device: str | torch.device = "cpu", experts_on_meta: bool = False
) -> LoadedPipeline:
    """Reads a WanVACE pipeline folder (Wan2.2 two-expert or Wan2.1 single transformer) onto `device`.

    With `experts_on_meta` the experts are only built on the meta device, carrying their config (parallel
    workers load them from `worker_source`); the text encoder and VAE are read either way.
    """
    if dtype not in DTYPES:
        raise WanVACEModelFolderError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}.")
    torch_dtype = DTYPES[dtype]
    device = torch.device(device)
    layout = inspect_pipeline_folder(path)
    model_index = json.loads((layout.path / "model_index.json").read_text())
    on_meta = EXPERT_NAMES if experts_on_meta else ()
    modules = {
        name: (
            meta_stand_in(build_on_meta(component_class(model_index, name), files.folder), torch_dtype)
            if name in on_meta
            else load_component(component_class(model_index, name), files, torch_dtype, device)
        )
        for name, files in layout.components.items()
    }
    tokenizer_cls = component_class(model_index, "tokenizer")
    tokenizer = tokenizer_cls.from_pretrained(layout.path / "tokenizer")
    scheduler_cls = component_class(model_index, "scheduler")
    scheduler_config = scheduler_cls.load_config(layout.path / "scheduler")
    logger.info("Loaded WanVACE pipeline %s (%s, %s)", layout.path, dtype, ", ".join(modules))
    return LoadedPipeline(
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
        weights=FolderWeights(layout, torch_dtype),
        worker_source={"kind": "folder", "path": str(layout.path)},
    )


def read_experts(path: str | Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.nn.Module]:
    """Just the experts of a pipeline folder, whole (a parallel worker that does not shard them)."""
    layout = inspect_pipeline_folder(path)
    model_index = json.loads((layout.path / "model_index.json").read_text())
    return {
        name: load_component(component_class(model_index, name), layout.components[name], dtype, device)
        for name in EXPERT_NAMES
        if name in layout.components
    }
