#!/usr/bin/env bash
# Regenerate every trace in examples/ (deterministic: same seeds, same bytes). From the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
P="${PYTHON:-python3} -m dilu_invoker simulate gen"
for n in 100 200 400 800 1600 3200; do $P placement --instances $n --train-fraction 0.2 --seed 1 --out examples/placement/dilu-mix-$n.jsonl.gz; done
$P placement --instances 3200 --train-fraction 0.1 --seed 1 --out examples/placement/dilu-mix-3200-train10.jsonl.gz
$P serving --pattern azure --functions 100 --duration 86400 --rate 60 --profile-names resnet50,bert-base --training-profile train-resnet50 --training-jobs 8 --training-duration 14400 --seed 1 --out examples/serving/azure-day.jsonl.gz
$P serving --pattern bursty --functions 10 --duration 3600 --rate 1000 --burst-factor 5 --profile-names resnet50,bert-base --training-profile train-resnet50 --training-jobs 4 --training-duration 1800 --seed 1 --out examples/serving/bursty.jsonl.gz
$P azure --functions 4 --rate 2 --seed 1 --out examples/azure2019
