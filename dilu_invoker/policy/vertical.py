"""Vertical scaling: each instance's SM share on one GPU, re-decided every manager period (~50 ms).

This module holds the types every vertical policy shares and the `rckm` policy (`decide_shares`), the
default until the `slo` controller (vertical_slo.py) has won the GPU workload matrix. `rckm` works in the
spirit of Dilu's RCKM (`gpu-sharing.md` §4.2):

* Latency-critical instances (`inference`, `llm`) get their limit while they have demand: a share is a
  cap on launch rate, and a latency-critical instance launches at full speed inside each request, so any
  cap below its limit stretches every request. Only when their limits do not fit together are they cut
  back toward their requests. An idle one keeps its limit as a standing cap.
* Best-effort instances (`training`) share a *budget* in proportion to their requests, each capped at
  its limit. With no latency-critical demand (idle > 0.6 s) the budget is the whole GPU.
* The budget follows the cycles of the latency-critical instances — their request spans (first launch to
  the next quiet sync, µs precision) where the shim reports them, else Dilu's 5 ms launch-window cycles —
  judged by the median of their last few against a baseline (the minimum cycle; for spans the fastest
  period's median, never below 0.3 × SLO, reset by a quiet period with best-effort at its floor — one
  merged-request cycle or one rare fast request is not the measure): ≥ 1.6× (1.3× for `llm`) is an
  **emergency** — the budget is divided by that ratio at once, down to a floor;
  < 1.2× is **recovery** — each such cycle grows the budget ×1.3, up to a ceiling (`busy_ceiling`, the
  whole GPU unless a reserve is configured), and the first one after a burst cut undoes it;
  in between is **contention** — hold, unless the instance's spans fill ≥ 95% of its time (saturated: a
  queue builds), which makes it an emergency. A cut held in contention is **probed** after 0.5 s
  (best-effort at its floor for two periods) and given up when inference is no faster without it. A sudden
  jump of a latency-critical instance's launch rate (a **burst**) divides the budget by the jump within one
  period, never below the room the burst leaves.

A cap only limits; protection comes from the feedback. So Σ active shares may exceed 1: the
latency-critical caps cost nothing between requests, and the best-effort budget is wherever feedback
says the latency-critical tenants are unhurt. `oversubscribe_in_recovery=False` (or
`fair_budget_cap=True`, the policy of the first H200 run) ties the budget to the fair budget
1 − Σ latency-critical shares instead; docs/policies.md §1 says why the default changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from dilu_invoker.policy.fill import water_fill
from dilu_invoker.policy.types import EPS, InstanceClass, SharePair

if TYPE_CHECKING:
    from dilu_invoker.policy.vertical_slo import SloState

SATURATION_PERIODS = 3
"""Periods whose mean busy fraction (Σ request spans / period) judges saturation (`saturation_busy`)."""


class FeedbackMode(StrEnum):
    IDLE = "idle"
    """No latency-critical demand: best-effort instances may take the GPU up to their limits."""
    STEADY = "steady"
    """Latency-critical demand, no completed cycle to judge this period: hold."""
    RECOVERY = "recovery"
    """Every cycle < recovery ratio × its minimum: grow the best-effort budget."""
    CONTENTION = "contention"
    """A cycle between the recovery and emergency ratios: hold, at most the fair budget."""
    EMERGENCY = "emergency"
    """A cycle ≥ the emergency ratio: cut the best-effort budget now."""
    BURST = "burst"
    """A latency-critical launch rate jumped: cut the best-effort budget now, to the room left."""
    DRAIN = "drain"
    """A latency-critical cycle in progress is eating into its SLO (a queue is building): best-effort
    instances drop to their floor until it completes; the budget is kept for afterwards."""
    PROBE = "probe"
    """Best-effort held at its floor for a few periods to measure the latency-critical spans without it
    (`quiet_probe_every_s`); the budget is kept for afterwards."""
    # The modes of the `slo` policy (vertical_slo.py) besides IDLE and EMERGENCY:
    MEASURE = "measure"
    """`slo`: best-effort at its floor to measure a latency-critical instance's solo latency."""
    HOLD = "hold"
    """`slo`: the SLO error is within the deadband, or the dwell since the last move has not passed."""
    INCREASE = "increase"
    """`slo`: the SLO error is below the deadband: the best-effort budget grows by one step."""
    DECREASE = "decrease"
    """`slo`: the SLO error is above 1: the best-effort budget shrinks by the decrease factor."""


