"""What one live balancer tick costs at scale: `plan_tick` with the live defaults on N one-GPU instances.

    PYTHONPATH=. python3 bench/planner_scale.py [--sizes 1000,3200,10000] [--ticks 20] [--redis [--busy 0.5]] [--out FILE.md] [--json FILE]

The leader runs `loadbalancer.planner.plan_tick` every `--balancer-tick-s` (1 s): a tick that takes longer
than that delays every placement and routing table. Here the invokers are simulated (bench/live_replay.py:
each reports its records' instances ready, its GPU budgets hold them), the planner is the balancer's own
with a default configuration (`service.planner_config(Config())`), and N functions each want one instance
(min-instances 1): the first N creates of `dilu_mix(N, train_fraction=0, llm_fraction=0.2, seed)` (the live
planner places one-GPU instances only, so no training gangs), on enough 4-GPU nodes of 40 GiB GPUs.

Per size, CPU seconds (`time.process_time`, this process alone):
- place all: the tick that places all N at once (a balancer taking over an empty cluster with N functions);
- steady: `--ticks` ticks where nothing changes (median and max), once every scaler window has settled (the
  `--balancer-window` ticks after the instances are ready; a tick repeats a function's hold only then,
  `planner.PlanMemo`);
- 1 % changed: `--ticks` ticks, each right after 1 % of the functions (another 1 % each time) had their spec
  changed (max-instances 1 ↔ 2: re-planned, the same hold), median;
- cold: a steady tick planned without the last plan's memo (every function from scratch: a new leader's
  first tick, and what every tick cost before the memo);
- churn: a tick in which 1 % of the functions scale to zero (idle at min-instances 0) and 1 % new ones arrive;
- compaction: the next tick, with compaction due (the live `LIVE_COMPACTION`, 2 moves);
- build: reading the reports and building the cluster snapshot, as the service does from Redis every tick
  (the Redis reads themselves are not in it);
- with `--redis`: the tick's read of every live GPU's budget from a real redis-server (loopback, the same
  `EmbeddedRedis` standalone runs) holding the placed instances' reservations, wall seconds, median of 5:
  one `GpuBudgets.get` after another (each GPU's hash, then the clock: two round trips a GPU) against one
  `GpuBudgets.get_many` (one pipeline), which the balancer uses to read what changed;
- with `--redis`, the read path: the leader's whole read of a steady tick (`service_reads`: the reports, the
  function registry, the budgets and the snapshot, through the `Balancer`'s own methods) from a real
  redis-server holding what invokers and routers write; CPU and wall seconds, median of 5 after a first read.
  Before each read every invoker writes its report anew (`live_replay.live_figures`): the clock moves, and so
  do the figures of a `--busy` fraction (0.5) of the instances, drawn from the seed and the tick.
  Before each of the 5, the budgets of one GPU in `--gpu-reservation-ttl-s` / `--balancer-tick-s` (30) change.
  Those are read again with the same content (a renewed lease), so the steady snapshot is the last one at the new
  time (`service.SnapshotCache`); "snapshot" is `cluster_of` from scratch, and "snapshot, a budget changed" the
  cache's answer when one lit GPU's budget did change (a reservation released), median of 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from live_replay import GPU_MIB, GPUS_PER_NODE, LiveHarness, live_figures
from loadgen import cpu_model

from dilu_invoker.config import Config
from dilu_invoker.gpu.budgets import GpuBudgets, GpuCapacity, Reservation
from dilu_invoker.loadbalancer.service import Balancer, SnapshotCache, cluster_of, planner_config
from dilu_invoker.redis_embedded import EmbeddedRedis, redis_client
from dilu_invoker.sim.events import CREATE
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import cluster_size
from dilu_invoker.wire import FunctionSpec, Keys, LoadReport, pack


def spec_of(ev: Any) -> FunctionSpec:
    s = ev.spec
    return FunctionSpec(fqn=ev.instance, rev="1-a", kind="python:3-gpu", cls=s.cls.value, request=s.sm_request,
                        limit=s.sm_limit, memory_mb=int(s.memory_mib), min_instances=1, max_instances=1,
                        capacity_rps=1.0, user_memory_mb=256)


async def budget_reads(live: LiveHarness) -> dict[str, float]:
    """Every GPU of the harness registered in a real redis-server with its records' reservations; the wall
    seconds (median of 5) of reading them all one GPU after another, and in one pipeline."""
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis(tmp, persistent=False) as server:
            client = redis_client(server.url)
            budgets = GpuBudgets(client)
            uuids = [f"{inv}-g{i}" for inv in live.invokers for i in range(GPUS_PER_NODE)]
            for inv in live.invokers:
                for i in range(GPUS_PER_NODE):
                    await budgets.register_gpu(f"{inv}-g{i}", GpuCapacity(node=inv, index=i, name="bench",
                                                                          memory_mb=GPU_MIB, sm_count=132))
            for r in live.records.values():
                if r.gpu is not None:
                    await budgets.reserve(f"{r.invoker}-g{r.gpu}", Reservation(
                        instance=r.id, function=r.function, invoker=r.invoker, cls=r.cls, request=r.request,
                        limit=r.limit, memory_mb=r.memory_mb), ttl_s=3600, force=True)
            one_by_one, pipelined = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                each = [await budgets.get(u) for u in uuids]
                t1 = time.perf_counter()
                many = await budgets.get_many(uuids)
                t2 = time.perf_counter()
                assert list(many.values()) == each
                one_by_one.append(t1 - t0)
                pipelined.append(t2 - t1)
            await client.aclose()
    return {"gpus_read": len(uuids), "read_one_by_one_s": statistics.median(one_by_one),
            "read_pipelined_s": statistics.median(pipelined)}


async def _fill_budgets(budgets: GpuBudgets, live: LiveHarness) -> None:
    """Register every GPU of the harness and reserve its records' instances, through the scripts the service
    and the invokers use (a few calls at a time)."""
    calls: list[Any] = [budgets.register_gpu(f"{inv}-g{i}", GpuCapacity(node=inv, index=i, name="bench",
                                                                         memory_mb=GPU_MIB, sm_count=132))
                        for inv in live.invokers for i in range(GPUS_PER_NODE)]
    for k in range(0, len(calls), 64):
        await asyncio.gather(*calls[k : k + 64])
    calls = [budgets.reserve(f"{r.invoker}-g{r.gpu}", Reservation(
        instance=r.id, function=r.function, invoker=r.invoker, cls=r.cls, request=r.request, limit=r.limit,
        memory_mb=r.memory_mb), ttl_s=3600, force=True) for r in live.records.values() if r.gpu is not None]
    for k in range(0, len(calls), 64):
        await asyncio.gather(*calls[k : k + 64])


async def _write_reports(client: Any, keys: Keys, reports: dict[str, LoadReport]) -> None:
    names = list(reports)
    for k in range(0, len(names), 1000):
        async with client.pipeline(transaction=False) as pipe:
            for name in names[k : k + 1000]:
                pipe.set(keys.report(name), pack(reports[name]))
            await pipe.execute()


async def service_reads(live: LiveHarness, rounds: int = 5, seed: int = 1, busy: float = 0.5) -> dict[str, Any]:
    """The leader's whole read path of a steady tick against a real redis-server holding what the invokers and
    routers write (every live invoker's load report, every function's registry hash, every GPU's budget with
    its instances' reservations): `Balancer._read_reports`, `_read_specs` and `_cluster` (the budgets, then the
    snapshot), as `Balancer.tick` calls them. CPU seconds of this process (the decoding, redis-py's parsing,
    the snapshot's worker thread; not the redis-server's) and wall seconds, median of `rounds` reads after a
    first one (a leader's first tick reads everything; later ones may use what it read before). Before each
    read every invoker publishes its report anew, as live invokers do every period (`live_replay.live_figures`:
    the clock and the figures of the `busy` fraction of the instances move, the rest stays)."""
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis(tmp, persistent=False) as server:
            client = redis_client(server.url)
            cfg = Config()
            keys = Keys(cfg.redis.prefix)
            balancer = Balancer(client, cfg, holder="bench")
            reports = live.reports()
            async with client.pipeline(transaction=False) as pipe:
                pipe.sadd(keys.invokers, *reports)
                pipe.sadd(keys.functions, *live.specs)
                for fqn, spec in live.specs.items():
                    doc = json.dumps({"namespace": "bench", "name": fqn, "exec": {"kind": spec.kind, "code": "x" * 64},
                                      "annotations": [{"key": "gpu-memory-mb", "value": spec.memory_mb}]})
                    pipe.hset(keys.function(fqn), mapping={"rev": spec.rev, "doc": doc, "meta": pack(spec)})
                await pipe.execute()
            await _fill_budgets(balancer.budgets, live)
            parts: dict[str, list[tuple[float, float]]] = {"reports": [], "specs": [], "budgets+snapshot": [],
                                                           "snapshot": [], "total": []}
            uuids = [f"{inv}-g{i}" for inv in live.invokers for i in range(GPUS_PER_NODE)]
            ttl_ticks = round(cfg.gpu.reservation_ttl_s / cfg.balancer.tick_s)
            for k in range(rounds + 1):
                await _write_reports(client, keys, live_figures(reports, k, seed, busy))
                if k:
                    # Between two ticks, the budgets of a lease's worth of GPUs change (re-registered: the same
                    # capacity, marked changed), as many as a leader that re-reads the GPUs whose reservations'
                    # leases as read have passed (renewals do not mark them) reads each tick.
                    for j in range(k, len(uuids), ttl_ticks):
                        inv, i = uuids[j].rsplit("-g", 1)
                        await balancer.budgets.register_gpu(uuids[j], GpuCapacity(
                            node=inv, index=int(i), name="bench", memory_mb=GPU_MIB, sm_count=132))
                c0, w0 = time.process_time(), time.perf_counter()
                got, _known = await balancer._read_reports()
                c1, w1 = time.process_time(), time.perf_counter()
                specs = await balancer._read_specs()
                c2, w2 = time.process_time(), time.perf_counter()
                cluster, _evictable = await balancer._cluster(time.time(), got, specs)
                c3, w3 = time.process_time(), time.perf_counter()
                assert cluster is not None and len(got) == len(reports) and len(specs) == len(live.specs)
                if k == 0:
                    first = (c3 - c0, w3 - w0)
                    budgets = await balancer.budgets.get_many(
                        list(dict.fromkeys(g.uuid for rep in got.values() for g in rep.gpus)))
                    placed = sum(len(b.reservations) for b in budgets.values() if b is not None)
                    assert placed == sum(1 for r in live.records.values() if r.gpu is not None)
                    continue
                c4 = time.process_time()
                cluster_of(time.time(), got, specs, budgets)
                c5 = time.process_time()
                for part, value in (("reports", (c1 - c0, w1 - w0)), ("specs", (c2 - c1, w2 - w1)),
                                    ("budgets+snapshot", (c3 - c2, w3 - w2)), ("snapshot", (c5 - c4, c5 - c4)),
                                    ("total", (c3 - c0, w3 - w0))):
                    parts[part].append(value)
            parts["snapshot_changed"] = await _snapshot_changed(balancer, got, specs)
            await client.aclose()
    out: dict[str, Any] = {"read_first_cpu_s": first[0], "read_first_wall_s": first[1]}
    for part, values in parts.items():
        out[f"read_{part}_cpu_s"] = statistics.median(v[0] for v in values)
        out[f"read_{part}_wall_s"] = statistics.median(v[1] for v in values)
    return out


async def _snapshot_changed(balancer: Balancer, reports: dict[str, LoadReport], specs: dict[str, FunctionSpec],
                            rounds: int = 3) -> list[tuple[float, float]]:
    """CPU seconds of the leader's snapshot (`SnapshotCache.cluster`) right after one lit GPU's budget changed
    (one reservation released): that GPU rebuilt, the snapshot built again from every GPU's state."""
    budgets = dict(await balancer._budget_cache.get_many(
        list(dict.fromkeys(g.uuid for rep in reports.values() for g in rep.gpus))))
    cache = SnapshotCache()
    cache.cluster(time.time(), reports, specs, budgets)
    lit = [u for u, b in budgets.items() if b is not None and b.reservations]
    out = []
    for u in lit[:: max(1, len(lit) // rounds)][:rounds]:
        b = budgets[u]
        assert b is not None
        gone = next(iter(b.reservations))
        budgets[u] = replace(b, reservations={k: r for k, r in b.reservations.items() if k != gone})
        c0 = time.process_time()
        cluster, _evictable = cache.cluster(time.time(), reports, specs, budgets)
        c1 = time.process_time()
        assert cluster is not None
        assert gone not in {i.id for g in cluster.gpus if g.uuid == u for i in g.instances}
        out.append((c1 - c0, c1 - c0))
    return out


def run_size(n: int, ticks: int, seed: int, redis: bool = False, busy: float = 0.5) -> dict[str, Any]:
    creates = [ev for ev in dilu_mix(2 * n, train_fraction=0.0, llm_fraction=0.2, seed=seed)
               if ev.op == CREATE and ev.spec is not None and ev.spec.gpus == 1]
    first, spare = creates[:n], creates[n:]
    assert len(first) == n and len(spare) >= n // 100, "the trace has too few one-GPU creates"
    nodes = cluster_size(first, GPUS_PER_NODE) // GPUS_PER_NODE
    live = LiveHarness(nodes, planner_config(Config()))
    live.specs.update((ev.instance, spec_of(ev)) for ev in first)
    now = 0.0
    plan = live.tick(now)
    place_all = live.last_plan_s
    placed = sum(1 for d in plan.decisions if d.kind == "place")
    now += 1.0
    live.tick(now)  # the invokers report them ready
    for _ in range(Config().balancer.window):  # every scaler window fills with the same samples
        now += 1.0
        live.tick(now)
    steady, builds = [], []
    for _ in range(ticks):
        now += 1.0
        live.tick(now)
        steady.append(live.last_plan_s)
        builds.append(live.last_build_s)
    changed = []
    names = sorted(live.specs)
    for k in range(ticks):
        for fqn in names[k % 100 :: 100]:
            s = live.specs[fqn]
            live.specs[fqn] = replace(s, max_instances=3 - s.max_instances)
        now += 1.0
        live.tick(now)
        changed.append(live.last_plan_s)
    live.incremental = False
    now += 1.0
    live.tick(now)
    cold = live.last_plan_s
    live.incremental = True
    # Churn: 1 % of the functions fall to min-instances 0 and have been idle past --balancer-scale-to-zero-after-s
    # (the clock jumps past it: they scale to zero), and 1 % new ones arrive.
    for fqn in sorted(live.specs)[:: 100][: n // 100]:
        live.specs[fqn] = replace(live.specs[fqn], min_instances=0)
    live.specs.update((ev.instance, spec_of(ev)) for ev in spare[: n // 100])
    now += Config().balancer.scale_to_zero_after_s + 1.0
    plan = live.tick(now)
    churn = live.last_plan_s
    churn_decisions = {"place": sum(1 for d in plan.decisions if d.kind == "place"), "stop": len(plan.stops),
                       "blocked": sum(1 for d in plan.decisions if d.kind == "blocked")}
    now += 1.0
    live.tick(now)  # the new ones ready, the stopped ones gone
    now += 1.0
    plan = live.tick(now, compact=True)
    compaction = live.last_plan_s
    moves = sum(1 for d in plan.decisions if d.kind == "move")
    lit = len({(r.invoker, r.gpu) for r in live.records.values()})
    reads = ({**asyncio.run(budget_reads(live)), **asyncio.run(service_reads(live, seed=seed, busy=busy)),
              "busy_fraction": busy} if redis else {})
    return {**reads,
        "n": n, "nodes": nodes, "gpus": nodes * GPUS_PER_NODE, "placed_first_tick": placed, "lit_gpus": lit,
        "place_all_s": place_all, "steady_median_s": statistics.median(steady), "steady_max_s": max(steady),
        "changed_median_s": statistics.median(changed), "cold_s": cold,
        "build_median_s": statistics.median(builds), "churn_s": churn, "churn_decisions": churn_decisions,
        "compaction_s": compaction, "compaction_moves": moves, "ticks": ticks, "seed": seed,
    }


def markdown(rows: list[dict[str, Any]], argv: list[str], started: str) -> str:
    lines = [
        "# The live balancer's tick at scale",
        "",
        f"Generated by `PYTHONPATH=. python3 bench/planner_scale.py {' '.join(argv)}` on {started}: "
        f"{os.cpu_count()} CPU(s), {cpu_model()}, Python {platform.python_version()}. CPU seconds of this process "
        "(`time.process_time`); the machine may be shared. What is measured, and how: the module docstring of "
        "bench/planner_scale.py.",
        "",
        "| instances | GPUs (lit) | place all N in one tick | steady tick: median / max | 1 % changed (median) "
        "| cold tick (no memo) | build reports + snapshot "
        "(median) | churn tick (1 % to zero, 1 % new) | compaction tick (moves) | budgets read: one by one / "
        "one pipeline |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']:,} | {r['gpus']:,} ({r['lit_gpus']:,}) | {r['place_all_s']:.2f} s "
            f"({r['placed_first_tick']:,} placed) | {1000 * r['steady_median_s']:.0f} / {1000 * r['steady_max_s']:.0f} ms "
            f"| {1000 * r['changed_median_s']:.0f} ms | {1000 * r['cold_s']:.0f} ms "
            f"| {1000 * r['build_median_s']:.0f} ms | {1000 * r['churn_s']:.0f} ms "
            f"({r['churn_decisions']['place']} placed, {r['churn_decisions']['stop']} stopped) "
            f"| {1000 * r['compaction_s']:.0f} ms ({r['compaction_moves']}) | "
            + (f"{1000 * r['read_one_by_one_s']:.0f} / {1000 * r['read_pipelined_s']:.0f} ms |" if "gpus_read" in r
               else "– |"))
    if any("read_total_cpu_s" in r for r in rows):
        lines += [
            "",
            "The leader's read path of a steady tick against a real redis-server (`--redis`), CPU / wall ms, median "
            "of 5 after a first read:",
            "",
            "| instances | reports | function specs | budgets + snapshot (of which the snapshot, CPU) | whole read "
            "| first read | snapshot, a budget changed (CPU) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            if "read_total_cpu_s" not in r:
                continue
            lines.append(
                f"| {r['n']:,} "
                + "".join(f"| {1000 * r[f'read_{p}_cpu_s']:.0f} / {1000 * r[f'read_{p}_wall_s']:.0f} "
                          + (f"({1000 * r['read_snapshot_cpu_s']:.0f}) " if p == "budgets+snapshot" else "")
                          for p in ("reports", "specs", "budgets+snapshot", "total"))
                + f"| {1000 * r['read_first_cpu_s']:.0f} / {1000 * r['read_first_wall_s']:.0f} "
                + (f"| {1000 * r['read_snapshot_changed_cpu_s']:.0f} |" if "read_snapshot_changed_cpu_s" in r else "| – |"))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,3200,10000")
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--redis", action="store_true", help="also time reading every GPU's budget from a redis-server")
    ap.add_argument("--busy", type=float, default=0.5,
                    help="with --redis: the fraction of instances whose reported figures move every period")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for n in (int(x) for x in args.sizes.split(",") if x):
        r = run_size(n, args.ticks, args.seed, args.redis, args.busy)
        rows.append(r)
        print(f"{n:6d} instances on {r['gpus']} GPUs: place all {r['place_all_s']:.2f} s, steady "
              f"{1000 * r['steady_median_s']:.0f} / {1000 * r['steady_max_s']:.0f} ms, 1 % changed "
              f"{1000 * r['changed_median_s']:.0f} ms, cold {1000 * r['cold_s']:.0f} ms, build "
              f"{1000 * r['build_median_s']:.0f} ms, churn {1000 * r['churn_s']:.0f} ms {r['churn_decisions']}, "
              f"compaction {1000 * r['compaction_s']:.0f} ms ({r['compaction_moves']} moves)"
              + (f", budgets of {r['gpus_read']} GPUs: one by one {1000 * r['read_one_by_one_s']:.0f} ms, "
                 f"one pipeline {1000 * r['read_pipelined_s']:.0f} ms" if "gpus_read" in r else "")
              + (f"; read path CPU/wall: reports {1000 * r['read_reports_cpu_s']:.0f}/"
                 f"{1000 * r['read_reports_wall_s']:.0f} ms, specs {1000 * r['read_specs_cpu_s']:.0f}/"
                 f"{1000 * r['read_specs_wall_s']:.0f} ms, budgets+snapshot {1000 * r['read_budgets+snapshot_cpu_s']:.0f}/"
                 f"{1000 * r['read_budgets+snapshot_wall_s']:.0f} ms (snapshot {1000 * r['read_snapshot_cpu_s']:.0f} ms), "
                 f"whole {1000 * r['read_total_cpu_s']:.0f}/{1000 * r['read_total_wall_s']:.0f} ms, first "
                 f"{1000 * r['read_first_cpu_s']:.0f}/{1000 * r['read_first_wall_s']:.0f} ms, snapshot after a "
                 f"budget changed {1000 * r['read_snapshot_changed_cpu_s']:.0f} ms"
                 if "read_total_cpu_s" in r else ""), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "cpu": cpu_model(), "started": started, "rows": rows},
                                        indent=1) + "\n", encoding="utf-8")
    if args.out is not None:
        args.out.write_text(markdown(rows, sys.argv[1:], started), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
