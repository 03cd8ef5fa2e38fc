#!/usr/bin/env bash
# Dry run of bench/gpu_check.sh on a machine WITHOUT a GPU, the way the offline GPU machine runs it. Not part of
# CI or scripts/test.sh: the first run downloads torch 2.11 and its CUDA libraries from PyPI (a 5 GB venv), and
# the CPU part takes minutes on a small shared machine.
#   bash bench/gpu_dry_run.sh            # reuses the venv when it was built from the same package list
#   bash bench/gpu_dry_run.sh --fresh    # builds the venv again from nothing
# 1. A venv (python3.11 -m venv, $GPU_DRY_VENV, default /tmp/gpu-dry-venv) holding only what the issue's GPU
#    machine has: torch==2.11.0, transformers==5.17.*, accelerate, safetensors, einops, sentencepiece, peft,
#    numpy, pillow, imageio (and what pip installs for them); so every other package has to come from the wheel
#    folder. bench/gpu_wheels.sh makes that folder first if it is missing.
# 2. gpu_check.sh, unchanged, with that venv's python3 first on PATH, in a new network namespace (unshare -n, as
#    root) that has only a loopback interface (torchrun's rendezvous needs it): checked before it runs, by the
#    interface list and by a pip download that must fail. It must end with "no CUDA device" and exit 0.
# 3. The venv's packages are the same after the run (gpu_check.sh installs into a temporary folder only).
# The wheels are CPython 3.12 ones, but all are pure Python, so they install under this Python 3.11 too; a
# binary one would be installed here into the venv for 3.11 before the network is cut, and gpu_check.sh would
# use that one (it leaves out a wheel this Python cannot install when the distribution is already installed).
# The CPU part runs many times slower on a loaded 2-core machine than on a GPU host, so the dry run gives it
# larger limits (WANVACE_GPU_CPU_LIMIT_S, WANVACE_GPU_BUDGET_S below); the steps and commands are the same.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
VENV="${GPU_DRY_VENV:-/tmp/gpu-dry-venv}"
OUT_DRY="${GPU_DRY_OUT:-/tmp/gpu-dry-out}"
BASE=(torch==2.11.0 "transformers==5.17.*" accelerate safetensors einops sentencepiece peft numpy pillow imageio)
STAMP="$VENV/.gpu-dry-run-stamp"

die() { echo "[gpu_dry_run] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "unshare -n needs root"
command -v python3.11 >/dev/null || die "python3.11 is needed for the venv"
start=$SECONDS
if [ "${1:-}" = "--fresh" ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "${BASE[*]}" ]; then
    echo "[gpu_dry_run] building $VENV from nothing: ${BASE[*]}"
    rm -rf "$VENV"
    python3.11 -m venv "$VENV" || die "python3.11 -m venv $VENV failed"
    "$VENV/bin/python" -m pip install --quiet --progress-bar off "${BASE[@]}" \
        || die "pip could not install ${BASE[*]} into $VENV"
    echo "${BASE[*]}" >"$STAMP"
    echo "[gpu_dry_run] venv built in $((SECONDS - start)) s"
fi
if ! compgen -G "$ROOT/.gpu-wheels/*.whl" >/dev/null; then
    bash bench/gpu_wheels.sh || die "bench/gpu_wheels.sh failed"
fi
for wheel in "$ROOT"/.gpu-wheels/*.whl; do
    case "$wheel" in
        *-none-any.whl) ;;
        *)
            # A cp312 binary cannot install under 3.11: bring the same release for this Python into the venv.
            base="$(basename "$wheel")"
            name="${base%%-*}" version="${base#*-}"
            version="${version%%-*}"
            echo "[gpu_dry_run] $base is binary: installing $name==$version for Python 3.11 into the venv"
            "$VENV/bin/python" -m pip install --quiet --no-deps "$name==$version" || die "could not install $name"
            ;;
    esac
done
"$VENV/bin/python" -m pip freeze --all >"$VENV/freeze-before.txt"

rm -rf "$OUT_DRY"
dry_start=$SECONDS
# In the namespace: loopback up, then proof that nothing else is reachable, then the check itself.
# shellcheck disable=SC2016 # expanded by the inner bash
unshare -n env PATH="$VENV/bin:$PATH" OUT="$OUT_DRY" WANVACE_GPU_CPU_LIMIT_S="${WANVACE_GPU_CPU_LIMIT_S:-900}" \
    WANVACE_GPU_BUDGET_S="${WANVACE_GPU_BUDGET_S:-3600}" bash -c '
    ip link set lo up || exit 90
    interfaces="$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d " " | tr "\n" " ")"
    echo "[gpu_dry_run] network interfaces in this namespace: $interfaces"
    [ "$interfaces" = "lo " ] || exit 91
    # --isolated: no local index or find-links from pip config, only PyPI itself.
    if python3 -m pip --isolated download --quiet --no-deps --retries 0 --timeout 5 --no-cache-dir \
        --index-url https://pypi.org/simple -d "$(mktemp -d)" ftfy >/dev/null 2>&1; then
        exit 92
    fi
    echo "[gpu_dry_run] pip cannot reach PyPI from here: the network is cut"
    bash bench/gpu_check.sh
' 2>&1 | tee /tmp/gpu-dry-run.log
rc="${PIPESTATUS[0]}"
case "$rc" in
    90) die "could not bring up the loopback interface in the namespace" ;;
    91) die "the namespace has interfaces other than lo: the network is not cut" ;;
    92) die "pip reached PyPI from inside the namespace: the network is not cut" ;;
esac
echo "[gpu_dry_run] gpu_check.sh exited $rc after $((SECONDS - dry_start)) s offline ($((SECONDS - start)) s in all)"
"$VENV/bin/python" -m pip freeze --all >"$VENV/freeze-after.txt"
if ! diff -u "$VENV/freeze-before.txt" "$VENV/freeze-after.txt"; then
    die "the venv's packages changed during the run (above)"
fi
echo "[gpu_dry_run] the venv's packages are unchanged; the log is /tmp/gpu-dry-run.log, \$OUT's files are:" \
    "$(find "$OUT_DRY" -type f -printf '%f ' 2>/dev/null)"
grep -q "no CUDA device: every import" /tmp/gpu-dry-run.log || die "gpu_check.sh did not reach 'no CUDA device'"
[ "$rc" -eq 0 ] || die "gpu_check.sh exited $rc"
echo "[gpu_dry_run] OK: every import and each bench's CPU part passed offline, then 'no CUDA device', exit 0"
