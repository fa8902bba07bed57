"""`dilu-invoker simulate …` end to end, in-process: files written, exact keys, errors, exit codes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from dilu_invoker.cli import main as top_main
from dilu_invoker.sim.cli import DILU_COMPACT_EVERY_S, build_parser, main
from dilu_invoker.sim.placement import (
    PLACEMENT_POLICIES,
    SUMMARY_KEYS,
    TIMESERIES_COLUMNS,
)
from dilu_invoker.sim.serving import SERVING_POLICIES, SERVING_TIMESERIES_COLUMNS
from dilu_invoker.sim.serving import SUMMARY_KEYS as SERVING_KEYS

from .conftest import SYNTHETIC_PROFILES


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ev") / "mix.jsonl.gz"
    assert main(["gen", "placement", "--instances", "60", "--seed", "2", "--out", str(path)]) == 0
    return path


def test_placement_one_policy_writes_its_files(events: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p"
    assert main(["placement", "--events", str(events), "--policy", "dilu", "--gpu-memory-gib", "40", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert tuple(summary) == SUMMARY_KEYS and summary["policy"] == "dilu" and summary["instances"] == 60
    details = json.loads((out / "details.json").read_text())
    assert details["compact_every_s"] == DILU_COMPACT_EVERY_S  # dilu's default
    with (out / "timeseries.csv").open() as fh:
        rows = list(csv.reader(fh))
    assert tuple(rows[0]) == TIMESERIES_COLUMNS and len(rows) > 10
    assert (out / "lit_gpus.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "lower bound on lit GPUs: peak" in printed and "peak/bound" in printed


def test_placement_all_compares_every_policy(events: Path, tmp_path: Path) -> None:
    out = tmp_path / "all"
    rc = main(["placement", "--events", str(events), "--policy", "all", "--gpu-memory-gib", "40", "--out", str(out), "--quiet", "--no-plots"])
    assert rc == 0
    for p in PLACEMENT_POLICIES:
        s = json.loads((out / p / "summary.json").read_text())
        assert tuple(s) == SUMMARY_KEYS and s["policy"] == p
    table = (out / "comparison.md").read_text()
    assert all(f"| {p} |" in table for p in PLACEMENT_POLICIES)
    assert not (out / "lit_gpus.png").exists()


def test_compaction_can_be_given_to_a_baseline(events: Path, tmp_path: Path) -> None:
    out = tmp_path / "c"
    assert main(["placement", "--events", str(events), "--policy", "infless-r", "--compact-every", "5", "--out", str(out), "--quiet", "--no-plots"]) == 0
    assert json.loads((out / "details.json").read_text())["compact_every_s"] == 5.0


def test_dilus_compaction_is_the_simulators_by_default(
    events: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without flags `simulate placement` replays dilu with `SIM_COMPACTION` itself (every field, the
    memory merges and the gates included), so a change of the simulator's default reaches the CLI."""
    from dilu_invoker.sim import placement

    seen = []
    real = placement.simulate_placement

    def spy(evs, config, **kw):  # type: ignore[no-untyped-def]
        seen.append(config.compaction)
        return real(evs, config, **kw)

    monkeypatch.setattr(placement, "simulate_placement", spy)
    out = tmp_path / "d"
    assert main(["placement", "--events", str(events), "--policy", "dilu", "--out", str(out), "--quiet", "--no-plots"]) == 0
    assert seen == [placement.SIM_COMPACTION]


@pytest.mark.parametrize(("argv", "merging"), [([], True), (["--compact-merges", "0"], False)], ids=["default", "off"])
def test_compaction_merges_sm_room_by_default(tmp_path: Path, argv: list[str], merging: bool) -> None:
    """On a training-free trace (Σ request binds), dilu's compaction merges SM room unless told not to;
    `compaction_merges` counts those moves among `compaction_moves`."""
    events = tmp_path / "inference.jsonl.gz"
    assert main(["gen", "placement", "--instances", "400", "--train-fraction", "0", "--llm-fraction", "0",
                 "--seed", "3", "--out", str(events)]) == 0
    out = tmp_path / "m"
    assert main(["placement", "--events", str(events), "--policy", "dilu", "--gpu-memory-gib", "40", "--out", str(out),
                 "--quiet", "--no-plots", *argv]) == 0
    details = json.loads((out / "details.json").read_text())
    assert (details["compaction_merges"] > 0) is merging
    assert details["compaction_moves"] >= details["compaction_merges"]


