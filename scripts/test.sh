#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite once per tested dependency set (scripts/sets/):
#   oldest  = ComfyUI 0.3.75, torch 2.8, transformers 4.57, diffusers 0.36
#   current = ComfyUI 0.33 or newer ($COMFYUI_DIR, the ComfyUI this clone is installed in, else
#             ../shared/comfyui/), torch 2.11, transformers 5, diffusers 0.42
# Extra arguments go to pytest (test files among them run instead of all of tests/). WANVACE_SETS="current" runs one
# set. Exits non-zero if any set fails.
# The current set runs every test; the oldest set runs each test's first variant and no `one_set` test
# (tests/conftest.py says why; WANVACE_FULL=1 runs everything in both).
# Each set runs on WANVACE_TEST_WORKERS pytest-xdist workers (default 2, one file per worker at a time; 0 runs in
# this process): much of the suite waits on one-threaded imports and subprocesses, which leaves a second core idle.
# Ends with each set's time and passed / skipped / failed counts; pytest lists each set's 15 slowest tests.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

read -r -a SETS <<<"${WANVACE_SETS:-oldest current}"
WORKERS="${WANVACE_TEST_WORKERS:-2}"
if ! [[ "$WORKERS" =~ ^[0-9]+$ ]]; then
    echo "WANVACE_TEST_WORKERS=$WORKERS: give a number of pytest-xdist workers (0 runs the tests in one process)" >&2
    exit 2
fi
PARALLEL=()
if [ "$WORKERS" -gt 0 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile); fi

run_start=$SECONDS
bash scripts/setup.sh "${SETS[@]}" || exit 1
setup_s=$((SECONDS - run_start))

# "N passed, M skipped, ..." from pytest's closing line, as "passed N, skipped M, failed K" (zeros included).
counts_of() {
    local line="$1" kind out=""
    for kind in passed skipped failed error; do
        local n
        n="$(grep -oE "[0-9]+ ${kind}" <<<"$line" | grep -oE '^[0-9]+' || true)"
        out+="${out:+, }${n:-0} ${kind}"
    done
    printf '%s' "$out"
}

# The whole of tests/, unless the arguments name test files or folders (tests/test_x.py, tests/test_x.py::test_y).
TARGETS=(tests)
for arg in "$@"; do
    if [ -e "${arg%%::*}" ]; then TARGETS=(); fi
done

status=0
summary=()
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
for set in "${SETS[@]}"; do
    comfy="$ROOT/.cache/comfyui-$set"
    skip_reason=""
    if [ -f "$ROOT/.cache/comfyui-$set.skipped" ]; then
        skip_reason="$(cat "$ROOT/.cache/comfyui-$set.skipped")"
        printf '\n%s\n' "################################################################################"
        printf '# %s set: the ComfyUI server tests are SKIPPED: %s\n' "$set" "$skip_reason"
        printf '# Set COMFYUI_DIR=/path/to/ComfyUI to run them against your ComfyUI tree.\n'
        printf '%s\n\n' "################################################################################"
    fi
    printf '\n===== %s set: %s =====\n' "$set" "$(grep -Ev '^#' "scripts/sets/$set.txt" | tr '\n' ' ')"
    warning=""
    if [ -z "$skip_reason" ]; then
        printf 'ComfyUI %s at %s\n' "$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$comfy/comfyui_version.py" 2>/dev/null)" \
            "$(cd "$comfy" && pwd -P)"
        if [ -f "$ROOT/.cache/comfyui-$set.warning" ]; then
            warning="$(cat "$ROOT/.cache/comfyui-$set.warning")"
            printf 'WARNING: %s\n' "$warning"
        fi
    fi
    start=$SECONDS
    # The venv by its real folder: torch.compile's C++ build on the CPU cannot use a path with a space, and this
    # clone's path may have one (the venvs live outside it).
    venv="$(cd "$ROOT/.venvs/$set" && pwd -P)"
    WANVACE_SET="$set" WANVACE_COMFY_DIR="$comfy" WANVACE_COMFY_SKIPPED="$skip_reason" \
        "$venv/bin/python" -m pytest "${TARGETS[@]}" -p no:cacheprovider -ra --durations=15 "${PARALLEL[@]}" "$@" \
        2>&1 | tee "$logs/$set.log"
    rc=${PIPESTATUS[0]}
    # pytest's closing line: "=== 3 passed, 1 skipped in 9.1s ===", or without the rules under -q.
    closing="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran' "$logs/$set.log" \
        | grep -E ' in [0-9.]+s' | tail -n1)"
    line="$set: $(counts_of "$closing") in $((SECONDS - start)) s (pytest exit $rc)"
    if [ -n "$skip_reason" ]; then
        line+="; the ComfyUI server tests were skipped: $skip_reason"
    fi
    if [ -n "$warning" ]; then
        line+="; WARNING: $warning"
    fi
    summary+=("$line")
    # Exit 5 is "no tests ran": a set that tests nothing has failed too.
    if [ "$rc" -ne 0 ]; then status=1; fi
done

printf '\n===== summary =====\n'
printf 'setup: %s s\n' "$setup_s"
printf '%s\n' "${summary[@]}"
printf 'total: %s s\n' "$((SECONDS - run_start))"
exit "$status"
