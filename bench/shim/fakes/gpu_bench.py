#!/usr/bin/env python3
"""Stand-in for gpu_bench in a dry run of the benchmark pipeline (no GPU here).

Prints JSON shaped like gpu_bench's, with made-up but self-consistent numbers: a burn
under a control block runs at min(rate, R0). Nothing it prints is a measurement.
"""

import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "abi", Path(__file__).resolve().parents[3] / "dilu_invoker/gpu/abi.py"
)
assert spec and spec.loader
abi = importlib.util.module_from_spec(spec)
sys.modules["abi"] = abi
spec.loader.exec_module(abi)

R0 = 2000.0


def arg(name, default=None, cast=str):
    a = sys.argv
    return cast(a[a.index(name) + 1]) if name in a else default


def control():
    p = os.environ.get("DILU_SHIM_CONTROL")
    return abi.ControlFile.open(p).read().quota if p else None


mode = sys.argv[1]
shim = 1 if os.environ.get("LD_PRELOAD") else 0
if mode == "enqueue":
    base = 3.1 + 0.01 * shim + random.random() * 0.05
    print(
        json.dumps(
            {
                "mode": "enqueue",
                "grid": arg("--grid", 1, int),
                "enqueue_us_p50": base,
                "enqueue_us_p90": base + 0.2,
                "enqueue_us_min": base - 0.1,
                "launch_sync_us_p50": 8.0,
                "launch_sync_us_p99": 12.0,
            }
        )
    )
elif mode == "burn":
    seconds = arg("--seconds", 3.0, float)
    blocks = arg("--blocks", 528, int)
    start = arg("--start-at", 0, int) or time.monotonic_ns()
    time.sleep(max(0.0, (start - time.monotonic_ns()) / 1e9))
    time.sleep(min(seconds, 0.3))
    q = control()
    pct = float(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")) / 100
    rate = min(q.rate_blocks_per_ms if q and q.limited else R0, R0 * pct) * (
        1 + random.uniform(-0.02, 0.02)
    )
    out = {
        "mode": "burn",
        "blocks": blocks,
        "kernel_ms_solo": 0.27,
        "blocks_per_ms": rate,
        "kernels": 100,
    }
    flips = [
        tuple(map(float, f.split(":")))
        for i, f in enumerate(sys.argv)
        if sys.argv[i - 1] == "--flip"
    ]
    if flips:
        bin_ms = arg("--bin-ms", 2.0, float)
        n = int(seconds * 1000 / bin_ms) + 1
        bins, cur = [], rate
        for i in range(n):
            t = i * bin_ms
            for at, r in flips:
                if t >= at + 3:
                    cur = r
            bins.append(cur * bin_ms)
        out.update(
            bin_ms=bin_ms,
            bins_blocks=bins,
            flips=[{"at_ms": at + 0.01, "rate": r} for at, r in flips],
        )
    print(json.dumps(out))
elif mode == "threads":
    print(
        json.dumps(
            {
                "mode": "threads",
                "threads": arg("--threads", 64, int),
                "launches_per_thread": arg("--launches", 500, int),
                "elapsed_ms": 50.0,
                "errors": 0,
            }
        )
    )
elif mode == "memcap":
    cap = control().mem_cap_bytes
    print(
        json.dumps(
            {
                "mode": "memcap",
                "total0": cap,
                "free0": cap - 4096,
                "free_before_rest": cap // 2,
                "alloc_rest": 0,
                "free_after_rest": 0,
                "alloc_one_more": 2,
                "free_rc": 0,
                "free_after_free": cap // 2,
                "async_rest": 0,
                "async_one_more": 2,
            }
        )
    )
