"""The container lifecycle and the pool's choices on their own: transitions as sequences, choices as tables."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dilu_invoker.invoker.dataplane.backends.base import ContainerSpec
from dilu_invoker.invoker.dataplane.container import (
    ContainerProxy,
    IllegalTransition,
    Initializing,
    Paused,
    Placement,
    PoolKey,
    Ready,
    Removed,
    Removing,
    Starting,
    State,
    Transition,
)
from dilu_invoker.invoker.dataplane.pool import ContainerPool, Lease, View, evict_for, fits, pick_warm, starting
from dilu_invoker.model import Action, Exec

R, P, N, S, X = State.READY, State.PAUSED, State.INITIALIZING, State.STARTING, State.REMOVING


def v(name: str, state: State = R, *, active: int = 0, slots: int = 1, mb: int = 256, used: float = 0.0,
      placed: bool = False) -> View:
    return View(name, state, active, slots, mb, used, placed)


@pytest.mark.parametrize(("same_key", "expected"), [
    ((), None),
    ((v("a"),), "a"),
    ((v("a", active=1),), None),  # its one slot is taken
    ((v("a", P), v("b", R)), "b"),  # ready before paused
    ((v("a", S), v("b", P)), "b"),  # paused before starting
    ((v("a", S), v("b", N)), "b"),  # initializing before starting: ready sooner
    ((v("a", R, active=2, slots=4), v("b", R, active=1, slots=4)), "b"),  # least busy
    ((v("a", X), v("b", State.REMOVED)), None),  # going away
    ((v("a", S, active=1, slots=2),), "a"),  # a starting container's free slot beats a new one
], ids=["none", "ready", "full", "ready-first", "paused-before-starting", "initializing-first", "least-busy",
        "removing", "starting-slot"])
def test_pick_warm(same_key: tuple[View, ...], expected: str | None) -> None:
    assert pick_warm(same_key) == expected


@pytest.mark.parametrize(("in_use", "need", "total", "expected"), [
    (0, 256, 256, True), (1792, 256, 2048, True), (1800, 256, 2048, False), (0, 4096, 2048, False),
], ids=["exact", "last-slot", "over", "too-big"])
def test_fits(in_use: int, need: int, total: int, expected: bool) -> None:
    assert fits(in_use_mb=in_use, need_mb=need, user_memory_mb=total) is expected


@pytest.mark.parametrize(("containers", "need", "expected"), [
    # 1024 MB in all; each container 256 MB unless said otherwise
    ((v("a", used=3), v("b", used=1), v("c", used=2), v("d", used=4)), 256, ("b",)),  # least recently used
    ((v("a", used=3), v("b", used=1), v("c", used=2), v("d", used=4)), 512, ("b", "c")),
    ((v("a", active=1), v("b", used=1), v("c", active=1), v("d", active=1)), 512, None),  # busy ones stay
    ((v("a", placed=True, used=0), v("b", used=1), v("c", P, used=2), v("d", S)), 512, ("b", "c")),
    ((v("a", placed=True), v("b", placed=True), v("c", placed=True), v("d", placed=True)), 256, None),
    ((v("a", mb=512, used=2), v("b", used=1)), 256, ()),  # 768 in use: it fits already
], ids=["lru", "two", "busy-kept", "placed-kept-paused-evicted", "all-placed", "fits"])
def test_evict_for(containers: tuple[View, ...], need: int, expected: tuple[str, ...] | None) -> None:
    in_use = sum(c.memory_mb for c in containers)
    assert evict_for(containers, need_mb=need, in_use_mb=in_use, user_memory_mb=1024) == expected


# -- transitions --------------------------------------------------------------------------------------------


class _Handle:
    """What a backend hands back, as far as the lifecycle cares: an object it keeps until removal."""

    name = "c"
    url = "http://127.0.0.1:1"
    secret = None


def _proxy(seen: list[Transition], **kw: Any) -> ContainerProxy:
    action = Action(namespace="guest", name="a", exec=Exec(kind="python:3", code=""))
    return ContainerProxy(name="c", key=PoolKey.of("guest", action), action=action,
                          spec=ContainerSpec(name="c", kind="python:3", image="", memory_mb=256), memory_mb=256,
                          slots=1, on_transition=seen.append, **kw)


async def test_a_life_is_a_sequence_of_observed_transitions() -> None:
    seen: list[Transition] = []
    p = _proxy(seen)
    handle: Any = _Handle()
    assert isinstance(p.phase, Starting) and p.container is None and not p.ready.done()
    p.started(handle)
    assert isinstance(p.phase, Initializing) and p.container is handle
    p.initialized("initialized", init_ms=42)
    assert p.ready.result() is None and p.init_ms == 42
    p.paused("pause grace elapsed")
    assert isinstance(p.phase, Paused) and p.container is handle and p.init_ms is None
    p.resumed("resumed for an activation")
    p.removing("idle timeout")
    assert isinstance(p.phase, Removing) and p.phase.reason == "idle timeout" and p.container is handle
    p.removed()
    assert isinstance(p.phase, Removed) and p.container is None
    assert [(t.old, t.new, t.reason) for t in seen] == [
        (S, N, "container started"), (N, R, "initialized"), (R, P, "pause grace elapsed"),
        (P, R, "resumed for an activation"), (R, X, "idle timeout"), (X, State.REMOVED, "destroyed")]


async def test_a_failed_start_resolves_ready_once_with_the_failure() -> None:
    seen: list[Transition] = []
    p = _proxy(seen)
    p.started(_Handle())  # type: ignore[arg-type]
    p.removing("initialization failed", failure={"error": "boom"})
    assert p.ready.result() == {"error": "boom"}
    with pytest.raises(IllegalTransition):
        p.transition(Ready(0.0, _Handle()), "too late")  # type: ignore[arg-type]
    p.removed()
    assert [t.new for t in seen] == [N, X, State.REMOVED]


async def test_timers_belong_to_the_state_they_were_armed_in() -> None:
    seen: list[Transition] = []
    p = _proxy(seen, placement=Placement(instance="i-1"))
    assert p.placed
    fired: list[str] = []
    p.started(_Handle())  # type: ignore[arg-type]
    p.initialized("initialized", init_ms=None)
    p.arm(0.05, lambda: fired.append("idle"))
    p.paused("pause")  # leaving READY cancels its timers
    await asyncio.sleep(0.1)
    assert fired == [] and p.timers == []
    p.arm(0.01, lambda: fired.append("paused idle"))
    await asyncio.sleep(0.05)
    assert fired == ["paused idle"]


@pytest.mark.parametrize(("same_key", "expected"), [
    ((), False),
    ((v("a"), v("b", P)), False),
    ((v("a", S, active=1),), True),
    ((v("a"), v("b", N, active=1)), True),
    ((v("a", X),), False),
], ids=["none", "warm-only", "starting", "initializing", "removing"])
def test_starting(same_key: tuple[View, ...], expected: bool) -> None:
    assert starting(same_key) is expected


class _Pool:
    """A pool of 2 × 256 MB driven by hand: leases, starts and releases, removals recorded."""

    def __init__(self) -> None:
        self.removed: list[str] = []

        async def destroy(proxy: ContainerProxy) -> None:
            self.removed.append(proxy.key.fqn)

        self.pool = ContainerPool(user_memory_mb=512, idle_timeout_s=600, pause_grace_s=None, max_queue=100,
                                  destroy=destroy)

    def acquire(self, name: str) -> asyncio.Task[Lease]:
        action = Action(namespace="guest", name=name, exec=Exec(kind="python:3", code=""), revision="1-a")
        return asyncio.ensure_future(self.pool.acquire(
            PoolKey.of("guest", action), action, memory_mb=256, slots=1,
            make_spec=lambda n: ContainerSpec(name=n, kind="python:3", image="", memory_mb=256)))

    def ready(self, lease: Lease) -> None:
        lease.proxy.started(_Handle())  # type: ignore[arg-type]
        self.pool.mark_ready(lease.proxy, "initialized")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_freed_container_serves_its_own_waiters_before_it_is_evicted_for_another_action() -> None:
    p = _Pool()
    x, y = p.acquire("x"), p.acquire("y")
    await _settle()
    p.ready(x.result())
    p.ready(y.result())
    need_new, wants_x = p.acquire("a"), p.acquire("x")  # the pool is full and busy: both queue, "a" first
    await _settle()
    assert not need_new.done() and not wants_x.done()
    p.pool.release(x.result().proxy, healthy=True)
    await _settle()
    # x's own waiter takes it; evicting x for "a" would cost two cold starts instead of none
    assert wants_x.done() and wants_x.result().proxy is x.result().proxy and not wants_x.result().cold
    assert not need_new.done() and p.removed == []
    p.pool.release(y.result().proxy, healthy=True)  # nobody waits for y: "a" may evict it
    await _settle()
    assert need_new.done() and need_new.result().cold and p.removed == ["guest/y"]


async def test_no_warm_container_is_evicted_for_a_second_start_of_a_key_that_is_starting() -> None:
    p = _Pool()
    other, first = p.acquire("b"), p.acquire("a")
    await _settle()
    p.ready(other.result())
    p.pool.release(other.result().proxy, healthy=True)  # b: warm and idle, evictable
    second = p.acquire("a")  # a's first container is still starting
    await _settle()
    assert not second.done() and p.removed == []
    p.ready(first.result())
    await _settle()
    assert not second.done()  # its one slot is the first activation's
    p.pool.release(first.result().proxy, healthy=True)
    await _settle()
    assert second.done() and second.result().proxy is first.result().proxy and not second.result().cold
    assert p.removed == []
    # A waiter of a key that has nothing starting still evicts: here c takes b's memory.
    third = p.acquire("c")
    await _settle()
    assert third.done() and third.result().cold and p.removed == ["guest/b"]
