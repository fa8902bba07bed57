"""The rckm policy's small helpers (dilu_invoker/policy/vertical.py), one table each."""

from __future__ import annotations

import pytest

from dilu_invoker.policy import CycleTrack, FeedbackMode, InstanceClass, VerticalConfig, VerticalInstance
from dilu_invoker.policy.vertical import (
    _demand,
    _drain,
    _Feedback,
    _kind,
    _lc_room,
    _open_cycle,
    _Probe,
    _probe_step,
    _quiet_baseline,
    _references,
    _restore_burst,
    _saturation,
    _share_decision,
    _signals,
    _slo_floor,
)

CFG = VerticalConfig()


def inst(id: str = "inf", cls: InstanceClass = InstanceClass.INFERENCE, *, request: float = 0.4,
         limit: float = 0.9, slo_ms: float | None = None, blocks: int = 100,
         capacity: float | None = None, throttled_s: float = 0.0) -> VerticalInstance:
    return VerticalInstance(id=id, cls=cls, request=request, limit=limit, slo_ms=slo_ms, blocks=blocks,
                            last_active_at=0.0, capacity_blocks_per_ms=capacity, throttled_s=throttled_s)


def fb(*, emergency: float = 0.0, contention: float = 0.0, recovery: int = 0, jump: float = 0.0,
       drain: bool = False, rebased: bool = False, spans: bool = False, note: str = "",
       demand: float | None = None, ema: float | None = None) -> _Feedback:
    return _Feedback(CycleTrack(id="x", spans=spans, demand_ema=ema), emergency, contention, recovery, note,
                     demand, jump, drain, rebased)


@pytest.mark.parametrize(("live", "expected"), [
    ([], (0.0, 0.0, 0, 0.0, False, False, False, "")),
    ([fb(emergency=1.7, note="a"), fb(contention=1.3, recovery=2, note="b")], (1.7, 1.3, 2, 0.0, False, False, False, "a; b")),
    ([fb(jump=2.5, drain=True), fb(jump=3.0, rebased=True, spans=True)], (0.0, 0.0, 0, 3.0, True, True, True, "")),
], ids=["nothing", "worst-and-sum", "flags"])
def test_signals(live: list[_Feedback], expected: tuple[object, ...]) -> None:
    s = _signals(live)
    assert (s.emergency, s.contention, s.recovery, s.jump, s.drain, s.rebased, s.spans, s.notes) == expected


@pytest.mark.parametrize(("config", "carried", "expected"), [
    (CFG, None, 1.0),  # caps, not reservations
    (VerticalConfig(oversubscribe_in_recovery=False), None, 0.5),  # best-effort requests 0.5 protected
    (VerticalConfig(oversubscribe_in_recovery=False), 0.2, 0.8),  # ... except what feedback took already
    (VerticalConfig(fair_budget_cap=True), 0.0, 0.95),  # never less than the floors
], ids=["caps", "strict", "strict-after-a-cut", "strict-floor"])
def test_lc_room(config: VerticalConfig, carried: float | None, expected: float) -> None:
    assert _lc_room(config, carried=carried, be_requests=0.5, floor_total=0.05) == pytest.approx(expected)


