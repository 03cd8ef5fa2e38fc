"""The rest of a tiny Wan VACE model in the single-file layouts ComfyUI users have, beside the experts of
bench/expert_files.py: the umt5 text encoder and the VAE, a whole ComfyUI `models/` tree in every format
(`write_comfy_models`), broken and foreign files for the error tests, and the readers that check what was written.

Test-side only: the product loader must read these files, and tests/integration/test_comfy_accepts_files.py proves
ComfyUI's own code accepts them.

- umt5 (`write_umt5`): HF T5 encoder names, a relative-attention bias in every block, no
  `encoder.embed_tokens.weight`, the sentencepiece model as a uint8 `spiece_model` tensor; the
  "fp8_e4m3fn_scaled" variant quantises the 7 Linear weights of every block (q, k, v, o, wi_0, wi_1, wo:
  168 `scale_weight`s in the real 24-block file) and carries the `scaled_fp8` marker.
- VAE (`write_vae`): original Wan 2.1 VAE keys, the exact inverse of diffusers'
  `convert_wan_vae_to_diffusers`.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file

from bench.expert_files import (
    FP8,
    PREFIX,
    QK_K,
    quantize_scaled_fp8,
    single_threaded,
    write_expert,
    write_gguf_expert,
)

# ComfyUI's T5 attention (comfy/text_encoders/t5.py) hard-codes 32 buckets and max distance 128.
COMFY_T5_BUCKETS = 32
COMFY_T5_MAX_DISTANCE = 128


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * scale.float()


def fp8_tolerance(reference: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Largest rounding error of e4m3fn at each element: half an ulp (3 mantissa bits) or of a subnormal."""
    scale = float(scale)
    return reference.detach().float().abs() * 2.0**-4 + scale * 2.0**-10 + 1e-12


def read_comfy_quant(tensor: torch.Tensor) -> dict:
    return json.loads(bytes(tensor.tolist()).decode("utf-8"))


_QUANT_BOOKKEEPING = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant")


