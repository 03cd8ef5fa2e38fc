"""The control video and masks of the VACE tasks, sized by the same width, height and length as WanVACE
Conditioning, so a workflow sets them once (the shipped templates feed all of them from one width, one height and
one length):

- WanVACEControlVideo: frames (a video, or images) fitted to the size and cut to the length, used as a control
  signal (depth, pose, edges), kept as they are (image to video, extension), or kept where masks say (inpaint).
- WanVACEFirstLastFrame: the first image at frame 0, the last at frame length - 1, grey and generated between.
- WanVACEOutpaintCanvas: the video fitted inside new canvas on its sides, which is generated.

They arrange their inputs with `wanvace_core.generation.tasks.task_inputs`, which the offline command and the videos
API use too. Images of another size are centre-cropped to the output's aspect and resized (bicubic, antialiased).
A VIDEO (LoadVideo's output) is read with its own `get_components()`, as ComfyUI's GetVideoComponents does.
"""

from __future__ import annotations

import torch
from comfy_api.v0_0_2 import io

from ..wanvace_core.errors import WanVACEInputError
from ..wanvace_core.generation.tasks import Outpaint, task_inputs
from .inputs import video_size_inputs
from .refusals import NOT_CONNECTED
from .types import CATEGORY

PAD_RANGE = (0, 4096)
CONTROL_USES = ("control", "keep")
SAME_AS_CONDITIONING = ", the same as WanVACE Conditioning's"


def _source_inputs() -> list:
    return [
        io.Video.Input("video", optional=True, tooltip="A video (LoadVideo); connect this or images."),
        io.Image.Input("images", optional=True, tooltip="Frames or one image (LoadImage); connect this or video."),
    ]


def _one_source(video, images) -> bool | str:
    """validate_inputs: exactly one of video and images is connected."""
    connected = [name for name, value in (("video", video), ("images", images)) if value is not NOT_CONNECTED]
    if len(connected) != 1:
        return (
            "connect video (a LoadVideo) or images (a LoadImage or other frames), one of them"
            + ("; both are connected" if len(connected) == 2 else "; neither is connected")
            + "."
        )
    return True


def _frames(video, images) -> torch.Tensor:
    if video is not None:
        return video.get_components().images
    if images is None:
        raise WanVACEInputError("connect video or images.")
    return images


class WanVACEControlVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEControlVideo",
            display_name="WanVACE Control Video",
            category=CATEGORY,
            description=(
                "Frames for WanVACE Conditioning's control_video, fitted to width x height and cut to length: a "
                "control signal the video follows (use control: depth, pose, edges), frames kept as they are with "
                "the rest generated (use keep: one image = image to video; a clip's first frames = extension), or, "
                "with masks, frames kept where the masks are black (inpaint). Connect control_masks too unless use "
                "is control."
            ),
            inputs=[
                *_source_inputs(),
                *video_size_inputs(SAME_AS_CONDITIONING),
                io.Combo.Input(
                    "use",
                    options=list(CONTROL_USES),
                    default="control",
                    tooltip="Without masks: control = the frames steer the video; keep = they are kept as they are.",
                ),
                io.Mask.Input(
                    "masks",
                    optional=True,
                    tooltip="1 (white) = generate, 0 = keep the pixel; one mask for all frames or one per frame.",
                ),
            ],
            outputs=[
                io.Image.Output(display_name="control_video", tooltip="The frames at width x height, at most length."),
                io.Mask.Output(
                    display_name="control_masks",
                    tooltip="The masks at width x height (keep: one black mask; control: one white mask).",
                ),
            ],
        )

    @classmethod
    def validate_inputs(cls, video=NOT_CONNECTED, images=NOT_CONNECTED) -> bool | str:
        return _one_source(video, images)

    @classmethod
    def execute(
        cls, width: int, height: int, length: int, use: str, video=None, images=None, masks=None
    ) -> io.NodeOutput:
        frames = _frames(video, images)
        if masks is not None:
            arranged = task_inputs("inpaint", width, height, length, video=frames, mask=masks)
        elif use == "keep":
            arranged = task_inputs("extension", width, height, length, video=frames)
        else:
            arranged = task_inputs("v2v", width, height, length, video=frames)
            arranged["control_masks"] = torch.ones(1, height, width)
        return io.NodeOutput(arranged["control_video"], arranged["control_masks"])


class WanVACEFirstLastFrame(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEFirstLastFrame",
            display_name="WanVACE First/Last Frame",
            category=CATEGORY,
            description=(
                "A video that starts at first_frame and ends at last_frame: both are kept (mask 0), the frames "
                "between are grey and generated (mask 1). Connect both outputs to WanVACE Conditioning, whose "
                "width, height and length must be these."
            ),
            inputs=[
                io.Image.Input("first_frame", tooltip="The image the video starts with (its first image is used)."),
                io.Image.Input("last_frame", tooltip="The image the video ends with (its first image is used)."),
                *video_size_inputs(SAME_AS_CONDITIONING),
            ],
            outputs=[
                io.Image.Output(display_name="control_video", tooltip="length frames: first, grey, ..., last."),
                io.Mask.Output(display_name="control_masks", tooltip="0 on the first and last frame, 1 between."),
            ],
        )

    @classmethod
    def execute(cls, first_frame, last_frame, width: int, height: int, length: int) -> io.NodeOutput:
        arranged = task_inputs("flf2v", width, height, length, image=first_frame, last_image=last_frame)
        return io.NodeOutput(arranged["control_video"], arranged["control_masks"])


class WanVACEOutpaintCanvas(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEOutpaintCanvas",
            display_name="WanVACE Outpaint Canvas",
            category=CATEGORY,
            description=(
                "Fits a video inside a width x height canvas, leaving left/top/right/bottom pixels of new canvas "
                "(grey, mask 1) to generate around it (mask 0). Connect both outputs to WanVACE Conditioning, whose "
                "width, height and length must be these."
            ),
            inputs=[
                *_source_inputs(),
                *video_size_inputs(SAME_AS_CONDITIONING),
                *(
                    io.Int.Input(
                        side,
                        default=default,
                        min=PAD_RANGE[0],
                        max=PAD_RANGE[1],
                        step=8,
                        tooltip=f"Pixels of new canvas {where}.",
                    )
                    for side, default, where in (
                        ("left", 128, "left of the video"),
                        ("top", 0, "above the video"),
                        ("right", 128, "right of the video"),
                        ("bottom", 0, "below the video"),
                    )
                ),
            ],
            outputs=[
                io.Image.Output(display_name="control_video", tooltip="The video on its grey canvas, width x height."),
                io.Mask.Output(display_name="control_masks", tooltip="1 on the new canvas, 0 on the video."),
            ],
        )

    @classmethod
    def validate_inputs(cls, video=NOT_CONNECTED, images=NOT_CONNECTED) -> bool | str:
        return _one_source(video, images)

    @classmethod
    def execute(
        cls, width: int, height: int, length: int, left: int, top: int, right: int, bottom: int, video=None, images=None
    ) -> io.NodeOutput:
        arranged = task_inputs(
            "outpaint", width, height, length, video=_frames(video, images), outpaint=Outpaint(left, top, right, bottom)
        )
        return io.NodeOutput(arranged["control_video"], arranged["control_masks"])
