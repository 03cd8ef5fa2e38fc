"""One diffusers Wan VACE expert written as the single files ComfyUI users have: original Wan keys, plain or fp8, and
city96-style GGUF. bench/bench_load.py measures loading them; the tests write them too (tests/support/single_files.py
adds the text encoder, the VAE, a whole `models/` tree, and the readers that check what was written).

The formats were read from ComfyUI 0.3.75 and 0.33 (`comfy/utils.py:convert_old_quants`, `comfy/ops.py`,
`comfy/model_detection.py`, `comfy/sd.py`), diffusers' `loaders/single_file_utils.py` and city96's
ComfyUI-GGUF (`tools/convert.py`, `tools/fix_5d_tensors.py`, `tools/lcpp.patch`, `loader.py`); nothing
here is copied from them. tests/integration/test_comfy_accepts_files.py proves ComfyUI's own code accepts them.

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
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
PREFIX = "model.diffusion_model."
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


def single_threaded(function):
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


def original_key(key: str) -> str:
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
        new = original_key(key)
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


def quantize_scaled_fp8(
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


# --------------------------------------------------------------------------------------------------
# Experts


@single_threaded
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
        state = quantize_scaled_fp8(
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


@single_threaded
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


def _gguf_encode(data: np.ndarray, qtype) -> np.ndarray:
    import gguf

    types = gguf.GGMLQuantizationType
    if qtype == types.Q6_K:
        return quantize_q6_k(data)
    return gguf.quants.quantize(data, qtype)


@single_threaded
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
