"""Reading a Redis stream through a consumer group, resiliently (instance commands, forwarded activations)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError, ResponseError

log = structlog.get_logger(__name__)


async def ensure_group(redis: aioredis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) unless it exists."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def read_group(redis: aioredis.Redis, stream: str, group: str, consumer: str, *, count: int,
                     what: str, block_ms: int = 1000) -> AsyncIterator[tuple[Any, dict[bytes, bytes]]]:
    """Yield ``(entry id, fields)`` of new entries for ``consumer`` until cancelled. A group deleted under
    us (Redis restarted empty) is re-created; while Redis is unreachable it retries every 0.5 s."""
    await ensure_group(redis, stream, group)
    while True:
        try:
            got: Any = await redis.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                await ensure_group(redis, stream, group)
                continue
            raise
        except RedisError as exc:
            log.warning(f"cannot read {what}", error=str(exc))
            await asyncio.sleep(0.5)
            continue
        for _stream, entries in got or ():
            for entry_id, fields in entries:
                yield entry_id, fields
