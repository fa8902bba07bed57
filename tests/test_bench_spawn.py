"""bench/spawn.py runs: a small burst in both modes, rendered."""

from __future__ import annotations

from bench.spawn import MODES, render, run


async def test_a_small_burst_in_both_modes_is_measured_and_rendered() -> None:
    raw = await run(burst=2, rounds=1)
    assert [r["mode"] for r in raw["rows"]] == list(MODES)
    for r in raw["rows"]:
        assert r["burst_s"] > 0 and 0 <= r["max_stall_ms"] <= r["sum_stall_ms"] + 0.1
    text = render(raw, "PYTHONPATH=. python3 bench/spawn.py --burst 2 --rounds 1")
    assert "| one fork at a time |" in text and "| all forks in one turn |" in text
    assert text.count("\n| 1 | ") == 2
