"""Lets comfy.model_management see, and free, the device memory our pipeline holds.

ComfyUI tracks what is on the GPU as `LoadedModel` entries around `ModelPatcher` objects. Ours is a
real `comfy.model_patcher.ModelPatcher` subclass (so every method either ComfyUI version calls
exists and behaves) whose `model` is a weightless placeholder: the weights stay with our residency
(`wanvace_core.runtime.offload`), which moves them itself. ComfyUI is told:

- `model_size()`: the weight bytes we hold on the device plus the bytes about to load;
- `loaded_size()`: the weight bytes we hold on the device now;
- `memory_required` of `load_models_gpu`: the activations of the work about to run.

"Unload models" / POST /free and ComfyUI's memory pressure call `detach()` (or `partially_unload`,
which frees everything too: our units are whole components or blocks), and our residency releases
its device memory; the next use brings back what it needs. It is a plain (not Dynamic VRAM)
patcher: with ComfyUI 0.33's Dynamic VRAM on, ComfyUI's own models page their weights in on demand
while ours are loaded whole and unloaded whole when ComfyUI needs the room.
"""

from __future__ import annotations

import logging
import weakref

import comfy.model_management as model_management
import comfy.model_patcher
import torch

logger = logging.getLogger(__name__)


class WanVACE(torch.nn.Module):
    """What ComfyUI sees as the patcher's model: holds no weights; its class name appears in ComfyUI's log."""


class WanVACEPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher over a weightless placeholder whose sizes come from our residency."""

    def __init__(self, model, load_device: torch.device) -> None:
        super().__init__(WanVACE(), load_device=load_device, offload_device=torch.device("cpu"))
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
        return self.load_device  # where our weights are used; the placeholder's own device means nothing

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
        self.patcher.incoming_bytes = int(incoming_bytes)
        _retired.clear()  # see _retired
        try:
            model_management.load_models_gpu([self.patcher], memory_required=self.working_bytes)
        finally:
            self.patcher.incoming_bytes = 0


_brokers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Patchers whose pipeline has died. A pipeline can die inside ComfyUI's own unload (our detach drops
# the loader's hold on it); if its patcher died with it, the placeholder's death would run ComfyUI's
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
    if device.type != "cpu":
        model_management.free_memory(incoming_bytes + model_management.minimum_inference_memory(), device)


def set_working_memory(model, working_bytes: int) -> None:
    """Tells ComfyUI, at the next reservation, how much activation memory the coming work needs."""
    broker = _brokers.get(model.base)  # a LoRA view shares its base's registration
    if broker is not None:
        broker.working_bytes = int(working_bytes)
