#!/usr/bin/env bash
# Every GPU check in one go, for a machine with one or more CUDA GPUs (about 16 minutes on one H100/H200):
# the gpu-marked tests, then the GPU benchmarks, each printing its figures. Run from a fresh clone:
#   bash bench/gpu_check.sh            # sets up the current set first (no ComfyUI server is started)
# Exits non-zero if a test failed; the benchmarks print ratios measured side by side in one run.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SET="${WANVACE_SET:-current}"
PY="$ROOT/.venvs/$SET/bin/python"
if [ ! -x "$PY" ]; then
    bash scripts/setup.sh "$SET" || exit 1
fi
"$PY" - <<'PYEOF' || { echo "[gpu_check] no CUDA device: nothing measured"; exit 0; }
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
PYEOF
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"[gpu_check] {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")'

status=0
step() {
    local name="$1" limit="$2"
    shift 2
    echo "===== $name ====="
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "===== $name: exit $rc in $((SECONDS - start)) s ====="
    if [ "$rc" -ne 0 ]; then status=1; fi
}

step "gpu tests" 180 "$PY" -m pytest tests -m gpu -p no:cacheprovider -q -rA
step "offload bench 480x832x81" 150 "$PY" bench/bench_offload_gpu.py --height 480 --width 832 --frames 81 --steps 3
step "offload bench 720x1280x81" 180 "$PY" bench/bench_offload_gpu.py --height 720 --width 1280 --frames 81 --steps 3
# bf16 vs kept fp8 vs kept GGUF Q8_0 weights, one A14B expert; 720x1280x81 runs only if predicted to fit 120 s.
step "single-file formats bench" 150 "$PY" bench/bench_single_file_gpu.py --sizes 480x832x81,720x1280x81 --steps 3 \
    --max-seconds 120
# 1 GPU against N GPUs (the sharded path at world size 1 when the machine has one GPU), A14B expert at 720p.
step "parallel bench 720x1280x81" 240 "$PY" bench/bench_parallel_gpu.py --height 720 --width 1280 --frames 81 --steps 2
# Untiled vs tiled (256 px tiles, 64 px overlap) decode of 81 frames at 720p, real Wan 2.1 VAE architecture, bf16.
step "VAE tiling bench 720x1280x81" 240 "$PY" bench/bench_vae_tiling.py --device cuda --frames 81 --height 720 \
    --width 1280 --tile-size 256 --overlap 64
exit "$status"
