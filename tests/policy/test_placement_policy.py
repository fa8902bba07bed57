"""Table-driven tests of placement: filters, scorers, strategies, gangs and decisions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from dilu_invoker.policy import (
    FILTERS,
    SCORERS,
    STRATEGIES,
    Affinity,
    ClusterSnapshot,
    FilterStatus,
    GpuRef,
    GpuState,
    InstanceClass,
    PlacedInstance,
    PlacementConfig,
    PlacementDecision,
    PlacementRequest,
    Profile,
    ShareMode,
    Strategy,
    apply_placement,
    describe_strategies,
    get_strategy,
    place,
    register_strategy,
)

GIB = 1024.0
INF, LLM, TRAIN = InstanceClass.INFERENCE, InstanceClass.LLM, InstanceClass.TRAINING
DILU = PlacementConfig()
DILU_15 = PlacementConfig(gamma=1.5)
"""Dilu's own Σ limit ≤ 1.5 (the default has no Σ-limit bound)."""


def placed(
    id: str,
    request: float,
    limit: float,
    mem_gib: float = 5.0,
    *,
    cls: InstanceClass = INF,
    function: str | None = None,
    profile: Profile | None = None,
    gpus: int = 1,
) -> PlacedInstance:
    return PlacedInstance(
        id=id,
        function=function or id,
        cls=cls,
        request=request,
        limit=limit,
        memory_mib=mem_gib * GIB,
        profile=profile,
        gpus=gpus,
    )


def gpu(
    invoker: str,
    index: int,
    *instances: PlacedInstance,
    mem_gib: float = 40.0,
    schedulable: bool = True,
) -> GpuState:
    return GpuState(
        ref=GpuRef(invoker, index),
        memory_mib=mem_gib * GIB,
        instances=instances,
        schedulable=schedulable,
    )


def req(
    id: str = "new",
    request: float = 0.3,
    limit: float = 0.5,
    mem_gib: float = 5.0,
    *,
    cls: InstanceClass = INF,
    function: str | None = None,
    **kw: object,
) -> PlacementRequest:
    return PlacementRequest(
        instance_id=id,
        function=function or id,
        cls=cls,
        request=request,
        limit=limit,
        memory_mib=mem_gib * GIB,
        **kw,  # type: ignore[arg-type]
    )


def cluster(*gpus: GpuState) -> ClusterSnapshot:
    return ClusterSnapshot.build(now=0.0, gpus=gpus)


# -- filters -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FilterCase:
    filter: str
    gpu: GpuState
    request: PlacementRequest
    ok: bool
    reason_has: str = ""


FILTER_CASES = {
    "sm-request-exactly-full-fits": FilterCase(
        "sm-request",
        gpu("a", 0, placed("x", 0.3, 0.3), placed("y", 0.3, 0.3)),
        req(request=0.4, limit=0.4),
        True,
    ),
    "sm-request-over": FilterCase(
        "sm-request",
        gpu("a", 0, placed("x", 0.7, 0.7)),
        req(request=0.4, limit=0.4),
        False,
        "Σ request 0.70 + 0.40",
    ),
    "sm-limit-within-gamma": FilterCase(
        "sm-limit",
        gpu("a", 0, placed("x", 0.3, 0.6), placed("y", 0.3, 0.5)),
        req(limit=0.4),
        True,
    ),
    "sm-limit-over-gamma": FilterCase(
        "sm-limit",
        gpu("a", 0, placed("x", 0.3, 0.6), placed("y", 0.3, 0.6)),
        req(limit=0.4),
        False,
        "γ 1.50",
    ),
    "sm-limit-static-over-one": FilterCase(
        "sm-limit-static",
        gpu("a", 0, placed("x", 0.3, 0.6)),
        req(limit=0.5),
        False,
        "> 1",
    ),
    "memory-fits-exactly": FilterCase(
        "memory", gpu("a", 0, placed("x", 0.1, 0.1, 35)), req(mem_gib=5), True
    ),
    "memory-over": FilterCase(
        "memory", gpu("a", 0, placed("x", 0.1, 0.1, 36)), req(mem_gib=5), False, "MiB >"
    ),
    "exclusive-empty": FilterCase("exclusive", gpu("a", 0), req(), True),
    "exclusive-taken": FilterCase(
        "exclusive", gpu("a", 0, placed("x", 0.1, 0.1)), req(), False, "already holds 1"
    ),
    "draining": FilterCase(
        "schedulable", gpu("a", 0, schedulable=False), req(), False, "draining"
    ),
    "avoided-gpu": FilterCase(
        "avoid",
        gpu("a", 0),
        req(avoid_gpus=frozenset({GpuRef("a", 0)})),
        False,
        "excluded",
    ),
    "avoided-invoker": FilterCase(
        "avoid", gpu("a", 0), req(avoid_invokers=frozenset({"a"})), False, "excluded"
    ),
    "not-avoided": FilterCase(
        "avoid", gpu("a", 0), req(avoid_invokers=frozenset({"b"})), True
    ),
}


