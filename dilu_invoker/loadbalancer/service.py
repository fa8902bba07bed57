"""``dilu-invoker balancer``: the cluster balancer service (standalone mode embeds one).

Every balancer campaigns for the lease (:mod:`~dilu_invoker.loadbalancer.lease`); the leader, each tick
(``--balancer-tick-s``) and at once when a router signals demand:

1. reads the invokers' load reports (an expired report means the invoker is gone), the function registry
   and the GPU budgets of the live invokers' GPUs, and builds a :class:`~dilu_invoker.policy.ClusterSnapshot`;
2. runs :func:`~dilu_invoker.loadbalancer.planner.plan_tick` (pure: horizontal policy, placement, stops,
   routing tables);
3. reserves each new instance's GPU budget atomically (the same Lua admission the node uses), then writes
   the instance table, the start/stop commands on the invokers' streams, the routing tables and the
   decisions in one fenced script — nothing is written if the lease moved on.

A standby polls the lease every 0.2 s, so it leads within ``lease-ttl + 0.2 s`` of the leader's death; a
leader that stops cleanly releases the lease at once. See docs/balancer.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import operator
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, replace
from itertools import compress
from typing import Any, ClassVar

import msgpack
import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError

from dilu_invoker import logs
from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.config import Config, ConfigError
from dilu_invoker.gpu.budgets import BudgetCache, GpuBudget, GpuBudgets, Reservation, ReserveResult
from dilu_invoker.loadbalancer.lease import LeaderLease, Leadership, Ops
from dilu_invoker.loadbalancer.model_preload import ActionFeed, following, place_first
from dilu_invoker.loadbalancer.planner import (
    CompactionLoop,
    Evictable,
    FunctionState,
    Order,
    PlanMemo,
    PlannerConfig,
    TickInput,
    TickPlan,
    plan_tick,
    weights_identity,
)
from dilu_invoker.model import weights_group
from dilu_invoker.policy import (
    Affinity,
    ClusterSnapshot,
    GpuRef,
    GpuState,
    HorizontalConfig,
    InstanceClass,
    PlacedInstance,
    PlacementConfig,
    Profile,
)
from dilu_invoker.policy.live_compaction import LiveCompaction, live_compaction_config
from dilu_invoker.wire import (
    CommandOp,
    FunctionSpec,
    GpuReport,
    InstanceCommand,
    InstanceRecord,
    Keys,
    LoadReport,
    RecordState,
    ReportDecoder,
    RoutingTable,
    StageRecord,
    WireError,
    decode,
    pack,
    rank_of,
    stage_parent,
    text,
)

log = structlog.get_logger(__name__)

COMMAND_STREAM_MAXLEN = 1000
DECISION_STREAM_MAXLEN = 2000
#: a standby checks the lease this often
POLL_S = 0.2
#: demand signals never make ticks closer than this
MIN_TICK_GAP_S = 0.05


#: Every function's ``meta`` field (false where there is none), packed into one msgpack reply: a pipeline of
#: one HGET per function costs redis-py's reply parser a round of reads per function, several times the decoding
#: (docs/benchmarks/planner-scale.md). Chunked by the caller (`READ_CHUNK`) so that no call holds Redis long.
READ_METAS = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGET', key, 'meta') end
return cmsgpack.pack(out)
"""
#: keys per `READ_METAS` / `READ_STRINGS` call (a few milliseconds of Redis's time each)
READ_CHUNK = 2000
#: A whole hash packed into one msgpack reply (field, value, field, value, …): a new leader reads the instance
#: table once, and redis-py parsing tens of thousands of fields one by one holds the event loop for seconds.
READ_HASH = """
return cmsgpack.pack(redis.call('HGETALL', KEYS[1]))
"""
#: The members of a set packed into one msgpack reply (the invokers, the functions), for the same reason.
READ_MEMBERS = """
return cmsgpack.pack(redis.call('SMEMBERS', KEYS[1]))
"""
#: MGET packed into one msgpack reply (false for a missing key), for the same reason (the load reports).
READ_STRINGS = """
return cmsgpack.pack(redis.call('MGET', unpack(KEYS)))
"""


@dataclass(frozen=True, slots=True)
class _Names:
    """A registry set as last read (`Balancer._names`): its packed reply, its members sorted, and their keys."""

    packed: bytes
    names: list[str]
    keys: list[str]
    members: frozenset[str]


def planner_config(cfg: Config) -> PlannerConfig:
    """The policies' configuration from the balancer's settings; ConfigError names the flag at fault."""
    b = cfg.balancer
    try:
        horizontal = HorizontalConfig(
            window=b.window,
            scale_out_samples=b.scale_out_samples,
            scale_in_samples=b.scale_in_samples,
            sample_period_s=b.tick_s,
            stale_after_s=max(5.0, 5 * b.tick_s),
            cooldown_s=b.cooldown_s,
            scale_to_zero_after_s=b.scale_to_zero_after_s,
        )
    except ValueError as exc:
        raise ConfigError(f"balancer scaling settings (--balancer-window, -scale-*): {exc}") from None
    try:
        placement = PlacementConfig(strategy=b.strategy, gamma=cfg.gpu.gamma, affinity=Affinity(b.affinity),
                                    llm_max_parts=b.max_stages, split_node_fit=b.split_node_fit)
    except ValueError as exc:
        raise ConfigError(f"--balancer-strategy / --gpu-gamma: {exc}") from None
    compaction = None
    if b.compaction:
        compaction = LiveCompaction(config=live_compaction_config(max_moves=b.compaction_max_moves,
                                                                  max_request=b.compaction_max_request,
                                                                  merges=b.compaction_merges,
                                                                  memory_merges=b.compaction_memory_merges,
                                                                  stages=b.compaction_stages,
                                                                  repacks=b.compaction_repacks),
                                    period_s=b.compaction_period_s)
    return PlannerConfig(horizontal=horizontal, placement=placement, start_timeout_s=b.start_timeout_s,
                         demand_hold_s=max(2.0, 2 * cfg.balancer.report_period_s), compaction=compaction)


