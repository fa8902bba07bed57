"""Horizontal scaling: how many instances a function should have. Lazy by default (Dilu's scaler).

Each tick (1 s) adds the function's arrival rate to a window of the last 40 samples. Scale out when
≥ 20 of them exceeded what the current instances serve at their limits; scale in (one at a time) when
≥ 30 were below what one instance fewer would serve. Bursts shorter than that are vertical scaling's
job. Fast paths act at once: a request waiting with no instance starts one; every instance saturated at
its limit while queueing delay exceeds the SLO scales out. Bounds (`min-instances`, `max-instances`)
always hold; a function with no work for `scale_to_zero_after_s` goes to its minimum (0 by default).

The core is tiny (`desired = ⌈rate / capacity per instance⌉`); the window, the fast paths, bounds and
the cooldown are separate helpers below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from dilu_invoker.policy.types import EPS


class ScaleAction(StrEnum):
    OUT = "out"
    IN = "in"
    HOLD = "hold"


class ScaleTrigger(StrEnum):
    NONE = "none"
    BOUNDS = "bounds"
    """Below min-instances or above max-instances."""
    COLD_START = "cold-start"
    """No instance and work waiting."""
    OVERLOAD = "overload"
    """Every instance at its limit, no vertical headroom, queueing delay above the SLO."""
    SUSTAINED_LOAD = "sustained-load"
    """≥ scale_out_samples of the window above capacity."""
    SUSTAINED_UNDERLOAD = "sustained-underload"
    """≥ scale_in_samples of the window below the capacity of one instance fewer."""
    IDLE = "idle"
    """No work for scale_to_zero_after_s."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HorizontalConfig:
    """Every constant of the horizontal policy; docs/policies.md says why each default."""

    window: int = 40
    """Samples kept (Dilu: 40 one-second samples)."""
    scale_out_samples: int = 20
    """Samples above capacity that trigger a scale-out (Dilu: 20 of 40)."""
    scale_in_samples: int = 30
    """Samples below the capacity of n − 1 that trigger a scale-in (Dilu: 30 of 40)."""
    sample_period_s: float = 1.0
    """One sample per this period; calls in between re-evaluate the fast paths only."""
    stale_after_s: float = 5.0
    """A gap this long between samples (missed ticks, leader change) restarts the window."""
    target_utilization: float = 1.0
    """Fraction of the at-limit capacity counted as usable (1: vertical scaling absorbs the rest)."""
    max_scale_out_step: int = 8
    """Most instances one scale-out decision adds."""
    max_scale_in_step: int = 1
    """Most instances one scale-in decision removes (lazy: one at a time)."""
    min_instances: int = 0
    """Default for functions without a min-instances annotation."""
    max_instances: int = 32
    """Default for functions without a max-instances annotation."""
    scale_to_zero_after_s: float = 600.0
    """No arrivals, nothing queued or running for this long → scale to min-instances (OpenWhisk's
    default idle-container timeout is 10 min)."""
    cooldown_s: float = 5.0
    """After a decision, no further out/in (bounds excepted) for this long."""
    clear_window_after_action: bool = True
    """Start a fresh window after scaling, so old samples are not judged against the new count."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        for name in ("scale_out_samples", "scale_in_samples"):
            v = getattr(self, name)
            if not 1 <= v <= self.window:
                raise ValueError(
                    f"{name} must be between 1 and window ({self.window}), got {v}"
                )
        for name in ("sample_period_s", "stale_after_s", "target_utilization"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.stale_after_s < self.sample_period_s:
            raise ValueError("stale_after_s must be >= sample_period_s")
        if self.max_scale_out_step < 1 or self.max_scale_in_step < 1:
            raise ValueError("max_scale_out_step and max_scale_in_step must be >= 1")
        if not 0 <= self.min_instances <= self.max_instances:
            raise ValueError(
                f"need 0 <= min_instances <= max_instances, got {self.min_instances}, {self.max_instances}"
            )
        for name in ("scale_to_zero_after_s", "cooldown_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be >= 0, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FunctionLoad:
    """One function this tick, from the invokers' load reports."""

    function: str
    now: float
    instances: int
    """Ready instances that are not being stopped."""
    starting: int = 0
    """Instances decided and still starting (cold starts in progress)."""
    stopping: int = 0
    arrival_rate: float = 0.0
    """Requests per second over the last sample period."""
    capacity_per_instance: float | None = None
    """Requests per second one instance sustains at its limit (profile); None: unknown."""
    waiting: int = 0
    """Requests queued for an instance."""
    in_flight: int = 0
    queue_delay_ms: float = 0.0
    """Recent queueing delay (e.g. p90 over the last period)."""
    slo_ms: float | None = None
    instances_at_limit: int = 0
    """Ready instances saturated at their limit: vertical scaling has nothing more to give them."""
    min_instances: int | None = None
    max_instances: int | None = None
    last_tick_at: float | None = None
    """When the caller's previous pass over its functions (a leader's tick) ran, or None (not known, a first
    tick). A window whose last sample is from that pass missed none, however long ago it was: a leader slowed
    by its cluster's size does not restart every window (`stale_after_s` is for samples a function missed)."""

    def __post_init__(self) -> None:
        if not self.function:
            raise ValueError("function must not be empty")
        for name in (
            "instances",
            "starting",
            "stopping",
            "waiting",
            "in_flight",
            "instances_at_limit",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.function}: {name} must be >= 0")
        for name in ("arrival_rate", "queue_delay_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{self.function}: {name} must be >= 0, got {v!r}")
        cap = self.capacity_per_instance
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise ValueError(
                f"{self.function}: capacity_per_instance must be > 0, got {cap!r}"
            )
        lo, hi = self.min_instances, self.max_instances
        if (
            (lo is not None and lo < 0)
            or (hi is not None and hi < 0)
            or (lo is not None and hi is not None and lo > hi)
        ):
            raise ValueError(
                f"{self.function}: need 0 <= min-instances <= max-instances, got {lo}, {hi}"
            )

    @property
    def committed(self) -> int:
        """Instances it has or will have once starts complete."""
        return self.instances + self.starting

    @property
    def busy(self) -> bool:
        return self.arrival_rate > 0 or self.waiting > 0 or self.in_flight > 0


