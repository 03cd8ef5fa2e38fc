"""The tensor-reading primitives both weight readers share (`pipeline_folder` for diffusers folders, `weight_files`
and `single_file` for single files): the safetensors header, its dtype names, streaming a file's bytes into a tensor
one mapped window at a time, and putting a tensor in place of a meta parameter."""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from ..errors import WanVACEModelFolderError

_SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024

# Tensors that are cast or moved are read through mapped windows of the file of at most this many bytes.
_WINDOW_BYTES = 64 * 1024 * 1024

SAFETENSORS_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
    }.items()
    if hasattr(torch, attr)
}


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """The data start offset and the tensor entries of a safetensors file (metadata dropped)."""
    remedy = "re-download or re-convert this file"
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            raw_length = handle.read(8)
            if len(raw_length) < 8:
                raise WanVACEModelFolderError(f"Weight file {path} is empty or truncated ({size} bytes); {remedy}.")
            (header_length,) = struct.unpack("<Q", raw_length)
            if header_length > min(size - 8, _SAFETENSORS_HEADER_LIMIT):
                raise WanVACEModelFolderError(
                    f"Weight file {path} has no valid safetensors header (claims {header_length} header bytes in a "
                    f"{size}-byte file); {remedy}."
                )
            header = json.loads(handle.read(header_length))
    except (OSError, ValueError) as error:
        if isinstance(error, WanVACEModelFolderError):
            raise
        raise WanVACEModelFolderError(f"Cannot read weight file {path} as safetensors: {error}; {remedy}.") from error
    header.pop("__metadata__", None)
    if not isinstance(header, dict) or any(
        not isinstance(entry, dict) or len(entry.get("data_offsets", ())) != 2 for entry in header.values()
    ):
        raise WanVACEModelFolderError(f"Weight file {path} has a malformed safetensors header; {remedy}.")
    return 8 + header_length, header


def _owner(module: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str]:
    """The submodule holding state-dict entry `key`, and the entry's name there."""
    owner_name, _, attr = key.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), attr


def set_tensor(module: torch.nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Puts `tensor` in place of the (meta) parameter or buffer `key`, keeping the parameter class."""
    owner, attr = _owner(module, key)
    if attr in owner._parameters:
        old = owner._parameters[attr]
        owner._parameters[attr] = type(old)(tensor, requires_grad=old.requires_grad)
    else:
        owner._buffers[attr] = tensor


def stream_into(
    fileno: int,
    offset: int,
    nbytes: int,
    source_dtype: torch.dtype,
    target: torch.Tensor,
    transform=None,
    unit_bytes: int | None = None,
    unit_elements: int = 1,
    window_bytes: int = _WINDOW_BYTES,
) -> None:
    """Casts the `nbytes` at `offset` of the file into `target` (any dtype, device), one mapped window at a time.

    Each window of at most `_WINDOW_BYTES` is mapped copy-on-write (never written), cast into its place in
    `target` and unmapped again, so the file's pages never pile up in this process's RSS. `transform` turns a
    window's stored values into target values (dequantisation): every `unit_bytes` stored bytes (default one
    element) become `unit_elements` target elements, and windows hold whole units (`window_bytes` at most).
    """
    flat = target.view(-1)
    itemsize = unit_bytes or source_dtype.itemsize
    window = max(itemsize, window_bytes - window_bytes % itemsize)
    done = 0
    while done < nbytes:
        size = min(window, nbytes - done)
        start = offset + done
        map_start = start - start % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(fileno, start + size - map_start, offset=map_start, access=mmap.ACCESS_COPY)
        try:
            count = size // source_dtype.itemsize
            source = torch.frombuffer(mapped, dtype=source_dtype, count=count, offset=start - map_start)
            try:
                values = source if transform is None else transform(source)
                first = done // itemsize * unit_elements
                flat[first : first + values.numel()].copy_(values.reshape(-1))
                del values
            finally:
                del source  # the mapping can only be closed once no tensor views it
        finally:
            mapped.close()
        done += size
