"""Shared by the tests of split placement and of compaction around split pieces: units, class names, the
splitting configuration, GPU names, a 40 GiB GPU and a placed-instance builder."""

from __future__ import annotations

from typing import Any

import pytest

from dilu_invoker.policy import GpuRef, GpuState, InstanceClass, PlacedInstance, PlacementConfig

GIB = 1024.0
INF, LLM, TRAIN = InstanceClass.INFERENCE, InstanceClass.LLM, InstanceClass.TRAINING
SPLIT = PlacementConfig(llm_max_parts=4)
A0, A1, A2, B0, C0, D0 = GpuRef("a", 0), GpuRef("a", 1), GpuRef("a", 2), GpuRef("b", 0), GpuRef("c", 0), GpuRef("d", 0)


def inst(id: str, request: float, limit: float, mem_gib: float, cls: InstanceClass = TRAIN) -> PlacedInstance:
    return PlacedInstance(id=id, function=id, cls=cls, request=request, limit=limit, memory_mib=mem_gib * GIB)


def gpu(ref: GpuRef, *instances: PlacedInstance) -> GpuState:
    """A 40 GiB GPU holding ``instances``."""
    return GpuState(ref=ref, memory_mib=40 * GIB, instances=instances)


def assert_stages_resized(cluster: Any, plan: Any, sizes: dict[str, tuple[float, float]],
                          stages: tuple[str, ...]) -> None:
    """A stage-resizing plan (`rebalances`, `memory_rebalances`) moved exactly the stages in `sizes` to their
    (SM request, GiB) where they are, held the split instance's Σ request and Σ memory over `stages`, and
    turned no GPU off or on."""
    after = plan.cluster
    assert {m.instance_id for m in plan.moves} == set(sizes), plan.reason
    for pid, (request, mem_gib) in sizes.items():
        q = after.instance(pid)
        assert q.request == pytest.approx(request)
        assert q.memory_mib == pytest.approx(mem_gib * GIB)
        assert q.limit == pytest.approx(request)
        assert after.instance_gpus(pid) == cluster.instance_gpus(pid)
    assert sum(after.instance(s).request for s in stages) == pytest.approx(
        sum(cluster.instance(s).request for s in stages)
    )
    assert sum(after.instance(s).memory_mib for s in stages) == pytest.approx(
        sum(cluster.instance(s).memory_mib for s in stages)
    )
    assert after.lit_count == cluster.lit_count and plan.freed == ()
