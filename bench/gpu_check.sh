#!/usr/bin/env bash
# Every GPU check in one go, within 8 minutes on one H200 (the device tool lends 15 minutes, its machine's start
# included), on a machine that reaches no network and whose python3 has torch 2.11 and the packages of
# bench/h200_packages.txt. First, on a networked machine, `bash bench/gpu_wheels.sh` puts what it lacks (diffusers,
# cache-dit, gguf, ftfy, SageAttention 1.0.6, comfy-kitchen, ...: bench/gpu_wheels.lock.json) and ComfyUI's comfy
# package in .gpu-wheels/; bring the repository with that folder to the GPU machine, then there:
#   bash bench/gpu_check.sh                 # artefacts in $OUT (default /tmp/wanvace-gpu-check-out)
#   WANVACE_GPU_BUDGET_S=200 WANVACE_GPU_STEPS=fast720,vae,parallel bash bench/gpu_check.sh  # a short rerun
# It installs .gpu-wheels/ offline into a temporary folder on PYTHONPATH (python3's own packages are left alone),
# imports every module the GPU steps import (lazy imports included; ComfyUI's from .gpu-wheels/comfyui), and looks
# for CUDA. Without it: each bench's CPU part (tiny configs: the logic), then "no CUDA device" and exit 0 if all
# passed (bench/gpu_dry_run.sh runs it so). With CUDA, most valuable first (the estimates are from the rates
# measured on such a machine, KINDS.md: bf16 GEMM 769-798 TFLOP/s, device copy ~4.3 TB/s; a CFG step of the
# 48-block A14B expert at 480p is ~4 PFLOP, ~7 s): the machine probe, the gpu-marked tests (each under its own
# timeout), the fast path at 480p, offload none/layerwise, single-file bf16/fp8; then, only with budget left,
# 720p, VAE tiling and parallel. A failed import or step marks the run failed and the rest still runs; nothing runs
# past the budget. After every step $OUT holds gpu_check_table.txt and gpu_check.json (every bench's rows), and
# at the end gpu_check.log, junit.xml and pip_freeze.txt: 5 files (the device tool returns 8 at most).
#   WANVACE_GPU_PYTHON (python3)  WANVACE_GPU_WHEELS (.gpu-wheels)  WANVACE_GPU_BUDGET_S (480: the whole run)
#   WANVACE_GPU_CPU_LIMIT_S (60: each CPU-part step; a slow shared CPU needs more)  WANVACE_GPU_STEPS (all)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${WANVACE_GPU_PYTHON:-python3}"
WHEELS="${WANVACE_GPU_WHEELS:-$ROOT/.gpu-wheels}"
# 8 minutes: with the machine's start (a minute or two) that leaves 5 of the 15 for one short rerun.
BUDGET_S="${WANVACE_GPU_BUDGET_S:-480}"
CPU_LIMIT_S="${WANVACE_GPU_CPU_LIMIT_S:-60}"
STEPS=",${WANVACE_GPU_STEPS:-},"
OUT_DIR="${OUT:-${TMPDIR:-/tmp}/wanvace-gpu-check-out}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/wanvace-gpu-check.XXXXXX")"
SITE="$WORK/site"
trap 'rm -rf "$WORK"' EXIT # the work folder only: every artefact is in $OUT_DIR already

status=0

summary() { # the table so far into $OUT_DIR (printed with --print)
    local quiet=(--quiet)
    [ "${1:-}" = "--print" ] && quiet=()
    "$PY" bench/gpu_check.py table "$WORK" --out "$OUT_DIR" "${quiet[@]}" \
        || echo "[gpu_check] ERROR: the summary table could not be made (see the steps above)"
}

