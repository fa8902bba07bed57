#!/usr/bin/env bash
# Diagnosis on a GPU machine: what a pre-loaded process's warm-up saves a model's first inference.
# Each case is a fresh process: import torch and torchvision, make the CUDA context, run a warm-up, build
# ResNet-50 on the meta device and give it GPU storage (as a mapped model is), then time the first and
# second fp16 inferences (batch 8). Cases: no warm-up; the pre-loaded process's `_warm_torch_libraries`;
# that plus a wider set of common layers (`WARM=wide`); CUDA_MODULE_LOADING=EAGER.
#   bash bench/h200_first_infer.sh OUT
set -u
OUT=${1:?usage: h200_first_infer.sh OUT}; mkdir -p "$OUT"
exec > >(tee "$OUT/first_infer.txt") 2>&1
cat > /tmp/first_infer.py <<'PY'
import json, os, sys, time
t0 = time.perf_counter()
import torch, torchvision
imp = time.perf_counter() - t0
case = sys.argv[1]
t = time.perf_counter(); torch.empty(1, device="cuda"); torch.cuda.synchronize(); ctx = time.perf_counter() - t
free0 = torch.cuda.mem_get_info()[0]
t = time.perf_counter()
if case in ("libs", "wide", "eager"):
    from dilu_invoker.actions import worker
    worker._warm_torch_libraries(torch)
if case == "wide" and hasattr(worker, "_warm_torch_layers"):
    worker._warm_torch_layers(torch)
torch.cuda.synchronize(); warm = time.perf_counter() - t
used_by_warm = (free0 - torch.cuda.mem_get_info()[0]) / 2**20
t = time.perf_counter()
with torch.device("meta"):
    m = torchvision.models.resnet50(weights=None)
m = m.to_empty(device="cuda").half().eval(); torch.cuda.synchronize(); build = time.perf_counter() - t
x = torch.randn(8, 3, 224, 224, dtype=torch.half, device="cuda")
res = {"case": case, "import_s": round(imp, 3), "context_s": round(ctx, 3), "warm_s": round(warm, 3),
       "warm_mib": round(used_by_warm, 1), "build_meta_s": round(build, 3)}
for k in ("first_ms", "second_ms", "third_ms"):
    t = time.perf_counter()
    with torch.inference_mode():
        m(x).float().sum().item()
    res[k] = round((time.perf_counter() - t) * 1000, 1)
res["context_mib_total"] = round((torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]) / 2**20, 1)
print(json.dumps(res), flush=True)
PY
for rep in 1 2; do
  for case in none libs wide; do PYTHONPATH=$PWD python3 /tmp/first_infer.py $case; done
  CUDA_MODULE_LOADING=EAGER PYTHONPATH=$PWD python3 /tmp/first_infer.py eager
done
