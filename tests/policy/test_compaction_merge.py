"""Compaction's merging moves (`CompactionConfig.merges`, issue 19): SM room that no live instance can
use (less than the least request) is merged into room one can, by moving one of the GPU's instances
to the lit GPU that takes it most tightly, when the room left there is smaller than the room merged.
Only while Σ request bounds the lit GPUs; whole one-GPU instances only, never pinned ones."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from split_testlib import A0, A1, B0, C0, D0, GIB, INF, SPLIT, gpu, inst

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    CompactionState,
    GpuRef,
    GpuState,
    PlacedInstance,
    PlacementConfig,
    compaction_plan,
)
from dilu_invoker.sim.generate import dilu_mix

A2 = GpuRef("a", 2)
MERGE = CompactionConfig(source_max_request=1.0, merges=1)


def i(id: str, request: float, mem_gib: float = 4.0, limit: float | None = None) -> PlacedInstance:
    return inst(id, request, request if limit is None else limit, mem_gib, INF)


def piece(id: str, of: str, request: float, mem_gib: float = 4.0) -> PlacedInstance:
    return replace(i(id, request, mem_gib), part_of=of)


@dataclass(frozen=True)
class Case:
    id: str
    gpus: tuple[GpuState, ...]
    moves: tuple[tuple[str, GpuRef, GpuRef], ...]
    """(instance, source, target) of each move, in order."""
    config: CompactionConfig = MERGE
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    pinned: frozenset[str] = frozenset()


# a/0: 0.85 requested, 0.15 of room that no instance (the least asks 0.25) can use; b/0 has 0.30.
LOST = (gpu(A0, i("p", 0.30), i("q", 0.30), i("r", 0.25)), gpu(B0, i("s", 0.40), i("t", 0.30)))

# One node: a/0 holds the stage p of L beside q and r, a/1 p's sibling stage p2, a/2 one instance.
PIECES_NODE = (
    gpu(A0, piece("p", "L", 0.30, 6), i("q", 0.32), i("r", 0.25)),
    gpu(A1, piece("p2", "L", 0.20, 20), i("y", 0.58)),
    gpu(A2, i("x", 0.70)),
)

CASES = [
    # p fills b/0 exactly: a/0's 0.15 becomes 0.45, b/0 keeps none (q gains as much: found later).
    Case("lost-room-merged", LOST, (("p", A0, B0),)),
    Case("off-by-default", LOST, (), config=replace(MERGE, merges=0)),
    # b/0 has 0.60: the best move would leave 0.30 there for the 0.15 it merges on a/0.
    Case(
        "no-gain-no-move",
        (gpu(A0, i("p", 0.30), i("q", 0.30), i("r", 0.25)), gpu(B0, i("s", 0.40))),
        (),
    ),
    # The same shapes with 13 GiB each: Σ memory (1.625 GPUs) exceeds Σ request (1.55): memory binds.
    Case(
        "memory-binds",
        (
            gpu(A0, i("p", 0.30, 13), i("q", 0.30, 13), i("r", 0.25, 13)),
            gpu(B0, i("s", 0.40, 13), i("t", 0.30, 13)),
        ),
        (),
    ),
    # p and q may not move now: r (0.25) leaves 0.05 on b/0 and merges 0.15, a gain of 0.10.
    Case("pinned-stay", LOST, (("r", A0, B0),), pinned=frozenset({"p", "q"})),
    # A pipeline stage (p) never merges: q does.
    Case(
        "pieces-stay",
        (
            gpu(A0, piece("p", "L", 0.30), i("q", 0.30), i("r", 0.25)),
            gpu(A1, piece("p2", "L", 0.65, 20)),
            gpu(B0, i("s", 0.40), i("t", 0.30)),
        ),
        (("q", A0, B0),),
    ),
    # a/0 has SM room 0.40, more than the least request (0.30), but 2 GiB of free memory, less than
    # the least memory (4 GiB): no instance fits it. p fills b/0 exactly and leaves 0.70 with 6 GiB.
    Case(
        "memory-short-room-merged",
        (gpu(A0, i("p", 0.30), i("q", 0.30, 34)), gpu(B0, i("s", 0.40), i("t", 0.30))),
        (("p", A0, B0),),
    ),
    # a/0: room 0.13 below the least request (0.25). The piece p (0.30) fills a/2 exactly, a gain of
    # 0.13 (r would leave 0.05 there, p2 0.10 on a/2 for the 0.22 it merges on a/1); a/1 holds p's
    # sibling stage and is avoided.
    Case(
        "pieces-merge-in-their-node",
        PIECES_NODE,
        (("p", A0, A2),),
        config=replace(MERGE, move_pieces=True),
    ),
    # The same without `move_pieces`: the piece stays, r merges a gain of 0.08.
    Case(
        "pieces-stay-unless-they-may-move",
        PIECES_NODE,
        (("r", A0, A2),),
    ),
    # Moving the piece p would fill a/1 exactly, but the 0.10 it leaves on a/0 is still less than
    # the least request (0.45): nothing is merged. q and r find no GPU with 0.45 of room.
    Case(
        "room-left-still-lost",
        (
            gpu(A0, piece("p", "L", 0.05, 2), i("q", 0.45), i("r", 0.45)),
            gpu(A1, piece("p2", "L", 0.05, 2), i("s", 0.45), i("t", 0.45)),
            gpu(A2, piece("p3", "M", 0.05, 2), i("u", 0.45), i("v", 0.45)),
        ),
        (),
        config=replace(MERGE, move_pieces=True),
    ),
    # a/0 (room 0.15) gains 0.10 at best (q leaves 0.05 on b/0); c/0 (room 0.12) gains 0.12 (u fills
    # b/0): the larger gain, though a/0 is met first.
    Case(
        "largest-gain-first",
        (
            gpu(A0, i("p", 0.35), i("q", 0.25), i("r", 0.25)),
            gpu(B0, i("s", 0.40), i("t", 0.30)),
            gpu(C0, i("u", 0.30), i("v", 0.30), i("w", 0.28)),
        ),
        (("u", C0, B0),),
    ),
    # Two moves: p fills b/0 (a gain of 0.15), then v fills d/0 (0.10; u would leave 0.10 in a/0's
    # new 0.45, no gain). b/0 and d/0 tie on room and free memory: the first in cluster order.
    Case(
        "two-merges",
        (
            gpu(A0, i("p", 0.30), i("q", 0.30), i("r", 0.25)),
            gpu(B0, i("s", 0.40), i("t", 0.30)),
            gpu(C0, i("u", 0.35), i("v", 0.30), i("w", 0.25)),
            gpu(D0, i("x", 0.40), i("y", 0.30)),
        ),
        (("p", A0, B0), ("v", C0, D0)),
        config=replace(MERGE, merges=2),
    ),
    # With a finite γ (sm-limit filter), b/0's Σ limit 1.40 refuses p's 0.30: d/0 (room 0.32,
    # Σ limit 0.68) takes it instead, leaving 0.02: a gain of 0.13.
    Case(
        "other-filters-hold",
        (
            gpu(A0, i("p", 0.30), i("q", 0.30), i("r", 0.25)),
            gpu(B0, i("s", 0.40, limit=0.80), i("t", 0.30, limit=0.60)),
            gpu(D0, i("x", 0.68)),
        ),
        (("p", A0, D0),),
        placement=PlacementConfig(gamma=1.5),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_merging_moves(case: Case) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=case.gpus)
    plan = compaction_plan(cluster, case.placement, case.config, pinned=case.pinned)
    assert tuple((m.instance_id, m.source, m.target) for m in plan.moves) == case.moves, plan.reason
    # Merging turns no GPU off and lights none; the instance is the same on its new GPU.
    assert plan.freed == ()
    assert plan.cluster.lit_count == cluster.lit_count
    for m in plan.moves:
        assert plan.cluster.instance_gpus(m.instance_id) == (m.target,)
        assert plan.cluster.instance(m.instance_id) == cluster.instance(m.instance_id)
        assert m.reason.startswith(f"merge room on {m.source}")
    if case.moves:
        assert plan.reason.endswith(f"{len(case.moves)} of them merging SM room")


GANG = replace(i("g", 0.2, 8.0), gpus=2)


@pytest.mark.parametrize(
    ("gpus", "smallest"),
    [
        ((gpu(A0),), None),
        ((gpu(A0, i("p", 0.30), i("q", 0.25)),), 0.25),
        # A piece's request is a share of its instance's: left out.
        ((gpu(A0, piece("p", "L", 0.05), i("q", 0.25)), gpu(A1, piece("p2", "L", 0.05))), 0.25),
        # A gang counts once, with its per-GPU request.
        ((gpu(A0, GANG), gpu(A1, GANG)), 0.2),
    ],
    ids=["empty", "least", "pieces-left-out", "gang"],
)
def test_smallest_request(gpus: tuple[GpuState, ...], smallest: float | None) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=gpus)
    assert cluster.smallest_request() == smallest
    assert sum(cluster.request_counts.values()) == len(
        {x.id for g in gpus for x in g.instances if x.part_of is None}
    )
    # Kept as instances come and go.
    grown = cluster.with_instance(i("tiny", 0.1), (A0,))
    assert grown.smallest_request() == 0.1
    assert grown.without_instance("tiny").smallest_request() == smallest


@pytest.mark.parametrize(
    ("gpus", "least"),
    [
        ((gpu(A0),), None),
        ((gpu(A0, i("p", 0.30, 6), i("q", 0.25, 9)),), 6 * GIB),
        # A piece's memory is a share of its instance's: left out.
        ((gpu(A0, piece("p", "L", 0.05, 2), i("q", 0.25, 9)), gpu(A1, piece("p2", "L", 0.05, 2))), 9 * GIB),
        # A gang counts once, with its per-GPU memory.
        ((gpu(A0, GANG), gpu(A1, GANG)), 8 * GIB),
    ],
    ids=["empty", "least", "pieces-left-out", "gang"],
)
def test_smallest_memory(gpus: tuple[GpuState, ...], least: float | None) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=gpus)
    assert cluster.smallest_memory() == least
    assert sum(cluster.memory_counts.values()) == len({x.id for g in gpus for x in g.instances if x.part_of is None})
    # Kept as instances come and go.
    grown = cluster.with_instance(i("tiny", 0.1, 1), (A0,))
    assert grown.smallest_memory() == 1 * GIB
    assert grown.without_instance("tiny").smallest_memory() == least


def _room_squares(cluster: ClusterSnapshot) -> float:
    return sum((1.0 - g.used_request) ** 2 for g in cluster.gpus if g.lit)


def test_merging_along_a_trace_agrees_with_a_fresh_call_and_concentrates_room() -> None:
    """Replay a training-free trace: at every compaction point the plan with the carried state makes the
    moves a call without it makes (merges included: the next call sees what they changed as changes
    since `seen`), and each merging move makes Σ room² over lit GPUs grow."""
    from test_compaction_state import _follow, _replay

    config = CompactionConfig(source_max_request=1.0, max_sources=10_000, max_moves=10_000,
                              move_pieces=True, merges=2)
    cluster = ClusterSnapshot.uniform(invokers=80, gpus_per_invoker=4, memory_mib=40 * GIB)
    state: CompactionState | None = None
    where: dict[str, tuple[str, ...]] = {}
    checked = merged = 0
    for n, ev in enumerate(dilu_mix(240, train_fraction=0.0, llm_fraction=0.2, seed=7)):
        cluster = _replay(cluster, where, ev)
        if n % 5 == 4:
            with_state = compaction_plan(cluster, SPLIT, config, state)
            fresh = compaction_plan(cluster, SPLIT, config)
            assert [(m.instance_id, m.target, m.replaces) for m in with_state.moves] == [
                (m.instance_id, m.target, m.replaces) for m in fresh.moves
            ], f"event {n}"
            merges = [m for m in with_state.moves if m.reason.startswith("merge room")]
            if merges:
                # Replay the merges alone on the cluster the emptying left (`state.seen`).
                assert with_state.state is not None and with_state.state.seen is not None
                step = with_state.state.seen
                for m in merges:
                    moved = step.instance(m.instance_id)
                    after = step.without_instance(m.instance_id).with_instance(moved, (m.target,))
                    assert _room_squares(after) > _room_squares(step) + 1e-9, f"event {n}"
                    step = after
                assert step.gpus == with_state.cluster.gpus
            checked += 1
            merged += len(merges)
            cluster, state = with_state.cluster, with_state.state
            _follow(where, with_state.moves)
    assert checked > 40 and merged > 5


# a/0's three instances fit b/0, c/0 and d/0: emptying frees it; while merging (Σ request binds),
# a GPU of three is left to the merges (`merge_source_instances`), and here no room is lost.
THREE = (
    gpu(A0, i("p", 0.20), i("q", 0.20), i("r", 0.20)),
    gpu(B0, i("s", 0.70)),
    gpu(C0, i("u", 0.70)),
    gpu(D0, i("x", 0.80)),
)


@pytest.mark.parametrize(
    ("config", "moved", "freed"),
    [
        (replace(MERGE, merges=0), {"p", "q", "r"}, (A0,)),
        (MERGE, set(), ()),
        (replace(MERGE, merge_source_instances=3), {"p", "q", "r"}, (A0,)),
    ],
    ids=["not-merging", "merging", "merging-any-source"],
)
def test_merging_leaves_fuller_sources_to_the_merges(
    config: CompactionConfig, moved: set[str], freed: tuple[GpuRef, ...]
) -> None:
    plan = compaction_plan(ClusterSnapshot.build(now=0.0, gpus=THREE), PlacementConfig(), config)
    assert {m.instance_id for m in plan.moves} == moved and plan.freed == freed, plan.reason


def test_a_state_made_under_other_limits_is_not_carried() -> None:
    """While merging, a call empties fewer sources; once memory binds it empties all again: the state
    of a merging call is dropped, and the call finds what a call without a state finds."""
    cluster = ClusterSnapshot.build(now=0.0, gpus=(*LOST, gpu(C0), gpu(D0)))
    first = compaction_plan(cluster, PlacementConfig(), MERGE)
    assert first.state is not None and first.state.config is not None
    assert first.state.config.source_max_instances == MERGE.merge_source_instances
    # Two memory-heavy instances: Σ memory (2.4 GPUs) now exceeds Σ request (1.65).
    heavy = first.cluster.with_instance(i("h1", 0.05, 38), (C0,)).with_instance(i("h2", 0.05, 38), (D0,))
    carried = compaction_plan(heavy, PlacementConfig(), MERGE, first.state)
    fresh = compaction_plan(heavy, PlacementConfig(), MERGE)
    assert carried.moves == fresh.moves and carried.state == fresh.state
    assert carried.state is not None and carried.state.config == MERGE
