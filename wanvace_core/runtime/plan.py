"""The one place a loaded pipeline's runtime is put together: the same function in ComfyUI's process and on
every parallel worker rank (torchtitan's `parallelize`, for a WanVACE pipeline).

Per expert, always in this order (`EXPERT_STEPS`):

1. `interleaved_vace`: the forward that runs VACE block k right before main block `vace_layers[k]`
   (`interleave.apply_interleaved_vace`). It replaces `forward`, so it comes first and everything below
   sees the forward that really runs, and the block order the steps below follow is the interleaved one;
2. `ulysses` (worker ranks with `ulysses_degree` > 1): the self-attention split over the Ulysses group;
3. `fsdp` (worker ranks with `shard` != none): FSDP2 units over the meta-built expert, each rank's shards
   then streamed from the files (`parallel.sharding`), and each block prefetching the next in the
   interleaved order;
4. `residency`: where the weights live (`offload.make_residency`: all on the device, one component at a
   time, or block by block in the interleaved order; FSDP places sharded experts itself). Its hooks are
   module hooks: they survive (1) and run before any hook added later;
5. `fp8_matmul`: layers whose weights are kept in fp8 compute with `torch._scaled_mm` (`fp8_matmul.py`)
   instead of dequantising; a forward of the layer, so the module hooks of (4) and LoRA run around it;
6. `attention`: the attention kernel, through diffusers' dispatcher (`attention.py`); it is set on each
   attention processor, so it runs inside the Ulysses wrapper (2) too;
7. `compile`: each block's forward compiled (`regional_compile.py`). Last, because it traces what the steps
   before put inside a block (fp8 matmul, the attention backend, and per run the LoRA hooks), while the hooks
   of (2)-(4) sit around the block's forward and stay eager.

Then, in ComfyUI's process only, `workers`: with parallel options, the experts' workers are started here,
and they run this same function on their side.

Per sampling run, entered around `sample` in this order and left in reverse (`RUN_STEPS`), also on an
error or a cancel: `settle` (weights back to their resting place if the run fails), `loras` (hooks added
after the residency's, so a LoRA sees the weights the residency just bound), `cache` (cache-dit wraps the
block lists the steps above prepared, for this run only), `compiled_cache` (with compile and cache both on:
the blocks cache-dit patched run the compiled forward again).

Every step attaches to the modules in one way (`wanvace_core.hooks`): torch module hooks, kept per step, and an
instance forward where the step changes the computation (1, 5, 7).

Changing the offload options re-plans (4) over the weights already loaded: nothing is read from the
files again except weights an unload had dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import WanVACEInputError
from ..load.loaded import EXPERT_NAMES, LoadedPipeline
from ..parallel.groups import ParallelGroups
from ..parallel.launcher import remote_experts
from ..parallel.options import ParallelOptions
from ..parallel.sequence import apply_ulysses
from ..parallel.sharding import ShardSources, prefetch_in_order, shard_and_fill
from .attention import ATTENTION_BACKENDS, DEFAULT_ATTENTION, apply_attention, resolve_attention
from .fp8_matmul import apply_fp8_matmul, check_fp8_matmul
from .interleave import apply_interleaved_vace, current_execution_order
from .lora import applied_loras
from .model import WanVACEModel
from .offload import OffloadOptions, ShardedResidency, StreamOps, Transfer, make_residency
from .regional_compile import apply_regional_compile, check_regional_compile, compiled_cached_blocks

logger = logging.getLogger(__name__)

EXPERT_STEPS = ("interleaved_vace", "ulysses", "fsdp", "residency", "fp8_matmul", "attention", "compile")
RUN_STEPS = ("settle", "loras", "guidance", "cache", "compiled_cache")


@dataclass(frozen=True)
class RuntimePlan:
    """How a loaded pipeline runs; validated once, by its parts. `parallel` None runs the experts here."""

    offload: OffloadOptions = field(default_factory=OffloadOptions)
    parallel: ParallelOptions | None = None
    attention: str = DEFAULT_ATTENTION
    fp8_matmul: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise WanVACEInputError(
                f"attention={self.attention!r} is unknown; choose one of {', '.join(ATTENTION_BACKENDS)}."
            )

    def check(self, device: torch.device | str) -> None:
        """Refuses, before anything is read, a plan whose attention kernel cannot run where the experts will run:
        `device`, or the parallel workers' devices where they are on this machine (torchrun's workers elsewhere
        check it when they load)."""
        if self.parallel is not None and self.parallel.launcher != "local":
            return
        where = device if self.parallel is None else self.parallel.devices[0]
        resolve_attention(self.attention, where)
        if self.fp8_matmul:
            check_fp8_matmul(where)
        if self.compile:
            check_regional_compile(where)

    def load_device(self, device: torch.device | str) -> torch.device:
        """Where the loaders read weights to: the device itself without offload, else host memory."""
        return torch.device(device) if self.offload.mode == "none" else torch.device("cpu")


@dataclass(frozen=True)
class RankContext:
    """What a worker rank adds to the plan: its process groups, and for `fsdp` the experts' weight sources."""

    groups: ParallelGroups
    shard_sources: dict[str, ShardSources] | None = None


