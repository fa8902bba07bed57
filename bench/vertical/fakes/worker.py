#!/usr/bin/env python3
"""Stand-in for bench/vertical/worker.py in a dry run (no GPU, no torch): the same protocol, with "kernels"
launched through the fake libcuda (cuda_shim/tests), so the real shim meters them and the real manager's
quotas slow this process down. Service times are made up; nothing it reports is a GPU measurement.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schedule import arrivals


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Fake:
    def __init__(self, launches: int, blocks: int, gap_s: float) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        self.launch = cuda.cuLaunchKernel
        self.launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        cuda.cuInit(0)
        self.n, self.blocks, self.gap = launches, blocks, gap_s

    def once(self) -> None:
        for _ in range(self.n):
            self.launch(None, self.blocks, 1, 1, 1, 1, 1, 0, 0x100, None, None)
            time.sleep(self.gap)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["inference", "training"])
    ap.add_argument("--batch", type=int)
    ap.add_argument("--fp32", action="store_true")
    args = ap.parse_args()
    # inference: ~4 ms per request; training: ~25 ms per step
    fake = Fake(16, 50, 0.00025) if args.role == "inference" else Fake(80, 100, 0.0003)
    say({"ready": True, "role": args.role, "torch": "dry-run", "torchvision": "dry-run", "device": "fake",
         "load_s": 0.0})
    for line in sys.stdin:
        if not line.strip():
            continue
        c = json.loads(line)
        if c["cmd"] == "quit":
            break
        if c["cmd"] == "closed":
            t0 = time.monotonic()
            lat = []
            while time.monotonic() - t0 < float(c["seconds"]):
                a = time.monotonic()
                fake.once()
                lat.append(time.monotonic() - a)
            took = time.monotonic() - t0
            lat.sort()
            say({"ok": True, "n": len(lat), "seconds": took, "rps": len(lat) / took,
                 "p50_ms": 1000 * lat[len(lat) // 2], "min_ms": 1000 * lat[0], "t0": t0, "t1": t0 + took})
        elif c["cmd"] == "open":
            start = time.monotonic() + float(c.get("start_in", 0.3))
            arr = arrivals(c["phases"], int(c.get("seed", 1)), start, c.get("arrivals", "poisson"))
            done = []
            for a in arr:
                now = time.monotonic()
                if a > now:
                    time.sleep(a - now)
                fake.once()
                done.append(time.monotonic())
            say({"ok": True, "start": start, "arrivals": arr, "completions": done})
        elif c["cmd"] == "train":
            t0 = time.monotonic()
            steps = []
            while time.monotonic() - t0 < float(c["seconds"]):
                fake.once()
                steps.append(time.monotonic())
            say({"ok": True, "t0": t0, "steps": steps})
        else:
            say({"ok": False, "error": f"unknown {c}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
