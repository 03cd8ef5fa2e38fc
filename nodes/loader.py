"""WanVACEModelLoader: a diffusers-format WanVACE pipeline folder -> WANVACE_MODEL."""

from __future__ import annotations

import logging
import os

import comfy.model_management
import folder_paths
from comfy_api.latest import io

from ..wanvace_core import (
    DTYPES,
    OffloadOptions,
    WanVACEModelFolderError,
    attach_offload,
    find_pipeline_folders,
    inspect_pipeline_folder,
    load_pipeline,
)
from ..wanvace_core.loading import file_stamps
from .held import forget_last, hold, reusable
from .memory import cooperate, make_room_before_loading
from .types import CATEGORY, WanVACEModelType, WanVACEOffloadType

MODEL_FOLDER = "diffusers"
logger = logging.getLogger(__name__)


def _model_roots() -> list[str]:
    if MODEL_FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path(MODEL_FOLDER, os.path.join(folder_paths.models_dir, MODEL_FOLDER))
    return folder_paths.get_folder_paths(MODEL_FOLDER)


def resolve_model_folder(model_name: str) -> str:
    for root in _model_roots():
        candidate = os.path.join(root, model_name)
        if os.path.isfile(os.path.join(candidate, "model_index.json")):
            return candidate
    roots = ", ".join(_model_roots())
    raise WanVACEModelFolderError(
        f"model_name={model_name!r} is not a pipeline folder under the diffusers model folders ({roots}); "
        "put the WanVACE pipeline folder there and refresh."
    )


class WanVACEModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEModelLoader",
            display_name="WanVACE Model Loader",
            category=CATEGORY,
            description=(
                "Loads a diffusers-format WanVACE pipeline folder (Wan2.2-VACE-Fun-A14B with its high- and "
                "low-noise experts, or a single-transformer Wan2.1-VACE) from models/diffusers. Only "
                ".safetensors weights are read; tensors stream from the files straight into place."
            ),
            inputs=[
                io.Combo.Input(
                    "model_name",
                    options=find_pipeline_folders(_model_roots()),
                    tooltip="A pipeline folder under models/diffusers that has a model_index.json naming "
                    "WanVACEPipeline, e.g. Wan2.2-VACE-Fun-A14B-Diffusers.",
                ),
                io.Combo.Input(
                    "dtype",
                    options=list(DTYPES),
                    default="bf16",
                    tooltip="Weight and compute dtype. bf16 is what the model was trained in; fp32 doubles memory; "
                    "fp16 may overflow. Norms and time embeddings stay fp32 as diffusers keeps them.",
                ),
                WanVACEOffloadType.Input(
                    "offload",
                    optional=True,
                    tooltip="From WanVACE Offload Options; unconnected = everything on the GPU (ComfyUI's "
                    "'Unload models' then drops the weights and the next prompt reads them back from disk). "
                    "Changing only these options re-attaches to the weights already loaded.",
                ),
            ],
            outputs=[WanVACEModelType.Output(display_name="model", tooltip="The loaded WanVACE pipeline.")],
        )

    @classmethod
    def validate_inputs(cls, model_name: str | None = None) -> bool | str:
        # One argument only: ComfyUI lists a refusal under every argument of validate_inputs, and checks
        # the other inputs (dtype's combo) itself.
        if model_name is None:
            return True
        try:
            inspect_pipeline_folder(resolve_model_folder(model_name))
        except WanVACEModelFolderError as error:
            return str(error)
        return True

    @classmethod
    def execute(cls, model_name: str, dtype: str, offload: OffloadOptions | None = None) -> io.NodeOutput:
        device = comfy.model_management.get_torch_device()
        folder = resolve_model_folder(model_name)
        options = offload or OffloadOptions()
        if options.mode != "none" and device.type == "cpu":
            logger.warning(
                "WanVACE offload mode %r on a CPU-only ComfyUI only adds copying; use mode 'none' there.", options.mode
            )
        key = ("folder", folder, dtype, str(device))
        model = reusable(key, file_stamps(inspect_pipeline_folder(folder, check_weights=False)))
        forget_last()  # a pipeline of other files, or another dtype, must not stay held beside this one
        if model is not None:
            # Only the offload options changed: re-attach to the weights in memory instead of re-reading them.
            attach_offload(model, options)
            logger.info("WanVACE: reusing the loaded %s with offload mode %r", folder, options.mode)
        else:
            if options.mode == "none":
                make_room_before_loading(device, _weight_file_bytes(folder))
            model = load_pipeline(folder, dtype, device, offload=options)
        hold(key, model)
        cooperate(model, device).on_unload = forget_last
        return io.NodeOutput(model)


def _weight_file_bytes(folder: str) -> int:
    layout = inspect_pipeline_folder(folder, check_weights=False)
    return sum(path.stat().st_size for files in layout.components.values() for path in files.weight_files)
