"""Table-driven tests of memory splitting (an LLM over GPUs of one invoker), the tgs strategy, and
compaction around split instances."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from split_testlib import GIB, INF, LLM, SPLIT, TRAIN, inst

from dilu_invoker.policy import (
    FILTERS,
    ClusterSnapshot,
    CompactionConfig,
    GpuRef,
    GpuState,
    InstanceClass,
    PlacedInstance,
    PlacementConfig,
    PlacementRequest,
    ShareMode,
    apply_placement,
    compaction_plan,
    part_id,
    place,
)


def gpu(invoker: str, index: int, *instances: PlacedInstance, mem_gib: float = 40.0) -> GpuState:
    return GpuState(ref=GpuRef(invoker, index), memory_mib=mem_gib * GIB, instances=instances)


def llm(mem_gib: float, request: float = 0.5, limit: float = 0.7, **kw: object) -> PlacementRequest:
    return PlacementRequest(
        instance_id="llm",
        function="llm",
        cls=LLM,
        request=request,
        limit=limit,
        memory_mib=mem_gib * GIB,
        **kw,  # type: ignore[arg-type]
    )


def snapshot(*gpus: GpuState) -> ClusterSnapshot:
    return ClusterSnapshot.build(now=0.0, gpus=gpus)


@dataclass(frozen=True)
class SplitCase:
    cluster: ClusterSnapshot
    request: PlacementRequest
    config: PlacementConfig
    parts: tuple[tuple[GpuRef, float], ...]
    """Expected (GPU, GiB) of each piece; empty: not split."""
    lights: int = 0


# Two training GPUs of invoker a with 15 GiB and 10 GiB free; invoker b has one unlit GPU.
TWO_HOLES = snapshot(
    gpu("a", 0, inst("t0", 0.4, 0.6, 25)),
    gpu("a", 1, inst("t1", 0.4, 0.6, 30)),
    gpu("b", 0),
)

SPLIT_CASES = {
    "fills-two-holes-instead-of-lighting": SplitCase(
        TWO_HOLES, llm(25), SPLIT, ((GpuRef("a", 0), 15.0), (GpuRef("a", 1), 10.0))
    ),
    "live-default-never-splits": SplitCase(TWO_HOLES, llm(25), PlacementConfig(), (), lights=1),
    "request-can-forbid": SplitCase(TWO_HOLES, llm(25, max_parts=1), SPLIT, (), lights=1),
    "request-can-allow-an-inference": SplitCase(
        TWO_HOLES,
        PlacementRequest(
            instance_id="llm", function="llm", cls=INF, request=0.5, limit=0.7, memory_mib=25 * GIB, max_parts=2
        ),
        PlacementConfig(),
        ((GpuRef("a", 0), 15.0), (GpuRef("a", 1), 10.0)),
    ),
    "too-big-for-the-holes": SplitCase(TWO_HOLES, llm(26), SPLIT, (), lights=1),
    "baselines-never-split": SplitCase(
        TWO_HOLES, llm(25), PlacementConfig(strategy="infless-r", llm_max_parts=4), (), lights=1
    ),
    "whole-on-a-lit-gpu-beats-splitting": SplitCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.4, 0.6, 25)),
            gpu("a", 1, inst("t1", 0.4, 0.6, 30)),
            gpu("a", 2, inst("i", 0.2, 0.4, 5, INF)),
        ),
        llm(25),
        SPLIT,
        (),
    ),
    "holes-on-two-invokers-do-not-combine": SplitCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.4, 0.6, 25)),
            gpu("b", 0, inst("t1", 0.4, 0.6, 30)),
            gpu("c", 0),
        ),
        llm(25),
        SPLIT,
        (),
        lights=1,
    ),
    # Σ request room 0.1 on a/0 caps its piece at 0.1 / 0.5 × 25 = 5 GiB of the 15 GiB free, so the
    # two GPUs with 15 and 10 GiB free take the instance in two pieces.
    "sm-room-caps-a-piece": SplitCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.9, 0.95, 25)),
            gpu("a", 1, inst("t1", 0.4, 0.6, 25)),
            gpu("a", 2, inst("t2", 0.4, 0.6, 30)),
            gpu("b", 0),
        ),
        llm(25),
        SPLIT,
        ((GpuRef("a", 1), 15.0), (GpuRef("a", 2), 10.0)),
    ),
    "fewest-pieces-wins": SplitCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.4, 0.6, 30)),
            gpu("a", 1, inst("t1", 0.4, 0.6, 30)),
            gpu("a", 2, inst("t2", 0.4, 0.6, 35)),
            gpu("b", 0, inst("t3", 0.4, 0.6, 20)),
            gpu("b", 1, inst("t4", 0.4, 0.6, 35)),
            gpu("c", 0),
        ),
        llm(25),
        SPLIT,
        ((GpuRef("b", 0), 20.0), (GpuRef("b", 1), 5.0)),
    ),
    "max-parts-bounds-the-pieces": SplitCase(
        snapshot(
            gpu("a", 0, inst("t0", 0.4, 0.6, 32)),
            gpu("a", 1, inst("t1", 0.4, 0.6, 32)),
            gpu("a", 2, inst("t2", 0.4, 0.6, 32)),
            gpu("b", 0),
        ),
        llm(24),
        PlacementConfig(llm_max_parts=2),
        (),
        lights=1,
    ),
}


@pytest.mark.parametrize("case", SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
def test_split(case: SplitCase) -> None:
    d = place(case.cluster, case.request, case.config)
    assert d.placed
    got = tuple((p.gpu, round(p.instance.memory_mib / GIB, 3)) for p in d.parts)
    assert got == case.parts, d.reason
    assert d.split is bool(case.parts)
    assert d.lights == case.lights
    if case.parts:
        assert "split over" in d.reason
        assert d.gpus == tuple(g for g, _ in case.parts)


def test_pieces_carry_proportional_shares_and_sum_to_the_instance() -> None:
    r = llm(25, request=0.5, limit=0.7)
    d = place(TWO_HOLES, r, SPLIT)
    pieces = [p.instance for p in d.parts]
    assert [p.id for p in pieces] == [part_id("llm", 0), part_id("llm", 1)]
    assert all(p.part_of == "llm" and p.gpus == 1 and p.cls is LLM for p in pieces)
    assert sum(p.memory_mib for p in pieces) == pytest.approx(r.memory_mib)
    assert sum(p.request for p in pieces) == pytest.approx(0.5)
    assert sum(p.limit for p in pieces) == pytest.approx(0.7)
    assert pieces[0].request == pytest.approx(0.5 * 15 / 25)


def test_apply_places_every_piece_and_the_bound_counts_memory_once() -> None:
    r = llm(25)
    d = place(TWO_HOLES, r, SPLIT)
    after = apply_placement(TWO_HOLES, r, d)
    assert after.lit_count == 2
    assert {after.instance_gpus(p.instance.id)[0] for p in d.parts} == set(d.gpus)
    assert after.sum_memory - TWO_HOLES.sum_memory == pytest.approx(r.memory_mib)
    assert after.sum_request - TWO_HOLES.sum_request == pytest.approx(r.request)
    # Pieces leave one by one.
    for p in d.parts:
        after = after.without_instance(p.instance.id)
    assert after.sum_memory == pytest.approx(TWO_HOLES.sum_memory)


def test_a_part_must_name_its_instance_and_sit_on_one_gpu() -> None:
    with pytest.raises(ValueError, match="part"):
        PlacedInstance(id="x#p0", function="x", cls=LLM, request=0.1, limit=0.1, memory_mib=1.0, part_of="")
    with pytest.raises(ValueError, match="part"):
        PlacedInstance(id="x#p0", function="x", cls=LLM, request=0.1, limit=0.1, memory_mib=1.0, gpus=2, part_of="x")


@pytest.mark.parametrize(
    "kwargs",
    [{"max_parts": 0}, {"max_parts": 2, "gpus": 2}],
    ids=["zero-parts", "split-gang"],
)
def test_split_request_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        llm(10, **kwargs)


@pytest.mark.parametrize("kwargs", [{"llm_max_parts": 0}, {"min_part_mib": 0.0}], ids=["parts", "min-part"])
def test_split_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PlacementConfig(**kwargs)  # type: ignore[arg-type]


def test_min_part_keeps_crumbs_out() -> None:
    cl = snapshot(
        gpu("a", 0, inst("t0", 0.4, 0.6, 39)),
        gpu("a", 1, inst("t1", 0.4, 0.6, 39)),
        gpu("a", 2, inst("t2", 0.4, 0.6, 38)),
        gpu("b", 0),
    )
    d = place(cl, llm(4), PlacementConfig(llm_max_parts=4, min_part_mib=2 * GIB))
    assert not d.split and d.lights == 1


# -- tgs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("held", "cls", "ok"),
    [
        ((), INF, True),
        ((inst("p", 0.3, 0.5, 5, INF),), INF, False),
        ((inst("p", 0.3, 0.5, 5, INF),), TRAIN, True),
        ((inst("o", 0.3, 0.5, 5, TRAIN),), TRAIN, False),
        ((inst("o", 0.3, 0.5, 5, TRAIN),), LLM, True),
    ],
    ids=["empty", "second-production", "opportunistic-beside-production", "second-opportunistic", "llm-is-production"],
)
def test_priority_pair_filter(held: tuple[PlacedInstance, ...], cls: InstanceClass, ok: bool) -> None:
    r = PlacementRequest(instance_id="n", function="n", cls=cls, request=0.3, limit=0.5, memory_mib=5 * GIB)
    assert FILTERS["priority-pair"].check(gpu("a", 0, *held), r, PlacementConfig()).ok is ok


def test_tgs_pairs_training_with_inference_and_runs_shares_by_priority() -> None:
    cl = snapshot(gpu("a", 0, inst("p", 0.3, 0.5, 5, INF)), gpu("a", 1))
    cfg = PlacementConfig(strategy="tgs")
    t = PlacementRequest(instance_id="t", function="t", cls=TRAIN, request=0.5, limit=1.0, memory_mib=10 * GIB)
    d = place(cl, t, cfg)
    assert d.gpus == (GpuRef("a", 0),)
    assert d.share_mode is ShareMode.PRIORITY and d.static_share is None
    i = PlacementRequest(instance_id="i", function="i", cls=INF, request=0.1, limit=0.2, memory_mib=1 * GIB)
    assert place(cl, i, cfg).gpus == (GpuRef("a", 1),)


# -- compaction around split instances -------------------------------------------------------------


def test_compaction_never_moves_a_piece_and_may_split_a_move() -> None:
    piece = PlacedInstance(
        id="big#p0", function="big", cls=LLM, request=0.1, limit=0.1, memory_mib=35 * GIB, part_of="big"
    )
    cl = snapshot(
        gpu("a", 0, inst("t0", 0.4, 0.6, 25)),
        gpu("a", 1, inst("t1", 0.4, 0.6, 30)),
        gpu("a", 2, inst("lone", 0.2, 0.3, 20, LLM)),
        gpu("a", 3, piece),
    )
    plan = compaction_plan(cl, SPLIT, CompactionConfig(source_max_request=1.0))
    assert [m.instance_id for m in plan.moves] == ["lone"]
    (move,) = plan.moves
    assert move.parts and {p.gpu for p in move.parts} == {GpuRef("a", 0), GpuRef("a", 1)}
    assert plan.freed == (GpuRef("a", 2),)
    assert plan.cluster.has_instance("big#p0")
    assert plan.cluster.lit_count == 3
    # Without splitting the lone LLM has nowhere to go.
    assert compaction_plan(cl, PlacementConfig(), CompactionConfig(source_max_request=1.0)).moves == ()
