"""FSDP2-sharded WanVACE experts, each rank streaming only its own slices from the weight files.

`fully_shard` moves a module's whole weights to the mesh device before it splits them, so sharding a
loaded expert would put the full 35 GB A14B expert on every rank first. Here no rank ever holds more
than its shard:

1. the expert is built on meta (parameters only; the RoPE tables are real, computed at build time),
   and each meta parameter is given its final dtype: `dtype`, or fp32 for the modules the library
   keeps in fp32 (`loading.fp32_module_names`: time embedder, norms, scale-shift tables);
2. `fully_shard` runs on every `blocks.N`, then every `vace_blocks.N`, then the root (one explicit
   order, the same on every rank). FSDP refuses a unit mixing fp32 and bf16 trainable parameters, and
   gathers a mixed unit of frozen ones as repacked bytes, so the fp32-kept parameters are
   `ignored_params` (in torch 2.8 and 2.11 alike): every block then gathers in its one dtype, and
   every rank holds them whole, which is cheap (0.17% of an A14B expert's parameters, 113 MiB in fp32);
3. `to_empty` allocates each rank's shards (on the CPU with `cpu_offload`), the RoPE tables are put
   back (`to_empty` would leave them uninitialised), and every local shard is filled from the file's
   bytes for its rows only: FSDP shards dim 0, and rows [start, end) of a row-major tensor are one
   contiguous byte range, which `loading.stream_into` casts into place through small mapped windows
   (unmapped once used, so the file's pages never pile up either).

Sources: a diffusers pipeline folder's `transformer/` and `transformer_2/` (`ComponentFiles`), or
single files (`single_file.ExpertFiles` / a `wan_layouts.Layout`: original Wan keys renamed to
diffusers' through the layout; bf16/fp16/fp32 storage; scaled fp8 kept as stored with
`weight_dtype="auto"`, each rank holding its rows of the fp8 bytes, or dequantised at load; GGUF
dequantised at load, window by window over each rank's rows of whole blocks). GGUF blocks kept as
stored are refused: FSDP wraps every shard in a trainable Parameter, which uint8 bytes cannot be.
The parameters are frozen before sharding, which is also what lets FSDP gather a block whose
parameters have several dtypes (fp8 weights beside bf16 biases): it gathers frozen ones as bytes.

Every rank must call these functions in the same order with the same arguments (FSDP pairs the
ranks' units by order). Loading itself runs no collective; the first forward does (all-gathers).
Afterwards install the interleaved forward (`interleave.apply_interleaved_vace`: FSDP's hooks are
module hooks, so replacing `forward` on the instance keeps them) and, for overlap, `prefetch_in_order`
with the order that forward runs the blocks in. After a forward FSDP keeps the root's own parameters
gathered (395 MiB in bf16 for A14B) until `expert.reshard()`.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..errors import WanVACEError, WanVACEInputError, WanVACEModelFolderError
from ..load.folder_layout import TRANSFORMER_COMPONENTS, ComponentFiles, inspect_pipeline_folder
from ..load.loaded import block_lists_of
from ..load.pipeline_folder import DTYPES, build_on_meta, component_class, fp32_module_names
from ..load.quantized import QuantizedLinear, WeightFormat, replace_linears
from ..load.single_file import WEIGHT_DTYPES, ExpertFiles, inspect_expert_files, plan_placements
from ..load.tensor_files import set_tensor
from ..load.wan_layouts import Layout
from ..load.weight_files import PickleWeightFile, StoredTensor, WeightFile, give_back_freed_heap, open_weight_file

logger = logging.getLogger(__name__)

# The order the units are created in; the same on every rank.
_SHARDED_BLOCK_LISTS = ("blocks", "vace_blocks")


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise WanVACEInputError(f"dtype={dtype} is not supported; choose one of {', '.join(DTYPES)}.")
        return dtype
    if dtype not in DTYPES:
        raise WanVACEInputError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def _keeps_fp32(key: str, fp32_names: set[str]) -> bool:
    """The loaders' rule: a state-dict key inside a module the library keeps in fp32."""
    return any(part in fp32_names for part in key.split("."))


