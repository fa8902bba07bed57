"""Scale figures of the simulators (issue 7, part 5) on this machine.

    PYTHONPATH=. python3 bench/sim_scale.py [--profiles FILE] [--policies dilu,exclusive]

1. The 3,200-instance placement trace (examples/placement/dilu-mix-3200.jsonl.gz), each policy, and
   all five through the CLI (`--policy all`, with plots): target < 10 s.
2. The one-day, 100-function serving trace on 64 GPUs (examples/serving/azure-day.jsonl.gz), per
   policy: target < 5 minutes.
Prints wall-clock seconds; nothing is asserted (speed belongs here, not in tests).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dilu_invoker.sim.events import load_events
from dilu_invoker.sim.placement import (
    PLACEMENT_POLICIES,
    PlacementSimConfig,
    simulate_placement,
)
from dilu_invoker.sim.profiles import load_profiles
from dilu_invoker.sim.serving import (
    SERVING_POLICIES,
    ServingSimConfig,
    simulate_serving,
)
from dilu_invoker.sim.traces import load_trace


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", default="tests/sim/data/synthetic_profiles.json")
    ap.add_argument("--policies", default=",".join(SERVING_POLICIES))
    ap.add_argument("--skip-serving", action="store_true")
    args = ap.parse_args()
    path = ROOT / "examples/placement/dilu-mix-3200.jsonl.gz"
    events = load_events(path)
    print(f"placement, {len(events)} events of 3,200 instances, 40 GiB GPUs:")
    for p in PLACEMENT_POLICIES:
        t0 = time.perf_counter()
        cfg = PlacementSimConfig(policy=p, gpu_memory_gib=40.0, compact_every_s=10.0 if p == "dilu" else 0.0)
        r = simulate_placement(events, cfg)
        print(f"  {p:10s} {time.perf_counter() - t0:6.2f} s  (peak {r.summary['gpus_peak']})")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "dilu_invoker", "simulate", "placement", "--events", str(path), "--policy", "all",
             "--gpu-memory-gib", "40", "--out", tmp, "--quiet"],
            check=True, cwd=ROOT, capture_output=True,
        )
        print(f"  CLI --policy all with plots: {time.perf_counter() - t0:.2f} s")
    if args.skip_serving:
        return 0
    profiles = load_profiles(ROOT / args.profiles)
    trace = load_trace(ROOT / "examples/serving/azure-day.jsonl.gz", profiles)
    print(f"serving, {len(trace.functions)} functions, {trace.requests:,} requests over 24 h, 64 GPUs"
          f"{' (SYNTHETIC profiles)' if profiles.synthetic else ''}:")
    for p in args.policies.split(","):
        t0 = time.perf_counter()
        r = simulate_serving(trace, profiles, ServingSimConfig(policy=p, gpus=64))
        print(f"  {p:12s} {time.perf_counter() - t0:6.1f} s  ({r.summary['completed']:,} completed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
