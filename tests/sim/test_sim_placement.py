"""The placement simulation: hand-computed small traces, the bound as a true bound, compaction and
splitting, determinism."""

from __future__ import annotations

import json
import math

import pytest

from dilu_invoker.sim.events import PlacementEvent, read_events
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import (
    PLACEMENT_POLICIES,
    SUMMARY_KEYS,
    PlacementSimConfig,
    cluster_size,
    simulate_placement,
)


def ev(t: float, op: str, inst: str, cls: str = "inference", gpus: int = 1, mem: float = 10.0,
       req: float = 0.3, lim: float = 0.5) -> str:
    if op == "delete":
        return json.dumps({"t": t, "op": op, "instance": inst})
    return json.dumps(
        {"t": t, "op": op, "instance": inst, "function": inst, "class": cls, "gpus": gpus,
         "mem_gib_per_gpu": mem, "sm_request": req, "sm_limit": lim}
    )


def run(lines: list[str], policy: str, **kw: object) -> tuple[dict, dict, list]:
    kw.setdefault("gpu_memory_gib", 40.0)
    r = simulate_placement(read_events(lines), PlacementSimConfig(policy=policy, **kw))  # type: ignore[arg-type]
    return r.summary, r.details, list(r.samples)


TWO = [ev(0, "create", "a"), ev(10, "create", "b"), ev(20, "delete", "a"), ev(30, "delete", "b")]


@pytest.mark.parametrize(
    ("policy", "peak", "gpu_seconds", "sm_frag", "mem_frag"),
    [
        # exclusive: 1 GPU for 10 s, 2 for 10 s, 1 for 10 s; every lit GPU holds one instance.
        ("exclusive", 2, 40.0, 0.7, 0.75),
        # dilu packs both on one GPU: SM frag 0.7, 0.4, 0.7; memory frag 0.75, 0.5, 0.75.
        ("dilu", 1, 30.0, 0.6, 2 / 3),
        ("infless-r", 1, 30.0, 0.6, 2 / 3),
        # infless-l reserves limits: 0.5 + 0.5 ≤ 1, so they share too.
        ("infless-l", 1, 30.0, 0.6, 2 / 3),
    ],
)
def test_two_instances_by_hand(policy: str, peak: int, gpu_seconds: float, sm_frag: float, mem_frag: float) -> None:
    s, d, _ = run(TWO, policy)
    assert tuple(s) == SUMMARY_KEYS
    assert s["policy"] == policy
    assert (s["events"], s["instances"], s["rejected"]) == (4, 2, 0)
    assert s["gpus_peak"] == peak
    assert s["gpu_seconds"] == pytest.approx(gpu_seconds)
    assert s["sm_fragmentation_mean"] == pytest.approx(sm_frag)
    assert s["mem_fragmentation_mean"] == pytest.approx(mem_frag)
    assert d["lower_bound_peak"] == 1 and d["lower_bound_mean"] == pytest.approx(1.0)
    assert d["gpus_mean"] == pytest.approx(gpu_seconds / 30.0, abs=1e-3)
    assert d["peak_vs_bound"] == pytest.approx(peak / 1)


def test_rejections_are_counted_and_the_bound_still_counts_the_demand() -> None:
    s, d, samples = run(TWO, "exclusive", gpus=1, gpus_per_node=1)
    assert s["rejected"] == 1 and s["gpus_peak"] == 1
    assert max(x.lower_bound for x in samples) == 1
    assert d["unknown_deletes"] == 0


def test_unknown_delete_is_counted_not_fatal() -> None:
    _, d, _ = run([ev(0, "create", "a"), ev(1, "delete", "ghost")], "dilu")
    assert d["unknown_deletes"] == 1


def test_creating_a_live_instance_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="created while it is live"):
        run([ev(0, "create", "a"), ev(1, "create", "a")], "dilu")


# Training gang on 2 GPUs of one node (25 GiB each), then an LLM of 25 GiB.
SPLIT_TRACE = [
    ev(0, "create", "train", cls="training", gpus=2, mem=25, req=0.4, lim=0.6),
    ev(1, "create", "llm", cls="llm", mem=25, req=0.5, lim=0.7),
    ev(10, "delete", "llm"),
    ev(20, "delete", "train"),
]


def test_dilu_splits_an_llm_into_the_training_gpus_holes() -> None:
    s, d, samples = run(SPLIT_TRACE, "dilu", gpus_per_node=2, gpus=4)
    assert s["gpus_peak"] == 2 and d["split_instances"] == 1
    # The bound counts the LLM once: ⌈(50 + 25) / 40⌉ = 2.
    assert d["lower_bound_peak"] == 2
    # Its pieces leave with it: back to the training gang alone.
    assert [x.lit_gpus for x in samples if x.t == 10.0] == [2]


