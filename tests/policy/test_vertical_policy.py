"""Table-driven tests of the vertical SM-share policy (no clock, no event loop)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu_invoker.policy import (
    EPS,
    CycleTrack,
    FeedbackMode,
    InstanceClass,
    VerticalConfig,
    VerticalDecision,
    VerticalInstance,
    VerticalSnapshot,
    VerticalState,
    decide_shares,
)

NOW = 100.0
# The first tables pin the first H200 run's policy (still reachable as `VerticalConfig.run1()`, the
# benchmark's `run1-default` variant); the defaults since then are tested in test_vertical_feedback.py.
CFG = VerticalConfig.run1()
INF, LLM, TRAIN = InstanceClass.INFERENCE, InstanceClass.LLM, InstanceClass.TRAINING


def inst(
    id: str,
    cls: InstanceClass,
    request: float,
    limit: float,
    *,
    idle_for: float | None = 0.0,
    cycles: tuple[float, ...] = (),
    open_cycle: float = 0.0,
    throttled: float = 0.0,
    share: float | None = None,
) -> VerticalInstance:
    """`idle_for` 0: launching now; > 0: last launch that long ago; None: never launched."""
    return VerticalInstance(
        id=id,
        cls=cls,
        request=request,
        limit=limit,
        blocks=100 if idle_for == 0.0 else 0,
        last_active_at=None if idle_for is None else NOW - idle_for,
        cycles_s=cycles,
        open_cycle_s=open_cycle,
        throttled_s=throttled,
        share=share,
    )


def lc(
    id: str = "inf", request: float = 0.3, limit: float = 0.6, **kw: object
) -> VerticalInstance:
    return inst(id, INF, request, limit, **kw)  # type: ignore[arg-type]


def llm(
    id: str = "llm", request: float = 0.3, limit: float = 0.6, **kw: object
) -> VerticalInstance:
    return inst(id, LLM, request, limit, **kw)  # type: ignore[arg-type]


def be(
    id: str = "train", request: float = 0.4, limit: float = 0.8, **kw: object
) -> VerticalInstance:
    return inst(id, TRAIN, request, limit, **kw)  # type: ignore[arg-type]


def tracked(
    *ids: str,
    budget: float | None,
    mode: FeedbackMode,
    min_cycle: float = 0.010,
    recovery_cycles: int = 0,
) -> VerticalState:
    """A state in which each latency-critical instance has a known minimum cycle."""
    return VerticalState(
        budget=budget,
        recovery_cycles=recovery_cycles,
        mode=mode,
        tracks=tuple(
            CycleTrack(id=i, min_cycle_s=min_cycle, history=(min_cycle,)) for i in ids
        ),
    )


def run(
    *instances: VerticalInstance,
    state: VerticalState | None = None,
    config: VerticalConfig = CFG,
) -> VerticalDecision:
    return decide_shares(
        VerticalSnapshot(now=NOW, instances=instances, gpu="gpu0"),
        state or VerticalState(),
        config,
    )


@dataclass(frozen=True)
class Case:
    instances: tuple[VerticalInstance, ...]
    shares: dict[str, float]
    mode: FeedbackMode
    state: VerticalState = field(default_factory=VerticalState)
    config: VerticalConfig = CFG
    budget: float | None = None
    reason_has: str = ""


STEADY_LC_BE = tracked("inf", budget=0.4, mode=FeedbackMode.RECOVERY)

CASES = {
    "empty-gpu": Case((), {}, FeedbackMode.IDLE, reason_has="nothing active"),
    "single-inference-gets-its-limit": Case((lc(),), {"inf": 0.6}, FeedbackMode.STEADY),
    "single-training-alone-rises-to-limit": Case(
        (be(),), {"train": 0.8}, FeedbackMode.IDLE
    ),
    "idle-training-keeps-request-as-standing-cap": Case(
        (be(idle_for=5.0),),
        {"train": 0.4},
        FeedbackMode.IDLE,
        reason_has="nothing active",
    ),
    "two-trainings-split-gpu-by-request": Case(
        (be("t1", 0.2, 1.0), be("t2", 0.6, 1.0)),
        {"t1": 0.25, "t2": 0.75},
        FeedbackMode.IDLE,
    ),
    "idle-inference-lets-training-rise-to-limit": Case(
        (lc(idle_for=2.0), be()), {"inf": 0.6, "train": 0.8}, FeedbackMode.IDLE
    ),
    "inference-idle-under-threshold-still-counts-as-active": Case(
        (lc(idle_for=0.5), be()),
        {"inf": 0.6, "train": 0.4},
        FeedbackMode.STEADY,
        budget=0.4,
    ),
    "never-launched-inference-is-idle": Case(
        (lc(idle_for=None), be()), {"inf": 0.6, "train": 0.8}, FeedbackMode.IDLE
    ),
    "burst-after-idle-cuts-training-to-fair-budget-at-once": Case(
        (lc(share=0.6), be(share=0.8)),
        {"inf": 0.6, "train": 0.4},
        FeedbackMode.STEADY,
        budget=0.4,
        reason_has="began",
    ),
    "inference-cut-toward-request-to-keep-training-request": Case(
        (lc(limit=0.8), be()),
        {"inf": 0.6, "train": 0.4},
        FeedbackMode.STEADY,
        budget=0.4,
    ),
    "training-takes-what-is-left-above-its-request": Case(
        (lc(limit=0.4), be()),
        {"inf": 0.4, "train": 0.6},
        FeedbackMode.STEADY,
        budget=0.6,
    ),
    "two-inferences-contend-cut-toward-requests": Case(
        (lc("a", 0.3, 0.7), lc("b", 0.3, 0.7)),
        {"a": 0.5, "b": 0.5},
        FeedbackMode.STEADY,
    ),
    "contending-inferences-by-headroom": Case(
        (lc("a", 0.2, 0.8), lc("b", 0.4, 0.6)),
        {"a": 0.2 + 0.4 * 0.6 / 0.8, "b": 0.4 + 0.4 * 0.2 / 0.8},
        FeedbackMode.STEADY,
    ),
    "two-inferences-and-training-keep-requests": Case(
        (lc("a", 0.3, 0.7), lc("b", 0.3, 0.7), be()),
        {"a": 0.3, "b": 0.3, "train": 0.4},
        FeedbackMode.STEADY,
        budget=0.4,
    ),
    "emergency-cuts-training-by-the-ratio": Case(
        (lc(cycles=(0.018,)), be()),
        {"inf": 0.6, "train": 0.4 / 1.8},
        FeedbackMode.EMERGENCY,
        state=STEADY_LC_BE,
        budget=0.4 / 1.8,
        reason_has="1.80× its minimum",
    ),
    "emergency-removes-oversubscription-first": Case(
        (lc(cycles=(0.02,)), be()),
        {"inf": 0.6, "train": 0.2},
        FeedbackMode.EMERGENCY,
        state=tracked("inf", budget=0.8, mode=FeedbackMode.RECOVERY),
        budget=0.2,
    ),
    "emergency-never-below-floor": Case(
        (lc(cycles=(0.035,)), be()),
        {"inf": 0.6, "train": 0.05 * 0.4},
        FeedbackMode.EMERGENCY,
        state=tracked("inf", budget=0.03, mode=FeedbackMode.EMERGENCY),
        budget=0.02,
    ),
    "emergency-frees-room-for-contending-inferences": Case(
        (lc("a", 0.3, 0.7, cycles=(0.02,)), lc("b", 0.3, 0.7), be()),
        # The inferences grow into what the last cut freed (0.1 left to training), and training is
        # cut again for this period's emergency.
        {"a": 0.45, "b": 0.45, "train": 0.05},
        FeedbackMode.EMERGENCY,
        state=tracked("a", "b", budget=0.1, mode=FeedbackMode.EMERGENCY),
        budget=0.05,
    ),
    "llm-emergency-at-1.3x": Case(
        (llm(cycles=(0.014,)), be()),
        {"llm": 0.6, "train": 0.4 / 1.4},
        FeedbackMode.EMERGENCY,
        state=tracked("llm", budget=0.4, mode=FeedbackMode.RECOVERY),
        budget=0.4 / 1.4,
    ),
    "same-ratio-is-only-contention-for-inference": Case(
        (lc(cycles=(0.014,)), be()),
        {"inf": 0.6, "train": 0.3},
        FeedbackMode.CONTENTION,
        state=tracked("inf", budget=0.3, mode=FeedbackMode.EMERGENCY),
        budget=0.3,
    ),
    "contention-clamps-oversubscription-to-fair": Case(
        (lc(cycles=(0.014,)), be()),
        {"inf": 0.6, "train": 0.4},
        FeedbackMode.CONTENTION,
        state=tracked("inf", budget=0.7, mode=FeedbackMode.RECOVERY),
        budget=0.4,
    ),
    "recovery-counts-cycles-before-growing": Case(
        (lc(cycles=(0.011,)), be()),
        {"inf": 0.6, "train": 0.2},
        FeedbackMode.RECOVERY,
        state=tracked("inf", budget=0.2, mode=FeedbackMode.EMERGENCY),
        budget=0.2,
        reason_has="1/5",
    ),
    "recovery-grows-budget-x1.3": Case(
        (lc(cycles=(0.011,)), be()),
        {"inf": 0.6, "train": 0.26},
        FeedbackMode.RECOVERY,
        state=tracked("inf", budget=0.2, mode=FeedbackMode.RECOVERY, recovery_cycles=4),
        budget=0.26,
    ),
    "recovery-may-oversubscribe-up-to-training-limit": Case(
        (lc(cycles=(0.010,) * 5), be()),
        {"inf": 0.6, "train": 0.8},
        FeedbackMode.RECOVERY,
        state=tracked("inf", budget=0.7, mode=FeedbackMode.RECOVERY),
        budget=0.8,
    ),
    "recovery-without-oversubscription-stops-at-fair": Case(
        (lc(cycles=(0.010,) * 5), be()),
        {"inf": 0.6, "train": 0.4},
        FeedbackMode.RECOVERY,
        state=tracked("inf", budget=0.35, mode=FeedbackMode.RECOVERY),
        config=VerticalConfig.run1(oversubscribe_in_recovery=False),
        budget=0.4,
    ),
    "outlier-cycle-is-ignored": Case(
        (lc(cycles=(0.05,)), be()),
        {"inf": 0.6, "train": 0.3},
        FeedbackMode.STEADY,
        state=tracked("inf", budget=0.3, mode=FeedbackMode.RECOVERY),
        budget=0.3,
    ),
    "idle-inference-late-cycle-says-nothing": Case(
        (lc(idle_for=1.0, cycles=(0.03,)), be()),
        {"inf": 0.6, "train": 0.8},
        FeedbackMode.IDLE,
        state=tracked("inf", budget=0.4, mode=FeedbackMode.RECOVERY),
    ),
    "long-cycle-in-progress-is-an-emergency-now": Case(
        (lc(open_cycle=0.02), be()),
        {"inf": 0.6, "train": 0.2},
        FeedbackMode.EMERGENCY,
        state=STEADY_LC_BE,
        budget=0.2,
        reason_has="in progress",
    ),
    "no-cycle-yet-holds": Case(
        (lc(), be()),
        {"inf": 0.6, "train": 0.3},
        FeedbackMode.STEADY,
        state=tracked("inf", budget=0.3, mode=FeedbackMode.EMERGENCY),
        budget=0.3,
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_shares(case: Case) -> None:
    d = decide_shares(
        VerticalSnapshot(now=NOW, instances=case.instances, gpu="gpu0"),
        case.state,
        case.config,
    )
    assert {s.id: s.share for s in d.shares} == pytest.approx(case.shares, abs=1e-9)
    assert d.mode is case.mode
    assert (
        d.budget == pytest.approx(case.budget)
        if case.budget is not None
        else d.budget is None
    )
    assert d.state.mode is case.mode and d.state.budget == d.budget
    assert case.reason_has in d.reason
    assert all(s.reason for s in d.shares)
    assert [s.id for s in d.shares] == [i.id for i in case.instances]


# -- carried state -------------------------------------------------------------------------------


def test_minimum_cycle_is_learned_and_ratios_follow_it() -> None:
    d1 = run(lc(cycles=(0.012, 0.010, 0.011)), be())
    track = d1.state.track("inf")
    assert track is not None and track.min_cycle_s == pytest.approx(0.010)
    assert d1.mode is FeedbackMode.RECOVERY
    d2 = decide_shares(
        VerticalSnapshot(now=NOW + 0.05, instances=(lc(cycles=(0.02,)), be())),
        d1.state,
        CFG,
    )
    assert d2.mode is FeedbackMode.EMERGENCY
    assert d2.share_of("train") < d1.share_of("train")


def test_too_short_cycles_never_become_the_minimum() -> None:
    d = run(lc(cycles=(0.0005, 0.010)))
    track = d.state.track("inf")
    assert track is not None and track.min_cycle_s == pytest.approx(0.010)


def test_llm_baseline_is_the_recent_minimum() -> None:
    config = VerticalConfig.run1(llm_history=3)
    state = VerticalState(
        mode=FeedbackMode.STEADY,
        budget=0.4,
        tracks=(CycleTrack("llm", 0.005, (0.010, 0.010, 0.010)),),
    )
    d = run(llm(cycles=(0.0115,)), be(), state=state, config=config)
    # 0.0115 / 0.010 = 1.15: recovery against the recent minimum, although 2.3× the all-time one.
    assert d.mode is FeedbackMode.RECOVERY
    same_for_inference = run(
        lc("llm", cycles=(0.0115,)), be(), state=state, config=config
    )
    assert same_for_inference.mode is FeedbackMode.EMERGENCY


def test_open_cycle_cuts_once_then_its_completion_is_not_counted_again() -> None:
    d1 = run(lc(open_cycle=0.02), be(), state=STEADY_LC_BE)
    assert d1.mode is FeedbackMode.EMERGENCY and d1.budget == pytest.approx(0.2)
    later = VerticalSnapshot(now=NOW + 0.05, instances=(lc(open_cycle=0.03), be()))
    d2 = decide_shares(later, d1.state, CFG)
    assert d2.mode is FeedbackMode.STEADY and d2.budget == pytest.approx(0.2)
    done = VerticalSnapshot(now=NOW + 0.1, instances=(lc(cycles=(0.032,)), be()))
    d3 = decide_shares(done, d2.state, CFG)
    assert d3.mode is FeedbackMode.CONTENTION and d3.budget == pytest.approx(0.2)
    again = VerticalSnapshot(now=NOW + 0.15, instances=(lc(open_cycle=0.02), be()))
    assert decide_shares(again, d3.state, CFG).mode is FeedbackMode.EMERGENCY


def test_tracks_of_departed_instances_are_dropped() -> None:
    state = tracked("inf", "gone", budget=0.4, mode=FeedbackMode.STEADY)
    d = run(lc(), be(), state=state)
    assert [t.id for t in d.state.tracks] == ["inf"]


def test_training_alone_again_forgets_the_budget() -> None:
    d = run(
        lc(idle_for=3.0),
        be(),
        state=tracked("inf", budget=0.1, mode=FeedbackMode.EMERGENCY),
    )
    assert d.mode is FeedbackMode.IDLE and d.budget is None
    d2 = decide_shares(
        VerticalSnapshot(now=NOW + 0.05, instances=(lc(), be())), d.state, CFG
    )
    assert d2.share_of("train") == pytest.approx(
        0.4
    )  # fair start, not the old emergency cut


def test_burst_emergency_recovery_sequence() -> None:
    """Inference bursts, its cycles stretch, training is cut, then recovers step by step."""
    state = VerticalState()
    shares = []
    t = NOW
    sequence = [(), (0.010,), (0.010,), (0.025,), (0.017,)] + [(0.010,) * 5] * 10
    for cycles in sequence:
        d = decide_shares(
            VerticalSnapshot(now=t, instances=(lc(cycles=cycles), be())), state, CFG
        )
        state, t = d.state, t + 0.05
        shares.append((d.mode, d.share_of("train")))
    modes = [m for m, _ in shares]
    assert modes[:5] == [
        FeedbackMode.STEADY,
        FeedbackMode.RECOVERY,
        FeedbackMode.RECOVERY,
        FeedbackMode.EMERGENCY,
        FeedbackMode.EMERGENCY,
    ]
    assert shares[3][1] == pytest.approx(0.4 / 2.5)
    assert shares[4][1] == pytest.approx(0.4 / 2.5 / 1.7)
    growth = [s for _, s in shares[5:]]
    assert all(b > a for a, b in itertools.pairwise(growth) if b < 0.8 - EPS)
    assert growth[-1] == pytest.approx(
        0.8
    )  # back up to its limit, oversubscribing by design


@pytest.mark.parametrize(
    ("throttled", "limit", "saturated"),
    [(0.01, 0.6, True), (0.001, 0.6, False), (0.01, 0.9, False)],
    ids=["throttled-at-limit", "barely-throttled", "below-limit"],
)
def test_saturation(throttled: float, limit: float, saturated: bool) -> None:
    d = run(lc(limit=limit, throttled=throttled), be("t", 0.4, 0.4))
    assert d.shares[0].saturated is saturated
    assert ("saturated" in d.shares[0].reason) is saturated


def test_changed_flag_compares_with_enforced_share() -> None:
    d = run(lc(share=0.6), be(share=0.8))
    assert [s.changed for s in d.shares] == [False, True]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"emergency_ratio": 1.1},
        {"llm_emergency_ratio": 1.7},
        {"outlier_ratio": 1.5},
        {"recovery_growth": 1.0},
        {"recovery_every": 0},
        {"emergency_floor": 1.5},
        {"idle_after_s": 0.0},
    ],
    ids=lambda k: next(iter(k)),
)
def test_config_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        VerticalConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        lambda: VerticalInstance(id="x", cls=INF, request=0.7, limit=0.5),
        lambda: VerticalInstance(id="x", cls=INF, request=0.1, limit=1.5),
        lambda: VerticalInstance(id="", cls=INF, request=0.1, limit=0.5),
        lambda: VerticalInstance(
            id="x", cls=INF, request=0.1, limit=0.5, cycles_s=(-1.0,)
        ),
        lambda: VerticalSnapshot(now=0.0, instances=(lc("a"), lc("a"))),
    ],
    ids=[
        "request-above-limit",
        "limit-above-one",
        "empty-id",
        "negative-cycle",
        "duplicate-ids",
    ],
)
def test_bad_input_is_a_clear_error(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


# -- invariants ----------------------------------------------------------------------------------

shares_st = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def instances_st(draw: st.DrawFn) -> VerticalInstance:
    request = draw(st.floats(min_value=0.0, max_value=0.5))
    limit = draw(st.floats(min_value=request, max_value=1.0))
    return VerticalInstance(
        id=draw(st.text(alphabet="abcdef", min_size=1, max_size=4)),
        cls=draw(st.sampled_from(list(InstanceClass))),
        request=request,
        limit=limit,
        blocks=draw(st.integers(min_value=0, max_value=3)),
        last_active_at=draw(st.none() | st.floats(min_value=NOW - 5, max_value=NOW)),
        throttled_s=draw(st.floats(min_value=0.0, max_value=0.05)),
        cycles_s=tuple(
            draw(st.lists(st.floats(min_value=0.0, max_value=0.1), max_size=4))
        ),
        open_cycle_s=draw(st.floats(min_value=0.0, max_value=0.1)),
        capacity_blocks_per_ms=draw(st.none() | st.floats(min_value=0.01, max_value=100.0)),
    )


@st.composite
def states_st(draw: st.DrawFn) -> VerticalState:
    return VerticalState(
        budget=draw(st.none() | shares_st),
        recovery_cycles=draw(st.integers(min_value=0, max_value=10)),
        mode=draw(st.sampled_from(list(FeedbackMode))),
        tracks=tuple(
            CycleTrack(
                id=i,
                min_cycle_s=draw(
                    st.none() | st.floats(min_value=0.001, max_value=0.05)
                ),
                recent_ratios=tuple(
                    draw(st.lists(st.floats(min_value=0.5, max_value=3.9), max_size=5))
                ),
                demand_ema=draw(st.none() | st.floats(min_value=0.0, max_value=2.0)),
            )
            for i in draw(
                st.lists(
                    st.text(alphabet="abcdef", min_size=1, max_size=4),
                    max_size=4,
                    unique=True,
                )
            )
        ),
    )


@settings(max_examples=300, deadline=None)
@given(
    instances=st.lists(instances_st(), max_size=6, unique_by=lambda i: i.id),
    state=states_st(),
    oversubscribe=st.booleans(),
    run1=st.booleans(),
)
def test_invariants(
    instances: list[VerticalInstance],
    state: VerticalState,
    oversubscribe: bool,
    run1: bool,
) -> None:
    config = (VerticalConfig.run1 if run1 else VerticalConfig)(
        oversubscribe_in_recovery=oversubscribe
    )
    d = decide_shares(
        VerticalSnapshot(now=NOW, instances=tuple(instances)), state, config
    )
    assert [s.id for s in d.shares] == [i.id for i in instances]
    for s, i in zip(d.shares, instances, strict=True):
        assert 0.0 <= s.share <= i.limit + EPS, s.reason
        assert s.reason
    assert d.reason
    assert {t.id for t in d.state.tracks} == {
        i.id for i in instances if i.cls.latency_critical
    }
    for t in d.state.tracks:
        assert len(t.recent_ratios) <= config.cycle_smoothing
    admitted = sum(i.request for i in instances) <= 1.0
    # Σ active ≤ 1 where the budget is tied to the fair budget (run 1's rule, or no oversubscription),
    # except for a budget grown in recovery (and held while steady); always with no latency-critical
    # demand. Admission guarantees requests fit.
    if admitted and (
        d.mode is FeedbackMode.IDLE
        or not oversubscribe
        or (
            config.strict
            and d.mode in {FeedbackMode.EMERGENCY, FeedbackMode.CONTENTION}
        )
    ):
        assert d.active_total <= 1.0 + 1e-6, d.reason
    if admitted:
        # Requests are guarantees unless feedback cut best-effort below them.
        for s, i in zip(d.shares, instances, strict=True):
            if s.active and i.cls.latency_critical:
                assert s.share >= i.request - 1e-6, s.reason
    carried = state.budget if state.mode is not FeedbackMode.IDLE else None
    if d.mode in {FeedbackMode.EMERGENCY, FeedbackMode.BURST} and carried is not None:
        # A cut never raises the budget (the floor aside).
        floor = sum(
            config.emergency_floor * s_i.request
            for s_i, s in zip(instances, d.shares, strict=True)
            if s.active and not s_i.cls.latency_critical
        )
        assert d.budget is None or d.budget <= max(carried, min(1.0, floor)) + 1e-9, d.reason


def test_replace_keeps_instances_frozen() -> None:
    a = lc()
    with pytest.raises(AttributeError):
        a.limit = 1.0  # type: ignore[misc]
    assert replace(a, limit=0.9).limit == 0.9
