"""`dilu-invoker profile` plumbing with real worker processes, on the dry-run formula (no GPU here):
the search's probes, the grid, the outputs, share-control selection and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dilu_invoker.policy import SearchConfig
from dilu_invoker.sim.profiler import (
    MpsShareControl,
    NoShareControl,
    ProfilerError,
    main,
    make_share_control,
)
from dilu_invoker.sim.profiles import load_profiles

FAST = ["--formula-scale", "0.01", "--warmup", "0", "--min-iters", "1", "--max-iters", "2", "--window-s", "0", "--quiet"]


def test_dry_run_compare_writes_profiles_and_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, runs = tmp_path / "p.json", tmp_path / "runs.json"
    rc = main(["--model", "resnet50", "--model", "train-resnet50", "--compare", "--dry-run",
               "--batches", "1,2,4", "--out", str(out), "--runs", str(runs), *FAST])
    assert rc == 0
    profiles = load_profiles(out)
    assert profiles.synthetic and "SYNTHETIC" in profiles.source
    inf, train = profiles["resnet50"], profiles["train-resnet50"]
    # The profile's points are the grid's: every share × batch once.
    assert len(inf.points) == 10 * 3 and len(train.points) == 10
    assert inf.recommended.request <= inf.recommended.limit
    raw = json.loads(runs.read_text())
    search, grid = raw["models"]["resnet50"]["search"], raw["models"]["resnet50"]["grid"]
    assert grid["probes"] == 30 and 0 < search["probes"] < grid["probes"]
    assert (search["points"][0]["sm_share"], search["points"][0]["batch"]) == (0.1, 1)
    assert raw["models"]["train-resnet50"]["search"]["method"] == "training"
    assert raw["command"].startswith("dilu-invoker profile --model resnet50")
    printed = capsys.readouterr().out
    assert "resnet50" in printed and "hybrid-growth" in printed


def test_exhaustive_only_runs_the_grid(tmp_path: Path) -> None:
    out, runs = tmp_path / "p.json", tmp_path / "r.json"
    assert main(["--model", "bert-base", "--exhaustive", "--dry-run", "--batches", "1,2",
                 "--out", str(out), "--runs", str(runs), *FAST]) == 0
    raw = json.loads(runs.read_text())["models"]["bert-base"]
    assert set(raw) == {"grid"} and raw["grid"]["probes"] == 20
    assert json.loads(out.read_text())["functions"]["bert-base"]["recommended_by"] == "grid"


def test_search_alone_is_the_default(tmp_path: Path) -> None:
    out, runs = tmp_path / "p.json", tmp_path / "r.json"
    assert main(["--model", "resnet50", "--dry-run", "--batches", "1,2,4,8", "--out", str(out), "--runs", str(runs), *FAST]) == 0
    raw = json.loads(runs.read_text())["models"]["resnet50"]
    assert set(raw) == {"search"} and raw["search"]["probes"] < 40
    assert json.loads(out.read_text())["functions"]["resnet50"]["points"]


def test_an_action_file_is_profiled_through_its_main(tmp_path: Path) -> None:
    action = tmp_path / "act.py"
    action.write_text("import time\ndef main(params):\n    time.sleep(0.0005 * params['batch'])\n    return {}\n")
    out = tmp_path / "p.json"
    rc = main(["--action", str(action), "--share-control", "none", "--batches", "1,2", "--step", "0.5",
               "--slo-ms", "1000", "--out", str(out), *FAST])
    assert rc == 0
    prof = load_profiles(out)["act"]
    assert prof.points and prof.recommended.batch in (1, 2)


def test_a_broken_action_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    action = tmp_path / "bad.py"
    action.write_text("x = 1\n")
    rc = main(["--action", str(action), "--share-control", "none", "--out", str(tmp_path / "p.json"), *FAST])
    assert rc == 2
    assert "no main(params)" in capsys.readouterr().err


def test_missing_action_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--action", str(tmp_path / "nope.py"), "--out", str(tmp_path / "p.json")]) == 2
    assert "not found" in capsys.readouterr().err


def test_share_control_selection(tmp_path: Path) -> None:
    assert isinstance(make_share_control("none", shim_lib=tmp_path / "x.so", mps_external=False), NoShareControl)
    # No shim library (and no ABI mirror yet): auto falls back to MPS.
    auto = make_share_control("auto", shim_lib=tmp_path / "x.so", mps_external=False)
    assert isinstance(auto, MpsShareControl) and auto.per_process
    with pytest.raises(ProfilerError, match="not found"):
        make_share_control("shim", shim_lib=tmp_path / "x.so", mps_external=False)


@pytest.fixture(scope="module")
def shim_and_fake_driver() -> tuple[Path, Path]:
    """``make -C cuda_shim tests``: the real shim and the fake libcuda.so.1."""
    import subprocess

    shim_dir = Path(__file__).resolve().parents[2] / "cuda_shim"
    r = subprocess.run(["make", "-C", str(shim_dir), "tests"], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return shim_dir / "build" / "libdilu_shim.so", shim_dir / "build" / "fake"


def test_shim_share_control_holds_the_share_through_the_control_block(
    tmp_path: Path, shim_and_fake_driver: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker launches through the fake driver under the real shim; the profiler calibrates each
    batch unlimited, then writes share × capacity into the control block: half the share takes about
    twice as long (the formula itself ignores the share here)."""
    library, fake = shim_and_fake_driver
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake))
    monkeypatch.setenv("DILU_PROFILE_FAKE_LAUNCHES", "1")
    out, runs = tmp_path / "p.json", tmp_path / "r.json"
    rc = main(["--model", "resnet50", "--exhaustive", "--dry-run", "--share-control", "shim", "--shim-lib", str(library),
               "--batches", "4", "--step", "0.25", "--formula-scale", "1", "--warmup", "1", "--min-iters", "4",
               "--max-iters", "4", "--window-s", "0", "--quiet", "--out", str(out), "--runs", str(runs)])
    assert rc == 0
    raw = json.loads(runs.read_text())
    assert raw["share_control"] == "shim"
    (cal,) = raw["calibrations"]
    assert cal["model"] == "formula:resnet50" and cal["batch"] == 4 and cal["blocks"] > 0 and cal["capacity_blocks_per_ms"] > 0
    lat = {p["sm_share"]: p["latency_ms"] for p in raw["models"]["resnet50"]["grid"]["points"]}
    assert set(lat) == {0.25, 0.5, 0.75, 1.0}
    assert lat[0.25] > 2.5 * lat[1.0], lat
    assert lat[0.5] == pytest.approx(2 * lat[1.0], rel=0.35), lat
    assert lat[0.25] > lat[0.5] > lat[0.75], lat
    # At 0.75 the shim's 5 ms token bucket refills between ~5 ms iterations and absorbs most of the cap
    # (measured 1.00-1.09× unlimited on the 2-core VM, so a 1.1× margin failed ~40% of runs): only
    # require it not to run faster than unlimited, beyond timing noise.
    assert lat[0.75] > lat[1.0] * 0.97, lat


