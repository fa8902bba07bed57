"""Staged exit (after SAGE): when the last instance of a GPU function that declares its read-only weights
(``gpu-weights-mb``) leaves a GPU of this invoker — scaled in by the balancer or idle too long — its compute
is released at once and its weights stay: the container's process lives on, out of the pool (it takes no
activation), its SM share is given back and its GPU budget reservation shrinks to the weights
(`GpuNode.keep_weights`). The models API's holder in that process keeps serving the weights, so the next
instance of the function revision on that GPU maps them in milliseconds instead of loading them, and needs
only the rest of its memory in the budget.

A kept process goes when ``--invoker-weights-grace-s`` has passed with no instance of its function revision
on that GPU (while instances live there it stays: they may map from it), when the host memory it holds is
needed (the pool sheds kept processes before pre-loaded ones and before it evicts a warm container), when a
GPU container cannot be attached for want of room (the kept processes go first, then the attach is tried
again), and when the invoker stops. Only where instances can map each other's weights (the node counts them
once: the process backend, not between Docker containers, nor between isolated MPS clients on a kernel
without ``ns_last_pid``, see `gpu.node._weights_of`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from dilu_invoker.invoker.dataplane.backends.base import Container, drain_output
from dilu_invoker.invoker.dataplane.container import ContainerProxy
from dilu_invoker.model import Action

log = structlog.get_logger(__name__)

#: how often the keeper looks at its kept processes (grace expiry, a process that died)
CHECK_PERIOD_S = 1.0

Group = tuple[str, str, int]
"""(action fqn, revision, GPU index): the instances that share one copy of weights."""


def group_of(proxy: ContainerProxy) -> Group | None:
    gpu = proxy.placement.gpu
    if gpu is None or gpu.gpu_index is None:
        return None
    return proxy.action.fqn, proxy.key.revision, gpu.gpu_index


@dataclass(eq=False, slots=True)
class Kept:
    proxy: ContainerProxy
    container: Container
    """The backend's handle (the proxy's ends when the pool forgets it)."""
    group: Group
    gpu_key: str
    """What its weights are attached under in the GPU node (`GpuNode.keep_weights`)."""
    memory_mb: int
    since: float
    until: float
    drain: asyncio.Task[None] | None = None
    gone: bool = False


class KeeperMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("dilu_invoker_weights_kept_events", "Staged exit: processes kept with their weights "
                              "(kept), instances that started beside kept weights (reused), and kept processes "
                              "removed (expired, shed for host memory, evicted for GPU room, died, closed)",
                              ("event",), registry=registry)
        self.kept = Gauge("dilu_invoker_weights_kept", "Processes kept for their GPU weights (staged exit)",
                          registry=registry)
        self.memory = Gauge("dilu_invoker_weights_kept_memory_mb", "Host memory held by kept processes (MB)",
                            registry=registry)


class WeightsKeeper:
    """The kept processes of one invoker; also a `pool.Reserve` (their host memory counts against the user
    memory and is released first)."""

    def __init__(self, *, grace_s: float, keep_weights: Callable[[str], Awaitable[str | None]],
                 destroy: Callable[[ContainerProxy, Container, str], Awaitable[None]],
                 members: Callable[[Group], int],
                 registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self._keep_weights = keep_weights
        self._destroy = destroy
        self._members = members
        self._clock = clock
        self.metrics = KeeperMetrics(registry)
        self.kept: dict[str, Kept] = {}  # container name -> kept
        self._tasks: set[asyncio.Task[None]] = set()
        self._keeping: set[Group] = set()
        self._loop: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0 and not self._closed

    @property
    def memory_in_use_mb(self) -> int:
        return sum(k.memory_mb for k in self.kept.values() if not k.gone)

    def holds(self, group: Group) -> bool:
        return any(k.group == group and not k.gone for k in self.kept.values())

    # -- keeping -------------------------------------------------------------------------------------

    async def keep(self, proxy: ContainerProxy) -> bool:
        """Keep ``proxy``'s process for its weights instead of destroying it; False: destroy it as usual."""
        group = group_of(proxy)
        container = proxy.container
        if (not self.enabled or group is None or container is None or not container.alive or self.holds(group)
                or group in self._keeping):
            return False
        self._keeping.add(group)  # two instances of the group removed at once: one is kept
        try:
            gpu_key = await self._keep_weights(proxy.placement.gpu_key or proxy.name)
        finally:
            self._keeping.discard(group)
        if gpu_key is None:
            return False
        now = self._clock()
        kept = Kept(proxy=proxy, container=container, group=group, gpu_key=gpu_key, memory_mb=proxy.memory_mb,
                    since=now, until=now + self.grace_s)
        self.kept[proxy.name] = kept
        if proxy.output is not None:
            # Its output is no activation's: stop collecting, read and drop what it still prints.
            await proxy.output.close()
        kept.drain = asyncio.create_task(drain_output(container, proxy.name, "kept for its weights"))
        self.metrics.events.labels("kept").inc()
        self._update()
        log.info("instance's weights kept on the GPU (staged exit)", container=proxy.name, action=group[0],
                 revision=group[1], gpu=group[2], grace_s=self.grace_s, memory_mb=proxy.memory_mb)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._watch(), name="weights-keeper")
        return True

    def started_beside(self, group: Group) -> None:
        """A new instance of ``group`` got a GPU: it maps the kept weights (counted as a reuse)."""
        if self.holds(group):
            self.metrics.events.labels("reused").inc()
            log.info("instance starts beside kept weights", action=group[0], revision=group[1], gpu=group[2])

    async def _watch(self) -> None:
        while self.kept:
            await asyncio.sleep(CHECK_PERIOD_S)
            self.check()

    def check(self) -> None:
        """Let go what expired or died; a kept process whose function has instances on its GPU stays."""
        now = self._clock()
        for k in list(self.kept.values()):
            if k.gone:
                continue
            if not k.container.alive:
                self._let_go(k, "died")
            elif self._members(k.group) > 0:
                k.until = now + self.grace_s  # they may map from it: the grace starts when the last one goes
            elif now >= k.until:
                self._let_go(k, "expired")

    def _let_go(self, k: Kept, why: str) -> None:
        k.gone = True
        self.metrics.events.labels(why).inc()
        log.info("kept weights released", container=k.proxy.name, action=k.group[0], gpu=k.group[2], reason=why,
                 kept_s=round(self._clock() - k.since, 1))
        task = asyncio.ensure_future(self._remove(k))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._update()

    async def _remove(self, k: Kept) -> None:
        try:
            if k.drain is not None:
                k.drain.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await k.drain
            await self._destroy(k.proxy, k.container, k.gpu_key)
        except Exception:
            log.exception("removing a kept process failed", container=k.proxy.name)
        finally:
            self.kept.pop(k.proxy.name, None)
            self._update()

    async def evict_gpu(self, gpu_index: int | None) -> int:
        """Release every kept process on a GPU (None: on every GPU) where a container found no room; how many."""
        victims = [k for k in self.kept.values() if not k.gone and gpu_index in (None, k.group[2])]
        for k in victims:
            self._let_go(k, "evicted")
        await self._settle()
        return len(victims)

    async def _settle(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- pool.Reserve ----------------------------------------------------------------------------------

    def memory_for(self, action: Action) -> int:
        return self.memory_in_use_mb

    def shed(self, need_mb: int, action: Action) -> int:
        released = 0
        for k in sorted((k for k in self.kept.values() if not k.gone), key=lambda k: k.since):
            if released >= need_mb:
                break
            self._let_go(k, "shed")
            released += k.memory_mb
        return released

    # -------------------------------------------------------------------------------------------------

    def _update(self) -> None:
        self.metrics.kept.set(sum(1 for k in self.kept.values() if not k.gone))
        self.metrics.memory.set(self.memory_in_use_mb)

    async def close(self) -> None:
        self._closed = True
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        for k in list(self.kept.values()):
            if not k.gone:
                self._let_go(k, "closed")
        await self._settle()
