"""Step caching for both experts with cache-dit: block-level DBCache, optionally TaylorSeer-calibrated.

Caching goes through cache-dit's `BlockAdapter` for the pair of transformers with the VACE patch
functor, so every VACE hint is still added at its layer. It is enabled for one sampling run and
released when the run ends (also on cancel), so every run starts from a fresh cache context whose
step count is that expert's share of the steps, and nothing is left patched between runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..errors import WanVACEError, WanVACEInputError
from ..hooks import instance_forward, set_instance_forward
from ..validation import validate_finite, validate_integer
from .model import WanVACEModel

logger = logging.getLogger(__name__)

CACHE_MODES = ("DBCache", "DBCache+TaylorSeer")
EXPERT_NAMES = {"transformer": "high-noise", "transformer_2": "low-noise"}


class WanVACECacheError(WanVACEError, RuntimeError):
    """cache-dit could not be applied as configured; the run is refused rather than silently uncached."""


@dataclass(frozen=True)
class ExpertCacheLimits:
    """Per-expert limits: the high-noise expert gets far fewer steps than the low-noise one."""

    max_warmup_steps: int = 2
    max_cached_steps: int = -1

    def __post_init__(self) -> None:
        validate_integer("max_warmup_steps", self.max_warmup_steps, "use a whole number of steps, 0 or more")
        validate_integer("max_cached_steps", self.max_cached_steps, "use a whole number of steps, or -1 for no limit")
        if self.max_warmup_steps < 0:
            raise WanVACEInputError(f"max_warmup_steps={self.max_warmup_steps} must be 0 or more.")
        if self.max_cached_steps < -1:
            raise WanVACEInputError(f"max_cached_steps={self.max_cached_steps} must be -1 (no limit) or 0 or more.")


@dataclass(frozen=True)
class CacheOptions:
    """What the user enabled. Validated once; `check_model` checks it against a model's layers."""

    mode: str = "DBCache"
    Fn_compute_blocks: int = 1
    Bn_compute_blocks: int = 0
    residual_diff_threshold: float = 0.08
    high_noise: ExpertCacheLimits = field(default_factory=ExpertCacheLimits)
    low_noise: ExpertCacheLimits = field(default_factory=ExpertCacheLimits)
    taylorseer_order: int = 1

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise WanVACEInputError(f"mode={self.mode!r} is unknown; choose one of {', '.join(CACHE_MODES)}.")
        validate_integer("Fn_compute_blocks", self.Fn_compute_blocks, "use a whole number of blocks, 1 or more")
        validate_integer("Bn_compute_blocks", self.Bn_compute_blocks, "use a whole number of blocks, 0 or more")
        validate_integer("taylorseer_order", self.taylorseer_order, "use 1 or 2")
        if self.Fn_compute_blocks < 1:
            raise WanVACEInputError(
                f"Fn_compute_blocks={self.Fn_compute_blocks} must be at least 1: the first block's residual decides "
                "whether a step is cached."
            )
        if self.Bn_compute_blocks < 0:
            raise WanVACEInputError(f"Bn_compute_blocks={self.Bn_compute_blocks} must be 0 or more.")
        threshold_fix = "use a value in (0, 1]; 0.04-0.12 is typical"
        if not 0.0 < validate_finite("residual_diff_threshold", self.residual_diff_threshold, threshold_fix) <= 1.0:
            raise WanVACEInputError(
                f"residual_diff_threshold={self.residual_diff_threshold} must lie in (0, 1]; 0.04-0.12 is typical."
            )
        if not 1 <= self.taylorseer_order <= 4:
            raise WanVACEInputError(f"taylorseer_order={self.taylorseer_order} must lie in [1, 4]; 1 or 2 is typical.")

    @property
    def uses_taylorseer(self) -> bool:
        return self.mode == "DBCache+TaylorSeer"

    def check_model(self, model: WanVACEModel) -> None:
        """Refuses block counts this model's layers cannot honour."""
        config = model.reference_expert.config
        num_layers, last_vace_layer = config.num_layers, max(config.vace_layers)
        if self.Fn_compute_blocks + self.Bn_compute_blocks > num_layers:
            raise WanVACEInputError(
                f"Fn_compute_blocks + Bn_compute_blocks = {self.Fn_compute_blocks + self.Bn_compute_blocks} exceeds "
                f"the model's {num_layers} blocks; lower them."
            )
        # On a cached step the middle blocks are skipped, so their VACE hints are never consumed; a Bn block
        # at or before a VACE layer would then be handed the wrong hint.
        allowed = num_layers - 1 - last_vace_layer
        if self.Bn_compute_blocks > allowed:
            raise WanVACEInputError(
                f"Bn_compute_blocks={self.Bn_compute_blocks} reaches back over VACE layer {last_vace_layer} of this "
                f"{num_layers}-block model, which would inject the wrong VACE hint; use at most {allowed}."
            )

    def limits_for(self, expert_attribute: str) -> ExpertCacheLimits:
        return self.high_noise if expert_attribute == "transformer" else self.low_noise

    @classmethod
    def from_plain(cls, fields: dict) -> CacheOptions:
        """The inverse of `dataclasses.asdict` (how the options travel to parallel workers)."""
        fields = dict(fields)
        for name in ("high_noise", "low_noise"):
            fields[name] = ExpertCacheLimits(**fields[name])
        return cls(**fields)


