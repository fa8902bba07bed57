"""One action container's life: its state with per-state data, and everything it owns (after OpenWhisk's
ContainerProxy). This is the one place that says what a container is doing.

::

    STARTING ──► INITIALIZING ──► READY ◄──► PAUSED
        │              │            │           │
        └──────────────┴────────────┴───────────┴──► REMOVING ──► REMOVED

Each state has its frozen data (:class:`Starting`, :class:`Initializing`, :class:`Ready`, :class:`Paused`,
:class:`Removing`, :class:`Removed`): the backend's container handle exists only from INITIALIZING to
REMOVING, a removal always has its reason. Every change goes through :meth:`ContainerProxy.transition`,
which checks it against :data:`ALLOWED`, cancels the timers of the state it leaves, resolves
:attr:`ContainerProxy.ready` (the one place that does: entering READY → None, entering REMOVING → the
failure) and reports a :class:`Transition` to the pool's observers (logs, metrics, the instances of the
cluster agent, and tests that assert the sequence).

Besides its state a container owns its placement (:class:`Placement`: the balancer instance it serves,
its GPU attachment and the key its GPU share is held under), its output (:class:`Output`: the log reader,
the collection of the init's output awaiting the first run, the drain of a shared container), its timers,
and — through the backend handle — its work directory and process tree, which ``destroy`` removes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dilu_invoker.invoker.dataplane.backends.base import Container, ContainerSpec
from dilu_invoker.model import Action

if TYPE_CHECKING:
    from dilu_invoker.gpu.attachment import GpuAttachment
    from dilu_invoker.invoker.dataplane.runtime_client import ActivationLogReader, LogCollection


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


# -- per-state data --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Starting:
    since: float


@dataclass(frozen=True, slots=True)
class Initializing:
    since: float
    container: Container


@dataclass(frozen=True, slots=True)
class Ready:
    since: float
    container: Container
    init_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Paused:
    since: float
    container: Container


@dataclass(frozen=True, slots=True)
class Removing:
    since: float
    reason: str
    container: Container | None


@dataclass(frozen=True, slots=True)
class Removed:
    since: float
    reason: str


Phase = Starting | Initializing | Ready | Paused | Removing | Removed
STATE_OF: dict[type, State] = {Starting: State.STARTING, Initializing: State.INITIALIZING, Ready: State.READY,
                               Paused: State.PAUSED, Removing: State.REMOVING, Removed: State.REMOVED}


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


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a container runs beyond the pool: the balancer instance it serves (None: a pooled container,
    with pause and idle timers, evictable) and its GPU share (attachment, and the key it is held under)."""

    instance: str | None = None
    gpu: GpuAttachment | None = None
    gpu_key: str | None = None


@dataclass(slots=True, eq=False)
class Output:
    """The container's output streams: one reader; for a single-slot container the init's output waits
    in ``pending`` for the first run's logs; a shared container's streams are drained (no attribution)."""

    reader: ActivationLogReader
    pending: LogCollection | None = None
    drain: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self.drain is not None:
            self.drain.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.drain
        pending, self.pending = self.pending, None
        if pending is not None:
            with contextlib.suppress(Exception):
                await pending.finish(developer_error=True)


# -- the container -------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class ContainerProxy:
    name: str
    key: PoolKey
    action: Action
    spec: ContainerSpec
    memory_mb: int
    slots: int
    on_transition: Callable[[Transition], None]
    placement: Placement = Placement()
    phase: Phase = field(default_factory=lambda: Starting(time.monotonic()))
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    output: Output | None = None
    #: started from a pre-loaded container (its libraries were imported before the action's /init)
    preloaded: bool = False
    #: what its first finished run imported was asked for (the invoker learns pre-loads from it)
    run_imports_learnt: bool = False
    #: resolved once, by :meth:`transition`: None when READY, else the failure (an activation response, or
    #: the removal's reason when there is none)
    ready: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    @property
    def state(self) -> State:
        return STATE_OF[type(self.phase)]

    @property
    def container(self) -> Container | None:
        """The backend's handle: from INITIALIZING until REMOVING."""
        return getattr(self.phase, "container", None)

    @property
    def init_ms(self) -> int | None:
        return self.phase.init_ms if isinstance(self.phase, Ready) else None

    @property
    def placed(self) -> bool:
        """Serves a balancer-placed instance: no pause or idle timers, never evicted."""
        return self.placement.instance is not None

    @property
    def has_capacity(self) -> bool:
        return self.state in (State.STARTING, State.INITIALIZING, State.READY, State.PAUSED) and self.active < self.slots

    @property
    def evictable(self) -> bool:
        """Idle, pooled (not a placed instance): the pool may remove it to make room."""
        return self.active == 0 and self.state in (State.READY, State.PAUSED) and not self.placed

    @property
    def is_idle(self) -> bool:
        return self.active == 0 and self.state in (State.READY, State.PAUSED)

    def transition(self, new: Phase, reason: str, *, failure: Any = None) -> None:
        state = STATE_OF[type(new)]
        if state not in ALLOWED[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state.value} -> {state.value} ({reason})")
        old, self.phase = self.state, new
        self.cancel_timers()
        if not self.ready.done():
            if state is State.READY:
                self.ready.set_result(None)
            elif state is State.REMOVING:
                self.ready.set_result(failure if failure is not None else reason)
        self.on_transition(Transition(self.name, old, state, reason, time.monotonic()))

    # -- the transitions, by name -------------------------------------------------------------------------

    def started(self, container: Container) -> None:
        self.transition(Initializing(time.monotonic(), container), "container started")

    def initialized(self, reason: str, *, init_ms: int | None) -> None:
        assert isinstance(self.phase, Initializing)
        self.transition(Ready(time.monotonic(), self.phase.container, init_ms), reason)

    def paused(self, reason: str) -> None:
        assert isinstance(self.phase, Ready)
        self.transition(Paused(time.monotonic(), self.phase.container), reason)

    def resumed(self, reason: str) -> None:
        assert isinstance(self.phase, Paused)
        self.transition(Ready(time.monotonic(), self.phase.container), reason)

    def removing(self, reason: str, *, failure: Any = None) -> None:
        self.transition(Removing(time.monotonic(), reason, self.container), reason, failure=failure)

    def removed(self) -> None:
        assert isinstance(self.phase, Removing)
        self.transition(Removed(time.monotonic(), self.phase.reason), "destroyed")

    # -- timers belong to the state they are armed in --------------------------------------------------

    def cancel_timers(self) -> None:
        for t in self.timers:
            t.cancel()
        self.timers.clear()

    def arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.timers.append(asyncio.get_running_loop().call_later(delay_s, callback))
