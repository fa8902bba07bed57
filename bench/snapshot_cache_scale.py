"""The leader's snapshot cache (`service.SnapshotCache.cluster`) at 40,008 GPUs and about 32,000 instances, without
Redis: a tick with nothing changed, and a tick right after one lit GPU's budget changed (a reservation released).
CPU ms of this process, median of 7. Run it against two trees to compare them (one JSON line each):

    PYTHONPATH=TREE python3 bench/snapshot_cache_scale.py LABEL
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time

from dilu_invoker.gpu.budgets import GpuBudget, GpuCapacity, Reservation
from dilu_invoker.loadbalancer.service import SnapshotCache
from dilu_invoker.wire import FunctionSpec, GpuReport, LoadReport

INVOKERS, GPUS = 10002, 4


def main() -> None:
    rng = random.Random(1)
    specs: dict[str, FunctionSpec] = {}
    reports: dict[str, LoadReport] = {}
    budgets: dict[str, GpuBudget | None] = {}
    k = 0
    for n in range(INVOKERS):
        name = f"inv{n}"
        gpus = tuple(GpuReport(index=i, uuid=f"{name}-g{i}", memory_mb=40960, sm_count=132) for i in range(GPUS))
        reports[name] = LoadReport(invoker=name, boot="b", at_ms=0, gpus=gpus)
        for g in gpus:
            cap = GpuCapacity(node=name, index=g.index, name="t", memory_mb=40960, sm_count=132)
            res = {}
            if k < 32000 and rng.random() < 0.8:
                fn = f"guest/f{k}"
                specs[fn] = FunctionSpec(fqn=fn, rev="r1", kind="python:3", cls="inference", request=0.2, limit=0.4,
                                         memory_mb=1000)
                res = {f"i{k}": Reservation(instance=f"i{k}", function=fn, cls="inference", invoker=name, request=0.2,
                                            limit=0.4, memory_mb=1000)}
                k += 1
            budgets[g.uuid] = GpuBudget(g.uuid, cap, res)
    cache = SnapshotCache()
    cache.cluster(0.0, reports, specs, budgets)
    gc.collect()
    lit = [u for u, b in budgets.items() if b is not None and b.reservations]
    same, changed = [], []
    for t in range(7):
        c = time.process_time()
        cache.cluster(1.0 + t, reports, specs, budgets)
        same.append(time.process_time() - c)
        u = lit[t * 101]
        b = budgets[u]
        assert b is not None
        budgets[u] = GpuBudget(u, b.capacity, {})
        c = time.process_time()
        cache.cluster(1.5 + t, reports, specs, budgets)
        changed.append(time.process_time() - c)
    print(json.dumps({"tree": sys.argv[1] if len(sys.argv) > 1 else "", "instances": k, "gpus": INVOKERS * GPUS,
                      "same_ms": round(1000 * statistics.median(same), 1),
                      "changed_ms": round(1000 * statistics.median(changed), 1)}))


if __name__ == "__main__":
    main()
