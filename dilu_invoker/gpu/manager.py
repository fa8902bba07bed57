"""The per-GPU vertical manager: every period, read each instance's stats block, let the vertical policy
decide the shares, write them into the control blocks (docs/gpu-manager.md).

One :class:`GpuManager` per GPU, one asyncio task each (``start``/``stop``). A tick is synchronous and
short (a few memory copies per instance and one pure policy call), so it runs on the event loop; it
never waits for Redis: shares are handed to a publisher callback whose call runs as its own task, at
most one at a time per GPU.

Shares become token rates through each instance's *capacity*, the thread blocks per millisecond it
launches when it has the whole GPU. :func:`estimate_capacity` learns it online (or takes the
``gpu-capacity-blocks-per-ms`` annotation measured by the profiler).

Imports stay light on purpose (stdlib, structlog, the policy, the ABI mirror): the GPU benchmark runs
this same class on a machine that has none of the service's other dependencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import structlog

from dilu_invoker.gpu import abi
from dilu_invoker.gpu.load import LoadReading
from dilu_invoker.policy.types import EPS, InstanceClass
from dilu_invoker.policy.vertical import (
    FeedbackMode,
    VerticalDecision,
    VerticalInstance,
    VerticalSnapshot,
)
from dilu_invoker.policy.vertical_slo import (
    AnyVerticalConfig,
    SloConfig,
    SloState,
    decide_vertical,
    gates_launches,
    initial_state,
    mps_start_threads,
    policy_name,
)

log = structlog.get_logger(__name__)

_DEFAULT_WINDOW_NS = abi.WINDOW_TICKS * abi.TICK_NS
#: modes in which the policy cuts best-effort instances to their floor now
CUT_MODES = frozenset({FeedbackMode.EMERGENCY})
#: a GPU whose policy cuts again and again logs the cut at info at most this often
CUT_LOG_EVERY_S = 10.0


async def ticks(period_s: float) -> AsyncIterator[int]:
    """Yield once per period on a fixed schedule (no drift); missed ticks are skipped, not bunched."""
    if not (math.isfinite(period_s) and period_s > 0):
        raise ValueError(f"period must be > 0, got {period_s!r}")
    loop = asyncio.get_running_loop()
    start = loop.time()
    n = 0
    while True:
        yield n
        n += 1
        target = start + n * period_s
        now = loop.time()
        if target < now:
            # Late by a period or more (a stalled loop): resume on the schedule from now on.
            n = math.ceil((now - start) / period_s)
            target = start + n * period_s
        await asyncio.sleep(target - now)


# -- instances -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceSpec:
    """What the manager knows of an instance from its placement: identity, class, shares, caps."""

    id: str
    function: str
    cls: InstanceClass
    request: float
    limit: float
    memory_mb: int = 0
    """Device memory cap (MiB); 0: none."""
    slo_ms: float | None = None
    capacity_blocks_per_ms: float | None = None
    """Measured capacity (``gpu-capacity-blocks-per-ms``): replaces the online estimate."""

    def __post_init__(self) -> None:
        # VerticalInstance validates id, request and limit the same way.
        VerticalInstance(id=self.id, cls=self.cls, request=self.request, limit=self.limit)
        if self.memory_mb < 0:
            raise ValueError(f"{self.id}: memory_mb must be >= 0")
        if self.capacity_blocks_per_ms is not None and not (
            math.isfinite(self.capacity_blocks_per_ms) and self.capacity_blocks_per_ms > 0
        ):
            raise ValueError(f"{self.id}: capacity_blocks_per_ms must be > 0, got {self.capacity_blocks_per_ms!r}")

    @property
    def mem_cap_bytes(self) -> int:
        return self.memory_mb * 1024 * 1024

    @property
    def starting_share(self) -> float:
        """The policy's standing cap for an idle instance: a latency-critical one starts at its limit (its
        first request runs unthrottled), a best-effort one at its request."""
        return self.limit if self.cls.latency_critical else self.request

    @property
    def namespace_action(self) -> tuple[str, str]:
        ns, _, action = self.function.partition("/")
        return (ns, action) if action else ("", ns)


# -- reading the stats block ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Counters:
    """The monotonic counters of the last stats snapshot (to take differences)."""

    pid: int
    launches: int
    blocks: int
    throttled_ns: int
    windows: int
    cycles: int
    cycle_current_windows: int
    spans: int = 0
    mem_peak_bytes: int = 0

    @classmethod
    def of(cls, s: abi.StatsSnapshot) -> Counters:
        return cls(
            pid=s.pid,
            launches=s.launches + s.graph_launches,
            blocks=s.blocks,
            throttled_ns=s.throttled_ns,
            windows=s.windows,
            cycles=s.cycles,
            cycle_current_windows=s.cycle_current_windows,
            spans=s.spans,
            mem_peak_bytes=s.mem_peak_bytes,
        )


@dataclass(frozen=True, slots=True)
class Reading:
    """What happened in one instance since the previous snapshot."""

    published: bool
    """A shim has published the block (a process under the shim exists)."""
    restarted: bool
    """The counters went back or another process owns the block: the deltas count from zero."""
    blocks: int
    launches: int
    throttled_s: float
    windows: int
    """Launch windows (5 ms) completed in between."""
    busy_windows: int
    """Of those, windows with launches."""
    cycles_s: tuple[float, ...]
    """Kernel-launch cycles completed in between, oldest first, in seconds."""
    open_cycle_s: float
    mem_used_bytes: int = 0
    stale: bool = False
    window_s: float = _DEFAULT_WINDOW_NS / 1e9
    spans: int = 0
    """Request spans (first launch to a quiet, successful sync) completed in between."""
    spans_s: tuple[float, ...] = ()
    """Their lengths in seconds, oldest first; the newest ``abi.SPAN_RING`` when more completed."""
    open_span_s: float = 0.0
    """Age of the span in progress when read (0: none)."""
    mem_grown_bytes: int = 0
    """Growth of the device-memory high-water mark in between (allocations: loading, warm-up)."""

    @property
    def busy_s(self) -> float:
        return self.busy_windows * self.window_s

    @property
    def demand(self) -> bool:
        return self.blocks > 0 or self.open_cycle_s > 0


EMPTY_READING = Reading(
    published=False, restarted=False, blocks=0, launches=0, throttled_s=0.0, windows=0, busy_windows=0,
    cycles_s=(), open_cycle_s=0.0,
)


def read_delta(prev: Counters | None, snap: abi.StatsSnapshot, *,
               now_ns: int | None = None) -> tuple[Reading, Counters | None]:
    """The reading between ``prev`` and ``snap``, and the counters to keep for the next call.

    Counters are cumulative since the owning process started; when they go back (a new process claimed
    the block) or the pid changes, the new values are what happened since, so they count whole. An
    unpublished block (no process yet) reads as nothing and keeps no counters. ``now_ns`` (default: now)
    is CLOCK_MONOTONIC, the shim's clock, for the age of an open span.
    """
    if not snap.published:
        return EMPTY_READING, None
    now = Counters.of(snap)
    restarted = prev is not None and (
        now.pid != prev.pid
        or now.blocks < prev.blocks
        or now.launches < prev.launches
        or now.windows < prev.windows
        or now.cycles < prev.cycles
        or now.throttled_ns < prev.throttled_ns
        or now.spans < prev.spans
    )
    base = prev if prev is not None and not restarted else None
    window_ns = snap.window_ns or _DEFAULT_WINDOW_NS
    new_cycles = now.cycles - (base.cycles if base else 0)
    recent = snap.recent_cycles[-new_cycles:] if new_cycles > 0 else ()
    open_prev = base.cycle_current_windows if base else 0
    windows = now.windows - (base.windows if base else 0)
    # The cycle that was open last time either grew (no cycle completed) or is among the completed ones;
    # either way its first open_prev windows were counted before.
    busy = sum(recent) + now.cycle_current_windows - open_prev
    busy = max(0, min(busy, windows)) if windows > 0 else 0
    new_spans = now.spans - (base.spans if base else 0)
    spans_us = snap.recent_spans_us[-new_spans:] if new_spans > 0 else ()
    if snap.span_open_ns:
        read_ns = time.monotonic_ns() if now_ns is None else now_ns
        open_span_s = max(0, read_ns - snap.span_open_ns) / 1e9
    else:
        open_span_s = 0.0
    reading = Reading(
        published=True,
        restarted=restarted,
        blocks=now.blocks - (base.blocks if base else 0),
        launches=now.launches - (base.launches if base else 0),
        throttled_s=(now.throttled_ns - (base.throttled_ns if base else 0)) / 1e9,
        windows=windows,
        busy_windows=busy,
        cycles_s=tuple(c * window_ns / 1e9 for c in recent),
        open_cycle_s=now.cycle_current_windows * window_ns / 1e9,
        mem_used_bytes=snap.mem_used_bytes,
        stale=snap.stale,
        window_s=window_ns / 1e9,
        spans=new_spans,
        spans_s=tuple(us / 1e6 for us in spans_us),
        open_span_s=open_span_s,
        mem_grown_bytes=max(0, now.mem_peak_bytes - (base.mem_peak_bytes if base else 0)),
    )
    return reading, now


def vertical_instance(
    spec: InstanceSpec,
    reading: Reading,
    *,
    period_s: float,
    last_active_at: float | None,
    share: float | None,
    load: LoadReading | None = None,
    mps_threads: float | None = None,
) -> VerticalInstance:
    """The policy's view of one instance this period (``last_active_at`` already updated for it); ``load``:
    its own queue as the invoker reports it (None: not reported); ``mps_threads``: the active-thread fraction
    its MPS client started with (None: not known)."""
    q = load or LoadReading()
    return VerticalInstance(
        id=spec.id,
        cls=spec.cls,
        request=spec.request,
        limit=spec.limit,
        slo_ms=spec.slo_ms,
        blocks=reading.blocks,
        last_active_at=last_active_at,
        # Summed over the instance's waiting threads: clip to the period so it stays a fraction of time.
        throttled_s=min(reading.throttled_s, period_s),
        cycles_s=reading.cycles_s,
        open_cycle_s=reading.open_cycle_s,
        spans_s=reading.spans_s,
        open_span_s=reading.open_span_s,
        share=share,
        queue_known=load is not None, runs_s=q.runs_s, open_run_s=q.open_run_s, waits_s=q.waits_s,
        queued=q.queued, oldest_wait_s=q.oldest_wait_s, mps_threads=mps_threads,
    )


# -- capacity ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CapacityConfig:
    """How the manager learns an instance's capacity (blocks/ms with the whole GPU); docs/gpu-manager.md.

    The estimate is a lower bound that only trustworthy periods raise: an instance runs unlimited until
    ``trust_periods`` of them have been seen, and a low estimate is found out by probing while the
    instance waits for tokens at its limit.
    """

    half_life_s: float = 600.0
    """An estimate decays toward newer observations with this half-life. Slow on purpose: an
    over-estimate is corrected by the policy's latency feedback, an under-estimate starves the instance."""
    trust_periods: int = 3
    """Consecutive trustworthy periods (unthrottled, busy-dominated, no new device memory) before the
    first estimate is used; until then the instance runs unlimited."""
    min_busy_fraction: float = 0.5
    """A period whose 5 ms launch windows are busy less than this fraction is idle-dominated: its
    launches were paced by the host (loading, a request now and then), not by the GPU."""
    probe_growth: float = 2.0
    """Per period, while an instance waits for tokens at its limit with no other latency-critical demand."""
    max_probe_ratio: float = 64.0
    """Probing never goes beyond this multiple of the highest rate observed: trustworthy periods' busy rates
    and the rate the instance consumes at its quota while probing (so the bound moves up with the probe)."""
    probe_backoff_s: float = 1.0
    """After a probe that found no faster rate, the next waits this long, doubling up to ``max_probe_backoff_s``."""
    max_probe_backoff_s: float = 30.0
    throttled_fraction: float = 0.1
    """Waiting for tokens at least this fraction of the period counts as throttled."""
    clean_fraction: float = 0.02
    """Waiting less than this fraction: the observed rate was the instance's own."""
    min_busy_windows: int = 2
    """Fewer busy 5 ms windows in a period give too coarse a rate to learn from."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.half_life_s) and self.half_life_s > 0):
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s!r}")
        if self.trust_periods < 1:
            raise ValueError("trust_periods must be >= 1")
        if not 0.0 <= self.min_busy_fraction <= 1.0:
            raise ValueError(f"min_busy_fraction must be within [0, 1], got {self.min_busy_fraction!r}")
        if not (math.isfinite(self.probe_growth) and self.probe_growth > 1.0):
            raise ValueError(f"probe_growth must be > 1, got {self.probe_growth!r}")
        if not (math.isfinite(self.max_probe_ratio) and self.max_probe_ratio >= 1.0):
            raise ValueError(f"max_probe_ratio must be >= 1, got {self.max_probe_ratio!r}")
        if not (0 <= self.probe_backoff_s <= self.max_probe_backoff_s and math.isfinite(self.max_probe_backoff_s)):
            raise ValueError("need 0 <= probe_backoff_s <= max_probe_backoff_s < inf")
        if not 0.0 <= self.clean_fraction <= self.throttled_fraction <= 1.0:
            raise ValueError("need 0 <= clean_fraction <= throttled_fraction <= 1")
        if self.min_busy_windows < 1:
            raise ValueError("min_busy_windows must be >= 1")


@dataclass(frozen=True, slots=True)
class CapacityEstimate:
    """An instance's capacity as far as the manager knows it."""

    blocks_per_ms: float | None = None
    """In force; None: unknown (the instance runs unlimited until ``trust_periods`` trustworthy periods)."""
    peak_blocks_per_ms: float = 0.0
    """Highest trustworthy rate ever observed (bounds probing)."""
    override: float | None = None
    """Measured by the profiler; never changed by observations."""
    trusted_periods: int = 0
    """While unknown: trustworthy periods in a row so far."""
    learnt_blocks_per_ms: float | None = None
    """The estimate observations support (``blocks_per_ms`` is above it while a probe runs)."""
    probing: bool = False
    next_probe_at: float = -math.inf
    probe_backoff_s: float = 0.0

    @property
    def value(self) -> float | None:
        return self.override if self.override is not None else self.blocks_per_ms


