"""Compact JSON, with large documents encoded and decoded off the event loop.

Action code may be tens of megabytes and activation logs up to ten; parsing those on the loop would stall
every other request for tens of milliseconds, so above :data:`OFFLOAD_BYTES` the work goes to a thread.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

OFFLOAD_BYTES = 256 * 1024


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes | bytearray | str) -> Any:
    return json.loads(data)


async def aloads(data: bytes | bytearray | str) -> Any:
    if len(data) > OFFLOAD_BYTES:
        return await asyncio.to_thread(json.loads, data)
    return json.loads(data)


async def adumps(value: Any, *, size_hint: int = 0) -> bytes:
    """``size_hint``: what the caller knows of the encoded size (e.g. the code or log length)."""
    if size_hint > OFFLOAD_BYTES:
        return await asyncio.to_thread(dumps, value)
    return dumps(value)
