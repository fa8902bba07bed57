"""bench/gpu_product.py's matrix mode without running anything: the plan fits the budget by leaving out whole
columns (every column that stays has all its trials, with its pair's reference), arrival processes keep their
mean rate, and the generated tables find the strongest static baseline and the static splits that dominate a
controller. Fast: no process is started."""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_product", ROOT / "bench/gpu_product.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_product"] = mod
    spec.loader.exec_module(mod)
    return mod


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "modes": ["noshim", "static30", "slo-ts", "mps50"], "pairs": ["resnet50+train", "bert+train"],
        "pair_modes": {"bert+train": ["noshim", "slo-ts"]}, "priority": "", "scenarios": ["cold", "solo", "idle"],
        "arrivals": ["paced", "poisson"], "loads": [0.5], "besides": ["paced@0.5", "poisson@0.7", "burst"],
        "seconds": 1.5, "trials": 3, "budget_s": 0.0}
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_plan_cuts_whole_columns_to_fit_the_budget(gp: ModuleType) -> None:
    args = _args()
    keep, cut = gp.plan(args)
    assert not cut and len(keep) == 3 * 6
    assert [m for t, p, m, _ in keep[:4]] == ["noshim", "static30", "slo-ts", "mps50"]  # trial by trial
    # The first trial of a column also measures the CPU no-op: it costs more than the others.
    first = {(p, m): e for t, p, m, e in keep if t == 0}
    later = {(p, m): e for t, p, m, e in keep if t == 2}
    assert all(first[c] > later[c] for c in first)
    # Room for the ResNet reference and two more columns, not a third: the later, cheaper BERT pair fits.
    three = [("resnet50+train", "noshim"), ("resnet50+train", "static30"), ("resnet50+train", "slo-ts")]
    budget = gp.FIRST_IMPORT_S + sum(e for _, p, m, e in keep if (p, m) in three) + 1.0
    keep, cut = gp.plan(_args(budget_s=budget, priority="resnet50+train:noshim,static30,slo-ts,mps50"))
    kept = {(p, m) for _, p, m, _ in keep}
    assert kept == {("resnet50+train", "noshim"), ("resnet50+train", "static30"), ("resnet50+train", "slo-ts")}
    assert all(sum(1 for _, p, m, _ in keep if (p, m) == c) == 3 for c in kept)  # every trial of what stays
    assert {(p, m) for _, p, m, _ in cut} == {("resnet50+train", "mps50"), ("bert+train", "noshim"),
                                              ("bert+train", "slo-ts")}
    assert gp.FIRST_IMPORT_S + sum(e for *_, e in keep) <= budget


def test_a_pair_is_planned_only_with_its_reference(gp: ModuleType) -> None:
    args = _args(priority="bert+train:slo-ts")
    keep, _ = gp.plan(args)
    bert = [m for _, p, m, _ in keep if p == "bert+train"]
    assert bert[:2] == ["noshim", "slo-ts"]  # the reference runs first in each trial
    per = sum(gp.stack_estimate_s(args, "slo-ts", "bert+train", t) for t in range(3))
    keep, _ = gp.plan(_args(priority="bert+train:slo-ts", budget_s=gp.FIRST_IMPORT_S + per + 1))
    assert keep == [], "the column does not fit with its reference, so neither runs"


@pytest.mark.parametrize("kind", ["paced", "poisson", "bursty"])
def test_arrival_processes_keep_the_mean_rate(gp: ModuleType, kind: str) -> None:
    times = gp.arrival_times(kind, 200.0, 50.0, random.Random(3))
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 200.0
    assert len(times) / 200.0 == pytest.approx(50.0, rel=0.05)
    per_s = [sum(1 for t in times if k <= t < k + 1) for k in range(200)]
    first_quarter = sum(1 for t in times if t % 1.0 < 0.25) / len(times)
    if kind == "paced":
        assert max(per_s) - min(per_s) <= 1
    elif kind == "bursty":
        assert first_quarter == pytest.approx(0.5, abs=0.05)  # 2x the rate in a quarter of each second
    else:
        assert first_quarter == pytest.approx(0.25, abs=0.05)


def _cell(gp: ModuleType, mode: str, trial: int, p99: float, train: float, viol: float) -> dict[str, object]:
    scen = {"p99_ms": p99, "p99_vs_solo": p99 / 10, "p99_vs_ref": p99 / 10, "slo_violations": viol,
            "train_vs_ref": train, "train_vs_solo": train, "train_it_s": 50 * train, "p50_ms": p99 / 2}
    return {"mode": mode, "pair": "resnet50+train", "trial": trial, "scenarios": {"paced@0.5": scen},
            "solo": {"p50_ms": 8.0, "p99_ms": 10.0}, "solo_train_it_s": 50.0, "cold_start_ms": {"infer": 3000.0},
            "effective": {"mps": mode.startswith("mps"), "policy": "static" if mode == "static30" else "slo"}}


