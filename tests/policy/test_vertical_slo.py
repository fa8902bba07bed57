"""The `slo` vertical policy: its helpers as tables, its state machine step by step, and selection."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import pytest

from dilu_invoker.policy import (
    FeedbackMode,
    InstanceClass,
    VerticalDecision,
    VerticalInstance,
    VerticalSnapshot,
)
from dilu_invoker.policy.vertical_slo import (
    CLAMP_RATIO,
    GPU_VERTICAL_POLICIES,
    VERTICAL_POLICIES,
    AnyVerticalConfig,
    SloConfig,
    SloState,
    SloTrack,
    SpatialConfig,
    StaticConfig,
    arrival_scv,
    check_policy_name,
    decide_slo,
    decide_vertical,
    dispersion,
    initial_state,
    latency_shares,
    median,
    move_for,
    mps_start_threads,
    next_budget,
    p99_estimate,
    policy_name,
    scv,
    target_s,
)

CFG = SloConfig()
P = 0.05


@pytest.mark.parametrize(("counts", "expected"), [
    ((5, 5, 5, 5), 0.0),
    ((4, 6, 4, 6), 12 / 6 / 5),  # half the mean square of successive differences / the mean
    ((0, 10, 0, 10), 300 / 6 / 5),
    ((2, 2, 2, 10, 10, 10), 64 / 10 / 6),  # a change of rate counts once, not as variability throughout
    ((5, 5), 1.0),  # too few periods: assume Poisson
    ((0, 0, 0), 1.0),
], ids=["paced", "alternating", "bursty", "rate-change", "too-few", "nothing"])
def test_dispersion(counts: tuple[int, ...], expected: float) -> None:
    assert dispersion(counts) == pytest.approx(expected)


@pytest.mark.parametrize(("spans", "expected"), [
    ((0.005,), 0.0),
    ((0.005, 0.005, 0.005), 0.0),
    ((0.004, 0.006), (2e-6 / 1) / 0.005 ** 2),
], ids=["one", "constant", "two"])
def test_scv(spans: tuple[float, ...], expected: float) -> None:
    assert scv(spans) == pytest.approx(expected)


@pytest.mark.parametrize(("cd2", "rho", "cs2", "expected"), [
    (1.0, 0.0, 0.0, 1.0),  # an idle server passes arrivals through
    (0.64, 0.6, 0.0, 1.0),  # Poisson arrivals smoothed by a deterministic server at ρ 0.6
    (0.0, 0.5, 0.0, 0.0),  # paced
    (10.0, 0.5, 0.0, 4.0),  # capped
    (0.0, 0.9, 1.0, 0.0),  # never negative
], ids=["idle", "poisson-smoothed", "paced", "capped", "floor"])
def test_arrival_scv_inverts_the_linking_equation(cd2: float, rho: float, cs2: float, expected: float) -> None:
    assert arrival_scv(cd2, rho=rho, cs2=cs2) == pytest.approx(expected)


@pytest.mark.parametrize(("rho", "ca2", "expected"), [
    (0.0, 1.0, 0.005),  # no load, no wait
    (0.5, 0.0, 0.005),  # paced, deterministic service: no wait
    (0.5, 1.0, 0.005 + 0.5 / 0.5 * 0.005 * math.log(50)),  # M/D/1 at 0.5
    (0.999, 1.0, 0.005 + 0.5 / 0.02 * 0.005 * math.log(98)),  # ρ capped at 0.98
], ids=["idle", "paced", "poisson", "capped"])
def test_p99_estimate(rho: float, ca2: float, expected: float) -> None:
    assert p99_estimate(0.005, rho=rho, ca2=ca2, cs2=0.0) == pytest.approx(expected)


def test_p99_estimate_grows_with_load_and_variability() -> None:
    loads = [p99_estimate(0.005, rho=r, ca2=1.0, cs2=0.0) for r in (0.2, 0.4, 0.6, 0.8)]
    assert loads == sorted(loads) and loads[-1] > 3 * loads[0]
    assert p99_estimate(0.005, rho=0.6, ca2=2.0, cs2=0.0) > p99_estimate(0.005, rho=0.6, ca2=1.0, cs2=0.0)


@pytest.mark.parametrize(("error", "expected"), [
    (0.5, FeedbackMode.INCREASE),
    (0.849, FeedbackMode.INCREASE),
    (0.85, FeedbackMode.HOLD),
    (1.0, FeedbackMode.HOLD),
    (1.01, FeedbackMode.DECREASE),
    (CLAMP_RATIO, FeedbackMode.EMERGENCY),
], ids=["low", "below-band", "band-bottom", "band-top", "above", "clamp"])
def test_move_for(error: float, expected: FeedbackMode) -> None:
    assert move_for(error, 0.15) is expected


@pytest.mark.parametrize(("move", "budget", "threshold", "expected"), [
    (FeedbackMode.EMERGENCY, 0.8, None, (0.01, 0.56)),
    (FeedbackMode.DECREASE, 0.8, None, (0.56, None)),
    (FeedbackMode.DECREASE, 0.012, None, (0.01, None)),  # not below the floor
    (FeedbackMode.INCREASE, 0.5, None, (0.6, None)),  # + 0.5/s × 0.2 s
    (FeedbackMode.INCREASE, 0.95, None, (1.0, None)),  # not above the ceiling
    (FeedbackMode.INCREASE, 0.1, 0.56, (0.2, 0.56)),  # below the threshold: doubled
    (FeedbackMode.INCREASE, 0.4, 0.56, (0.56, 0.56)),  # doubled, but not past the threshold
    (FeedbackMode.INCREASE, 0.56, 0.56, (0.66, None)),  # at the threshold: additive again
    (FeedbackMode.HOLD, 0.5, 0.56, (0.5, 0.56)),
], ids=["emergency", "decrease", "decrease-floor", "increase", "increase-ceiling", "slow-start",
        "slow-start-capped", "slow-start-done", "hold"])
def test_next_budget(move: FeedbackMode, budget: float, threshold: float | None,
                     expected: tuple[float, float | None]) -> None:
    b, t = next_budget(move, budget, floor=0.01, ceiling=1.0, threshold=threshold, config=CFG)
    assert b == pytest.approx(expected[0])
    assert t == (pytest.approx(expected[1]) if expected[1] is not None else None)


@pytest.mark.parametrize(("slo_ms", "track", "expected"), [
    (20.0, SloTrack(id="i"), 0.020),  # annotated: the SLO itself
    (None, SloTrack(id="i"), None),  # nothing measured yet
    # Derived, paced (constant counts, constant spans): the factor × the solo span.
    (None, SloTrack(id="i", solo_s=0.005, counts=(5,) * 10, busy=(0.25,) * 10, judged=(0.005,) * 5), 0.010),
], ids=["annotated", "unmeasured", "derived-paced"])
def test_target(slo_ms: float | None, track: SloTrack, expected: float | None) -> None:
    inst = VerticalInstance(id="i", cls=InstanceClass.INFERENCE, request=0.5, limit=1.0, slo_ms=slo_ms)
    got = target_s(inst, track, period_s=P, config=CFG)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_derived_target_includes_the_solo_queue_at_the_current_rate() -> None:
    inst = VerticalInstance(id="i", cls=InstanceClass.INFERENCE, request=0.5, limit=1.0)
    poisson = SloTrack(id="i", solo_s=0.005, counts=(3, 7, 5, 2, 8, 5) * 3, busy=(0.5,) * 10, judged=(0.005,) * 5)
    got = target_s(inst, poisson, period_s=P, config=CFG)
    assert got is not None and got > 2 * 0.005 * 1.5


def test_an_annotated_slo_looser_than_the_factor_times_solo_does_not_loosen_the_target() -> None:
    inst = VerticalInstance(id="i", cls=InstanceClass.INFERENCE, request=0.5, limit=1.0, slo_ms=100.0)
    paced = SloTrack(id="i", solo_s=0.005, counts=(5,) * 10, busy=(0.25,) * 10, judged=(0.005,) * 5)
    assert target_s(inst, paced, period_s=P, config=CFG) == pytest.approx(0.010)
    assert target_s(replace(inst, slo_ms=8.0), paced, period_s=P, config=CFG) == pytest.approx(0.008)


@pytest.mark.parametrize("xs", [(1.0,), (1.0, 3.0), (3.0, 1.0, 2.0)], ids=["one", "even", "odd"])
def test_median(xs: tuple[float, ...]) -> None:
    assert median(xs) == pytest.approx(2.0 if len(xs) > 1 else 1.0)


@pytest.mark.parametrize(("field", "value"), [
    ("slo_factor", 0.9), ("deadband", 0.0), ("deadband", 1.0), ("increase_per_s", 0.0), ("decrease", 1.0),
    ("decrease", 0.0), ("dwell_s", 0.0), ("mps_best_effort_threads", 0.0), ("mps_best_effort_threads", 1.5),
    ("dwell_s", math.inf),
], ids=lambda v: str(v))
def test_config_rejects_values_without_meaning(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SloConfig(**{field: value})


# -- the state machine, one period at a time -------------------------------------------------------


def inf(now: float, spans: tuple[float, ...] = (), *, slo_ms: float | None = 20.0, open_s: float = 0.0,
        active: bool = True) -> VerticalInstance:
    return VerticalInstance(id="inf", cls=InstanceClass.INFERENCE, request=0.5, limit=1.0, slo_ms=slo_ms,
                            blocks=100 if active else 0, last_active_at=now if active else None, spans_s=spans,
                            open_span_s=open_s)


KNOWN = SloTrack(id="inf", solo_s=0.02)
"""A solo span measured so long ago that the annotated SLO, not slo_factor × solo, is the target."""


def train(now: float) -> VerticalInstance:
    return VerticalInstance(id="train", cls=InstanceClass.TRAINING, request=0.2, limit=1.0, blocks=100,
                            last_active_at=now)


def step(now: float, state: SloState, *instances: VerticalInstance, config: SloConfig = CFG) -> VerticalDecision:
    return decide_slo(VerticalSnapshot(now=now, instances=instances, period_s=P), state, config)


def state_of(d: VerticalDecision) -> SloState:
    assert isinstance(d.state, SloState)
    return d.state


def test_idle_gives_best_effort_the_whole_gpu_and_remembers_the_budget() -> None:
    d = step(10.0, SloState(budget=0.4, tracks=(KNOWN,)), inf(10.0, active=False), train(10.0))
    assert d.mode is FeedbackMode.IDLE and d.share_of("train") == pytest.approx(1.0)
    assert state_of(d).budget is None and state_of(d).resume == pytest.approx(0.4)
    again = step(10.05, state_of(d), inf(10.05, (0.005,) * 4), train(10.05))
    assert again.share_of("train") == pytest.approx(0.4)


def test_start_is_the_room_the_requests_leave_and_the_dwell_holds_it() -> None:
    d = step(0.0, SloState(tracks=(KNOWN,)), inf(0.0), train(0.0))
    assert d.mode is FeedbackMode.HOLD and d.share_of("train") == pytest.approx(0.5)
    assert "began" in d.reason


def test_unhurt_spans_increase_after_the_dwell_and_not_before() -> None:
    state = SloState(tracks=(KNOWN,))
    modes, shares = [], []
    for k in range(12):
        now = k * P
        d = step(now, state, inf(now, (0.005,) * 5), train(now))
        state = state_of(d)
        modes.append(d.mode)
        shares.append(d.share_of("train"))
    assert FeedbackMode.INCREASE in modes
    first = modes.index(FeedbackMode.INCREASE)
    assert first * P >= CFG.dwell_s - 1e-9
    moves = [k for k, m in enumerate(modes) if m is FeedbackMode.INCREASE]
    assert all(b - a >= round(CFG.dwell_s / P) for a, b in itertools.pairwise(moves))
    assert shares == sorted(shares) and shares[-1] > 0.5


def test_stretched_spans_decrease_multiplicatively() -> None:
    state = SloState(budget=0.8, moved_at=0.0, mode=FeedbackMode.HOLD, tracks=(KNOWN,))
    d = None
    for k in range(1, 8):
        now = k * P
        d = step(now, state, inf(now, (0.023,)), train(now))  # 1.15× a 20 ms SLO, one request a period
        state = state_of(d)
        if d.mode is FeedbackMode.DECREASE:
            break
    assert d is not None and d.mode is FeedbackMode.DECREASE
    assert d.share_of("train") == pytest.approx(0.8 * CFG.decrease)


@pytest.mark.parametrize(("spans", "open_s", "what"), [
    ((0.035, 0.035, 0.035), 0.0, "this period"),  # 1.75× the SLO in one period
    ((), 0.025, "in progress"),  # a span already past the SLO
], ids=["period", "open-span"])
def test_emergency_clamps_at_once_without_waiting_for_the_dwell(spans: tuple[float, ...], open_s: float,
                                                                what: str) -> None:
    state = SloState(budget=0.8, moved_at=1.0, mode=FeedbackMode.HOLD,
                     tracks=(SloTrack(id="inf", solo_s=0.02, counts=(1, 1, 1), busy=(0.5, 0.5, 0.5)),))
    d = step(1.05, state, inf(1.05, spans, open_s=open_s), train(1.05))
    assert d.mode is FeedbackMode.EMERGENCY and what in d.reason
    assert d.share_of("train") == pytest.approx(0.01)
    assert state_of(d).threshold == pytest.approx(0.8 * CFG.decrease)


def test_spans_filling_the_time_near_the_target_decrease_without_waiting_for_the_dwell() -> None:
    track = SloTrack(id="inf", solo_s=0.02, counts=(5, 5, 5), busy=(0.97, 0.98), judged=(0.0099,) * 5)
    # The last move 0.15 s ago: within the dwell, yet the queue decreases at once.
    state = SloState(budget=0.8, moved_at=0.9, mode=FeedbackMode.HOLD, tracks=(track,))
    d = step(1.05, state, inf(1.05, (0.0099,) * 5), train(1.05))  # 99% busy, evenly spaced: ρ / 0.9 > 1
    assert d.mode is FeedbackMode.DECREASE and "fill its time" in d.reason
    assert d.share_of("train") == pytest.approx(0.8 * CFG.decrease)


def test_a_surge_is_judged_at_its_own_busy_fraction() -> None:
    # One request a period for a second, then ten in one period: the one-second busy fraction lags, the
    # surge's own does not, and its queue estimate clamps at once.
    track = SloTrack(id="inf", solo_s=0.004, counts=(1,) * 20, busy=(0.08,) * 20)
    state = SloState(budget=0.8, moved_at=0.0, mode=FeedbackMode.HOLD, tracks=(track,))
    d = step(1.0, state, inf(1.0, (0.0048,) * 10, slo_ms=12.0), train(1.0))
    assert d.mode is FeedbackMode.EMERGENCY and "this period" in d.reason
    calm = step(1.0, state, inf(1.0, (0.0048,), slo_ms=12.0), train(1.0))
    assert calm.mode is not FeedbackMode.EMERGENCY


def test_the_solo_latency_is_measured_at_the_floor_first() -> None:
    state, modes, shares = SloState(), [], []
    for k in range(8):
        now = k * P
        d = step(now, state, inf(now, (0.005,) * 5, slo_ms=None), train(now))
        state = state_of(d)
        modes.append(d.mode)
        shares.append(d.share_of("train"))
    # Two periods at the floor (the first still runs work admitted before), then the solo span is known.
    assert modes[:3] == [FeedbackMode.MEASURE, FeedbackMode.MEASURE, FeedbackMode.HOLD]
    assert shares[0] == pytest.approx(0.01) and shares[2] == pytest.approx(0.5)
    assert state.track("inf").solo_s == pytest.approx(0.005)
    assert FeedbackMode.MEASURE not in modes[4:] and shares[-1] >= 0.5
    assert "derived" in d.reason


def test_latency_critical_keeps_its_limit_and_best_effort_gets_the_mps_cap() -> None:
    d = step(0.0, SloState(tracks=(KNOWN,)), inf(0.0), train(0.0))
    assert d.share_of("inf") == pytest.approx(1.0)
    by_id = {s.id: s for s in d.shares}
    assert by_id["inf"].mps_threads is None
    assert by_id["train"].mps_threads == pytest.approx(CFG.mps_best_effort_threads)


@pytest.mark.parametrize(("cls", "limit", "config", "threads"), [
    (InstanceClass.TRAINING, 0.9, SloConfig(), 0.7),  # best-effort under slo: the knob
    (InstanceClass.TRAINING, 0.4, SloConfig(), 0.4),  # ... never above its own limit
    (InstanceClass.TRAINING, 0.9, SloConfig(mps_best_effort_threads=1.0), 0.9),
    (InstanceClass.INFERENCE, 0.8, SloConfig(), 0.8),  # latency-critical: its limit
    (InstanceClass.TRAINING, 0.9, StaticConfig(), 0.9),  # static: the limit
    (InstanceClass.TRAINING, 0.001, SloConfig(), 0.01),  # MPS takes 1% at least
])
def test_mps_start_threads(cls: InstanceClass, limit: float, config: object, threads: float) -> None:
    assert mps_start_threads(cls, limit, config) == pytest.approx(threads)  # type: ignore[arg-type]


# -- selection ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "name", "reason"), [
    (SloConfig(), "slo", "began"),
    (StaticConfig(), "static", "static: every instance at its limit"),
    (SpatialConfig(), "spatial", "spatial: launches not throttled"),
], ids=["slo", "static", "spatial"])
def test_the_config_selects_the_policy(config: AnyVerticalConfig, name: str, reason: str) -> None:
    assert initial_state(config) == SloState() and policy_name(config) == name
    snap = VerticalSnapshot(now=0.0, instances=(inf(0.0), train(0.0)), period_s=P)
    d = decide_vertical(snap, initial_state(config), config)
    assert reason in d.reason and isinstance(d.state, SloState)


@pytest.mark.parametrize(("name", "choices", "error"), [
    ("slo", GPU_VERTICAL_POLICIES, None),
    ("auto", GPU_VERTICAL_POLICIES, None),
    ("static", VERTICAL_POLICIES, None),
    ("rckm", GPU_VERTICAL_POLICIES,
     "--gpu-vertical-policy rckm was removed: slo replaced it as the time-sliced policy (docs/policies.md §1.2); "
     "use one of auto, slo, static, spatial"),
    ("rckm", VERTICAL_POLICIES,
     "--gpu-vertical-policy rckm was removed: slo replaced it as the time-sliced policy (docs/policies.md §1.2); "
     "use one of slo, static"),
    ("auto", VERTICAL_POLICIES, "--gpu-vertical-policy must be one of slo, static, not 'auto'"),
    ("pid", GPU_VERTICAL_POLICIES, "--gpu-vertical-policy must be one of auto, slo, static, spatial, not 'pid'"),
], ids=["slo", "auto", "static-simulated", "rckm", "rckm-simulated", "auto-simulated", "unknown"])
def test_a_policy_name_is_checked_and_a_removed_one_refused_by_name(name: str, choices: tuple[str, ...],
                                                                    error: str | None) -> None:
    if error is None:
        check_policy_name(name, choices=choices)
        return
    with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
        check_policy_name(name, choices=choices)


def test_the_remaining_policies() -> None:
    assert VERTICAL_POLICIES == ("slo", "static")
    assert GPU_VERTICAL_POLICIES == ("auto", "slo", "static", "spatial")


# -- latency-critical shares ---------------------------------------------------------------------------


def _lc(id: str, request: float, limit: float) -> VerticalInstance:
    return VerticalInstance(id=id, cls=InstanceClass.INFERENCE, request=request, limit=limit)


@pytest.mark.parametrize(("pairs", "room", "expected", "why"), [
    ([], 1.0, {}, ""),
    ([(0.3, 0.6), (0.2, 0.4)], 1.0, {"a": 0.6, "b": 0.4}, ""),  # the limits fit (exactly): each its limit
    # Σ limits 1.4: requests first, the 0.5 left by headroom 0.5 : 0.4
    ([(0.3, 0.8), (0.2, 0.6)], 1.0, {"a": 0.3 + 0.5 * 5 / 9, "b": 0.2 + 0.5 * 4 / 9}, "cut toward requests"),
    ([(0.3, 0.3), (0.2, 0.9)], 0.8, {"a": 0.3, "b": 0.5}, "cut toward requests"),  # no headroom, no more
    ([(0.3, 0.8), (0.2, 0.6)], 0.4, {"a": 0.24, "b": 0.16}, "cut in proportion"),  # not even the requests fit
], ids=["none", "limits-fit", "toward-requests", "no-headroom", "requests-cut"])
def test_latency_shares(pairs: list[tuple[float, float]], room: float, expected: dict[str, float], why: str) -> None:
    active = [_lc(id, r, limit) for id, (r, limit) in zip("ab", pairs, strict=False)]
    shares, reason = latency_shares(active, room)
    assert shares == pytest.approx(expected)
    assert (why in reason) if why else reason == ""


@pytest.mark.parametrize(("inference_active", "mode"), [(True, FeedbackMode.HOLD), (False, FeedbackMode.IDLE)],
                         ids=["beside-inference", "alone"])
def test_static_puts_every_instance_at_its_limit(inference_active: bool, mode: FeedbackMode) -> None:
    t = VerticalInstance(id="train", cls=InstanceClass.TRAINING, request=0.3, limit=0.3, blocks=100,
                         last_active_at=1.0)
    snap = VerticalSnapshot(now=1.0, instances=(inf(1.0, (0.05,) * 3, active=inference_active), t), period_s=P)
    d = decide_vertical(snap, SloState(), StaticConfig())
    assert d.mode is mode and d.share_of("inf") == pytest.approx(1.0) and d.share_of("train") == pytest.approx(0.3)
    assert d.budget is None and all("static" in s.reason for s in d.shares)
