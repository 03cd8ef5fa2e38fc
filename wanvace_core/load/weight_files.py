"""One interface over the weight files ComfyUI users have: safetensors and GGUF.

`open_weight_file(path)` reads only the file's header (cheap enough for prompt validation) and
gives a `WeightFile`: its metadata and a `StoredTensor` per tensor (storage dtype, logical shape,
byte range, GGUF quantisation type). `WeightFile.view(entry)` is the stored bytes as a tensor of a
copy-on-write mapping of the file: no private memory until written (it never is), paged in on
first use. Loading casts or dequantises from there in windows (`loading.stream_into`).
"""

from __future__ import annotations

import ctypes
import json
import math
import pickle
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import WanVACEModelFolderError
from .tensor_files import SAFETENSORS_DTYPES, read_safetensors_header, stream_into

_REMEDY = "re-download or re-convert this file"
_WINDOW_BYTES = 64 * 1024 * 1024
# A dequantising window yields at most this many fp32 elements (4 MiB): small temporaries, reused each window.
_TRANSFORM_WINDOW_ELEMENTS = 1024 * 1024
# Plain float types GGUF stores unquantised, by gguf-py's GGMLQuantizationType name.
_GGUF_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# city96's ComfyUI-GGUF stores the shape of tensors it had to flatten (GGUF has at most 4 dims) here.
_GGUF_ORIGINAL_SHAPE = "comfy.gguf.orig_shape."


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in its file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # the logical (dequantised) shape
    dtype: torch.dtype  # the storage dtype (uint8 for GGUF quantised blocks)
    offset: int  # absolute byte offset in the file
    nbytes: int
    quant: str | None = None  # GGUF quantisation type name ("Q8_0", "Q6_K", ...) or None

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The shape of the stored bytes as a tensor of `dtype` (rows of blocks for GGUF)."""
        if self.quant is None:
            return self.shape
        return (*self.shape[:-1], self.nbytes // max(1, math.prod(self.shape[:-1])))


@dataclass
class WeightFile:
    """A weight file's header: format, metadata and tensors. Views map the file lazily."""

    path: Path
    format: str  # "safetensors" or "gguf"
    metadata: dict
    tensors: dict[str, StoredTensor]
    _storage: torch.UntypedStorage | None = field(default=None, repr=False)

    @property
    def stamp(self) -> tuple[int, int]:
        status = self.path.stat()
        return status.st_size, status.st_mtime_ns

    def view(self, entry: StoredTensor) -> torch.Tensor:
        """The stored bytes of `entry` as a tensor of its storage dtype and shape, on a private file mapping."""
        if self._storage is None:
            # shared=False maps the file copy-on-write: clean pages stay file-backed, nothing is read up front.
            self._storage = torch.UntypedStorage.from_file(
                str(self.path), shared=False, nbytes=self.path.stat().st_size
            )
        raw = torch.empty(0, dtype=torch.uint8).set_(self._storage, entry.offset, (entry.nbytes,))
        if entry.dtype.itemsize > 1 and entry.offset % entry.dtype.itemsize:
            raw = raw.clone()  # unaligned: a view of another dtype cannot start here
        return raw.view(entry.dtype).view(entry.storage_shape)

    def copy_into(self, entry: StoredTensor, target: torch.Tensor, transform=None, unit=(None, 1)) -> None:
        """Casts (or `transform`s) the stored values of `entry` into `target`, one unmapped-after-use window at a time.

        `unit` = (stored bytes, target elements) of one quantisation block; windows hold whole blocks. A
        transform's fp32 output is a temporary the size of its window, so its windows are kept small.
        """

        unit_bytes, unit_elements = unit
        window = _WINDOW_BYTES if transform is None else _TRANSFORM_WINDOW_ELEMENTS * (unit_bytes or 1) // unit_elements
        with open(self.path, "rb", buffering=0) as handle:
            stream_into(
                handle.fileno(),
                entry.offset,
                entry.nbytes,
                entry.dtype,
                target,
                transform,
                unit_bytes,
                unit_elements,
                window_bytes=window,
            )

    def release(self) -> None:
        """Forgets the mapping (tensors viewing it keep it alive until they go)."""
        self._storage = None


