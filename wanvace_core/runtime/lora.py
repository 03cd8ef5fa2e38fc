"""LoRAs on the two experts, for one sampling run: low-rank updates and full weight differences.

Files are read and parsed by `load.lora_files` (`load_lora`: the key layouts it reads are listed there).

`applied_loras` patches the experts for one run and leaves them bitwise as they were afterwards:
Linear layers (also `QuantizedLinear`, whose weights stay fp8/GGUF) get a forward hook adding
`x A^T B^T * strength * alpha / rank` (and `x diff^T + diff_b`) to their output; other modules with
parameter diffs get the patched parameter bound just before they run, computed from the tensor bound
at that moment (so offload's streamed copies are patched too), and the original bound back after.
`merge=True` instead adds the deltas into the weights in place (plain float weights on the device
only) and copies the originals back at the end. Under offload the on-the-fly terms stay in host memory
with the weights and are copied to the device per use.
"""

from __future__ import annotations

import contextlib
import logging
import re
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import WanVACEInputError
from ..hooks import ModuleHooks
from ..load.lora_files import LoraEntry, LoraWeights, load_lora
from ..load.quantized import QuantizedLinear
from ..validation import validate_finite

logger = logging.getLogger(__name__)

STRENGTH_LIMIT = 10.0
# Model widths of the published Wan transformers, to say which model a foreign LoRA was made for.
_KNOWN_WIDTHS = {5120: "a Wan 14B model", 1536: "a Wan 1.3B model", 3072: "the Wan2.2 5B model"}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class LoraPatch:
    """One LoRA file and its strength on each expert (high noise = `transformer`, low noise = `transformer_2`).

    `merge=True` adds the LoRA into the weights for the run (faster steps; plain float weights kept on the
    device only); the default applies it on the fly, which works with every offload mode and fp8/GGUF weights.
    """

    path: Path
    strength_high_noise: float = 1.0
    strength_low_noise: float = 1.0
    merge: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, Path)) or not str(self.path):
            raise WanVACEInputError(f"path={self.path!r} is not a file path; choose a LoRA .safetensors file.")
        object.__setattr__(self, "path", Path(self.path))
        for name in ("strength_high_noise", "strength_low_noise"):
            fix = (
                f"use a value in [-{STRENGTH_LIMIT:g}, {STRENGTH_LIMIT:g}] (1.0 is the LoRA as trained, 0 turns it off)"
            )
            value = validate_finite(name, getattr(self, name), fix)
            if abs(value) > STRENGTH_LIMIT:
                raise WanVACEInputError(f"{name}={getattr(self, name)} is out of range; {fix}.")
            object.__setattr__(self, name, value)
        if not isinstance(self.merge, bool):
            raise WanVACEInputError(f"merge={self.merge!r} must be True or False.")

    def strength(self, expert_attribute: str) -> float:
        return self.strength_high_noise if expert_attribute == "transformer" else self.strength_low_noise


# --------------------------------------------------------------------------------------------------
# Matching a file against the model


@dataclass(frozen=True)
class _Change:
    """One parameter a LoRA entry changes: `module._parameters[attr]`, with the entry's parts for it."""

    module_name: str
    module: torch.nn.Module
    attr: str
    entry: LoraEntry
    part: str  # "low_rank", "diff", "diff_b", "up_bias"


def _is_linear(module: torch.nn.Module) -> bool:

    return isinstance(module, (torch.nn.Linear, QuantizedLinear))


def _param_shape(module: torch.nn.Module, attr: str) -> tuple[int, ...] | None:
    param = module._parameters.get(attr)
    if param is None:
        return None
    if attr == "weight" and _is_linear(module):
        return (module.out_features, module.in_features)  # a QuantizedLinear stores its weight flat
    return tuple(param.shape)


