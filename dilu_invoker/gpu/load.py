"""An instance's own queue, as the invoker's data plane sees it: the second measurement of the vertical
policy next to the shim's request spans (docs/policies.md §1.1, "Measurement").

The shim sees a request only while it is on the GPU. The time a request spends in the instance is longer:
it waits for the container (the pool's queue), then runs — the runtime's request handling and host code
off the GPU, the GPU part in between. The invoker knows all of it, in the same process and on the same
event loop as the GPU manager, so the data plane updates these counters synchronously (a few dictionary
operations and two clock reads per activation, no I/O) and the manager drains them once a period
(`InstanceLoad.read`): no locks, no Redis.

* `KeyQueue`: the activations waiting for a container of one pool key, with the time each began waiting.
  Waiters belong to the key, not to one container; with several containers of the key each is counted
  its even part of the queue (FIFO over equal containers).
* `InstanceLoad`: one GPU container: its key's queue, the activations running on it now (since when), and
  the activations it completed since the last read (how long each waited, how long it ran).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

RECENT_MAX = 4096
"""Completed activations kept between two reads (the manager reads every period; a bound if it stops)."""


@dataclass(frozen=True, slots=True)
class LoadReading:
    """One instance since the previous read; every time in seconds."""

    queued: float = 0.0
    """Activations waiting for the instance now (its part of its key's queue)."""
    oldest_wait_s: float = 0.0
    """How long the oldest of them has waited (0: none waits)."""
    running: int = 0
    """Activations running on the instance now."""
    open_run_s: float = 0.0
    """How long the oldest of them has run (0: none runs)."""
    runs_s: tuple[float, ...] = ()
    """Activations completed since the previous read, oldest first: their time in the container, from the
    invoker handing it over to its result (the instance's service time, off-GPU time included)."""
    waits_s: tuple[float, ...] = ()
    """The same activations' waits for the container (the pool's queue), same order."""


class KeyQueue:
    """The activations waiting for a container of one pool key."""

    __slots__ = ("_since", "_tickets", "members")

    def __init__(self) -> None:
        self._since: dict[int, float] = {}
        self._tickets = itertools.count()
        self.members = 0
        """GPU containers of the key that report this queue (its waiters are shared among them)."""

    def enter(self, now: float) -> int:
        ticket = next(self._tickets)
        self._since[ticket] = now
        return ticket

    def leave(self, ticket: int) -> None:
        self._since.pop(ticket, None)

    def __len__(self) -> int:
        return len(self._since)

    def oldest_since(self) -> float | None:
        # Insertion order is arrival order: the first entry left is the oldest waiter.
        return next(iter(self._since.values()), None)


class InstanceLoad:
    """One GPU container's activations; the data plane calls `started` / `finished`, the manager `read`."""

    __slots__ = ("_clock", "_running", "_runs", "_tickets", "_waits", "queue")

    def __init__(self, queue: KeyQueue, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self._clock = clock
        self._running: dict[int, float] = {}
        self._tickets = itertools.count()
        self._runs: collections.deque[float] = collections.deque(maxlen=RECENT_MAX)
        self._waits: collections.deque[float] = collections.deque(maxlen=RECENT_MAX)

    def started(self, now: float) -> int:
        """An activation began to run on the container at ``now``; the ticket for `finished`."""
        ticket = next(self._tickets)
        self._running[ticket] = now
        return ticket

    def finished(self, ticket: int, now: float, *, waited_s: float) -> None:
        """The activation of ``ticket`` has its result at ``now``; it had waited ``waited_s`` for the container."""
        began = self._running.pop(ticket, None)
        if began is None:
            return
        self._runs.append(max(0.0, now - began))
        self._waits.append(max(0.0, waited_s))

    def read(self) -> LoadReading:
        """The reading since the previous call (which it drains)."""
        now = self._clock()
        members = max(1, self.queue.members)
        oldest = self.queue.oldest_since()
        first_run = next(iter(self._running.values()), None)
        runs, waits = tuple(self._runs), tuple(self._waits)
        self._runs.clear()
        self._waits.clear()
        return LoadReading(
            queued=len(self.queue) / members,
            oldest_wait_s=max(0.0, now - oldest) if oldest is not None else 0.0,
            running=len(self._running),
            open_run_s=max(0.0, now - first_run) if first_run is not None else 0.0,
            runs_s=runs,
            waits_s=waits,
        )


__all__ = ["RECENT_MAX", "InstanceLoad", "KeyQueue", "LoadReading"]
