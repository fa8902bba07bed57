#!/usr/bin/env bash
# The GPU run behind docs/benchmarks/warm-path.md, on a bare H200 machine (PyTorch image), from the tree's root:
#   bench/h200_warm.sh OUT [BUDGET_S]
# Installs the wheels the image lacks (WHEELS, default .whl) to /tmp/site, builds the shim, then runs
# bench/warm_path.py (all actions, both clients) at the standalone's default log level, and, where
# BASE_TREE names another checkout (its bench/warm_path.py replaced by this one), the same against that
# tree's product right after, for a side-by-side ratio (ROUNDS="1 2": twice, alternating). Each step writes
# OUT/<name>.json. LANE_OFF=1 adds, per round, this tree with the direct lane off
# (DILU_INVOKER_PROCESS_DIRECT_LANE=false) as OUT/nolane_rN.json. DRY=1: the same without a GPU (the
# actions' CPU fallbacks).
set -uo pipefail
OUT=$1; BUDGET=${2:-400}; START=$SECONDS; STEP_RESERVE=5; STEP_MIN=30
mkdir -p "$OUT"; OUT=$(readlink -f "$OUT"); LOG=$OUT/run.log; HERE=$PWD
. bench/lib.sh
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
DRYFLAG=()
if [ "${DRY:-0}" = 1 ]; then DRYFLAG=(--dry); else gpu_machine_setup "${BASE_TREE:-}"; fi
log "source $(source_hash 2>/dev/null); python $(python3 -c 'import sys; print(sys.version.split()[0])')"
ARGS=(--batches "${BATCHES:-8}" --per "${PER:-100}" ${ACTIONS:+--actions "$ACTIONS"} "${DRYFLAG[@]}")
for round in ${ROUNDS:-1}; do
  step "warm_r$round" 240 python3 bench/warm_path.py "${ARGS[@]}" --out "$OUT/warm_r$round.json"
  if [ "${LANE_OFF:-0}" = 1 ]; then
    DILU_INVOKER_PROCESS_DIRECT_LANE=false step "nolane_r$round" 240 python3 bench/warm_path.py "${ARGS[@]}" \
      --out "$OUT/nolane_r$round.json"
  fi
  if [ -n "${BASE_TREE:-}" ]; then
    cd "$BASE_TREE" && step "base_r$round" 240 python3 bench/warm_path.py "${ARGS[@]}" --out "$OUT/base_r$round.json"
    cd "$HERE"
  fi
done
log "done after $((SECONDS - START))s"
