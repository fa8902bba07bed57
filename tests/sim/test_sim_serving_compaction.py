"""Live compaction in the serving simulation (`ServingSimConfig.compaction_period_s`): a GPU that one
small instance keeps lit is emptied make-before-break, never while its function is in a burst, and
nothing runs with the period at 0.

The layout: two training jobs fill GPU 0 by Σ request (0.5 + 0.5), so the function's instance is
placed on GPU 1; at 60 s the short job ends and GPU 0 has room for it."""

from __future__ import annotations

import numpy as np
import pytest

from dilu_invoker.policy import HorizontalConfig
from dilu_invoker.sim.profiles import ProfileSet
from dilu_invoker.sim.serving import ServingResult, ServingSimConfig, simulate_serving
from dilu_invoker.sim.traces import FunctionTrace, ServingTrace, TrainingJob

END_S = 240.0
SHORT_JOB_ENDS_S = 60.0
COLD_START_S = 2.0


def layout(rate: int, burst: int | None = None) -> ServingTrace:
    """`rate` requests/s of bert-base for the whole trace; with `burst`, that rate from 50 s on."""
    counts = np.full(int(END_S), rate, dtype=np.int64)
    if burst is not None:
        counts[50:] = burst
    a = FunctionTrace("a", "bert-base", counts, bin_s=1.0)
    jobs = (
        TrainingJob("long", "train-resnet50", 0.0, END_S),
        TrainingJob("short", "train-resnet50", 0.0, SHORT_JOB_ENDS_S),
    )
    return ServingTrace(END_S, (a,), jobs)


def run(profiles: ProfileSet, trace: ServingTrace, policy: str, period: float, **kw: object) -> ServingResult:
    config = ServingSimConfig(
        policy=policy, gpus=2, cold_start_s=COLD_START_S, compaction_period_s=period, **kw  # type: ignore[arg-type]
    )
    return simulate_serving(trace, profiles, config)


def lit_after(r: ServingResult, t: float) -> set[int]:
    return {int(row[1]) for row in r.samples if row[0] > t}


@pytest.mark.parametrize(
    ("policy", "rate", "drained"),
    [
        ("dilu", 20, 0),
        ("mps-static", 20, 0),
        # At 50 requests/s an instance at its request is busy often: the original has a batch in
        # flight when the replacement is ready, finishes it, then goes.
        ("mps-static", 50, 1),
    ],
    ids=["dilu", "mps-static", "mps-static-original-busy"],
)
def test_compaction_empties_the_gpu_one_instance_keeps_lit(
    policy: str, rate: int, drained: int, synthetic_profiles: ProfileSet
) -> None:
    trace = layout(rate)
    off = run(synthetic_profiles, trace, policy, 0.0)
    on = run(synthetic_profiles, trace, policy, 30.0)
    # Without compaction both GPUs stay lit to the end; with it, one move turns GPU 1 off.
    assert lit_after(off, SHORT_JOB_ENDS_S) == {2}
    assert lit_after(on, SHORT_JOB_ENDS_S + 30.0) == {1}
    assert on.summary["compaction_moves"] == 1 and on.details["compaction"]["done"] == 1
    assert on.details["compaction"]["drained"] == drained
    assert on.summary["cold_starts"] == off.summary["cold_starts"] + 1
    assert on.functions["a"]["instances_started"] == off.functions["a"]["instances_started"] + 1
    # Runs at 1, 31, 61 s…: the one at 61 s moves; GPU 1 is lit until the replacement serves, 2 s later.
    saved = off.summary["gpu_seconds"] - on.summary["gpu_seconds"]
    assert saved == pytest.approx(END_S - (SHORT_JOB_ENDS_S + 1.0 + COLD_START_S), abs=1.0)
    # Make-before-break: the original serves until the replacement does; no request is dropped or
    # waits out the cold start.
    assert on.summary["dropped"] == off.summary["dropped"] == 0
    assert on.summary["completed"] == off.summary["completed"] == trace.requests
    assert on.functions["a"]["slo_violations"] == off.functions["a"]["slo_violations"]
    assert on.functions["a"]["latency_p99_ms"] == pytest.approx(off.functions["a"]["latency_p99_ms"], rel=0.05)
    assert on.summary["throughput_per_gpu"] > off.summary["throughput_per_gpu"] * 1.5


