"""Custom ComfyUI socket types of this package."""

from comfy_api.v0_0_2 import io

WanVACEModelType = io.Custom("WANVACE_MODEL")
WanVACEConditioningType = io.Custom("WANVACE_COND")
WanVACECacheType = io.Custom("WANVACE_CACHE")
WanVACEContextWindowsType = io.Custom("WANVACE_CONTEXT_WINDOWS")
WanVACEOffloadType = io.Custom("WANVACE_OFFLOAD")
WanVACEParallelType = io.Custom("WANVACE_PARALLEL")
WanVACEGuidanceType = io.Custom("WANVACE_GUIDANCE")

CATEGORY = "WanVACE"
