from __future__ import annotations

import asyncio
import math

import pytest

from dilu_invoker.gpu.budgets import GpuBudgets, GpuCapacity, Reservation

UUID = "GPU-test-0"


def _res(name: str, request: float = 0.1, limit: float = 0.2, memory: int = 1000, invoker: str = "0") -> Reservation:
    return Reservation(instance=name, function="guest/f", cls="inference", invoker=invoker,
                       request=request, limit=limit, memory_mb=memory)


@pytest.fixture
async def budgets(redis, request):
    """A GPU with Dilu's Σ limit ≤ 1.5, or the bound a test names (`gamma` parameter)."""
    gamma = request.node.callspec.params.get("gamma", 1.5) if hasattr(request.node, "callspec") else 1.5
    b = GpuBudgets(redis, prefix="t:")
    await b.register_gpu(UUID, GpuCapacity(node="0", index=0, name="Test", memory_mb=80_000, sm_count=132,
                                           gamma=gamma))
    return b


async def test_concurrent_reservations_never_oversubscribe(budgets: GpuBudgets) -> None:
    results = await asyncio.gather(*(budgets.reserve(UUID, _res(f"i{n}", request=0.15, limit=0.15), ttl_s=30)
                                     for n in range(20)))
    admitted = [r for r in results if r.ok]
    assert len(admitted) == 6  # 6 × 0.15 = 0.9; a 7th would pass 1.0
    assert all("SM requests" in r.reason for r in results if not r.ok)
    budget = await budgets.get(UUID)
    assert budget is not None and budget.sum_request == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("first", "second", "ok", "reason"),
    [
        (_res("a", 0.5, 1.0), _res("b", 0.4, 0.6), False, "gamma"),
        (_res("a", 0.5, 0.7), _res("b", 0.4, 0.8), True, "reserved"),
        (_res("a", 0.1, 0.1, 70_000), _res("b", 0.1, 0.1, 20_000), False, "memory"),
        (_res("a", 0.6, 0.6), _res("b", 0.5, 0.5), False, "SM requests"),
    ],
    ids=["limits-over-gamma", "limits-within-gamma", "memory-full", "requests-over-one"],
)
async def test_admission_rules(budgets: GpuBudgets, first: Reservation, second: Reservation, ok: bool, reason: str) -> None:
    assert (await budgets.reserve(UUID, first, ttl_s=30)).ok
    result = await budgets.reserve(UUID, second, ttl_s=30)
    assert result.ok is ok
    assert reason in result.reason


@pytest.mark.parametrize("gamma", [math.inf])
async def test_without_a_limit_bound_requests_and_memory_admit(budgets: GpuBudgets, gamma: float) -> None:
    # The default capacity (no Σ-limit bound) travels through msgpack and the Lua script as +inf.
    assert GpuCapacity(node="0", index=0, name="x", memory_mb=1, sm_count=1).gamma == gamma
    budget = await budgets.get(UUID)
    assert budget is not None and budget.capacity.gamma == gamma
    for n in range(4):  # Σ limit 4.0, Σ request 0.8
        assert (await budgets.reserve(UUID, _res(f"i{n}", 0.2, 1.0), ttl_s=30)).ok
    result = await budgets.reserve(UUID, _res("over", 0.3, 1.0), ttl_s=30)
    assert not result.ok and "SM requests" in result.reason


async def test_reservation_expires_unless_renewed(budgets: GpuBudgets) -> None:
    assert (await budgets.reserve(UUID, _res("kept", 0.5, 0.5), ttl_s=0.3)).ok
    assert (await budgets.reserve(UUID, _res("lost", 0.5, 0.5), ttl_s=0.3)).ok
    assert not (await budgets.reserve(UUID, _res("new", 0.5, 0.5), ttl_s=30)).ok
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await budgets.renew(UUID, ["kept"], ttl_s=0.3) == 1
    # "lost" was not renewed: its lease lapsed and its share is free again.
    assert (await budgets.reserve(UUID, _res("new", 0.5, 0.5), ttl_s=30)).ok
    budget = await budgets.get(UUID)
    assert budget is not None and set(budget.reservations) == {"kept", "new"}