@pytest.mark.parametrize("policy", ["dilu", "mps-static"])
def test_nothing_moves_while_the_function_is_in_a_burst(policy: str, synthetic_profiles: ProfileSet) -> None:
    # From 50 s on, arrivals exceed what its one instance (max-instances 1) serves: never calm.
    trace = layout(20, burst=600)
    one = HorizontalConfig(max_instances=1)
    off = run(synthetic_profiles, trace, policy, 0.0, horizontal=one)
    on = run(synthetic_profiles, trace, policy, 30.0, horizontal=one)
    assert on.details["compaction"]["runs"] == 8
    assert on.summary["compaction_moves"] == 0
    assert lit_after(on, SHORT_JOB_ENDS_S) == {2}
    assert on.summary["dropped"] > 0  # the burst is real: it overruns the instance
    # Runs that move nothing change nothing.
    assert on.summary == off.summary


def test_an_original_the_scaler_removes_mid_move_leaves_an_ordinary_instance(synthetic_profiles: ProfileSet) -> None:
    # 300 requests/s for 40 s scale the function out (its instances land on GPU 1), then 30/s: once GPU 0
    # has room, a run moves both instances of GPU 1; with a 20 s start, the scaler removes one original
    # (the emptiest GPU's idle instance) before its replacement serves.
    counts = np.full(int(END_S), 30, dtype=np.int64)
    counts[:40] = 300
    base = layout(0)
    trace = ServingTrace(END_S, (FunctionTrace("a", "bert-base", counts, bin_s=1.0),), base.jobs)
    config = ServingSimConfig(policy="dilu", gpus=2, cold_start_s=20.0, compaction_period_s=30.0)
    r = simulate_serving(trace, synthetic_profiles, config)
    c = r.details["compaction"]
    assert (c["moves"], c["done"], c["promoted"]) == (2, 1, 1)
    # The promoted replacement is an instance the scaler counts: it scales in to one, and GPU 1 is dark.
    assert r.samples[-1][1:3] == (1, 2)  # lit GPUs, instances (the function's one and the long job)
    assert r.summary["dropped"] == 0


def test_period_zero_runs_no_compaction(synthetic_profiles: ProfileSet) -> None:
    r = run(synthetic_profiles, layout(20), "dilu", 0.0)
    assert r.details["compaction"] == {
        "period_s": 0.0, "max_moves": 2, "runs": 0, "moves": 0, "done": 0, "drained": 0, "promoted": 0,
        "gpus_freed_planned": 0,
    }
    assert r.summary["compaction_moves"] == 0
    assert lit_after(r, SHORT_JOB_ENDS_S) == {2}
    # By default dilu compacts as the live balancer does (every 30 s), the baselines never.
    live = ServingSimConfig(policy="dilu", gpus=2).live_compaction()
    assert live is not None and live.period_s == 30.0 and live.config.max_moves == 2
    assert ServingSimConfig(policy="mps-static", gpus=2).live_compaction() is None
    assert ServingSimConfig(policy="dilu", gpus=2, compaction_period_s=0.0).live_compaction() is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("compaction_period_s", -1.0), ("compaction_period_s", float("nan")), ("compaction_max_moves", 0)],
)
def test_compaction_settings_are_checked(field: str, value: float, synthetic_profiles: ProfileSet) -> None:
    with pytest.raises(ValueError, match=field):
        ServingSimConfig(policy="dilu", gpus=2, **{field: value})  # type: ignore[arg-type]
