"""The container pool: which container runs an activation, when to start or evict one, and the queue.

Scheduling follows OpenWhisk's ContainerPool (reference/openwhisk.md §9):

1. a container of the same action revision and invoking namespace with a free slot (warm, or still
   starting: it will be ready sooner than a new one);
2. a new container if ``Σ memory + need ≤ user_memory``;
3. otherwise release pre-loaded containers (``preload.py``: they go first under memory pressure), then
   evict least-recently-used idle containers of other actions and start one;
4. otherwise wait in a FIFO queue. A waiter that a warm container can serve is served as soon as a slot
   frees; among waiters that need a new container only the oldest may start one, so large actions are
   not starved by a stream of small ones.

Two rules keep churn from turning into cold starts: a freed slot goes to the waiters that it can serve
before any waiter may evict its container for another action; and a second container for a key whose
first one is still starting is started only where it fits — evicting another action's warm container
for it would cost a cold start and win nothing (the waiter gets the starting one's slot no later than a
new container could be ready), so the waiter waits for that slot. The first rule favours throughput over
strict arrival order: under sustained overload, when every container has waiters of its own, a key
without a container waits until one frees without waiters.

The choices themselves are pure functions of what they read of the containers (:class:`ContainerView`) —
:func:`pick_warm` (step 1), :func:`fits` (step 2) and :func:`evict_for` (step 3) — tested as tables of frozen
:class:`View` snapshots; :class:`ContainerPool` applies them to its live containers. All bookkeeping is
synchronous on the event loop (no awaits between a decision and its effect), so no locks are needed.
Starting, initializing and removing containers is done by the caller (``core``) and by the pool's own
removal tasks.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import structlog

from dilu_invoker.invoker.api import InvokerOverloaded
from dilu_invoker.invoker.dataplane.backends.base import ContainerSpec
from dilu_invoker.invoker.dataplane.container import ContainerProxy, Placement, PoolKey, State, Transition
from dilu_invoker.model import Action

log = structlog.get_logger(__name__)


# -- the choices, as pure functions -------------------------------------------------------------------


class ContainerView(Protocol):
    """What the choices read of a container: a frozen :class:`View` in tests, the live
    :class:`ContainerProxy` in the pool (no snapshot per container and decision on the hot path)."""

    @property
    def name(self) -> str: ...
    @property
    def state(self) -> State: ...
    @property
    def active(self) -> int: ...
    @property
    def memory_mb(self) -> int: ...
    @property
    def last_used(self) -> float: ...
    @property
    def has_capacity(self) -> bool: ...
    @property
    def evictable(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class View:
    """A frozen snapshot of what the choices see of one container."""

    name: str
    state: State
    active: int
    slots: int
    memory_mb: int
    last_used: float
    placed: bool = False

    @classmethod
    def of(cls, p: ContainerProxy) -> View:
        return cls(p.name, p.state, p.active, p.slots, p.memory_mb, p.last_used, p.placed)

    @property
    def has_capacity(self) -> bool:
        return self.state in _WARM_RANK and self.active < self.slots

    @property
    def evictable(self) -> bool:
        return self.active == 0 and self.state in (State.READY, State.PAUSED) and not self.placed


#: a ready container first, then a paused one (resumed first), then one still starting
_WARM_RANK = {State.READY: 0, State.PAUSED: 1, State.INITIALIZING: 2, State.STARTING: 3}
_STARTING = (State.STARTING, State.INITIALIZING)
V = TypeVar("V", bound=ContainerView)


def best_warm(same_key: Iterable[V]) -> V | None:
    """Step 1: the container of the activation's key to run on — ready before paused before starting,
    least busy first; None when none has a free slot."""
    best: V | None = None
    best_rank = (4, 0)
    for v in same_key:
        if v.has_capacity:
            rank = (_WARM_RANK[v.state], v.active)
            if rank < best_rank:
                best, best_rank = v, rank
    return best


def pick_warm(same_key: Iterable[ContainerView]) -> str | None:
    """:func:`best_warm`'s name."""
    best = best_warm(same_key)
    return best.name if best is not None else None


def starting(same_key: Iterable[ContainerView]) -> bool:
    """A container of the key is still starting or initializing (its slot will free soon)."""
    return any(v.state in _STARTING for v in same_key)


def fits(*, in_use_mb: int, need_mb: int, user_memory_mb: int) -> bool:
    """Step 2: a new container fits beside the others."""
    return in_use_mb + need_mb <= user_memory_mb