class BalancerMetrics:
    """Prometheus metrics of one balancer (its own registry), and the compaction totals it also keeps in
    Redis (``P bal:compaction``, msgpack map) so any process can read them."""

    #: decision kind → outcome: a replacement's, or a stage move's (`CommandOp.MOVE_STAGE`)
    MOVES: ClassVar[Mapping[str, str]] = {"move": "started", "move-done": "done", "move-abandoned": "abandoned",
                                          "stage-move": "started", "stage-move-done": "done",
                                          "stage-move-failed": "abandoned", "move-held": "held"}

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ticks = Counter("dilu_balancer_ticks", "Ticks this balancer ran as the leader", registry=r)
        self.compaction_runs = Counter("dilu_balancer_compaction_runs", "Compaction runs", registry=r)
        self.compaction_moves = Counter(
            "dilu_balancer_compaction_moves",
            "Compaction moves by outcome: started (a replacement or a pipeline stage's, i.e. cold starts), done "
            "(original drained), abandoned (the replacement or the new stage failed; the original kept serving), "
            "held (not made: the target invoker's user memory could not hold the containers it starts, or a move of "
            "the function onto that GPU failed lately)",
            ("outcome",), registry=r)
        self.compaction_in_flight = Gauge("dilu_balancer_compaction_in_flight",
                                          "Compaction replacements starting and stage moves in flight", registry=r)
        self.compaction_run_cpu = Histogram(
            "dilu_balancer_compaction_run_cpu_seconds",
            "CPU seconds of each compaction run (the leader's planning thread): what compaction costs the leader",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)
        self.totals: dict[str, int] = {"runs": 0, "started": 0, "done": 0, "abandoned": 0, "held": 0}

    def observe(self, plan: TickPlan, before: CompactionLoop, refused: frozenset[str] = frozenset()) -> bool:
        """Count a tick's compaction; True when the totals changed. `refused`: the replacements and new stages whose
        GPU budget refused them (not started: not counted)."""
        self.ticks.inc()
        changed = False
        if plan.compaction_cpu_s is not None:
            self.compaction_run_cpu.observe(plan.compaction_cpu_s)
        if plan.compaction.next_at != before.next_at:
            self.compaction_runs.inc()
            self.totals["runs"] += 1
            changed = True
        for d in plan.decisions:
            outcome = self.MOVES.get(d.kind)
            if outcome is not None and not (outcome == "started" and d.instance in refused):
                self.compaction_moves.labels(outcome).inc()
                self.totals[outcome] += 1
                changed = True
        self.compaction_in_flight.set(sum(1 for r in plan.records.values()
                                          if (r.replaces or r.moving) and r.id not in refused))
        return changed


def compaction_held(raw: bytes | str, now: float) -> CompactionLoop:
    """What an earlier leader's compaction held back (``P bal:compaction`` field ``held``): the instances cooling down
    after a failed move and the GPUs held against a function (`CompactionLoop.cooling`, `failed_targets`), those not
    over by ``now``. Anything unreadable is dropped: this is only what spares a cold start."""
    try:
        held = msgpack.unpackb(raw) if isinstance(raw, bytes) else {}
        loop = CompactionLoop(
            cooling=tuple((str(i), float(t)) for i, t in held.get("cooling", ())),
            failed_targets=tuple((str(f), str(inv), int(g), float(t)) for f, inv, g, t in held.get("failed_targets", ())))
    except (ValueError, TypeError, AttributeError):
        return CompactionLoop()
    return loop.held(now)


def _natural(name: str) -> tuple[str, int, str]:
    m = re.match(r"^(.*?)(\d+)$", name)
    return (m.group(1), int(m.group(2)), name) if m else (name, -1, name)


def weight_groups_of(invoker: str, reservations: Iterable[Reservation]) -> frozenset[tuple[str, float]]:
    """The shared weights a GPU of ``invoker`` holds, as its snapshot names them (`GpuState.weight_groups`):
    the sharing groups of that invoker's own reservations there (another invoker's instances cannot map
    them, so they are not shared with its new instances)."""
    held: set[tuple[str, float]] = set()
    for r in reservations:
        key = r.sharing_key
        if key is None or r.invoker != invoker:
            continue
        prefix = weights_group(invoker, r.function, "")
        if key[0].startswith(prefix):
            held.add((weights_identity(r.function, key[0][len(prefix):]), float(key[1])))
    return frozenset(held)


def evictable_of(invoker: str, reservations: Iterable[Reservation]) -> Evictable | None:
    """The kept weights (staged exit) on a GPU of ``invoker`` that its invoker evicts for room: its own
    reservations marked ``kept``, with the GPU's weight groups once they are gone; None when it holds none."""
    every = list(reservations)
    kept = [r for r in every if r.kept and r.invoker == invoker]
    if not kept:
        return None
    ids = frozenset(r.instance for r in kept)
    return Evictable(instances=ids, weight_groups=weight_groups_of(invoker, [r for r in every if r.instance not in ids]),
                     memory_mib=float(sum(r.memory_mb for r in kept)))


def gpu_state_of(invoker: str, gpu: GpuReport, enabled: bool, budget: GpuBudget | None,
                 specs: Mapping[str, FunctionSpec], seen_instance: set[str]) -> tuple[GpuState, Evictable | None]:
    """One GPU of `cluster_of`'s snapshot, and its kept weights: the reservations its budget holds but those of
    instances in ``seen_instance`` (counted on an earlier GPU), which it adds them to."""
    placed: list[PlacedInstance] = []
    for r in (budget.reservations.values() if budget is not None else ()):
        if r.instance in seen_instance:
            continue
        seen_instance.add(r.instance)
        spec = specs.get(r.function)
        try:
            cls = InstanceClass.parse(r.cls)
        except ValueError:
            cls = InstanceClass.INFERENCE
        # A gang's rank is the gang on this GPU: one instance over as many GPUs as its id says (`rank_of`).
        gang = rank_of(r.instance)
        placed.append(PlacedInstance(
            id=r.instance if gang is None else gang[0], function=r.function, cls=cls, request=r.request,
            limit=r.limit, memory_mib=float(r.memory_mb),
            profile=Profile(spec.profile) if spec is not None and spec.profile else None,
            gpus=1 if gang is None else gang[2], part_of=stage_parent(r.instance)))
    memory = budget.capacity.memory_mb if budget is not None else gpu.memory_mb
    groups = weight_groups_of(invoker, budget.reservations.values()) if budget is not None else frozenset()
    ref = GpuRef(invoker, gpu.index)
    state = GpuState(ref=ref, memory_mib=float(max(1, memory)), uuid=gpu.uuid, sm_count=gpu.sm_count,
                     instances=tuple(placed), schedulable=enabled, weight_groups=groups)
    kept = evictable_of(invoker, budget.reservations.values()) if budget is not None else None
    if kept is not None and not kept.instances <= {p.id for p in placed}:
        kept = None
    return state, kept


