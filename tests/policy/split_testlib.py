"""Shared by the tests of split placement and of compaction around split pieces: units, class names, the
splitting configuration, GPU names, a 40 GiB GPU and a placed-instance builder."""

from __future__ import annotations

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