def evict_for(containers: Sequence[ContainerView], *, need_mb: int, in_use_mb: int, user_memory_mb: int
              ) -> tuple[str, ...] | None:
    """Step 3: the least-recently-used idle pooled containers whose removal makes ``need_mb`` fit (in
    eviction order; empty when it already fits); None when even all of them would not do."""
    free = user_memory_mb - in_use_mb
    victims: list[str] = []
    for v in sorted((v for v in containers if v.evictable), key=lambda v: v.last_used):
        if free >= need_mb:
            break
        victims.append(v.name)
        free += v.memory_mb
    return tuple(victims) if free >= need_mb else None


# -- the pool --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lease:
    proxy: ContainerProxy
    #: this activation must start and initialize the container itself
    cold: bool


class Reserve(Protocol):
    """Memory held outside the pool that counts against its user memory and is released first: the
    pre-loaded containers (``preload.PreloadPool``)."""

    def memory_for(self, action: Action) -> int:
        """The memory it holds that counts beside a new container of ``action`` (one pre-loaded container
        that this very cold start will take does not: it becomes that container)."""
        ...

    def shed(self, need_mb: int, action: Action) -> int:
        """Release at least ``need_mb`` if it can, sparing the container ``action`` would take unless
        nothing else is left; returns what was released (MB)."""
        ...


class Reserves:
    """Several reserves as one: their memory together, released in their order."""

    def __init__(self, *parts: Reserve) -> None:
        self.parts = parts

    def memory_for(self, action: Action) -> int:
        return sum(p.memory_for(action) for p in self.parts)

    def shed(self, need_mb: int, action: Action) -> int:
        released = 0
        for part in self.parts:
            if released >= need_mb:
                break
            released += part.shed(need_mb - released, action)
        return released


class NoContainer(RuntimeError):
    """``acquire(start=False)`` found no live container of the key (a pinned instance that is gone)."""


@dataclass(slots=True, eq=False)
class _Waiter:
    key: PoolKey
    action: Action
    memory_mb: int
    slots: int
    make_spec: Callable[[str], ContainerSpec]
    future: asyncio.Future[Lease]
    start: bool = True
    instance: str | None = None


