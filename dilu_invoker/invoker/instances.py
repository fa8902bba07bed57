"""Balancer-placed instances on this invoker: the command stream, their lifecycle, running on them.

An *instance* is one container of a GPU action, started ahead of its activations on the GPU the balancer
chose, with the action's ``<request, limit>``; it lives until the balancer stops it. Its lifecycle::

    STARTING ──► READY ──► DRAINING ──► (removed)
        │          │
        └──────────┴──► FAILED ──► (removed when the balancer stops it, or after a while)

Commands arrive on ``{prefix}inv:{name}:cmd`` (consumer group ``invoker``). A command of an older epoch
than one already obeyed is refused (a deposed leader); one meant for an earlier boot of this invoker is
ignored. Each instance queues its activations for its ``concurrency`` slots and counts arrivals,
completions, run times and queueing delays for the load report.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.invoker.container import State, Transition
from dilu_invoker.invoker.core import Invoker
from dilu_invoker.invoker.registry import FunctionRegistry
from dilu_invoker.invoker.streams import read_group
from dilu_invoker.model import Action, Activation, ActivationRequest
from dilu_invoker.wire import (
    COMMAND_GROUP,
    CommandOp,
    InstanceCommand,
    InstanceReport,
    InstanceState,
    Keys,
    WireError,
    from_stream,
    text,
)

log = structlog.get_logger(__name__)

#: a failed instance stays in the reports this long unless the balancer stops it first
FAILED_KEEP_S = 30.0
#: queueing delays kept per report period for the percentile
MAX_DELAY_SAMPLES = 4096


@dataclass(slots=True)
class PeriodStats:
    """Counts over one report period; :meth:`take` returns them and starts the next period."""

    started: float = field(default_factory=time.monotonic)
    arrivals: int = 0
    completions: int = 0
    busy_ms: float = 0.0
    delays_ms: list[float] = field(default_factory=list)

    def arrival(self) -> None:
        self.arrivals += 1

    def queued(self, delay_ms: float) -> None:
        if len(self.delays_ms) < MAX_DELAY_SAMPLES:
            self.delays_ms.append(delay_ms)

    def completed(self, run_ms: float) -> None:
        self.completions += 1
        self.busy_ms += run_ms

    def take(self, now: float | None = None) -> tuple[float, float, float | None, float]:
        """(arrival rate, completion rate, mean run ms or None, p90 queueing delay ms)."""
        now = time.monotonic() if now is None else now
        elapsed = max(1e-3, now - self.started)
        delays = sorted(self.delays_ms)
        p90 = delays[min(len(delays) - 1, int(0.9 * len(delays)))] if delays else 0.0
        out = (self.arrivals / elapsed, self.completions / elapsed,
               self.busy_ms / self.completions if self.completions else None, p90)
        self.started, self.arrivals, self.completions, self.busy_ms = now, 0, 0, 0.0
        self.delays_ms = []
        return out


@dataclass(slots=True, eq=False)
class LocalInstance:
    cmd: InstanceCommand
    state: InstanceState = InstanceState.STARTING
    action: Action | None = None
    container: str | None = None
    slots: int = 1
    sem: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    waiting: int = 0
    in_flight: int = 0
    stats: PeriodStats = field(default_factory=PeriodStats)
    stop_reason: str | None = None
    failure: str = ""
    since: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.cmd.instance

    @property
    def function(self) -> str:
        return self.cmd.function

    @property
    def load(self) -> float:
        return (self.in_flight + self.waiting) / max(1, self.slots)


class InstanceManager:
    def __init__(
        self,
        invoker: Invoker,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        name: str,
        boot: str,
        registry: FunctionRegistry,
        budgets: GpuBudgets | None = None,
        reservation_ttl_s: float = 30.0,
    ) -> None:
        self.invoker = invoker
        self.redis = redis
        self.keys = keys
        self.name = name
        self.boot = boot
        self.registry = registry
        self.budgets = budgets
        self.reservation_ttl_s = reservation_ttl_s
        self.instances: dict[str, LocalInstance] = {}
        self.max_epoch = 0
        self._by_container: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: called when an instance becomes ready, fails or is gone (the report goes out at once)
        self.on_change: Callable[[], None] = lambda: None
        self._closing = False
        invoker.pool.observe(self._on_transition)

    # -- commands --------------------------------------------------------------------------------

    async def consume(self) -> None:
        """Read this invoker's command stream until cancelled."""
        stream = self.keys.commands(self.name)
        async for entry_id, fields in read_group(self.redis, stream, COMMAND_GROUP, self.boot, count=50,
                                                 what="instance commands"):
            try:
                cmd = from_stream(InstanceCommand, fields)
            except WireError as exc:
                log.warning("unreadable instance command; skipped", entry=text(entry_id), error=str(exc))
            else:
                self.handle(cmd)
            with contextlib.suppress(RedisError):
                await self.redis.xack(stream, COMMAND_GROUP, entry_id)

    def handle(self, cmd: InstanceCommand) -> str:
        """Carry out one command; returns what was done (for logs and tests)."""
        if cmd.epoch < self.max_epoch:
            log.warning("command from a deposed balancer refused", epoch=cmd.epoch, current=self.max_epoch,
                        op=cmd.op, instance=cmd.instance)
            return "stale-epoch"
        self.max_epoch = cmd.epoch
        if cmd.boot and cmd.boot != self.boot:
            return "other-boot"
        inst = self.instances.get(cmd.instance)
        if cmd.op == CommandOp.START:
            if inst is not None:
                return "duplicate"
            inst = LocalInstance(cmd)
            self.instances[cmd.instance] = inst
            log.info("instance starting", instance=cmd.instance, function=cmd.function, gpu=cmd.gpu,
                     request=cmd.request, limit=cmd.limit, reason=cmd.reason)
            self._spawn(self._start(inst))
            return "start"
        if cmd.op == CommandOp.STOP:
            if inst is None:
                return "unknown"
            if inst.stop_reason is not None:
                return "duplicate"
            inst.stop_reason = cmd.reason or "stopped by the balancer"
            if inst.state is not InstanceState.STARTING:
                self._spawn(self._stop(inst))
            return "stop"
        log.warning("unknown instance command", op=cmd.op)
        return "unknown-op"

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- lifecycle -------------------------------------------------------------------------------

    async def _start(self, inst: LocalInstance) -> None:
        try:
            action = await self.registry.load(inst.function)
            if action is None:
                self._fail(inst, f"action {inst.function} is not registered")
                return
            inst.action = action
            inst.slots = max(1, action.limits.concurrency)
            inst.sem = asyncio.Semaphore(inst.slots)
            container, failure = await self.invoker.start_instance(inst.id, action, gpu_index=inst.cmd.gpu)
            if container is not None:
                inst.container = container
                self._by_container[container] = inst.id
            if failure is not None:
                self._fail(inst, f"start failed: {failure.result}")
            elif inst.state is InstanceState.STARTING:
                inst.state = InstanceState.READY
                inst.since = time.monotonic()
                log.info("instance ready", instance=inst.id, function=inst.function, container=container)
                self.on_change()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the instance fails, the invoker goes on
            log.exception("instance start failed", instance=inst.id)
            self._fail(inst, f"start failed: {exc!r}")
        if inst.stop_reason is not None:
            await self._stop(inst)

    def _fail(self, inst: LocalInstance, reason: str) -> None:
        if inst.state in (InstanceState.FAILED, InstanceState.DRAINING):
            return
        log.warning("instance failed", instance=inst.id, function=inst.function, reason=reason)
        inst.state = InstanceState.FAILED
        inst.failure = reason
        inst.since = time.monotonic()
        self.on_change()

    def _on_transition(self, t: Transition) -> None:
        iid = self._by_container.get(t.container)
        if iid is None or t.new is not State.REMOVING or self._closing:
            return
        inst = self.instances.get(iid)
        if inst is not None and inst.stop_reason is None:
            self._fail(inst, f"container removed: {t.reason}")

    async def _stop(self, inst: LocalInstance) -> None:
        if inst.state is not InstanceState.FAILED:
            inst.state = InstanceState.DRAINING
        timeout_s = (inst.action.limits.timeout_ms / 1000 if inst.action else 60.0) + 5.0
        deadline = time.monotonic() + timeout_s
        while (inst.in_flight or inst.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if inst.container is not None:
            self.invoker.stop_instance(inst.container, inst.stop_reason or "stopped")
            self._by_container.pop(inst.container, None)
        await self._release(inst)
        self.instances.pop(inst.id, None)
        log.info("instance stopped", instance=inst.id, function=inst.function, reason=inst.stop_reason)
        self.on_change()

    async def _release(self, inst: LocalInstance) -> None:
        if self.budgets is not None and inst.cmd.gpu_uuid:
            with contextlib.suppress(RedisError):
                await self.budgets.release(inst.cmd.gpu_uuid, inst.id)

    # -- running ---------------------------------------------------------------------------------

    async def run(self, instance_id: str, req: ActivationRequest) -> Activation | None:
        """Run on that instance (queued for one of its slots); None when it cannot take work."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.action is None or inst.state not in (InstanceState.READY, InstanceState.DRAINING):
            return None
        arrived = time.monotonic()
        inst.stats.arrival()
        inst.waiting += 1
        try:
            await inst.sem.acquire()
        finally:
            inst.waiting -= 1
        try:
            if inst.state is InstanceState.FAILED:
                return None
            started = time.monotonic()
            inst.stats.queued((started - arrived) * 1000)
            inst.in_flight += 1
            try:
                activation = await self.invoker.run_on_instance(instance_id, replace(req, action=inst.action))
            finally:
                inst.in_flight -= 1
            if activation is not None:
                inst.stats.completed((time.monotonic() - started) * 1000)
            return activation
        finally:
            inst.sem.release()

    def pick_local(self, function: str, *, exclude: frozenset[str] = frozenset()) -> str | None:
        """The least busy ready instance of the function here, if any."""
        ready = [i for i in self.instances.values()
                 if i.function == function and i.state is InstanceState.READY and i.id not in exclude]
        return min(ready, key=lambda i: (i.load, i.id)).id if ready else None

    def action_of(self, instance_id: str) -> Action | None:
        inst = self.instances.get(instance_id)
        return inst.action if inst is not None else None

    # -- reporting -------------------------------------------------------------------------------

    def reports(self, shares: Mapping[str, tuple[float | None, bool | None, float | None]] | None = None,
                ) -> list[InstanceReport]:
        """Each instance over the period since the last call; ``shares``: id → (share, saturated,
        throttled s) from the GPU manager."""
        now = time.monotonic()
        out: list[InstanceReport] = []
        for inst in list(self.instances.values()):
            if inst.state is InstanceState.FAILED and inst.stop_reason is None and now - inst.since > FAILED_KEEP_S:
                self.instances.pop(inst.id, None)
                self._spawn(self._release(inst))
                continue
            arrivals, completions, latency, delay = inst.stats.take(now)
            share, saturated, throttled = (shares or {}).get(inst.id, (None, None, None))
            cmd = inst.cmd
            out.append(InstanceReport(
                id=inst.id, function=inst.function, rev=(inst.action.revision or "") if inst.action else cmd.rev,
                state=inst.state.value, cls=cmd.cls, gpu=cmd.gpu, request=cmd.request, limit=cmd.limit,
                memory_mb=cmd.memory_mb, slots=inst.slots, share=share, saturated=saturated, throttled_s=throttled,
                waiting=inst.waiting, in_flight=inst.in_flight, arrival_rate=arrivals, completion_rate=completions,
                latency_ms=latency, queue_delay_ms=delay, error=inst.failure))
        return out

    async def renew_reservations(self) -> None:
        if self.budgets is None:
            return
        by_gpu: dict[str, list[str]] = {}
        for inst in self.instances.values():
            if inst.cmd.gpu_uuid and inst.state is not InstanceState.FAILED:
                by_gpu.setdefault(inst.cmd.gpu_uuid, []).append(inst.id)
        for uuid, ids in by_gpu.items():
            await self.budgets.renew(uuid, ids, ttl_s=self.reservation_ttl_s)

    async def close(self) -> None:
        self._closing = True  # the invoker removes every container next: that is no instance failure
        await cancel_and_wait(*self._tasks)
        for inst in list(self.instances.values()):
            await self._release(inst)
