#!/usr/bin/env bash
# A split instance's tensors handed on as stage frames against base64 in JSON, on a GPU machine, in one device
# call: bench/split_pipeline.py (a 24-layer fp16 decoder, whole in one runtime and split into two stages, each its
# own runtime process, driven with the invoker's RuntimeClient) with --hops json and --hops frames alternating,
# TRIALS times each, at batch 4 x 512 tokens (8 MiB of hidden state between the stages), then once each at
# batch 8 x 512 (16 MiB). Wheels for what the PyTorch image lacks come from .whl/ (bench/h200_product.sh wheels).
# Only the raw JSON is written (render pages with bench/split_pipeline.py --from-json): the device hands back few files.
#   bench/h200_split_hops.sh OUT [TRIALS]       (DRY=1: on the CPU, tiny, for a dry run)
set -uo pipefail
out=${1:-out}; trials=${2:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
mkdir -p "$out"
LOG="$out/run.log"; BUDGET=${BUDGET:-540}; START=$SECONDS
source bench/lib.sh
py=${PY:-python3}
if [ -z "${DRY:-}" ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv > "$out/nvidia-smi.txt" 2>&1
  log "pip: $($py -m pip install -q --no-deps --no-index --find-links "${WHEELS:-.whl}" --target /tmp/site \
      "${WHEELS:-.whl}"/*.whl 2>&1 | tail -2)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  model=(--device cuda --requests 50 --warmup 5)
else
  model=(--device cpu --layers 4 --d-model 64 --heads 2 --vocab 100 --seq 16 --batch 2 --requests 4 --warmup 1)
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
log "tree $(source_hash); git $(git rev-parse --short HEAD 2>/dev/null || echo none)"
for t in $(seq 1 "$trials"); do
  for hops in json frames; do
    step "b4-$hops-$t" 150 "$py" bench/split_pipeline.py "${model[@]}" --hops "$hops" \
      --json "$out/2-stages-$hops-$t.json"
  done
done
for hops in json frames; do
  if [ -z "${DRY:-}" ]; then big=(--batch 8); else big=(--batch 4); fi
  step "b8-$hops" 150 "$py" bench/split_pipeline.py "${model[@]}" "${big[@]}" --hops "$hops" \
    --json "$out/2-stages-batch-8-$hops.json"
done
log "done after $((SECONDS - START)) s"