def shard_expert(
    expert: nn.Module, mesh: DeviceMesh, *, dtype: torch.dtype | str, cpu_offload: bool = False
) -> nn.Module:
    """Shards a meta-built WanVACE expert with FSDP2 over `mesh` ("shard",) or HSDP over ("replicate", "shard").

    Each meta parameter first gets its final dtype (`dtype`, or fp32 where the library keeps fp32;
    `QuantizedLinear` weights keep the stored dtype the loader gave them); the fp32 ones are left out
    of the FSDP units (`ignored_params`) and stay whole on every rank. Every parameter is frozen.
    `cpu_offload` keeps the shards in host memory and gathers each block onto the device only for its
    forward (FSDP2's `CPUOffloadPolicy`, pinned on CUDA). Returns `expert`, still on meta: fill it with
    `load_sharded_expert` (or `to_empty` and your own fill).
    """
    dtype = _torch_dtype(dtype)
    real = [name for name, param in expert.named_parameters() if not param.is_meta]
    if real:
        raise WanVACEError(
            f"shard_expert needs an expert built on the meta device, but '{real[0]}' (and {len(real) - 1} more) "
            "holds real weights: FSDP would first move the whole expert to the mesh device. Build it on meta "
            "(Layout.build_on_meta, or init_empty_weights) and let load_sharded_expert fill each rank's shards."
        )
    block_lists = block_lists_of(expert)  # before fully_shard renames the class
    fp32_names = fp32_module_names(expert, dtype)
    stored_weights = {f"{name}.weight" for name, child in expert.named_modules() if isinstance(child, QuantizedLinear)}
    with torch.no_grad():
        for name, param in list(expert.named_parameters()):
            if name in stored_weights or not param.dtype.is_floating_point:
                continue  # held as stored (QuantizedLinear), in the dtype the loader gave it
            final = torch.float32 if _keeps_fp32(name, fp32_names) else dtype
            if param.dtype != final:
                set_tensor(expert, name, torch.empty_like(param, dtype=final))  # still meta: no memory
    held_whole = {param for name, param in expert.named_parameters() if _keeps_fp32(name, fp32_names)}
    # FSDP refuses a unit of mixed parameter dtypes only for trainable parameters; frozen ones it gathers as
    # bytes, which is how a block of stored fp8 weights beside its bf16 biases is sharded.
    expert.requires_grad_(False)
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    for list_name in _SHARDED_BLOCK_LISTS:
        if list_name not in block_lists:
            raise WanVACEError(f"{type(expert).__name__} has no block list '{list_name}' to shard.")
        for block in getattr(expert, list_name):
            fully_shard(block, mesh=mesh, offload_policy=policy, ignored_params=held_whole)
    fully_shard(expert, mesh=mesh, offload_policy=policy, ignored_params=held_whole)
    return expert


@dataclass(frozen=True)
class _TensorSource:
    """Where one state-dict tensor's stored values are, and how they become the model's values."""

    file: WeightFile
    entry: StoredTensor
    dequantize: WeightFormat | None = None  # fp8 / GGUF dequantised at load
    scale: StoredTensor | None = None  # scaled fp8: the per-tensor scale


def _folder_sources(files: ComponentFiles) -> dict[str, _TensorSource]:
    """Every tensor of a diffusers component's safetensors shards, by its (diffusers) state-dict key."""
    sources = {}
    for path in files.weight_files:
        file = open_weight_file(Path(path))  # checks every entry against the file's size, naming the file
        for name, entry in file.tensors.items():
            sources[name] = _TensorSource(file, entry)
    return sources


