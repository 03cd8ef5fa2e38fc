"""Loading a pipeline and making it runnable in one call: a loader from `load/` reads it, `plan.build_model`
puts its runtime together (the nodes and most callers want both)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..load.pipeline_folder import read_pipeline_folder
from ..load.single_file import DEFAULT_BOUNDARY_RATIO, ExpertFiles, read_expert_files
from ..parallel.options import ParallelOptions
from .model import WanVACEModel
from .offload import OffloadOptions
from .plan import RuntimePlan, build_model


def load_pipeline(
    path: str | Path,
    dtype: str = "bf16",
    device: str | torch.device = "cpu",
    offload: OffloadOptions | None = None,
    parallel: ParallelOptions | None = None,
) -> WanVACEModel:
    """Loads a WanVACE pipeline folder (Wan2.2 two-expert or Wan2.1 single transformer).

    Without `offload` (or with mode `none`) the weights go straight to `device`; with an offload mode they
    stay in host memory (memory-mapped where the dtype matches the files) and move to `device` on demand.
    With `parallel` the experts load in parallel workers, each rank its own part; this process keeps the text
    encoder and VAE, the experts only as meta-device stand-ins carrying the config, and `offload` applies to
    the text encoder and VAE here and to the experts in the workers.
    """
    plan = RuntimePlan(offload=offload or OffloadOptions(), parallel=parallel)
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
) -> WanVACEModel:
    """Loads a WanVACE pipeline from single files (see `ExpertFiles`); offload and parallel as `load_pipeline`."""
    plan = RuntimePlan(offload=offload or OffloadOptions(), parallel=parallel)
    loaded = read_expert_files(
        files, dtype, weight_dtype, boundary_ratio, plan.load_device(device), experts_on_meta=parallel is not None
    )
    return build_model(loaded, plan, device)
