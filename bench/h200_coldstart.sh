#!/usr/bin/env bash
# The GPU run behind docs/benchmarks/coldstart.md, on a bare H200 machine (PyTorch image), from the tree's root:
#   bench/h200_coldstart.sh OUT [BUDGET_S]
# Installs the wheels the image lacks (WHEELS, default ../.whl) to /tmp/site, builds the shim, writes the
# ~14 GiB weights file in the background, then runs bench/coldstart.py's steps in order of value, each under
# its own timeout and all within BUDGET_S (default 250); every step writes OUT/<name>.json as it goes.
# DRY=1 runs the same on a machine without a GPU (small files, sleep-based models).
set -uo pipefail
OUT=$1; BUDGET=${2:-250}; START=$SECONDS; LOG=$OUT/run.log; STEP_RESERVE=${STEP_RESERVE:-5}; STEP_MIN=10
# Everything goes to RAW; after each step OUT/coldstart-raw.tar.gz is replaced by a tarball of it (few files in
# OUT: a clipped run still returns what it measured).
mkdir -p "$OUT"; OUT=$(readlink -f "$OUT"); HERE=$PWD
FINAL=$OUT; OUT=${RAW:-/tmp/coldstart-raw}; rm -rf "$OUT"; mkdir -p "$OUT"; LOG=$OUT/run.log
pack() { tar -czf "$FINAL/.raw.tmp" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv "$FINAL/.raw.tmp" "$FINAL/coldstart-raw.tar.gz"
  cp "$LOG" "$FINAL/run.log"; }
. bench/lib.sh
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WF=${WEIGHTS_FILE:-/srv/dilu-coldstart/weights-7b.safetensors}
if [ "${DRY:-0}" = 1 ]; then
  COMMON=(--dry-run); GIB=${GIB:-0.05}; PY=${PY:-python3}
else
  COMMON=(); GIB=${GIB:-14}; PY=python3
  gpu_machine_setup "${PRELOAD_TREE:-}"
fi
log "source $(source_hash 2>/dev/null); python $($PY -c 'import sys; print(sys.version.split()[0])')"
run() { local name=$1 limit=$2; shift 2; step "$name" "$limit" $PY bench/coldstart.py step "$@" --out "$OUT" \
  --name "$name" --weights-file "$WF" --weights-gib "$GIB" --isolation "${ISO:-auto}" "${COMMON[@]}"; pack; }
# The pre-loading steps run from PRELOAD_TREE (default: this tree) where pre-loading lives on another branch.
run_preload() { cd "${PRELOAD_TREE:-$HERE}" && log "tree $(source_hash 2>/dev/null) at $PWD" && run "$@"; cd "$HERE"; }
PRE_EXTRA="--invoker-preload-memory-mb 4096 --invoker-preload-budget-mb 16384"
ISO=auto
run cold_resnet50_preload0 50 cold --model resnet50 --preload 0 --count 3 --warm 10
# Process isolation untried on this machine: without one good cold invoke, the rest runs without it.
if [ -f "$OUT/cold_resnet50_preload0.json" ] && ! $PY -c "import json,sys; d=json.load(open('$OUT/cold_resnet50_preload0.json')); sys.exit(0 if d.get('summary',{}).get('cold_ok') else 1)" 2>/dev/null; then
  ISO=off; log "no cold invoke answered with isolation: the other steps run with --invoker-process-isolation off"
  run cold_resnet50_preload0_isooff 50 cold --model resnet50 --preload 0 --count 3 --warm 10
fi
run_preload cold_resnet50_preload1 75 cold --model resnet50 --preload 1 --count 3 --warm 10 --preload-wait-s 30 \
  --refill-wait-s 12 --extra="$PRE_EXTRA"
# A function woken from zero on a pre-loaded container, its weights kept (grace 60) or not (0).
run_preload rewake 150 rewake --preload 1 --count 3 --warm 5 --preload-wait-s 30 --refill-wait-s 12 \
  --extra="$PRE_EXTRA"
# A function's first request after its PUT: its model pre-loaded by the invoker (--invoker-model-preload-mb
# 32768) or not (0), side by side.
run_preload first_after_put 150 first_after_put --preload 1 --count 3 --warm 5 --preload-wait-s 30 \
  --refill-wait-s 12 --extra="$PRE_EXTRA"
# The weights file, after the cold-start steps (its writing would compete with their imports for the disk).
run makefile 40 makefile
log "weights file: $(ls -la "$WF" 2>&1)"
run weights 80 weights
run share 45 share --hold-s 6
run staged 90 staged
run ipc 45 ipc
# BERT: a fresh machine's cold file cache makes `import transformers` 12 s (run 9), hence the wider limits;
# the pre-loaded arm's second cold start waits for the replacement restarted with the learnt `transformers`.
run cold_bert_preload0 75 cold --model bert --preload 0 --count 2 --warm 5
run_preload cold_bert_preload1 90 cold --model bert --preload 1 --count 2 --warm 5 --preload-wait-s 30 \
  --refill-wait-s 30 --refill-min-wait-s 8 --extra="$PRE_EXTRA"
run_preload cold_resnet50_preload0_sametree 50 cold --model resnet50 --preload 0 --count 3 --warm 10
rm -f "$WF" "$WF.part"
log "done after $((SECONDS - START))s"
ls -la "$OUT"; pack