@pytest.mark.parametrize(("config", "demand", "expected"), [
    (CFG, None, (0.1, 0.4, 1.0)),  # unknown demand: the share counts; room ≥ best-effort requests beside
    (CFG, 0.2, (0.1, 0.75, 1.0)),  # demand 0.2 × 1.25 headroom leaves 0.75
    (VerticalConfig(busy_ceiling=0.8), 0.2, (0.1, 0.75, 0.8)),
    (VerticalConfig(oversubscribe_in_recovery=False), 0.2, (0.1, 0.1, 0.1)),
], ids=["unknown-demand", "measured-demand", "reserve", "strict"])
def test_references(config: VerticalConfig, demand: float | None, expected: tuple[float, float, float]) -> None:
    lc = [inst(request=0.2, limit=0.9)]
    be = [inst("tr", InstanceClass.TRAINING, request=0.4, limit=1.0)]
    got = _references(config, lc, be, {"inf": 0.9}, {"inf": fb(demand=demand)}, 0.02)
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(("mode", "b", "restore_to", "expected"), [
    (FeedbackMode.BURST, 0.3, None, (0.3, 0.8, "")),  # remember the budget before the cut
    (FeedbackMode.BURST, 0.2, 0.9, (0.2, 0.9, "")),  # a second cut keeps the higher one
    (FeedbackMode.EMERGENCY, 0.2, 0.9, (0.2, None, "")),  # confirmed
    (FeedbackMode.CONTENTION, 0.3, 0.9, (0.3, None, "")),
    (FeedbackMode.RECOVERY, 0.39, 0.9, (0.9, None, "undone")),  # unhurt: give it back
    (FeedbackMode.RECOVERY, 0.95, 0.9, (0.95, None, "")),  # grown past it already
    (FeedbackMode.STEADY, 0.3, 0.9, (0.3, 0.9, "")),  # nothing judged: keep waiting
], ids=["burst", "second-burst", "emergency", "contention", "recovery", "recovered", "steady"])
def test_restore_burst(mode: FeedbackMode, b: float, restore_to: float | None,
                       expected: tuple[float, float | None, str]) -> None:
    nb, rt, note = _restore_burst(mode, b, restore_to=restore_to, before=0.8, ceiling=1.0, config=CFG)
    assert nb == pytest.approx(expected[0]) and rt == expected[1] and expected[2] in note


def test_restore_burst_off() -> None:
    assert _restore_burst(FeedbackMode.BURST, 0.3, restore_to=0.9, before=0.8, ceiling=1.0,
                          config=VerticalConfig(burst_restore=False)) == (0.3, None, "")


@pytest.mark.parametrize(("probe", "now", "quiet", "mode", "held", "spans", "expected", "probing"), [
    (_Probe(None, 0, 0), 10.0, False, FeedbackMode.CONTENTION, True, True, _Probe(10.0, 0, 0), False),  # clock starts
    (_Probe(10.0, 0, 0), 10.6, False, FeedbackMode.CONTENTION, True, True, _Probe(10.0, 1, 1), True),  # 0.5 s held
    (_Probe(10.0, 0, 1), 10.6, False, FeedbackMode.CONTENTION, True, True, _Probe(10.0, 0, 1), False),  # doubled wait
    (_Probe(10.0, 0, 1), 10.6, False, FeedbackMode.CONTENTION, False, True, _Probe(10.0, 0, 0), False),  # at ceiling
    (_Probe(10.0, 0, 0), 10.6, False, FeedbackMode.EMERGENCY, True, True, _Probe(10.0, 0, 0), False),
    (_Probe(10.0, 0, 0), 10.6, False, FeedbackMode.CONTENTION, True, False, _Probe(10.0, 0, 0), False),  # cycles
    (_Probe(10.0, 1, 1), 10.65, False, FeedbackMode.CONTENTION, True, True, _Probe(10.0, 0, 1), True),  # 2nd period
    (_Probe(10.0, 0, 0), 10.6, True, FeedbackMode.CONTENTION, True, True, _Probe(10.6, 0, 0), False),  # quiet now
], ids=["start", "held-probe", "backed-off", "ceiling-resets", "not-in-emergency", "needs-spans", "continues",
        "quiet-resets"])
def test_probe_step(probe: _Probe, now: float, quiet: bool, mode: FeedbackMode, held: bool, spans: bool,
                    expected: _Probe, probing: bool) -> None:
    assert _probe_step(CFG, probe, now=now, quiet=quiet, mode=mode, held=held, spans=spans) == (expected, probing)


@pytest.mark.parametrize(("judged", "slo_ms", "already_cut", "expected"), [
    (1.0, None, False, "recovery"),
    (1.3, None, False, "contention"),
    (1.7, None, False, "emergency"),
    (1.7, None, True, "contention"),  # the cycle in progress was already cut for
    (4.5, None, False, "outlier"),
    (1.7, 100.0, False, "recovery"),  # 1.7 × 10 ms = 17 ms, within 25% of a 100 ms SLO
], ids=["recovery", "contention", "emergency", "already-cut", "outlier", "slo-guard"])
def test_kind(judged: float, slo_ms: float | None, already_cut: bool, expected: str) -> None:
    assert _kind(judged, 0.010, inst(slo_ms=slo_ms), CFG, already_cut=already_cut)[0] == expected


