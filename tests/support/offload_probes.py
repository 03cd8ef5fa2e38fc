"""Observations of offload taken from the real modules and the real copies, not from the offloader's books.

- `BlockProbe` hooks every block of every expert and, as each block starts, records its name and which
  blocks of that expert are running on copied (device) weights at that moment.
- `MeasuredTransfer` is a `SynchronousTransfer` that keeps a weak reference to the storage of every copy
  it makes: `live_bytes()` is what the storages still alive take, i.e. what was not freed.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from wanvace_core.runtime.interleave import stock_execution_order
from wanvace_core.runtime.offload import EXPERTS
from wanvace_core.runtime.plan import RuntimePlan, replan
from wanvace_core.runtime.transfer import SynchronousTransfer


def _first_weight(block: torch.nn.Module) -> torch.Tensor:
    return next(block.parameters())


class BlockProbe:
    """With a `MeasuredTransfer`, also counts the block copies alive (bound or prefetched) as each block starts."""

    def __init__(self, model, transfer: MeasuredTransfer | None = None) -> None:
        self.transfer = transfer
        self.runs: dict[str, list[str]] = {}
        self.resident_when_run: dict[str, list[int]] = {}
        self.live_copies_when_run: dict[str, list[int]] = {}
        self._handles = []
        for expert_name in EXPERTS:
            expert = getattr(model, expert_name, None)
            if expert is None:
                continue
            # Taken while nothing runs: every block points at its host weights. The block objects are kept:
            # cache-dit replaces `expert.blocks` by its wrapper while it runs.
            blocks = {name: expert.get_submodule(name) for name in stock_execution_order(expert)}
            host = {name: (block, _first_weight(block).data_ptr()) for name, block in blocks.items()}
            self.runs[expert_name], self.resident_when_run[expert_name] = [], []
            self.live_copies_when_run[expert_name] = []
            for name, block in blocks.items():
                self._handles.append(
                    block.register_forward_pre_hook(lambda *_, _e=expert_name, _n=name, _h=host: self._seen(_e, _n, _h))
                )

    def _seen(self, expert_name: str, name: str, host: dict) -> None:
        copied = [n for n, (block, ptr) in host.items() if _first_weight(block).data_ptr() != ptr]
        assert name in copied, f"{expert_name}.{name} ran on its host weights, not on a device copy"
        self.runs[expert_name].append(name)
        self.resident_when_run[expert_name].append(len(copied))
        if self.transfer is not None:
            self.live_copies_when_run[expert_name].append(self.transfer.live_units(expert_name + "."))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class MeasuredTransfer(SynchronousTransfer):
    copies: list = field(default_factory=list)  # (unit name, [(storage weak reference, bytes)])
    loads: list = field(default_factory=list)  # unit names copied whole, in order

    def begin(self, unit):
        tensors = super().begin(unit)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}.values()
        self.copies.append((unit.name, [(StorageWeakRef(storage), storage.nbytes()) for storage in storages]))
        return tensors

    def load(self, unit):
        self.loads.append(unit.name)
        return self.begin(unit)

    def live_units(self, prefix: str) -> int:
        """Units named `prefix...` whose copies are still alive (no garbage collection: called per block)."""
        return sum(1 for name, refs in self.copies if name.startswith(prefix) and any(not r.expired() for r, _ in refs))

    def live_bytes(self) -> int:
        gc.collect()
        return sum(nbytes for _, refs in self.copies for ref, nbytes in refs if not ref.expired())


def units_of(offloader, component: str) -> list:
    """Every unit of an `Offloader` that moves weights of `component` (its own, and its streamed blocks)."""
    units = [offloader.units[component]] if component in offloader.units else []
    if component in offloader.streamers:
        units += offloader.streamers[component].units.values()
    return units


def attach_offload(model, options, transfer=None, *, stream_ops=None) -> None:
    """`replan` with new offload options only (the model's other runtime options kept)."""
    current = model.plan if model.plan is not None else RuntimePlan()
    replan(model, dataclasses.replace(current, offload=options), transfer, stream_ops=stream_ops)
