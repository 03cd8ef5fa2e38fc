#!/usr/bin/env bash
# Dry run of bench/gpu_check.sh on a machine WITHOUT a GPU, the way the offline H200 machine runs it. Not part of
# CI or scripts/test.sh: the first run downloads torch 2.11 and its CUDA libraries from PyPI (a ~5 GB venv), and
# the CPU part takes minutes on a small shared machine.
#   bash bench/gpu_dry_run.sh            # reuses the venv when it was built from the same package list
#   bash bench/gpu_dry_run.sh --fresh    # builds the venv again from nothing
# 1. A Python 3.12 venv ($GPU_DRY_VENV, default /tmp/gpu-dry-venv312) holding the H200 machine's versions
#    (the device library's KINDS.md: torch 2.11.0, transformers 5.17.0, huggingface_hub 1.33.0, numpy 2.5.2,
#    triton 3.6.0, accelerate 1.15.0, safetensors 0.8.0, ...) and only packages bench/h200_packages.txt names, so
#    everything else must come from the wheel folder, as there. bench/gpu_wheels.sh makes that folder if missing.
# 2. gpu_check.sh, unchanged, with that venv's python3 first on PATH, in a new network namespace (unshare -n, as
#    root) that has only a loopback interface (torchrun's rendezvous needs it): checked before it runs, by the
#    interface list and by a pip download that must fail. It must end with "no CUDA device" and exit 0.
# 3. The venv's packages are the same after the run (gpu_check.sh installs into a temporary folder only).
# The CPU part runs many times slower on a loaded 2-core machine than on a GPU host, so the dry run gives it
# larger limits (WANVACE_GPU_CPU_LIMIT_S, WANVACE_GPU_BUDGET_S below); the steps and commands are the same.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
VENV="${GPU_DRY_VENV:-/tmp/gpu-dry-venv312}"
OUT_DRY="${GPU_DRY_OUT:-/tmp/gpu-dry-out}"
LOG=/tmp/gpu-dry-run.log
# The machine's versions where KINDS.md records them; the other names are on it at versions not recorded. The
# packages the GPU check takes from the machine (bench/gpu_wheels.lock.json's taken_from_machine, and what the
# library, the tests and ComfyUI's row import: tests/test_gpu_imports.py) are named, pip adds their requirements.
BASE=(torch==2.11.0 triton==3.6.0 numpy==2.5.2 "transformers==5.17.0" huggingface_hub==1.33.0 tokenizers==0.23.2
    accelerate==1.15.0 safetensors==0.8.0 sentencepiece==0.2.2 einops pillow psutil tqdm pyyaml requests regex
    filelock packaging protobuf zipp pytest pytest-timeout)
STAMP="$VENV/.gpu-dry-run-stamp"

die() { echo "[gpu_dry_run] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "unshare -n needs root"
PY312="${GPU_DRY_PYTHON:-}"
if [ -z "$PY312" ]; then
    for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            PY312="$candidate"
            break
        fi
    done
fi
[ -n "$PY312" ] || die "a Python 3.12 is needed for the venv (the H200 machine's); set GPU_DRY_PYTHON"
start=$SECONDS
if [ "${1:-}" = "--fresh" ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$PY312 ${BASE[*]}" ]; then
    echo "[gpu_dry_run] building $VENV with $("$PY312" --version) from nothing: ${BASE[*]}"
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV" || die "$PY312 -m venv $VENV failed"
    "$VENV/bin/python" -m pip install --quiet --progress-bar off --upgrade pip || die "pip could not upgrade pip"
    "$VENV/bin/python" -m pip install --quiet --progress-bar off "${BASE[@]}" \
        || die "pip could not install ${BASE[*]} into $VENV"
    echo "$PY312 ${BASE[*]}" >"$STAMP"
    echo "[gpu_dry_run] venv built in $((SECONDS - start)) s"
fi
# Only what the H200 machine has, where it matters: a distribution it lacks that the GPU check imports would let an
# import pass here that fails there. (pip may add others the check never imports: newer typer needs pydantic.)
"$VENV/bin/python" - <<'PYTHON' || die "the venv differs from the H200 machine where the GPU check imports (above)"
import importlib.metadata
import sys

sys.path.insert(0, "bench")
import gpu_imports

machine = gpu_imports.machine_packages()
imported = {item.top for item in gpu_imports.third_party(gpu_imports.all_imports())}
provides = {}
for top, dists in importlib.metadata.packages_distributions().items():
    for dist in dists:
        provides.setdefault(gpu_imports.canonical(dist), set()).add(top)
venv_only = {"pip", "setuptools", "wheel"}
extra, other_version, harmful = [], [], []
for dist in importlib.metadata.distributions():
    name = gpu_imports.canonical(dist.metadata["Name"])
    if name in venv_only:
        continue
    if name not in machine:
        extra.append(f"{name} {dist.version}")
        if provides.get(name, set()) & imported:
            harmful.append(name)
    elif machine[name] and machine[name] != dist.version:
        other_version.append(f"{name} {dist.version} (the machine: {machine[name]})")
if extra:
    print("[gpu_dry_run] not in bench/h200_packages.txt, never imported by the GPU check: " + ", ".join(sorted(extra)))
if other_version:
    print("[gpu_dry_run] versions other than the H200 machine's: " + ", ".join(other_version))
if harmful:
    print("[gpu_dry_run] not on the H200 machine but imported by the GPU check: " + ", ".join(harmful))
sys.exit(1 if other_version or harmful else 0)
PYTHON
echo "[gpu_dry_run] the venv holds the H200 machine's recorded versions and nothing the GPU check imports that it lacks"
if ! compgen -G "$ROOT/.gpu-wheels/*.whl" >/dev/null; then
    bash bench/gpu_wheels.sh || die "bench/gpu_wheels.sh failed"
fi
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
    echo "[gpu_dry_run] pip cannot reach PyPI from here: the network is cut; python3 is $(python3 --version)"
    bash bench/gpu_check.sh
' 2>&1 | tee "$LOG"
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
echo "[gpu_dry_run] the venv's packages are unchanged; the log is $LOG, \$OUT's files are:" \
    "$(find "$OUT_DRY" -type f -printf '%f ' 2>/dev/null)"
grep -q "no CUDA device: every import" "$LOG" || die "gpu_check.sh did not reach 'no CUDA device'"
[ "$rc" -eq 0 ] || die "gpu_check.sh exited $rc"
echo "[gpu_dry_run] OK: every import and each bench's CPU part passed offline, then 'no CUDA device', exit 0"
