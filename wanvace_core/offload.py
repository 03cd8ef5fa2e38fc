"""Where weights live while a pipeline runs: all on the device, one component at a time, or block by block.

- `none`: every component is on the compute device.
- `model`: a component moves to the device only while it runs (text encoder, then the high-noise
  expert, then the low-noise expert, then the VAE); activating one sends the previous one back, so
  two experts are never on the device together.
- `layerwise`: like `model` for the text encoder and VAE; an expert's small non-block weights move
  with it, while its blocks stream in just before they run, `prefetch_blocks` ahead, in the order the
  forward runs them (`vace_blocks.k` interleaved before `blocks.vace_layers[k]`), and go back right
  after.

The copying sits behind `Transfer`: `SynchronousTransfer` copies on the calling thread (CPU, and the
reference for tests); `CudaStreamTransfer` stages blocks through a bounded ring of pinned buffers
and copies them on a side stream. Everything else (what is resident, when, in which order, what is
freed) is ordinary Python, tested on the CPU.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .errors import WanVACEError, WanVACEInputError
from .interleave import current_execution_order, execution_order

logger = logging.getLogger(__name__)

OFFLOAD_MODES = ("none", "model", "layerwise")
_EVENT_HISTORY = 20_000
COMPONENTS = ("text_encoder", "transformer", "transformer_2", "vae")
EXPERTS = ("transformer", "transformer_2")

# Model facts: the block lists of each streamed model class. A model with a parameter-holding
# ModuleList not named here is refused rather than left resident.
BLOCK_LISTS: dict[str, tuple[str, ...]] = {"WanVACETransformer3DModel": ("vace_blocks", "blocks")}


@dataclass(frozen=True)
class OffloadOptions:
    """How weights move between host memory and the compute device. Validated once."""

    mode: str = "none"
    prefetch_blocks: int = 1
    max_pinned_mb: int = 0

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise WanVACEInputError(f"mode={self.mode!r} is unknown; choose one of {', '.join(OFFLOAD_MODES)}.")
        if not 0 <= self.prefetch_blocks <= 16:
            raise WanVACEInputError(f"prefetch_blocks={self.prefetch_blocks} must lie in [0, 16]; 1-2 is typical.")
        if self.max_pinned_mb < 0:
            raise WanVACEInputError(f"max_pinned_mb={self.max_pinned_mb} must be 0 (automatic) or positive.")


def block_lists_of(module: torch.nn.Module) -> tuple[str, ...]:
    try:
        return BLOCK_LISTS[type(module).__name__]
    except KeyError as error:
        raise WanVACEError(
            f"Layerwise offload does not know the block lists of {type(module).__name__}; "
            "declare them in wanvace_core.offload.BLOCK_LISTS."
        ) from error


def undeclared_block_lists(module: torch.nn.Module) -> list[str]:
    """Parameter-holding ModuleLists of `module` that the declared block lists miss."""
    declared = set(block_lists_of(module))
    return [
        name
        for name, child in module.named_children()
        if isinstance(child, torch.nn.ModuleList) and name not in declared and any(True for _ in child.parameters())
    ]


class Unit:
    """A set of tensors that moves as one: a block, a component, or an expert's non-block weights."""

    def __init__(self, name: str, tensors: Iterable[tuple[torch.nn.Module, str, bool]]) -> None:
        self.name = name
        self.slots = list(tensors)
        self.host = [self._get(module, attr, is_param) for module, attr, is_param in self.slots]
        self.nbytes = sum(tensor.numel() * tensor.element_size() for tensor in self.host)
        self.staged_nbytes = sum(_padded(tensor) for tensor in self.host)
        on_device = [tensor.device for tensor in self.host if tensor.device.type != "cpu"]
        if on_device:
            raise WanVACEError(
                f"{name} has weights on {on_device[0]}; offload needs them in host memory (load with device='cpu')."
            )

    @staticmethod
    def _get(module: torch.nn.Module, attr: str, is_param: bool) -> torch.Tensor:
        return (module._parameters if is_param else module._buffers)[attr].data

    def bind(self, tensors: list[torch.Tensor]) -> None:
        for (module, attr, is_param), tensor in zip(self.slots, tensors, strict=True):
            if is_param:
                module._parameters[attr].data = tensor
            else:
                module._buffers[attr] = tensor

    def unbind(self) -> None:
        self.bind(self.host)

    @classmethod
    def of_module(cls, name: str, module: torch.nn.Module, skip: tuple[str, ...] = ()) -> Unit:
        """Every parameter and buffer of `module` outside the child modules named in `skip`."""
        slots, seen = [], set()
        for module_name, submodule in module.named_modules():
            if any(module_name == prefix or module_name.startswith(prefix + ".") for prefix in skip):
                continue
            for attr, value in submodule._parameters.items():
                # A parameter shared by two modules (tied embeddings) moves once; both see the new data.
                if value is not None and id(value) not in seen:
                    seen.add(id(value))
                    slots.append((submodule, attr, True))
            slots += [(submodule, attr, False) for attr, value in submodule._buffers.items() if value is not None]
        return cls(name, slots)


