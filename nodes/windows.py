"""WanVACEContextWindows: context-window settings for WanVACESampler's optional `context_windows` input."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core import FUSE_METHODS, SCHEDULES, ContextWindowOptions
from ..wanvace_core.validation import validate_range
from .graph_checks import check_windows_in_graph
from .inputs import int_input
from .queued_prompt import this_node
from .refusals import Refusal
from .types import CATEGORY, WanVACEContextWindowsType

_DEFAULTS = ContextWindowOptions()
# The widgets' ranges, checked again in validate_inputs (whose arguments skip ComfyUI's range check).
LENGTH_RANGE = (5, 1025)
OVERLAP_RANGE = (0, 1020)
STRIDE_RANGE = (1, 8)


class WanVACEContextWindows(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEContextWindows",
            display_name="WanVACE Context Windows",
            category=CATEGORY,
            description=(
                "Denoises a video longer than one window as overlapping windows at every step, fused frame by frame: "
                "activation memory follows the window, not the video. Connect to WanVACESampler's context_windows "
                "input."
            ),
            inputs=[
                int_input(
                    "context_length",
                    _DEFAULTS.context_length,
                    LENGTH_RANGE,
                    "Frames per window, 4n+1 (81 is what Wan2.2 was trained on).",
                    step=4,
                ),
                int_input(
                    "context_overlap",
                    _DEFAULTS.context_overlap,
                    OVERLAP_RANGE,
                    "Frames neighbouring windows share, a multiple of 4 (16-32): more hides seams, costs windows.",
                    step=4,
                ),
                io.Combo.Input(
                    "schedule",
                    options=list(SCHEDULES),
                    default=_DEFAULTS.schedule,
                    tooltip="Where the windows lie at each step: fixed (static), moving (uniform) or also wrapping "
                    "around (looped); the cache needs standard_static.",
                ),
                int_input(
                    "context_stride",
                    _DEFAULTS.context_stride,
                    STRIDE_RANGE,
                    "Uniform schedules: also windows over every 2nd, 4th, ... frame, up to this many levels (1 = off).",
                ),
                io.Boolean.Input(
                    "closed_loop",
                    default=_DEFAULTS.closed_loop,
                    tooltip="looped_uniform: wrap the last window into the first frames too.",
                ),
                io.Combo.Input(
                    "fuse_method",
                    options=list(FUSE_METHODS),
                    default=_DEFAULTS.fuse_method,
                    tooltip="How a frame held by several windows is blended (pyramid: each window's middle most).",
                ),
                io.Boolean.Input(
                    "freenoise",
                    default=_DEFAULTS.freenoise,
                    tooltip="Start overlapping windows from related noise (FreeNoise) for smoother blends.",
                ),
            ],
            outputs=[
                WanVACEContextWindowsType.Output(
                    display_name="context_windows", tooltip="For WanVACE Sampler's context_windows input."
                )
            ],
        )

    @classmethod
    def validate_inputs(
        cls,
        context_length: int | None = None,
        context_overlap: int | None = None,
        schedule: str | None = None,
        fuse_method: str | None = None,
    ) -> bool | str:
        # The 4n+1 length and the overlap (with their ranges) and the combos; context_stride keeps ComfyUI's range
        # check. Then the settings against the samplers they feed: the cache's schedule, the model's frames per call.
        with Refusal() as refusal:
            for name, value, bounds in (
                ("context_length", context_length, LENGTH_RANGE),
                ("context_overlap", context_overlap, OVERLAP_RANGE),
            ):
                if value is not None:
                    validate_range(name, value, *bounds)
            # A linked input arrives as None: the other one is checked against the value that refuses none of it
            # (the longest window, no overlap), not against the default.
            options = ContextWindowOptions(
                context_length=LENGTH_RANGE[1] if context_length is None else context_length,
                context_overlap=OVERLAP_RANGE[0] if context_overlap is None else context_overlap,
                schedule=_DEFAULTS.schedule if schedule is None else schedule,
                fuse_method=_DEFAULTS.fuse_method if fuse_method is None else fuse_method,
            )
            graph = this_node()
            if graph is not None and None not in (context_length, context_overlap):
                check_windows_in_graph(graph[0], graph[1], options)
        return refusal.message or True

    @classmethod
    def execute(
        cls,
        context_length: int,
        context_overlap: int,
        schedule: str,
        context_stride: int,
        closed_loop: bool,
        fuse_method: str,
        freenoise: bool,
    ) -> io.NodeOutput:
        return io.NodeOutput(
            ContextWindowOptions(
                context_length, context_overlap, schedule, context_stride, closed_loop, fuse_method, freenoise
            )
        )
