"""Table-driven tests of node-level best fit for split placement (`PlacementConfig.split_node_fit`): where
memory binds the cluster, an LLM that no lit GPU takes whole is split over the lit GPUs of the node left
with the least free memory, not over the node where it needs the fewest pieces; where Σ request binds, as
without it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from split_testlib import GIB, INF, LLM, SPLIT, TRAIN, inst

from dilu_invoker.policy import (
    ClusterSnapshot,
    GpuRef,
    GpuState,
    PlacedInstance,
    PlacementConfig,
    PlacementRequest,
    apply_placement,
    place,
)
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import PlacementSimConfig, cluster_size

NODE_FIT = replace(SPLIT, split_node_fit=True)


def gpu(invoker: str, index: int, *instances: PlacedInstance) -> GpuState:
    return GpuState(ref=GpuRef(invoker, index), memory_mib=40 * GIB, instances=instances)


def llm(mem_gib: float, request: float = 0.5, limit: float = 0.7, **kw: object) -> PlacementRequest:
    return PlacementRequest(
        instance_id="llm", function="llm", cls=LLM, request=request, limit=limit, memory_mib=mem_gib * GIB,
        **kw,  # type: ignore[arg-type]
    )


def snapshot(*gpus: GpuState) -> ClusterSnapshot:
    return ClusterSnapshot.build(now=0.0, gpus=gpus)


def gang(invoker: str, width: int, mem_gib: float, request: float = 0.4, start: int = 0) -> list[GpuState]:
    """`width` GPUs of `invoker` from `start`, each holding a slot of one training gang."""
    return [gpu(invoker, start + i, inst(f"{invoker}-t{start}", request, request + 0.2, mem_gib, TRAIN))
            for i in range(width)]


A = [GpuRef("a", i) for i in range(4)]
B = [GpuRef("b", i) for i in range(4)]

# Memory binds. Node a: a 4-gang of 35 GiB slots, 5 GiB free on each (20 in all); node b: a 2-gang of 25
# GiB slots and a 2-gang of 30 GiB slots, 15 + 15 + 10 + 10 GiB free. A 20 GiB LLM fits no lit GPU
# whole; on b it needs two pieces, on a four, and only a leaves no room.
CRUMBS = snapshot(*gang("a", 4, 35), *gang("b", 2, 25), *gang("b", 2, 30, start=2))

# Σ request binds (little memory placed). Node a: three GPUs at Σ request 0.8, 105 GiB free; node b: two
# at 0.5, 70 GiB free. A 0.6-request, 30 GiB LLM fits no lit GPU whole; b holds it in two pieces, a in
# three; node fit by memory would take b too, but the fewest pieces decide here.
SM_BINDS = snapshot(
    *(gpu("a", i, inst(f"ia{i}", 0.8, 0.9, 5, INF)) for i in range(3)),
    *(gpu("b", i, inst(f"ib{i}", 0.5, 0.7, 5, INF)) for i in range(2)),
)


@dataclass(frozen=True)
class NodeFitCase:
    cluster: ClusterSnapshot
    request: PlacementRequest
    config: PlacementConfig
    parts: tuple[tuple[GpuRef, float], ...]
    """Expected (GPU, GiB) of each piece; empty: placed whole."""
    by_memory: bool = True
    """Whether memory binds the cluster (node fit applies)."""


CASES = {
    "off-by-default-fewest-pieces": NodeFitCase(CRUMBS, llm(20), SPLIT, ((B[0], 15.0), (B[1], 5.0))),
    "memory-binds-the-node-left-with-least-room": NodeFitCase(
        CRUMBS, llm(20), NODE_FIT, tuple((g, 5.0) for g in A)
    ),
    # 22 GiB: a's 20 GiB cannot hold it, b is the only node.
    "a-node-too-small-is-passed-over": NodeFitCase(CRUMBS, llm(22), NODE_FIT, ((B[0], 15.0), (B[1], 7.0))),
    # Two pieces at most: a cannot hold 20 GiB in two of its 5 GiB crumbs.
    "max-parts-bounds-the-pieces": NodeFitCase(
        CRUMBS, llm(20), replace(NODE_FIT, llm_max_parts=2), ((B[0], 15.0), (B[1], 5.0))
    ),
    # Nodes a and c are left with no room alike: c's two pieces beat a's four.
    "equal-room-fewest-pieces": NodeFitCase(
        snapshot(*gang("a", 4, 35), *gang("c", 2, 30)), llm(20), NODE_FIT,
        ((GpuRef("c", 0), 10.0), (GpuRef("c", 1), 10.0)),
    ),
    "sm-binds-as-without-it": NodeFitCase(
        SM_BINDS, llm(30, request=0.6, limit=0.8), NODE_FIT, ((B[0], 25.0), (B[1], 5.0)), by_memory=False
    ),
    "sm-binds-off-by-default": NodeFitCase(
        SM_BINDS, llm(30, request=0.6, limit=0.8), SPLIT, ((B[0], 25.0), (B[1], 5.0))
    ),
    "whole-on-a-lit-gpu-first": NodeFitCase(
        snapshot(*gang("a", 4, 35), gpu("d", 0, inst("i", 0.2, 0.4, 5, INF))), llm(20), NODE_FIT, ()
    ),
    "kept-to-one-invoker": NodeFitCase(
        CRUMBS, llm(20, only_invoker="b", lit_only=True), NODE_FIT, ((B[0], 15.0), (B[1], 5.0))
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_split_node_fit(case: NodeFitCase) -> None:
    d = place(case.cluster, case.request, case.config)
    assert d.placed, d.reason
    got = tuple((p.gpu, round(p.instance.memory_mib / GIB, 3)) for p in d.parts)
    assert got == case.parts, d.reason
    if case.parts:
        assert d.lights == 0
        after = apply_placement(case.cluster, case.request, d)
        assert after.lit_count == case.cluster.lit_count
        assert ("least free memory" in d.reason) == (case.config.split_node_fit and case.by_memory)


def test_pieces_sum_to_the_instance() -> None:
    r = llm(20, request=0.5, limit=0.7)
    d = place(CRUMBS, r, NODE_FIT)
    pieces = [p.instance for p in d.parts]
    assert all(p.part_of == "llm" and p.cls is LLM for p in pieces)
    assert sum(p.memory_mib for p in pieces) == pytest.approx(r.memory_mib)
    assert sum(p.request for p in pieces) == pytest.approx(0.5)
    assert sum(p.limit for p in pieces) == pytest.approx(0.7)


def test_no_node_holds_it_lights_one_whole() -> None:
    cluster = snapshot(*gang("a", 4, 35), gpu("b", 0))
    d = place(cluster, llm(25), NODE_FIT)
    assert d.gpus == (GpuRef("b", 0),) and not d.split and d.lights == 1


def test_the_sim_config_passes_it_through() -> None:
    assert PlacementSimConfig(policy="dilu").placement_config().split_node_fit is False
    assert PlacementSimConfig(policy="dilu", split_node_fit=True).placement_config().split_node_fit is True
    assert PlacementConfig().split_node_fit is False


def _free_gib(cluster: ClusterSnapshot, invoker: str) -> float:
    lit = [cluster.gpus[o] for o in cluster.invoker_ordinals[invoker] if cluster.gpus[o].instances]
    return sum(g.memory_mib - g.used_memory for g in lit) / GIB


def test_along_a_trace_no_node_would_be_left_with_less_room() -> None:
    # Every split of a 0.2:0.4 trace under node fit: where memory binds, no other node whose lit GPUs
    # hold the instance (as the default splits it there) is left with less free memory (in whole MiB);
    # where Σ request binds, the default's decision.
    events = dilu_mix(240, train_fraction=0.2, llm_fraction=0.4, seed=3)
    cluster = ClusterSnapshot.uniform(invokers=[f"n{i:03d}" for i in range(cluster_size(events, 4) // 4)],
                                      gpus_per_invoker=4, memory_mib=40 * GIB)
    splits = compared = 0
    placed: dict[str, tuple[str, ...]] = {}
    for ev in events:
        spec = ev.spec
        if spec is None:
            for pid in placed.pop(ev.instance, ()):
                cluster = cluster.without_instance(pid)
            continue
        r = PlacementRequest(instance_id=spec.instance, function=spec.function, cls=spec.cls,
                             request=spec.sm_request, limit=spec.sm_limit, memory_mib=spec.memory_mib, gpus=spec.gpus)
        d = place(cluster, r, NODE_FIT)
        assert d.placed, d.reason
        by_memory = (cluster.sum_memory + r.memory_mib) / cluster.max_memory_mib >= cluster.sum_request + r.request
        if not by_memory:
            assert d == place(cluster, r, SPLIT)
        elif d.split:
            splits += 1
            chosen = _free_gib(apply_placement(cluster, r, d), d.gpus[0].invoker)
            for inv in cluster.invokers:
                if inv == d.gpus[0].invoker or not any(cluster.gpus[o].instances
                                                       for o in cluster.invoker_ordinals[inv]):
                    continue
                other = place(cluster, replace(r, only_invoker=inv, lit_only=True), SPLIT)
                if other.split:
                    compared += 1
                    room = _free_gib(apply_placement(cluster, r, other), inv)
                    assert room >= chosen - 1.0 / GIB, (inv, room, chosen)
        cluster = apply_placement(cluster, r, d)
        placed[r.instance_id] = tuple(p.instance.id for p in d.parts) if d.split else (r.instance_id,)
    assert splits >= 10 and compared >= 10
