"""Balancer-placed instances on this invoker: the command stream, their lifecycle, running on them.

An *instance* is one container of a GPU action, started ahead of its activations on the GPU the balancer
chose, with the action's ``<request, limit>``; it lives until the balancer stops it. Its state is not kept
here but derived (:attr:`LocalInstance.state`) from its container's lifecycle (``container.py``) and what
happened to the instance — a stop ordered, a failure::

    STARTING ──► READY ──► DRAINING ──► (removed)
        │          │
        └──────────┴──► FAILED ──► (removed when the balancer stops it, or after a while)

STARTING until its start finished (the container is then READY or PAUSED: the instance is READY);
DRAINING once a stop is ordered and the start is over; FAILED when the start failed or its container went
away without a stop. Its activations wait for one of the container's slots in the container pool (the one
slot count), which reports when each gets one (queueing delay, in-flight count).

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

import structlog
from redis.exceptions import RedisError

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.invoker.api import InvokerOverloaded
from dilu_invoker.invoker.cluster.agent import Agent
from dilu_invoker.invoker.cluster.streams import read_group
from dilu_invoker.invoker.dataplane.container import ContainerProxy, State, Transition
from dilu_invoker.model import Action, Activation, ActivationRequest
from dilu_invoker.wire import (
    COMMAND_GROUP,
    CommandOp,
    InstanceCommand,
    InstanceReport,
    InstanceState,
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


@dataclass(frozen=True, slots=True)
class Failure:
    reason: str
    at: float


@dataclass(slots=True, eq=False)
class LocalInstance:
    cmd: InstanceCommand
    action: Action | None = None
    #: its container (once the start got one); the pool owns it
    proxy: ContainerProxy | None = None
    #: the start, owned by the manager; the instance is STARTING until it is done
    starting: asyncio.Task[None] | None = None
    slots: int = 1
    waiting: int = 0
    in_flight: int = 0
    stats: PeriodStats = field(default_factory=PeriodStats)
    stop_reason: str | None = None
    failure: Failure | None = None

    @property
    def id(self) -> str:
        return self.cmd.instance

    @property
    def function(self) -> str:
        return self.cmd.function

    @property
    def container(self) -> str | None:
        return self.proxy.name if self.proxy is not None else None

    @property
    def started(self) -> bool:
        return self.starting is not None and self.starting.done()

    @property
    def state(self) -> InstanceState:
        if self.failure is not None:
            return InstanceState.FAILED
        if not self.started:
            return InstanceState.STARTING
        if self.stop_reason is not None:
            return InstanceState.DRAINING
        if self.proxy is not None and self.proxy.state in (State.READY, State.PAUSED):
            return InstanceState.READY
        return InstanceState.STARTING

    @property
    def load(self) -> float:
        return (self.in_flight + self.waiting) / max(1, self.slots)


class InstanceManager:
    def __init__(self, agent: Agent, *, reservation_ttl_s: float = 30.0) -> None:
        self.invoker = invoker = agent.invoker
        self.redis = agent.redis
        self.keys = agent.keys
        self.name = agent.name
        self.boot = agent.boot
        self.registry = agent.registry
        self.budgets = agent.budgets
        self.reservation_ttl_s = reservation_ttl_s
        self.instances: dict[str, LocalInstance] = {}
        self.max_epoch = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        #: called when an instance becomes ready, fails or is gone (the report goes out at once)
        self.on_change: Callable[[], None] = lambda: None
        #: handlers of the commands that concern no instance (``preload``, ``release``: model pre-loading)
        self.other_ops: dict[str, Callable[[InstanceCommand], str]] = {}
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
            inst.starting = self._spawn(self._start(inst))
            return "start"
        if cmd.op == CommandOp.STOP:
            if inst is None:
                return "unknown"
            if inst.stop_reason is not None:
                return "duplicate"
            inst.stop_reason = cmd.reason or "stopped by the balancer"
            if inst.started:  # else the start stops it when it is over
                self._spawn(self._stop(inst))
            return "stop"
        other = self.other_ops.get(cmd.op)
        if other is not None:
            return other(cmd)
        log.warning("unknown instance command", op=cmd.op)
        return "unknown-op"

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- lifecycle -------------------------------------------------------------------------------

    async def _start(self, inst: LocalInstance) -> None:
        try:
            action = await self.registry.load(inst.function)
            if action is None:
                self._fail(inst, f"action {inst.function} is not registered")
                return
            inst.action = action
            inst.slots = max(1, action.limits.concurrency)
            container, failure = await self.invoker.start_instance(inst.id, action, gpu_index=inst.cmd.gpu)
            if container is not None:
                inst.proxy = self.invoker.pool.containers.get(container)
            if failure is not None:
                self._fail(inst, f"start failed: {failure.result}")
            elif inst.failure is None:
                log.info("instance ready", instance=inst.id, function=inst.function, container=container)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the instance fails, the invoker goes on
            log.exception("instance start failed", instance=inst.id)
            self._fail(inst, f"start failed: {exc!r}")
        finally:
            if inst.stop_reason is None:
                self.on_change()  # ready or failed: the report goes out at once
        if inst.stop_reason is not None:
            await self._stop(inst)

    def _fail(self, inst: LocalInstance, reason: str) -> None:
        if inst.failure is not None or (inst.stop_reason is not None and inst.started):
            return
        log.warning("instance failed", instance=inst.id, function=inst.function, reason=reason)
        inst.failure = Failure(reason, time.monotonic())
        if inst.started:
            self.on_change()

    def _on_transition(self, t: Transition) -> None:
        if t.new is not State.REMOVING or self._closing:
            return
        proxy = self.invoker.pool.containers.get(t.container)
        iid = proxy.placement.instance if proxy is not None else None
        inst = self.instances.get(iid) if iid is not None else None
        if inst is not None and inst.stop_reason is None and inst.proxy is proxy:
            self._fail(inst, f"container removed: {t.reason}")

    async def _stop(self, inst: LocalInstance) -> None:
        timeout_s = (inst.action.limits.timeout_ms / 1000 if inst.action else 60.0) + 5.0
        deadline = time.monotonic() + timeout_s
        while (inst.in_flight or inst.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if inst.container is not None:
            self.invoker.stop_instance(inst.container, inst.stop_reason or "stopped")
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
        started: float | None = None
        inst.stats.arrival()
        inst.waiting += 1

        def got_slot() -> None:  # the pool gave it one of the container's slots
            nonlocal started
            if started is None:
                started = time.monotonic()
                inst.stats.queued((started - arrived) * 1000)
                inst.waiting -= 1
                inst.in_flight += 1

        try:
            activation = await self.invoker.run_on_instance(instance_id, replace(req, action=inst.action),
                                                            on_lease=got_slot)
        except InvokerOverloaded:
            return None
        finally:
            if started is None:
                inst.waiting -= 1
            else:
                inst.in_flight -= 1
        if activation is not None and started is not None:
            inst.stats.completed((time.monotonic() - started) * 1000)
        return activation

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
            if inst.failure is not None and inst.stop_reason is None and now - inst.failure.at > FAILED_KEEP_S:
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
                latency_ms=latency, queue_delay_ms=delay,
                error=inst.failure.reason if inst.failure is not None else ""))
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
