"""Writes one tiny diffusers Wan VACE model in every single-file layout ComfyUI users have.

Test-side only: the product loader must read these files, and
tests/integration/test_comfy_accepts_files.py proves ComfyUI's own code accepts them. The formats were
read from ComfyUI 0.3.75 and 0.33 (`comfy/utils.py:convert_old_quants`, `comfy/ops.py`,
`comfy/model_detection.py`, `comfy/sd.py`), diffusers' `loaders/single_file_utils.py` and city96's
ComfyUI-GGUF (`tools/convert.py`, `tools/fix_5d_tensors.py`, `tools/lcpp.patch`, `loader.py`); nothing
here is copied from them.

Layouts (high-noise expert = diffusers `transformer`, low-noise expert = `transformer_2`):

- Expert, plain (`write_expert(quant=None)`): original Wan keys (`original_wan_state_dict`), every tensor
  in one dtype, optional `model.diffusion_model.` prefix, no metadata.
- Expert, legacy "fp8_scaled" (`quant="scaled_fp8"`, Comfy-Org's `*_fp8_scaled.safetensors`): a
  `scaled_fp8` marker tensor (empty, dtype float8_e4m3fn, as ComfyUI's own save writes it; ComfyUI
  also reads an fp32 marker as e4m3fn and a 2-element marker as "full-precision matmul"), each
  quantised Linear weight in float8_e4m3fn with a 0-dim fp32 `<layer>.scale_weight` = amax / 448 and a
  0-dim fp32 `<layer>.scale_input` = 1.0. By default every `nn.Linear` of the expert is quantised
  (blocks, VACE blocks, text/time embeddings, time projection, head): ComfyUI 0.3.75's scaled-fp8 ops
  give every Linear an fp8 weight plus `scale_weight`/`scale_input`, so only such a file loads there
  without "unet missing" keys (`fp8_layers="blocks"` quantises only `blocks.*`/`vace_blocks.*`). Biases,
  norms, modulation and the patch-embedding convs stay in `dtype`. The real files' key lists were not
  available to check which Linears they quantise.
- Expert, mixed precision (`quant="mixed_fp8"`, ComfyUI's current scheme, QUANTIZATION.md; Comfy-Org
  names such files `*_fp8mixed.safetensors`): the Linear weights of `blocks.*`/`vace_blocks.*` in float8_e4m3fn with a
  0-dim fp32 `<layer>.weight_scale` (optionally `<layer>.input_scale`), everything else in `dtype`. The
  layer list is written in both forms ComfyUI knows (`mixed_form="both"`): the safetensors header entry
  `_quantization_metadata` = {"format_version": "1.0", "layers": {layer: {"format": "float8_e4m3fn"}}}
  (layer names without prefix: what 0.3.75 reads, and 0.33 turns it into tensors) and a uint8
  `<layer>.comfy_quant` tensor holding the JSON {"format": "float8_e4m3fn"} (what 0.33 itself saves and
  reads). 0.3.75 reads only the header and reports the `.comfy_quant` tensors as unexpected keys;
  `mixed_form="header"` / `"tensors"` write one form only.
- `parts="base"`: everything but `vace_blocks.*`/`vace_patch_embedding.*` (a Wan2.2-T2V expert file);
  `parts="vace"`: only those (Kijai's `Wan2_2_Fun_VACE_module_A14B_*` files, merged into the base state
  dict by `sd.update(vace_sd)` as KJNodes' DiffusionModelLoaderKJ does).
- GGUF (`write_gguf_expert`): arch "wan", unprefixed original keys, city96's type rules (see there).
- umt5 (`write_umt5`): HF T5 encoder names, a relative-attention bias in every block, no
  `encoder.embed_tokens.weight`, the sentencepiece model as a uint8 `spiece_model` tensor; the
  "fp8_e4m3fn_scaled" variant quantises the 7 Linear weights of every block (q, k, v, o, wi_0, wi_1, wo:
  168 `scale_weight`s in the real 24-block file) and carries the `scaled_fp8` marker.
- VAE (`write_vae`): original Wan 2.1 VAE keys, the exact inverse of diffusers'
  `convert_wan_vae_to_diffusers`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
PREFIX = "model.diffusion_model."
# ComfyUI's T5 attention (comfy/text_encoders/t5.py) hard-codes 32 buckets and max distance 128.
COMFY_T5_BUCKETS = 32
COMFY_T5_MAX_DISTANCE = 128
MIXED_FORMS = ("both", "header", "tensors")


@contextlib.contextmanager
def single_thread():
    """One intra-op thread while writing: these tensors are tiny, and on a busy machine torch's thread
    pool makes each small op ~100x slower than running it on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _single_threaded(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with single_thread():
            return function(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------------------------------
# Transformer keys: diffusers WanVACETransformer3DModel <-> original Wan


_TOP_LEVEL = {
    "scale_shift_table": "head.modulation",
    "proj_out.weight": "head.head.weight",
    "proj_out.bias": "head.head.bias",
    "condition_embedder.time_embedder.linear_1.": "time_embedding.0.",
    "condition_embedder.time_embedder.linear_2.": "time_embedding.2.",
    "condition_embedder.text_embedder.linear_1.": "text_embedding.0.",
    "condition_embedder.text_embedder.linear_2.": "text_embedding.2.",
    "condition_embedder.time_proj.": "time_projection.1.",
    "patch_embedding.": "patch_embedding.",
    "vace_patch_embedding.": "vace_patch_embedding.",
}
# Inside `blocks.N.` / `vace_blocks.N.` (diffusers name -> original name).
_IN_BLOCK = {
    "scale_shift_table": "modulation",
    "attn1.to_q.": "self_attn.q.",
    "attn1.to_k.": "self_attn.k.",
    "attn1.to_v.": "self_attn.v.",
    "attn1.to_out.0.": "self_attn.o.",
    "attn1.norm_q.": "self_attn.norm_q.",
    "attn1.norm_k.": "self_attn.norm_k.",
    "attn2.to_q.": "cross_attn.q.",
    "attn2.to_k.": "cross_attn.k.",
    "attn2.to_v.": "cross_attn.v.",
    "attn2.to_out.0.": "cross_attn.o.",
    "attn2.norm_q.": "cross_attn.norm_q.",
    "attn2.norm_k.": "cross_attn.norm_k.",
    # diffusers' affine `norm2` is the cross-attention norm, original `norm3`.
    "norm2.": "norm3.",
    "ffn.net.0.proj.": "ffn.0.",
    "ffn.net.2.": "ffn.2.",
}
_IN_VACE_BLOCK = {"proj_in.": "before_proj.", "proj_out.": "after_proj.", **_IN_BLOCK}
_BLOCK = re.compile(r"^(vace_blocks|blocks)\.(\d+)\.(.+)$")


def _original_key(key: str) -> str:
    match = _BLOCK.match(key)
    if match:
        kind, index, rest = match.groups()
        table = _IN_VACE_BLOCK if kind == "vace_blocks" else _IN_BLOCK
        for old, new in table.items():
            if rest.startswith(old):
                return f"{kind}.{index}.{new}{rest[len(old) :]}"
        raise KeyError(f"no original Wan name for diffusers key {key!r}")
    for old, new in _TOP_LEVEL.items():
        if key == old or (old.endswith(".") and key.startswith(old)):
            return new + key[len(old) :]
    raise KeyError(f"no original Wan name for diffusers key {key!r}")


def original_wan_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The diffusers expert's tensors under their original Wan names (same tensor objects, no copy).

    The exact inverse of diffusers' `convert_wan_transformer_to_diffusers` for a Wan VACE T2V model;
    raises KeyError on a key it does not know (I2V image embedder, Animate, ...).
    """
    state = transformer.state_dict() if hasattr(transformer, "state_dict") else dict(transformer)
    out = {}
    for key, value in state.items():
        new = _original_key(key)
        if new in out:
            raise KeyError(f"two diffusers keys map to {new!r}")
        out[new] = value
    return out


def is_vace_key(key: str) -> bool:
    """True for the tensors of Kijai's VACE module files (`vace_blocks.*`, `vace_patch_embedding.*`)."""
    key = key.removeprefix(PREFIX)
    return key.startswith(("vace_blocks.", "vace_patch_embedding."))


def linear_weight_keys(state: dict[str, torch.Tensor], *, blocks_only: bool = False) -> list[str]:
    """Original-layout keys of the `nn.Linear` weights of an expert (2-D `.weight`s; convs are 5-D).

    `blocks_only` keeps those under `blocks.*` / `vace_blocks.*` (attention q/k/v/o, ffn.0/ffn.2,
    VACE before_proj/after_proj).
    """
    keys = [k for k, v in state.items() if k.endswith(".weight") and v.ndim == 2]
    if blocks_only:
        keys = [k for k in keys if k.removeprefix(PREFIX).startswith(("blocks.", "vace_blocks."))]
    return keys


def select_parts(state: dict[str, torch.Tensor], parts: str) -> dict[str, torch.Tensor]:
    if parts == "all":
        return dict(state)
    if parts == "base":
        return {k: v for k, v in state.items() if not is_vace_key(k)}
    if parts == "vace":
        return {k: v for k, v in state.items() if is_vace_key(k)}
    raise ValueError(f"parts must be 'all', 'base' or 'vace', not {parts!r}")


# --------------------------------------------------------------------------------------------------
# fp8


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor absmax float8_e4m3fn: (fp8 weight, 0-dim fp32 scale) with weight ~= fp8 * scale."""
    w = weight.detach().float()
    amax = w.abs().max()
    scale = (amax / FP8_MAX) if amax > 0 else torch.tensor(1.0)
    scale = scale.to(torch.float32).reshape(())
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * scale.float()


def fp8_tolerance(reference: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Largest rounding error of e4m3fn at each element: half an ulp (3 mantissa bits) or of a subnormal."""
    scale = float(scale)
    return reference.detach().float().abs() * 2.0**-4 + scale * 2.0**-10 + 1e-12


def _quantize_scaled_fp8(
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    layers: Iterable[str],
    *,
    scale_input: bool,
    marker: torch.dtype,
) -> dict[str, torch.Tensor]:
    weight_keys = set(layers)
    out = {}
    for key, value in state.items():
        if key in weight_keys:
            layer = key[: -len(".weight")]
            out[key], out[f"{layer}.scale_weight"] = quantize_fp8(value)
            if scale_input:
                out[f"{layer}.scale_input"] = torch.ones((), dtype=torch.float32)
        else:
            out[key] = value.detach().to(dtype)
    out["scaled_fp8"] = scaled_fp8_marker(marker)
    return out


def scaled_fp8_marker(marker: torch.dtype | str = FP8) -> torch.Tensor:
    """The `scaled_fp8` key ComfyUI's `convert_old_quants` looks for.

    `FP8` (default): empty float8_e4m3fn tensor (ComfyUI's own save); `torch.float32`: empty fp32, read
    as e4m3fn; `"fp32x2"`: two fp32 elements, read as e4m3fn with full-precision matmul.
    """
    if marker == "fp32x2":
        return torch.zeros(2, dtype=torch.float32)
    return torch.empty(0, dtype=marker)


def _quantize_mixed_fp8(
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    layers: Iterable[str],
    *,
    input_scale: bool,
    form: str,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if form not in MIXED_FORMS:
        raise ValueError(f"mixed_form must be one of {MIXED_FORMS}, not {form!r}")
    weight_keys = set(layers)
    out = {}
    header_layers = {}
    for key, value in state.items():
        if key not in weight_keys:
            out[key] = value.detach().to(dtype)
            continue
        layer = key[: -len(".weight")]
        out[key], out[f"{layer}.weight_scale"] = quantize_fp8(value)
        if input_scale:
            out[f"{layer}.input_scale"] = torch.ones((), dtype=torch.float32)
        conf = {"format": "float8_e4m3fn"}
        if form in ("both", "tensors"):
            out[f"{layer}.comfy_quant"] = comfy_quant_tensor(conf)
        header_layers[layer.removeprefix(PREFIX)] = conf
    metadata = {}
    if form in ("both", "header"):
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": header_layers})
    return out, metadata


def comfy_quant_tensor(conf: dict) -> torch.Tensor:
    """A layer's `<layer>.comfy_quant` tensor: its JSON config as uint8 bytes."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def read_comfy_quant(tensor: torch.Tensor) -> dict:
    return json.loads(bytes(tensor.tolist()).decode("utf-8"))


# --------------------------------------------------------------------------------------------------
# Experts


@_single_threaded
def expert_state_dict(
    transformer,
    *,
    dtype: torch.dtype = torch.bfloat16,
    prefix: str = "",
    quant: str | None = None,
    parts: str = "all",
    fp8_layers: str | None = None,
    scale_input: bool | None = None,
    marker: torch.dtype | str = FP8,
    mixed_form: str = "both",
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What `write_expert` writes: (tensors, safetensors metadata)."""
    if prefix not in ("", PREFIX):
        raise ValueError(f"prefix must be '' or {PREFIX!r}, not {prefix!r}")
    state = select_parts(original_wan_state_dict(transformer), parts)
    metadata: dict[str, str] = {}
    if quant is None:
        state = {k: v.detach().to(dtype) for k, v in state.items()}
    elif quant == "scaled_fp8":
        layers = linear_weight_keys(state, blocks_only=(fp8_layers or "all_linear") == "blocks")
        state = _quantize_scaled_fp8(
            state, dtype, layers, scale_input=True if scale_input is None else scale_input, marker=marker
        )
    elif quant == "mixed_fp8":
        layers = linear_weight_keys(state, blocks_only=(fp8_layers or "blocks") == "blocks")
        state, metadata = _quantize_mixed_fp8(state, dtype, layers, input_scale=bool(scale_input), form=mixed_form)
    else:
        raise ValueError(f"quant must be None, 'scaled_fp8' or 'mixed_fp8', not {quant!r}")
    if prefix:
        # The marker too: ComfyUI 0.3.75 drops unprefixed keys of a prefixed file before it looks for
        # `scaled_fp8`; 0.33 finds it either way.
        state = {prefix + k: v for k, v in state.items()}
    return {k: v.contiguous() for k, v in state.items()}, metadata


@_single_threaded
def write_expert(
    path: str | Path,
    transformer,
    *,
    dtype: torch.dtype = torch.bfloat16,
    prefix: str = "",
    quant: str | None = None,
    parts: str = "all",
    fp8_layers: str | None = None,
    scale_input: bool | None = None,
    marker: torch.dtype | str = FP8,
    mixed_form: str = "both",
) -> Path:
    """Writes one expert as a Comfy-Org-style single safetensors file (layouts: module docstring).

    `fp8_layers`: which Linear weights get fp8, "all_linear" (default for scaled_fp8) or "blocks"
    (default for mixed_fp8: only `blocks.*`/`vace_blocks.*`). `scale_input`: write `scale_input`
    (scaled_fp8, default True) / `input_scale` (mixed_fp8, default False) = 1.0 per quantised layer.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state, metadata = expert_state_dict(
        transformer,
        dtype=dtype,
        prefix=prefix,
        quant=quant,
        parts=parts,
        fp8_layers=fp8_layers,
        scale_input=scale_input,
        marker=marker,
        mixed_form=mixed_form,
    )
    save_file(state, str(path), metadata=metadata or None)
    return path


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


# --------------------------------------------------------------------------------------------------
# GGUF (city96's ComfyUI-GGUF conventions for arch "wan")

# llama-quantize (city96's lcpp.patch) leaves these Wan tensors unquantised, in the BF16 of the source.
GGUF_WAN_KEEP_SOURCE_TYPE = (
    "modulation.",
    "patch_embedding.",
    "text_embedding.",
    "time_projection.",
    "time_embedding.",
    "img_emb.",
    "head.",
)
GGUF_QUANTIZATION_THRESHOLD = 1024  # tools/convert.py: tensors with <= this many elements stay F32
QK_K = 256


def gguf_type_for(key: str, shape: tuple[int, ...], qtype: str):
    """The GGML type city96's tools give an original Wan tensor of a BF16 source in a `qtype` file.

    tools/convert.py: 1-D tensors, tensors of <= 1024 elements and `.modulation` -> F32; 5-D conv
    weights are cut out and added back as F32 with their 5-D shape (tools/fix_5d_tensors.py; no
    `comfy.gguf.orig_shape` metadata, which is only for reshaped SD1/SDXL tensors); the rest BF16.
    llama-quantize with city96's patch then keeps `modulation.`, `patch_embedding.`, `text_embedding.`,
    `time_projection.`, `time_embedding.`, `img_emb.` and `head.` tensors as they are (BF16) and
    quantises the others; a K-quant whose rows are not a multiple of 256 falls back to F16.
    """
    import gguf

    types = gguf.GGMLQuantizationType
    numel = int(np.prod(shape))
    if len(shape) > 4 or len(shape) == 1 or numel <= GGUF_QUANTIZATION_THRESHOLD or ".modulation" in key:
        return types.F32
    if any(part in key for part in GGUF_WAN_KEEP_SOURCE_TYPE):
        return types.BF16
    target = getattr(types, qtype)
    block_size = gguf.GGML_QUANT_SIZES[target][0]
    if shape[-1] % block_size != 0:
        return types.F16
    return target


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K blocks of a float array whose last dimension is a multiple of 256 (gguf-py has no Q6_K
    quantiser). Returns uint8 of shape (..., last // 256 * 210), the layout `gguf.quants.dequantize`
    (and ggml's `dequantize_row_q6_K`) reads.

    A block of 256 values holds 16 sub-blocks of 16, each with a signed 8-bit scale, times one fp16
    super-scale `d`; a value is `d * scale[sub] * (q - 32)` with a 6-bit `q`. Stored per block:
    `ql` (128 bytes, low 4 bits of q), `qh` (64 bytes, high 2 bits), `scales` (16 int8), `d` (fp16).
    Within each half of 128 values, value r's low nibble is byte `r % 64` of that half's 64 `ql` bytes
    (low nibble for r < 64, high nibble above) and its high 2 bits are bits `2 * (r // 32)` of byte
    `r % 32` of that half's 32 `qh` bytes. Scales here are symmetric absmax (sub-block amax / 31), not
    ggml's error-searching `make_qx_quants`: a simpler quantiser, the same format.
    """
    data = np.asarray(data, dtype=np.float32)
    if data.shape[-1] % QK_K != 0:
        raise ValueError(f"Q6_K needs rows that are a multiple of {QK_K}, got {data.shape}")
    blocks = data.reshape(-1, QK_K)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    sub_scale = np.abs(sub).max(axis=-1) / 31.0  # (n, 16)
    d = (sub_scale.max(axis=-1) / 127.0).astype(np.float16)  # (n,)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(d32[:, None] > 0, np.rint(sub_scale / d32[:, None]), 0)
    scales = np.clip(scales, -128, 127).astype(np.int8)
    step = d32[:, None] * scales.astype(np.float32)  # (n, 16): the value of one q unit
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(sub / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # 0..63, two halves
    low, high = q & 0x0F, q >> 4
    ql = low[:, :, :64] | (low[:, :, 64:] << 4)  # (n, 2, 64)
    hh = high.reshape(n, 2, 4, 32)
    qh = hh[:, :, 0] | (hh[:, :, 1] << 2) | (hh[:, :, 2] << 4) | (hh[:, :, 3] << 6)  # (n, 2, 32)
    packed = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), scales.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1
    )
    return packed.reshape(*data.shape[:-1], data.shape[-1] // QK_K * 210)


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


def _gguf_encode(data: np.ndarray, qtype) -> np.ndarray:
    import gguf

    types = gguf.GGMLQuantizationType
    if qtype == types.Q6_K:
        return quantize_q6_k(data)
    return gguf.quants.quantize(data, qtype)


@_single_threaded
def write_gguf_expert(path: str | Path, transformer, qtype: str = "Q8_0") -> Path:
    """Writes one expert as a city96-style GGUF (arch "wan"): original unprefixed Wan keys, the source
    rounded to bf16 first (the files are made from the bf16 release), types per `gguf_type_for`,
    `general.architecture` "wan", `general.quantization_version`, `general.file_type`. Works with
    gguf-py 0.10 and 0.19. The reader shows ggml's reversed shapes; city96's loader reverses them back."""
    import gguf

    if qtype not in ("Q8_0", "Q6_K"):
        raise ValueError(f"qtype must be 'Q8_0' or 'Q6_K', not {qtype!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    file_type = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K}[qtype]
    writer = gguf.GGUFWriter(str(path), arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(file_type)
    for key, tensor in original_wan_state_dict(transformer).items():
        data = tensor.detach().to(torch.bfloat16).float().numpy()
        target = gguf_type_for(key, data.shape, qtype)
        writer.add_tensor(key, _gguf_encode(data, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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


@_single_threaded
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
        out = _quantize_scaled_fp8(state, dtype, layers, scale_input=False, marker=FP8)
    else:
        raise ValueError(f"quant must be None or 'scaled_fp8', not {quant!r}")
    out["spiece_model"] = torch.frombuffer(bytearray(sentencepiece_bytes), dtype=torch.uint8).clone()
    return {k: v.contiguous() for k, v in out.items()}


@_single_threaded
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


@_single_threaded
def write_vae(path: str | Path, vae, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes the VAE as ComfyUI's `wan_2.1_vae.safetensors` (original keys, one dtype, no metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in original_wan_vae_state_dict(vae).items()}
    save_file(state, str(path))
    return path


# --------------------------------------------------------------------------------------------------
# The tiny model shaped for ComfyUI, and a whole models/ tree


@_single_threaded
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


@_single_threaded
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