def cluster_of(now: float, reports: Mapping[str, LoadReport], specs: Mapping[str, FunctionSpec],
               budgets: Mapping[str, GpuBudget | None]) -> tuple[ClusterSnapshot | None, dict[GpuRef, Evictable]]:
    """The snapshot the planner sees: each live invoker's GPUs (a GPU two invokers report counts for the first)
    with the reservations its budget holds (an instance reserved on two GPUs counts on the first), and the kept
    weights among them (`evictable_of`). Pure: the budgets are read before (`GpuBudgets.get_many`).
    `SnapshotCache.cluster` derives the same from the last tick's."""
    states: list[GpuState] = []
    evictable: dict[GpuRef, Evictable] = {}
    seen_uuid: set[str] = set()
    seen_instance: set[str] = set()
    for name, report in reports.items():
        for g in report.gpus:
            if g.uuid in seen_uuid:
                log.warning("a GPU is reported by two invokers; ignoring the second", uuid=g.uuid, invoker=name)
                continue
            seen_uuid.add(g.uuid)
            state, kept = gpu_state_of(name, g, report.enabled, budgets.get(g.uuid), specs, seen_instance)
            states.append(state)
            if kept is not None:
                evictable[state.ref] = kept
    if not states:
        return None, {}
    return ClusterSnapshot.build(now=now, gpus=states), evictable


@dataclass(frozen=True, slots=True)
class _CachedGpu:
    """A GPU's part of the last snapshot and what it was derived from (compared by identity, but the report)."""

    invoker: str
    report: GpuReport
    enabled: bool
    budget: GpuBudget | None
    functions: frozenset[str]
    """The functions of its reservations: the entry is rebuilt when the spec of one of them is another object."""
    instances: frozenset[str]
    state: GpuState
    kept: Evictable | None


class SnapshotCache:
    """`cluster_of`, rebuilding only the GPUs whose inputs changed since the last call: the invoker and report
    entry, the budget object (`BudgetCache` hands back the same one for a GPU it did not re-read) or the spec of
    one of its reservations (another object than in the last call's specs, or gone, or new). A GPU rebuilt equal
    to what it was keeps its old state, and when every GPU kept its state (in the same order) the snapshot is
    the last one at ``now``. When the same GPUs come in the same order and a few changed, only those are indexed
    again (`ClusterSnapshot.with_states`, which sums the floats in `build`'s order); otherwise it is built again
    from the states (`ClusterSnapshot.build`). The answer always equals `cluster_of`'s
    (tests/loadbalancer/test_snapshot_cache.py). Each call derives from the last call's result and replaces it
    at once, so calls from two threads are each exact (the later one's result is kept)."""

    def __init__(self) -> None:
        self._gpus: dict[str, _CachedGpu] = {}
        self._last: tuple[tuple[GpuState, ...], ClusterSnapshot] | None = None
        self._specs: Mapping[str, FunctionSpec] = {}

    def cluster(self, now: float, reports: Mapping[str, LoadReport], specs: Mapping[str, FunctionSpec],
                budgets: Mapping[str, GpuBudget | None]) -> tuple[ClusterSnapshot | None, dict[GpuRef, Evictable]]:
        old, last, old_specs = self._gpus, self._last, self._specs
        # Every entry kept from the last call was derived from the last call's specs (or rebuilt then), so the
        # functions whose spec is another object now are the ones whose GPUs need rebuilding.
        respec = {f for f, spec in specs.items() if old_specs.get(f) is not spec}
        respec.update(f for f in old_specs if f not in specs)
        gpus: dict[str, _CachedGpu] = {}
        states: list[GpuState] = []
        evictable: dict[GpuRef, Evictable] = {}
        seen_instance: set[str] = set()
        for name, report in reports.items():
            enabled = report.enabled
            for g in report.gpus:
                uuid = g.uuid
                if uuid in gpus:
                    log.warning("a GPU is reported by two invokers; ignoring the second", uuid=uuid, invoker=name)
                    continue
                budget = budgets.get(uuid)
                entry = old.get(uuid)
                if (entry is None or entry.budget is not budget or entry.invoker != name or entry.enabled != enabled
                        or (entry.report is not g and entry.report != g)
                        or (respec and not respec.isdisjoint(entry.functions))):
                    entry = self._rebuilt(name, g, enabled, budget, specs, entry)
                gpus[uuid] = entry
                if seen_instance.isdisjoint(entry.instances):
                    # What `cluster_of` builds here: none of its reservations was counted on an earlier GPU.
                    state, kept = entry.state, entry.kept
                    seen_instance |= entry.instances
                else:
                    state, kept = gpu_state_of(name, g, enabled, budget, specs, seen_instance)
                states.append(state)
                if kept is not None:
                    evictable[state.ref] = kept
        if not states:
            self._gpus, self._last, self._specs = gpus, None, specs
            return None, {}
        same = tuple(states)
        changed = (list(compress(range(len(same)), map(operator.is_not, last[0], same)))
                   if last is not None and len(last[0]) == len(same) else None)
        if last is not None and changed == []:
            snapshot = last[1].at(now)
        elif last is not None and changed is not None and all(last[0][o].ref == same[o].ref for o in changed):
            # The same GPUs in the same order, a few of them changed: only those are indexed again.
            snap = last[1]
            snapshot = snap.with_states(now, {snap.ordinals[same[o].ref]: same[o] for o in changed})
        else:
            snapshot = ClusterSnapshot.build(now=now, gpus=same)
        self._gpus, self._last, self._specs = gpus, (same, snapshot), specs
        return snapshot, evictable

    @staticmethod
    def _rebuilt(name: str, g: GpuReport, enabled: bool, budget: GpuBudget | None,
                 specs: Mapping[str, FunctionSpec], before: _CachedGpu | None) -> _CachedGpu:
        reservations = list(budget.reservations.values()) if budget is not None else []
        state, kept = gpu_state_of(name, g, enabled, budget, specs, set())
        if before is not None and before.state == state and before.kept == kept:
            state, kept = before.state, before.kept  # an equal budget read again (a renewed lease)
        return _CachedGpu(invoker=name, report=g, enabled=enabled, budget=budget,
                          functions=frozenset(r.function for r in reservations),
                          instances=frozenset(r.instance for r in reservations), state=state, kept=kept)