@pytest.mark.parametrize("case", FILTER_CASES.values(), ids=FILTER_CASES.keys())
def test_filter(case: FilterCase) -> None:
    result = FILTERS[case.filter].check(case.gpu, case.request, DILU_15)
    assert result.ok is case.ok
    assert result.status is (
        FilterStatus.SUCCESS if case.ok else FilterStatus.UNSCHEDULABLE
    )
    assert result.filter == case.filter
    assert case.reason_has in result.reason


def test_filter_bounds_never_skip_a_passing_gpu() -> None:
    # A bound is the most Σ request a passing GPU may have; check it against the predicate itself.
    request = req(request=0.25, limit=0.45)
    for name, f in FILTERS.items():
        if f.bound is None:
            continue
        bound = f.bound(request, DILU_15)
        for used in [x / 100 for x in range(151)]:
            g = gpu(
                "a",
                0,
                placed("x", min(used, 1.0), min(1.0, used)),
                placed("y", max(0.0, used - 1.0), max(0.0, used - 1.0)),
            )
            if f.passes(g, request, DILU_15):
                assert g.used_request <= bound + 1e-9, (name, used)


# -- scorers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoreCase:
    scorer: str
    gpu: GpuState
    request: PlacementRequest
    score: float
    config: PlacementConfig = DILU


