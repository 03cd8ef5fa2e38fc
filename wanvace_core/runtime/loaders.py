"""Loading a pipeline and making it runnable in one call: a loader from `load/` reads it, `plan.build_model`
puts its runtime together (the nodes and most callers want both)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import WanVACEInputError
from ..load.loaded import EXPERT_NAMES
from ..load.pipeline_folder import read_pipeline_folder
from ..load.single_file import DEFAULT_BOUNDARY_RATIO, ExpertFiles, inspect_expert_files, read_expert_files
from ..parallel.options import ParallelOptions
from .attention import DEFAULT_ATTENTION
from .model import WanVACEModel
from .offload import OffloadOptions
from .plan import RuntimePlan, build_model


def load_pipeline(
    path: str | Path,
    dtype: str = "bf16",
    device: str | torch.device = "cpu",
    offload: OffloadOptions | None = None,
    parallel: ParallelOptions | None = None,
    attention: str = DEFAULT_ATTENTION,
    compile: bool = False,
) -> WanVACEModel:
    """Loads a WanVACE pipeline folder (Wan2.2 two-expert or Wan2.1 single transformer).

    Without `offload` (or with mode `none`) the weights go straight to `device`; with an offload mode they
    stay in host memory (memory-mapped where the dtype matches the files) and move to `device` on demand.
    With `parallel` the experts load in parallel workers, each rank its own part; this process keeps the text
    encoder and VAE, the experts only as meta-device stand-ins carrying the config, and `offload` applies to
    the text encoder and VAE here and to the experts in the workers. `attention` is the experts' attention kernel
    (`runtime.attention.ATTENTION_BACKENDS`; refused if it cannot run on `device`). `compile` compiles each
    block's forward with torch.compile (`runtime.regional_compile`).
    """
    plan = RuntimePlan(offload=offload or OffloadOptions(), parallel=parallel, attention=attention, compile=compile)
    plan.check(device)
    loaded = read_pipeline_folder(path, dtype, plan.load_device(device), experts_on_meta=parallel is not None)
    return build_model(loaded, plan, device)


def load_expert_files(
    files: ExpertFiles,
    dtype: str = "bf16",
    weight_dtype: str = "auto",
    boundary_ratio: float | None = DEFAULT_BOUNDARY_RATIO,
    device: str | torch.device = "cpu",
    offload: OffloadOptions | None = None,
    parallel: ParallelOptions | None = None,
    attention: str = DEFAULT_ATTENTION,
    fp8_matmul: bool = False,
    compile: bool = False,
) -> WanVACEModel:
    """Loads a WanVACE pipeline from single files (see `ExpertFiles`); the options as `load_pipeline`, and
    `fp8_matmul`: experts' weights kept in fp8 compute with fp8 matmul (`runtime.fp8_matmul`)."""
    plan = RuntimePlan(
        offload=offload or OffloadOptions(),
        parallel=parallel,
        attention=attention,
        fp8_matmul=fp8_matmul,
        compile=compile,
    )
    plan.check(device)
    if fp8_matmul:
        refuse_fp8_matmul_without_fp8(files, weight_dtype)
    loaded = read_expert_files(
        files, dtype, weight_dtype, boundary_ratio, plan.load_device(device), experts_on_meta=parallel is not None
    )
    return build_model(loaded, plan, device)


def refuse_fp8_matmul_without_fp8(files: ExpertFiles, weight_dtype: str, layouts: dict | None = None) -> None:
    """fp8 matmul needs expert weights kept in e4m3: refused up front (from the headers, or `layouts` already read
    from them by `inspect_expert_files`) when none will be."""
    if weight_dtype != "auto":
        raise WanVACEInputError(
            f"fp8_matmul is on but weight_dtype={weight_dtype!r} dequantises every expert weight at load; choose "
            "weight_dtype auto (fp8 weights stay fp8), or turn fp8_matmul off."
        )
    layouts = inspect_expert_files(files) if layouts is None else layouts
    if not any(
        source.entry.dtype == torch.float8_e4m3fn
        for name in EXPERT_NAMES
        if name in layouts
        for source in layouts[name].sources.values()
    ):
        raise WanVACEInputError(
            f"fp8_matmul is on but high_noise_model={Path(files.high_noise_model).name} holds no fp8 (e4m3) weights; "
            "choose fp8 experts (e.g. wan2.2_fun_vace_high_noise_14B_fp8_scaled.safetensors), or turn fp8_matmul off."
        )
