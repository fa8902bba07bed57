"""The `spatial` vertical policy by tables: MPS thread caps at a client's start, shares that are never token caps,
the load signals it still reports, and `auto`'s choice per GPU (`resolve_vertical`)."""

from __future__ import annotations

import pytest

from dilu_invoker.policy.types import InstanceClass
from dilu_invoker.policy.vertical import FeedbackMode, VerticalInstance, VerticalSnapshot
from dilu_invoker.policy.vertical_slo import (
    PerGpuVertical,
    SloConfig,
    SloState,
    SpatialConfig,
    StaticConfig,
    decide_spatial,
    decide_vertical,
    gates_launches,
    initial_state,
    mps_start_threads,
    policy_name,
    resolve_vertical,
    spatial_threads,
)

P = 0.05
CFG = SpatialConfig()
LC, BE = InstanceClass.INFERENCE, InstanceClass.TRAINING


@pytest.mark.parametrize(("cls", "req", "limit", "lc_requests", "config", "threads"), [
    (LC, 0.5, 0.8, 0.0, CFG, 0.8),  # latency-critical: its SM limit, whatever is on the GPU
    (LC, 0.5, 0.8, 0.9, CFG, 0.8),
    (BE, 0.2, 0.8, 0.0, CFG, 0.5),  # alone: the reserve 0.5 stays free for inference that arrives later
    (BE, 0.2, 0.8, 0.3, CFG, 0.5),  # a small latency-critical neighbour: still the reserve
    (BE, 0.2, 0.8, 0.7, CFG, pytest.approx(0.3)),  # a larger one: its requests are kept free
    (BE, 0.4, 0.8, 0.9, CFG, 0.4),  # ... but never below its own request
    (BE, 0.2, 0.3, 0.0, CFG, 0.3),  # never above its own limit
    (BE, 0.2, 1.0, 0.0, SpatialConfig(lc_reserve=0.0), 1.0),  # no reserve: the whole GPU up to its limit
    (BE, 0.2, 1.0, 0.25, SpatialConfig(lc_reserve=0.0), 0.75),
    (BE, 0.0, 0.9, 1.0, CFG, 0.01),  # MPS takes 1% at least
    (LC, 0.5, 0.8, 0.0, SpatialConfig(lc_threads=0.5), 0.5),  # capped where the best-effort cap starts
    (LC, 0.3, 0.8, 0.0, SpatialConfig(lc_threads=0.5), 0.5),
    (LC, 0.6, 0.8, 0.0, SpatialConfig(lc_threads=0.5), 0.6),  # ... never below its own request
    (LC, 0.1, 0.4, 0.0, SpatialConfig(lc_threads=0.5), 0.4),  # ... nor above its limit
    (BE, 0.3, 0.7, 0.0, SpatialConfig(lc_threads=0.5), 0.5),  # best-effort caps do not depend on it
    (BE, 0.3, 0.7, 0.5, SpatialConfig(be_threads=1.0), 0.7),  # into the reserve: up to its limit
    (BE, 0.3, 0.9, 0.5, SpatialConfig(be_threads=0.6), 0.6),  # ... or as far as be_threads reaches
    (BE, 0.3, 0.9, 0.2, SpatialConfig(be_threads=0.4), 0.5),  # ... never less than outside it
    (LC, 0.5, 0.8, 0.0, SpatialConfig(be_threads=1.0, lc_threads=0.5), 0.5),  # latency-critical caps ignore it
], ids=["lc-alone", "lc-beside-lc", "be-alone", "be-small-lc", "be-large-lc", "be-own-request", "be-own-limit",
        "no-reserve", "no-reserve-lc", "floor", "lc-threads", "lc-threads-small-request", "lc-threads-own-request",
        "lc-threads-own-limit", "lc-threads-be", "be-threads-limit", "be-threads-reach", "be-threads-below-reserve",
        "be-threads-lc"])
def test_spatial_threads(cls: InstanceClass, req: float, limit: float, lc_requests: float, config: SpatialConfig,
                         threads: float) -> None:
    assert spatial_threads(cls, limit, request=req, lc_requests=lc_requests, config=config) == threads
    # mps_start_threads is how the manager asks, for every policy
    assert mps_start_threads(cls, limit, config, request=req, lc_requests=lc_requests) == threads


def test_the_reserve_is_a_fraction() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="lc_reserve"):
            SpatialConfig(lc_reserve=bad)
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="lc_threads"):
            SpatialConfig(lc_threads=bad)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="be_threads"):
            SpatialConfig(be_threads=bad)


def test_only_spatial_leaves_launches_ungated() -> None:
    assert not gates_launches(SpatialConfig())
    assert all(gates_launches(c) for c in (SloConfig(), StaticConfig()))
    assert policy_name(SpatialConfig()) == "spatial" and isinstance(initial_state(SpatialConfig()), SloState)


