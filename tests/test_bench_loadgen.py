"""bench/loadgen.py: the client loops every throughput figure uses keep their count, time and concurrency."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from loadgen import closed_loop, machine, percentile, sequential


async def test_closed_loop_runs_clients_concurrently_for_a_count() -> None:
    in_flight = peak = 0

    async def call() -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1

    result = await closed_loop(call, 7, per_client=5)
    assert result.calls == 35 and peak == 7
    assert result.rate == pytest.approx(35 / result.seconds)


async def test_closed_loop_stops_after_its_time() -> None:
    async def call() -> None:
        await asyncio.sleep(0.01)

    t = time.monotonic()
    result = await closed_loop(call, 3, seconds=0.2)
    assert 0.2 <= time.monotonic() - t < 1.0
    assert 3 <= result.calls <= 3 * 21


async def test_closed_loop_needs_one_bound_and_sequential_times_each_call() -> None:
    async def call() -> None:
        await asyncio.sleep(0.005)

    with pytest.raises(ValueError, match="exactly one"):
        await closed_loop(call, 1)
    with pytest.raises(ValueError, match="exactly one"):
        await closed_loop(call, 1, seconds=1, per_client=1)
    lat = await sequential(call, 4)
    assert len(lat) == 4 and all(ms >= 5 for ms in lat)
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 3.0
    assert "cores" in machine() and "load average" in machine(load=True)
