"""WanVACEExpertsLoader: the single files ComfyUI users have (Comfy-Org experts, Kijai's VACE modules over
Wan2.2-T2V experts, GGUF, umt5 and Wan VAE files) -> WANVACE_MODEL."""

from __future__ import annotations

import logging

import comfy.model_management
from comfy_api.v0_0_2 import io

from ..wanvace_core import (
    DEFAULT_ATTENTION,
    DTYPES,
    WEIGHT_DTYPES,
    ExpertFiles,
    OffloadOptions,
    RuntimePlan,
    WanVACEInputError,
    WanVACEModel,
    inspect_expert_files,
    load_expert_files,
)
from ..wanvace_core.generation.limits import SizeLimits, size_limits_of_layouts
from ..wanvace_core.load.single_file import DEFAULT_BOUNDARY_RATIO, expert_file_stamps, resident_bytes
from ..wanvace_core.parallel import ParallelOptions
from ..wanvace_core.runtime.loaders import refuse_fp8_matmul_without_fp8
from ..wanvace_core.validation import nan_refusing_min
from .held import load_or_reuse
from .model_files import list_weight_files, refuse_unlisted, resolve_listed_file, where_to_get
from .refusals import Refusal
from .runtime_inputs import (
    attention_input,
    compile_input,
    dtype_input,
    fp8_matmul_input,
    placement_inputs,
    runtime_plan,
    runtime_refusal,
)
from .types import CATEGORY, WanVACEModelType

logger = logging.getLogger(__name__)

NONE = "none"
# Each file input and the ComfyUI folder type it lists.
_FOLDER_OF_INPUT = {
    "high_noise_model": "diffusion_models",
    "low_noise_model": "diffusion_models",
    "text_encoder": "text_encoders",
    "vae": "vae",
    "high_noise_vace_module": "diffusion_models",
    "low_noise_vace_module": "diffusion_models",
}


def _file_inputs(
    high_noise_model: str | None,
    low_noise_model: str | None,
    text_encoder: str | None,
    vae: str | None,
    high_noise_vace_module: str | None = NONE,
    low_noise_vace_module: str | None = NONE,
) -> dict[str, str | None]:
    """The node's file inputs by name."""
    return {
        "high_noise_model": high_noise_model,
        "low_noise_model": low_noise_model,
        "text_encoder": text_encoder,
        "vae": vae,
        "high_noise_vace_module": high_noise_vace_module,
        "low_noise_vace_module": low_noise_vace_module,
    }


def _expert_files(chosen: dict[str, str | None]) -> ExpertFiles:
    """The chosen files, each only from what its input lists (checked before any file is opened)."""
    listings = {folder: list_weight_files(folder) for folder in set(_FOLDER_OF_INPUT.values())}
    paths = {}
    for input_name, name in chosen.items():
        folder = _FOLDER_OF_INPUT[input_name]
        if input_name.endswith("_vace_module") and name in (NONE, "", None):
            paths[input_name] = None
        else:
            paths[input_name] = resolve_listed_file(input_name, name, listings[folder], folder)
    return ExpertFiles(**paths)


def _refuse_missing_files(chosen: dict) -> None:
    """Refuses every chosen name that its folder does not list, in one message that starts with the first input and
    says where each file comes from."""
    listings = {folder: list_weight_files(folder) for folder in set(_FOLDER_OF_INPUT.values())}
    missing = [
        (input_name, name)
        for input_name, name in chosen.items()
        if name is not None
        and not (input_name.endswith("_vace_module") and name in (NONE, ""))
        and not (isinstance(name, str) and name in listings[_FOLDER_OF_INPUT[input_name]])
    ]
    if not missing:
        return
    if len(missing) == 1:
        input_name, name = missing[0]
        refuse_unlisted(input_name, name, listings[_FOLDER_OF_INPUT[input_name]], _FOLDER_OF_INPUT[input_name])
    named = ", ".join(f"{input_name}={name!r}" for input_name, name in missing)
    folders = sorted({_FOLDER_OF_INPUT[input_name] for input_name, _ in missing})
    steps = "; ".join(
        dict.fromkeys(where_to_get(input_name, _FOLDER_OF_INPUT[input_name]) for input_name, _ in missing)
    )
    raise WanVACEInputError(
        f"{named} are not in ComfyUI's model folders ({', '.join(f'models/{folder}' for folder in folders)}): "
        f"{steps}; then refresh ComfyUI (press R) and pick them."
    )


def size_limits_of_expert_inputs(inputs: dict) -> SizeLimits | None:
    """The video size limits of the model an experts loader with these (queued) inputs loads; None if not known."""
    names = ("high_noise_model", "low_noise_model", "text_encoder", "vae")
    if not all(isinstance(inputs.get(name), str) for name in names):
        return None
    modules = {
        name: inputs.get(name, NONE) if isinstance(inputs.get(name, NONE), str) else NONE
        for name in ("high_noise_vace_module", "low_noise_vace_module")
    }
    files = _expert_files(_file_inputs(**{name: inputs[name] for name in names}, **modules))
    return size_limits_of_layouts(inspect_expert_files(files))


def _vace_module_input(noise: str) -> io.Combo.Input:
    return io.Combo.Input(
        f"{noise}_noise_vace_module",
        options=[NONE, *list_weight_files("diffusion_models")],
        default=NONE,
        optional=True,
        tooltip=f"Kijai's VACE module for a Wan2.2-T2V {noise}-noise expert (none for a VACE expert).",
    )


class WanVACEExpertsLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        experts = list_weight_files("diffusion_models")
        return io.Schema(
            node_id="WanVACEExpertsLoader",
            display_name="WanVACE Experts Loader (single files)",
            category=CATEGORY,
            description=(
                "Loads Wan2.2-VACE-Fun from the single files ComfyUI users have: the Comfy-Org experts "
                "(wan2.2_fun_vace_{high,low}_noise_14B_{bf16,fp8_scaled}), a Wan2.2-T2V expert plus Kijai's VACE "
                "module, or GGUF experts; a umt5 text encoder from models/text_encoders and the Wan 2.1 VAE from "
                "models/vae. fp8 and GGUF weights stay quantised in memory with weight_dtype auto. Gives the same "
                "model as WanVACE Model Loader, so every other node works unchanged."
            ),
            inputs=[
                io.Combo.Input(
                    "high_noise_model",
                    options=experts,
                    tooltip="The high-noise expert (the first, noisiest steps) from models/diffusion_models.",
                ),
                io.Combo.Input(
                    "low_noise_model",
                    options=experts,
                    tooltip="The low-noise expert (the final, detail steps) of the same release.",
                ),
                io.Combo.Input(
                    "text_encoder",
                    options=list_weight_files("text_encoders"),
                    tooltip="umt5-xxl from models/text_encoders (umt5_xxl_fp16 or umt5_xxl_fp8_e4m3fn_scaled).",
                ),
                io.Combo.Input(
                    "vae",
                    options=list_weight_files("vae"),
                    tooltip="The Wan 2.1 VAE from models/vae (wan_2.1_vae.safetensors).",
                ),
                dtype_input("Compute dtype, and that of every weight not kept quantised; bf16 is the trained one."),
                io.Combo.Input(
                    "weight_dtype",
                    options=list(WEIGHT_DTYPES),
                    default="auto",
                    tooltip="auto keeps fp8 and GGUF expert weights as stored; a dtype dequantises them at load.",
                ),
                io.Float.Input(
                    "boundary_ratio",
                    default=DEFAULT_BOUNDARY_RATIO,
                    min=nan_refusing_min(0.0),
                    max=1.0,
                    step=0.005,
                    tooltip="The high-noise expert runs while timestep >= this x 1000, the low-noise one after.",
                ),
                *(_vace_module_input(noise) for noise in ("high", "low")),
                *placement_inputs(),
                attention_input(),
                fp8_matmul_input(),
                compile_input(),
            ],
            outputs=[WanVACEModelType.Output(display_name="model", tooltip="The loaded WanVACE pipeline.")],
        )

    @classmethod
    async def validate_inputs(
        cls,
        high_noise_model: str | None = None,
        low_noise_model: str | None = None,
        text_encoder: str | None = None,
        vae: str | None = None,
        dtype: str | None = None,
        weight_dtype: str | None = None,
        high_noise_vace_module: str = NONE,
        low_noise_vace_module: str = NONE,
        attention: str = DEFAULT_ATTENTION,
        fp8_matmul: bool = False,
        compile: bool = False,
    ) -> bool | str:
        # The files together (headers only: whether they fit is a property of the set), every one not there named
        # at once with where to get it, and the dtypes; attention, fp8_matmul and compile are probed on this device
        # off the event loop (async).
        with Refusal() as refusal:
            for name, value, options in (("dtype", dtype, DTYPES), ("weight_dtype", weight_dtype, WEIGHT_DTYPES)):
                if value is not None and value not in options:
                    raise WanVACEInputError(f"{name}={value!r} is not supported; choose one of {', '.join(options)}.")
            chosen = _file_inputs(
                high_noise_model, low_noise_model, text_encoder, vae, high_noise_vace_module, low_noise_vace_module
            )
            _refuse_missing_files(chosen)
            if None not in (high_noise_model, low_noise_model, text_encoder, vae):
                inspect_expert_files(_expert_files(chosen))
        return refusal.message or await runtime_refusal(attention, compile, fp8_matmul) or True

    @classmethod
    def execute(
        cls,
        high_noise_model: str,
        low_noise_model: str,
        text_encoder: str,
        vae: str,
        dtype: str,
        weight_dtype: str,
        boundary_ratio: float,
        high_noise_vace_module: str = NONE,
        low_noise_vace_module: str = NONE,
        offload: OffloadOptions | None = None,
        parallel: ParallelOptions | None = None,
        attention: str = DEFAULT_ATTENTION,
        fp8_matmul: bool = False,
        compile: bool = False,
    ) -> io.NodeOutput:
        device = comfy.model_management.get_torch_device()
        files = _expert_files(
            _file_inputs(
                high_noise_model, low_noise_model, text_encoder, vae, high_noise_vace_module, low_noise_vace_module
            )
        )
        plan = runtime_plan(offload, parallel, attention, fp8_matmul, compile)
        return io.NodeOutput(load_experts_or_reuse(files, dtype, weight_dtype, boundary_ratio, plan, device))


def load_experts_or_reuse(
    files: ExpertFiles, dtype: str, weight_dtype: str, boundary_ratio: float, plan: RuntimePlan, device
) -> WanVACEModel:
    """`load_or_reuse` for single files (and the original release's folder, read as its files)."""
    layouts = inspect_expert_files(files)

    def before_replan() -> None:
        if plan.fp8_matmul:  # refused before the re-plan starts changing the model (a fresh load refuses it itself)
            refuse_fp8_matmul_without_fp8(files, weight_dtype, layouts)

    return load_or_reuse(
        "experts",
        ("experts", files, dtype, weight_dtype, float(boundary_ratio)),
        expert_file_stamps(layouts),
        plan,
        device,
        load=lambda plan: load_expert_files(files, dtype, weight_dtype, boundary_ratio, device, plan=plan),
        resident_bytes=lambda: resident_bytes(layouts, dtype, weight_dtype),
        before_replan=before_replan,
    )
