"""Table-driven tests of the lazy horizontal scaler (1 s ticks, time passed in)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from dilu_invoker.policy import (
    FunctionLoad,
    HorizontalConfig,
    HorizontalState,
    ScaleAction,
    ScaleDecision,
    ScaleTrigger,
    decide_scale,
    instances_for,
)
from dilu_invoker.policy.horizontal import sustained_level, window_counts

CFG = HorizontalConfig()
CAP = 10.0  # requests/s one instance serves at its limit


def load(t: float, rate: float, n: int, **kw: Any) -> FunctionLoad:
    return FunctionLoad(
        function="f",
        now=t,
        instances=n,
        arrival_rate=rate,
        capacity_per_instance=CAP,
        **kw,
    )


def drive(
    rates: list[float],
    n: int,
    *,
    config: HorizontalConfig = CFG,
    apply: bool = True,
    **kw: Any,
) -> list[ScaleDecision]:
    """Feed one sample per second; when `apply`, instances follow each decision at once."""
    state = HorizontalState()
    out = []
    for t, rate in enumerate(rates):
        d = decide_scale(load(float(t), rate, n, **kw), state, config)
        out.append(d)
        state = d.state
        if apply:
            n = d.desired
    return out


@dataclass(frozen=True)
class Seq:
    rates: list[float]
    n: int
    changes: list[tuple[int, int, ScaleTrigger]]
    """(tick, desired, trigger) of every decision that changed the count."""
    kw: dict[str, Any] | None = None
    config: HorizontalConfig = CFG


SEQUENCES = {
    "sustained-load-scales-out-after-20-of-40": Seq(
        [15.0] * 25, 1, [(19, 2, ScaleTrigger.SUSTAINED_LOAD)]
    ),
    "sustained-load-jumps-to-the-sustained-level": Seq(
        [35.0] * 25, 1, [(19, 4, ScaleTrigger.SUSTAINED_LOAD)]
    ),
    "half-window-of-load-is-enough": Seq(
        ([15.0, 5.0] * 20), 1, [(38, 2, ScaleTrigger.SUSTAINED_LOAD)]
    ),
    "short-burst-no-change": Seq([5.0] * 5 + [50.0] * 10 + [5.0] * 40, 1, []),
    "load-at-capacity-is-not-over": Seq([10.0] * 45, 1, []),
    "sustained-underload-scales-in-one-at-a-time": Seq(
        [5.0] * 75,
        3,
        [
            (29, 2, ScaleTrigger.SUSTAINED_UNDERLOAD),
            (59, 1, ScaleTrigger.SUSTAINED_UNDERLOAD),
        ],
    ),
    "underload-keeps-min-instances": Seq(
        [1.0] * 75, 3, [(29, 2, ScaleTrigger.SUSTAINED_UNDERLOAD)], {"min_instances": 2}
    ),
    "lazy-scale-in-stops-at-one": Seq(
        [0.0] * 100, 2, [(29, 1, ScaleTrigger.SUSTAINED_UNDERLOAD)]
    ),
    "idle-goes-to-zero-after-timeout": Seq(
        [0.0] * 40,
        1,
        [(30, 0, ScaleTrigger.IDLE)],
        config=HorizontalConfig(scale_to_zero_after_s=30),
    ),
    "idle-keeps-min": Seq(
        [0.0] * 40,
        2,
        [],
        {"min_instances": 2},
        HorizontalConfig(scale_to_zero_after_s=30),
    ),
    "cold-start-then-sustained": Seq(
        [0.0, 25.0] + [25.0] * 30, 0, [(1, 3, ScaleTrigger.COLD_START)]
    ),
    "max-instances-caps-scale-out": Seq(
        [100.0] * 25, 1, [(19, 3, ScaleTrigger.SUSTAINED_LOAD)], {"max_instances": 3}
    ),
    "scale-out-step-is-bounded": Seq(
        [200.0] * 25,
        1,
        [(19, 3, ScaleTrigger.SUSTAINED_LOAD)],
        config=HorizontalConfig(max_scale_out_step=2),
    ),
    "dilu-constructor-thresholds": Seq(
        [15.0] * 20,
        1,
        [(14, 2, ScaleTrigger.SUSTAINED_LOAD)],
        config=HorizontalConfig(window=20, scale_out_samples=15, scale_in_samples=15),
    ),
}


@pytest.mark.parametrize("seq", SEQUENCES.values(), ids=SEQUENCES.keys())
def test_sequences(seq: Seq) -> None:
    decisions = drive(seq.rates, seq.n, config=seq.config, **(seq.kw or {}))
    changes = [
        (i, d.desired, d.trigger) for i, d in enumerate(decisions) if d.delta != 0
    ]
    assert changes == seq.changes, [d.reason for d in decisions if d.delta]
    assert all(d.reason.startswith("f: ") for d in decisions)
    for d in decisions:
        assert (d.action is ScaleAction.HOLD) == (d.delta == 0)
        assert (d.trigger is ScaleTrigger.NONE) == (d.delta == 0)


@dataclass(frozen=True)
class Tick:
    load: FunctionLoad
    desired: int
    trigger: ScaleTrigger
    reason_has: str
    state: HorizontalState = field(default_factory=HorizontalState)


OVERLOAD = {"instances_at_limit": 2, "queue_delay_ms": 300.0, "slo_ms": 100.0}
RECENT = HorizontalState(
    rates=(1.0,), last_sample_at=9.0, last_action_at=8.0, last_busy_at=9.0
)

TICKS = {
    "cold-start-one-request-waiting": Tick(
        FunctionLoad(function="f", now=10, instances=0, waiting=1),
        1,
        ScaleTrigger.COLD_START,
        "start 1 now",
    ),
    "cold-start-sized-by-rate": Tick(
        load(10, 25.0, 0, waiting=3), 3, ScaleTrigger.COLD_START, "start 3"
    ),
    "cold-start-not-repeated-while-starting": Tick(
        load(10, 25.0, 0, waiting=3, starting=1), 1, ScaleTrigger.NONE, "hold"
    ),
    "cold-start-blocked-by-max-zero": Tick(
        load(10, 5.0, 0, waiting=1, max_instances=0),
        0,
        ScaleTrigger.NONE,
        "max-instances is 0",
    ),
    "nothing-to-do-at-zero": Tick(load(10, 0.0, 0), 0, ScaleTrigger.NONE, "hold at 0"),
    "overload-scales-out-now": Tick(
        load(10, 30.0, 2, **OVERLOAD), 3, ScaleTrigger.OVERLOAD, "saturated"
    ),
    "overload-waits-for-starting-instance": Tick(
        load(10, 30.0, 2, starting=1, **OVERLOAD),
        3,
        ScaleTrigger.NONE,
        "already starting",
    ),
    "overload-respects-cooldown": Tick(
        load(10, 30.0, 2, **OVERLOAD), 2, ScaleTrigger.NONE, "cooldown", RECENT
    ),
    "overload-at-max": Tick(
        load(10, 30.0, 2, max_instances=2, **OVERLOAD),
        2,
        ScaleTrigger.NONE,
        "max-instances 2",
    ),
    "overload-needs-every-instance-saturated": Tick(
        load(10, 30.0, 2, instances_at_limit=1, queue_delay_ms=300.0, slo_ms=100.0),
        2,
        ScaleTrigger.NONE,
        "hold",
    ),
    "overload-needs-queueing-above-slo": Tick(
        load(10, 30.0, 2, instances_at_limit=2, queue_delay_ms=50.0, slo_ms=100.0),
        2,
        ScaleTrigger.NONE,
        "hold",
    ),
    "below-min-scales-out-even-in-cooldown": Tick(
        load(10, 0.0, 1, min_instances=3), 3, ScaleTrigger.BOUNDS, "below min", RECENT
    ),
    "above-max-scales-in": Tick(
        load(10, 50.0, 5, max_instances=2), 2, ScaleTrigger.BOUNDS, "above max"
    ),
    "unknown-capacity-disables-lazy-path": Tick(
        FunctionLoad(function="f", now=10, instances=1, arrival_rate=50.0),
        1,
        ScaleTrigger.NONE,
        "capacity per instance unknown",
    ),
    "unknown-capacity-still-scales-idle-to-min": Tick(
        FunctionLoad(function="f", now=700, instances=1, arrival_rate=0.0),
        0,
        ScaleTrigger.IDLE,
        "no work for 690 s",
        HorizontalState(last_busy_at=10.0),
    ),
    "underload-waits-while-requests-queue": Tick(
        load(40, 1.0, 3, waiting=2),
        3,
        ScaleTrigger.NONE,
        "requests waiting",
        HorizontalState(rates=(1.0,) * 39, last_sample_at=39.0, last_busy_at=39.0),
    ),
    "stale-window-restarts": Tick(
        load(100, 15.0, 1),
        1,
        ScaleTrigger.NONE,
        "window restarted",
        HorizontalState(rates=(15.0,) * 39, last_sample_at=50.0, last_busy_at=50.0),
    ),
}


def test_a_slow_caller_does_not_restart_its_windows() -> None:
    """A caller whose passes come 6 s apart (a leader slowed by a large cluster) and says when its previous pass
    was keeps each window: a sustained load scales out after `scale_out_samples` passes, as at 1 s; told nothing,
    every pass restarts the window and the load never scales out. A sample the function missed (its last one
    older than the previous pass) still restarts it."""
    rates = [15.0] * 30  # above one instance's capacity

    def passes(gap: float, tell: bool) -> list[ScaleDecision]:
        state, out, prev = HorizontalState(), [], None
        for i, rate in enumerate(rates):
            t = i * gap
            d = decide_scale(load(t, rate, 1, last_tick_at=prev if tell else None), state, CFG)
            out.append(d)
            state, prev = d.state, t
        return out

    def first_out(ds: list[ScaleDecision]) -> int | None:
        return next((i for i, d in enumerate(ds) if d.action is ScaleAction.OUT), None)

    at_1s = first_out(passes(1.0, tell=False))
    assert at_1s == CFG.scale_out_samples - 1
    assert first_out(passes(6.0, tell=True)) == at_1s
    slow_untold = passes(6.0, tell=False)
    assert first_out(slow_untold) is None and all("window restarted" in d.reason for d in slow_untold[1:])
    # The function was not sampled by the previous pass (at 56 s): its window from 50 s restarts.
    st = HorizontalState(rates=(15.0,) * 10, last_sample_at=50.0, last_busy_at=50.0)
    d = decide_scale(load(62.0, 15.0, 1, last_tick_at=56.0), st, CFG)
    assert "window restarted" in d.reason and d.state.rates == (15.0,)
    # A pass within half a period after the sample took none; the one after it still continues the window.
    d = decide_scale(load(62.0, 15.0, 1, last_tick_at=50.4), st, CFG)
    assert "window restarted" not in d.reason and len(d.state.rates) == 11


@pytest.mark.parametrize("tick", TICKS.values(), ids=TICKS.keys())
def test_single_tick(tick: Tick) -> None:
    d = decide_scale(tick.load, tick.state, CFG)
    assert (d.desired, d.trigger) == (tick.desired, tick.trigger), d.reason
    assert d.current == tick.load.committed
    assert tick.reason_has in d.reason


def test_action_clears_the_window_and_starts_cooldown() -> None:
    state = HorizontalState(rates=(15.0,) * 19, last_sample_at=18.0, last_busy_at=18.0)
    d = decide_scale(load(19, 15.0, 1), state, CFG)
    assert d.delta == 1 and d.over_samples == 20
    assert d.state.rates == () and d.state.last_action_at == 19
    # Keeping the window (Dilu clears it; this is the option) the cooldown still stops a repeat.
    keep = HorizontalConfig(clear_window_after_action=False)
    d2 = decide_scale(load(19, 15.0, 1), state, keep)
    d3 = decide_scale(load(20, 15.0, 1), d2.state, keep)
    assert d2.delta == 1 and d3.delta == 0 and "cooldown" in d3.reason


def test_samples_are_taken_once_per_period() -> None:
    d1 = decide_scale(load(0.0, 5.0, 1), HorizontalState(), CFG)
    d2 = decide_scale(load(0.3, 7.0, 1), d1.state, CFG)
    d3 = decide_scale(load(0.95, 9.0, 1), d2.state, CFG)
    assert d2.state.rates == (5.0,) and d3.state.rates == (5.0, 9.0)


def test_window_keeps_the_last_samples() -> None:
    decisions = drive([5.0 + i % 5 for i in range(60)], 1, apply=False)
    assert all(d.delta == 0 for d in decisions)
    assert len(decisions[-1].state.rates) == CFG.window


def test_busy_time_is_tracked() -> None:
    d = decide_scale(
        load(10, 0.0, 1, in_flight=1), HorizontalState(last_busy_at=0.0), CFG
    )
    assert d.state.last_busy_at == 10


@pytest.mark.parametrize(
    ("rate", "cap", "n"),
    [
        (0.0, 10.0, 0),
        (10.0, 10.0, 1),
        (10.0000000001, 10.0, 1),
        (10.5, 10.0, 2),
        (0.1, 10.0, 1),
    ],
    ids=["zero", "exact", "float-noise", "just-over", "tiny"],
)
def test_instances_for(rate: float, cap: float, n: int) -> None:
    assert instances_for(rate, cap) == n


def test_window_helpers() -> None:
    rates = (5.0, 15.0, 25.0, 9.0)
    assert window_counts(rates, 1, 10.0) == (2, 0)
    assert window_counts(rates, 3, 10.0) == (0, 3)
    assert (
        window_counts(rates, 1, 10.0)[1] == 0
    )  # one fewer than one is none: never "below"
    assert sustained_level(rates, 2, high=True) == 15.0
    assert sustained_level(rates, 3, high=False) == 15.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale_out_samples": 41},
        {"scale_in_samples": 0},
        {"window": 0},
        {"min_instances": 3, "max_instances": 2},
        {"sample_period_s": 0.0},
        {"stale_after_s": 0.5},
        {"max_scale_in_step": 0},
        {"cooldown_s": -1.0},
    ],
    ids=lambda k: ",".join(k),
)
def test_config_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HorizontalConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"instances": -1},
        {"arrival_rate": float("nan")},
        {"capacity_per_instance": 0.0},
        {"min_instances": 3, "max_instances": 1},
        {"function": ""},
    ],
    ids=lambda k: next(iter(k)),
)
def test_load_rejects_nonsense(kwargs: dict[str, object]) -> None:
    base = {"function": "f", "now": 0.0, "instances": 1}
    with pytest.raises(ValueError):
        FunctionLoad(**{**base, **kwargs})  # type: ignore[arg-type]


def test_decisions_are_values() -> None:
    d = decide_scale(load(0, 1.0, 1), HorizontalState(), CFG)
    with pytest.raises(AttributeError):
        d.desired = 3  # type: ignore[misc]
    assert replace(d, desired=3).delta == 2