# step KEY KIND NAME LIMIT_S ESTIMATE_S JSON_NAME|- COMMAND...: runs COMMAND under `timeout`, never past the
# budget, then kills whatever it left running (torchrun's ranks live in their own sessions) and writes the table.
# KIND: setup (always), cpu, tests, gpu (must run), extra (only with budget left) or args (no CUDA: the GPU
# steps' command lines). KEY: for WANVACE_GPU_STEPS.
step() {
    local key="$1" kind="$2" name="$3" limit="$4" estimate="$5" json="$6"
    shift 6
    local left=$((BUDGET_S - SECONDS)) state
    if [ "$kind" != setup ] && [ "$STEPS" != ",," ] && [[ $STEPS != *",$key,"* ]]; then
        return 0 # not chosen for this run (the set-up always runs): not shown
    fi
    if [ "$kind" = extra ] && [ "$left" -lt "$((estimate + 10))" ]; then
        echo "===== $name: skipped: ${left} s of the ${BUDGET_S} s budget left, it needs ~${estimate} s ====="
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$kind" "skipped (budget)" 0 "$limit" "$json" "$estimate" \
            >>"$WORK/steps.tsv"
        summary
        return 0
    fi
    if [ "$left" -lt 10 ]; then
        echo "===== $name: not run: ${left} s of the ${BUDGET_S} s budget left ====="
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$kind" "not run (budget)" 0 "$limit" "$json" "$estimate" \
            >>"$WORK/steps.tsv"
        summary
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit="$left"
    echo "===== $name (limit $limit s, estimate $estimate s) ====="
    local start=$SECONDS marker="$key.$$.$SECONDS"
    WANVACE_GPU_STEP="$marker" timeout -k 5 "$limit" "$@"
    local rc=$?
    case "$rc" in
        0) state="ok" ;;
        124 | 137) state="TIMEOUT" ;;
        *) state="FAILED (exit $rc)" ;;
    esac
    local left_behind
    left_behind="$("$PY" bench/gpu_check.py leftovers "$marker" --kill | tee /dev/stderr | grep -c 'left behind')"
    if [ "$left_behind" -gt 0 ]; then
        state="$state; $left_behind processes left (killed)"
        [ "$rc" -eq 0 ] && rc=1
    fi
    local seconds=$((SECONDS - start))
    echo "===== $name: $state in $seconds s ====="
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$kind" "$state" "$seconds" "$limit" "$json" "$estimate" \
        >>"$WORK/steps.tsv"
    summary
    [ "$rc" -eq 0 ]
}

cpu_part() { # each bench's logic on tiny configs; the dry run's proof that the GPU steps will start
    local pytest=("$@") threads
    step collect cpu "cpu: collect the gpu-marked tests" "$CPU_LIMIT_S" 5 - \
        "${pytest[@]}" --collect-only -q -m gpu "${gpu_tests[@]}" || status=1
    step probe cpu "cpu: machine probe, tiny" "$CPU_LIMIT_S" 10 cpu_probe.json \
        "$PY" bench/gpu_probe.py --device cpu --tiny --json "$WORK/cpu_probe.json" || status=1
    step single cpu "cpu: single-file formats, tiny" "$CPU_LIMIT_S" 15 cpu_single_file.json \
        "$PY" bench/bench_single_file_gpu.py --device cpu --tiny --steps 3 --json "$WORK/cpu_single_file.json" \
        || status=1
    step offload cpu "cpu: offload none/layerwise, tiny" "$CPU_LIMIT_S" 15 cpu_offload.json \
        "$PY" bench/bench_offload_gpu.py --device cpu --tiny --modes none,layerwise --steps 3 \
        --json "$WORK/cpu_offload.json" || status=1
    step parallel cpu "cpu: parallel (torchrun, gloo), tiny" "$CPU_LIMIT_S" 40 cpu_parallel.json \
        "$PY" bench/bench_parallel_gpu.py --device cpu --tiny --steps 3 --timeout "$CPU_LIMIT_S" \
        --json "$WORK/cpu_parallel.json" || status=1
    # Every row but the compiled ones (the tiny graphs take minutes to build on a CPU), ComfyUI's model included.
    step fast480 cpu "cpu: fast path vs ComfyUI, tiny" "$CPU_LIMIT_S" 40 cpu_fast_path.json \
        "$PY" bench/bench_fast_path_gpu.py --device cpu --tiny --sizes 64x64x5 --steps 3 \
        --rows today,attention_auto,fp8_matmul,fp8_fast_accum,batched_cfg --json "$WORK/cpu_fast_path.json" || status=1
    # 64x64, one frame, 48 px tiles overlapping 16 px: 2x2 tiles, the smallest decode that blends tiles.
    threads="$(nproc)"
    [ "$threads" -le 8 ] || threads=8
    step vae cpu "cpu: VAE tiling, 64x64x1" "$CPU_LIMIT_S" 60 cpu_vae.json \
        "$PY" bench/bench_vae_tiling.py --device cpu --frames 1 --height 64 --width 64 --tile-size 48 --overlap 16 \
        --threads "$threads" --json "$WORK/cpu_vae.json" || status=1
}

