"""Routing GPU activations to the instances the balancer placed (the data plane of issue 5).

An activation of a GPU kind that reaches any invoker goes to an instance of its function from the
function's routing table (``{prefix}route:{fqn}``, written by the balancer): least outstanding work among
the instances with a free slot, by the power of two random choices (:func:`pick_instance`). An instance
on this invoker runs it directly; one on another invoker gets it through that invoker's activation stream
(:mod:`~dilu_invoker.invoker.cluster.forwarding`), and the result comes back here, where the caller is answered.
With no instance yet, the router signals demand on ``{prefix}bal:demand`` (the balancer starts one at
once, without waiting for its next tick) and waits for the table to change (pub/sub
``{prefix}routes``). Activations of other kinds run in this invoker's own pool, as before.

:func:`enable_balancer_routing` is the one call a front needs: it starts the load reports, the command
consumer, the forwarding consumer and the route cache around an open :class:`~dilu_invoker.invoker.dataplane.core.Invoker`
and yields the :class:`BalancedRunner` to hand activations to (it is an ``ActivationRunner``, and also a
``Router`` of the cluster front: ``route(req)`` returns itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.config import Config
from dilu_invoker.gpu.devices import GpuDevice, discover_for
from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.invoker.cluster.agent import Agent
from dilu_invoker.invoker.cluster.forwarding import Forwarder
from dilu_invoker.invoker.cluster.instances import InstanceManager
from dilu_invoker.invoker.cluster.reports import GpuView, Reporter
from dilu_invoker.invoker.dataplane.core import Invoker
from dilu_invoker.model import Activation, ActivationRequest, ValidationError
from dilu_invoker.wire import (
    FunctionReport,
    Keys,
    RouteEntry,
    RoutingTable,
    WireError,
    decode,
    revision_generation,
    text,
)

log = structlog.get_logger(__name__)

#: a router signals demand for one function at most this often
DEMAND_EVERY_S = 0.25
#: a cached routing table is re-read after this even without a change notification
TABLE_MAX_AGE_S = 1.0


# -- choosing an instance -----------------------------------------------------------------------------


def instance_load(entry: RouteEntry, outstanding: Mapping[str, int]) -> float:
    """Work per slot: what this router has outstanding there, or what the instance last reported (both
    are lower bounds of the truth; the larger is the better estimate)."""
    return max(outstanding.get(entry.id, 0), entry.in_flight + entry.waiting) / max(1, entry.slots)


def pick_instance(
    entries: Sequence[RouteEntry], outstanding: Mapping[str, int], rng: random.Random, *, local: str
) -> RouteEntry:
    """Power of two choices among the instances with a free slot (all of them when none has one): sample
    two, take the one with less work per slot; on a tie the one on this invoker (no hop), then by id."""
    if not entries:
        raise ValueError("no instance to choose from")
    free = [e for e in entries if instance_load(e, outstanding) < 1.0]
    pool = free or list(entries)
    if len(pool) == 1:
        return pool[0]
    a, b = rng.sample(pool, 2)
    return min((a, b), key=lambda e: (instance_load(e, outstanding), e.invoker != local, e.id))


# -- routing tables -----------------------------------------------------------------------------------


class RouteCache:
    """Routing tables read from Redis, dropped when the balancer announces a change (and after a second)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, max_age_s: float = TABLE_MAX_AGE_S) -> None:
        self.redis = redis
        self.keys = keys
        self.max_age_s = max_age_s
        self._tables: dict[str, tuple[float, RoutingTable | None]] = {}
        self._changed: dict[str, asyncio.Event] = {}

    async def get(self, fqn: str) -> RoutingTable | None:
        hit = self._tables.get(fqn)
        if hit is not None and time.monotonic() - hit[0] < self.max_age_s:
            return hit[1]
        raw = await self.redis.get(self.keys.route(fqn))
        try:
            table = decode(RoutingTable, raw)
        except WireError as exc:
            log.warning("unreadable routing table", function=fqn, error=str(exc))
            table = None
        self._tables[fqn] = (time.monotonic(), table)
        return table

    def invalidate(self, fqn: str) -> None:
        self._tables.pop(fqn, None)
        event = self._changed.pop(fqn, None)
        if event is not None:
            event.set()

    async def wait_change(self, fqn: str, timeout_s: float) -> None:
        event = self._changed.setdefault(fqn, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    async def listen(self) -> None:
        """Follow the balancer's change notifications until cancelled."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.routes_channel)
                # Whatever changed while we were not listening is re-read.
                for fqn in list(self._tables):
                    self.invalidate(fqn)
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        self.invalidate(text(msg["data"]))
            except RedisError as exc:
                log.warning("routing table notifications interrupted", error=str(exc))
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()


# -- what the router saw, for the load report ---------------------------------------------------------


@dataclass(slots=True)
class _FunctionCounters:
    arrivals: int = 0
    waiting_since: list[float] = field(default_factory=list)


class RouterStats:
    def __init__(self) -> None:
        self._fns: dict[str, _FunctionCounters] = {}
        self._since = time.monotonic()

    def arrival(self, fqn: str) -> None:
        self._fns.setdefault(fqn, _FunctionCounters()).arrivals += 1

    def wait(self, fqn: str) -> float:
        t = time.monotonic()
        self._fns.setdefault(fqn, _FunctionCounters()).waiting_since.append(t)
        return t

    def unwait(self, fqn: str, token: float) -> None:
        counters = self._fns.get(fqn)
        if counters is not None:
            with contextlib.suppress(ValueError):
                counters.waiting_since.remove(token)

    def take(self) -> list[FunctionReport]:
        now = time.monotonic()
        elapsed = max(1e-3, now - self._since)
        self._since = now
        out = []
        for fqn, c in list(self._fns.items()):
            oldest = min(c.waiting_since, default=None)
            out.append(FunctionReport(function=fqn, arrival_rate=c.arrivals / elapsed, waiting=len(c.waiting_since),
                                      queue_delay_ms=(now - oldest) * 1000 if oldest is not None else 0.0))
            c.arrivals = 0
            if not c.waiting_since:
                del self._fns[fqn]
        return out


# -- the router ---------------------------------------------------------------------------------------


class BalancedRunner:
    """Runs GPU activations on balancer-placed instances (here or elsewhere), everything else locally."""

    def __init__(
        self,
        agent: Agent,
        *,
        instances: InstanceManager,
        forwarder: Forwarder,
        routes: RouteCache,
        stats: RouterStats,
        route_wait_s: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self.invoker = agent.invoker
        self.redis = agent.redis
        self.keys = agent.keys
        self.name = agent.name
        self.registry = agent.registry
        self.instances = instances
        self.forwarder = forwarder
        self.routes = routes
        self.stats = stats
        self.route_wait_s = route_wait_s
        self.rng = rng or random.Random()
        self._outstanding: dict[str, int] = {}
        self._demand_at: dict[str, float] = {}
        self.local_runs = 0
        self.forwarded_runs = 0
        self.fallback_runs = 0
        self.refused_runs = 0

    async def route(self, req: ActivationRequest) -> ActivationRunner:
        """The cluster front's ``Router``: every activation goes through this runner."""
        return self

    async def run(self, req: ActivationRequest) -> Activation:
        runtime = self.invoker.runtime_for(req.action)
        if runtime is None or not runtime.gpu:
            return await self.invoker.run(req)
        try:
            spec = await self.registry.ensure(req.action)
        except ValidationError:
            return await self.invoker.run(req)  # the core explains and runs it without a GPU
        except RedisError as exc:
            log.warning("cannot register a GPU function; running it here", function=req.action.fqn, error=str(exc))
            self.fallback_runs += 1
            return await self.invoker.run(req)
        return await self._route_gpu(req, spec.fqn)

    async def _route_gpu(self, req: ActivationRequest, fqn: str) -> Activation:
        self.stats.arrival(fqn)
        deadline = time.monotonic() + self.route_wait_s
        gone_invokers: set[str] = set()
        gone_instances: set[str] = set()
        waiting: float | None = None
        generation = revision_generation(req.action.revision)
        try:
            while True:
                try:
                    table = await self.routes.get(fqn)
                except RedisError as exc:
                    log.warning("cannot read a routing table", function=fqn, error=str(exc))
                    table = None
                if table is not None and table.local_fallback:
                    self.fallback_runs += 1
                    return await self.invoker.run(req)
                entries = [e for e in table.instances
                           if e.invoker not in gone_invokers and e.id not in gone_instances] \
                    if table is not None and revision_generation(table.rev) >= generation else []
                if entries:
                    if waiting is not None:
                        self.stats.unwait(fqn, waiting)
                        waiting = None
                    entry = pick_instance(entries, self._outstanding, self.rng, local=self.name)
                    activation = await self._run_on(entry, req)
                    if activation is not None:
                        return activation
                    if entry.invoker == self.name:
                        gone_instances.add(entry.id)  # stopped or failed here meanwhile
                    else:
                        gone_invokers.add(entry.invoker)  # died before running it
                    self.routes.invalidate(fqn)
                    continue
                if table is not None and table.blocked and revision_generation(table.rev) >= generation:
                    # The balancer could not place or start an instance: say why now rather than after the
                    # wait (docs/balancer.md, "Refusals").
                    log.warning("activation refused: no instance can be placed", function=fqn, reason=table.blocked)
                    self.refused_runs += 1
                    await self._signal_demand(fqn)  # the balancer keeps trying for the next caller
                    return self.invoker.refuse(req, f"The action cannot run: {table.blocked}")
                if time.monotonic() >= deadline:
                    log.warning("no instance of the function in time; running it here", function=fqn,
                                waited_s=self.route_wait_s, blocked=table.blocked if table else None)
                    self.fallback_runs += 1
                    return await self.invoker.run(req)
                if waiting is None:
                    waiting = self.stats.wait(fqn)
                await self._signal_demand(fqn)
                await self.routes.wait_change(fqn, min(0.5, max(0.01, deadline - time.monotonic())))
                self.routes.invalidate(fqn)
        finally:
            if waiting is not None:
                self.stats.unwait(fqn, waiting)

    async def _run_on(self, entry: RouteEntry, req: ActivationRequest) -> Activation | None:
        self._outstanding[entry.id] = self._outstanding.get(entry.id, 0) + 1
        try:
            if entry.invoker == self.name:
                activation = await self.instances.run(entry.id, req)
                if activation is not None:
                    self.local_runs += 1
                return activation
            try:
                activation = await self.forwarder.forward(entry, req)
            except RedisError as exc:
                log.warning("cannot forward an activation", target=entry.invoker, error=str(exc))
                return None
            if activation is not None:
                self.forwarded_runs += 1
            return activation
        finally:
            left = self._outstanding.get(entry.id, 1) - 1
            if left > 0:
                self._outstanding[entry.id] = left
            else:
                self._outstanding.pop(entry.id, None)

    async def _signal_demand(self, fqn: str) -> None:
        now = time.monotonic()
        if now - self._demand_at.get(fqn, 0.0) < DEMAND_EVERY_S:
            return
        self._demand_at[fqn] = now
        try:
            await self.redis.xadd(self.keys.demand, {"f": fqn, "i": self.name}, maxlen=1000, approximate=True)
        except RedisError as exc:
            log.warning("cannot signal demand", function=fqn, error=str(exc))


# -- devices ------------------------------------------------------------------------------------------


def devices_for(cfg: Config, *, slot: int = 0, invokers: int = 1) -> tuple[GpuDevice, ...]:
    """This invoker's GPUs (``cfg.invoker.id``, the ``slot``-th of ``invokers`` on the machine:
    `gpu.devices.discover_for`)."""
    return discover_for(enabled=cfg.gpu.enabled, inventory=cfg.gpu.inventory, invoker_id=cfg.invoker.id,
                        slot=slot, invokers=invokers).devices


# -- the seam -----------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def enable_balancer_routing(
    invoker: Invoker,
    cfg: Config,
    *,
    redis: aioredis.Redis,
    devices: Sequence[GpuDevice] | None = None,
    gpu_view: GpuView | None = None,
    rng: random.Random | None = None,
) -> AsyncIterator[BalancedRunner]:
    """Join the balancer's cluster with an open invoker; yields the runner activations go through.

    Starts: load reports (now, then every ``--balancer-report-period-s``), the consumer of this invoker's
    instance commands, the consumer of activations forwarded here, the reader of results coming back, and
    the routing-table cache. On exit it stops taking forwarded work, lets what runs finish (bounded),
    withdraws its report (the balancer re-places its instances at once), and stops the rest; the invoker
    itself (its containers) is closed by its owner afterwards.
    """
    agent = Agent.of(invoker, redis, prefix=cfg.redis.prefix, boot=secrets.token_hex(8))
    name, boot = agent.name, agent.boot
    if devices is None:
        devices = devices_for(cfg)
    instances = InstanceManager(agent, reservation_ttl_s=cfg.gpu.reservation_ttl_s)
    forwarder = Forwarder(agent, instances=instances, result_ttl_s=cfg.balancer.result_ttl_s)
    routes = RouteCache(redis, agent.keys)
    stats = RouterStats()
    reporter = Reporter(agent, instances=instances, functions=stats.take, devices=devices, gpu_view=gpu_view,
                        period_s=cfg.balancer.report_period_s, ttl_s=cfg.balancer.report_ttl_s,
                        gamma=cfg.gpu.gamma)
    runner = BalancedRunner(agent, instances=instances, forwarder=forwarder, routes=routes, stats=stats,
                            route_wait_s=cfg.balancer.route_wait_s, rng=rng)
    instances.on_change = reporter.nudge
    await reporter.register_gpus()
    tasks: dict[str, asyncio.Task[Any]] = {
        "replies": asyncio.create_task(forwarder.listen_replies(), name=f"{name}-replies"),
        "routes": asyncio.create_task(routes.listen(), name=f"{name}-routes"),
        "commands": asyncio.create_task(instances.consume(), name=f"{name}-commands"),
        "serve": asyncio.create_task(forwarder.serve(), name=f"{name}-serve"),
    }
    await reporter.publish_once()
    tasks["report"] = asyncio.create_task(reporter.run(), name=f"{name}-report")
    log.info("balancer routing enabled", invoker=name, boot=boot, gpus=[d.uuid for d in devices])
    try:
        yield runner
    finally:
        await cancel_and_wait(tasks["serve"])
        await forwarder.drain(timeout_s=5.0)
        await cancel_and_wait(tasks["report"])
        await reporter.withdraw()
        await cancel_and_wait(*tasks.values())
        await forwarder.close()
        await instances.close()
