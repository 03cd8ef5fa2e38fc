"""ComfyUI nodes of ComfyUI-WanVACE: thin V3 wrappers over wanvace_core."""

from comfy_api.v0_0_2 import ComfyExtension, io

from .cache import WanVACECacheOptions
from .conditioning import WanVACEConditioning
from .decode import WanVACEDecode
from .examples import install_example_inputs, install_template_order
from .folder_loader import WanVACEModelLoader
from .frames import WanVACEControlVideo, WanVACEFirstLastFrame, WanVACEOutpaintCanvas
from .guidance import WanVACEGuidanceOptions
from .lora import WanVACELoraLoader
from .offload import WanVACEOffloadOptions
from .parallel import WanVACEParallelOptions
from .queued_prompt import install as install_queue_checks
from .sampler import WanVACESampler
from .scheduler import WanVACEScheduler
from .single_files_loader import WanVACEExpertsLoader
from .windows import WanVACEContextWindows


class WanVACEExtension(ComfyExtension):
    async def on_load(self) -> None:
        # The shipped workflows name example inputs; ComfyUI's loaders list the input folder.
        install_example_inputs()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        # ComfyUI 0.3.75 never calls on_load; the copy runs once either way.
        install_example_inputs()
        install_template_order()
        install_queue_checks()
        return [
            WanVACEModelLoader,
            WanVACEExpertsLoader,
            WanVACELoraLoader,
            WanVACEConditioning,
            WanVACEControlVideo,
            WanVACEFirstLastFrame,
            WanVACEOutpaintCanvas,
            WanVACESampler,
            WanVACEScheduler,
            WanVACEGuidanceOptions,
            WanVACEDecode,
            WanVACECacheOptions,
            WanVACEContextWindows,
            WanVACEOffloadOptions,
            WanVACEParallelOptions,
        ]
