"""Table-driven tests of the split that lights a GPU (`PlacementConfig.light_split_min_share`): an LLM
that would light a GPU whole is split over lit GPUs of one invoker and one new GPU of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
from split_testlib import GIB, INF, SPLIT, inst

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
from dilu_invoker.policy.types import InstanceClass


def gpu(invoker: str, index: int, *instances: PlacedInstance, mem_gib: float = 40.0) -> GpuState:
    return GpuState(ref=GpuRef(invoker, index), memory_mib=mem_gib * GIB, instances=instances)


def llm(mem_gib: float, request: float = 0.5, limit: float = 0.7, **kw: object) -> PlacementRequest:
    return PlacementRequest(
        instance_id="llm", function="llm", cls=InstanceClass.LLM, request=request, limit=limit,
        memory_mib=mem_gib * GIB, **kw,  # type: ignore[arg-type]
    )


def snapshot(*gpus: GpuState) -> ClusterSnapshot:
    return ClusterSnapshot.build(now=0.0, gpus=gpus)


def lighting(share: float | None, **kw: object) -> PlacementConfig:
    return replace(SPLIT, light_split_min_share=share, **kw)  # type: ignore[arg-type]


A0, A1, B0, B1, B2 = GpuRef("a", 0), GpuRef("a", 1), GpuRef("b", 0), GpuRef("b", 1), GpuRef("b", 2)

# Invoker a: 15 GiB free on a lit GPU and an unlit one; invoker b: 10 and 5 GiB free on two lit GPUs
# and an unlit one. No lit GPU takes a 25 GiB LLM whole, and no invoker's lit GPUs hold it.
ROOMS = snapshot(
    gpu("a", 0, inst("t0", 0.4, 0.6, 25)),
    gpu("a", 1),
    gpu("b", 0, inst("t1", 0.4, 0.6, 30)),
    gpu("b", 1, inst("t2", 0.4, 0.6, 35)),
    gpu("b", 2),
)


@dataclass(frozen=True)
class LightingCase:
    cluster: ClusterSnapshot
    request: PlacementRequest
    config: PlacementConfig
    parts: tuple[tuple[GpuRef, float], ...]
    """Expected (GPU, GiB) of each piece, the new GPU's last; empty: placed whole."""
    lights: int = 1


