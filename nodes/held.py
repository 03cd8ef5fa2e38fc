"""The pipelines the loaders hold between prompts, and `load_or_reuse`, the one way both loader nodes load.

Loading the same weights again with other offload options re-attaches instead of re-reading them, so
loaded pipelines are remembered (weakly) by what was loaded. ComfyUI drops a loader's cached output
before it runs the loader again with changed inputs, so the last pipeline is also held strongly, until
another one is loaded or ComfyUI unloads it ("Unload models", "Free model and node cache", memory
pressure): then only ComfyUI's cache decides how long it lives, as for its own models.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from ..wanvace_core import RuntimePlan, WanVACEModel, replan
from .memory import cooperate, make_room_before_loading

logger = logging.getLogger(__name__)

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


def load_or_reuse(
    what: str,
    source: tuple,
    stamps: dict,
    plan: RuntimePlan,
    device,
    load: Callable[[RuntimePlan], WanVACEModel],
    resident_bytes: Callable[[], int],
    before_replan: Callable[[], None] = lambda: None,
) -> WanVACEModel:
    """The pipeline of `source` (what was read and how: files, dtypes; their `stamps`; `what` names it in the log)
    under `plan` on `device`: re-attached under the new plan when only the plan changed (`before_replan` refuses
    first what the new plan cannot run), else `load(plan)`, after asking ComfyUI for `resident_bytes()` of room when
    the weights go straight to the device. Then held between prompts and registered with ComfyUI's model management.

    With parallel workers the plan was applied in the workers at load, so any change of it loads again.
    """
    key = (*source, str(device)) if plan.parallel is None else (*source, str(device), plan)
    model = reusable(key, stamps)
    forget_last()  # other files or settings must not stay held beside this one (parallel: its workers stop)
    if model is not None and plan.parallel is not None:
        logger.info("WanVACE: reusing the experts loaded in the parallel workers")
    elif model is not None:
        before_replan()
        replan(model, plan)
        logger.info(
            "WanVACE: reusing the loaded %s (offload %r, attention %r)", what, plan.offload.mode, plan.attention
        )
    else:
        if plan.offload.mode == "none" and plan.parallel is None:
            make_room_before_loading(device, resident_bytes())
        elif plan.offload.mode != "none" and torch.device(device).type == "cpu":
            logger.warning(
                "WanVACE offload mode %r on a CPU-only ComfyUI only adds copying; use mode 'none' there.",
                plan.offload.mode,
            )
        model = load(plan)
    hold(key, model)
    cooperate(model, device).on_unload = forget_on_unload(model)
    return model