def _libc_malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return None  # not glibc (musl)


_MALLOC_TRIM = _libc_malloc_trim()


def give_back_freed_heap() -> None:
    """Returns freed heap pages to the system (glibc), after a tensor was dequantised window by window.

    The dequantising kernels' mid-size temporaries land between the loaded tensors on glibc's heap, and the holes
    they leave are never returned: measured on a 235M-parameter Q8_0 expert dequantised to bf16, 612 MiB private
    after the load for 503 MiB of weights, 461-510 with this (tests/test_load_memory.py).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_PICKLE_WINDOW_ELEMENTS = 16 * 1024 * 1024


class PickleWeightFile(WeightFile):
    """A `.pth` state dict, read only on the user's request with `torch.load(weights_only=True, mmap=True)`.

    weights_only refuses code objects, and mmap keeps the tensors in the file's pages (no private copy);
    what is read stays in the page cache rather than being unmapped window by window.
    """

    def __init__(self, path: Path) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as error:
            raise WanVACEModelFolderError(
                f"{path} could not be read as a weights-only PyTorch checkpoint ({type(error).__name__}: {error}); "
                f"{_REMEDY}."
            ) from error
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
            raise WanVACEModelFolderError(f"{path} does not hold a plain state dict of tensors; {_REMEDY}.")
        self._tensors = state
        tensors = {
            name: StoredTensor(name, tuple(value.shape), value.dtype, 0, value.numel() * value.element_size())
            for name, value in state.items()
        }
        super().__init__(path, "pth", {}, tensors)

    def view(self, entry: StoredTensor) -> torch.Tensor:
        return self._tensors[entry.name]

    def copy_into(self, entry: StoredTensor, target: torch.Tensor, transform=None, unit=(None, 1)) -> None:
        source, flat = self._tensors[entry.name].reshape(-1), target.view(-1)
        for start in range(0, source.numel(), _PICKLE_WINDOW_ELEMENTS):
            values = source[start : start + _PICKLE_WINDOW_ELEMENTS]
            flat[start : start + values.numel()].copy_(values if transform is None else transform(values).reshape(-1))

    def release(self) -> None:
        pass  # the tensors are the mapping; they go with this object


def _safetensors_file(path: Path) -> WeightFile:

    data_start, header = read_safetensors_header(path)
    with open(path, "rb") as handle:
        handle.seek(8)
        raw_header = json.loads(handle.read(data_start - 8))
    metadata = raw_header.get("__metadata__") or {}
    size = path.stat().st_size
    tensors = {}
    for name, entry in header.items():
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise WanVACEModelFolderError(
                f"{path} stores '{name}' as {entry.get('dtype')}, which is not supported; convert it to BF16, F16, "
                "F32 or FP8."
            )
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
            raise WanVACEModelFolderError(
                f"{path} is truncated or corrupt at tensor '{name}' ({size} bytes on disk); {_REMEDY}."
            )
        tensors[name] = StoredTensor(name, shape, dtype, data_start + begin, end - begin)
    return WeightFile(path, "safetensors", metadata, tensors)


def _gguf_value(field):
    """A GGUF metadata field's value: a string, a number, or a list of them."""
    from gguf import GGUFValueType

    def one(index):
        part = field.parts[index]
        if field.types and field.types[-1] == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0] if len(part) == 1 else part.tolist()

    values = [one(index) for index in field.data]
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return values
    return values[0] if values else None


