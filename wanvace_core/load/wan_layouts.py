"""The key layouts of Wan weight files, and the model configs their shapes imply.

Each `*_layout(files)` looks only at tensor names and shapes (no data) and returns a `Layout`: the
diffusers/transformers class, the config to build it with, and for every state-dict key of that
class the file and stored tensor it comes from. Renames use diffusers' own converters
(`convert_wan_transformer_to_diffusers`, `convert_wan_vae_to_diffusers`), run over the *names*
only, so no tensor is touched (they only rename for these models). Errors name the file and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import WanVACEModelFolderError
from .weight_files import StoredTensor, WeightFile

_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_VACE_KEYS = ("vace_blocks.", "vace_patch_embedding.")


@dataclass(frozen=True)
class Source:
    """Where one state-dict entry of the model comes from."""

    file: WeightFile
    entry: StoredTensor
    scale: StoredTensor | None = None  # scaled fp8: the per-tensor weight scale
    fp8_format: str | None = None  # "float8_e4m3fn" / "float8_e5m2" when the entry is scaled fp8


@dataclass
class Layout:
    """What to build and where each of its tensors comes from."""

    cls: type
    config: dict
    sources: dict[str, Source]
    files: tuple[WeightFile, ...]
    description: str = ""
    extra: dict = field(default_factory=dict)

    make: Callable[[dict], torch.nn.Module] | None = None  # config -> model; default `cls.from_config`

    def build_on_meta(self) -> torch.nn.Module:
        """The model with its parameters on meta (buffers such as RoPE tables computed normally)."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            return (self.make or self.cls.from_config)(self.config)


# Model facts of the Wan 2.x transformers (original code, ComfyUI and diffusers all assume them).
WAN_HEAD_DIM = 128
WAN_ROPE_MAX_SEQ_LEN = 1024
WAN_EPS = 1e-6
# umt5-xxl's relative-attention distance; not recoverable from the weights.
UMT5_MAX_DISTANCE = 128


