"""bench/leader_scale.py on a small cluster: a real Balancer takes over a settled cluster held in a real
redis-server while another process plays the invokers, and ticks past the scaler's window (what it measures is
checked here, not how fast)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from leader_scale import lead, settled_cluster


def test_a_small_cluster_is_taken_over_and_led_past_the_window() -> None:
    live = settled_cluster(60, seed=3)
    assert len(live.records) == 60
    r = asyncio.run(lead(live, seconds=8.0, seed=3, tick_s=0.02))
    assert r["n"] == 60 and r["epochs"] == 1  # one leader, the lease never lost
    assert r["takeover_s"] > 0 and r["first_tick_cpu_s"] > 0
    assert r["filling_ticks"] == r["window"] == 40 and r["steady_ticks"] > 0
    assert r["steady_wall_max_s"] >= r["steady_wall_median_s"] > 0 and r["steady_cpu_median_s"] > 0
    assert r["stall_max_s"] >= r["steady_stall_max_s"] >= 0 and r["gc_freeze"] is True
    # Past the window the scaler's windows are full (no function scaled in 8 s of steady load).
    assert r["functions"] > 0 and r["windows_full"] > 0 and r["window_samples_median"] == r["window"]
