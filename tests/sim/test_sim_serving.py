"""The serving simulation's mechanics on small traces, with expectations derived from the (synthetic)
profile: each policy's share rule, training progress, drops, cold starts, scaling, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from dilu_invoker.policy.vertical_slo import SloConfig, StaticConfig
from dilu_invoker.sim.profiles import ProfileSet
from dilu_invoker.sim.serving import (
    SERVING_POLICIES,
    SUMMARY_KEYS,
    ServingSimConfig,
    simulate_serving,
)
from dilu_invoker.sim.traces import FunctionTrace, ServingTrace, TrainingJob


def trace(*fns: FunctionTrace, jobs: tuple[TrainingJob, ...] = (), duration: float | None = None) -> ServingTrace:
    end = max([f.end_s for f in fns] + [j.end_s for j in jobs])
    return ServingTrace(duration or end, tuple(fns), jobs)


def sparse(name: str = "f", profile: str = "resnet50", minutes: int = 10, per_minute: int = 6) -> FunctionTrace:
    """A few requests a minute: each finds an idle instance and runs alone at batch 1."""
    return FunctionTrace(name, profile, np.full(minutes, per_minute, dtype=np.int64), bin_s=60.0)


def cfg(policy: str, **kw: object) -> ServingSimConfig:
    kw.setdefault("gpus", 2)
    kw.setdefault("cold_start_s", 0.0)
    return ServingSimConfig(policy=policy, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", SERVING_POLICIES)
def test_summary_has_every_metric_and_adds_up(policy: str, synthetic_profiles: ProfileSet) -> None:
    r = simulate_serving(trace(sparse()), synthetic_profiles, cfg(policy))
    s = r.summary
    assert tuple(s) == SUMMARY_KEYS and s["policy"] == policy
    assert s["requests"] == 60
    assert s["completed"] + s["dropped"] == s["requests"]
    assert s["throughput"] == pytest.approx(s["completed"] / 600.0, rel=1e-3)
    assert s["throughput_per_gpu"] == pytest.approx(s["completed"] / s["gpu_seconds"], rel=1e-3)
    assert s["cold_starts"] >= 1 and s["gpus_peak"] == 1
    assert sum(f["requests"] for f in r.functions.values()) == s["requests"]
    assert r.samples and len(r.samples[0]) == 10


@pytest.mark.parametrize(
    ("policy", "share_of"),
    [
        ("exclusive", lambda p: (1.0, 1.0)),
        ("tgs", lambda p: (1.0, 1.0)),
        # MPS-style static partition at the request.
        ("mps-static", lambda p: (p.recommended.request, 1.0)),
        # A fixed time quota at the limit: the whole GPU for that fraction of the time.
        ("static-quota", lambda p: (1.0, p.recommended.limit)),
    ],
)
def test_a_lone_request_takes_the_profiles_latency_under_each_share_rule(
    policy: str, share_of: object, synthetic_profiles: ProfileSet
) -> None:
    prof = synthetic_profiles["resnet50"]
    share, quota = share_of(prof)  # type: ignore[operator]
    expected = prof.latency_ms(share, 1) / quota
    r = simulate_serving(trace(sparse()), synthetic_profiles, cfg(policy))
    # The first request waits for the instance to be decided (≤ 1 s tick); the rest run alone.
    assert r.summary["latency_p50_ms"] == pytest.approx(expected, rel=1e-3)


def test_dilu_runs_a_lone_instance_up_to_its_limit(synthetic_profiles: ProfileSet) -> None:
    prof = synthetic_profiles["resnet50"]
    r = simulate_serving(trace(sparse()), synthetic_profiles, cfg("dilu"))
    p50 = r.summary["latency_p50_ms"]
    assert p50 <= prof.latency_ms(prof.recommended.limit, 1) * 1.001
    assert p50 < prof.latency_ms(prof.recommended.request, 1)


@pytest.mark.parametrize(
    ("policy", "share"),
    [("exclusive", 1.0), ("static-quota", None), ("mps-static", "request")],
)
def test_training_progress_follows_the_profile(policy: str, share: object, synthetic_profiles: ProfileSet) -> None:
    prof = synthetic_profiles["train-resnet50"]
    b = prof.recommended.batch
    if share == "request":
        rate = prof.throughput_rps(prof.recommended.request, b)
    elif share is None:
        rate = prof.throughput_rps(1.0, b) * prof.recommended.limit
    else:
        rate = prof.throughput_rps(1.0, b)
    job = TrainingJob("t", "train-resnet50", 10.0, 110.0)
    quiet = FunctionTrace("f", "resnet50", np.zeros(2, dtype=np.int64), bin_s=60.0)
    r = simulate_serving(trace(quiet, jobs=(job,)), synthetic_profiles, cfg(policy))
    assert r.summary["training_samples"] == pytest.approx(rate * 100.0, rel=2e-3)


def test_tgs_lets_training_run_beside_production_and_yields_to_it(synthetic_profiles: ProfileSet) -> None:
    prof = synthetic_profiles["train-resnet50"]
    full = prof.throughput_rps(1.0, prof.recommended.batch) * 100.0
    job = TrainingJob("t", "train-resnet50", 0.0, 100.0)
    busy = FunctionTrace("f", "resnet50", np.full(100, 200, dtype=np.int64), bin_s=1.0)
    r = simulate_serving(trace(busy, jobs=(job,)), synthetic_profiles, cfg("tgs", gpus=1))
    assert 0 < r.summary["training_samples"] < full
    assert r.summary["gpus_peak"] == 1


def test_requests_with_no_gpu_are_dropped_after_the_timeout(synthetic_profiles: ProfileSet) -> None:
    a = FunctionTrace("a", "resnet50", np.full(5, 30, dtype=np.int64), bin_s=60.0)
    b = FunctionTrace("b", "bert-base", np.full(5, 30, dtype=np.int64), bin_s=60.0)
    r = simulate_serving(trace(a, b), synthetic_profiles, cfg("exclusive", gpus=1, timeout_s=5.0))
    s = r.summary
    starved = [f for f in r.functions.values() if f["completed"] == 0]
    assert len(starved) == 1 and starved[0]["slo_violations"] == starved[0]["requests"] == 150
    assert s["dropped"] >= 150
    assert s["slo_violation_rate"] >= 0.5


def test_idle_functions_scale_to_zero_and_cold_start_again(synthetic_profiles: ProfileSet) -> None:
    counts = np.zeros(16, dtype=np.int64)
    counts[0] = 20
    counts[15] = 20  # 14 idle minutes > the 600 s idle timeout
    f = FunctionTrace("f", "resnet50", counts, bin_s=60.0)
    r = simulate_serving(trace(f), synthetic_profiles, cfg("dilu", cold_start_s=2.0))
    assert r.summary["cold_starts"] == 2
    assert r.summary["completed"] == 40
    # While scaled to zero nothing is lit.
    lit_mid = [row[1] for row in r.samples if 12 * 60 <= row[0] <= 14 * 60]
    assert lit_mid and all(x == 0 for x in lit_mid)


def test_sustained_load_scales_out(synthetic_profiles: ProfileSet) -> None:
    prof = synthetic_profiles["resnet50"]
    cap = prof.throughput_rps(prof.recommended.request, prof.recommended.batch)
    rate = int(cap * 3)
    f = FunctionTrace("f", "resnet50", np.full(120, rate, dtype=np.int64), bin_s=1.0)
    r = simulate_serving(trace(f), synthetic_profiles, cfg("mps-static", gpus=4))
    assert r.functions["f"]["instances_started"] >= 3


def test_deterministic_for_a_seed_and_seed_dependent(synthetic_profiles: ProfileSet) -> None:
    f = FunctionTrace("f", "bert-base", np.full(30, 40, dtype=np.int64), bin_s=10.0)
    t = trace(f, sparse("g"))
    a = simulate_serving(t, synthetic_profiles, cfg("dilu", seed=7))
    b = simulate_serving(t, synthetic_profiles, cfg("dilu", seed=7))
    c = simulate_serving(t, synthetic_profiles, cfg("dilu", seed=8))
    assert a.summary == b.summary and a.samples == b.samples
    assert a.summary["latency_p99_ms"] != c.summary["latency_p99_ms"] or a.samples != c.samples


def test_dilu_keeps_inference_latency_beside_training(synthetic_profiles: ProfileSet) -> None:
    # One GPU, a training job and a steady inference function: the vertical policy must keep the
    # inference within its SLO while training takes what is left.
    job = TrainingJob("t", "train-resnet50", 0.0, 300.0)
    f = FunctionTrace("f", "resnet50", np.full(300, 50, dtype=np.int64), bin_s=1.0)
    r = simulate_serving(trace(f, jobs=(job,)), synthetic_profiles, cfg("dilu", gpus=1))
    assert r.summary["gpus_peak"] == 1
    assert r.summary["training_samples"] > 0
    assert r.functions["f"]["latency_p50_ms"] < synthetic_profiles["resnet50"].slo_ms


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown serving policy"):
        ServingSimConfig(policy="nope", gpus=1)
    with pytest.raises(ValueError):
        ServingSimConfig(policy="dilu", gpus=0)
    with pytest.raises(ValueError):
        ServingSimConfig(policy="dilu", gpus=1, timeout_s=0)


@pytest.mark.parametrize("vertical", [SloConfig(), StaticConfig()], ids=["slo", "static"])
def test_dilu_runs_either_vertical_policy(vertical: SloConfig | StaticConfig,
                                          synthetic_profiles: ProfileSet) -> None:
    # The same scenario as above under each vertical policy: the simulator calls the policy the config
    # selects (slo by default), which keeps inference within its SLO while training makes progress.
    assert ServingSimConfig(policy="dilu", gpus=1).vertical == SloConfig()
    job = TrainingJob("t", "train-resnet50", 0.0, 300.0)
    f = FunctionTrace("f", "resnet50", np.full(300, 50, dtype=np.int64), bin_s=1.0)
    r = simulate_serving(trace(f, jobs=(job,)), synthetic_profiles, cfg("dilu", gpus=1, vertical=vertical))
    assert r.details["vertical_calls"] > 0 and r.summary["training_samples"] > 0
    assert r.functions["f"]["latency_p50_ms"] < synthetic_profiles["resnet50"].slo_ms


def test_preloaded_processes_hide_cold_starts_and_refill(synthetic_profiles: ProfileSet) -> None:
    # Two functions start on the one node: with one pre-loaded process the first start takes it (0.33 s),
    # the second finds the slot still refilling (a plain 4.2 s start; refilling is slowed so that their
    # random first arrivals cannot be far enough apart); with two, both are hidden.
    t = trace(sparse("a"), sparse("b"))
    node: dict[str, object] = {"gpus": 2, "gpus_per_node": 2, "cold_start_s": 4.2}
    plain = simulate_serving(t, synthetic_profiles, cfg("exclusive", **node))
    one = simulate_serving(t, synthetic_profiles, cfg("exclusive", **node, preload_per_node=1,
                                                      preload_refill_s=3600.0))
    two = simulate_serving(t, synthetic_profiles, cfg("exclusive", **node, preload_per_node=2))
    assert plain.details["preloaded_starts"] == 0 and plain.summary["cold_starts"] == 2
    assert one.details["preloaded_starts"] == 1 and one.details["plain_cold_starts"] == 1
    assert two.details["preloaded_starts"] == 2 and two.details["plain_cold_starts"] == 0
    # The first request of each function waits for its instance: hidden starts shorten the worst wait.
    assert two.summary["latency_p99_ms"] < plain.summary["latency_p99_ms"]
    with pytest.raises(ValueError, match="preload_per_node"):
        cfg("dilu", preload_per_node=-1)


def six_functions() -> ServingTrace:
    return trace(*(sparse(f"f{i}", minutes=3) for i in range(6)))


def test_packing_names_the_limit_when_sigma_limit_lights_the_second_gpu(synthetic_profiles: ProfileSet) -> None:
    # Six instances at request 0.1, limit 0.3: Σ limit ≤ 1.5 holds five per GPU, Σ request ≤ 1 ten.
    r = simulate_serving(six_functions(), synthetic_profiles, cfg("dilu", gamma=1.5))
    pk = r.details["packing"]
    assert r.summary["gpus_peak"] == 2
    assert pk["lit_by"] == {"none-lit": 1, "sm-limit-bound": 1}
    assert pk["instance_seconds"] == pytest.approx(pk["instances_per_lit_gpu"] * r.summary["gpu_seconds"], rel=1e-3)
    assert pk["limit_per_lit_gpu"] == pytest.approx(3 * pk["request_per_lit_gpu"], rel=1e-3)
    assert pk["request_per_lit_gpu"] <= 1.0


def test_a_larger_gamma_or_a_request_placement_packs_the_six_on_one_gpu(synthetic_profiles: ProfileSet) -> None:
    from dilu_invoker.policy import PlacementConfig

    for c in (cfg("dilu"), cfg("dilu", gamma=2.0), cfg("dilu", placement=PlacementConfig(strategy="infless-r")),
              cfg("mps-static")):
        r = simulate_serving(six_functions(), synthetic_profiles, c)
        assert r.summary["gpus_peak"] == 1, c
        assert r.details["packing"]["lit_by"] == {"none-lit": 1}
        assert r.details["placement_strategy"] == ("infless-r" if c.policy == "mps-static" or c.placement else "dilu")


def test_capacity_share_sizes_instances_at_the_request_or_is_refused(synthetic_profiles: ProfileSet) -> None:
    with pytest.raises(ValueError, match="capacity_share"):
        cfg("dilu", capacity_share="half")
    # Sized at its request, each dilu instance counts for less capacity: a heavy function gets more instances.
    heavy = FunctionTrace("h", "resnet50", np.full(2, 30000, dtype=np.int64), bin_s=60.0)
    at_limit = simulate_serving(trace(heavy), synthetic_profiles, cfg("dilu", gpus=4))
    at_request = simulate_serving(trace(heavy), synthetic_profiles, cfg("dilu", gpus=4, capacity_share="request"))
    assert at_request.details["packing"]["instance_seconds"] > at_limit.details["packing"]["instance_seconds"]


def test_training_has_its_own_interference_when_given(synthetic_profiles: ProfileSet) -> None:
    busy = FunctionTrace("f", "resnet50", np.full(2, 12000, dtype=np.int64), bin_s=60.0)
    t = trace(busy, jobs=(TrainingJob("t", "train-resnet50", 0.0, 120.0),))

    def samples(**kw: object) -> float:
        return simulate_serving(t, synthetic_profiles, cfg("mps-static", gpus=1, **kw)).summary["training_samples"]

    alone_k = samples(interference=0.0)
    slowed = samples(interference=0.5)
    assert slowed < alone_k * 0.99  # training beside busy inference, slowed by κ
    assert samples(interference=0.5, interference_training=0.0) == pytest.approx(alone_k, rel=1e-6)
    with pytest.raises(ValueError, match="interference_training"):
        cfg("dilu", interference_training=-1.0)
