"""The `slo` policy's second measurement: the instance's own queue, as the invoker reports it."""

from __future__ import annotations

import pytest

from dilu_invoker.policy import FeedbackMode, InstanceClass, VerticalDecision, VerticalInstance, VerticalSnapshot
from dilu_invoker.policy.vertical_slo import (
    SloConfig,
    SloState,
    SloTrack,
    decide_slo,
    is_saturated,
    occupancy,
    queue_latency_s,
    waiting_latency_s,
)

P = 0.05
CFG = SloConfig()


@pytest.mark.parametrize(("queued", "oldest", "service", "open_run", "expected"), [
    (0.0, 0.0, 0.005, 0.003, 0.0),  # nobody waits
    (1.0, 0.010, 0.005, 0.0, 0.015),  # the oldest: its wait so far plus its own run
    (6.0, 0.002, 0.005, 0.0, 0.030),  # the last of six waits behind the other five, then runs
    (1.5, 0.004, 0.004, 0.0, 0.008),  # a share of a key's queue: the oldest bound is the larger
    (1.0, 0.001, 0.005, 0.002, 0.009),  # a run 2 ms in: 3 ms of it left before the oldest can start
    (1.0, 0.001, 0.005, 0.009, 0.006),  # a run longer than usual: nothing known to be left
], ids=["empty", "oldest", "deep", "shared", "behind-a-run", "long-run"])
def test_queue_latency(queued: float, oldest: float, service: float, open_run: float, expected: float) -> None:
    assert queue_latency_s(queued, oldest, service, open_run_s=open_run) == pytest.approx(expected)


def inst(*, runs: tuple[float, ...] = (), open_run: float = 0.0, queued: float = 0.0, oldest: float = 0.0,
         spans: tuple[float, ...] = (), slo_ms: float | None = 40.0, known: bool = True) -> VerticalInstance:
    return VerticalInstance(id="inf", cls=InstanceClass.INFERENCE, request=0.5, limit=1.0, slo_ms=slo_ms,
                            blocks=100, last_active_at=0.0, spans_s=spans, queue_known=known, runs_s=runs,
                            open_run_s=open_run, queued=queued, oldest_wait_s=oldest)


@pytest.mark.parametrize(("instance", "expected"), [
    (inst(), 0.0),
    (inst(runs=(0.01, 0.01)), 0.4),
    (inst(runs=(0.01,), open_run=0.02), 0.6),
    (inst(open_run=0.2), 1.0),  # running the whole period
    (inst(runs=(0.01,), queued=1.0, oldest=0.001), 1.0),  # activations waiting: it never had time to spare
], ids=["idle", "two-runs", "one-running", "long-run", "queue"])
def test_occupancy(instance: VerticalInstance, expected: float) -> None:
    assert occupancy(instance, P) == pytest.approx(expected)


def train() -> VerticalInstance:
    return VerticalInstance(id="train", cls=InstanceClass.TRAINING, request=0.2, limit=1.0, blocks=100,
                            last_active_at=1.0)


def step(state: SloState, inference: VerticalInstance, now: float = 1.0) -> VerticalDecision:
    return decide_slo(VerticalSnapshot(now=now, instances=(inference, train()), period_s=P), state, CFG)


def steady(**track: object) -> SloState:
    fields: dict[str, object] = {"solo_s": 0.004, "counts": (5,) * 10, "busy": (0.3,) * 10, **track}
    t = SloTrack(id="inf", **fields)  # type: ignore[arg-type]
    return SloState(budget=0.8, moved_at=0.9, mode=FeedbackMode.HOLD, tracks=(t,))


@pytest.mark.parametrize(("queued", "oldest", "slo_ms", "mode"), [
    (9.0, 0.001, 40.0, FeedbackMode.EMERGENCY),  # nine runs of 5 ms behind each other: the last past 40 ms
    (1.0, 0.045, 40.0, FeedbackMode.EMERGENCY),  # one waiting already longer than the SLO
    (2.0, 0.004, 40.0, FeedbackMode.HOLD),  # a short queue that meets the SLO: no clamp (the dwell holds)
    (9.0, 0.001, None, FeedbackMode.HOLD),  # no annotated SLO: the derived T is a model, not an objective
], ids=["deep", "old", "short", "derived"])
def test_a_queue_that_will_miss_the_objective_clamps_at_once(queued: float, oldest: float, slo_ms: float | None,
                                                              mode: FeedbackMode) -> None:
    runs = (0.005,) * 5
    d = step(steady(), inst(runs=runs, spans=(0.004,) * 5, queued=queued, oldest=oldest, slo_ms=slo_ms))
    assert d.mode is mode
    if mode is FeedbackMode.EMERGENCY:
        assert "waiting" in d.reason and d.share_of("train") == pytest.approx(0.01)


