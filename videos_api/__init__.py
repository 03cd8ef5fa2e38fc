"""vLLM-Omni's videos API served from ComfyUI's own server, each job a prompt in ComfyUI's queue."""

from .routes import install_videos_api

__all__ = ["install_videos_api"]
