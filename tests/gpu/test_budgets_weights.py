"""Shared weights count once in a GPU's Redis budget: one carrier per function revision and GPU, the weights
released with the group's last reservation (whichever left first), atomic under concurrent reservations,
and following leases that lapse."""

from __future__ import annotations

import asyncio

import pytest

from dilu_invoker.gpu.budgets import GpuBudget, GpuBudgets, GpuCapacity, Reservation
from dilu_invoker.model import weights_group

UUID = "GPU-w-0"
F1 = weights_group("invoker0", "guest/llm", "1-abc")


def _res(name: str, memory: int = 30_000, weights: int = 20_000, group: str = F1, *, function: str = "guest/llm",
         request: float = 0.1, limit: float = 0.1) -> Reservation:
    return Reservation(instance=name, function=function, cls="inference", invoker="invoker0", request=request,
                       limit=limit, memory_mb=memory, weights_mb=weights, group=group)


@pytest.fixture
async def budgets(redis) -> GpuBudgets:
    b = GpuBudgets(redis, prefix="tw:")
    await b.register_gpu(UUID, GpuCapacity(node="invoker0", index=0, name="Test", memory_mb=80_000, sm_count=132))
    return b


async def _budget(budgets: GpuBudgets) -> GpuBudget:
    got = await budgets.get(UUID)
    assert got is not None
    return got


def _carriers(budget: GpuBudget) -> set[str]:
    return {n for n, r in budget.reservations.items() if r.sharing_key is not None and not r.shares_weights}


async def test_two_instances_of_one_revision_reserve_the_weights_once(budgets: GpuBudgets) -> None:
    first = await budgets.reserve(UUID, _res("a"), ttl_s=30)
    second = await budgets.reserve(UUID, _res("b"), ttl_s=30)
    assert (first.ok, first.memory_mb, first.shares_weights) == (True, 30_000, False)
    assert (second.ok, second.memory_mb, second.shares_weights) == (True, 10_000, True)
    assert second.sum_memory_mb == 40_000
    budget = await _budget(budgets)
    assert budget.sum_memory_mb == 40_000
    assert budget.reservations["a"].memory_mb == 30_000 and budget.reservations["b"].memory_mb == 10_000
    assert budget.reservations["b"].declared_mb == 30_000 and _carriers(budget) == {"a"}


@pytest.mark.parametrize(
    "other",
    [
        _res("b", group=weights_group("invoker0", "guest/llm", "2-def")),  # a new revision: other weights
        _res("b", group=weights_group("invoker0", "guest/other", "1-abc"), function="guest/other"),
        _res("b", weights=25_000),  # other weights sizes cannot be the same weights
        _res("b", weights=0),  # shares nothing
        _res("b", group=""),
    ],
    ids=["other-revision", "other-function", "other-weights-size", "no-weights", "no-group"],
)
async def test_another_function_or_revision_reserves_its_weights_again(budgets: GpuBudgets,
                                                                       other: Reservation) -> None:
    assert (await budgets.reserve(UUID, _res("a"), ttl_s=30)).ok
    result = await budgets.reserve(UUID, other, ttl_s=30)
    assert result.ok and result.memory_mb == 30_000 and not result.shares_weights
    assert (await _budget(budgets)).sum_memory_mb == 60_000


async def test_sharing_admits_instances_a_full_copy_each_would_not(budgets: GpuBudgets) -> None:
    # 50 GB each, 40 GB of it weights: 80 GB holds 4 instances (50 + 3 × 10), not 1.
    results = [await budgets.reserve(UUID, _res(f"i{k}", memory=50_000, weights=40_000), ttl_s=30) for k in range(5)]
    assert [r.ok for r in results] == [True, True, True, True, False]
    assert results[3].sum_memory_mb == 80_000
    assert results[4].reason == "memory would reach 90000 MB > 80000 MB (its 40000 MB of weights shared)"
    refused = await budgets.reserve(UUID, _res("plain", memory=50_000, weights=0), ttl_s=30)
    assert not refused.ok and refused.reason == "memory would reach 130000 MB > 80000 MB"


