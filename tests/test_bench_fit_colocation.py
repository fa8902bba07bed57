"""bench/fit_colocation.py: κ from a matrix's static-MPS cells, on a small synthetic matrix with known answers."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from fit_colocation import fit, load_cells, main


def _cell(mode: str, trial: int, gpu_solo: float, gpu_beside: float, train_solo: float, train_beside: float) -> dict:
    scen = {}
    for name in ("paced@0.5", "poisson@0.3", "poisson@0.5", "poisson@0.7", "bursty@0.7"):
        scen[name] = {"requests": 40, "p50_ms": gpu_beside + 5.0, "gpu_p50_ms": gpu_beside,
                      "train_it_s": train_beside, "window": [100.0, 102.0]}
    scen["bursty@0.7"]["gpu_p50_ms"] = 100 * gpu_beside  # queueing-dominated: must not enter the fit
    scen["idle"] = {"train_it_s": train_solo}
    return {"mode": mode, "pair": "resnet50+train", "trial": trial, "scenarios": scen,
            "solo": {"p50_ms": gpu_solo + 5.0, "gpu_p50_ms": gpu_solo}, "solo_train_it_s": train_solo,
            "ref": {"p50": gpu_solo + 5.0, "train": train_solo}}


def _matrix(path: Path, cells: list[dict]) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump({"machine": {"gpu": "test GPU"}, "cells": cells}, f)
    return path


def test_kappa_is_the_stretch_over_the_neighbours_share_median_of_trials(tmp_path: Path) -> None:
    # Trials stretched by 1.05, 1.10, 1.20 beside a neighbour at 0.5: κ 0.1, 0.2, 0.4 -> median 0.2.
    cells = [_cell("mps50", i, 10.0, 10.0 * s, 40.0, 40.0) for i, s in enumerate((1.05, 1.10, 1.20))]
    cells.append(_cell("noshim", 0, 10.0, 30.0, 40.0, 10.0))  # another mode: ignored
    r = fit(load_cells([_matrix(tmp_path / "m.json.gz", cells)]))
    assert [t["kappa_gpu"] for t in r["trials"]] == pytest.approx([0.1, 0.2, 0.4])
    assert r["kappa"] == pytest.approx(0.2)
    assert r["summary"]["kappa_gpu"] == {"n": 3, "median": pytest.approx(0.2), "min": pytest.approx(0.1),
                                         "max": pytest.approx(0.4), "ci90": pytest.approx((0.1, 0.4))}
    assert [x["scenario"] for x in r["trials"][0]["scenarios"]] == ["paced@0.5", "poisson@0.3", "poisson@0.5", "poisson@0.7"]
    # Client p50 includes a fixed 5 ms: a smaller relative stretch.
    assert r["trials"][0]["kappa_client"] == pytest.approx((15.5 / 15.0 - 1) / 0.5, abs=1e-4)
    assert r["summary"]["train_factor"]["median"] == pytest.approx(1.0)
    assert r["summary"]["kappa_train"]["median"] == pytest.approx(0.0)


def test_training_kappa_from_its_slowdown_and_the_inference_busy_fraction(tmp_path: Path) -> None:
    # 40 requests in 2 s at 10 ms GPU time: inference busy 20% of the time. With κ 1 and u 0.5 training runs
    # at 1/1.5 while inference is busy: factor 1 - 0.2 * (1 - 1/1.5).
    factor = 1 - 0.2 * (1 - 1 / 1.5)
    cells = [_cell("mps50", 0, 10.0, 10.0, 30.0, 30.0 * factor)]
    t = fit(load_cells([_matrix(tmp_path / "m.json.gz", cells)]))["trials"][0]
    assert t["scenarios"][0]["inference_duty"] == pytest.approx(0.2)
    assert t["kappa_train"] == pytest.approx(1.0, abs=2e-3)


def test_negative_median_is_clamped_and_files_are_written(tmp_path: Path) -> None:
    src = _matrix(tmp_path / "m.json.gz", [_cell("mps50", 0, 10.0, 9.0, 40.0, 40.0)])
    out, doc = tmp_path / "fit.json", tmp_path / "fit.md"
    assert main([str(src), "--out", str(out), "--doc", str(doc)]) == 0
    data = json.loads(out.read_text())
    assert data["fit"]["summary"]["kappa_gpu"]["median"] == pytest.approx(-0.2)
    assert data["fit"]["kappa"] == 0.0
    text = doc.read_text()
    assert "Fitted κ = **0.000**" in text and "test GPU" in text


def test_no_cells_of_the_mode_is_a_clear_error(tmp_path: Path) -> None:
    src = _matrix(tmp_path / "m.json.gz", [_cell("noshim", 0, 10.0, 9.0, 40.0, 40.0)])
    with pytest.raises(SystemExit, match="no mps50 cells"):
        fit(load_cells([src]))


def test_the_verdict_says_whether_dilu_meets_mps_static() -> None:
    from fit_colocation import _verdict

    def row(policy: str, seed: int, tput: float, viol: float) -> dict:
        return {"trace": "t", "policy": policy, "kappa": 0.2, "seed": seed, "throughput_per_gpu": tput,
                "slo_violation_rate": viol, "latency_p99_ms": 9.0, "gpus_peak": 2, "training_samples_per_s": 5.0,
                "limits": {"resnet50": [0.2, 0.7]}}

    result = {"kappa": 0.2, "traces": [("t", "x", 4, 60.0)], "variants": ["mps-static", "dilu", "dilu γ 6"]}
    rows = [row("mps-static", s, 4.0, 0.01) for s in (1, 2)] + [row("dilu", s, 2.0, 0.01) for s in (1, 2)] \
        + [row("dilu γ 6", s, 4.0, 0.01) for s in (1, 2)]
    text = "\n".join(_verdict(rows, result))
    assert "The shipped `dilu` at the fitted κ 0.2: **not met** — t 0.50× mps-static" in text
    assert "`dilu γ 6` (t 1.00×)" in text
    rows[2:4] = [row("dilu", s, 4.5, 0.005) for s in (1, 2)]
    assert "**met** — t 1.12× mps-static" in "\n".join(_verdict(rows, result))
