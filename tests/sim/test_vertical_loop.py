"""The one-GPU closed loop of the vertical policies at the live period (dilu_invoker/sim/vertical_loop.py):
the plant is monotone in training's share, the arrival processes keep their mean rate, and the `slo`
controller holds the SLO without being dominated on a paced cell. Fast: seconds of simulated time."""

from __future__ import annotations

import pytest

from dilu_invoker.policy.vertical_slo import SloConfig
from dilu_invoker.sim.vertical_loop import ARRIVALS, PAIRS, PERIOD_S, arrivals, cell, run

RESNET = PAIRS["resnet50+train"]


@pytest.mark.parametrize("kind", ARRIVALS)
def test_arrivals_keep_the_mean_rate(kind: str) -> None:
    times = arrivals(kind, 0.5, RESNET, 120.0, seed=2)
    rate = 0.5 * RESNET.capacity_rps * (1.0 if kind != "burst5" else (2 * 0.2 + 1.0) / 3)
    assert times == sorted(times) and times[-1] < 120.0
    assert len(times) / 120.0 == pytest.approx(rate, rel=0.06)


def test_more_training_share_means_slower_inference() -> None:
    times = arrivals("paced", 0.7, RESNET, 10.0, seed=1)
    p99s = [run(RESNET, times, static=s, seconds=10.0).p99_ms for s in (0.0, 0.5, 1.0)]
    assert p99s[0] < p99s[1] < p99s[2]
    # Alone, a request is its overheads plus its GPU time (with jitter up to +10%).
    assert p99s[0] == pytest.approx((RESNET.gpu_s * 1.1 + RESNET.overhead_s + RESNET.pipelined_s) * 1000, rel=0.05)


def test_the_controller_holds_a_paced_cell_at_the_live_period() -> None:
    r = cell(RESNET, "paced", 0.5, seed=1, annotated=True, config=SloConfig(), seconds=10.0)
    assert r.controller.p99_ms <= r.slo_ms
    assert not r.dominating()
    assert r.controller.training >= 0.75 * r.best_static
    assert "measure" in r.controller.modes  # it measured inference's solo latency first
    assert len(r.controller.modes) == int(10.0 / PERIOD_S)


def test_a_static_share_or_a_policy_not_both() -> None:
    with pytest.raises(ValueError, match="static share or a policy"):
        run(RESNET, [0.1], static=0.5, config=SloConfig())
    with pytest.raises(ValueError, match="unknown arrival"):
        arrivals("trace", 0.5, RESNET, 1.0, seed=1)