class LongLived:
    """Keeps what a leader's ticks leave alive out of the cyclic garbage collector's full passes.

    A leader of tens of thousands of instances holds millions of objects from tick to tick (the records, the
    reports decoded, the snapshot, the plan's memo), and each tick leaves a few hundred thousand new ones alive
    in place of the last tick's. CPython then runs a full collection over the whole heap every tick or two:
    0.4–0.7 s at 32,000 instances, more than the plan's own work (docs/benchmarks/planner-scale.md, round 5).
    After the takeover and after each tick everything alive is moved out of the collector's view (`gc.freeze`),
    so the full passes scan only what the next tick makes; what later dies is freed by reference counting as
    before. Garbage in a reference cycle among frozen objects (rare here: an exception's traceback) would wait,
    so every `thaw_every` ticks the objects go back to the collector (`gc.unfreeze`), whose next full pass sees
    them all once.

    While a tick runs on a frozen heap (`before_tick` to `after_tick`) there is no full pass at all: the
    tick's new objects are young collected as before, but the full passes over all of them (0.5–1.2 s a tick
    at 32,000 instances, round 6) would only find what the tick still holds, which the freeze after it takes
    out of view anyway. A tick after a thaw keeps its full passes, so the thawed heap is collected."""

    #: generation 2's threshold while a tick runs on a frozen heap (no full collection falls due)
    NO_FULL_PASS = 1 << 30

    # The collector's thresholds are the process's, and several balancers may lead in one process (tests, a
    # standalone beside a cluster balancer): the first tick to start keeps CPython's thresholds and the last to
    # end gives them back, whatever order their awaits interleave in. Without the count, a tick that began
    # while another ran kept the raised threshold as "CPython's" and left it set for good.
    _ticking = 0
    _saved: tuple[int, int, int] | None = None

    def __init__(self, thaw_every: int = 300) -> None:
        self.thaw_every = thaw_every
        self.ticks = 0
        self._frozen = False
        self._in_tick = False

    def freeze(self) -> None:
        """What is alive now is long-lived (the state a new leader loaded, or a tick left)."""
        gc.freeze()
        self._frozen = True

    def before_tick(self) -> None:
        if not self._frozen or self._in_tick:
            return
        self._in_tick = True
        cls = LongLived
        if cls._ticking == 0:
            cls._saved = gc.get_threshold()
            gc.set_threshold(cls._saved[0], cls._saved[1], self.NO_FULL_PASS)
        cls._ticking += 1

    def after_tick(self) -> None:
        self._restore()
        self.ticks += 1
        if self.ticks % self.thaw_every == 0:
            gc.unfreeze()
            self._frozen = False
        else:
            self.freeze()

    def release(self) -> None:
        """Give everything back to the collector (a leader that stops leading)."""
        self._restore()
        gc.unfreeze()
        self._frozen = False

    def _restore(self) -> None:
        if not self._in_tick:
            return
        self._in_tick = False
        cls = LongLived
        cls._ticking -= 1
        if cls._ticking == 0 and cls._saved is not None:
            gc.set_threshold(*cls._saved)
            cls._saved = None


def default_holder() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


