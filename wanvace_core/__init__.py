"""ComfyUI-free core of ComfyUI-WanVACE: loading, VACE conditioning, dual-expert sampling, decoding.

Its packages import one way only, each from the ones after it: `generation` (conditioning, sampling,
decoding) → `runtime` (the ordered runtime plan and what it applies) → `parallel` (worker launch, relay,
Ulysses, FSDP) → `load` (files, layouts, quantised weights, tokenizers) → `errors` / `validation`. Above them
sit this module's names (the API the nodes use) and `worker` (a parallel worker's process).
`tests/test_core_imports.py` refuses any import against that order, any cycle, and any ComfyUI import.
"""

from .errors import WanVACEError, WanVACEInputError, WanVACEModelFolderError
from .generation.conditioning import (
    VACEConditioning,
    VACEInputs,
    prepare_conditioning,
    validate_generation_size,
    validate_prompt,
    validate_vace_inputs,
)
from .generation.decoding import decode, to_vae_space
from .generation.sampling import SampleResult, SamplerSettings, sample
from .generation.schedules import SCHEDULERS
from .generation.tiling import VAETiling
from .generation.windows import FUSE_METHODS, SCHEDULES, ContextWindowOptions
from .load.folder_layout import find_pipeline_folders, inspect_pipeline_folder
from .load.pipeline_folder import DTYPES
from .load.single_file import WEIGHT_DTYPES, ExpertFiles, inspect_expert_files
from .runtime.attention import ATTENTION_BACKENDS, DEFAULT_ATTENTION, resolve_attention
from .runtime.caching import CACHE_MODES, CacheOptions, CacheReport, ExpertCacheLimits, WanVACECacheError
from .runtime.loaders import load_expert_files, load_pipeline
from .runtime.lora import LoraPatch, check_lora
from .runtime.model import WanVACEModel
from .runtime.offload import OFFLOAD_MODES, DeviceMemoryBroker, OffloadOptions, Residency
from .runtime.plan import RuntimePlan, build_model, replan

__all__ = [
    "ATTENTION_BACKENDS",
    "CACHE_MODES",
    "DEFAULT_ATTENTION",
    "DTYPES",
    "FUSE_METHODS",
    "OFFLOAD_MODES",
    "SCHEDULERS",
    "SCHEDULES",
    "WEIGHT_DTYPES",
    "CacheOptions",
    "CacheReport",
    "ContextWindowOptions",
    "DeviceMemoryBroker",
    "ExpertCacheLimits",
    "ExpertFiles",
    "LoraPatch",
    "OffloadOptions",
    "Residency",
    "RuntimePlan",
    "SampleResult",
    "SamplerSettings",
    "VACEConditioning",
    "VACEInputs",
    "VAETiling",
    "WanVACECacheError",
    "WanVACEError",
    "WanVACEInputError",
    "WanVACEModel",
    "WanVACEModelFolderError",
    "build_model",
    "check_lora",
    "decode",
    "find_pipeline_folders",
    "inspect_expert_files",
    "inspect_pipeline_folder",
    "load_expert_files",
    "load_pipeline",
    "prepare_conditioning",
    "replan",
    "resolve_attention",
    "sample",
    "to_vae_space",
    "validate_generation_size",
    "validate_prompt",
    "validate_vace_inputs",
]
