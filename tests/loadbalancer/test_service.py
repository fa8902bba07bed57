"""The balancer service against a real Redis, with invokers' reports written as invokers write them."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as aioredis

from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets, GpuCapacity
from dilu_invoker.invoker.cluster.registry import FunctionRegistry
from dilu_invoker.loadbalancer.service import Balancer, open_balancer
from dilu_invoker.model import Action, Exec, Parameter
from dilu_invoker.wire import (
    Decision,
    GpuReport,
    InstanceCommand,
    InstanceRecord,
    Keys,
    LoadReport,
    RoutingTable,
    decode,
    from_stream,
    pack,
)

PREFIX = "svc:"
KEYS = Keys(PREFIX)


def _cfg() -> config.Config:
    base = config.load(environ={})
    return replace(base, redis=replace(base.redis, prefix=PREFIX),
                   balancer=replace(base.balancer, tick_s=0.2, lease_ttl_s=1.0))


async def _invoker(redis: aioredis.Redis, name: str, *, gpus: int = 1, boot: str = "boot") -> None:
    """What an invoker's reporter writes: GPU budgets, report, boot key, membership."""
    budgets = GpuBudgets(redis, PREFIX)
    report = LoadReport(invoker=name, boot=boot, at_ms=int(time.time() * 1000),
                        gpus=tuple(GpuReport(index=i, uuid=f"{name}-gpu{i}", memory_mb=16000) for i in range(gpus)))
    for g in report.gpus:
        await budgets.register_gpu(g.uuid, GpuCapacity(node=name, index=g.index, name="t", memory_mb=16000,
                                                       sm_count=132))
    await redis.set(KEYS.report(name), pack(report), px=60_000)
    await redis.set(KEYS.boot(name), boot, px=60_000)
    await redis.sadd(KEYS.invokers, name)


async def _function(redis: aioredis.Redis, name: str = "f", **annotations: object) -> None:
    action = Action(namespace="guest", name=name, exec=Exec(kind="python:3-gpu", code="def main(a): return a"),
                    revision="1-x", annotations=tuple(Parameter(k, v) for k, v in annotations.items()))
    await FunctionRegistry(redis, KEYS).ensure(action)


async def _heartbeat(beats: list[float]) -> None:
    """The event loop's pulse: a beat every 20 ms while the loop is free."""
    while True:
        beats.append(time.monotonic())
        await asyncio.sleep(0.02)


async def _commands(redis: aioredis.Redis, invoker: str) -> list[InstanceCommand]:
    return [from_stream(InstanceCommand, f) for _, f in await redis.xrange(KEYS.commands(invoker))]


async def _until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_demand_places_reserves_and_commands(redis: aioredis.Redis) -> None:
    await _invoker(redis, "invoker0")
    await _function(redis, "f", **{"gpu-sm-request": 0.25, "gpu-memory-mb": 3000})
    async with open_balancer(_cfg(), redis, holder="solo") as balancer:
        await redis.xadd(KEYS.demand, {"f": "guest/f", "i": "invoker0"})

        async def started() -> bool:
            return bool(await _commands(redis, "invoker0"))

        await _until(started)
        assert balancer.leading is not None
        epoch = balancer.leading.epoch
    [cmd] = await _commands(redis, "invoker0")
    assert (cmd.op, cmd.function, cmd.gpu, cmd.gpu_uuid, cmd.request, cmd.epoch, cmd.boot) == (
        "start", "guest/f", 0, "invoker0-gpu0", 0.25, epoch, "boot")
    record = decode(InstanceRecord, await redis.hget(KEYS.instances, cmd.instance))
    assert record is not None and record.state == "starting" and record.invoker == "invoker0"
    budget = await GpuBudgets(redis, PREFIX).get("invoker0-gpu0")
    assert budget is not None and set(budget.reservations) == {cmd.instance}
    assert budget.reservations[cmd.instance].memory_mb == 3000
    table = decode(RoutingTable, await redis.get(KEYS.route("guest/f")))
    assert table is not None and table.instances == ()  # not ready yet
    decisions = [from_stream(Decision, f).kind for _, f in await redis.xrange(KEYS.decisions)]
    assert decisions[:2] == ["scale-out", "place"]
    assert await redis.get(KEYS.lease) is None  # a leader that stops lets go at once


