"""Merges gated by the integral bound (`CompactionConfig.merge_above`, `memory_merge_above`, issue 19): a
merge turns no GPU off by itself, and no placement lights fewer GPUs than the integral lower bound of what
is placed (`ClusterSnapshot.integral_bound`), so a call merges only while the lit GPUs exceed that bound
by more than the configured share of it. The bound is kept by the snapshot and equals the simulator's
(`sim.placement._Bound`) for the live instances of a trace."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from split_testlib import A0, A1, B0, C0, GIB, INF, LLM, SPLIT, TRAIN, gpu, inst

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    GpuRef,
    GpuState,
    PlacedInstance,
    PlacementConfig,
    compaction_plan,
)
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import _Bound


def i(id: str, request: float, mem_gib: float, cls=INF, gpus: int = 1) -> PlacedInstance:
    return replace(inst(id, request, request, mem_gib, cls), gpus=gpus)


# -- the bound ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BoundCase:
    id: str
    gpus: tuple[GpuState, ...]
    bound: int


BOUNDS = [
    BoundCase("empty", (gpu(A0), gpu(B0)), 0),
    # ⌈1.55⌉ of request, memory 8 GiB: 2.
    BoundCase("request", (gpu(A0, i("p", 0.85, 4)), gpu(B0, i("s", 0.70, 4))), 2),
    # ⌈(38 + 34 + 6) / 40⌉ = 2 of memory, Σ request 0.6.
    BoundCase("memory", (gpu(A0, i("p", 0.2, 38)), gpu(B0, i("s", 0.2, 34)), gpu(C0, i("u", 0.2, 6))), 2),
    # Exactly 2.0 of memory, summed from floats: not 3.
    BoundCase("memory-exact", (gpu(A0, i("p", 0.1, 13.3)), gpu(B0, i("s", 0.1, 26.7)), gpu(C0, i("u", 0.1, 40))), 2),
    # A gang of 3 (4 GiB, 0.1 each): its width.
    BoundCase("widest", tuple(gpu(r, i("g", 0.1, 4, TRAIN, 3)) for r in (A0, A1, B0)), 3),
    # Three training slots over half a GPU's memory (21 GiB), Σ memory 1.9 GPUs: three GPUs.
    BoundCase(
        "large-memory-slots",
        (gpu(A0, i("t1", 0.1, 21), i("p", 0.1, 5)), gpu(B0, i("t2", 0.1, 21)), gpu(C0, i("t3", 0.1, 21))),
        2,
    ),
    BoundCase(
        "large-memory-slots-training",
        (gpu(A0, i("t1", 0.1, 21, TRAIN)), gpu(B0, i("t2", 0.1, 21, TRAIN)), gpu(C0, i("t3", 0.1, 21, TRAIN))),
        3,
    ),
    # SM request above 0.5 per slot, a gang of two and one more: three GPUs, Σ request 1.8.
    BoundCase(
        "large-request-slots",
        (gpu(A0, i("g", 0.6, 2, TRAIN, 2)), gpu(A1, i("g", 0.6, 2, TRAIN, 2)), gpu(B0, i("t", 0.6, 2, TRAIN))),
        3,
    ),
    # Exactly half a GPU (20 GiB) and 0.5 of request are not large: two such share a GPU.
    BoundCase(
        "half-is-not-large",
        (gpu(A0, i("t1", 0.5, 20, TRAIN)), gpu(B0, i("t2", 0.5, 20, TRAIN)), gpu(C0, i("t3", 0.5, 20, TRAIN))),
        2,
    ),
    # An LLM's pieces count with their sums, as the whole instance: 1.
    BoundCase(
        "pieces",
        (gpu(A0, replace(i("l.0", 0.2, 10, LLM), part_of="l")), gpu(A1, replace(i("l.1", 0.2, 10, LLM), part_of="l"))),
        1,
    ),
]


@pytest.mark.parametrize("case", BOUNDS, ids=[c.id for c in BOUNDS])
def test_the_integral_bound_of_a_snapshot(case: BoundCase) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=case.gpus)
    assert cluster.integral_bound() == case.bound
    # Derived snapshots keep the same sums as a built one.
    emptied = cluster
    for g in case.gpus:
        for x in g.instances:
            if emptied.has_instance(x.id):
                emptied = emptied.without_instance(x.id)
    assert emptied.integral_bound() == 0
    assert (emptied.large_memory_slots, emptied.large_request_slots) == (0, 0)


def test_the_snapshots_bound_is_the_simulators_along_a_trace() -> None:
    """Replay a trace with training gangs and split LLMs: after every event the snapshot's integral bound
    equals the simulator's, kept from the trace's specs."""
    from test_compaction_state import _replay

    cluster = ClusterSnapshot.uniform(invokers=120, gpus_per_invoker=4, memory_mib=40 * GIB)
    where: dict[str, tuple[str, ...]] = {}
    bound = _Bound(40 * GIB)
    specs = {}
    large = 0
    for ev in dilu_mix(300, train_fraction=0.3, llm_fraction=0.4, seed=3):
        cluster = _replay(cluster, where, ev)
        if ev.spec is not None:
            specs[ev.instance] = ev.spec
            bound.add(ev.spec, +1)
        else:
            bound.add(specs.pop(ev.instance), -1)
        assert cluster.integral_bound() == bound.integral()
        large = max(large, cluster.large_memory_slots)
    assert large > 0  # the trace exercises the gang slots


# -- the gates ------------------------------------------------------------------------------------

# Nothing to empty (every GPU is fuller than a source may be): only the merges act.
MEMORY = CompactionConfig(source_max_request=0.05, memory_merges=1)

# Memory binds. a/0 keeps 2 GiB free, less than the least memory (6 GiB): lost; p (6 GiB) fills b/0's
# 6 GiB exactly. Σ memory 72 GiB: the bound is 2, the lit GPUs.
CRUMB = (
    gpu(A0, i("p", 0.10, 6), i("q", 0.10, 16), i("r", 0.10, 16)),
    gpu(B0, i("s", 0.10, 20), i("t", 0.10, 14)),
)
# With c/0 (6 GiB, room an instance can use): 3 lit GPUs for a bound of 2 (Σ 1.95 GPUs of memory).
CRUMB_ABOVE = (*CRUMB, gpu(C0, i("u", 0.10, 6)))
# Memory binds (Σ 1.9 GPUs against Σ request 1.83), the fractional bound is 2, but three training slots
# ask SM request above 0.5: the integral bound is 3, the lit GPUs. a/0 keeps 2 GiB, less than the
# least memory (t3's 4 GiB): lost, and p would fill b/0 exactly.
SLOTS = (
    gpu(A0, i("t1", 0.6, 10, TRAIN), i("p", 0.01, 6), i("q", 0.01, 22)),
    gpu(B0, i("t2", 0.6, 10, TRAIN), i("s", 0.01, 24)),
    gpu(C0, i("t3", 0.6, 4, TRAIN)),
)

# Σ request binds. a/0: 0.15 of SM room no instance can use (the least asks 0.25); p fills b/0's 0.30.
# c/0 holds u (0.45, 34 GiB: room 0.55 beside 6 GiB, usable): no GPU can be emptied, and 3 lit GPUs
# for a bound of ⌈2.0⌉ = 2.
SM = CompactionConfig(source_max_request=1.0, merges=1)
LOST = (
    gpu(A0, i("p", 0.30, 4), i("q", 0.30, 4), i("r", 0.25, 4)),
    gpu(B0, i("s", 0.40, 4), i("t", 0.30, 4)),
    gpu(C0, i("u", 0.45, 34)),
)
# Without c/0 the lit GPUs are at the bound (2).
LOST_AT = LOST[:2]


@dataclass(frozen=True)
class GateCase:
    id: str
    gpus: tuple[GpuState, ...]
    config: CompactionConfig
    moves: tuple[tuple[str, GpuRef, GpuRef], ...]
    pinned: frozenset[str] = frozenset()
    placement: PlacementConfig = field(default_factory=PlacementConfig)


GATES = [
    # memory merges
    GateCase("memory-ungated-at-the-bound", CRUMB, MEMORY, (("p", A0, B0),)),
    GateCase("memory-at-the-bound", CRUMB, replace(MEMORY, memory_merge_above=0.0), ()),
    GateCase("memory-above-the-bound", CRUMB_ABOVE, replace(MEMORY, memory_merge_above=0.0), (("p", A0, B0),)),
    # 3 lit against 2 × 1.5: not more than half above the bound.
    GateCase("memory-within-the-share", CRUMB_ABOVE, replace(MEMORY, memory_merge_above=0.5), ()),
    GateCase("memory-beyond-the-share", CRUMB_ABOVE, replace(MEMORY, memory_merge_above=0.49), (("p", A0, B0),)),
    # The integral bound, not the fractional one (2): the slots keep all three GPUs lit.
    GateCase("memory-at-the-slots-bound", SLOTS, replace(MEMORY, memory_merge_above=0.0), ()),
    GateCase("memory-slots-ungated", SLOTS, MEMORY, (("p", A0, B0),)),
    # The SM gate does not hold memory merges back, nor the memory gate SM merges.
    GateCase("memory-not-held-by-the-sm-gate", CRUMB, replace(MEMORY, merge_above=0.0), (("p", A0, B0),)),
    # SM merges
    GateCase("sm-ungated-at-the-bound", LOST_AT, SM, (("p", A0, B0),)),
    GateCase("sm-at-the-bound", LOST_AT, replace(SM, merge_above=0.0), ()),
    GateCase("sm-above-the-bound", LOST, replace(SM, merge_above=0.0), (("p", A0, B0),)),
    GateCase("sm-within-the-share", LOST, replace(SM, merge_above=0.5), ()),
    GateCase("sm-beyond-the-share", LOST, replace(SM, merge_above=0.49), (("p", A0, B0),)),
    GateCase("sm-not-held-by-the-memory-gate", LOST_AT, replace(SM, memory_merge_above=0.0), (("p", A0, B0),)),
    # Resizing stages is held back with SM merging: a/0's stage would grow into its 0.1 of room.
    GateCase(
        "rebalance-at-the-bound",
        (
            gpu(A0, replace(i("l.0", 0.30, 8, LLM), part_of="l"), i("x", 0.60, 4)),
            gpu(A1, replace(i("l.1", 0.30, 8, LLM), part_of="l"), i("y", 0.40, 4)),
        ),
        replace(SM, merges=1, rebalances=1, merge_above=0.0),
        (),
        placement=SPLIT,
    ),
]


@pytest.mark.parametrize("case", GATES, ids=[c.id for c in GATES])
def test_merges_are_gated_by_the_integral_bound(case: GateCase) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=case.gpus)
    plan = compaction_plan(cluster, case.placement, case.config, pinned=case.pinned)
    assert tuple((m.instance_id, m.source, m.target) for m in plan.moves) == case.moves, plan.reason


def test_the_rebalance_case_resizes_without_the_gate() -> None:
    """The rebalance case above is held back by the gate alone."""
    case = next(c for c in GATES if c.id == "rebalance-at-the-bound")
    cluster = ClusterSnapshot.build(now=0.0, gpus=case.gpus)
    plan = compaction_plan(cluster, case.placement, replace(case.config, merge_above=None))
    assert plan.moves and all(m.source == m.target for m in plan.moves), plan.reason


def test_the_gates_bounds() -> None:
    for name in ("merge_above", "memory_merge_above"):
        with pytest.raises(ValueError, match=name):
            CompactionConfig(**{name: -0.01})
        with pytest.raises(ValueError, match=name):
            CompactionConfig(**{name: float("inf")})
        assert getattr(CompactionConfig(), name) is None
