"""The whole balancer at scale: a real `Balancer` leading a cluster of N one-GPU instances held in a real
redis-server, as `dilu-invoker balancer` runs it (the same `Config` defaults: a 1 s tick, a 2 s lease).

    PYTHONPATH=. python3 bench/leader_scale.py [--sizes 3200,10000,32000] [--seconds 40] [--json FILE]

bench/planner_scale.py times the parts of a tick one by one (the plan, each read). This runs the leader itself:
campaigning, taking over (loading every instance record and routing table a predecessor left), then ticking
(reads, the snapshot and the plan in a worker thread, the writes through the lease), with the lease renewed by
its own task on the same event loop. The cluster is bench/live_replay.py's (the first N one-GPU creates of
`dilu_mix(2N, train_fraction=0, llm_fraction=0.2)`, placed by the live planner and settled): its invokers'
reports, the function registry, every GPU's budget with its reservations, the records and the routing tables
are written into the redis-server before the balancer starts. While it leads, a separate process plays the
invokers: every second it rewrites each invoker's report with the current clock and new load figures for a
fifth of the instances (arrivals, completions, latency), as live invokers do, so that no tick reads the same
bytes as the last.

Per size: how long the takeover took (from the campaign to the end of the first tick, wall seconds); then for
the ticks while the scaler's window fills (the next `--balancer-window` ticks: a new leader knows no history, so
it plans every function from scratch) and for the steady ticks after it (a tick may then repeat a function's
hold), each tick's wall seconds and this process's CPU seconds (every thread: the event loop and the plan's
worker), median and max; the event loop's longest stall in each phase (a task that sleeps 10 ms and measures how
late it wakes: what the lease renewal and the demand reader wait at worst); and whether the lease held (the
epoch counter: 1 if the balancer never lost and re-took it); and how many samples the scaler's windows hold when
the run ends (`window_samples_median`, `windows_full` of `functions`: a window that keeps restarting stays short,
docs/benchmarks/planner-scale.md round 7). `--no-gc-freeze` runs the leader with the garbage
collector as CPython runs it, for comparison (`service.LongLived`). A tick is followed by `--balancer-tick-s` of
sleep (or less, when woken by demand), so the ticks come every tick time + 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from live_replay import GPUS_PER_NODE, LiveHarness
from loadgen import cpu_model
from planner_scale import _fill_budgets, spec_of

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.config import Config
from dilu_invoker.loadbalancer.service import Balancer, LongLived, planner_config
from dilu_invoker.redis_embedded import EmbeddedRedis, redis_client
from dilu_invoker.sim.events import CREATE
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import cluster_size
from dilu_invoker.wire import Keys, LoadReport, pack


def settled_cluster(n: int, seed: int) -> LiveHarness:
    creates = [ev for ev in dilu_mix(2 * n, train_fraction=0.0, llm_fraction=0.2, seed=seed)
               if ev.op == CREATE and ev.spec is not None and ev.spec.gpus == 1][:n]
    assert len(creates) == n, "the trace has too few one-GPU creates"
    live = LiveHarness(cluster_size(creates, GPUS_PER_NODE) // GPUS_PER_NODE, planner_config(Config()))
    live.specs.update((ev.instance, spec_of(ev)) for ev in creates)
    for k in range(Config().balancer.window + 2):
        live.tick(float(k))
    assert sum(1 for r in live.records.values() if r.state == "ready") == n, "not every instance is ready"
    return live


def play_invokers(url: str, reports: dict[str, bytes], stop: Any, seed: int) -> None:
    """A separate process: every second, each invoker's report again at the current clock, with new load figures
    for a fifth of its instances."""
    import redis

    from dilu_invoker.wire import decode

    client = redis.Redis.from_url(url)
    keys = Keys(Config().redis.prefix)
    base = {name: decode(LoadReport, raw) for name, raw in reports.items()}
    rng = random.Random(seed)
    while not stop.is_set():
        started = time.monotonic()
        pipe = client.pipeline(transaction=False)
        for name, rep in base.items():
            assert rep is not None
            insts = tuple(replace(i, arrival_rate=round(rng.uniform(0, 2), 3), completion_rate=round(rng.uniform(0, 2), 3),
                                  latency_ms=round(rng.uniform(5, 50), 2), in_flight=rng.randrange(2))
                          if rng.random() < 0.2 else i for i in rep.instances)
            pipe.set(keys.report(name), pack(replace(rep, at_ms=int(time.time() * 1000), instances=insts)))
        pipe.execute()
        stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))


class _NoFreeze(LongLived):
    """The collector left as CPython runs it (`--no-gc-freeze`)."""

    def freeze(self) -> None:
        pass

    def after_tick(self) -> None:
        pass


async def lead(live: LiveHarness, seconds: float, seed: int, freeze: bool = True,
               tick_s: float | None = None) -> dict[str, Any]:
    cfg = Config()
    if tick_s is not None:
        cfg = replace(cfg, balancer=replace(cfg.balancer, tick_s=tick_s))
    keys = Keys(cfg.redis.prefix)
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis(tmp, persistent=False) as server:
            client = redis_client(server.url)
            reports = {name: pack(rep) for name, rep in live.reports().items()}
            async with client.pipeline(transaction=False) as pipe:
                pipe.sadd(keys.invokers, *reports)
                for name, raw in reports.items():
                    pipe.set(keys.report(name), raw)
                pipe.sadd(keys.functions, *live.specs)
                for fqn, spec in live.specs.items():
                    doc = json.dumps({"namespace": "bench", "name": fqn, "exec": {"kind": spec.kind, "code": "x" * 64},
                                      "annotations": [{"key": "gpu-memory-mb", "value": spec.memory_mb}]})
                    pipe.hset(keys.function(fqn), mapping={"rev": spec.rev, "doc": doc, "meta": pack(spec)})
                for rid, rec in live.records.items():
                    pipe.hset(keys.instances, rid, pack(rec))
                for fqn, table in live.routes.items():
                    pipe.set(keys.route(fqn), pack(table))
                await pipe.execute()
            balancer = Balancer(client, cfg, holder="bench")
            if not freeze:
                balancer._collector = _NoFreeze()
            await _fill_budgets(balancer.budgets, live)
            ctx = multiprocessing.get_context("spawn")
            stop = ctx.Event()
            writer = ctx.Process(target=play_invokers, args=(server.url, reports, stop, seed), daemon=True)
            writer.start()

            ticks: list[tuple[float, float, float]] = []  # (ended at, wall s, CPU s)
            real_tick = balancer.tick

            async def timed_tick(leadership: Any) -> bool:
                w0, c0 = time.perf_counter(), time.process_time()
                ok = await real_tick(leadership)
                ticks.append((time.perf_counter(), time.perf_counter() - w0, time.process_time() - c0))
                return ok

            balancer.tick = timed_tick  # type: ignore[method-assign]
            stalls: list[tuple[float, float]] = []  # (woke at, how late)

            async def watch() -> None:
                while True:
                    t = time.perf_counter()
                    await asyncio.sleep(0.01)
                    now = time.perf_counter()
                    stalls.append((now, now - t - 0.01))

            watcher = asyncio.create_task(watch())
            started = time.perf_counter()
            task = asyncio.create_task(balancer.run())
            await asyncio.sleep(seconds)
            # As the product stops a balancer (`open_balancer`): cancelled again every 50 ms, so a cancellation that
            # lands as a 20 ms tick's sleep times out, and is lost there, does not leave the leader running.
            await cancel_and_wait(task, watcher)
            # How many samples the scaler's windows hold at the end: a window that keeps restarting stays short.
            samples = sorted(len(s.horizontal.rates) for s in balancer._states.values())
            stop.set()
            writer.join(10)
            epoch = int(await client.get(keys.epoch) or 0)
            await client.aclose()
    window = cfg.balancer.window
    filling, steady = ticks[1 : window + 1], ticks[window + 1 :]

    def phase(part: list[tuple[float, float, float]], name: str) -> dict[str, Any]:
        if not part:
            return {f"{name}_ticks": 0}
        since = part[0][0] - part[0][1]
        late = [d for at, d in stalls if since <= at <= part[-1][0]]
        return {
            f"{name}_ticks": len(part),
            f"{name}_wall_median_s": statistics.median(t[1] for t in part), f"{name}_wall_max_s": max(t[1] for t in part),
            f"{name}_cpu_median_s": statistics.median(t[2] for t in part), f"{name}_cpu_max_s": max(t[2] for t in part),
            f"{name}_stall_max_s": max(late, default=0.0),
        }

    first_end = ticks[0][0] if ticks else started
    return {
        "n": len(live.records), "gpus": len(live.invokers) * GPUS_PER_NODE, "seconds": seconds, "window": window,
        "takeover_s": first_end - started if ticks else None,
        "first_tick_wall_s": ticks[0][1] if ticks else None, "first_tick_cpu_s": ticks[0][2] if ticks else None,
        "takeover_stall_max_s": max((d for at, d in stalls if at <= first_end), default=0.0),
        **phase(filling, "filling"), **phase(steady, "steady"),
        "stall_max_s": max((d for _, d in stalls), default=0.0), "epochs": epoch, "gc_freeze": freeze,
        "window_samples_median": statistics.median(samples) if samples else None,
        "windows_full": sum(1 for k in samples if k >= window), "functions": len(samples),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3200,10000")
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the balancer leads, per size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the garbage collector as CPython runs it (no `service.LongLived` freezing)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        row = asyncio.run(lead(settled_cluster(n, args.seed), args.seconds, args.seed, not args.no_gc_freeze))
        rows.append(row)
        fmt = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(fmt), flush=True)
    meta = {"started": started, "cpus": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
            "load": os.getloadavg(), "argv": sys.argv[1:]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
