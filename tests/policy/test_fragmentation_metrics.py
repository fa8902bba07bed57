"""Dilu's fragmentation metrics, the lit-GPU lower bound, compaction, and water filling."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    GpuRef,
    GpuState,
    InstanceClass,
    PlacedInstance,
    PlacementConfig,
    cluster_fragmentation,
    cluster_lower_bound,
    compaction_plan,
    fragmentation_after,
    gpu_fragmentation,
    lit_gpu_lower_bound,
    water_fill,
)

GIB = 1024.0


def inst(
    id: str,
    request: float,
    mem_gib: float,
    *,
    gpus: int = 1,
    limit: float | None = None,
) -> PlacedInstance:
    return PlacedInstance(
        id=id,
        function=id,
        cls=InstanceClass.INFERENCE,
        request=request,
        limit=limit if limit is not None else min(1.0, request + 0.1),
        memory_mib=mem_gib * GIB,
        gpus=gpus,
    )


def gpu(inv: str, i: int, *instances: PlacedInstance) -> GpuState:
    return GpuState(ref=GpuRef(inv, i), memory_mib=40 * GIB, instances=instances)


def test_gpu_fragmentation() -> None:
    f = gpu_fragmentation(gpu("a", 0, inst("x", 0.3, 10), inst("y", 0.2, 10)))
    assert f is not None
    assert (f.sm, f.memory, f.score) == pytest.approx((0.5, 0.5, 0.5))
    assert gpu_fragmentation(gpu("a", 1)) is None
    assert fragmentation_after(
        used_request=1.0, used_memory=40, capacity=40
    ).score == pytest.approx(0.0)


def test_cluster_fragmentation_is_the_mean_over_lit_gpus() -> None:
    c = ClusterSnapshot.build(
        now=0,
        gpus=[
            gpu("a", 0, inst("x", 0.9, 30)),
            gpu("a", 1, inst("y", 0.3, 4)),
            gpu("a", 2),
            gpu("a", 3),
        ],
    )
    f = cluster_fragmentation(c)
    assert f.lit_gpus == 2
    assert f.sm_mean == pytest.approx((0.1 + 0.7) / 2)
    assert f.memory_mean == pytest.approx((0.25 + 0.9) / 2)
    assert f.score_mean == pytest.approx(0.6 * f.sm_mean + 0.4 * f.memory_mean)
    empty = cluster_fragmentation(
        ClusterSnapshot.uniform(invokers=1, gpus_per_invoker=1, memory_mib=GIB)
    )
    assert empty.lit_gpus == 0 and empty.sm_mean == 0.0


@pytest.mark.parametrize(
    ("sm", "mem_gib", "widest", "bound"),
    [
        (0.0, 0.0, 0, 0),
        (0.3 + 0.3 + 0.4, 5.0, 1, 1),
        (2.01, 5.0, 1, 3),
        (0.5, 81.0, 1, 3),
        (0.5, 5.0, 4, 4),
    ],
    ids=["nothing", "float-sum-stays-one", "sm-bound", "memory-bound", "widest-gang"],
)
def test_lit_gpu_lower_bound(
    sm: float, mem_gib: float, widest: int, bound: int
) -> None:
    assert (
        lit_gpu_lower_bound(
            sm_request=sm,
            memory_mib=mem_gib * GIB,
            memory_capacity_mib=40 * GIB,
            widest=widest,
        )
        == bound
    )


def test_cluster_lower_bound_counts_gangs_on_every_gpu() -> None:
    gang = inst("g", 0.6, 30, gpus=4)
    c = ClusterSnapshot.build(
        now=0,
        gpus=[gpu("a", i, gang) for i in range(4)] + [gpu("a", 4, inst("x", 0.5, 5))],
    )
    # Σ gpus·request = 4·0.6 + 0.5 = 2.9 → 3; Σ memory = 125 GiB / 40 → 4; widest 4.
    assert cluster_lower_bound(c) == 4
    with pytest.raises(ValueError):
        lit_gpu_lower_bound(sm_request=1, memory_mib=1, memory_capacity_mib=0, widest=1)


# -- compaction ----------------------------------------------------------------------------------


def test_compaction_empties_the_emptiest_gpu_onto_lit_ones() -> None:
    c = ClusterSnapshot.build(
        now=0,
        gpus=[
            gpu("a", 0, inst("x", 0.5, 10)),
            gpu("a", 1, inst("y", 0.2, 5)),
            gpu("b", 0),
            gpu("b", 1),
        ],
    )
    plan = compaction_plan(c, PlacementConfig())
    assert [(m.instance_id, m.source, m.target) for m in plan.moves] == [
        ("y", GpuRef("a", 1), GpuRef("a", 0))
    ]
    assert plan.freed == (GpuRef("a", 1),) and plan.cold_starts == 1
    assert plan.cluster.lit_count == 1 and c.lit_count == 2
    assert all(m.reason for m in plan.moves) and "turn off 1" in plan.reason


@pytest.mark.parametrize(
    ("gpus", "config", "freed"),
    [
        (
            [gpu("a", 0, inst("x", 0.7, 10)), gpu("a", 1, inst("y", 0.4, 5))],
            CompactionConfig(),
            (),
        ),
        (
            [
                gpu("a", 0, inst("g", 0.2, 10, gpus=2)),
                gpu("a", 1, inst("g", 0.2, 10, gpus=2)),
            ],
            CompactionConfig(),
            (),
        ),
        (
            # a1's two instances may not move, but a0's one can join them.
            [
                gpu("a", 0, inst("x", 0.5, 10)),
                gpu("a", 1, inst("y", 0.1, 1), inst("w", 0.1, 1)),
            ],
            CompactionConfig(source_max_instances=1),
            (GpuRef("a", 0),),
        ),
        (
            [gpu("a", 0, inst("x", 0.3, 10)), gpu("a", 1, inst("y", 0.45, 5))],
            CompactionConfig(source_max_request=0.2),
            (),
        ),
    ],
    ids=[
        "no-room-elsewhere",
        "gangs-never-move",
        "only-small-sources",
        "sources-too-full",
    ],
)
def test_compaction_choices(
    gpus: list[GpuState], config: CompactionConfig, freed: tuple[GpuRef, ...]
) -> None:
    c = ClusterSnapshot.build(now=0, gpus=gpus)
    plan = compaction_plan(c, PlacementConfig(), config)
    assert plan.freed == freed
    assert all(m.instance_id != "g" for m in plan.moves)
    if not freed:
        assert (
            plan.cluster is c and not plan.moves and "nothing to compact" in plan.reason
        )
    else:
        assert plan.cluster.lit_count == c.lit_count - len(freed)


def test_compaction_respects_the_move_budget() -> None:
    gpus = [gpu("a", 0, inst("big", 0.1, 1))] + [
        gpu("b", i, inst(f"s{i}", 0.05, 1)) for i in range(6)
    ]
    plan = compaction_plan(
        ClusterSnapshot.build(now=0, gpus=gpus),
        PlacementConfig(),
        CompactionConfig(max_moves=2),
    )
    assert len(plan.moves) == 2


def test_compaction_config_validation() -> None:
    with pytest.raises(ValueError):
        CompactionConfig(max_moves=0)
    with pytest.raises(ValueError):
        CompactionConfig(source_max_request=2.0)


# -- water filling -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "weights", "caps", "expected"),
    [
        (1.0, [1, 3], [1, 1], [0.25, 0.75]),
        (1.0, [1, 3], [1, 0.5], [0.5, 0.5]),
        (1.0, [0, 0], [1, 1], [0.5, 0.5]),
        (2.0, [1, 1], [0.3, 0.4], [0.3, 0.4]),
        (0.0, [1, 1], [1, 1], [0.0, 0.0]),
        (1.0, [], [], []),
        (1.0, [1, 1, 1], [0.0, 1, 1], [0.0, 0.5, 0.5]),
    ],
    ids=[
        "by-weight",
        "cap-spills-over",
        "zero-weights-equal",
        "caps-bind",
        "nothing",
        "no-items",
        "zero-cap",
    ],
)
def test_water_fill(
    total: float, weights: list[float], caps: list[float], expected: list[float]
) -> None:
    assert water_fill(total, weights, caps) == pytest.approx(expected)


@given(
    total=st.floats(min_value=0, max_value=3),
    items=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=5), st.floats(min_value=0, max_value=1)
        ),
        max_size=8,
    ),
)
def test_water_fill_invariants(total: float, items: list[tuple[float, float]]) -> None:
    weights = [w for w, _ in items]
    caps = [c for _, c in items]
    alloc = water_fill(total, weights, caps)
    assert all(-1e-12 <= a <= c + 1e-9 for a, c in zip(alloc, caps, strict=True))
    assert sum(alloc) == pytest.approx(
        min(total, sum(c for c in caps if c > 1e-9)), abs=1e-6
    )


def test_water_fill_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        water_fill(1.0, [1.0], [])
