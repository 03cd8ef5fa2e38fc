"""Lets comfy.model_management see, and free, the GPU memory our offloader holds.

ComfyUI tracks models as `LoadedModel` entries around ModelPatcher objects. `ComfyMemoryHandle`
offers the handful of ModelPatcher methods model_management calls, so our pipeline appears in
`current_loaded_models`: "Unload models" / POST /free and ComfyUI's own memory pressure call
`detach()`, which sends our weights back to host memory, and before our components move to the
GPU we ask ComfyUI to make room first. The next activation re-onloads as needed.
"""

from __future__ import annotations

import logging
import weakref

import comfy.model_management as model_management
import torch

logger = logging.getLogger(__name__)


class WanVACE:
    """What ComfyUI sees as the handle's model; its class name appears in ComfyUI's log lines."""


class ComfyMemoryHandle:
    def __init__(self, offloader, load_device: torch.device) -> None:
        self._offloader = weakref.ref(offloader)
        self.load_device = load_device
        self.offload_device = torch.device("cpu")
        self.parent = None
        self.model = WanVACE()
        self.planned_bytes = 0

    def loaded_size(self) -> int:
        offloader = self._offloader()
        return 0 if offloader is None else offloader.device_bytes()

    def model_size(self) -> int:
        return max(self.planned_bytes, self.loaded_size())

    def current_loaded_device(self) -> torch.device:
        return self.load_device

    def model_patches_models(self) -> list:
        return []

    def model_patches_to(self, _device_or_dtype) -> None:
        pass

    def model_dtype(self):
        return None

    def lowvram_patch_counter(self) -> int:
        return 0

    def is_clone(self, other) -> bool:
        # Re-registering ourselves must replace our old entry, not add a second one.
        return other is self

    def partially_load(self, _device_to, extra_memory=0, force_patch_weights=False) -> int:
        return 0  # weights move when the offloader activates a component

    def partially_unload(self, _device_to, memory_to_free=0, force_patch_weights=False) -> int:
        return 0  # no partial eviction: ComfyUI then detaches the whole handle

    def detach(self, unpatch_all: bool = True):
        offloader = self._offloader()
        if unpatch_all and offloader is not None:
            held = offloader.device_bytes()
            offloader.release_all()
            logger.info("WanVACE released %.1f MB of device memory at ComfyUI's request", held / 2**20)
        return self.model


_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cooperate(offloader, device: torch.device) -> None:
    """Makes `offloader` ask ComfyUI for room before each activation and obey ComfyUI's unloads."""

    def make_room(_component: str, peak_bytes: int) -> None:
        handle = _handles.get(offloader)
        if handle is None:
            handle = _handles[offloader] = ComfyMemoryHandle(offloader, device)
        handle.planned_bytes = int(peak_bytes)
        model_management.load_models_gpu([handle])

    offloader.on_activate = make_room