class Balancer:
    """One balancer: a standby until it holds the lease, then the leader until it loses it."""

    def __init__(self, redis: aioredis.Redis, cfg: Config, *, holder: str | None = None) -> None:
        self.redis = redis
        self.cfg = cfg
        self.planner = planner_config(cfg)
        self.keys = Keys(cfg.redis.prefix)
        self.budgets = GpuBudgets(redis, cfg.redis.prefix)
        self._metas = redis.register_script(READ_METAS)
        self._hash = redis.register_script(READ_HASH)
        self._members = redis.register_script(READ_MEMBERS)
        self._strings = redis.register_script(READ_STRINGS)
        #: the invokers' and the functions' sets as last read (`_names`)
        self._names_read: dict[str, _Names] = {}
        self._budget_cache = self._new_budget_cache()
        #: the reports' elements decoded at the last reads, reused where their bytes are the same (`_read_reports`)
        self._report_decoder = ReportDecoder()
        #: held while the reports or the specs are decoded (in a worker thread; the decoder and the spec cache
        #: take one reader at a time, and model pre-loading reads them beside the tick)
        self._decoding = threading.Lock()
        #: each function's last meta bytes and the spec decoded from them (`_read_specs`)
        self._spec_cache: dict[str, tuple[bytes, FunctionSpec]] = {}
        #: the functions' set of the last `_read_specs`, and each of its `READ_METAS` calls' reply and specs
        self._spec_chunks: tuple[_Names | None, list[tuple[bytes, dict[str, FunctionSpec]]]] = (None, [])
        self._snapshots = SnapshotCache()
        self.holder = holder or default_holder()
        self.lease = LeaderLease(redis, self.keys, holder=self.holder, ttl_s=cfg.balancer.lease_ttl_s)
        self.leading: Leadership | None = None
        self.ticks = 0
        self._wake = asyncio.Event()
        self._lost = asyncio.Event()
        self._valid_until = 0.0
        self._records: dict[str, InstanceRecord] = {}
        self._routes: dict[str, RoutingTable] = {}
        self._states: dict[str, FunctionState] = {}
        #: the `now` of the tick whose plan `_states` carry (None before a leader's first tick)
        self._planned_at: float | None = None
        self._demand: dict[str, float] = {}
        self._seq = 1
        self._bad_reports: set[str] = set()
        self._compaction = CompactionLoop()
        self._memo: PlanMemo | None = None
        self._collector = LongLived()
        self.metrics = BalancerMetrics()

    # -- campaign --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign and lead until cancelled; a leader cancelled here releases the lease."""
        while True:
            try:
                lead = await self.campaign_once()
            except RedisError as exc:
                log.warning("balancer cannot reach Redis", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            if lead is None:
                await asyncio.sleep(POLL_S)
                continue
            try:
                await self._lead(lead)
            finally:
                self.leading = None
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.lease.release(lead))

    async def campaign_once(self) -> Leadership | None:
        """Take the lease if it is free and load the predecessor's state; None when another leads."""
        lead = await self.lease.acquire()
        if lead is not None:
            self._valid_until = time.monotonic() + self.cfg.balancer.lease_ttl_s
            # Loading a large cluster's records takes longer than the lease: renew it meanwhile.
            renew = asyncio.create_task(self._renew_loop(lead), name="balancer-renew-takeover")
            try:
                await self._take_over(lead)
            finally:
                await cancel_and_wait(renew)
        return lead

    async def _take_over(self, lead: Leadership) -> None:
        self.leading = lead
        self._lost.clear()
        self._states = {}
        self._planned_at = None
        self._demand = {}
        self._seq = 1
        self._compaction = CompactionLoop()
        self._memo = None
        self._budget_cache = self._new_budget_cache()
        self._snapshots = SnapshotCache()
        raw, held = await self.redis.hmget(self.keys.compaction, ["totals", "held"])
        if raw:
            with contextlib.suppress(ValueError, TypeError):
                totals = msgpack.unpackb(raw)
                self.metrics.totals.update({k: int(v) for k, v in totals.items() if k in self.metrics.totals})
        if held:
            self._compaction = compaction_held(held, time.time())
        self._records = await self._load_records()
        self._routes = await self._load_routes()
        log.info("balancer leads", holder=self.holder, epoch=lead.epoch, instances=len(self._records))

    def _new_budget_cache(self) -> BudgetCache:
        # A GPU whose budget no script marked changed is re-read at least once a reservation lease: a writer
        # that does not mark its changes (an older version, during an upgrade) is seen that late at worst.
        return BudgetCache(self.budgets, max_age_s=self.cfg.gpu.reservation_ttl_s)

    async def _lead(self, lead: Leadership) -> None:
        renew = asyncio.create_task(self._renew_loop(lead), name="balancer-renew")
        demand = asyncio.create_task(self._demand_loop(), name="balancer-demand")
        try:
            self._collector.freeze()  # what the takeover loaded (every record and routing table)
            last = 0.0
            while not self._lost.is_set():
                if time.monotonic() > self._valid_until:
                    log.warning("balancer lease may have lapsed; stepping down", epoch=lead.epoch)
                    break
                gap = time.monotonic() - last
                if gap < MIN_TICK_GAP_S:
                    await asyncio.sleep(MIN_TICK_GAP_S - gap)
                last = time.monotonic()
                self._collector.before_tick()
                try:
                    if not await self.tick(lead):
                        log.warning("balancer lost the lease; stepping down", epoch=lead.epoch)
                        break
                except RedisError as exc:
                    log.warning("balancer tick failed", error=str(exc))
                self._collector.after_tick()
                await self._sleep(self.cfg.balancer.tick_s)
        finally:
            # The collector first: a second cancellation during the wait below would skip what follows it, and
            # leave the process's thresholds raised and its heap frozen.
            self._collector.release()
            await cancel_and_wait(renew, demand)
            log.info("balancer no longer leads", holder=self.holder, epoch=lead.epoch)

    async def _sleep(self, timeout: float) -> None:
        # `asyncio.timeout`, not `wait_for`: Python 3.11's wait_for can swallow a cancellation that arrives as the
        # wait ends, and a leader cancelled then would tick on.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()
        self._wake.clear()

    async def _renew_loop(self, lead: Leadership) -> None:
        period = self.cfg.balancer.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            started = time.monotonic()
            try:
                ok = await self.lease.renew(lead)
            except RedisError as exc:
                log.warning("balancer cannot renew its lease", error=str(exc))
                if time.monotonic() > self._valid_until:
                    ok = False
                else:
                    continue
            if not ok:
                self._lost.set()
                self._wake.set()
                return
            self._valid_until = started + self.cfg.balancer.lease_ttl_s

    async def _demand_loop(self) -> None:
        # Signals of the last moments before this balancer led count too (a predecessor may have missed them).
        last = f"{int(time.time() * 1000) - 2000}-0"
        while True:
            try:
                got: Any = await self.redis.xread({self.keys.demand: last}, count=100, block=1000)
            except RedisError as exc:
                log.warning("balancer cannot read demand signals", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for _stream, entries in got or ():
                for entry_id, fields in entries:
                    last = text(entry_id)
                    fn = fields.get(b"f")
                    if fn:
                        self._demand[text(fn)] = time.time()
                    self._wake.set()  # demand, or an invoker's instance changed state

    # -- one tick --------------------------------------------------------------------------------

    async def tick(self, lead: Leadership) -> bool:
        """Read, plan, apply. False when the lease is gone (nothing was written)."""
        now = time.time()
        reports, known = await self._read_reports()
        specs = await self._read_specs()
        cluster, evictable = await self._cluster(now, reports, specs)
        self._demand = {f: t for f, t in self._demand.items() if now - t < 60}
        # The plan is pure CPU work that grows with the cluster (docs/benchmarks/planner-scale.md: 0.15 s at 3,200
        # instances, 2 s at 32,000): it runs in a worker thread so that the lease is renewed and demand read
        # meanwhile. Its inputs are this tick's own (the demand a copy: the demand loop goes on writing).
        plan = await asyncio.to_thread(
            plan_tick,
            TickInput(now=now, epoch=lead.epoch, reports=reports, known_invokers=known, records=self._records,
                      specs=specs, cluster=cluster, demand=dict(self._demand), states=self._states,
                      routes=self._routes, seq=self._seq, compaction=self._compaction, evictable=evictable,
                      memo=self._memo, last_tick_at=self._planned_at),
            self.planner,
        )
        ok = await self._apply(lead, plan)
        if ok:
            self._planned_at = now
        self.ticks += 1
        return ok

    async def _names(self, key: str, sort_key: Any, key_of: Any) -> _Names:
        """The members of the set `key`, sorted by `sort_key`, and the key `key_of` each: packed by Redis in one
        reply, and, while that reply is the same bytes as at the last read (the set rarely changes), the lists
        made from it then."""
        packed = await self._members(keys=[key])
        last = self._names_read.get(key)
        if last is not None and last.packed == packed:
            return last
        names = sorted((text(m) for m in msgpack.unpackb(packed, raw=True) or ()), key=sort_key)
        read = self._names_read[key] = _Names(packed=packed, names=names, keys=[key_of(n) for n in names],
                                              members=frozenset(names))
        return read

    async def _read_packed(self, keys: list[str], script: Any) -> list[bytes]:
        """`script` over `keys`, `READ_CHUNK` keys a call in one pipeline: each call's packed reply."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for k in range(0, len(keys), READ_CHUNK):
                await script(keys=keys[k : k + READ_CHUNK], client=pipe)
            replies: list[bytes] = await pipe.execute()
        return replies

    async def _read_reports(self) -> tuple[dict[str, LoadReport], frozenset[str]]:
        invokers = await self._names(self.keys.invokers, _natural, self.keys.report)
        names = invokers.names
        if not names:
            return {}, frozenset()
        packed = await self._read_packed(invokers.keys, self._strings)
        # Decoded in a worker thread, one read at a time (the decoder keeps what it decoded at the last reads):
        # tens of thousands of instances' figures would hold the event loop, and with it the lease's renewal.
        return await asyncio.to_thread(self._decode_reports, invokers, packed)

    def _decode_reports(self, invokers: _Names, packed: list[bytes]) -> tuple[dict[str, LoadReport], frozenset[str]]:
        names = invokers.names
        raws = _flat(packed)
        with self._decoding:
            reports: dict[str, LoadReport] = {}
            # Each report is what `decode` makes of it; the decoder reuses the objects of the elements (GPUs,
            # instances, functions) whose bytes it decoded at the last reads (most of them: only the busy instances'
            # figures and the clock move every period).
            decoder = self._report_decoder
            try:
                for name, raw in zip(names, raws, strict=True):
                    if raw is False or raw is None:  # no report (Lua's false)
                        continue
                    try:
                        report = decoder.decode(raw)
                    except WireError as exc:
                        if name not in self._bad_reports:
                            self._bad_reports.add(name)
                            log.warning("unreadable load report; the invoker counts as gone", invoker=name,
                                        error=str(exc))
                        continue
                    if report is not None:
                        self._bad_reports.discard(name)
                        reports[name] = report
            finally:
                decoder.turn()
            return reports, invokers.members

    async def _read_specs(self) -> dict[str, FunctionSpec]:
        functions = await self._names(self.keys.functions, None, self.keys.function)
        names = functions.names
        if not names:
            return {}
        replies = await self._read_packed(functions.keys, self._metas)
        return await asyncio.to_thread(self._decode_specs, functions, replies)

    def _decode_specs(self, functions: _Names, replies: list[bytes]) -> dict[str, FunctionSpec]:
        names = functions.names
        with self._decoding:
            last_functions, last_chunks = self._spec_chunks
            if functions is not last_functions:
                # The set changed: its chunks are other names; forget the specs of functions gone.
                last_chunks = []
                self._spec_cache = {n: c for n, c in self._spec_cache.items() if n in functions.members}
            specs: dict[str, FunctionSpec] = {}
            chunks: list[tuple[bytes, dict[str, FunctionSpec]]] = []
            for c, reply in enumerate(replies):
                # A call whose reply is the same bytes as at the last read (the same names, and specs rarely change)
                # gives the specs decoded then.
                if c < len(last_chunks) and last_chunks[c][0] == reply:
                    part = last_chunks[c][1]
                else:
                    part = self._specs_of(names[c * READ_CHUNK : (c + 1) * READ_CHUNK], msgpack.unpackb(reply, raw=True))
                chunks.append((reply, part))
                specs.update(part)
            self._spec_chunks = (functions, chunks)
            return specs

    def _specs_of(self, names: list[str], metas: list[Any]) -> dict[str, FunctionSpec]:
        specs: dict[str, FunctionSpec] = {}
        cache = self._spec_cache
        for name, raw in zip(names, metas, strict=True):
            if raw is False or raw is None:  # no meta (Lua's false)
                cache.pop(name, None)
                continue
            # A spec whose bytes did not change since the last read is the object decoded then (they rarely do).
            cached = cache.get(name)
            spec: FunctionSpec | None = cached[1] if cached is not None and cached[0] == raw else None
            if spec is None:
                cache.pop(name, None)
                try:
                    spec = decode(FunctionSpec, raw)
                except WireError as exc:
                    log.warning("unreadable function spec", function=name, error=str(exc))
                    continue
                if spec is None:
                    continue
                cache[name] = (raw, spec)
            specs[name] = spec
        return specs

    async def _cluster(self, now: float, reports: dict[str, LoadReport], specs: dict[str, FunctionSpec],
                       ) -> tuple[ClusterSnapshot | None, dict[GpuRef, Evictable]]:
        """The live invokers' GPUs with what their budgets hold (the node's own admission sees the same), and
        the kept weights among it that their invokers evict for room (`evictable_of`)."""
        # Every live GPU's budget, re-reading only those that may have changed since the last tick (`BudgetCache`;
        # thousands of GPUs would otherwise be read whole every tick), then the snapshot off the event loop (it
        # grows with the cluster, as the plan does), rebuilding only the GPUs whose inputs changed (`SnapshotCache`).
        budgets = await self._budget_cache.get_many(
            list(dict.fromkeys(g.uuid for rep in reports.values() for g in rep.gpus)))
        return await asyncio.to_thread(self._snapshots.cluster, now, reports, specs, budgets)

    # -- model pre-loading (loadbalancer/model_preload.py) ------------------------------------------

    async def read_reports(self) -> dict[str, LoadReport]:
        """The live invokers' load reports."""
        reports, _known = await self._read_reports()
        return reports

    async def first_placement(self, spec: FunctionSpec) -> tuple[dict[str, LoadReport], str, int, str | None, str]:
        """The live reports, and where a first instance of ``spec`` would be placed now (invoker, GPU index,
        GPU uuid, reason; invoker "" when nowhere): the snapshot a tick would build, not reserved."""
        now = time.time()
        reports, _known = await self._read_reports()
        cluster, _evictable = await self._cluster(now, reports, await self._read_specs())
        if cluster is None:
            return reports, "", -1, None, "no GPU in the cluster"
        return (reports, *place_first(cluster, spec, reports=reports, records=self._records,
                                      config=self.planner.placement))

    # -- applying a plan -------------------------------------------------------------------------

    async def _apply(self, lead: Leadership, plan: TickPlan) -> bool:
        ttl_s = self.cfg.gpu.reservation_ttl_s
        # Room held by instances that are gone goes back first, so this tick's starts can use it.
        for order in plan.forgotten:
            for uuid, rid in order.record.gpu_reservations():
                with contextlib.suppress(RedisError):
                    await self.budgets.release(uuid, rid)
        records = dict(plan.records)
        states = dict(plan.states)
        starts = []
        reserved: list[InstanceRecord] = []
        refused: set[str] = set()  # compaction's replacements and new stages the budgets refused
        for order in plan.starts:
            r = order.record
            if r.gpu_uuid is None:
                starts.append(order)
                continue
            result = await self._reserve(r, order, ttl_s)
            if not result.ok:
                # The budget saw something the snapshot did not (a concurrent admission): retry next tick.
                log.info("GPU budget refused a placement", instance=r.id, gpu=r.gpu_uuid, reason=result.reason)
                records.pop(r.id, None)
                if r.replaces:  # a compaction replacement is not owed: its original keeps serving
                    refused.add(r.id)
                else:
                    st = states.get(r.function, FunctionState())
                    states[r.function] = replace(st, owed=st.owed + 1)
                continue
            reserved.append(r)
            starts.append(order)
        moves = []
        for order in plan.stage_moves:
            r = order.record
            move = r.stage_move()
            assert move is not None
            fresh = move[1]
            result = await self.budgets.reserve(fresh.gpu_uuid or "", Reservation(
                instance=fresh.id, function=r.function, cls=r.cls, invoker=r.invoker, request=fresh.request,
                limit=fresh.limit, memory_mb=fresh.memory_mb), ttl_s=ttl_s)
            if not result.ok:
                # As for a start: the budget saw something the snapshot did not. The old stage serves on.
                log.info("GPU budget refused a stage move", instance=r.id, stage=fresh.id, gpu=fresh.gpu_uuid,
                         reason=result.reason)
                records[r.id] = r.stage_move_undone()
                refused.update((fresh.id, r.id))
                continue
            moves.append(order)
        # Until its invoker renews them, the leader keeps the reservations of starting instances alive.
        by_gpu: dict[str, list[str]] = {}
        for r in records.values():
            if r.state == RecordState.STARTING and r.gpu_uuid and r not in reserved:
                for uuid, rid in r.gpu_reservations():
                    by_gpu.setdefault(uuid, []).append(rid)
        for uuid, ids in by_gpu.items():
            with contextlib.suppress(RedisError):
                await self.budgets.renew(uuid, ids, ttl_s=ttl_s)

        # The tick's writes, packed in a worker thread (a tick that changes thousands of records or routing
        # tables would otherwise hold the event loop, and with it the lease's renewal).
        ops = await asyncio.to_thread(self._writes, lead, plan, records, starts, moves)
        before = dict(self.metrics.totals)
        if self.metrics.observe(plan, self._compaction, frozenset(refused)):
            ops.hset(self.keys.compaction, "totals", msgpack.packb(self.metrics.totals))
        now_held = (plan.compaction.cooling, plan.compaction.failed_targets)
        if now_held != (self._compaction.cooling, self._compaction.failed_targets):
            ops.hset(self.keys.compaction, "held", msgpack.packb({"cooling": now_held[0], "failed_targets": now_held[1]}))

        if ops.count and not await self.lease.apply(lead, ops):
            self.metrics.totals = before
            for r in reserved:
                for uuid, rid in r.gpu_reservations():
                    with contextlib.suppress(RedisError):
                        await self.budgets.release(uuid, rid)
            for order in moves:
                fresh = order.record.stage_move()[1]  # type: ignore[index]
                with contextlib.suppress(RedisError):
                    await self.budgets.release(fresh.gpu_uuid or "", fresh.id)
            self._lost.set()
            return False
        for d in plan.decisions:
            log.info("balancer decision", kind=d.kind, function=d.function, instance=d.instance or None,
                     invoker=d.invoker or None, gpu=d.gpu, reason=d.reason, epoch=lead.epoch)
        self._records = records
        self._routes = dict(plan.routes)
        self._states = states
        self._seq = plan.seq
        self._compaction = plan.compaction
        self._memo = plan.memo
        return True

    async def _reserve(self, r: InstanceRecord, order: Order, ttl_s: float) -> ReserveResult:
        """Reserve a start's GPU budget: one reservation, or one per stage of a split instance, all or none
        (a stage refused releases the stages reserved before it)."""
        if r.stages:
            done: list[StageRecord] = []
            for st in r.stages:
                result = await self.budgets.reserve(st.gpu_uuid or "", Reservation(
                    instance=st.id, function=r.function, cls=r.cls, invoker=r.invoker, request=st.request,
                    limit=st.limit, memory_mb=st.memory_mb), ttl_s=ttl_s)
                if not result.ok:
                    for prev in done:
                        with contextlib.suppress(RedisError):
                            await self.budgets.release(prev.gpu_uuid or "", prev.id)
                    return replace(result, reason=f"stage {st.id}: {result.reason}")
                done.append(st)
            return result
        # On a GPU holding its revision's weights it declares them with the group its invoker's own
        # reservation will name, so Redis charges it the rest now and the invoker's settles the same.
        return await self.budgets.reserve(r.gpu_uuid or "", Reservation(
            instance=r.id, function=r.function, cls=r.cls, invoker=r.invoker, request=r.request,
            limit=r.limit, memory_mb=r.memory_mb, weights_mb=order.weights_mb,
            group=weights_group(r.invoker, r.function, r.rev) if order.weights_mb else ""), ttl_s=ttl_s,
            evict=order.evicts)

    def _writes(self, lead: Leadership, plan: TickPlan, records: Mapping[str, InstanceRecord],
                starts: list[Order], moves: list[Order]) -> Ops:
        """What the tick writes under the lease, against what the last applied tick left (`_records`, `_routes`)."""
        ops = Ops()
        # (the plan hands back the same objects for what it did not change: those are passed over at once)
        for rid, rec in records.items():
            prev_rec = self._records.get(rid)
            if prev_rec is not rec and prev_rec != rec:
                ops.hset(self.keys.instances, rid, pack(rec))
        for rid in self._records.keys() - records.keys():
            ops.hdel(self.keys.instances, rid)
        # A start names the instance's stages; a stage move its whole new stage list (`CommandOp.MOVE_STAGE`).
        for op, orders in ((CommandOp.START, starts), (CommandOp.MOVE_STAGE, moves)):
            for order in orders:
                r = order.record
                ops.xadd(self.keys.commands(r.invoker), pack(InstanceCommand(
                    op=op.value, epoch=lead.epoch, instance=r.id, function=r.function, rev=r.rev,
                    gpu=r.gpu, gpu_uuid=r.gpu_uuid, cls=r.cls, request=r.request, limit=r.limit,
                    memory_mb=r.memory_mb, boot=r.boot, reason=order.reason, stages=r.stages)),
                    maxlen=COMMAND_STREAM_MAXLEN)
        for order in plan.stops:
            r = order.record
            ops.xadd(self.keys.commands(r.invoker), pack(InstanceCommand(
                op=CommandOp.STOP.value, epoch=lead.epoch, instance=r.id, function=r.function, rev=r.rev,
                gpu=r.gpu, gpu_uuid=r.gpu_uuid, boot=r.boot, reason=order.reason)), maxlen=COMMAND_STREAM_MAXLEN)
        for fqn, table in plan.routes.items():
            prev = self._routes.get(fqn)
            if prev is table:
                continue
            if prev != table:
                ops.set(self.keys.route(fqn), pack(table))
            if not table.same_routes(prev):
                ops.publish(self.keys.routes_channel, fqn)
        for d in plan.decisions:
            ops.xadd(self.keys.decisions, pack(d), maxlen=DECISION_STREAM_MAXLEN)
        for name in plan.gone:
            ops.srem(self.keys.invokers, name)
        return ops

    # -- loading a predecessor's state -----------------------------------------------------------

    async def _load_records(self) -> dict[str, InstanceRecord]:
        # Decoded off the event loop (tens of thousands of records take seconds; the lease is renewed meanwhile).
        packed = await self._hash(keys=[self.keys.instances])
        return await asyncio.to_thread(_decode_records, packed)

    async def _load_routes(self) -> dict[str, RoutingTable]:
        names = (await self._names(self.keys.functions, None, self.keys.function)).names
        if not names:
            return {}
        packed = await self._read_packed([self.keys.route(n) for n in names], self._strings)
        return await asyncio.to_thread(_decode_routes, names, packed)