def test_mps_env_sets_the_thread_percentage() -> None:
    mps = MpsShareControl(external=True)
    mps.start()
    env = mps.worker_env(0.3)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert mps.worker_env(0.001)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"


def test_mps_without_the_daemon_binary_is_a_clear_error() -> None:
    with pytest.raises(ProfilerError, match="not found"):
        MpsShareControl(control="no-such-mps-control-binary").start()


def test_default_grid_is_the_issues() -> None:
    cfg = SearchConfig()
    assert len(cfg.shares()) == 10 and cfg.batch_sizes()[-1] == 64


def test_report_of_a_compare_run(tmp_path: Path) -> None:
    import importlib.util

    out, runs = tmp_path / "profiles.json", tmp_path / "runs.json"
    assert main(["--model", "resnet50", "--model", "train-resnet50", "--compare", "--dry-run",
                 "--batches", "1,2,4", "--out", str(out), "--runs", str(runs), *FAST]) == 0
    path = Path(__file__).resolve().parents[2] / "bench" / "profiler_report.py"
    spec = importlib.util.spec_from_file_location("profiler_report", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.report(tmp_path)
    assert "SYNTHETIC dry run" in text
    assert "| resnet50 |" in text and "| train-resnet50 |" in text
    assert "of the grid's 30 points" in text and "Limit check" in text


def _measured_set(path: Path) -> None:
    """A measured-looking profile set without timing noise: throughput grows linearly with share up to
    0.6 (then flat), latency = batch / throughput."""
    points = []
    for b in (1, 2, 4, 8):
        for k in range(1, 11):
            share = round(k / 10, 1)
            rps = 100.0 * b * min(share, 0.6)
            points.append({"sm_share": share, "batch": b, "latency_ms": 1000.0 * b / rps, "throughput_rps": rps})
    doc = {"format": "dilu-profiles", "version": 1, "source": "test", "functions": {
        "inf": {"class": "inference", "memory_mib": 1000, "slo_ms": 500.0, "points": points,
                "recommended": {"request": 0.1, "limit": 1.0, "batch": 1}},
        "train": {"class": "training", "memory_mib": 1000, "points": [p for p in points if p["batch"] == 8],
                  "recommended": {"request": 0.5, "limit": 1.0, "batch": 8}}}}
    path.write_text(json.dumps(doc))


def test_replay_rederives_recommendations_from_the_measured_points(tmp_path: Path) -> None:
    measured = tmp_path / "measured.json"
    _measured_set(measured)
    limits = {}
    for gain in (0.05, 0.5):
        out = tmp_path / f"replayed-{gain}.json"
        assert main(["--replay", str(measured), "--limit-gain", str(gain), "--out", str(out), "--quiet"]) == 0
        doc = json.loads(out.read_text())
        assert "replayed" in doc["functions"]["inf"]["recommended_by"]
        assert f"limit_gain {gain:g}" in doc["source"]
        # The points are the measured ones, untouched.
        assert doc["functions"]["inf"]["points"] == json.loads(measured.read_text())["functions"]["inf"]["points"]
        rec = load_profiles(out)["inf"].recommended
        limits[gain] = rec.limit
        assert rec.request <= rec.limit
        train = load_profiles(out)["train"].recommended
        assert (train.batch, train.limit) == (8, pytest.approx(0.6))  # 98% of the full throughput from 0.6 on
    # Each step up to 0.6 adds ≥ 20% (0.5 → 0.6) and the plateau nothing: a 5% gain stops at the knee 0.6;
    # a 50% gain is met only by the first steps (0.1 → 0.2 doubles, 0.2 → 0.3 adds 50%, 0.3 → 0.4 33%).
    assert limits[0.05] == pytest.approx(0.6)
    assert limits[0.5] < limits[0.05]


def test_replay_needs_the_points_the_search_asks_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    measured = tmp_path / "measured.json"
    assert main(["--model", "resnet50", "--exhaustive", "--dry-run", "--batches", "1,2", "--out", str(measured), *FAST]) == 0
    doc = json.loads(measured.read_text())
    doc["functions"]["resnet50"]["points"] = [p for p in doc["functions"]["resnet50"]["points"]
                                              if not (p["batch"] == 2 and p["sm_share"] <= 0.5)]
    holed = tmp_path / "holed.json"
    holed.write_text(json.dumps(doc))
    assert main(["--replay", str(holed), "--out", str(tmp_path / "o.json"), "--quiet"]) == 2
    assert "no measured point at share" in capsys.readouterr().err


def test_replay_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--replay", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"format": "dilu-profiles", "functions": {}}')
    assert main(["--replay", str(garbage), "--out", str(tmp_path / "o.json")]) == 2
    assert "functions" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
    with pytest.raises(SystemExit):
        main(["--replay", str(garbage), "--limit-gain", "1.5"])
    assert "must be in [0, 1)" in capsys.readouterr().err