def dequantized_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A written expert's tensors as fp32 under original keys: fp8 weights times their scale, the
    quantisation bookkeeping (marker, scales, `comfy_quant`) dropped, the prefix stripped."""
    out = {}
    for key, value in state.items():
        if key.removeprefix(PREFIX) == "scaled_fp8" or key.endswith(_QUANT_BOOKKEEPING):
            continue
        if value.dtype == FP8:
            layer = key[: -len(".weight")]
            scale = state.get(f"{layer}.scale_weight", state.get(f"{layer}.weight_scale"))
            value = dequantize_fp8(value, scale)
        out[key.removeprefix(PREFIX)] = value.float()
    return out


def dequantize_q6_k_reference(data: np.ndarray) -> np.ndarray:
    """Values `quantize_q6_k(data)` stands for, computed the quantiser's way (d * scale * (q - 32)),
    for checking its packing against `gguf.quants.dequantize`."""
    data = np.asarray(data, dtype=np.float32)
    blocks = data.reshape(-1, QK_K)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    sub_scale = np.abs(sub).max(axis=-1) / 31.0
    d32 = (sub_scale.max(axis=-1) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(d32[:, None] > 0, np.rint(sub_scale / d32[:, None]), 0)
    scales = np.clip(scales, -128, 127).astype(np.int8).astype(np.float32)
    step = d32[:, None] * scales
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(sub / step[..., None]), 0)
    q = np.clip(q, -32, 31)
    return (step[..., None] * q).reshape(data.shape)


def read_gguf(path: str | Path) -> tuple[str, dict[str, tuple[object, np.ndarray]]]:
    """(arch, {name: (GGML type, fp32 array in torch's shape order)}) of a GGUF file, dequantised with
    `gguf.quants.dequantize` and its ggml shape reversed (city96's `loader.py` convention, honouring a
    `comfy.gguf.orig_shape.<name>` entry when there is one)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    arch = bytes(field.parts[field.data[-1]]).decode("utf-8")
    out = {}
    for tensor in reader.tensors:
        shape_field = reader.get_field(f"comfy.gguf.orig_shape.{tensor.name}")
        if shape_field is not None:
            shape = tuple(int(shape_field.parts[i][0]) for i in shape_field.data)
        else:
            shape = tuple(int(v) for v in reversed(tensor.shape))
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        out[tensor.name] = (tensor.tensor_type, np.asarray(values, dtype=np.float32).reshape(shape))
    return arch, out


# --------------------------------------------------------------------------------------------------
# umt5 text encoder

UMT5_FP8_LINEARS = (
    ".layer.0.SelfAttention.q.weight",
    ".layer.0.SelfAttention.k.weight",
    ".layer.0.SelfAttention.v.weight",
    ".layer.0.SelfAttention.o.weight",
    ".layer.1.DenseReluDense.wi_0.weight",
    ".layer.1.DenseReluDense.wi_1.weight",
    ".layer.1.DenseReluDense.wo.weight",
)


@single_threaded
def umt5_state_dict(
    text_encoder, sentencepiece_bytes: bytes, *, dtype: torch.dtype = torch.bfloat16, quant: str | None = None
) -> dict[str, torch.Tensor]:
    """What `write_umt5` writes."""
    state = {
        k: v.detach() for k, v in text_encoder.state_dict().items() if k != "encoder.embed_tokens.weight"
    }  # tied to shared.weight; ComfyUI's files have none
    if quant is None:
        out = {k: v.to(dtype) for k, v in state.items()}
    elif quant == "scaled_fp8":
        layers = [k for k in state if k.startswith("encoder.block.") and k.endswith(UMT5_FP8_LINEARS)]
        out = quantize_scaled_fp8(state, dtype, layers, scale_input=False, marker=FP8)
    else:
        raise ValueError(f"quant must be None or 'scaled_fp8', not {quant!r}")
    out["spiece_model"] = torch.frombuffer(bytearray(sentencepiece_bytes), dtype=torch.uint8).clone()
    return {k: v.contiguous() for k, v in out.items()}


@single_threaded
def write_umt5(
    path: str | Path,
    text_encoder,
    sentencepiece_bytes: bytes,
    *,
    dtype: torch.dtype = torch.bfloat16,
    quant: str | None = None,
) -> Path:
    """Writes a transformers UMT5EncoderModel as ComfyUI's `umt5_xxl_*.safetensors` (layout: module
    docstring). ComfyUI's T5 needs `relative_attention_num_buckets` 32 and max distance 128."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(umt5_state_dict(text_encoder, sentencepiece_bytes, dtype=dtype, quant=quant), str(path))
    return path


# --------------------------------------------------------------------------------------------------
# Wan 2.1 VAE keys: diffusers AutoencoderKLWan <-> original Wan

_RESNET = {
    "norm1.gamma": "residual.0.gamma",
    "conv1.weight": "residual.2.weight",
    "conv1.bias": "residual.2.bias",
    "norm2.gamma": "residual.3.gamma",
    "conv2.weight": "residual.6.weight",
    "conv2.bias": "residual.6.bias",
    "conv_shortcut.weight": "shortcut.weight",
    "conv_shortcut.bias": "shortcut.bias",
}
_VAE_FIXED = {
    "quant_conv.weight": "conv1.weight",
    "quant_conv.bias": "conv1.bias",
    "post_quant_conv.weight": "conv2.weight",
    "post_quant_conv.bias": "conv2.bias",
}
_VAE_RULES = (
    (re.compile(r"^(encoder|decoder)\.conv_in\.(.+)$"), lambda m: f"{m[1]}.conv1.{m[2]}"),
    (re.compile(r"^(encoder|decoder)\.norm_out\.gamma$"), lambda m: f"{m[1]}.head.0.gamma"),
    (re.compile(r"^(encoder|decoder)\.conv_out\.(.+)$"), lambda m: f"{m[1]}.head.2.{m[2]}"),
    (re.compile(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(.+)$"), lambda m: f"{m[1]}.middle.1.{m[2]}"),
    (
        re.compile(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)$"),
        lambda m: f"{m[1]}.middle.{2 * int(m[2])}.{_RESNET[m[3]]}",
    ),
    (
        re.compile(r"^encoder\.down_blocks\.(\d+)\.(norm1|conv1|norm2|conv2|conv_shortcut)\.(.+)$"),
        lambda m: f"encoder.downsamples.{m[1]}.{_RESNET[f'{m[2]}.{m[3]}']}",
    ),
    (
        re.compile(r"^encoder\.down_blocks\.(\d+)\.(resample|time_conv)\.(.+)$"),
        lambda m: f"encoder.downsamples.{m[1]}.{m[2]}.{m[3]}",
    ),
    # Each decoder stage holds num_res_blocks + 1 = 3 resnets, then one upsampler: 4 slots per stage.
    (
        re.compile(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$"),
        lambda m: f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{_RESNET[m[3]]}",
    ),
    (
        re.compile(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$"),
        lambda m: f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}",
    ),
)


def _original_vae_key(key: str) -> str:
    if key in _VAE_FIXED:
        return _VAE_FIXED[key]
    for pattern, build in _VAE_RULES:
        match = pattern.match(key)
        if match:
            return build(match)
    raise KeyError(f"no original Wan VAE name for diffusers key {key!r}")


def original_wan_vae_state_dict(vae) -> dict[str, torch.Tensor]:
    """The diffusers AutoencoderKLWan (2.1: dim_mult of 4 stages, 2 res blocks) under original Wan VAE
    names, the exact inverse of diffusers' `convert_wan_vae_to_diffusers` (same tensor objects)."""
    config = vae.config
    if list(config.dim_mult) != [1, 2, 4, 4] or config.num_res_blocks != 2:
        # diffusers' converter hard-codes the block indices of this shape (and so does ComfyUI).
        raise ValueError(f"a ComfyUI Wan 2.1 VAE has dim_mult [1, 2, 4, 4] and 2 res blocks, not {dict(config)}")
    out = {}
    for key, value in vae.state_dict().items():
        new = _original_vae_key(key)
        if new in out:
            raise KeyError(f"two diffusers keys map to {new!r}")
        out[new] = value
    return out


@single_threaded
def write_vae(path: str | Path, vae, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes the VAE as ComfyUI's `wan_2.1_vae.safetensors` (original keys, one dtype, no metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in original_wan_vae_state_dict(vae).items()}
    save_file(state, str(path))
    return path


# --------------------------------------------------------------------------------------------------
# The tiny model shaped for ComfyUI, and a whole models/ tree


@single_threaded
def comfy_components(spec=None) -> dict:
    """`build_tiny_components(spec)` (default COMFY_SHAPED) with a text encoder ComfyUI's T5 can load.

    ComfyUI's T5 attention hard-codes 32 relative-attention buckets (comfy/text_encoders/t5.py); when
    the spec's encoder has another count, it is rebuilt with the same config and seed but 32 buckets
    and max distance 128. A no-op once the tiny spec itself uses 32. Built on one thread (the same
    weights, ~10x faster on a busy machine).
    """
    from transformers import UMT5EncoderModel

    from wanvace_core.load.tiny import COMFY_SHAPED, build_tiny_components

    spec = COMFY_SHAPED if spec is None else spec
    components = build_tiny_components(spec)
    config = components["text_encoder"].config
    if (
        config.relative_attention_num_buckets != COMFY_T5_BUCKETS
        or config.relative_attention_max_distance != COMFY_T5_MAX_DISTANCE
    ):
        config = copy.deepcopy(config)
        config.relative_attention_num_buckets = COMFY_T5_BUCKETS
        config.relative_attention_max_distance = COMFY_T5_MAX_DISTANCE
        with torch.random.fork_rng():
            torch.manual_seed(spec.seed)
            components["text_encoder"] = UMT5EncoderModel(config).eval()
    return components


EXPERT_FORMATS = ("bf16", "fp8_scaled", "fp8mixed", "split", "Q8_0", "Q6_K")
OTHER_FORMATS = ("umt5_fp16", "umt5_fp8_scaled", "vae")
ALL_FORMATS = EXPERT_FORMATS + OTHER_FORMATS
EXPERTS = {"high": "transformer", "low": "transformer_2"}


def comfy_file_names(expert: str) -> dict[str, str | tuple[str, str]]:
    """The real file names per format for expert "high" or "low" (`split`: (T2V base, VACE module)).

    Comfy-Org's repackaged names; "fp8mixed" follows Comfy-Org's newer mixed-precision naming; Kijai's
    VACE module names; the GGUF names are QuantStack's (Wan2.2-VACE-Fun-A14B-GGUF: HighNoise/...-high-noise-Q8_0.gguf).
    """
    return {
        "bf16": f"wan2.2_fun_vace_{expert}_noise_14B_bf16.safetensors",
        "fp8_scaled": f"wan2.2_fun_vace_{expert}_noise_14B_fp8_scaled.safetensors",
        "fp8mixed": f"wan2.2_fun_vace_{expert}_noise_14B_fp8mixed.safetensors",
        "split": (
            f"wan2.2_t2v_{expert}_noise_14B_fp16.safetensors",
            f"Wan2_2_Fun_VACE_module_A14B_{expert.upper()}_bf16.safetensors",
        ),
        "Q8_0": f"Wan2.2-VACE-Fun-A14B-{expert}-noise-Q8_0.gguf",
        "Q6_K": f"Wan2.2-VACE-Fun-A14B-{expert}-noise-Q6_K.gguf",
    }


class ComfyModels(NamedTuple):
    """A written `models/` tree: its folder, and what `write_comfy_models` returned for it."""

    root: Path
    written: dict


@single_threaded
def write_comfy_models(models_dir: str | Path, components: dict, *, formats: Iterable[str] = ALL_FORMATS) -> dict:
    """Writes a ComfyUI `models/` tree: `diffusion_models/` (experts), `text_encoders/`, `vae/`.

    Returns what it wrote: `{fmt: {"high": Path, "low": Path}}` for expert formats (`"split"`:
    `{"high": {"base": Path, "vace": Path}, ...}`), `{"umt5_fp16": Path, "umt5_fp8_scaled": Path,
    "vae": Path}` for the others. The low-noise expert is skipped for a one-expert (Wan2.1) component set.
    """
    from wanvace_core.load.tiny import sentencepiece_model_bytes

    formats = tuple(formats)
    unknown = set(formats) - set(ALL_FORMATS)
    if unknown:
        raise ValueError(f"unknown formats {sorted(unknown)}; known: {ALL_FORMATS}")
    models_dir = Path(models_dir)
    unet_dir, te_dir, vae_dir = models_dir / "diffusion_models", models_dir / "text_encoders", models_dir / "vae"
    written: dict = {}
    for fmt in formats:
        if fmt not in EXPERT_FORMATS:
            continue
        written[fmt] = {}
        for expert, component in EXPERTS.items():
            transformer = components.get(component)
            if transformer is None:
                continue
            name = comfy_file_names(expert)[fmt]
            if fmt == "bf16":
                written[fmt][expert] = write_expert(unet_dir / name, transformer, dtype=torch.bfloat16)
            elif fmt == "fp8_scaled":
                written[fmt][expert] = write_expert(
                    unet_dir / name, transformer, dtype=torch.bfloat16, quant="scaled_fp8"
                )
            elif fmt == "fp8mixed":
                written[fmt][expert] = write_expert(
                    unet_dir / name, transformer, dtype=torch.bfloat16, quant="mixed_fp8"
                )
            elif fmt == "split":
                base_name, vace_name = name
                written[fmt][expert] = {
                    "base": write_expert(unet_dir / base_name, transformer, dtype=torch.float16, parts="base"),
                    "vace": write_expert(unet_dir / vace_name, transformer, dtype=torch.bfloat16, parts="vace"),
                }
            else:
                written[fmt][expert] = write_gguf_expert(unet_dir / name, transformer, fmt)
    if "umt5_fp16" in formats or "umt5_fp8_scaled" in formats:
        spiece = sentencepiece_model_bytes()
        if "umt5_fp16" in formats:
            written["umt5_fp16"] = write_umt5(
                te_dir / "umt5_xxl_fp16.safetensors", components["text_encoder"], spiece, dtype=torch.float16
            )
        if "umt5_fp8_scaled" in formats:
            written["umt5_fp8_scaled"] = write_umt5(
                te_dir / "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                components["text_encoder"],
                spiece,
                dtype=torch.float16,
                quant="scaled_fp8",
            )
    if "vae" in formats:
        written["vae"] = write_vae(vae_dir / "wan_2.1_vae.safetensors", components["vae"], dtype=torch.bfloat16)
    return written


# --------------------------------------------------------------------------------------------------
# Broken and foreign files for error tests


def truncate_copy(src: str | Path, dst: str | Path, fraction: float = 0.5) -> Path:
    """Copies `src` to `dst` cut to `fraction` of its size (a half-finished download)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.truncate(int(dst.stat().st_size * fraction))
    return dst


def non_wan_file(path: str | Path, seed: int = 0) -> Path:
    """A small real safetensors model that is no Wan model: a tiny diffusers `AutoencoderKL` (SD-style
    VAE) state dict, a few hundred KB."""
    from diffusers import AutoencoderKL

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoencoderKL(
            block_out_channels=(8, 16),
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            latent_channels=4,
            norm_num_groups=4,
            layers_per_block=1,
        )
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def expert_files(written, fmt: str, text: str = "umt5_fp16"):
    """The `ExpertFiles` of format `fmt` in what `write_comfy_models` wrote, with text encoder `text`."""
    from wanvace_core import ExpertFiles

    experts = written[fmt]
    if fmt == "split":
        return ExpertFiles(
            high_noise_model=experts["high"]["base"],
            high_noise_vace_module=experts["high"]["vace"],
            low_noise_model=experts["low"]["base"],
            low_noise_vace_module=experts["low"]["vace"],
            text_encoder=written[text],
            vae=written["vae"],
        )
    return ExpertFiles(
        high_noise_model=experts["high"], low_noise_model=experts["low"], text_encoder=written[text], vae=written["vae"]
    )