def _single_file_sources(layout: Layout, expert: nn.Module, dtype: torch.dtype, weight_dtype: str):
    """The single-file loader's plan for `expert` (still on meta): what each key reads, kept or dequantised.

    Linear weights kept as stored (`weight_dtype="auto"` over fp8, or a `weight_dtype` other than `dtype`)
    become `QuantizedLinear` weights, sharded by rows like every other weight; a scaled fp8 layer's scale is
    a whole buffer on every rank. GGUF blocks kept as stored are refused (uint8: see the message).
    """
    placements, formats = plan_placements(layout, expert, dtype, weight_dtype, True)
    gguf_kept = sorted({f.quant for f in formats.values() if f.kind == "gguf"})
    if gguf_kept:
        dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
        raise WanVACEInputError(
            f"weight_dtype={weight_dtype!r} keeps the {', '.join(gguf_kept)} GGUF blocks of {layout.description} as "
            "stored, which FSDP cannot shard: it wraps every shard in a trainable Parameter, which the blocks' uint8 "
            f"bytes cannot be. Use weight_dtype {dtype_name} with sharding (dequantised once at load, to the values "
            "weight_dtype auto computes), or an fp8_scaled / bf16 file, whose weights shard as stored."
        )
    replace_linears(expert, formats)
    sources = {}
    for key, placement in placements.items():
        source, entry = placement.source, placement.source.entry
        owner_name = key.rpartition(".")[0]
        if owner_name not in formats or not key.endswith(".weight"):
            sources[key] = _TensorSource(source.file, entry, placement.dequantize, source.scale)
            continue
        layer = expert.get_submodule(owner_name)
        if (layer.out_features, layer.in_features) != tuple(entry.shape):
            raise WanVACEModelFolderError(
                f"{layout.description}: '{entry.name}' has shape {list(entry.shape)}, {type(expert).__name__} "
                f"expects {[layer.out_features, layer.in_features]}; this file belongs to another model size."
            )
        if placement.keep is not None:
            entry = replace(entry, dtype=placement.keep.stored_dtype, shape=entry.storage_shape, quant=None)
            sources[key] = _TensorSource(source.file, entry)
            if source.scale is not None:
                sources[f"{owner_name}.weight_scale"] = _TensorSource(source.file, replace(source.scale, shape=()))
        else:
            sources[key] = _TensorSource(source.file, entry, placement.dequantize, source.scale)  # cast at load
        # The placeholder QuantizedLinear holds an empty weight: give it the shape and dtype it will hold.
        set_tensor(expert, key, torch.empty(entry.shape, dtype=placement.dtype, device="meta"))
    return sources


def _check_sources(expert: nn.Module, sources: dict[str, _TensorSource], where: str, remedy: str) -> None:
    """Refuses foreign, missing or misshapen tensors before anything is allocated."""
    name = type(expert).__name__
    placeholders = expert.state_dict(keep_vars=True)
    foreign = [key for key in sources if key not in placeholders]
    if foreign:
        source = sources[foreign[0]]
        raise WanVACEModelFolderError(
            f"{source.file.path} holds tensor '{source.entry.name}', which {name} does not have; this file belongs "
            "to another model or version."
        )
    missing = [key for key in placeholders if key not in sources]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WanVACEModelFolderError(f"{where} lacks {len(missing)} tensor(s) of {name} ({shown}); {remedy}.")
    for key, source in sources.items():
        if tuple(placeholders[key].shape) != tuple(source.entry.shape):
            raise WanVACEModelFolderError(
                f"{source.file.path} stores '{source.entry.name}' with shape {list(source.entry.shape)}, {name} "
                f"expects {list(placeholders[key].shape)}; this file belongs to another model size."
            )


def _rows_of(tensor: DTensor) -> tuple[int, int]:
    """(first row, row count) of the full tensor that this rank's local shard holds (FSDP shards dim 0).

    DTensor splits like `torch.chunk`: ceil(rows / shards) per shard, the last ones shorter or empty.
    """
    start, length = 0, tensor.shape[0] if tensor.dim() else 1
    coordinate = tensor.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(tensor.placements):
        if not isinstance(placement, Shard):
            continue  # replicated along this mesh dim (HSDP's "replicate")
        if placement.dim != 0:
            raise WanVACEError(f"a tensor sharded along dim {placement.dim}; only dim-0 shards are read from files")
        chunk = -(-length // tensor.device_mesh.size(mesh_dim))
        offset = min(coordinate[mesh_dim] * chunk, length)
        start, length = start + offset, min(chunk, length - offset)
    return start, length


def _copy_rows(source: _TensorSource, start: int, rows: int, target: torch.Tensor) -> None:
    """Casts (or dequantises) rows [start, start + rows) of the stored tensor into `target`, from those bytes only."""
    entry, weight_format = source.entry, source.dequantize
    if rows == 0 or target.numel() == 0:
        return
    if isinstance(source.file, PickleWeightFile):
        # A weights-only .pth is one memory-mapped tensor per key: its rows are a plain slice.
        values = source.file.view(entry)
        target.copy_(values.narrow(0, start, rows) if values.dim() else values)
        return
    if weight_format is not None and weight_format.kind == "scaled_fp8" and entry.dtype != weight_format.stored_dtype:
        entry = replace(entry, dtype=weight_format.stored_dtype)  # fp8 stored as raw bytes (U8)
    if entry.shape:
        row_bytes = entry.nbytes // entry.shape[0]  # GGUF: one row of whole quantisation blocks
        entry = replace(
            entry,
            shape=(rows, *entry.shape[1:]),
            offset=entry.offset + start * row_bytes,
            nbytes=rows * row_bytes,
        )
    if weight_format is not None and weight_format.kind == "gguf":
        import gguf

        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[weight_format.quant]]
        source.file.copy_into(
            entry, target, lambda raw: weight_format.dequantize(raw, None, (-1,)), unit=(type_size, block_size)
        )
        give_back_freed_heap()
        return
    source.file.copy_into(entry, target)
    if weight_format is not None and weight_format.kind == "scaled_fp8":
        # As the single-file loader does: fp8 values are exact in every target dtype, so cast, then scale in place.
        target.mul_(source.file.view(source.scale).to(torch.float32).reshape(()).clone())