async def test_release_and_shares(budgets: GpuBudgets) -> None:
    assert (await budgets.reserve(UUID, _res("a", 0.3, 0.6), ttl_s=30)).ok
    await budgets.set_shares(UUID, {"a": 0.55})
    budget = await budgets.get(UUID)
    assert budget is not None and budget.shares == {"a": 0.55}
    assert budget.fragmentation == pytest.approx(0.7)
    await budgets.release(UUID, "a")
    budget = await budgets.get(UUID)
    assert budget is not None and budget.reservations == {} and budget.shares == {}


async def test_reconcile_after_invoker_restart(budgets: GpuBudgets) -> None:
    # Before the restart: three containers; one died while the invoker was down, one reservation was lost.
    for name in ("alive", "dead"):
        assert (await budgets.reserve(UUID, _res(name, invoker="7"), ttl_s=30)).ok
    assert (await budgets.reserve(UUID, _res("other-node", invoker="8"), ttl_s=30)).ok
    live = {"alive": _res("alive", invoker="7"), "lost": _res("lost", invoker="7")}
    dropped, restored = await budgets.reconcile(UUID, invoker="7", live=live, ttl_s=30)
    assert (dropped, restored) == (1, 1)
    budget = await budgets.get(UUID)
    assert budget is not None and set(budget.reservations) == {"alive", "lost", "other-node"}


async def test_unknown_gpu_is_refused(budgets: GpuBudgets) -> None:
    result = await budgets.reserve("GPU-missing", _res("x"), ttl_s=30)
    assert not result.ok and "unknown GPU" in result.reason


async def test_get_many_reads_what_get_reads_in_one_round_trip(budgets: GpuBudgets) -> None:
    other = "GPU-other"
    await budgets.register_gpu(other, GpuCapacity(node="1", index=0, name="Test", memory_mb=40_000, sm_count=132))
    assert (await budgets.reserve(UUID, _res("a", 0.3, 0.6), ttl_s=30)).ok
    assert (await budgets.reserve(UUID, _res("gone", 0.2, 0.2), ttl_s=0.05)).ok
    assert (await budgets.reserve(other, _res("b", 0.4, 0.4, invoker="1"), ttl_s=30)).ok
    await budgets.set_shares(UUID, {"a": 0.5})
    await asyncio.sleep(0.1)  # "gone" lapses: get_many drops it as get does, unless asked for expired ones
    many = await budgets.get_many([UUID, "GPU-missing", other])
    assert list(many) == [UUID, "GPU-missing", other] and many["GPU-missing"] is None
    assert many[UUID] == await budgets.get(UUID) and many[other] == await budgets.get(other)
    assert set(many[UUID].reservations) == {"a"} and many[UUID].shares == {"a": 0.5}  # type: ignore[union-attr]
    expired = await budgets.get_many([UUID], include_expired=True)
    assert set(expired[UUID].reservations) == {"a", "gone"}  # type: ignore[union-attr]
    assert await budgets.get_many([]) == {}


async def test_get_many_of_more_than_a_chunk_decodes_off_the_loop_to_the_same_answer(
        budgets: GpuBudgets, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of GPUs (a leader's first read) are decoded in a worker thread, to what `get` reads."""
    from dilu_invoker.gpu import budgets as module

    uuids = [f"GPU-many-{k}" for k in range(module.READ_CHUNK + 30)]
    for at in range(0, len(uuids), 50):
        await asyncio.gather(*(budgets.register_gpu(u, GpuCapacity(node="n", index=at + k, name="Test",
                                                                   memory_mb=40_000, sm_count=132))
                               for k, u in enumerate(uuids[at : at + 50])))
    assert (await budgets.reserve(uuids[-1], _res("last", invoker="n"), ttl_s=30)).ok
    threads: list[object] = []
    real = asyncio.to_thread

    async def counting(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        threads.append(fn)
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(module.asyncio, "to_thread", counting)
    many = await budgets.get_many([*uuids, "GPU-missing"])
    assert len(threads) == 1 and many["GPU-missing"] is None
    assert many[uuids[-1]] == await budgets.get(uuids[-1]) and set(many[uuids[-1]].reservations) == {"last"}  # type: ignore[union-attr]
    assert [many[u] for u in uuids[:: 97]] == [await budgets.get(u) for u in uuids[:: 97]]
    await budgets.get_many(uuids[:10])
    assert len(threads) == 1  # a few GPUs are decoded in place
