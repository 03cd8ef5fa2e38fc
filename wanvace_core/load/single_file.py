"""Loads the single files ComfyUI users have: one file per expert (or a T2V expert plus a VACE module),
a umt5 text encoder file and a Wan 2.1 VAE file, as safetensors (bf16/fp16/fp32, scaled fp8) or GGUF.

The loading is the folder loader's: each model is built on meta and every tensor streams from its
file straight into place (used in place from the copy-on-write mapping when nothing needs to change,
else cast or dequantised window by window into its one final allocation); no model exists twice.
With `weight_dtype="auto"` fp8 and GGUF weights of the experts' Linear layers stay stored as the
file has them (`quantized.QuantizedLinear`) and are dequantised per layer at compute time; any other
`weight_dtype` dequantises them at load time. Both paths compute the same weights bitwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import WanVACEModelFolderError
from .loaded import EXPERT_NAMES, LoadedPipeline
from .pipeline_folder import DTYPES, finish_filling, fp32_module_names, meta_stand_in
from .quantized import QuantizedLinear, WeightFormat, replace_linears
from .tensor_files import set_tensor
from .tokenizer import t5_tokenizer_from_sentencepiece
from .wan_layouts import Layout, Source, expert_layout, umt5_layout, vae_layout
from .weight_files import give_back_freed_heap, open_weight_file

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = ("auto", *DTYPES)
DEFAULT_BOUNDARY_RATIO = 0.875
# Model facts of Wan2.2-VACE-Fun-A14B's diffusers release (its scheduler/scheduler_config.json).
SCHEDULER_CONFIG = {
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "num_train_timesteps": 1000,
    "flow_shift": 3.0,
}
_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class ExpertFiles:
    """The files of one pipeline. `high_noise_model` is diffusers' `transformer`, `low_noise_model` its
    `transformer_2` (VideoX-Fun names them the other way round). A VACE module goes over a T2V expert."""

    high_noise_model: Path
    text_encoder: Path
    vae: Path
    low_noise_model: Path | None = None
    high_noise_vace_module: Path | None = None
    low_noise_vace_module: Path | None = None
    tokenizer: Path | None = None  # a tokenizer folder, for text encoders that carry none
    allow_pth: bool = False  # the user opted in to reading .pth files (weights-only)


@dataclass(frozen=True)
class _Placement:
    """How one state-dict entry is made from its source."""

    source: Source
    dtype: torch.dtype  # the dtype it is held in (the stored dtype when kept)
    keep: WeightFormat | None = None  # kept as stored, dequantised per forward
    dequantize: WeightFormat | None = None  # dequantised (or cast) at load


def _stored_format(source: Source) -> WeightFormat | None:
    if source.entry.quant is not None:
        return WeightFormat("gguf", torch.uint8, source.entry.quant)
    if source.scale is not None:
        # The tensor's own fp8 dtype wins; fp8 stored as raw bytes (U8) takes the layer's declared format.
        stored = source.entry.dtype if source.entry.dtype in _FP8_DTYPES.values() else _FP8_DTYPES[source.fp8_format]
        return WeightFormat("scaled_fp8", stored)
    return None


def plan_placements(
    layout: Layout, module: torch.nn.Module, dtype: torch.dtype, weight_dtype: str, keep_quantized: bool
):
    """Decides, per state-dict key, what is kept stored and what is cast or dequantised to which dtype."""
    fp32_names = fp32_module_names(module, dtype)
    # Modules the library keeps in fp32 are never kept quantised: diffusers reads their weight dtype to cast
    # inputs (the time embedder), whatever the compute dtype.
    fp32_kept = fp32_module_names(module, torch.bfloat16)
    linears = {name for name, child in module.named_modules() if isinstance(child, torch.nn.Linear)}
    storage = dtype if weight_dtype == "auto" else DTYPES[weight_dtype]
    placements: dict[str, _Placement] = {}
    formats: dict[str, WeightFormat] = {}
    for key, source in layout.sources.items():
        stored = _stored_format(source)
        owner = key.rpartition(".")[0]
        keep_fp32 = any(part in fp32_names for part in key.split("."))
        protected = any(part in fp32_kept for part in key.split("."))
        is_linear_weight = key.endswith(".weight") and owner in linears and not protected and keep_quantized
        if not source.entry.dtype.is_floating_point and stored is None:
            placements[key] = _Placement(source, source.entry.dtype)
        elif keep_fp32:
            placements[key] = _Placement(source, torch.float32, dequantize=stored)
        elif is_linear_weight and stored is not None and weight_dtype == "auto":
            formats[owner] = stored
            placements[key] = _Placement(source, stored.stored_dtype, keep=stored)
        elif is_linear_weight and storage != dtype:
            formats[owner] = WeightFormat("cast", storage)
            placements[key] = _Placement(source, storage, dequantize=stored)
        else:
            placements[key] = _Placement(source, dtype, dequantize=stored)
    return placements, formats


def _tensor_for(placement: _Placement, device: torch.device) -> torch.Tensor:
    source = placement.source
    entry, file = source.entry, source.file
    if placement.keep is not None:
        stored = replace(entry, dtype=placement.keep.stored_dtype, shape=entry.storage_shape, quant=None)
        if device.type == "cpu":
            return file.view(stored)  # kept as stored, in place: a view of the copy-on-write mapping
        target = torch.empty(stored.shape, dtype=stored.dtype, device=device)
        file.copy_into(stored, target)  # window by window, so the file's pages never pile up
        return target
    if placement.dequantize is None and entry.dtype == placement.dtype and device.type == "cpu":
        return file.view(entry)  # used in place: a view of the copy-on-write mapping
    target = torch.empty(entry.shape, dtype=placement.dtype, device=device)
    if entry.nbytes == 0:
        return target
    weight_format = placement.dequantize
    if weight_format is None:
        file.copy_into(entry, target)
    elif weight_format.kind == "gguf":
        import gguf

        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[weight_format.quant]]
        file.copy_into(
            entry, target, lambda raw: weight_format.dequantize(raw, None, (-1,)), unit=(type_size, block_size)
        )
        give_back_freed_heap()
    else:
        # fp8 values are exact in every target dtype, so cast them into place, then scale in place: the 0-dim
        # fp32 scale is applied in fp32 arithmetic and rounded once, bitwise what `dequantize` computes per
        # forward, with no temporary at all.
        scale = file.view(source.scale).to(torch.float32).reshape(()).clone()
        stored = (
            entry if entry.dtype == weight_format.stored_dtype else replace(entry, dtype=weight_format.stored_dtype)
        )
        file.copy_into(stored, target)
        target.mul_(scale)
    return target


def _fill(module: torch.nn.Module, layout: Layout, placements: dict[str, _Placement], device: torch.device) -> None:
    placeholders = module.state_dict(keep_vars=True)
    name = type(module).__name__
    foreign = [key for key in placements if key not in placeholders]
    if foreign:
        raise WanVACEModelFolderError(
            f"{layout.description} holds tensor '{foreign[0]}', which {name} does not have; this file belongs to "
            "another model or version."
        )
    with torch.no_grad():
        for key, placement in placements.items():
            entry = placement.source.entry
            owner = module.get_submodule(key.rpartition(".")[0]) if "." in key else module
            stored_whole = isinstance(owner, QuantizedLinear) and key.endswith(".weight")
            expected = (owner.out_features, owner.in_features) if stored_whole else placeholders[key].shape
            if tuple(expected) != tuple(entry.shape):
                raise WanVACEModelFolderError(
                    f"{layout.description}: '{entry.name}' has shape {list(entry.shape)}, {name} expects "
                    f"{list(expected)}; this file belongs to another model size."
                )
            set_tensor(module, key, _tensor_for(placement, device))
            if placement.keep is not None and placement.source.scale is not None:
                scale = placement.source.file.view(placement.source.scale).to(torch.float32).reshape(())
                set_tensor(module, key.rpartition(".")[0] + ".weight_scale", scale.to(device))
    finish_filling(module, layout.description, "the file is incomplete or belongs to another model")
    for file in layout.files:
        file.release()  # tensors used in place keep their mapping alive


def _load(layout: Layout, dtype, weight_dtype: str, device, keep_quantized: bool):
    module = layout.build_on_meta()
    placements, formats = plan_placements(layout, module, dtype, weight_dtype, keep_quantized)
    replace_linears(module, formats)
    _fill(module, layout, placements, device)
    for key, buffer in list(module.named_buffers()):
        if buffer.device != device:
            set_tensor(module, key, buffer.to(device))
    return module.eval().requires_grad_(False), placements


class SingleFileWeights:
    """The `WeightSource` of single files: reads dropped weights back exactly as they were loaded."""

    def __init__(self, layouts: dict[str, Layout], placements: dict[str, dict]) -> None:
        self.layouts = layouts
        self.placements = placements
        self.stamps = expert_file_stamps(layouts)

    def refill(self, name: str, module: torch.nn.Module, device: torch.device) -> None:
        if expert_file_stamps(self.layouts) != self.stamps:
            raise WanVACEModelFolderError(
                "A weight file of this model changed since it was loaded, so its unloaded weights cannot be read "
                "back; load the model again (re-run the loader, or change one of its inputs)."
            )
        _fill(module, self.layouts[name], self.placements[name], torch.device(device))
        module.requires_grad_(False)
        logger.info("Reloaded WanVACE weights of %s onto %s", self.layouts[name].description, device)


def expert_file_stamps(layouts: dict[str, Layout]) -> dict[str, tuple[int, int]]:
    return {str(file.path): file.stamp for layout in layouts.values() for file in layout.files}


def _tokenizer_folder(text_encoder: Path, layout: Layout, folder: Path | None) -> Path | None:
    """Where the tokenizer comes from when the text encoder file carries none; raises if nowhere."""
    if layout.extra.get("spiece_model") is not None:
        return None
    candidates = [folder] if folder is not None else []
    candidates += [text_encoder.parent / f"{text_encoder.stem}_tokenizer", text_encoder.parent / "tokenizer"]
    for candidate in candidates:
        if (candidate / "tokenizer.json").is_file() or (candidate / "spiece.model").is_file():
            return candidate
    raise WanVACEModelFolderError(
        f"text_encoder={text_encoder.name} carries no tokenizer (no 'spiece_model' tensor) and none lies at "
        f"{candidates[0]}; use ComfyUI's umt5_xxl_fp16 / umt5_xxl_fp8_e4m3fn_scaled, or put the google/umt5-xxl "
        f"tokenizer files (tokenizer.json or spiece.model) in {candidates[0]}."
    )


def _tokenizer(text_encoder: Path, layout: Layout, folder: Path | None):
    found = _tokenizer_folder(text_encoder, layout, folder)
    if found is not None:
        from transformers import T5TokenizerFast

        return T5TokenizerFast.from_pretrained(found)
    file = layout.files[0]
    model_bytes = bytes(file.view(layout.extra["spiece_model"]).numpy().tobytes())
    file.release()
    return t5_tokenizer_from_sentencepiece(model_bytes, f"The spiece_model tensor of {text_encoder}")


def _open_expert(path: Path | None, allow_pth: bool) -> list | None:
    """A file, or a folder of shards (`*.safetensors`, listed by an index file if there is one)."""
    if path is None:
        return None
    path = Path(path)
    if not path.is_dir():
        return [open_weight_file(path, allow_pth)]
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        import json

        names = sorted(set(json.loads(indexes[0].read_text()).get("weight_map", {}).values()))
        shards = [path / name for name in names]
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise WanVACEModelFolderError(f"{path} holds no .safetensors shards; finish the download of this folder.")
    return [open_weight_file(shard) for shard in shards]


@contextlib.contextmanager
def _refusals_name(input_name: str, path: str | Path | None):
    """Puts `input_name=<file name>` first in a refusal about one file (the message may name the full path later):
    a loader lists several files, and the path alone does not say which input is wrong."""
    try:
        yield
    except WanVACEModelFolderError as error:
        if path is None or str(error).startswith(input_name):
            raise
        raise WanVACEModelFolderError(f"{input_name}={Path(path).name!r}: {error}") from error


def inspect_expert_files(files: ExpertFiles) -> dict[str, Layout]:
    """Reads every header and checks the files fit together; cheap (no tensor data). Each refusal names the input
    (`ExpertFiles`' field names are the loader's inputs) and the file first."""

    def expert(model: Path, module: Path | None, label: str) -> Layout:
        with _refusals_name(label, model):
            opened_model = _open_expert(model, files.allow_pth)
        module_label = label.replace("_model", "_vace_module")
        with _refusals_name(module_label, module):
            opened_module = _open_expert(module, files.allow_pth)
        with _refusals_name(label, model):
            return expert_layout(opened_model, opened_module, label, model.name)

    high = expert(Path(files.high_noise_model), files.high_noise_vace_module, "high_noise_model")
    layouts = {"transformer": high}
    if files.low_noise_model is not None:
        low = expert(Path(files.low_noise_model), files.low_noise_vace_module, "low_noise_model")
        if low.config != high.config:
            differing = sorted(key for key in high.config if high.config[key] != low.config.get(key))
            shown = ", ".join(f"{key} {high.config[key]} vs {low.config[key]}" for key in differing[:3])
            raise WanVACEModelFolderError(
                f"high_noise_model={files.high_noise_model.name} and low_noise_model={files.low_noise_model.name} "
                f"are experts of two different models ({shown}); choose the high- and low-noise experts of one "
                "release (e.g. both Wan2.2-VACE-Fun-A14B)."
            )
        layouts["transformer_2"] = low
    with _refusals_name("text_encoder", files.text_encoder):
        text = umt5_layout(open_weight_file(files.text_encoder, files.allow_pth))
        if text.config["d_model"] != high.config["text_dim"]:
            raise WanVACEModelFolderError(
                f"text_encoder={files.text_encoder.name} gives {text.config['d_model']}-wide embeddings, the experts "
                f"take {high.config['text_dim']}; Wan uses umt5-xxl (4096): choose umt5_xxl_fp16 or "
                "umt5_xxl_fp8_e4m3fn_scaled."
            )
        _tokenizer_folder(Path(files.text_encoder), text, files.tokenizer)
    layouts["text_encoder"] = text
    with _refusals_name("vae", files.vae):
        vae = vae_layout(open_weight_file(files.vae, files.allow_pth))
        if vae.config["z_dim"] != high.config["in_channels"]:
            raise WanVACEModelFolderError(
                f"vae={Path(files.vae).name} has {vae.config['z_dim']} latent channels, the experts take "
                f"{high.config['in_channels']}; Wan2.2-VACE-Fun-A14B uses the Wan 2.1 VAE: choose "
                "wan_2.1_vae.safetensors."
            )
    layouts["vae"] = vae
    return layouts


def read_expert_files(
    files: ExpertFiles,
    dtype: str = "bf16",
    weight_dtype: str = "auto",
    boundary_ratio: float | None = DEFAULT_BOUNDARY_RATIO,
    device: str | torch.device = "cpu",
    experts_on_meta: bool = False,
) -> LoadedPipeline:
    """Reads a WanVACE pipeline from single files (see `ExpertFiles`) onto `device`.

    With `experts_on_meta` the experts are only built on meta, carrying their config (parallel workers load
    them from `worker_source`), as `pipeline_folder.read_pipeline_folder` does.
    """
    if dtype not in DTYPES:
        raise WanVACEModelFolderError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}.")
    if weight_dtype not in WEIGHT_DTYPES:
        raise WanVACEModelFolderError(
            f"weight_dtype={weight_dtype!r} is not supported; choose one of {', '.join(WEIGHT_DTYPES)}."
        )
    two_experts = files.low_noise_model is not None
    if two_experts and (boundary_ratio is None or not 0.0 <= float(boundary_ratio) <= 1.0):
        raise WanVACEModelFolderError(
            f"boundary_ratio={boundary_ratio} must lie in [0, 1] for two experts; Wan2.2 uses 0.875."
        )
    torch_dtype = DTYPES[dtype]
    device = torch.device(device)
    layouts = inspect_expert_files(files)
    modules, placements = {}, {}
    for name, layout in layouts.items():
        if experts_on_meta and name in EXPERT_NAMES:
            # Loaded by the workers; here only the config is needed.
            modules[name], placements[name] = meta_stand_in(layout.build_on_meta(), torch_dtype), {}
            continue
        # The text encoder stays plain: transformers' T5 casts activations to its `wo` weight dtype.
        keep = name in EXPERT_NAMES
        modules[name], placements[name] = _load(layout, torch_dtype, weight_dtype, device, keep)
    tokenizer = _tokenizer(Path(files.text_encoder), layouts["text_encoder"], files.tokenizer)
    from diffusers import UniPCMultistepScheduler

    scheduler_config = dict(UniPCMultistepScheduler(**SCHEDULER_CONFIG).config)
    logger.info(
        "Loaded WanVACE single files (%s, weights %s): %s",
        dtype,
        weight_dtype,
        ", ".join(layout.description for layout in layouts.values()),
    )
    return LoadedPipeline(
        source=Path(files.high_noise_model),
        dtype=torch_dtype,
        device=device,
        tokenizer=tokenizer,
        text_encoder=modules["text_encoder"],
        vae=modules["vae"],
        transformer=modules["transformer"],
        transformer_2=modules.get("transformer_2"),
        scheduler_config=scheduler_config,
        boundary_ratio=float(boundary_ratio) if two_experts else None,
        weights=SingleFileWeights(layouts, placements),
        worker_source={
            "kind": "files",
            "files": _plain_files(files),
            "weight_dtype": weight_dtype,
            "path": str(files.high_noise_model),
        },
    )


def load_experts_only(
    files: ExpertFiles, dtype: torch.dtype, weight_dtype: str, device: torch.device
) -> dict[str, torch.nn.Module]:
    """Just the experts of `files`, whole (a parallel worker with shard=none); fp8/GGUF kept as `load_expert_files`."""
    layouts = inspect_expert_files(files)
    return {
        name: _load(layouts[name], dtype, weight_dtype, device, True)[0] for name in EXPERT_NAMES if name in layouts
    }


def _plain_files(files: ExpertFiles) -> dict:
    return {
        field.name: (str(value) if isinstance(value, Path) else value)
        for field in dataclasses.fields(files)
        for value in [getattr(files, field.name)]
    }


def expert_files_from(fields: dict) -> ExpertFiles:
    """`_plain_files`' inverse (paths travel as text to the parallel workers)."""
    return ExpertFiles(**{name: Path(value) if isinstance(value, str) else value for name, value in fields.items()})


