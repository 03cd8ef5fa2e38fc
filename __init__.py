"""ComfyUI-WanVACE: Wan2.2-VACE-Fun-A14B (and Wan2.1-VACE) video creation and editing nodes."""


async def comfy_entrypoint():
    from .nodes import WanVACEExtension

    return WanVACEExtension()
