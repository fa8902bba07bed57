#!/usr/bin/env bash
# Exercise run_h200.sh end to end without a GPU: a stand-in worker (bench/vertical/fakes/worker.py)
# launches "kernels" through the fake libcuda under the real shim, driven by the real GpuManager; the MPS
# control program is a stand-in too, and every run is shortened. The numbers it produces are made up; it
# only proves the orchestration, the manager wiring, merge and report.
#
#   OUT=/tmp/vertical-dry bash bench/vertical/dry_run.sh
set -u
cd "$(dirname "$0")/../.." || exit 1
make -C cuda_shim tests >/dev/null || exit 1
export LD_LIBRARY_PATH=$PWD/cuda_shim/build/fake${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export DILU_BENCH_WORKER=$PWD/bench/vertical/fakes/worker.py
export DILU_BENCH_MPS_CONTROL=$PWD/bench/shim/fakes/mps_control.py
export DILU_BENCH_SCALE=${DILU_BENCH_SCALE:-0.4} DILU_BENCH_DRY_RUN=1 DILU_BENCH_SKIP_BUILD=1
export DILU_BENCH_BUDGET=${DILU_BENCH_BUDGET:-300}
export OUT=${OUT:-/tmp/dilu-vertical-dry-run}
exec bash bench/vertical/run_h200.sh