class _IdleAfter(Protocol):
    @property
    def idle_after_s(self) -> float: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class VerticalConfig:
    """Every constant of the rckm vertical policy; docs/policies.md §1 says why each default, with the GPU runs
    that chose it."""

    idle_after_s: float = 0.6
    """An instance that launched nothing for this long is idle (Dilu: 120 × 5 ms windows)."""
    emergency_ratio: float = 1.6
    """Cycle / minimum cycle at or above which an `inference` instance is in emergency (Dilu 1.6)."""
    llm_emergency_ratio: float = 1.3
    """Same for `llm`, whose decode steps are short and regular (Dilu 1.3)."""
    recovery_ratio: float = 1.2
    """Cycle / minimum below which the cycle counts toward recovery (Dilu 1.2)."""
    outlier_ratio: float = 4.0
    """Cycles this much longer than the minimum are not interference (merged requests): ignored."""
    recovery_growth: float = 1.3
    """Budget multiplier per recovery step (Dilu ×1.3)."""
    recovery_every: int = 1
    """Recovery cycles needed per growth step (Dilu: every 5th cycle; judged cycles are already the median
    of `cycle_smoothing`, so each is evidence)."""
    emergency_floor: float = 0.05
    """A best-effort instance keeps at least this fraction of its request, even in emergency."""
    min_cycle_s: float = 0.035
    """Completed cycles shorter than this never become an instance's minimum (Dilu: > 6 windows)."""
    span_feedback: bool = True
    """Judge a latency-critical instance by its request spans (the shim's first launch to the next quiet
    application sync) instead of its 5 ms launch-window cycles, once its shim reports any. False: windows only."""
    min_span_s: float = 0.0005
    """Spans shorter than this never become an instance's minimum (a sync after a trivial kernel)."""
    span_quiet_baseline: bool = True
    """Judge spans against the shortest per-period median span, reset by a quiet period (best-effort at its
    floor for `quiet_periods` periods: the instance's speed without best-effort now, clocks included), instead
    of the shortest span; a quiet period still stretched restarts the budget from the room. False: the minimum span."""
    quiet_periods: int = 2
    """Periods at the floor before spans count as quiet (the first still runs work admitted before the cut)."""
    quiet_min_spans: int = 3
    """Spans a quiet period needs before their median becomes the baseline."""
    quiet_probe_every_s: float | None = None
    """Seconds without a quiet period, while latency-critical and best-effort demand run together, after which
    best-effort is held at its floor for `quiet_periods` periods (a probe) to measure the span baseline.
    None: no periodic probes."""
    quiet_probe_held_s: float | None = 0.5
    """Seconds a cut may be held (the budget below its ceiling, spans neither recovering nor in emergency)
    without a quiet period before it is probed; each probe that leaves it held doubles the wait (up to 16×),
    the budget back at its ceiling resets it. None: only `quiet_probe_every_s` probes."""
    saturation_busy: float | None = 0.95
    """Fraction of its time (mean of the last `SATURATION_PERIODS` periods) a latency-critical instance's
    request spans may cover before a span in the contention band counts as an emergency: requests arrive as
    fast as they complete, so every stretch becomes queueing. None: off."""
    span_slo_base: float | None = 0.3
    """Fraction of the SLO below which a span's baseline never goes (spans and an SLO only): a request well
    inside its SLO is not hurt however much slower than the best one seen. None: the best span only."""
    llm_history: int = 20
    """An `llm` instance's minimum is over its last N cycles: decode length drifts (Dilu: 20)."""
    cycle_smoothing: int = 5
    """Judge the median ratio of the last N cycles, not each cycle alone (1: each cycle)."""
    open_cycle_ratio: float | None = 3.0
    """A cycle still in progress at this ratio is an emergency now (None: at the emergency ratio)."""
    slo_guard: float | None = 0.25
    """A latency-critical instance with an SLO whose (smoothed) cycle stays within this fraction of the
    SLO is not hurt: stretch relative to its best cycle is then read as recovery, not contention or
    emergency. Dilu's ratios know nothing of the SLO; with one we know how much stretch is affordable.
    None: ratios only (Dilu)."""
    drain_slo_fraction: float | None = None
    """Fraction of the SLO a latency-critical cycle in progress may run before best-effort instances drop
    to their floor until it completes (a queue is building), their budget kept for afterwards; a cycle as long
    as the SLO is left to the ratios. None (the default): off."""
    burst_restore: bool = True
    """A burst cut is provisional: when the next judged cycles are unhurt (recovery), the budget returns to
    what it was before the cut instead of regrowing ×`recovery_growth` at a time. False: regrow."""
    busy_ceiling: float = 1.0
    """Share of the GPU best-effort instances together may take while latency-critical demand exists (a
    reserve the cycle feedback cannot see); 1.0: no reserve."""
    oversubscribe_in_recovery: bool = True
    """Let the budget exceed the fair budget (Σ active > 1); False keeps Σ active ≤ 1 always."""
    fair_budget_cap: bool = False
    """Run 1's rule: latency-critical shares leave room for best-effort requests, contention clamps the
    budget to the fair budget 1 − Σ latency-critical shares, emergency cuts from at most the fair budget
    (only growth in recovery may go above it)."""
    demand_headroom: float = 1.25
    """The room a latency-critical instance leaves: max(request, measured demand × this)."""
    demand_ema_weight: float = 0.125
    """Weight of the newest period in the demand average (the shim's window EMA uses 1/8 too)."""
    burst_ratio: float = 2.0
    """Demand this period ≥ this × its average is a burst (0: off)."""
    burst_min_demand: float = 0.05
    """The average a burst is judged against is at least this share (a few stray launches are no base)."""
    saturated_throttle_fraction: float = 0.1
    """An instance at its limit that waited for tokens this fraction of the period is saturated."""

    def __post_init__(self) -> None:
        positive = ("idle_after_s", "min_cycle_s", "min_span_s")
        for name in positive:
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if not (
            1.0
            <= self.recovery_ratio
            <= self.llm_emergency_ratio
            <= self.emergency_ratio
        ):
            raise ValueError(
                "need 1 <= recovery_ratio <= llm_emergency_ratio <= emergency_ratio, got "
                f"{self.recovery_ratio}, {self.llm_emergency_ratio}, {self.emergency_ratio}"
            )
        if self.span_slo_base is not None and not 0.0 < self.span_slo_base <= 1.0:
            raise ValueError(f"span_slo_base must be in (0, 1] or None, got {self.span_slo_base}")
        if self.slo_guard is not None and not 0.0 < self.slo_guard <= 1.0:
            raise ValueError(f"slo_guard must be in (0, 1] or None, got {self.slo_guard}")
        if self.drain_slo_fraction is not None and not 0.0 < self.drain_slo_fraction < 1.0:
            raise ValueError(f"drain_slo_fraction must be in (0, 1) or None, got {self.drain_slo_fraction}")
        if not self.outlier_ratio > self.emergency_ratio:
            raise ValueError(
                f"outlier_ratio must exceed emergency_ratio, got {self.outlier_ratio}"
            )
        if not (math.isfinite(self.recovery_growth) and self.recovery_growth > 1.0):
            raise ValueError(
                f"recovery_growth must be > 1, got {self.recovery_growth!r}"
            )
        if self.recovery_every < 1 or self.llm_history < 1 or self.cycle_smoothing < 1:
            raise ValueError("recovery_every, llm_history and cycle_smoothing must be >= 1")
        if self.quiet_periods < 1 or self.quiet_min_spans < 1:
            raise ValueError("quiet_periods and quiet_min_spans must be >= 1")
        if self.saturation_busy is not None and not (
                math.isfinite(self.saturation_busy) and self.saturation_busy > 0):
            raise ValueError(f"saturation_busy must be > 0 or None, got {self.saturation_busy!r}")
        if self.quiet_probe_held_s is not None and not (
                math.isfinite(self.quiet_probe_held_s) and self.quiet_probe_held_s > 0):
            raise ValueError(f"quiet_probe_held_s must be > 0 or None, got {self.quiet_probe_held_s!r}")
        if self.quiet_probe_every_s is not None and not (
                math.isfinite(self.quiet_probe_every_s) and self.quiet_probe_every_s > 0):
            raise ValueError(f"quiet_probe_every_s must be > 0 or None, got {self.quiet_probe_every_s!r}")
        if self.open_cycle_ratio is not None and not (
            self.recovery_ratio < self.open_cycle_ratio < self.outlier_ratio
        ):
            raise ValueError(
                "open_cycle_ratio must lie between recovery_ratio and outlier_ratio, got "
                f"{self.open_cycle_ratio!r}"
            )
        if not (math.isfinite(self.demand_headroom) and self.demand_headroom >= 1.0):
            raise ValueError(f"demand_headroom must be >= 1, got {self.demand_headroom!r}")
        if not 0.0 < self.demand_ema_weight <= 1.0:
            raise ValueError("demand_ema_weight must be within (0, 1]")
        if not (
            math.isfinite(self.burst_ratio)
            and (self.burst_ratio == 0 or self.burst_ratio > 1.0)
        ):
            raise ValueError(f"burst_ratio must be 0 (off) or > 1, got {self.burst_ratio!r}")
        if not 0.0 < self.burst_min_demand <= 1.0:
            raise ValueError("burst_min_demand must be within (0, 1]")
        if not 0.0 < self.busy_ceiling <= 1.0:
            raise ValueError(f"busy_ceiling must be within (0, 1], got {self.busy_ceiling!r}")
        if not 0.0 <= self.emergency_floor <= 1.0:
            raise ValueError(
                f"emergency_floor must be between 0 and 1, got {self.emergency_floor!r}"
            )
        if not 0.0 <= self.saturated_throttle_fraction <= 1.0:
            raise ValueError("saturated_throttle_fraction must be between 0 and 1")

    @classmethod
    def run1(cls, **overrides: object) -> VerticalConfig:
        """The defaults of the first H200 run (docs/benchmarks/vertical.md), for side-by-side runs."""
        return cls(**{**RUN1_OVERRIDES, **overrides})  # type: ignore[arg-type]

    @classmethod
    def run3(cls, **overrides: object) -> VerticalConfig:
        """The defaults of the third H200 run: slow regrowth, no drain, burst cuts regrown."""
        return cls(**{**RUN3_OVERRIDES, **overrides})  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: str) -> VerticalConfig:
        """A config from ``key=value,…`` overrides of the defaults, each typed by its field's default
        (``none`` clears an optional one); an unknown key or a bad value raises ValueError."""
        defaults = cls()
        overrides: dict[str, object] = {}
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            key, sep, raw = item.partition("=")
            key, raw = key.strip().replace("-", "_"), raw.strip()
            if not sep or key not in cls.__dataclass_fields__:
                raise ValueError(f"not a VerticalConfig override: {item!r}")
            overrides[key] = _parse_value(key, raw, getattr(defaults, key))
        return cls(**overrides)  # type: ignore[arg-type]

    @property
    def strict(self) -> bool:
        """The budget is tied to the fair budget (Σ active ≤ 1 outside recovery growth)."""
        return self.fair_budget_cap or not self.oversubscribe_in_recovery

    def open_threshold(self, cls: InstanceClass) -> float:
        return (
            self.open_cycle_ratio
            if self.open_cycle_ratio is not None
            else self.emergency_threshold(cls)
        )

    def emergency_threshold(self, cls: InstanceClass) -> float:
        return (
            self.llm_emergency_ratio
            if cls is InstanceClass.LLM
            else self.emergency_ratio
        )