@pytest.mark.parametrize(
    ("policy", "kw"),
    [("dilu", {"llm_split_parts": 1}), ("infless-r", {}), ("fastgs", {})],
    ids=["dilu-no-split", "infless-r", "fastgs"],
)
def test_without_splitting_the_llm_lights_a_third_gpu(policy: str, kw: dict) -> None:
    s, d, _ = run(SPLIT_TRACE, policy, gpus_per_node=2, gpus=4, **kw)
    assert s["gpus_peak"] == 3 and d["split_instances"] == 0


HOLES = [
    ev(0, "create", "x", mem=30, req=0.6, lim=0.8),
    ev(1, "create", "y", mem=30, req=0.6, lim=0.8),
    ev(2, "create", "z", mem=8, req=0.3, lim=0.4),
    ev(3, "create", "w", mem=8, req=0.3, lim=0.4),
    ev(4, "delete", "x"),
    ev(5, "delete", "y"),
    ev(6, "create", "v", mem=1, req=0.1, lim=0.2),
    ev(50, "delete", "v"),
]


def test_compaction_closes_holes_at_a_reported_cold_start_cost() -> None:
    s0, d0, samples0 = run(HOLES, "dilu", compact_every_s=0.0)
    s1, d1, samples1 = run(HOLES, "dilu", compact_every_s=1.0)
    assert d0["compaction_moves"] == 0
    assert d1["compaction_moves"] >= 1
    assert d1["compaction_cold_starts"] == d1["compaction_moves"]
    assert [x.lit_gpus for x in samples0 if x.t == 6.0] == [2]
    assert [x.lit_gpus for x in samples1 if x.t == 6.0] == [1]
    assert s1["gpu_seconds"] < s0["gpu_seconds"]


@pytest.mark.parametrize("policy", PLACEMENT_POLICIES)
def test_the_lower_bound_bounds_every_policy_at_every_moment(policy: str) -> None:
    events = dilu_mix(200, seed=3)
    r = simulate_placement(events, PlacementSimConfig(policy=policy, gpu_memory_gib=40.0, compact_every_s=10.0))
    assert r.summary["rejected"] == 0
    assert all(x.lower_bound <= x.integral_bound <= x.lit_gpus for x in r.samples)
    assert any(x.integral_bound > x.lower_bound for x in r.samples)  # tighter on this mix
    # The bound at each moment, recomputed from the live instances of the trace alone.
    live: dict[str, tuple[int, float, float]] = {}
    expected: dict[float, int] = {}
    for e in events:
        if e.spec is not None:
            live[e.instance] = (e.spec.gpus, e.spec.sm_request, e.spec.memory_mib)
        else:
            live.pop(e.instance, None)
        sm = sum(g * q for g, q, _ in live.values())
        mem = sum(g * m for g, _, m in live.values())
        widest = max((g for g, _, _ in live.values()), default=0)
        expected[e.t] = max(math.ceil(sm - 1e-6), math.ceil(mem / (40 * 1024) - 1e-6), widest, 0)
    got = {x.t: x.lower_bound for x in r.samples}
    assert {t: got[t] for t in expected} == expected


def test_deterministic() -> None:
    events = dilu_mix(150, seed=5)
    cfg = PlacementSimConfig(policy="dilu", gpu_memory_gib=40.0, compact_every_s=10.0)
    a = simulate_placement(events, cfg)
    b = simulate_placement(events, cfg)
    assert a.summary == b.summary and a.samples == b.samples


def test_split_lighting_is_a_setting_of_dilu_and_deterministic() -> None:
    events = dilu_mix(400, train_fraction=0.2, llm_fraction=0.4, seed=1)
    base = PlacementSimConfig(policy="dilu", gpu_memory_gib=40.0, compact_every_s=2.0)
    cfg = PlacementSimConfig(policy="dilu", gpu_memory_gib=40.0, compact_every_s=2.0, light_split_min_share=0.0)
    assert base.placement_config().light_split_min_share is None
    assert cfg.placement_config().light_split_min_share == 0.0
    a, b, off = simulate_placement(events, cfg), simulate_placement(events, cfg), simulate_placement(events, base)
    assert a.summary == b.summary and a.samples == b.samples
    # LLMs that lit a GPU whole are split at creation instead: more splits, nothing refused.
    assert a.details["split_instances"] > off.details["split_instances"]
    assert a.summary["rejected"] == off.summary["rejected"] == 0


