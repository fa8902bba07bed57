#!/usr/bin/env bash
# The shim's GPU proof (issue 3 (a)-(e)) on the H200 machine. From the repository root:
#
#   OUT=/path/to/out bash bench/shim/run_h200.sh
#
# Needs: gcc, nvcc (CUDA 13, -arch=sm_90), python3 with torch + torchvision, an NVIDIA
# driver, nvidia-cuda-mps-control for (e); no network. Finishes in about 5 minutes and
# never more than ~8.5 (every step has a time limit and a share of one global budget).
# A failing step is logged and the next one still runs.
#
# Writes under $OUT (default ./out/shim):
#   shim_results.json  every measurement (raw and summarised); input of report.py
#   shim.md            the report rendered from it (same as docs/benchmarks/shim.md)
#   shim_log.txt       every command, its exit status and the tail of its errors
#   machine.txt        GPU, driver, CPU, toolchain and library versions
set -u
cd "$(dirname "$0")/../.." || exit 1
REPO=$PWD
OUT=${OUT:-$REPO/out/shim}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/dilu-shim-bench.XXXXXX)
RES=$WORK/results
mkdir -p "$RES"
LOG=$OUT/shim_log.txt
: >"$LOG"
PY=${PYTHON:-python3}
BUDGET=${DILU_BENCH_BUDGET:-510} # seconds for everything, merge and report included
START=$SECONDS

STEP_RESERVE=20 STEP_MIN=15
# shellcheck source=../lib.sh
. bench/lib.sh

mps_quit() {
    if command -v nvidia-cuda-mps-control >/dev/null 2>&1 && [ -d "$WORK/mps_pipe" ]; then
        echo quit | CUDA_MPS_PIPE_DIRECTORY=$WORK/mps_pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps_log \
            timeout 20 nvidia-cuda-mps-control >/dev/null 2>&1
    fi
}
trap mps_quit EXIT

log "shim benchmark: repo $REPO, out $OUT, work $WORK, budget ${BUDGET}s"

# ---- machine ------------------------------------------------------------------------
{
    echo "date: $(date -Is)"
    echo "host: $(uname -a)"
    echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "--- nvidia-smi"
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,compute_mode,mig.mode.current --format=csv 2>&1
    timeout 20 nvidia-smi 2>&1 | head -20
    echo "--- cpu"
    timeout 10 lscpu 2>&1 | grep -E "Model name|^CPU\(s\)|Thread|MHz|NUMA node\(s\)" || true
    echo "--- toolchain"
    timeout 10 gcc --version 2>&1 | head -1
    timeout 10 nvcc --version 2>&1 | tail -2
    timeout 10 ldd --version 2>&1 | head -1
    echo "python: $(timeout 10 "$PY" --version 2>&1)"
    timeout 60 "$PY" -c 'import torch, torchvision; print("torch", torch.__version__, "cuda", torch.version.cuda, "torchvision", torchvision.__version__)' 2>&1 | tail -1
    echo "mps: $(command -v nvidia-cuda-mps-control || echo missing)"
    echo "taskset: $(command -v taskset || echo missing)"
} >"$OUT/machine.txt" 2>&1
log "machine info written"

# ---- build ----------------------------------------------------------------------------
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null 2>&1 || NVCC=/usr/local/cuda/bin/nvcc
# cuda.h + cudaTypedefs.h for the shim's build: find_cuda_include (bench/lib.sh)
CUDA_INCLUDE=$(find_cuda_include)
export CUDA_INCLUDE=${CUDA_INCLUDE:-/usr/local/cuda/include}
log "CUDA_INCLUDE=$CUDA_INCLUDE nvcc=$NVCC"
step build-shim 180 make -C cuda_shim clean tests
make_rc=1
[ -f cuda_shim/build/libdilu_shim.so ] && [ -x cuda_shim/build/tests/shim_tests ] && make_rc=0
step build-gpu-bench 240 "$NVCC" -O2 -std=c++17 -arch=sm_90 -I cuda_shim/include -o "$WORK/gpu_bench" bench/shim/gpu_bench.cu
nvcc_rc=1
[ -x "$WORK/gpu_bench" ] && nvcc_rc=0
"$PY" - "$RES/build.json" "$make_rc" "$nvcc_rc" <<'EOF'
import json, sys
path, make_rc, nvcc_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
json.dump({"shim_built": make_rc == 0, "gpu_bench_built": nvcc_rc == 0}, open(path, "w"))
EOF
log "build: shim ok=$((make_rc == 0)) gpu_bench ok=$((nvcc_rc == 0))"

# ---- steps (most important first) -------------------------------------------------------
run_step() { step "$1" "$2" "$PY" bench/shim/h200.py step "$1" --work "$WORK" --results "$RES" --log "$LOG"; }
run_step c_tests 120
run_step fastpath 90
if [ $nvcc_rc -eq 0 ] && [ $make_rc -eq 0 ]; then
    run_step enqueue 150
    run_step accuracy 150
    run_step reaction 60
    run_step threads64 60
    run_step memcap 40
    run_step resnet 200
    run_step mps 100
    mps_quit
else
    log "GPU steps skipped: build failed"
fi

# ---- results --------------------------------------------------------------------------
timeout 60 "$PY" bench/shim/h200.py merge --results "$RES" --out "$OUT/shim_results.json" \
    --machine "$OUT/machine.txt" --command "OUT=<dir> bash bench/shim/run_h200.sh" >>"$LOG" 2>&1
log "merge exit $?"
timeout 60 "$PY" bench/shim/report.py "$OUT/shim_results.json" --out "$OUT/shim.md" >>"$LOG" 2>&1
log "report exit $?; total $((SECONDS - START))s"
rm -rf "$WORK"
exit 0