def test_the_matrix_names_the_strongest_baseline_and_what_dominates(gp: ModuleType, tmp_path: Path) -> None:
    cells = []
    for t in range(3):
        cells += [_cell(gp, "noshim", t, 14.0, 1.0, 0.05),  # most training, but breaks the SLO
                  _cell(gp, "static30", t, 11.0 + t, 0.30, 0.0),
                  _cell(gp, "mps50", t, 12.0, 0.60, 0.0),  # meets the SLO with the most training: strongest
                  _cell(gp, "slo-ts", t, 12.5, 0.55 + 0.1 * t, 0.0)]
    agg = gp.aggregate(cells)
    a = agg[("resnet50+train", "paced@0.5", "slo-ts")]
    assert a["trials"] == 3 and a["train_vs_ref"] == (pytest.approx(0.65), pytest.approx(0.55))
    assert agg[("resnet50+train", "paced@0.5", "static30")]["p99_ms"] == (12.0, 13.0)  # median, worst
    assert gp.strongest_baseline(agg, "resnet50+train", "paced@0.5") == "mps50"
    assert gp.dominated_by(agg, "resnet50+train", "paced@0.5", "slo-ts") == []  # 0.65 vs mps50's 0.60
    cells = [c for c in cells if c["mode"] != "slo-ts"] + [_cell(gp, "slo-ts", t, 12.5, 0.40, 0.0) for t in range(3)]
    agg = gp.aggregate(cells)
    assert gp.dominated_by(agg, "resnet50+train", "paced@0.5", "slo-ts") == ["mps50"]
    page = tmp_path / "page.md"
    page.write_text("# title\n\nhand-written\n\n" + gp.BEGIN + "\nold\n" + gp.END + "\n\nafter\n")
    doc = {"machine": {}, "command": "x", "cells": cells, "errors": [], "cut": [], "skipped": []}
    gp.write_matrix(page, gp.matrix_report([doc]))
    text = page.read_text()
    assert "hand-written" in text and "after" in text and "\nold\n" not in text
    assert "| paced@0.5 | slo-ts | 12.5 / 12.5 |" in text and "| mps50 |" in text
    slo_row = text.split("| paced@0.5 | slo-ts |")[1].split("\n")[0]
    assert "| 0.4 / 0.4 | 20 / 20 |" in slo_row  # training against the reference, then absolute (it/s)
    assert "**strongest baseline**" in text and "| none |" not in text.split("| paced@0.5 | slo-ts |")[1].split("\n")[0]


def test_dominance_odds_say_how_sure_a_verdict_is(gp: ModuleType, tmp_path: Path) -> None:
    # mps50 beats slo-ts in every trial: every resample agrees.
    clear = [c for t in range(3) for c in (_cell(gp, "mps50", t, 12.0, 0.60, 0.0),
                                           _cell(gp, "slo-ts", t, 12.5, 0.40, 0.0))]
    agg = gp.aggregate(clear)
    assert gp.dominance_odds(agg, "resnet50+train", "paced@0.5", "slo-ts", "mps50") == 1.0
    assert gp.dominance_odds(agg, "resnet50+train", "paced@0.5", "mps50", "slo-ts") == 0.0
    # Trials that disagree: slo-ts's medians lose, but one trial in three wins on both counts.
    noisy = [c for t in range(3) for c in (_cell(gp, "mps50", t, 11.0 + t, 0.60, 0.0),
                                           _cell(gp, "slo-ts", t, (12.5, 13.5, 11.0)[t], (0.50, 0.55, 0.70)[t], 0.0))]
    agg = gp.aggregate(noisy)
    assert gp.dominated_by(agg, "resnet50+train", "paced@0.5", "slo-ts") == ["mps50"]
    odds = gp.dominance_odds(agg, "resnet50+train", "paced@0.5", "slo-ts", "mps50")
    assert odds is not None and 0.2 < odds < gp.BEYOND_NOISE
    assert odds == gp.dominance_odds(agg, "resnet50+train", "paced@0.5", "slo-ts", "mps50")  # seeded
    one = gp.aggregate(noisy[:2])  # one trial each: no odds
    assert gp.dominance_odds(one, "resnet50+train", "paced@0.5", "slo-ts", "mps50") is None
    page = tmp_path / "page.md"
    page.write_text(gp.BEGIN + "\n" + gp.END + "\n")
    doc = {"machine": {}, "command": "x", "cells": noisy, "errors": [], "cut": [], "skipped": []}
    gp.write_matrix(page, gp.matrix_report([doc]))
    text = page.read_text()
    assert f"mps50 ({odds:.2f})" in text
    assert "| resnet50+train | slo-ts | 1 | 1 | 0 |" in text


