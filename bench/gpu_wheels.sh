#!/usr/bin/env bash
# Run on a machine WITH network (PyPI): downloads into .gpu-wheels/ (ignored by git) what bench/gpu_check.sh
# installs offline on the GPU machine, whose python3 (CPython 3.12, x86_64; bench/h200_packages.txt) reaches no
# network, and copies ComfyUI's `comfy` package (its .py files) beside them for the fast path's ComfyUI row.
#   bash bench/gpu_wheels.sh                    # the wheels bench/gpu_wheels.lock.json names (about 20 s)
#   bash bench/gpu_wheels.sh --lock             # resolve again, rewrite the lock (commit it), then download
#   bash bench/gpu_wheels.sh --lock FREEZE.txt  # the same for a machine whose `python3 -m pip freeze` is FREEZE.txt
# The lock comes from requirements.txt (pinned by scripts/sets/current.txt), pytest and pytest-timeout,
# SageAttention 1.0.6 and the comfy-kitchen / comfy-aimdo versions the ComfyUI tree's requirements.txt pins, then
# every Requires-Dist of each wheel, leaving out what the machine already has at a fitting version. One version of
# each; a pure-Python wheel wherever the release has one (comfy-kitchen's is 0.2 MB, its CUDA build 58 MB), else a
# cp312 manylinux (glibc <= 2.28) x86_64 one. .gpu-wheels/MANIFEST.txt says what each wheel is there for.
# Then hand the repository with .gpu-wheels/ to the GPU machine (the device tool: `carry` .gpu-wheels) and run
# `bash bench/gpu_check.sh` there. Fails if the wheels and ComfyUI's files would not fit the 64 MiB the device
# tool carries with the repository.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${PYTHON:-python3}"
DEST="$ROOT/.gpu-wheels"
LIMIT_MIB=64

if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "[gpu_wheels] ERROR: $PY has no pip; set PYTHON to a Python 3.10+ with pip" >&2
    exit 1
fi
args=()
if [ "${1:-}" = "--lock" ]; then
    args=(--lock)
    if [ -n "${2:-}" ]; then
        [ -f "$2" ] || { echo "[gpu_wheels] ERROR: $2 is not a file (expected the GPU machine's pip freeze)" >&2; exit 1; }
        args+=(--has "$2")
    fi
elif [ "$#" -gt 0 ]; then
    echo "[gpu_wheels] ERROR: unknown arguments $*; see the head of $0" >&2
    exit 1
fi
start=$SECONDS
"$PY" bench/gpu_check.py wheels "$DEST" "${args[@]}" || {
    echo "[gpu_wheels] FAILED after $((SECONDS - start)) s; .gpu-wheels/ is left as it was" >&2
    exit 1
}
# ComfyUI's `comfy` package (its Python files) from the current set's tree, for the fast-path bench's ComfyUI row.
COMFY_TREE="${WANVACE_COMFY_DIR:-$ROOT/.cache/comfyui-current}"
if [ -d "$COMFY_TREE/comfy" ]; then
    mkdir -p "$DEST/comfyui" && (cd "$COMFY_TREE" && find comfy -name '*.py' -print0 \
        | xargs -0 cp --parents -t "$DEST/comfyui") && cp "$COMFY_TREE/comfyui_version.py" "$DEST/comfyui/" \
        || { echo "[gpu_wheels] ERROR: copying $COMFY_TREE/comfy failed" >&2; exit 1; }
    echo "[gpu_wheels] ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$COMFY_TREE/comfyui_version.py")'s comfy" \
        "package from $COMFY_TREE: $(du -sh "$DEST/comfyui" | cut -f1) in $DEST/comfyui"
else
    echo "[gpu_wheels] ERROR: no ComfyUI tree at $COMFY_TREE (set WANVACE_COMFY_DIR): the fast path's ComfyUI row" \
        "would have nothing to import" >&2
    exit 1
fi
# What travels: tracked and untracked-not-ignored files, plus the carried .gpu-wheels/.
repo_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
wheels_kib=$(du -sk "$DEST" | cut -f1)
total_mib=$(((repo_kib + wheels_kib) / 1024))
echo "[gpu_wheels] done in $((SECONDS - start)) s: .gpu-wheels/ $((wheels_kib / 1024)) MiB + the repository" \
    "$((repo_kib / 1024)) MiB = ${total_mib} MiB of the ${LIMIT_MIB} MiB the device tool carries"
if [ "$total_mib" -ge "$LIMIT_MIB" ]; then
    echo "[gpu_wheels] ERROR: over the ${LIMIT_MIB} MiB limit" >&2
    exit 1
fi
echo "[gpu_wheels] next, on the GPU machine: bash bench/gpu_check.sh"
