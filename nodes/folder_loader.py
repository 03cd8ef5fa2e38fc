"""WanVACEModelLoader: a diffusers-format WanVACE pipeline folder -> WANVACE_MODEL."""

from __future__ import annotations

import logging
from pathlib import Path

import comfy.model_management
from comfy_api.v0_0_2 import io

from ..wanvace_core import (
    DEFAULT_ATTENTION,
    DTYPES,
    OffloadOptions,
    WanVACEError,
    WanVACEInputError,
    find_pipeline_folders,
    inspect_pipeline_folder,
    load_pipeline,
)
from ..wanvace_core.generation.limits import SizeLimits, size_limits_of_folder, size_limits_of_layouts
from ..wanvace_core.load.original_release import (
    ORIGINAL_VAE,
    find_original_folders,
    is_original_folder,
    original_folder_files,
)
from ..wanvace_core.load.pipeline_folder import folder_file_stamps
from ..wanvace_core.load.single_file import DEFAULT_BOUNDARY_RATIO, inspect_expert_files
from ..wanvace_core.parallel import ParallelOptions
from .held import load_or_reuse
from .model_files import folder_roots, resolve_listed_folder
from .refusals import Refusal
from .runtime_inputs import attention_input, compile_input, dtype_input, placement_inputs, runtime_plan, runtime_refusal
from .single_files_loader import load_experts_or_reuse
from .types import CATEGORY, WanVACEModelType

MODEL_FOLDER = "diffusers"
logger = logging.getLogger(__name__)


def list_model_folders() -> list[str]:
    """Pipeline folders (diffusers, or the original release) under the diffusers model folders, links followed."""
    roots = folder_roots(MODEL_FOLDER)
    return sorted(set(find_pipeline_folders(roots)) | set(find_original_folders(roots)))


def size_limits_of_folder_inputs(inputs: dict) -> SizeLimits | None:
    """The video size limits of the model a folder loader with these (queued) inputs loads; None if not known yet."""
    model_name = inputs.get("model_name")
    if not isinstance(model_name, str):
        return None
    folder = resolve_model_folder(model_name)
    if is_original_folder(folder):
        files = original_folder_files(folder, inputs.get("allow_pth_weights") is True)
        return size_limits_of_layouts(inspect_expert_files(files))
    return size_limits_of_folder(folder)


def resolve_model_folder(model_name: str) -> Path:
    """The listed folder `model_name`, found through `folder_paths` (a diffusers folder by its model_index.json,
    the original release by its VAE file)."""
    markers = ("model_index.json", ORIGINAL_VAE)
    return resolve_listed_folder("model_name", model_name, list_model_folders(), MODEL_FOLDER, markers)


class WanVACEModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACEModelLoader",
            display_name="WanVACE Model Loader",
            category=CATEGORY,
            description=(
                "Loads a diffusers-format WanVACE pipeline folder (Wan2.2-VACE-Fun-A14B with its high- and "
                "low-noise experts, or a single-transformer Wan2.1-VACE) from models/diffusers, or the original "
                "alibaba-pai/Wan2.2-VACE-Fun-A14B release folder (with allow_pth_weights). Tensors stream from the "
                "files straight into place."
            ),
            inputs=[
                io.Combo.Input(
                    "model_name",
                    options=list_model_folders(),
                    tooltip="A pipeline folder under models/diffusers: a diffusers one, or the original release.",
                ),
                dtype_input("Weight and compute dtype; bf16 is what the model was trained in."),
                io.Boolean.Input(
                    "allow_pth_weights",
                    default=False,
                    optional=True,
                    tooltip="Read the original release's .pth pickles (turn on only for files from a trusted source).",
                ),
                *placement_inputs(),
                attention_input(),
                compile_input(),
            ],
            outputs=[WanVACEModelType.Output(display_name="model", tooltip="The loaded WanVACE pipeline.")],
        )

    @classmethod
    async def validate_inputs(
        cls,
        model_name: str | None = None,
        dtype: str | None = None,
        allow_pth_weights: bool = False,
        attention: str = DEFAULT_ATTENTION,
        compile: bool = False,
    ) -> bool | str:
        # model_name against the listed folders (whether a folder loads depends on the pickle opt-in) and dtype;
        # attention and compile are probed on this device off the event loop (async).
        with Refusal() as refusal:
            if dtype is not None and dtype not in DTYPES:
                raise WanVACEInputError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}.")
            if model_name is not None:
                folder = resolve_model_folder(model_name)
                try:
                    if is_original_folder(folder):
                        inspect_expert_files(original_folder_files(folder, allow_pth_weights))
                    else:
                        inspect_pipeline_folder(folder)
                except WanVACEError as error:
                    message = str(error)
                    raise WanVACEInputError(
                        message if message.startswith("model_name") else f"model_name={model_name!r}: {message}"
                    ) from error
        return refusal.message or await runtime_refusal(attention, compile) or True

    @classmethod
    def execute(
        cls,
        model_name: str,
        dtype: str,
        allow_pth_weights: bool = False,
        offload: OffloadOptions | None = None,
        parallel: ParallelOptions | None = None,
        attention: str = DEFAULT_ATTENTION,
        compile: bool = False,
    ) -> io.NodeOutput:
        device = comfy.model_management.get_torch_device()
        folder = resolve_model_folder(model_name)
        plan = runtime_plan(offload, parallel, attention, compile=compile)
        if is_original_folder(folder):
            files = original_folder_files(folder, allow_pth_weights)
            return io.NodeOutput(load_experts_or_reuse(files, dtype, "auto", DEFAULT_BOUNDARY_RATIO, plan, device))
        return io.NodeOutput(
            load_or_reuse(
                str(folder),
                ("folder", folder, dtype),
                folder_file_stamps(inspect_pipeline_folder(folder, check_weights=False)),
                plan,
                device,
                load=lambda plan: load_pipeline(folder, dtype, device, plan=plan),
                resident_bytes=lambda: _weight_file_bytes(folder),
            )
        )


def _weight_file_bytes(folder: Path) -> int:
    layout = inspect_pipeline_folder(folder, check_weights=False)
    return sum(path.stat().st_size for files in layout.components.values() for path in files.weight_files)
