"""The invoker's load report, published to Redis every period for the balancer.

``{prefix}inv:{name}:report`` holds a msgpack :class:`~dilu_invoker.wire.LoadReport` with a TTL of
``--balancer-report-ttl-s``; ``{prefix}inv:{name}:boot`` holds the boot id with the same TTL (Lua scripts
of the forwarding layer read it to tell a live invoker from a dead one); the name joins the set
``{prefix}invokers``. A report that expires means the invoker is gone. Each period the invoker also renews
the GPU budget reservations of its instances.

SM shares, saturation and throttling come from the node's GPU manager when there is one (anything with a
``view()`` in the shape of :class:`GpuView`); without it they are reported as unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import structlog
from redis.exceptions import RedisError

from dilu_invoker.gpu.budgets import GpuCapacity
from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.invoker.cluster.agent import Agent
from dilu_invoker.invoker.cluster.instances import InstanceManager
from dilu_invoker.wire import FunctionReport, GpuReport, LoadReport, pack

log = structlog.get_logger(__name__)


@runtime_checkable
class GpuView(Protocol):
    """The node GPU manager as the report sees it: per GPU ``(index, uuid, memory_mb, sm_count, instances)``
    with per instance ``(id, function, cls, request, limit, share, memory_mb, active, saturated,
    throttled_s)`` — named fields or positions, either works."""

    def view(self) -> Iterable[Any]: ...


def gpu_view_of(gpu: object) -> GpuView | None:
    """``gpu`` when it can show a view of its GPUs (the node's GPU manager), else None."""
    return gpu if isinstance(gpu, GpuView) else None


_GPU_FIELDS = ("index", "uuid", "memory_mb", "sm_count", "instances")
_INSTANCE_FIELDS = ("id", "function", "cls", "request", "limit", "share", "memory_mb", "active", "saturated",
                    "throttled_s")


def _field(row: Any, name: str, names: Sequence[str]) -> Any:
    if isinstance(row, dict):
        return row.get(name)
    if hasattr(row, name):
        return getattr(row, name)
    try:
        return row[names.index(name)]
    except (TypeError, IndexError, KeyError):
        return None


def shares_from_view(rows: Iterable[Any]) -> dict[str, tuple[float | None, bool | None, float | None]]:
    """Instance id → (share, saturated, throttled seconds) from a GPU manager's view."""
    out: dict[str, tuple[float | None, bool | None, float | None]] = {}
    for gpu in rows:
        for inst in _field(gpu, "instances", _GPU_FIELDS) or ():
            iid = _field(inst, "id", _INSTANCE_FIELDS)
            if iid is None:
                continue
            share = _field(inst, "share", _INSTANCE_FIELDS)
            saturated = _field(inst, "saturated", _INSTANCE_FIELDS)
            throttled = _field(inst, "throttled_s", _INSTANCE_FIELDS)
            out[str(iid)] = (None if share is None else float(share),
                             None if saturated is None else bool(saturated),
                             None if throttled is None else float(throttled))
    return out


class Reporter:
    def __init__(
        self,
        agent: Agent,
        *,
        instances: InstanceManager,
        functions: Callable[[], list[FunctionReport]],
        devices: Sequence[GpuDevice] = (),
        gpu_view: GpuView | None = None,
        period_s: float = 1.0,
        ttl_s: float = 3.0,
        gamma: float = math.inf,
    ) -> None:
        self.redis = agent.redis
        self.keys = agent.keys
        self.name = agent.name
        self.boot = agent.boot
        self.invoker = agent.invoker
        self.instances = instances
        self.functions = functions
        self.devices = tuple(devices)
        self.budgets = agent.budgets
        self.gpu_view = gpu_view
        self.period_s = period_s
        self.ttl_ms = int(ttl_s * 1000)
        self.gamma = gamma
        self.published = 0
        self._nudged = asyncio.Event()

    def nudge(self) -> None:
        """Publish now, not at the end of the period, and wake the balancer (an instance became ready, failed
        or stopped: the routing tables should follow at once)."""
        self._nudged.set()

    async def register_gpus(self) -> None:
        """Make the GPUs' budgets known (idempotent; the node's GPU manager registers the same)."""
        if self.budgets is None:
            return
        for d in self.devices:
            await self.budgets.register_gpu(d.uuid, GpuCapacity(node=self.name, index=d.index, name=d.name,
                                                                memory_mb=d.memory_mb, sm_count=d.sm_count,
                                                                gamma=self.gamma))

    def build(self) -> LoadReport:
        shares = None
        if self.gpu_view is not None:
            try:
                shares = shares_from_view(self.gpu_view.view())
            except Exception as exc:  # noqa: BLE001 - a report without shares beats no report
                log.warning("GPU manager view failed", error=str(exc))
        pool = self.invoker.pool
        return LoadReport(
            invoker=self.name,
            boot=self.boot,
            at_ms=time.time_ns() // 1_000_000,
            period_s=self.period_s,
            enabled=self.invoker.enabled,
            epoch=self.instances.max_epoch,
            user_memory_mb=pool.user_memory_mb,
            memory_in_use_mb=pool.memory_in_use_mb,
            gpus=tuple(GpuReport(index=d.index, uuid=d.uuid, name=d.name, memory_mb=d.memory_mb,
                                 sm_count=d.sm_count, simulated=d.simulated) for d in self.devices),
            instances=tuple(self.instances.reports(shares)),
            functions=tuple(self.functions()),
        )

    async def publish_once(self) -> None:
        report = self.build()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.report(self.name), pack(report), px=self.ttl_ms)
            pipe.set(self.keys.boot(self.name), self.boot, px=self.ttl_ms)
            pipe.sadd(self.keys.invokers, self.name)
            await pipe.execute()
        self.published += 1
        with contextlib.suppress(RedisError):
            await self.instances.renew_reservations()

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            nudged = self._nudged.is_set()
            self._nudged.clear()
            try:
                await self.publish_once()
                if nudged:
                    await self.redis.xadd(self.keys.demand, {"w": self.name}, maxlen=1000, approximate=True)
            except RedisError as exc:
                log.warning("cannot publish the load report", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), max(0.0, self.period_s - (time.monotonic() - started)))

    async def withdraw(self) -> None:
        """Leave the cluster now (a clean shutdown): the balancer re-places this invoker's instances at once
        and origins take back what was forwarded here and not begun."""
        with contextlib.suppress(RedisError):
            await self.redis.delete(self.keys.report(self.name), self.keys.boot(self.name))
