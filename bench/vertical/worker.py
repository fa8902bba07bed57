#!/usr/bin/env python3
"""A GPU tenant of the vertical benchmark: torchvision ResNet-50 (random weights) serving inference or
training, driven by JSON commands on stdin, one JSON answer per line on stdout.

    python3 bench/vertical/worker.py inference [--batch 8] [--fp32]
    python3 bench/vertical/worker.py training [--batch 64]

Commands (all times are CLOCK_MONOTONIC seconds, shared with the orchestrator):

    {"cmd": "closed", "seconds": S}                 back-to-back requests: capacity in requests/s
    {"cmd": "open", "phases": [[S, RPS], ...], "seed": K, "start_in": 0.3, "arrivals": "paced"}
                                                    open-loop arrivals ("paced": evenly spaced, "poisson":
                                                    exponential gaps, the default), FIFO queue, one request
                                                    at a time; latency = completion - arrival
    {"cmd": "train", "seconds": S}                  training steps for S seconds: step completion times
    {"cmd": "quit"}

The first line is {"ready": true, ...} once the model is loaded and warm.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
import torchvision
from schedule import arrivals


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Inference:
    def __init__(self, batch: int, fp16: bool) -> None:
        torch.backends.cudnn.benchmark = True
        model = torchvision.models.resnet50(weights=None).cuda().eval()
        dtype = torch.float16 if fp16 else torch.float32
        self.model = model.to(dtype)
        self.x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)
        for _ in range(30):
            self.once()

    def once(self) -> None:
        with torch.inference_mode():
            self.model(self.x)
        torch.cuda.synchronize()

    def closed(self, seconds: float) -> dict:
        t0 = time.monotonic()
        lat = []
        while time.monotonic() - t0 < seconds:
            a = time.monotonic()
            self.once()
            lat.append(time.monotonic() - a)
        took = time.monotonic() - t0
        lat.sort()
        return {"n": len(lat), "seconds": took, "rps": len(lat) / took,
                "p50_ms": 1000 * lat[len(lat) // 2], "min_ms": 1000 * lat[0], "t0": t0, "t1": t0 + took}

    def open(self, phases: list[list[float]], seed: int, start_in: float, process: str) -> dict:
        start = time.monotonic() + start_in
        arr = arrivals(phases, seed, start, process)
        done = []
        for a in arr:
            now = time.monotonic()
            if a > now:
                time.sleep(a - now)
            self.once()
            done.append(time.monotonic())
        return {"start": start, "arrivals": arr, "completions": done}


class Training:
    def __init__(self, batch: int) -> None:
        torch.backends.cudnn.benchmark = True
        self.model = torchvision.models.resnet50(weights=None).cuda().train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x = torch.randn(batch, 3, 224, 224, device="cuda")
        self.y = torch.randint(0, 1000, (batch,), device="cuda")
        for _ in range(5):
            self.step()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        torch.cuda.synchronize()

    def train(self, seconds: float) -> dict:
        t0 = time.monotonic()
        steps = []
        while time.monotonic() - t0 < seconds:
            self.step()
            steps.append(time.monotonic())
        return {"t0": t0, "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["inference", "training"])
    ap.add_argument("--batch", type=int)
    ap.add_argument("--fp32", action="store_true")
    args = ap.parse_args()
    t = time.monotonic()
    if args.role == "inference":
        worker: Inference | Training = Inference(args.batch or 8, not args.fp32)
    else:
        worker = Training(args.batch or 64)
    say({"ready": True, "role": args.role, "torch": torch.__version__, "torchvision": torchvision.__version__,
         "device": torch.cuda.get_device_name(0), "load_s": time.monotonic() - t})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            c = json.loads(line)
            if c["cmd"] == "quit":
                break
            if c["cmd"] == "closed" and isinstance(worker, Inference):
                say({"ok": True, **worker.closed(float(c["seconds"]))})
            elif c["cmd"] == "open" and isinstance(worker, Inference):
                say({"ok": True, **worker.open(c["phases"], int(c.get("seed", 1)), float(c.get("start_in", 0.3)),
                                                 c.get("arrivals", "poisson"))})
            elif c["cmd"] == "train" and isinstance(worker, Training):
                say({"ok": True, **worker.train(float(c["seconds"]))})
            else:
                say({"ok": False, "error": f"unknown command for {args.role}: {c}"})
        except Exception as e:  # noqa: BLE001 - answer, so the orchestrator does not wait for nothing
            say({"ok": False, "error": repr(e)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
