"""Serving traces: the native format, the Azure 2019 schemas (per-app and per-function memory),
arrivals, and the synthetic generators."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from dilu_invoker.policy import InstanceClass
from dilu_invoker.sim import generate
from dilu_invoker.sim.profiles import ProfileSet
from dilu_invoker.sim.traces import (
    FunctionTrace,
    ServingTrace,
    TraceError,
    TrainingJob,
    arrivals,
    load_trace,
    write_azure,
)


def test_arrivals_fall_in_their_bins_sorted() -> None:
    fn = FunctionTrace("f", "resnet50", np.array([3, 0, 2]), bin_s=10.0, start_s=5.0)
    t = arrivals(fn, np.random.default_rng(1))
    assert len(t) == 5 and np.all(np.diff(t) >= 0)
    assert np.all((t[:3] >= 5) & (t[:3] < 15)) and np.all((t[3:] >= 25) & (t[3:] < 35))


def test_native_roundtrip(tmp_path: Path, synthetic_profiles: ProfileSet) -> None:
    tr = ServingTrace(
        120.0,
        (FunctionTrace("f", "resnet50", np.array([1, 2]), bin_s=60.0, slo_ms=30.0),),
        (TrainingJob("t", "train-resnet50", 10.0, 100.0),),
        "test",
    )
    for name in ("t.jsonl", "t.jsonl.gz"):
        tr.write(tmp_path / name)
        again = load_trace(tmp_path / name, synthetic_profiles)
        assert again.duration_s == 120.0 and again.requests == 3
        assert again.functions[0].slo_ms == 30.0 and list(again.functions[0].counts) == [1, 2]
        assert again.jobs == tr.jobs


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"format": "x"}'], "first line must be the header"),
        (['{"format": "dilu-serving-trace"}'], "no functions"),
        (['{"format": "dilu-serving-trace"}', '{"function": "f", "profile": "resnet50", "counts": [1, -1]}'], "counts must be"),
        (['{"format": "dilu-serving-trace"}', '{"function": "f", "profile": "resnet50", "counts": [1]}',
          '{"function": "f", "profile": "resnet50", "counts": [1]}'], "appears twice"),
        (['{"format": "dilu-serving-trace"}', '{"function": "f", "profile": "nope", "counts": [1]}'], "no profile named"),
        (['{"format": "dilu-serving-trace"}', '{"function": "f", "profile": "train-resnet50", "counts": [1]}'], "training profile"),
        (['{"format": "dilu-serving-trace"}', '{"function": "t", "profile": "resnet50", "class": "training", "start_s": 5, "end_s": 9}'], "not a training profile"),
        (['{"format": "dilu-serving-trace"}', '{"function": "t", "profile": "train-resnet50", "class": "training", "start_s": 9, "end_s": 5}'], "start_s < end_s"),
    ],
    ids=["header", "empty", "negative", "duplicate", "unknown-profile", "training-as-inference", "inference-as-training", "backwards-job"],
)
def test_native_errors(tmp_path: Path, synthetic_profiles: ProfileSet, lines: list[str], message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises((TraceError, ValueError), match=message):
        load_trace(path, synthetic_profiles)


def _azure(tmp_path: Path, per_function_memory: bool) -> Path:
    rng = np.random.default_rng(3)
    fns = generate.azure_style_functions(4, mean_rate=1.0, rng=rng, minutes=30)
    paths = write_azure(fns, tmp_path, per_function_memory=per_function_memory)
    if not per_function_memory:
        assert not (tmp_path / "memory.csv").exists()
    return paths[0]


@pytest.mark.parametrize("per_function", [False, True], ids=["per-app-memory", "per-function-memory"])
def test_azure_files_load_with_either_memory_schema(
    tmp_path: Path, synthetic_profiles: ProfileSet, per_function: bool
) -> None:
    inv = _azure(tmp_path, per_function)
    memory = tmp_path / ("memory.csv" if per_function else "app_memory_percentiles.anon.d01.csv")
    tr = load_trace(inv, synthetic_profiles, memory=memory)
    with inv.open() as fh:
        rows = list(csv.reader(fh))
    assert rows[0][:4] == ["HashOwner", "HashApp", "HashFunction", "Trigger"] and rows[0][4] == "1"
    total = sum(int(c) for row in rows[1:] for c in row[4:])
    assert tr.requests == total and tr.duration_s == 30 * 60.0
    assert all(f.bin_s == 60.0 for f in tr.functions)
    assert all("host_memory_mb" in f.meta and "duration_ms" in f.meta for f in tr.functions)
    # Longer functions get the slower model.
    by_dur = sorted(tr.functions, key=lambda f: f.meta["duration_ms"])
    slow = max(synthetic_profiles.names(training=False), key=lambda n: synthetic_profiles[n].latency_ms(synthetic_profiles[n].recommended.request, 1))
    assert by_dur[-1].profile == slow


def test_azure_without_durations_assigns_profiles_by_hash(tmp_path: Path, synthetic_profiles: ProfileSet) -> None:
    inv = _azure(tmp_path, False)
    (tmp_path / "function_durations_percentiles.anon.d01.csv").unlink()
    a = load_trace(inv, synthetic_profiles, seed=1)
    b = load_trace(inv, synthetic_profiles, seed=1)
    assert [f.profile for f in a.functions] == [f.profile for f in b.functions]
    assert all("duration_ms" not in f.meta for f in a.functions)


def test_azure_top_keeps_the_most_invoked(tmp_path: Path, synthetic_profiles: ProfileSet) -> None:
    inv = _azure(tmp_path, False)
    full = load_trace(inv, synthetic_profiles)
    top = load_trace(inv, synthetic_profiles, top=2)
    assert len(top.functions) == 2
    assert sorted(f.requests for f in top.functions) == sorted(f.requests for f in full.functions)[-2:]


@pytest.mark.parametrize(
    ("header", "row", "message"),
    [
        ("HashOwner,HashApp,Trigger,1", "o,a,http,1", "missing column"),
        ("HashOwner,HashApp,HashFunction,Trigger", "o,a,f,http", "no per-minute columns"),
        ("HashOwner,HashApp,HashFunction,Trigger,1,2", "o,a,f,http,1,-2", "negative count"),
        ("HashOwner,HashApp,HashFunction,Trigger,1,2", "o,a,f,http,1,x", "must be integers"),
    ],
    ids=["no-hashfunction", "no-minutes", "negative", "text"],
)
def test_azure_errors(tmp_path: Path, synthetic_profiles: ProfileSet, header: str, row: str, message: str) -> None:
    path = tmp_path / "invocations_per_function_md.anon.d01.csv"
    path.write_text(header + "\n" + row + "\n")
    with pytest.raises(TraceError, match=message):
        load_trace(path, synthetic_profiles)


def test_unknown_file_kind(tmp_path: Path, synthetic_profiles: ProfileSet) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="neither"):
        load_trace(path, synthetic_profiles)


# -- generators ------------------------------------------------------------------------------------


def test_dilu_mix_proportions_and_lifetimes() -> None:
    events = generate.dilu_mix(1000, train_fraction=0.2, seed=2)
    creates = [e for e in events if e.spec is not None]
    deletes = {e.instance: e.t for e in events if e.spec is None}
    by_class = {c: [e for e in creates if e.spec.cls is c] for c in InstanceClass}
    assert len(creates) == 1000
    assert len(by_class[InstanceClass.LLM]) == 200 and len(by_class[InstanceClass.TRAINING]) == 200
    assert len(deletes) == 600 + 100
    start = {e.instance: e.t for e in creates}
    for e in creates:
        s = e.spec
        assert s.sm_request <= s.sm_limit <= 1.0
        if s.cls is InstanceClass.TRAINING:
            assert s.gpus in (2, 4) and s.mem_gib_per_gpu in (25, 30, 35, 40)
            if e.instance in deletes:
                assert 600 <= deletes[e.instance] - start[e.instance] <= 900
        elif s.cls is InstanceClass.LLM:
            assert 20 <= s.mem_gib_per_gpu <= 30 and 0.4 <= s.sm_request <= 0.6
        else:
            assert 3 <= s.mem_gib_per_gpu <= 10 and 0.2 <= s.sm_request <= 0.4
            if e.instance in deletes:
                assert 60 <= deletes[e.instance] - start[e.instance] <= 180
    assert sorted(start.values()) == [float(i) for i in range(1000)]
    assert generate.dilu_mix(1000, seed=2) == events


@pytest.mark.parametrize("pattern", ["poisson", "gamma", "bursty", "periodic", "azure"])
def test_patterns_hit_their_mean_rate(pattern: str) -> None:
    tr = generate.serving_trace(pattern, functions=4, duration_s=7200, rate=20.0, profiles=["resnet50"], seed=4)
    mean = tr.requests / 7200
    assert mean == pytest.approx(20.0, rel=0.25)
    again = generate.serving_trace(pattern, functions=4, duration_s=7200, rate=20.0, profiles=["resnet50"], seed=4)
    assert [list(f.counts) for f in again.functions] == [list(f.counts) for f in tr.functions]


def test_gamma_cv_orders_burstiness() -> None:
    rng = np.random.default_rng(1)
    low = generate.gamma_counts(50.0, 0.5, 2000, rng)
    high = generate.gamma_counts(50.0, 4.0, 2000, rng)
    assert np.std(high) > 2 * np.std(low)


def test_bursty_has_bursts() -> None:
    c = generate.bursty_counts(10.0, 3600, np.random.default_rng(2), burst_factor=8.0)
    assert c.max() > 4 * np.median(c)


def test_training_jobs_need_a_profile() -> None:
    with pytest.raises(ValueError):
        generate.serving_trace("poisson", functions=1, duration_s=60, rate=1, profiles=["resnet50"], training_jobs=1)
    tr = generate.serving_trace(
        "poisson", functions=1, duration_s=600, rate=1, profiles=["resnet50"],
        training_jobs=2, training_profiles=["train-resnet50"], training_duration_s=100,
    )
    assert len(tr.jobs) == 2 and all(j.end_s - j.start_s == pytest.approx(100) for j in tr.jobs)
    assert json.loads(json.dumps(tr.jobs[0].to_json()))["class"] == "training"
