#!/usr/bin/env bash
# Every GPU check in one go, within 8 minutes on one H200, set-up included, on a machine that reaches no
# network and whose python3 already has torch, transformers, accelerate, safetensors, einops, sentencepiece,
# peft, numpy, pillow and imageio. First, on a networked machine, `bash bench/gpu_wheels.sh` puts what it
# lacks (diffusers, cache-dit, gguf, ftfy, protobuf, pytest, ... : 16 pure-Python wheels, 8 MiB) in
# .gpu-wheels/; copy the repository with that folder to the GPU machine, then there:
#   bash bench/gpu_check.sh             # OUT=/some/folder bash bench/gpu_check.sh also writes the table there
# It installs .gpu-wheels/ offline into a temporary folder on PYTHONPATH (python3's own packages are left
# alone; no venv, no scripts/setup.sh, no ComfyUI server), imports every module the GPU tests and benches
# import, runs each bench's CPU part (tiny configs, seconds: the logic), and only then looks for CUDA:
# without it, it prints "no CUDA device" and exits 0 (bench/gpu_dry_run.sh runs it so). With CUDA: the
# gpu-marked tests, then the GPU benches, and one table: test counts, and per bench row its time, peak VRAM
# and the ratios measured side by side in this run. Exits non-zero if an import, a CPU part, a test or a
# bench failed, ran past its limit or was left out for lack of time (the table says which). Never run on a
# GPU yet: the sizes below are estimates (see there).
#   WANVACE_GPU_PYTHON (python3)  WANVACE_GPU_WHEELS (.gpu-wheels)  WANVACE_GPU_BUDGET_S (470: the whole run)
#   WANVACE_GPU_CPU_LIMIT_S (60: each CPU-part step; a slow shared CPU needs more)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${WANVACE_GPU_PYTHON:-python3}"
WHEELS="${WANVACE_GPU_WHEELS:-$ROOT/.gpu-wheels}"
# 8 minutes less 10 s for the table and the grace `timeout -k` gives a stopped step.
BUDGET_S="${WANVACE_GPU_BUDGET_S:-470}"
CPU_LIMIT_S="${WANVACE_GPU_CPU_LIMIT_S:-60}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/wanvace-gpu-check.XXXXXX")"
SITE="$WORK/site"
trap 'rm -rf "$WORK"' EXIT
OUT_DIR="${OUT:-}"

status=0
cpu_failed=0

# step KIND NAME LIMIT_S JSON_NAME|- COMMAND...: runs COMMAND under `timeout`, never past the budget; records
# its outcome for the table. KIND: setup, cpu, tests or gpu.
step() {
    local kind="$1" name="$2" limit="$3" json="$4"
    shift 4
    local left=$((BUDGET_S - SECONDS)) state
    if [ "$left" -lt 10 ]; then
        echo "===== $name: not run: ${left} s of the ${BUDGET_S} s budget left ====="
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$kind" "not run (budget)" 0 "$limit" "$json" >>"$WORK/steps.tsv"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit="$left"
    echo "===== $name (limit $limit s) ====="
    local start=$SECONDS
    timeout -k 5 "$limit" "$@"
    local rc=$?
    case "$rc" in
        0) state="ok" ;;
        124 | 137) state="TIMEOUT" ;;
        *) state="FAILED (exit $rc)" ;;
    esac
    local seconds=$((SECONDS - start))
    echo "===== $name: $state in $seconds s ====="
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$kind" "$state" "$seconds" "$limit" "$json" >>"$WORK/steps.tsv"
    [ "$rc" -eq 0 ]
}

summary() {
    "$PY" bench/gpu_check.py table "$WORK" ${OUT_DIR:+--out "$OUT_DIR/gpu_check_table.txt"} \
        || echo "[gpu_check] ERROR: the summary table could not be made (see the steps above)"
}

