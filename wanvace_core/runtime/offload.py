"""Where weights live while a pipeline runs: all on the device, one component at a time, or block by block.

Every mode is a `Residency` with the same methods (activate, settle, release_all, device_bytes,
planned_bytes, close), so the model, the sampler and the ComfyUI glue never ask which mode runs:

- `none` (`OnDevice`): every component is on the compute device. `release_all` (ComfyUI's unload)
  drops the weights, and `activate` reads a dropped component back from its `WeightSource`.
- `model`: a component moves to the device only while it runs (text encoder, then the high-noise
  expert, then the low-noise expert, then the VAE); activating one sends the previous one back, so
  two experts are never on the device together.
- `layerwise`: like `model` for the text encoder and VAE; an expert's small non-block weights move
  with it, while its blocks stream in just before they run, `prefetch_blocks` ahead, in the order the
  forward runs them (`vace_blocks.k` interleaved before `blocks.vace_layers[k]`), and go back right
  after.

The copying sits behind `Transfer` (`wanvace_core.runtime.transfer`): `SynchronousTransfer` copies on the
calling thread (CPU, and the reference for tests); `RingTransfer` stages blocks through a bounded ring
of pinned buffers and copies them on a side stream. Everything else (what is resident, when, in which
order, what is freed) is ordinary Python, tested on the CPU.

`layerwise` rather than diffusers' `apply_group_offloading` (block level, side stream): that one pins a host copy of
every block (~35 GB more locked memory per A14B expert) or pins again on every transfer (`low_cpu_mem_usage`),
where the ring's pinned memory is bounded by `max_pinned_mb`, and it has no answer to ComfyUI's unload and memory
planning (`release_all`, `planned_bytes`); its speed against ours is `group/layerwise` in
bench/bench_offload_gpu.py (not yet measured on a GPU; on the CPU, where neither copies, its hooks cost 0.54x ours).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import WanVACEError, WanVACEInputError
from ..hooks import ModuleHooks
from ..load.loaded import WeightSource, block_lists_of, loaded_bytes, tensor_bytes, undeclared_block_lists
from ..parallel.sharding import local_shard_bytes
from .interleave import current_execution_order, execution_order
from .transfer import CudaStreamOps, StreamOps, SynchronousTransfer, Transfer, Unit, ring_transfer

logger = logging.getLogger(__name__)

OFFLOAD_MODES = ("none", "model", "layerwise")
COMPONENTS = ("text_encoder", "transformer", "transformer_2", "vae")
EXPERTS = ("transformer", "transformer_2")


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


@dataclass(frozen=True)
class OffloadEvent:
    """What an observer attached to `Offloader.observers` is told each time a unit moves."""

    kind: str  # "onload" or "offload"
    unit: str
    resident: tuple[str, ...]


class DeviceMemoryBroker(Protocol):
    """The host application's memory manager (ComfyUI's), asked for room before weights move to the device."""

    def reserve(self, incoming_bytes: int) -> None:
        """Makes room for `incoming_bytes` more weight bytes on the device (may unload other models)."""


class Residency:
    """Where a pipeline's weights live; one implementation per offload mode, all with these methods.

    `broker` (set by a host application) is asked for room before any weight moves to the device.
    """

    broker: DeviceMemoryBroker | None = None

    def activate(self, name: str) -> None:
        """Makes component `name` runnable on the device (experts are activated by their forward hooks)."""
        raise NotImplementedError

    def settle(self) -> None:
        """After a failed run: nothing may stay on the device that the resting state does not hold."""
        raise NotImplementedError

    def release_all(self) -> int:
        """Frees every device byte the weights take (the host asked); returns the bytes released."""
        raise NotImplementedError

    def device_bytes(self) -> int:
        """Weight bytes (and streaming buffers) held on the device now."""
        raise NotImplementedError

    def planned_bytes(self, name: str | None = None) -> int:
        """The most weight bytes on the device while `name` (default: any component) is active."""
        raise NotImplementedError

    def close(self) -> None:
        """Removes every hook and gives back device and pinned buffers; also runs when the model is dropped."""
        raise NotImplementedError

    def _reserve(self, incoming_bytes: int) -> None:
        if self.broker is not None and incoming_bytes > 0:
            self.broker.reserve(incoming_bytes)


def drop_weights(module: torch.nn.Module) -> None:
    """Replaces every parameter of `module` by a meta placeholder, freeing its memory; tied ones stay tied."""
    placeholders: dict[int, torch.nn.Parameter] = {}
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) not in placeholders:
            empty = torch.empty(param.shape, dtype=param.dtype, device="meta")
            placeholders[id(param)] = type(param)(empty, requires_grad=param.requires_grad)
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._parameters[attr] = placeholders[id(param)]


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` is on `device`; a device without an index ("cuda") means its current one."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _is_dropped(module: torch.nn.Module) -> bool:
    return any(param.is_meta for param in module.parameters())


def _activate_experts_on_forward(residency: Residency, components: dict[str, torch.nn.Module]) -> ModuleHooks:
    """Forward pre-hooks that activate each expert just before it runs, whichever mode is attached."""
    hooks = ModuleHooks()
    for name in EXPERTS:
        if components.get(name) is not None:
            hooks.pre(components[name], lambda *_, _name=name: residency.activate(_name))
    return hooks


class OnDevice(Residency):
    """Mode `none`: every component lives on the device. An unload drops the weights (there is no host
    copy); the next `activate` of a component reads only that component back from `weights`.
    """

    def __init__(self, components: dict[str, torch.nn.Module], weights: WeightSource, device) -> None:
        self.components = {name: module for name, module in components.items() if module is not None}
        self.weights = weights
        self.device = torch.device(device)
        # Components known to be loaded on the device: each expert forward activates, so this stays a lookup.
        self._placed: set[str] = set()
        # Re-entrant: the broker (ComfyUI) may call release_all while activate asks it for room.
        self._lock = threading.RLock()
        self._hooks = _activate_experts_on_forward(self, self.components)

    @property
    def dropped(self) -> set[str]:
        return {name for name, module in self.components.items() if _is_dropped(module)}

    def activate(self, name: str) -> None:
        if name in self._placed:
            return
        with self._lock:
            module = self.components.get(name)
            if module is None:
                return
            if _is_dropped(module):
                self._reserve(loaded_bytes([module], buffers=False))
                try:
                    self.weights.refill(name, module, self.device)
                except BaseException:
                    drop_weights(module)  # half-read: hold nothing that no release would find
                    raise
            elif any(not _on(tensor, self.device) for tensor in module.parameters()):
                # Attached after an offload mode: the weights are in host memory and move over once.
                self._reserve(tensor_bytes([module]))
                module.to(self.device)
            self._placed.add(name)

    def settle(self) -> None:
        pass  # resting state: everything on the device

    def release_all(self) -> int:
        with self._lock:
            held = self.device_bytes()
            for module in self.components.values():
                drop_weights(module)
            self._placed.clear()
            return held - self.device_bytes()

    def device_bytes(self) -> int:
        return tensor_bytes(self.components.values())

    def planned_bytes(self, name: str | None = None) -> int:
        return loaded_bytes(self.components.values())

    def close(self) -> None:
        self._hooks.remove()


def _control_input(args: tuple, kwargs: dict):
    """A WanVACE transformer call's `control_hidden_states` (its fifth positional parameter)."""
    if "control_hidden_states" in kwargs:
        return kwargs["control_hidden_states"]
    return args[4] if len(args) > 4 else None


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
        self.hooks = ModuleHooks()
        self.hooks.pre(expert, self._forward_start, with_kwargs=True)
        self.hooks.post(expert, self._forward_end)
        for name in self.order:
            block = expert.get_submodule(name)
            self.hooks.pre(block, lambda *_, _name=name: self.before_block(_name))
            self.hooks.post(block, lambda *_, _name=name: self.after_block(_name))

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
        return self.order[start + 1 : start + 1 + self.owner.prefetch_blocks]

    def _forward_start(self, _module, args, kwargs) -> None:
        self._forward_end()  # a forward that raised may have left blocks behind
        # Under Cache-DiT the VACE functor's forward runs every VACE block first: stream in that order then.
        self.order = current_execution_order(self.expert)
        if _control_input(args, kwargs) is None:  # a step outside the VACE window: the VACE blocks do not run
            self.order = [name for name in self.order if not name.startswith("vace_blocks.")]
        self.position = {name: index for index, name in enumerate(self.order)}
        self._prefetch(self.order[: self.owner.prefetch_blocks])

    def before_block(self, name: str) -> None:
        keep = {name, *self._window(name)}
        for stale in sorted(self.resident - keep):  # blocks a cache skipped, prefetched for nothing
            self.release(stale)
        if name not in self.bound:
            if name not in self.pending:
                self._prefetch([name])
            unit = self.units[name]
            handle = self.pending[name]
            tensors = self.owner.transfer.finish(unit, handle)  # if this raises, the handle is still released
            del self.pending[name]
            unit.bind(tensors)
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