@dataclass(frozen=True, slots=True)
class HorizontalState:
    """Carried between ticks for one function; start with `HorizontalState()`."""

    rates: tuple[float, ...] = ()
    last_sample_at: float | None = None
    last_action_at: float | None = None
    last_busy_at: float | None = None


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    function: str
    now: float
    current: int
    """Committed instances (ready + starting)."""
    desired: int
    action: ScaleAction
    trigger: ScaleTrigger
    reason: str
    over_samples: int
    under_samples: int
    state: HorizontalState

    @property
    def delta(self) -> int:
        return self.desired - self.current


# -- small helpers -------------------------------------------------------------------------------


def instances_for(rate: float, capacity_per_instance: float) -> int:
    """The core formula: instances needed to serve `rate` at `capacity_per_instance` each."""
    return max(0, math.ceil(rate / capacity_per_instance - EPS))


def bounds(load: FunctionLoad, config: HorizontalConfig) -> tuple[int, int]:
    lo = config.min_instances if load.min_instances is None else load.min_instances
    hi = config.max_instances if load.max_instances is None else load.max_instances
    return lo, max(lo, hi)


def window_counts(rates: tuple[float, ...], n: int, capacity: float) -> tuple[int, int]:
    """(samples above what n instances serve, samples below what n − 1 serve)."""
    # Thresholds hoisted and list counting: this runs once per function per tick (and per simulated
    # second in the simulator), so it is kept cheap.
    high = n * capacity + EPS
    over = len([r for r in rates if r > high])
    if n <= 1:
        return over, 0
    low = (n - 1) * capacity - EPS
    return over, len([r for r in rates if r < low])


def sustained_level(rates: tuple[float, ...], samples: int, *, high: bool) -> float:
    """The rate reached (high) or not exceeded (low) by at least `samples` of the window."""
    ordered = sorted(rates, reverse=high)
    return ordered[samples - 1]


def window_is_stale(
    last_sample_at: float | None, now: float, last_tick_at: float | None, config: HorizontalConfig
) -> bool:
    """Whether a window last sampled at `last_sample_at` restarts at `now`: more than `stale_after_s` without a
    sample, unless the last sample came from the caller's previous pass (`FunctionLoad.last_tick_at`). A pass
    that came within half a sample period of the last sample took none, so "from the previous pass" allows
    that much."""
    if last_sample_at is None or now - last_sample_at <= config.stale_after_s:
        return False
    return last_tick_at is None or last_sample_at < last_tick_at - 0.5 * config.sample_period_s


