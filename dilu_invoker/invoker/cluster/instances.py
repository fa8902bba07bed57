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

A *split* instance (a START with ``stages``: an LLM placed as pipeline stages over several GPUs of this
invoker) is one instance of several containers, one per stage, each under its stage's id on its stage's GPU
with the stage's GPU needs; they start together. It is READY when every stage is, FAILED when any stage's
start fails or any stage's container goes away without a stop (the other stages are then stopped and every
reservation released); a run goes through the stages in turn (`Invoker.run_on_stages`). docs/invoker.md,
"Split instances (pipeline stages)".

A *gang* (a START whose ``stages`` are ranks, `InstanceCommand.gang`: an action annotated ``gpu-count`` N) starts,
fails and stops as a split instance does, rank by rank on its GPUs; each rank's /init carries torch.distributed's
``env://`` rendezvous (rank 0's address and a port picked here), and a run goes to every rank at once
(`Invoker.run_on_ranks`). It is never moved. docs/invoker.md, "Gangs (gpu-count)".

A *stage move* (a MOVE_STAGE: one stage of a ready split instance to another GPU of this invoker) is make-before-
break while the pipeline serves: the new stage starts beside the old one (a failing new stage fails the move,
never the instance), the instance switches over to it (runs that start from then on go through it), the old
stage drains the runs that started on it and is stopped, and its reservation released. docs/invoker.md, "Stage
moves".

Commands arrive on ``{prefix}inv:{name}:cmd`` (consumer group ``invoker``). A command of an older epoch
than one already obeyed is refused (a deposed leader); one meant for an earlier boot of this invoker is
ignored. Each instance queues its activations for its ``concurrency`` slots and counts arrivals,
completions, run times and queueing delays for the load report.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from redis.exceptions import RedisError

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.invoker.api import InvokerOverloaded
from dilu_invoker.invoker.cluster.agent import Agent
from dilu_invoker.invoker.cluster.streams import read_group
from dilu_invoker.invoker.dataplane.container import ContainerProxy, State, Transition
from dilu_invoker.invoker.dataplane.core import RankStart, Rendezvous, StageStart
from dilu_invoker.model import Action, Activation, ActivationRequest, ActivationResponse, GpuNeeds
from dilu_invoker.wire import (
    COMMAND_GROUP,
    CommandOp,
    InstanceCommand,
    InstanceReport,
    InstanceState,
    StageRecord,
    WireError,
    from_stream,
    gpu_reservations,
    rank_of,
    stage_parent,
    stage_span,
    text,
)

log = structlog.get_logger(__name__)

#: a failed instance stays in the reports this long unless the balancer stops it first
FAILED_KEEP_S = 30.0
#: queueing delays kept per report period for the percentile
MAX_DELAY_SAMPLES = 4096
#: how often a split instance's stage processes are checked: one that exited fails the pipeline then, not at
#: its next run (a stage idle behind a busy one may not run for a while)
STAGE_WATCH_S = 0.5
#: how long a stopped container's removal (its processes, its GPU share) is waited for before its reservation is
#: released all the same (a stage move's old or failed new stage)
REMOVAL_WAIT_S = 30.0


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


class MovePhase(enum.Enum):
    #: the new stage starts beside the old one, which serves on
    STARTING = "starting"
    #: the new stage serves; the old one finishes the runs that started on it, then goes
    DRAINING = "draining"


@dataclass(slots=True, eq=False)
class StageMove:
    """A stage move in flight (`CommandOp.MOVE_STAGE`): stage `index` of a split instance goes from `old` to
    `new`, on another GPU of this invoker; `stages` is the instance's stage list once it is done."""

    index: int
    old: StageRecord
    new: StageRecord
    stages: tuple[StageRecord, ...]
    phase: MovePhase = MovePhase.STARTING

    @property
    def beside(self) -> StageRecord:
        """The stage the instance holds beside its stages (`LocalInstance.parts`): the new one while it starts,
        the old one while it drains."""
        return self.new if self.phase is MovePhase.STARTING else self.old