async def test_the_weights_stay_until_the_last_instance_leaves_in_either_order(budgets: GpuBudgets) -> None:
    for name in ("a", "b", "c"):
        assert (await budgets.reserve(UUID, _res(name), ttl_s=30)).ok
    assert (await _budget(budgets)).sum_memory_mb == 50_000
    # The carrier leaves first: the next instance carries the weights, nothing else changes.
    await budgets.release(UUID, "a")
    budget = await _budget(budgets)
    assert budget.sum_memory_mb == 40_000 and _carriers(budget) == {"b"}
    assert budget.reservations["b"].memory_mb == 30_000 and budget.reservations["c"].memory_mb == 10_000
    # A sharer leaves: only its own part goes.
    await budgets.release(UUID, "c")
    budget = await _budget(budgets)
    assert budget.sum_memory_mb == 30_000 and _carriers(budget) == {"b"}
    # A new instance joins the carrier it finds.
    joined = await budgets.reserve(UUID, _res("d"), ttl_s=30)
    assert joined.shares_weights and joined.sum_memory_mb == 40_000
    # The last instances leave: the weights with them.
    await budgets.release(UUID, "b")
    assert (await _budget(budgets)).reservations["d"].memory_mb == 30_000
    await budgets.release(UUID, "d")
    budget = await _budget(budgets)
    assert budget.reservations == {} and budget.sum_memory_mb == 0
    # A first instance after that copies (and reserves) the weights again.
    assert (await budgets.reserve(UUID, _res("e"), ttl_s=30)).memory_mb == 30_000


async def test_concurrent_reservations_elect_one_carrier_and_never_oversubscribe(budgets: GpuBudgets) -> None:
    # 20 GB each with 15 GB of weights: 20 + 12 × 5 = 80, so 13 fit; two functions race at once.
    f2 = weights_group("invoker0", "guest/llm", "2-def")
    results = await asyncio.gather(*(
        budgets.reserve(UUID, _res(f"{g}-{k}", memory=20_000, weights=15_000, group=grp, request=0.01,
                                   limit=0.01), ttl_s=30)
        for k in range(12) for g, grp in (("x", F1), ("y", f2))
    ))
    budget = await _budget(budgets)
    assert budget.sum_memory_mb <= 80_000
    assert {budget.reservations[n].group for n in _carriers(budget)} == {F1, f2} and len(_carriers(budget)) == 2
    # Two carriers (40 GB) + k sharers × 5 GB ≤ 80 GB: 8 sharers; the rest refused on memory.
    assert sum(r.ok for r in results) == 10
    assert all("memory" in r.reason for r in results if not r.ok)
    assert budget.sum_memory_mb == 2 * 20_000 + 8 * 5_000


async def test_a_lapsed_carrier_hands_the_weights_to_a_live_instance(budgets: GpuBudgets) -> None:
    assert (await budgets.reserve(UUID, _res("dies"), ttl_s=0.3)).ok  # its invoker crashed: no renewals
    assert (await budgets.reserve(UUID, _res("lives"), ttl_s=0.3)).shares_weights
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await budgets.renew(UUID, ["lives"], ttl_s=0.3) == 1
    # No script has looked at the GPU since the lapse: a reader still sees the weights counted.
    budget = await _budget(budgets)
    assert set(budget.reservations) == {"lives"} and budget.reservations["lives"].memory_mb == 30_000
    # The next script makes it so in Redis: 80 − 30 = 50 GB left for a plain instance, not 70.
    assert not (await budgets.reserve(UUID, _res("plain", memory=50_001, weights=0), ttl_s=30)).ok
    assert (await budgets.reserve(UUID, _res("plain", memory=50_000, weights=0), ttl_s=30)).ok
    raw = await budgets.get(UUID, include_expired=True)
    assert raw is not None and not raw.reservations["lives"].shares_weights


async def test_the_weights_lapse_with_the_groups_last_lease(budgets: GpuBudgets) -> None:
    assert (await budgets.reserve(UUID, _res("a"), ttl_s=0.2)).ok
    assert (await budgets.reserve(UUID, _res("b"), ttl_s=0.2)).ok
    await asyncio.sleep(0.35)
    fresh = await budgets.reserve(UUID, _res("c"), ttl_s=30)
    assert fresh.ok and not fresh.shares_weights and fresh.sum_memory_mb == 30_000


