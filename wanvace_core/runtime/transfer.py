"""How offloaded weights reach the compute device: units of tensors, and the transfers that copy them.

`SynchronousTransfer` copies on the calling thread (the CPU path, and the reference for tests).
`RingTransfer` streams blocks through a bounded ring: a worker thread copies a block from host memory
(often memory-mapped) into a pinned staging buffer, then queues the copy into a device slot on a side
stream. The device primitives it needs (streams, events, pinned and device buffers) sit behind
`StreamOps`; `CudaStreamOps` is the CUDA implementation, and the tests drive the same ring through a
simulated one on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import WanVACEError, WanVACEInputError

logger = logging.getLogger(__name__)

_ALIGNMENT = 64  # CPU allocations
# Tensors in a ring slot start at multiples of this: the CUDA allocator aligns to 512 bytes and cuBLASLt
# picks kernels by operand alignment up to 256 bytes, so slot views compute like freshly allocated weights.
_SLOT_ALIGNMENT = 256


def _padded(tensor: torch.Tensor) -> int:
    """Bytes `tensor` takes in a ring slot where every tensor starts on a `_SLOT_ALIGNMENT` boundary."""
    size = tensor.numel() * tensor.element_size()
    return (size + _SLOT_ALIGNMENT - 1) // _SLOT_ALIGNMENT * _SLOT_ALIGNMENT


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
        # Copies are packed contiguously; a strided weight would compute with another layout than in place.
        strided = [
            f"{type(module).__name__}.{attr}"
            for (module, attr, _), tensor in zip(self.slots, self.host, strict=True)
            if not tensor.is_contiguous()
        ]
        if strided:
            raise WanVACEError(
                f"{name} has non-contiguous weights ({', '.join(strided[:3])}); offload copies them contiguously, "
                "which would change results. Make them contiguous before attaching offload."
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


class Transfer(Protocol):
    """Copies a unit's host tensors to the compute device."""

    device: torch.device
    capacity: int | None  # most units in flight (begun, not yet released) at once; None = unbounded

    def begin(self, unit: Unit) -> object:
        """Starts copying; returns a handle for `finish` and `release`."""

    def finish(self, unit: Unit, handle: object) -> list[torch.Tensor]:
        """Waits for the copy; returns device tensors ready for the compute stream."""

    def release(self, unit: Unit, handle: object) -> None:
        """The unit's device tensors are no longer used by work queued from now on."""

    def load(self, unit: Unit) -> list[torch.Tensor]:
        """Copies a whole component synchronously (outside any ring); returns its device tensors."""

    def device_bytes(self, in_flight: list[Unit]) -> int:
        """Device bytes held for the units in flight (including buffers kept for reuse)."""

    def planned_bytes(self, blocks: list[Unit], in_flight: int) -> int:
        """The most device bytes streaming `blocks` takes with `in_flight` of them begun at once."""

    def trim(self) -> None:
        """Nothing is in flight: gives back device buffers kept for reuse."""

    def close(self) -> None:
        """Waits for queued work and frees every buffer; the transfer is not used again."""


