"""The types every vertical policy shares (dilu_invoker/policy/vertical.py) as tables, and what each policy's
decision keeps to whatever it is given: one decision per instance, in order, each share within [0, its limit]
with a reason (hypothesis)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu_invoker.policy import (
    EPS,
    InstanceClass,
    ShareDecision,
    VerticalDecision,
    VerticalInstance,
    VerticalSnapshot,
)
from dilu_invoker.policy.vertical_slo import (
    FLOOR_FRACTION,
    AnyVerticalConfig,
    SloConfig,
    SloState,
    SpatialConfig,
    StaticConfig,
    decide_vertical,
    initial_state,
)

NOW = 100.0
P = 0.05
INF, LLM, TRAIN = InstanceClass.INFERENCE, InstanceClass.LLM, InstanceClass.TRAINING


def inst(id: str = "inf", cls: InstanceClass = INF, request: float = 0.3, limit: float = 0.6,
         **kw: object) -> VerticalInstance:
    return VerticalInstance(id=id, cls=cls, request=request, limit=limit, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: inst(request=0.7, limit=0.5), "exceeds limit"),
    (lambda: inst(request=0.1, limit=1.5), "limit"),
    (lambda: inst(id=""), "id must not be empty"),
    (lambda: inst(cycles_s=(-1.0,)), "cycle and span lengths"),
    (lambda: inst(spans_s=(float("nan"),)), "cycle and span lengths"),
    (lambda: inst(blocks=-1), "blocks"),
    (lambda: inst(open_span_s=-0.1), "open_span_s"),
    (lambda: inst(queued=-1.0), "the queue"),
    (lambda: inst(runs_s=(float("inf"),)), "runs"),
    (lambda: inst(mps_threads=0.0), "mps_threads"),
    (lambda: inst(mps_threads=1.5), "mps_threads"),
    (lambda: VerticalSnapshot(now=0.0, instances=(inst("a"), inst("a"))), "duplicate instance ids"),
    (lambda: VerticalSnapshot(now=0.0, instances=(), period_s=0.0), "period_s"),
], ids=["request-above-limit", "limit-above-one", "empty-id", "negative-cycle", "nan-span", "negative-blocks",
        "negative-open-span", "negative-queue", "infinite-run", "no-threads", "threads-above-one", "duplicate-ids",
        "no-period"])
def test_bad_input_is_a_clear_error(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(("blocks", "last_active_at", "active"), [
    (10, None, True),  # launching now
    (0, None, False),  # never launched
    (0, NOW - 0.6, True),  # idle for exactly IDLE_AFTER_S: still active
    (0, NOW - 0.61, False),
], ids=["launching", "never", "at-idle-after", "idle"])
def test_active_is_a_launch_within_idle_after(blocks: int, last_active_at: float | None, active: bool) -> None:
    i = inst(blocks=blocks, last_active_at=last_active_at)
    assert i.active(NOW, SloConfig()) is active
    assert i.active(NOW, StaticConfig()) is active and i.active(NOW, SpatialConfig()) is active


@pytest.mark.parametrize(("previous", "share", "changed"), [
    (None, 0.5, True),  # nothing enforced yet
    (0.5, 0.5, False),
    (0.5, 0.5 + EPS / 2, False),  # float noise is no change
    (0.5, 0.6, True),
], ids=["first", "same", "within-eps", "moved"])
def test_changed_compares_with_the_enforced_share(previous: float | None, share: float, changed: bool) -> None:
    d = ShareDecision(id="i", share=share, previous=previous, active=True, saturated=False, reason="r")
    assert d.changed is changed


def test_share_of_an_unknown_instance_is_a_key_error() -> None:
    d = decide_vertical(VerticalSnapshot(now=NOW, instances=(inst(blocks=1),)), SloState(), SloConfig())
    assert d.share_of("inf") == pytest.approx(0.6)
    with pytest.raises(KeyError):
        d.share_of("other")


def test_instances_are_frozen() -> None:
    a = inst()
    with pytest.raises(AttributeError):
        a.limit = 1.0  # type: ignore[misc]
    assert replace(a, limit=0.9).limit == 0.9 and a.limit == 0.6


# -- saturation: at its limit and waiting for tokens ---------------------------------------------------


@pytest.mark.parametrize("config", [SloConfig(), StaticConfig()], ids=["slo", "static"])
@pytest.mark.parametrize(("throttled", "saturated"), [(0.01, True), (0.001, False)],
                         ids=["throttled-at-limit", "barely-throttled"])
def test_an_instance_throttled_at_its_limit_is_saturated(config: AnyVerticalConfig, throttled: float,
                                                         saturated: bool) -> None:
    """Waiting for tokens ≥ 10% of the period at its limit: vertical scaling has nothing more to give it."""
    snap = VerticalSnapshot(now=NOW, instances=(inst(blocks=10, throttled_s=throttled),), period_s=P)
    d = decide_vertical(snap, initial_state(config), config)
    assert d.share_of("inf") == pytest.approx(0.6)
    assert d.shares[0].saturated is saturated
    if isinstance(config, SloConfig):  # static's reason is its limit alone
        assert ("saturated" in d.shares[0].reason) is saturated


def test_a_best_effort_instance_held_below_its_limit_is_not_saturated() -> None:
    """Under `slo` training beside inference gets a budget below its limit: throttled, but there is more to give."""
    lc = inst(blocks=10, last_active_at=NOW, slo_ms=20.0)
    be = inst("train", TRAIN, 0.2, 1.0, blocks=10, last_active_at=NOW, throttled_s=0.05)
    d = decide_vertical(VerticalSnapshot(now=NOW, instances=(lc, be), period_s=P), SloState(), SloConfig())
    assert d.share_of("train") < 1.0 and not d.shares[1].saturated


# -- what every decision keeps ------------------------------------------------------------------------

times_st = st.lists(st.floats(min_value=0.0, max_value=0.1), max_size=5).map(tuple)


@st.composite
def instances_st(draw: st.DrawFn) -> VerticalInstance:
    request = draw(st.floats(min_value=0.0, max_value=0.5))
    return VerticalInstance(
        id=draw(st.text(alphabet="abcdef", min_size=1, max_size=4)),
        cls=draw(st.sampled_from(list(InstanceClass))),
        request=request,
        limit=draw(st.floats(min_value=request, max_value=1.0)),
        slo_ms=draw(st.none() | st.floats(min_value=1.0, max_value=200.0)),
        blocks=draw(st.integers(min_value=0, max_value=3)),
        last_active_at=draw(st.none() | st.floats(min_value=NOW - 5, max_value=NOW)),
        throttled_s=draw(st.floats(min_value=0.0, max_value=0.05)),
        cycles_s=draw(times_st),
        spans_s=draw(times_st),
        open_span_s=draw(st.floats(min_value=0.0, max_value=0.1)),
        queue_known=draw(st.booleans()),
        runs_s=draw(times_st),
        queued=draw(st.floats(min_value=0.0, max_value=5.0)),
        oldest_wait_s=draw(st.floats(min_value=0.0, max_value=0.2)),
        mps_threads=draw(st.none() | st.floats(min_value=0.01, max_value=1.0)),
    )


CONFIGS = {"slo": SloConfig(), "static": StaticConfig(), "spatial": SpatialConfig()}


@settings(max_examples=200, deadline=None)
@given(
    first=st.lists(instances_st(), max_size=6, unique_by=lambda i: i.id),
    second=st.lists(instances_st(), max_size=6, unique_by=lambda i: i.id),
    name=st.sampled_from(sorted(CONFIGS)),
)
def test_every_decision_keeps_shares_within_limits(first: list[VerticalInstance], second: list[VerticalInstance],
                                                   name: str) -> None:
    """Two periods in a row (the second from the state the first returned), any instances."""
    config = CONFIGS[name]
    d1 = decide_vertical(VerticalSnapshot(now=NOW, instances=tuple(first), period_s=P), initial_state(config), config)
    snap = VerticalSnapshot(now=NOW + P, instances=tuple(second), period_s=P)
    d2 = decide_vertical(snap, d1.state, config)
    for d, instances in ((d1, first), (d2, second)):
        _check(d, instances, config, now=d.now)


def _check(d: VerticalDecision, instances: list[VerticalInstance], config: AnyVerticalConfig, *, now: float) -> None:
    assert [s.id for s in d.shares] == [i.id for i in instances]
    assert d.reason and isinstance(d.state, SloState)
    admitted = sum(i.request for i in instances) <= 1.0
    for s, i in zip(d.shares, instances, strict=True):
        assert 0.0 <= s.share <= i.limit + EPS, s.reason
        assert s.reason and s.active is i.active(now, config)
        if isinstance(config, SpatialConfig):
            continue
        if admitted and s.active and i.cls.latency_critical:
            # Requests are guarantees: only limits that do not fit together are cut, toward the requests.
            assert s.share >= i.request - 1e-6, s.reason
        if s.active and not i.cls.latency_critical:
            assert s.share >= min(FLOOR_FRACTION * i.request, i.limit) - 1e-9, s.reason  # never below the floor
    assert d.active_total == pytest.approx(sum(s.share for s in d.shares if s.active))
