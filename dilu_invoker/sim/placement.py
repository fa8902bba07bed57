"""Placement simulation: replay create/delete events through the live placement policy.

Every decision is `dilu_invoker.policy.place` with the named strategy, every removal
`ClusterSnapshot.without_instance`, compaction is `compaction_plan`, fragmentation is
`cluster_fragmentation` and the bound is `lit_gpu_lower_bound`: the simulator only replays time.

The lower bound is computed from the *live instances of the trace* (what was asked for), never from
how a policy placed them: max(⌈Σ gpus·sm_request⌉, ⌈Σ gpus·memory / capacity⌉, widest live
instance). A split LLM therefore counts once, with its whole request and memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from dilu_invoker.policy import (
    EPS,
    STRATEGIES,
    ClusterSnapshot,
    CompactionConfig,
    CompactionState,
    GpuRef,
    GpuState,
    InstanceClass,
    PlacedInstance,
    PlacementConfig,
    PlacementPart,
    PlacementRequest,
    apply_placement,
    cluster_fragmentation,
    compaction_plan,
    integral_lit_gpu_lower_bound,
    lit_gpu_lower_bound,
    part_id,
    place,
    whole_mib_pieces,
)
from dilu_invoker.policy.live_compaction import LiveCompaction
from dilu_invoker.sim.events import CREATE, GIB, InstanceSpec, PlacementEvent

#: The policies `simulate placement` knows, in the order comparisons list them.
PLACEMENT_POLICIES: tuple[str, ...] = ("exclusive", "infless-l", "infless-r", "fastgs", "dilu")

#: The exact keys of `summary.json` (issue 7).
SUMMARY_KEYS: tuple[str, ...] = (
    "policy",
    "events",
    "instances",
    "rejected",
    "gpus_peak",
    "gpu_seconds",
    "sm_fragmentation_mean",
    "mem_fragmentation_mean",
)

#: Compaction as the simulator runs it by default: every lit GPU may be a source (the live default
#: looks only at GPUs with Σ request ≤ 0.5, 32 per run, to bound cold starts). A run tries at most
#: 8 sources, the ones it does not get to carry over to the next run (docs/benchmarks/sim-scale.md:
#: 64 cost 2–3× the CPU for the same packing), then makes at most one move that merges SM room no
#: instance can use, looking at up to 256 such GPUs; while it merges it empties only GPUs of one
#: instance (docs/benchmarks/sim-scale.md, twelfth and thirteenth rounds: what these cost and buy).
SIM_COMPACTION = CompactionConfig(
    source_max_request=1.0,
    max_sources=8,
    max_moves=64,
    move_pieces=True,
    merges=1,
    merge_sources=256,
    merge_source_instances=1,
)



TIMESERIES_COLUMNS: tuple[str, ...] = (
    "t",
    "live_instances",
    "lit_gpus",
    "lower_bound",
    "sm_fragmentation",
    "mem_fragmentation",
    "integral_bound",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementSimConfig:
    policy: str
    gpu_memory_gib: float = 80.0
    gpus: int | None = None
    """Cluster size; None: enough for the trace (Σ gpus of the live instances at their peak,
    plus room for gangs, rounded up to whole nodes)."""
    gpus_per_node: int = 4
    gamma: float = math.inf
    """dilu's Σ-limit bound γ per GPU; the default, none: admission by request (PlacementConfig.gamma)."""
    llm_split_parts: int = 4
    """dilu may split an LLM's memory over up to this many GPUs of one node (Dilu's artifact);
    1 turns splitting off. Baselines never split."""
    compact_every_s: float = 0.0
    """Run compaction at most this often (seconds of trace time); 0: never."""
    compaction: CompactionConfig = SIM_COMPACTION
    light_split_min_share: float | None = None
    """dilu splits an LLM that would light a GPU whole over lit GPUs of one node and one new GPU
    when the lit GPUs take at least this share of it (`PlacementConfig.light_split_min_share`);
    None: never (the default)."""
    compaction_splits: bool = True
    """Whether a compaction move may split the instance it moves (as placement would); the live balancer's
    moves split exactly when its compaction moves stages (`--balancer-compaction-stages`)."""
    whole_mib_stages: bool = False
    """Each pipeline stage of a split instance holds whole MiB, as the live balancer's GPU budgets count it
    (`planner.stages_of_parts`: each piece's memory rounded, the last taking what keeps the instance's sum);
    False: the exact share placement computed (the simulator's own `dilu`)."""
    split_node_fit: bool = False
    """Where memory binds, dilu splits an LLM over the lit GPUs of the node left with the least free memory
    once it is placed (`PlacementConfig.split_node_fit`); False: the node where it needs the fewest pieces
    (the default)."""

    def __post_init__(self) -> None:
        if self.policy not in STRATEGIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {sorted(STRATEGIES)}")
        if not (math.isfinite(self.gpu_memory_gib) and self.gpu_memory_gib > 0):
            raise ValueError(f"GPU memory must be > 0 GiB, got {self.gpu_memory_gib!r}")
        if self.gpus is not None and self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus per node must be >= 1, got {self.gpus_per_node}")
        if self.llm_split_parts < 1:
            raise ValueError(f"llm split parts must be >= 1, got {self.llm_split_parts}")
        if not (math.isfinite(self.compact_every_s) and self.compact_every_s >= 0):
            raise ValueError(f"compaction period must be >= 0, got {self.compact_every_s!r}")

    def placement_config(self) -> PlacementConfig:
        return PlacementConfig(
            strategy=self.policy,
            gamma=self.gamma,
            llm_max_parts=min(self.llm_split_parts, self.gpus_per_node),
            light_split_min_share=self.light_split_min_share,
            split_node_fit=self.split_node_fit,
        )


