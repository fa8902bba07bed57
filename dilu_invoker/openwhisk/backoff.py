"""Exponential backoff with jitter, shared by the Kafka and CouchDB clients."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_s: float = 0.05
    maximum_s: float = 2.0
    factor: float = 2.0
    #: each delay is scaled by a random factor in [1 - jitter, 1 + jitter] so that many invokers
    #: retrying against one broker or database do not move in lock step
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.maximum_s < self.initial_s or self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError(f"invalid backoff {self!r}")

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield delay * random.uniform(1 - self.jitter, 1 + self.jitter)
            delay = min(self.maximum_s, delay * self.factor)


async def sleep_or_stop(delay_s: float, stop: asyncio.Event | None) -> bool:
    """Sleep ``delay_s``; True if ``stop`` was set meanwhile (the caller should give up)."""
    if stop is None:
        await asyncio.sleep(delay_s)
        return False
    try:
        await asyncio.wait_for(stop.wait(), delay_s)
    except TimeoutError:
        return False
    return True