def _flat(packed: list[bytes]) -> list[Any]:
    """The values of `READ_STRINGS` calls' packed replies, in the order of their keys (False: no value)."""
    return [raw for reply in packed for raw in msgpack.unpackb(reply, raw=True)]


def _decode_records(packed: bytes) -> dict[str, InstanceRecord]:
    flat = msgpack.unpackb(packed, raw=True)
    out: dict[str, InstanceRecord] = {}
    for rid, raw in zip(flat[::2], flat[1::2], strict=True):
        try:
            rec = decode(InstanceRecord, raw)
        except WireError as exc:
            log.warning("unreadable instance record; dropped", instance=text(rid), error=str(exc))
            continue
        if rec is not None:
            out[rec.id] = rec
    return out


def _decode_routes(names: list[str], packed: list[bytes]) -> dict[str, RoutingTable]:
    raws = _flat(packed)
    out: dict[str, RoutingTable] = {}
    for name, raw in zip(names, raws, strict=True):
        if raw is False or raw is None:  # no table (Lua's false)
            continue
        with contextlib.suppress(WireError):
            table = decode(RoutingTable, raw)
            if table is not None:
                out[name] = table
    return out


# -- running it ---------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_balancer(cfg: Config, redis: aioredis.Redis, *, holder: str | None = None,
                        action_feed: ActionFeed | None = None) -> AsyncIterator[Balancer]:
    """Run a balancer (campaigning, then leading) for the duration of the block; a leader leaving
    releases the lease so a standby takes over at once. With ``action_feed`` (the whisks database's
    changes, in a cluster) and ``--balancer-model-preload`` on, the leader pre-loads the models of GPU
    actions created or updated there (loadbalancer/model_preload.py)."""
    balancer = Balancer(redis, cfg, holder=holder)
    task = asyncio.create_task(balancer.run(), name="balancer")
    try:
        async with following(balancer, action_feed if cfg.balancer.model_preload else None):
            yield balancer
    finally:
        await cancel_and_wait(task)


