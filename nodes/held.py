"""The pipelines the loaders hold between prompts, shared by every loader node.

Loading the same weights again with other offload options re-attaches instead of re-reading them, so
loaded pipelines are remembered (weakly) by what was loaded. ComfyUI drops a loader's cached output
before it runs the loader again with changed inputs, so the last pipeline is also held strongly, until
another one is loaded or ComfyUI unloads it ("Unload models", "Free model and node cache", memory
pressure): then only ComfyUI's cache decides how long it lives, as for its own models.
"""

from __future__ import annotations

import weakref

from ..wanvace_core import WanVACEModel

_loaded: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_last: list[WanVACEModel] = []


def reusable(key: tuple, stamps: dict) -> WanVACEModel | None:
    """The pipeline loaded under `key` if something still holds it and its files are unchanged (`stamps`)."""
    model = _loaded.get(key)
    if model is None or model.weights.stamps != stamps:
        return None
    return model


def forget_last() -> None:
    """Lets go of the last pipeline: another one is about to load."""
    _last.clear()


def forget_on_unload(model: WanVACEModel):
    """The callback for ComfyUI's unload of `model`: stop holding it if it is the one held (unloading an older
    pipeline leaves the hold on the current one). It refers to `model` weakly: the patcher that calls it lives
    as long as the model, and a strong reference would keep both alive forever."""
    ref = weakref.ref(model)

    def forget() -> None:
        if _last and _last[0] is ref():
            _last.clear()

    return forget


def hold(key: tuple, model: WanVACEModel) -> None:
    _loaded[key] = model
    _last[:] = [model]
