"""bench/serving_seeds.py: the per-seed ratio and the page it writes (no replay: rows are given)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from serving_seeds import page, ratios


def _row(seed: int, run: str, tput: float, viol: float = 0.005) -> dict:
    return {
        "seed": seed,
        "run": run,
        "requests_per_gpu_s": tput,
        "gpu_seconds": 1000.0,
        "gpus_peak": 16,
        "slo_violation_rate": viol,
        "p99_ms": 9.0,
        "training_samples_per_s": 1500.0,
        "cold_starts": 3,
        "cpu_s": 1.0,
    }


def test_ratio_per_seed_pairs_each_seed_with_its_own_baseline() -> None:
    rows = [_row(1, "dilu", 4.0), _row(1, "mps-static", 4.1), _row(2, "dilu", 4.2), _row(2, "mps-static", 4.0)]
    r = ratios(rows, "dilu", "mps-static")
    assert r == {1: pytest.approx(4.0 / 4.1), 2: pytest.approx(4.2 / 4.0)}


def test_ratio_skips_a_seed_without_the_baseline() -> None:
    assert ratios([_row(1, "dilu", 4.0), _row(2, "dilu", 4.0), _row(2, "mps-static", 2.0)], "dilu", "mps-static") == {2: 2.0}


def test_page_reports_median_and_worst_over_seeds() -> None:
    rows = [
        _row(s, run, t)
        for s, run, t in (
            (1, "dilu", 3.0),
            (1, "mps-static", 4.0),
            (2, "dilu", 4.0),
            (2, "mps-static", 4.0),
            (3, "dilu", 5.0),
            (3, "mps-static", 4.0),
        )
    ]
    text = page({"azure-day": rows}, {"machine": "m", "command": "c", "date": "d", "kappa": 0.232, "kappa_from": "f"})
    assert "## azure-day" in text
    assert "median **1.0000×**, worst **0.7500×**" in text
    assert "| 3 | dilu | 5.0000 |" in text
