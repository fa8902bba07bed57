"""Latency of an activation routed to a balancer-placed instance: on the receiving invoker vs forwarded
to another invoker through Redis streams (and back).

Two invokers with balancer routing run in this process (process backend: the action runs in a runtime
child process), sharing an embedded redis-server; one instance of a no-op GPU-kind action is started on
invoker1 and listed in the routing table (the script plays the balancer). Then, warm:

* ``instance``: ``Invoker.run_on_instance`` on invoker1 (the floor: pool + runtime /run);
* ``local``: invoker1's router (registry check, table, pick, instance queue, run);
* ``forwarded``: invoker0's router → invoker1's stream → run → result back on invoker0's stream.

Sequential latency (p50/p90/p99) and throughput with ``--concurrency`` activations in flight.
Both invokers share one event loop here; across processes the forwarded path adds no more than the
Redis round trips measured, but the two loops then work in parallel.

    python bench/routing.py [--n 1000] [--concurrency 32] [--out docs/benchmarks/routing.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import structlog

from dilu_invoker import config
from dilu_invoker.invoker.cluster.routing import enable_balancer_routing
from dilu_invoker.invoker.dataplane.core import open_invoker
from dilu_invoker.model import (
    GUEST_IDENTITY,
    Action,
    ActivationRequest,
    Exec,
    new_activation_id,
)
from dilu_invoker.redis_embedded import EmbeddedRedis, redis_client
from dilu_invoker.wire import (
    InstanceCommand,
    Keys,
    RouteEntry,
    RoutingTable,
    pack,
    stream_fields,
)

PREFIX = "bench:"
KEYS = Keys(PREFIX)
NOOP = "def main(a):\n    return {'ok': True}\n"


def _cfg(url: str, invoker_id: int) -> config.Config:
    base = config.load(environ={})
    return replace(base, redis=replace(base.redis, url=url, prefix=PREFIX),
                   invoker=replace(base.invoker, id=invoker_id, user_memory_mb=4096),
                   log=replace(base.log, level="warning"))


def _req(action: Action) -> ActivationRequest:
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY, content={})


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(run: Callable[[], Awaitable[object]], n: int, concurrency: int) -> dict[str, float]:
    for _ in range(50):
        await run()
    latencies = []
    for _ in range(n):
        t = time.perf_counter()
        await run()
        latencies.append((time.perf_counter() - t) * 1000)
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            await run()

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    elapsed = time.perf_counter() - t
    return {"p50": statistics.median(latencies), "p90": _pct(latencies, 0.9), "p99": _pct(latencies, 0.99),
            "rps": n / elapsed}


async def main(n: int, concurrency: int, out: Path | None) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis(tmp, persistent=False) as server, contextlib.AsyncExitStack() as stack:
            redis = redis_client(server.url)
            stack.push_async_callback(redis.aclose)
            nodes = []
            for k in (0, 1):
                cfg = _cfg(server.url, k)
                inv = await stack.enter_async_context(open_invoker(cfg))
                runner = await stack.enter_async_context(enable_balancer_routing(inv, cfg, redis=redis, devices=()))
                nodes.append((inv, runner))
            action = Action(namespace="guest", name="noop", exec=Exec(kind="python:3-gpu", code=NOOP),
                            revision="1-bench")
            (_, r0), (inv1, r1) = nodes
            await r1.registry.ensure(action)
            await redis.xadd(KEYS.commands(inv1.name), stream_fields(InstanceCommand(
                op="start", epoch=1, instance="noop-1", function=action.fqn, rev="1-bench")))
            while "noop-1" not in r1.instances.instances or r1.instances.instances["noop-1"].state.value != "ready":
                await asyncio.sleep(0.05)
            await redis.set(KEYS.route(action.fqn), pack(RoutingTable(
                function=action.fqn, rev="1-bench", epoch=1, version=1, instances=(RouteEntry("noop-1", inv1.name),))))
            results = {
                "instance": await _measure(lambda: inv1.run_on_instance("noop-1", _req(action)), n, concurrency),
                "local": await _measure(lambda: r1.run(_req(action)), n, concurrency),
                "forwarded": await _measure(lambda: r0.run(_req(action)), n, concurrency),
            }
    machine = (f"Machine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
               f"{len(os.sched_getaffinity(0))} CPUs; n = {n}, concurrency = {concurrency}.")
    lines = [
        machine,
        "",
        "| path | p50 ms | p90 ms | p99 ms | throughput /s (concurrent) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['p50']:.2f} | {r['p90']:.2f} | {r['p99']:.2f} | {r['rps']:.0f} |")
    text = "\n".join(lines)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.concurrency, args.out))