def live_placement_config(**changes: Any) -> PlacementSimConfig:
    """`dilu` as the live balancer runs it by default: LLMs are not split (`llm_split_parts` 1: the trace's LLM
    actions declare no ``gpu-stages``; N: they declare N, and the live balancer splits an LLM no lit GPU holds
    over up to N GPUs of a node, `--balancer-max-stages` at least N), and compaction is
    `policy.live_compaction.LIVE_COMPACTION` at `LiveCompaction`'s period (`--balancer-compaction-period-s`,
    30 s; at most `--balancer-compaction-max-moves` moves a run). A compaction move may split what it moves and
    move a pipeline stage exactly when its compaction's `move_pieces` is on (`--balancer-compaction-stages`,
    the default). Moves are instant here; the live planner also waits for a move in flight (a replacement's
    cold start, a stage's hand-over) before its next run. `changes`: other fields of `PlacementSimConfig`
    (cluster shape, a compaction variant to try live)."""
    live = LiveCompaction()
    compaction = changes.get("compaction", live.config)
    return PlacementSimConfig(**{"policy": "dilu", "llm_split_parts": 1, "compact_every_s": live.period_s,
                                 "compaction": live.config, "compaction_splits": compaction.move_pieces,
                                 "whole_mib_stages": True, **changes})


def whole_mib_parts(parts: tuple[PlacementPart, ...]) -> tuple[PlacementPart, ...]:
    """The pieces of a split placement holding whole MiB, as the live balancer's budgets hold its stages
    (`PlacementSimConfig.whole_mib_stages`, `planner.stages_of_parts`): each piece's memory rounded, in stage order,
    the last taking the rest of the instance's sum."""
    mibs = whole_mib_pieces([p.instance.memory_mib for p in parts], round(sum(p.instance.memory_mib for p in parts)))
    return tuple(p if p.instance.memory_mib == mib else replace(p, instance=replace(p.instance, memory_mib=float(mib)))
                 for p, mib in zip(parts, mibs, strict=True))


def whole_mib_stages(cluster: ClusterSnapshot, instances: Iterable[str]) -> ClusterSnapshot:
    """`cluster` with the pieces of the split `instances` holding whole MiB (`whole_mib_parts`), each piece where it
    is in its GPU's instances (one `ClusterSnapshot.with_states` for them all)."""
    changes: dict[int, GpuState] = {}
    for instance in instances:
        pieces: list[tuple[PlacedInstance, GpuRef]] = []
        while cluster.has_instance(pid := part_id(instance, len(pieces))):
            pieces.append((cluster.instance(pid), cluster.instance_gpus(pid)[0]))
        rounded = whole_mib_parts(tuple(PlacementPart(gpu=ref, instance=i) for i, ref in pieces))
        for (inst, ref), part in zip(pieces, rounded, strict=True):
            if part.instance is inst:
                continue
            o = cluster.ordinals[ref]
            g = changes.get(o) or cluster.gpus[o]
            changes[o] = replace(g, instances=tuple(part.instance if i.id == inst.id else i for i in g.instances))
    return cluster.with_states(cluster.now, changes) if changes else cluster


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    live_instances: int
    lit_gpus: int
    lower_bound: int
    sm_fragmentation: float
    mem_fragmentation: float
    integral_bound: int = 0

    def row(self) -> tuple[float | int, ...]:
        return (
            self.t,
            self.live_instances,
            self.lit_gpus,
            self.lower_bound,
            self.sm_fragmentation,
            self.mem_fragmentation,
            self.integral_bound,
        )