def test_bursts_have_heights_and_an_alone_reference(gp: ModuleType, tmp_path: Path) -> None:
    args = _args(besides=["burst", "burst@0.16", "paced@0.5"], scenarios=["cold", "solo", "alone"])
    assert gp.scenarios_of(args) == [("burst", "burst", 0.2), ("burst@0.16", "burst", 0.16),
                                     ("paced@0.5", "paced", 0.5)]
    rates = gp.burst_rates(1.5, 10.0)
    assert [r for _, r in rates] == [10.0, 50.0, 10.0] and sum(s for s, _ in rates) == pytest.approx(3.5)
    # Each burst alone runs once more per stack: the estimate grows by the two bursts' length.
    without = gp.stack_estimate_s(_args(besides=args.besides, scenarios=["cold", "solo"]), "noshim", "resnet50+train")
    assert gp.stack_estimate_s(args, "noshim", "resnet50+train") - without == pytest.approx(2 * (1.5 + 2.0 + gp.GAP_S))
    cells = []
    for t, (alone, beside) in enumerate(((0.0, 0.02), (0.005, 0.30), (0.20, 0.25))):
        c = _cell(gp, "shim", t, 12.0, 0.9, 0.0)
        c["scenarios"]["burst"] = {**c["scenarios"]["paced@0.5"], "slo_violations": beside}
        c["scenarios"]["burst alone"] = {"p99_ms": 11.0, "slo_violations": alone, "train_vs_ref": None}
        cells.append(c)
    rows = "\n".join(gp.bursts_alone(cells))
    assert "| resnet50+train | burst | shim | 0.5% / 20.0% (2 of 3 ≤ 1%) | 25.0% / 30.0% (0 of 3 ≤ 1%) |" in rows
    page = tmp_path / "page.md"
    page.write_text(gp.BEGIN + "\n" + gp.END + "\n")
    gp.write_matrix(page, gp.matrix_report([{"machine": {}, "command": "x", "cells": cells, "errors": [], "cut": [],
                                             "skipped": []}]))
    text = page.read_text()
    assert "| burst alone |" not in text  # alone is a reference, not a cell of the matrix
    assert "| resnet50+train | shim | 2 |" in text  # paced@0.5 and burst: two cells, not three


@pytest.mark.parametrize("item", ["burst@", "burst@.", "paced@.", "paced@0.5.1", "spiky@0.5", "paced"])
def test_a_malformed_scenario_is_refused_with_its_name(item: str) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench/gpu_product.py"), "--besides", f"burst@0.16,{item}",
                          "--plan-only"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"--besides: {item!r} is not burst" in run.stderr, run.stderr
    ok = subprocess.run([sys.executable, str(ROOT / "bench/gpu_product.py"), "--besides", "burst,burst@.12,paced@0.5",
                         "--plan-only"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "burst@0.12" in ok.stdout, ok.stderr


def test_isolation_fallback_keeps_the_run(gp: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU action that cannot cold-start under process isolation costs one stack, not the run: that stack
    and every later one run with isolation off, and the results say so."""
    import asyncio

    calls: list[tuple[str, list[str]]] = []

    async def fake_cell(args: argparse.Namespace, mode: str, pair: str, trial: int, ref: dict[str, object]) -> dict[str, object]:
        calls.append((mode, list(args.extra_flags)))
        if not args.extra_flags:
            raise RuntimeError(f"{mode}: training cold start answered 502")
        return {"mode": mode, "pair": pair, "trial": trial, "scenarios": {}, "solo": {"p50_ms": 1.0, "p99_ms": 2.0},
                "effective": {"mps": False, "policy": "slo", "shim": True}, "solo_train_it_s": 1.0,
                "cold_start_ms": {}, "wall_s": 1.0}

    monkeypatch.setattr(gp, "run_cell", fake_cell)
    monkeypatch.setattr(gp, "machine", lambda: {})
    args = _args(modes=["noshim", "slo-ts"], pairs=["resnet50+train"], pair_modes={}, trials=1, deadline_s=0.0,
                 dry_run=True, out=None, isolation_fallback=True, extra_flags=[])
    doc = asyncio.run(gp.main_async(args))
    off = ["--invoker-process-isolation", "off"]
    assert calls == [("noshim", []), ("noshim", off), ("slo-ts", off)]
    assert [c["mode"] for c in doc["cells"]] == ["noshim", "slo-ts"]
    assert "noshim resnet50+train trial 0" == doc["isolation_fallback"]["after"]
    assert "process isolation turned off" in gp.matrix_report([doc])


@pytest.mark.parametrize(("pair_modes", "order", "setters"), [
    (["noshim", "shim", "mps50"], ["shim", "noshim", "mps50"], ["noshim"]),
    (["shim-ts", "slo-ts"], ["shim-ts", "slo-ts"], ["shim-ts"]),
    (["slo-ts", "shim-ts"], ["slo-ts", "shim-ts"], ["slo-ts"]),
])
def test_every_mode_of_a_trial_serves_the_same_arrivals(gp: ModuleType, pair_modes: list[str], order: list[str],
                                                         setters: list[str]) -> None:
    """The reference the loads and the SLO come from: the unlimited `noshim` where the pair runs it, else the
    trial's first mode, once per trial; a plan without `noshim` (PLAN 25) then judges its modes on the same
    arrivals instead of each on its own measured capacity."""
    for trial in range(2):
        ref: dict[str, object] = {}
        key = f"resnet50+train:{trial}"
        got = []
        for mode in order:
            if gp.sets_reference(ref, key, mode, pair_modes):
                got.append(mode)
                ref[key] = {"rps": 100.0, "mode": mode}
        assert got == setters
