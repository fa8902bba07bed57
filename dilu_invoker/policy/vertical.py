"""Vertical scaling: each instance's SM share on one GPU, re-decided every manager period (~50 ms).

The types every vertical policy shares: what the GPU manager (and the serving simulator) reads of one GPU
each period (`VerticalInstance`, `VerticalSnapshot`), what a policy decides (`ShareDecision`,
`VerticalDecision`) and the modes a decision is in (`FeedbackMode`). The policies themselves (`slo`, `static`,
`spatial`) and the choice between them are in vertical_slo.py; docs/policies.md §1 describes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from dilu_invoker.policy.types import EPS, InstanceClass, SharePair

if TYPE_CHECKING:
    from dilu_invoker.policy.vertical_slo import SloState


class FeedbackMode(StrEnum):
    """The mode of one GPU's decision (the `slo` law's state machine, docs/policies.md §1.1; `static` and
    `spatial` only ever report `idle` and `hold`)."""

    IDLE = "idle"
    """No latency-critical demand: best-effort instances may take the GPU up to their limits."""
    MEASURE = "measure"
    """Best-effort at its floor to measure a latency-critical instance's solo latency."""
    HOLD = "hold"
    """The SLO error is within the deadband, or the dwell since the last move has not passed."""
    INCREASE = "increase"
    """The SLO error is below the deadband: the best-effort budget grows by one step."""
    DECREASE = "decrease"
    """The SLO error is above 1: the best-effort budget shrinks by the decrease factor."""
    EMERGENCY = "emergency"
    """A latency-critical instance is far past its target, or will miss its SLO: best-effort to its floor now."""


class _IdleAfter(Protocol):
    @property
    def idle_after_s(self) -> float: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class VerticalInstance:
    """One instance on the GPU, as the manager read it from its stats block this period."""

    id: str
    cls: InstanceClass
    request: float
    limit: float
    slo_ms: float | None = None
    blocks: int = 0
    """Thread blocks launched during the last period (> 0 means it has demand now)."""
    last_active_at: float | None = None
    """When it last launched anything (None: never)."""
    throttled_s: float = 0.0
    """Time its launches waited for tokens during the last period."""
    cycles_s: tuple[float, ...] = ()
    """Kernel-launch cycles completed since the previous call, oldest first, in seconds."""
    open_cycle_s: float = 0.0
    """Length of the cycle in progress (0: none)."""
    spans_s: tuple[float, ...] = ()
    """Request spans completed since the previous call, oldest first, in seconds (shim ABI ≥ 1.1)."""
    open_span_s: float = 0.0
    """Age of the request span in progress (0: none)."""
    share: float | None = None
    """The share enforced now (None: not yet set)."""
    queue_known: bool = False
    """The invoker reports the instance's own queue (the fields below, `dilu_invoker.gpu.load`); without it
    only the shim's view of the GPU exists."""
    runs_s: tuple[float, ...] = ()
    """Activations completed since the previous call, oldest first: their time in the instance, off-GPU time
    included (the instance's service time), in seconds."""
    open_run_s: float = 0.0
    """How long the activation running now has run (0: none)."""
    waits_s: tuple[float, ...] = ()
    """The completed activations' waits for the instance, same order, in seconds."""
    queued: float = 0.0
    """Activations waiting for the instance now."""
    oldest_wait_s: float = 0.0
    """How long the oldest of them has waited (0: none waits)."""
    mps_threads: float | None = None
    """The MPS active-thread fraction its client started with (None: not known, e.g. not an MPS client):
    under the `spatial` policy its share of the GPU."""

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("instance id must not be empty")
        SharePair(self.request, self.limit)
        if any(not (math.isfinite(x) and x >= 0) for x in (*self.runs_s, *self.waits_s, self.open_run_s,
                                                            self.queued, self.oldest_wait_s)):
            raise ValueError(f"{self.id}: runs, waits, the queue and its age must be finite and >= 0")
        if self.blocks < 0 or self.throttled_s < 0 or self.open_cycle_s < 0 or self.open_span_s < 0:
            raise ValueError(
                f"{self.id}: blocks, throttled_s, open_cycle_s and open_span_s must be >= 0"
            )
        if any(not (math.isfinite(c) and c >= 0) for c in (*self.cycles_s, *self.spans_s)):
            raise ValueError(f"{self.id}: cycle and span lengths must be finite and >= 0")
        if self.mps_threads is not None and not (math.isfinite(self.mps_threads) and 0 < self.mps_threads <= 1):
            raise ValueError(f"{self.id}: mps_threads must be within (0, 1], got {self.mps_threads!r}")

    def active(self, now: float, config: _IdleAfter) -> bool:
        if self.blocks > 0:
            return True
        return (
            self.last_active_at is not None
            and now - self.last_active_at <= config.idle_after_s
        )


@dataclass(frozen=True, slots=True)
class VerticalSnapshot:
    """Everything on one GPU this period."""

    now: float
    instances: tuple[VerticalInstance, ...]
    period_s: float = 0.05
    gpu: str = ""

    def __post_init__(self) -> None:
        ids = [i.id for i in self.instances]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"duplicate instance ids on GPU {self.gpu!r}: {sorted(ids)}"
            )
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"period_s must be > 0, got {self.period_s!r}")


@dataclass(frozen=True, slots=True)
class ShareDecision:
    id: str
    share: float
    previous: float | None
    active: bool
    saturated: bool
    """At its limit and throttled: vertical scaling has nothing more to give it."""
    reason: str
    mps_threads: float | None = None
    """The MPS active-thread fraction its client starts with (None: no cap); the `slo` and `spatial` policies
    set it for the instances they cap below their limit."""

    @property
    def changed(self) -> bool:
        return self.previous is None or abs(self.previous - self.share) > EPS


@dataclass(frozen=True, slots=True)
class VerticalDecision:
    now: float
    gpu: str
    mode: FeedbackMode
    shares: tuple[ShareDecision, ...]
    budget: float | None
    reason: str
    state: SloState
    active_total: float = field(default=0.0)
    """Σ shares of active instances."""

    def share_of(self, instance_id: str) -> float:
        for s in self.shares:
            if s.id == instance_id:
                return s.share
        raise KeyError(instance_id)