@dataclass(frozen=True, slots=True)
class PlacementResult:
    summary: dict[str, Any]
    """Exactly SUMMARY_KEYS."""
    details: dict[str, Any]
    """Everything else measured: the bound, ratios, means, compaction cost, splits, timing."""
    samples: tuple[Sample, ...]
    rejections: tuple[str, ...]
    """The reason of each refused create (first 100)."""


class _Bound:
    """Running sums over the live instances of the trace, for the lower bound in O(1)."""

    def __init__(self, capacity_mib: float) -> None:
        self.capacity = capacity_mib
        self.sm = 0.0
        self.mem = 0.0
        self.widths: dict[int, int] = {}
        self.live = 0
        self.large_memory = 0
        self.large_request = 0

    def add(self, s: InstanceSpec, sign: int) -> None:
        self.sm += sign * s.gpus * s.sm_request
        self.mem += sign * s.gpus * s.memory_mib
        if s.cls is InstanceClass.TRAINING:
            if s.memory_mib > self.capacity / 2 + EPS:
                self.large_memory += sign * s.gpus
            if s.sm_request > 0.5 + EPS:
                self.large_request += sign * s.gpus
        self.widths[s.gpus] = self.widths.get(s.gpus, 0) + sign
        if self.widths[s.gpus] == 0:
            del self.widths[s.gpus]
        self.live += sign
        if self.live == 0:
            self.sm = self.mem = 0.0

    def value(self) -> int:
        return lit_gpu_lower_bound(
            sm_request=self.sm,
            memory_mib=self.mem,
            memory_capacity_mib=self.capacity,
            widest=max(self.widths, default=0),
        )

    def integral(self) -> int:
        return integral_lit_gpu_lower_bound(
            sm_request=self.sm,
            memory_mib=self.mem,
            memory_capacity_mib=self.capacity,
            widest=max(self.widths, default=0),
            large_memory_slots=self.large_memory,
            large_request_slots=self.large_request,
        )


def cluster_size(events: Sequence[PlacementEvent], gpus_per_node: int) -> int:
    """GPUs enough for any policy: peak Σ gpus of live instances, plus a node per gang width, in nodes."""
    live: dict[str, int] = {}
    total = peak = 0
    for ev in events:
        if ev.op == CREATE and ev.spec is not None:
            if ev.instance not in live:
                live[ev.instance] = ev.spec.gpus
                total += ev.spec.gpus
        elif ev.instance in live:
            total -= live.pop(ev.instance)
        peak = max(peak, total)
    # Gangs need whole nodes' worth of free GPUs; leave slack for node fragmentation.
    want = math.ceil(peak * 1.25) + 2 * gpus_per_node
    return max(gpus_per_node, math.ceil(want / gpus_per_node) * gpus_per_node)


def _request(spec: InstanceSpec) -> PlacementRequest:
    return PlacementRequest(
        instance_id=spec.instance,
        function=spec.function,
        cls=spec.cls,
        request=spec.sm_request,
        limit=spec.sm_limit,
        memory_mib=spec.memory_mib,
        gpus=spec.gpus,
    )


ProgressFn = Callable[[int, int], None]