CASES = {
    "off-by-default-lights-whole": LightingCase(ROOMS, llm(25), SPLIT, ()),
    # a's lit GPU takes 15 GiB in one piece, b's two take 10 + 5: as much, in more pieces.
    "most-lit-room-then-fewest-pieces": LightingCase(ROOMS, llm(25), lighting(0.0), ((A0, 15.0), (A1, 10.0))),
    "the-share-is-met": LightingCase(ROOMS, llm(25), lighting(0.6), ((A0, 15.0), (A1, 10.0))),
    "below-the-share-lights-whole": LightingCase(ROOMS, llm(25), lighting(0.61), ()),
    # b's lit GPUs take 10 + 5 of 20 GiB, a's 15: b wins on the room it fills.
    "more-lit-room-beats-fewer-pieces": LightingCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.4, 0.6, 25)),
            gpu("a", 1),
            gpu("b", 0, inst("t1", 0.4, 0.6, 30)),
            gpu("b", 1, inst("t2", 0.4, 0.6, 34)),
            gpu("b", 2),
        ),
        llm(21),
        lighting(0.0),
        ((B0, 10.0), (B1, 6.0), (B2, 5.0)),
    ),
    "max-parts-bounds-the-lit-pieces": LightingCase(
        ROOMS, llm(25), lighting(0.0, llm_max_parts=2), ((A0, 15.0), (A1, 10.0))
    ),
    # The new GPU's piece keeps at least `min_part_mib` (2 GiB): the lit GPU takes 23 of its 24 free.
    "the-new-piece-keeps-a-stage": LightingCase(
        snapshot(gpu("a", 0, inst("t0", 0.2, 0.4, 16)), gpu("a", 1)),
        llm(25, request=0.3),
        lighting(0.0),
        ((A0, 23.0), (A1, 2.0)),
    ),
    # Invoker a has the lit room but no unlit GPU: b's lit GPU and new GPU take it.
    "only-an-invoker-with-an-unlit-gpu": LightingCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.4, 0.6, 20)),
            gpu("a", 1, inst("t1", 0.4, 0.6, 40)),
            gpu("b", 0, inst("t2", 0.4, 0.6, 30)),
            gpu("b", 1),
        ),
        llm(25),
        lighting(0.0),
        ((B0, 10.0), (B1, 15.0)),
    ),
    # Σ request room 0.1 on a/0 caps its piece at 0.1 / 0.5 × 25 = 5 GiB of its 15 GiB free.
    "sm-room-caps-a-lit-piece": LightingCase(
        snapshot(gpu("a", 0, inst("t0", 0.9, 0.95, 25)), gpu("a", 1)),
        llm(25),
        lighting(0.0),
        ((A0, 5.0), (A1, 20.0)),
    ),
    "whole-on-a-lit-gpu-first": LightingCase(
        snapshot(gpu("a", 0, inst("i", 0.2, 0.4, 5, INF)), gpu("a", 1)), llm(25), lighting(0.0), (), lights=0
    ),
    "a-split-over-lit-gpus-first": LightingCase(
        snapshot(gpu("a", 0, inst("t0", 0.4, 0.6, 25)), gpu("a", 1, inst("t1", 0.4, 0.6, 25)), gpu("a", 2)),
        llm(25),
        lighting(0.0),
        ((A0, 15.0), (A1, 10.0)),
        lights=0,
    ),
    "an-instance-that-may-not-split-lights-whole": LightingCase(ROOMS, llm(25, max_parts=1), lighting(0.0), ()),
    "baselines-never-split": LightingCase(
        ROOMS, llm(25), PlacementConfig(strategy="infless-r", llm_max_parts=4, light_split_min_share=0.0), ()
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_split_lighting(case: LightingCase) -> None:
    d = place(case.cluster, case.request, case.config)
    assert d.placed, d.reason
    got = tuple((p.gpu, round(p.instance.memory_mib / GIB, 3)) for p in d.parts)
    assert got == case.parts, d.reason
    assert d.lights == case.lights
    if case.parts:
        assert d.gpus == tuple(g for g, _ in case.parts)
        lit_after = apply_placement(case.cluster, case.request, d).lit_count
        assert lit_after == case.cluster.lit_count + case.lights
    if case.parts and case.lights:
        assert "one it lights" in d.reason


def test_pieces_sum_to_the_instance() -> None:
    r = llm(25, request=0.5, limit=0.7)
    d = place(ROOMS, r, lighting(0.0))
    pieces = [p.instance for p in d.parts]
    assert all(p.part_of == "llm" and p.cls is InstanceClass.LLM for p in pieces)
    assert sum(p.memory_mib for p in pieces) == pytest.approx(r.memory_mib)
    assert sum(p.request for p in pieces) == pytest.approx(0.5)
    assert sum(p.limit for p in pieces) == pytest.approx(0.7)


def test_a_lit_only_request_never_lights() -> None:
    d = place(ROOMS, llm(25, lit_only=True), lighting(0.0))
    assert not d.placed


def test_no_unlit_gpu_beside_the_room_lights_whole_elsewhere() -> None:
    cluster = snapshot(gpu("a", 0, inst("t0", 0.4, 0.6, 25)), gpu("a", 1, inst("t1", 0.4, 0.6, 38)), gpu("b", 0))
    d = place(cluster, llm(25), lighting(0.0))
    assert d.gpus == (GpuRef("b", 0),) and not d.split and d.lights == 1


@pytest.mark.parametrize("share", [-0.1, 1.0, math.nan, math.inf], ids=["negative", "one", "nan", "inf"])
def test_config_validation(share: float) -> None:
    with pytest.raises(ValueError, match="light_split_min_share"):
        PlacementConfig(light_split_min_share=share)