def _gguf_file(path: Path) -> WeightFile:
    try:
        import gguf
    except ImportError as error:
        raise WanVACEModelFolderError(
            f"{path} is a GGUF file, which needs the 'gguf' package; install this pack's requirements.txt."
        ) from error
    from diffusers.quantizers.gguf.utils import dequantize_functions

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except ValueError as error:
        message = str(error)
        if "GGMLQuantizationType" in message or "is not a valid" in message:
            raise WanVACEModelFolderError(
                f"{path} uses a GGUF quantisation type this pack cannot read ({message}); use a Q8_0, Q6_K, Q5_K, "
                "Q4_K, Q3_K, Q2_K, Q5_0/Q5_1, Q4_0/Q4_1 or F16/BF16 file."
            ) from error
        raise WanVACEModelFolderError(f"{path} is not a readable GGUF file ({message}); {_REMEDY}.") from error
    except (OSError, IndexError, KeyError, struct.error) as error:
        raise WanVACEModelFolderError(f"{path} is not a readable GGUF file ({error}); {_REMEDY}.") from error
    metadata = {name: _gguf_value(entry) for name, entry in reader.fields.items() if not name.startswith("GGUF.")}
    size = path.stat().st_size
    tensors = {}
    for tensor in reader.tensors:
        qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
        original = metadata.get(_GGUF_ORIGINAL_SHAPE + tensor.name)
        shape = tuple(int(v) for v in original) if original else tuple(int(v) for v in reversed(tensor.shape.tolist()))
        if qtype.name in _GGUF_PLAIN:
            dtype, quant = _GGUF_PLAIN[qtype.name], None
        elif qtype in dequantize_functions:
            dtype, quant = torch.uint8, qtype.name
        else:
            raise WanVACEModelFolderError(
                f"{path} stores '{tensor.name}' as GGUF type {qtype.name}, which diffusers cannot dequantise; use a "
                "Q8_0, Q6_K, Q5_K, Q4_K, Q3_K, Q2_K, Q5_0/Q5_1, Q4_0/Q4_1 or F16/BF16 file."
            )
        stored_count = math.prod(int(v) for v in tensor.shape.tolist())
        if math.prod(shape) != stored_count or (quant is None and int(tensor.n_bytes) != stored_count * dtype.itemsize):
            raise WanVACEModelFolderError(
                f"{path} declares shape {list(shape)} for '{tensor.name}', which holds {stored_count} values; "
                f"the file is corrupt: {_REMEDY}."
            )
        offset, nbytes = int(tensor.data_offset), int(tensor.n_bytes)
        if offset + nbytes > size:
            raise WanVACEModelFolderError(
                f"{path} is truncated at tensor '{tensor.name}' ({size} bytes on disk); {_REMEDY}."
            )
        tensors[tensor.name] = StoredTensor(tensor.name, shape, dtype, offset, nbytes, quant)
    del reader  # drops gguf-py's own mapping of the file
    return WeightFile(path, "gguf", metadata, tensors)


PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")


def open_weight_file(path: str | Path, allow_pickle: bool = False) -> WeightFile:
    """Reads the header of a `.safetensors` or `.gguf` weight file; raises naming the file and the fix.

    `.pth` files are read only with `allow_pickle` (the user opted in), and then weights-only.
    """
    path = Path(path)
    if not path.is_file():
        raise WanVACEModelFolderError(f"Weight file {path} does not exist; put it there or pick another file.")
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return _gguf_file(path)
    if suffix in (".safetensors", ".sft"):
        return _safetensors_file(path)
    if suffix in PICKLE_SUFFIXES and allow_pickle:
        return PickleWeightFile(path)
    raise WanVACEModelFolderError(
        f"{path} is a pickle checkpoint ({suffix}), which can run code when loaded and is refused; use the "
        ".safetensors or .gguf release, or turn on allow_pth_weights if you trust this file."
        if suffix in PICKLE_SUFFIXES
        else f"{path} is neither .safetensors nor .gguf; pick a weight file of one of those formats."
    )
