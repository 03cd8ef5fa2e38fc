"""Running the experts across devices and machines: options, worker ranks, the ComfyUI-side launcher."""

from .messages import WanVACEWorkerError
from .options import DEFAULT_ENDPOINT, LAUNCHERS, SHARD_MODES, ParallelLayout, ParallelOptions

__all__ = ["DEFAULT_ENDPOINT", "LAUNCHERS", "SHARD_MODES", "ParallelLayout", "ParallelOptions", "WanVACEWorkerError"]
