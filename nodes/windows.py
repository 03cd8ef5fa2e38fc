"""WanVACEContextWindows: context-window settings for WanVACESampler's optional `context_windows` input."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core import FUSE_METHODS, SCHEDULES, ContextWindowOptions, WanVACEInputError
from .types import CATEGORY, WanVACEContextWindowsType

_DEFAULTS = ContextWindowOptions()


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
                    min=5,
                    max=1025,
                    step=4,
                    tooltip="Frames per window, 4n+1 (81 is what Wan2.2 was trained on).",
                ),
                io.Int.Input(
                    "context_overlap",
                    default=_DEFAULTS.context_overlap,
                    min=0,
                    max=1020,
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
                    min=1,
                    max=8,
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
        context_length: int,
        context_overlap: int,
        schedule: str,
        context_stride: int,
        closed_loop: bool,
        fuse_method: str,
        freenoise: bool,
    ) -> bool | str:
        try:
            ContextWindowOptions(
                context_length, context_overlap, schedule, context_stride, closed_loop, fuse_method, freenoise
            )
        except WanVACEInputError as error:
            return str(error)
        return True

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
