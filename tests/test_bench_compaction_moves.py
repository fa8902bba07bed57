"""bench/compaction_moves.py: compaction's moves sorted by kind add up to what the simulator counts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from compaction_moves import KINDS, breakdown

from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import SIM_COMPACTION, PlacementSimConfig, simulate_placement


def test_kinds_add_up_to_the_simulators_counts() -> None:
    r = breakdown(400, 0.2, 0.4, 1, SIM_COMPACTION, 2.0)
    events = dilu_mix(400, train_fraction=0.2, llm_fraction=0.4, seed=1)
    d = simulate_placement(events, PlacementSimConfig(policy="dilu", gpu_memory_gib=40.0, compact_every_s=2.0)).details
    assert set(r["moves"]) == set(KINDS) == set(r["cold"])
    assert abs(sum(r["moves"].values()) - 100.0 * d["compaction_moves"] / 400) < 1e-9
    assert abs(sum(r["cold"].values()) - 100.0 * d["compaction_cold_starts"] / 400) < 1e-9
    assert abs(sum(r["cold_by_class"].values()) - r["cold_per_100"]) < 1e-9
    # A move that splits an LLM starts more than one process; an ordinary move one.
    assert r["moves"]["empty_split"] > 0 and r["cold"]["empty_split"] > r["moves"]["empty_split"]
    assert r["cold"]["empty_whole"] == r["moves"]["empty_whole"]
    # The trace's own creations are not compaction's cold starts.
    assert r["created_per_100"] == 100.0 and r["created_processes_per_100"] > 100.0


def test_moves_that_never_split() -> None:
    r = breakdown(400, 0.2, 0.4, 1, SIM_COMPACTION, 2.0, move_parts=1)
    assert r["moves"]["empty_split"] == 0
    assert r["cold_per_100"] == r["moves_per_100"]  # every move starts exactly one process
