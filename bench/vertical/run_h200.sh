#!/usr/bin/env bash
# Vertical scaling on the H200 (issue 4): an inference and a training ResNet-50 under the shim, driven by
# the real GpuManager. From the repository root:
#
#   OUT=/path/to/out bash bench/vertical/run_h200.sh
#
# Needs: gcc (the shim), python3 with torch + torchvision, an NVIDIA driver, nvidia-cuda-mps-control for
# the MPS steps; no network, no Redis (the manager runs without it). About 6-8 minutes, never more than
# 9.5 (every step has a time limit and a share of one global budget); a failing step is logged and the
# next one still runs. Extra arguments for every step go in DILU_BENCH_ARGS (e.g. "--vertical
# dwell_s=0.1 --load 0.4").
#
# Writes under $OUT (default ./out/vertical):
#   vertical_results.json  every measurement; input of report.py
#   vertical.md            the report rendered from it (same as docs/benchmarks/vertical.md)
#   vertical_log.txt       every step, its exit status, the manager's and workers' complaints
#   machine.txt            GPU, driver, CPU, toolchain and library versions
#   gpu_samples.csv        nvidia-smi every 100 ms: SM clock, power, temperature, utilisation, clock reasons
set -u
cd "$(dirname "$0")/../.." || exit 1
REPO=$PWD
OUT=${OUT:-$REPO/out/vertical}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/dilu-vertical-bench.XXXXXX)
RES=$WORK/results
mkdir -p "$RES"
LOG=$OUT/vertical_log.txt
: >"$LOG"
PY=${PYTHON:-python3}
BUDGET=${DILU_BENCH_BUDGET:-560} # seconds for everything, merge and report included
START=$SECONDS
ARGS=${DILU_BENCH_ARGS:-}
MPS_CONTROL=${DILU_BENCH_MPS_CONTROL:-nvidia-cuda-mps-control}

STEP_RESERVE=25 STEP_MIN=20
# shellcheck source=../lib.sh
. bench/lib.sh

mps_quit() {
    # The steps quit their daemon themselves; this is for a step killed by its time limit.
    if [ -d "$WORK/mps_pipe" ] && { command -v "$MPS_CONTROL" >/dev/null 2>&1 || [ -f "$MPS_CONTROL" ]; }; then
        echo quit | CUDA_MPS_PIPE_DIRECTORY=$WORK/mps_pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps_log \
            timeout 20 "$MPS_CONTROL" >/dev/null 2>&1
    fi
}
trap 'mps_quit; rm -rf "$WORK"' EXIT

log "vertical benchmark: repo $REPO, out $OUT, work $WORK, budget ${BUDGET}s, args '$ARGS'"

# ---- machine ------------------------------------------------------------------------
{
    echo "date: $(date -Is)"
    echo "host: $(uname -a)"
    echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
    # A copied working tree can carry a stale .git: the sources' own hash says what really ran
    # (the same command in a checkout of the commit gives the same hash).
    echo "sources: $(source_hash)"
    echo "--- nvidia-smi"
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,compute_mode,mig.mode.current --format=csv 2>&1
    echo "--- cpu"
    timeout 10 lscpu 2>&1 | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)" || true
    echo "--- toolchain"
    timeout 10 gcc --version 2>&1 | head -1
    echo "python: $(timeout 10 "$PY" --version 2>&1)"
    timeout 60 "$PY" -c 'import torch, torchvision; print("torch", torch.__version__, "cuda", torch.version.cuda, "torchvision", torchvision.__version__)' 2>&1 | tail -1
    echo "mps: $(command -v "$MPS_CONTROL" || echo missing)"
} >"$OUT/machine.txt" 2>&1
log "machine info written"

# ---- build ----------------------------------------------------------------------------
# cuda.h + cudaTypedefs.h for the shim: find_cuda_include (bench/lib.sh)
if [ -z "${DILU_BENCH_SKIP_BUILD:-}" ]; then
    CUDA_INCLUDE=$(find_cuda_include)
    export CUDA_INCLUDE=${CUDA_INCLUDE:-/usr/local/cuda/include}
    log "CUDA_INCLUDE=$CUDA_INCLUDE"
    step build-shim 120 make -C cuda_shim clean all
