"""Table-driven tests of the vertical policy's defaults: smoothed cycle feedback, a budget that holds under
contention and grows past the fair budget, demand-sized room and burst cuts (docs/policies.md §1).

Numbers follow the first H200 run: inference <0.5, 1.0>, training <0.2, 1.0>, 50 ms periods, cycles
judged against a minimum of 40 ms (the default `min_cycle_s` 35 ms keeps one-request cycles out of it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from dilu_invoker.policy import (
    CycleTrack,
    FeedbackMode,
    InstanceClass,
    VerticalConfig,
    VerticalInstance,
    VerticalSnapshot,
    VerticalState,
    decide_shares,
)

NOW = 50.0
PERIOD = 0.05
CAPACITY = 100.0  # blocks/ms: a demand share d is d × 5000 blocks per 50 ms period
MIN = 0.040
CFG = VerticalConfig(busy_ceiling=1.0)
"""The feedback rules without the reserve, so budgets up to 1 show each rule alone (the reserve is tested
on its own at the end)."""
INF, TRAIN = InstanceClass.INFERENCE, InstanceClass.TRAINING


def infer(
    *,
    demand: float = 0.4,
    cycles: tuple[float, ...] = (),
    open_cycle: float = 0.0,
    idle_for: float = 0.0,
    capacity: float | None = CAPACITY,
    request: float = 0.5,
    limit: float = 1.0,
    id: str = "inf",
) -> VerticalInstance:
    """`cycles` and `open_cycle` in multiples of the 40 ms minimum."""
    active = idle_for == 0.0
    return VerticalInstance(
        id=id,
        cls=INF,
        request=request,
        limit=limit,
        blocks=round(demand * CAPACITY * PERIOD * 1000) if active else 0,
        last_active_at=NOW - idle_for,
        cycles_s=tuple(c * MIN for c in cycles),
        open_cycle_s=open_cycle * MIN,
        capacity_blocks_per_ms=capacity,
    )


def train(*, request: float = 0.2, limit: float = 1.0) -> VerticalInstance:
    return VerticalInstance(
        id="train", cls=TRAIN, request=request, limit=limit, blocks=1000, last_active_at=NOW
    )


def state(
    budget: float,
    *,
    recent: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0),
    ema: float | None = 0.4,
    mode: FeedbackMode = FeedbackMode.RECOVERY,
    recovery_cycles: int = 0,
) -> VerticalState:
    return VerticalState(
        budget=budget,
        recovery_cycles=recovery_cycles,
        mode=mode,
        tracks=(CycleTrack("inf", MIN, (MIN,), recent_ratios=recent, demand_ema=ema),),
    )


@dataclass(frozen=True)
class Case:
    instances: tuple[VerticalInstance, ...]
    mode: FeedbackMode
    train: float
    infer: float = 1.0
    state: VerticalState = field(default_factory=VerticalState)
    config: VerticalConfig = CFG
    reason_has: str = ""


CASES = {
    # -- start and idle
    "idle-inference-training-takes-its-limit": Case(
        (infer(idle_for=2.0), train()), FeedbackMode.IDLE, 1.0
    ),
    "start-at-the-room-measured-demand-leaves": Case(
        # Inference launched 0.4 of the GPU: it needs max(request 0.5, 0.4 × 1.25) = 0.5.
        (infer(demand=0.4), train()), FeedbackMode.STEADY, 0.5, reason_has="began"
    ),
    "start-sized-by-a-high-demand": Case(
        (infer(demand=0.6), train()), FeedbackMode.STEADY, 1 - 0.6 * 1.25
    ),
    "start-never-below-training-request": Case(
        (infer(demand=0.9), train()), FeedbackMode.STEADY, 0.2
    ),
    "start-without-a-capacity-counts-the-limit": Case(
        # No demand share to measure: as conservative as run 1 (the request is the guarantee).
        (infer(capacity=None), train()), FeedbackMode.STEADY, 0.2
    ),
    "inference-keeps-its-limit-beside-training-request": Case(
        (infer(), train()), FeedbackMode.STEADY, 0.5, infer=1.0
    ),
    "run1-inference-yields-to-training-request": Case(
        (infer(), train()),
        FeedbackMode.STEADY,
        0.2,
        infer=0.8,
        config=VerticalConfig.run1(),
    ),
    # -- contention and merged-request noise
    "contention-holds-an-oversubscribed-budget": Case(
        (infer(cycles=(1.3,)), train()),
        FeedbackMode.CONTENTION,
        0.9,
        state=state(0.9, recent=(1.3, 1.3, 1.3, 1.3)),
        reason_has="median of its last 5 cycles 1.30×",
    ),
    "run1-contention-clamps-to-fair": Case(
        (infer(cycles=(1.3,)), train()),
        FeedbackMode.CONTENTION,
        0.2,
        infer=0.8,
        state=state(0.9),
        config=VerticalConfig.run1(),
    ),
    "one-merged-request-cycle-is-not-an-emergency": Case(
        (infer(cycles=(2.5,)), train()),
        FeedbackMode.RECOVERY,
        0.5 * 1.3,
        state=state(0.5, recent=(1.0, 1.0, 1.05, 1.1)),
    ),
    "run1-one-merged-request-cycle-is-an-emergency": Case(
        (infer(cycles=(2.5,)), train()),
        FeedbackMode.EMERGENCY,
        0.2 / 2.5,
        infer=0.8,
        state=state(0.9),
        config=VerticalConfig.run1(min_cycle_s=0.035),
    ),
    "outlier-cycle-stays-out-of-the-median": Case(
        (infer(cycles=(4.5, 1.0)), train()),
        FeedbackMode.RECOVERY,
        0.5 * 1.3,
        state=state(0.5, recent=(1.0, 1.0, 1.0, 1.0)),
    ),
    # -- emergency
    "stretched-median-is-an-emergency-cut-by-the-ratio": Case(
        (infer(cycles=(1.9,)), train()),
        FeedbackMode.EMERGENCY,
        0.9 / 1.7,
        state=state(0.9, recent=(1.7, 1.8, 1.7, 1.0)),
        reason_has="÷1.70",
    ),
    "emergency-never-below-the-floor": Case(
        (infer(cycles=(3.0,)), train()),
        FeedbackMode.EMERGENCY,
        0.05 * 0.2,
        state=state(0.012, recent=(3.0, 3.0, 3.0, 3.0)),
    ),
    "cycle-in-progress-at-2x-is-not-yet-an-emergency": Case(
        (infer(open_cycle=2.0), train()),
        FeedbackMode.STEADY,
        0.9,
        state=state(0.9),
    ),
    "cycle-in-progress-at-3x-is-an-emergency-now": Case(
        (infer(open_cycle=3.2), train()),
        FeedbackMode.EMERGENCY,
        0.9 / 3.2,
        state=state(0.9),
        reason_has="in progress",
    ),
    # -- recovery
    "recovery-grows-on-every-unhurt-cycle": Case(
        (infer(cycles=(1.0,)), train()),
        FeedbackMode.RECOVERY,
        0.5 * 1.3,
        state=state(0.5),
    ),
    "run3-recovery-counts-cycles": Case(
        (infer(cycles=(1.0,)), train()),
        FeedbackMode.RECOVERY,
        0.5,
        state=state(0.5),
        reason_has="1/5",
        config=VerticalConfig.run3(),
    ),
    "recovery-grows-past-the-fair-budget": Case(
        (infer(cycles=(1.0,)), train()),
        FeedbackMode.RECOVERY,
        0.7 * 1.3,
        state=state(0.7, recovery_cycles=4),
    ),
    "recovery-stops-at-training-limit": Case(
        (infer(cycles=(1.0,) * 5), train(limit=0.85)),
        FeedbackMode.RECOVERY,
        0.85,
        state=state(0.8),
    ),
    "no-oversubscription-keeps-the-fair-budget": Case(
        (infer(cycles=(1.0,) * 5), train()),
        FeedbackMode.RECOVERY,
        0.2,
        infer=0.8,
        state=state(0.2),
        config=VerticalConfig(oversubscribe_in_recovery=False),
    ),
    # -- burst
    "burst-cuts-at-once-by-the-jump": Case(
        # Demand 0.6 against an average of 0.2: ÷3 (0.3), above the room it leaves (1 − 0.75).
        (infer(demand=0.6), train()),
        FeedbackMode.BURST,
        0.9 / 3,
        state=state(0.9, ema=0.2),
        reason_has="burst",
    ),
    "burst-cut-stops-at-the-room-left": Case(
        (infer(demand=0.45), train()),
        FeedbackMode.BURST,
        1 - 0.45 * 1.25,
        state=state(0.9, ema=0.2),
    ),
    "burst-within-the-room-holds": Case(
        (infer(demand=0.6), train()),
        FeedbackMode.CONTENTION,
        0.2,
        state=state(0.2, ema=0.2),
    ),
    "demand-noise-below-the-burst-ratio-is-no-burst": Case(
        (infer(demand=0.7), train()),
        FeedbackMode.STEADY,
        0.9,
        state=state(0.9, ema=0.4),
    ),
    "emergency-deeper-than-the-burst-wins": Case(
        # The burst alone (÷2) would give max(room 0.25, 0.45); the cycles say ÷2.5.
        (infer(demand=0.6, cycles=(2.5,)), train()),
        FeedbackMode.EMERGENCY,
        0.9 / 2.5,
        state=state(0.9, ema=0.3, recent=(2.5, 2.5, 2.5, 2.5)),
    ),
    "burst-off-in-run1": Case(
        (infer(demand=0.6), train()),
        FeedbackMode.STEADY,
        0.9,
        infer=1.0,
        state=state(0.9, ema=0.2),
        config=VerticalConfig.run1(fair_budget_cap=False),
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_default_policy(case: Case) -> None:
    d = decide_shares(
        VerticalSnapshot(now=NOW, instances=case.instances, period_s=PERIOD, gpu="0"),
        case.state,
        case.config,
    )
    assert d.mode is case.mode, d.reason
    assert d.share_of("train") == pytest.approx(case.train), d.reason
    assert d.share_of("inf") == pytest.approx(case.infer), d.reason
    assert case.reason_has in d.reason
    assert d.state.mode is case.mode


# -- sequences -----------------------------------------------------------------------------------


def _steps(
    config: VerticalConfig, periods: list[tuple[float, tuple[float, ...]]], start: VerticalState
) -> list[tuple[FeedbackMode, float]]:
    """(demand, cycles in multiples of 40 ms) per period → (mode, training share) per period."""
    out = []
    s, t = start, NOW
    for demand, cycles in periods:
        d = decide_shares(
            VerticalSnapshot(now=t, instances=(infer(demand=demand, cycles=cycles), train()), period_s=PERIOD),
            s,
            config,
        )
        out.append((d.mode, d.share_of("train")))
        s, t = d.state, t + PERIOD
    return out


# A steady Poisson load as run 1 saw it: short cycles (requests alone, below the minimum), cycles near
# the minimum, and every few periods one merged-request cycle 1.7-2.7× the minimum.
STEADY = [
    (0.4, (0.3, 1.0)),
    (0.45, (1.1,)),
    (0.35, (0.25, 2.7)),
    (0.4, (1.0, 0.3)),
    (0.4, (1.05,)),
    (0.5, (1.7,)),
    (0.4, (0.3, 1.0)),
    (0.35, (1.1, 0.25)),
    (0.4, (2.2,)),
    (0.45, (1.0,)),
] * 6


def test_merged_request_noise_does_not_starve_training() -> None:
    new = _steps(CFG, STEADY, VerticalState())
    assert FeedbackMode.EMERGENCY not in {m for m, _ in new}
    assert new[-1][1] == pytest.approx(1.0)  # grown to its limit while the cycles are unhurt
    old = _steps(VerticalConfig.run1(min_cycle_s=0.035), STEADY, VerticalState())
    assert FeedbackMode.EMERGENCY in {m for m, _ in old}
    assert max(s for _, s in old[-20:]) < 0.3  # run 1: held at or below the fair budget 0.2 + growth


def test_real_stretch_is_cut_then_recovers() -> None:
    """Interference stretches every cycle ×1.8 for a while: an emergency within three cycles, then growth
    back once the cycles are unhurt."""
    grown = _steps(CFG, STEADY, VerticalState())
    assert grown[-1][1] == pytest.approx(1.0)
    s = VerticalState()
    for demand, cycles in STEADY:  # rebuild the state the steady run ended with
        s = decide_shares(
            VerticalSnapshot(now=NOW, instances=(infer(demand=demand, cycles=cycles), train()), period_s=PERIOD),
            s,
            CFG,
        ).state
    stretched = [(0.4, (1.8,))] * 4 + [(0.4, (1.0,))] * 20
    seq = _steps(CFG, stretched, s)
    modes = [m for m, _ in seq]
    assert FeedbackMode.EMERGENCY in modes[:3]
    low = min(v for _, v in seq)
    assert low < 0.6
    assert seq[-1][1] > low * 1.5  # recovering


def test_burst_is_absorbed_within_two_periods() -> None:
    """Base load 0.12 of the GPU, then 3×: training is cut by the second 50 ms period (≤ 100 ms)."""
    base = [(0.12, (1.0,)), (0.12, ()), (0.12, (0.3,))] * 10
    s = VerticalState()
    for demand, cycles in base:
        s = decide_shares(
            VerticalSnapshot(now=NOW, instances=(infer(demand=demand, cycles=cycles), train()), period_s=PERIOD),
            s,
            CFG,
        ).state
    assert s.budget is not None and s.budget > 0.8
    seq = _steps(CFG, [(0.36, ()), (0.36, ())], s)
    assert seq[0][0] is FeedbackMode.BURST
    # ÷3 would be below what the burst leaves: inference's request 0.5 beats 0.36 × 1.25.
    assert seq[0][1] == pytest.approx(0.5)


# -- the SLO guard ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slo_ms", "cycles", "open_cycle", "mode"),
    [
        # 2× its best cycle is 80 ms: a 400 ms SLO can afford it (guard 25% = 100 ms): no cut.
        (400.0, (2.0, 2.0, 2.0), 0.0, FeedbackMode.RECOVERY),
        # The same stretch against a 200 ms SLO (guard 50 ms) is an emergency, as without an SLO.
        (200.0, (2.0, 2.0, 2.0), 0.0, FeedbackMode.EMERGENCY),
        (None, (2.0, 2.0, 2.0), 0.0, FeedbackMode.EMERGENCY),
        # A cycle in progress is judged the same way.
        (1000.0, (), 3.5, FeedbackMode.STEADY),
        (200.0, (), 3.5, FeedbackMode.EMERGENCY),
    ],
    ids=["within-guard", "beyond-guard", "no-slo", "open-within-guard", "open-beyond-guard"],
)
def test_slo_guard_reads_affordable_stretch_as_recovery(
    slo_ms: float | None, cycles: tuple[float, ...], open_cycle: float, mode: FeedbackMode
) -> None:
    inst = infer(cycles=cycles, open_cycle=open_cycle)
    inst = VerticalInstance(**{**{f: getattr(inst, f) for f in inst.__slots__}, "slo_ms": slo_ms})
    decision = decide_shares(VerticalSnapshot(now=NOW, instances=(inst, train()), period_s=PERIOD),
                             state(0.5, recent=(1.0, 1.0)), CFG)
    assert decision.mode is mode, decision.reason
    if mode is FeedbackMode.RECOVERY:
        assert decision.share_of("train") >= 0.5 - 1e-9


def test_slo_guard_off_restores_ratio_only_feedback() -> None:
    inst = infer(cycles=(2.0, 2.0, 2.0))
    inst = VerticalInstance(**{**{f: getattr(inst, f) for f in inst.__slots__}, "slo_ms": 400.0})
    decision = decide_shares(VerticalSnapshot(now=NOW, instances=(inst, train()), period_s=PERIOD),
                             state(0.5, recent=(1.0, 1.0)), VerticalConfig(slo_guard=None))
    assert decision.mode is FeedbackMode.EMERGENCY


def test_slo_guard_is_validated() -> None:
    with pytest.raises(ValueError, match="slo_guard"):
        VerticalConfig(slo_guard=1.5)


# -- the drain (off by default): a queue building behind a long cycle --------------------------------

DRAIN = VerticalConfig(drain_slo_fraction=0.25, busy_ceiling=1.0)


def _with_slo(inst: VerticalInstance, slo_ms: float | None) -> VerticalInstance:
    return VerticalInstance(**{**{f: getattr(inst, f) for f in inst.__slots__}, "slo_ms": slo_ms})


@pytest.mark.parametrize(
    ("slo_ms", "open_cycle", "config", "mode", "train_share"),
    [
        # 1.5 × 40 ms = 60 ms in progress against a 200 ms SLO: 30% of it, past the 25% drain point.
        (200.0, 1.5, DRAIN, FeedbackMode.DRAIN, 0.05 * 0.2),
        # 20% of the SLO: no queue worth draining yet.
        (300.0, 1.5, DRAIN, FeedbackMode.STEADY, 0.9),
        # A cycle as long as the SLO is a continuously busy instance, not a queue: the ratios judge it.
        (100.0, 2.6, DRAIN, FeedbackMode.STEADY, 0.9),
        # No SLO, no drain; and off by default.
        (None, 1.5, DRAIN, FeedbackMode.STEADY, 0.9),
        (200.0, 1.5, CFG, FeedbackMode.STEADY, 0.9),
    ],
    ids=["past-drain-point", "before-drain-point", "longer-than-slo", "no-slo", "off"],
)
def test_drain_drops_best_effort_to_its_floor_while_a_queue_builds(
    slo_ms: float | None, open_cycle: float, config: VerticalConfig, mode: FeedbackMode, train_share: float
) -> None:
    inst = _with_slo(infer(open_cycle=open_cycle), slo_ms)
    d = decide_shares(VerticalSnapshot(now=NOW, instances=(inst, train()), period_s=PERIOD), state(0.9), config)
    assert d.mode is mode, d.reason
    assert d.share_of("train") == pytest.approx(train_share), d.reason
    assert d.share_of("inf") == pytest.approx(1.0)
    # The budget itself is kept for when the cycle completes.
    assert d.state.budget == pytest.approx(0.9)


def test_drain_ends_with_the_cycle_and_the_budget_comes_back() -> None:
    s = state(0.6)
    seq = []
    for open_cycle, cycles in [(1.5, ()), (2.0, ()), (0.0, (1.0,))]:
        inst = _with_slo(infer(open_cycle=open_cycle, cycles=cycles), 200.0)
        d = decide_shares(VerticalSnapshot(now=NOW, instances=(inst, train()), period_s=PERIOD), s, DRAIN)
        seq.append((d.mode, d.share_of("train")))
        s = d.state
    assert [m for m, _ in seq] == [FeedbackMode.DRAIN, FeedbackMode.DRAIN, FeedbackMode.RECOVERY]
    assert seq[0][1] == pytest.approx(0.01) and seq[1][1] == pytest.approx(0.01)
    assert seq[2][1] == pytest.approx(0.6 * 1.3)


# -- a burst cut is provisional ----------------------------------------------------------------------


def test_burst_cut_is_undone_when_the_cycles_stay_unhurt() -> None:
    s = state(0.9, ema=0.2)
    d = decide_shares(VerticalSnapshot(now=NOW, instances=(infer(demand=0.6), train()), period_s=PERIOD), s, CFG)
    assert d.mode is FeedbackMode.BURST and d.share_of("train") == pytest.approx(0.3)
    assert d.state.restore_to == pytest.approx(0.9)
    d = decide_shares(VerticalSnapshot(now=NOW + PERIOD, instances=(infer(demand=0.4, cycles=(1.0,)), train()),
                                       period_s=PERIOD), d.state, CFG)
    assert d.mode is FeedbackMode.RECOVERY
    assert d.share_of("train") == pytest.approx(0.9), d.reason
    assert "undone" in d.reason and d.state.restore_to is None
    # Regrowth instead (the third run's rule): ×1.3 from the cut.
    r3 = VerticalConfig.run3(recovery_every=1, busy_ceiling=1.0)
    d = decide_shares(VerticalSnapshot(now=NOW, instances=(infer(demand=0.6), train()), period_s=PERIOD), s, r3)
    d = decide_shares(VerticalSnapshot(now=NOW + PERIOD, instances=(infer(demand=0.4, cycles=(1.0,)), train()),
                                       period_s=PERIOD), d.state, r3)
    assert d.share_of("train") == pytest.approx(0.3 * 1.3)


def test_burst_cut_followed_by_stretch_is_not_undone() -> None:
    s = state(0.9, ema=0.2, recent=(1.7, 1.7, 1.7, 1.7))
    d = decide_shares(VerticalSnapshot(now=NOW, instances=(infer(demand=0.6), train()), period_s=PERIOD), s, CFG)
    assert d.mode is FeedbackMode.BURST
    d = decide_shares(VerticalSnapshot(now=NOW + PERIOD, instances=(infer(demand=0.6, cycles=(1.8,)), train()),
                                       period_s=PERIOD), d.state, CFG)
    assert d.mode is FeedbackMode.EMERGENCY
    assert d.state.restore_to is None
    assert d.share_of("train") < 0.3


# -- the reserve while latency-critical demand exists -------------------------------------------------


def test_busy_ceiling_keeps_a_reserve_beside_latency_critical_demand() -> None:
    assert VerticalConfig().busy_ceiling == pytest.approx(1.0)  # no reserve by default
    reserve = VerticalConfig(busy_ceiling=0.8)
    grown = _steps(reserve, STEADY, VerticalState())
    assert max(s for _, s in grown) == pytest.approx(0.8)  # grows to the ceiling, never past it
    assert grown[-1][1] == pytest.approx(0.8)
    assert max(s for _, s in _steps(VerticalConfig(), STEADY, VerticalState())) > 0.8  # the default grows on
    # Without latency-critical demand the whole GPU is training's again.
    d = decide_shares(VerticalSnapshot(now=NOW, instances=(infer(idle_for=2.0), train()), period_s=PERIOD),
                      VerticalState(), reserve)
    assert d.mode is FeedbackMode.IDLE and d.share_of("train") == pytest.approx(1.0)
    # The ceiling never cuts below what latency-critical demand leaves.
    d = decide_shares(VerticalSnapshot(now=NOW, instances=(infer(demand=0.05), train()), period_s=PERIOD),
                      VerticalState(), VerticalConfig(busy_ceiling=0.3))
    assert d.share_of("train") == pytest.approx(1 - 0.5)  # room = 1 − inference's request 0.5
    with pytest.raises(ValueError):
        VerticalConfig(busy_ceiling=0.0)


# -- request spans (shim ABI 1.1) ------------------------------------------------------------------------

SPAN = 0.005  # a 5 ms request


def spanned(spans: tuple[float, ...], *, open_span: float = 0.0, cycles: tuple[float, ...] = (),
            slo_ms: float | None = None) -> VerticalInstance:
    """An inference instance whose shim reports request spans (multiples of SPAN) beside window cycles."""
    base = infer(cycles=cycles)
    return VerticalInstance(
        id=base.id, cls=base.cls, request=base.request, limit=base.limit, blocks=base.blocks, slo_ms=slo_ms,
        last_active_at=base.last_active_at, cycles_s=base.cycles_s, capacity_blocks_per_ms=base.capacity_blocks_per_ms,
        spans_s=tuple(x * SPAN for x in spans), open_span_s=open_span * SPAN,
    )


def _decide(inst: VerticalInstance, st: VerticalState, cfg: VerticalConfig = CFG):
    return decide_shares(VerticalSnapshot(now=NOW, instances=(inst, train()), period_s=PERIOD), st, cfg)


def test_request_spans_replace_window_cycles_once_reported() -> None:
    # A window-cycle track (40 ms minimum) meets its first spans: the baseline starts over in spans, so
    # 5 ms requests are not read as anything against 40 ms windows.
    d = _decide(spanned((1.0, 1.0, 1.0, 1.0, 1.0)), state(0.5))
    track = d.state.track("inf")
    assert track is not None and track.spans and track.min_cycle_s == pytest.approx(SPAN)
    assert d.mode is FeedbackMode.RECOVERY and d.budget == pytest.approx(0.5 * 1.3)
    # Stretched spans cut training at once, whatever the window cycles say (here: unhurt).
    d2 = _decide(spanned((1.8, 1.8, 1.8, 1.8, 1.8), cycles=(1.0, 1.0)), d.state)
    assert d2.mode is FeedbackMode.EMERGENCY and d2.budget == pytest.approx(0.5 * 1.3 / 1.8, rel=1e-6)
    assert "request spans" in d2.reason
    # A span in progress 3.5× the minimum is an emergency before it completes.
    d3 = _decide(spanned((), open_span=3.5), d.state)
    assert d3.mode is FeedbackMode.EMERGENCY and "request span in progress" in d3.reason
    # Once judged by spans, a period without spans stays span-judged (no flip back to windows).
    d4 = _decide(spanned((), cycles=(3.0,)), d.state)
    assert d4.state.track("inf").spans and d4.mode is FeedbackMode.STEADY


def test_span_feedback_off_judges_window_cycles_only() -> None:
    cfg = VerticalConfig(busy_ceiling=1.0, span_feedback=False)
    d = _decide(spanned((3.0, 3.0, 3.0, 3.0, 3.0), cycles=(1.0,)), state(0.5), cfg)
    assert not d.state.track("inf").spans
    assert d.mode is FeedbackMode.RECOVERY  # the 40 ms window cycle is unhurt; the spans are not read
    assert VerticalConfig.run3().span_feedback is False
    with pytest.raises(ValueError, match="min_span_s"):
        VerticalConfig(min_span_s=0.0)
    with pytest.raises(ValueError, match="span lengths"):
        spanned((-1.0,))


@pytest.mark.parametrize(("spans", "mode"), [
    # SLO 50 ms: spans are judged against max(best span 5 ms, 0.3 × 50 = 15 ms).
    ((3.0, 3.0, 3.0, 3.0, 3.0), FeedbackMode.RECOVERY),  # 15 ms: 3× the best, but 1.0× the SLO floor
    ((4.0, 4.0, 4.0, 4.0, 4.0), FeedbackMode.CONTENTION),  # 20 ms = 1.33× the floor: hold
    ((5.0, 5.0, 5.0, 5.0, 5.0), FeedbackMode.EMERGENCY),  # 25 ms = 1.67× the floor: cut
])
def test_spans_are_judged_against_a_fraction_of_the_slo(spans: tuple[float, ...], mode: FeedbackMode) -> None:
    first = _decide(spanned((1.0, 1.0, 1.0), slo_ms=50.0), state(0.5))  # the baseline: 5 ms
    d = _decide(spanned(spans, slo_ms=50.0), first.state)
    assert d.mode is mode, d.reason
    if mode is FeedbackMode.EMERGENCY:
        assert d.budget == pytest.approx(first.budget / (5.0 / 3.0), rel=1e-6)
        assert "0.3 of its SLO" in d.reason
    # Against the best span alone (no SLO floor, or no SLO) 15 ms spans are 3× the best one: an emergency.
    three = (3.0,) * 5
    best = VerticalConfig(busy_ceiling=1.0, span_quiet_baseline=False)
    none = VerticalConfig(busy_ceiling=1.0, span_slo_base=None, span_quiet_baseline=False)
    first_n = _decide(spanned((1.0,), slo_ms=50.0), state(0.5), none)
    assert _decide(spanned(three, slo_ms=50.0), first_n.state, none).mode is FeedbackMode.EMERGENCY
    first_s = _decide(spanned((1.0,)), state(0.5), best)
    assert _decide(spanned(three), first_s.state, best).mode is FeedbackMode.EMERGENCY
    with pytest.raises(ValueError, match="span_slo_base"):
        VerticalConfig(span_slo_base=1.5)


def test_span_baseline_is_the_shortest_period_median_not_one_rare_span() -> None:
    cfg = VerticalConfig(busy_ceiling=1.0, span_slo_base=None)
    d = _decide(spanned((0.5, 2.0, 2.0, 2.0, 2.0)), state(0.5), cfg)  # one rare 2.5 ms span among 10 ms ones
    assert d.state.track("inf").quiet_s == pytest.approx(2.0 * SPAN) and d.mode is FeedbackMode.RECOVERY
    d = _decide(spanned((1.0, 1.0, 1.0)), d.state, cfg)  # a faster period lowers the baseline
    assert d.state.track("inf").quiet_s == pytest.approx(SPAN)
    d = _decide(spanned((1.8, 1.8, 1.8, 1.8, 1.8)), d.state, cfg)
    assert d.mode is FeedbackMode.EMERGENCY and "its quiet baseline" in d.reason


def test_a_quiet_period_resets_the_span_baseline_so_futile_cuts_stop() -> None:
    cfg = VerticalConfig(busy_ceiling=1.0, span_slo_base=None)
    floor = cfg.emergency_floor * 0.2  # training's request 0.2
    track = CycleTrack("inf", SPAN, (SPAN,), recent_ratios=(1.8,) * 4, demand_ema=0.4, spans=True, quiet_s=SPAN)
    st = VerticalState(budget=floor, mode=FeedbackMode.EMERGENCY, tracks=(track,), floor_periods=1)
    slow = spanned((1.8, 1.8, 1.8, 1.8, 1.8))  # slower than the baseline although training is at its floor
    d = _decide(slow, st, cfg)
    assert d.mode is FeedbackMode.EMERGENCY and d.budget == pytest.approx(floor)  # one period: not yet quiet
    assert d.state.floor_periods == 2
    d = _decide(slow, d.state, cfg)  # the second period at the floor is quiet: 9 ms is its speed now
    assert d.state.track("inf").quiet_s == pytest.approx(1.8 * SPAN)
    # The quiet spans measure the baseline and are not judged; still 1.8× the old one, so the cuts did not
    # help: the budget starts over from the room inference leaves (1 − 0.4 × 1.25) ...
    assert d.mode is FeedbackMode.STEADY and "quiet period" in d.reason and "did not help" in d.reason
    assert d.budget == pytest.approx(1 - 0.4 * 1.25)
    assert d.state.floor_periods == 0
    # ... and the next period judges the same spans against the new baseline: unhurt, so it grows.
    d = _decide(slow, d.state, cfg)
    assert d.mode is FeedbackMode.RECOVERY and d.budget == pytest.approx((1 - 0.4 * 1.25) * cfg.recovery_growth)
    # Off: the same periods keep cutting.
    off = VerticalConfig(busy_ceiling=1.0, span_slo_base=None, span_quiet_baseline=False)
    d = _decide(slow, VerticalState(budget=floor, mode=FeedbackMode.EMERGENCY, tracks=(track,), floor_periods=5), off)
    assert d.mode is FeedbackMode.EMERGENCY
    with pytest.raises(ValueError, match="quiet_periods"):
        VerticalConfig(quiet_periods=0)


def test_a_probe_holds_best_effort_at_its_floor_then_gives_the_budget_back() -> None:
    cfg = VerticalConfig(quiet_probe_every_s=1.0, span_slo_base=None)
    st, t, modes, shares = VerticalState(), NOW, [], []
    for _ in range(30):  # 1.5 s of steady, unhurt spans beside training
        inst = spanned((1.0, 1.05, 1.0, 1.1, 1.0))
        d = decide_shares(VerticalSnapshot(now=t, instances=(inst, train()), period_s=PERIOD), st, cfg)
        modes.append(d.mode)
        shares.append(d.share_of("train"))
        st, t = d.state, t + PERIOD
    first = modes.index(FeedbackMode.PROBE)
    assert 19 <= first <= 21  # one second after the demands met
    assert modes[first:first + cfg.quiet_periods] == [FeedbackMode.PROBE] * cfg.quiet_periods
    floor = cfg.emergency_floor * 0.2
    assert all(x == pytest.approx(floor) for x in shares[first:first + cfg.quiet_periods])
    assert shares[first + cfg.quiet_periods] == pytest.approx(1.0)  # the budget was carried through
    assert FeedbackMode.PROBE not in modes[first + cfg.quiet_periods:]  # the next one a second later
    assert FeedbackMode.PROBE not in _steps(CFG, STEADY, VerticalState())  # window cycles: nothing to probe
    with pytest.raises(ValueError, match="quiet_probe_every_s"):
        VerticalConfig(quiet_probe_every_s=0.0)


def _held_run(cfg: VerticalConfig, spans: tuple[float, ...], periods: int, budget: float = 0.2):
    """A cut held in contention from NOW on: (mode, training share) per period."""
    track = CycleTrack("inf", SPAN, (SPAN,), recent_ratios=(1.3,) * 4, demand_ema=0.4, spans=True, quiet_s=SPAN)
    st = VerticalState(budget=budget, mode=FeedbackMode.CONTENTION, tracks=(track,), quiet_at=NOW)
    out, t = [], NOW
    for _ in range(periods):
        d = decide_shares(VerticalSnapshot(now=t, instances=(spanned(spans), train()), period_s=PERIOD), st, cfg)
        out.append((d.mode, d.share_of("train"), d))
        st, t = d.state, t + PERIOD
    return out


def test_a_held_cut_is_probed_and_given_up_when_it_buys_nothing() -> None:
    cfg = VerticalConfig(busy_ceiling=1.0, span_slo_base=None)
    floor = cfg.emergency_floor * 0.2
    # Spans 1.3× the baseline whatever training runs at: contention holds the cut at 0.2 ...
    run = _held_run(cfg, (1.3, 1.3, 1.3, 1.3, 1.3), periods=30)
    modes = [m for m, _, _ in run]
    first = modes.index(FeedbackMode.PROBE)
    assert first in (10, 11)  # ... until quiet_probe_held_s (0.5 s) without a quiet period (float steps)
    assert all(m is FeedbackMode.CONTENTION for m in modes[:first])
    assert all(share == pytest.approx(0.2) for _, share, _ in run[:first])
    assert [share for _, share, _ in run[first:first + 2]] == pytest.approx([floor, floor])
    assert "a cut held" in run[first][2].reason
    # The quiet period measured 1.3×: that is the speed now, so the cut is given up (the budget starts over
    # from the room, 1 − 0.4 × 1.25) and training regrows.
    after = run[first + 2]
    assert after[0] is FeedbackMode.STEADY and "did not help" in after[2].reason
    assert after[2].state.track("inf").quiet_s == pytest.approx(1.3 * SPAN)
    assert after[1] == pytest.approx(0.5)
    assert run[first + 3][0] is FeedbackMode.RECOVERY
    assert run[-1][1] == pytest.approx(1.0) and run[-1][2].state.held_probes == 0  # back at the ceiling
    # Off: the same spans hold training at 0.2 throughout.
    off = _held_run(VerticalConfig(busy_ceiling=1.0, span_slo_base=None, quiet_probe_held_s=None),
                    (1.3,) * 5, periods=30)
    assert {m for m, _, _ in off} == {FeedbackMode.CONTENTION} and off[-1][1] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="quiet_probe_held_s"):
        VerticalConfig(quiet_probe_held_s=-1.0)


def test_a_cut_that_protects_is_probed_less_and_less_often() -> None:
    # Spans 1.3× beside training at 0.2, 1.0× with training at its floor: the probes confirm the cut.
    cfg = VerticalConfig(busy_ceiling=1.0, span_slo_base=None)
    track = CycleTrack("inf", SPAN, (SPAN,), recent_ratios=(1.3,) * 4, demand_ema=0.4, spans=True, quiet_s=SPAN)
    st, t, probes, held = VerticalState(budget=0.2, mode=FeedbackMode.CONTENTION, tracks=(track,), quiet_at=NOW), NOW, [], []
    share = 0.2
    for i in range(200):  # 10 s
        x = 1.0 if share < 0.05 else 1.3
        d = decide_shares(VerticalSnapshot(now=t, instances=(spanned((x,) * 5), train()), period_s=PERIOD), st, cfg)
        if d.mode is FeedbackMode.PROBE and st.mode is not FeedbackMode.PROBE:
            probes.append(i)
        held.append(d.budget)
        share, st, t = d.share_of("train"), d.state, t + PERIOD
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 3 and all(b > a for a, b in itertools.pairwise(gaps))  # backing off
    assert gaps[0] >= 10 and max(gaps) <= 0.5 * 16 / PERIOD + 2 + 1
    assert max(held) <= 0.2 + 1e-9  # the cut stayed: training never regrew into the interference


@pytest.mark.parametrize(("per_period", "ratio", "modes"), [
    # 1.3× spans: 8 a period fill 8 × 6.5 ms = 104% of a 50 ms period: after three such periods, an emergency;
    # then fresh evidence is needed before the next cut.
    (8, 1.3, [FeedbackMode.CONTENTION, FeedbackMode.CONTENTION, FeedbackMode.EMERGENCY, FeedbackMode.CONTENTION]),
    (4, 1.3, [FeedbackMode.CONTENTION] * 4),  # 52% of the time: room to absorb the stretch, hold
    (7, 1.3, [FeedbackMode.CONTENTION] * 4),  # 91%: busy, but not yet ≥ 95%
    (9, 1.0, [FeedbackMode.RECOVERY] * 4),  # saturated but unstretched: cutting cannot help
])
def test_contention_while_saturated_is_an_emergency(per_period: int, ratio: float, modes: list[FeedbackMode]) -> None:
    cfg = VerticalConfig(busy_ceiling=1.0, span_slo_base=None)
    track = CycleTrack("inf", SPAN, (SPAN,), recent_ratios=(ratio,) * 4, demand_ema=0.4, spans=True, quiet_s=SPAN)
    st, got = VerticalState(budget=0.6, mode=FeedbackMode.CONTENTION, tracks=(track,), quiet_at=NOW), []
    for _ in modes:
        d = _decide(spanned((ratio,) * per_period), st, cfg)
        got.append(d.mode)
        st = d.state
        if d.mode is FeedbackMode.EMERGENCY:
            assert "saturated" in d.reason and d.budget == pytest.approx(0.6 / ratio)
    assert got == modes
    off = VerticalConfig(busy_ceiling=1.0, span_slo_base=None, saturation_busy=None)
    st = VerticalState(budget=0.6, mode=FeedbackMode.CONTENTION, tracks=(track,), quiet_at=NOW)
    for _ in range(4):
        d = _decide(spanned((1.3,) * 8), st, off)
        assert d.mode is FeedbackMode.CONTENTION
        st = d.state
    with pytest.raises(ValueError, match="saturation_busy"):
        VerticalConfig(saturation_busy=0.0)