SCORE_CASES = {
    "lit": ScoreCase("lit", gpu("a", 0, placed("x", 0.1, 0.1)), req(), 100.0),
    "unlit": ScoreCase("lit", gpu("a", 0), req(), 0.0),
    "fragmentation-after": ScoreCase(
        # after: Σ request 0.8, memory 20/40 → frag 0.6·0.2 + 0.4·0.5 = 0.32
        "fragmentation",
        gpu("a", 0, placed("x", 0.5, 0.5, 15)),
        req(request=0.3, mem_gib=5),
        68.0,
    ),
    "fragmentation-full": ScoreCase(
        "fragmentation", gpu("a", 0, placed("x", 0.7, 0.7, 35)), req(request=0.3), 100.0
    ),
    "sm-fit": ScoreCase(
        "sm-fit", gpu("a", 0, placed("x", 0.5, 0.5)), req(request=0.3), 80.0
    ),
    "limit-fit": ScoreCase(
        "limit-fit", gpu("a", 0, placed("x", 0.2, 0.5)), req(limit=0.4), 90.0
    ),
    "complementarity-empty-gpu": ScoreCase("complementarity", gpu("a", 0), req(), 50.0),
    "inference-beside-training": ScoreCase(
        "complementarity",
        gpu("a", 0, placed("t", 0.5, 0.9, cls=TRAIN)),
        req(),
        60.0 + 20.0,
    ),
    "inference-beside-inference": ScoreCase(
        "complementarity", gpu("a", 0, placed("i", 0.3, 0.5)), req(), 20.0
    ),
    "training-beside-llm": ScoreCase(
        "complementarity",
        gpu("a", 0, placed("l", 0.5, 0.7, cls=LLM)),
        req(cls=TRAIN),
        80.0,
    ),
    "compute-beside-memory-bound": ScoreCase(
        "complementarity",
        gpu("a", 0, placed("i", 0.3, 0.5, profile=Profile.MEMORY)),
        req(profile=Profile.COMPUTE),
        40.0,
    ),
    "compute-beside-compute-bound-training": ScoreCase(
        "complementarity",
        gpu("a", 0, placed("t", 0.3, 0.5, cls=TRAIN, profile=Profile.COMPUTE)),
        req(profile=Profile.COMPUTE),
        60.0,
    ),
    "dominant-fit-sm-binds": ScoreCase(
        # after: Σ request 0.8, memory 10/40: the SM request runs out first
        "dominant-fit", gpu("a", 0, placed("x", 0.5, 0.5, 5)), req(request=0.3, mem_gib=5), 80.0
    ),
    "dominant-fit-memory-binds": ScoreCase(
        # after: Σ request 0.3, memory 36/40: memory runs out first
        "dominant-fit", gpu("a", 0, placed("x", 0.2, 0.2, 30)), req(request=0.1, mem_gib=6), 90.0
    ),
    "dominant-fit-full": ScoreCase(
        "dominant-fit", gpu("a", 0, placed("x", 0.7, 0.7, 35)), req(request=0.3, mem_gib=5), 100.0
    ),
    "complementarity-be-inference-beside-training": ScoreCase(
        # neutral class part: an inference instance beside a job outlives it
        "complementarity-be", gpu("a", 0, placed("t", 0.5, 0.9, cls=TRAIN)), req(), 50.0
    ),
    "complementarity-be-training-beside-inference": ScoreCase(
        "complementarity-be", gpu("a", 0, placed("i", 0.3, 0.5)), req(cls=TRAIN), 80.0
    ),
    "complementarity-be-training-beside-training": ScoreCase(
        "complementarity-be", gpu("a", 0, placed("t", 0.3, 0.5, cls=TRAIN)), req(cls=TRAIN), 20.0
    ),
    "spread-none-on-invoker": ScoreCase(
        "affinity", gpu("a", 0), req(function="f"), 100.0
    ),
    "spread-one-elsewhere-on-invoker": ScoreCase(
        "affinity",
        gpu("a", 0, placed("x", 0.1, 0.1, function="f")),
        req(function="f"),
        25.0,
    ),
    "pack-one-on-invoker": ScoreCase(
        "affinity", gpu("a", 0), req(function="f", affinity=Affinity.PACK), 0.0
    ),
    "affinity-none": ScoreCase(
        "affinity", gpu("a", 0), req(), 50.0, PlacementConfig(affinity=Affinity.NONE)
    ),
}


@pytest.mark.parametrize("case", SCORE_CASES.values(), ids=SCORE_CASES.keys())
def test_scorer(case: ScoreCase) -> None:
    cl = cluster(case.gpu, gpu("b", 0))
    g = cl.gpu(case.gpu.ref)
    assert SCORERS[case.scorer].score(
        g, case.request, cl, case.config
    ) == pytest.approx(case.score)


def test_dilu_lifetime_places_inference_by_fit_not_beside_training() -> None:
    # Equal Σ request after placing on either GPU. dilu draws inference beside the training job (its
    # complementarity, and the job's memory in its fit); dilu-lifetime sees equal fits and takes the first
    # GPU in cluster order, the one whose tenant outlives no job.
    cl = cluster(
        gpu("a", 0, placed("i", 0.5, 0.8, 2)),
        gpu("b", 0, placed("t", 0.5, 0.9, 10, cls=TRAIN)),
    )
    r = req(request=0.1, mem_gib=1)
    assert place(cl, r, DILU).gpus == (GpuRef("b", 0),)
    assert place(cl, r, PlacementConfig(strategy="dilu-lifetime")).gpus == (GpuRef("a", 0),)
    # A training job still seeks inference under dilu-lifetime.
    cl = cluster(
        gpu("a", 0, placed("t", 0.5, 0.9, 2, cls=TRAIN)),
        gpu("b", 0, placed("i", 0.5, 0.8, 2)),
    )
    assert place(cl, req(request=0.1, mem_gib=1, cls=TRAIN), PlacementConfig(strategy="dilu-lifetime")).gpus == (
        GpuRef("b", 0),
    )