async def test_a_deposed_leader_writes_nothing(redis: aioredis.Redis) -> None:
    await _invoker(redis, "invoker0")
    await _function(redis, "f")
    old = Balancer(redis, _cfg(), holder="old")
    new = Balancer(redis, _cfg(), holder="new")
    lead_old = await old.campaign_once()
    assert lead_old is not None and await new.campaign_once() is None
    await redis.delete(KEYS.lease)  # the old leader paused past its lease
    lead_new = await new.campaign_once()
    assert lead_new is not None and lead_new.epoch == lead_old.epoch + 1
    await redis.xadd(KEYS.demand, {"f": "guest/f"})
    old._demand["guest/f"] = new._demand["guest/f"] = time.time()  # both saw the demand
    assert not await old.tick(lead_old)
    assert await redis.hlen(KEYS.instances) == 0 and await _commands(redis, "invoker0") == []
    assert await new.tick(lead_new)
    [cmd] = await _commands(redis, "invoker0")
    assert cmd.epoch == lead_new.epoch and await redis.hlen(KEYS.instances) == 1


async def test_a_standby_takes_over_with_the_table(redis: aioredis.Redis) -> None:
    await _invoker(redis, "invoker0")
    await _function(redis, "f", **{"min-instances": 1})
    first = Balancer(redis, _cfg(), holder="first")
    lead = await first.campaign_once()
    assert lead is not None and await first.tick(lead)
    assert await redis.hlen(KEYS.instances) == 1
    await redis.delete(KEYS.lease)
    second = Balancer(redis, _cfg(), holder="second")
    lead2 = await second.campaign_once()
    assert lead2 is not None
    for _ in range(3):
        assert await second.tick(lead2)
    # min-instances is already met by the predecessor's starting instance: nothing is started twice.
    assert len(await _commands(redis, "invoker0")) == 1 and await redis.hlen(KEYS.instances) == 1


async def _leading_with(redis: aioredis.Redis, monkeypatch, plan) -> tuple[Balancer, Any]:  # type: ignore[no-untyped-def]
    """A leader of one invoker and one function held at one instance, planning with `plan` in place of
    `plan_tick`."""
    from dilu_invoker.loadbalancer import service

    monkeypatch.setattr(service, "plan_tick", plan)
    await _invoker(redis, "invoker0")
    await _function(redis, "f", **{"min-instances": 1})
    balancer = Balancer(redis, _cfg(), holder="solo")
    lead = await balancer.campaign_once()
    assert lead is not None
    return balancer, lead


