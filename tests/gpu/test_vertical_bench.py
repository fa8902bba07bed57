"""The H200 benchmark of the vertical manager (bench/vertical): measurement helpers, the report, a dry run."""

from __future__ import annotations

import datetime
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dilu_invoker.policy.vertical_slo import SloConfig
from tests.gpu.support import REPO


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_vertical_{name}", REPO / "bench" / "vertical" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


h200 = _load("h200")
report = _load("report")
schedule = _load("schedule")


def test_latency_window_and_slo() -> None:
    res = {"start": 10.0, "arrivals": [10.1, 10.2, 10.3, 11.5], "completions": [10.105, 10.25, 10.31, 11.6]}
    whole = h200.latency(res, slo_ms=20.0)
    assert whole["n"] == 4 and whole["violations"] == pytest.approx(0.5)
    assert whole["p50_ms"] == pytest.approx(50.0) and whole["max_ms"] == pytest.approx(100.0)
    part = h200.latency(res, slo_ms=20.0, window=(10.0, 10.25))
    assert part["n"] == 2 and part["violations"] == pytest.approx(0.5) and part["offered_rps"] == pytest.approx(8.0)


def test_rates_and_windows() -> None:
    steps = [0.5, 1.0, 1.5, 2.0, 2.5]
    assert h200.rate(steps, 1.0, 2.0) == pytest.approx(2.0)
    assert h200.rate(steps, 2.0, 2.0) is None
    res = {"start": 0.0, "completions": [1.0, 3.0]}
    assert h200.window(res, {"steps": steps}, 5.0) == (0.0, 2.5)  # not past training's last step
    assert h200.window({"start": 0.0, "completions": []}, {}, 5.0) == (0.0, 5.0)


