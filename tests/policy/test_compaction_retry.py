"""When compaction tries a source again, and how one call's work is bounded (issue 19).

A failed source is remembered with every blocker its cheap proof found (an instance no lit GPU takes,
a group of instances whose few GPUs lack room together), each tied to the instances it is about: it
is tried again only once every blocker may be helped by room gained since, or when a blocker's
instances left. A group's GPUs that gained room without making up its deficit are remembered, so
room gained over several calls adds up. At every step a call without the state makes the same moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from split_testlib import A0, A1, B0, C0, INF, gpu, inst

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    CompactionState,
    GpuRef,
    PlacedInstance,
    PlacementConfig,
    compaction_plan,
)

ANY = CompactionConfig(source_max_request=1.0)
DILU = PlacementConfig()


def inf(id: str, request: float, mem_gib: float, limit: float | None = None) -> PlacedInstance:
    return inst(id, request, request if limit is None else limit, mem_gib, INF)


@dataclass(frozen=True)
class Step:
    """A change to the cluster, then what the next call must do."""

    name: str
    remove: tuple[str, ...] = ()
    add: tuple[tuple[PlacedInstance, GpuRef], ...] = ()
    moved: frozenset[str] = frozenset()
    blockers_on_a0: tuple[str, ...] | None = None
    """The instances the blockers remembered for a/0 are about, when it stays failed."""
    tried: int | None = None
    """How many sources the call tried, when it moves nothing."""


def replay(cluster: ClusterSnapshot, steps: list[Step], config: CompactionConfig = ANY) -> None:
    plan = compaction_plan(cluster, DILU, config)
    assert plan.moves == () and plan.state is not None
    state: CompactionState | None = plan.state
    for step in steps:
        for iid in step.remove:
            cluster = cluster.without_instance(iid)
        for instance, ref in step.add:
            cluster = cluster.with_instance(instance, (ref,))
        plan = compaction_plan(cluster, DILU, config, state)
        fresh = compaction_plan(cluster, DILU, config)
        assert frozenset(m.instance_id for m in plan.moves) == step.moved, (step.name, plan.reason)
        # Whatever the state skipped would have failed: a call without it moves the same.
        assert [(m.instance_id, m.target) for m in plan.moves] == [
            (m.instance_id, m.target) for m in fresh.moves
        ], step.name
        assert plan.state is not None
        if step.tried is not None:
            assert plan.reason.startswith(f"nothing to compact: tried {step.tried} "), (step.name, plan.reason)
        if step.blockers_on_a0 is not None:
            need = plan.state.failed[cluster.ordinals[A0]]
            assert tuple(sorted(i for b in need.blockers() for i in b.ids)) == step.blockers_on_a0, step.name
        cluster, state = plan.cluster, plan.state


# a/0 holds x (8 GiB) and w (2 GiB); a/1 has 4 GiB free, b/0 2 GiB: x fits nowhere, w fits both.
def one_blocker() -> ClusterSnapshot:
    return ClusterSnapshot.build(
        now=0.0,
        gpus=[
            gpu(A0, inf("x", 0.2, 8.0), inf("w", 0.1, 2.0)),
            gpu(A1, inf("f1", 0.5, 36.0)),
            gpu(B0, inf("f2", 0.5, 38.0)),
        ],
    )


# a/0 holds x (8 GiB, request 0.2) and y (2 GiB, request 0.6); a/1 and b/0 are at request 0.5 with
# 4 and 2 GiB free: x lacks memory everywhere, y lacks SM request everywhere (two blockers).
def two_blockers() -> ClusterSnapshot:
    return ClusterSnapshot.build(
        now=0.0,
        gpus=[
            gpu(A0, inf("x", 0.2, 8.0), inf("y", 0.6, 2.0)),
            gpu(A1, inf("f1", 0.5, 36.0)),
            gpu(B0, inf("f2", 0.5, 38.0)),
        ],
    )


# a/0 holds y and z (request 0.3 each); only a/1 (request room 0.5) takes either: together they
# lack 0.1 of SM request there (a group blocker). b/0 and c/0 are at request 0.8.
def group() -> ClusterSnapshot:
    return ClusterSnapshot.build(
        now=0.0,
        gpus=[
            gpu(A0, inf("y", 0.3, 4.0, 0.4), inf("z", 0.3, 4.0, 0.4)),
            gpu(A1, inf("a1", 0.5, 4.0)),
            gpu(B0, inf("b", 0.8, 4.0)),
            gpu(C0, inf("c", 0.8, 4.0)),
        ],
    )


CASES: dict[str, tuple[ClusterSnapshot, list[Step]]] = {
    "an instance the failure is not about leaves: still hopeless, not tried": (
        one_blocker(),
        [Step("w leaves", remove=("w",), blockers_on_a0=("x",), tried=0)],
    ),
    "the instance the failure is about leaves: tried again and emptied": (
        one_blocker(),
        [Step("x leaves", remove=("x",), moved=frozenset({"w"}))],
    ),
    "room for the blocker opens: tried again and emptied": (
        one_blocker(),
        # f1 gives way to f1b (28 GiB, request 0.75, which fits nowhere else): x goes to a/1, w to b/0.
        [Step("a/1 gains", remove=("f1",), add=((inf("f1b", 0.75, 28.0), A1),), moved=frozenset({"x", "w"}))],
    ),
    "two blockers: room for one is remembered, the source waits for the other": (
        two_blockers(),
        [
            # b/0's instance asks less SM (0.2): y fits there; x still lacks memory everywhere.
            # Only b/0 (changed, its old failure gone with f2) is tried.
            Step(
                "room for y",
                remove=("f2",),
                add=((inf("f2b", 0.2, 38.0), B0),),
                blockers_on_a0=("x",),
                tried=1,
            ),
            # a/1 gains memory (12 GiB free): x fits there; y's room was remembered.
            Step("room for x", remove=("f1",), add=((inf("f1b", 0.5, 28.0), A1),), moved=frozenset({"x", "y"})),
        ],
    ),
    "a group's deficit made up over two calls: the GPUs that gained room add up": (
        group(),
        [
            # a/1 takes another instance (request room 0.2 left) and b/0 gains request room 0.3:
            # 0.2 + 0.3 < 0.6 for y and z; b/0 is remembered.
            Step(
                "b/0 gains, a/1 fills",
                remove=("b",),
                add=((inf("d", 0.3, 4.0), A1), (inf("b2", 0.7, 4.0), B0)),
                blockers_on_a0=("y", "z"),
                tried=1,  # b/0 (its own instance changed); a/0 is not tried
            ),
            # c/0 gains request room 0.3 too: b/0 and c/0 take one each.
            Step("c/0 gains", remove=("c",), add=((inf("c2", 0.7, 4.0), C0),), moved=frozenset({"y", "z"})),
        ],
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_failed_source_is_tried_again_when_every_blocker_may_be_helped(
    case: tuple[ClusterSnapshot, list[Step]],
) -> None:
    replay(*case)


def test_a_group_that_lacks_room_together_is_ruled_out_without_placing() -> None:
    plan = compaction_plan(group(), DILU, ANY)
    assert plan.moves == () and plan.state is not None
    need = plan.state.failed[group().ordinals[A0]]
    assert need.deficit is not None and need.ids == frozenset({"y", "z"})
    assert need.deficit[0] == pytest.approx(0.1)


def test_the_most_constrained_instance_moves_first() -> None:
    # a (0.4, 8 GiB) fits a/1 and b/0; b (0.3, 12 GiB) only a/1 (b/0 has 10 GiB free); a/1 takes
    # one of them. Biggest first would give a/1 to a (the fuller GPU scores best) and leave b
    # nowhere.
    cluster = ClusterSnapshot.build(
        now=0.0,
        gpus=[
            gpu(A0, inf("a", 0.4, 8.0), inf("b", 0.3, 12.0)),
            gpu(A1, inf("f1", 0.6, 28.0)),
            gpu(B0, inf("f2", 0.4, 30.0)),
        ],
    )
    plan = compaction_plan(cluster, DILU, ANY)
    assert {(m.instance_id, m.target) for m in plan.moves} == {("b", A1), ("a", B0)}
    assert A0 in plan.freed


def test_a_call_stops_placing_after_max_trials_and_the_next_resumes() -> None:
    # a/0 and b/0 each hold one small instance that a/1 or b/1 takes; a/1's and b/1's own do not
    # fit anywhere (ruled out by the proof, no placement).
    cluster = ClusterSnapshot.build(
        now=0.0,
        gpus=[
            gpu(A0, inf("p", 0.1, 4.0)),
            gpu(A1, inf("t1", 0.5, 30.0)),
            gpu(B0, inf("q", 0.1, 4.0)),
            gpu(GpuRef("b", 1), inf("t2", 0.5, 30.0)),
        ],
    )
    unbounded = compaction_plan(cluster, DILU, ANY)
    assert {m.instance_id for m in unbounded.moves} == {"p", "q"}
    one = CompactionConfig(source_max_request=1.0, max_trials=1)
    first = compaction_plan(cluster, DILU, one)
    assert [m.instance_id for m in first.moves] == ["p"]
    assert first.state is not None and cluster.ordinals[B0] in first.state.pending
    second = compaction_plan(first.cluster, DILU, one, first.state)
    assert [m.instance_id for m in second.moves] == ["q"]
    assert {m.target for m in first.moves + second.moves} == {m.target for m in unbounded.moves}


def test_max_trials_is_checked() -> None:
    with pytest.raises(ValueError, match="max_trials"):
        CompactionConfig(max_trials=0)
