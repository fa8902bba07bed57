"""Diagnosis on a GPU machine (run as root, no other MPS daemon): does an MPS client priority protect a
latency-critical client from a best-effort one on the same GPU?

Starts an MPS control daemon in a private pipe directory, then for each condition runs a best-effort
ResNet-50 training loop (fp16, batch 32) in one client process and a ResNet-50 inference client (fp16, batch
8, paced at ``--load`` of its solo rate) in another, and reports the inference client's p50/p99 and the
training loop's iterations per second. Conditions: inference alone, training alone, both with equal
priority, training at ``CUDA_MPS_CLIENT_PRIORITY=1`` (below normal), each also with training capped by
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``. Harness only: the product's numbers come from bench/gpu_product.py.

    python3 bench/mps_priority.py --out OUT/mps_priority.json [--seconds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLIENT = r'''
import json, sys, time
import torch, torchvision
role, seconds, period_ms = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
torch.backends.cudnn.benchmark = True
if role == "train":
    m = torchvision.models.resnet50().cuda().half().train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(32, 3, 224, 224, device="cuda", dtype=torch.half)
    y = torch.randint(0, 1000, (32,), device="cuda")
    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
else:
    m = torchvision.models.resnet50().cuda().half().eval()
    x = torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.half)
    def step():
        with torch.no_grad():
            m(x)
for _ in range(15):
    step()
torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.readline()
lat, n, t0 = [], 0, time.perf_counter()
nxt = t0
while time.perf_counter() - t0 < seconds:
    if period_ms > 0:
        now = time.perf_counter()
        if now < nxt:
            time.sleep(nxt - now)
        nxt += period_ms / 1000
    s = time.perf_counter()
    step()
    torch.cuda.synchronize()
    lat.append((time.perf_counter() - s) * 1000)
    n += 1
el = time.perf_counter() - t0
lat.sort()
print(json.dumps({"role": role, "n": n, "per_s": round(n / el, 2), "p50_ms": round(lat[len(lat) // 2], 3),
                  "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3)}), flush=True)
'''


def start(role: str, seconds: float, period_ms: float, env: dict[str, str], script: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, str(script), role, str(seconds), str(period_ms)], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith("READY"):
        raise RuntimeError(f"{role} client did not start: {line!r}")
    return p


def finish(p: subprocess.Popen[str]) -> dict:
    out, _ = p.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--load", type=float, default=0.5, help="inference's arrival rate as a fraction of its solo rate")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctl = shutil.which("nvidia-cuda-mps-control") or "/usr/bin/nvidia-cuda-mps-control"
    work = Path(tempfile.mkdtemp(prefix="dilu-mps-prio."))
    (work / "pipe").mkdir()
    (work / "log").mkdir()
    script = work / "client.py"
    script.write_text(CLIENT)
    base = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(work / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(work / "log")}
    subprocess.run([ctl, "-d"], env=base, check=True)
    time.sleep(1)
    results: dict = {"machine": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                               capture_output=True, text=True).stdout.strip(), "conditions": []}
    try:
        solo = start("infer", args.seconds, 0, base, script)
        solo.stdin.write("\n"); solo.stdin.flush()  # noqa: E702
        s = finish(solo)
        period = s["p50_ms"] / args.load
        results["solo_infer"] = s
        results["period_ms"] = round(period, 3)
        conds = [("train alone", None, {}), ("both, equal priority", period, {}),
                 ("both, training priority 1", period, {"CUDA_MPS_CLIENT_PRIORITY": "1"}),
                 ("both, training 50% threads", period, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}),
                 ("both, training 50% threads, priority 1", period,
                  {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_CLIENT_PRIORITY": "1"})]
        for name, per, train_env in conds:
            tr = start("train", args.seconds, 0, {**base, **train_env}, script)
            inf = start("infer", args.seconds, per, base, script) if per is not None else None
            for p in (tr, inf):
                if p is not None:
                    p.stdin.write("\n"); p.stdin.flush()  # noqa: E702
            row = {"name": name, "train_env": train_env, "train": finish(tr)}
            if inf is not None:
                row["infer"] = finish(inf)
            results["conditions"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))  # a clipped run keeps what it measured
    finally:
        subprocess.run([ctl], input="quit\n", env=base, text=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