gpu_part() { # most valuable first; each estimate is written next to its step
    # `gpu_part args PYTEST...` (no CUDA): every GPU step's command line, which parses its arguments, imports its
    # modules and exits at "no CUDA device" (the tests skip): the dry run's proof that each will start.
    local mode="$1" peak=() gpu=gpu extra=extra label="" limit
    shift
    local pytest=("$@")
    if [ "$mode" = args ]; then
        gpu=args extra=args label="args: "
    fi
    # limit MAX: the step's limit on a GPU, the CPU part's in the argument check.
    limit() { if [ "$mode" = args ]; then echo "$CPU_LIMIT_S"; else echo "$1"; fi; }
    # ~30 s: torch + CUDA start ~10 s; GEMM 8192^3 1.4 ms x 23; copy 4 GiB ~1 ms x 23; one block (~0.7 GB) H2D x 15;
    # attention, 4 backends + sageattn at 32760 tokens (~45 ms a call) and 75600 (~0.25 s) x 4 calls; fp8 at the FFN
    # shapes, ~20 cases of ~8 ms x 12 calls.
    step probe "$gpu" "${label}machine probe (GEMM, copies, attention, fp8)" "$(limit 75)" 30 probe.json \
        "$PY" bench/gpu_probe.py --json "$WORK/probe.json" || status=1
    local tflops
    tflops="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["ceilings"]["gemm_tflops"])' \
        "$WORK/probe.json" 2>/dev/null)" && peak=(--peak-tflops "$tflops")
    [ "$mode" = args ] && peak=(--peak-tflops 780)
    # ~75 s: 7 tests on tiny models (collection imports ~10 s; the two parallel ones start workers, ~20 s each).
    step tests tests "${label}gpu tests (${#gpu_tests[@]} files, -m gpu, 60 s per test)" "$(limit 120)" 75 - \
        "${pytest[@]}" -m gpu -q -rfEs --timeout 60 --junitxml "$OUT_DIR/junit.xml" "${gpu_tests[@]}" || status=1
    # ~150 s: 4 of the 40 A14B blocks + 1 VACE block (~0.2 PFLOP a pass, ~0.9 s a CFG step); 7 rows + ComfyUI, each
    # 1 warm-up + 3 timed steps (~30 s in all), of which the two compiled rows' warm-ups compile ~4 graphs (~100 s).
    step fast480 "$gpu" "${label}fast path 480x832x81, 4 + 1 blocks, vs ComfyUI" "$(limit 200)" 150 fast_path_480.json \
        "$PY" bench/bench_fast_path_gpu.py --sizes 480x832x81 --layers 4 --steps 3 "${peak[@]}" \
        --json "$WORK/fast_path_480.json" || status=1
    # ~90 s: two A14B-sized experts (35 GB of host weights, drawn on the GPU: ~10 s); per mode 1 warm-up + 3 timed
    # CFG steps of ~7 s (none moves 35 GB up first, ~3 s; layerwise streams it per pass, overlapped).
    step offload "$gpu" "${label}offload 480x832x81: none, layerwise" "$(limit 130)" 90 offload_480.json \
        "$PY" bench/bench_offload_gpu.py --height 480 --width 832 --frames 81 --modes none,layerwise --steps 3 \
        --json "$WORK/offload_480.json" || status=1
    # ~80 s: one A14B expert in bf16, then with kept fp8 weights (built on the GPU, ~5 s each), 1 + 3 CFG steps each.
    step single "$gpu" "${label}single-file formats 480x832x81: bf16, fp8" "$(limit 120)" 80 single_file_480.json \
        "$PY" bench/bench_single_file_gpu.py --sizes 480x832x81 --formats bf16,fp8 --steps 3 \
        --json "$WORK/single_file_480.json" || status=1
    # Only with budget left (a rerun: WANVACE_GPU_STEPS=fast720,vae,parallel).
    # ~110 s: a 720p CFG step of the 5 blocks ~4 s (attention 5x, the rest 2.3x 480p's); today, attention auto and
    # all (its warm-up compiles 2 graphs, ~50 s), and ComfyUI; a fresh process, so every graph is traced once.
    step fast720 "$extra" "${label}fast path 720x1280x81, 4 + 1 blocks, vs ComfyUI" "$(limit 150)" 110 \
        fast_path_720.json "$PY" bench/bench_fast_path_gpu.py --sizes 720x1280x81 --layers 4 --steps 3 \
        --rows today,attention_auto,all "${peak[@]}" --json "$WORK/fast_path_720.json" || status=1
    # ~40 s: untiled vs tiled decode of 33 frames at 720p, bf16 (the decoder's peak hardly grows with length).
    step vae "$extra" "${label}VAE tiling 720x1280x33" "$(limit 60)" 40 vae_720.json \
        "$PY" bench/bench_vae_tiling.py --device cuda --frames 33 --height 720 --width 1280 --tile-size 256 \
        --overlap 64 --json "$WORK/vae_720.json" || status=1
    # ~60 s: 1 GPU against the sharded path at world 1, 10 of the 40 blocks at 480p, under torchrun (~20 s to start
    # each), 1 + 3 steps of ~1.8 s.
    step parallel "$extra" "${label}parallel 480x832x81, 10 blocks" "$(limit 90)" 60 parallel_480.json \
        "$PY" bench/bench_parallel_gpu.py --height 480 --width 832 --frames 81 --layers 10 --steps 3 --timeout 80 \
        --json "$WORK/parallel_480.json" || status=1
}