@dataclass(frozen=True)
class ExpertRun:
    """How one expert is used in a run: its steps and whether it runs a CFG (negative) pass."""

    attribute: str
    steps: int
    cfg: bool


@dataclass(frozen=True)
class ExpertCacheReport:
    """What cache-dit recorded for one expert during one run."""

    expert: str
    steps: int
    cached_steps: tuple[int, ...]
    cfg_steps: int
    cfg_cached_steps: tuple[int, ...]
    calibrator: str | None
    windows: int = 1  # context windows, each cached on its own: steps counts every window's steps

    @property
    def computed_steps(self) -> int:
        return self.steps - len(self.cached_steps)

    def text(self) -> str:
        unit = "steps" if self.windows == 1 else f"window steps ({self.windows} windows)"
        line = f"{self.expert} expert: {self.computed_steps}/{self.steps} {unit} computed, "
        line += f"{len(self.cached_steps)} cached"
        if self.cfg_steps:
            line += f"; CFG branch {self.cfg_steps - len(self.cfg_cached_steps)} computed, "
            line += f"{len(self.cfg_cached_steps)} cached"
        return line + f"; calibrator: {self.calibrator or 'none'}"


@dataclass(frozen=True)
class CacheReport:
    mode: str
    experts: tuple[ExpertCacheReport, ...]

    def text(self) -> str:
        return f"Cache-DiT {self.mode}: " + " | ".join(expert.text() for expert in self.experts)

    @classmethod
    def from_plain(cls, fields: dict) -> CacheReport:
        """The inverse of `dataclasses.asdict` (how a report comes back from parallel workers)."""
        experts = tuple(
            ExpertCacheReport(
                **{
                    **expert,
                    "cached_steps": tuple(expert["cached_steps"]),
                    "cfg_cached_steps": tuple(expert["cfg_cached_steps"]),
                }
            )
            for expert in fields["experts"]
        )
        return cls(mode=fields["mode"], experts=experts)


_FUNCTOR_MARKS = ("_is_patched",)
_FUNCTOR_BLOCK_MARKS = ("_i", "_vace_layers")


@dataclass
class _ForwardSnapshot:
    """Instance-level forwards of an expert and its blocks before cache-dit's VACE patch functor ran."""

    expert: torch.nn.Module
    forward: object
    block_forwards: list

    @classmethod
    def take(cls, expert: torch.nn.Module) -> _ForwardSnapshot:
        return cls(expert, instance_forward(expert), [instance_forward(block) for block in expert.blocks])

    def restore(self) -> None:
        modules = [(self.expert, self.forward, _FUNCTOR_MARKS)]
        modules += [
            (block, forward, _FUNCTOR_BLOCK_MARKS)
            for block, forward in zip(self.expert.blocks, self.block_forwards, strict=True)
        ]
        for module, forward, marks in modules:
            set_instance_forward(module, forward)
            for mark in marks:
                module.__dict__.pop(mark, None)


