"""ComfyUI-free core of ComfyUI-WanVACE: loading, VACE conditioning, dual-expert sampling, decoding."""

from .caching import CACHE_MODES, CacheOptions, CacheReport, ExpertCacheLimits, WanVACECacheError
from .conditioning import (
    VACEConditioning,
    VACEInputs,
    prepare_conditioning,
    validate_generation_size,
    validate_prompt,
    validate_vace_inputs,
)
from .decoding import decode, to_vae_space
from .errors import WanVACEError, WanVACEInputError, WanVACEModelFolderError
from .folder import find_pipeline_folders, inspect_pipeline_folder
from .loading import DTYPES, load_pipeline
from .lora import LoraPatch, check_lora
from .model import WanVACEModel
from .offload import OFFLOAD_MODES, DeviceMemoryBroker, OffloadOptions, Residency
from .runtime import attach_offload
from .sampling import SCHEDULERS, SampleResult, SamplerSettings, sample
from .single_file import WEIGHT_DTYPES, ExpertFiles, inspect_expert_files, load_expert_files
from .tiling import VAETiling

__all__ = [
    "CACHE_MODES",
    "DTYPES",
    "OFFLOAD_MODES",
    "SCHEDULERS",
    "WEIGHT_DTYPES",
    "CacheOptions",
    "CacheReport",
    "DeviceMemoryBroker",
    "ExpertCacheLimits",
    "ExpertFiles",
    "LoraPatch",
    "OffloadOptions",
    "Residency",
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
    "attach_offload",
    "check_lora",
    "decode",
    "find_pipeline_folders",
    "inspect_expert_files",
    "inspect_pipeline_folder",
    "load_expert_files",
    "load_pipeline",
    "prepare_conditioning",
    "sample",
    "to_vae_space",
    "validate_generation_size",
    "validate_prompt",
    "validate_vace_inputs",
]
