"""The REST API under load and while Redis fails: bounded pools answer 503 (never 500), and every
activation answered to a client gets its record, even when Redis died while it ran."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from ow_support.api import PY_CODE, Api, basic_auth
from ow_support.runners import ScriptedRunner

from dilu_invoker.model import GUEST_IDENTITY, Activation, ActivationResponse, annotations_of, new_activation_id
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.openwhisk.rest_common import Msg
from dilu_invoker.redis_embedded import EmbeddedRedis, free_port, redis_client
from dilu_invoker.store import EntityStore

GUEST = basic_auth(GUEST_IDENTITY)


async def _put_echo(api: Api) -> None:
    status, body, _ = await api.put_action("echo", {"exec": {"kind": "python:3", "code": PY_CODE}})
    assert status == 200, body


async def test_an_exhausted_redis_pool_answers_openwhisk_overload_not_500(
    redis_server: EmbeddedRedis, api_over: Any
) -> None:
    client = redis_client(redis_server.url, pool_size=2, pool_timeout_s=0.05)
    try:
        api = await api_over(EntityStore(client, prefix="t:"), auth=Authenticator([GUEST_IDENTITY]))
        await _put_echo(api)
        # Both pooled connections are held by blocking pops for a while: the next command cannot get one.
        holders = [asyncio.create_task(client.blpop([f"t:nothing{i}"], timeout=1)) for i in range(2)]
        await asyncio.sleep(0.1)
        status, body, headers = await api.call("GET", "actions/echo")
        assert status == 503
        assert body == {"error": Msg.OVERLOADED, "code": headers["X-Request-ID"]}
        await asyncio.gather(*holders)
        status, _, _ = await api.call("GET", "actions/echo")
        assert status == 200  # back-pressure released: served again
    finally:
        await client.aclose()


# 200 clients and the server share this test's loop: one turn serving them all can pass the guard's
# limit on a loaded machine without any blocking call.
@pytest.mark.allow_loop_block
async def test_waiting_for_a_connection_is_back_pressure_within_the_bound(
    redis_server: EmbeddedRedis, api_over: Any
) -> None:
    # 4 connections for 200 concurrent invokes: requests queue for a connection and all are served.
    client = redis_client(redis_server.url, pool_size=4, pool_timeout_s=10.0)
    try:
        api = await api_over(EntityStore(client, prefix="t:"), auth=Authenticator([GUEST_IDENTITY]))
        await _put_echo(api)
        statuses, ids = await _burst(api, 200)
        assert statuses == Counter({200: 200})
        for aid in ids:
            assert await api.store.get_activation("guest", aid) is not None
        assert client.connection_pool.max_connections == 4
    finally:
        await client.aclose()


async def _burst(api: Api, n: int, **params: str) -> tuple[Counter[int], list[str]]:
    """``n`` concurrent blocking invokes from their own connections (no client-side connection limit)."""
    url = api.client.make_url("/api/v1/namespaces/_/actions/echo")
    query = {"blocking": "true", **params}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> tuple[int, str | None]:
            async with session.post(url, params=query, json={}, headers=GUEST) as resp:
                await resp.read()
                return resp.status, resp.headers.get("x-openwhisk-activation-id")

        got = await asyncio.gather(*(one() for _ in range(n)))
    return Counter(s for s, _ in got), [aid for s, aid in got if s in (200, 202) and aid]


# 200 clients and the server share this test's loop: one turn serving them all can pass the guard's
# limit on a loaded machine without any blocking call.
@pytest.mark.allow_loop_block
async def test_200_concurrent_invokes_with_the_default_pool_are_all_served_and_recorded(
    redis_server: EmbeddedRedis, api_over: Any
) -> None:
    client = redis_client(redis_server.url)
    try:
        api = await api_over(EntityStore(client, prefix="t:"), auth=Authenticator([GUEST_IDENTITY]))
        await _put_echo(api)
        statuses, ids = await _burst(api, 200)
        assert statuses == Counter({200: 200})
        assert len(set(ids)) == 200
        for aid in ids:
            assert await api.store.get_activation("guest", aid) is not None
    finally:
        await client.aclose()


async def _restartable_redis(tmp_path: Path) -> EmbeddedRedis:
    server = EmbeddedRedis(tmp_path / "redis", port=free_port(), password="pw-test", persistent=True)
    await server.start()
    return server


async def test_activations_answered_while_redis_is_down_are_recorded_when_it_returns(
    tmp_path: Path, api_over: Any
) -> None:
    server = await _restartable_redis(tmp_path)
    client = redis_client(server.url, pool_timeout_s=0.5)
    runner = ScriptedRunner()
    try:
        store = EntityStore(client, prefix="t:", retry_period_s=0.05)
        api = await api_over(store, runner=runner, auth=Authenticator([GUEST_IDENTITY]))
        await _put_echo(api)
        # Activations in flight when Redis dies: they finish while it is down and are answered 200.
        invokes = [asyncio.create_task(api.invoke("echo", {"hold": True})) for _ in range(5)]
        while len(runner.requests) < 5:
            await asyncio.sleep(0.01)
        await server.stop()
        runner.release()
        answered = await asyncio.gather(*invokes)
        assert [status for status, _, _ in answered] == [200] * 5
        ids = [headers["x-openwhisk-activation-id"] for _, _, headers in answered]
        assert store.unstored == 5
        # New requests while Redis is down: 503 in OpenWhisk's shape, never 500.
        status, body, _ = await api.invoke("echo", {})
        assert status == 503 and body["error"] == Msg.OVERLOADED
        # The held records are readable meanwhile ...
        for aid in ids:
            assert (await store.get_activation("guest", aid)) is not None
        await server.start()
        assert await store.flush(10.0)
        # ... and in Redis once it is back (a second store, without the held copies, sees them).
        fresh = EntityStore(client, prefix="t:")
        for aid in ids:
            record = await fresh.get_activation("guest", aid)
            assert record is not None and record.response.success
    finally:
        await store.close()
        await client.aclose()
        await server.stop()


async def test_records_held_at_shutdown_are_saved_and_replayed(tmp_path: Path) -> None:
    server = await _restartable_redis(tmp_path)
    client = redis_client(server.url, pool_timeout_s=0.5)
    spill = tmp_path / "unstored-activations.jsonl"
    try:
        store = EntityStore(client, prefix="t:", spill_path=spill)
        await server.stop()
        records = [Activation(namespace="guest", name="echo", subject="guest", activation_id=new_activation_id(),
                              start=1000 + i, end=1001 + i, response=ActivationResponse.success({"i": i}),
                              logs=("l1",), annotations=annotations_of([("path", "guest/echo")]))
                   for i in range(3)]
        for r in records:
            await store.store_activation(r)
        assert store.unstored == 3
        await store.close(flush_timeout_s=0.2)
        assert spill.stat().st_mode & 0o777 == 0o600
        assert len(spill.read_bytes().splitlines()) == 3
        await server.start()
        again = EntityStore(client, prefix="t:", spill_path=spill)
        assert await again.replay_spilled() == 3
        assert not spill.exists()
        for r in records:
            assert await again.get_activation("guest", r.activation_id) == r
    finally:
        await client.aclose()
        await server.stop()


def test_pool_settings_are_validated() -> None:
    from dilu_invoker.config import ConfigError, RedisConfig

    with pytest.raises(ConfigError, match="--redis-pool-size"):
        RedisConfig(pool_size=0)
    with pytest.raises(ConfigError, match="--redis-pool-timeout-s"):
        dataclasses.replace(RedisConfig(), pool_timeout_s=0)
