"""Loading a pipeline and making it runnable in one call: a loader from `load/` reads it, `plan.build_model`
puts its runtime together, and with parallel options the workers start and load their part (the nodes and most
callers want all of it)."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKLWan

from ..errors import WanVACEInputError
from ..load.loaded import EXPERT_NAMES, LoadedPipeline
from ..load.pipeline_folder import read_experts, read_pipeline_folder
from ..load.single_file import (
    DEFAULT_BOUNDARY_RATIO,
    ExpertFiles,
    expert_files_from,
    inspect_expert_files,
    load_experts_only,
    read_expert_files,
)
from ..parallel.groups import ParallelGroups
from ..parallel.launcher import remote_experts
from ..parallel.messages import WanVACEWorkerError
from ..parallel.options import ParallelOptions
from ..parallel.sharding import meta_experts
from .attention import DEFAULT_ATTENTION
from .model import WanVACEModel
from .offload import OffloadOptions
from .plan import RankContext, RuntimePlan, build_model


def load_pipeline(
    path: str | Path,
    dtype: str = "bf16",
    device: str | torch.device = "cpu",
    offload: OffloadOptions | None = None,
    parallel: ParallelOptions | None = None,
    attention: str = DEFAULT_ATTENTION,
    compile: bool = False,
    *,
    plan: RuntimePlan | None = None,
) -> WanVACEModel:
    """Loads a WanVACE pipeline folder (Wan2.2 two-expert or Wan2.1 single transformer).

    How it runs is `plan` (the loader nodes build one), or for a script the plan's options one by one: without
    `offload` (or with mode `none`) the weights go straight to `device`; with an offload mode they stay in host
    memory (memory-mapped where the dtype matches the files) and move to `device` on demand. With `parallel` the
    experts load in parallel workers, each rank its own part; this process keeps the text encoder and VAE, the
    experts only as meta-device stand-ins carrying the config, and `offload` applies to the text encoder and VAE here
    and to the experts in the workers. `attention` is the experts' attention kernel (`runtime.attention.
    ATTENTION_BACKENDS`; refused if it cannot run on `device`). `compile` compiles each block's forward with
    torch.compile (`runtime.regional_compile`).
    """
    plan = _plan_of(plan, offload=offload, parallel=parallel, attention=attention, compile=compile)
    plan.check(device)
    loaded = read_pipeline_folder(path, dtype, plan.load_device(device), experts_on_meta=plan.parallel is not None)
    return _runnable(loaded, plan, device)


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
    *,
    plan: RuntimePlan | None = None,
) -> WanVACEModel:
    """Loads a WanVACE pipeline from single files (see `ExpertFiles`); the plan as `load_pipeline`, and its
    `fp8_matmul`: experts' weights kept in fp8 compute with fp8 matmul (`runtime.fp8_matmul`)."""
    plan = _plan_of(
        plan, offload=offload, parallel=parallel, attention=attention, fp8_matmul=fp8_matmul, compile=compile
    )
    plan.check(device)
    if plan.fp8_matmul:
        refuse_fp8_matmul_without_fp8(files, weight_dtype)
    loaded = read_expert_files(
        files, dtype, weight_dtype, boundary_ratio, plan.load_device(device), experts_on_meta=plan.parallel is not None
    )
    return _runnable(loaded, plan, device)


def _plan_of(plan: RuntimePlan | None, **options) -> RuntimePlan:
    """`plan`, or the plan of `options` (each left out where it is None)."""
    given = {name: value for name, value in options.items() if value is not None}
    if plan is None:
        return RuntimePlan(**given)
    if any(value != getattr(RuntimePlan(), name) for name, value in given.items()):
        raise WanVACEInputError(
            f"a runtime plan and its options ({', '.join(sorted(given))}) were both given; give the plan alone."
        )
    return plan


def _runnable(loaded, plan: RuntimePlan, device: str | torch.device) -> WanVACEModel:
    """The model with its plan applied; with parallel options, its experts' workers started (they load them)."""
    model = build_model(loaded, plan, device)
    if plan.parallel is not None:
        model.remote = remote_experts(model, plan.parallel, plan.to_plain())
        model.remote.start()
    return model


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


def load_on_rank(request: dict, plan: RuntimePlan, device: torch.device, groups: ParallelGroups) -> WanVACEModel:
    """A parallel worker rank's model from the load request `remote_experts` made: its experts built on meta with
    their weight sources when sharded (the plan's FSDP step fills each rank's shards), else read whole; the VAE a meta
    stand-in for its config; then the plan applied with the rank's process groups."""
    source = request["source"]
    dtype = getattr(torch, request["torch_dtype"])
    files = Path(source["path"]) if source["kind"] == "folder" else expert_files_from(source["files"])
    shard_sources = None
    if plan.parallel.shard != "none":
        built = meta_experts(files, dtype, weight_dtype=source.get("weight_dtype", "auto"))
        experts = {name: expert for name, (expert, _) in built.items()}
        shard_sources = {name: sources for name, (_, sources) in built.items()}
    elif source["kind"] == "folder":
        experts = read_experts(source["path"], dtype, plan.load_device(device))
    else:
        experts = load_experts_only(files, dtype, source["weight_dtype"], plan.load_device(device))
    with init_empty_weights():  # only the VAE's config is read on a worker (the latent strides)
        vae = AutoencoderKLWan.from_config(request["vae_config"])
    loaded = LoadedPipeline(
        source=Path(source["path"]),
        dtype=dtype,
        device=device,
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        transformer=experts.get("transformer"),
        transformer_2=experts.get("transformer_2"),
        scheduler_config=dict(request["scheduler_config"]),
        boundary_ratio=request["boundary_ratio"],
        weights=_NoRefill(),
    )
    return build_model(loaded, plan, device, rank=RankContext(groups, shard_sources))


class _NoRefill:
    """Workers load once per model; ComfyUI never asks them to unload parts of it."""

    def refill(self, name, module, device):
        raise WanVACEWorkerError(f"a parallel worker cannot read back {name}; load the model again")