def build_model(
    loaded: LoadedPipeline,
    plan: RuntimePlan,
    device: torch.device | str,
    *,
    rank: RankContext | None = None,
    transfer: Transfer | None = None,
    stream_ops: StreamOps | None = None,
) -> WanVACEModel:
    """The runnable model over `loaded` (components shared, not copied), with `plan` applied."""
    model = WanVACEModel.from_loaded(loaded)
    model.device = torch.device(device)
    apply_plan(model, plan, rank=rank, transfer=transfer, stream_ops=stream_ops)
    return model


@dataclass
class _Applying:
    """What the steps of one `apply_plan` / `replan` call share."""

    model: WanVACEModel
    plan: RuntimePlan
    rank: RankContext | None
    transfer: Transfer | None
    stream_ops: StreamOps | None

    @property
    def sharded(self) -> bool:
        return self.rank is not None and self.plan.parallel is not None and self.plan.parallel.shard != "none"

    @property
    def experts_here(self) -> bool:
        """False in ComfyUI's process with parallel workers: its experts are meta stand-ins, the workers apply these."""
        return self.rank is not None or self.plan.parallel is None

    def experts(self) -> Iterator[tuple[str, torch.nn.Module]]:
        return ((name, expert) for name in EXPERT_NAMES if (expert := getattr(self.model, name)) is not None)


def _step_interleaved_vace(applying: _Applying) -> None:
    for _, expert in applying.experts():
        apply_interleaved_vace(expert)


def _step_ulysses(applying: _Applying) -> None:
    if applying.rank is not None and applying.rank.groups.ulysses_group is not None:
        for _, expert in applying.experts():
            apply_ulysses(expert, applying.rank.groups.ulysses_group)


def _step_fsdp(applying: _Applying) -> None:
    if not applying.sharded:
        return
    rank, model = applying.rank, applying.model
    for name, expert in applying.experts():
        cpu_offload = applying.plan.offload.mode != "none"
        shard_and_fill(expert, rank.shard_sources[name], rank.groups.shard_mesh, model.device, cpu_offload)
        prefetch_in_order(expert, current_execution_order(expert))


def _step_residency(applying: _Applying) -> None:
    model, plan = applying.model, applying.plan
    model.close_residency()  # the new residency must find the weights unhooked and off the ring
    if applying.rank is None:
        components = model.components
    else:  # a worker holds only the experts; its VAE is a meta stand-in for the config
        components = dict(applying.experts())
    if applying.sharded:
        model.residency = ShardedResidency(components)
    else:
        model.residency = make_residency(
            plan.offload, components, model.weights, model.device, applying.transfer, stream_ops=applying.stream_ops
        )


def _step_fp8_matmul(applying: _Applying) -> None:
    if not applying.experts_here:
        return
    model, plan = applying.model, applying.plan
    if plan.fp8_matmul:
        check_fp8_matmul(model.device)
    layers = sum(apply_fp8_matmul(expert, plan.fp8_matmul) for expert in model.experts)
    if plan.fp8_matmul and layers == 0:
        raise WanVACEInputError(
            "fp8_matmul is on but no expert weight is kept in fp8; it needs fp8 expert files (e.g. "
            "wan2.2_fun_vace_*_fp8_scaled.safetensors) loaded with weight_dtype auto. Turn fp8_matmul off."
        )
    if plan.fp8_matmul:
        logger.info("WanVACE fp8 matmul: %d layers", layers)


def _step_attention(applying: _Applying) -> None:
    if not applying.experts_here:
        return
    model, plan = applying.model, applying.plan
    backend = resolve_attention(plan.attention, model.device)
    for expert in model.experts:
        apply_attention(expert, backend)
    logger.info("WanVACE attention: %s (chosen: %s)", backend, plan.attention)


