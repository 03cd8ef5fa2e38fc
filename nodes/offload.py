"""WanVACEOffloadOptions: where the weights live while the pipeline runs."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core import OFFLOAD_MODES, OffloadOptions
from .inputs import int_input
from .refusals import Refusal
from .types import CATEGORY, WanVACEOffloadType

_DEFAULTS = OffloadOptions()
DEFAULT_MODE = "model"  # the node is for offloading; the loaders' unconnected input is mode none


class WanVACEOffloadOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEOffloadOptions",
            display_name="WanVACE Offload Options",
            category=CATEGORY,
            description=(
                "Runs the two 14B experts on a GPU smaller than the model. Connect to WanVACE Model Loader's "
                "offload input. Results are bitwise equal in every mode; only memory and speed change."
            ),
            inputs=[
                io.Combo.Input(
                    "mode",
                    options=list(OFFLOAD_MODES),
                    default=DEFAULT_MODE,
                    tooltip="none: all on the GPU; model: one component at a time; layerwise: blocks stream in.",
                ),
                int_input(
                    "prefetch_blocks",
                    _DEFAULTS.prefetch_blocks,
                    (0, 16),
                    "layerwise: blocks copied ahead, each one block of GPU memory (1-2 hide the copy on PCIe 4).",
                ),
                int_input(
                    "max_pinned_mb",
                    _DEFAULTS.max_pinned_mb,
                    (0, 1 << 20),
                    "layerwise: cap on the pinned host memory of the copies; 0 = prefetch_blocks + 1 blocks.",
                    display_name="max_pinned_mb (0 = auto)",
                ),
            ],
            outputs=[WanVACEOffloadType.Output(display_name="offload", tooltip="Offload settings for the loader.")],
        )

    @classmethod
    def validate_inputs(cls, mode: str | None = None) -> bool | str:
        # The combo alone (a linked one arrives as None and is checked when it runs); the numbers keep ComfyUI's
        # range check.
        with Refusal() as refusal:
            if mode is not None:
                OffloadOptions(mode=mode)
        return refusal.message or True

    @classmethod
    def execute(cls, mode: str, prefetch_blocks: int, max_pinned_mb: int) -> io.NodeOutput:
        return io.NodeOutput(OffloadOptions(mode, prefetch_blocks, max_pinned_mb))
