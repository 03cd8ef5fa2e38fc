"""WanVACECacheOptions: Cache-DiT settings for WanVACESampler's optional `cache` input."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..wanvace_core import CACHE_MODES, CacheOptions, ExpertCacheLimits
from .inputs import float_input, int_input
from .refusals import Refusal
from .types import CATEGORY, WanVACECacheType

_DEFAULTS = CacheOptions()
STEPS_RANGE = (0, 200)
LIMIT_RANGE = (-1, 200)  # -1: no limit


class WanVACECacheOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        high, low = _DEFAULTS.high_noise, _DEFAULTS.low_noise
        return io.Schema(
            node_id="WanVACECacheOptions",
            display_name="WanVACE Cache Options (Cache-DiT)",
            category=CATEGORY,
            description=(
                "Step caching for both experts with cache-dit's DBCache: on a step whose first blocks barely change, "
                "the middle blocks are skipped and their residual reused. Connect to WanVACESampler's cache input."
            ),
            inputs=[
                io.Combo.Input(
                    "mode",
                    options=list(CACHE_MODES),
                    default=_DEFAULTS.mode,
                    tooltip="DBCache reuses the last residual; DBCache+TaylorSeer predicts it from the last steps.",
                ),
                int_input(
                    "Fn_compute_blocks",
                    _DEFAULTS.Fn_compute_blocks,
                    (1, 64),
                    "Leading blocks always computed, whose change decides whether a step is cached (1-4).",
                ),
                int_input(
                    "Bn_compute_blocks",
                    _DEFAULTS.Bn_compute_blocks,
                    (0, 64),
                    "Trailing blocks always computed, all after the last VACE layer (at most 4 for A14B).",
                ),
                float_input(
                    "residual_diff_threshold",
                    _DEFAULTS.residual_diff_threshold,
                    (0.001, 1.0),
                    0.001,
                    "Change of the first blocks' residual below which a step is cached; higher is faster, less exact.",
                ),
                int_input(
                    "max_warmup_steps",
                    high.max_warmup_steps,
                    STEPS_RANGE,
                    "High-noise expert: steps computed before caching may start (it gets ~1/3 of the steps: 1-3).",
                ),
                int_input(
                    "max_cached_steps",
                    high.max_cached_steps,
                    LIMIT_RANGE,
                    "High-noise expert: most steps it may cache.",
                    display_name="max_cached_steps (-1 = no limit)",
                ),
                int_input(
                    "low_noise_max_warmup_steps",
                    low.max_warmup_steps,
                    STEPS_RANGE,
                    "Low-noise expert: steps computed before caching may start (2-6).",
                ),
                int_input(
                    "low_noise_max_cached_steps",
                    low.max_cached_steps,
                    LIMIT_RANGE,
                    "Low-noise expert: most steps it may cache.",
                    display_name="low_noise_max_cached_steps (-1 = no limit)",
                ),
                int_input(
                    "taylorseer_order",
                    _DEFAULTS.taylorseer_order,
                    (1, 4),
                    "Taylor order of DBCache+TaylorSeer's prediction (1 or 2).",
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
        mode: str = _DEFAULTS.mode,
        Fn_compute_blocks: int = _DEFAULTS.Fn_compute_blocks,
        Bn_compute_blocks: int = _DEFAULTS.Bn_compute_blocks,
        residual_diff_threshold: float = _DEFAULTS.residual_diff_threshold,
        max_warmup_steps: int = _DEFAULTS.high_noise.max_warmup_steps,
        max_cached_steps: int = _DEFAULTS.high_noise.max_cached_steps,
        low_noise_max_warmup_steps: int = _DEFAULTS.low_noise.max_warmup_steps,
        low_noise_max_cached_steps: int = _DEFAULTS.low_noise.max_cached_steps,
        taylorseer_order: int = _DEFAULTS.taylorseer_order,
    ) -> CacheOptions:
        """The node's inputs as `CacheOptions`; its defaults are the node's (the videos API starts from them)."""
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