@pytest.mark.parametrize(("spans", "slo_ms", "cls", "expected"), [
    (True, 20.0, InstanceClass.INFERENCE, 0.006),
    (False, 20.0, InstanceClass.INFERENCE, 0.0),  # window cycles: no floor
    (True, None, InstanceClass.INFERENCE, 0.0),
    (True, 20.0, InstanceClass.TRAINING, 0.0),
], ids=["spans-slo", "cycles", "no-slo", "best-effort"])
def test_slo_floor(spans: bool, slo_ms: float | None, cls: InstanceClass, expected: float) -> None:
    assert _slo_floor(inst(cls=cls, slo_ms=slo_ms), CFG, spans=spans) == pytest.approx(expected)


@pytest.mark.parametrize(("track", "cycles", "quiet", "expected"), [
    (CycleTrack(id="inf", spans=True), (0.006, 0.005, 0.007), False, (0.006, False, False)),  # first median
    (CycleTrack(id="inf", spans=True, quiet_s=0.005), (0.006, 0.006, 0.006), False, (0.005, False, False)),
    (CycleTrack(id="inf", spans=True, quiet_s=0.005), (0.004, 0.004, 0.004), False, (0.004, False, False)),
    (CycleTrack(id="inf", spans=True, quiet_s=0.005), (0.0055,) * 3, True, (0.0055, True, False)),  # quiet
    (CycleTrack(id="inf", spans=True, quiet_s=0.005), (0.007,) * 3, True, (0.007, True, True)),  # still slow
    (CycleTrack(id="inf", spans=True, quiet_s=0.005), (0.004, 0.004), False, (0.005, False, False)),  # too few
    (CycleTrack(id="inf", spans=False), (0.04, 0.05, 0.06), True, (None, False, False)),  # window cycles
], ids=["first", "slower", "faster", "quiet", "quiet-still-stretched", "too-few", "cycles"])
def test_quiet_baseline(track: CycleTrack, cycles: tuple[float, ...], quiet: bool,
                        expected: tuple[float | None, bool, bool]) -> None:
    q = _quiet_baseline(inst(), track, cycles, CFG, quiet=quiet, floor_s=0.0)
    assert (q.quiet_s, q.measured, q.rebased) == (pytest.approx(expected[0]) if expected[0] else None,
                                                 expected[1], expected[2])


@pytest.mark.parametrize(("busy", "cycles", "contention", "expected"), [
    ((0.96, 0.97), (0.049,), 1.3, ((), True)),  # busy ≥ 95% over 3 periods while contended
    ((0.96, 0.97), (0.049,), 0.0, ((0.96, 0.97, 0.98), False)),  # busy but not stretched
    ((0.5, 0.6), (0.035,), 1.3, ((0.5, 0.6, 0.7), False)),
    ((0.96,), (0.049,), 1.3, ((0.96, 0.98), False)),  # not yet three periods
], ids=["saturated", "no-contention", "not-busy", "too-few"])
def test_saturation(busy: tuple[float, ...], cycles: tuple[float, ...], contention: float,
                    expected: tuple[tuple[float, ...], bool]) -> None:
    track = CycleTrack(id="inf", spans=True, recent_busy=busy)
    got, saturated, _ = _saturation(inst(), track, cycles, 0.05, CFG, contention=contention)
    assert got == pytest.approx(expected[0]) and saturated is expected[1]