main() {
    echo "[gpu_check] $(date -u '+%Y-%m-%d %H:%M:%S UTC'); $PY is $("$PY" --version 2>&1) at $(command -v "$PY")"
    if ! "$PY" -c 'import torch' 2>/dev/null; then
        echo "[gpu_check] ERROR: $PY cannot import torch; set WANVACE_GPU_PYTHON to the Python that has torch"
        return 1
    fi
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        local wheels
        mapfile -t wheels < <("$PY" bench/gpu_check.py installable "$WHEELS" || echo FAILED)
        if [ "${#wheels[@]}" -eq 0 ] || [ "${wheels[-1]}" = FAILED ]; then
            echo "[gpu_check] ERROR: $WHEELS holds wheels this Python cannot use (above): bench/gpu_wheels.sh"
            return 1
        fi
        mkdir -p "$SITE"
        local install=("$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$SITE")
        if ! "$PY" -m pip --version >/dev/null 2>&1; then
            # No pip: a pure-Python wheel is a zip of what goes on sys.path.
            install=("$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]'
                "$SITE")
        fi
        step setup "install ${#wheels[@]} wheels from $(basename "$WHEELS")/ offline" 60 - \
            "${install[@]}" "${wheels[@]}" || { summary; return 1; }
    else
        echo "[gpu_check] no wheels in $WHEELS: using $PY's packages as they are (bench/gpu_wheels.sh makes them)"
    fi
    if [ -n "$OUT_DIR" ]; then  # the machine's own packages: `bash bench/gpu_wheels.sh pip_freeze.txt` next time
        "$PY" -m pip freeze --all >"$OUT_DIR/pip_freeze.txt" 2>/dev/null || rm -f "$OUT_DIR/pip_freeze.txt"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" WANVACE_GPU_SITE="$SITE" WANVACE_GPU_WORK="$WORK"
    # ComfyUI's comfy package as bench/gpu_wheels.sh copied it (the fast-path bench's ComfyUI row).
    [ -d "$WHEELS/comfyui/comfy" ] && export WANVACE_COMFY_DIR="${WANVACE_COMFY_DIR:-$WHEELS/comfyui}"
    export PYTHONUNBUFFERED=1
    # Our pytest on PYTHONPATH would otherwise load every plugin python3's own site-packages registers.
    export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
    local pytest=("$PY" -m pytest -p pytest_timeout -p no:cacheprovider)
    mapfile -t gpu_tests < <(grep -rlE 'pytest\.mark\.gpu' tests --include='test_*.py' | sort)
    if [ "${#gpu_tests[@]}" -eq 0 ]; then
        echo "[gpu_check] ERROR: no test file under tests/ has a pytest.mark.gpu test"
        return 1
    fi

    # --- before any GPU: everything the GPU steps import, and each bench's CPU part --------------------------
    step setup "imports" 90 - "$PY" bench/gpu_check.py imports "${gpu_tests[@]}" || { summary; return 1; }
    step cpu "cpu: collect the gpu-marked tests" "$CPU_LIMIT_S" - \
        "${pytest[@]}" --collect-only -q -m gpu "${gpu_tests[@]}" || cpu_failed=1
    step cpu "cpu: single-file formats, tiny" "$CPU_LIMIT_S" cpu_single_file.json \
        "$PY" bench/bench_single_file_gpu.py --device cpu --tiny --steps 2 --json "$WORK/cpu_single_file.json" \
        || cpu_failed=1
    step cpu "cpu: offload modes, tiny" "$CPU_LIMIT_S" cpu_offload.json \
        "$PY" bench/bench_offload_gpu.py --device cpu --tiny --steps 2 --json "$WORK/cpu_offload.json" || cpu_failed=1
    step cpu "cpu: parallel (torchrun, gloo), tiny" "$CPU_LIMIT_S" cpu_parallel.json \
        "$PY" bench/bench_parallel_gpu.py --device cpu --tiny --steps 1 --json "$WORK/cpu_parallel.json" \
        || cpu_failed=1
    # Every row but compile (the tiny graphs take a minute to build on a CPU), ComfyUI's model included.
    step cpu "cpu: fast path vs ComfyUI, tiny" "$CPU_LIMIT_S" cpu_fast_path.json \
        "$PY" bench/bench_fast_path_gpu.py --device cpu --tiny --sizes 64x64x5 --steps 1 \
        --rows today,attention_auto,fp8_matmul,batched_cfg --json "$WORK/cpu_fast_path.json" || cpu_failed=1
    # 64x64, one frame, 48 px tiles overlapping 16 px: 2x2 tiles, the smallest decode that blends tiles; the real
    # VAE's width makes it the slowest CPU part, so it gets up to 8 of the host's cores.
    local threads
    threads="$(nproc)"
    [ "$threads" -le 8 ] || threads=8
    step cpu "cpu: VAE tiling, 64x64x1" "$CPU_LIMIT_S" cpu_vae.json \
        "$PY" bench/bench_vae_tiling.py --device cpu --frames 1 --height 64 --width 64 --tile-size 48 --overlap 16 \
        --threads "$threads" --json "$WORK/cpu_vae.json" || cpu_failed=1
    [ "$cpu_failed" -eq 0 ] || status=1

    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        "$PY" -c 'import platform, torch; print(f"no CUDA device (CPU part only); torch {torch.__version__}, \
Python {platform.python_version()}")' >"$WORK/device.txt"
        summary
        if [ "$cpu_failed" -ne 0 ]; then
            echo "[gpu_check] the CPU part FAILED (above); no CUDA device here either"
            return 1
        fi
        echo "[gpu_check] no CUDA device: every import and each bench's CPU part passed; nothing measured on a GPU"
        return 0
    fi
    "$PY" -c 'import platform, torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, \
{p.total_memory / 2**30:.0f} GiB x {torch.cuda.device_count()}, torch {torch.__version__} (CUDA {torch.version.cuda}), \
Python {platform.python_version()}")' | tee "$WORK/device.txt"

    # --- the GPU steps, most informative first; none may outrun the budget ------------------------------------
    # Sizes are picked to fit 8 minutes with the set-up and the CPU part (about 1 minute), estimated from an
    # A14B expert's FLOPs at H200 rates (not yet measured): a 480x832x81 CFG step ~7 s, 720x1280x81 ~30 s.
    # Each bench writes its rows as it goes, so a step stopped at its limit still shows what it finished.
    # The tiny-model tests: every offload mode and LoRA through the CUDA ring, the sharded world-1 path.
    step tests "gpu tests (${#gpu_tests[@]} files, -m gpu)" 90 - "${pytest[@]}" -m gpu -q -rfEs \
        --junitxml "$WORK/junit.xml" "${gpu_tests[@]}" || status=1
    # The fast path (issue 18): 4 of the 40 A14B blocks + 1 VACE block, every option alone, all together (compile
    # warm-up included: untimed), and ComfyUI's Wan model at its best, at 480p and 720p.
    step gpu "fast path 480x832x81, 720x1280x81, 4 blocks" 150 fast_path.json \
        "$PY" bench/bench_fast_path_gpu.py --sizes 480x832x81,720x1280x81 --layers 4 --steps 2 \
        --json "$WORK/fast_path.json" || status=1
    # 480p, every mode, 2 steps (the first is a warm-up; in `model` the second includes the expert swap).
    step gpu "offload 480x832x81: none, model, layerwise, diffusers group" 140 offload_480.json \
        "$PY" bench/bench_offload_gpu.py --height 480 --width 832 --frames 81 --steps 2 \
        --json "$WORK/offload_480.json" || status=1
    # bf16 against kept fp8 and kept GGUF Q8_0 weights, one A14B expert, 480p only (720p would triple it).
    step gpu "single-file formats 480x832x81: bf16, fp8, q8_0" 90 single_file_480.json \
        "$PY" bench/bench_single_file_gpu.py --sizes 480x832x81 --steps 2 --json "$WORK/single_file_480.json" \
        || status=1
    # Untiled vs tiled decode at 720p. The decoder runs latent frame by latent frame, so its peak hardly grows
    # with the length: 33 frames should show the ratio 81 would, in 40% of the time.
    step gpu "VAE tiling 720x1280x33" 60 vae_720.json \
        "$PY" bench/bench_vae_tiling.py --device cuda --frames 33 --height 720 --width 1280 --tile-size 256 \
        --overlap 64 --json "$WORK/vae_720.json" || status=1
    # 1 GPU against the sharded path at world size 1 (N GPUs where there are): its overhead, on 10 of the 40
    # blocks at 480p, which shows it at a quarter of the time.
    step gpu "parallel 480x832x81, 10 blocks" 60 parallel_480.json \
        "$PY" bench/bench_parallel_gpu.py --height 480 --width 832 --frames 81 --layers 10 --steps 1 \
        --json "$WORK/parallel_480.json" || status=1
    summary
    return "$status"
}

if [ -n "$OUT_DIR" ]; then
    mkdir -p "$OUT_DIR" || { echo "[gpu_check] ERROR: cannot create OUT=$OUT_DIR"; exit 1; }
    main 2>&1 | tee "$OUT_DIR/gpu_check.log"
    rc="${PIPESTATUS[0]}"
else
    main 2>&1
    rc=$?
fi
echo "[gpu_check] exit $rc after $SECONDS s"
exit "$rc"