@dataclass(frozen=True, slots=True)
class CapacityObservation:
    """One period of one instance, as the estimator needs it."""

    blocks: int
    busy_windows: int
    window_s: float
    elapsed_s: float
    throttled_s: float
    limited: bool
    """A finite rate was in force."""
    at_limit: bool
    """Its share in force is its limit."""
    others_latency_active: bool
    """Another latency-critical instance on this GPU has demand."""
    windows: int | None = None
    """5 ms launch windows completed in the period (None: as many as busy)."""
    mem_grown_bytes: int = 0
    """Growth of the process's device-memory high-water mark in the period (loading, warm-up)."""
    now: float = 0.0

    @property
    def busy_rate(self) -> float:
        """Blocks per ms while it had launches (a bursty instance's rate inside its bursts)."""
        busy_ms = self.busy_windows * self.window_s * 1000.0
        return self.blocks / busy_ms if busy_ms > 0 else 0.0

    @property
    def busy_fraction(self) -> float:
        windows = self.windows if self.windows is not None else self.busy_windows
        return self.busy_windows / windows if windows > 0 else 0.0


def estimate_capacity(
    est: CapacityEstimate, obs: CapacityObservation, config: CapacityConfig
) -> tuple[CapacityEstimate, str]:
    """The next estimate and why (pure).

    * Only a *trustworthy* period teaches: the instance (almost) never waited for tokens, most of its
      launch windows were busy, at least ``min_busy_windows`` of them, and its device memory did not grow
      (model loading and warm-up allocate; their launches are paced by copies and the host). Its busy
      rate is a lower bound of the capacity.
    * Unknown capacity means unlimited; the first estimate is the highest rate of ``trust_periods``
      trustworthy periods in a row. After that the estimate is the highest trustworthy rate, decaying
      slowly (half-life ``half_life_s``) toward newer ones.
    * Throttled at its limit while no other latency-critical instance has demand: the estimate may be
      low (the instance would run faster than share x estimate allows). Probe upward x``probe_growth``
      per period (at most ``max_probe_ratio`` x the highest rate seen, its consumed quota included) until
      the quota no longer binds; the rate then observed is the instance's own. A probe that found nothing faster backs off (``probe_backoff_s``
      doubling), so an estimate that is right costs one short probe now and then.
    * Throttled otherwise: no information.
    """
    if est.override is not None:
        return est, f"measured capacity {est.override:.1f} blocks/ms"
    period = max(obs.elapsed_s, 1e-9)
    waited = obs.throttled_s / period if obs.limited else 0.0
    if waited >= config.throttled_fraction:
        if est.blocks_per_ms is None:
            return est, f"throttled {waited:.0%} with no estimate in force"
        if not obs.at_limit or obs.others_latency_active:
            return est, f"throttled {waited:.0%}: its rate is the quota's, not its own"
        if not est.probing and obs.now < est.next_probe_at:
            return est, f"throttled at its limit; next probe in {est.next_probe_at - obs.now:.1f} s"
        # Whatever it consumed at its quota is also a rate it sustains: the ceiling follows it, so an estimate
        # that started more than max_probe_ratio x too low keeps climbing while the quota binds.
        sustained = obs.blocks / (period * 1000.0)
        ceiling = max(est.peak_blocks_per_ms, est.learnt_blocks_per_ms or 0.0, sustained) * config.max_probe_ratio
        grown = min(est.blocks_per_ms * config.probe_growth, ceiling)
        if grown <= est.blocks_per_ms * (1 + 1e-9):
            return est, f"throttled at its limit; probing stopped at {config.max_probe_ratio}x the peak"
        why = (f"throttled {waited:.0%} at its limit with no other latency-critical demand: "
               f"probe {est.blocks_per_ms:.1f} -> {grown:.1f} blocks/ms")
        return replace(est, blocks_per_ms=grown, probing=True), why
    if obs.mem_grown_bytes > 0:
        why = f"loading: device memory grew {obs.mem_grown_bytes / 2**20:.1f} MiB; not learnt"
        return (replace(est, trusted_periods=0) if est.blocks_per_ms is None else est), why
    if waited >= config.clean_fraction or obs.busy_windows < config.min_busy_windows or obs.blocks <= 0:
        return est, "no clean busy period to learn from"
    if obs.busy_fraction < config.min_busy_fraction:
        return est, f"idle-dominated ({obs.busy_fraction:.0%} of windows busy): not learnt"
    rate = obs.busy_rate
    peak = max(est.peak_blocks_per_ms, rate)
    if est.blocks_per_ms is None:
        n = est.trusted_periods + 1
        if n < config.trust_periods:
            return (replace(est, trusted_periods=n, peak_blocks_per_ms=peak),
                    f"trustworthy period {n}/{config.trust_periods} at {rate:.1f} blocks/ms: unlimited meanwhile")
        return (CapacityEstimate(blocks_per_ms=peak, peak_blocks_per_ms=peak, learnt_blocks_per_ms=peak,
                                 trusted_periods=n, probe_backoff_s=config.probe_backoff_s),
                f"learnt {peak:.1f} blocks/ms from {n} trustworthy periods")
    learnt = est.learnt_blocks_per_ms if est.learnt_blocks_per_ms is not None else est.blocks_per_ms
    decayed = learnt * 0.5 ** (obs.elapsed_s / config.half_life_s)
    new = max(rate, decayed)
    if est.probing:
        # The quota stopped binding: the rate seen now is the instance's own.
        if rate > learnt * 1.1:
            return (replace(est, blocks_per_ms=new, learnt_blocks_per_ms=new, peak_blocks_per_ms=peak,
                            probing=False, next_probe_at=obs.now, probe_backoff_s=config.probe_backoff_s),
                    f"probe found {rate:.1f} blocks/ms (was {learnt:.1f}): raised")
        backoff = min(max(est.probe_backoff_s, config.probe_backoff_s) * 2, config.max_probe_backoff_s)
        return (replace(est, blocks_per_ms=new, learnt_blocks_per_ms=new, peak_blocks_per_ms=peak,
                        probing=False, next_probe_at=obs.now + est.probe_backoff_s, probe_backoff_s=backoff),
                f"probe found nothing faster ({rate:.1f} blocks/ms): back to {new:.1f}, next probe in "
                f"{est.probe_backoff_s:.1f} s")
    why = (f"observed {rate:.1f} blocks/ms unthrottled: raised" if rate >= decayed
           else f"observed {rate:.1f} blocks/ms: decayed to {new:.1f}")
    return replace(est, blocks_per_ms=new, learnt_blocks_per_ms=new, peak_blocks_per_ms=peak), why


