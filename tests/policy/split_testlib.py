"""Shared by the tests of split placement and of compaction around split pieces: units, class names, the
splitting configuration and a placed-instance builder."""

from __future__ import annotations

from dilu_invoker.policy import InstanceClass, PlacedInstance, PlacementConfig

GIB = 1024.0
INF, LLM, TRAIN = InstanceClass.INFERENCE, InstanceClass.LLM, InstanceClass.TRAINING
SPLIT = PlacementConfig(llm_max_parts=4)


def inst(id: str, request: float, limit: float, mem_gib: float, cls: InstanceClass = TRAIN) -> PlacedInstance:
    return PlacedInstance(id=id, function=id, cls=cls, request=request, limit=limit, memory_mib=mem_gib * GIB)
