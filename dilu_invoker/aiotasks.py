"""Stopping background tasks reliably.

On Python 3.11 a cancellation that arrives while a timeout inside the awaited call (redis-py's read
timeouts, ``asyncio.timeout``) fires at the same moment can be swallowed: the task goes on with its loop
and a plain ``cancel(); await task`` waits forever. :func:`cancel_and_wait` cancels again until the task
is done.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

log = structlog.get_logger(__name__)


async def cancel_and_wait(*tasks: asyncio.Task[Any], timeout_s: float = 10.0) -> None:
    """Cancel the tasks and wait until each has finished (re-cancelling every 50 ms); their exceptions are
    logged, not raised. Tasks still running after ``timeout_s`` are logged and left behind."""
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for t in pending:
            t.cancel()
        _done, pending = await asyncio.wait(pending, timeout=0.05)
    for t in pending:
        log.warning("background task did not stop", task=t.get_name())
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.warning("background task failed", task=t.get_name(), error=repr(t.exception()))
