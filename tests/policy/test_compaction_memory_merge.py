"""Compaction's memory merges (`CompactionConfig.memory_merges`, issue 19): where memory rather than
Σ request binds the lit GPUs, free memory that no live instance can use (less than the least memory,
or beside SM room below the least request) is merged into room one can, by moving one of the GPU's
instances to the lit GPU that takes it most tightly in free memory, when the free memory left there
is less than the memory merged. Whole one-GPU instances, and pieces within their node with
`move_pieces`; never pinned ones, never gangs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from split_testlib import A0, A1, A2, B0, C0, D0, GIB, INF, SPLIT, gpu, inst

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
from dilu_invoker.policy.live_compaction import LIVE_COMPACTION
from dilu_invoker.sim.generate import dilu_mix

# Nothing to empty (every GPU is fuller than a source may be): only the merges act.
MERGE = CompactionConfig(source_max_request=0.05, memory_merges=1)


def i(id: str, request: float, mem_gib: float) -> PlacedInstance:
    return inst(id, request, request, mem_gib, INF)


def piece(id: str, of: str, request: float, mem_gib: float) -> PlacedInstance:
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


# a/0 keeps 2 GiB free, less than the least memory (6 GiB): lost. p (6 GiB) fills b/0's 6 GiB
# exactly, and a/0 keeps 8 GiB. Σ memory 1.85 GPUs, Σ request 0.5: memory binds.
CRUMB = (
    gpu(A0, i("p", 0.10, 6), i("q", 0.10, 16), i("r", 0.10, 16)),
    gpu(B0, i("s", 0.10, 20), i("t", 0.10, 14)),
)

# One node: a/0 holds the stage p of L (6 GiB) beside q, 2 GiB free, less than the least memory
# (z's 4 GiB); a/1 holds p's sibling stage p2, 7 GiB free; a/2 6 GiB free. Σ memory 2.6 GPUs,
# Σ request 1.05.
PIECES_NODE = (
    gpu(A0, piece("p", "L", 0.05, 6), i("q", 0.30, 32)),
    gpu(A1, piece("p2", "L", 0.05, 13), i("y", 0.30, 20)),
    gpu(A2, i("x", 0.30, 30), i("z", 0.05, 4)),
)

CASES = [
    Case("lost-memory-merged", CRUMB, (("p", A0, B0),)),
    Case("off-by-default", CRUMB, (), config=replace(MERGE, memory_merges=0)),
    # `merges` merge SM room where Σ request binds; where memory binds they do nothing.
    Case("sm-merges-do-not-act", CRUMB, (), config=replace(MERGE, memory_merges=0, merges=4)),
    # Σ request binds (1.55 against Σ memory 0.5): a/0's 28 GiB beside SM room 0.15 (below the
    # least request, 0.25) is not merged by memory merges.
    Case(
        "request-binds",
        (gpu(A0, i("p", 0.30, 4), i("q", 0.30, 4), i("r", 0.25, 4)), gpu(B0, i("s", 0.40, 4), i("t", 0.30, 4))),
        (),
    ),
    # b/0 has 20 GiB: moving p there would leave 14 GiB for the 2 GiB it merges: no gain.
    Case(
        "no-gain-no-move",
        (gpu(A0, i("p", 0.10, 6), i("q", 0.10, 16), i("r", 0.10, 16)), gpu(B0, i("s", 0.10, 20))),
        (),
    ),
    # a/0 has 18 GiB free beside SM room 0.05, below the least request (0.10): lost. p fills b/0's
    # 10 GiB exactly; a/0 keeps 28 GiB beside 0.15 (x, 12 GiB, fits nowhere).
    Case(
        "memory-beside-no-sm-room",
        (gpu(A0, i("x", 0.85, 12), i("p", 0.10, 10)), gpu(B0, i("s", 0.10, 30))),
        (("p", A0, B0),),
    ),
    # The stage p (1.5 GiB) would fill a/2 exactly (a/1 holds its sibling), but a/0 would keep
    # 2.5 GiB, still less than the least memory (z's 3 GiB): nothing is merged. (A whole instance
    # always leaves usable room: it is no smaller than the least.)
    Case(
        "room-left-still-lost",
        (
            gpu(A0, piece("p", "L", 0.02, 1.5), i("q", 0.30, 37.5)),
            gpu(A1, piece("p2", "L", 0.02, 10), i("y", 0.30, 20)),
            gpu(A2, i("x", 0.30, 35.5), i("z", 0.10, 3)),
        ),
        (),
        config=replace(MERGE, move_pieces=True),
    ),
    # p may not move now, and q (16 GiB) fits nowhere: nothing is merged.
    Case("pinned-stay", CRUMB, (), pinned=frozenset({"p"})),
    # a/0 (2.5 GiB free, the least memory 3 GiB) is met first, but p would leave 1 GiB on b/0: a
    # gain of 1.5 GiB; c/0 (2 GiB) gains 2 GiB with u filling b/0 exactly: the larger gain.
    Case(
        "largest-gain-first",
        (
            gpu(A0, i("p", 0.10, 3), i("q", 0.10, 34.5)),
            gpu(B0, i("s", 0.10, 36)),
            gpu(C0, i("u", 0.10, 4), i("v", 0.10, 34)),
            gpu(D0, i("x", 0.10, 36)),
        ),
        (("u", C0, B0),),
    ),
    # Two moves: then p goes to d/0 (b/0 is full), a gain of 1.5 GiB still.
    Case(
        "two-merges",
        (
            gpu(A0, i("p", 0.10, 3), i("q", 0.10, 34.5)),
            gpu(B0, i("s", 0.10, 36)),
            gpu(C0, i("u", 0.10, 4), i("v", 0.10, 34)),
            gpu(D0, i("x", 0.10, 36)),
        ),
        (("u", C0, B0), ("p", A0, D0)),
        config=replace(MERGE, memory_merges=2),
    ),
    # The stage p merges within its node, onto a/2 (6 GiB, exactly), not a/1 (its sibling's).
    Case("pieces-merge-in-their-node", PIECES_NODE, (("p", A0, A2),), config=replace(MERGE, move_pieces=True)),
    # Without `move_pieces` the stage stays, and q (32 GiB) fits nowhere.
    Case("pieces-stay-unless-they-may-move", PIECES_NODE, ()),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_memory_merging_moves(case: Case) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=case.gpus)
    plan = compaction_plan(cluster, case.placement, case.config, pinned=case.pinned)
    assert tuple((m.instance_id, m.source, m.target) for m in plan.moves) == case.moves, plan.reason
    # Merging turns no GPU off and lights none; the instance is the same on its new GPU.
    assert plan.freed == ()
    assert plan.cluster.lit_count == cluster.lit_count
    assert plan.merged == len(case.moves)
    for m in plan.moves:
        assert plan.cluster.instance_gpus(m.instance_id) == (m.target,)
        assert plan.cluster.instance(m.instance_id) == cluster.instance(m.instance_id)
        assert m.reason.startswith(f"merge memory on {m.source}")
    if case.moves:
        assert plan.reason.endswith(f"{len(case.moves)} of them merging memory room")


def test_the_config_bounds_and_the_live_default() -> None:
    with pytest.raises(ValueError, match="memory_merges"):
        CompactionConfig(memory_merges=-1)
    assert CompactionConfig().memory_merges == 0
    assert LIVE_COMPACTION.memory_merges == 0


def _free_squares(cluster: ClusterSnapshot) -> float:
    return sum((g.free_memory / g.memory_mib) ** 2 for g in cluster.gpus if g.lit)


def test_memory_merging_along_a_trace_agrees_with_a_fresh_call_and_concentrates_free_memory() -> None:
    """Replay a trace with training (memory binds): at every compaction point the plan with the
    carried state makes the moves a call without it makes, and each memory merge makes Σ φ² (free
    memory, fractions of a GPU) over lit GPUs grow."""
    from test_compaction_state import _follow, _replay

    config = CompactionConfig(source_max_request=1.0, max_sources=10_000, max_moves=10_000,
                              move_pieces=True, merges=2, memory_merges=2)
    cluster = ClusterSnapshot.uniform(invokers=120, gpus_per_invoker=4, memory_mib=40 * GIB)
    state: CompactionState | None = None
    where: dict[str, tuple[str, ...]] = {}
    checked = merged = 0
    for n, ev in enumerate(dilu_mix(240, train_fraction=0.2, llm_fraction=0.4, seed=7)):
        cluster = _replay(cluster, where, ev)
        if n % 5 == 4:
            with_state = compaction_plan(cluster, SPLIT, config, state)
            fresh = compaction_plan(cluster, SPLIT, config)
            assert [(m.instance_id, m.target, m.replaces) for m in with_state.moves] == [
                (m.instance_id, m.target, m.replaces) for m in fresh.moves
            ], f"event {n}"
            merges = [m for m in with_state.moves if m.reason.startswith("merge memory")]
            if merges:
                assert with_state.state is not None and with_state.state.seen is not None
                step = with_state.state.seen
                for m in merges:
                    moved = step.instance(m.instance_id)
                    after = step.without_instance(m.instance_id).with_instance(moved, (m.target,))
                    assert _free_squares(after) > _free_squares(step) + 1e-9, f"event {n}"
                    step = after
                assert step.gpus == with_state.cluster.gpus
            checked += 1
            merged += len(merges)
            cluster, state = with_state.cluster, with_state.state
            _follow(where, with_state.moves)
    assert checked > 40 and merged > 5


def test_the_incremental_search_finds_what_a_fresh_one_does_along_a_trace() -> None:
    """`_merge_memory` keeps its search (`_MemoryIndex`: the lost GPUs, the targets of whole instances,
    each source's movers) from call to call and brings it up to date from the GPUs that changed. Along
    a trace with training and split LLMs, each plan equals the plan made with the index built afresh,
    and the index it leaves equals one built afresh for the cluster it last searched."""
    from test_compaction_state import _follow, _replay

    from dilu_invoker.policy import compaction

    config = CompactionConfig(source_max_request=1.0, max_sources=8, max_moves=64, move_pieces=True,
                              merges=1, merge_sources=256, merge_source_instances=1, memory_merges=2)
    cluster = ClusterSnapshot.uniform(invokers=120, gpus_per_invoker=4, memory_mib=40 * GIB)
    state: CompactionState | None = None
    where: dict[str, tuple[str, ...]] = {}
    merged = compared = weighed = 0
    for n, ev in enumerate(dilu_mix(300, train_fraction=0.2, llm_fraction=0.4, seed=11)):
        cluster = _replay(cluster, where, ev)
        if n % 3 != 2:
            continue
        plan = compaction_plan(cluster, SPLIT, config, state)
        if compaction._INDEX:
            kept = compaction._INDEX[0]
            searched = kept.gpus
            lost, pool = list(kept.lost), list(kept.pool)
            movers = dict(kept.movers)
            compaction._INDEX.clear()
            fresh = compaction_plan(cluster, SPLIT, config, state)
            assert [(m.instance_id, m.source, m.target) for m in fresh.moves] == [
                (m.instance_id, m.source, m.target) for m in plan.moves
            ], f"event {n}"
            # The index of the last search, afresh, for the cluster it searched.
            assert compaction._INDEX
            again = compaction._INDEX[0]
            if again.gpus == searched and again.key == kept.key:
                assert (again.lost, again.pool) == (lost, pool), f"event {n}"
                snapshot = ClusterSnapshot.build(now=0.0, gpus=list(searched))
                smallest, least_memory, _, omega, pieces, _ = kept.key
                for o, m in movers.items():
                    assert m == compaction._movers(snapshot, o, smallest, least_memory, omega, pieces), f"event {n}"
                    weighed += bool(m)
                compared += 1
        merged += sum(m.reason.startswith("merge memory") for m in plan.moves)
        cluster, state = plan.cluster, plan.state
        _follow(where, plan.moves)
    assert merged > 5 and compared > 20 and weighed > 20