def _parse_value(key: str, raw: str, default: object) -> object:
    if raw.lower() == "none":
        return None
    try:
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        return float(raw)
    except ValueError:
        raise ValueError(f"{key}: {raw!r} is not a valid {type(default).__name__ if default is not None else 'number'}") from None


RUN3_OVERRIDES: dict[str, object] = {
    "recovery_every": 5,
    "burst_restore": False,
    "span_feedback": False,
    "span_quiet_baseline": False,
}
"""What `VerticalConfig.run3()` changes: the third H200 run's defaults."""

RUN1_OVERRIDES: dict[str, object] = {
    **RUN3_OVERRIDES,
    "min_cycle_s": 0.001,
    "cycle_smoothing": 1,
    "open_cycle_ratio": None,
    "fair_budget_cap": True,
    "burst_ratio": 0.0,
    "slo_guard": None,
}
"""What `VerticalConfig.run1()` changes: the first H200 run's defaults."""


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
    capacity_blocks_per_ms: float | None = None
    """Blocks/ms it launches with the whole GPU (None: unknown); turns `blocks` into a demand share."""
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
        cap = self.capacity_blocks_per_ms
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"{self.id}: capacity_blocks_per_ms must be > 0, got {cap!r}")
        if self.mps_threads is not None and not (math.isfinite(self.mps_threads) and 0 < self.mps_threads <= 1):
            raise ValueError(f"{self.id}: mps_threads must be within (0, 1], got {self.mps_threads!r}")

    def demand(self, period_s: float) -> float | None:
        """Its launches this period as a share of the GPU (None: capacity unknown)."""
        if self.capacity_blocks_per_ms is None:
            return None
        return self.blocks / (self.capacity_blocks_per_ms * period_s * 1000.0)

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
class CycleTrack:
    """What the policy remembers of one latency-critical instance's launch cycles."""

    id: str
    min_cycle_s: float | None = None
    history: tuple[float, ...] = ()
    """Last `llm_history` qualifying cycles (the baseline of an `llm` instance)."""
    last_ratio: float | None = None
    open_flagged: bool = False
    """The cycle in progress already triggered an emergency; do not cut twice for it."""
    last_open_s: float = 0.0
    recent_ratios: tuple[float, ...] = ()
    """Ratios of the last `cycle_smoothing` judged cycles (outliers excluded), oldest first."""
    demand_ema: float | None = None
    """Average demand share per period (None: capacity unknown or nothing measured yet)."""
    spans: bool = False
    """Judged by request spans (its shim reported one); the cycle fields above then hold spans."""
    quiet_s: float | None = None
    """Span baseline (span_quiet_baseline): the median span of the last quiet period (best-effort at its
    floor), lowered by any later period whose median span is shorter; None: the minimum span."""
    recent_busy: tuple[float, ...] = ()
    """Σ request spans / period of the last few periods (`saturation_busy`), oldest first."""

    def baseline(self, cls: InstanceClass) -> float | None:
        if cls is InstanceClass.LLM and self.history:
            return min(self.history)
        return self.min_cycle_s