def _advance_window(
    load: FunctionLoad, state: HorizontalState, config: HorizontalConfig
) -> tuple[HorizontalState, str]:
    rates, last = state.rates, state.last_sample_at
    note = ""
    if last is not None and window_is_stale(last, load.now, load.last_tick_at, config):
        rates, note = (
            (),
            f"window restarted after {load.now - last:.1f} s without samples",
        )
    # Half a period of slack so a tick arriving a little early still samples.
    if last is None or load.now - last >= 0.5 * config.sample_period_s:
        rates = (rates + (load.arrival_rate,))[-config.window :]
        last = load.now
    busy_at = (
        load.now if (load.busy or state.last_busy_at is None) else state.last_busy_at
    )
    return HorizontalState(rates, last, state.last_action_at, busy_at), note


def _cooling(now: float, st: HorizontalState, config: HorizontalConfig) -> bool:
    """Within the cooldown after the last scaling decision."""
    return st.last_action_at is not None and now - st.last_action_at < config.cooldown_s


def _idle_for(now: float, st: HorizontalState) -> float:
    return now - st.last_busy_at if st.last_busy_at is not None else 0.0


# -- the decision --------------------------------------------------------------------------------


def decide_scale(
    load: FunctionLoad, state: HorizontalState, config: HorizontalConfig
) -> ScaleDecision:
    """Desired instance count for one function this tick, with the reason and the state to carry."""
    st, note = _advance_window(load, state, config)
    n = load.committed
    lo, hi = bounds(load, config)
    cap = (
        load.capacity_per_instance * config.target_utilization
        if load.capacity_per_instance
        else None
    )
    over, under = window_counts(st.rates, n, cap) if cap else (0, 0)
    cooling = _cooling(load.now, st, config)
    counts = f"{over}/{len(st.rates)} samples above capacity, {under}/{len(st.rates)} below n−1"
    prefix = f"{note}; " if note else ""

    def result(desired: int, trigger: ScaleTrigger, why: str) -> ScaleDecision:
        desired = min(max(desired, lo), hi) if trigger is not ScaleTrigger.NONE else n
        new = st
        if desired != n:
            new = HorizontalState(
                rates=() if config.clear_window_after_action else st.rates,
                last_sample_at=st.last_sample_at,
                last_action_at=load.now,
                last_busy_at=st.last_busy_at,
            )
        action = (
            ScaleAction.OUT
            if desired > n
            else ScaleAction.IN
            if desired < n
            else ScaleAction.HOLD
        )
        return ScaleDecision(
            function=load.function,
            now=load.now,
            current=n,
            desired=desired,
            action=action,
            trigger=trigger if desired != n else ScaleTrigger.NONE,
            reason=f"{load.function}: {prefix}{why}",
            over_samples=over,
            under_samples=under,
            state=new,
        )

    # Bounds first: they hold even during a cooldown.
    if n < lo:
        return result(
            lo,
            ScaleTrigger.BOUNDS,
            f"{n} instance(s) below min-instances {lo}: scale out to {lo}",
        )
    if n > hi:
        return result(
            hi,
            ScaleTrigger.BOUNDS,
            f"{n} instance(s) above max-instances {hi}: scale in to {hi}",
        )

    if n == 0 and (load.waiting > 0 or load.arrival_rate > 0):
        if hi == 0:
            return result(0, ScaleTrigger.NONE, "work waiting but max-instances is 0")
        want = max(1, instances_for(load.arrival_rate, cap)) if cap else 1
        want = min(want, config.max_scale_out_step)
        return result(
            want,
            ScaleTrigger.COLD_START,
            f"no instance and {load.waiting} request(s) waiting: start {want} now",
        )

    overloaded = (
        load.instances > 0
        and load.instances_at_limit >= load.instances
        and load.slo_ms is not None
        and load.queue_delay_ms > load.slo_ms
    )
    if overloaded:
        what = (
            f"all {load.instances} instance(s) saturated at their limits and queueing delay "
            f"{load.queue_delay_ms:.0f} ms > SLO {load.slo_ms:.0f} ms"
        )
        if n >= hi:
            return result(
                n, ScaleTrigger.NONE, f"{what}, but already at max-instances {hi}"
            )
        if load.starting:
            return result(
                n,
                ScaleTrigger.NONE,
                f"{what}; {load.starting} instance(s) already starting: wait",
            )
        if cooling:
            return result(
                n, ScaleTrigger.NONE, f"{what}; in cooldown after the last decision"
            )
        want = max(n + 1, instances_for(load.arrival_rate, cap)) if cap else n + 1
        want = min(want, n + config.max_scale_out_step)
        return result(want, ScaleTrigger.OVERLOAD, f"{what}: scale out to {want} now")

    idle_for = _idle_for(load.now, st)
    idle = n > lo and not load.busy and idle_for >= config.scale_to_zero_after_s
    if cap is None:
        if idle:  # needs no capacity figure: a function nobody calls goes to its minimum either way
            return result(lo, ScaleTrigger.IDLE, f"no work for {idle_for:.0f} s: scale in to min-instances {lo}")
        return result(
            n,
            ScaleTrigger.NONE,
            "capacity per instance unknown: lazy scaling off, fast paths only",
        )

    if over >= config.scale_out_samples:
        if load.starting or cooling:
            why = "instances still starting" if load.starting else "in cooldown"
            return result(
                n, ScaleTrigger.NONE, f"sustained load ({counts}) but {why}: wait"
            )
        level = sustained_level(st.rates, config.scale_out_samples, high=True)
        want = min(max(n + 1, instances_for(level, cap)), n + config.max_scale_out_step)
        return result(
            want,
            ScaleTrigger.SUSTAINED_LOAD,
            f"sustained load: {counts} (≥ {config.scale_out_samples}); {level:.1f} req/s needs {want} × {cap:.1f}",
        )

    if under >= config.scale_in_samples and n > max(lo, 1):
        if load.stopping or cooling or load.waiting:
            why = (
                "instances still stopping"
                if load.stopping
                else "in cooldown"
                if cooling
                else "requests waiting"
            )
            return result(
                n, ScaleTrigger.NONE, f"sustained underload ({counts}) but {why}: wait"
            )
        level = sustained_level(st.rates, config.scale_in_samples, high=False)
        want = max(n - config.max_scale_in_step, instances_for(level, cap), lo, 1)
        return result(
            want,
            ScaleTrigger.SUSTAINED_UNDERLOAD,
            f"sustained underload: {counts} (≥ {config.scale_in_samples}); scale in to {want}",
        )

    if idle:
        return result(
            lo,
            ScaleTrigger.IDLE,
            f"no work for {idle_for:.0f} s: scale in to min-instances {lo}",
        )

    return result(n, ScaleTrigger.NONE, f"hold at {n}: {counts}")