@pytest.mark.parametrize(("flagged", "last_open", "open_s", "completed", "slo_ms", "expected"), [
    (False, 0.0, 0.035, False, None, (True, 3.5)),  # 3.5× a 10 ms baseline: cut now
    (False, 0.0, 0.02, False, None, (False, 0.0)),  # 2×: not yet
    (True, 0.03, 0.04, False, None, (True, 0.0)),  # already cut for this one
    (True, 0.03, 0.035, True, None, (True, 3.5)),  # completed meanwhile: a new one, cut again
    (False, 0.0, 0.045, False, None, (False, 0.0)),  # ≥ outlier: merged requests
    (False, 0.0, 0.035, False, 200.0, (False, 0.0)),  # within the SLO guard (50 ms)
], ids=["cut", "short", "once", "new-cycle", "outlier", "slo-guard"])
def test_open_cycle(flagged: bool, last_open: float, open_s: float, completed: bool, slo_ms: float | None,
                    expected: tuple[bool, float]) -> None:
    track = CycleTrack(id="inf", open_flagged=flagged, last_open_s=last_open)
    got = _open_cycle(inst(slo_ms=slo_ms), track, open_s, 0.010, CFG, completed=completed, unit="cycle")
    assert got[:2] == pytest.approx(expected)


@pytest.mark.parametrize(("fraction", "open_s", "expected"), [
    (None, 0.015, False),
    (0.25, 0.015, True),  # 15 ms of a 40 ms SLO
    (0.25, 0.005, False),
    (0.25, 0.040, False),  # as long as the SLO: a busy instance, for the ratios
], ids=["off", "draining", "short", "at-slo"])
def test_drain(fraction: float | None, open_s: float, expected: bool) -> None:
    assert _drain(inst(slo_ms=40.0), open_s, VerticalConfig(drain_slo_fraction=fraction), unit="cycle")[0] is expected


@pytest.mark.parametrize(("capacity", "blocks", "ema", "expected"), [
    (None, 500, 0.1, (None, 0.1, 0.0)),  # capacity unknown: no demand
    (100.0, 500, None, (0.1, 0.1, 0.0)),  # first reading: the average starts there
    (100.0, 500, 0.1, (0.1, 0.1, 0.0)),
    (100.0, 2000, 0.1, (0.4, 0.1 * 0.875 + 0.4 * 0.125, 4.0)),  # a 4× jump is a burst
    (100.0, 400, 0.01, (0.08, 0.01 * 0.875 + 0.08 * 0.125, 0.0)),  # judged against at least 0.05
], ids=["unknown", "first", "steady", "burst", "small-base"])
def test_demand(capacity: float | None, blocks: int, ema: float | None,
                expected: tuple[float | None, float | None, float]) -> None:
    track = CycleTrack(id="inf", demand_ema=ema)
    d, e, j, _ = _demand(inst(capacity=capacity, blocks=blocks), track, 0.05, CFG)
    assert (d, e, j) == ((pytest.approx(expected[0]) if expected[0] is not None else None),
                         pytest.approx(expected[1]) if expected[1] is not None else None, pytest.approx(expected[2]))


@pytest.mark.parametrize(("instance", "shares", "share", "active", "saturated", "why"), [
    (inst(), {"inf": 0.9}, 0.9, True, False, "its limit"),
    (inst(), {"inf": 0.6}, 0.6, True, False, "request 0.40"),
    (inst(), {}, 0.9, False, False, "standing cap at its limit"),
    (inst(throttled_s=0.01), {"inf": 0.9}, 0.9, True, True, "saturated"),
    (inst("tr", InstanceClass.TRAINING, request=0.2, limit=1.0), {"tr": 0.5}, 0.5, True, False, "of budget"),
    (inst("tr", InstanceClass.TRAINING, request=0.2, limit=1.0), {}, 0.2, False, False, "at its request"),
], ids=["lc-limit", "lc-cut", "lc-idle", "lc-saturated", "be-active", "be-idle"])
def test_share_decision(instance: VerticalInstance, shares: dict[str, float], share: float, active: bool,
                        saturated: bool, why: str) -> None:
    d = _share_decision(instance, shares, mode=FeedbackMode.CONTENTION, be_total=0.5, lc_cut_why="cut",
                        period_s=0.05, config=CFG)
    assert (d.share, d.active, d.saturated) == (pytest.approx(share), active, saturated) and why in d.reason