async def test_each_tick_tells_the_plan_when_the_last_applied_tick_ran(redis: aioredis.Redis,
                                                                        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The plan learns the `now` of this leader's last applied tick (`TickInput.last_tick_at`), so the scaler's
    windows survive slow ticks; a new leader's first tick knows none."""
    from dilu_invoker.loadbalancer import service

    seen: list[tuple[float, float | None]] = []
    real = service.plan_tick

    def plan(inp, cfg):  # type: ignore[no-untyped-def]
        seen.append((inp.now, inp.last_tick_at))
        return real(inp, cfg)

    balancer, lead = await _leading_with(redis, monkeypatch, plan)
    for _ in range(3):
        assert await balancer.tick(lead)
    assert [last for _, last in seen] == [None, seen[0][0], seen[1][0]]
    # The lease is taken over: the new leader's first tick knows no last tick (it carries no windows).
    await redis.delete(KEYS.lease)
    other = Balancer(redis, _cfg(), holder="other")
    lead2 = await other.campaign_once()
    assert lead2 is not None
    assert await other.tick(lead2)
    assert seen[-1][1] is None


async def test_an_unreadable_report_counts_as_gone(redis: aioredis.Redis) -> None:
    await _invoker(redis, "invoker0")
    await _invoker(redis, "invoker1")
    await redis.set(KEYS.report("invoker0"), b"\xc1garbage")
    await _function(redis, "f")
    balancer = Balancer(redis, _cfg(), holder="b")
    lead = await balancer.campaign_once()
    assert lead is not None
    balancer._demand["guest/f"] = time.time()
    assert await balancer.tick(lead)
    assert [c.gpu_uuid for c in await _commands(redis, "invoker1")] == ["invoker1-gpu0"]
    assert await _commands(redis, "invoker0") == []


def test_the_command_refuses_what_cannot_work(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from dilu_invoker.loadbalancer import service

    # Configuring logs would bind structlog to this test's captured stderr, closed after it.
    monkeypatch.setattr(service.logs, "configure", lambda cfg: None)
    base = _cfg()
    assert service.main(base) == 2
    assert "--redis-url" in capsys.readouterr().err
    bad = replace(base, redis=replace(base.redis, url="redis://127.0.0.1:1"),
                  balancer=replace(base.balancer, strategy="nope"))
    assert service.main(bad) == 2
    assert "unknown placement strategy 'nope'" in capsys.readouterr().err
    tiny = replace(bad, balancer=replace(base.balancer, window=3, scale_out_samples=5))
    assert service.main(tiny) == 2
    assert "scale_out_samples" in capsys.readouterr().err


async def test_a_long_plan_does_not_hold_the_event_loop(redis: aioredis.Redis, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """At tens of thousands of instances a plan takes seconds of CPU (docs/benchmarks/planner-scale.md); it runs off
    the event loop, so the leader keeps renewing its lease and reading demand meanwhile (the test's own loop guard
    fails it too if the plan blocks the loop)."""
    from dilu_invoker.loadbalancer import service

    real = service.plan_tick

    def slow_plan(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.8)  # a plan as slow as a huge cluster's, holding the GIL only as pure Python does
        return real(*args, **kwargs)

    balancer, lead = await _leading_with(redis, monkeypatch, slow_plan)
    beats: list[float] = []
    beat = asyncio.create_task(_heartbeat(beats))
    t0 = time.monotonic()
    assert await balancer.tick(lead)
    took = time.monotonic() - t0
    beat.cancel()
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert took >= 0.8 and len(beats) > 10 and max(gaps) < 0.3, (took, len(beats), max(gaps, default=None))
    assert await redis.hlen(KEYS.instances) == 1  # and the plan was applied


def test_the_snapshot_counts_a_gpu_and_an_instance_once_and_falls_back_to_the_report() -> None:
    """`cluster_of`, the pure half of the tick's snapshot (run off the event loop): a GPU two invokers report counts
    for the first, an instance reserved on two GPUs counts on the first, a GPU without a budget has the memory its
    report gives, and a disabled invoker's GPUs take nothing new."""
    from dilu_invoker.gpu.budgets import GpuBudget, GpuCapacity, Reservation
    from dilu_invoker.loadbalancer.service import cluster_of
    from dilu_invoker.policy import GpuRef

    def res(iid: str) -> Reservation:
        return Reservation(instance=iid, function="guest/f", cls="inference", invoker="a", request=0.2, limit=0.4,
                           memory_mb=1000)

    cap = GpuCapacity(node="a", index=0, name="t", memory_mb=16000, sm_count=132)
    budgets = {"u0": GpuBudget("u0", cap, {"i1": res("i1")}), "u1": GpuBudget("u1", cap, {"i1": res("i1"), "i2": res("i2")}),
               "u2": None}
    reports = {
        "a": LoadReport(invoker="a", boot="b", at_ms=0, gpus=(GpuReport(index=0, uuid="u0", memory_mb=16000),
                                                              GpuReport(index=1, uuid="u1", memory_mb=16000))),
        "b": LoadReport(invoker="b", boot="b", at_ms=0, enabled=False,
                        gpus=(GpuReport(index=0, uuid="u1", memory_mb=16000), GpuReport(index=1, uuid="u2", memory_mb=8000))),
    }
    cluster, evictable = cluster_of(0.0, reports, {}, budgets)
    assert cluster is not None and evictable == {}
    assert [i.id for i in cluster.gpu(GpuRef("a", 0)).instances] == ["i1"]
    assert [i.id for i in cluster.gpu(GpuRef("a", 1)).instances] == ["i2"]
    assert GpuRef("b", 0) not in cluster.ordinals and GpuRef("b", 1) in cluster.ordinals  # u1 counted for "a"
    assert cluster.gpu(GpuRef("b", 1)).memory_mib == 8000.0 and not cluster.gpu(GpuRef("b", 1)).schedulable
    assert cluster_of(0.0, {}, {}, {}) == (None, {})


async def test_a_takeover_longer_than_the_lease_keeps_the_lease(redis: aioredis.Redis, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A new leader of a large cluster loads its predecessor's records and routing tables for longer than the lease
    (tens of thousands of records take seconds): it renews the lease meanwhile, and the records are decoded off
    the event loop, so it leads afterwards instead of stepping down before its first tick (and campaigning again,
    forever, as it did at 32,000 instances: bench/leader_scale.py)."""
    from dilu_invoker.loadbalancer import service

    real = service._decode_records

    def slow_decode(raws):  # type: ignore[no-untyped-def]
        time.sleep(2.5)  # 2.5 leases of 1 s, as pure Python holds the GIL
        return real(raws)

    monkeypatch.setattr(service, "_decode_records", slow_decode)
    await _invoker(redis, "invoker0")
    await _function(redis, "f", **{"min-instances": 1})
    await redis.hset(KEYS.instances, "gone-1", pack(InstanceRecord(
        id="gone-1", function="guest/f", rev="1-x", invoker="invoker9", gpu=0, gpu_uuid="invoker9-gpu0",
        cls="inference", request=0.2, limit=0.4, memory_mb=1000, state="ready")))
    balancer = Balancer(redis, _cfg(), holder="solo")
    beats: list[float] = []
    beat = asyncio.create_task(_heartbeat(beats))
    lead = await balancer.campaign_once()
    beat.cancel()
    assert lead is not None and "gone-1" in balancer._records
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert len(beats) > 50 and max(gaps) < 0.3, (len(beats), max(gaps, default=None))
    holder = await balancer.lease.holder_of(redis)
    assert holder is not None and holder[0] == "solo" and holder[1] == lead.epoch
    assert await balancer.tick(lead)  # it still leads: the tick is applied under the same lease


def test_long_lived_objects_leave_the_collector_between_ticks_and_come_back() -> None:
    """After each tick what is alive is frozen out of the collector's full passes; every `thaw_every` ticks, and
    when the leader stops, it goes back, so garbage in a cycle among it is collected after all."""
    import gc
    import weakref

    from dilu_invoker.loadbalancer.service import LongLived

    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the cyclic collector frees it

    gc.unfreeze()
    keep = LongLived(thaw_every=3)
    try:
        node = Node()
        alive = weakref.ref(node)
        keep.after_tick()
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: no pass looks at it
        keep.after_tick()
        keep.after_tick()  # the third: thawed
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert alive() is None  # back in view, collected
        keep.after_tick()
        assert gc.get_freeze_count() > 0
        keep.release()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def _full_passes(allocate: int) -> int:
    """How many full collections run while `allocate` new containers are made and kept."""
    import gc

    passes = 0

    def seen(phase: str, info: dict[str, int]) -> None:
        nonlocal passes
        if phase == "start" and info["generation"] == 2:
            passes += 1

    gc.callbacks.append(seen)
    try:
        kept = [[] for _ in range(allocate)]
        del kept
    finally:
        gc.callbacks.remove(seen)
    return passes


def test_a_tick_on_a_frozen_heap_runs_no_full_collection() -> None:
    """Between `before_tick` and `after_tick` on a frozen heap no full collection falls due (young ones still run),
    and the thresholds are CPython's again after the tick; a tick after a thaw keeps its full passes, so the thawed
    heap is collected."""
    import gc

    from dilu_invoker.loadbalancer.service import LongLived

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults, whatever an earlier test left
    thresholds = gc.get_threshold()
    keep = LongLived(thaw_every=2)
    try:
        keep.freeze()
        gc.collect()  # what the collector counts as long-lived: what is not frozen (little)
        assert _full_passes(200_000) > 0, "no full pass without the tick's setting: the test exercises nothing"
        keep.before_tick()
        assert _full_passes(200_000) == 0
        keep.after_tick()  # the first: frozen again
        assert gc.get_threshold() == thresholds
        keep.before_tick()
        assert _full_passes(200_000) == 0
        keep.after_tick()  # the second: thawed
        assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
        keep.before_tick()
        assert gc.get_threshold() == thresholds
        assert _full_passes(200_000) > 0
        keep.after_tick()
        keep.before_tick()
        keep.release()  # a leader that stops mid-tick gives the thresholds back too
        assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def test_ticks_of_two_leaders_in_one_process_give_the_thresholds_back() -> None:
    """Two leaders in one process whose ticks overlap (each awaits Redis mid-tick): the collector's thresholds
    stay raised while either tick runs and are the process's own once both have ended, in either order; a
    second `before_tick` without an `after_tick` counts once."""
    import gc

    from dilu_invoker.loadbalancer.service import LongLived

    thresholds = gc.get_threshold()
    a, b = LongLived(), LongLived()
    try:
        a.freeze()
        b.freeze()
        for first, second in ((a, b), (b, a)):
            first.before_tick()
            first.before_tick()
            second.before_tick()
            assert gc.get_threshold()[2] == LongLived.NO_FULL_PASS
            first.after_tick()
            assert gc.get_threshold()[2] == LongLived.NO_FULL_PASS  # the other tick still runs
            second.after_tick()
            assert gc.get_threshold() == thresholds
        a.before_tick()
        b.before_tick()
        a.release()
        b.release()  # leaders that stop mid-tick
        assert gc.get_threshold() == thresholds
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


async def test_a_leader_cancelled_as_it_is_woken_stops(redis: aioredis.Redis) -> None:
    """The tick's sleep ends on a wake (a demand signal) or its period. A cancellation that arrives in the same step
    as the wake must still cancel it (Python 3.11's `wait_for` returned normally there, and a leader cancelled then
    ticked on), and one during the sleep too."""
    b = Balancer(redis, _cfg(), holder="solo")
    sleeping = asyncio.create_task(b._sleep(10.0))
    await asyncio.sleep(0)
    b._wake.set()
    sleeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    b._wake.clear()
    sleeping = asyncio.create_task(b._sleep(10.0))
    await asyncio.sleep(0.01)
    sleeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    # Woken or timed out, it returns and clears the wake.
    b._wake.set()
    await asyncio.wait_for(b._sleep(10.0), 1.0)
    assert not b._wake.is_set()
    await asyncio.wait_for(b._sleep(0.01), 1.0)


async def test_a_leaders_ticks_run_on_a_frozen_heap_from_the_first(redis: aioredis.Redis) -> None:
    """What a takeover loaded is frozen before the first tick, so even the first tick runs with no full collection
    due; when the leader stops, the collector's thresholds are CPython's again and nothing stays frozen."""
    import gc

    from dilu_invoker.loadbalancer.service import LongLived

    thresholds = gc.get_threshold()
    b = Balancer(redis, _cfg(), holder="solo")
    seen: list[tuple[int, bool]] = []

    async def tick(lead):  # type: ignore[no-untyped-def]
        seen.append((gc.get_threshold()[2], gc.get_freeze_count() > 0))
        return len(seen) < 2  # the second: "the lease is lost", the leader steps down

    b.tick = tick  # type: ignore[method-assign]
    try:
        lead = await b.campaign_once()
        assert lead is not None
        await asyncio.wait_for(b._lead(lead), 10.0)
        assert seen == [(LongLived.NO_FULL_PASS, True)] * 2
        assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
