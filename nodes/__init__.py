"""ComfyUI nodes of ComfyUI-WanVACE: thin V3 wrappers over wanvace_core."""

from comfy_api.latest import ComfyExtension, io

from .cache import WanVACECacheOptions
from .conditioning import WanVACEConditioning
from .decode import WanVACEDecode
from .loader import WanVACEModelLoader
from .offload import WanVACEOffloadOptions
from .sampler import WanVACESampler


class WanVACEExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [
            WanVACEModelLoader,
            WanVACEConditioning,
            WanVACESampler,
            WanVACEDecode,
            WanVACECacheOptions,
            WanVACEOffloadOptions,
        ]
