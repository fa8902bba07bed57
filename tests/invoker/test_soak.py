"""A bounded version of bench/soak.py: a mixed create/update/invoke/delete run on an isolated standalone
leaves no private directory and no process behind (the full 5-minute soak and its RSS and latency
figures are in docs/benchmarks/soak.md)."""

from __future__ import annotations

import os

import pytest

from bench.soak import run_soak

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="isolation needs root")]


@pytest.mark.allow_loop_block
async def test_mixed_soak_leaks_nothing() -> None:
    result = await run_soak(10, 15, actions=4, warmup_s=3)
    assert result.ops["invoke"] > 50 and result.ops["update"] > 0, result.ops
    assert result.statuses["invoke 200"] > 50 and result.failed_invokes == 0, result.statuses
    assert result.peak_dirs > 0
    assert result.leaked_dirs == [] and result.leaked_after_stop_dirs == []
    assert result.leaked_processes == []