@pytest.mark.parametrize(
    ("content", "message"),
    [('{"t": 0, "op": "create", "instance": "a"}\n', "missing field 'class'"), ("nonsense\n", "not valid JSON")],
)
def test_bad_event_file_exits_2_with_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert main(["placement", "--events", str(path), "--policy", "dilu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and "bad.jsonl:1" in err


def test_unknown_policy_is_refused_by_argparse(events: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["placement", "--events", str(events), "--policy", "kubernetes"])
    assert info.value.code == 2


def test_serving_all_on_a_generated_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["gen", "serving", "--pattern", "bursty", "--functions", "3", "--duration", "300", "--rate", "20",
                 "--profiles", str(SYNTHETIC_PROFILES), "--training-jobs", "1", "--out", str(trace)]) == 0
    out = tmp_path / "s"
    rc = main(["serving", "--trace", str(trace), "--profiles", str(SYNTHETIC_PROFILES), "--policy", "all",
               "--gpus", "4", "--out", str(out), "--quiet", "--sample-every", "30"])
    assert rc == 0
    for p in SERVING_POLICIES:
        s = json.loads((out / p / "summary.json").read_text())
        assert tuple(s) == SERVING_KEYS and s["requests"] > 0
        with (out / p / "timeseries.csv").open() as fh:
            assert tuple(next(csv.reader(fh))) == SERVING_TIMESERIES_COLUMNS
    assert (out / "throughput_per_gpu.png").exists()
    assert "SYNTHETIC" in capsys.readouterr().out


def test_serving_reads_an_azure_sample(tmp_path: Path) -> None:
    azure = tmp_path / "azure"
    assert main(["gen", "azure", "--functions", "3", "--minutes", "20", "--out", str(azure)]) == 0
    inv = azure / "invocations_per_function_md.anon.d01.csv"
    out = tmp_path / "s"
    rc = main(["serving", "--trace", str(inv), "--profiles", str(SYNTHETIC_PROFILES), "--policy", "dilu",
               "--gpus", "2", "--out", str(out), "--quiet", "--no-plots", "--memory", str(azure / "memory.csv")])
    assert rc == 0
    assert json.loads((out / "summary.json").read_text())["requests"] > 0


def test_serving_runs_dilu_with_the_slo_vertical_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["gen", "serving", "--pattern", "bursty", "--functions", "2", "--duration", "120", "--rate", "20",
                 "--profiles", str(SYNTHETIC_PROFILES), "--training-jobs", "1", "--out", str(trace)]) == 0
    out = tmp_path / "s"
    rc = main(["serving", "--trace", str(trace), "--profiles", str(SYNTHETIC_PROFILES), "--policy", "dilu",
               "--gpus", "2", "--out", str(out), "--quiet", "--no-plots", "--vertical-policy", "slo"])
    assert rc == 0 and json.loads((out / "summary.json").read_text())["requests"] > 0
    assert build_parser().parse_args(["serving", "--trace", "t", "--profiles", "p", "--policy", "dilu",
                                      "--gpus", "1"]).vertical_policy == "slo"
    capsys.readouterr()
    for policy, said in (("pid", "policy must be one of slo, static, not 'pid'"),
                         ("rckm", "policy rckm was removed: slo replaced it as the time-sliced policy")):
        with pytest.raises(SystemExit):
            main(["serving", "--trace", str(trace), "--profiles", str(SYNTHETIC_PROFILES), "--policy", "dilu",
                  "--gpus", "2", "--vertical-policy", policy])
        assert said in capsys.readouterr().err


def test_serving_with_a_missing_profile_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["gen", "serving", "--pattern", "poisson", "--profile-names", "gpt", "--duration", "60", "--out", str(trace)]) == 0
    assert main(["serving", "--trace", str(trace), "--profiles", str(SYNTHETIC_PROFILES), "--policy", "dilu", "--gpus", "1"]) == 2
    assert "no profile named 'gpt'" in capsys.readouterr().err


def test_gen_serving_needs_profile_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gen", "serving", "--pattern", "poisson", "--out", str(tmp_path / "t.jsonl")]) == 2
    assert "--profiles" in capsys.readouterr().err


def test_wired_as_dilu_invoker_simulate(events: Path, tmp_path: Path) -> None:
    out = tmp_path / "top"
    assert top_main(["simulate", "placement", "--events", str(events), "--policy", "exclusive", "--out", str(out), "--quiet", "--no-plots"]) == 0
    assert json.loads((out / "summary.json").read_text())["policy"] == "exclusive"


def test_serving_what_if_placement_and_sizing_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["gen", "serving", "--pattern", "poisson", "--functions", "8", "--duration", "120", "--rate", "8",
                 "--profiles", str(SYNTHETIC_PROFILES), "--out", str(trace)]) == 0
    runs = {}
    for name, extra in (("plain", ["--gamma", "1.5"]),
                        ("by-request", ["--gamma", "1.5", "--placement-strategy", "infless-r", "--capacity-share", "request"]),
                        ("default", [])):
        out = tmp_path / name
        assert main(["serving", "--trace", str(trace), "--profiles", str(SYNTHETIC_PROFILES), "--policy", "dilu",
                     "--gpus", "4", "--out", str(out), "--quiet", "--no-plots", *extra]) == 0
        runs[name] = json.loads((out / "summary.json").read_text())
    # Eight instances at request 0.1 / limit 0.3 (synthetic resnet50, bert 0.4): Σ limit ≤ 1.5 needs two GPUs,
    # Σ request ≤ 1 one.
    assert runs["by-request"]["gpus_peak"] < runs["plain"]["gpus_peak"]
    # The default has no Σ-limit bound: it admits by request, as the what-if does.
    assert runs["default"]["gpus_peak"] == runs["by-request"]["gpus_peak"]
    details = json.loads((tmp_path / "by-request" / "details.json").read_text())
    assert details["placement_strategy"] == "infless-r" and details["packing"]["request_per_lit_gpu"] <= 1.0
    rc = main(["serving", "--trace", str(trace), "--profiles", str(SYNTHETIC_PROFILES), "--policy", "dilu",
               "--gpus", "4", "--out", str(tmp_path / "bad"), "--quiet", "--no-plots", "--placement-strategy", "nope"])
    assert rc == 2 and "--placement-strategy" in capsys.readouterr().err