def test_pack_prefers_invoker_running_the_function() -> None:
    cl = cluster(
        gpu("a", 0, placed("x", 0.1, 0.1, function="f")), gpu("a", 1), gpu("b", 0)
    )
    r = req(function="f", affinity=Affinity.PACK)
    scores = {
        ref: SCORERS["affinity"].score(cl.gpu(ref), r, cl, DILU)
        for ref in (GpuRef("a", 1), GpuRef("b", 0))
    }
    assert (
        scores[GpuRef("a", 1)] == pytest.approx(50.0) and scores[GpuRef("b", 0)] == 0.0
    )


def test_unlit_bounds_are_upper_bounds() -> None:
    cl = cluster(
        gpu("a", 0),
        gpu("a", 1, mem_gib=80),
        gpu("b", 0, placed("x", 0.1, 0.1, function="f")),
    )
    for r in (
        req(function="f"),
        req(request=0.9, limit=1.0, mem_gib=39),
        req(function="f", affinity=Affinity.PACK),
    ):
        for g in cl.gpus:
            if g.lit:
                continue
            for s in SCORERS.values():
                assert s.score(g, r, cl, DILU) <= s.unlit_bound(r, cl, DILU) + 1e-9, (
                    s.name
                )


# -- strategies ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlaceCase:
    gpus: tuple[GpuState, ...]
    request: PlacementRequest
    where: tuple[GpuRef, ...]
    strategy: str = "dilu"
    config: PlacementConfig | None = None
    reason_has: str = ""


A0, A1, B0, B1 = GpuRef("a", 0), GpuRef("a", 1), GpuRef("b", 0), GpuRef("b", 1)