def _copy_keeping_alignment(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy at the same address offset modulo 64 as `tensor`.

    CPU GEMM kernels pick their code path by operand alignment, so a copy at another alignment can
    round differently; keeping the offset keeps CPU results bitwise equal to the uncopied weights.
    """
    size = tensor.numel() * tensor.element_size()
    buffer = torch.empty(size + _ALIGNMENT, dtype=torch.uint8)
    shift = (tensor.data_ptr() - buffer.data_ptr()) % _ALIGNMENT
    copy = buffer[shift : shift + size].view(tensor.dtype).view(tensor.shape)
    return copy.copy_(tensor)


@dataclass
class SynchronousTransfer:
    """Copies on the calling thread. On the CPU it makes real copies, so residency is observable."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    capacity: int | None = None

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

    def device_bytes(self, in_flight: list[Unit]) -> int:
        return sum(unit.nbytes for unit in in_flight)

    def planned_bytes(self, blocks: list[Unit], in_flight: int) -> int:
        return sum(sorted((unit.nbytes for unit in blocks), reverse=True)[:in_flight])

    def trim(self) -> None:
        pass

    def close(self) -> None:
        pass


class StreamOps(Protocol):
    """The device primitives `RingTransfer` uses. Streams and events are opaque to the ring."""

    device: torch.device

    def new_stream(self) -> object: ...

    def compute_stream(self) -> object:
        """The stream the calling thread's kernels run on (per thread in PyTorch: call on the compute thread)."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer of exactly `nbytes` bytes (uint8)."""

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        """Unlocks a buffer from `host_buffer`; no copy may still read it."""

    def device_buffer(self, nbytes: int) -> torch.Tensor: ...

    def copy_async(self, stream: object, target: torch.Tensor, source: torch.Tensor) -> None:
        """Queues `target.copy_(source)` on `stream`."""

    def record(self, stream: object) -> object:
        """An event that completes when the work queued on `stream` so far has run."""

    def wait(self, stream: object, event: object) -> None:
        """Work queued on `stream` from now on runs after `event` (the host does not wait)."""

    def synchronize(self, event: object) -> None:
        """The host waits for `event`."""


class CudaStreamOps:
    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise WanVACEError(f"CudaStreamOps needs a CUDA device, got {device}.")
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def new_stream(self) -> object:
        return torch.cuda.Stream(device=self.device)

    def compute_stream(self) -> object:
        return torch.cuda.current_stream(self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Registered rather than `pin_memory=True`: the caching host allocator rounds each allocation up
        # to a power of two (a 0.8 GB slot would pin 1 GiB) and keeps it pinned after it is freed.
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        if error != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {error}")
        return buffer

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_async(self, stream: object, target: torch.Tensor, source: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)

    def record(self, stream: object) -> object:
        # Blocking: a host waiting on it sleeps instead of spinning a core beside the compute thread.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def wait(self, stream: object, event: object) -> None:
        stream.wait_event(event)

    def synchronize(self, event: object) -> None:
        event.synchronize()


@dataclass
class _RingHandle:
    slot: int
    staged: Future  # -> (device views, event recorded after the copy into the device slot)


class RingTransfer:
    """Streams blocks through `slots` pinned staging buffers and `slots` device slots of `slot_bytes` each.

    `begin` claims a free slot and hands the copying to one worker thread, so reading host memory (a
    page-cache read for memory-mapped weights) overlaps the compute already queued. The worker waits
    until the slot's pinned buffer has been copied out, fills it, and queues the device copy on a side
    stream behind the compute-stream event recorded when the slot's previous block was released. A
    block's parameters are views of its device slot.

    Device memory for streamed blocks is therefore `slots x slot_bytes` however far the host runs
    ahead, and pinned host memory is the same amount: the weights themselves are never pinned. Device
    slots are allocated on first use and given back by `trim`. Only the worker ever waits on the host
    for a copy (apart from `trim` and `close`), so the compute thread never stalls behind host reads.
    """

    def __init__(self, ops: StreamOps, slots: int, slot_bytes: int) -> None:
        if slots < 1 or slot_bytes < 1:
            raise WanVACEError(
                f"RingTransfer needs slots >= 1 and slot_bytes >= 1, got slots={slots}, slot_bytes={slot_bytes}; "
                "size it with ring_transfer()."
            )
        self.ops = ops
        self.device = ops.device
        self.capacity = slots
        self.slot_bytes = slot_bytes
        self.stream = ops.new_stream()
        self.pinned: list[torch.Tensor] = []
        try:
            for _ in range(slots):
                self.pinned.append(ops.host_buffer(slot_bytes))
        except RuntimeError as error:
            for buffer in self.pinned:
                ops.free_host_buffer(buffer)
            raise WanVACEError(
                f"Could not pin {slots} x {slot_bytes / 2**20:.0f} MB of host memory for layerwise offload "
                f"({error}); lower prefetch_blocks or max_pinned_mb, or free host RAM."
            ) from error
        self.device_slots: list[torch.Tensor] | None = None
        self.last: list[Future | None] = [None] * slots  # the latest staging into slot i (its copy event)
        self.freed: list[object | None] = [None] * slots  # compute passed the release of device slot i's block
        self.in_use: list[str | None] = [None] * slots  # the unit occupying slot i
        self.next_slot = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wanvace-offload")

    def _claim(self, unit: Unit) -> int:
        if unit.staged_nbytes > self.slot_bytes:
            raise WanVACEError(
                f"{unit.name} needs {unit.staged_nbytes} bytes but offload slots hold {self.slot_bytes}; the ring "
                "was sized for another model: re-plan the offload (runtime.plan.replan) after changing the model."
            )
        for step in range(self.capacity):
            slot = (self.next_slot + step) % self.capacity
            if self.in_use[slot] is None:
                self.in_use[slot] = unit.name
                self.next_slot = (slot + 1) % self.capacity
                return slot
        raise WanVACEError(
            f"offload ring overrun: {unit.name} needs a slot while all {self.capacity} hold "
            f"{', '.join(self.in_use)}; the streamer must not begin more blocks than the ring's capacity."
        )

    def begin(self, unit: Unit) -> object:
        if self.device_slots is None:
            try:
                self.device_slots = [self.ops.device_buffer(self.slot_bytes) for _ in range(self.capacity)]
            except RuntimeError as error:
                raise WanVACEError(
                    f"Could not allocate {self.capacity} offload slots of {self.slot_bytes / 2**20:.0f} MB on "
                    f"{self.device} ({error}); lower prefetch_blocks."
                ) from error
            # The allocator may hand out memory that queued compute still reads (freed activations, or
            # slots given back by `trim`): the first copy into each slot waits for that compute.
            self.freed = [self.ops.record(self.ops.compute_stream())] * self.capacity
        slot = self._claim(unit)
        # The worker runs stagings in order, so the slot's previous staging has finished when this one
        # starts; its copy event is read there, never by blocking this thread.
        staged = self._worker.submit(
            self._stage, unit, self.pinned[slot], self.device_slots[slot], self.last[slot], self.freed[slot]
        )
        self.last[slot] = staged
        return _RingHandle(slot, staged)

    @staticmethod
    def _copy_event(staging: Future | None):
        if staging is None or staging.exception() is not None:
            return None
        return staging.result()[1]

    def _stage(self, unit: Unit, staging: torch.Tensor, target: torch.Tensor, previous: Future | None, freed):
        """Worker thread: host tensors -> pinned buffer -> (side stream) device slot."""
        copied = self._copy_event(previous)
        if copied is not None:
            self.ops.synchronize(copied)  # the pinned buffer's previous contents may still be in transit
        offset, views = 0, []
        for tensor in unit.host:
            size = tensor.numel() * tensor.element_size()
            staging[offset : offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            views.append(target[offset : offset + size].view(tensor.dtype).view(tensor.shape))
            offset += _padded(tensor)
        if freed is not None:
            self.ops.wait(self.stream, freed)  # the slot's previous block may still be read by queued compute
        try:
            self.ops.copy_async(self.stream, target[:offset], staging[:offset])
            return views, self.ops.record(self.stream)
        except BaseException:
            # A copy may be queued without an event to wait on: let it finish before the buffer is reused.
            self.ops.synchronize(self.ops.record(self.stream))
            raise

    def finish(self, unit: Unit, handle: object) -> list[torch.Tensor]:
        views, event = handle.staged.result()
        self.ops.wait(self.ops.compute_stream(), event)
        return views

    def release(self, unit: Unit, handle: object) -> None:
        # Never waits: a prefetched block that never ran (a cache skipped it) may still be staging.
        try:
            self.freed[handle.slot] = self.ops.record(self.ops.compute_stream())
        finally:
            self.in_use[handle.slot] = None

    def load(self, unit: Unit) -> list[torch.Tensor]:
        return [tensor.to(self.device) for tensor in unit.host]

    def device_bytes(self, in_flight: list[Unit]) -> int:
        return 0 if self.device_slots is None else self.capacity * self.slot_bytes

    def planned_bytes(self, blocks: list[Unit], in_flight: int) -> int:
        return self.capacity * self.slot_bytes if blocks else 0

    def _drain(self) -> None:
        """The host waits for every queued staging and copy."""
        for staging in self.last:
            if staging is not None:
                staging.exception()  # waits; a failure was raised to the caller by finish()
            copied = self._copy_event(staging)
            if copied is not None:
                self.ops.synchronize(copied)

    def trim(self) -> None:
        busy = [name for name in self.in_use if name is not None]
        if busy:
            raise WanVACEError(f"offload ring trimmed while {', '.join(busy)} are in flight; release them first.")
        # The side stream may still be writing into a slot; the allocator only orders compute-stream use.
        self._drain()
        self.device_slots, self.last = None, [None] * self.capacity  # finished stagings still hold slot views

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._drain()
        for buffer in self.pinned:
            self.ops.free_host_buffer(buffer)
        self.device_slots, self.pinned, self.last = None, [], [None] * self.capacity


def ring_transfer(ops: StreamOps, blocks: list[Unit], prefetch_blocks: int, max_pinned_mb: int) -> RingTransfer:
    """A ring sized for `blocks`: `prefetch_blocks + 1` slots of the largest block, fewer if the pinned cap says so."""
    slot_bytes = max(unit.staged_nbytes for unit in blocks)
    slots = prefetch_blocks + 1
    if max_pinned_mb:
        budget = max_pinned_mb * 2**20
        if budget < slot_bytes:
            raise WanVACEInputError(
                f"max_pinned_mb={max_pinned_mb} is smaller than one block ({slot_bytes / 2**20:.0f} MB); "
                "raise it or set 0 for automatic."
            )
        if budget // slot_bytes < slots:
            slots = budget // slot_bytes
            logger.warning(
                "WanVACE offload: max_pinned_mb=%d holds %d block(s) of %.0f MB, so %d block(s) are prefetched "
                "instead of %d.",
                max_pinned_mb,
                slots,
                slot_bytes / 2**20,
                slots - 1,
                prefetch_blocks,
            )
    return RingTransfer(ops, slots, slot_bytes)