class ContainerPool:
    def __init__(
        self,
        *,
        user_memory_mb: int,
        idle_timeout_s: float,
        pause_grace_s: float | None,
        max_queue: int,
        destroy: Callable[[ContainerProxy], Awaitable[None]],
        name_prefix: str = "wsk0",
        observers: tuple[Callable[[Transition], None], ...] = (),
    ) -> None:
        self.user_memory_mb = user_memory_mb
        self.idle_timeout_s = idle_timeout_s
        self.pause_grace_s = pause_grace_s
        self.max_queue = max_queue
        self._destroy = destroy
        self._prefix = name_prefix
        self._observers = list(observers)
        self._counter = itertools.count(1)
        self.containers: dict[str, ContainerProxy] = {}
        self._by_key: dict[PoolKey, list[ContainerProxy]] = collections.defaultdict(list)
        self._queue: collections.deque[_Waiter] = collections.deque()
        #: how many waiters of each key are in the queue (a queue pass stops once every key is stuck)
        self._queued_keys: collections.Counter[PoolKey] = collections.Counter()
        self._removals: set[asyncio.Task[None]] = set()
        self._closed = False
        #: pre-loaded containers: counted in the memory in use, shed before any warm container is evicted
        self.reserve: Reserve | None = None

    # -- observation --------------------------------------------------------------------------

    def observe(self, callback: Callable[[Transition], None]) -> None:
        self._observers.append(callback)

    def _on_transition(self, t: Transition) -> None:
        log.debug("container transition", container=t.container, old=t.old.value, new=t.new.value, reason=t.reason)
        for cb in self._observers:
            cb(t)

    @property
    def memory_in_use_mb(self) -> int:
        return sum(p.memory_mb for p in self.containers.values())

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def busy_count(self) -> int:
        return sum(1 for p in self.containers.values() if p.active > 0)

    # -- acquiring ---------------------------------------------------------------------------

    async def acquire(
        self, key: PoolKey, action: Action, *, memory_mb: int, slots: int, make_spec: Callable[[str], ContainerSpec],
        start: bool = True, instance: str | None = None,
    ) -> Lease:
        """A slot of a container of ``key``. ``start=False``: only an existing container of the key will do
        (wait for a slot of one; :class:`NoContainer` when there is none). ``instance``: a container started
        for this call serves that balancer-placed instance (no idle or pause timers, never evicted)."""
        if self._closed:
            raise InvokerOverloaded("the invoker is shutting down")
        if memory_mb > self.user_memory_mb:
            raise InvokerOverloaded(
                f"the action needs {memory_mb} MB but this invoker has only {self.user_memory_mb} MB for actions"
            )
        if not start and not self._live(key):
            raise NoContainer(f"no container of {key.namespace}/{key.fqn}")
        lease = self._try_assign(key, action, memory_mb, slots, make_spec,
                                 may_start=start and not self._queue_needs_memory(), instance=instance)
        if lease is not None:
            return lease
        if len(self._queue) >= self.max_queue:
            raise InvokerOverloaded("too many activations are waiting for a container")
        waiter = _Waiter(key, action, memory_mb, slots, make_spec, asyncio.get_running_loop().create_future(),
                         start=start, instance=instance)
        self._queue.append(waiter)
        self._queued_keys[key] += 1
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                # Assigned just as we were cancelled: give the slot back.
                self.release(waiter.future.result().proxy, healthy=True)
            elif waiter in self._queue:
                self._queue.remove(waiter)
                self._dequeued(waiter)
            raise

    def _dequeued(self, waiter: _Waiter) -> None:
        left = self._queued_keys[waiter.key] - 1
        if left > 0:
            self._queued_keys[waiter.key] = left
        else:
            del self._queued_keys[waiter.key]

    @property
    def closed(self) -> bool:
        """The pool is shutting down: it takes no more activations."""
        return self._closed

    def _queue_needs_memory(self) -> bool:
        return any(self._needs_container(w) for w in self._queue)

    def _needs_container(self, waiter: _Waiter) -> bool:
        """The waiter can only be served by a new container (none of its key is warm or starting)."""
        return waiter.start and not starting(self._by_key.get(waiter.key, ()))

    def _live(self, key: PoolKey) -> bool:
        return any(p.state not in (State.REMOVING, State.REMOVED) for p in self._by_key.get(key, ()))

    def _try_assign(
        self,
        key: PoolKey,
        action: Action,
        memory_mb: int,
        slots: int,
        make_spec: Callable[[str], ContainerSpec],
        *,
        may_start: bool,
        instance: str | None = None,
    ) -> Lease | None:
        same_key = self._by_key.get(key, ())
        proxy = best_warm(same_key)
        if proxy is not None:
            proxy.active += 1
            proxy.last_used = time.monotonic()
            proxy.cancel_timers()
            return Lease(proxy, cold=False)
        if not may_start:
            return None
        in_use = self.memory_in_use_mb
        reserve = self.reserve
        if reserve is not None:
            held = reserve.memory_for(action)
            in_use += held
            short = in_use + memory_mb - self.user_memory_mb
            if short > 0 and held > 0:
                in_use -= min(held, reserve.shed(short, action))
        if not fits(in_use_mb=in_use, need_mb=memory_mb, user_memory_mb=self.user_memory_mb):
            victims = evict_for(list(self.containers.values()), need_mb=memory_mb,
                                in_use_mb=in_use, user_memory_mb=self.user_memory_mb)
            if victims is None or starting(same_key):
                return None
            for victim in victims:
                self.remove(self.containers[victim], "evicted to make room")
        name = f"{self._prefix}_{next(self._counter)}_{_slug(key.namespace)}_{_slug(action.name)}"
        proxy = ContainerProxy(
            name=name,
            key=key,
            action=action,
            spec=make_spec(name),
            memory_mb=memory_mb,
            slots=max(1, slots),
            on_transition=self._on_transition,
            placement=Placement(instance=instance),
            active=1,
        )
        self.containers[name] = proxy
        self._by_key[key].append(proxy)
        self._on_transition(Transition(name, State.STARTING, State.STARTING, "cold start", time.monotonic()))
        return Lease(proxy, cold=True)

    # -- releasing and removing ---------------------------------------------------------------

    def release(self, proxy: ContainerProxy, *, healthy: bool, reason: str = "") -> None:
        """An activation is done with ``proxy``; an unhealthy container is removed."""
        proxy.active = max(0, proxy.active - 1)
        proxy.last_used = time.monotonic()
        if not healthy:
            self.remove(proxy, reason or "activation failed")
        elif proxy.state is State.READY and proxy.active == 0 and not self._closed:
            self._arm_idle(proxy)
        self._drain_queue()

    def _arm_idle(self, proxy: ContainerProxy) -> None:
        if proxy.placed:
            return  # an instance lives until the balancer stops it
        if self.pause_grace_s is not None and self.pause_grace_s < self.idle_timeout_s:
            proxy.arm(self.pause_grace_s, lambda: self._spawn(self._pause(proxy)))
        proxy.arm(self.idle_timeout_s, lambda: self.remove(proxy, "idle timeout") if proxy.is_idle else None)

    async def _pause(self, proxy: ContainerProxy) -> None:
        if not proxy.is_idle or proxy.state is not State.READY or proxy.container is None:
            return
        proxy.paused("pause grace elapsed")
        # idle timer continues in PAUSED
        proxy.arm(max(0.0, self.idle_timeout_s - (self.pause_grace_s or 0.0)),
                  lambda: self.remove(proxy, "idle timeout") if proxy.is_idle else None)
        try:
            await proxy.container.pause()
        except Exception as exc:  # noqa: BLE001 - a failed pause makes the container unusable
            log.warning("pause failed", container=proxy.name, error=str(exc))
            self.remove(proxy, f"pause failed: {exc}")

    async def resume(self, proxy: ContainerProxy) -> bool:
        """Bring a paused container back before running on it; False if it is gone."""
        if proxy.state is not State.PAUSED or proxy.container is None:
            return proxy.state is State.READY
        proxy.resumed("resumed for an activation")
        try:
            await proxy.container.resume()
        except Exception as exc:  # noqa: BLE001
            log.warning("resume failed", container=proxy.name, error=str(exc))
            self.remove(proxy, f"resume failed: {exc}")
            return False
        return True

    def mark_ready(self, proxy: ContainerProxy, reason: str, *, init_ms: int | None = None) -> None:
        if proxy.state is State.INITIALIZING:
            proxy.initialized(reason, init_ms=init_ms)
            if proxy.active == 0:
                self._arm_idle(proxy)
        self._drain_queue(starts=False)  # readiness frees slots, not memory

    def remove(self, proxy: ContainerProxy, reason: str, *, failure: object = None) -> None:
        """Start removing ``proxy``; ``failure`` (an activation response) is what activations waiting for
        it to become ready get, else the reason."""
        if proxy.state in (State.REMOVING, State.REMOVED):
            return
        proxy.removing(reason, failure=failure)
        self._spawn(self._finish_removal(proxy))

    async def _finish_removal(self, proxy: ContainerProxy) -> None:
        try:
            await self._destroy(proxy)
        finally:
            proxy.removed()
            self.containers.pop(proxy.name, None)
            siblings = self._by_key.get(proxy.key)
            if siblings is not None:
                if proxy in siblings:
                    siblings.remove(proxy)
                if not siblings:
                    del self._by_key[proxy.key]
            self._drain_queue()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    def _drain_queue(self, *, starts: bool = True) -> None:
        # First every waiter a free slot can serve, then the starts: a container freed with waiters of its
        # own key is never evicted for another key's cold start.
        for pass_starts in (False, True) if starts else (False,):
            if not self._queue:
                return
            may_start = pass_starts
            # A key whose waiter found no slot has none for the waiters behind it in this pass either (one
            # pass sees one pool state): they are not asked again, and once every queued key is stuck the
            # pass ends — under a deep queue this scan was the invoker's hot spot.
            stuck: set[PoolKey] = set()
            keep: list[_Waiter] = []
            queue = self._queue
            while queue:
                if not may_start and len(stuck) == len(self._queued_keys):
                    # Every key still queued is stuck and no start is allowed any more: the rest of the
                    # queue stays as it is (a release with a deep queue of one key costs O(1), not O(queue)).
                    break
                waiter = queue.popleft()
                if waiter.future.done():
                    self._dequeued(waiter)
                    continue
                if waiter.key in stuck and not (may_start and waiter.start):
                    keep.append(waiter)
                    continue
                if not waiter.start and not self._live(waiter.key):
                    self._dequeued(waiter)
                    waiter.future.set_exception(NoContainer(
                        f"no container of {waiter.key.namespace}/{waiter.key.fqn}"))
                    continue
                lease = self._try_assign(waiter.key, waiter.action, waiter.memory_mb, waiter.slots,
                                         waiter.make_spec, may_start=may_start and waiter.start,
                                         instance=waiter.instance)
                if lease is not None:
                    self._dequeued(waiter)
                    waiter.future.set_result(lease)
                    continue
                keep.append(waiter)
                stuck.add(waiter.key)
                if pass_starts and self._needs_container(waiter):
                    may_start = False  # only the oldest waiter that needs a new container may start one
            queue.extendleft(reversed(keep))

    # -- shutdown ------------------------------------------------------------------------------

    async def close(self, *, drain_s: float = 5.0) -> None:
        """Stop taking work, let running activations finish for ``drain_s``, then remove everything."""
        self._closed = True
        for waiter in self._queue:
            if not waiter.future.done():
                waiter.future.set_exception(InvokerOverloaded("the invoker is shutting down"))
        self._queue.clear()
        self._queued_keys.clear()
        deadline = time.monotonic() + drain_s
        while any(p.active for p in self.containers.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # activations release through many paths; polling keeps this simple
        for proxy in list(self.containers.values()):
            self.remove(proxy, "invoker shutting down")
        if self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "" for c in text)[:32] or "x"