def _submodule(expert: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return expert.get_submodule(name) if name else expert
    except AttributeError:
        return None


def _width(expert: torch.nn.Module) -> int:
    config = expert.config
    return config.num_attention_heads * config.attention_head_dim


def _lora_width(weights: LoraWeights) -> int | None:
    """The model width a LoRA was made for, read from its attention projections, if it has any."""
    for name, entry in weights.entries.items():
        if re.search(r"attn[12]\.to_[qkv]$", name):
            if entry.down is not None:
                return entry.down.shape[1]
            if entry.diff is not None:
                return entry.diff.shape[-1]
    return None


def _describe(width: int) -> str:
    return _KNOWN_WIDTHS.get(width, f"a model of width {width}")


def _foreign(
    weights: LoraWeights, expert: torch.nn.Module, entry: LoraEntry, problem: str, part: str | None = None
) -> WanVACEInputError:
    width, ours = _lora_width(weights), _width(expert)
    if width is not None and width != ours:
        fix = f"this LoRA is for {_describe(width)}, not {_describe(ours)}; use a LoRA made for this model"
    else:
        fix = f"use a LoRA made for this model ({_describe(ours)}: Wan2.2 14B LoRAs for Wan2.2-VACE-Fun-A14B)"
    key = entry.keys.get(part, entry.key)
    return WanVACEInputError(f"LoRA {weights.path} does not fit this model: '{key}' {problem}; {fix}.")


def _changes(weights: LoraWeights, expert: torch.nn.Module) -> list[_Change]:
    """Every parameter `weights` changes in `expert`; the first entry that does not fit is refused."""
    changes = []
    for entry in weights.entries.values():
        module = _submodule(expert, entry.name)
        if module is None:
            # `blocks.N.modulation.diff` / `head.modulation.diff` name a parameter, not a module.
            parent, _, attr = entry.name.rpartition(".")
            owner = _submodule(expert, parent)
            only_diff = entry.down is None and entry.diff_b is None and entry.diff is not None
            if owner is None or not only_diff or _param_shape(owner, attr) is None:
                raise _foreign(weights, expert, entry, f"names {entry.name!r}, which this model does not have")
            _expect_shape(weights, expert, entry, entry.diff, _param_shape(owner, attr), "diff")
            changes.append(_Change(parent, owner, attr, entry, "diff"))
            continue
        weight_shape = _param_shape(module, "weight")
        if entry.down is not None:
            if weight_shape is None:
                problem = f"adds a low-rank update to {entry.name!r}, which has no weight"
                raise _foreign(weights, expert, entry, problem, "down")
            delta = (entry.up.shape[0], *entry.down.shape[1:])
            if _is_linear(module):
                fits = entry.down.ndim == 2 and entry.up.ndim == 2 and delta == weight_shape
            else:  # convolutions: B [out, r, 1, ...] @ A [r, in, k...]
                fits = (
                    delta == weight_shape
                    and all(size == 1 for size in entry.up.shape[2:])
                    and entry.up.ndim == entry.down.ndim
                )
            if not fits:
                raise _foreign(
                    weights,
                    expert,
                    entry,
                    f"has down {list(entry.down.shape)} and up {list(entry.up.shape)}; {entry.name} is "
                    f"{list(weight_shape)} here",
                    "down",
                )
            changes.append(_Change(entry.name, module, "weight", entry, "low_rank"))
        if entry.diff is not None:
            _expect_shape(weights, expert, entry, entry.diff, weight_shape, "diff")
            changes.append(_Change(entry.name, module, "weight", entry, "diff"))
        for part, tensor in (("up_bias", entry.up_bias), ("diff_b", entry.diff_b)):
            if tensor is not None:
                _expect_shape(weights, expert, entry, tensor, _param_shape(module, "bias"), part)
                changes.append(_Change(entry.name, module, "bias", entry, part))
    return changes


def _expect_shape(weights, expert, entry: LoraEntry, tensor: torch.Tensor, shape, part: str) -> None:
    if shape is None:
        problem = f"has a {part} for {entry.name!r}, which has no such parameter here"
        raise _foreign(weights, expert, entry, problem, part)
    if tuple(tensor.shape) != tuple(shape):
        problem = f"has a {list(tensor.shape)} {part}; {entry.name} is {list(shape)} here"
        raise _foreign(weights, expert, entry, problem, part)


def check_lora(model, patch: LoraPatch) -> None:
    """Refuses, before any sampling, a LoRA file that does not fit `model`'s experts (naming file and key). With the
    experts in parallel workers this reads the meta stand-ins' shapes; each rank applies the LoRA itself."""
    weights = load_lora(patch.path)
    _changes(weights, model.reference_expert)
    if patch.merge:
        _refuse_merge(model, _expert_changes(model, [patch]))


# --------------------------------------------------------------------------------------------------
# Applying


def _low_rank_delta(entry: LoraEntry, shape) -> torch.Tensor:
    """B @ A in fp32 in the weight's shape (for a convolution, B [out, r, 1..] @ A [r, in, k..])."""
    return (entry.up.float().flatten(1) @ entry.down.float().flatten(1)).reshape(shape)


def _delta(change: _Change, strength: float) -> torch.Tensor:
    """The change to the parameter, in fp32: strength * (alpha / rank) * B @ A, or strength * diff."""
    entry = change.entry
    if change.part == "low_rank":
        return _low_rank_delta(entry, _param_shape(change.module, "weight")) * (strength * entry.scale)
    if change.part == "up_bias":
        return entry.up_bias.float() * (strength * entry.scale)
    return getattr(entry, change.part).float() * strength


class _OutputTerms:
    """Forward hook of one Linear: adds every patch's term to the output, in the input's dtype."""

    def __init__(self) -> None:
        self.terms: list[tuple[str, tuple[torch.Tensor | None, ...]]] = []
        self._cast: dict[tuple, torch.Tensor] = {}

    def add(self, change: _Change, strength: float, device, dtype) -> None:
        """`device`: where the terms live for the run (the host under offload: copied per use, never kept)."""
        entry = change.entry

        def prepared(tensor):
            # Always a fresh allocation: tensors read from a file sit at its offsets, and CPU GEMM kernels pick
            # their path by operand alignment, so a file's layout would otherwise change the result's last bits.
            return tensor.to(device=device, dtype=dtype, copy=True)

        if change.part == "low_rank":
            # B is scaled once here, so the hook computes (x A^T) B'^T.
            up = entry.up.float() * (strength * entry.scale)
            self.terms.append(("low_rank", (prepared(entry.down), prepared(up))))
        elif change.part == "up_bias":
            self.terms.append(("bias", (prepared(entry.up_bias.float() * (strength * entry.scale)),)))
        elif change.part == "diff":
            self.terms.append(("linear", (prepared(entry.diff.float() * strength),)))
        else:
            self.terms.append(("bias", (prepared(entry.diff_b.float() * strength),)))

    def _like(self, tensor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == x.dtype and tensor.device == x.device:
            return tensor
        if tensor.device != x.device:
            # Offloaded run: the terms stay in host memory, like the weights, and visit the device per use.
            return tensor.to(device=x.device, dtype=x.dtype)
        key = (id(tensor), x.dtype)
        if key not in self._cast:
            self._cast[key] = tensor.to(dtype=x.dtype)
        return self._cast[key]

    def __call__(self, _module, args, output):
        x = args[0]
        linear = torch.nn.functional.linear
        for kind, tensors in self.terms:
            if kind == "low_rank":
                down, up = (self._like(tensor, x) for tensor in tensors)
                output = output + linear(linear(x, down), up)
            elif kind == "linear":
                output = output + linear(x, self._like(tensors[0], x))
            else:
                output = output + self._like(tensors[0], output)
        return output


class _BoundParameters:
    """Pre-hook and hook of a non-Linear module: binds `param + delta` while it runs, the original after."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.deltas: dict[str, list[torch.Tensor]] = {}
        self.bound: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # attr -> (original, patched)

    def add(self, attr: str, delta: torch.Tensor) -> None:
        self.deltas.setdefault(attr, []).append(delta)

    # Rebinding a parameter inside a compiled block's graph (compile on) would be traced and replayed wrongly:
    # these hooks always run eagerly, and the graph reads the parameter they bound.
    @torch.compiler.disable
    def before(self, *_args) -> None:
        self.restore()  # a forward that raised never ran the restoring hook
        for attr, deltas in self.deltas.items():
            param = self.module._parameters[attr]
            current = param.data  # whatever is bound now: the resident weight or offload's device copy
            patched = current.float()
            for delta in deltas:
                patched = patched + delta.to(current.device)
            patched = patched.to(current.dtype)
            param.data = patched
            self.bound[attr] = (current, patched)

    @torch.compiler.disable
    def after(self, *_args) -> None:
        self.restore()

    def restore(self) -> None:
        for attr, (original, patched) in self.bound.items():
            param = self.module._parameters[attr]
            # Offload may already have bound its host copy back after an error: leave that in place.
            if param.data_ptr() == patched.data_ptr():
                param.data = original
        self.bound.clear()


def _compute_dtype(linear: torch.nn.Module, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a Linear computes in: its own for float weights (fp32-kept layers stay fp32), else the model's."""

    if isinstance(linear, QuantizedLinear) or linear.weight.dtype not in _FLOAT_DTYPES:
        return model_dtype
    return linear.weight.dtype


def _resting_place(model) -> str:
    """Where the experts' weights rest between uses, from the model's runtime plan: "none" (on the device), the
    offload mode, or "sharded" (FSDP/HSDP shards across parallel workers)."""
    plan = model.plan
    if plan is None:
        return "none"
    if plan.parallel is not None and plan.parallel.shard != "none":
        return "sharded"
    return plan.offload.mode


def _expert_changes(model, patches: Sequence[LoraPatch]) -> list[tuple[str, LoraPatch, float, list[_Change]]]:
    planned = []
    for patch in patches:
        weights = load_lora(patch.path)
        _changes(weights, model.reference_expert)  # the same refusal as check_lora, for callers that skip it
        for attribute in ("transformer", "transformer_2"):
            expert = getattr(model, attribute)
            strength = patch.strength(attribute)
            if expert is None or strength == 0.0:
                continue
            planned.append((attribute, patch, strength, _changes(weights, expert)))
    return planned


def _refuse_merge(model, planned) -> None:

    for _attribute, patch, _strength, changes in planned:
        if not patch.merge:
            continue
        mode = _resting_place(model)
        if mode == "sharded":
            raise WanVACEInputError(
                f"LoRA {patch.path} has merge on, but shard={model.plan.parallel.shard} keeps each expert weight in "
                "shards across the workers, which cannot be merged into; set merge off (the LoRA is then applied on "
                "the fly, which works with sharding), or set shard to none in WanVACE Parallel Options."
            )
        if mode != "none":
            raise WanVACEInputError(
                f"LoRA {patch.path} has merge on, but offload mode '{mode}' keeps the weights off the device between "
                "uses, so they cannot be merged in place; set merge off (the LoRA is then applied on the fly, which "
                "works with every offload mode)."
            )
        for change in changes:
            param = change.module._parameters[change.attr]
            if isinstance(change.module, QuantizedLinear) and change.attr == "weight":
                raise WanVACEInputError(
                    f"LoRA {patch.path} has merge on, but {change.module_name} keeps its weights as stored "
                    f"({change.module.weight_format.quant or change.module.weight_format.kind}), which cannot be "
                    "merged into; set merge off, or load the experts with weight_dtype bf16/fp16/fp32."
                )
            if param.dtype not in _FLOAT_DTYPES:
                raise WanVACEInputError(
                    f"LoRA {patch.path} has merge on, but {change.module_name}.{change.attr} is stored as "
                    f"{param.dtype}; set merge off."
                )


class _MergedWeight:
    """One weight a merge patch changes: its deltas, and the original it restores (a host copy)."""

    def __init__(self, module: torch.nn.Module, attr: str) -> None:
        self.module = module
        self.attr = attr
        self.terms: list[tuple[_Change, float]] = []
        self.merged_into = None  # a weak reference: an unload must be able to free the merged parameter
        self.original: torch.Tensor | None = None

    def merge(self) -> None:
        """Merges into the parameter bound now, unless it is the one merged already."""
        param = self.module._parameters[self.attr]
        if param.is_meta or (self.merged_into is not None and self.merged_into() is param):
            return
        # A new parameter object is one an unload dropped and a refill read back from the file: unmerged.
        self.original = param.data.to("cpu", copy=True)
        merged = param.data.float()
        # One weight-sized fp32 delta at a time: all of a 14B expert's at once would not fit anywhere.
        for change, strength in self.terms:
            merged = merged + _delta(change, strength).to(merged.device)
        param.data.copy_(merged.to(param.dtype))
        self.merged_into = weakref.ref(param)

    def restore(self) -> None:
        param = self.module._parameters[self.attr]
        if self.merged_into is not None and self.merged_into() is param and not param.is_meta:
            param.data.copy_(self.original)
        self.merged_into = None
        self.original = None


@contextlib.contextmanager
def _merged(model, planned) -> Iterator[None]:
    """Adds the merge patches' deltas into the weights in place; copies the originals back on exit.

    ComfyUI may unload the model between steps (memory pressure, a TAESD preview loading its decoder):
    the weights are then dropped and read back, unmerged, at the next forward, so a pre-hook on each expert,
    after the residency's own, merges into whatever was read back.
    """
    weights: dict[tuple[int, str], _MergedWeight] = {}
    experts: dict[str, list[_MergedWeight]] = {}
    for attribute, patch, strength, changes in planned:
        if not patch.merge:
            continue
        for change in changes:
            key = (id(change.module), change.attr)
            if key not in weights:
                weights[key] = _MergedWeight(change.module, change.attr)
                experts.setdefault(attribute, []).append(weights[key])
            weights[key].terms.append((change, strength))
    hooks = ModuleHooks()

    def merge_all(entries):
        with torch.no_grad():
            for entry in entries:
                entry.merge()

    try:
        for attribute, entries in experts.items():
            model.activate(attribute)  # weights an unload dropped are read back before they are merged into
            merge_all(entries)
            expert = getattr(model, attribute)
            hooks.pre(expert, lambda *_args, _entries=entries: merge_all(_entries))
        yield
    finally:
        hooks.remove()
        with torch.no_grad():
            for entry in weights.values():
                entry.restore()


@contextlib.contextmanager
def applied_loras(model, patches: Sequence[LoraPatch]) -> Iterator[None]:
    """Applies `patches` (in order; their deltas add up) to `model`'s experts for the duration of the block.

    On exit, also after an error or a cancel, every hook is removed and every merged weight is restored bit
    for bit. An expert whose strength is 0 gets nothing at all.
    """
    patches = tuple(patches)
    if not patches:
        yield
        return
    planned = _expert_changes(model, patches)
    _refuse_merge(model, planned)
    # Under offload the weights live in host memory between uses; so do the LoRA terms (copied in per use).
    offloaded = model.plan is not None and model.plan.offload.mode != "none"
    device = torch.device("cpu") if offloaded else model.device
    hooks = ModuleHooks()
    binders: list[_BoundParameters] = []
    try:
        with _merged(model, planned):
            outputs: dict[int, tuple[torch.nn.Module, _OutputTerms]] = {}
            bound: dict[int, _BoundParameters] = {}
            for attribute, patch, strength, changes in planned:
                if patch.merge:
                    _log(patch, attribute, strength, changes, "merged")
                    continue
                for change in changes:
                    if _is_linear(change.module) and change.attr in ("weight", "bias"):
                        terms = outputs.setdefault(id(change.module), (change.module, _OutputTerms()))[1]
                        terms.add(change, strength, device, _compute_dtype(change.module, model.dtype))
                    else:
                        if id(change.module) not in bound:
                            bound[id(change.module)] = _BoundParameters(change.module)
                        bound[id(change.module)].add(change.attr, _delta(change, strength).to(device))
                _log(patch, attribute, strength, changes, "applied on the fly")
            for module, terms in outputs.values():
                # First among the module's output hooks: the terms add to the layer's own output, before a hook that
                # reshapes it (Ulysses gathers `proj_out`'s sequence shards) sees it.
                hooks.post(module, terms, prepend=True)
            for binder in bound.values():
                binders.append(binder)
                # Registered after offload's hooks, so the pre-hook patches the copy offload just bound;
                # prepended, so the original is back before offload's release hook unbinds it.
                hooks.pre(binder.module, binder.before)
                hooks.post(binder.module, binder.after, prepend=True)
            yield
    finally:
        hooks.remove()
        for binder in binders:
            binder.restore()


def _log(patch: LoraPatch, attribute: str, strength: float, changes: list[_Change], how: str) -> None:
    expert = "high-noise" if attribute == "transformer" else "low-noise"
    layers = len({change.module_name for change in changes})
    low_rank = sum(change.part == "low_rank" for change in changes)
    logger.info(
        "LoRA %s on the %s expert, strength %g, %s: %d layers (%d low-rank, %d full differences)",
        patch.path.name,
        expert,
        strength,
        how,
        layers,
        low_rank,
        len(changes) - low_rank,
    )