def _step_compile(applying: _Applying) -> None:
    if not applying.experts_here:
        return
    model, plan = applying.model, applying.plan
    if plan.compile:
        check_regional_compile(model.device)
    blocks = sum(apply_regional_compile(expert, plan.compile) for expert in model.experts)
    if plan.compile:
        logger.info("WanVACE compile: %d blocks (torch.compile per block; each new size compiles once)", blocks)


_EXPERT_STEP_FUNCTIONS = {
    "interleaved_vace": _step_interleaved_vace,
    "ulysses": _step_ulysses,
    "fsdp": _step_fsdp,
    "residency": _step_residency,
    "fp8_matmul": _step_fp8_matmul,
    "attention": _step_attention,
    "compile": _step_compile,
}
# What `replan` re-applies over weights already in memory: the steps from here on (the ones before change the
# experts' structure, sharding or forward, which a loaded model keeps).
_REPLANNED_FROM = "residency"


def apply_plan(
    model: WanVACEModel,
    plan: RuntimePlan,
    *,
    rank: RankContext | None = None,
    transfer: Transfer | None = None,
    stream_ops: StreamOps | None = None,
) -> None:
    """Applies `EXPERT_STEPS`, in that order, to `model`'s experts, then (in ComfyUI's process) starts its workers."""
    applying = _Applying(model, plan, rank, transfer, stream_ops)
    for step in EXPERT_STEPS:
        _EXPERT_STEP_FUNCTIONS[step](applying)
    model.plan = plan
    if rank is None and plan.parallel is not None:
        runtime = {"attention": plan.attention, "fp8_matmul": plan.fp8_matmul, "compile": plan.compile}
        model.remote = remote_experts(model, plan.parallel, plan.offload, runtime)
        model.remote.start()


def replan(
    model: WanVACEModel, plan: RuntimePlan, transfer: Transfer | None = None, *, stream_ops: StreamOps | None = None
) -> None:
    """Puts a loaded model (experts in this process) under another plan's steps from `residency` on (offload, fp8
    matmul, attention, compile), over the weights already in memory; the steps before stay as applied."""
    applying = _Applying(model, plan, None, transfer, stream_ops)
    for step in EXPERT_STEPS[EXPERT_STEPS.index(_REPLANNED_FROM) :]:
        _EXPERT_STEP_FUNCTIONS[step](applying)
    model.plan = plan


def attach_offload(
    model: WanVACEModel,
    options: OffloadOptions,
    transfer: Transfer | None = None,
    *,
    stream_ops: StreamOps | None = None,
) -> None:
    """`replan` with new offload options only."""
    current = model.plan if model.plan is not None else RuntimePlan()
    replan(model, dataclasses.replace(current, offload=options), transfer, stream_ops=stream_ops)


@contextlib.contextmanager
def planned_run(model: WanVACEModel, cache=None, guidance=None) -> Iterator[None]:
    """`RUN_STEPS` around one sampling run: entered in that order, left in reverse, also on an error or a cancel.

    `cache` is the run's `caching.CachedExperts` (or None); `guidance` the run's hooks inside the experts
    (`attention_guidance.attention_guidance`, or None), attached after the LoRAs and before the cache wraps the experts.
    """
    with contextlib.ExitStack() as run:
        for step in RUN_STEPS:
            entered = _RUN_STEP_FUNCTIONS[step](model, cache, guidance)
            if entered is not None:
                run.enter_context(entered)
        yield


def _run_step_loras(model: WanVACEModel, cache, guidance):
    return applied_loras(model, model.loras) if model.loras else None


def _run_step_cache(model: WanVACEModel, cache, guidance):
    return cache


def _run_step_compiled_cache(model: WanVACEModel, cache, guidance):
    if cache is None or model.plan is None or not model.plan.compile:
        return None
    return compiled_cached_blocks([getattr(model, run.attribute) for run in cache.runs])


@contextlib.contextmanager
def _settled_on_error(model: WanVACEModel) -> Iterator[None]:
    """A run that raises (cancel, OOM) must not leave weights on the device until the next prompt."""
    try:
        yield
    except BaseException:
        model.residency.settle()
        raise


_RUN_STEP_FUNCTIONS = {
    "settle": lambda model, cache, guidance: _settled_on_error(model),
    "loras": _run_step_loras,
    "guidance": lambda model, cache, guidance: guidance,
    "cache": _run_step_cache,
    "compiled_cache": _run_step_compiled_cache,
}
