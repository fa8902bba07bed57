"""The cluster invoker's endpoints (``dilu-invoker invoker --redis-url …``) report its Redis: ``/ping``
unhealthy while a real redis-server is stopped, ``pong`` again within seconds of its restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from dilu_invoker import config
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.invoker.server import invoker_credentials
from dilu_invoker.openwhisk.invoker_main import endpoint_app
from dilu_invoker.redis_embedded import EmbeddedRedis, RedisHealth


@pytest.fixture
async def invoker(tmp_path: Any) -> AsyncIterator[tuple[config.Config, Invoker]]:
    base = config.load(environ={"DILU_DATA_DIR": str(tmp_path), "DILU_INVOKER_BACKEND": "process"})
    cfg = replace(base, invoker=replace(base.invoker, id=7))
    async with open_invoker(cfg) as inv:
        yield cfg, inv


async def _until(client: Any, path: str, status: int, *, headers: dict[str, str] | None = None,
                 timeout_s: float = 10.0) -> tuple[float, str]:
    t0 = time.monotonic()
    while True:
        async with client.get(path, headers=headers or {}) as r:
            text = await r.text()
            if r.status == status:
                return time.monotonic() - t0, text
        assert time.monotonic() - t0 < timeout_s, (path, r.status, text)
        await asyncio.sleep(0.05)


async def test_ping_follows_the_redis_health(redis_server: EmbeddedRedis, invoker: tuple[config.Config, Invoker],
                                             aiohttp_client: Any) -> None:
    cfg, inv = invoker
    user, password = invoker_credentials(cfg)
    auth = {"Authorization": aiohttp.encode_basic_auth(user, password)}
    async with RedisHealth(redis_server.url, period_s=0.1) as health:
        client = await aiohttp_client(endpoint_app(cfg, inv, health))
        async with client.get("/ping") as r:
            assert (r.status, await r.text()) == (200, "pong")
        async with client.get("/invoker/health", headers=auth) as r:
            body = await r.json()
            assert r.status == 200 and body["healthy"] is True and body["enabled"] is True

        await redis_server.stop()
        _, text = await _until(client, "/ping", 503)
        assert text.startswith("unhealthy: redis unavailable for ")
        async with client.get("/invoker/health", headers=auth) as r:
            body = await r.json()
            assert r.status == 503 and body["healthy"] is False and body["reasons"][0].startswith("redis unavailable")
        async with client.get("/invoker/health") as r:
            assert r.status == 401  # the reasons are for the operator

        await redis_server.start()  # same port and password
        back_s, text = await _until(client, "/ping", 200)
        assert text == "pong" and back_s < 5.0
        async with client.get("/invoker/health", headers=auth) as r:
            assert r.status == 200 and (await r.json())["healthy"] is True


async def test_without_redis_the_invoker_reports_healthy_without_a_redis(invoker: tuple[config.Config, Invoker],
                                                           aiohttp_client: Any) -> None:
    cfg, inv = invoker
    client = await aiohttp_client(endpoint_app(cfg, inv, None))
    async with client.get("/ping") as r:
        assert (r.status, await r.text()) == (200, "pong")
    user, password = invoker_credentials(cfg)
    async with client.get("/invoker/health", headers={"Authorization": aiohttp.encode_basic_auth(user, password)}) as r:
        body = await r.json()
        assert r.status == 200 and body == {"healthy": True, "reasons": [], "enabled": True, "redis": None}