def test_the_queue_counts_only_where_the_invoker_reports_it() -> None:
    d = step(steady(), inst(runs=(0.005,) * 5, spans=(0.004,) * 5, queued=8.0, oldest=0.001, known=False))
    assert d.mode is not FeedbackMode.EMERGENCY


@pytest.mark.parametrize(("known", "queued", "mode"), [
    (True, 1.0, FeedbackMode.DECREASE),
    (True, 0.0, FeedbackMode.HOLD),  # busy without anyone waiting (evenly spaced arrivals): no queue yet
    (False, 1.0, FeedbackMode.HOLD),  # the spans alone never fill the time
], ids=["instance-time", "no-queue", "spans-only"])
def test_saturation_is_the_instance_busy_not_its_gpu_spans(known: bool, queued: float, mode: FeedbackMode) -> None:
    # Spans fill 60% of the time (the rest of each request is off the GPU), the activations all of it, one
    # waits, and the estimate sits near the target: a queue forms over the instance's time: decrease at once.
    judged = (0.007,) * 20  # 0.875 of the target, 2 × the 4 ms solo span: within the deadband
    state = steady(judged=judged, busy=(0.6,) * 20, held=(1.0, 1.0) if known else ())
    d = step(state, inst(runs=(0.01,) * 5, spans=(0.007,) * 5, queued=queued, oldest=0.001, slo_ms=17.0,
                         known=known))
    assert d.mode is mode
    if mode is FeedbackMode.DECREASE:
        assert "fill its time" in d.reason


@pytest.mark.parametrize(("budget", "floor_periods", "with_training", "saturated"), [
    (0.8, 0, True, False),  # the clamp still has best-effort budget to take: vertical scaling acts first
    (0.01, 0, True, False),  # just clamped to the floor: the queue gets a period to drain
    (0.01, 1, True, True),  # at the floor already and the queue still misses: only another instance helps
    (None, 0, False, True),  # nothing beside it to take from
], ids=["budget-left", "just-clamped", "at-floor", "alone"])
def test_a_queue_that_misses_with_nothing_left_to_take_is_saturated(budget: float | None, floor_periods: int,
                                                                    with_training: bool, saturated: bool) -> None:
    state = SloState(budget=budget, moved_at=0.5, mode=FeedbackMode.HOLD, tracks=steady().tracks,
                     floor_periods=floor_periods)
    waiting = inst(runs=(0.005,) * 5, spans=(0.004,) * 5, queued=9.0, oldest=0.001)
    instances = (waiting, train()) if with_training else (waiting,)
    d = decide_slo(VerticalSnapshot(now=1.0, instances=instances, period_s=P), state, CFG)
    first = next(s for s in d.shares if s.id == "inf")
    assert first.saturated is saturated
    assert ("queue misses" in first.reason) is saturated


@pytest.mark.parametrize(("instance", "track", "expected"), [
    (inst(known=False), SloTrack(id="inf", busy=(0.97, 0.97, 0.97)), True),  # spans fill the time
    (inst(known=False), SloTrack(id="inf", busy=(0.97, 0.97)), False),  # too few periods yet
    (inst(queued=1.0), SloTrack(id="inf", held=(1.0, 1.0, 1.0)), True),  # busy and someone waits
    (inst(queued=0.0), SloTrack(id="inf", held=(1.0, 1.0, 1.0)), False),  # busy, nobody waits
    (inst(queued=1.0), SloTrack(id="inf", busy=(0.6,) * 3, held=(0.9, 0.9, 1.0)), False),
], ids=["spans", "too-few", "queue", "no-queue", "not-busy"])
def test_is_saturated(instance: VerticalInstance, track: SloTrack, expected: bool) -> None:
    assert is_saturated(instance, track) is expected


@pytest.mark.parametrize(("instance", "track", "spans", "expected"), [
    (inst(queued=2.0, oldest=0.001, known=False), SloTrack(id="inf"), (0.004,), 0.0),  # not reported
    (inst(queued=2.0, oldest=0.001, runs=(0.006, 0.008, 0.007)), SloTrack(id="inf"), (), 0.014),  # runs
    (inst(queued=2.0, oldest=0.001), SloTrack(id="inf", judged=(0.005,) * 3), (0.004,), 0.010),  # judged
    (inst(queued=2.0, oldest=0.001), SloTrack(id="inf"), (0.004,), 0.008),  # this period's spans
    (inst(queued=2.0, oldest=0.001), SloTrack(id="inf", solo_s=0.003), (), 0.006),  # the solo span
], ids=["unreported", "runs", "judged", "spans", "solo"])
def test_waiting_latency_takes_the_best_service_time_known(instance: VerticalInstance, track: SloTrack,
                                                           spans: tuple[float, ...], expected: float) -> None:
    assert waiting_latency_s(instance, track, spans) == pytest.approx(expected)