_ALIGNMENT = 64


def _padded(tensor: torch.Tensor) -> int:
    """Bytes `tensor` takes in a staging buffer where every tensor starts on a 64-byte boundary."""
    size = tensor.numel() * tensor.element_size()
    return (size + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


class Transfer(Protocol):
    """Copies a unit's host tensors to the compute device."""

    device: torch.device

    def begin(self, unit: Unit) -> object:
        """Starts copying; returns a handle for `finish` and `release`."""

    def finish(self, unit: Unit, handle: object) -> list[torch.Tensor]:
        """Waits for the copy; returns device tensors ready for the compute stream."""

    def release(self, unit: Unit, handle: object) -> None:
        """The unit's device tensors are no longer used by work queued from now on."""

    def load(self, unit: Unit) -> list[torch.Tensor]:
        """Copies a whole component synchronously (outside any ring); returns its device tensors."""


def _copy_keeping_alignment(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy at the same address offset modulo 64 as `tensor`.

    CPU GEMM kernels pick their code path by operand alignment, so a copy at another alignment can
    round differently; keeping the offset keeps CPU results bitwise equal to the uncopied weights.
    """
    size = tensor.numel() * tensor.element_size()
    buffer = torch.empty(size + 64, dtype=torch.uint8)
    shift = (tensor.data_ptr() - buffer.data_ptr()) % 64
    copy = buffer[shift : shift + size].view(tensor.dtype).view(tensor.shape)
    return copy.copy_(tensor)


@dataclass
class SynchronousTransfer:
    """Copies on the calling thread. On the CPU it makes real copies, so residency is observable."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def begin(self, unit: Unit) -> object:
        if self.device.type == "cpu":
            return [_copy_keeping_alignment(tensor.contiguous()) for tensor in unit.host]
        return [tensor.to(self.device, copy=True) for tensor in unit.host]

    def finish(self, unit: Unit, handle: object) -> list[torch.Tensor]:
        return handle

    def release(self, unit: Unit, handle: object) -> None:
        pass

    def load(self, unit: Unit) -> list[torch.Tensor]:
        return self.begin(unit)


class CudaStreamTransfer:
    """Streams blocks through bounded rings: pinned host staging buffers and device slots.

    A block is copied host -> pinned slot (CPU) -> device slot (side stream); its parameters are
    views of the device slot. A slot is refilled only after the compute stream has passed the point
    where the block in it was released, so device memory for streamed blocks is exactly
    `slots x slot_bytes` however far the CPU runs ahead. Host tensors may be memory-mapped; only the
    staging ring is pinned. Units larger than a slot (whole components in `model` mode, the text
    encoder and VAE) are copied synchronously from pageable memory.
    """

    def __init__(self, device: torch.device, slots: int, slot_bytes: int) -> None:
        if torch.device(device).type != "cuda":
            raise WanVACEError(f"CudaStreamTransfer needs a CUDA device, got {device}.")
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.slot_bytes = slot_bytes
        try:
            self.pinned = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
            self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        except RuntimeError as error:
            raise WanVACEError(
                f"Could not allocate {slots} offload slots of {slot_bytes / 2**20:.0f} MB ({error}); lower "
                "prefetch_blocks or max_pinned_mb."
            ) from error
        self.copied = [None] * slots  # event: the copy out of pinned slot i has finished
        self.freed = [None] * slots  # event on the compute stream: the block last in device slot i is done
        self.in_use = [False] * slots
        self.next_slot = 0

    def load(self, unit: Unit) -> list[torch.Tensor]:
        return [tensor.to(self.device) for tensor in unit.host]

    def begin(self, unit: Unit) -> object:
        if unit.staged_nbytes > self.slot_bytes or not self.slots:
            return None, self.load(unit)
        slot = self.next_slot
        if self.in_use[slot]:
            raise WanVACEError(f"offload ring overrun: slot {slot} is still held when {unit.name} needs it.")
        self.in_use[slot] = True
        self.next_slot = (slot + 1) % len(self.slots)
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # the pinned buffer is about to be overwritten
        staging, target, offset, views = self.pinned[slot], self.slots[slot], 0, []
        for tensor in unit.host:
            size = tensor.numel() * tensor.element_size()
            staging[offset : offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            views.append(target[offset : offset + size].view(tensor.dtype).view(tensor.shape))
            offset += _padded(tensor)
        with torch.cuda.stream(self.stream):
            if self.freed[slot] is not None:
                self.stream.wait_event(self.freed[slot])
            target[:offset].copy_(staging[:offset], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[slot] = event
        return slot, (views, event)

    def finish(self, unit: Unit, handle: object) -> list[torch.Tensor]:
        slot, payload = handle
        if slot is None:
            return payload
        views, event = payload
        torch.cuda.current_stream(self.device).wait_event(event)
        return views

    def release(self, unit: Unit, handle: object) -> None:
        slot, _payload = handle
        if slot is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.freed[slot] = event
            self.in_use[slot] = False


@dataclass
class OffloadEvent:
    kind: str  # "onload" or "offload"
    unit: str
    resident: tuple[str, ...]


class _BlockStreamer:
    """Streams one expert's blocks in execution order with a fixed prefetch window."""

    def __init__(self, owner: Offloader, expert_name: str, expert: torch.nn.Module) -> None:
        self.owner = owner
        self.expert = expert
        self.order = execution_order(expert)
        self.position = {name: index for index, name in enumerate(self.order)}
        self.units = {name: Unit.of_module(f"{expert_name}.{name}", expert.get_submodule(name)) for name in self.order}
        self.pending: dict[str, object] = {}  # name -> transfer handle, copy in flight
        self.bound: dict[str, object] = {}  # name -> transfer handle, parameters point at device copies
        self.handles = [expert.register_forward_pre_hook(self._forward_start)]
        self.handles.append(expert.register_forward_hook(self._forward_end))
        for name in self.order:
            block = expert.get_submodule(name)
            self.handles.append(block.register_forward_pre_hook(lambda *_, _name=name: self.before_block(_name)))
            self.handles.append(block.register_forward_hook(lambda *_, _name=name: self.after_block(_name)))

    @property
    def resident(self) -> set[str]:
        return set(self.pending) | set(self.bound)

    def _prefetch(self, names: list[str]) -> None:
        for name in names:
            if name not in self.resident:
                self.pending[name] = self.owner.transfer.begin(self.units[name])
                self.owner.record("onload", self.units[name].name)

    def _window(self, name: str) -> list[str]:
        start = self.position[name]
        return self.order[start + 1 : start + 1 + self.owner.options.prefetch_blocks]

    def _forward_start(self, *_args) -> None:
        self._forward_end()  # a forward that raised may have left blocks behind
        # Under Cache-DiT the VACE functor's forward runs every VACE block first: stream in that order then.
        self.order = current_execution_order(self.expert)
        self.position = {name: index for index, name in enumerate(self.order)}
        self._prefetch(self.order[: self.owner.options.prefetch_blocks])

    def before_block(self, name: str) -> None:
        keep = {name, *self._window(name)}
        for stale in sorted(self.resident - keep):  # blocks a cache skipped, prefetched for nothing
            self.release(stale)
        if name not in self.bound:
            if name not in self.pending:
                self._prefetch([name])
            unit = self.units[name]
            handle = self.pending.pop(name)
            unit.bind(self.owner.transfer.finish(unit, handle))
            self.bound[name] = handle
        self._prefetch(self._window(name))

    def after_block(self, name: str) -> None:
        self.release(name)

    def release(self, name: str) -> None:
        unit = self.units[name]
        if name in self.bound:
            unit.unbind()
            handle = self.bound.pop(name)
        else:
            handle = self.pending.pop(name)
        self.owner.transfer.release(unit, handle)
        self.owner.record("offload", unit.name)

    def _forward_end(self, *_args) -> None:
        for name in sorted(self.resident, key=self.position.__getitem__):
            self.release(name)


class Offloader:
    """Moves a pipeline's weights to the compute device as the run needs them."""

    def __init__(self, components: dict[str, torch.nn.Module], options: OffloadOptions, transfer: Transfer) -> None:
        self.options = options
        self.transfer = transfer
        # Bounded: a long-running server must not keep every event of every run.
        self.events: deque[OffloadEvent] = deque(maxlen=_EVENT_HISTORY)
        self.active: str | None = None
        self._hooks: list = []
        # Called as on_activate(component, peak_device_bytes) before weights move, so a host application
        # (ComfyUI) can make room on the device first.
        self.on_activate = None
        self.units: dict[str, Unit] = {}
        self.streamers: dict[str, _BlockStreamer] = {}
        for name, module in components.items():
            if module is None:
                continue
            streamed = options.mode == "layerwise" and name in EXPERTS
            if name in EXPERTS:
                # Registered before the streamer's hooks: activating releases other units first, then the
                # streamer prefetches this expert's first blocks.
                self._hooks.append(module.register_forward_pre_hook(lambda *_, _name=name: self.activate(_name)))
            if streamed:
                missing = undeclared_block_lists(module)
                if missing:
                    raise WanVACEError(
                        f"{type(module).__name__} has block list(s) {', '.join(missing)} that layerwise offload "
                        "does not cover; declare them in wanvace_core.offload.BLOCK_LISTS."
                    )
                self.streamers[name] = _BlockStreamer(self, name, module)
            skip = block_lists_of(module) if streamed else ()
            self.units[name] = Unit.of_module(name, module, skip=skip)

    def record(self, kind: str, unit: str) -> None:
        self.events.append(OffloadEvent(kind, unit, tuple(self._resident_names())))

    def detach(self) -> None:
        """Releases everything and removes every hook; the modules behave as if never offloaded."""
        self.release_all()
        for handle in self._hooks:
            handle.remove()
        for streamer in self.streamers.values():
            for handle in streamer.handles:
                handle.remove()
        self._hooks, self.streamers = [], {}

    def _resident_names(self) -> list[str]:
        names = [] if self.active is None else [self.active]
        for streamer in self.streamers.values():
            names += sorted(streamer.units[name].name for name in streamer.resident)
        return names

    def activate(self, name: str) -> None:
        """Makes component `name` runnable on the device; the previously active one goes back to host memory."""
        if name == self.active or name not in self.units:
            return
        self.release_all()
        if self.on_activate is not None:
            self.on_activate(name, self.peak_device_bytes(name))
        unit = self.units[name]
        unit.bind(self.transfer.load(unit))
        self.active = name
        self.record("onload", name)

    def release_all(self) -> None:
        """Sends every weight back to host memory (also used when ComfyUI asks to free memory)."""
        for streamer in self.streamers.values():
            streamer._forward_end()
        if self.active is not None:
            self.units[self.active].unbind()
            released, self.active = self.active, None
            self.record("offload", released)
            logger.debug("WanVACE offload: %s back in host memory", released)

    def peak_device_bytes(self, name: str | None = None) -> int:
        """The most weight bytes held on the device while `name` (or, by default, any component) is active."""
        peaks = []
        for component, unit in self.units.items():
            streamed = 0
            if component in self.streamers:
                sizes = sorted((block.nbytes for block in self.streamers[component].units.values()), reverse=True)
                streamed = sum(sizes[: self.options.prefetch_blocks + 1])
            if name is None or component == name:
                peaks.append(unit.nbytes + streamed)
        return max(peaks, default=0)

    def device_bytes(self) -> int:
        """Bytes of weights this offloader currently holds on the device."""
        total = 0 if self.active is None else self.units[self.active].nbytes
        for streamer in self.streamers.values():
            total += sum(streamer.units[name].nbytes for name in streamer.resident)
        return total

    def all_units(self) -> list[Unit]:
        units = list(self.units.values())
        for streamer in self.streamers.values():
            units += streamer.units.values()
        return units


class NoOffload:
    """Mode `none`: weights were loaded onto the device and stay there."""

    def activate(self, name: str) -> None:
        pass

    def release_all(self) -> None:
        pass

    def device_bytes(self) -> int:
        return 0

    def detach(self) -> None:
        pass


def make_transfer(options: OffloadOptions, device: torch.device, offloader: Offloader) -> Transfer:
    """The transfer for `device`: bounded rings on CUDA (layerwise), synchronous copies elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return SynchronousTransfer(device)
    blocks = [unit for streamer in offloader.streamers.values() for unit in streamer.units.values()]
    if not blocks:  # `model` mode moves whole components, which never go through the ring
        return CudaStreamTransfer(device, slots=0, slot_bytes=0)
    slot_bytes = max(unit.staged_nbytes for unit in blocks)
    slots = options.prefetch_blocks + 1
    if options.max_pinned_mb:
        budget = options.max_pinned_mb * 2**20
        if budget < slot_bytes:
            raise WanVACEInputError(
                f"max_pinned_mb={options.max_pinned_mb} is smaller than one block ({slot_bytes / 2**20:.0f} MB); "
                "raise it or set 0 for automatic."
            )
        slots = max(1, min(slots, budget // slot_bytes))
    return CudaStreamTransfer(device, slots=slots, slot_bytes=slot_bytes)


def attach_offload(model, options: OffloadOptions, transfer: Transfer | None = None) -> None:
    """Attaches an offloader to a loaded `WanVACEModel` whose weights sit in host memory.

    A previously attached offloader is detached first, so attaching twice never stacks hooks.
    """
    model.offload.detach()
    if options.mode == "none":
        model.offload = NoOffload()
        return
    components = {name: getattr(model, name) for name in COMPONENTS}
    offloader = Offloader(components, options, transfer or SynchronousTransfer(model.device))
    if transfer is None:
        offloader.transfer = make_transfer(options, model.device, offloader)
    model.offload = offloader
