#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite once per tested dependency set (scripts/sets/):
#   oldest  = ComfyUI 0.3.75, torch 2.8, transformers 4.57, diffusers 0.36
#   current = ComfyUI 0.33 ($COMFYUI_DIR, else ../shared/comfyui/), torch 2.11, transformers 5, diffusers 0.42
# Extra arguments go to pytest. WANVACE_SETS="current" runs one set. Exits non-zero if any set fails.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

read -r -a SETS <<<"${WANVACE_SETS:-oldest current}"
bash scripts/setup.sh "${SETS[@]}" || exit 1

status=0
summary=()
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
    start=$SECONDS
    WANVACE_SET="$set" WANVACE_COMFY_DIR="$comfy" WANVACE_COMFY_SKIPPED="$skip_reason" \
        "$ROOT/.venvs/$set/bin/python" -m pytest tests -p no:cacheprovider -ra "$@"
    rc=$?
    summary+=("$set: pytest exit $rc in $((SECONDS - start)) s${skip_reason:+ (ComfyUI tests skipped: $skip_reason)}")
    if [ "$rc" -ne 0 ]; then status=1; fi
done

printf '\n===== summary =====\n'
printf '%s\n' "${summary[@]}"
exit "$status"
