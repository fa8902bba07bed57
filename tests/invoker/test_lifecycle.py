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
from dilu_invoker.invoker.dataplane.pool import View, evict_for, fits, pick_warm
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