PLACE_CASES = {
    "dilu-prefers-lit-over-unlit": PlaceCase(
        (gpu("a", 0), gpu("b", 0, placed("x", 0.2, 0.4))),
        req(),
        (B0,),
        reason_has="no GPU lit",
    ),
    "dilu-lights-a-gpu-when-no-lit-one-fits": PlaceCase(
        (gpu("a", 0, placed("x", 0.8, 0.9)), gpu("b", 0)),
        req(),
        (B0,),
        reason_has="lights 1",
    ),
    "dilu-best-fit-among-lit": PlaceCase(
        (gpu("a", 0, placed("x", 0.2, 0.3)), gpu("b", 0, placed("y", 0.6, 0.7))),
        req(request=0.3),
        (B0,),
    ),
    "dilu-gamma-pushes-elsewhere": PlaceCase(
        (
            gpu("a", 0, placed("x", 0.3, 1.0), placed("y", 0.1, 0.3)),
            gpu("b", 0, placed("z", 0.2, 0.3)),
        ),
        req(request=0.3, limit=0.5),
        (B0,),
        config=DILU_15,
    ),
    # The same GPUs without a Σ-limit bound (the default): a/0's Σ limit 1.8 is no obstacle, its request
    # room is, and the fuller GPU wins.
    "dilu-default-admits-by-request": PlaceCase(
        (
            gpu("a", 0, placed("x", 0.3, 1.0), placed("y", 0.1, 0.3)),
            gpu("b", 0, placed("z", 0.2, 0.3)),
        ),
        req(request=0.3, limit=0.5),
        (A0,),
    ),
    "dilu-memory-pushes-elsewhere": PlaceCase(
        (
            gpu("a", 0, placed("x", 0.6, 0.6, 38)),
            gpu("b", 0, placed("y", 0.2, 0.3, 10)),
        ),
        req(mem_gib=5),
        (B0,),
    ),
    "dilu-complementary-neighbour-breaks-a-tie": PlaceCase(
        (
            gpu("a", 0, placed("i", 0.4, 0.6)),
            gpu("b", 0, placed("t", 0.4, 0.6, cls=TRAIN)),
        ),
        req(),
        (B0,),
    ),
    "dilu-spreads-a-function-across-invokers": PlaceCase(
        (
            gpu("a", 0, placed("f1", 0.3, 0.4, function="f")),
            gpu("a", 1, placed("g", 0.3, 0.4)),
            gpu("b", 0, placed("h", 0.3, 0.4)),
        ),
        req(function="f"),
        (B0,),
    ),
    "dilu-pack-keeps-a-function-together": PlaceCase(
        (
            gpu("a", 0, placed("f1", 0.3, 0.4, function="f")),
            gpu("a", 1, placed("g", 0.3, 0.4)),
            gpu("b", 0, placed("h", 0.3, 0.4)),
        ),
        req(function="f"),
        (A0,),
        config=PlacementConfig(affinity=Affinity.PACK),
    ),
    "dilu-skips-draining": PlaceCase(
        (gpu("a", 0, placed("x", 0.2, 0.3), schedulable=False), gpu("b", 0)),
        req(),
        (B0,),
    ),
    "dilu-equal-choices-take-cluster-order": PlaceCase(
        (gpu("b", 0), gpu("a", 0), gpu("a", 1)), req(), (B0,)
    ),
    "exclusive-takes-an-empty-gpu": PlaceCase(
        (gpu("a", 0, placed("x", 0.1, 0.2)), gpu("a", 1)),
        req(),
        (A1,),
        strategy="exclusive",
    ),
    "infless-l-reserves-limits": PlaceCase(
        (gpu("a", 0, placed("x", 0.2, 0.6)), gpu("b", 0, placed("y", 0.2, 0.5))),
        req(request=0.2, limit=0.5),
        (B0,),
        strategy="infless-l",
    ),
    "infless-r-ignores-limits": PlaceCase(
        (gpu("a", 0, placed("x", 0.3, 1.0)), gpu("b", 0)),
        req(request=0.3, limit=1.0),
        (A0,),
        strategy="infless-r",
    ),
    "fastgs-partitions-at-request": PlaceCase(
        (gpu("a", 0, placed("x", 0.7, 1.0)), gpu("b", 0, placed("y", 0.6, 0.7))),
        req(request=0.4, limit=0.9),
        (B0,),
        strategy="fastgs",
    ),
}


@pytest.mark.parametrize("case", PLACE_CASES.values(), ids=PLACE_CASES.keys())
def test_place(case: PlaceCase) -> None:
    config = case.config or PlacementConfig(strategy=case.strategy)
    d = place(cluster(*case.gpus), case.request, config)
    assert d.placed, d.reason
    assert d.gpus == case.where, d.reason
    assert d.strategy == config.strategy
    assert case.reason_has in d.reason
    assert d.candidates and d.candidates[0].gpus == case.where
    assert all(c.reason for c in d.candidates)
    assert [c.total for c in d.candidates] == sorted(
        (c.total for c in d.candidates), reverse=True
    )


@dataclass(frozen=True)
class NoRoomCase:
    gpus: tuple[GpuState, ...]
    request: PlacementRequest
    rejected_by: set[str]
    strategy: str = "dilu"
    gamma: float = math.inf


