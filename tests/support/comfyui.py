"""What only the tests need of the set's ComfyUI beside `scripts/comfy_server.py`: whether this set has a ComfyUI tree
(else the tests that need one skip, naming why), and reading back the videos a prompt wrote."""

from __future__ import annotations

import os
from pathlib import Path

from scripts.comfy_server import DEFAULT_COMFY_DIR

# Why the ComfyUI server tests of this set do not run (no ComfyUI tree found), or "".
COMFY_SKIPPED = os.environ.get("WANVACE_COMFY_SKIPPED", "")


def require_comfyui(marker: str = "main.py") -> Path:
    """This set's ComfyUI tree for a test that needs it: skips the test where the set has none (the skip names
    the reason), fails it where the tree should be but `marker` is missing."""
    import pytest

    if COMFY_SKIPPED:
        pytest.skip(f"SKIPPED: no ComfyUI for this dependency set ({COMFY_SKIPPED}); set COMFYUI_DIR")
    if not (DEFAULT_COMFY_DIR / marker).is_file():
        pytest.fail(f"ComfyUI is not installed at {DEFAULT_COMFY_DIR}; run `bash scripts/setup.sh`", pytrace=False)
    return DEFAULT_COMFY_DIR


def count_video_frames(path: Path) -> int:
    import av

    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))