fi
if [ ! -f cuda_shim/build/libdilu_shim.so ]; then
    log "no cuda_shim/build/libdilu_shim.so: nothing can be measured"
fi

# ---- GPU samples --------------------------------------------------------------------------
# SM clock, power, temperature, utilisation and why the clocks are held back, every 100 ms for the whole
# run: a slowdown of inference that no share explains shows up here (scenarios carry t0_unix to line up).
SMI=${DILU_BENCH_NVIDIA_SMI:-nvidia-smi}
SMI_PID=
if command -v "$SMI" >/dev/null 2>&1; then
    FIELDS=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
    for reasons in clocks_event_reasons.active clocks_throttle_reasons.active; do
        if timeout 20 "$SMI" --query-gpu="$FIELDS,$reasons" --format=csv >/dev/null 2>&1; then
            FIELDS=$FIELDS,$reasons
            break
        fi
    done
    "$SMI" --query-gpu="$FIELDS" --format=csv -lms 100 >"$OUT/gpu_samples.csv" 2>>"$LOG" &
    SMI_PID=$!
    log "GPU samples every 100 ms: $FIELDS"
fi
trap '[ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null; mps_quit; rm -rf "$WORK"' EXIT

# ---- steps (most important first) -------------------------------------------------------
# Per-step extra arguments and limits: DILU_BENCH_ARGS_TIMESLICE / _MPS / _MPS_CAPPED / _MPS_STATIC and
# DILU_BENCH_LIMIT_TIMESLICE / _MPS / _MPS_CAPPED / _MPS_STATIC (seconds).
run_step() {
    local name=$1 limit=$2 extra=$3
    # shellcheck disable=SC2086  # ARGS is a list of words on purpose
    step "$name" "$limit" "$PY" bench/vertical/h200.py step "$name" --work "$WORK" --results "$RES" \
        --log "$LOG" $ARGS $extra
    mps_quit
}
# DILU_BENCH_STEPS picks the steps (default all four, in this order).
STEPS=" ${DILU_BENCH_STEPS:-timeslice mps mps_capped mps_static} "
[[ $STEPS == *" timeslice "* ]] && run_step timeslice "${DILU_BENCH_LIMIT_TIMESLICE:-200}" "${DILU_BENCH_ARGS_TIMESLICE:-}"
[[ $STEPS == *" mps "* ]] && run_step mps "${DILU_BENCH_LIMIT_MPS:-135}" "${DILU_BENCH_ARGS_MPS:-}"
[[ $STEPS == *" mps_capped "* ]] && run_step mps_capped "${DILU_BENCH_LIMIT_MPS_CAPPED:-135}" "${DILU_BENCH_ARGS_MPS_CAPPED:-}"
[[ $STEPS == *" mps_static "* ]] && run_step mps_static "${DILU_BENCH_LIMIT_MPS_STATIC:-110}" "${DILU_BENCH_ARGS_MPS_STATIC:-}"

# ---- results --------------------------------------------------------------------------
CMD="OUT=<dir> bash bench/vertical/run_h200.sh${ARGS:+ (DILU_BENCH_ARGS='$ARGS')}"
[ -n "${DILU_BENCH_STEPS:-}" ] && CMD="$CMD (DILU_BENCH_STEPS='$DILU_BENCH_STEPS')"
for v in DILU_BENCH_ARGS_TIMESLICE DILU_BENCH_ARGS_MPS DILU_BENCH_ARGS_MPS_CAPPED DILU_BENCH_ARGS_MPS_STATIC; do
    [ -n "${!v:-}" ] && CMD="$CMD ($v='${!v}')"
done
timeout 60 "$PY" bench/vertical/h200.py merge --results "$RES" --out "$OUT/vertical_results.json" \
    --machine "$OUT/machine.txt" --command "$CMD" --steps "$STEPS" >>"$LOG" 2>&1
log "merge exit $?"
[ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null && SMI_PID=
SAMPLES=()
[ -s "$OUT/gpu_samples.csv" ] && SAMPLES=(--gpu-samples "$OUT/gpu_samples.csv")
timeout 60 "$PY" bench/vertical/report.py "$OUT/vertical_results.json" --out "$OUT/vertical.md" "${SAMPLES[@]}" >>"$LOG" 2>&1
log "report exit $?; total $((SECONDS - START))s"
exit 0
