"""One action container's life as an explicit state machine (after OpenWhisk's ContainerProxy).

::

    STARTING ──► INITIALIZING ──► READY ◄──► PAUSED
        │              │            │           │
        └──────────────┴────────────┴───────────┴──► REMOVING ──► REMOVED

Every change goes through :meth:`ContainerProxy.transition`, which checks it against :data:`ALLOWED`
and reports a :class:`Transition` to the pool's observer (logs, metrics, and tests that assert the
sequence). Timers belong to states: entering READY with no work arms the pause-grace and idle timers,
entering PAUSED arms the idle timer; leaving the state cancels them.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dilu_invoker.invoker.backends.base import Container, ContainerSpec
from dilu_invoker.model import Action


class State(enum.Enum):
    STARTING = "starting"
    INITIALIZING = "initializing"
    READY = "ready"
    PAUSED = "paused"
    REMOVING = "removing"
    REMOVED = "removed"


ALLOWED: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.INITIALIZING, State.REMOVING}),
    State.INITIALIZING: frozenset({State.READY, State.REMOVING}),
    State.READY: frozenset({State.PAUSED, State.REMOVING}),
    State.PAUSED: frozenset({State.READY, State.REMOVING}),
    State.REMOVING: frozenset({State.REMOVED}),
    State.REMOVED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Transition:
    container: str
    old: State
    new: State
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class PoolKey:
    """Warm containers are shared by activations of the same action revision and invoking namespace."""

    namespace: str
    fqn: str
    revision: str

    @classmethod
    def of(cls, invoking_namespace: str, action: Action) -> PoolKey:
        # The revision changes on every update; without one (an inline test action) the code decides.
        rev = action.revision or f"{action.version}:{hash((action.exec, action.limits))}"
        return cls(invoking_namespace, action.fqn, rev)


@dataclass(slots=True, eq=False)
class ContainerProxy:
    name: str
    key: PoolKey
    action: Action
    spec: ContainerSpec
    memory_mb: int
    slots: int
    on_transition: Callable[[Transition], None]
    state: State = State.STARTING
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    container: Container | None = None
    #: resolved once /init finished: None on success, else the activation response of the failure
    ready: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    init_ms: int | None = None
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    #: resources attached to this container by others (a GPU lease); released on removal
    attachments: list[Any] = field(default_factory=list)
    #: a balancer-placed instance: no pause or idle timers, never evicted; removed only when told to
    pinned: bool = False

    @property
    def has_capacity(self) -> bool:
        return self.state in (State.STARTING, State.INITIALIZING, State.READY, State.PAUSED) and self.active < self.slots

    @property
    def is_idle(self) -> bool:
        return self.active == 0 and self.state in (State.READY, State.PAUSED)

    def transition(self, new: State, reason: str) -> None:
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state.value} -> {new.value} ({reason})")
        old, self.state = self.state, new
        self.cancel_timers()
        self.on_transition(Transition(self.name, old, new, reason, time.monotonic()))

    def cancel_timers(self) -> None:
        for t in self.timers:
            t.cancel()
        self.timers.clear()

    def arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.timers.append(asyncio.get_running_loop().call_later(delay_s, callback))