class Offloader(Residency):
    """Modes `model` and `layerwise`: moves a pipeline's weights to the compute device as the run needs them.

    `transfer` copies the weights; by default `make_transfer` picks one for `device`, and
    `stream_ops` (tests: a simulated CUDA) makes it a ring over those primitives.
    """

    def __init__(
        self,
        components: dict[str, torch.nn.Module],
        options: OffloadOptions,
        transfer: Transfer | None = None,
        *,
        device: torch.device | str = "cpu",
        stream_ops: StreamOps | None = None,
    ) -> None:
        self.options = options
        # Tests and benchmarks append callables here to watch every move; nothing is kept otherwise.
        self.observers: list[Callable[[OffloadEvent], None]] = []
        self.active: str | None = None
        self._hooks = ModuleHooks()
        self.units: dict[str, Unit] = {}
        self.streamers: dict[str, _BlockStreamer] = {}
        # Registered before the streamers' hooks: activating releases other units first, then the
        # streamer prefetches this expert's first blocks.
        self._hooks = _activate_experts_on_forward(self, components)
        for name, module in components.items():
            if module is None:
                continue
            streamed = options.mode == "layerwise" and name in EXPERTS
            if streamed:
                missing = undeclared_block_lists(module)
                if missing:
                    raise WanVACEError(
                        f"{type(module).__name__} has block list(s) {', '.join(missing)} that layerwise offload "
                        "does not cover; declare them in wanvace_core.load.loaded.BLOCK_LISTS."
                    )
                self.streamers[name] = _BlockStreamer(self, name, module)
            skip = block_lists_of(module) if streamed else ()
            self.units[name] = Unit.of_module(name, module, skip=skip)
        if transfer is None:
            blocks = [unit for streamer in self.streamers.values() for unit in streamer.units.values()]
            transfer = make_transfer(options, device, blocks, stream_ops)
        self.transfer = transfer
        # A ring smaller than prefetch + 1 blocks (capped by max_pinned_mb) prefetches fewer.
        self.prefetch_blocks = options.prefetch_blocks
        if transfer.capacity is not None:
            self.prefetch_blocks = min(self.prefetch_blocks, transfer.capacity - 1)

    def record(self, kind: str, unit: str) -> None:
        if self.observers:
            event = OffloadEvent(kind, unit, tuple(self._resident_names()))
            for observer in self.observers:
                observer(event)

    def close(self) -> None:
        """Releases everything and removes every hook; the modules behave as if never offloaded."""
        self.release_all()
        self._hooks.remove()
        for streamer in self.streamers.values():
            streamer.hooks.remove()
        self.streamers = {}
        self.transfer.close()

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
        self._reserve(self.planned_bytes(name))
        unit = self.units[name]
        unit.bind(self.transfer.load(unit))
        self.active = name
        self.record("onload", name)

    def settle(self) -> None:
        self.release_all()

    def release_all(self) -> int:
        """Sends every weight back to host memory and frees the device buffers (also on ComfyUI's request)."""
        held = self.device_bytes()
        for streamer in self.streamers.values():
            streamer._forward_end()
        self.transfer.trim()
        if self.active is not None:
            self.units[self.active].unbind()
            released, self.active = self.active, None
            self.record("offload", released)
            logger.debug("WanVACE offload: %s back in host memory", released)
        return held - self.device_bytes()

    def planned_bytes(self, name: str | None = None) -> int:
        """The most weight bytes held on the device while `name` (or, by default, any component) is active."""
        peaks = []
        for component, unit in self.units.items():
            streamed = 0
            if component in self.streamers:
                blocks = list(self.streamers[component].units.values())
                streamed = self.transfer.planned_bytes(blocks, self.prefetch_blocks + 1)
            if name is None or component == name:
                peaks.append(unit.nbytes + streamed)
        return max(peaks, default=0)

    def device_bytes(self) -> int:
        """Bytes this offloader currently holds on the device (weights and streaming buffers)."""
        total = 0 if self.active is None else self.units[self.active].nbytes
        in_flight = [streamer.units[name] for streamer in self.streamers.values() for name in streamer.resident]
        return total + self.transfer.device_bytes(in_flight)