def inf(t: float, **kw: object) -> VerticalInstance:
    return VerticalInstance(id="inf", cls=LC, request=0.5, limit=0.8, blocks=50, last_active_at=t,
                            mps_threads=0.8, **kw)  # type: ignore[arg-type]


def train(t: float, **kw: object) -> VerticalInstance:
    return VerticalInstance(id="train", cls=BE, request=0.2, limit=0.9, blocks=500, last_active_at=t,
                            throttled_s=0.05, mps_threads=0.5, **kw)  # type: ignore[arg-type]


def test_shares_are_the_thread_caps_and_nothing_is_cut() -> None:
    """Beside busy inference, training keeps its thread cap period after period: no emergency, no budget;
    its throttled time (a stale reading) does not make it saturated either."""
    state = SloState()
    for k in range(20):
        now = k * P
        d = decide_spatial(VerticalSnapshot(now=now, instances=(inf(now), train(now)), period_s=P), state, CFG)
        state = d.state  # type: ignore[assignment]
        assert d.mode is FeedbackMode.HOLD and d.budget is None
        assert d.share_of("inf") == pytest.approx(0.8) and d.share_of("train") == pytest.approx(0.5)
        assert not any(s.saturated for s in d.shares)
    assert "no token cap" in d.shares[1].reason and "MPS thread cap" in d.shares[1].reason
    assert "spatial" in d.reason


def test_alone_it_is_idle_and_an_unknown_cap_reads_as_the_limit() -> None:
    t = VerticalInstance(id="train", cls=BE, request=0.2, limit=0.9, blocks=500, last_active_at=1.0)
    d = decide_vertical(VerticalSnapshot(now=1.0, instances=(t,), period_s=P), SloState(), CFG)
    assert d.mode is FeedbackMode.IDLE and d.share_of("train") == pytest.approx(0.9)
    assert "no MPS cap known" in d.shares[0].reason


def test_an_instance_whose_queue_misses_its_slo_is_saturated() -> None:
    """Vertical scaling has nothing to give under a static split: activations waiting past the annotated SLO,
    or an instance busy all the time with activations waiting, are the horizontal scaler's signal."""
    waiting = inf(0.0, slo_ms=20.0, queue_known=True, runs_s=(0.012,), queued=3.0, oldest_wait_s=0.015)
    d = decide_spatial(VerticalSnapshot(now=0.0, instances=(waiting, train(0.0)), period_s=P), SloState(), CFG)
    inf_d = next(s for s in d.shares if s.id == "inf")
    assert inf_d.saturated and "past its SLO" in inf_d.reason
    assert inf_d.share == pytest.approx(0.8)  # the signal changes no share

    state = SloState()
    for k in range(4):  # busy the whole period with one waiting, no SLO annotated
        busy = inf(k * P, queue_known=True, runs_s=(P,), queued=1.0, oldest_wait_s=0.001)
        d = decide_spatial(VerticalSnapshot(now=k * P, instances=(busy,), period_s=P), state, CFG)
        state = d.state  # type: ignore[assignment]
    assert d.shares[0].saturated and "fill its time" in d.shares[0].reason

    calm = inf(0.0, slo_ms=20.0, queue_known=True, runs_s=(0.012,), queued=0.0)
    d = decide_spatial(VerticalSnapshot(now=0.0, instances=(calm,), period_s=P), SloState(), CFG)
    assert not d.shares[0].saturated


AUTO = PerGpuVertical(name="auto", mps=SpatialConfig(lc_reserve=0.4), time_sliced=SloConfig(deadband=0.2))
SPATIAL = PerGpuVertical(name="spatial", mps=SpatialConfig(), time_sliced=SloConfig())


@pytest.mark.parametrize(("config", "mps", "expect", "fallback", "why"), [
    (AUTO, True, SpatialConfig(lc_reserve=0.4), False, "auto: spatial, the GPU runs MPS"),
    (AUTO, False, SloConfig(deadband=0.2), False, "auto: slo, the GPU time-slices"),
    (SPATIAL, True, SpatialConfig(), False, "spatial: the GPU runs MPS"),
    (SPATIAL, False, SloConfig(), True, "spatial needs MPS, but the GPU time-slices (because): slo instead"),
    (SloConfig(), True, SloConfig(), False, "--gpu-vertical-policy slo"),
    (StaticConfig(), False, StaticConfig(), False, "--gpu-vertical-policy static"),
], ids=["auto-mps", "auto-time-sliced", "spatial-mps", "spatial-time-sliced", "slo", "static"])
def test_resolve_vertical(config: object, mps: bool, expect: object, fallback: bool, why: str) -> None:
    got, reason, warn = resolve_vertical(config, mps=mps, mps_reason="because")  # type: ignore[arg-type]
    assert got == expect and warn is fallback
    assert why in reason
