"""Placement of an instance whose read-only weights its revision's instances share on a GPU: the memory
filter and the fragmentation scorer count the weights once where the GPU holds them, and such GPUs are
tried first; requests without weights decide exactly as before."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dilu_invoker.policy import (
    FILTERS,
    SCORERS,
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
from dilu_invoker.policy.placement import holds_weights, memory_need, place_sharing

GIB = 1024.0
DILU = PlacementConfig()
GROUP = "guest/llm@1-a"


def inst(id: str, request: float = 0.2, limit: float = 0.4, mem_gib: float = 10.0, function: str = "guest/llm",
         ) -> PlacedInstance:
    return PlacedInstance(id=id, function=function, cls=InstanceClass.INFERENCE, request=request, limit=limit,
                          memory_mib=mem_gib * GIB)


def gpu(invoker: str, index: int, *instances: PlacedInstance, mem_gib: float = 16.0,
        groups: frozenset[tuple[str, float]] = frozenset()) -> GpuState:
    return GpuState(ref=GpuRef(invoker, index), memory_mib=mem_gib * GIB, instances=instances,
                    weight_groups=groups)


def req(id: str = "new", mem_gib: float = 10.0, weights_gib: float = 8.0, group: str = GROUP,
        request: float = 0.2, limit: float = 0.4, **kw: object) -> PlacementRequest:
    return PlacementRequest(instance_id=id, function="guest/llm", cls=InstanceClass.INFERENCE, request=request,
                            limit=limit, memory_mib=mem_gib * GIB, weights_mib=weights_gib * GIB,
                            weights_group=group if weights_gib else "", **kw)  # type: ignore[arg-type]


HELD = frozenset({(GROUP, 8 * GIB)})


@pytest.mark.parametrize(
    ("groups", "request_", "fits", "need_gib"),
    [
        # 10 GiB used of 16: a whole 10 GiB instance does not fit, its 2 GiB beside the weights do
        (HELD, req(), True, 2.0),
        (frozenset(), req(), False, 10.0),
        # the same group with another weights size is other weights
        (frozenset({(GROUP, 4 * GIB)}), req(), False, 10.0),
        # another revision's weights
        (frozenset({("guest/llm@2-b", 8 * GIB)}), req(), False, 10.0),
        # a request declaring no weights takes its whole memory even where the GPU holds some
        (HELD, req(weights_gib=0.0), False, 10.0),
        # the boundary: 10 + (12 − 6) = 16 GiB exactly fits; one MiB more does not
        (frozenset({(GROUP, 6 * GIB)}), req(mem_gib=12.0, weights_gib=6.0), True, 6.0),
        (frozenset({(GROUP, 6 * GIB)}), req(mem_gib=12.0 + 1 / GIB, weights_gib=6.0), False, 6.0 + 1 / GIB),
        # all of its memory is weights: it needs nothing more there
        (frozenset({(GROUP, 10 * GIB)}), req(mem_gib=10.0, weights_gib=10.0), True, 0.0),
    ],
)
def test_memory_filter_counts_held_weights_once(groups: frozenset[tuple[str, float]], request_: PlacementRequest,
                                                fits: bool, need_gib: float) -> None:
    g = gpu("inv0", 0, inst("a"), groups=groups)
    assert memory_need(g, request_) == pytest.approx(need_gib * GIB)
    result = FILTERS["memory"].check(g, request_, DILU)
    assert result.ok is fits
    if not fits:
        assert f"+ {need_gib * GIB:.0f} MiB" in result.reason
        assert ("weights shared" in result.reason) is holds_weights(g, request_)


@pytest.mark.parametrize(
    ("groups", "used_after_gib"),
    [(HELD, 12.0), (frozenset(), 20.0), (frozenset({("other@1", 8 * GIB)}), 20.0)],
)
def test_fragmentation_scores_memory_less_held_weights(groups: frozenset[tuple[str, float]],
                                                       used_after_gib: float) -> None:
    g = gpu("inv0", 0, inst("a"), mem_gib=32.0, groups=groups)
    r = req()
    score = SCORERS["fragmentation"].score(g, r, ClusterSnapshot.build(now=0, gpus=[g]), DILU)
    frag = DILU.sm_weight * (1 - (0.2 + 0.2)) + DILU.memory_weight * (1 - used_after_gib / 32.0)
    assert score == pytest.approx(100 * (1 - frag))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"weights_gib": 11.0}, "weights_mib must be within"),
        ({"weights_gib": -1.0}, "weights_mib must be within"),
        ({"weights_gib": float("nan")}, "weights_mib must be within"),
        ({"group": ""}, "needs a weights_group"),
        ({"gpus": 2}, "shares no weights"),
    ],
)
def test_request_weights_are_validated(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        req(**kw)  # type: ignore[arg-type]


def test_second_instance_fits_only_beside_its_weights() -> None:
    """One 16 GiB GPU holding the first instance (10 GiB, 8 of them weights): the second fits with its
    2 GiB; counted whole it is refused."""
    holder = gpu("inv0", 0, inst("a", 0.1, 0.2), groups=HELD)
    cluster = ClusterSnapshot.build(now=0, gpus=[holder])
    d = place(cluster, req(limit=0.2), DILU)
    assert d.gpus == (GpuRef("inv0", 0),)
    assert "8192 MiB of weights shared there" in d.reason
    after = apply_placement(cluster, req(limit=0.2), d)
    g = after.gpu(GpuRef("inv0", 0))
    assert g.used_memory == pytest.approx(12 * GIB)  # charged as the budget charges it: weights once
    assert g.weight_groups == HELD
    # a third fits too (14 GiB), a fourth (16 GiB) as well, a fifth does not
    d3 = place(after, req("n3", request=0.1, limit=0.2), DILU)
    assert d3.placed
    after = apply_placement(after, req("n3", request=0.1, limit=0.2), d3)
    r4 = req("n4", request=0.1, limit=0.2)
    after = apply_placement(after, r4, place(after, r4, DILU))
    assert after.gpu(GpuRef("inv0", 0)).used_memory == pytest.approx(16 * GIB)
    d5 = place(after, req("n5", request=0.1, limit=0.2), DILU)
    assert not d5.placed and "memory" in d5.reason and "weights shared" in d5.reason

    whole = ClusterSnapshot.build(now=0, gpus=[gpu("inv0", 0, inst("a"))])
    refused = place(whole, req(), DILU)
    assert not refused.placed and "memory rejected 1" in refused.reason


def test_holder_is_preferred_over_a_better_fit_and_a_new_gpu() -> None:
    """inv0/gpu0 holds the weights; inv1/gpu0 is a tighter fit by the scorers (fuller SM) and lit;
    inv2 is unlit. The holder wins; without the group the tighter fit does."""
    holder = gpu("inv0", 0, inst("a", 0.1, 0.2), mem_gib=80.0, groups=HELD)
    tight = gpu("inv1", 0, inst("b", 0.6, 0.8, function="guest/other"), mem_gib=80.0)
    empty = gpu("inv2", 0, mem_gib=80.0)
    cluster = ClusterSnapshot.build(now=0, gpus=[holder, tight, empty])
    d = place(cluster, req(), DILU)
    assert d.gpus == (GpuRef("inv0", 0),) and "weights shared" in d.reason
    assert place_sharing(cluster, req(), DILU) == d
    unheld = ClusterSnapshot.build(now=0, gpus=[replace(holder, weight_groups=frozenset()), tight, empty])
    assert place(unheld, req(), DILU).gpus == (GpuRef("inv1", 0),)
    assert place_sharing(unheld, req(), DILU) is None


def test_among_holders_the_scorers_decide_and_a_full_holder_falls_back() -> None:
    a = gpu("inv0", 0, inst("a", 0.1, 0.2), mem_gib=80.0, groups=HELD)
    b = gpu("inv0", 1, inst("b", 0.5, 0.6), mem_gib=80.0, groups=HELD)
    other = gpu("inv1", 0, inst("c", 0.1, 0.2, function="guest/other"), mem_gib=80.0)
    cluster = ClusterSnapshot.build(now=0, gpus=[a, b, other])
    assert place(cluster, req(), DILU).gpus == (GpuRef("inv0", 1),)  # the fuller holder: best fit
    # both holders' SM requests are full: the instance goes elsewhere, whole, and the reason says nothing shared
    full = ClusterSnapshot.build(now=0, gpus=[replace(a, instances=(inst("a", 0.9, 1.0),)),
                                              replace(b, instances=(inst("b", 0.9, 1.0),)), other])
    d = place(full, req(), DILU)
    assert d.gpus == (GpuRef("inv1", 0),) and "weights shared" not in d.reason
    assert place_sharing(full, req(), DILU) is None
    after = apply_placement(full, req(), d)
    assert after.gpu(GpuRef("inv1", 0)).used_memory == pytest.approx(20 * GIB)  # whole: no copy there yet


def test_avoided_holder_is_not_used() -> None:
    holder = gpu("inv0", 0, inst("a"), mem_gib=80.0, groups=HELD)
    other = gpu("inv1", 0, inst("c", function="guest/other"), mem_gib=80.0)
    cluster = ClusterSnapshot.build(now=0, gpus=[holder, other])
    d = place(cluster, req(avoid_invokers=frozenset({"inv0"})), DILU)
    assert d.gpus == (GpuRef("inv1", 0),)


def test_weight_groups_survive_snapshot_updates() -> None:
    holder = gpu("inv0", 0, inst("a"), mem_gib=80.0, groups=HELD)
    cluster = ClusterSnapshot.build(now=0, gpus=[holder, gpu("inv0", 1, mem_gib=80.0)])
    ref = GpuRef("inv0", 0)
    moved = cluster.with_instance(inst("x"), (ref,)).without_instance("x")
    assert moved.gpu(ref).weight_groups == HELD
    drained = cluster.with_schedulable(ref, False)
    assert drained.gpu(ref).weight_groups == HELD and not drained.gpu(ref).schedulable
    assert not place(drained, req(), DILU).gpus == (ref,)


def _random_cluster(rng: random.Random, with_groups: bool) -> ClusterSnapshot:
    gpus = []
    for i in range(24):
        n = rng.randrange(0, 4)
        insts = tuple(inst(f"g{i}i{k}", round(rng.uniform(0.05, 0.3), 2), 0.5, rng.choice([2.0, 5.0, 10.0]),
                           function=rng.choice(["guest/llm", "guest/a", "guest/b"])) for k in range(n))
        holds = rng.random() < 0.5  # drawn either way: both clusters are the same but for the groups
        groups = HELD if with_groups and insts and holds else frozenset()
        gpus.append(gpu(f"inv{i // 4}", i % 4, *insts, mem_gib=40.0, groups=groups))
    return ClusterSnapshot.build(now=0, gpus=gpus)


@pytest.mark.parametrize("strategy", ["dilu", "infless-r", "infless-l", "fastgs", "tgs", "exclusive"])
def test_requests_without_weights_decide_as_before(strategy: str) -> None:
    """A cluster whose GPUs hold weights decides every request that declares none exactly as the same
    cluster without them; a request declaring weights nobody holds decides as one declaring none."""
    config = PlacementConfig(strategy=strategy)
    for seed in range(20):
        held = _random_cluster(random.Random(seed), True)
        plain = _random_cluster(random.Random(seed), False)
        assert any(g.weight_groups for g in held.gpus)
        for k, (mem, r) in enumerate([(2.0, 0.1), (10.0, 0.3), (30.0, 0.5), (39.0, 0.2)]):
            bare = req(f"n{k}", mem_gib=mem, weights_gib=0.0, request=r, limit=max(r, 0.4))
            assert place(held, bare, config) == place(plain, bare, config)
            declared = replace(bare, weights_mib=min(mem, 1.0) * GIB, weights_group="guest/nobody@1")
            assert place(held, declared, config) == place(held, bare, config)
