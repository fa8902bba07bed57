#!/usr/bin/env bash
# Exercise run_h200.sh end to end without a GPU: stand-ins replace gpu_bench, the torch
# benchmark and the MPS control program (bench/shim/fakes/), and every run is shortened.
# The numbers it produces are made up; it only proves the pipeline, merge and report.
#
#   OUT=/tmp/shim-dry bash bench/shim/dry_run.sh
set -u
cd "$(dirname "$0")/../.." || exit 1
F=$PWD/bench/shim/fakes
export DILU_BENCH_GPU_BENCH=$F/gpu_bench.py DILU_BENCH_PYTHON=$F/python_resnet.py
export DILU_BENCH_MPS_CONTROL=$F/mps_control.py DILU_BENCH_SCALE=${DILU_BENCH_SCALE:-0.05}
export OUT=${OUT:-/tmp/dilu-shim-dry-run}
exec bash bench/shim/run_h200.sh