@dataclass(frozen=True, slots=True)
class VerticalState:
    """Carried from one call to the next for one GPU; start with `VerticalState()`."""

    budget: float | None = None
    """Best-effort budget while latency-critical demand exists; None: not constrained."""
    recovery_cycles: int = 0
    mode: FeedbackMode = FeedbackMode.IDLE
    tracks: tuple[CycleTrack, ...] = ()
    restore_to: float | None = None
    """The budget before a burst cut, given back at the next recovery (None: nothing to give back)."""
    floor_periods: int = 0
    """Consecutive decisions that left best-effort instances at their floor."""
    quiet_at: float | None = None
    """When the last quiet period was measured, or latency-critical and best-effort demand met (probes)."""
    probe_left: int = 0
    """Periods of the probe in progress still to hold best-effort at its floor."""
    held_probes: int = 0
    """Probes of a held cut since the budget was last at its ceiling (each doubles the next wait)."""

    def track(self, instance_id: str) -> CycleTrack | None:
        for t in self.tracks:
            if t.id == instance_id:
                return t
        return None


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
    state: VerticalState | SloState
    active_total: float = field(default=0.0)
    """Σ shares of active instances."""

    def share_of(self, instance_id: str) -> float:
        for s in self.shares:
            if s.id == instance_id:
                return s.share
        raise KeyError(instance_id)


# -- cycle feedback ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Feedback:
    track: CycleTrack
    emergency: float  # largest emergency ratio seen this period (0: none)
    contention: float  # largest contention ratio (0: none)
    recovery: int  # recovery cycles this period
    note: str
    demand: float | None = None  # this period's demand share (None: capacity unknown)
    jump: float = 0.0  # demand / its previous average when that is a burst (0: none)
    drain: bool = False  # its cycle in progress is eating into its SLO: a queue is building
    rebased: bool = False  # a quiet period's spans were still stretched: the cuts before it did not help


def _classify(ratio: float, threshold: float, config: VerticalConfig) -> str:
    if ratio >= config.outlier_ratio:
        return "outlier"
    if ratio >= threshold:
        return "emergency"
    if ratio < config.recovery_ratio:
        return "recovery"
    return "contention"


