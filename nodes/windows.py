"""WanVACEContextWindows: context-window settings for WanVACESampler's optional `context_windows` input."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core import FUSE_METHODS, SCHEDULES, ContextWindowOptions
from ..wanvace_core.validation import validate_range
from .graph_checks import check_windows_in_graph
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
                "activation memory follows the window, not the video. Each window gets its slice of the control "
                "video and masks, and every window gets the reference images. A video no longer than one window "
                "runs exactly as without this node. Connect to WanVACESampler's context_windows input."
            ),
            inputs=[
                io.Int.Input(
                    "context_length",
                    default=_DEFAULTS.context_length,
                    min=LENGTH_RANGE[0],
                    max=LENGTH_RANGE[1],
                    step=4,
                    tooltip="Frames per window, 4n+1 (81 is what Wan2.2 was trained on).",
                ),
                io.Int.Input(
                    "context_overlap",
                    default=_DEFAULTS.context_overlap,
                    min=OVERLAP_RANGE[0],
                    max=OVERLAP_RANGE[1],
                    step=4,
                    tooltip="Frames neighbouring windows share, a multiple of 4; more blends seams better and costs "
                    "more windows (16-32 is typical).",
                ),
                io.Combo.Input(
                    "schedule",
                    options=list(SCHEDULES),
                    default=_DEFAULTS.schedule,
                    tooltip="standard_static: the same windows every step. standard_uniform: windows move every step "
                    "so seams fall in different places, none wraps around. looped_uniform: like standard_uniform, "
                    "but windows wrap from the last frames to the first (for looping videos). With the sampler's "
                    "cache use standard_static: each window then caches on its own.",
                ),
                io.Int.Input(
                    "context_stride",
                    default=_DEFAULTS.context_stride,
                    min=STRIDE_RANGE[0],
                    max=STRIDE_RANGE[1],
                    tooltip="Uniform schedules: also windows over every 2nd, 4th, ... frame, up to this many levels. "
                    "1 (the usual) turns that off.",
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
                    tooltip="How a frame held by several windows is blended: pyramid weighs each window's middle "
                    "most; flat weighs all alike; overlap-linear ramps across the overlap only.",
                ),
                io.Boolean.Input(
                    "freenoise",
                    default=_DEFAULTS.freenoise,
                    tooltip="FreeNoise: the starting noise of each next stretch is shuffled from the stretch before, "
                    "so overlapping windows start from related noise (smoother blends).",
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
