"""ComfyUI-WanVACE: Wan2.2-VACE-Fun-A14B (and Wan2.1-VACE) video creation and editing nodes, and vLLM-Omni's videos
API on ComfyUI's own server."""


async def comfy_entrypoint():
    from .nodes import WanVACEExtension
    from .videos_api import install_videos_api

    # The videos API's routes must be on the server before it starts listening, which is after the packs load.
    install_videos_api()
    return WanVACEExtension()