def _median(xs: tuple[float, ...]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _baseline(cls: InstanceClass, history: tuple[float, ...], min_cycle: float | None, span_base: float | None,
              floor_s: float) -> float | None:
    """What a cycle or span is judged against: an `llm`'s recent minimum, else the span baseline (when
    kept) or the minimum; never below the SLO floor (0 when none). None: nothing to judge against yet."""
    base = min(history) if cls is InstanceClass.LLM and history else (span_base or min_cycle)
    return max(base, floor_s) if base is not None and base > 0 else None


def _span_track(inst: VerticalInstance, prev: CycleTrack | None, config: VerticalConfig) -> CycleTrack:
    """The track to judge this period with: spans once the shim reports any (spans and window cycles are
    different units, so switching starts the baseline over; the demand average stays)."""
    track = prev or CycleTrack(id=inst.id)
    use_spans = config.span_feedback and (track.spans or bool(inst.spans_s))
    if use_spans and not track.spans:
        return CycleTrack(id=inst.id, demand_ema=track.demand_ema, spans=True)
    return track if use_spans or not track.spans else replace(track, spans=False)


def _slo_floor(inst: VerticalInstance, config: VerticalConfig, *, spans: bool) -> float:
    """Spans against an SLO are never judged against less than this (`span_slo_base`); 0: no floor."""
    if spans and config.span_slo_base is not None and inst.slo_ms and inst.cls.latency_critical:
        return config.span_slo_base * inst.slo_ms / 1000.0
    return 0.0


@dataclass(frozen=True, slots=True)
class _Quiet:
    quiet_s: float | None  # the span baseline after this period
    measured: bool = False  # this period's spans measured the baseline (they are not judged)
    rebased: bool = False  # ... and were still stretched against the old one: the cuts did not help
    note: str = ""


def _quiet_baseline(inst: VerticalInstance, track: CycleTrack, cycles_s: tuple[float, ...], config: VerticalConfig,
                    *, quiet: bool, floor_s: float) -> _Quiet:
    """The span baseline (`span_quiet_baseline`): a quiet period's median resets it, a faster period's
    median lowers it."""
    if not (track.spans and config.span_quiet_baseline and inst.cls is not InstanceClass.LLM
            and len(cycles_s) >= config.quiet_min_spans):
        return _Quiet(track.quiet_s)
    period_median = _median(cycles_s)
    if not quiet:
        faster = track.quiet_s is None or period_median < track.quiet_s
        return _Quiet(period_median if faster else track.quiet_s)
    # Best-effort has been at its floor: this is the instance's uncontended speed now. These spans measure
    # the baseline; judged against it they would count as recovery for nothing.
    old = _baseline(inst.cls, track.history, track.min_cycle_s, track.quiet_s, floor_s)
    # Still stretched at the floor (by what counts as unhurt): the cuts before it did not help.
    rebased = old is None or period_median >= config.recovery_ratio * old
    note = (f"{inst.id} quiet period (best-effort at its floor): baseline {period_median * 1000:.1f} ms"
            + (f", {period_median / old:.2f}× the last one: the cuts did not help" if rebased and old else ""))
    return _Quiet(period_median, measured=True, rebased=rebased, note=note)


@dataclass(frozen=True, slots=True)
class _Judged:
    min_cycle_s: float | None
    history: tuple[float, ...]
    last_ratio: float | None
    recent: tuple[float, ...]
    emergency: float = 0.0
    contention: float = 0.0
    recovery: int = 0
    notes: tuple[str, ...] = ()


def _kind(judged: float, base: float, inst: VerticalInstance, config: VerticalConfig, *,
          already_cut: bool) -> tuple[str, str]:
    """(kind, note) of one judged ratio: `_classify`, then the SLO guard (a stretch within `slo_guard` of the
    SLO is recovery) and a cycle already cut for while in progress (contention, not a second emergency)."""
    kind = _classify(judged, config.emergency_threshold(inst.cls), config)
    safe_s = _safe_s(inst, config)
    if kind in ("emergency", "contention") and safe_s is not None and judged * base <= safe_s:
        return "recovery", (f"but {judged * base * 1000:.1f} ms, within {config.slo_guard:.0%} of its "
                            f"{inst.slo_ms:g} ms SLO (recovery)")
    if kind == "emergency" and already_cut:
        return "contention", ""
    return kind, ""


def _safe_s(inst: VerticalInstance, config: VerticalConfig) -> float | None:
    """The cycle length within `slo_guard` of the SLO (None: no guard)."""
    if config.slo_guard is not None and inst.slo_ms and inst.cls.latency_critical:
        return config.slo_guard * inst.slo_ms / 1000.0
    return None


def _judge(inst: VerticalInstance, track: CycleTrack, cycles_s: tuple[float, ...], config: VerticalConfig, *,
           quiet: _Quiet, floor_s: float, unit: str) -> _Judged:
    """Every completed cycle updates the minimum and history; unless the period measured the baseline,
    each is judged: the median ratio of the last `cycle_smoothing` against the baseline."""
    min_len = config.min_span_s if track.spans else config.min_cycle_s
    min_cycle, history, last_ratio = track.min_cycle_s, track.history, track.last_ratio
    recent = () if quiet.measured else track.recent_ratios[-config.cycle_smoothing:]
    emergency = contention = 0.0
    recovery = 0
    notes: list[str] = []
    smoothed = config.cycle_smoothing > 1
    already_cut = track.open_flagged
    for c in cycles_s:
        if c >= min_len:
            min_cycle = c if min_cycle is None else min(min_cycle, c)
            history = (history + (c,))[-config.llm_history:]
        if quiet.measured:
            continue
        base = _baseline(inst.cls, history, min_cycle, quiet.quiet_s, floor_s)
        if base is None:
            continue
        against = ("its quiet baseline" if quiet.quiet_s and base == quiet.quiet_s else "its minimum"
                   if base > floor_s else f"{config.span_slo_base:g} of its SLO")
        ratio = c / base
        last_ratio = ratio
        if ratio >= config.outlier_ratio:
            # Several requests merged into one cycle: not interference, and kept out of the median.
            notes.append(f"{inst.id} {unit} {ratio:.2f}× {against} (outlier)")
            already_cut = False
            continue
        recent = (recent + (ratio,))[-config.cycle_smoothing:]
        judged = _median(recent) if smoothed else ratio
        kind, guard = _kind(judged, base, inst, config, already_cut=already_cut)
        already_cut = False
        if guard:
            notes.append(f"{inst.id} {unit}s {judged:.2f}× {against} {guard}")
        if kind == "emergency":
            emergency = max(emergency, judged)
        elif kind == "contention":
            contention = max(contention, judged)
        elif kind == "recovery":
            recovery += 1
        if kind != "recovery":
            what = (f"median of its last {len(recent)} {unit}s {judged:.2f}× {against}" if smoothed
                    else f"{unit} {ratio:.2f}× {against}")
            notes.append(f"{inst.id} {what} ({kind})")
    return _Judged(min_cycle, history, last_ratio, recent, emergency, contention, recovery, tuple(notes))


def _saturation(inst: VerticalInstance, track: CycleTrack, cycles_s: tuple[float, ...], period_s: float,
                config: VerticalConfig, *, contention: float) -> tuple[tuple[float, ...], bool, str]:
    """(recent busy fractions, saturated?, note): contention while the spans fill ≥ `saturation_busy` of the
    last `SATURATION_PERIODS` periods is an emergency (a queue builds); the evidence then starts over."""
    if not (track.spans and config.saturation_busy is not None):
        return track.recent_busy, False, ""
    recent_busy = (track.recent_busy + (sum(cycles_s) / period_s,))[-SATURATION_PERIODS:]
    busy = sum(recent_busy) / len(recent_busy)
    if contention and len(recent_busy) == SATURATION_PERIODS and busy >= config.saturation_busy:
        return (), True, (f"{inst.id} request spans cover {busy:.0%} of its time (saturated): a queue builds, "
                          f"so {contention:.2f}× its baseline is an emergency")
    return recent_busy, False, ""


def _open_cycle(inst: VerticalInstance, track: CycleTrack, open_s: float, base: float | None,
                config: VerticalConfig, *, completed: bool, unit: str) -> tuple[bool, float, str]:
    """(flagged, emergency ratio, note) of the cycle in progress: at `open_threshold` × the baseline it cuts
    at once, once (a completed cycle clears the flag; whatever runs now is a new one)."""
    flagged = False if completed else track.open_flagged and 0 < open_s >= track.last_open_s
    safe_s = _safe_s(inst, config)
    if not (open_s > 0 and base and not flagged and (safe_s is None or open_s > safe_s)):
        return flagged, 0.0, ""
    ratio = open_s / base
    if config.open_threshold(inst.cls) <= ratio < config.outlier_ratio:
        return True, ratio, f"{inst.id} {unit} in progress already {ratio:.2f}× its baseline {base * 1000:.1f} ms (emergency)"
    return flagged, 0.0, ""


def _drain(inst: VerticalInstance, open_s: float, config: VerticalConfig, *, unit: str) -> tuple[bool, str]:
    """A cycle in progress between `drain_slo_fraction` of the SLO and the SLO is building a queue."""
    if (config.drain_slo_fraction is not None and inst.slo_ms and inst.cls.latency_critical
            and config.drain_slo_fraction * inst.slo_ms <= open_s * 1000.0 < inst.slo_ms):
        return True, (f"{inst.id} {unit} in progress {open_s * 1000:.0f} ms, "
                      f"≥ {config.drain_slo_fraction:.0%} of its {inst.slo_ms:g} ms SLO (drain)")
    return False, ""


def _demand(inst: VerticalInstance, track: CycleTrack, period_s: float,
            config: VerticalConfig) -> tuple[float | None, float | None, float, str]:
    """(demand share this period, its new average, burst jump (0: none), note)."""
    demand = inst.demand(period_s)
    if demand is None:
        return None, track.demand_ema, 0.0, ""
    ema, jump, note = track.demand_ema, 0.0, ""
    if ema is not None and config.burst_ratio > 0:
        j = demand / max(ema, config.burst_min_demand)
        if j >= config.burst_ratio:
            jump, note = j, f"{inst.id} launched {demand:.2f} of the GPU, {j:.1f}× its average {ema:.2f} (burst)"
    w = config.demand_ema_weight
    return demand, demand if ema is None else (1 - w) * ema + w * demand, jump, note


def _feedback(
    inst: VerticalInstance,
    prev: CycleTrack | None,
    config: VerticalConfig,
    period_s: float,
    quiet: bool = False,
) -> _Feedback:
    """One latency-critical instance's reading this period. `quiet`: best-effort instances ran at their floor
    through this period (see span_quiet_baseline)."""
    track = _span_track(inst, prev, config)
    cycles_s, open_s = (inst.spans_s, inst.open_span_s) if track.spans else (inst.cycles_s, inst.open_cycle_s)
    unit = "request span" if track.spans else "cycle"
    floor_s = _slo_floor(inst, config, spans=track.spans)
    q = _quiet_baseline(inst, track, cycles_s, config, quiet=quiet, floor_s=floor_s)
    j = _judge(inst, track, cycles_s, config, quiet=q, floor_s=floor_s, unit=unit)
    notes = [q.note, *j.notes] if q.note else list(j.notes)
    emergency, contention = j.emergency, j.contention
    recent_busy, saturated, why = _saturation(inst, track, cycles_s, period_s, config, contention=contention)
    if saturated:
        notes.append(why)
        emergency, contention = max(emergency, contention), 0.0
    base = _baseline(inst.cls, j.history, j.min_cycle_s, q.quiet_s, floor_s)
    open_flagged, open_ratio, why = _open_cycle(inst, track, open_s, base, config, completed=bool(cycles_s), unit=unit)
    if open_ratio:
        emergency = max(emergency, open_ratio)
        notes.append(why)
    drain, why = _drain(inst, open_s, config, unit=unit)
    if drain:
        notes.append(why)
    demand, demand_ema, jump, why = _demand(inst, track, period_s, config)
    if why:
        notes.append(why)
    new_track = CycleTrack(
        id=inst.id, min_cycle_s=j.min_cycle_s, history=j.history, last_ratio=j.last_ratio,
        open_flagged=open_flagged, last_open_s=open_s, recent_ratios=j.recent, demand_ema=demand_ema,
        spans=track.spans, quiet_s=q.quiet_s, recent_busy=recent_busy,
    )
    return _Feedback(new_track, emergency, contention, j.recovery, "; ".join(notes), demand, jump, drain, q.rebased)


# -- shares --------------------------------------------------------------------------------------


def _latency_shares(
    active: list[VerticalInstance], room: float
) -> tuple[dict[str, float], str]:
    """Limits when they fit in `room`; else requests first, the rest by headroom (limit − request)."""
    limits = sum(i.limit for i in active)
    if limits <= room + EPS:
        return {i.id: i.limit for i in active}, ""
    requests = sum(i.request for i in active)
    if requests > room + EPS:
        # Admission keeps Σ request ≤ 1, so this means a misconfigured GPU: scale requests down.
        alloc = water_fill(
            room, [i.request for i in active], [i.request for i in active]
        )
        why = f"Σ active requests {requests:.2f} exceed the {room:.2f} available: cut in proportion"
        return {i.id: a for i, a in zip(active, alloc, strict=True)}, why
    extra = water_fill(
        max(0.0, room - requests),
        [i.limit - i.request for i in active],
        [i.limit - i.request for i in active],
    )
    why = f"Σ active limits {limits:.2f} exceed the {room:.2f} available: cut toward requests"
    return {i.id: i.request + e for i, e in zip(active, extra, strict=True)}, why


def _room_left(
    lc_active: list[VerticalInstance],
    shares: dict[str, float],
    feedback: dict[str, _Feedback],
    config: VerticalConfig,
) -> float:
    """1 − what the active latency-critical instances need: max(request, demand × headroom) each, their
    share where the demand is unknown. Uses the larger of this period's demand and its average."""
    need = 0.0
    for i in lc_active:
        f = feedback[i.id]
        levels = [x for x in (f.demand, f.track.demand_ema) if x is not None]
        if not levels:
            need += shares[i.id]
            continue
        need += max(i.request, min(shares[i.id], max(levels) * config.demand_headroom))
    return 1.0 - need


def _budget_step(
    b: float,
    *,
    fair: float,
    room: float,
    floor: float,
    ceiling: float,
    emergency: float,
    contention: float,
    recovery: int,
    jump: float,
    counted: int,
    notes: str,
    config: VerticalConfig,
) -> tuple[FeedbackMode, float, int, str]:
    """One feedback step of the best-effort budget: (mode, budget, recovery cycles, summary)."""
    clamp = config.fair_budget_cap
    if emergency or jump:
        cuts = []
        if emergency:
            cuts.append((max(floor, (min(b, fair) if clamp else b) / emergency), FeedbackMode.EMERGENCY))
        if jump and b > room:
            # Not below the room the burst leaves: feedback takes it further if the cycles stretch.
            cuts.append((max(floor, room, b / jump), FeedbackMode.BURST))
        if cuts:
            nb, mode = min(cuts, key=lambda c: c[0])
            if mode is FeedbackMode.EMERGENCY:
                why = f"emergency: best-effort budget cut ÷{emergency:.2f} ({notes})"
            else:
                why = f"burst: best-effort budget cut ÷{jump:.2f}, not below the room {room:.2f} ({notes})"
            return mode, min(b, nb), 0, why
    if contention or jump:
        if clamp:
            b = max(floor, min(b, fair))
            why = f"contention: hold best-effort budget, at most the fair {fair:.2f} ({notes})"
        else:
            why = f"contention: hold the best-effort budget ({notes})"
        return FeedbackMode.CONTENTION, b, 0, why
    if recovery:
        counted += recovery
        if counted < config.recovery_every:
            why = f"recovery: {counted}/{config.recovery_every} cycles toward the next growth step"
            return FeedbackMode.RECOVERY, b, counted, why
        # A budget at (or near) zero would never grow back multiplicatively.
        grown = b * config.recovery_growth if b > 0.01 else 0.01
        why = (
            f"recovery: {recovery} cycle(s) within {config.recovery_ratio}× their baseline, "
            f"budget ×{config.recovery_growth}" + (f" ({notes})" if notes else "")
        )
        return FeedbackMode.RECOVERY, min(ceiling, max(b, grown)), 0, why
    return (
        FeedbackMode.STEADY,
        b,
        counted,
        "latency-critical demand, no completed cycle judged this period: hold" + (f" ({notes})" if notes else ""),
    )


def _probe_wait(config: VerticalConfig, *, held: bool, held_probes: int) -> tuple[float, int] | None:
    """How long without a quiet period before the next probe, and whether it counts as a held probe (1) or a
    periodic one (0); None: no probes. A held cut is probed after `quiet_probe_held_s`, doubling per probe
    up to 16×, never later than the periodic probe."""
    waits = []
    if held and config.quiet_probe_held_s is not None:
        waits.append((config.quiet_probe_held_s * 2 ** min(held_probes, 4), 1))
    if config.quiet_probe_every_s is not None:
        waits.append((config.quiet_probe_every_s, 0))
    return min(waits) if waits else None


@dataclass(frozen=True, slots=True)
class _Signals:
    """What the latency-critical instances with demand say this period, together."""

    emergency: float = 0.0  # the largest emergency ratio (0: none)
    contention: float = 0.0  # the largest contention ratio (0: none)
    recovery: int = 0  # recovery cycles, summed
    jump: float = 0.0  # the largest burst jump (0: none)
    drain: bool = False
    rebased: bool = False  # some quiet period's spans were still stretched
    spans: bool = False  # some instance is judged by spans (only a span baseline is measured by probes)
    notes: str = ""


def _signals(live: list[_Feedback]) -> _Signals:
    """Only instances with demand speak for the GPU; an idle one's late cycle says nothing about now."""
    return _Signals(
        emergency=max((f.emergency for f in live), default=0.0),
        contention=max((f.contention for f in live), default=0.0),
        recovery=sum(f.recovery for f in live),
        jump=max((f.jump for f in live), default=0.0),
        drain=any(f.drain for f in live),
        rebased=any(f.rebased for f in live),
        spans=any(f.track.spans for f in live),
        notes="; ".join(f.note for f in live if f.note),
    )


def _lc_room(config: VerticalConfig, *, carried: float | None, be_requests: float, floor_total: float) -> float:
    """What the active latency-critical instances may take together. Caps, not reservations: a
    latency-critical cap costs nothing between its requests and any cap below its limit would stretch every
    request, so only they contend here (1.0). A strict partition keeps best-effort requests as admitted
    guarantees, except what feedback has already taken from best-effort."""
    if not config.strict:
        return 1.0
    protected = be_requests if carried is None else min(be_requests, carried)
    return 1.0 - min(1.0, max(protected, floor_total))


def _references(
    config: VerticalConfig,
    lc_active: list[VerticalInstance],
    be_active: list[VerticalInstance],
    shares: dict[str, float],
    feedback: dict[str, _Feedback],
    floor_total: float,
) -> tuple[float, float, float]:
    """(fair, room, ceiling) of the best-effort budget: the fair budget 1 − Σ latency-critical shares; the
    room their measured demand leaves (never less than the best-effort requests that fit beside their
    requests); the ceiling recovery grows to."""
    fair = max(floor_total, 1.0 - sum(shares[i.id] for i in lc_active))
    be_requests = sum(i.request for i in be_active)
    if config.strict:
        room = fair
    else:
        lc_requests = sum(i.request for i in lc_active)
        room = max(fair, _room_left(lc_active, shares, feedback, config), min(be_requests, 1.0 - lc_requests),
                   floor_total)
    if not config.oversubscribe_in_recovery:
        return fair, room, fair
    return fair, room, max(room, min(1.0, config.busy_ceiling, sum(i.limit for i in be_active)))


def _restore_burst(mode: FeedbackMode, b: float, *, restore_to: float | None, before: float, ceiling: float,
                   config: VerticalConfig) -> tuple[float, float | None, str]:
    """(budget, budget to restore later, note): a burst cut remembers the budget before it; an emergency or
    contention reading confirms the cut; the next recovery gives the remembered budget back."""
    if not config.burst_restore:
        return b, None, ""
    if mode is FeedbackMode.BURST:
        return b, max(restore_to or 0.0, before), ""
    if mode in (FeedbackMode.EMERGENCY, FeedbackMode.CONTENTION):
        return b, None, ""
    if mode is FeedbackMode.RECOVERY and restore_to is not None:
        if restore_to > b:
            b = min(ceiling, restore_to)
            return b, None, f"; the burst cut is undone: cycles unhurt, budget back to {b:.2f}"
        return b, None, ""
    return b, restore_to, ""


@dataclass(frozen=True, slots=True)
class _Probe:
    """The probe bookkeeping carried in `VerticalState`."""

    quiet_at: float | None = None
    left: int = 0
    held: int = 0


def _probe_step(config: VerticalConfig, probe: _Probe, *, now: float, quiet: bool, mode: FeedbackMode,
                held: bool, spans: bool) -> tuple[_Probe, bool]:
    """The probe state after this period, and whether best-effort sits at its floor for it. A probe starts
    when the latency-critical instances are judged by spans, no probe is running, the mode holds or
    grows, and no quiet period has come for the wait `_probe_wait` gives."""
    quiet_at = now if quiet or probe.quiet_at is None else probe.quiet_at
    left, held_probes = probe.left, probe.held if held else 0
    if left == 0 and spans and mode in (FeedbackMode.CONTENTION, FeedbackMode.STEADY, FeedbackMode.RECOVERY):
        wait = _probe_wait(config, held=held and mode is not FeedbackMode.RECOVERY, held_probes=held_probes)
        if wait is not None and now - quiet_at >= wait[0]:
            left = config.quiet_periods
            held_probes += wait[1]
    if left > 0:
        return _Probe(quiet_at, left - 1, held_probes), True
    return _Probe(quiet_at, left, held_probes), False


@dataclass(frozen=True, slots=True)
class _Budget:
    """The best-effort side of one decision with latency-critical demand."""

    mode: FeedbackMode
    budget: float
    total: float  # what best-effort shares this period (the budget, or the floor in a drain or probe)
    recovery_cycles: int
    restore_to: float | None
    probe: _Probe
    summary: str


def _budget(
    state: VerticalState,
    config: VerticalConfig,
    sig: _Signals,
    *,
    now: float,
    quiet: bool,
    fair: float,
    room: float,
    ceiling: float,
    floor_total: float,
    be_active: bool,
) -> _Budget:
    """The budget's feedback step, burst restore, drain and probe, for a GPU with latency-critical demand."""
    carried = state.budget if state.mode is not FeedbackMode.IDLE else None
    start = carried is None
    before = room if carried is None else carried
    if sig.rebased and before < room:
        # Cutting to the floor did not bring the spans back: they were not interference. Start over from
        # the room latency-critical demand leaves instead of regrowing ×1.3 from the floor.
        before = room
    mode, b, recovery_cycles, summary = _budget_step(
        before, fair=fair, room=room, floor=floor_total, ceiling=ceiling, emergency=sig.emergency,
        contention=sig.contention, recovery=sig.recovery, jump=0.0 if start else sig.jump,
        counted=state.recovery_cycles, notes=sig.notes, config=config,
    )
    b, restore_to, note = _restore_burst(mode, b, restore_to=None if start else state.restore_to, before=before,
                                         ceiling=ceiling, config=config)
    summary += note
    if start and be_active:
        what = "the fair budget" if config.strict else "the room latency-critical demand leaves"
        summary = f"latency-critical demand began: best-effort start at {what} {room:.2f}; " + summary
    b = min(max(b, floor_total), ceiling)
    total = b
    if sig.drain and be_active:
        # The budget is kept (and carried) for when the cycle completes; only the shares drop.
        mode, total = FeedbackMode.DRAIN, floor_total
        summary = f"drain: best-effort at its floor until the cycle completes ({sig.notes}); then {summary}"
    probe = (_Probe(state.quiet_at, state.probe_left, state.held_probes) if state.mode is not FeedbackMode.IDLE
             else _Probe())
    if be_active:
        held = b < ceiling - EPS
        probe, probing = _probe_step(config, probe, now=now, quiet=quiet, mode=mode, held=held, spans=sig.spans)
        if probing:
            # Like a drain, the budget is carried; only the shares drop, for the quiet measurement.
            assert probe.quiet_at is not None
            mode, total = FeedbackMode.PROBE, floor_total
            summary = (f"probe: best-effort at its floor to measure latency-critical spans without it "
                       f"(no quiet period for {now - probe.quiet_at:.1f} s{', a cut held' if held else ''}); "
                       f"then {summary}")
    summary += f"; budget {b:.2f} (fair {fair:.2f}, room {room:.2f}, floor {floor_total:.2f}, ceiling {ceiling:.2f})"
    return _Budget(mode, b, total, recovery_cycles, restore_to, probe, summary)


def _share_decision(inst: VerticalInstance, shares: dict[str, float], *, mode: FeedbackMode, be_total: float,
                    lc_cut_why: str, period_s: float, config: VerticalConfig) -> ShareDecision:
    """One instance's share and reason: an active one's from `shares`, an idle one's standing cap."""
    active = inst.id in shares
    if inst.cls.latency_critical:
        share = shares[inst.id] if active else inst.limit
        if not active:
            why = f"latency-critical, idle: standing cap at its limit {inst.limit:.2f} so a burst starts unthrottled"
        elif share >= inst.limit - EPS:
            why = f"latency-critical with demand: its limit {inst.limit:.2f}"
        else:
            why = (f"latency-critical with demand: {share:.2f} (request {inst.request:.2f}, "
                   f"limit {inst.limit:.2f}): {lc_cut_why}")
    elif active:
        share = shares[inst.id]
        why = (f"best-effort: {share:.2f} of the whole GPU split by request (limit {inst.limit:.2f})"
               if mode is FeedbackMode.IDLE
               else f"best-effort: {share:.2f} of budget {be_total:.2f} split by request ({mode.value})")
    else:
        share = inst.request
        why = f"best-effort, idle: standing cap at its request {inst.request:.2f}"
    share = min(max(0.0, share), inst.limit)
    saturated = (active and share >= inst.limit - EPS
                 and inst.throttled_s >= config.saturated_throttle_fraction * period_s)
    if saturated:
        why += "; saturated (throttled at its limit)"
    return ShareDecision(id=inst.id, share=share, previous=inst.share, active=active, saturated=saturated,
                         reason=why)


def decide_shares(
    snapshot: VerticalSnapshot, state: VerticalState, config: VerticalConfig
) -> VerticalDecision:
    """New shares for every instance on the GPU, with reasons, and the state for the next call."""
    now = snapshot.now
    lc = [i for i in snapshot.instances if i.cls.latency_critical]
    lc_active = [i for i in lc if i.active(now, config)]
    be_active = [i for i in snapshot.instances if not i.cls.latency_critical and i.active(now, config)]

    quiet = state.mode is not FeedbackMode.IDLE and state.floor_periods >= config.quiet_periods
    feedback = {i.id: _feedback(i, state.track(i.id), config, snapshot.period_s, quiet) for i in lc}
    sig = _signals([feedback[i.id] for i in lc_active])
    floors = {i.id: config.emergency_floor * i.request for i in be_active}
    floor_total = min(1.0, sum(floors.values()))

    carried = state.budget if state.mode is not FeedbackMode.IDLE else None
    shares, lc_cut_why = _latency_shares(lc_active, _lc_room(
        config, carried=carried, be_requests=sum(i.request for i in be_active), floor_total=floor_total)) \
        if lc_active else ({}, "")
    if not lc_active:
        plan = _Budget(FeedbackMode.IDLE, 1.0, 1.0, 0, None, _Probe(),
                       "no latency-critical demand: best-effort may use the whole GPU up to their limits"
                       if be_active else "nothing active")
    else:
        fair, room, ceiling = _references(config, lc_active, be_active, shares, feedback, floor_total)
        plan = _budget(state, config, sig, now=now, quiet=quiet, fair=fair, room=room, ceiling=ceiling,
                       floor_total=floor_total, be_active=bool(be_active))
        if lc_cut_why:
            plan = replace(plan, summary=f"{plan.summary}; {lc_cut_why}")

    if be_active:
        alloc = water_fill(plan.total, [i.request for i in be_active], [i.limit for i in be_active])
        for inst, a in zip(be_active, alloc, strict=True):
            shares[inst.id] = max(a, min(floors[inst.id], inst.limit))
    decisions = tuple(_share_decision(i, shares, mode=plan.mode, be_total=plan.total, lc_cut_why=lc_cut_why,
                                      period_s=snapshot.period_s, config=config) for i in snapshot.instances)

    at_floor = bool(lc_active) and bool(be_active) and plan.total <= floor_total + EPS
    budget = plan.budget if lc_active and be_active else None
    new_state = VerticalState(
        budget=budget, recovery_cycles=plan.recovery_cycles, mode=plan.mode,
        tracks=tuple(f.track for f in feedback.values()), restore_to=plan.restore_to,
        floor_periods=state.floor_periods + 1 if at_floor else 0,
        quiet_at=plan.probe.quiet_at if lc_active else None, probe_left=plan.probe.left if lc_active else 0,
        held_probes=plan.probe.held if lc_active else 0,
    )
    active_total = sum(d.share for d in decisions if d.active)
    reason = f"{snapshot.gpu or 'gpu'} {plan.mode.value}: {plan.summary}; Σ active shares {active_total:.2f}"
    return VerticalDecision(now=now, gpu=snapshot.gpu, mode=plan.mode, shares=decisions, budget=budget,
                            reason=reason, state=new_state, active_total=active_total)
