"""Compaction's stage resizing (`CompactionConfig.rebalances`, issue 19): SM room no instance can use
(less than the least request) on GPUs holding pipeline stages of a split instance is filled by
growing those stages; one stage of the same instance shrinks by as much, so that its GPU's room
becomes room an instance can use. The instance's Σ request and Σ memory stay the same."""

from __future__ import annotations

from dataclasses import replace

import pytest
from split_testlib import A0, A1, GIB, INF, assert_stages_resized, gpu, inst

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    PlacedInstance,
    PlacementConfig,
    compaction_plan,
)

RESIZE = CompactionConfig(source_max_request=1.0, merges=1, rebalances=1)


def i(id: str, request: float, mem_gib: float = 4.0) -> PlacedInstance:
    return inst(id, request, request, mem_gib, INF)


def stage(id: str, request: float, mem_gib: float) -> PlacedInstance:
    return replace(i(id, request, mem_gib), part_of="L")


# The least request is 0.25. a/0: room 0.04; a/1: room 0.22, both lost. L's stages ask 20 GiB per
# unit of request. No single move helps (merging finds no GPU for q, r or y).
CRUMBS = (
    gpu(A0, stage("p", 0.30, 6.0), i("q", 0.25), i("r", 0.41)),
    gpu(A1, stage("p2", 0.20, 4.0), i("y", 0.58)),
)

CASES = [
    # p grows by a/0's 0.04 (0.8 GiB), p2 shrinks by as much: a/1's room 0.26 fits the least
    # request. (p2 cannot fill a/1: p would shrink to 0.10, a/0's room 0.14 still lost.)
    ("crumb-filled", CRUMBS, RESIZE, {"p": (0.34, 6.8), "p2": (0.16, 3.2)}),
    ("off-by-default", CRUMBS, replace(RESIZE, rebalances=0), {}),
    # 0.26 of room made usable by 2 resized stages: 0.13 each, less than asked.
    ("gain-too-small", CRUMBS, replace(RESIZE, rebalance_min_gain=0.2), {}),
    # y asks 0.62: a/1's room 0.18 + 0.04 = 0.22 stays below 0.25: nothing is resized.
    (
        "room-left-still-lost",
        (CRUMBS[0], gpu(A1, stage("p2", 0.20, 4.0), i("y", 0.62))),
        RESIZE,
        {},
    ),
    # A stage shrinks no lower than the least piece: with min_part_mib 3.6 GiB p2 gives 0.02 only
    # (a/1's room 0.24 stays lost) and p 0.12 (a/0's 0.16 stays lost).
    ("least-piece-held", CRUMBS, RESIZE, {}, PlacementConfig(min_part_mib=3.6 * GIB)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stage_resizing(case: tuple) -> None:
    _, gpus, config, sizes, *rest = case
    placement = rest[0] if rest else PlacementConfig()
    cluster = ClusterSnapshot.build(now=0.0, gpus=gpus)
    plan = compaction_plan(cluster, placement, config)
    assert_stages_resized(cluster, plan, sizes, ("p", "p2"))
    after = plan.cluster
    assert plan.cold_starts == len(sizes)
    if sizes:
        rooms = sorted(round(1.0 - g.used_request, 6) for g in after.gpus if g.instances)
        assert rooms == [0.0, 0.26]
        assert all(m.source == m.target and m.reason.startswith("resize stage") for m in plan.moves)


def test_live_compaction_refuses_resizing() -> None:
    from dilu_invoker.policy.live_compaction import LIVE_COMPACTION, LiveCompaction

    assert LIVE_COMPACTION.rebalances == 0
    with pytest.raises(ValueError, match="rebalances must be 0"):
        LiveCompaction(config=replace(LIVE_COMPACTION, merges=1, rebalances=1))


def test_config_bounds() -> None:
    for bad in ({"rebalances": -1}, {"rebalance_min_gain": -0.1}, {"rebalance_sources": 0}):
        with pytest.raises(ValueError):
            CompactionConfig(**bad)