@dataclass(slots=True, eq=False)
class LocalInstance:
    cmd: InstanceCommand
    action: Action | None = None
    #: its containers (once the start got them) by the id each runs under (`parts`); the pool owns them
    proxies: dict[str, ContainerProxy] = field(default_factory=dict)
    #: the start, owned by the manager; the instance is STARTING until it is done
    starting: asyncio.Task[None] | None = None
    slots: int = 1
    waiting: int = 0
    in_flight: int = 0
    stats: PeriodStats = field(default_factory=PeriodStats)
    stop_reason: str | None = None
    failure: Failure | None = None
    #: a split instance's stage move in flight
    move: StageMove | None = None
    #: the id of the stage its last stage move put in place, once done; ``"{new id}: {why}"`` of the last one
    #: that failed (the report's ``moved`` and ``move_failed``)
    moved: str = ""
    move_failed: str = ""
    #: a split instance's runs, started or waiting, by each part they go through: a stage a move replaced is
    #: drained when none of those that started before the switch is left on it
    using: Counter[str] = field(default_factory=Counter)

    @property
    def id(self) -> str:
        return self.cmd.instance

    @property
    def function(self) -> str:
        return self.cmd.function

    @property
    def parts(self) -> tuple[str, ...]:
        """The ids its containers run under: each stage's of a split instance, else its own."""
        return tuple(s.id for s in self.cmd.stages) or (self.id,)

    @property
    def held_parts(self) -> tuple[str, ...]:
        """`parts`, and the stage a move in flight holds beside them: what a stop or a failure stops."""
        return self.parts + (self.move.beside.id,) if self.move is not None else self.parts

    @property
    def container(self) -> str | None:
        """Its (first stage's) container."""
        proxy = self.proxies.get(self.parts[0])
        return proxy.name if proxy is not None else None

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
        proxies = [self.proxies.get(part) for part in self.parts]
        if all(p is not None and p.state in (State.READY, State.PAUSED) for p in proxies):
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
        #: a split instance's stage ids → its id (what its containers run under → the instance)
        self._stage_owner: dict[str, str] = {}
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
            problem = self._stage_ids_problem(cmd) if cmd.stages else None
            if cmd.stages and problem is None:  # its stage ids are its own: it starts, fails, stops by them
                self._stage_owner.update((s.id, cmd.instance) for s in cmd.stages)
                problem = self._stage_problem(cmd)
            log.info("instance starting", instance=cmd.instance, function=cmd.function, gpu=cmd.gpu,
                     request=cmd.request, limit=cmd.limit, reason=cmd.reason,
                     stages=[(s.id, s.gpu) for s in cmd.stages] or None)
            inst.starting = self._spawn(self._start(inst, problem))
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
        if cmd.op == CommandOp.MOVE_STAGE:
            if inst is None:  # nothing here to report its failure on, nor to say the new stage's id is its own
                log.warning("stage move of an unknown instance refused", instance=cmd.instance,
                            stages=[(s.id, s.gpu) for s in cmd.stages])
                return "unknown"
            return self._move_stage(inst, cmd)
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

    def _stage_ids_problem(self, cmd: InstanceCommand) -> str | None:
        ids = [s.id for s in cmd.stages]
        taken = [i for i in ids if not i or i in self.instances or i in self._stage_owner or i == cmd.instance]
        if taken or len(set(ids)) < len(ids):
            return f"invalid {_kind(cmd)}: {_parts(cmd)} ids must be distinct and new, got {ids}"
        n = len(ids)
        if cmd.gang and (n < 2 or [rank_of(i) for i in ids] != [(cmd.instance, k, n) for k in range(n)]):
            return f"invalid gang: its ranks' ids must be rank 0 to {n - 1} of {n} of {cmd.instance}, got {ids}"
        return None

    def _stage_problem(self, cmd: InstanceCommand) -> str | None:
        """What makes a split instance's stages impossible here (None: nothing): each stage needs its own GPU
        of this invoker and a valid share."""
        stages = cmd.stages
        gpus = [s.gpu for s in stages]
        part = _parts(cmd)
        if len(set(gpus)) < len(gpus):
            return f"invalid {_kind(cmd)}: each {part} needs a GPU of its own, got GPUs {gpus}"
        for k, s in enumerate(stages):
            problem = self._placement_problem(k, s, part)
            if problem is not None:
                return f"invalid {_kind(cmd)}: {problem}"
        return None

    def _placement_problem(self, k: int, s: StageRecord, part: str = "stage") -> str | None:
        """What makes stage (or rank) `k` impossible here on its own (None: nothing): a GPU of this invoker, that
        GPU's uuid, a valid share."""
        devices = {d.index: d.uuid for d in getattr(self.invoker.gpu, "devices", ())}
        if s.gpu not in devices:
            return f"{part} {k} is placed on GPU {s.gpu}, which this invoker does not have (its GPUs: {sorted(devices)})"
        if s.gpu_uuid and s.gpu_uuid != devices[s.gpu]:
            return f"{part} {k} is placed on {s.gpu_uuid}, but GPU {s.gpu} of this invoker is {devices[s.gpu]}"
        if not (0.0 < s.request <= s.limit <= 1.0) or s.memory_mb <= 0:
            return (f"{part} {k} asks for request {s.request}, limit {s.limit}, memory {s.memory_mb} MB "
                    f"(0 < request <= limit <= 1, memory > 0)")
        return None

    async def _start(self, inst: LocalInstance, problem: str | None = None) -> None:
        try:
            if problem is not None:
                self._fail(inst, problem)
                return
            action = await self.registry.load(inst.function)
            if action is None:
                self._fail(inst, f"action {inst.function} is not registered")
                return
            inst.action = action
            inst.slots = max(1, action.limits.concurrency)
            problem = _gang_problem(inst.cmd, action)
            if problem is not None:
                self._fail(inst, problem)
                return
            if inst.cmd.gang:
                await self._start_ranks(inst, action)
            elif inst.cmd.stages:
                await asyncio.gather(*(self._start_stage(inst, action, k) for k in range(len(inst.cmd.stages))))
            else:
                container, failure = await self.invoker.start_instance(inst.id, action, gpu_index=inst.cmd.gpu)
                self._started_part(inst, inst.id, container, failure)
            if inst.failure is None:
                log.info("instance ready", instance=inst.id, function=inst.function,
                         containers=[p.name for p in inst.proxies.values()])
                if inst.cmd.stages:
                    self._spawn(self._watch_stages(inst))
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

    async def _start_stage(self, inst: LocalInstance, action: Action, k: int) -> None:
        stages = inst.cmd.stages
        stage = stages[k]
        start = StageStart(index=k, count=len(stages), span=stage_span(stages, k), request=stage.request,
                           limit=stage.limit, memory_mb=stage.memory_mb)
        container, failure = await self.invoker.start_instance(stage.id, action, gpu_index=stage.gpu, stage=start)
        self._started_part(inst, stage.id, container, failure, f"stage {k} of {len(stages)}: ")

    async def _start_ranks(self, inst: LocalInstance, action: Action) -> None:
        """Every rank of a gang at once, each on its GPU; they meet at rank 0's address (`Rendezvous`), which each
        rank's /init waits for."""
        ranks = inst.cmd.stages
        rendezvous = Rendezvous.new()

        async def one(k: int) -> None:
            rank = ranks[k]
            start = RankStart(rank=k, world=len(ranks), rendezvous=rendezvous, request=rank.request,
                              limit=rank.limit, memory_mb=rank.memory_mb)
            try:
                container, failure = await self.invoker.start_instance(rank.id, action, gpu_index=rank.gpu,
                                                                       stage=start)
            finally:
                if k == 0:  # started (the address is out) or not: no rank waits on in vain
                    rendezvous.close("rank 0 did not start")
            self._started_part(inst, rank.id, container, failure, f"{start.named}: ")

        log.info("gang rendezvous", instance=inst.id, master_port=rendezvous.port, world=len(ranks))
        await asyncio.gather(*(one(k) for k in range(len(ranks))))

    async def _watch_stages(self, inst: LocalInstance) -> None:
        """Remove a stage whose process exited (the removal fails the instance, `_on_transition`). It watches the
        instance's current stages (`proxies`): after a stage move's switch the new one, not the old one that
        drains (whose exit fails nothing)."""
        while self.instances.get(inst.id) is inst and inst.failure is None and inst.stop_reason is None:
            for proxy in list(inst.proxies.values()):
                container = proxy.container
                if container is not None and not container.alive and proxy.state in (State.READY, State.PAUSED):
                    self.invoker.pool.remove(proxy, f"its process exited ({container.exit_reason() or 'no reason'})")
            await asyncio.sleep(STAGE_WATCH_S)

    def _started_part(self, inst: LocalInstance, part: str, container: str | None,
                      failure: ActivationResponse | None, named: str = "") -> None:
        """One of its containers' start is over: from now on its removal without a stop fails the instance."""
        proxy = self.invoker.pool.containers.get(container) if container is not None else None
        if failure is not None:
            self._fail(inst, f"{named}start failed: {failure.result}")
        elif proxy is None or proxy.state in (State.REMOVING, State.REMOVED):
            self._fail(inst, f"{named}start failed: its container is gone")
        else:
            inst.proxies[part] = proxy

    def _fail(self, inst: LocalInstance, reason: str) -> None:
        if inst.failure is not None or (inst.stop_reason is not None and inst.started):
            return
        log.warning("instance failed", instance=inst.id, function=inst.function, reason=reason)
        inst.failure = Failure(reason, time.monotonic())
        if inst.cmd.stages and self._owns_stages(inst):
            # A pipeline (a gang) is whole or nothing: its other stages (ranks) go, and what each holds on its GPU.
            self._stop_parts(inst, f"another {_parts(inst.cmd)} of the instance failed: {reason}")
            self._spawn(self._release(self._held(inst)))
        if inst.started:
            self.on_change()

    def _stop_parts(self, inst: LocalInstance, reason: str) -> None:
        """Remove each of its containers: those it has, those of stages still starting, and the stage a move in
        flight holds beside them (none when its stage ids were refused: they may be another instance's)."""
        if self._owns_stages(inst):
            self._stop_containers(set(inst.held_parts), reason)

    def _stop_containers(self, parts: Collection[str], reason: str) -> None:
        """Remove every container that runs under one of these ids (started or still starting)."""
        for proxy in list(self.invoker.pool.containers.values()):
            if proxy.placement.instance in parts:
                self.invoker.stop_instance(proxy.name, reason)

    async def _gone(self, parts: Collection[str], timeout_s: float = REMOVAL_WAIT_S) -> None:
        """Until no container of these ids is left (its processes and GPU share gone with it), at most
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (any(p.placement.instance in parts for p in self.invoker.pool.containers.values())
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    def _on_transition(self, t: Transition) -> None:
        if t.new is not State.REMOVING or self._closing:
            return
        proxy = self.invoker.pool.containers.get(t.container)
        part = proxy.placement.instance if proxy is not None else None
        if part is None:
            return
        inst = self.instances.get(self._stage_owner.get(part, part))
        if inst is not None and inst.stop_reason is None and inst.proxies.get(part) is proxy:
            named = f"{_parts(inst.cmd)} {inst.parts.index(part)} of {len(inst.parts)}: " if inst.cmd.stages else ""
            self._fail(inst, f"{named}container removed: {t.reason}")

    @staticmethod
    def _drain_s(inst: LocalInstance) -> float:
        """How long its runs in flight are waited for: the action's time limit and a margin."""
        return (inst.action.limits.timeout_ms / 1000 if inst.action else 60.0) + 5.0

    async def _stop(self, inst: LocalInstance) -> None:
        deadline = time.monotonic() + self._drain_s(inst)
        while (inst.in_flight or inst.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if inst.cmd.stages:
            self._stop_parts(inst, inst.stop_reason or "stopped")
        elif inst.container is not None:
            self.invoker.stop_instance(inst.container, inst.stop_reason or "stopped")
        await self._release(self._held(inst))
        self._forget(inst)
        log.info("instance stopped", instance=inst.id, function=inst.function, reason=inst.stop_reason)
        self.on_change()

    def _forget(self, inst: LocalInstance) -> None:
        if self.instances.get(inst.id) is inst:
            del self.instances[inst.id]
            moving = (inst.move.old, inst.move.new) if inst.move is not None else ()
            for s in (*inst.cmd.stages, *moving):
                if self._stage_owner.get(s.id) == inst.id:
                    del self._stage_owner[s.id]

    def _held(self, inst: LocalInstance) -> tuple[tuple[str, str], ...]:
        """(GPU uuid, reservation id) of what it holds, the stage a move in flight holds beside its stages
        included; none for a split instance whose stage ids were refused (they may be another instance's)."""
        if not self._owns_stages(inst):
            return ()
        cmd = inst.cmd
        held = gpu_reservations(cmd.instance, cmd.gpu_uuid, cmd.stages)
        beside = inst.move.beside if inst.move is not None else None
        return held + ((beside.gpu_uuid, beside.id),) if beside is not None and beside.gpu_uuid else held

    def _owns_stages(self, inst: LocalInstance) -> bool:
        """Its stage ids are its own (true of any instance but a split one whose stage ids were refused)."""
        return all(self._stage_owner.get(s.id) == inst.id for s in inst.cmd.stages)

    async def _release(self, held: tuple[tuple[str, str], ...]) -> None:
        if self.budgets is None:
            return
        for uuid, reservation in held:
            with contextlib.suppress(RedisError):
                await self.budgets.release(uuid, reservation)

    # -- stage moves -----------------------------------------------------------------------------

    def _move_stage(self, inst: LocalInstance, cmd: InstanceCommand) -> str:
        """Start a stage move of the instance (`_move` carries it out), or refuse it: the move fails at once and
        nothing of the instance is touched."""
        stages, current = cmd.stages, inst.cmd.stages
        if stages and (stages == current or (inst.move is not None and stages == inst.move.stages)):
            return "duplicate"  # the move in flight or done, sent again: nothing to do, and no failure to report
        changed = [k for k, (s, c) in enumerate(zip(stages, current, strict=False)) if s != c]
        k = changed[0] if len(stages) == len(current) and len(changed) == 1 else None
        problem = self._move_problem(inst, stages, changed, k)
        if problem is not None:
            new = stages[k] if k is not None else None
            named = new.id if new is not None else ",".join(s.id for s in stages if s.id not in inst.parts)
            log.warning("stage move refused", instance=inst.id, new=named, reason=problem)
            if new is not None and new.gpu_uuid and self._new_stage_id(inst, new.id):
                # what the balancer reserved for it (an id that is not new may be another stage's: left alone)
                self._spawn(self._release(((new.gpu_uuid, new.id),)))
            if named not in inst.held_parts:  # (a report of a stage that serves or moves would say it failed)
                inst.move_failed = f"{named}: {problem}"
                self.on_change()
            return "refused"
        assert k is not None
        move = inst.move = StageMove(k, current[k], stages[k], stages)
        self._stage_owner[move.new.id] = inst.id
        log.info("stage move starting", instance=inst.id, stage=k, old=move.old.id, old_gpu=move.old.gpu,
                 new=move.new.id, gpu=move.new.gpu, reason=cmd.reason)
        self._spawn(self._move(inst, move))
        return "move-stage"

    def _move_problem(self, inst: LocalInstance, stages: tuple[StageRecord, ...], changed: list[int],
                      k: int | None) -> str | None:
        """Why a stage move of the instance to `stages` cannot be done (None: it can)."""
        current = inst.cmd.stages
        if not current:
            return f"invalid stage move: {inst.id} is not a split instance"
        if inst.cmd.gang:
            return (f"invalid stage move: {inst.id} is a gang of {len(current)} ranks, not a split instance (its "
                    "ranks start, run and stop together: a gang is never moved rank by rank)")
        if inst.state is not InstanceState.READY:
            return f"stage move refused: the instance is {inst.state.value}, not ready"
        if inst.move is not None:
            return f"stage move refused: a stage move of the instance is in flight (to {inst.move.new.id})"
        if len(stages) != len(current):
            return f"invalid stage move: {len(stages)} stages, the instance has {len(current)}"
        if k is None:
            return f"invalid stage move: exactly one stage must change, got stages {changed}"
        new = stages[k]
        if not self._new_stage_id(inst, new.id):
            return f"invalid stage move: stage id {new.id!r} is not a new stage id of {inst.id}"
        held = {s.gpu: j for j, s in enumerate(current)}  # the new list's other stages are these
        if new.gpu in held:
            return f"invalid stage move: stage {k} is moved to GPU {new.gpu}, which holds stage {held[new.gpu]}"
        problem = self._placement_problem(k, new)
        return f"invalid stage move: {problem}" if problem is not None else None

    def _new_stage_id(self, inst: LocalInstance, sid: str) -> bool:
        """A stage id of the instance that nothing here runs under or holds."""
        return (stage_parent(sid) == inst.id and sid not in self.instances and sid not in self._stage_owner
                and sid not in inst.parts)

    def _serving(self, inst: LocalInstance) -> bool:
        return self.instances.get(inst.id) is inst and inst.failure is None and inst.stop_reason is None

    async def _move(self, inst: LocalInstance, move: StageMove) -> None:
        """Make before break: start the new stage beside the old one, switch the instance over to it, drain the
        old one, stop it and release what it holds. The instance serves throughout; a new stage that fails to
        start, or whose container goes before the switch, fails the move only."""
        new, k, n = move.new, move.index, len(move.stages)
        try:
            assert inst.action is not None  # a ready instance has its action
            start = StageStart(index=k, count=n, span=stage_span(move.stages, k), request=new.request,
                               limit=new.limit, memory_mb=new.memory_mb)
            container, failure = await self.invoker.start_instance(new.id, inst.action, gpu_index=new.gpu,
                                                                   stage=start)
            proxy = self.invoker.pool.containers.get(container) if container is not None else None
            if not self._serving(inst):
                why = "the instance " + ("failed" if inst.failure is not None else "was stopped")
            elif failure is not None:
                why = f"start failed: {failure.result}"
            elif proxy is None or proxy.state in (State.REMOVING, State.REMOVED):
                why = "start failed: its container is gone"
            else:
                why = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the move fails, the instance serves on
            log.exception("stage move failed", instance=inst.id, new=new.id)
            why = f"start failed: {exc!r}"
        if why is not None:
            await self._move_failed(inst, move, why)
            return
        assert proxy is not None
        self._switch(inst, move, proxy)
        await self._drain_moved(inst, move)

    async def _move_failed(self, inst: LocalInstance, move: StageMove, why: str) -> None:
        """The new stage goes (its container, its reservation); the old one serves on."""
        new = move.new
        log.warning("stage move failed", instance=inst.id, stage=move.index, new=new.id, gpu=new.gpu, reason=why)
        await self._let_go(inst, move, new, f"stage move failed: {why}")
        inst.move_failed = f"{new.id}: {why}"
        self.on_change()

    async def _let_go(self, inst: LocalInstance, move: StageMove, stage: StageRecord, reason: str) -> None:
        """The stage a move leaves behind (the old one once done, the new one once failed): its container stopped
        and its removal waited for, its reservation released, its id no longer the instance's; the move is over."""
        self._stop_containers((stage.id,), reason)
        await self._gone((stage.id,))
        if stage.gpu_uuid:
            await self._release(((stage.gpu_uuid, stage.id),))
        if inst.move is move:
            inst.move = None
        if self._stage_owner.get(stage.id) == inst.id:
            del self._stage_owner[stage.id]

    def _switch(self, inst: LocalInstance, move: StageMove, proxy: ContainerProxy) -> None:
        """Every run that starts from now on goes through the new stage; those that started before keep the
        stages they started with (`run`)."""
        stages = move.stages
        inst.cmd = replace(inst.cmd, stages=stages, gpu=stages[0].gpu, gpu_uuid=stages[0].gpu_uuid)
        inst.proxies.pop(move.old.id, None)  # its removal from now on fails nothing (`_on_transition`)
        inst.proxies[move.new.id] = proxy
        move.phase = MovePhase.DRAINING
        log.info("stage move switched", instance=inst.id, stage=move.index, new=move.new.id, container=proxy.name,
                 draining=inst.using[move.old.id])

    async def _drain_moved(self, inst: LocalInstance, move: StageMove) -> None:
        """The old stage finishes the runs that started on it (at most the action's time limit and a margin),
        then goes; the move is done. A stop or failure of the instance meanwhile takes it with the rest."""
        old, new = move.old, move.new
        deadline = time.monotonic() + self._drain_s(inst)
        while inst.using[old.id] and time.monotonic() < deadline and self._serving(inst):
            await asyncio.sleep(0.05)
        if not self._serving(inst):
            return
        if inst.using[old.id]:
            log.warning("stage move: runs still on the old stage are cut short", instance=inst.id, stage=old.id,
                        runs=inst.using[old.id])
        await self._let_go(inst, move, old, f"stage {move.index} moved to GPU {new.gpu} ({new.id})")
        if not inst.using[old.id]:
            del inst.using[old.id]
        inst.moved = new.id
        log.info("stage move done", instance=inst.id, stage=move.index, old=old.id, new=new.id, gpu=new.gpu)
        self.on_change()

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

        # A split instance's run goes through the stages it starts with, to its end: a stage move drains the
        # stage it replaces by these counts. A gang's goes to all its ranks at once.
        parts = inst.parts if inst.cmd.stages else ()
        inst.using.update(parts)
        try:
            if parts and inst.cmd.gang:
                activation = await self.invoker.run_on_ranks(parts, replace(req, action=inst.action),
                                                             on_lease=got_slot)
            elif parts:
                activation = await self.invoker.run_on_stages(parts, replace(req, action=inst.action),
                                                              on_lease=got_slot)
            else:
                activation = await self.invoker.run_on_instance(instance_id, replace(req, action=inst.action),
                                                                on_lease=got_slot)
        except InvokerOverloaded:
            return None
        finally:
            if started is None:
                inst.waiting -= 1
            else:
                inst.in_flight -= 1
            inst.using.subtract(parts)
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
                self._spawn(self._release(self._held(inst)))
                self._forget(inst)
                continue
            arrivals, completions, latency, delay = inst.stats.take(now)
            share, saturated, throttled = _share_of(inst.parts, shares or {})
            cmd = inst.cmd
            out.append(InstanceReport(
                id=inst.id, function=inst.function, rev=(inst.action.revision or "") if inst.action else cmd.rev,
                state=inst.state.value, cls=cmd.cls, gpu=cmd.gpu, request=cmd.request, limit=cmd.limit,
                memory_mb=cmd.memory_mb, slots=inst.slots, share=share, saturated=saturated, throttled_s=throttled,
                waiting=inst.waiting, in_flight=inst.in_flight, arrival_rate=arrivals, completion_rate=completions,
                latency_ms=latency, queue_delay_ms=delay,
                error=inst.failure.reason if inst.failure is not None else "", moved=inst.moved,
                move_failed=inst.move_failed))
        return out

    async def renew_reservations(self) -> None:
        if self.budgets is None:
            return
        by_gpu: dict[str, list[str]] = {}
        for inst in self.instances.values():
            if inst.state is not InstanceState.FAILED:
                for uuid, reservation in self._held(inst):
                    by_gpu.setdefault(uuid, []).append(reservation)
        for uuid, ids in by_gpu.items():
            await self.budgets.renew(uuid, ids, ttl_s=self.reservation_ttl_s)

    async def close(self) -> None:
        self._closing = True  # the invoker removes every container next: that is no instance failure
        await cancel_and_wait(*self._tasks)
        for inst in list(self.instances.values()):
            await self._release(self._held(inst))


def _kind(cmd: InstanceCommand) -> str:
    return "gang" if cmd.gang else "split instance"


def _parts(cmd: InstanceCommand) -> str:
    return "rank" if cmd.gang else "stage"


def _gang_problem(cmd: InstanceCommand, action: Action) -> str | None:
    """Why the start cannot make the action's instance (None: it can): an action annotated ``gpu-count`` N > 1
    runs as a gang of N ranks or not at all, never on one GPU."""
    gpus = GpuNeeds.gpus_of(action.annotation_map)  # (invalid annotations: the start explains them, as before)
    if gpus > 1 and not cmd.gang:
        got = f"{len(cmd.stages)} pipeline stages" if cmd.stages else "one GPU"
        return f"invalid start: annotation 'gpu-count' {gpus} makes each instance a gang of {gpus} ranks, got {got}"
    return None


def _share_of(parts: tuple[str, ...], shares: Mapping[str, tuple[float | None, bool | None, float | None]],
              ) -> tuple[float | None, bool | None, float | None]:
    """(share, saturated, throttled s) of an instance from its containers': a pipeline runs at its slowest
    stage's pace, so the lowest share; saturated when any stage is; the most throttled stage's time."""
    if len(parts) == 1:
        return shares.get(parts[0], (None, None, None))
    seen = [shares[p] for p in parts if p in shares]
    if len(seen) < len(parts):
        return None, None, None
    got = [s for s, _, _ in seen if s is not None]
    sat = [x for _, x, _ in seen if x is not None]
    thr = [t for _, _, t in seen if t is not None]
    return (min(got) if len(got) == len(seen) else None, any(sat) if sat else None, max(thr) if thr else None)
