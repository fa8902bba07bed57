"""Table-driven tests of compaction emptying GPUs that hold pieces of split instances, and of
placement kept to one invoker (`PlacementRequest.only_invoker`)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from split_testlib import GIB, INF, LLM, SPLIT, inst

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    GpuRef,
    GpuState,
    PlacedInstance,
    PlacementConfig,
    PlacementRequest,
    compaction_plan,
    place,
)


def piece(index: int, mem_gib: float, of: str = "big", whole_gib: float = 25.0) -> PlacedInstance:
    """Piece `index` of an LLM asking 0.5/0.7 SM for `whole_gib`, scaled by its memory."""
    f = mem_gib / whole_gib
    return PlacedInstance(
        id=f"{of}#p{index}", function=of, cls=LLM, request=0.5 * f, limit=0.7 * f,
        memory_mib=mem_gib * GIB, part_of=of,
    )


def gpu(invoker: str, index: int, *instances: PlacedInstance) -> GpuState:
    return GpuState(ref=GpuRef(invoker, index), memory_mib=40 * GIB, instances=instances)


def snapshot(*gpus: GpuState) -> ClusterSnapshot:
    return ClusterSnapshot.build(now=0.0, gpus=gpus)


@dataclass(frozen=True)
class PieceCase:
    cluster: ClusterSnapshot
    config: CompactionConfig
    moves: tuple[tuple[str, GpuRef, GpuRef, tuple[str, ...]], ...]
    """Expected (instance id, source, target, ids of the pieces it replaces) of each move."""
    freed: tuple[GpuRef, ...]
    cold_starts: int


A0, A1, A2, A3, B0 = GpuRef("a", 0), GpuRef("a", 1), GpuRef("a", 2), GpuRef("a", 3), GpuRef("b", 0)

# Only GPUs with Σ request ≤ 0.5 are sources; the others hold 0.6 or more.
PIECES = CompactionConfig(source_max_request=0.5, move_pieces=True)

CASES = {
    # a/1 holds one stage alone; a/0 has room; a/2 holds the sibling stage (never two stages on one
    # GPU); b/0 has more room but is on another node.
    "a stage moves within its node": PieceCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.6, 0.8, 25)),
            gpu("a", 1, piece(0, 10)),
            gpu("a", 2, piece(1, 15), inst("t2", 0.3, 0.4, 5)),
            gpu("a", 3, inst("t3", 0.6, 0.8, 40)),
            gpu("b", 0, inst("t4", 0.6, 0.7, 5)),
        ),
        PIECES,
        (("big#p0", A1, A0, ()),),
        (A1,),
        1,
    ),
    # No other GPU of node a takes the 15 GiB stage: the whole 25 GiB instance starts on b/0 (which
    # the plan then never empties); a/1, left with a small inference, is emptied next.
    "the whole instance anew on another node": PieceCase(
        snapshot(
            gpu("a", 0, piece(0, 15)),
            gpu("a", 1, piece(1, 10), inst("t1", 0.2, 0.3, 3, INF)),
            gpu("a", 2, inst("t2", 0.6, 0.8, 35)),
            gpu("b", 0, inst("t3", 0.45, 0.6, 10)),
        ),
        PIECES,
        (("big", A0, B0, ("big#p0", "big#p1")), ("t1", A1, A2, ())),
        (A0, A1),
        2,
    ),
    # Off (the live default): a GPU holding a stage is not a source.
    "stages stay where they are when off": PieceCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.6, 0.8, 25)),
            gpu("a", 1, piece(0, 10)),
            gpu("a", 2, piece(1, 15), inst("t2", 0.3, 0.4, 5)),
        ),
        CompactionConfig(source_max_request=0.5),
        (),
        (),
        0,
    ),
    # Placed anew, the instance is split again over two lit GPUs of node b: two stages start (two
    # cold starts); a/0 keeps its inference and stays lit.
    "placed anew and split again": PieceCase(
        snapshot(
            gpu("a", 0, piece(0, 12), inst("i0", 0.2, 0.3, 20, INF)),
            gpu("a", 1, piece(1, 13)),
            gpu("a", 2, inst("t2", 0.6, 0.8, 40)),
            gpu("b", 0, inst("t3", 0.6, 0.7, 25)),
            gpu("b", 1, inst("t4", 0.6, 0.7, 25)),
        ),
        CompactionConfig(source_max_request=0.5, source_max_instances=1, move_pieces=True),
        (("big", A1, B0, ("big#p0", "big#p1")),),
        (A1,),
        2,
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_compaction_of_gpus_holding_pieces(case: PieceCase) -> None:
    before = {g.ref for g in case.cluster.lit_gpus()}
    plan = compaction_plan(case.cluster, SPLIT, case.config)
    assert tuple((m.instance_id, m.source, m.target, m.replaces) for m in plan.moves) == case.moves
    assert plan.freed == case.freed
    assert plan.cold_starts == case.cold_starts
    after = {g.ref for g in plan.cluster.lit_gpus()}
    # No move lights a GPU; every GPU that went dark is reported.
    assert after <= before and before - after == set(case.freed)
    for g in plan.cluster.gpus:
        assert g.used_request <= 1.0 + 1e-9
        assert g.used_limit <= SPLIT.gamma + 1e-9
        assert g.used_memory <= g.memory_mib * (1 + 1e-6)
        # Never two stages of one instance on one GPU.
        owners = [i.part_of for i in g.instances if i.part_of is not None]
        assert len(owners) == len(set(owners))
    # Every stage of an instance sits on one node; a moved stage keeps its identity.
    nodes: dict[str, set[str]] = {}
    for g in plan.cluster.gpus:
        for i in g.instances:
            if i.part_of is not None:
                nodes.setdefault(i.part_of, set()).add(g.ref.invoker)
    assert all(len(n) == 1 for n in nodes.values())
    for m in plan.moves:
        if not m.replaces:
            moved = plan.cluster.instance(m.instance_id)
            assert moved == case.cluster.instance(m.instance_id)
            assert plan.cluster.instance_gpus(m.instance_id) == (m.target,)


@dataclass(frozen=True)
class OnlyCase:
    lit_only: bool
    only: str
    gpus: tuple[GpuRef, ...]


ONLY_CLUSTER = snapshot(
    gpu("a", 0, inst("t0", 0.4, 0.6, 38)),
    gpu("a", 1, inst("t1", 0.2, 0.3, 30)),
    gpu("a", 2),
    gpu("b", 0, inst("t2", 0.2, 0.3, 5)),
)

ONLY_CASES = {
    "the invoker's lit GPU that fits": OnlyCase(True, "a", (A1,)),
    "another invoker's best GPU is not looked at": OnlyCase(True, "b", (B0,)),
    "lit only and nothing fits there": OnlyCase(True, "c", ()),
    "an unlit GPU of the invoker when allowed": OnlyCase(False, "a", (A1,)),
}


@pytest.mark.parametrize("case", ONLY_CASES.values(), ids=ONLY_CASES.keys())
def test_only_invoker_keeps_placement_on_one_invoker(case: OnlyCase) -> None:
    request = PlacementRequest(
        instance_id="x", function="x", cls=INF, request=0.3, limit=0.4, memory_mib=8 * GIB,
        only_invoker=case.only, lit_only=case.lit_only,
    )
    decision = place(ONLY_CLUSTER, request, PlacementConfig())
    assert decision.gpus == case.gpus
    assert all(g.invoker == case.only for g in decision.gpus)


def test_only_invoker_lights_its_own_gpu_when_its_lit_ones_are_full() -> None:
    request = PlacementRequest(
        instance_id="x", function="x", cls=INF, request=0.3, limit=0.4, memory_mib=12 * GIB,
        only_invoker="a",
    )
    decision = place(ONLY_CLUSTER, request, PlacementConfig())
    assert decision.gpus == (A2,) and decision.lights == 1