async def _main(cfg: Config, action_feed: ActionFeed | None = None) -> int:
    from dilu_invoker.redis_embedded import configured_client

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    assert cfg.redis.url is not None
    redis = configured_client(cfg.redis.url, cfg.redis)
    try:
        await redis.ping()
        async with open_balancer(cfg, redis, action_feed=action_feed) as balancer:
            log.info("balancer started", holder=balancer.holder, prefix=cfg.redis.prefix,
                     strategy=cfg.balancer.strategy,
                     model_preload=bool(action_feed is not None and cfg.balancer.model_preload))
            await stop.wait()
    finally:
        await redis.aclose()
    return 0


def main(cfg: Config, args: argparse.Namespace | None = None, *, action_feed: ActionFeed | None = None) -> int:
    """``action_feed``: the whisks database's changes (the CLI wires CouchDB's feed in when configured)."""
    logs.configure(cfg.log)
    if not cfg.redis.url:
        print("dilu-invoker balancer: --redis-url (DILU_REDIS_URL) is required: the balancer shares the "
              "invokers' Redis", file=sys.stderr)
        return 2
    try:
        planner_config(cfg)
        return asyncio.run(_main(cfg, action_feed))
    except ConfigError as exc:
        print(f"dilu-invoker balancer: {exc}", file=sys.stderr)
        return 2
    except (OSError, RedisError) as exc:
        log.error("balancer could not start", error=str(exc))
        return 1
