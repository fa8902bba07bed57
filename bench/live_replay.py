"""The live planner (`loadbalancer.planner.plan_tick`) driven on simulated time, with simulated invokers.

The invokers are the harness: each reports every non-stopping record of its own as a ready instance (a
started instance is ready at the next tick, a stopped one gone), and its GPUs' budgets hold what those
records hold. Used by tests/loadbalancer/test_live_equals_sim.py (the live planner decides as the placement
simulator does) and bench/planner_scale.py (what a tick costs at scale)."""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from dilu_invoker.loadbalancer.planner import (
    CompactionLoop,
    PlanMemo,
    PlannerConfig,
    TickInput,
    TickPlan,
    plan_tick,
)
from dilu_invoker.policy import ClusterSnapshot, GpuRef, GpuState, InstanceClass, PlacedInstance
from dilu_invoker.wire import (
    FunctionReport,
    FunctionSpec,
    GpuReport,
    InstanceRecord,
    InstanceReport,
    LoadReport,
    RecordState,
    stage_id,
    stage_index,
    stage_parent,
)

GPU_MIB = 40 * 1024
GPUS_PER_NODE = 4


class LiveHarness:
    """`nodes` invokers of `GPUS_PER_NODE` GPUs of `GPU_MIB` each; `specs` is the registry the planner reads."""

    def __init__(self, nodes: int, cfg: PlannerConfig) -> None:
        self.invokers = [f"node{i:04d}" for i in range(nodes)]
        self.cfg = cfg
        self.records: dict[str, InstanceRecord] = {}
        self.specs: dict[str, FunctionSpec] = {}
        self.states: dict[str, Any] = {}
        self.routes: dict[str, Any] = {}
        self.seq = 1
        self.loop = CompactionLoop(next_at=math.inf)
        #: the last plan's memo, as the service carries it (`PlanMemo`); None plans every function from scratch
        self.memo: PlanMemo | None = None
        self.incremental = True
        self.log: list[tuple[Any, ...]] = []
        #: CPU seconds of the last tick: building the reports and the cluster snapshot (what the service reads
        #: from Redis each tick, without the I/O), and `plan_tick` itself
        self.last_build_s = 0.0
        self.last_plan_s = 0.0

    def reports(self) -> dict[str, LoadReport]:
        """What every invoker reports now."""
        by_inv: dict[str, list[InstanceReport]] = {inv: [] for inv in self.invokers}
        for r in self.records.values():
            if r.state != RecordState.STOPPING:
                # A stage move is done by the next report (the new stage serves, the old one is gone).
                move = r.stage_move()
                by_inv[r.invoker].append(InstanceReport(
                    id=r.id, function=r.function, rev=r.rev, state="ready", gpu=r.gpu, request=r.request,
                    limit=r.limit, memory_mb=r.memory_mb, moved=move[1].id if move is not None else ""))
        return {inv: LoadReport(invoker=inv, boot="b", at_ms=0,
                                gpus=tuple(GpuReport(index=i, uuid=f"{inv}-g{i}", memory_mb=GPU_MIB)
                                           for i in range(GPUS_PER_NODE)),
                                instances=tuple(insts)) for inv, insts in by_inv.items()}

    def _cluster(self, now: float) -> ClusterSnapshot:
        placed: dict[GpuRef, list[PlacedInstance]] = {}
        # In the order they were placed (the simulator appends to a GPU's instances likewise; a moved stage is
        # placed when it moved: its id ends with that sequence number).
        pieces: list[tuple[int, GpuRef, PlacedInstance]] = []
        for r in self.records.values():
            if r.state != RecordState.STOPPING and r.gpu is not None:
                cls = InstanceClass.parse(r.cls)
                seq = int(r.id.rsplit("-", 1)[1])
                # A split instance as its stages' reservations hold it: a piece on each stage's GPU (the stage a
                # move replaces too, until the move is done).
                if r.gang:  # a gang as its ranks' reservations hold it: the one instance on each rank's GPU
                    for s in r.stages:
                        pieces.append((seq, GpuRef(r.invoker, s.gpu), PlacedInstance(
                            id=r.id, function=r.function, cls=cls, request=s.request, limit=s.limit,
                            memory_mib=float(s.memory_mb), gpus=len(r.stages))))
                    continue
                for s in (*r.stages, *r.moving):
                    _, dot, moved = s.id.rpartition("#p")[2].partition(".")
                    pieces.append((int(moved) if dot else seq, GpuRef(r.invoker, s.gpu), PlacedInstance(
                        id=s.id, function=r.function, cls=cls, request=s.request, limit=s.limit,
                        memory_mib=float(s.memory_mb), part_of=r.id)))
                if not r.stages:
                    pieces.append((seq, GpuRef(r.invoker, r.gpu), PlacedInstance(
                        id=r.id, function=r.function, cls=cls, request=r.request, limit=r.limit,
                        memory_mib=float(r.memory_mb))))
        for _, ref, inst in sorted(pieces, key=lambda p: p[0]):
            placed.setdefault(ref, []).append(inst)
        return ClusterSnapshot.build(now=now, gpus=[
            GpuState(ref=GpuRef(inv, i), memory_mib=float(GPU_MIB), uuid=f"{inv}-g{i}",
                     instances=tuple(placed.get(GpuRef(inv, i), ())))
            for inv in self.invokers for i in range(GPUS_PER_NODE)])

    def tick(self, now: float, *, compact: bool = False) -> TickPlan:
        """One tick at `now`; `compact`: compaction is due (else it never is). Logs the placements, moves and
        refusals as (kind, function, …) tuples in `log`."""
        before = dict(self.records)
        c0 = time.process_time()
        reports, cluster = self.reports(), self._cluster(now)
        c1 = time.process_time()
        plan = plan_tick(TickInput(
            now=now, epoch=1, reports=reports, known_invokers=frozenset(self.invokers),
            records=self.records, specs=self.specs, cluster=cluster, states=self.states,
            routes=self.routes, seq=self.seq, compaction=replace(self.loop, next_at=0.0 if compact else math.inf),
            memo=self.memo if self.incremental else None), self.cfg)
        self.last_build_s, self.last_plan_s = c1 - c0, time.process_time() - c1
        for d in plan.decisions:
            if d.kind == "place":
                rec = plan.records[d.instance]
                self.log.append(("place", d.function, tuple(GpuRef(d.invoker, s.gpu) for s in rec.stages)
                                 or (GpuRef(d.invoker, d.gpu or 0),)))
            elif d.kind == "move":
                orig = before[plan.records[d.instance].replaces]
                self.log.append(("move", orig.function, _source(d.reason), GpuRef(d.invoker, d.gpu or 0)))
            elif d.kind == "stage-move":
                rec = plan.records[stage_parent(d.instance) or ""]
                old = rec.moving[0]
                # Named as the simulator names the piece (`part_id` of the instance: here, its function).
                self.log.append(("move", stage_id(rec.function, stage_index(old.id) or 0),
                                 GpuRef(rec.invoker, old.gpu), GpuRef(d.invoker, d.gpu or 0)))
            elif d.kind in ("blocked", "move-abandoned", "lost"):
                self.log.append((d.kind, d.function))
        self.records, self.states, self.routes = dict(plan.records), dict(plan.states), dict(plan.routes)
        self.seq = plan.seq
        self.loop = plan.compaction
        self.memo = plan.memo
        return plan


