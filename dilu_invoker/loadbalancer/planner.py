"""One balancer tick as a pure function: reports + instance table + registry in, orders out.

:func:`plan_tick` is what the leader runs every tick (and at once when a router signals demand). It

1. reconciles the instance table with the invokers' load reports: a starting instance the invoker reports
   ready becomes ready; an instance whose invoker is gone (report expired) or restarted (new boot), or that
   failed, or that vanished from its invoker's reports, is *lost* — forgotten and owed (re-placed at once);
   an instance that did not start in time is given up; an instance of an outdated action revision is
   stopped and owed; an instance an invoker runs but the table does not know is stopped;
2. aggregates each function's load over every live report and asks the horizontal policy
   (:func:`~dilu_invoker.policy.decide_scale`) how many instances it should have;
3. places the instances to start (:func:`~dilu_invoker.policy.spread.place_spread` over a
   :class:`~dilu_invoker.policy.ClusterSnapshot` built from the GPU budgets) and picks the instances to stop;
4. with compaction on (:class:`LiveCompaction`), at most every ``period_s``, runs the simulator's
   :func:`~dilu_invoker.policy.compaction_plan` on the cluster and starts a replacement for each move
   (make-before-break: the original keeps serving; once the replacement is ready it is routed to and the
   original drained), never for an instance of a function in a burst or while a move is in flight; a move of
   one pipeline stage of a split instance is a stage move instead (the record names the new stage and keeps the
   old one in ``moving`` until its invoker reports the hand-over done: `_move_stage`, `_stage_move_outcome`);
5. builds each function's routing table (its ready instances on live invokers).

No I/O and no clock: ``now`` and everything else comes in :class:`TickInput`; the service applies the
:class:`TickPlan` to Redis (reservations, fenced writes of the table, commands and routes).
"""

from __future__ import annotations

import math
import operator
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from dilu_invoker.model import LimitBounds
from dilu_invoker.policy import (
    Affinity,
    ClusterSnapshot,
    CompactionMove,
    CompactionPlan,
    CompactionState,
    FunctionLoad,
    GpuRef,
    HorizontalConfig,
    HorizontalState,
    InstanceClass,
    PlacedInstance,
    PlacementConfig,
    PlacementRequest,
    Profile,
    ScaleAction,
    ScaleDecision,
    apply_placement,
    compaction_plan,
    decide_scale,
    repeat_decision,
)
from dilu_invoker.policy.live_compaction import LiveCompaction, function_calm
from dilu_invoker.policy.placement import (
    PlacementDecision,
    PlacementPart,
    holds_weights,
    place_sharing,
    whole_mib_pieces,
)
from dilu_invoker.policy.spread import place_spread
from dilu_invoker.wire import (
    Decision,
    FunctionReport,
    FunctionSpec,
    InstanceRecord,
    InstanceReport,
    InstanceState,
    LoadReport,
    RecordState,
    RouteEntry,
    RoutingTable,
    StageRecord,
    moved_stage_id,
    rank_id,
    revision_generation,
    routes_equal,
    stage_id,
    stage_parent,
)

#: After a move of an instance failed, compaction leaves it where it is for this many periods: a new stage or a
#: replacement that did not start on a GPU would most likely fail there again, a cold start each time.
FAILED_MOVE_COOLDOWN_RUNS = 10

#: After a move of an instance of a function failed on a GPU (its replacement or new stage did not start there),
#: compaction moves no instance of that function onto that GPU for this long (seconds of the balancer's clock), beyond
#: the instance's own cool-down: a GPU whose real state the budgets do not show (memory a stray process holds, a
#: device in trouble) would otherwise cost a cold start every cool-down.
FAILED_TARGET_HOLD_S = 1800.0

#: Beyond a start, the longest a stage move may take on its invoker: the old stage drains the runs that started on it
#: for up to the action's time limit (at most OpenWhisk's 300 s) and 5 s, and its removal is waited for up to
#: `instances.REMOVAL_WAIT_S` (30 s). A move not done after `start_timeout_s` and this gives its instance up.
STAGE_MOVE_DRAIN_S = LimitBounds().timeout_ms[1] / 1000 + 5.0 + 30.0


@dataclass(frozen=True, slots=True)
class CompactionLoop:
    """What the balancer carries for compaction between ticks."""

    next_at: float = 0.0
    """No run before this (the balancer's clock)."""
    state: CompactionState | None = None
    """The last plan's state (sources known to fail)."""
    cooling: tuple[tuple[str, float], ...] = ()
    """(instance id, until): instances a move of which failed lately (a replacement abandoned, a stage move that
    failed); compaction does not move them again before then (`FAILED_MOVE_COOLDOWN_RUNS`)."""
    failed_targets: tuple[tuple[str, str, int, float], ...] = ()
    """(function, invoker, GPU index, until): GPUs a move of an instance of the function failed on lately; compaction
    moves no instance of it there before then (`FAILED_TARGET_HOLD_S`)."""

    def expiring(self, now: float) -> bool:
        """Whether a cool-down or a held GPU is over by `now` (`held` would drop it)."""
        return bool((self.cooling and self.cooling[0][1] <= now)
                    or (self.failed_targets and self.failed_targets[0][3] <= now))

    def held(self, now: float, cool: Iterable[str] = (), cool_until: float = 0.0,
             hold: Iterable[tuple[str, str, int]] = (), hold_until: float = 0.0) -> CompactionLoop:
        """This loop without the cool-downs and held GPUs over by `now`, with the instances `cool` cooling down until
        `cool_until` and the GPUs `hold` ((function, invoker, GPU index)) held until `hold_until`; each in the order
        they end."""
        cooling = {i: t for i, t in self.cooling if t > now} | dict.fromkeys(cool, cool_until)
        targets = {e[:3]: e[3] for e in self.failed_targets if e[3] > now} | dict.fromkeys(hold, hold_until)
        return replace(self, cooling=tuple(sorted(cooling.items(), key=_by_end)),
                       failed_targets=tuple(sorted(((*k, t) for k, t in targets.items()), key=_by_end)))


