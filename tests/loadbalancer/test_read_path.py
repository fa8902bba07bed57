"""The leader's reads of the invokers' reports and the function registry (`Balancer._read_reports`, `_read_specs`)
against a real Redis: over reads in which reports, members and specs change, each read answers what decoding every
value afresh answers (tests/test_wire_reports.py checks the decoder itself)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis

from dilu_invoker import config
from dilu_invoker.loadbalancer import service
from dilu_invoker.loadbalancer.service import Balancer
from dilu_invoker.wire import FunctionSpec, Keys, LoadReport, WireError, decode, pack, text
from tests.test_wire_reports import TRICKY, same

PREFIX = "rp:"
KEYS = Keys(PREFIX)


def _balancer(redis: aioredis.Redis) -> Balancer:
    base = config.load(environ={})
    return Balancer(redis, replace(base, redis=replace(base.redis, prefix=PREFIX)), holder="t")


async def _plain_reports(redis: aioredis.Redis) -> tuple[dict[str, LoadReport], frozenset[str]]:
    names = {text(m) for m in await redis.smembers(KEYS.invokers)}
    out = {}
    for name in names:
        try:
            report = decode(LoadReport, await redis.get(KEYS.report(name)))
        except WireError:
            continue
        if report is not None:
            out[name] = report
    return out, frozenset(names)


def _report(rng: random.Random, name: str, at: int) -> dict[str, Any]:
    return {"invoker": name, "boot": "b", "at_ms": at, "enabled": rng.choice([True, 1, False]),
            "gpus": [{"index": i, "uuid": f"{name}-g{i}", "memory_mb": rng.choice([81920, 81920.0])}
                     for i in range(2)],
            "instances": [{"id": f"{name}-i{k}", "function": "ns/f", "rev": "1", "state": "ready", "gpu": k % 2,
                           "arrival_rate": rng.choice([0.0, 0, -0.0, rng.uniform(0, 9)]),
                           "latency_ms": rng.choice([None, 0, 1.0, 1]), "new": rng.choice(TRICKY)}
                          for k in range(rng.randint(0, 3))],
            "functions": [{"function": "ns/f", "arrival_rate": rng.choice([1, 1.0, True])}] if rng.random() < 0.5 else []}


@pytest.fixture(params=[3, service.READ_CHUNK], ids=["chunks-of-3", "one-chunk"])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Keys per script call: 3 makes several calls, some of whose replies change while others do not."""
    monkeypatch.setattr(service, "READ_CHUNK", request.param)
    return int(request.param)


async def test_the_reports_read_are_those_decoded_afresh(redis: aioredis.Redis, chunk: int) -> None:
    rng = random.Random(5)
    balancer = _balancer(redis)
    names = [f"invoker{k}" for k in range(8)]
    for tick in range(25):
        for name in names:
            roll = rng.random()
            if roll < 0.1:
                await redis.srem(KEYS.invokers, name)  # gone from the set
            elif roll < 0.2:
                await redis.delete(KEYS.report(name))  # its report expired
            elif roll < 0.25:
                await redis.set(KEYS.report(name), rng.choice([b"\xc1", msgpack.packb([1]), b"\x81\xa1a"]))  # bad
            elif roll < 0.5:
                pass  # the same bytes as last time
            else:
                await redis.sadd(KEYS.invokers, name)
                await redis.set(KEYS.report(name), msgpack.packb(_report(rng, name, 1000 * tick)))
        got, known = await balancer._read_reports()
        want, want_known = await _plain_reports(redis)
        assert known == want_known and list(got) == sorted(got, key=lambda n: int(n[7:]))
        assert got.keys() == want.keys()
        for name in got:
            assert same(got[name], want[name]), name
        # The decoder turned: it holds what this read decoded, nothing older.
        assert not any(balancer._report_decoder._seen.values())
    assert (await balancer.read_reports()).keys() == (await _plain_reports(redis))[0].keys()


async def test_no_invoker_no_report(redis: aioredis.Redis) -> None:
    balancer = _balancer(redis)
    assert await balancer._read_reports() == ({}, frozenset())
    await redis.sadd(KEYS.invokers, "invoker0")
    assert await balancer._read_reports() == ({}, frozenset({"invoker0"}))


async def test_the_specs_read_are_those_decoded_afresh(redis: aioredis.Redis, chunk: int) -> None:
    rng = random.Random(7)
    balancer = _balancer(redis)
    assert await balancer._read_specs() == {}
    fqns = [f"ns/f{k}" for k in range(12)]
    for tick in range(20):
        for fqn in fqns:
            roll = rng.random()
            if roll < 0.1:
                await redis.srem(KEYS.functions, fqn)  # unregistered
            elif roll < 0.15:
                await redis.hdel(KEYS.function(fqn), "meta")
            elif roll < 0.2:
                await redis.hset(KEYS.function(fqn), "meta", b"\xc1")  # unreadable
            elif roll < 0.5:
                pass
            else:
                spec = FunctionSpec(fqn=fqn, rev=f"{tick}-a", kind="python:3-gpu", cls="inference",
                                    request=rng.choice([0.5, 1, 1.0]), limit=1.0, memory_mb=rng.choice([1024, 1024.0]),
                                    max_instances=rng.choice([1, True]))
                await redis.sadd(KEYS.functions, fqn)
                await redis.hset(KEYS.function(fqn), "meta", pack(spec))
        got = await balancer._read_specs()
        want = {}
        for fqn in sorted(text(m) for m in await redis.smembers(KEYS.functions)):
            try:
                spec = decode(FunctionSpec, await redis.hget(KEYS.function(fqn), "meta"))
            except WireError:
                continue
            if spec is not None:
                want[fqn] = spec
        assert list(got) == list(want)
        for fqn in got:
            assert same(got[fqn], want[fqn]), fqn


async def test_a_changed_set_with_the_same_metas_is_read_anew(redis: aioredis.Redis) -> None:
    """Two functions holding the same meta bytes (a copied registry hash), one registered after the other."""
    balancer = _balancer(redis)
    meta = pack(FunctionSpec(fqn="ns/a", rev="1", kind="k", cls="inference", request=1.0, limit=1.0, memory_mb=1))
    for fqn in ("ns/a", "ns/b"):
        await redis.hset(KEYS.function(fqn), "meta", meta)
    await redis.sadd(KEYS.functions, "ns/a")
    assert list(await balancer._read_specs()) == ["ns/a"]
    await redis.srem(KEYS.functions, "ns/a")
    await redis.sadd(KEYS.functions, "ns/b")
    assert list(await balancer._read_specs()) == ["ns/b"]
