"""A CPU stand-in for CUDA streams that runs `RingTransfer` and checks the ordering rules CUDA would need.

- The compute stream is eager (CPU kernels run when called). Side streams are lazy: their copies run
  only when something waits for them, the latest moment CUDA would allow, so a block used before its
  copy was awaited reads poison (NaN bytes) and a wrong result shows.
- Hazards that cannot show as wrong data on an eager CPU raise `StreamHazard`:
  - a side-stream copy into device memory that compute last read (inside `observing_compute()`, every
    op's operands are tracked) or that was just allocated (the allocator may recycle memory queued
    kernels still read), unless the stream first waited for a compute event recorded after that;
  - a copy out of a host buffer that an earlier queued copy read from, before the host synchronised
    on that earlier copy (the host may already have overwritten it);
  - a device allocation while a queued copy still targets device memory its owner has dropped;
  - the compute stream used from another thread than the one that created the simulation (CUDA's
    current stream is per thread, so a worker would get another stream).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

POISON = 0xFF  # every float dtype reads 0xFF.. bytes as NaN


class StreamHazard(AssertionError):
    pass


def _region(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@dataclass
class SimStream:
    name: str
    eager: bool
    queue: list = field(default_factory=list)  # (position, op, args) not yet run
    enqueued: int = 0
    waited_tick: int = -1  # the latest compute event this stream's executed work waited for
    last_copy: tuple[int, tuple[int, int]] | None = None  # (position, target region) of the last copy run


@dataclass(frozen=True)
class SimEvent:
    stream: SimStream
    position: int  # side streams: ops enqueued before it
    tick: int  # compute stream: when it was recorded


class SimulatedStreamOps:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._lock = threading.RLock()
        self.compute = SimStream("compute", eager=True)
        self.streams: list[SimStream] = []
        self.tick = 0
        self.in_use: list[tuple[tuple[int, int], int]] = []  # device regions compute used, and when last
        self._owner = threading.get_ident()
        self._internal = False  # the simulation's own copies are not compute reads
        self.unsynced_sources: list[tuple[tuple[int, int], SimStream, int]] = []  # host regions queued copies read
        self.device_buffers: list[weakref.ref] = []  # what the ring holds; a dropped slot no longer counts
        self.peak_device_bytes = 0
        self.copies_run = 0

    # --- StreamOps -------------------------------------------------------------------------------

    def new_stream(self) -> SimStream:
        with self._lock:
            stream = SimStream(f"side{len(self.streams)}", eager=False)
            self.streams.append(stream)
            return stream

    def _on_compute_thread(self, what: str) -> None:
        if threading.get_ident() != self._owner:
            raise StreamHazard(f"{what} from another thread: on CUDA that thread has its own current stream")

    def compute_stream(self) -> SimStream:
        self._on_compute_thread("compute_stream()")
        return self.compute

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        with self._lock:
            region = _region(buffer)
            if any(_overlaps(region, kept) for kept, _stream, _position in self.unsynced_sources):
                raise StreamHazard("a host buffer was unlocked while a queued copy may still read it")

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for stream in self.streams:
                for _position, op, args in stream.queue:
                    if op == "copy" and args[2]() is None:
                        raise StreamHazard(
                            f"a copy queued on {stream.name} still writes into device memory its owner dropped; "
                            "the allocator may already have handed that memory out again"
                        )
            self._internal = True
            try:
                buffer = torch.full((nbytes,), POISON, dtype=torch.uint8)
            finally:
                self._internal = False
            self.device_buffers = [kept for kept in self.device_buffers if kept() is not None]
            self.device_buffers.append(weakref.ref(buffer))
            live = sum(kept().numel() for kept in self.device_buffers if kept() is not None)
            self.peak_device_bytes = max(self.peak_device_bytes, live)
            # Fresh memory may be recycled from tensors that queued compute still reads.
            self.tick += 1
            self.in_use = [entry for entry in self.in_use if not _overlaps(entry[0], _region(buffer))]
            self.in_use.append((_region(buffer), self.tick))
        return buffer

    def copy_async(self, stream: SimStream, target: torch.Tensor, source: torch.Tensor) -> None:
        with self._lock:
            if stream.eager:
                target.copy_(source)
                return
            source_region = _region(source)
            for region, other, position in self.unsynced_sources:
                if _overlaps(region, source_region):
                    raise StreamHazard(
                        f"a copy on {stream.name} reads a host buffer that copy #{position} on {other.name} also "
                        "read, and the host never synchronised on that copy: it may have overwritten it too early"
                    )
            self.unsynced_sources.append((source_region, stream, stream.enqueued))
            owner = next(
                (
                    kept
                    for kept in self.device_buffers
                    if kept() is not None and _overlaps(_region(kept()), _region(target))
                ),
                None,
            )
            if owner is None:
                raise StreamHazard("a side-stream copy targets memory that is not a live device buffer")
            stream.queue.append((stream.enqueued, "copy", (target, source, owner)))
            stream.enqueued += 1

    def record(self, stream: SimStream) -> SimEvent:
        with self._lock:
            if stream.eager:
                self._on_compute_thread("record(compute stream)")
                self.tick += 1
                return SimEvent(stream, 0, self.tick)
            return SimEvent(stream, stream.enqueued, -1)

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        with self._lock:
            if stream.eager:
                self._on_compute_thread("wait(compute stream, ...)")
                # Compute runs now, so the awaited copies run now. The copy the event was recorded after is
                # the one compute waits for: its target is in use from here on.
                written = self._run_until(event)
                self.tick += 1
                if event.position - 1 in written:
                    self.in_use.append((written[event.position - 1], self.tick))
                elif event.stream.last_copy is not None and event.stream.last_copy[0] == event.position - 1:
                    self.in_use.append((event.stream.last_copy[1], self.tick))
                return
            stream.queue.append((stream.enqueued, "wait", (event,)))
            stream.enqueued += 1

    def synchronize(self, event: SimEvent) -> None:
        with self._lock:
            if event.stream.eager:
                return
            self._run_until(event)
            self.unsynced_sources = [
                entry for entry in self.unsynced_sources if entry[1] is not event.stream or entry[2] >= event.position
            ]

    # --- execution ---------------------------------------------------------------------------------

    def _run_until(self, event: SimEvent) -> dict[int, tuple[int, int]]:
        """Runs `event.stream` up to `event`; returns the regions its copies wrote, by queue position."""
        stream, written = event.stream, {}
        while stream.queue and stream.queue[0][0] < event.position:
            position, op, args = stream.queue.pop(0)
            if op == "wait":
                (awaited,) = args
                if awaited.stream.eager:
                    stream.waited_tick = max(stream.waited_tick, awaited.tick)
                else:
                    self._run_until(awaited)
                continue
            target, source, _owner = args
            target_region = _region(target)
            for region, since in self.in_use:
                if _overlaps(region, target_region) and stream.waited_tick <= since:
                    raise StreamHazard(
                        f"a copy on {stream.name} overwrites device memory compute has used since tick {since}, "
                        f"but the stream only waited for compute up to tick {stream.waited_tick}"
                    )
            self.in_use = [entry for entry in self.in_use if not _overlaps(entry[0], target_region)]
            self._internal = True
            try:
                target.copy_(source)
            finally:
                self._internal = False
            self.copies_run += 1
            written[position] = target_region
            stream.last_copy = (position, target_region)
        return written

    # --- compute reads ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def observing_compute(self):
        """Within this, every op the calling thread runs marks the device memory it touches as in use."""
        with _ComputeReads(self):
            yield self

    def _used(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            if self._internal:
                return
            live = [_region(kept()) for kept in self.device_buffers if kept() is not None]
            for tensor in tensors:
                if tensor.device.type != "cpu" or tensor.numel() == 0:
                    continue
                region = _region(tensor)
                if any(_overlaps(region, buffer) for buffer in live):
                    self.tick += 1
                    self.in_use = [entry for entry in self.in_use if entry[0] != region]
                    self.in_use.append((region, self.tick))

    def pending(self) -> int:
        with self._lock:
            return sum(len(stream.queue) for stream in self.streams)


class _ComputeReads(TorchDispatchMode):
    def __init__(self, ops: SimulatedStreamOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _spec = tree_flatten((args, kwargs))
        self.ops._used([value for value in flat if isinstance(value, torch.Tensor)])
        return func(*args, **kwargs)


class ForgetsStreamWaits(SimulatedStreamOps):
    """A ring built on this never orders its side-stream copies after compute."""

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if stream.eager:
            super().wait(stream, event)


class ForgetsHostSync(SimulatedStreamOps):
    """A ring built on this never waits on the host before refilling a pinned buffer."""

    def synchronize(self, event: SimEvent) -> None:
        pass
