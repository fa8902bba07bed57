"""ResNet-50 inference latency (torchvision, random weights) for the shim benchmark (d).

    python3 bench/shim/resnet_bench.py [--batches 1 32] [--iters 300 60] [--graph-check]

Prints one JSON object: per batch size the p50/p90/mean latency of a synchronised
forward pass. With --graph-check it also captures the batch-1 forward in a CUDA graph
and replays it, so a run under the shim exercises capture and graph costing on the
real driver.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torchvision


def latencies(
    model: torch.nn.Module, x: torch.Tensor, iters: int, warmup: int
) -> list[float]:
    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        torch.cuda.synchronize()
        out = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            model(x)
            torch.cuda.synchronize()
            out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]


def graph_check(model: torch.nn.Module) -> dict[str, object]:
    x = torch.randn(1, 3, 224, 224, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(s):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(g):
        model(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    replays = 20
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return {
        "replays": replays,
        "replay_ms_mean": (time.perf_counter_ns() - t0) / 1e6 / replays,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--iters", type=int, nargs="+", default=[300, 60])
    ap.add_argument("--graph-check", action="store_true")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = False
    model = torchvision.models.resnet50(weights=None).cuda().eval()
    result: dict[str, object] = {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
    }
    per_batch = {}
    for batch, iters in zip(args.batches, args.iters, strict=True):
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        lat = latencies(model, x, iters, warmup=max(10, iters // 5))
        per_batch[str(batch)] = {
            "iters": iters,
            "p50_ms": pct(lat, 0.5),
            "p90_ms": pct(lat, 0.9),
            "mean_ms": statistics.fmean(lat),
            "min_ms": min(lat),
        }
    result["batches"] = per_batch
    if args.graph_check:
        try:
            result["graph"] = graph_check(model)
        except Exception as e:  # noqa: BLE001 - report it; the latencies above still count
            result["graph"] = {"error": repr(e)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
