from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    port, password = _free_port(), secrets.token_hex(8)
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--requirepass", password], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.02)
    yield f"redis://:{password}@127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(5)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()
