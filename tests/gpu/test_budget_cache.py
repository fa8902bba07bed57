"""`BudgetCache`: the balancer's per-tick read of the budgets re-reads only the GPUs whose budget may have changed,
and answers as `GpuBudgets.get_many` does (but for the leases' ends and the SM shares), on a real redis-server."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import msgpack

from dilu_invoker.gpu.budgets import BudgetCache, GpuBudget, GpuBudgets, GpuCapacity, Reservation

A, B, C = "GPU-a", "GPU-b", "GPU-c"


def _res(name: str, request: float = 0.1, memory: int = 1000, **kw: Any) -> Reservation:
    return Reservation(instance=name, function="guest/f", cls="inference", invoker="0", request=request,
                       limit=request, memory_mb=memory, **kw)


def _cap(node: str = "0", index: int = 0) -> GpuCapacity:
    return GpuCapacity(node=node, index=index, name="Test", memory_mb=40_000, sm_count=132)


def view(budgets: dict[str, GpuBudget | None]) -> dict[str, Any]:
    """What the snapshot reads of a budget: its capacity and reservations, without the leases' ends."""
    return {u: None if b is None else (b.capacity, {k: replace(r, expires_ms=0) for k, r in b.reservations.items()})
            for u, b in budgets.items()}


async def _same(cache: BudgetCache, budgets: GpuBudgets, uuids: list[str], read: int) -> None:
    got = await cache.get_many(uuids)
    assert list(got) == uuids
    assert view(got) == view(await budgets.get_many(uuids))
    assert cache.last_read == read


async def test_only_changed_gpus_are_read_again(redis) -> None:  # type: ignore[no-untyped-def]
    budgets = GpuBudgets(redis, prefix="t:")
    for i, uuid in enumerate((A, B)):
        await budgets.register_gpu(uuid, _cap(index=i))
    cache = BudgetCache(budgets, max_age_s=3600)
    assert (await budgets.reserve(A, _res("a1"), ttl_s=30)).ok
    await _same(cache, budgets, [A, B, C], read=3)  # the first read reads every GPU (C is not registered)
    await _same(cache, budgets, [A, B, C], read=0)
    assert (await budgets.reserve(B, _res("b1"), ttl_s=30)).ok
    await _same(cache, budgets, [A, B, C], read=1)
    assert await budgets.renew(A, ["a1"], ttl_s=60) == 1  # a lease extended: nothing a reader sees changed
    await budgets.set_shares(A, {"a1": 0.5})
    await _same(cache, budgets, [A, B, C], read=0)
    await budgets.release(B, "b1")
    await budgets.register_gpu(C, _cap(index=2))
    await _same(cache, budgets, [A, B, C], read=2)
    refused = await budgets.reserve(A, _res("big", request=0.95), ttl_s=30)
    assert not refused.ok
    await _same(cache, budgets, [A, B, C], read=0)  # a refusal that dropped nothing changed nothing
    # Shared weights: the carrier leaves, the next member of its group carries them (a change of both).
    for name in ("w1", "w2"):
        assert (await budgets.reserve(C, _res(name, memory=3000, weights_mb=2000, group="g"), ttl_s=30)).ok
    await _same(cache, budgets, [A, B, C], read=1)
    await budgets.release(C, "w1")
    got = await cache.get_many([A, B, C])
    assert cache.last_read == 1 and got[C] is not None and got[C].reservations["w2"].memory_mb == 3000
    await _same(cache, budgets, [B], read=0)  # a GPU no longer asked for is forgotten…
    await _same(cache, budgets, [A, B], read=1)  # …and read again when it is


async def test_a_lapsed_lease_is_seen_without_any_script(redis) -> None:  # type: ignore[no-untyped-def]
    budgets = GpuBudgets(redis, prefix="t:")
    await budgets.register_gpu(A, _cap())
    await budgets.register_gpu(B, _cap(index=1))
    assert (await budgets.reserve(A, _res("short"), ttl_s=0.3)).ok
    assert (await budgets.reserve(B, _res("long"), ttl_s=30)).ok
    cache = BudgetCache(budgets, max_age_s=3600)
    await _same(cache, budgets, [A, B], read=2)
    await asyncio.sleep(0.4)  # nothing bumps A: its lease, as read, has passed
    got = await cache.get_many([A, B])
    assert cache.last_read == 1 and got[A] is not None and got[A].reservations == {}
    assert view(got) == view(await budgets.get_many([A, B]))


async def test_a_lease_cut_shorter_counts_as_a_change(redis) -> None:  # type: ignore[no-untyped-def]
    budgets = GpuBudgets(redis, prefix="t:")
    await budgets.register_gpu(A, _cap())
    assert (await budgets.reserve(A, _res("a1"), ttl_s=30)).ok
    cache = BudgetCache(budgets, max_age_s=3600)
    await _same(cache, budgets, [A], read=1)
    assert await budgets.renew(A, ["a1"], ttl_s=0.2) == 1
    await _same(cache, budgets, [A], read=1)
    await asyncio.sleep(0.3)
    got = await cache.get_many([A])
    assert got[A] is not None and got[A].reservations == {}


async def test_a_writer_that_does_not_mark_changes_is_seen_after_max_age(redis) -> None:  # type: ignore[no-untyped-def]
    budgets = GpuBudgets(redis, prefix="t:")
    await budgets.register_gpu(A, _cap())
    cache = BudgetCache(budgets, max_age_s=0.3)
    await _same(cache, budgets, [A], read=1)
    # An older writer's reservation, written without marking the change: unseen until the GPU's read is too old.
    record = {"instance": "old", "function": "guest/f", "cls": "inference", "invoker": "0", "request": 0.2,
              "limit": 0.2, "memory_mb": 1000, "expires_ms": 2**52, "weights_mb": 0, "group": "",
              "shares_weights": False, "kept": False}
    await redis.hset(budgets.gpu_key(A), "r:old", msgpack.packb(record, use_bin_type=True))
    got = await cache.get_many([A])
    assert cache.last_read == 0 and got[A] is not None and got[A].reservations == {}
    await asyncio.sleep(0.35)
    got = await cache.get_many([A])
    assert cache.last_read == 1 and got[A] is not None and set(got[A].reservations) == {"old"}


async def test_a_sequence_gone_back_reads_everything(redis) -> None:  # type: ignore[no-untyped-def]
    budgets = GpuBudgets(redis, prefix="t:")
    await budgets.register_gpu(A, _cap())
    await budgets.register_gpu(B, _cap(index=1))
    cache = BudgetCache(budgets, max_age_s=3600)
    await _same(cache, budgets, [A, B], read=2)
    await redis.flushall()  # Redis lost its data
    await budgets.register_gpu(A, _cap())
    await _same(cache, budgets, [A, B], read=2)
