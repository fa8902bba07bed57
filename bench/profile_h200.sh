#!/usr/bin/env bash
# Profile ResNet-50 inference, BERT-base inference and a ResNet-50 training step on the GPU machine:
# the hybrid growth search AND the exhaustive grid (SM share 0.1..1.0 step 0.1 x batch 1..64), with the
# share held by SHARE_CONTROL:
#   shim (default): the shim preloaded into one worker, share x the launch rate the workload reaches alone
#                   written into its control block (what the live GpuManager enforces);
#   mps:            CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, one worker process per share; a private MPS control
#                   daemon is started and stopped by the profiler.
# Random weights, nothing downloaded.
#
#   bench/profile_h200.sh            # from the repository root; writes to $OUT (default out/profile)
#
# Writes 4 files under $OUT:
#   profiles.json     the profile set (points of the grid; recommended <request, limit> and batch of the search)
#   runs.json         every probe of every search and grid, with timings and the environment
#   profile.log       the profiler's output
#   worker.log        the workers' stderr
# Then, on the development machine:
#   python3 bench/profiler_report.py <dir with runs.json and profiles.json> > docs/benchmarks/profiler.md
#   cp <dir>/profiles.json examples/profiles.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/profile}"
mkdir -p "$OUT"
LOG="$OUT/profile.log"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-330}"
SHARE_CONTROL="${SHARE_CONTROL:-shim}"
if [ "$SHARE_CONTROL" = shim ] && [ -z "${EXTRA_ARGS:-}" ]; then
  make -C cuda_shim >/dev/null 2>"$OUT/build.log" || { echo "cannot build the shim: see $OUT/build.log"; exit 2; }
fi
# EXTRA_ARGS="--dry-run --formula-scale 0.02" smoke-tests the plumbing on a machine without a GPU.
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"

{
  echo "# $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi -L 2>&1 || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,mig.mode.current --format=csv 2>&1 || true
  "$PY" -c 'import torch, torchvision, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__, "transformers", transformers.__version__)' 2>&1
} >"$LOG"

run() {
  timeout --kill-after=20 "$BUDGET_S" "$PY" -m dilu_invoker profile \
    --model resnet50 --model bert-base --model train-resnet50 --compare \
    --share-control "$SHARE_CONTROL" --prestart --shim-lib cuda_shim/build/libdilu_shim.so "${EXTRA[@]}" "$@" \
    --slo-ms 50 --training-batch 32 --batches 1,2,4,8,16,32,64 --step 0.1 \
    --warmup 3 --min-iters 5 --max-iters 30 --window-s 0.2 \
    --out "$OUT/profiles.json" --runs "$OUT/runs.json" --worker-log "$OUT/worker.log" >>"$LOG" 2>&1
}

run
rc=$?
if [ "$rc" -eq 2 ] && grep -q "MPS control daemon" "$LOG"; then
  # An MPS daemon already serves this GPU: use it rather than a private one.
  echo "# retrying with the running MPS daemon (--mps-external)" >>"$LOG"
  run --mps-external
  rc=$?
fi
echo "# exit status $rc" >>"$LOG"
tail -n 8 "$LOG"
exit "$rc"
