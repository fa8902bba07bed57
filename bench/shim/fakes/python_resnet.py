#!/usr/bin/env python3
"""Stand-in for `python3 resnet_bench.py` in a dry run (no GPU, no torch): made-up numbers."""

import json
import os
import random
import sys

extra = 0.01 if os.environ.get("LD_PRELOAD") else 0.0
out = {
    "torch": "dry-run",
    "torchvision": "dry-run",
    "batches": {
        "1": {"p50_ms": 3.0 + extra + random.random() * 0.01, "p90_ms": 3.2},
        "32": {"p50_ms": 20.0 + extra, "p90_ms": 21.0},
    },
}
if "--graph-check" in sys.argv:
    out["graph"] = {"replays": 20, "replay_ms_mean": 2.5}
print(json.dumps(out))
