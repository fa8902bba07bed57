"""`place_spread`: spread over invokers as a tier between "lit" and "best fit" (tables, no clock)."""

from __future__ import annotations

import pytest

from dilu_invoker.policy import (
    Affinity,
    ClusterSnapshot,
    GpuRef,
    GpuState,
    InstanceClass,
    PlacedInstance,
    PlacementConfig,
    PlacementRequest,
    place,
)
from dilu_invoker.policy.spread import invokers_running, place_spread

INF = InstanceClass.INFERENCE


def gpu(inv: str, index: int, *held: tuple[str, str, float]) -> GpuState:
    return GpuState(ref=GpuRef(inv, index), memory_mib=16000.0, instances=tuple(
        PlacedInstance(id=iid, function=fn, cls=INF, request=req, limit=min(1.0, 2 * req), memory_mib=1000.0)
        for iid, fn, req in held))


def req(**kw: object) -> PlacementRequest:
    base: dict[str, object] = {"instance_id": "new", "function": "f", "cls": INF, "request": 0.1, "limit": 0.2,
                               "memory_mib": 1000.0}
    base.update(kw)
    return PlacementRequest(**base)  # type: ignore[arg-type]


# Two lit GPUs: invoker0's is fuller (better fit) and already runs f; invoker1's holds another function.
TWO_LIT = [gpu("invoker0", 0, ("f1", "f", 0.5)), gpu("invoker1", 0, ("o1", "o", 0.1))]


@pytest.mark.parametrize(("gpus", "ask", "config", "expect"), [
    (TWO_LIT, req(), PlacementConfig(), GpuRef("invoker1", 0)),
    (TWO_LIT, req(affinity=Affinity.PACK), PlacementConfig(), GpuRef("invoker0", 0)),
    (TWO_LIT, req(), PlacementConfig(affinity=Affinity.NONE), GpuRef("invoker0", 0)),
    (TWO_LIT, req(function="g"), PlacementConfig(), GpuRef("invoker0", 0)),
    ([gpu("invoker0", 0, ("f1", "f", 0.5)), gpu("invoker1", 0)], req(), PlacementConfig(), GpuRef("invoker0", 0)),
    ([gpu("invoker0", 0, ("f1", "f", 0.5)), gpu("invoker1", 0, ("o1", "o", 0.95))], req(), PlacementConfig(),
     GpuRef("invoker0", 0)),
    ([gpu("invoker0", 0, ("f1", "f", 0.5)), gpu("invoker0", 1, ("o1", "o", 0.1))], req(), PlacementConfig(),
     GpuRef("invoker0", 0)),
], ids=["spread-beats-fit", "pack", "affinity-off", "first-instance", "never-lights", "elsewhere-full",
        "one-invoker"])
def test_place_spread(gpus: list[GpuState], ask: PlacementRequest, config: PlacementConfig,
                      expect: GpuRef) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=gpus)
    decision = place_spread(cluster, ask, config)
    assert decision.gpus == (expect,)


def test_spread_says_why_and_plain_place_would_differ() -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=TWO_LIT)
    assert place(cluster, req(), PlacementConfig()).gpus == (GpuRef("invoker0", 0),)
    decision = place_spread(cluster, req(), PlacementConfig())
    assert "spread: kept off invoker0" in decision.reason


def test_spread_keeps_the_callers_own_exclusions() -> None:
    gpus = [gpu("invoker0", 0, ("f1", "f", 0.5)), gpu("invoker1", 0, ("o1", "o", 0.1)),
            gpu("invoker2", 0, ("p1", "p", 0.2))]
    cluster = ClusterSnapshot.build(now=0.0, gpus=gpus)
    decision = place_spread(cluster, req(avoid_invokers=frozenset({"invoker2"})), PlacementConfig())
    assert decision.gpus == (GpuRef("invoker1", 0),)
    assert invokers_running(cluster, "f") == {"invoker0"}
