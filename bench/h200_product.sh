#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks/gpu-product.md, on a bare H200 machine (PyTorch image): wheels for what
# the image lacks are installed to /tmp/site first (see docs/benchmarks/gpu-product.md).
#   bench/h200_product.sh smoke OUT    traces of ResNet-50 and BERT under the shim, the MPS smoke test, a short
#                                      product benchmark (ResNet-50 pair, all modes)
#   bench/h200_product.sh traces OUT   the traces and the MPS smoke test alone
#   bench/h200_product.sh full OUT [PAIRS] [MODES] [TIMEOUT]   the product benchmark (SECONDS_PER=5 per scenario)
set -uo pipefail
what=$1; out=$2
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv | tee "$out/nvidia-smi.txt"
which nvidia-cuda-mps-control | tee -a "$out/nvidia-smi.txt"
if [ "$what" = smoke ] || [ "$what" = traces ]; then
  timeout 120 python3 bench/gpu_traces.py traces --out "$out" --seconds 3 2>&1 | tail -20
  timeout 90 python3 bench/gpu_traces.py mps --out "$out" > "$out/mps_smoke.log" 2>&1; tail -c 3000 "$out/mps_smoke.log"
fi
if [ "$what" = smoke ]; then  timeout 300 python3 -W ignore::DeprecationWarning bench/gpu_product.py --modes noshim,shim,mps50 \
    --pairs resnet50+train --seconds 3 --loads 0.5 --scenarios cold,solo,share,paced,burst,idle \
    --out "$out/gpu_product_smoke.json" --report "$out/gpu_product_smoke.md" 2>&1 | tail -60
elif [ "$what" = full ]; then
  timeout "${5:-480}" python3 -W ignore::DeprecationWarning bench/gpu_product.py --modes "${4:-noshim,shim,mps50}" \
    --pairs "${3:-resnet50+train,bert+train}" --seconds "${SECONDS_PER:-5}" --loads 0.5,0.7 \
    --out "$out/${NAME:-gpu_product}.json" --report "$out/${NAME:-gpu_product}.md" 2>&1 | tail -80
fi
gzip -f "$out"/trace_*.json 2>/dev/null || true
ls -la "$out"