def quota_for(
    share: float, capacity: float | None, *, mem_cap_bytes: int, stale_after_ns: int
) -> abi.Quota:
    """The control block for a share: rate = share × capacity; unlimited at share ≥ 1 or with no
    capacity yet (the share is recorded either way)."""
    share = min(max(share, 0.0), 1.0)
    if share >= 1.0 - EPS or capacity is None or capacity <= 0:
        return abi.Quota(rate_blocks_per_ms=0.0, share=share, capacity_blocks_per_ms=capacity or 0.0,
                         mem_cap_bytes=mem_cap_bytes, stale_after_ns=stale_after_ns)
    # A share of 0 would mean "unlimited" to the shim; the policy's floor keeps it positive, and this
    # keeps a token trickle even if it did not.
    return abi.Quota.from_share(max(share, 1e-4), capacity, mem_cap_bytes=mem_cap_bytes,
                                stale_after_ns=stale_after_ns)


# -- what a tick produced ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """One instance after a tick (the node's view and the metrics are built from these)."""

    id: str
    share: float
    rate_blocks_per_ms: float
    """In the control block; 0 = unlimited."""
    capacity_blocks_per_ms: float | None
    active: bool
    saturated: bool
    throttled_s: float
    blocks: int
    mem_used_bytes: int
    pinned: bool
    stale: bool
    reason: str
    capacity_reason: str = ""
    busy_s: float = 0.0
    """Time of the period in launch windows with launches (busy 5 ms windows × 5 ms)."""
    cycles_s: tuple[float, ...] = ()
    """Kernel-launch cycles completed this period."""
    open_cycle_s: float = 0.0
    """The cycle in progress (0: none)."""
    spans_s: tuple[float, ...] = ()
    """Request spans completed this period, oldest first, in seconds (at most ``abi.SPAN_RING``, the newest)."""
    open_span_s: float = 0.0
    """Age of the request span in progress when the stats block was read (0: none)."""


