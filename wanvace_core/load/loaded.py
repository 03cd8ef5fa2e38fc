"""What a loader returns: the pipeline's components and model facts, nothing about how they will run.

`runtime.plan` turns a `LoadedPipeline` into a runnable `runtime.model.WanVACEModel` (residency, parallel
workers, attention, compile); loading never decides any of that.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..errors import WanVACEError

# Model facts: the block lists of each model class whose blocks are streamed, sharded or compiled. A model
# with a parameter-holding ModuleList not named here is refused rather than left out.
BLOCK_LISTS: dict[str, tuple[str, ...]] = {"WanVACETransformer3DModel": ("vace_blocks", "blocks")}
EXPERT_NAMES = ("transformer", "transformer_2")


def block_lists_of(module: torch.nn.Module) -> tuple[str, ...]:
    # By the class or a base: FSDP2 gives a sharded module a subclass of its own (FSDPWanVACETransformer3DModel).
    for cls in type(module).__mro__:
        if cls.__name__ in BLOCK_LISTS:
            return BLOCK_LISTS[cls.__name__]
    raise WanVACEError(
        f"The block lists of {type(module).__name__} are unknown; declare them in wanvace_core.load.loaded.BLOCK_LISTS."
    )


def undeclared_block_lists(module: torch.nn.Module) -> list[str]:
    """Parameter-holding ModuleLists of `module` that the declared block lists miss."""
    declared = set(block_lists_of(module))
    return [
        name
        for name, child in module.named_children()
        if isinstance(child, torch.nn.ModuleList) and name not in declared and any(True for _ in child.parameters())
    ]


def _unique_tensors(modules: Iterable[torch.nn.Module], buffers: bool) -> list[torch.Tensor]:
    unique: dict[int, torch.Tensor] = {}
    for module in modules:
        for tensor in [*module.parameters(), *(module.buffers() if buffers else ())]:
            unique.setdefault(id(tensor), tensor)
    return list(unique.values())


def tensor_bytes(modules: Iterable[torch.nn.Module], buffers: bool = True) -> int:
    """Bytes the (non-meta) parameters, and optionally buffers, of `modules` take, each tensor once."""
    return sum(t.numel() * t.element_size() for t in _unique_tensors(modules, buffers) if not t.is_meta)


def loaded_bytes(modules: Iterable[torch.nn.Module], buffers: bool = True) -> int:
    """Bytes the tensors of `modules` take once loaded (dropped, meta parameters counted at full size)."""
    return sum(t.numel() * t.element_size() for t in _unique_tensors(modules, buffers))


class WeightSource(Protocol):
    """Where a component's weights are read back from after they were dropped (the model's files)."""

    def refill(self, name: str, module: torch.nn.Module, device: torch.device) -> None:
        """Fills the dropped (meta) parameters of component `name` onto `device`."""


@dataclass(eq=False)
class LoadedPipeline:
    """A WanVACE pipeline's components as a loader read them.

    `transformer` is the high-noise expert and `transformer_2` the low-noise one (diffusers naming); a
    Wan2.1-VACE folder has only `transformer`. With `experts_on_meta` the loader left the experts on the
    meta device (they carry only their config: parallel workers load them), and `worker_source` says
    where the workers read them from. `weights` reads dropped weights back.
    """

    source: Path
    dtype: torch.dtype
    device: torch.device
    tokenizer: object
    text_encoder: torch.nn.Module
    vae: torch.nn.Module
    transformer: torch.nn.Module | None
    transformer_2: torch.nn.Module | None
    scheduler_config: dict
    boundary_ratio: float | None
    weights: WeightSource
    max_sequence_length: int = 512
    worker_source: dict | None = field(default=None, repr=False)