main() {
    echo "[gpu_check] $(date -u '+%Y-%m-%d %H:%M:%S UTC'); $PY is $("$PY" --version 2>&1) at $(command -v "$PY");" \
        "budget ${BUDGET_S} s; artefacts in $OUT_DIR"
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        echo "[gpu_check] ERROR: $PY cannot import torch; set WANVACE_GPU_PYTHON to the Python that has torch"
        return 1
    fi
    "$PY" -m pip freeze --all >"$OUT_DIR/pip_freeze.txt" 2>/dev/null || rm -f "$OUT_DIR/pip_freeze.txt"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        local wheels
        mapfile -t wheels < <("$PY" bench/gpu_check.py installable "$WHEELS" || echo FAILED)
        if [ "${#wheels[@]}" -eq 0 ] || [ "${wheels[-1]}" = FAILED ]; then
            echo "[gpu_check] ERROR: $WHEELS does not hold what bench/gpu_wheels.lock.json names (above)"
            status=1
            unset 'wheels[-1]'
        fi
        mkdir -p "$SITE"
        local install=("$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$SITE")
        if ! "$PY" -m pip --version >/dev/null 2>&1; then
            # No pip: a pure-Python wheel is a zip of what goes on sys.path.
            install=("$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]'
                "$SITE")
        fi
        # ~10 s: ten pure-Python wheels, 7 MiB.
        [ "${#wheels[@]}" -gt 0 ] && { step wheels setup "install ${#wheels[@]} wheels offline" 60 10 - \
            "${install[@]}" "${wheels[@]}" || status=1; }
    else
        echo "[gpu_check] no wheels in $WHEELS: using $PY's packages as they are (bench/gpu_wheels.sh makes them)"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" WANVACE_GPU_SITE="$SITE" WANVACE_GPU_WORK="$WORK"
    # Our `tests`, `bench` and `scripts` are namespace packages, which lose to a regular package of that name anywhere
    # on the path (some distributions ship a top-level `tests`): then a package first on the path points the name here.
    local package where
    for package in tests bench scripts; do
        where="$("$PY" -c "import sys, $package; print(*$package.__path__, sep=chr(10))" 2>/dev/null)"
        if ! grep -qx "$ROOT/$package" <<<"$where"; then
            echo "[gpu_check] the machine's $package package (${where//$'\n'/ }) shadows ours: pointing the name at $ROOT/$package"
            mkdir -p "$SITE/$package" && printf '__path__ = [%s]\n' "'$ROOT/$package'" >"$SITE/$package/__init__.py"
        fi
    done
    # ComfyUI's comfy package as bench/gpu_wheels.sh copied it (the fast-path bench's ComfyUI row).
    [ -d "$WHEELS/comfyui/comfy" ] && export WANVACE_COMFY_DIR="${WANVACE_COMFY_DIR:-$WHEELS/comfyui}"
    export PYTHONUNBUFFERED=1
    # Only the plugin we name: python3's own site-packages may register others (the machine has pytest-xdist...).
    export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
    local pytest=("$PY" -m pytest -p pytest_timeout -p no:cacheprovider)
    mapfile -t gpu_tests < <(grep -lE 'pytest\.mark\.gpu' tests/test_*.py | sort)
    # ~20 s: torch, diffusers, transformers, cache-dit and ComfyUI's modules.
    step imports setup "imports (ours, lazy ones too, and ComfyUI's)" 90 20 - "$PY" bench/gpu_check.py imports \
        || status=1

    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        "$PY" -c 'import platform, torch; print(f"no CUDA device (CPU part only); torch {torch.__version__}, \
Python {platform.python_version()}")' >"$WORK/device.txt"
        cpu_part "${pytest[@]}"
        gpu_part args "${pytest[@]}"
        summary --print
        if [ "$status" -ne 0 ]; then
            echo "[gpu_check] FAILED (above); no CUDA device here either"
            return 1
        fi
        echo "[gpu_check] no CUDA device: every import, each bench's CPU part and each GPU step's command line passed;" \
            "nothing measured on a GPU"
        return 0
    fi
    "$PY" -c 'import platform, torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, \
{p.total_memory / 2**30:.0f} GiB x {torch.cuda.device_count()}, torch {torch.__version__} (CUDA {torch.version.cuda}), \
Python {platform.python_version()}")' | tee "$WORK/device.txt"
    gpu_part gpu "${pytest[@]}"
    summary --print
    return "$status"
}

mkdir -p "$OUT_DIR" || { echo "[gpu_check] ERROR: cannot create $OUT_DIR"; exit 1; }
rm -f "$OUT_DIR"/gpu_check_table.txt "$OUT_DIR"/gpu_check.json "$OUT_DIR"/junit.xml
main 2>&1 | tee "$OUT_DIR/gpu_check.log"
rc="${PIPESTATUS[0]}"
echo "[gpu_check] exit $rc after $SECONDS s; $OUT_DIR: $(cd "$OUT_DIR" && echo *)" | tee -a "$OUT_DIR/gpu_check.log"
exit "$rc"
