"""Rules that span nodes, checked from the graph: when a prompt is queued (`queued_prompt`), and again when a node
runs (its hidden PROMPT), before anything slow. Each raises `WanVACEInputError` naming the input it is about first.

- The size the model can run (`generation/limits.py`): the conditioning's width and height against the model its
  `model` input comes from; its length against the model of each sampler it feeds without context windows; a
  context window's length against the model of each sampler it feeds.
- The sampler's cache needs `standard_static` windows.
- A merged LoRA needs whole weights: not on experts sharded across parallel workers.

What is not known before the prompt runs (a value linked from a node other than ComfyUI's primitives, the number of
reference images) is left to the checks that run with the real values.
"""

from __future__ import annotations

import numbers

from ..wanvace_core import ContextWindowOptions, WanVACEError, WanVACEInputError
from ..wanvace_core.generation.limits import SizeLimits, check_frame_size, check_frames
from ..wanvace_core.generation.windows import check_schedule_with_cache
from .folder_loader import size_limits_of_folder_inputs
from .queued_prompt import consumers, linked_node, model_source, value_of
from .single_files_loader import size_limits_of_expert_inputs

SAMPLER = "WanVACESampler"
_LIMITS_OF_LOADER = {
    "WanVACEModelLoader": size_limits_of_folder_inputs,
    "WanVACEExpertsLoader": size_limits_of_expert_inputs,
}


def _integer(value) -> int | None:
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def model_limits(prompt: dict, node: dict, input_name: str = "model") -> SizeLimits | None:
    """The size limits of the model `node`'s `input_name` comes from, read from the loader's files (config files
    and headers only); None where the loader's inputs are not known yet or do not load (its own check says why)."""
    source = model_source(prompt, node, input_name)
    if source is None:
        return None
    read = _LIMITS_OF_LOADER.get(source[1].get("class_type"))
    if read is None:
        return None
    try:
        return read(source[1].get("inputs", {}))
    except (WanVACEError, OSError, ValueError, KeyError, TypeError):
        return None


_UNKNOWN = object()


def context_windows_of(prompt: dict, sampler: dict):
    """The sampler's context windows as queued: None when none are connected, `_UNKNOWN` when their settings are not
    known yet or their node refuses them (it says why)."""
    source = linked_node(prompt, sampler, "context_windows")
    if source is None:
        return None
    inputs = source[1].get("inputs", {})
    defaults = ContextWindowOptions()
    try:
        return ContextWindowOptions(
            context_length=_integer(value_of(prompt, source[1], "context_length")),
            context_overlap=_integer(value_of(prompt, source[1], "context_overlap")),
            schedule=inputs.get("schedule", defaults.schedule),
            fuse_method=inputs.get("fuse_method", defaults.fuse_method),
        )
    except WanVACEInputError:
        return _UNKNOWN


def check_conditioning_size(prompt: dict, node_id: str, node: dict, references: int = 0) -> None:
    """The conditioning node's width and height against its model; its length against the model of each sampler it
    feeds without context windows (the windows node checks its own length; with the real reference count, when the
    node runs, each sampler's windows are checked here too)."""
    limits = model_limits(prompt, node)
    width, height = _integer(value_of(prompt, node, "width")), _integer(value_of(prompt, node, "height"))
    if limits is not None and width is not None and height is not None:
        check_frame_size(limits, width, height)
    length = _integer(value_of(prompt, node, "length"))
    if length is None or length < 1:
        return
    for _, sampler in consumers(prompt, node_id, SAMPLER, "conditioning"):
        windows = context_windows_of(prompt, sampler)
        sampler_limits = model_limits(prompt, sampler)
        if sampler_limits is None or windows is _UNKNOWN or (windows is not None and not references):
            continue
        check_frames(sampler_limits, length, references, windows)


def check_frames_at_run(prompt: dict, node_id: str, limits: SizeLimits, length: int, references: int) -> None:
    """When the conditioning node runs (before the text encoder and the VAE): its length and real reference count
    against the loaded model, through the windows of each sampler it feeds."""
    samplers = consumers(prompt, node_id, SAMPLER, "conditioning")
    for _, sampler in samplers:
        windows = context_windows_of(prompt, sampler)
        if windows is not _UNKNOWN:
            check_frames(limits, length, references, windows)


def check_windows_in_graph(prompt: dict, node_id: str, options: ContextWindowOptions) -> None:
    """The windows node's settings against each sampler it feeds: the cache's schedule, the model's frames per call."""
    for _, sampler in consumers(prompt, node_id, SAMPLER, "context_windows"):
        if linked_node(prompt, sampler, "cache") is not None:
            check_schedule_with_cache(options.schedule)
        conditioning = linked_node(prompt, sampler, "conditioning")
        limits = model_limits(prompt, sampler)
        if conditioning is None or limits is None:
            continue
        length = _integer(value_of(prompt, conditioning[1], "length"))
        if length is not None and length >= 1:
            check_frames(limits, length, 0, options)


def check_lora_in_graph(prompt: dict, node: dict, merge: bool) -> None:
    """A merged LoRA over experts sharded across parallel workers is refused (a merge needs whole weights)."""
    loader = model_source(prompt, node)
    parallel = None if loader is None else linked_node(prompt, loader[1], "parallel")
    shard = None if parallel is None else value_of(prompt, parallel[1], "shard")
    if merge is True and shard not in (None, "none"):
        raise WanVACEInputError(
            f"merge=True: the loader's WanVACE Parallel Options shard the experts (shard={shard}), which keeps each "
            "weight in shards across the workers, where a LoRA cannot be merged in; set merge off (the LoRA is then "
            "applied on the fly, which works with sharding), or set shard to none."
        )
