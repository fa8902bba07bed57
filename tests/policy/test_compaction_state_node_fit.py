"""Under node fit (`PlacementConfig.split_node_fit`) compaction's carried state keeps exactly what it learns:
a source whose instances failed part-way is tried again when room appears for *any* of them, when a GPU
stops taking one of them (the most constrained move first), when the resource that binds the cluster
changes (it decides how an LLM is split), and when a GPU of its node gains room after one of its split
instances was placed anew. Each case is a cluster where the former rules (kept by the fewest pieces, whose
recorded decisions they made) skip a source that a plan from scratch empties."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from split_testlib import GIB, INF, LLM, SPLIT, gpu, inst

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    GpuRef,
    PlacedInstance,
    compaction_plan,
)
from dilu_invoker.policy.compaction import Need, _review

NODE_FIT = replace(SPLIT, split_node_fit=True)
# Every lit GPU may be a source, no merging: only emptying decides the moves.
ANY = CompactionConfig(source_max_request=1.0, max_sources=100, move_pieces=True)
A0, B0, B1, C0, C1, C2, D0 = (
    GpuRef("a", 0), GpuRef("b", 0), GpuRef("b", 1), GpuRef("c", 0), GpuRef("c", 1), GpuRef("c", 2), GpuRef("d", 0),
)


def fill(id: str, request: float, mem_gib: float) -> PlacedInstance:
    """Training that no lit GPU here can take: it keeps its GPU lit and fails as a source."""
    return inst(id, request, request, mem_gib)


@dataclass(frozen=True)
class Case:
    """A cluster where source a/0 fails part-way; a change after which a fresh plan empties it."""

    gpus: tuple[tuple[GpuRef, tuple[PlacedInstance, ...]], ...]
    arrive: tuple[PlacedInstance, GpuRef] | None = None
    replace_with: tuple[str, PlacedInstance, GpuRef] | None = None


CASES = {
    # a/0: an LLM (22 GiB) and y (8 GiB, 0.34) that only b/1 takes, so y moves first and leaves node b
    # too little for the LLM's pieces. c/0 gains room for y (not for the LLM): y has two GPUs now, the
    # LLM moves first, split over b/0 and b/1, and y goes to c/0.
    "room for another instance of the source": Case(
        gpus=(
            (A0, (inst("L", 0.53, 0.8, 22.0, LLM), inst("y", 0.34, 0.5, 8.0, INF))),
            (B0, (fill("fb0", 0.7, 30.0),)),
            (B1, (fill("fb1", 0.5, 26.0),)),
            (C0, (fill("fc0", 0.6, 36.0),)),
        ),
        replace_with=("fc0", fill("fc0b", 0.6, 28.0), C0),
    ),
    # a/0: an LLM (20 GiB) and y (8 GiB, 0.3) that b/0 and b/1 take: the LLM moves first, split over
    # node b (the node left with the least free memory), and y finds no room. z arrives on b/0, which
    # then no longer takes y: y has one GPU, moves first to b/1, and the LLM goes to node c.
    "a GPU stops taking an instance of the source": Case(
        gpus=(
            (A0, (inst("L", 0.4, 0.6, 20.0, LLM), inst("y", 0.3, 0.4, 8.0, INF))),
            (B0, (fill("fb0", 0.4, 28.0),)),
            (B1, (fill("fb1", 0.4, 28.0),)),
            (C0, (fill("fc0", 0.75, 25.0),)),
            (C1, (fill("fc1", 0.75, 25.0),)),
        ),
        arrive=(inst("z", 0.35, 0.35, 2.0, INF), B0),
    ),
    # a/0: an LLM (20 GiB, 0.1) and y (16 GiB) that b/0 and b/1 take. Memory binds: node fit splits the
    # LLM over node b (12 GiB left against node c's 21), and y finds no room. w arrives on d/0, which
    # takes neither: Σ request binds now, the fewest pieces split the LLM over c/0 and c/1 (1 GiB unused
    # against node b's 12), and y goes to b/0.
    "the resource that binds the cluster changes": Case(
        gpus=(
            (A0, (inst("L", 0.1, 0.1, 20.0, LLM), inst("y", 0.05, 0.05, 16.0, INF))),
            (B0, (fill("fb0", 0.85, 24.0),)),
            (B1, (fill("fb1", 0.85, 24.0),)),
            (C0, (fill("fc0", 0.9, 25.0),)),
            (C1, (fill("fc1", 0.9, 34.0),)),
            (C2, (fill("fc2", 1.0, 20.0),)),
            (D0, (fill("fd0", 0.1, 39.0),)),
        ),
        arrive=(inst("w", 0.5, 0.5, 1.0, INF), D0),
    ),
}


def _changed(case: Case, cluster: ClusterSnapshot) -> ClusterSnapshot:
    if case.arrive is not None:
        instance, ref = case.arrive
        cluster = cluster.with_instance(instance, (ref,))
    if case.replace_with is not None:
        old, instance, ref = case.replace_with
        cluster = cluster.without_instance(old).with_instance(instance, (ref,))
    return cluster


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_source_that_failed_part_way_is_retried_when_it_may_succeed(case: Case) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=[gpu(ref, *instances) for ref, instances in case.gpus])
    first = compaction_plan(cluster, NODE_FIT, ANY)
    assert first.moves == () and first.state is not None, first.reason
    failed = first.state.failed[cluster.ordinals[A0]]
    assert failed.others, "a/0 failed part-way, not by a proof"
    after = _changed(case, cluster)
    fresh = compaction_plan(after, NODE_FIT, ANY)
    assert {m.instance_id for m in fresh.moves} == {"L", "y"} and A0 in fresh.freed, fresh.reason
    stateful = compaction_plan(after, NODE_FIT, ANY, first.state)
    assert [(m.instance_id, m.target, m.parts) for m in stateful.moves] == [
        (m.instance_id, m.target, m.parts) for m in fresh.moves
    ]
    # The fewest pieces keep the former rules: the same source is skipped there (where it fails
    # part-way alike; in the third case it splits over node c from the start).
    before = compaction_plan(cluster, SPLIT, ANY)
    if before.moves == ():
        assert before.state is not None and not before.state.failed[cluster.ordinals[A0]].others
        skipped = compaction_plan(after, SPLIT, ANY, before.state)
        assert all(m.source != A0 for m in skipped.moves), skipped.reason


def _need(id: str, mem_gib: float, request: float) -> Need:
    return Need(ids=frozenset((id,)), instance=id, memory_mib=mem_gib * GIB, request=request, limit=request,
                invoker=None, split_mib=None)


# a/0 is the source; b/0 gained 10 GiB free at 0.5 request room, c/0 (another node) the same.
ROOMY = ClusterSnapshot.build(now=0.0, gpus=[
    gpu(A0, inst("x", 0.2, 0.2, 30.0, INF)),
    gpu(GpuRef("a", 1), fill("fa1", 0.5, 30.0)),
    gpu(B0, fill("fb0", 0.5, 30.0)),
    gpu(C0, fill("fc0", 0.5, 30.0)),
])
STUCK = _need("x", 30.0, 0.2)  # no GPU takes 30 GiB


@dataclass(frozen=True)
class Review:
    need: Need
    gained: tuple[GpuRef, ...]
    retried: bool
    union: tuple[GpuRef, ...] | None = None


REVIEWS = {
    "the stuck instance alone, no room for it: kept": Review(STUCK, (B0, C0), False),
    "room for another instance: retried": Review(replace(STUCK, others=(_need("y", 8.0, 0.3),)), (C0,), True),
    "another instance too big for the room: kept": Review(
        replace(STUCK, others=(_need("y", 12.0, 0.3),)), (B0, C0), False
    ),
    "room on the node a split instance was placed anew from: retried": Review(
        replace(STUCK, opened="a"), (GpuRef("a", 1),), True
    ),
    "room on another node: kept": Review(replace(STUCK, opened="a"), (B0, C0), False),
    # A group of three (9 GiB each) that lacked room together on a/1 takes b/0 into its union (b/0 takes
    # one member) though the two still lack room for all three: b/0 is not seen as gaining it again.
    "a group's union takes the GPUs that take a member": Review(
        replace(_need("g1", 9.0, 0.3), deficit=(0.0, 0.0, 17.0 * GIB), members=((0.3, 0.3, 9.0 * GIB),) * 3,
                union=(ROOMY.ordinals[GpuRef("a", 1)],)),
        (B0,), False, union=(GpuRef("a", 1), B0),
    ),
}


@pytest.mark.parametrize("case", REVIEWS.values(), ids=REVIEWS.keys())
def test_review_retries_a_source_only_when_a_gained_gpu_may_help(case: Review) -> None:
    cluster = ROOMY
    gained = [(cluster.ordinals[r], cluster.gpu(r)) for r in case.gained]
    helpers, rest = _review(cluster, gained, case.need, NODE_FIT, cluster.ordinals[A0])
    assert (rest is None) == case.retried
    if case.retried:
        assert helpers
    if case.union is not None:
        assert rest is not None and rest.union == tuple(cluster.ordinals[r] for r in case.union)


def test_node_fit_is_what_turns_the_exact_state_on() -> None:
    # Under the fewest pieces a part-way failure records no other instances: the former rules.
    cluster = ClusterSnapshot.build(now=0.0, gpus=[gpu(r, *i) for r, i in CASES[
        "room for another instance of the source"].gpus])
    for placement, others in ((SPLIT, False), (NODE_FIT, True)):
        plan = compaction_plan(cluster, placement, ANY)
        assert plan.state is not None
        assert bool(plan.state.failed[cluster.ordinals[A0]].others) is others
