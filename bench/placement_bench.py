"""Placement speed and packing on a synthetic Dilu-style instance trace.

    /work/venv/bin/python bench/placement_bench.py [--instances 3200] [--strategy all] [--seed 1]

The trace follows the mix described for Dilu's large-scale simulation (prior-art.md §1.2): 20% LLM
inference (1 GPU, 20–30 GiB, request 0.4–0.6), a share of 2- or 4-GPU training jobs (25–40 GiB per
GPU, request 0.4–0.8), the rest small inference (1 GPU, 3–10 GiB, request 0.2–0.4); one start per
second; 60% of the instances (inference only) stop after 1–3 min and 10% (training) after 10–15 min.
GPUs have 40 GiB. Prints, per strategy, wall time, peak and time-mean lit GPUs and the lower bound.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from dilu_invoker.policy import (
    STRATEGIES,
    ClusterSnapshot,
    InstanceClass,
    PlacementConfig,
    PlacementRequest,
    apply_placement,
    cluster_fragmentation,
    cluster_lower_bound,
    compaction_plan,
    place,
)

GIB = 1024.0


@dataclass(frozen=True)
class Event:
    t: float
    op: str
    request: PlacementRequest


def make_trace(n: int, train_fraction: float, seed: int) -> list[Event]:
    rng = random.Random(seed)
    n_llm = int(n * 0.2)
    n_train = int(n * train_fraction)
    n_inf = n - n_llm - n_train
    reqs: list[PlacementRequest] = []
    for i in range(n_train):
        r = round(rng.uniform(0.4, 0.8), 2)
        lim = min(1.0, max(r + 0.2, round(rng.uniform(0.6, 1.0), 2)))
        reqs.append(
            PlacementRequest(
                instance_id=f"train-{i}",
                function=f"train-{i}",
                cls=InstanceClass.TRAINING,
                request=r,
                limit=lim,
                memory_mib=rng.choice([25, 30, 35, 40]) * GIB,
                gpus=rng.choice([2, 4]),
            )
        )
    for i in range(n_inf):
        r = round(rng.uniform(0.2, 0.4), 2)
        lim = max(r + 0.2, round(rng.uniform(0.3, 0.6), 2))
        reqs.append(
            PlacementRequest(
                instance_id=f"inf-{i}",
                function=f"inf-{i}",
                cls=InstanceClass.INFERENCE,
                request=r,
                limit=round(lim, 2),
                memory_mib=rng.randint(3, 10) * GIB,
            )
        )
    for i in range(n_llm):
        r = round(rng.uniform(0.4, 0.6), 2)
        lim = round(rng.uniform(r + 0.2, max(r + 0.2, 0.8)), 2)
        reqs.append(
            PlacementRequest(
                instance_id=f"llm-{i}",
                function=f"llm-{i}",
                cls=InstanceClass.LLM,
                request=r,
                limit=lim,
                memory_mib=rng.randint(20, 30) * GIB,
            )
        )
    rng.shuffle(reqs)
    events = [Event(float(i), "create", r) for i, r in enumerate(reqs)]
    inference = [e for e in events if e.request.cls is not InstanceClass.TRAINING]
    for e in rng.sample(inference, min(int(n * 0.6), len(inference))):
        events.append(Event(e.t + 60 * rng.randint(1, 3), "delete", e.request))
    training = [
        e
        for e in events
        if e.request.cls is InstanceClass.TRAINING and e.op == "create"
    ]
    for e in rng.sample(training, min(int(n * 0.1), len(training))):
        events.append(Event(e.t + 60 * rng.randint(10, 15), "delete", e.request))
    events.sort(key=lambda e: (e.t, e.op != "delete"))
    return events


def run(
    events: list[Event], strategy: str, gpus: int, compact_every: float
) -> dict[str, float]:
    config = PlacementConfig(strategy=strategy)
    cluster = ClusterSnapshot.uniform(
        invokers=gpus // 4, gpus_per_invoker=4, memory_mib=40 * GIB
    )
    rejected = 0
    peak = peak_lb = 0
    area = area_lb = frag_area = 0.0
    moves = 0
    last_t = events[0].t
    next_compact = compact_every
    t0 = time.perf_counter()
    for e in events:
        dt = e.t - last_t
        area += dt * cluster.lit_count
        area_lb += dt * cluster_lower_bound(cluster)
        frag_area += dt * cluster_fragmentation(cluster).sm_mean
        last_t = e.t
        if e.op == "create":
            d = place(cluster.at(e.t), e.request, config)
            if d.placed:
                cluster = apply_placement(cluster, e.request, d)
            else:
                rejected += 1
        elif cluster.has_instance(e.request.instance_id):
            cluster = cluster.without_instance(e.request.instance_id)
        if compact_every and e.t >= next_compact:
            next_compact = e.t + compact_every
            plan = compaction_plan(cluster, config)
            cluster = plan.cluster
            moves += len(plan.moves)
        peak = max(peak, cluster.lit_count)
        peak_lb = max(peak_lb, cluster_lower_bound(cluster))
    wall = time.perf_counter() - t0
    span = events[-1].t - events[0].t
    return {
        "wall_s": wall,
        "rejected": rejected,
        "peak": peak,
        "peak_lb": peak_lb,
        "mean": area / span,
        "mean_lb": area_lb / span,
        "sm_frag": frag_area / span,
        "moves": moves,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=3200)
    ap.add_argument("--train-fraction", type=float, default=0.1)
    ap.add_argument("--gpus", type=int, default=1600)
    ap.add_argument("--strategy", default="all")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--compact-every",
        type=float,
        default=0.0,
        help="seconds of trace time; 0 = never",
    )
    args = ap.parse_args()
    events = make_trace(args.instances, args.train_fraction, args.seed)
    names = sorted(STRATEGIES) if args.strategy == "all" else [args.strategy]
    print(f"{len(events)} events, {args.instances} instances, {args.gpus} GPUs")
    for name in names:
        r = run(events, name, args.gpus, args.compact_every)
        print(
            f"{name:10s} {r['wall_s']:6.2f} s  rejected {r['rejected']:4.0f}  "
            f"peak {r['peak']:5.0f} (bound {r['peak_lb']:5.0f}, {r['peak'] / r['peak_lb']:.3f}x)  "
            f"mean {r['mean']:7.1f} (bound {r['mean_lb']:7.1f}, {r['mean'] / r['mean_lb']:.3f}x)  "
            f"SM frag {r['sm_frag']:.3f}  moves {r['moves']:.0f}"
        )


if __name__ == "__main__":
    main()