def test_cluster_size_covers_the_peak_demand_in_whole_nodes() -> None:
    events = read_events(
        [ev(0, "create", "g", cls="training", gpus=4, mem=30, req=0.5, lim=0.7), ev(1, "create", "i")]
    )
    n = cluster_size(events, 4)
    assert n % 4 == 0 and n >= 5


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        PlacementSimConfig(policy="nope")
    with pytest.raises(ValueError):
        PlacementSimConfig(policy="dilu", gpu_memory_gib=0)
    with pytest.raises(ValueError):
        PlacementSimConfig(policy="dilu", compact_every_s=-1)
    with pytest.raises(ValueError, match="light_split_min_share"):
        PlacementSimConfig(policy="dilu", light_split_min_share=1.0).placement_config()


def test_events_for_generated_mix_are_valid_placement_events() -> None:
    events = dilu_mix(100, seed=1)
    assert all(isinstance(e, PlacementEvent) for e in events)


@pytest.mark.parametrize(
    ("lines", "runs"),
    [
        # Creates only: nothing ever opens a hole, so compaction never runs.
        ([ev(t, "create", f"i{t}") for t in range(6)], 0),
        # One departure at t=2: one run, at the next event after it (t=3), none after.
        ([ev(t, "create", f"i{t}") for t in range(6)] + [ev(2, "delete", "i0")], 1),
        # Departures at t=1 and t=4: a run after each.
        (
            [ev(t, "create", f"i{t}") for t in range(6)]
            + [ev(1, "delete", "i0"), ev(4, "delete", "i1")],
            2,
        ),
    ],
)
def test_compaction_runs_only_after_a_departure(lines: list[str], runs: int) -> None:
    lines = sorted(lines, key=lambda line: json.loads(line)["t"])
    _, d, _ = run(lines, "dilu", compact_every_s=1.0)
    assert d["compaction_runs"] == runs
    # Each run's CPU is kept: the quantiles are ordered, and the slowest is within the total (zeros without a run).
    per_run = d["compaction_run_cpu_s"]
    assert set(per_run) == {"p50", "p99", "max"}
    assert 0.0 <= per_run["p50"] <= per_run["p99"] <= per_run["max"] <= d["compaction_cpu_s"] + 1e-3
    if not runs:
        assert per_run == {"p50": 0.0, "p99": 0.0, "max": 0.0} and d["compaction_cpu_s"] == 0.0


@pytest.mark.parametrize(
    ("lines", "fractional", "integral"),
    [
        # Two 2-GPU gangs of 30 GiB per GPU on 40 GiB GPUs: 120 GiB fit 3 GPUs by memory, but no two
        # 30 GiB slots share a GPU: 4.
        (
            [ev(0, "create", "t1", cls="training", gpus=2, mem=30, req=0.3, lim=0.5),
             ev(1, "create", "t2", cls="training", gpus=2, mem=30, req=0.3, lim=0.5)],
            3,
            4,
        ),
        # Slots of 20 GiB are not over half a GPU; requests of 0.6 are: 4 GPUs by request.
        (
            [ev(0, "create", "t1", cls="training", gpus=2, mem=20, req=0.6, lim=0.8),
             ev(1, "create", "t2", cls="training", gpus=2, mem=20, req=0.6, lim=0.8)],
            3,
            4,
        ),
        # Inference (and LLMs) are filler even when large: the bounds agree.
        (
            [ev(0, "create", "a", mem=30, req=0.3), ev(1, "create", "b", mem=30, req=0.3),
             ev(2, "create", "c", cls="llm", mem=30, req=0.3)],
            3,
            3,
        ),
        # Filler beyond the large slots' holes: 2 slots of 30 GiB + 3 × 20 GiB = 120 GiB → 3 by
        # memory, 2 large slots: the fractional bound binds.
        (
            [ev(0, "create", "t", cls="training", gpus=2, mem=30, req=0.3, lim=0.5),
             ev(1, "create", "a", mem=20), ev(2, "create", "b", mem=20), ev(3, "create", "c", mem=20)],
            3,
            3,
        ),
    ],
    ids=["large-memory-slots", "large-request-slots", "filler-only", "filler-binds"],
)
def test_integral_bound(lines: list[str], fractional: int, integral: int) -> None:
    for policy in PLACEMENT_POLICIES:
        s, d, samples = run(lines, policy)
        assert d["lower_bound_peak"] == fractional
        assert d["integral_bound_peak"] == integral
        assert s["gpus_peak"] >= integral  # a true bound for every policy
        assert d["peak_vs_integral"] == pytest.approx(s["gpus_peak"] / integral, abs=1e-4)
        assert all(x.integral_bound >= x.lower_bound for x in samples)
