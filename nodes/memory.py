"""Lets comfy.model_management see, and free, the device memory our pipeline holds.

ComfyUI tracks models as `LoadedModel` entries around ModelPatcher objects. `ComfyMemoryHandle`
offers the handful of ModelPatcher methods model_management calls, so our pipeline appears in
`current_loaded_models`: "Unload models" / POST /free and ComfyUI's own memory pressure call
`detach()`, which releases our weights (back to host memory with offload; dropped, to be read back
from the files, without), and before our weights move to the device we ask ComfyUI to make room
first. The next use re-onloads or reloads as needed.
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
    def __init__(self, model, load_device: torch.device) -> None:
        self._model = weakref.ref(model)
        self.load_device = load_device
        self.offload_device = torch.device("cpu")
        self.parent = None
        self.model = WanVACE()
        self.planned_bytes = 0

    def loaded_size(self) -> int:
        model = self._model()
        return 0 if model is None else model.device_bytes()

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
        model = self._model()
        if unpatch_all and model is not None:
            held = model.release_device_memory()
            logger.info("WanVACE released %.1f MB of device memory at ComfyUI's request", held / 2**20)
        return self.model


_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cooperate(model, device: torch.device) -> None:
    """Makes `model` ask ComfyUI for room before its weights move to `device`, and obey ComfyUI's unloads.

    With offload that is before each component activates; without, the weights are on the device
    already (registered now) and are asked room for again only when dropped weights are reloaded.
    """
    reference = weakref.ref(model)

    def make_room(peak_bytes: int) -> None:
        owner = reference()
        if owner is None:
            return
        handle = _handles.get(owner)
        if handle is None:
            handle = _handles[owner] = ComfyMemoryHandle(owner, device)
        handle.planned_bytes = int(peak_bytes)
        model_management.load_models_gpu([handle])

    if hasattr(model.offload, "on_activate"):
        model.offload.on_activate = lambda _component, peak_bytes: make_room(peak_bytes)
    else:
        model.on_reload = make_room
        make_room(model.device_bytes())
