"""The pool's wait queue: first come, first served per key, and a waiter that cannot be served now does not
hold back one behind it that can (the queue pass skips keys already found full)."""

from __future__ import annotations

import asyncio

from dilu_invoker.invoker.dataplane.backends.base import ContainerSpec
from dilu_invoker.invoker.dataplane.container import ContainerProxy, PoolKey
from dilu_invoker.invoker.dataplane.pool import ContainerPool, Lease
from dilu_invoker.model import Action, Exec


class _Handle:
    name = "c"
    url = "http://127.0.0.1:1"
    secret = None


async def _destroy(_: ContainerProxy) -> None:
    return None


def _pool(user_memory_mb: int) -> ContainerPool:
    return ContainerPool(user_memory_mb=user_memory_mb, idle_timeout_s=60, pause_grace_s=None, max_queue=1000,
                         destroy=_destroy)


def _action(name: str) -> tuple[PoolKey, Action]:
    action = Action(namespace="guest", name=name, exec=Exec(kind="python:3", code=""))
    return PoolKey.of("guest", action), action


def _acquire(pool: ContainerPool, name: str, *, start: bool = True) -> asyncio.Task[Lease]:
    key, action = _action(name)
    return asyncio.ensure_future(pool.acquire(
        key, action, memory_mb=256, slots=1, start=start,
        make_spec=lambda n: ContainerSpec(name=n, kind="python:3", image="", memory_mb=256)))


async def test_a_deep_queue_is_served_in_arrival_order_and_other_keys_wait() -> None:
    pool = _pool(256)
    first = await _acquire(pool, "a")
    waiters = [_acquire(pool, "a") for _ in range(50)]
    other = _acquire(pool, "b")  # no memory for a container of b while a's is busy
    await asyncio.sleep(0)
    assert pool.queue_length == 51
    lease = first
    for i, waiter in enumerate(waiters):
        pool.release(lease.proxy, healthy=True)
        await asyncio.sleep(0)
        assert waiter.done(), i
        assert [w.done() for w in waiters[i + 1:]] == [False] * (len(waiters) - i - 1)
        lease = waiter.result()
        assert lease.proxy is first.proxy and not lease.cold
    assert not other.done() and pool.queue_length == 1
    other.cancel()


async def test_a_pinned_waiter_does_not_hold_back_a_starting_one_of_its_key() -> None:
    pool = _pool(512)
    a = await _acquire(pool, "a")
    b = await _acquire(pool, "b")  # memory now full
    pinned = _acquire(pool, "a", start=False)  # waits for a slot of a's container only
    starter = _acquire(pool, "a")  # needs a new container: waits for memory
    await asyncio.sleep(0)
    assert pool.queue_length == 2
    pool.release(b.proxy, healthy=False, reason="test")  # b's container goes: 256 MB free
    for _ in range(5):
        await asyncio.sleep(0)
    assert starter.done() and starter.result().cold and starter.result().proxy is not a.proxy
    assert not pinned.done()
    pool.release(a.proxy, healthy=True)
    await asyncio.sleep(0)
    assert pinned.done() and pinned.result().proxy is a.proxy


async def test_a_release_with_a_deep_queue_of_full_keys_looks_at_few_waiters() -> None:
    # Two keys, each with one busy container and a deep queue: a release serves the oldest waiter its
    # container can serve and ends the pass once both keys are stuck, instead of walking all 400 waiters.
    pool = _pool(512)
    a = await _acquire(pool, "a")
    b = await _acquire(pool, "b")
    for lease in (a, b):  # warm: a waiter of a busy key can only wait for its slot
        lease.proxy.started(_Handle())  # type: ignore[arg-type]
        lease.proxy.initialized("initialized", init_ms=1)
    waiters = [_acquire(pool, name) for _ in range(200) for name in ("a", "b")]
    await asyncio.sleep(0)
    assert pool.queue_length == 400
    tried: list[str] = []
    assign = pool._try_assign

    def counting(key: PoolKey, *args: object, **kwargs: object) -> Lease | None:
        tried.append(key.fqn)
        return assign(key, *args, **kwargs)  # type: ignore[arg-type]

    pool._try_assign = counting  # type: ignore[method-assign]
    pool.release(b.proxy, healthy=True)
    await asyncio.sleep(0)
    assert len(tried) <= 6, tried
    served = [w for w in waiters if w.done()]
    assert served == [waiters[1]] and served[0].result().proxy is b.proxy
    assert pool.queue_length == 399
    # A cancelled waiter leaves the queue's count of its key: the pass still reaches the other key.
    for w in waiters[2::2]:
        w.cancel()
    await asyncio.sleep(0)
    assert pool.queue_length == 200
    tried.clear()
    pool.release(a.proxy, healthy=True)
    await asyncio.sleep(0)
    assert waiters[0].done() and waiters[0].result().proxy is a.proxy
    assert len(tried) <= 6, tried
    for w in waiters:
        w.cancel()
    await asyncio.sleep(0)
    assert pool.queue_length == 0 and not pool._queued_keys
