"""WanVACECacheOptions: Cache-DiT settings for WanVACESampler's optional `cache` input."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core import CACHE_MODES, CacheOptions, ExpertCacheLimits
from ..wanvace_core.validation import nan_refusing_min
from .refusals import Refusal
from .types import CATEGORY, WanVACECacheType


class WanVACECacheOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVACECacheOptions",
            display_name="WanVACE Cache Options (Cache-DiT)",
            category=CATEGORY,
            description=(
                "Step caching for both experts with cache-dit's DBCache: on a step whose first blocks barely change, "
                "the middle blocks are skipped and their residual reused (VACE blocks always run). "
                "DBCache+TaylorSeer extrapolates the skipped residual instead of repeating it. Connect to "
                "WanVACESampler's cache input; the sampler reports how many steps each expert cached."
            ),
            inputs=[
                io.Combo.Input(
                    "mode",
                    options=list(CACHE_MODES),
                    default="DBCache",
                    tooltip="DBCache reuses the last residual; DBCache+TaylorSeer predicts it from the last steps "
                    "(usually closer to the uncached result at the same speed).",
                ),
                io.Int.Input(
                    "Fn_compute_blocks",
                    default=1,
                    min=1,
                    max=64,
                    tooltip="Leading blocks always computed; their residual decides whether a step is cached. "
                    "1-4 is typical; more is slower and more faithful.",
                ),
                io.Int.Input(
                    "Bn_compute_blocks",
                    default=0,
                    min=0,
                    max=64,
                    tooltip="Trailing blocks always computed. Must stay after the last VACE layer (at most 4 for "
                    "Wan2.2-VACE-Fun-A14B, whose last VACE layer is 35 of 40).",
                ),
                io.Float.Input(
                    "residual_diff_threshold",
                    default=0.08,
                    min=nan_refusing_min(0.001),
                    max=1.0,
                    step=0.001,
                    tooltip="Relative change of the first blocks' residual below which a step is cached. "
                    "0.04-0.12 is typical; higher is faster and less faithful.",
                ),
                io.Int.Input(
                    "max_warmup_steps",
                    default=2,
                    min=0,
                    max=200,
                    tooltip="High-noise expert: steps always computed before caching may start. It gets only the "
                    "first ~1/3 of the steps (about 7 of 20), so keep this small (1-3).",
                ),
                io.Int.Input(
                    "max_cached_steps",
                    display_name="max_cached_steps (-1 = no limit)",
                    default=-1,
                    min=-1,
                    max=200,
                    tooltip="High-noise expert: most steps it may cache; -1 = no limit.",
                ),
                io.Int.Input(
                    "low_noise_max_warmup_steps",
                    default=2,
                    min=0,
                    max=200,
                    tooltip="Low-noise expert: steps always computed before caching may start (2-6 is typical).",
                ),
                io.Int.Input(
                    "low_noise_max_cached_steps",
                    display_name="low_noise_max_cached_steps (-1 = no limit)",
                    default=-1,
                    min=-1,
                    max=200,
                    tooltip="Low-noise expert: most steps it may cache; -1 = no limit.",
                ),
                io.Int.Input(
                    "taylorseer_order",
                    default=1,
                    min=1,
                    max=4,
                    tooltip="Taylor expansion order of the TaylorSeer calibrator (DBCache+TaylorSeer only); 1 or 2.",
                ),
            ],
            outputs=[WanVACECacheType.Output(display_name="cache", tooltip="Cache settings for WanVACE Sampler.")],
        )

    @classmethod
    def validate_inputs(cls, mode: str | None = None) -> bool | str:
        # The combo alone; the numbers keep ComfyUI's range check.
        with Refusal() as refusal:
            if mode is not None:
                CacheOptions(mode=mode)
        return refusal.message or True

    @staticmethod
    def options_from(
        mode: str = "DBCache",
        Fn_compute_blocks: int = 1,
        Bn_compute_blocks: int = 0,
        residual_diff_threshold: float = 0.08,
        max_warmup_steps: int = 2,
        max_cached_steps: int = -1,
        low_noise_max_warmup_steps: int = 2,
        low_noise_max_cached_steps: int = -1,
        taylorseer_order: int = 1,
    ) -> CacheOptions:
        return CacheOptions(
            mode=mode,
            Fn_compute_blocks=Fn_compute_blocks,
            Bn_compute_blocks=Bn_compute_blocks,
            residual_diff_threshold=residual_diff_threshold,
            high_noise=ExpertCacheLimits(max_warmup_steps, max_cached_steps),
            low_noise=ExpertCacheLimits(low_noise_max_warmup_steps, low_noise_max_cached_steps),
            taylorseer_order=taylorseer_order,
        )

    @classmethod
    def execute(cls, **values) -> io.NodeOutput:
        return io.NodeOutput(cls.options_from(**values))