def _fill_local_shards(expert: nn.Module, sources: dict[str, _TensorSource], device: torch.device) -> None:
    with torch.no_grad():
        for key, tensor in expert.state_dict(keep_vars=True).items():
            source = sources[key]
            if isinstance(tensor, DTensor):
                local = tensor.to_local()  # a view of FSDP's (padded) shard storage: filled in place
                start, rows = _rows_of(tensor)
                if local.dim() and local.shape[0] != rows:
                    raise WanVACEError(
                        f"'{key}': this rank's shard has {local.shape[0]} rows, the mesh placement implies {rows}; "
                        "this torch version shards differently from what the loader reads."
                    )
                _copy_rows(source, start, rows, local)
                continue
            # Held whole on every rank (fp32-kept parameters FSDP ignores, fp8 scales): on the compute device.
            if tensor.device != device:
                tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                set_tensor(expert, key, tensor)
            _copy_rows(source, 0, tensor.shape[0] if tensor.dim() else 1, tensor)
    for file in {id(source.file): source.file for source in sources.values()}.values():
        file.release()


def _check_device(mesh: DeviceMesh, device: torch.device) -> None:
    if mesh.device_type != device.type:
        raise WanVACEInputError(
            f"device={device} does not match the shard mesh's device type {mesh.device_type!r}; build the mesh on "
            f"the workers' device type (init_device_mesh('{device.type}', ...))."
        )
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        raise WanVACEInputError(
            f"device={device} is not this process's current CUDA device (cuda:{torch.cuda.current_device()}), on "
            f"which FSDP allocates its all-gather buffers; call torch.cuda.set_device({device}) in the worker first."
        )


@dataclass(frozen=True)
class ShardSources:
    """Where each rank reads its rows of one meta-built expert from, and the dtype its parameters take."""

    tensors: dict[str, _TensorSource]
    dtype: torch.dtype
    where: str


def meta_expert(
    source: ComponentFiles | Layout, *, dtype: torch.dtype | str, weight_dtype: str = "auto"
) -> tuple[nn.Module, ShardSources]:
    """One expert built on meta, and where its tensors are; every header is checked, nothing is allocated.

    `source`: a diffusers component (`inspect_pipeline_folder(...).components["transformer"]`) or a single-file
    expert layout (`single_file.inspect_expert_files(...)["transformer"]`; `weight_dtype` as the single-file
    loader takes it).
    """
    torch_dtype = _torch_dtype(dtype)
    if isinstance(source, ComponentFiles):
        index_path = source.folder.parent / "model_index.json"
        if not index_path.is_file():
            raise WanVACEModelFolderError(
                f"{source.folder} is not inside a diffusers pipeline folder (no {index_path.name} beside it), so its "
                "model class is unknown; pass the component of inspect_pipeline_folder(<pipeline folder>)."
            )
        expert = build_on_meta(component_class(json.loads(index_path.read_text()), source.name), source.folder)
        tensors = _folder_sources(source)
        where, remedy = str(source.folder), "the download is incomplete or the files belong to another model"
    else:
        if weight_dtype not in WEIGHT_DTYPES:
            raise WanVACEInputError(
                f"weight_dtype={weight_dtype!r} is not supported; choose one of {', '.join(WEIGHT_DTYPES)}."
            )
        expert = source.build_on_meta()
        tensors = _single_file_sources(source, expert, torch_dtype, weight_dtype)
        where, remedy = source.description, "the file is incomplete or belongs to another model"
    _check_sources(expert, tensors, where, remedy)
    return expert, ShardSources(tensors, torch_dtype, where)