def repeat_decision(
    prev: ScaleDecision, load: FunctionLoad, state: HorizontalState, now: float, config: HorizontalConfig,
    *, last_tick_at: float | None = None,
) -> ScaleDecision | None:
    """`decide_scale` at `now` for a function whose load figures have not changed since `prev` was decided on
    `load` (its figures; its `now` is not read), with `state` carried from it, when that is certainly `prev` again: the same
    hold, only the clock and the window's sample time moved. None when it might not be (call `decide_scale`):
    `prev` scaled, the window would change (a sample of another rate, a restart after a gap, no sample this
    tick) or the clock crosses a threshold of the cooldown or of the idle timeout. A balancer tick asks this
    for each function whose inputs did not change, so that a steady cluster costs little per function.
    `last_tick_at` is this tick's `FunctionLoad.last_tick_at` (`load`'s is the last tick's)."""
    if prev.action is not ScaleAction.HOLD or (state is not prev.state and state != prev.state) or now < prev.now:
        return None
    last = state.last_sample_at
    # `_advance_window`: a sample is taken (no restart) and leaves the window as it was.
    if last is None or window_is_stale(last, now, last_tick_at, config) or now - last < 0.5 * config.sample_period_s:
        return None
    if (state.rates + (load.arrival_rate,))[-config.window :] != state.rates:
        return None
    busy = load.busy
    st = HorizontalState(
        state.rates, now, state.last_action_at, now if (busy or state.last_busy_at is None) else state.last_busy_at
    )
    if _cooling(prev.now, state, config) != _cooling(now, st, config):
        return None
    if not busy and load.committed > bounds(load, config)[0]:
        s2z = config.scale_to_zero_after_s
        if (_idle_for(prev.now, state) >= s2z) != (_idle_for(now, st) >= s2z):
            return None
    # A hold's reason names neither the clock nor the idle time (an idle scale-in is not a hold).
    return ScaleDecision(
        prev.function, now, prev.current, prev.desired, prev.action, prev.trigger, prev.reason,
        prev.over_samples, prev.under_samples, st,
    )