async def test_a_re_reservation_that_leaves_its_group_hands_the_weights_on(budgets: GpuBudgets) -> None:
    # The balancer reserves an instance with its whole memory; its invoker re-reserves it with its group.
    assert (await budgets.reserve(UUID, _res("a"), ttl_s=30)).ok
    placed = await budgets.reserve(UUID, _res("b", weights=0, group=""), ttl_s=30)
    assert placed.memory_mb == 30_000 and placed.sum_memory_mb == 60_000
    attached = await budgets.reserve(UUID, _res("b"), ttl_s=30)
    assert attached.shares_weights and attached.sum_memory_mb == 40_000
    # The carrier becomes another function's (a re-targeted share): its old group keeps its weights.
    moved = await budgets.reserve(UUID, _res("a", group=weights_group("invoker0", "guest/new", "1")), ttl_s=30)
    assert moved.ok and not moved.shares_weights
    budget = await _budget(budgets)
    assert _carriers(budget) == {"a", "b"} and budget.sum_memory_mb == 60_000
    # A refused re-reservation changes nothing.
    refused = await budgets.reserve(UUID, _res("b", memory=60_000, weights=0, group=""), ttl_s=30)
    assert not refused.ok
    assert (await _budget(budgets)).sum_memory_mb == 60_000


async def test_a_carrier_leaving_its_group_counts_the_weights_its_heir_takes_on(budgets: GpuBudgets) -> None:
    assert (await budgets.reserve(UUID, _res("a"), ttl_s=30)).ok  # 30 GB, 20 of them weights
    assert (await budgets.reserve(UUID, _res("b"), ttl_s=30)).shares_weights  # 10 GB
    assert (await budgets.reserve(UUID, _res("c", weights=0), ttl_s=30)).ok  # 30 GB: 70 of 80 GB
    # "a" re-reserved as another function's 30 GB: "b" would carry the 20 GB → 90 GB > 80 GB.
    moved = await budgets.reserve(UUID, _res("a", group=weights_group("invoker0", "guest/new", "1")), ttl_s=30)
    assert not moved.ok and moved.reason == "memory would reach 90000 MB > 80000 MB"
    budget = await _budget(budgets)
    assert _carriers(budget) == {"a"} and budget.sum_memory_mb == 70_000
    assert (await budgets.reserve(UUID, _res("a", memory=20_000, group=weights_group("invoker0", "guest/new", "1")),
                                  ttl_s=30)).sum_memory_mb == 80_000
    assert _carriers(await _budget(budgets)) == {"a", "b"}


async def test_reconcile_restores_a_group_with_one_carrier(budgets: GpuBudgets) -> None:
    for name in ("a", "b", "gone"):
        assert (await budgets.reserve(UUID, _res(name), ttl_s=30)).ok
    # The invoker restarted: "a" still runs, "b" lost its reservation, "gone" is gone.
    await budgets.release(UUID, "b")
    dropped, restored = await budgets.reconcile(UUID, invoker="invoker0", live={"a": _res("a"), "b": _res("b")},
                                                ttl_s=30)
    assert (dropped, restored) == (1, 1)
    budget = await _budget(budgets)
    assert set(budget.reservations) == {"a", "b"} and len(_carriers(budget)) == 1
    assert budget.sum_memory_mb == 40_000


def test_weights_beyond_the_declared_memory_are_refused() -> None:
    with pytest.raises(ValueError, match="weights_mb"):
        _res("a", memory=1000, weights=1001)
    with pytest.raises(ValueError, match="weights_mb"):
        _res("a", weights=-1)


async def test_a_cache_kept_for_a_grace_period_holds_only_the_weights_until_its_lease_lapses(
        budgets: GpuBudgets) -> None:
    # Staged exit: whatever keeps the weights on the GPU after the last instance reserves as a member of the
    # group holding just the weights, with a lease of the grace period that nobody renews.
    assert (await budgets.reserve(UUID, _res("a"), ttl_s=30)).ok
    keeper = await budgets.reserve(UUID, _res("cache:guest/llm", memory=20_000, weights=20_000), ttl_s=0.3)
    assert keeper.ok and keeper.memory_mb == 0 and keeper.sum_memory_mb == 30_000
    await budgets.release(UUID, "a")  # the last instance goes: the cache carries the weights
    budget = await _budget(budgets)
    assert budget.sum_memory_mb == 20_000 and _carriers(budget) == {"cache:guest/llm"}
    again = await budgets.reserve(UUID, _res("b"), ttl_s=30)  # the next instance maps the cached weights
    assert again.shares_weights and again.sum_memory_mb == 30_000
    await asyncio.sleep(0.45)  # the grace period ends: "b" carries them now
    assert (await budgets.reserve(UUID, _res("c"), ttl_s=30)).sum_memory_mb == 40_000
    assert _carriers(await _budget(budgets)) == {"b"}