class CachedExperts:
    """Context manager: cache-dit on the experts of one run, released on exit (also on errors and cancel)."""

    def __init__(self, model: WanVACEModel, options: CacheOptions, runs: list[ExpertRun]) -> None:
        options.check_model(model)
        self.model = model
        self.options = options
        self.runs = [run for run in runs if run.steps > 0]
        self._adapter = None
        self._saved_forwards: list[_ForwardSnapshot] = []
        # Per context window, each expert's cache-dit context by name; empty for a run without windows.
        self._window_contexts: dict[int, dict[str, object]] = {}
        self._active_window: int | None = None

    def _cache_config(self, run: ExpertRun):
        from cache_dit import DBCacheConfig

        limits = self.options.limits_for(run.attribute)
        return DBCacheConfig(
            Fn_compute_blocks=self.options.Fn_compute_blocks,
            Bn_compute_blocks=self.options.Bn_compute_blocks,
            residual_diff_threshold=self.options.residual_diff_threshold,
            max_warmup_steps=limits.max_warmup_steps,
            max_cached_steps=limits.max_cached_steps,
            enable_separate_cfg=run.cfg,
            num_inference_steps=run.steps,
        )

    def _calibrator_config(self):
        if not self.options.uses_taylorseer:
            return None
        from cache_dit import TaylorSeerCalibratorConfig

        return TaylorSeerCalibratorConfig(taylorseer_order=self.options.taylorseer_order)

    def __enter__(self) -> CachedExperts:
        import cache_dit
        from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern, ParamsModifier
        from cache_dit.caching.patch_functors import WanVACEPatchFunctor

        experts = [getattr(self.model, run.attribute) for run in self.runs]
        self._saved_forwards = [_ForwardSnapshot.take(expert) for expert in experts]
        calibrator = self._calibrator_config()
        adapter = BlockAdapter(
            transformer=experts,
            blocks=[expert.blocks for expert in experts],
            forward_pattern=[ForwardPattern.Pattern_2] * len(experts),
            patch_functor=WanVACEPatchFunctor(),
            has_separate_cfg=True,
            params_modifiers=[
                ParamsModifier(cache_config=self._cache_config(run), calibrator_config=calibrator) for run in self.runs
            ],
        )
        self._adapter = adapter  # set first: whatever enable_cache attaches before failing is released
        try:
            cache_dit.enable_cache(
                adapter, cache_config=DBCacheConfig(num_inference_steps=None), calibrator_config=calibrator
            )
            for run, expert in zip(self.runs, experts, strict=True):
                if not getattr(expert, "_is_cached", False) or not hasattr(expert.blocks, "_forward_pattern"):
                    raise WanVACECacheError(
                        f"cache-dit did not take the block-level path for the {EXPERT_NAMES[run.attribute]} expert; "
                        "refusing to run uncached while caching was asked for. Disconnect the cache input or "
                        "install a cache-dit version that supports WanVACE (>= 1.5.3)."
                    )
                if not getattr(expert, "_is_patched", False):
                    # Without the VACE functor cache-dit's block wrapper adds only the first VACE hint.
                    raise WanVACECacheError(
                        f"cache-dit skipped its WanVACE patch functor for the {EXPERT_NAMES[run.attribute]} expert "
                        f"(class {type(expert).__name__}), so VACE hints would be lost; refusing to run. Disconnect "
                        "the cache input, or report this with your cache-dit version."
                    )
        except (AssertionError, ValueError, TypeError, AttributeError) as error:
            self.__exit__(None, None, None)
            raise WanVACECacheError(
                f"cache-dit could not be applied to the WanVACE experts: {error}. Disconnect the cache input or "
                "check the cache settings."
            ) from error
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *_exc) -> None:
        experts = [getattr(self.model, run.attribute) for run in self.runs]
        # cache-dit releases the contexts in its registry; the other windows' contexts are ours to release.
        for contexts in self._window_contexts.values():
            for context in contexts.values():
                context.clear_buffers()
        self._window_contexts, self._active_window = {}, None
        if self._adapter is not None and any(getattr(expert, "_is_cached", False) for expert in experts):
            import cache_dit

            cache_dit.disable_cache(self._adapter)
        self._adapter = None
        # disable_cache leaves the VACE patch functor's forwards in place (it computes every hint up front);
        # put our interleaved forwards back so uncached runs keep their lower activation peak.
        for snapshot in self._saved_forwards:
            snapshot.restore()
        self._saved_forwards = []

    def _context_manager(self):
        # cache-dit keeps one context manager per adapter and puts it on each transformer it caches.
        return getattr(self.model, self.runs[0].attribute)._context_manager

    def _context_names(self) -> dict[str, str]:
        """Each cached expert's cache-dit context name (one block list per expert, so one context each)."""
        names = {}
        for run in self.runs:
            (name,) = getattr(self.model, run.attribute)._context_names
            names[run.attribute] = name
        return names

    def use_window(self, position: int) -> None:
        """Gives the experts the cache state of context window `position` of the step (the same frames at every
        step under the `standard_static` schedule), so that one window's residuals never decide another's.

        Each window gets cache-dit contexts of its own, made as cache-dit makes the first; the first window uses
        the ones `enable_cache` made. cache-dit has no public call that puts back a context it made before (its
        blocks look their context up by name at every call), so this swaps the entry in its manager's registry;
        `report` refuses a run in which any window's context did not see every step of its expert.
        """
        manager = self._context_manager()
        registry = getattr(manager, "_cached_context_manager", None)
        if not isinstance(registry, dict):
            raise WanVACECacheError(
                "this cache-dit version keeps its cache contexts differently, so context windows cannot each have "
                "their own cache; disconnect the cache input or the context windows, or install cache-dit 1.5.x."
            )
        names = self._context_names()
        if self._active_window is None:
            self._active_window = 0
            self._window_contexts[0] = {name: manager.get_context(name) for name in names.values()}
        if position == self._active_window:
            return
        self._window_contexts[self._active_window] = {name: manager.get_context(name) for name in names.values()}
        if position not in self._window_contexts:
            first = self._window_contexts[0]
            self._window_contexts[position] = {
                name: manager.new_context(*first[name]._init_args, **{**first[name]._init_kwargs, "name": name})
                for name in names.values()
            }
        registry.update(self._window_contexts[position])
        self._active_window = position

    def report(self) -> CacheReport:
        """Reads cache-dit's own statistics from each expert's contexts (one per context window) and checks they
        describe the run that happened."""
        manager = self._context_manager()
        names = self._context_names()
        if self._active_window is not None:
            self._window_contexts[self._active_window] = {name: manager.get_context(name) for name in names.values()}
        windows = [self._window_contexts[position] for position in sorted(self._window_contexts)] or [
            {name: manager.get_context(name) for name in names.values()}
        ]
        experts = []
        for run in self.runs:
            expert_name = EXPERT_NAMES[run.attribute]
            cached_steps, cfg_cached_steps = [], []
            calibrators = set()
            for position, contexts in enumerate(windows):
                context = contexts[names[run.attribute]]
                where = f" in context window {position + 1}" if len(windows) > 1 else ""
                if context.accumulated_executed_steps != run.steps:
                    raise WanVACECacheError(
                        f"cache-dit saw {context.accumulated_executed_steps} steps of the {expert_name} expert{where} "
                        f"but it ran {run.steps}; its cache context is not the one this run used."
                    )
                cached_steps += context.cached_steps
                cfg_cached_steps += context.cfg_cached_steps
                calibrator = context.calibrator_config
                calibrators.add(
                    f"TaylorSeer (order {calibrator.taylorseer_order})"
                    if context.calibrator is not None and calibrator is not None
                    else None
                )
            (calibrator_name,) = calibrators
            if self.options.uses_taylorseer and calibrator_name is None:
                raise WanVACECacheError("TaylorSeer was enabled but cache-dit did not attach its calibrator.")
            steps = run.steps * len(windows)
            experts.append(
                ExpertCacheReport(
                    expert=expert_name,
                    steps=steps,
                    cached_steps=tuple(cached_steps),
                    cfg_steps=steps if run.cfg else 0,
                    cfg_cached_steps=tuple(cfg_cached_steps) if run.cfg else (),
                    calibrator=calibrator_name,
                    windows=len(windows),
                )
            )
        return CacheReport(mode=self.options.mode, experts=tuple(experts))