def simulate_placement(
    events: Sequence[PlacementEvent],
    config: PlacementSimConfig,
    *,
    progress: ProgressFn | None = None,
    log: list[tuple[Any, ...]] | None = None,
) -> PlacementResult:
    """Replay `events` (ordered by t) under `config.policy`; deterministic for equal inputs.

    `log`, when given, receives every decision carried out: ("place", t, instance, GPUs),
    ("reject", t, instance), ("compact", t) before a compaction run, ("move", t, instance, source,
    target)."""
    wall0 = time.perf_counter()
    pconf = config.placement_config()
    compaction_pconf = pconf if config.compaction_splits else replace(pconf, llm_max_parts=1)
    capacity = config.gpu_memory_gib * GIB
    n_gpus = config.gpus or cluster_size(events, config.gpus_per_node)
    nodes = math.ceil(n_gpus / config.gpus_per_node)
    cluster = ClusterSnapshot.uniform(
        invokers=[f"node{i:04d}" for i in range(nodes)],
        gpus_per_invoker=config.gpus_per_node,
        memory_mib=capacity,
    )
    bound = _Bound(capacity)
    specs: dict[str, InstanceSpec] = {}
    placed_ids: dict[str, tuple[str, ...]] = {}
    seen: set[str] = set()
    rejected = 0
    unknown_deletes = 0
    split_instances = 0
    compaction_moves = 0
    compaction_cold_starts = 0
    compaction_merges = 0
    compaction_runs = 0
    #: CPU seconds of each compaction run (`compaction_plan`), what a leader spends on it per period
    compaction_cpu: list[float] = []
    freed_by_compaction = 0
    rejections: list[str] = []

    samples: list[Sample] = []
    peak = peak_bound = 0
    lit_area = bound_area = integral_area = 0.0
    peak_integral = 0
    sm_area = mem_area = frag_time = 0.0
    t0 = events[0].t if events else 0.0
    last_t = t0
    next_compact = t0 + config.compact_every_s if config.compact_every_s else math.inf
    total = len(events)

    def sample(t: float) -> Sample:
        frag = cluster_fragmentation(cluster)
        return Sample(
            t=t,
            live_instances=bound.live,
            lit_gpus=cluster.lit_count,
            lower_bound=bound.value(),
            sm_fragmentation=frag.sm_mean,
            mem_fragmentation=frag.memory_mean,
            integral_bound=bound.integral(),
        )

    departed = False
    compaction_state: CompactionState | None = None
    current = sample(t0)
    for i, ev in enumerate(events):
        if ev.t > last_t:
            dt = ev.t - last_t
            lit_area += dt * current.lit_gpus
            bound_area += dt * current.lower_bound
            integral_area += dt * current.integral_bound
            if current.lit_gpus:
                sm_area += dt * current.sm_fragmentation
                mem_area += dt * current.mem_fragmentation
                frag_time += dt
            samples.append(current)
            last_t = ev.t
            # Only a departure opens a hole a lit GPU could be emptied into: without one since the
            # last run, a run would find what the last one found.
            if ev.t >= next_compact and departed:
                next_compact = ev.t + config.compact_every_s
                departed = False
                if log is not None:
                    log.append(("compact", ev.t))
                c0 = time.process_time()
                plan = compaction_plan(cluster.at(ev.t), compaction_pconf, config.compaction, compaction_state)
                compaction_cpu.append(time.process_time() - c0)
                compaction_state = plan.state
                compaction_runs += 1
                if plan.moves:
                    cluster = plan.cluster
                    if config.whole_mib_stages:
                        cluster = whole_mib_stages(cluster, [mv.instance_id for mv in plan.moves if mv.parts])
                    compaction_moves += len(plan.moves)
                    compaction_cold_starts += plan.cold_starts
                    compaction_merges += plan.merged
                    freed_by_compaction += len(plan.freed)
                    for mv in plan.moves:
                        if log is not None:
                            log.append(("move", ev.t, mv.instance_id, mv.source, mv.target))
                        if mv.parts:
                            placed_ids[mv.instance_id] = tuple(p.instance.id for p in mv.parts)
                            split_instances += not mv.replaces  # split once already
                        elif mv.replaces:
                            placed_ids[mv.instance_id] = (mv.instance_id,)
        if ev.op == CREATE:
            spec = ev.spec
            assert spec is not None
            if ev.instance in specs:
                raise ValueError(
                    f"event line {ev.line}: instance {ev.instance!r} is created while it is live"
                )
            seen.add(ev.instance)
            specs[ev.instance] = spec
            bound.add(spec, +1)
            req = _request(spec)
            decision = place(cluster.at(ev.t), req, pconf)
            if log is not None:
                log.append(("place", ev.t, ev.instance, decision.gpus) if decision.placed
                           else ("reject", ev.t, ev.instance))
            if decision.placed:
                if decision.split and config.whole_mib_stages:
                    decision = replace(decision, parts=whole_mib_parts(decision.parts))
                cluster = apply_placement(cluster, req, decision)
                if decision.split:
                    placed_ids[ev.instance] = tuple(p.instance.id for p in decision.parts)
                    split_instances += 1
                else:
                    placed_ids[ev.instance] = (ev.instance,)
            else:
                rejected += 1
                if len(rejections) < 100:
                    rejections.append(f"t={ev.t:g}: {decision.reason}")
        else:
            spec_gone = specs.pop(ev.instance, None)
            if spec_gone is None:
                unknown_deletes += 1
            else:
                departed = True
                bound.add(spec_gone, -1)
                for pid in placed_ids.pop(ev.instance, ()):
                    cluster = cluster.without_instance(pid)
        current = sample(ev.t)
        peak = max(peak, current.lit_gpus)
        peak_bound = max(peak_bound, current.lower_bound)
        peak_integral = max(peak_integral, current.integral_bound)
        if progress is not None and (i & 255) == 0:
            progress(i + 1, total)
    samples.append(current)
    if progress is not None:
        progress(total, total)

    span = last_t - t0
    gpu_seconds = lit_area
    mean_lit = lit_area / span if span > 0 else float(current.lit_gpus)
    mean_bound = bound_area / span if span > 0 else float(current.lower_bound)
    mean_integral = integral_area / span if span > 0 else float(current.integral_bound)
    summary: dict[str, Any] = {
        "policy": config.policy,
        "events": len(events),
        "instances": len(seen),
        "rejected": rejected,
        "gpus_peak": peak,
        "gpu_seconds": round(gpu_seconds, 3),
        "sm_fragmentation_mean": round(sm_area / frag_time, 6) if frag_time else 0.0,
        "mem_fragmentation_mean": round(mem_area / frag_time, 6) if frag_time else 0.0,
    }
    assert tuple(summary) == SUMMARY_KEYS
    details: dict[str, Any] = {
        "policy": config.policy,
        "cluster_gpus": len(cluster),
        "gpus_per_node": config.gpus_per_node,
        "gpu_memory_gib": config.gpu_memory_gib,
        "gamma": config.gamma if math.isfinite(config.gamma) else None,  # None: no Σ-limit bound (JSON has no inf)
        "span_s": span,
        "gpus_mean": round(mean_lit, 3),
        "lower_bound_peak": peak_bound,
        "lower_bound_mean": round(mean_bound, 3),
        "peak_vs_bound": round(peak / peak_bound, 4) if peak_bound else None,
        "mean_vs_bound": round(mean_lit / mean_bound, 4) if mean_bound else None,
        "integral_bound_peak": peak_integral,
        "integral_bound_mean": round(mean_integral, 3),
        "peak_vs_integral": round(peak / peak_integral, 4) if peak_integral else None,
        "mean_vs_integral": round(mean_lit / mean_integral, 4) if mean_integral else None,
        "llm_split_parts": pconf.llm_max_parts if pconf.strategy_spec().splits else 1,
        "split_instances": split_instances,
        "split_node_fit": pconf.split_node_fit,
        "compact_every_s": config.compact_every_s,
        # The compaction's settings (`CompactionConfig`), so that a run says what it simulated.
        "compaction": {f.name: getattr(config.compaction, f.name) for f in fields(config.compaction)},
        "compaction_splits": config.compaction_splits,
        "whole_mib_stages": config.whole_mib_stages,
        "compaction_runs": compaction_runs,
        "compaction_moves": compaction_moves,
        "compaction_cold_starts": compaction_cold_starts,
        "compaction_merges": compaction_merges,
        "gpus_freed_by_compaction": freed_by_compaction,
        # CPU of the compaction runs: in all, and per run (median, 99th percentile, slowest), in seconds
        "compaction_cpu_s": round(sum(compaction_cpu), 3),
        "compaction_run_cpu_s": _run_cpu(compaction_cpu),
        "unknown_deletes": unknown_deletes,
        "wall_s": round(time.perf_counter() - wall0, 3),
    }
    return PlacementResult(
        summary=summary, details=details, samples=tuple(samples), rejections=tuple(rejections)
    )


def _run_cpu(runs: list[float]) -> dict[str, float]:
    """Median, 99th percentile (nearest rank) and maximum of the compaction runs' CPU seconds (zeros without one)."""
    if not runs:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(runs)
    return {"p50": round(ordered[len(ordered) // 2], 6),
            "p99": round(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)], 6),
            "max": round(ordered[-1], 6)}


def split_part_ids(instance_id: str, parts: int) -> tuple[str, ...]:
    """Ids a split instance's pieces get (for callers that track pieces themselves)."""
    return tuple(part_id(instance_id, k) for k in range(parts))


def class_mix(events: Sequence[PlacementEvent]) -> dict[str, int]:
    """How many creates of each class a trace holds."""
    out = {c.value: 0 for c in InstanceClass}
    for ev in events:
        if ev.spec is not None:
            out[ev.spec.cls.value] += 1
    return out