def _source(reason: str) -> GpuRef:
    """The GPU a compaction move empties, as its decision's reason names it ("… (from INVOKER/gpuN)")."""
    where = reason.rpartition("(from ")[2].rstrip(")")
    invoker, _, gpu = where.rpartition("/gpu")
    return GpuRef(invoker, int(gpu))


#: `live_figures`' clock at tick 0 (ms)
EPOCH_MS = 1_800_000_000_000


def live_figures(reports: Mapping[str, LoadReport], tick: int, seed: int, busy: float = 0.5) -> dict[str, LoadReport]:
    """`reports` as live invokers publish them at `tick` (one report period a tick), for the balancer's read path:
    `at_ms` moves one period each tick, and so do the figures of every busy instance. A fraction `busy` of the
    instances is busy, chosen by `seed` once for all ticks; a busy instance's share, throttled seconds, waiting,
    in flight, arrival and completion rates, latency and queue delay are drawn anew each tick (from `seed` and
    `tick`), and its invoker's router reports its function's arrivals (`FunctionReport`). An idle instance reports
    its request as its share and zero load, the same every tick. The identity fields (id, function, rev, state,
    class, GPU, request, limit, memory, slots) and the GPUs are the reports' own. Deterministic."""
    rng = random.Random(seed * 1_000_003 + tick)
    out: dict[str, LoadReport] = {}
    for name, report in reports.items():
        insts: list[InstanceReport] = []
        fns: list[FunctionReport] = []
        for i in report.instances:
            if zlib.crc32(f"{seed}:{i.id}".encode()) < busy * 2**32:
                arrivals = rng.uniform(0.1, 50.0)
                insts.append(replace(
                    i, share=rng.uniform(i.request, max(i.request, i.limit)), saturated=rng.random() < 0.1,
                    throttled_s=rng.uniform(0.0, 0.2), waiting=rng.randint(0, 2), in_flight=rng.randint(0, i.slots),
                    arrival_rate=arrivals, completion_rate=arrivals * rng.uniform(0.9, 1.1),
                    latency_ms=rng.uniform(5.0, 500.0), queue_delay_ms=rng.uniform(0.0, 100.0)))
                fns.append(FunctionReport(function=i.function, arrival_rate=arrivals * rng.uniform(0.5, 1.0)))
            else:
                insts.append(replace(i, share=i.request, saturated=False, throttled_s=0.0))
        out[name] = replace(report, at_ms=EPOCH_MS + 1000 * tick, user_memory_mb=64 * 1024,
                            memory_in_use_mb=256 * len(insts), instances=tuple(insts), functions=tuple(fns))
    return out
