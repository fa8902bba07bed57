"""Live compaction whose replacement the GPU budget refuses (a concurrent admission took the room): the
original keeps serving and the function owes nothing, so no extra instance is started. Real Redis."""

from __future__ import annotations

import time
from dataclasses import replace

import redis.asyncio as aioredis

from dilu_invoker.gpu.budgets import GpuBudgets, Reservation
from dilu_invoker.loadbalancer.service import Balancer
from dilu_invoker.wire import Decision, InstanceRecord, InstanceReport, from_stream, pack
from tests.loadbalancer.test_weights import KEYS, PREFIX, REV, TTL, _attach, _cfg, _function, _invoker, _starts


async def test_a_refused_compaction_replacement_is_not_owed_as_one_more_instance(redis: aioredis.Redis) -> None:
    """Live compaction moves f's instance a beside g's b; the budget refuses the replacement (its GPU
    filled meanwhile). The original keeps serving and nothing is owed: the next tick starts no extra
    instance of f."""
    names = {"invoker0": ("a", "guest/f"), "invoker1": ("b", "guest/g")}
    budgets = GpuBudgets(redis, PREFIX)
    for inv, (iid, fn) in names.items():
        await _invoker(redis, inv, instances=(InstanceReport(id=iid, function=fn, rev=REV, state="ready", gpu=0,
                                                             request=0.1, limit=0.2, memory_mb=2000),))
        await _function(redis, fn.split("/")[1], **{"gpu-memory-mb": 2000, "gpu-weights-mb": 0, "min-instances": 1})
        await redis.hset(KEYS.instances, iid, pack(InstanceRecord(
            id=iid, function=fn, rev=REV, invoker=inv, gpu=0, gpu_uuid=f"{inv}-gpu0", cls="inference", request=0.1,
            limit=0.2, memory_mb=2000, state="ready", since=time.time() - 60, epoch=0, boot="boot")))
        assert (await budgets.reserve(f"{inv}-gpu0", replace(_attach(iid, invoker=inv, function=fn, memory_mb=2000,
                                                                     weights_mb=0), group=""), ttl_s=TTL)).ok
    cfg = _cfg()
    cfg = replace(cfg, balancer=replace(cfg.balancer, compaction=True, compaction_period_s=60.0))
    balancer = Balancer(redis, cfg, holder="solo")
    lead = await balancer.campaign_once()
    assert lead is not None
    reserve = balancer.budgets.reserve
    rival = replace(_attach("rival", invoker="invoker1", function="guest/rival", memory_mb=14000, weights_mb=0),
                    group="")

    async def rival_first(uuid: str, reservation: Reservation, **kw: object):  # type: ignore[no-untyped-def]
        assert (await budgets.reserve(uuid, rival, ttl_s=TTL)).ok
        return await reserve(uuid, reservation, **kw)  # type: ignore[arg-type]

    balancer.budgets.reserve = rival_first  # type: ignore[method-assign]
    assert await balancer.tick(lead)
    moves = [from_stream(Decision, f) for _, f in await redis.xrange(KEYS.decisions)]
    assert [d.kind for d in moves] == ["move"] and "replaces a" in moves[0].reason
    assert await _starts(redis, "invoker1") == [] and set(await redis.hkeys(KEYS.instances)) == {b"a", b"b"}
    assert balancer._states.get("guest/f") is None or balancer._states["guest/f"].owed == 0
    # Nothing was started: the metrics count no move (a refused replacement is no cold start).
    assert balancer.metrics.totals["started"] == 0
    balancer.budgets.reserve = reserve  # type: ignore[method-assign]
    assert await balancer.tick(lead)
    assert await _starts(redis, "invoker0") == [] and await _starts(redis, "invoker1") == []
