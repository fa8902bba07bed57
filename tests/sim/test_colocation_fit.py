"""bench/fit_colocation.py: the κ fit recovers a known slowdown from matrix-shaped cells, and the verdict
counts a seed as won only at ≥ mps-static's throughput per GPU and ≤ its violations."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fit_colocation", ROOT / "bench" / "fit_colocation.py")
assert _spec is not None and _spec.loader is not None
fc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fc)


def cell(mode: str, trial: int, kappa: float, solo_gpu: float = 5.0, train: float = 40.0) -> dict[str, Any]:
    """A matrix cell whose co-located GPU p50 is solo × (1 + κ·0.5) in every load scenario."""
    scen = {n: {"gpu_p50_ms": solo_gpu * (1 + kappa * 0.5), "p50_ms": 2 * solo_gpu * (1 + kappa * 0.5),
                "requests": 60, "window": [0.0, 1.5], "train_it_s": train} for n in fc.LOAD_SCENARIOS}
    scen["idle"] = {"train_it_s": train}
    return {"mode": mode, "pair": "resnet50+train", "trial": trial, "file": "m.json.gz", "machine": {},
            "solo": {"gpu_p50_ms": solo_gpu, "p50_ms": 2 * solo_gpu}, "solo_train_it_s": train,
            "ref": {"p50": 2 * solo_gpu, "train": train}, "scenarios": scen}


def test_the_fit_recovers_kappa_and_the_pooled_figures_agree() -> None:
    cells = [cell("mps50", t, k) for t, k in enumerate((0.1, 0.3, 0.2))]
    cells += [cell("noshim", t, 0.0, solo_gpu=4.0) for t in range(3)]
    f = fc.fit(cells)
    assert [t["kappa_gpu"] for t in f["trials"]] == pytest.approx([0.1, 0.3, 0.2])
    assert f["kappa"] == pytest.approx(0.2)
    assert f["pooled"]["every_scenario"]["median"] == pytest.approx(0.2)
    lo, hi = f["summary"]["kappa_gpu"]["ci90"]
    assert 0.1 <= lo <= 0.2 <= hi <= 0.3
    # Training unchanged beside inference: no training slowdown; the cap: solo 5.0 ms under MPS vs 4.0 full GPU.
    assert f["kappa_train"] == 0.0
    assert f["summary"]["cap_inference_gpu_speed"]["median"] == pytest.approx(0.8)
    assert f["time_sliced"][0]["inference_gpu_p50_beside_over_solo"]["median"] == pytest.approx(1.0)
    with pytest.raises(SystemExit):
        fc.fit([cell("noshim", 0, 0.0)])


def test_a_seed_is_won_only_at_equal_or_better_throughput_and_violations() -> None:
    def row(policy: str, seed: int, tput: float, viol: float) -> dict[str, Any]:
        return {"trace": "t", "policy": policy, "kappa": 0.2, "seed": seed, "throughput_per_gpu": tput,
                "slo_violation_rate": viol}

    rows = [row("mps-static", 1, 10.0, 0.01), row("mps-static", 2, 10.0, 0.01),
            row("x", 1, 10.0, 0.01), row("x", 2, 11.0, 0.011)]
    assert fc._wins(rows, "t", "x", 0.2) == (1, 2)
