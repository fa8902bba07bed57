"""Compaction's stage resizing for memory (`CompactionConfig.memory_rebalances`, issue 19): where memory
rather than Σ request binds the lit GPUs, free memory no instance can use (less than the least memory,
or beside SM room below the least request) on GPUs holding pipeline stages of a split instance is
filled by growing those stages; one stage of the same instance shrinks by as much, so that its GPU's
free memory becomes room an instance can use. The instance's Σ request and Σ memory stay the same."""

from __future__ import annotations

from dataclasses import replace

import pytest
from split_testlib import A0, A1, A2, B0, C0, D0, GIB, INF, SPLIT, assert_stages_resized, gpu, inst

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    CompactionState,
    PlacedInstance,
    PlacementConfig,
    compaction_plan,
)
from dilu_invoker.sim.generate import dilu_mix

# Nothing to empty (every GPU is fuller than a source may be): only the resizes act.
RESIZE = CompactionConfig(source_max_request=0.05, memory_rebalances=1)


def i(id: str, request: float, mem_gib: float) -> PlacedInstance:
    return inst(id, request, request, mem_gib, INF)


def stage(id: str, request: float, mem_gib: float) -> PlacedInstance:
    return replace(i(id, request, mem_gib), part_of="L")


# L's stages ask 50 GiB per unit of request. The least memory is 5 GiB (z): a/0 keeps 4 GiB free,
# lost; a/1 8 GiB, a/2 5 GiB, usable. Σ memory 2.7 GPUs, Σ request 1.48: memory binds. Growing s0 by
# 4 GiB (0.08 of request) and shrinking s1 by as much fills a/0 and leaves a/1 12 GiB: a gain of 0.1
# of a GPU for two resized stages.
CRUMB = (
    gpu(A0, stage("s0", 0.24, 12), i("q", 0.30, 24)),
    gpu(A1, stage("s1", 0.24, 12), i("y", 0.30, 20)),
    gpu(A2, i("x", 0.30, 30), i("z", 0.10, 5)),
)
RESIZED = {"s0": (0.32, 16.0), "s1": (0.16, 8.0)}
# Three GPUs of Σ request 0.95 (6 GiB each) make Σ request (4.33) bind over Σ memory (3.1).
BUSY = tuple(gpu(r, i(f"w{k}", 0.95, 6)) for k, r in enumerate((B0, C0, D0)))

CASES = [
    ("lost-memory-filled", CRUMB, RESIZE, RESIZED),
    ("off-by-default", CRUMB, replace(RESIZE, memory_rebalances=0), {}),
    # With memory merges as well: no instance can move (q, y, x fit nowhere; s0, s1 may not move),
    # and the resize is made after them.
    ("after-memory-merges", CRUMB, replace(RESIZE, memory_merges=1), RESIZED),
    # Σ request binds: memory is not what keeps GPUs lit, no resize.
    ("request-binds", CRUMB + BUSY, RESIZE, {}),
    # The gain, 0.1 of a GPU, is below 0.06 per resized stage (two).
    ("least-gain", CRUMB, replace(RESIZE, rebalance_min_gain=0.06), {}),
    # A stage of L is pinned: L stays as it is.
    ("pinned-stay", CRUMB, RESIZE, {}, frozenset({"s1"})),
    # a/1 is full: s1 has nowhere to grow and shrinking it would leave a/1 4 GiB, less than the
    # least memory; shrinking s0 instead fills nothing (a/1 has no free memory, lost or not).
    (
        "room-left-must-be-usable",
        (
            gpu(A0, stage("s0", 0.24, 12), i("q", 0.30, 24)),
            gpu(A1, stage("s1", 0.24, 12), i("y", 0.30, 28)),
            gpu(A2, i("x", 0.30, 30), i("z", 0.10, 5)),
        ),
        RESIZE,
        {},
    ),
    # The shrinking stage keeps at least `min_part_mib` (10 GiB here): s1 gives up 2 GiB only,
    # a gain of 0.05 of a GPU, at least 0.02 per stage.
    (
        "min-part-kept",
        CRUMB,
        replace(RESIZE, rebalance_min_gain=0.02),
        {"s0": (0.28, 14.0), "s1": (0.20, 10.0)},
        frozenset(),
        PlacementConfig(min_part_mib=10 * GIB),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_memory_stage_resizing(case: tuple) -> None:
    _, gpus, config, sizes, *rest = case
    pinned = rest[0] if rest else frozenset()
    placement = rest[1] if len(rest) > 1 else PlacementConfig()
    cluster = ClusterSnapshot.build(now=0.0, gpus=gpus)
    plan = compaction_plan(cluster, placement, config, pinned=pinned)
    assert_stages_resized(cluster, plan, sizes, ("s0", "s1"))
    assert plan.cold_starts == len(sizes) == plan.merged
    assert all(m.source == m.target and m.reason.startswith("resize stage") and "for memory" in m.reason
               for m in plan.moves)


def test_live_compaction_refuses_memory_resizing() -> None:
    from dilu_invoker.policy.live_compaction import LIVE_COMPACTION, LiveCompaction

    assert LIVE_COMPACTION.memory_rebalances == 0
    with pytest.raises(ValueError, match="memory_rebalances must be 0"):
        LiveCompaction(config=replace(LIVE_COMPACTION, memory_rebalances=1))


def test_config_bounds_and_default() -> None:
    with pytest.raises(ValueError, match="memory_rebalances"):
        CompactionConfig(memory_rebalances=-1)
    assert CompactionConfig().memory_rebalances == 0


def test_memory_resizing_along_a_trace_holds_each_instance() -> None:
    """Replay a trace with training (memory binds): at every compaction point a resize keeps each
    split instance's Σ request and Σ memory, keeps its stages on their GPUs, at least
    `min_part_mib` each."""
    from test_compaction_state import _follow, _replay

    config = CompactionConfig(source_max_request=1.0, max_sources=10_000, max_moves=10_000,
                              move_pieces=True, memory_merges=1, memory_rebalances=2, rebalance_min_gain=0.0)
    cluster = ClusterSnapshot.uniform(invokers=120, gpus_per_invoker=4, memory_mib=40 * GIB)
    state: CompactionState | None = None
    where: dict[str, tuple[str, ...]] = {}
    resized = 0
    for n, ev in enumerate(dilu_mix(240, train_fraction=0.2, llm_fraction=0.4, seed=7)):
        cluster = _replay(cluster, where, ev)
        if n % 5 != 4:
            continue
        plan = compaction_plan(cluster, SPLIT, config, state)
        ours = [m for m in plan.moves if "for memory" in m.reason]
        if ours:
            before = plan.state.seen if plan.state is not None else None
            assert before is not None
            for m in ours:
                q = plan.cluster.instance(m.instance_id)
                assert plan.cluster.instance_gpus(m.instance_id) == (m.target,) == (m.source,)
                assert q.memory_mib >= SPLIT.min_part_mib - 1e-6
            for whole in {plan.cluster.instance(m.instance_id).part_of for m in ours}:
                now = [p for g in plan.cluster.gpus for p in g.instances if p.part_of == whole]
                then = [p for g in before.gpus for p in g.instances if p.part_of == whole]
                assert sum(p.request for p in now) == pytest.approx(sum(p.request for p in then))
                assert sum(p.memory_mib for p in now) == pytest.approx(sum(p.memory_mib for p in then))
            resized += len(ours)
        cluster, state = plan.cluster, plan.state
        _follow(where, plan.moves)
    assert resized > 0