def resident_bytes(layouts: dict[str, Layout], dtype: str, weight_dtype: str) -> int:
    """About how many bytes the loaded weights take (kept fp8/GGUF weights at their stored size)."""
    compute = DTYPES[dtype].itemsize
    storage = compute if weight_dtype == "auto" else DTYPES[weight_dtype].itemsize
    total = 0
    for name, layout in layouts.items():
        for source in layout.sources.values():
            entry = source.entry
            kept = weight_dtype == "auto" and name in ("transformer", "transformer_2") and _stored_format(source)
            if kept or (not entry.dtype.is_floating_point and entry.quant is None):
                total += entry.nbytes
            else:
                total += math.prod(entry.shape) * (storage if len(entry.shape) == 2 else compute)
    return total


def load_expert(
    path: str | Path,
    dtype: str = "bf16",
    weight_dtype: str = "auto",
    device: str | torch.device = "cpu",
    vace_module: str | Path | None = None,
    label: str = "high_noise_model",
) -> torch.nn.Module:
    """One expert (`WanVACETransformer3DModel`) from its file, loaded exactly as `load_expert_files` loads each."""
    if dtype not in DTYPES or weight_dtype not in WEIGHT_DTYPES:
        raise WanVACEModelFolderError(
            f"dtype={dtype!r} / weight_dtype={weight_dtype!r}: choose dtype from {', '.join(DTYPES)} and "
            f"weight_dtype from {', '.join(WEIGHT_DTYPES)}."
        )
    path = Path(path)
    layout = expert_layout(_open_expert(path, False), _open_expert(vace_module, False), label, path.name)
    module, _placements = _load(layout, DTYPES[dtype], weight_dtype, torch.device(device), True)
    return module
