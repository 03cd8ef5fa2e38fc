#!/usr/bin/env bash
# Run on a machine WITH network (PyPI): downloads into .gpu-wheels/ (ignored by git, under 64 MiB) the wheels
# that bench/gpu_check.sh installs offline on a GPU machine whose python3 (CPython 3.12, x86_64) reaches no
# network. Then copy the repository, .gpu-wheels/ included, to that machine and run `bash bench/gpu_check.sh`.
#   bash bench/gpu_wheels.sh                # the GPU machine has torch 2.11, transformers 5.17, accelerate, ...
#   bash bench/gpu_wheels.sh FREEZE.txt     # FREEZE.txt: `python3 -m pip freeze` run on the GPU machine
# Which wheels: requirements.txt (pinned by scripts/sets/current.txt: diffusers 0.42.1, cache-dit 1.5.3,
# gguf 0.19.0) and pytest + pytest-timeout, then every Requires-Dist of each downloaded wheel (its METADATA,
# markers read for CPython 3.12 on Linux x86_64), skipping what the GPU machine already has at a version
# that satisfies it. "Has" is FREEZE.txt, or else what pip resolves the issue's machine (torch==2.11.0,
# transformers==5.17.*, accelerate, safetensors, einops, sentencepiece, peft, numpy, pillow, imageio) to need
# (metadata only, about a minute). One version of each package; a pure-Python wheel wherever the release has
# one (so the same folder also installs under another Python: bench/gpu_dry_run.sh), else a cp312
# manylinux (glibc <= 2.28) x86_64 one. .gpu-wheels/MANIFEST.txt says what each wheel is there for.
# Fails if the folder is 64 MiB or more (the device tool carries 64 MiB, the repository included).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
DEST="$ROOT/.gpu-wheels"

if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "[gpu_wheels] ERROR: $PY has no pip; set PYTHON to a Python 3.10+ with pip" >&2
    exit 1
fi
has=()
if [ "$#" -gt 0 ]; then
    [ -f "$1" ] || { echo "[gpu_wheels] ERROR: $1 is not a file (expected the GPU machine's pip freeze)" >&2; exit 1; }
    has=(--has "$1")
fi
start=$SECONDS
"$PY" bench/gpu_check.py wheels "$DEST" "${has[@]}" || {
    echo "[gpu_wheels] FAILED after $((SECONDS - start)) s; .gpu-wheels/ is left as it was" >&2
    exit 1
}
# ComfyUI's `comfy` package (its Python files) from the current set's tree, for the fast-path bench's ComfyUI row.
COMFY_TREE="${WANVACE_COMFY_DIR:-$ROOT/.cache/comfyui-current}"
if [ -d "$COMFY_TREE/comfy" ]; then
    mkdir -p "$DEST/comfyui" && (cd "$COMFY_TREE" && find comfy -name '*.py' -print0 \
        | xargs -0 cp --parents -t "$DEST/comfyui") \
        || { echo "[gpu_wheels] ERROR: copying $COMFY_TREE/comfy failed" >&2; exit 1; }
    echo "[gpu_wheels] ComfyUI's comfy package from $COMFY_TREE: $(du -sh "$DEST/comfyui" | cut -f1) in $DEST/comfyui"
else
    echo "[gpu_wheels] no ComfyUI tree at $COMFY_TREE (set WANVACE_COMFY_DIR): the fast-path bench will leave ComfyUI out"
fi
echo "[gpu_wheels] done in $((SECONDS - start)) s: copy the repository with .gpu-wheels/ to the GPU machine" \
    "and run: bash bench/gpu_check.sh"