NO_ROOM_CASES = {
    "everything-full": NoRoomCase(
        (
            gpu("a", 0, placed("x", 0.9, 1.0)),
            gpu("a", 1, placed("y", 0.5, 0.7), placed("z", 0.1, 0.7)),
        ),
        req(),
        {"sm-request", "sm-limit"},
        gamma=1.5,
    ),
    "everything-full-by-request": NoRoomCase(
        (
            gpu("a", 0, placed("x", 0.9, 1.0)),
            gpu("a", 1, placed("y", 0.5, 0.7), placed("z", 0.5, 0.7)),
        ),
        req(),
        {"sm-request"},
    ),
    "too-big-for-any-gpu": NoRoomCase((gpu("a", 0),), req(mem_gib=41), {"memory"}),
    "exclusive-with-every-gpu-taken": NoRoomCase(
        (gpu("a", 0, placed("x", 0.1, 0.1)),), req(), set(), strategy="exclusive"
    ),
    "lit-only-never-lights": NoRoomCase(
        (gpu("a", 0, placed("x", 0.9, 0.9)), gpu("a", 1)),
        req(lit_only=True),
        {"sm-request"},
    ),
    "gang-needs-one-invoker": NoRoomCase(
        (
            gpu("a", 0),
            gpu("a", 1, placed("x", 0.9, 0.9)),
            gpu("b", 0, placed("y", 0.9, 0.9)),
            gpu("b", 1),
        ),
        req(cls=TRAIN, gpus=2),
        {"sm-request"},
    ),
}


@pytest.mark.parametrize("case", NO_ROOM_CASES.values(), ids=NO_ROOM_CASES.keys())
def test_no_room(case: NoRoomCase) -> None:
    d = place(
        cluster(*case.gpus), case.request, PlacementConfig(strategy=case.strategy, gamma=case.gamma)
    )
    assert not d.placed and d.gpus == () and d.invoker is None
    assert d.reason.startswith("no GPU fits new")
    assert {r.filter for r in d.rejections} >= case.rejected_by
    assert all(r.count > 0 and r.example for r in d.rejections)
    with pytest.raises(ValueError, match="failed placement"):
        apply_placement(cluster(*case.gpus), case.request, d)


@pytest.mark.parametrize(
    ("strategy", "mode", "static"),
    [
        ("dilu", ShareMode.DYNAMIC, None),
        ("exclusive", ShareMode.WHOLE_GPU, 1.0),
        ("infless-l", ShareMode.STATIC_LIMIT, 0.5),
        ("infless-r", ShareMode.STATIC_REQUEST, 0.3),
        ("fastgs", ShareMode.SPATIAL_REQUEST, 0.3),
    ],
    ids=lambda v: str(v),
)
def test_share_mode_of_each_strategy(
    strategy: str, mode: ShareMode, static: float | None
) -> None:
    d = place(
        cluster(gpu("a", 0)),
        req(request=0.3, limit=0.5),
        PlacementConfig(strategy=strategy),
    )
    assert d.share_mode is mode and d.static_share == static


def test_exclusive_never_shares_a_gpu() -> None:
    cl = ClusterSnapshot.uniform(invokers=2, gpus_per_invoker=2, memory_mib=40 * GIB)
    config = PlacementConfig(strategy="exclusive")
    for i in range(4):
        r = req(f"i{i}", request=0.1, limit=0.2)
        cl = apply_placement(cl, r, place(cl, r, config))
    assert all(len(g.instances) == 1 for g in cl.gpus)
    assert not place(cl, req("i5"), config).placed


# -- gangs ---------------------------------------------------------------------------------------


def test_gang_lands_on_one_invoker_preferring_lit_gpus() -> None:
    cl = cluster(
        gpu("a", 0),
        gpu("a", 1),
        gpu("b", 0, placed("x", 0.2, 0.3)),
        gpu("b", 1),
        gpu("b", 2, placed("y", 0.2, 0.3)),
    )
    d = place(cl, req(cls=TRAIN, request=0.5, limit=0.8, mem_gib=20, gpus=2), DILU)
    assert d.gpus == (GpuRef("b", 0), GpuRef("b", 2)) and d.lights == 0, d.reason


def test_gang_lights_gpus_of_one_invoker_when_needed() -> None:
    cl = cluster(
        gpu("a", 0),
        gpu("a", 1, placed("x", 0.9, 0.9)),
        gpu("b", 0),
        gpu("b", 1),
        gpu("b", 2),
    )
    d = place(cl, req(cls=TRAIN, request=0.5, limit=0.8, gpus=3), DILU)
    assert d.gpus == (GpuRef("b", 0), GpuRef("b", 1), GpuRef("b", 2)) and d.lights == 3
    cl2 = apply_placement(cl, req(cls=TRAIN, request=0.5, limit=0.8, gpus=3), d)
    assert cl2.instance_gpus("new") == d.gpus