def make_transfer(
    options: OffloadOptions, device: torch.device | str, blocks: list[Unit], stream_ops: StreamOps | None = None
) -> Transfer:
    """A ring of pinned and device slots where blocks stream to a CUDA device; synchronous copies elsewhere."""
    device = torch.device(device)
    if stream_ops is None and device.type == "cuda":
        stream_ops = CudaStreamOps(device)
    if stream_ops is None or not blocks:  # `model` mode moves whole components, which never use the ring
        return SynchronousTransfer(device)
    return ring_transfer(stream_ops, blocks, options.prefetch_blocks, options.max_pinned_mb)


def make_residency(
    options: OffloadOptions,
    components: dict[str, torch.nn.Module],
    weights: WeightSource,
    device: torch.device | str,
    transfer: Transfer | None = None,
    *,
    stream_ops: StreamOps | None = None,
) -> Residency:
    """The residency for `options` over loaded `components`.

    Offload modes need the weights in host memory: components whose weights were dropped are read back
    there from `weights`, and components on another device are moved there, once.
    """
    device = torch.device(device)
    if options.mode == "none":
        return OnDevice(components, weights, device)
    for name, module in components.items():
        if module is None:
            continue
        if _is_dropped(module):
            weights.refill(name, module, torch.device("cpu"))
        elif any(tensor.device.type != "cpu" for tensor in [*module.parameters(), *module.buffers()]):
            module.to("cpu")
    return Offloader(
        {name: components.get(name) for name in COMPONENTS}, options, transfer, device=device, stream_ops=stream_ops
    )


class ShardedResidency(Residency):
    """FSDP2 places sharded experts itself (shards on the device, or in host memory with its CPU offload policy,
    each block gathered for its forward): nothing to move, and nothing ComfyUI could ask a worker to drop."""

    def __init__(self, experts: dict[str, torch.nn.Module]) -> None:
        self.experts = experts

    def activate(self, name: str) -> None:
        pass

    def settle(self) -> None:
        pass

    def release_all(self) -> int:
        return 0

    def device_bytes(self) -> int:
        return sum(local_shard_bytes(expert) for expert in self.experts.values())

    def planned_bytes(self, name: str | None = None) -> int:
        return self.device_bytes()

    def close(self) -> None:
        pass
