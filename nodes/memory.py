"""Lets comfy.model_management see, and free, the device memory our pipeline holds.

ComfyUI tracks what is on the GPU as `LoadedModel` entries around `ModelPatcher` objects. Ours is a
real `comfy.model_patcher.ModelPatcher` subclass (so every method either ComfyUI version calls
exists and behaves) whose `model`, a `WanVACEPipelineWeights`, holds no tensors: the weights stay with
our residency (`wanvace_core.runtime.offload`), which moves them itself. ComfyUI is told:

- `model_size()`: the weight bytes we hold on the device plus the bytes about to load;
- `loaded_size()`: the weight bytes we hold on the device now;
- `memory_required` of `load_models_gpu`: the activations of the work about to run.

"Unload models" / POST /free and ComfyUI's memory pressure call `detach()` (or `partially_unload`,
which frees everything too: our units are whole components or blocks), and our residency releases
its device memory; the next use brings back what it needs.

Dynamic VRAM (ComfyUI 0.33 on, on by default on NVIDIA): ComfyUI's own models then keep their weights
in comfy-aimdo's pages, which give way one by one when any CUDA allocation needs the room (aimdo hooks
`cuMemAlloc`). Ours stays a plain patcher (weights ComfyUI cannot page), and `load_models_gpu` with any
plain patcher in its list takes ComfyUI's non-dynamic path: it evicts dynamic models' pages until its
own estimate is free, fully unloading (pinned host copies included) every dynamic model that holds
less VRAM than is still missing, and asks host RAM to pin our whole size. ComfyUI's own plain models
(several VAEs, torch-compiled models) get the same, once per use. So we register that way once, and
every later reservation (each component switch, each load straight onto the GPU) asks ComfyUI as its
dynamic models do (`free_memory(..., for_dynamic=True)`): plain models are unloaded for us, dynamic
pages are left to give way on demand. Without Dynamic VRAM every reservation is a `load_models_gpu`.
"""

from __future__ import annotations

import logging
import weakref

import comfy.model_management as model_management
import comfy.model_patcher
import torch

try:
    import comfy.memory_management as dynamic_vram_state  # ComfyUI 0.33 on: says whether Dynamic VRAM runs
except ImportError:  # ComfyUI 0.3.75
    dynamic_vram_state = None

logger = logging.getLogger(__name__)


class WanVACEPipelineWeights(torch.nn.Module):
    """The pipeline's weights as ComfyUI's model management sees them, the `model` of its patcher; the tensors stay
    with our residency, so the module itself holds none.

    ComfyUI sets its bookkeeping attributes on it, names its class in the log ("Requested to load
    WanVACEPipelineWeights"), and drops the patcher's loaded-model entry when it is garbage-collected
    (`cleanup_models`, through a weak reference): one per patcher, living as long as the patcher (see `_retired`).
    """


class WanVACEPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher whose sizes come from our residency, over a `WanVACEPipelineWeights` that holds no tensors."""

    def __init__(self, model, load_device: torch.device) -> None:
        super().__init__(WanVACEPipelineWeights(), load_device=load_device, offload_device=torch.device("cpu"))
        self._wanvace = weakref.ref(model)  # the pipeline owns its patcher, not the other way round
        self.incoming_bytes = 0
        self.on_unload = None  # called after ComfyUI unloaded us (the loader then lets go of the pipeline)

    def _held(self) -> int:
        model = self._wanvace()
        return 0 if model is None else model.device_bytes()

    def model_size(self) -> int:
        return self._held() + self.incoming_bytes

    def loaded_size(self) -> int:
        return self._held()

    def current_loaded_device(self) -> torch.device:
        return self.load_device  # where our weights are used; the tensorless module's own device means nothing

    def model_dtype(self):
        model = self._wanvace()
        return None if model is None else model.dtype

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False) -> int:
        return 0  # the residency moves the weights when a component activates

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False) -> int:
        return self._release()

    def detach(self, unpatch_all: bool = True):
        if unpatch_all:
            self._release()
        return super().detach(unpatch_all)

    def _release(self) -> int:
        model = self._wanvace()
        if model is None:
            return 0
        released = model.release_device_memory()
        megabytes = released / 2**20
        logger.info("WanVACE released %d bytes (%.1f MB) of device memory at ComfyUI's request", released, megabytes)
        if self.on_unload is not None:
            self.on_unload()
        return released

    def clone(self, *args, **kwargs):
        raise NotImplementedError("WanVACE pipelines are not cloned by ComfyUI; connect WANVACE_MODEL directly.")


class ComfyMemoryBroker:
    """`DeviceMemoryBroker` for our residency: asks ComfyUI for room, then stays registered as loaded."""

    def __init__(self, patcher: WanVACEPatcher) -> None:
        self.patcher = patcher
        self.working_bytes = 0  # activations of the node about to run, passed as memory_required

    def reserve(self, incoming_bytes: int) -> None:
        _retired.clear()  # see _retired
        if dynamic_vram() and self.patcher in model_management.loaded_models():
            _make_room(self.patcher.load_device, int(incoming_bytes) + self.working_bytes)
            return
        self.patcher.incoming_bytes = int(incoming_bytes)
        try:
            model_management.load_models_gpu([self.patcher], memory_required=self.working_bytes)
        finally:
            self.patcher.incoming_bytes = 0


_brokers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Patchers whose pipeline has died. A pipeline can die inside ComfyUI's own unload (our detach drops
# the loader's hold on it); if its patcher died with it, its WanVACEPipelineWeights' death would run ComfyUI's
# `cleanup_models`, which removes entries from the list of loaded models that `free_memory` is
# walking at that moment (IndexError in ComfyUI's prompt worker, which then runs no more prompts).
# So they are let go only from our own code, before we next call into model management.
_retired: list[WanVACEPatcher] = []


def cooperate(model, device: torch.device) -> WanVACEPatcher:
    """Registers `model` with ComfyUI's model management; returns its patcher.

    From now on the residency asks ComfyUI for room before weights move to `device`, and ComfyUI's
    unloads (also on a CPU-only ComfyUI, where POST /free unloads the cpu device) release them.
    """
    model = model.base
    broker = _brokers.get(model)
    if broker is None:
        # The pipeline keeps its patcher alive (ComfyUI holds only weak references to it).
        broker = _brokers[model] = ComfyMemoryBroker(WanVACEPatcher(model, device))
        weakref.finalize(model, _retired.append, broker.patcher)
    model.residency.broker = broker
    broker.reserve(0)  # registered now: weights already on the device (mode none) count from the start
    return broker.patcher


def make_room_before_loading(device: torch.device, incoming_bytes: int) -> None:
    """Before weights are read straight onto the GPU: let ComfyUI unload its own models first."""
    _make_room(device, incoming_bytes)


def dynamic_vram() -> bool:
    """Whether ComfyUI runs Dynamic VRAM (feature-detected: 0.3.75 has no such state, 0.33 turns it off for
    --cpu, --highvram, --disable-dynamic-vram and where comfy-aimdo does not load)."""
    return bool(getattr(dynamic_vram_state, "aimdo_enabled", False))


def _make_room(device: torch.device, incoming_bytes: int) -> None:
    """Asks ComfyUI for `incoming_bytes` plus its minimum inference headroom on `device`.

    Under Dynamic VRAM, as for its dynamic models: plain models are unloaded as needed, dynamic ones keep their
    pages until our allocations take them (unloading them here would also drop their pinned host copies).
    """
    if device.type == "cpu":
        return
    needed = incoming_bytes + model_management.minimum_inference_memory()
    if dynamic_vram():
        model_management.free_memory(needed, device, for_dynamic=True)
    else:
        model_management.free_memory(needed, device)


def free_device_memory(model) -> int:
    """Bytes free for `model`'s activations on its device, for choices such as batched CFG and tile sizes.

    ComfyUI tells model code to ask the model's patcher (`ModelPatcher.get_free_memory`, 0.33 on): under
    Dynamic VRAM that also counts the VRAM idle dynamic models hold, which gives way when we allocate. Without
    that method (0.3.75), or for a pipeline not registered with ComfyUI, `model_management.get_free_memory`.
    """
    broker = _brokers.get(model.base)  # a LoRA view shares its base's registration
    ask = None if broker is None else getattr(broker.patcher, "get_free_memory", None)
    if ask is None:
        return int(model_management.get_free_memory(model.device))
    return int(ask(model.device))


def set_working_memory(model, working_bytes: int) -> None:
    """Tells ComfyUI, at the next reservation, how much activation memory the coming work needs."""
    broker = _brokers.get(model.base)  # a LoRA view shares its base's registration
    if broker is not None:
        broker.working_bytes = int(working_bytes)