class _ScaledFp8:
    """The fp8 scales a safetensors file carries, in either of ComfyUI's schemes (or none)."""

    def __init__(self, file: WeightFile, names: dict[str, StoredTensor], marker: StoredTensor | None = None) -> None:
        import json

        self.file = file
        self.scheme = None
        self.layers: dict[str, dict] = {}
        metadata = file.metadata.get("_quantization_metadata")
        # The legacy marker, wherever it sits: prefixed or not, in this shard or another of the same expert.
        marker = marker or _find_marker(file)
        if metadata:
            self.scheme = "mixed"
            try:
                layers = dict(json.loads(metadata).get("layers", {}))
            except (ValueError, AttributeError) as error:
                raise WanVACEModelFolderError(
                    f"{file.path} has unreadable _quantization_metadata ({error}); re-download or re-convert it."
                ) from error
            self.layers = {_unprefixed(layer): conf for layer, conf in layers.items()}
        elif marker is not None:
            self.scheme = "legacy"
            default = "float8_e5m2" if marker.dtype == torch.float8_e5m2 else "float8_e4m3fn"
            self.layers = {
                name[: -len(".scale_weight")]: {"format": default} for name in names if name.endswith(".scale_weight")
            }
        else:
            for name, entry in names.items():
                if name.endswith(".comfy_quant"):
                    self.scheme = "mixed"
                    self.layers[name[: -len(".comfy_quant")]] = _read_json_tensor(file, entry)
        if self.scheme is None:
            scales = [name for name in names if name.endswith((".scale_weight", ".weight_scale"))]
            if scales:
                raise WanVACEModelFolderError(
                    f"{file.path} has fp8 scales ('{scales[0]}') but no 'scaled_fp8' marker or quantisation metadata "
                    "saying how to apply them; the file is incomplete: re-download or re-convert it."
                )

    @property
    def auxiliary(self) -> tuple[str, ...]:
        return (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant")

    def source(self, names: dict[str, StoredTensor], key: str) -> tuple[StoredTensor | None, str | None]:
        """(scale entry, fp8 format) for tensor `key` of the file, or (None, None) if it is not scaled fp8."""
        if not key.endswith(".weight"):
            return None, None
        layer = key[: -len(".weight")]
        conf = self.layers.get(layer)
        entry = names[key]
        is_fp8 = entry.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if conf is None:
            if is_fp8 and self.scheme is not None:
                raise WanVACEModelFolderError(
                    f"{self.file.path} stores '{key}' in fp8 but lists no scale for it ({self.scheme} scaled-fp8 "
                    "scheme); the file is incomplete: re-download or re-convert it."
                )
            return None, None
        fmt = conf.get("format")
        if not (is_fp8 or entry.dtype == torch.uint8):
            raise WanVACEModelFolderError(
                f"{self.file.path} lists '{layer}' as {fmt!r} but stores its weight as {entry.dtype}; the quantisation "
                "data does not match the tensors: re-download or re-convert this file."
            )
        if fmt not in ("float8_e4m3fn", "float8_e5m2"):
            raise WanVACEModelFolderError(
                f"{self.file.path} quantises '{layer}' as {fmt!r}, which this pack cannot dequantise (only per-tensor "
                "float8_e4m3fn / float8_e5m2); use the bf16, fp8_scaled or GGUF release of this model."
            )
        scale_name = layer + (".scale_weight" if self.scheme == "legacy" else ".weight_scale")
        scale = names.get(scale_name)
        if scale is None:
            raise WanVACEModelFolderError(
                f"{self.file.path} stores '{key}' as {fmt} without its scale '{scale_name}'; the weights would be "
                "wrong by up to 448x. Re-download or re-convert this file."
            )
        if scale.shape not in ((), (1,)):
            raise WanVACEModelFolderError(
                f"{self.file.path} has a {list(scale.shape)} scale '{scale_name}'; only per-tensor fp8 scales are "
                "supported. Use the bf16 or fp8_scaled release of this model."
            )
        return scale, fmt


def _read_json_tensor(file: WeightFile, entry: StoredTensor) -> dict:
    import json

    try:
        return json.loads(bytes(file.view(entry).tolist()).decode("utf-8"))
    except ValueError as error:
        raise WanVACEModelFolderError(
            f"{file.path} has an unreadable '{entry.name}' ({error}); re-download or re-convert it."
        ) from error


def _unprefixed(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _find_marker(file: WeightFile) -> StoredTensor | None:
    return next((entry for name, entry in file.tensors.items() if _unprefixed(name) == "scaled_fp8"), None)


def _strip_prefix(file: WeightFile) -> dict[str, StoredTensor]:
    names = dict(file.tensors)
    for prefix in _PREFIXES:
        if any(name.startswith(prefix) for name in names):
            return {name[len(prefix) :]: entry for name, entry in names.items() if name.startswith(prefix)}
    return names


def _sources(file: WeightFile, renamed: dict[str, str], names: dict[str, StoredTensor], scales) -> dict[str, Source]:
    sources = {}
    for key, original in renamed.items():
        scale, fmt = scales.source(names, original)
        sources[key] = Source(file, names[original], scale, fmt)
    return sources


def _is_diffusers_transformer(names) -> bool:
    return any(name.startswith(("condition_embedder.", "proj_out.")) for name in names) or any(
        ".attn1.to_q." in name for name in names
    )


def _block_count(names, prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    indices = {int(match.group(1)) for name in names if (match := pattern.match(name))}
    return max(indices) + 1 if indices else 0


def _expert_part(files: list[WeightFile], where: str) -> tuple[dict[str, Source], str]:
    """The diffusers-named sources of one expert (one file or shards): whole expert, T2V base or VACE-only module."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    sources: dict[str, Source] = {}
    all_names: set[str] = set()
    marker = next((found for file in files if (found := _find_marker(file)) is not None), None)
    for file in files:
        names = _strip_prefix(file)
        scales = _ScaledFp8(file, names, marker)
        weights = {
            name: entry
            for name, entry in names.items()
            if _unprefixed(name) != "scaled_fp8" and not name.endswith(scales.auxiliary)
        }
        all_names |= set(weights)
        if _is_diffusers_transformer(weights):
            renamed = {name: name for name in weights}
        else:
            # The converter only renames for these models: run it over the names, its values are our keys.
            renamed = convert_wan_transformer_to_diffusers({name: name for name in weights})
        sources.update(_sources(file, renamed, names, scales))
    if not any(name.startswith(("blocks.", "vace_blocks.")) for name in all_names):
        raise WanVACEModelFolderError(
            f"{where} is not a Wan model (no 'blocks.N' or 'vace_blocks.N' tensors); pick a Wan2.2-VACE-Fun expert "
            "(diffusion_models/wan2.2_fun_vace_*), or a Wan2.2-T2V expert with a VACE module."
        )
    has_base = any(name.startswith("blocks.") for name in all_names)
    has_vace = any(name.startswith(_VACE_KEYS) for name in all_names)
    kind = "expert" if has_base and has_vace else ("base" if has_base else "vace")
    return sources, kind


def _infer_transformer_config(sources: dict[str, Source], where: str) -> dict:
    shapes = {key: source.entry.shape for key, source in sources.items()}
    try:
        dim = shapes["scale_shift_table"][-1]
        patch = shapes["patch_embedding.weight"]
        num_layers = _block_count(shapes, "blocks.")
        vace_count = _block_count(shapes, "vace_blocks.")
        if vace_count > num_layers:
            raise WanVACEModelFolderError(
                f"{where} has {vace_count} VACE blocks for {num_layers} main blocks; the VACE module belongs to "
                "another model size. Choose the VACE module of this expert's release."
            )
        config = {
            "patch_size": tuple(patch[2:]),
            "num_attention_heads": dim // WAN_HEAD_DIM,
            "attention_head_dim": WAN_HEAD_DIM,
            "in_channels": patch[1],
            "out_channels": shapes["proj_out.weight"][0] // (patch[2] * patch[3] * patch[4]),
            "text_dim": shapes["condition_embedder.text_embedder.linear_1.weight"][1],
            "freq_dim": shapes["condition_embedder.time_embedder.linear_1.weight"][1],
            "ffn_dim": shapes["blocks.0.ffn.net.0.proj.weight"][0],
            "num_layers": num_layers,
            "cross_attn_norm": "blocks.0.norm2.weight" in shapes,
            "qk_norm": "rms_norm_across_heads" if "blocks.0.attn1.norm_q.weight" in shapes else None,
            "eps": WAN_EPS,
            "rope_max_seq_len": WAN_ROPE_MAX_SEQ_LEN,
            # VACE blocks sit evenly spaced over the layers, as in every published Wan VACE model (and as
            # ComfyUI assumes): 8 of 40 -> 0, 5, ..., 35.
            "vace_layers": list(range(0, num_layers, num_layers // vace_count))[:vace_count] if vace_count else [],
            "vace_in_channels": shapes["vace_patch_embedding.weight"][1] if vace_count else 96,
        }
    except (KeyError, IndexError, ZeroDivisionError) as error:
        raise WanVACEModelFolderError(
            f"{where} lacks the Wan transformer tensor {error}; it is not a complete Wan expert. Re-download it."
        ) from error
    if dim % WAN_HEAD_DIM:
        raise WanVACEModelFolderError(
            f"{where} has model width {dim}, not a multiple of Wan's head size {WAN_HEAD_DIM}; it is not a Wan model."
        )
    return config


def expert_layout(model: list[WeightFile], vace_module: list[WeightFile] | None, label: str, name: str) -> Layout:
    """The WanVACETransformer3DModel of one expert (a file, or shards), or of a T2V expert plus a VACE-only module."""
    from diffusers import WanVACETransformer3DModel

    sources, kind = _expert_part(model, f"{label}={name}")
    if kind == "vace":
        raise WanVACEModelFolderError(
            f"{label}={name} is a VACE module only (no base blocks); choose the Wan2.2-T2V expert as "
            f"{label} and this file as the {label}'s VACE module."
        )
    files = list(model)
    if vace_module is not None:
        module_name = vace_module[0].path.name
        module_sources, module_kind = _expert_part(vace_module, f"The VACE module for {label}, {module_name},")
        if module_kind != "vace":
            raise WanVACEModelFolderError(
                f"The VACE module for {label}, {module_name}, holds base blocks too; it is a whole expert. "
                f"Choose it as {label} and leave the VACE module input empty."
            )
        if kind == "expert":
            raise WanVACEModelFolderError(
                f"{label}={name} already has VACE blocks; leave its VACE module input empty, or choose "
                "the Wan2.2-T2V expert under it."
            )
        sources.update(module_sources)
        files += vace_module
    elif kind == "base":
        raise WanVACEModelFolderError(
            f"{label}={name} is a Wan text-to-video expert without VACE blocks; choose a Wan2.2-VACE-Fun "
            f"expert, or add the matching VACE module (Wan2_2_Fun_VACE_module_A14B_*) as the {label}'s VACE module."
        )
    config = _infer_transformer_config(sources, f"{label}={name}")
    return Layout(WanVACETransformer3DModel, config, sources, tuple(files), f"{label} ({name})")


# The original Wan T5 encoder (models_t5_umt5-xxl-enc-bf16.pth) -> transformers' T5 names, per block.
_WAN_T5_BLOCK_NAMES = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",  # the GELU-gated branch
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}


def _wan_t5_names(weights) -> dict[str, str]:
    renamed = {}
    for name in weights:
        if name == "token_embedding.weight":
            renamed["shared.weight"] = name
        elif name == "norm.weight":
            renamed["encoder.final_layer_norm.weight"] = name
        elif match := re.match(r"blocks\.(\d+)\.(.+)$", name):
            inner = _WAN_T5_BLOCK_NAMES.get(match.group(2))
            renamed[f"encoder.block.{match.group(1)}.{inner}" if inner else name] = name
        else:
            renamed[name] = name  # unknown: refused later as a tensor the model lacks
    return renamed


def umt5_layout(file: WeightFile) -> Layout:
    """ComfyUI's umt5_xxl_*.safetensors (transformers' T5 names) or the original Wan T5 .pth -> UMT5EncoderModel."""
    from transformers import UMT5Config, UMT5EncoderModel

    names = _strip_prefix(file)
    scales = _ScaledFp8(file, names)
    weights = {
        name: entry
        for name, entry in names.items()
        if name not in ("scaled_fp8", "spiece_model") and not name.endswith(scales.auxiliary)
    }
    where = f"text_encoder={file.path.name}"
    if not {"shared.weight", "encoder.embed_tokens.weight", "token_embedding.weight"} & set(weights):
        raise WanVACEModelFolderError(
            f"{where} is not a umt5 text encoder (no 'shared.weight'); choose umt5_xxl_fp16 or "
            "umt5_xxl_fp8_e4m3fn_scaled from models/text_encoders."
        )
    renamed = _wan_t5_names(weights) if "token_embedding.weight" in weights else {name: name for name in weights}
    if "shared.weight" not in renamed:
        renamed["shared.weight"] = "encoder.embed_tokens.weight"
    if renamed.get("encoder.embed_tokens.weight") is not None:
        renamed.pop("encoder.embed_tokens.weight")  # tied to shared.weight
    shapes = {key: weights[original].shape for key, original in renamed.items()}
    try:
        vocab, d_model = shapes["shared.weight"]
        bias = shapes["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        num_heads = bias[1]
        config = {
            "vocab_size": vocab,
            "d_model": d_model,
            "d_kv": shapes["encoder.block.0.layer.0.SelfAttention.q.weight"][0] // num_heads,
            "d_ff": shapes["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"][0],
            "num_layers": _block_count(shapes, "encoder.block."),
            "num_heads": num_heads,
            "relative_attention_num_buckets": bias[0],
            "relative_attention_max_distance": UMT5_MAX_DISTANCE,
            "feed_forward_proj": "gated-gelu",
        }
    except (KeyError, ValueError, IndexError) as error:
        raise WanVACEModelFolderError(
            f"{where} lacks the umt5 tensor {error}; it is not a umt5 encoder (T5 v1.0 / CLIP files do not fit)."
        ) from error
    if (
        "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in shapes
        and config["num_layers"] > 1
    ):
        raise WanVACEModelFolderError(
            f"{where} is a T5 encoder with one shared position bias, not umt5 (which has one per block); Wan uses "
            "umt5-xxl: choose umt5_xxl_fp16 or umt5_xxl_fp8_e4m3fn_scaled."
        )
    extra = {"spiece_model": names.get("spiece_model")}
    sources = _sources(file, renamed, names, scales)
    return Layout(
        UMT5EncoderModel, config, sources, (file,), where, extra, make=lambda conf: UMT5EncoderModel(UMT5Config(**conf))
    )


def vae_layout(file: WeightFile) -> Layout:
    """ComfyUI's wan_2.1_vae.safetensors (original Wan VAE names) -> AutoencoderKLWan."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    names = _strip_prefix(file)
    where = f"vae={file.path.name}"
    if "decoder.upsamples.0.upsamples.0.residual.2.weight" in names:
        raise WanVACEModelFolderError(
            f"{where} is the Wan2.2 VAE of the 5B model (48 latent channels); Wan2.2-VACE-Fun-A14B uses the Wan 2.1 "
            "VAE: choose wan_2.1_vae.safetensors."
        )
    if "decoder.middle.0.residual.0.gamma" in names:
        renamed = convert_wan_vae_to_diffusers({name: name for name in names})
    elif "decoder.mid_block.resnets.0.norm1.gamma" in names:
        renamed = {name: name for name in names}
    else:
        raise WanVACEModelFolderError(
            f"{where} is not a Wan VAE (no 'decoder.middle.0.residual.0.gamma'); choose wan_2.1_vae.safetensors "
            "from models/vae."
        )
    shapes = {key: names[original].shape for key, original in renamed.items()}
    try:
        config = {
            "base_dim": shapes["encoder.conv_in.weight"][0],
            "z_dim": shapes["post_quant_conv.weight"][0],
        }
    except KeyError as error:
        raise WanVACEModelFolderError(f"{where} lacks the Wan VAE tensor {error}; re-download it.") from error
    scales = _ScaledFp8(file, names)
    return Layout(AutoencoderKLWan, config, _sources(file, renamed, names, scales), (file,), where)
