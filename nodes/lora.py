"""WanVACELoraLoader: a LoRA from ComfyUI's loras folder on either expert, each with its own strength (chainable)."""

from __future__ import annotations

from pathlib import Path

import folder_paths
from comfy_api.v0_0_2 import io

from ..wanvace_core import WanVACEError, WanVACEInputError
from ..wanvace_core.runtime.lora import LoraPatch, check_lora
from .graph_checks import check_lora_in_graph
from .inputs import float_input
from .model_files import resolve_listed_file
from .queued_prompt import this_node
from .refusals import Refusal
from .types import CATEGORY, WanVACEModelType

LORA_FOLDER = "loras"
STRENGTH_RANGE = 10.0


def _lora_path(lora_name: object) -> Path:
    return resolve_listed_file("lora_name", lora_name, folder_paths.get_filename_list(LORA_FOLDER), LORA_FOLDER)


def _strength_input(name: str, expert: str) -> io.Float.Input:
    return float_input(
        name,
        1.0,
        (-STRENGTH_RANGE, STRENGTH_RANGE),
        0.01,
        f"How strongly the LoRA changes the {expert} expert (0 leaves it untouched).",
    )


class WanVACELoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACELoraLoader",
            display_name="WanVACE LoRA Loader",
            category=CATEGORY,
            description=(
                "Adds a LoRA to the experts for the sampling runs of the model it outputs; chain several. The loaded "
                "weights are not changed: a branch that uses the input model directly samples without this LoRA. "
                "Wan2.2 LoRAs usually come as a high-noise and a low-noise file: load each with a strength on its own "
                "expert and 0 on the other."
            ),
            inputs=[
                WanVACEModelType.Input("model", tooltip="The pipeline (or the output of another WanVACE LoRA Loader)."),
                io.Combo.Input(
                    "lora_name",
                    options=folder_paths.get_filename_list(LORA_FOLDER),
                    tooltip="A LoRA file from models/loras, made for Wan2.1/2.2 14B (VACE or T2V).",
                ),
                _strength_input("strength_high_noise", "high-noise (transformer)"),
                _strength_input("strength_low_noise", "low-noise (transformer_2)"),
                io.Boolean.Input(
                    "merge",
                    default=False,
                    tooltip="Merge into the weights for each run: faster steps; needs offload none and float weights.",
                ),
            ],
            outputs=[
                WanVACEModelType.Output(display_name="model", tooltip="The pipeline that samples with this LoRA.")
            ],
        )

    @classmethod
    def validate_inputs(cls, lora_name: str | None = None, merge: bool | None = None) -> bool | str:
        # A listed name (the file is read against the model when the node runs), and a merge over experts sharded
        # across parallel workers, from the graph.
        with Refusal() as refusal:
            if lora_name is not None:
                _lora_path(lora_name)
            graph = this_node()
            if graph is not None:
                check_lora_in_graph(graph[0], graph[2], merge)
        return refusal.message or True

    @classmethod
    def execute(
        cls, model, lora_name: str, strength_high_noise: float, strength_low_noise: float, merge: bool
    ) -> io.NodeOutput:
        patch = LoraPatch(
            path=_lora_path(lora_name),
            strength_high_noise=strength_high_noise,
            strength_low_noise=strength_low_noise,
            merge=merge,
        )
        try:
            check_lora(model, patch)
        except WanVACEError as error:
            raise WanVACEInputError(f"lora_name={lora_name!r}: {error}") from error
        return io.NodeOutput(model.with_loras(patch))