def test_exclusive_gang_takes_empty_gpus_only() -> None:
    cl = cluster(
        gpu("a", 0, placed("x", 0.1, 0.1)), gpu("a", 1), gpu("b", 0), gpu("b", 1)
    )
    d = place(cl, req(cls=TRAIN, gpus=2), PlacementConfig(strategy="exclusive"))
    assert d.gpus == (GpuRef("b", 0), GpuRef("b", 1))


# -- registry and configuration ------------------------------------------------------------------


def test_builtin_strategies_are_registered() -> None:
    assert {"dilu", "exclusive", "infless-l", "infless-r", "fastgs"} <= set(STRATEGIES)
    assert set(describe_strategies()) == set(STRATEGIES)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "nope"},
        {"weights": (("nope", 1.0),)},
        {"weights": (("lit", -1.0),)},
        {"weights": ()},
        {"omega": 0.0},
        {"gamma": 0.9},
        {"sm_weight": 1.5},
        {"candidate_limit": 0},
    ],
    ids=lambda k: next(iter(k)),
)
def test_config_errors_at_start_up(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PlacementConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_strategy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: .*dilu"):
        get_strategy("gandiva")


def test_register_a_strategy_and_use_it() -> None:
    name = "test-worst-fit"
    if name not in STRATEGIES:
        register_strategy(
            Strategy(
                name,
                "spread load: emptiest lit GPU",
                ("schedulable", "sm-request", "memory"),
                (("lit", 10.0), ("sm-fit", 0.0), ("affinity", 1.0)),
                ShareMode.DYNAMIC,
            )
        )
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(get_strategy(name))
    with pytest.raises(ValueError, match="unknown filter"):
        Strategy("x", "", ("nope",), (("lit", 1.0),), ShareMode.DYNAMIC)
    d = place(
        cluster(gpu("a", 0, placed("x", 0.1, 0.1)), gpu("b", 0)),
        req(),
        PlacementConfig(strategy=name),
    )
    assert d.gpus == (GpuRef("a", 0),) and d.strategy == name


def test_weight_override_changes_the_choice() -> None:
    cl = cluster(gpu("a", 0, placed("x", 0.6, 0.7)), gpu("b", 0))
    assert place(cl, req(), DILU).gpus == (GpuRef("a", 0),)
    only_spread = PlacementConfig(
        weights=(("fragmentation", 0.0), ("affinity", 1.0), ("complementarity", 1.0))
    )
    # Without the lit tier, an empty GPU (complementarity 50) beats a GPU beside another inference (20).
    assert place(cl, req(), only_spread).gpus == (GpuRef("b", 0),)


def test_request_validation() -> None:
    with pytest.raises(ValueError):
        req(request=0.6, limit=0.5)
    with pytest.raises(ValueError):
        req(gpus=0)
    with pytest.raises(ValueError):
        req(id="")


def test_decision_is_deterministic_and_does_not_touch_the_snapshot() -> None:
    cl = ClusterSnapshot.uniform(invokers=3, gpus_per_invoker=2, memory_mib=40 * GIB)
    r = req()
    d1: PlacementDecision = place(cl, r, DILU)
    d2 = place(cl, r, DILU)
    assert d1 == d2
    after = apply_placement(cl, r, d1)
    assert cl.lit_count == 0 and after.lit_count == 1


def test_candidate_limit_bounds_the_work_not_the_result_quality_on_ties() -> None:
    gpus = [gpu("a", i, placed(f"x{i}", 0.5, 0.5)) for i in range(10)]
    d = place(
        cluster(*gpus), req(), PlacementConfig(candidate_limit=2, report_candidates=5)
    )
    assert d.placed and len(d.candidates) == 2
