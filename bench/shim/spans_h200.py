#!/usr/bin/env python3
"""GPU proof of the shim's request spans: do they measure what a PyTorch request takes?

    python3 bench/shim/spans_h200.py run --out DIR [--requests 200] [--python PY]

A worker process under the shim (no rate limit) serves ResNet-50 batch-1 requests (torchvision, random
weights; an MLP when torchvision is missing) in three ways: forward + torch.cuda.synchronize() (closes a
span in cuCtxSynchronize), forward + .cpu() (cuStreamSynchronize), and a CUDA-graph replay +
synchronize. Each request's wall time is measured in the worker; after each request it waits for the
stats block to show exactly one more span and pairs that span with the request. Then the same again while
a second process (without the shim) runs large matmuls on the GPU: the spans must stretch with the wall
times. Writes DIR/spans_results.json; stdlib only here, torch only in the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "cuda_shim" / "build" / "libdilu_shim.so"


# The shim's stats ABI, loaded by the shim benchmark beside this script (run as a script, its folder is on
# sys.path) without importing the dilu_invoker package.
from h200 import abi

# ---- the worker (under the shim, with torch) -------------------------------------------------------


def _model() -> tuple[Any, Any, str]:
    import torch

    try:
        import torchvision

        return torchvision.models.resnet50().cuda().eval(), torch.randn(1, 3, 224, 224, device="cuda"), "resnet50"
    except ImportError:
        layers = [torch.nn.Linear(4096, 4096) for _ in range(24)]
        return torch.nn.Sequential(*layers).cuda().eval(), torch.randn(8, 4096, device="cuda"), "mlp24x4096"


def worker(args: argparse.Namespace) -> int:
    import torch

    stats = abi.StatsFile.open(args.stats)
    model, x, name = _model()
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(5):
                model(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            model(x)
        for _ in range(20):
            model(x)
        torch.cuda.synchronize()

    def sync_forward() -> None:
        model(x)
        torch.cuda.synchronize()

    def cpu_forward() -> None:
        model(x).cpu()

    def graph_replay() -> None:
        graph.replay()
        torch.cuda.synchronize()

    out: dict[str, Any] = {"model": name, "variants": {}}
    with torch.inference_mode():
        for variant, fn in (("synchronize", sync_forward), ("cpu_copy", cpu_forward), ("graph", graph_replay)):
            rows = []
            for _ in range(args.requests):
                before = stats.snapshot().spans
                t0 = time.monotonic_ns()
                fn()
                wall_us = (time.monotonic_ns() - t0) / 1000
                end = time.monotonic() + 0.05
                while (snap := stats.snapshot()).spans == before and time.monotonic() < end:
                    time.sleep(0.0005)
                rows.append({"wall_us": round(wall_us, 1), "new_spans": snap.spans - before,
                             "span_us": snap.recent_spans_us[-1] if snap.spans > before else None,
                             "open_after": snap.span_open_ns != 0})
                time.sleep(args.gap_ms / 1000)
            out["variants"][variant] = rows
    Path(args.result).write_text(json.dumps(out))
    return 0


def contender(args: argparse.Namespace) -> int:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for _ in range(4):
            a @ a
        torch.cuda.synchronize()
    return 0


# ---- the driver (stdlib) ------------------------------------------------------------------------------


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    paired = [r for r in rows if r["new_spans"] == 1 and r["span_us"] is not None]
    ratios = [r["span_us"] / r["wall_us"] for r in paired if r["wall_us"] > 0]
    return {
        "requests": len(rows),
        "exactly_one_span": len(paired),
        "span_left_open": sum(r["open_after"] for r in rows),
        "wall_p50_us": statistics.median(r["wall_us"] for r in rows) if rows else None,
        "span_p50_us": statistics.median(r["span_us"] for r in paired) if paired else None,
        "span_over_wall_p10": statistics.quantiles(ratios, n=10)[0] if len(ratios) >= 10 else None,
        "span_over_wall_p50": statistics.median(ratios) if ratios else None,
        "span_over_wall_p90": statistics.quantiles(ratios, n=10)[-1] if len(ratios) >= 10 else None,
        "span_longer_than_wall": sum(r > 1.0 for r in ratios),
    }


def _phase(py: str, out: Path, label: str, requests: int, gap_ms: float, contend_s: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="dilu-spans-"))
    ctl, st = abi.create_instance_files(root, label, abi.Quota(stale_after_ns=0))
    ctl.close()
    st.close()
    env = dict(os.environ, LD_PRELOAD=str(SHIM), DILU_SHIM_CONTROL=str(root / label / "control"),
               DILU_SHIM_STATS=str(root / label / "stats"))
    result = out / f"spans_{label}_raw.json"
    other = None
    if contend_s > 0:
        other = subprocess.Popen([py, __file__, "contender", "--seconds", str(contend_s)])
        time.sleep(5)  # let it import torch and start its matmuls
    try:
        proc = subprocess.run([py, __file__, "worker", "--stats", str(root / label / "stats"), "--requests",
                               str(requests), "--gap-ms", str(gap_ms), "--result", str(result)],
                              env=env, capture_output=True, text=True, timeout=240, check=False)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    if proc.returncode != 0 or not result.exists():
        return {"error": f"worker exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
    raw = json.loads(result.read_text())
    return {"model": raw["model"], "variants": {v: _summary(rows) for v, rows in raw["variants"].items()}}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"shim": str(SHIM), "requests": args.requests, "gap_ms": args.gap_ms}
    if not SHIM.exists():
        results["error"] = "shim not built (make -C cuda_shim)"
    else:
        results["solo"] = _phase(args.python, out, "solo", args.requests, args.gap_ms, 0)
        results["contended"] = _phase(args.python, out, "contended", args.requests, args.gap_ms, 150)
    (out / "spans_results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--requests", type=int, default=200)
    r.add_argument("--gap-ms", type=float, default=5.0)
    r.add_argument("--python", default=sys.executable)
    w = sub.add_parser("worker")
    w.add_argument("--stats", required=True)
    w.add_argument("--requests", type=int, required=True)
    w.add_argument("--gap-ms", type=float, required=True)
    w.add_argument("--result", required=True)
    c = sub.add_parser("contender")
    c.add_argument("--seconds", type=float, required=True)
    args = ap.parse_args()
    return {"run": run, "worker": worker, "contender": contender}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
