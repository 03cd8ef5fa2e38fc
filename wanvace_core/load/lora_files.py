"""LoRA files read and parsed, for `runtime.lora` to apply: low-rank updates and full weight differences.

A file is read once into `LoraWeights` (diffusers module names, tensors as stored) and cached by
(path, mtime, size). Key layouts:

- ComfyUI / kohya on the original Wan names: `diffusion_model.blocks.0.self_attn.q.lora_up.weight`,
  `.lora_down.weight`, `.alpha` (with or without the prefix; also `lora_unet_blocks_0_self_attn_q`);
- PEFT / diffusers: `lora_A.weight`, `lora_B.weight` (and `lora_B.bias`), on diffusers names
  (`transformer.blocks.0.attn1.to_q`) or on the original names;
- lightx2v's full differences: `<module>.diff` (a weight delta: Linear, Conv3d, norms), `<module>.diff_b`
  (a bias delta) and `blocks.N.modulation.diff` / `head.modulation.diff` (the `scale_shift_table`s).

Original names become diffusers names through diffusers' `convert_wan_transformer_to_diffusers`, run
over the names only, as `wan_layouts` does for the experts. diffusers' own Wan LoRA converter
(`_convert_non_diffusers_wan_lora_to_diffusers`, diffusers 0.36 and 0.42 alike) does not fit: it
raises on `vace_blocks.*` keys and silently drops the `.diff` weight deltas and every norm diff.
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import WanVACEInputError

_CACHE_SIZE = 4  # parsed files kept; a 14B rank-64 LoRA is ~0.6 GB in host memory

# Longest first: a key is matched against the first suffix it ends with.
_SUFFIXES = (
    (".lora_down.weight", "down"),
    (".lora_up.weight", "up"),
    (".lora_A.weight", "down"),
    (".lora_B.weight", "up"),
    (".lora_B.bias", "up_bias"),
    (".alpha", "alpha"),
    (".diff_b", "diff_b"),
    (".diff", "diff"),
)
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.")
_UNDERSCORE_PREFIX = "lora_unet_"
# Name parts that contain an underscore, original Wan and diffusers: `lora_unet_` keys join the
# parts of a module path with underscores, so these are matched as one part.
_COMPOUND_PARTS = (
    "vace_patch_embedding",
    "condition_embedder",
    "scale_shift_table",
    "patch_embedding",
    "time_projection",
    "text_embedding",
    "time_embedding",
    "text_embedder",
    "time_embedder",
    "before_proj",
    "vace_blocks",
    "after_proj",
    "cross_attn",
    "self_attn",
    "time_proj",
    "proj_out",
    "linear_1",
    "linear_2",
    "proj_in",
    "img_emb",
    "norm_q",
    "norm_k",
    "to_out",
    "k_img",
    "v_img",
    "to_q",
    "to_k",
    "to_v",
)
# Names only diffusers' layout uses: a file holding any of them is in diffusers names throughout.
_DIFFUSERS_MARKERS = (
    "attn1.",
    "attn2.",
    ".to_q",
    ".to_out",
    "ffn.net.",
    "condition_embedder.",
    "proj_in",
    "proj_out",
    "scale_shift_table",
)


@dataclass
class LoraEntry:
    """What one file holds for one module (or, for parameter diffs, one parameter), in diffusers names."""

    name: str
    keys: dict[str, str] = field(default_factory=dict)  # kind ("down", "diff", ...) -> the file's key, for messages
    down: torch.Tensor | None = None  # A: [rank, in, ...]
    up: torch.Tensor | None = None  # B: [out, rank, ...]
    up_bias: torch.Tensor | None = None
    alpha: float | None = None
    diff: torch.Tensor | None = None
    diff_b: torch.Tensor | None = None

    @property
    def key(self) -> str:
        """The first key of the file naming this entry."""
        return next(iter(self.keys.values()))

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        """alpha / rank, or 1 for a file without alpha (PEFT files fold it into B)."""
        return 1.0 if self.alpha is None else self.alpha / self.rank


@dataclass(frozen=True)
class LoraWeights:
    """A parsed LoRA file: entries by diffusers name. Treat as read-only; it is shared through the cache."""

    path: Path
    naming: str  # "original" (Wan / ComfyUI names) or "diffusers"
    entries: dict[str, LoraEntry] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(
            tensor.numel() * tensor.element_size()
            for entry in self.entries.values()
            for tensor in (entry.down, entry.up, entry.up_bias, entry.diff, entry.diff_b)
            if tensor is not None
        )


_cache: OrderedDict[tuple, LoraWeights] = OrderedDict()
_cache_lock = threading.Lock()


def load_lora(path: str | Path) -> LoraWeights:
    """Reads and parses a LoRA `.safetensors` file; an unchanged file is served from a small cache."""
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise WanVACEInputError(
            f"LoRA {path} is not a .safetensors file; pickle LoRAs (.pt, .ckpt, .bin) are refused. Use the "
            "safetensors release of this LoRA."
        )
    try:
        stat = path.resolve().stat()
    except OSError as error:
        raise WanVACEInputError(f"LoRA {path} cannot be read ({error.strerror}); choose an existing file.") from error
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    weights = _parse(path, _read(path))
    with _cache_lock:
        _cache[key] = weights
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return weights


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise WanVACEInputError(f"LoRA {path} is not a readable safetensors file ({error}); re-download it.") from error


def _split_key(key: str) -> tuple[str, str] | None:
    """(module path as written, kind) of one key, or None for a key no LoRA layout has."""
    name = key
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    for suffix, kind in _SUFFIXES:
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            if module.startswith(_UNDERSCORE_PREFIX):
                module = _dotted(module[len(_UNDERSCORE_PREFIX) :])
            return (module, kind) if module else None
    return None


def _dotted(underscored: str) -> str:
    """`blocks_0_self_attn_q` -> `blocks.0.self_attn.q` (compound parts matched longest first)."""
    parts, rest = [], underscored
    while rest:
        compound = next((part for part in _COMPOUND_PARTS if re.match(re.escape(part) + r"(_|$)", rest)), None)
        part = compound or rest.split("_", 1)[0]
        parts.append(part)
        rest = rest[len(part) + 1 :]
    return ".".join(parts)


def _diffusers_name(original: str) -> str:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    # The converter renames state-dict keys ('.o.' needs the dot after it): give it one as a weight key.
    (renamed,) = convert_wan_transformer_to_diffusers({f"{original}.weight": None})
    return renamed[: -len(".weight")]


def _parse(path: Path, tensors: dict[str, torch.Tensor]) -> LoraWeights:
    split = {}
    for key, tensor in tensors.items():
        parts = _split_key(key)
        if parts is None:
            raise WanVACEInputError(
                f"LoRA {path} holds '{key}', which is no LoRA key this pack knows (lora_up/lora_down/alpha, "
                "lora_A/lora_B, diff/diff_b); use a LoRA made for Wan (ComfyUI, kohya, diffusers or lightx2v)."
            )
        if not (tensor.dtype.is_floating_point):
            raise WanVACEInputError(f"LoRA {path} stores '{key}' as {tensor.dtype}, not floats; re-download it.")
        split[key] = parts
    if not split:
        raise WanVACEInputError(f"LoRA {path} holds no tensors; use a LoRA made for this model.")
    names = {module for module, _ in split.values()}
    naming = "diffusers" if any(marker in name for name in names for marker in _DIFFUSERS_MARKERS) else "original"
    renamed = {name: name if naming == "diffusers" else _diffusers_name(name) for name in names}
    entries: dict[str, LoraEntry] = {}
    for key, (module, kind) in split.items():
        name = renamed[module]
        entry = entries.setdefault(name, LoraEntry(name))
        entry.keys.setdefault(kind, key)
        if kind == "alpha":
            if tensors[key].numel() != 1:
                raise WanVACEInputError(
                    f"LoRA {path} has a {list(tensors[key].shape)} alpha '{key}'; alpha is one number. Re-download it."
                )
            entry.alpha = float(tensors[key].float().item())
        elif getattr(entry, kind) is not None:
            raise WanVACEInputError(
                f"LoRA {path} holds '{key}' twice under different spellings; the file is malformed, re-download it."
            )
        else:
            setattr(entry, kind, tensors[key])
    for entry in entries.values():
        _check_entry(path, entry)
    return LoraWeights(path, naming, entries)


def _check_entry(path: Path, entry: LoraEntry) -> None:
    if (entry.down is None) != (entry.up is None):
        missing = "up (lora_up / lora_B)" if entry.up is None else "down (lora_down / lora_A)"
        raise WanVACEInputError(
            f"LoRA {path} has '{entry.key}' without its {missing} matrix; the file is incomplete, re-download it."
        )
    if entry.down is None and (entry.alpha is not None or entry.up_bias is not None):
        raise WanVACEInputError(
            f"LoRA {path} has '{entry.key}' without the low-rank matrices it belongs to; re-download it."
        )
    if entry.down is not None:
        if entry.down.ndim < 2 or entry.up.ndim < 2 or entry.up.shape[1] != entry.down.shape[0]:
            raise WanVACEInputError(
                f"LoRA {path} has '{entry.key}' with down {list(entry.down.shape)} and up {list(entry.up.shape)}, "
                "whose ranks do not match; the file is malformed, re-download it."
            )
        if entry.alpha is not None and not math.isfinite(entry.alpha):
            raise WanVACEInputError(f"LoRA {path} has alpha {entry.alpha} for '{entry.key}'; re-download it.")
