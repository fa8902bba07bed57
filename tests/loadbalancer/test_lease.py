"""The leader lease and fenced writes against a real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from dilu_invoker.loadbalancer.lease import LeaderLease, Ops
from dilu_invoker.wire import Keys

KEYS = Keys("t:")


async def _wait_acquire(lease: LeaderLease, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await lease.acquire()
        if got is not None:
            return got
        await asyncio.sleep(0.02)
    raise AssertionError("the lease was never free")


async def test_one_leader_then_a_higher_epoch_and_the_old_one_is_fenced(redis: aioredis.Redis) -> None:
    a = LeaderLease(redis, KEYS, holder="a", ttl_s=0.3)
    b = LeaderLease(redis, KEYS, holder="b", ttl_s=0.3)
    lead_a = await a.acquire()
    assert lead_a is not None and lead_a.epoch == 1 and lead_a.token == "a|1"
    assert await b.acquire() is None
    assert await a.renew(lead_a)
    ops = Ops()
    ops.hset("t:h", "k", b"from-a")
    assert await a.apply(lead_a, ops)
    lead_b = await _wait_acquire(b)  # a stopped renewing: the lease lapses
    assert lead_b.epoch == 2
    assert not await a.renew(lead_a)
    stale = Ops()
    stale.hset("t:h", "k", b"stale")
    stale.xadd("t:s", b"x", maxlen=10)
    assert not await a.apply(lead_a, stale)
    assert await redis.hget("t:h", "k") == b"from-a" and await redis.xlen("t:s") == 0
    fresh = Ops()
    fresh.hset("t:h", "k", b"from-b")
    fresh.publish("t:c", "m")
    fresh.srem("t:set", "x")
    fresh.set("t:k", b"v")
    fresh.hdel("t:h", "gone")
    assert await b.apply(lead_b, fresh) and fresh.count == 5
    assert await redis.hget("t:h", "k") == b"from-b" and await redis.get("t:k") == b"v"
    assert not await a.release(lead_a)  # not its lease any more
    assert await a.holder_of(redis) == ("b", 2)
    assert await b.release(lead_b) and await a.holder_of(redis) is None


async def test_an_unknown_operation_is_refused_whole(redis: aioredis.Redis) -> None:
    lease = LeaderLease(redis, KEYS, holder="a", ttl_s=5)
    lead = await lease.acquire()
    assert lead is not None
    with pytest.raises(ResponseError, match="unknown operation"):
        await lease.apply(lead, ["set", "t:x", "1", "drop", "t:x"])
    with pytest.raises(ResponseError, match="unknown operation"):
        await lease.apply(lead, ["set", "t:x", "1", "hset", "t:h"])  # too few arguments
    assert await redis.exists("t:x", "t:h") == 0
