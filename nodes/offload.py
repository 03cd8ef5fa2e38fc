"""WanVACEOffloadOptions: where the weights live while the pipeline runs."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core import OFFLOAD_MODES, OffloadOptions
from .refusals import Refusal
from .types import CATEGORY, WanVACEOffloadType


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
                    default="model",
                    tooltip="none: everything on the GPU (fastest, needs ~75 GB for A14B in bf16). model: each "
                    "component moves to the GPU only while it runs, one expert at a time (~36 GB peak, a few seconds "
                    "per switch). layerwise: blocks stream in just before they run (a few GB peak; a small slowdown "
                    "when PCIe keeps up with compute).",
                ),
                io.Int.Input(
                    "prefetch_blocks",
                    default=1,
                    min=0,
                    max=16,
                    tooltip="layerwise: blocks copied ahead on a side stream. Each costs one block of GPU memory "
                    "(~0.8 GB for A14B in bf16); 1-2 hides the copy time on PCIe 4.",
                ),
                io.Int.Input(
                    "max_pinned_mb",
                    display_name="max_pinned_mb (0 = auto)",
                    default=0,
                    min=0,
                    max=1 << 20,
                    tooltip="layerwise: cap on pinned host memory for the staging ring; 0 = (prefetch_blocks + 1) "
                    "blocks (~1.6 GB for A14B at prefetch 1). A cap below that prefetches fewer blocks. Weights "
                    "themselves stay memory-mapped, never pinned.",
                ),
            ],
            outputs=[WanVACEOffloadType.Output(display_name="offload", tooltip="Offload settings for the loader.")],
        )

    @classmethod
    def validate_inputs(cls, mode: str = "model") -> bool | str:
        # The combo alone; the numbers keep ComfyUI's range check.
        with Refusal() as refusal:
            OffloadOptions(mode=mode)
        return refusal.message or True

    @classmethod
    def execute(cls, mode: str, prefetch_blocks: int, max_pinned_mb: int) -> io.NodeOutput:
        return io.NodeOutput(OffloadOptions(mode, prefetch_blocks, max_pinned_mb))
