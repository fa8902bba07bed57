"""bench/planner_scale.py on a small cluster: it drives the live planner as the balancer does and reads the budgets
back from a real redis-server (what it measures is checked here, not how fast)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from planner_scale import markdown, run_size


def test_a_small_run_places_churns_compacts_and_reads_every_budget() -> None:
    r = run_size(120, 2, seed=3, redis=True)
    assert r["placed_first_tick"] == 120 and 0 < r["lit_gpus"] <= r["gpus"]
    # 1 % of 120: one function scales to zero and one new one arrives.
    assert r["churn_decisions"] == {"place": 1, "stop": 1, "blocked": 0}
    assert r["gpus_read"] == r["gpus"] and r["read_one_by_one_s"] > 0 and r["read_pipelined_s"] > 0
    assert r["steady_median_s"] > 0 and r["steady_max_s"] >= r["steady_median_s"]
    assert r["changed_median_s"] > 0 and r["cold_s"] > 0
    # The leader's whole read path against the redis-server, part by part.
    for part in ("reports", "specs", "budgets+snapshot", "snapshot", "snapshot_changed", "total"):
        assert r[f"read_{part}_cpu_s"] > 0 and r[f"read_{part}_wall_s"] > 0
    assert r["read_total_cpu_s"] >= r["read_reports_cpu_s"] and r["read_first_wall_s"] > 0
    table = markdown([r], ["--sizes", "120"], "now")
    assert "| 120 | " in table and "(120 placed)" in table and "bench/planner_scale.py --sizes 120" in table
    assert "read path of a steady tick" in table