def meta_experts(
    source: str | Path | ExpertFiles, dtype: torch.dtype | str, *, weight_dtype: str = "auto"
) -> dict[str, tuple[nn.Module, ShardSources]]:
    """`meta_expert` for each expert of a diffusers pipeline folder or of single files (those present).

    Every header is read and checked before any rank allocates a shard, so a truncated or foreign file is
    refused naming it, on every rank alike.
    """
    if isinstance(source, ExpertFiles):
        layouts = inspect_expert_files(source)
        experts = {name: layouts[name] for name in TRANSFORMER_COMPONENTS if name in layouts}
    else:
        components = inspect_pipeline_folder(source).components
        experts = {name: components[name] for name in TRANSFORMER_COMPONENTS if name in components}
    return {name: meta_expert(expert, dtype=dtype, weight_dtype=weight_dtype) for name, expert in experts.items()}


def shard_and_fill(
    expert: nn.Module, sources: ShardSources, mesh: DeviceMesh, device: torch.device | str, cpu_offload: bool = False
) -> nn.Module:
    """Shards the meta-built `expert` (`shard_expert`), then streams each rank's rows from `sources`.

    Shards live on `device`, or in host memory with `cpu_offload`; the fp32-kept parameters and the RoPE
    tables are whole on `device` in both cases. Returned ready to run (eval, no grad).
    """
    device = torch.device(device)
    _check_device(mesh, device)
    shard_expert(expert, mesh, dtype=sources.dtype, cpu_offload=cpu_offload)
    # The RoPE tables were computed at build time (buffers are not built on meta); to_empty would leave
    # them uninitialised, so they are kept aside and put back on the compute device.
    computed = {name: buffer for name, buffer in expert.named_buffers() if not buffer.is_meta}
    expert.to_empty(device="cpu" if cpu_offload else device)
    for name, buffer in computed.items():
        set_tensor(expert, name, buffer.to(device))
    _fill_local_shards(expert, sources.tensors, device)
    logger.info("Loaded %s sharded over %s (%s)", sources.where, tuple(mesh.mesh.shape), sources.dtype)
    return expert.eval().requires_grad_(False)


def load_sharded_expert(
    source: ComponentFiles | Layout,
    mesh: DeviceMesh,
    *,
    dtype: torch.dtype | str,
    device: torch.device | str,
    cpu_offload: bool = False,
    weight_dtype: str = "auto",
) -> nn.Module:
    """One FSDP2-sharded expert with no other runtime step: `meta_expert`, then `shard_and_fill`.

    The workers go through `runtime.plan` instead, which puts the interleaved forward and Ulysses on the
    meta-built expert before it is sharded.
    """
    device = torch.device(device)
    _check_device(mesh, device)
    expert, sources = meta_expert(source, dtype=dtype, weight_dtype=weight_dtype)
    return shard_and_fill(expert, sources, mesh, device, cpu_offload)


def prefetch_in_order(expert: nn.Module, order: list[str]) -> None:
    """Has each sharded block start the all-gather of the block that runs after it (FSDP2 explicit forward prefetch).

    `order` must be the order the installed forward runs the blocks in: `interleave.current_execution_order(expert)`
    after `apply_interleaved_vace`. A wrong order stays correct (FSDP gathers whatever is not yet gathered) but
    holds the wrong block gathered meanwhile.
    """
    units = [expert.get_submodule(name) for name in order]
    for current, following in itertools.pairwise(units):
        current.set_modules_to_forward_prefetch([following])


def local_shard_bytes(expert: nn.Module) -> int:
    """Bytes this rank holds for `expert` at rest: its shards' storage (FSDP's padding included), whole tensors,
    buffers. After a forward FSDP keeps the root's own parameters gathered until `expert.reshard()`."""
    seen, total = set(), 0
    for tensor in [*expert.parameters(), *expert.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