def test_vertical_config_overrides_are_the_slo_knobs() -> None:
    cfg = h200.vertical_config(["deadband=0.2", "dwell_s=0.3"])
    assert cfg == SloConfig(deadband=0.2, dwell_s=0.3)
    assert h200.vertical_config(["decrease=0.5"], cfg) == SloConfig(deadband=0.2, dwell_s=0.3, decrease=0.5)
    for bad, said in ((["busy_ceiling=0.8"], "SloConfig has no field 'busy_ceiling'"),  # a knob of the old policy
                      (["deadband=wide"], "deadband: 'wide' is not a number"),
                      (["decrease=1.5"], "decrease must be in (0, 1)")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            h200.vertical_config(bad)


def test_arrivals_follow_the_phases() -> None:
    arr = schedule.arrivals([[1.0, 200.0], [1.0, 0.0], [1.0, 50.0]], 3, 100.0)
    assert arr == sorted(arr) and all(100.0 < a < 103.0 for a in arr)
    assert not any(101.0 <= a < 102.0 for a in arr)  # a silent phase
    first, last = sum(a < 101.0 for a in arr), sum(a >= 102.0 for a in arr)
    assert first > last > 0
    assert arr == schedule.arrivals([[1.0, 200.0], [1.0, 0.0], [1.0, 50.0]], 3, 100.0)  # same seed, same load


def test_paced_arrivals_are_evenly_spaced() -> None:
    arr = schedule.arrivals([[1.0, 100.0], [0.5, 0.0], [1.0, 20.0]], 3, 10.0, "paced")
    first = [a for a in arr if a < 11.0]
    gaps = [b - a for a, b in itertools.pairwise(first)]
    assert len(first) == 99 and all(g == pytest.approx(0.01) for g in gaps)
    assert not any(11.0 <= a < 11.5 for a in arr)
    assert sum(a >= 11.5 for a in arr) == 19
    assert arr == schedule.arrivals([[1.0, 100.0], [0.5, 0.0], [1.0, 20.0]], 99, 10.0, "paced")  # no randomness
    with pytest.raises(ValueError, match="arrival process"):
        schedule.arrivals([[1.0, 1.0]], 1, 0.0, "bursty")


def test_report_of_a_partial_run_is_honest() -> None:
    doc = {
        "generated": "now", "command": "cmd", "machine": "GPU X",
        "steps": {
            "timeslice": {
                "solo_inference": {"p50_ms": 4.0, "p99_ms": 8.0},
                "calibration": {"training_solo_it_s": 30.0},
                "dynamic": {"inference": {"p50_ms": 4.5, "p99_ms": 9.0}, "training": {"it_s": 24.0, "vs_solo": 0.8}},
                "idle": {"training": {"it_s": 29.0, "vs_solo": 29 / 30}},
                "burst": {"inference_burst": {"violations": 0.02}, "reaction": {"first_cut_ms": 60.0}},
                "errors": {"static": "RuntimeError('worker died')"},
            },
            "mps": {"error": "Traceback ...\nRuntimeError: MPS daemon did not start (rc 1)"},
        },
    }
    md = report.Report(doc).render()
    assert ("| Time-slicing | default | 1.12 **met** | 80.0% **met** | 2.00% **not met** | 60 ms **met** | "
            "96.7% **met** |") in md
    assert "| MPS (100% threads each) + shim rates | default | — — | — — | — — | — — | — — |" in md
    assert "* step `mps`: RuntimeError: MPS daemon did not start (rc 1)" in md
    assert "* `timeslice/static`: RuntimeError('worker died')" in md
    assert "DRY RUN" not in md and "GPU X" in md
    assert "inference alone (this mode)" not in md  # the MPS step measured nothing


def test_report_shows_inference_alone_under_mps_against_the_time_sliced_solo() -> None:
    doc = {"steps": {"timeslice": {"solo_inference": {"p50_ms": 4.0, "p99_ms": 8.0}},
                     "mps": {"solo_inference": {"p50_ms": 5.0, "p99_ms": 10.0}}}}
    md = report.Report(doc).render()
    assert "| MPS + shim | inference alone (this mode) | 5.00 | 10.00 | 1.25 | — |" in md
    assert "| time-slicing | inference alone | 4.00 | 8.00 | 1.00 |" in md


def test_report_marks_a_dry_run() -> None:
    assert "DRY RUN" in report.Report({"dry_run": True, "steps": {}}).render()


@pytest.mark.slow
def test_dry_run_of_the_whole_pipeline(tmp_path: Path) -> None:
    """run_h200.sh with stand-in workers on the fake driver, under the real shim and the real manager."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DILU_", "LD_PRELOAD"))}
    env.update(OUT=str(tmp_path), DILU_BENCH_SCALE="0.05", PYTHON=sys.executable,
               DILU_BENCH_ARGS="--variant again: --mps-splits 50,50:30,70")
    out = subprocess.run(["bash", str(REPO / "bench" / "vertical" / "dry_run.sh")], env=env, capture_output=True,
                         text=True, timeout=400, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "machine.txt", "vertical.md", "vertical_log.txt", "vertical_results.json"]
    doc = json.loads((tmp_path / "vertical_results.json").read_text())
    assert doc["dry_run"] is True
    for name, step in doc["steps"].items():
        assert not step.get("error") and step.get("errors") == {}, (name, step.get("error"), step.get("errors"))
    ts, mps = doc["steps"]["timeslice"], doc["steps"]["mps"]
    for scenario in ("calibration", "solo_inference", "none", "static", "dynamic", "idle", "burst", "burst_solo"):
        assert scenario in ts, scenario
    for scenario in ("solo_inference", "none", "dynamic", "idle", "burst"):
        assert scenario in mps, scenario
    assert doc["steps"]["mps_static"]["static_mps_split"]["training"]["it_s"] > 0
    splits = doc["steps"]["mps_static"]["static_mps_splits"]
    assert list(splits) == ["50/50", "30/70"]
    assert splits["30/70"]["mps_percentages"] == {"inference": 30, "training": 70}
    capped = doc["steps"]["mps_capped"]
    assert capped["mps_percentages"] == {"inference": 100, "training": 70}
    assert {"none", "dynamic", "idle", "burst"} <= set(capped)
    assert doc["steps"]["timeslice"]["options"]["arrivals"] == "paced"
    # The manager really drove the workers: training's share fell while inference ran, and came back at idle.
    assert ts["dynamic"]["manager"]["mean_share"]["training"] < 1.0
    assert ts["idle"]["idle_mode_after_ms"] is not None
    md = (tmp_path / "vertical.md").read_text()
    assert "DRY RUN" in md and "| Time-slicing | default |" in md
    assert "| MPS (training ≤ 70% threads) + shim rates | default |" in md and "| MPS 30/70 |" in md
    assert "evenly spaced" in md
    assert "| MPS + shim | inference alone (this mode) |" in md
    assert "* policy variant `again`: the defaults again (a repeat" in md


def test_report_shows_each_seconds_p99_and_the_gpu_clocks(tmp_path: Path) -> None:
    # 3 s of 50 requests each; the second second has one 40 ms request in it.
    reqs = [[i / 50, 40.0 if i == 60 else 8.0] for i in range(150)]
    assert report.second_p99s({"requests": reqs}) == [8.0, 40.0, 8.0]
    assert report.second_p99s({"requests": reqs[:10]}) == []  # under 20 requests: no second to judge
    samples = tmp_path / "gpu_samples.csv"
    samples.write_text(
        "timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active\n"
        "2026/11/30 08:00:00.000, 1980 MHz, 500.00 W, 0x0000000000000000\n"
        "2026/11/30 08:00:01.500, 1410 MHz, 700.00 W, 0x0000000000000080\n"
        "2026/11/30 08:00:09.000, 345 MHz, 80.00 W, 0x0000000000000001\n"  # after the scenario: left out
        "Unable to determine the device handle\n")
    rows = report.read_samples(samples, "date: 2026-11-30T09:00:00+01:00\n")
    t0 = rows[0][0]
    # The machine's clock ran at +01:00: 08:00 there is 07:00 UTC.
    utc = datetime.datetime(2026, 11, 30, 7, 0, tzinfo=datetime.UTC).timestamp()
    assert len(rows) == 3 and t0 == pytest.approx(utc) and rows[1][0] == pytest.approx(utc + 1.5)
    doc = {"machine": "date: 2026-11-30T09:00:00+01:00",
           "steps": {"timeslice": {"solo_inference": {"p50_ms": 4.0, "p99_ms": 8.0},
                                   "dynamic": {"inference": {"p99_ms": 9.0}, "requests": reqs, "t0_unix": t0}}}}
    md = report.Report(doc, rows).render()
    assert "| time-slicing | dynamic | 2 | 1410–1980 | 600 / 700 | 0x0000000000000000, 0x0000000000000080 |" in md
    assert "| time-slicing | dynamic manager (default) | — | 9.00 | 1.12 | 8.0 / 40.0 |" in md
    assert "## GPU during each scenario" not in report.Report(doc).render()


def test_report_reads_gzipped_runs(tmp_path: Path) -> None:
    import gzip

    doc = {"steps": {"timeslice": {"solo_inference": {"p50_ms": 4.0, "p99_ms": 8.0}}}}
    src = tmp_path / "vertical_results_run99.json.gz"
    src.write_bytes(gzip.compress(json.dumps(doc).encode()))
    out = tmp_path / "vertical.md"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "vertical" / "report.py"), str(src), "--out", str(out)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "| time-slicing | inference alone | 4.00 | 8.00 | 1.00 |" in out.read_text()