def _by_end(entry: tuple[Any, ...]) -> tuple[Any, ...]:
    """Order of held entries: when they end (their last field), then the rest."""
    return entry[-1], entry[:-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    horizontal: HorizontalConfig = field(default_factory=HorizontalConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    start_timeout_s: float = 120.0
    """A starting instance not ready after this long is given up (and its start retried by the scaler)."""
    missing_ticks: int = 3
    """Ticks a ready instance may be absent from its live invoker's report before it counts as lost."""
    demand_hold_s: float = 2.0
    """A demand signal counts as one waiting activation for this long (reports lag by up to a period)."""
    compaction: LiveCompaction | None = None
    """None: no compaction (the default)."""
    failed_retry_s: float = 5.0
    """After an instance failed to start, the function's next placement waits this long; meanwhile its
    routing table carries the failure, and routers answer waiting activations with it at once."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_timeout_s) and self.start_timeout_s > 0):
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s!r}")
        if self.missing_ticks < 1:
            raise ValueError(f"missing_ticks must be >= 1, got {self.missing_ticks}")
        if not (math.isfinite(self.demand_hold_s) and self.demand_hold_s >= 0):
            raise ValueError(f"demand_hold_s must be >= 0, got {self.demand_hold_s!r}")


@dataclass(frozen=True, slots=True)
class FunctionState:
    """What the balancer carries for one function between ticks."""

    horizontal: HorizontalState = field(default_factory=HorizontalState)
    owed: int = 0
    """Instances decided (scale-out, or replacing lost ones) but not placed yet."""
    blocked: str = ""
    """Why the last placement attempt failed ("" when it did not)."""
    retry_at: float = 0.0
    """No placement before this time (an instance of the function failed to start)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TickInput:
    now: float
    epoch: int
    reports: Mapping[str, LoadReport]
    """Live invokers (their report has not expired)."""
    known_invokers: frozenset[str]
    """Every invoker that ever reported and was not yet dropped; those without a report are gone."""
    records: Mapping[str, InstanceRecord]
    specs: Mapping[str, FunctionSpec]
    cluster: ClusterSnapshot | None
    """The GPUs of the live invokers with what their budgets hold; None when there is no GPU at all."""
    demand: Mapping[str, float] = field(default_factory=dict)
    """Function → time of the last demand signal of a router."""
    states: Mapping[str, FunctionState] = field(default_factory=dict)
    routes: Mapping[str, RoutingTable] = field(default_factory=dict)
    """The routing tables published last."""
    seq: int = 1
    """Sequence number of the next instance id (unique per epoch)."""
    compaction: CompactionLoop = field(default_factory=CompactionLoop)
    evictable: Mapping[GpuRef, Evictable] = field(default_factory=dict)
    """The GPUs of ``cluster`` that hold kept weights (staged exit), with what is left once they go."""
    memo: PlanMemo | None = None
    """The last plan's `TickPlan.memo` (None: plan every function from scratch; the plan is the same)."""
    last_tick_at: float | None = None
    """The `now` of the plan whose `states` these are (this leader's last tick applied; None: a leader's first
    tick). The scaler's windows sampled then are not stale however long ago that was
    (`FunctionLoad.last_tick_at`): at 32,000 instances a busy leader's ticks start 4.5–6 s apart."""


@dataclass(frozen=True, slots=True)
class Evictable:
    """Kept weights on a GPU (staged exit): placed instances of `cluster` that hold only weights a process
    kept there after its function's last instance left, which the GPU's invoker evicts when a start finds no
    room (docs/balancer.md, "Kept weights")."""

    instances: frozenset[str]
    """The kept reservations' ids (placed instances of the GPU)."""
    weight_groups: frozenset[tuple[str, float]]
    """The GPU's `GpuState.weight_groups` once they are gone (what the other instances still hold)."""
    memory_mib: float
    """What they are charged: the room their eviction frees."""


@dataclass(frozen=True, slots=True)
class Order:
    record: InstanceRecord
    reason: str
    weights_mb: int = 0
    """A start on a GPU that holds its revision's shared weights: how much of ``memory_mb`` they are (its
    reservation declares them with its group, so the budget charges it the rest); 0: reserved whole."""
    evicts: bool = False
    """Placed on room that kept weights hold: reserved as if they were gone (their invoker evicts them)."""


@dataclass(frozen=True, slots=True)
class TickPlan:
    starts: tuple[Order, ...]
    stops: tuple[Order, ...]
    records: Mapping[str, InstanceRecord]
    """The whole table after this tick."""
    forgotten: tuple[Order, ...]
    """Records removed from the table (lost, given up, stopped), with why."""
    routes: Mapping[str, RoutingTable]
    states: Mapping[str, FunctionState]
    scale: tuple[ScaleDecision, ...]
    decisions: tuple[Decision, ...]
    gone: frozenset[str]
    seq: int
    cluster: ClusterSnapshot | None
    compaction: CompactionLoop = field(default_factory=CompactionLoop)
    stage_moves: tuple[Order, ...] = ()
    """Stage moves compaction ordered (`CommandOp.MOVE_STAGE`): each record as it is while its move is in flight
    (`InstanceRecord.stage_move`); the service reserves the new stage, then sends the command."""
    memo: PlanMemo | None = field(default=None, compare=False)
    """What the next tick may reuse (`PlanMemo`); not part of the plan's decisions."""
    compaction_cpu_s: float | None = field(default=None, compare=False)
    """CPU seconds of the planning thread this tick's compaction run took (None: no run this tick)."""


#: What a tick reads of one invoker's report (`_figures`).
_Figures = tuple[frozenset[tuple[Any, ...]], frozenset[FunctionReport]]


@dataclass(frozen=True, slots=True)
class FunctionMemo:
    """A function's load the last time it was planned from scratch (its figures since unchanged), and whether it
    was calm then (`function_calm`)."""

    load: FunctionLoad
    calm: bool


@dataclass(frozen=True, slots=True)
class PlanMemo:
    """A tick's inputs and per-function outputs, kept for the next tick (`TickInput.memo`): a function none of
    whose inputs changed since (its records, its figures in the reports, its spec, its carried state, no demand
    signal, nothing lost or failed) and that held without owing anything is planned again as it was, at the
    new time (`horizontal.repeat_decision`, which says when the clock alone may change a decision), and keeps
    its routing table. Every other function is planned from scratch, and so is everything that spans functions
    (reconciling the table, placement, compaction), so the plan is the one `plan_tick` makes without it."""

    cfg: PlannerConfig
    epoch: int
    records: Mapping[str, InstanceRecord]
    """The plan's table (what the next tick's input table is, unless the service changed it)."""
    reports: Mapping[str, LoadReport]
    figures: Mapping[str, _Figures]
    """Invoker → what the plan read of its report per instance and per function (`_figures`)."""
    specs: Mapping[str, FunctionSpec]
    states: Mapping[str, FunctionState]
    routes: Mapping[str, RoutingTable]
    demand: frozenset[str]
    """Functions whose demand signal counted as waiting work."""
    functions: Mapping[str, FunctionMemo]
    decisions: Mapping[str, ScaleDecision]
    """The plan's scaling decisions by function."""
    functions_order: list[str] = field(default_factory=list)
    """The functions of `specs`, sorted (the order a tick plans them in)."""
    settled: Mapping[str, InstanceRecord] = field(default_factory=dict)
    """The records that reconciling kept as they were, ready or stopping (no clock in their outcome): each is kept
    again, unchanged, while it is the same object, its invoker's report reads the same (`_same_report`) and its
    function's spec did not change (`_reconcile`)."""


# -- helpers --------------------------------------------------------------------------------------

_SLUG = re.compile(r"[^A-Za-z0-9]+")


def instance_id(function: str, epoch: int, seq: int) -> str:
    slug = _SLUG.sub("-", function).strip("-")[:40] or "fn"
    return f"{slug}-{epoch}-{seq}"


def outdated(record_rev: str, spec_rev: str) -> bool:
    """A record of an older action revision than the registry's."""
    return record_rev != spec_rev and revision_generation(record_rev) < revision_generation(spec_rev)


def estimate_capacity(reports: list[InstanceReport]) -> float | None:
    """Requests/s one instance sustains: its slots over the mean run time seen (None without data)."""
    done = [(r.completion_rate, r.latency_ms, r.slots) for r in reports if r.completion_rate > 0 and r.latency_ms]
    total = sum(c for c, _, _ in done)
    if total <= 0:
        return None
    latency = sum(c * lat for c, lat, _ in done if lat) / total
    slots = sum(c * s for c, _, s in done) / total
    return slots * 1000.0 / latency if latency > 0 else None


@dataclass(frozen=True, slots=True)
class ReportIndex:
    """The live reports' instances and per-function figures by function, made once per tick: looking them up
    per function instead of scanning every report keeps a tick linear in the cluster's size."""

    instances: Mapping[str, Mapping[str, InstanceReport]]
    """Function → instance id → its report (the last report naming it, in the reports' order)."""
    functions: Mapping[str, list[FunctionReport]]
    """Function → its figures in each invoker's report."""

    @classmethod
    def of(cls, reports: Mapping[str, LoadReport], only: set[str] | None = None) -> ReportIndex:
        """`only`: index these functions only (None: every function)."""
        instances: dict[str, dict[str, InstanceReport]] = {}
        functions: dict[str, list[FunctionReport]] = {}
        for rep in reports.values():
            for i in rep.instances:
                if only is None or i.function in only:
                    instances.setdefault(i.function, {})[i.id] = i
            for f in rep.functions:
                if only is None or f.function in only:
                    functions.setdefault(f.function, []).append(f)
        return cls(instances=instances, functions=functions)


def function_load(
    spec: FunctionSpec,
    *,
    now: float,
    records: list[InstanceRecord],
    reports: Mapping[str, LoadReport],
    demand_at: float | None,
    demand_hold_s: float,
    index: ReportIndex | None = None,
    last_tick_at: float | None = None,
) -> FunctionLoad:
    """One function's load this tick, summed over every live report (records: this function's, current revision;
    `index`: `ReportIndex.of(reports)`, made once for every function of a tick)."""
    index = index if index is not None else ReportIndex.of(reports)
    by_id = index.instances.get(spec.fqn, {})
    # One pass over the records (a tick makes this for every function it plans): the counts by state, and the
    # reports of the records not stopping, in the records' order (the float sums below follow it).
    ready = starting = stopping = saturated = 0
    live: list[InstanceReport] = []
    for r in records:
        state = r.state
        inst = by_id.get(r.id)
        if state == RecordState.READY:
            ready += 1
            if inst is not None and inst.saturated:
                saturated += 1
        elif state == RecordState.STARTING:
            starting += 1
        elif state == RecordState.STOPPING:
            stopping += 1
            continue
        if inst is not None:
            live.append(inst)
    fn_reports = index.functions.get(spec.fqn, [])
    waiting = sum(f.waiting for f in fn_reports) + sum(i.waiting for i in live)
    if demand_at is not None and now - demand_at <= demand_hold_s:
        waiting = max(waiting, 1)
    delays = [f.queue_delay_ms for f in fn_reports] + [i.queue_delay_ms for i in live]
    return FunctionLoad(
        function=spec.fqn,
        now=now,
        instances=ready,
        starting=starting,
        stopping=stopping,
        arrival_rate=sum(f.arrival_rate for f in fn_reports),
        capacity_per_instance=spec.capacity_rps or estimate_capacity(live),
        waiting=waiting,
        in_flight=sum(i.in_flight for i in live),
        queue_delay_ms=max(delays, default=0.0),
        slo_ms=spec.slo_ms,
        instances_at_limit=min(saturated, ready),
        min_instances=spec.min_instances,
        max_instances=max(spec.max_instances, spec.min_instances),
        last_tick_at=last_tick_at,
    )


def weights_identity(function: str, rev: str) -> str:
    """A function revision's shared-weights group as a GPU's view names it (`GpuState.weight_groups`):
    the GPU's invoker is implied (its budget group is `dilu_invoker.model.weights_group` of the three)."""
    return f"{function}@{rev}"


def shares_weights(spec: FunctionSpec) -> bool:
    """Whether the function's instances may share read-only weights on a GPU: it declares them and has a
    known revision (the invoker's budget groups them by revision)."""
    return bool(spec.rev) and 0 < spec.weights_mb <= spec.memory_mb


def placement_request(spec: FunctionSpec, instance: str, max_stages: int = 1) -> PlacementRequest:
    """`spec`'s instance as placement asks for it; it may be split into up to ``min(spec.stages, max_stages)``
    pipeline stages (`PlacementConfig.llm_max_parts`, ``--balancer-max-stages``); a gang (``gpu-count`` N) asks
    for N GPUs of one invoker, each holding its request, limit and memory."""
    shared = shares_weights(spec)
    gang = spec.gpus > 1
    return PlacementRequest(
        gpus=spec.gpus,
        max_parts=max(1, min(spec.stages, max_stages)) if not (shared or gang) else 1,
        instance_id=instance,
        function=spec.fqn,
        cls=InstanceClass.parse(spec.cls),
        request=spec.request,
        limit=spec.limit,
        memory_mib=float(spec.memory_mb),
        profile=Profile(spec.profile) if spec.profile else None,
        affinity=Affinity(spec.affinity) if spec.affinity else None,
        weights_mib=float(spec.weights_mb) if shared else 0.0,
        weights_group=weights_identity(spec.fqn, spec.rev) if shared else "",
    )


def stages_of_decision(cluster: ClusterSnapshot, where: PlacementDecision, memory_mb: int
                       ) -> tuple[StageRecord, ...]:
    """A split placement's pipeline stages as the record names them (one per piece, in placement's order:
    the piece ids are the stage ids); empty for a one-GPU placement. Budgets count whole MiB: each piece's
    memory is rounded, and the last takes what makes the stages' sum the instance's `memory_mb`."""
    return stages_of_parts(cluster, where.parts, memory_mb)


def stages_of_parts(cluster: ClusterSnapshot, parts: tuple[PlacementPart, ...], memory_mb: int,
                    instance: str | None = None) -> tuple[StageRecord, ...]:
    """`stages_of_decision` for placement's pieces; `instance`: the stages are named for it (`stage_id`), not
    as the pieces are (a compaction move places the pieces of the instance it replaces)."""
    if not parts:
        return ()
    mibs = whole_mib_pieces([p.instance.memory_mib for p in parts], memory_mb)
    return tuple(
        StageRecord(id=p.instance.id if instance is None else stage_id(instance, k), gpu=p.gpu.gpu,
                    gpu_uuid=cluster.gpu(p.gpu).uuid or None, request=p.instance.request, limit=p.instance.limit,
                    memory_mb=mib)
        for k, (p, mib) in enumerate(zip(parts, mibs, strict=True))
    )


def ranks_of_decision(cluster: ClusterSnapshot, where: PlacementDecision, spec: FunctionSpec, instance: str
                      ) -> tuple[StageRecord, ...]:
    """A gang's ranks as the record names them (`rank_id`), one on each GPU of the decision in placement's order,
    each with the function's per-GPU request, limit and memory; empty for a one-GPU placement."""
    n = len(where.gpus)
    if n < 2:
        return ()
    return tuple(StageRecord(id=rank_id(instance, k, n), gpu=ref.gpu, gpu_uuid=cluster.gpu(ref).uuid or None,
                             request=spec.request, limit=spec.limit, memory_mb=spec.memory_mb)
                 for k, ref in enumerate(where.gpus))


def snapshot_ids(r: InstanceRecord) -> list[str]:
    """The ids the cluster snapshot holds a record under: a split instance's stages (the stage a move replaces
    too), a gang and any other instance its own id (a gang is one instance on each of its GPUs)."""
    if r.stages and not r.gang:
        return [s.id for s in (*r.stages, *r.moving)]
    return [r.id]


def place_new(cluster: ClusterSnapshot, spec: FunctionSpec, request: PlacementRequest,
               config: PlacementConfig) -> PlacementDecision:
    """Where a new instance goes: a GPU holding its revision's shared weights first (unless the function
    asks for spread explicitly: then only when spread finds no other lit GPU), else as spread places."""
    if request.weights_mib and spec.affinity is None:
        shared = place_sharing(cluster, request, config)
        if shared is not None:
            return shared
    return place_spread(cluster, request, config)


def without_kept(cluster: ClusterSnapshot, evictable: Mapping[GpuRef, Evictable]) -> ClusterSnapshot:
    """The cluster as it is once the kept weights of those GPUs are evicted."""
    gpus = []
    for g in cluster.gpus:
        ev = evictable.get(g.ref)
        if ev is not None:
            g = replace(g, instances=tuple(i for i in g.instances if i.id not in ev.instances),
                        weight_groups=ev.weight_groups)
        gpus.append(g)
    return ClusterSnapshot.build(now=cluster.now, gpus=gpus)


def _place_or_evict(cluster: ClusterSnapshot, spec: FunctionSpec, request: PlacementRequest,
                    config: PlacementConfig, evictable: Mapping[GpuRef, Evictable],
                    ) -> tuple[PlacementDecision, GpuRef | None]:
    """`place_new`, or on a GPU whose kept weights go to make room (the GPU returned with it): when nothing
    fits without evicting, or when the GPU scores better once they are gone than where the instance fits
    without (all else equal, no eviction). Never where the GPU's invoker has a GPU that takes the instance as
    it is: the invoker tries its other GPUs before it evicts. One GPU only (no gang, no split)."""
    decision = place_new(cluster, spec, request, config)
    held = {ref: ev for ref, ev in evictable.items() if ref in cluster.ordinals and cluster.gpu(ref).schedulable}
    if not held or request.gpus > 1:
        return decision, None
    freed = without_kept(cluster, held)
    alt = place_new(freed, spec, request, config)
    if not alt.placed or alt.split or alt.gpus[0] not in held:
        return decision, None
    ref = alt.gpus[0]
    if place_new(cluster, spec, replace(request, only_invoker=ref.invoker), config).placed:
        return decision, None
    rival = decision.total
    if decision.placed and not decision.split:
        # the GPU it fits without eviction, scored in the same world (once the kept weights are gone)
        at = decision.gpus[0]
        others = frozenset(r for r in cluster.ordinals if r.invoker == at.invoker and r != at)
        there = place_new(freed, spec, replace(request, only_invoker=at.invoker,
                                                avoid_gpus=request.avoid_gpus | others), config)
        rival = there.total if there.placed else -math.inf
    if decision.placed and alt.total <= rival + 1e-9:
        return decision, None
    ev = held[ref]
    why = (f"{alt.reason}; evicts the kept weights there ({ev.memory_mib:.0f} MiB: "
           f"{', '.join(sorted(ev.instances))})")
    if decision.placed:
        why += f", over {', '.join(map(str, decision.gpus))} without eviction (score {rival:.1f} < {alt.total:.1f})"
    return replace(alt, reason=why), ref


def victim_order(
    candidates: list[InstanceRecord], *, cluster: ClusterSnapshot | None, reports: Mapping[str, LoadReport],
    index: ReportIndex | None = None,
) -> list[InstanceRecord]:
    """Which instances of a function to stop first: from the invoker holding most of them (keeps the rest
    spread), then from the emptiest GPU (it may go dark), then the least busy, then the newest (`index`:
    `ReportIndex.of(reports)`, made once a tick, so that a scale-in does not walk every report)."""
    per_invoker: dict[str, int] = {}
    for r in candidates:
        per_invoker[r.invoker] = per_invoker.get(r.invoker, 0) + 1
    index = index if index is not None else ReportIndex.of(reports)
    loads = {r.id: i.in_flight + i.waiting for r in candidates
             if (i := index.instances.get(r.function, {}).get(r.id)) is not None}

    def used(r: InstanceRecord) -> float:
        if cluster is None or r.gpu is None:
            return 0.0
        ref = GpuRef(r.invoker, r.gpu)
        return cluster.gpu(ref).used_request if ref in cluster.ordinals else 0.0

    return sorted(candidates, key=lambda r: (-per_invoker[r.invoker], used(r), loads.get(r.id, 0), -r.since, r.id))


# -- the tick -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Work:
    """Mutable scratch of one tick (kept inside plan_tick)."""

    records: dict[str, InstanceRecord]
    starts: list[Order] = field(default_factory=list)
    stage_moves: list[Order] = field(default_factory=list)
    stops: list[Order] = field(default_factory=list)
    forgotten: list[Order] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    lost: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """Function → why an instance of it failed on its invoker this tick."""
    failed_moves: list[str] = field(default_factory=list)
    """Instances whose compaction move failed this tick (`CompactionLoop.cooling`)."""
    failed_targets: list[tuple[str, GpuRef]] = field(default_factory=list)
    """(function, GPU) of each process those moves did not start (`CompactionLoop.failed_targets`)."""

    def forget(self, r: InstanceRecord, reason: str, *, owed: bool, stop: bool, now: float, epoch: int) -> None:
        self.records.pop(r.id, None)
        self.forgotten.append(Order(r, reason))
        # A compaction replacement that did not make it is owed nothing: its original still serves.
        if owed and r.state != RecordState.STOPPING and not r.replaces:
            self.lost[r.function] = self.lost.get(r.function, 0) + 1
        if stop:
            self.stops.append(Order(r, reason))
        if r.replaces:
            self.failed_moves.append(r.replaces)
            gpus = [s.gpu for s in r.stages] if r.stages else [r.gpu] if r.gpu is not None else []
            self.failed_targets.extend((r.function, GpuRef(r.invoker, g)) for g in gpus)
        kind = "move-abandoned" if r.replaces else "lost" if owed else "forget"
        self.decisions.append(Decision(now, epoch, kind, r.function, reason, r.id, r.invoker, r.gpu))


def _reconcile(inp: TickInput, cfg: PlannerConfig, work: _Work, memo: PlanMemo | None = None,
               moved: frozenset[str] | set[str] = frozenset(), respecced: frozenset[str] | set[str] = frozenset(),
               ) -> dict[str, InstanceRecord]:
    """Reconcile the table with the reports (the module doc, 1.); returns the records kept as they were, ready or
    stopping (`PlanMemo.settled`). With `memo`, a record it names as settled that is the same object, on an
    invoker not `moved` (its report reads the same) and of a function not `respecced` (its spec is the same) is
    kept again without a look: its outcome reads nothing else, and keeping it has no other effect."""
    now, epoch = inp.now, inp.epoch
    settled: dict[str, InstanceRecord] = {}
    if memo is None:
        todo = sorted(inp.records.values(), key=_by_id)
    else:
        before = memo.settled
        todo = []
        for rid, r in inp.records.items():
            if before.get(rid) is r and r.invoker not in moved and r.function not in respecced:
                work.records[rid] = settled[rid] = r
            else:
                todo.append(r)
        todo.sort(key=_by_id)
    reported: dict[str, dict[str, InstanceReport]] = {}
    for r in todo:
        rep = inp.reports.get(r.invoker)
        if rep is None:
            work.forget(r, f"{r.id}: invoker {r.invoker} is gone (no load report)", owed=True, stop=False,
                        now=now, epoch=epoch)
            continue
        if r.boot and r.boot != rep.boot:
            work.forget(r, f"{r.id}: invoker {r.invoker} restarted", owed=True, stop=False, now=now, epoch=epoch)
            continue
        on = reported.get(r.invoker)
        if on is None:
            on = reported[r.invoker] = {i.id: i for i in rep.instances}
        inst = on.get(r.id)
        if inst is None:
            if r.state == RecordState.STOPPING:
                work.forget(r, f"{r.id}: stopped", owed=False, stop=False, now=now, epoch=epoch)
            elif r.state == RecordState.STARTING:
                # The invoker has not read the command yet (or not reported since).
                if now - r.since > cfg.start_timeout_s:
                    work.forget(r, f"{r.id}: not started after {now - r.since:.0f} s", owed=False, stop=True,
                                now=now, epoch=epoch)
                else:
                    work.records[r.id] = r
            elif r.missing + 1 >= cfg.missing_ticks:
                work.forget(r, f"{r.id}: no longer reported by {r.invoker}", owed=True, stop=True,
                            now=now, epoch=epoch)
            else:
                work.records[r.id] = replace(r, missing=r.missing + 1)
            continue
        if inst.state == InstanceState.FAILED:
            why = f"{r.id}: failed on {r.invoker}" + (f": {inst.error}" if inst.error else "")
            work.forget(r, why, owed=True, stop=True, now=now, epoch=epoch)
            if r.state == RecordState.STARTING:  # it could not start: tell the callers, retry later
                work.failed[r.function] = why
            continue
        # The same object when nothing changes: the next tick's memo tells changed records by identity.
        new = r if (not r.missing and r.boot) else replace(r, missing=0, boot=r.boot or rep.boot)
        if r.state == RecordState.STARTING:
            if inst.state == InstanceState.READY:
                new = replace(new, state=RecordState.READY.value, since=now, rev=inst.rev or r.rev)
            elif now - r.since > cfg.start_timeout_s:
                work.forget(r, f"{r.id}: not ready after {now - r.since:.0f} s", owed=False, stop=True,
                            now=now, epoch=epoch)
                continue
        if r.moving:
            after = _stage_move_outcome(r, new, inst, cfg, work, now, epoch)
            if after is None:
                continue
            new = after
        spec = inp.specs.get(r.function)
        if spec is not None and new.state != RecordState.STOPPING and outdated(new.rev, spec.rev):
            new = replace(new, state=RecordState.STOPPING.value, since=now)
            work.stops.append(Order(new, f"{r.id}: runs revision {r.rev}, the action is now {spec.rev}"))
            work.lost[r.function] = work.lost.get(r.function, 0) + 1
        elif new is r and r.state != RecordState.STARTING and not r.moving:
            settled[r.id] = r
        work.records[r.id] = new
    # Instances an invoker runs that the table does not know (e.g. it came back after being given up): a report
    # naming only known instances has none (most do: each is looked at whole only when it names another).
    records = inp.records
    for inv, rep in inp.reports.items():
        for i in rep.instances:
            if i.id not in records:
                break
        else:
            continue
        for inst in {i.id: i for i in rep.instances}.values():
            if inst.id in records or inst.state == InstanceState.DRAINING:
                continue
            ghost = InstanceRecord(id=inst.id, function=inst.function, rev=inst.rev, invoker=inv, gpu=inst.gpu,
                                   gpu_uuid=None, cls=inst.cls, request=inst.request, limit=inst.limit,
                                   memory_mb=inst.memory_mb, slots=inst.slots, state=RecordState.STOPPING.value,
                                   since=now, epoch=epoch, boot=rep.boot)
            work.stops.append(Order(ghost, f"{inst.id}: unknown to the balancer"))
    _finish_moves(now, epoch, work)
    return settled


def _stage_move_outcome(r: InstanceRecord, new: InstanceRecord, inst: InstanceReport, cfg: PlannerConfig,
                        work: _Work, now: float, epoch: int) -> InstanceRecord | None:
    """A split instance with a stage move in flight (`r`; `new`: it as this tick has it so far), by its invoker's
    report `inst`: done (the old stage is gone: nothing moves any more), failed (the old stage serves on: the
    record as before the move), or in flight; None: the move took longer than a start and the longest drain may
    (`STAGE_MOVE_DRAIN_S`; the instance is given up, stopped and owed: what it runs is no longer known)."""
    move = r.stage_move()
    if move is None:  # a record no move could have written: it holds what it lists
        return replace(new, moving=(), moving_since=0.0)
    old, fresh = move
    if inst.moved == fresh.id:
        reason = f"{old.id}: moved to {r.invoker}/gpu{fresh.gpu} as {fresh.id}, which serves (compaction)"
        work.decisions.append(Decision(now, epoch, "stage-move-done", r.function, reason, fresh.id, r.invoker,
                                       fresh.gpu))
        return replace(new, moving=(), moving_since=0.0)
    if inst.move_failed.startswith(f"{fresh.id}:"):
        reason = f"{r.id}: stage move of {old.id} failed ({inst.move_failed}); it serves on from gpu{old.gpu}"
        work.decisions.append(Decision(now, epoch, "stage-move-failed", r.function, reason, fresh.id, r.invoker,
                                       fresh.gpu))
        work.failed_moves.append(r.id)
        work.failed_targets.append((r.function, GpuRef(r.invoker, fresh.gpu)))
        return new.stage_move_undone()
    if now - r.moving_since > cfg.start_timeout_s + STAGE_MOVE_DRAIN_S:
        work.forget(r, f"{r.id}: stage move of {old.id} to gpu{fresh.gpu} not done after {now - r.moving_since:.0f} s",
                    owed=True, stop=True, now=now, epoch=epoch)
        return None
    return new


def _finish_moves(now: float, epoch: int, work: _Work) -> None:
    """Make-before-break: a compaction replacement that is ready takes over (the original is drained:
    routers stop choosing it once the table is republished, what runs on it finishes)."""
    forgotten = {o.record.id for o in work.forgotten}
    for r in sorted((r for r in work.records.values() if r.replaces), key=lambda r: r.id):
        orig = work.records.get(r.replaces)
        if r.state == RecordState.READY:
            if orig is not None and orig.state in (RecordState.READY, RecordState.STARTING):
                reason = f"{orig.id}: moved to {r.invoker}/gpu{r.gpu} as {r.id}, which is ready (compaction)"
                stopped = replace(orig, state=RecordState.STOPPING.value, since=now)
                work.records[orig.id] = stopped
                work.stops.append(Order(stopped, reason))
                work.decisions.append(Decision(now, epoch, "move-done", r.function, reason, orig.id,
                                               orig.invoker, orig.gpu))
            work.records[r.id] = replace(r, replaces="")
        elif orig is None or orig.state == RecordState.STOPPING:
            # The original is gone (lost, stopped by a scale-in): the replacement is an ordinary
            # instance now, and stands in for the lost one.
            if r.replaces in forgotten and work.lost.get(r.function, 0) > 0:
                work.lost[r.function] -= 1
            work.records[r.id] = replace(r, replaces="")


def _compact(
    inp: TickInput,
    cfg: PlannerConfig,
    work: _Work,
    cluster: ClusterSnapshot,
    calm: set[str],
    seq: int,
) -> tuple[ClusterSnapshot, int, CompactionLoop]:
    """One compaction run: replacements for the moves of `compaction_plan` (see the module doc), and stage moves
    for the pieces of split instances it moves (`_move_stage`)."""
    live = cfg.compaction
    assert live is not None
    now, epoch = inp.now, inp.epoch
    loop = inp.compaction
    cool_until = now + FAILED_MOVE_COOLDOWN_RUNS * live.period_s
    if work.failed_moves or work.failed_targets or loop.expiring(now):
        loop = loop.held(now, work.failed_moves, cool_until,
                         [(f, ref.invoker, ref.gpu) for f, ref in work.failed_targets], now + FAILED_TARGET_HOLD_S)
    if now < loop.next_at or any(r.replaces or r.moving for r in work.records.values()):
        return cluster, seq, loop
    cooling_ids = {i for i, _ in loop.cooling}
    stages = live.config.move_pieces
    # Instances of a function sharing read-only weights stay: compaction sizes a move by what the instance
    # is charged on its GPU (without the weights where it shares them), and its replacement would load a copy.
    # A split instance's stages move with `move_pieces` only.
    movable: set[str] = set()
    for r in work.records.values():
        if (r.state == RecordState.READY and r.function in calm and r.function in inp.specs and r.id not in cooling_ids
                and not outdated(r.rev, inp.specs[r.function].rev) and not shares_weights(inp.specs[r.function])):
            if not r.stages:
                movable.add(r.id)
            elif stages and not r.gang:  # a gang never moves (compaction moves one-GPU instances and pieces)
                movable.update(s.id for s in r.stages)
    pinned = frozenset(i for i in cluster.locations if i not in movable)

    def parts_allowed(function: str) -> int:  # what `placement_request` allows an instance of the function
        spec = inp.specs.get(function)
        return max(1, min(spec.stages, cfg.placement.llm_max_parts)) if spec is not None and stages else 1

    # Placement for compaction splits as far as the llm actions declare `gpu-stages` (never without stage moves);
    # a move that splits an instance further than its own action declares is not made, nor are the other moves
    # off its source GPU (which would stay lit).
    placement = replace(cfg.placement, llm_max_parts=max(
        (parts_allowed(f) for f, spec in inp.specs.items() if spec.cls == InstanceClass.LLM.value), default=1))
    plan = compaction_plan(cluster, placement, live.config, loop.state, pinned=pinned)
    chosen, short = _chosen_moves(inp, work, cluster, plan, parts_allowed, loop.failed_targets)
    if short:
        # An invoker's user memory cannot hold the containers some moves start, or they would go where a move of
        # their function failed lately: those instances stay where they are (and cool down, as after a failed
        # move), and the run plans once more without them.
        plan = compaction_plan(cluster, placement, live.config, loop.state,
                               pinned=pinned | {s.id for orig, _ in short.values() for s in orig.stages} | set(short))
        chosen, again = _chosen_moves(inp, work, cluster, plan, parts_allowed, loop.failed_targets)
        short |= again
        for orig, why in short.values():
            work.decisions.append(Decision(now, epoch, "move-held", orig.function, why, orig.id, orig.invoker,
                                           orig.gpu))
        loop = loop.held(now, short, cool_until)
    for mv, orig, held_id in chosen:
        parent = stage_parent(mv.instance_id)
        if parent is not None and not mv.replaces:
            cluster, seq = _move_stage(inp, work, cluster, seq, orig, mv.instance_id, mv.target,
                                       f"compaction: {mv.reason}")
            continue
        iid = instance_id(orig.function, epoch, seq)
        seq += 1
        ref = mv.target
        rep = inp.reports.get(ref.invoker)
        spec = inp.specs[orig.function]
        held = cluster.instance(held_id)
        whole = PlacedInstance(id=iid, function=held.function, cls=held.cls, request=orig.request if orig.stages
                               else held.request, limit=orig.limit if orig.stages else held.limit,
                               memory_mib=float(orig.memory_mb) if orig.stages else held.memory_mib,
                               profile=held.profile)
        split = stages_of_parts(cluster, mv.parts, orig.memory_mb, iid)
        record = replace(
            orig, id=iid, invoker=ref.invoker, gpu=ref.gpu, gpu_uuid=cluster.gpu(ref).uuid or None,
            state=RecordState.STARTING.value, since=now, epoch=epoch, boot=rep.boot if rep is not None else "",
            missing=0, replaces=orig.id, stages=split, moving=(), moving_since=0.0,
            user_memory_mb=spec.user_memory_mb * max(1, len(split)),
        )
        if split:
            for st, part in zip(split, mv.parts, strict=True):
                cluster = cluster.with_instance(replace(part.instance, id=st.id, part_of=iid), (part.gpu,))
        else:
            cluster = cluster.with_instance(whole, (ref,))
        src = mv.source
        reason = f"compaction: {mv.reason}; {iid} replaces {orig.id} (from {src.invoker}/gpu{src.gpu})"
        work.records[iid] = record
        work.starts.append(Order(record, reason))
        work.decisions.append(Decision(now, epoch, "move", orig.function, reason, iid, ref.invoker, ref.gpu))
    return cluster, seq, replace(loop, next_at=now + live.period_s, state=plan.state)


def _chosen_moves(inp: TickInput, work: _Work, cluster: ClusterSnapshot, plan: CompactionPlan,
                  parts_allowed: Callable[[str], int], failed_targets: tuple[tuple[str, str, int, float], ...] = (),
                  ) -> tuple[list[tuple[CompactionMove, InstanceRecord, str]], dict[str, tuple[InstanceRecord, str]]]:
    """The moves of `plan` a run makes, each with the record it moves and the id the cluster holds it under, and
    the instances held back because an invoker's user memory cannot hold the containers their moves start, or
    because a move would start a process of their function on a GPU where one failed lately (`failed_targets`;
    record id → the record and why).

    Not made: a move that splits an instance further than its action declares, a second move of one instance (the
    invoker hands over one stage at a time, a replacement is started once), and every move off a GPU one of whose
    moves is not made (it would stay lit anyway), nor onto one (the plan counted on the room it frees). User memory
    (docs/balancer.md, "User memory"): a replacement holds its action's memory for each of its containers on its
    invoker while the original still holds its own, a stage move one more container on the instance's invoker
    until the old stage is drained."""
    too_split = {mv.source for mv in plan.moves if len(mv.parts) > parts_allowed(mv.function)}
    picked: list[tuple[CompactionMove, InstanceRecord, str]] = []
    touched: set[str] = set()
    for mv in plan.moves:
        if mv.source in too_split:
            continue
        parent = stage_parent(mv.instance_id)
        orig = work.records.get(parent if parent is not None and not mv.replaces else mv.instance_id)
        if orig is None or orig.id in touched or (parent is not None and not orig.stages):
            continue
        # The whole instance, as the cluster holds it (a split original: as one of its stages' pieces, summed).
        held_id = next((s.id for s in orig.stages if cluster.has_instance(s.id)), "") if orig.stages else orig.id
        if not cluster.has_instance(held_id):
            continue
        touched.add(orig.id)
        picked.append((mv, orig, held_id))
    memory = UserMemory(inp.reports, work.records)
    short: dict[str, tuple[InstanceRecord, str]] = {}
    short_sources: set[GpuRef] = set()
    failed_on = {(f, GpuRef(inv, g)) for f, inv, g, _ in failed_targets}
    for mv, orig, _ in picked:
        bad = next((p.gpu for p in mv.parts if (orig.function, p.gpu) in failed_on), None) if mv.parts else (
            mv.target if (orig.function, mv.target) in failed_on else None)
        if bad is not None:
            short_sources.add(mv.source)
            short[orig.id] = (orig, f"compaction: a move of {orig.function} onto {bad.invoker}/gpu{bad.gpu} failed "
                                    f"lately; {orig.id} stays on {mv.source.invoker}/gpu{mv.source.gpu}")
            continue
        per = inp.specs[orig.function].user_memory_mb
        if stage_parent(mv.instance_id) is not None and not mv.replaces:
            inv, need = orig.invoker, per
        else:
            inv, need = mv.target.invoker, per * max(1, len(mv.parts))
        if memory.holds(inv, need):
            memory.hold(inv, need)
            continue
        short_sources.add(mv.source)
        total, held = memory.total.get(inv, 0), memory.held.get(inv, 0)
        short[orig.id] = (orig, f"compaction: invoker user memory: moving {orig.id} needs {need} MB on {inv}, "
                                f"which has {total - held} of {total} MB free; it stays on "
                                f"{mv.source.invoker}/gpu{mv.source.gpu}")
    if short_sources:
        picked = [p for p in picked if p[0].source not in short_sources and p[0].target not in short_sources]
    return picked, short


def _move_stage(inp: TickInput, work: _Work, cluster: ClusterSnapshot, seq: int, orig: InstanceRecord,
                piece: str, target: GpuRef, reason: str) -> tuple[ClusterSnapshot, int]:
    """Stage `piece` of split instance `orig` to GPU `target` of its invoker, make-before-break: the record names
    the new stage (a new id, `moved_stage_id`) in the old one's place and keeps the old one in `moving` until the
    invoker reports the hand-over done; the cluster holds both meanwhile."""
    k = next((n for n, s in enumerate(orig.stages) if s.id == piece), None)
    if k is None or target.invoker != orig.invoker:
        return cluster, seq
    now, epoch = inp.now, inp.epoch
    old = orig.stages[k]
    fresh = StageRecord(id=moved_stage_id(orig.id, k, seq), gpu=target.gpu,
                        gpu_uuid=cluster.gpu(target).uuid or None, request=old.request, limit=old.limit,
                        memory_mb=old.memory_mb)
    seq += 1
    stages = (*orig.stages[:k], fresh, *orig.stages[k + 1:])
    record = replace(orig, stages=stages, moving=(old,), moving_since=now, gpu=stages[0].gpu,
                     gpu_uuid=stages[0].gpu_uuid)
    cluster = cluster.with_instance(replace(cluster.instance(old.id), id=fresh.id), (target,))
    reason = f"{reason}; stage {k} of {orig.id} to gpu{target.gpu} as {fresh.id} (from gpu{old.gpu})"
    work.records[orig.id] = record
    work.stage_moves.append(Order(record, reason))
    work.decisions.append(Decision(now, epoch, "stage-move", orig.function, reason, fresh.id, target.invoker,
                                   target.gpu))
    return cluster, seq


def plan_tick(inp: TickInput, cfg: PlannerConfig) -> TickPlan:
    now, epoch = inp.now, inp.epoch
    cluster = inp.cluster
    memo = inp.memo if (inp.memo is not None and inp.memo.cfg == cfg and inp.memo.epoch == epoch
                        and cluster is not None) else None
    work = _Work(records={})
    if memo is not None:
        moved = _moved(inp, memo)
        respecced = _respecced(inp, memo)
        settled = _reconcile(inp, cfg, work, memo, moved, respecced)
    else:
        settled = _reconcile(inp, cfg, work)
    # Lost instances leave the cluster snapshot (their budgets may still hold them until they expire).
    if cluster is not None:
        for order in work.forgotten:
            for held in snapshot_ids(order.record):  # a split instance: its stages (one a move replaces too)
                if cluster.has_instance(held):
                    cluster = cluster.without_instance(held)
    seq = inp.seq
    states = dict(inp.states)
    scale: list[ScaleDecision] = []
    calm: set[str] = set()
    evictable = dict(inp.evictable)
    # Every registered function, idle ones included: min-instances holds without traffic.
    functions = memo.functions_order if memo is not None and inp.specs.keys() == memo.specs.keys() else sorted(inp.specs)
    demand = frozenset(f for f, t in inp.demand.items() if now - t <= cfg.demand_hold_s)
    figures: dict[str, _Figures] = {}
    again: dict[str, ScaleDecision] = {}
    if memo is not None:
        dirty = _changed(inp, work, memo, figures, demand, moved, respecced)
        # Nothing a function depends on changed: the hold it decided last tick, again (`PlanMemo`). Asked before
        # any function is planned: the answer reads only the function's own inputs and the memo.
        for fqn in functions:
            if fqn in dirty or (last := memo.functions.get(fqn)) is None:
                continue
            was = states.get(fqn)
            if was is None:
                was = FunctionState()
            elif was.owed:
                continue
            decision = repeat_decision(memo.decisions[fqn], last.load, was.horizontal, now, cfg.horizontal,
                                       last_tick_at=inp.last_tick_at)
            if decision is not None:
                again[fqn] = decision
    else:
        figures.update((inv, _figures(rep)) for inv, rep in inp.reports.items())
    # What planning the others from scratch reads, for them only: the reports' figures of each and its records
    # by id (the order of a table reconciled from scratch, which the sums over them follow); a function's
    # iteration below changes only its own records.
    fresh = {f for f in functions if f not in again} if again else None
    index = ReportIndex.of(inp.reports, fresh)
    by_function: dict[str, list[InstanceRecord]] = {}
    for r in work.records.values():
        if fresh is None or r.function in fresh:
            by_function.setdefault(r.function, []).append(r)
    if memo is not None:  # the records kept without a look come first
        for rs in by_function.values():
            rs.sort(key=_by_id)
    memory: UserMemory | None = None  # made when first asked, before the table changes (from the table as is)
    memos: dict[str, FunctionMemo] = {}
    repeated: set[str] = set()
    kept: dict[str, RoutingTable] = {}
    # Without any GPU there is nothing to place: routers run GPU functions in their own pools (on the CPU)
    # as the routing tables say, and the scaler has nothing to decide.
    for fqn in functions if cluster is not None else ():
        spec = inp.specs[fqn]
        was = states.get(fqn)
        state = was if was is not None else FunctionState()
        repeat = again.get(fqn)
        if repeat is not None:
            assert memo is not None
            scale.append(repeat)
            states[fqn] = now_state = FunctionState(repeat.state, 0, "" if now >= state.retry_at else state.blocked,
                                                    state.retry_at)
            last = memo.functions[fqn]
            if last.calm:
                calm.add(fqn)
            memos[fqn] = last
            repeated.add(fqn)
            # It keeps its routing table when it blocks for the same reason (its records and figures did not
            # change): the table the service published, which the last tick made.
            table = inp.routes.get(fqn)
            if (table is not None and table is memo.routes.get(fqn) and (then := memo.states.get(fqn)) is not None
                    and now_state.blocked == then.blocked):
                kept[fqn] = table
            continue
        # A compaction replacement is not one more instance: it takes over from its original.
        mine = [r for r in by_function.get(fqn, ()) if not outdated(r.rev, spec.rev) and not r.replaces]
        load = function_load(spec, now=now, records=mine, reports=inp.reports, demand_at=inp.demand.get(fqn),
                             demand_hold_s=cfg.demand_hold_s, index=index, last_tick_at=inp.last_tick_at)
        decision = decide_scale(load, state.horizontal, cfg.horizontal)
        scale.append(decision)
        committed = load.committed
        hi = max(spec.max_instances, spec.min_instances)
        owed = state.owed + work.lost.get(fqn, 0)
        if decision.action is ScaleAction.IN:
            owed = 0
        elif decision.action is ScaleAction.OUT:
            owed = max(owed, decision.desired - committed)
        owed = max(0, min(owed, hi - committed))
        # A decision the balancer is still carrying out (blocked placement) is not logged again every tick.
        if decision.action is ScaleAction.IN or (decision.action is ScaleAction.OUT and owed > state.owed):
            work.decisions.append(Decision(now, epoch, f"scale-{decision.action.value}", fqn, decision.reason))
        if work.lost.get(fqn):
            work.decisions.append(Decision(now, epoch, "replace", fqn,
                                           f"{fqn}: {work.lost[fqn]} instance(s) lost or outdated: replace them"))
        blocked = state.blocked
        retry_at = state.retry_at
        if fqn in work.failed:
            blocked, retry_at = work.failed[fqn], now + cfg.failed_retry_s
        elif not owed and now >= retry_at:
            blocked = ""  # nothing to place: an old reason would refuse the next caller without a new try
        if owed and cluster is not None and now >= retry_at:
            placed = 0
            if memory is None:
                memory = UserMemory(inp.reports, work.records)
            for _ in range(owed):
                iid = instance_id(fqn, epoch, seq)
                request = placement_request(spec, iid, cfg.placement.llm_max_parts)
                fits, short = memory.fits(cluster, spec)
                where, evicts = (_place_or_evict(fits, spec, request, cfg.placement, evictable)
                                 if fits is not None else (None, None))
                if (where is not None and fits is not None and where.split
                        and not memory.holds(where.gpus[0].invoker, spec.user_memory_mb * len(where.parts))):
                    # Each stage is a container holding the action's memory limit: where the invoker's user
                    # memory cannot hold them all, the instance is placed whole.
                    where, evicts = _place_or_evict(fits, spec, replace(request, max_parts=1), cfg.placement,
                                                    evictable)
                if where is None or not where.placed:
                    reason = short if where is None else (f"{where.reason}; {short}" if short else where.reason)
                    if reason != blocked:
                        work.decisions.append(Decision(now, epoch, "blocked", fqn, reason))
                    blocked = reason
                    break
                seq += 1
                placed += 1
                blocked = ""
                ref = where.gpus[0]
                if evicts is not None:  # the kept weights there go: this tick's next placements see the room
                    cluster = without_kept(cluster, {evicts: evictable.pop(evicts)})
                weights = spec.weights_mb if not where.split and holds_weights(cluster.gpu(ref), request) else 0
                cluster = apply_placement(cluster, request, where)
                rep = inp.reports.get(ref.invoker)
                stages = (ranks_of_decision(cluster, where, spec, iid) if request.gpus > 1
                          else stages_of_decision(cluster, where, spec.memory_mb))
                # Each stage (each rank of a gang) is a container of its own, holding the action's memory limit of
                # its invoker.
                record = InstanceRecord(
                    id=iid, function=fqn, rev=spec.rev, invoker=ref.invoker, gpu=ref.gpu,
                    gpu_uuid=cluster.gpu(ref).uuid or None, cls=spec.cls, request=spec.request, limit=spec.limit,
                    memory_mb=spec.memory_mb * max(1, request.gpus), slots=spec.slots, state=RecordState.STARTING.value, since=now,
                    epoch=epoch, boot=rep.boot if rep is not None else "",
                    user_memory_mb=spec.user_memory_mb * max(1, len(stages)), stages=stages,
                )
                work.records[iid] = record
                memory.hold(record.invoker, record.user_memory_mb)
                work.starts.append(Order(record, where.reason, weights, evicts=evicts is not None))
                work.decisions.append(Decision(now, epoch, "place", fqn, where.reason, iid, ref.invoker, ref.gpu))
            owed -= placed
        if decision.action is ScaleAction.IN:
            stop_n = committed - decision.desired
            live = [r for r in mine if r.state in (RecordState.READY, RecordState.STARTING)]
            # Starting instances are cheapest to give up only in number: prefer ready ones, they cost
            # nothing more than a warm container, and a start in progress was just paid for.
            ready = [r for r in live if r.state == RecordState.READY]
            if memory is None:
                memory = UserMemory(inp.reports, work.records)
            for victim in victim_order(ready, cluster=cluster, reports=inp.reports, index=index)[:stop_n]:
                stopped = replace(victim, state=RecordState.STOPPING.value, since=now)
                work.records[victim.id] = stopped
                memory.hold(victim.invoker, -victim.user_memory_mb)
                work.stops.append(Order(stopped, decision.reason))
                work.decisions.append(Decision(now, epoch, "stop", fqn, decision.reason, victim.id, victim.invoker,
                                               victim.gpu))
        states[fqn] = FunctionState(horizontal=decision.state, owed=owed, blocked=blocked, retry_at=retry_at)
        is_calm = function_calm(decision, load, owed)
        if is_calm:
            calm.add(fqn)
        memos[fqn] = FunctionMemo(load, is_calm)
    loop = inp.compaction
    compaction_cpu_s = None
    if cfg.compaction is not None and cluster is not None:
        before = len(work.starts)
        c0 = time.thread_time()
        cluster, seq, loop = _compact(inp, cfg, work, cluster, calm, seq)
        if loop.next_at != inp.compaction.next_at:  # a run
            compaction_cpu_s = time.thread_time() - c0
        for o in work.starts[before:]:
            repeated.discard(o.record.function)
            kept.pop(o.record.function, None)
    routes = _routes(inp, work.records, states, cluster, kept, functions)
    gone = frozenset(inp.known_invokers - set(inp.reports))
    records = dict(work.records)
    return TickPlan(
        starts=tuple(work.starts),
        stops=tuple(work.stops),
        records=records,
        forgotten=tuple(work.forgotten),
        routes=routes,
        states=states,
        scale=tuple(scale),
        decisions=tuple(work.decisions),
        gone=gone,
        seq=seq,
        cluster=cluster,
        compaction=loop,
        stage_moves=tuple(work.stage_moves),
        # Copies of the mappings (not of what they hold): a caller may change its own in place.
        memo=PlanMemo(cfg=cfg, epoch=epoch, records=dict(records), reports=dict(inp.reports), figures=figures,
                      specs=dict(inp.specs), states=dict(states), routes=dict(routes), demand=demand, functions=memos,
                      decisions={d.function: d for d in scale}, settled=settled, functions_order=functions),
        compaction_cpu_s=compaction_cpu_s,
    )


#: The figures of an instance's report that a tick reads (`_figures`), in order.
_FIGURES = operator.attrgetter("function", "id", "state", "rev", "waiting", "in_flight", "queue_delay_ms",
                               "saturated", "completion_rate", "latency_ms", "slots", "moved", "move_failed")
_by_id = operator.attrgetter("id")


def _figures(rep: LoadReport) -> _Figures:
    """What a tick reads of one report for its functions' load and routing tables: each instance's id, function,
    state, revision and load figures, and the per-function figures. The rest (the clock, SM shares, throttled
    time, GPUs) changes no function's load."""
    return frozenset(map(_FIGURES, rep.instances)), frozenset(rep.functions)


def _same_report(rep: LoadReport, was: LoadReport) -> bool:
    """Whether a report reads as `was` did for a tick: the same boot, per-function figures and instances' figures
    (`_FIGURES`) in the same order. Then so do its `_figures`, and each record on its invoker reconciles as then."""
    if rep is was:
        return True
    if rep.boot != was.boot or rep.functions != was.functions or len(rep.instances) != len(was.instances):
        return False
    for a, b in zip(rep.instances, was.instances, strict=True):
        if a is not b and _FIGURES(a) != _FIGURES(b):
            return False
    return True


_V = TypeVar("_V")


def _differing(now: Mapping[str, _V], last: Mapping[str, _V], same: Callable[[_V, _V], bool]) -> set[str]:
    """The keys of `now` or `last` alone, and those whose values are not `same`."""
    out = set(last.keys() - now.keys())
    for key, value in now.items():
        was = last.get(key)
        if was is None or not same(value, was):
            out.add(key)
    return out


def _moved(inp: TickInput, memo: PlanMemo) -> set[str]:
    """The invokers whose report does not read as the memo's did (`_same_report`), or reported then or now only."""
    return _differing(inp.reports, memo.reports, _same_report)


def _respecced(inp: TickInput, memo: PlanMemo) -> set[str]:
    """The functions whose spec is not the memo's (added, removed or changed)."""
    return _differing(inp.specs, memo.specs, lambda spec, was: spec is was or spec == was)


def _changed(inp: TickInput, work: _Work, memo: PlanMemo, figures: dict[str, _Figures],
             demand: frozenset[str], moved: set[str], respecced: set[str]) -> set[str]:
    """The functions some input of which changed since the tick that made `memo` (records after reconciling,
    figures in the reports, spec, carried state, a demand signal counting now or then, lost or failed
    instances); fills `figures` with this tick's per invoker (`_figures`, reused for a report not `moved`)."""
    dirty = set(work.lost) | set(work.failed) | demand | memo.demand | respecced
    last = memo.records
    for rid, r in work.records.items():
        if last.get(rid) is not r:
            dirty.add(r.function)
    for rid in last.keys() - work.records.keys():
        dirty.add(last[rid].function)
    for inv, rep in inp.reports.items():
        before = memo.figures.get(inv)
        if before is not None and inv not in moved:
            figures[inv] = before
            continue
        now = figures[inv] = _figures(rep)
        if now != before:
            _touch(dirty, now, before or (frozenset(), frozenset()), work.records, last)
    for inv in memo.figures.keys() - inp.reports.keys():
        _touch(dirty, (frozenset(), frozenset()), memo.figures[inv], work.records, last)
    for fqn, state in inp.states.items():
        if memo.states.get(fqn) is not state:
            dirty.add(fqn)
    return dirty


def _touch(dirty: set[str], now: _Figures, then: _Figures, *tables: Mapping[str, InstanceRecord]) -> None:
    """Mark the functions whose figures differ between two readings of a report: those reported, and those of
    the records the instances' ids name (a routing table reads an instance's figures by its id)."""
    for i in now[0] ^ then[0]:
        dirty.add(i[0])
        for table in tables:
            r = table.get(i[1])
            if r is not None:
                dirty.add(r.function)
    dirty.update(f.function for f in now[1] ^ then[1])


def user_memory_fits(cluster: ClusterSnapshot, spec: FunctionSpec, reports: Mapping[str, LoadReport],
                     records: Mapping[str, InstanceRecord]) -> tuple[ClusterSnapshot | None, str]:
    """The cluster without the GPUs of invokers whose user memory cannot hold one more instance of ``spec``.

    The rule (docs/balancer.md, "User memory"): a placed instance holds its action's memory on its
    invoker for as long as it lives (its container is pinned, never evicted), so the balancer places an
    instance only where user memory minus what placed instances hold fits it; one function's pinned
    instances can never leave another's placed instance waiting for memory. Pool containers (not placed)
    are evictable and do not count. Returns None (and why) when no invoker has room. A tick that places
    many instances keeps a `UserMemory` instead (the same answers, without a pass over every record each)."""
    return UserMemory(reports, records).fits(cluster, spec)


class UserMemory:
    """What `user_memory_fits` judges, kept through a tick: each live invoker's user memory and what its placed
    (not stopping) instances hold, updated as the tick places and stops instances (`hold`)."""

    def __init__(self, reports: Mapping[str, LoadReport], records: Mapping[str, InstanceRecord]) -> None:
        self.total = {inv: rep.user_memory_mb for inv, rep in reports.items()}  # 0: the invoker does not say
        self.held: dict[str, int] = {}
        for r in records.values():
            if r.state != RecordState.STOPPING:
                # A stage being moved is one more container until the old one is drained (`InstanceRecord.moving`).
                extra = r.user_memory_mb // len(r.stages) * len(r.moving) if r.moving and r.stages else 0
                self.held[r.invoker] = self.held.get(r.invoker, 0) + r.user_memory_mb + extra
        self._short: dict[int, set[str]] = {}  # need (MB) -> the judged invokers that cannot fit it

    def _is_short(self, inv: str, need: int) -> bool:
        total = self.total.get(inv, 0)
        return bool(total) and total - self.held.get(inv, 0) < need

    def holds(self, invoker: str, mb: int) -> bool:
        """Whether `invoker`'s user memory has `mb` more room (one that does not say has)."""
        return not self._is_short(invoker, mb)

    def hold(self, invoker: str, mb: int) -> None:
        """A placed instance starts holding `mb` on `invoker` (negative: a stopped one no longer does)."""
        if not mb:
            return
        self.held[invoker] = self.held.get(invoker, 0) + mb
        for need, short in self._short.items():
            if self._is_short(invoker, need):
                short.add(invoker)
            else:
                short.discard(invoker)

    def fits(self, cluster: ClusterSnapshot, spec: FunctionSpec) -> tuple[ClusterSnapshot | None, str]:
        """`user_memory_fits` for ``spec`` on what is held now (a gang's: a container per rank)."""
        need = spec.user_memory_mb * max(1, spec.gpus)
        if not need:
            return cluster, ""
        short = self._short.get(need)
        if short is None:
            short = self._short[need] = {inv for inv in self.total if self._is_short(inv, need)}
        out = cluster
        for inv in sorted(short):
            out = _unschedulable(out, inv)
        why = (f"invoker user memory: {spec.fqn} needs {need} MB; " + "; ".join(
            f"invoker {inv}: {self.held.get(inv, 0)} of {self.total[inv]} MB user memory held by placed instances, "
            f"{self.total[inv] - self.held.get(inv, 0)} MB free" for inv in sorted(short))) if short else ""
        if len(short) == len(self.total):
            return None, why
        return out, why


def _unschedulable(cluster: ClusterSnapshot, invoker: str) -> ClusterSnapshot:
    for ref in [r for r in cluster.ordinals if r.invoker == invoker]:
        cluster = cluster.with_schedulable(ref, False)
    return cluster


def _routes(
    inp: TickInput,
    records: Mapping[str, InstanceRecord],
    states: Mapping[str, FunctionState],
    cluster: ClusterSnapshot | None,
    kept: Mapping[str, RoutingTable] | None = None,
    functions: list[str] | None = None,
) -> dict[str, RoutingTable]:
    """Each function's routing table; `kept`: tables known to be what this would make again; `functions`: the
    functions of `inp.specs`, sorted."""
    kept = kept or {}
    if functions is not None and inp.specs.keys() <= states.keys():
        names = functions  # every function has a table: those with records, demand or a table have a spec
    else:
        every = set(inp.routes) | set(inp.demand) | {r.function for r in records.values()} | set(states)
        names = sorted(every & set(inp.specs))
    out: dict[str, RoutingTable] = {}
    todo = [f for f in names if f not in kept]
    by_function: dict[str, list[InstanceRecord]] = {}
    loads: dict[str, InstanceReport] = {}
    if todo:
        need = set(todo)
        for r in records.values():
            if r.function in need:
                by_function.setdefault(r.function, []).append(r)
        ids = {r.id for rs in by_function.values() for r in rs}
        for rep in inp.reports.values():
            for i in rep.instances:
                if i.id in ids:
                    loads[i.id] = i
    reports, epoch, fallback = inp.reports, inp.epoch, cluster is None
    for fqn in names:
        table = kept.get(fqn)
        if table is not None:
            out[fqn] = table
            continue
        rev = inp.specs[fqn].rev
        entries = []
        for r in sorted(by_function.get(fqn, ()), key=_by_id):
            if r.state == RecordState.READY and r.invoker in reports and not outdated(r.rev, rev):
                load = loads.get(r.id)
                entries.append(RouteEntry(r.id, r.invoker, r.slots, load.in_flight if load is not None else 0,
                                          load.waiting if load is not None else 0))
        state = states.get(fqn)
        blocked = state.blocked if state is not None and not entries else ""
        prev = inp.routes.get(fqn)
        if prev is not None and routes_equal(prev, rev, fallback, blocked, entries):
            # The published table, when it is the one this would make (the service then writes nothing for it).
            if prev.epoch == epoch and prev.function == fqn and prev.instances == tuple(entries):
                out[fqn] = prev
                continue
            version = prev.version
        else:
            version = prev.version + 1 if prev is not None else 1
        out[fqn] = RoutingTable(function=fqn, rev=rev, epoch=epoch, version=version, instances=tuple(entries),
                                local_fallback=fallback, blocked=blocked)
    return out

