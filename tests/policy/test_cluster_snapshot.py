"""The cluster snapshot's incremental indexes must always equal a fresh build of the same GPUs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu_invoker.policy import (
    BUCKETS,
    ClusterSnapshot,
    GpuRef,
    GpuState,
    InstanceClass,
    PlacedInstance,
    PlacementConfig,
    PlacementRequest,
    apply_placement,
    place,
)
from dilu_invoker.policy.cluster import request_bucket

GIB = 1024.0


def inst(
    id: str,
    request: float = 0.2,
    limit: float = 0.4,
    *,
    function: str = "f",
    gpus: int = 1,
) -> PlacedInstance:
    return PlacedInstance(
        id=id,
        function=function,
        cls=InstanceClass.INFERENCE,
        request=request,
        limit=limit,
        memory_mib=4 * GIB,
        gpus=gpus,
    )


def index_view(c: ClusterSnapshot) -> dict[str, object]:
    return {
        "buckets": c.lit_buckets,
        "rooms": c.lit_room,
        "limits": c.lit_limits,
        "nodes": c.node_room,
        "unlit": dict(c.unlit),
        "unlit_nodes": c.unlit_nodes,
        "locations": dict(c.locations),
        "functions": {f: dict(v) for f, v in c.function_counts.items()},
        "widths": dict(c.width_counts),
        "requests": dict(c.request_counts),
        "memories": dict(c.memory_counts),
        "lit": c.lit_count,
        "sums": (
            round(c.sum_request, 9),
            round(c.sum_memory, 6),
            round(c.sum_memory_fraction, 9),
        ),
    }


def test_build_indexes_everything() -> None:
    gang = inst("g", 0.5, 0.8, function="train", gpus=2)
    c = ClusterSnapshot.build(
        now=5.0,
        gpus=[
            GpuState(ref=GpuRef("b", 1), memory_mib=40 * GIB, instances=(gang,)),
            GpuState(
                ref=GpuRef("a", 0), memory_mib=40 * GIB, instances=(inst("x", 0.25),)
            ),
            GpuState(ref=GpuRef("b", 0), memory_mib=40 * GIB, instances=(gang,)),
            GpuState(ref=GpuRef("a", 1), memory_mib=40 * GIB),
        ],
    )
    assert c.invokers == ("b", "a")
    assert c.refs == (GpuRef("b", 0), GpuRef("b", 1), GpuRef("a", 0), GpuRef("a", 1))
    assert c.lit_buckets[50] == (0, 1) and c.lit_buckets[25] == (2,)
    assert dict(c.unlit) == {"b": (), "a": (3,)}
    assert c.instance_gpus("g") == (GpuRef("b", 0), GpuRef("b", 1))
    assert c.function_count("train", "b") == 1 and c.function_count("train", "a") == 0
    totals = c.totals()
    assert totals.lit_gpus == 3 and totals.widest == 2
    assert totals.sm_request == pytest.approx(1.25)
    assert c.now == 5.0 and c.at(7.0).now == 7.0 and len(c) == 4


@pytest.mark.parametrize(
    ("gpus", "error"),
    [
        ([], "at least one GPU"),
        ([GpuState(ref=GpuRef("a", 0), memory_mib=1.0)] * 2, "duplicate GPU"),
        (
            [
                GpuState(
                    ref=GpuRef("a", 0), memory_mib=1.0, instances=(inst("x", 0.1),)
                ),
                GpuState(
                    ref=GpuRef("a", 1), memory_mib=1.0, instances=(inst("x", 0.2),)
                ),
            ],
            "described differently",
        ),
    ],
    ids=["empty", "duplicate-gpu", "inconsistent-instance"],
)
def test_build_rejects_bad_input(gpus: list[GpuState], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ClusterSnapshot.build(now=0.0, gpus=gpus)


def test_derivation_errors() -> None:
    c = ClusterSnapshot.uniform(invokers=1, gpus_per_invoker=2, memory_mib=GIB)
    c1 = c.with_instance(inst("x"), [GpuRef("invoker0", 0)])
    with pytest.raises(ValueError, match="already placed"):
        c1.with_instance(inst("x"), [GpuRef("invoker0", 1)])
    with pytest.raises(ValueError, match="distinct GPUs"):
        c.with_instance(
            inst("y", gpus=2), [GpuRef("invoker0", 0), GpuRef("invoker0", 0)]
        )
    with pytest.raises(ValueError, match="unknown GPU"):
        c.with_instance(inst("y"), [GpuRef("nope", 0)])
    with pytest.raises(KeyError):
        c.without_instance("nope")


def test_old_snapshots_never_change() -> None:
    c0 = ClusterSnapshot.uniform(invokers=2, gpus_per_invoker=2, memory_mib=40 * GIB)
    before = index_view(c0)
    c1 = c0.with_instance(inst("x"), [GpuRef("invoker1", 1)])
    c2 = c1.without_instance("x")
    assert index_view(c0) == before and index_view(c2) == before
    assert c1.lit_count == 1 and c0.lit_count == 0


def test_draining_a_gpu() -> None:
    c = ClusterSnapshot.uniform(invokers=1, gpus_per_invoker=2, memory_mib=40 * GIB)
    drained = c.with_schedulable(GpuRef("invoker0", 0), False)
    assert not drained.gpu(GpuRef("invoker0", 0)).schedulable
    r = PlacementRequest(
        instance_id="i",
        function="f",
        cls=InstanceClass.INFERENCE,
        request=0.1,
        limit=0.2,
        memory_mib=1,
    )
    assert place(drained, r, PlacementConfig()).gpus == (GpuRef("invoker0", 1),)


@pytest.mark.parametrize(
    ("used", "bucket"),
    [
        (0.0, 0),
        (0.3 + 0.3 + 0.4, BUCKETS),
        (0.7, 70),
        (0.699999999999, 70),
        (0.6949, 69),
        (1.3, BUCKETS),
    ],
    ids=[
        "empty",
        "float-sum-of-one",
        "exact",
        "just-under-by-float-noise",
        "below",
        "over-one",
    ],
)
def test_request_bucket(used: float, bucket: int) -> None:
    assert request_bucket(used) == bucket


ops = st.lists(
    st.tuples(
        st.booleans(),
        st.integers(min_value=0, max_value=11),
        st.sampled_from([1, 1, 1, 2]),
        st.floats(min_value=0.0, max_value=0.5),
        st.sampled_from(["f", "g", "h"]),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_incremental_index_equals_fresh_build(
    ops: list[tuple[bool, int, int, float, str]],
) -> None:
    c = ClusterSnapshot.uniform(invokers=3, gpus_per_invoker=4, memory_mib=40 * GIB)
    live: list[str] = []
    for n, (add, slot, width, request, function) in enumerate(ops):
        if add or not live:
            refs = [c.refs[(slot + k) % 4 + 4 * (slot // 4)] for k in range(width)]
            c = c.with_instance(
                inst(
                    f"i{n}",
                    request,
                    min(1.0, request + 0.1),
                    function=function,
                    gpus=width,
                ),
                refs,
            )
            live.append(f"i{n}")
        else:
            c = c.without_instance(live.pop(slot % len(live)))
        fresh = ClusterSnapshot.build(now=c.now, gpus=c.gpus)
        assert index_view(c) == index_view(fresh)
        dark = {inv: sum(not c.gpus[o].lit for o in ords) for inv, ords in c.invoker_ordinals.items()}
        assert c.unlit_nodes == tuple(
            tuple(c.invoker_ordinals[inv][0] for inv in c.invokers if dark[inv] > n) for n in range(4)
        )


@pytest.mark.parametrize("gamma", [1.5, math.inf], ids=["gamma-1.5", "no-limit-bound"])
def test_placements_through_the_policy_keep_the_index_consistent(gamma: float) -> None:
    c = ClusterSnapshot.uniform(invokers=4, gpus_per_invoker=2, memory_mib=40 * GIB)
    config = PlacementConfig(gamma=gamma)
    for i in range(20):
        r = PlacementRequest(
            instance_id=f"i{i}",
            function=f"f{i % 3}",
            cls=InstanceClass.TRAINING if i % 4 == 0 else InstanceClass.INFERENCE,
            request=0.1 + 0.05 * (i % 5),
            limit=0.5,
            memory_mib=(3 + i % 7) * GIB,
            gpus=2 if i % 7 == 0 else 1,
        )
        d = place(c, r, config)
        if d.placed:
            c = apply_placement(c, r, d)
        if i % 3 == 2:
            c = c.without_instance(next(iter(c.locations)))
    assert index_view(c) == index_view(ClusterSnapshot.build(now=0.0, gpus=c.gpus))
    for g in c.gpus:
        assert (
            g.used_request <= 1.0 + 1e-9
            and g.used_limit <= gamma + 1e-9
            and g.used_memory <= g.memory_mib
        )