@dataclass(frozen=True, slots=True)
class TickRecord:
    """Everything one tick decided, for observers (tests, the benchmark) and the debug log."""

    gpu: str
    now: float
    mode: FeedbackMode
    budget: float | None
    reason: str
    instances: tuple[InstanceStatus, ...]
    elapsed_s: float

    def status(self, instance: str) -> InstanceStatus:
        for s in self.instances:
            if s.id == instance:
                return s
        raise KeyError(instance)


class ManagerMetrics(Protocol):
    """What the manager reports each tick (``dilu_invoker.gpu.metrics.GpuMetrics`` implements it)."""

    def observe_instance(self, spec: InstanceSpec, gpu: GpuLabel, status: InstanceStatus,
                         reading: Reading) -> None: ...

    def observe_gpu(self, gpu: GpuLabel, *, fragmentation: float, utilization: float | None,
                    mode: FeedbackMode, decided: bool) -> None: ...

    def forget_instance(self, spec: InstanceSpec, gpu: GpuLabel) -> None: ...

    def observe_policy(self, gpu: GpuLabel, *, policy: str, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class GpuLabel:
    index: int
    uuid: str


SharePublisher = Callable[[str, Mapping[str, float]], Awaitable[None]]
"""``publish(uuid, {instance: share})``: best effort (Redis); the manager never waits for it."""


@dataclass(slots=True)
class _Managed:
    """One instance's mutable state; only the manager's tick and its add/remove/pin touch it."""

    spec: InstanceSpec
    control: abi.ControlFile
    stats: abi.StatsFile
    share: float
    quota: abi.Quota
    capacity: CapacityEstimate
    pinned: float | None = None
    counters: Counters | None = None
    last_active_at: float | None = None
    status: InstanceStatus | None = None
    last_reading: Reading = EMPTY_READING
    load: Callable[[], LoadReading] | None = None
    """Reads the instance's own queue from the invoker (`dilu_invoker.gpu.load`); None: not reported."""
    mps_threads: float | None = None
    """The active-thread fraction its MPS client started with (the policy's choice when it was added)."""


@dataclass(slots=True)
class _PublishState:
    task: asyncio.Task[None] | None = None
    last: dict[str, float] = field(default_factory=dict)
    last_at: float = -math.inf


class GpuManager:
    """The vertical manager of one GPU."""

    def __init__(
        self,
        *,
        uuid: str,
        index: int = 0,
        period_s: float = 0.05,
        vertical: AnyVerticalConfig | None = None,
        capacity: CapacityConfig | None = None,
        stale_after_s: float | None = None,
        publish: SharePublisher | None = None,
        publish_every_s: float = 1.0,
        metrics: ManagerMetrics | None = None,
        utilization: Callable[[], float | None] | None = None,
        observers: tuple[Callable[[TickRecord], None], ...] = (),
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        self.uuid = uuid
        self.index = index
        self.label = GpuLabel(index, uuid)
        self.period_s = period_s
        self.vertical: AnyVerticalConfig = vertical or SloConfig()  # its type selects the policy
        self.policy_reason = f"--gpu-vertical-policy {policy_name(self.vertical)}"
        """Why this GPU runs its policy (`GpuNode` sets it once the GPU's MPS decision is known)."""
        self.capacity_config = capacity or CapacityConfig()
        # Ten missed periods (and at least a second) mean the manager is gone: the shim fails static.
        stale = stale_after_s if stale_after_s is not None else max(1.0, 10 * period_s)
        if not (math.isfinite(stale) and stale >= 0):
            raise ValueError(f"stale_after_s must be >= 0, got {stale!r}")
        self.stale_after_ns = int(stale * 1e9)
        self._publish = publish
        self._publish_every_s = publish_every_s
        self._metrics = metrics
        self._utilization = utilization
        self._utilization_value: float | None = None
        self._utilization_at = -math.inf
        self._observers = list(observers)
        self._clock_ns = clock_ns
        self._instances: dict[str, _Managed] = {}
        self._state: SloState = initial_state(self.vertical)
        self._last_tick_ns: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._pub = _PublishState()
        self._log = log.bind(gpu=index, uuid=uuid)
        self.last: TickRecord | None = None
        self._cut_logged_at = -math.inf
        self._cuts_unlogged = 0
        self._cut_open = False

    # -- membership ------------------------------------------------------------------------------

    @property
    def gates_launches(self) -> bool:
        """Whether shares become token rates in the shim (False under `spatial`: every launch is admitted,
        MPS's thread caps split the SMs; a pinned share is still enforced)."""
        return gates_launches(self.vertical)

    def initial_quota(self, spec: InstanceSpec, *, lc_requests: float | None = None) -> abi.Quota:
        """The control block an instance starts with (written before its container starts); unlimited where
        the policy does not gate launches (its thread cap recorded as the share)."""
        if not self.gates_launches:
            return quota_for(self.mps_threads(spec, lc_requests=lc_requests), None,
                             mem_cap_bytes=spec.mem_cap_bytes, stale_after_ns=self.stale_after_ns)
        return quota_for(spec.starting_share, spec.capacity_blocks_per_ms, mem_cap_bytes=spec.mem_cap_bytes,
                         stale_after_ns=self.stale_after_ns)

    def latency_critical_requests(self, *, besides: str | None = None) -> float:
        """Σ SM request of the latency-critical instances managed on this GPU (other than ``besides``)."""
        return sum(m.spec.request for m in self._instances.values()
                   if m.spec.cls.latency_critical and m.spec.id != besides)

    def mps_threads(self, spec: InstanceSpec, *, lc_requests: float | None = None) -> float:
        """The MPS active-thread fraction the instance's client starts with under this GPU's policy (MPS fixes
        it when the process connects: `GpuNode` puts it in the container's environment). ``lc_requests``: Σ SM
        request of the latency-critical instances on the GPU besides it (None: those this manager holds)."""
        lc = self.latency_critical_requests(besides=spec.id) if lc_requests is None else lc_requests
        return mps_start_threads(spec.cls, spec.limit, self.vertical, request=spec.request, lc_requests=lc)

    def add(self, spec: InstanceSpec, control: abi.ControlFile, stats: abi.StatsFile, *,
            mps_threads: float | None = None) -> None:
        """Manage ``spec``; ``mps_threads``: the active-thread fraction its MPS client starts with (None: what
        `mps_threads` gives now)."""
        if spec.id in self._instances:
            raise ValueError(f"instance {spec.id} is already managed on GPU {self.index}")
        quota = control.read().quota
        threads = mps_threads if mps_threads is not None else self.mps_threads(spec)
        self._instances[spec.id] = _Managed(
            spec=spec, control=control, stats=stats, share=quota.share, quota=quota,
            capacity=CapacityEstimate(override=spec.capacity_blocks_per_ms), mps_threads=threads,
        )
        self._log.info("instance added", instance=spec.id, cls=spec.cls.value, request=spec.request,
                       limit=spec.limit, share=quota.share, capacity=spec.capacity_blocks_per_ms,
                       policy=policy_name(self.vertical), mps_threads=round(threads, 3))

    def mps_threads_of(self, instance: str) -> float | None:
        """The active-thread fraction recorded for a managed instance's client (None: not managed)."""
        m = self._instances.get(instance)
        return m.mps_threads if m is not None else None

    def remove(self, instance: str) -> InstanceSpec | None:
        """Stop managing ``instance`` (its files stay open; the caller closes and removes them)."""
        m = self._instances.pop(instance, None)
        if m is None:
            return None
        self._pub.last.pop(instance, None)
        if self._metrics is not None:
            self._metrics.forget_instance(m.spec, self.label)
        self._log.info("instance removed", instance=instance)
        return m.spec

    def pin(self, instance: str, share: float | None) -> None:
        """Run ``instance`` at a fixed share (static strategies, experiments); None: the policy decides."""
        m = self._instances[instance]
        if share is not None and not (math.isfinite(share) and 0 < share <= 1):
            raise ValueError(f"a pinned share must be within (0, 1], got {share!r}")
        m.pinned = share
        self._log.info("share pinned" if share is not None else "share unpinned", instance=instance, share=share)

    def set_slo(self, instance: str, slo_ms: float | None) -> None:
        """A latency objective learnt after the instance started (a measured solo p99); None: none."""
        if slo_ms is not None and not (math.isfinite(slo_ms) and slo_ms > 0):
            raise ValueError(f"an SLO must be > 0 ms, got {slo_ms!r}")
        m = self._instances[instance]
        m.spec = replace(m.spec, slo_ms=slo_ms)
        self._log.info("SLO set", instance=instance, slo_ms=slo_ms)

    def watch_load(self, instance: str, reader: Callable[[], LoadReading] | None) -> None:
        """Read ``instance``'s queue with ``reader`` every period from the next tick on (None: stop)."""
        self._instances[instance].load = reader
        self._log.info("instance queue reported" if reader is not None else "instance queue not reported",
                       instance=instance)

    def set_vertical_config(self, config: AnyVerticalConfig, *, reason: str | None = None) -> None:
        """Run the policy with ``config`` (its type selects it) from the next tick on; its memory starts over.
        ``reason``: why (logged, and in /metrics as ``dilu_gpu_vertical_policy``)."""
        self.vertical = config
        self._state = initial_state(config)
        self.policy_reason = reason or f"--gpu-vertical-policy {policy_name(config)}"
        self._log.info("vertical policy reconfigured", policy=policy_name(config), reason=self.policy_reason,
                       config=config)
        self._report_policy()

    def _report_policy(self) -> None:
        if self._metrics is not None:
            self._metrics.observe_policy(self.label, policy=policy_name(self.vertical), reason=self.policy_reason)

    def set_capacity(self, instance: str, blocks_per_ms: float | None) -> None:
        """Use a measured capacity (the profiler's) from the next tick on; None: back to the online estimate."""
        if blocks_per_ms is not None and not (math.isfinite(blocks_per_ms) and blocks_per_ms > 0):
            raise ValueError(f"a capacity must be > 0 blocks/ms, got {blocks_per_ms!r}")
        m = self._instances[instance]
        m.capacity = replace(m.capacity, override=blocks_per_ms)
        self._log.info("capacity set", instance=instance, blocks_per_ms=blocks_per_ms)

    def instances(self) -> tuple[InstanceSpec, ...]:
        return tuple(m.spec for m in self._instances.values())

    def statuses(self) -> tuple[tuple[InstanceSpec, InstanceStatus | None], ...]:
        return tuple((m.spec, m.status) for m in self._instances.values())

    def capacity_of(self, instance: str) -> CapacityEstimate:
        return self._instances[instance].capacity

    def add_observer(self, observer: Callable[[TickRecord], None]) -> None:
        self._observers.append(observer)

    # -- the loop --------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self.running:
            return
        self._task = asyncio.create_task(self._run(), name=f"gpu-manager-{self.index}")

    async def stop(self) -> None:
        """Stop ticking (the shims keep the last shares and go stale after ``stale_after_s``)."""
        tasks = [t for t in (self._task, self._pub.task) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None
        self._pub.task = None

    async def _run(self) -> None:
        self._log.info("manager started", period_ms=round(self.period_s * 1000, 3), policy=policy_name(self.vertical),
                       policy_reason=self.policy_reason, stale_after_ms=self.stale_after_ns // 1_000_000)
        self._report_policy()
        async for _ in ticks(self.period_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - one bad tick must not end vertical scaling for the GPU
                self._log.exception("manager tick failed; shares kept")
                self._heartbeat_all()

    def _heartbeat_all(self) -> None:
        for m in self._instances.values():
            with contextlib.suppress(Exception):
                m.control.heartbeat()

    def tick(self) -> TickRecord:
        """One period: read, decide, write, report. Synchronous and short."""
        now_ns = self._clock_ns()
        elapsed_s = (now_ns - self._last_tick_ns) / 1e9 if self._last_tick_ns is not None else self.period_s
        elapsed_s = max(elapsed_s, 1e-6)
        self._last_tick_ns = now_ns
        now = now_ns / 1e9
        managed = list(self._instances.values())
        # The shims' clock (CLOCK_MONOTONIC), not the injected one: open spans are aged against it.
        read_ns = time.monotonic_ns()

        for m in managed:
            try:
                snap = m.stats.snapshot(attempts=2000)
            except abi.StatsBusyError:
                m.last_reading = EMPTY_READING  # nothing this period; counters kept for next time
                continue
            reading, m.counters = read_delta(m.counters, snap, now_ns=read_ns)
            if reading.demand:
                m.last_active_at = now
            m.last_reading = reading
            if reading.restarted:
                self._log.info("instance restarted its CUDA process; counters start over", instance=m.spec.id,
                               pid=snap.pid)

        inputs = {
            m.spec.id: vertical_instance(m.spec, m.last_reading, period_s=elapsed_s,
                                         last_active_at=m.last_active_at, share=m.share, load=self._read_load(m),
                                         mps_threads=m.mps_threads)
            for m in managed
        }
        lc_active = {i for i, v in inputs.items() if v.cls.latency_critical and v.active(now, self.vertical)}
        free = [m for m in managed if m.pinned is None]
        decision: VerticalDecision | None = None
        if free:
            snapshot = VerticalSnapshot(now=now, instances=tuple(inputs[m.spec.id] for m in free),
                                        period_s=elapsed_s, gpu=str(self.index))
            previous_mode = self._state.mode
            decision = decide_vertical(snapshot, self._state, self.vertical)
            self._state = decision.state
            if decision.mode is not previous_mode:
                self._log_mode_change(previous_mode, decision, now)
            self._log.debug("vertical decision", mode=decision.mode.value, budget=decision.budget,
                            reason=decision.reason)

        statuses = []
        for m in managed:
            statuses.append(self._apply(m, decision, inputs[m.spec.id], lc_active, elapsed_s, now))
        mode = decision.mode if decision is not None else self._state.mode
        record = TickRecord(
            gpu=str(self.index), now=now, mode=mode, budget=decision.budget if decision else None,
            reason=decision.reason if decision else "no instance decided by the policy",
            instances=tuple(statuses), elapsed_s=elapsed_s,
        )
        self.last = record
        self._report(record, managed, decided=decision is not None, now=now)
        for observer in self._observers:
            observer(record)
        return record

    def _read_load(self, m: _Managed) -> LoadReading | None:
        if m.load is None:
            return None
        try:
            return m.load()
        except Exception:  # noqa: BLE001 - a broken reader costs the queue signal, not the tick
            self._log.exception("instance queue not readable; no longer reported", instance=m.spec.id)
            m.load = None
            return None

    def _log_mode_change(self, old: FeedbackMode, decision: VerticalDecision, now: float) -> None:
        """Info only when it matters: best-effort cut (entering emergency; at most once per
        ``CUT_LOG_EVERY_S``, with how many cuts were not logged) and best-effort back at its limits (idle
        after a cut). Every other change is debug; /metrics counts them all."""
        new = decision.mode
        if new in CUT_MODES and old not in CUT_MODES:
            self._cuts_unlogged += 1
            if now - self._cut_logged_at >= CUT_LOG_EVERY_S:
                self._log.info("best-effort cut", old=old.value, new=new.value, reason=decision.reason,
                               cuts_since_last_line=self._cuts_unlogged)
                self._cut_logged_at, self._cuts_unlogged = now, 0
                self._cut_open = True
                return
            self._cut_open = True
        elif new is FeedbackMode.IDLE and self._cut_open:
            self._cut_open = False
            self._log.info("best-effort back at its limits", old=old.value, reason=decision.reason)
            return
        self._log.debug("vertical mode changed", old=old.value, new=new.value, reason=decision.reason)

    def _apply(self, m: _Managed, decision: VerticalDecision | None, inst: VerticalInstance,
               lc_active: set[str], elapsed_s: float, now: float) -> InstanceStatus:
        spec, reading = m.spec, m.last_reading
        if m.pinned is not None:
            share, saturated, why = m.pinned, False, f"pinned at {m.pinned:.2f}"
        else:
            assert decision is not None
            d = next(s for s in decision.shares if s.id == spec.id)
            share, saturated, why = d.share, d.saturated, d.reason
        obs = CapacityObservation(
            blocks=reading.blocks, busy_windows=reading.busy_windows, window_s=reading.window_s,
            elapsed_s=elapsed_s, throttled_s=reading.throttled_s, limited=m.quota.limited,
            at_limit=m.share >= spec.limit - EPS, others_latency_active=bool(lc_active - {spec.id}),
            windows=reading.windows, mem_grown_bytes=reading.mem_grown_bytes, now=now,
        )
        before = m.capacity.value
        m.capacity, cap_why = estimate_capacity(m.capacity, obs, self.capacity_config)
        if before is None and m.capacity.value is not None:
            self._log.info("capacity learnt", instance=spec.id, blocks_per_ms=round(m.capacity.value, 1),
                           reason=cap_why)
        elif before != m.capacity.value:
            self._log.debug("capacity changed", instance=spec.id, blocks_per_ms=m.capacity.value, reason=cap_why)
        # Under a policy that does not gate launches (`spatial`) the share is recorded, the rate unlimited.
        gated = m.pinned is not None or self.gates_launches
        quota = quota_for(share, m.capacity.value if gated else None, mem_cap_bytes=spec.mem_cap_bytes,
                          stale_after_ns=self.stale_after_ns)
        if _differs(quota, m.quota):
            m.control.write(quota)
            self._log.debug("share written", instance=spec.id, share=round(share, 4),
                            rate=round(quota.rate_blocks_per_ms, 1), reason=why)
        else:
            m.control.heartbeat()
        m.share, m.quota = share, quota
        status = InstanceStatus(
            id=spec.id, share=share, rate_blocks_per_ms=quota.rate_blocks_per_ms,
            capacity_blocks_per_ms=m.capacity.value,
            active=inst.active(now, self.vertical), saturated=saturated,
            throttled_s=min(reading.throttled_s, elapsed_s), blocks=reading.blocks,
            mem_used_bytes=reading.mem_used_bytes, pinned=m.pinned is not None, stale=reading.stale,
            reason=why, capacity_reason=cap_why, busy_s=reading.busy_s, cycles_s=reading.cycles_s,
            open_cycle_s=reading.open_cycle_s, spans_s=reading.spans_s, open_span_s=reading.open_span_s,
        )
        m.status = status
        return status

    def _report(self, record: TickRecord, managed: list[_Managed], *, decided: bool, now: float) -> None:
        if self._metrics is not None:
            if self._utilization is not None and now - self._utilization_at >= 1.0:
                self._utilization_at = now
                self._utilization_value = self._utilization()
            requests = sum(m.spec.request for m in managed)
            fragmentation = max(0.0, 1.0 - requests) if managed else 0.0
            self._metrics.observe_gpu(self.label, fragmentation=fragmentation, utilization=self._utilization_value,
                                      mode=record.mode, decided=decided)
            for m, status in zip(managed, record.instances, strict=True):
                self._metrics.observe_instance(m.spec, self.label, status, m.last_reading)
        if self._publish is not None:
            shares = {s.id: s.share for s in record.instances}
            changed = shares != self._pub.last
            due = changed or now - self._pub.last_at >= self._publish_every_s
            idle = self._pub.task is None or self._pub.task.done()
            if due and idle:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # ticked by hand outside a loop (tests): nothing to publish with
                    return
                self._pub.last, self._pub.last_at = shares, now
                self._pub.task = loop.create_task(self._publish_once(shares))

    async def _publish_once(self, shares: dict[str, float]) -> None:
        assert self._publish is not None
        try:
            await self._publish(self.uuid, shares)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - best effort: the publisher reports its own outages
            self._pub.last = {}  # publish again next tick
            self._log.debug("shares not published", error=repr(exc))


def _differs(a: abi.Quota, b: abi.Quota) -> bool:
    if a.mem_cap_bytes != b.mem_cap_bytes or a.stale_after_ns != b.stale_after_ns:
        return True
    if abs(a.share - b.share) > 1e-6 or a.limited != b.limited:
        return True
    # A capacity estimate creeping by a fraction of a percent is not worth a control-block epoch.
    return a.limited and abs(a.rate_blocks_per_ms - b.rate_blocks_per_ms) > 0.01 * b.rate_blocks_per_ms
