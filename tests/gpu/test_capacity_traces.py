"""The capacity estimator on stats-block traces of real models recorded under the shim on an H200
(``bench/gpu_traces.py traces``; tests/gpu/data/trace_*.json.gz): ResNet-50 and BERT-base inference, fp16
batch 8, through loading, warm-up, serving, paced requests and idle, one snapshot every 50 ms, unlimited.

The estimator must learn nothing before the model serves, and then a capacity at least the serving busy
rate (so a share s gives at least s of the instance's own speed). The rule it replaced (learn from the
first period with two busy windows) would have taken a warm-up rate a few per cent of that: the trap is in
the real data, not only in the fake driver's replay (test_capacity_e2e.py).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from dilu_invoker.gpu import abi
from dilu_invoker.gpu.manager import (
    CapacityConfig,
    CapacityEstimate,
    CapacityObservation,
    Counters,
    Reading,
    estimate_capacity,
    read_delta,
)

DATA = Path(__file__).resolve().parent / "data"
FIELDS = {f.name for f in dataclasses.fields(abi.StatsSnapshot)}


def _snapshot(raw: dict[str, Any]) -> abi.StatsSnapshot:
    values = {k: raw[k] for k in FIELDS}
    values.update(flags=abi.StatsFlag(raw["flags"]), recent_cycles=tuple(raw["recent_cycles"]),
                  recent_spans_us=tuple(raw["recent_spans_us"]))
    return abi.StatsSnapshot(**values)


def _periods(model: str) -> list[tuple[str, Reading, float, float]]:
    """(phase, reading, elapsed s, time s) per 50 ms period of the trace."""
    doc = json.loads(gzip.open(DATA / f"trace_{model}.json.gz").read())
    assert doc["rc"] == 0
    phases = doc["phases"]
    out = []
    counters: Counters | None = None
    last_t: int | None = None
    for raw in doc["snapshots"]:
        reading, counters = read_delta(counters, _snapshot(raw), now_ns=raw["t_ns"])
        if last_t is not None:
            phase = ([p for p, t in phases if t <= raw["t_ns"]] or ["start"])[-1]
            out.append((phase, reading, (raw["t_ns"] - last_t) / 1e9, raw["t_ns"] / 1e9))
        last_t = raw["t_ns"]
    return out


def _observation(r: Reading, elapsed: float, now: float) -> CapacityObservation:
    return CapacityObservation(blocks=r.blocks, busy_windows=r.busy_windows, window_s=r.window_s, elapsed_s=elapsed,
                               throttled_s=r.throttled_s, limited=False, at_limit=True, others_latency_active=False,
                               windows=r.windows, mem_grown_bytes=r.mem_grown_bytes, now=now)


@pytest.mark.parametrize("model", ["resnet50", "bert"])
def test_capacity_is_learnt_from_serving_not_from_loading(model: str) -> None:
    periods = _periods(model)
    assert [p for p in dict.fromkeys(p for p, *_ in periods) if p != "start"][:4] == ["import", "build", "load", "warmup"]
    serving = [_observation(r, e, t).busy_rate for p, r, e, t in periods
               if p == "serve" and r.busy_windows == r.windows and r.blocks > 0]
    assert len(serving) > 20
    served = statistics.median(serving)
    est = CapacityEstimate()
    learnt_in = None
    for phase, r, elapsed, now in periods:
        before = est.value
        est, why = estimate_capacity(est, _observation(r, elapsed, now), CapacityConfig())
        if before is None and est.value is not None:
            learnt_in = phase
            first = est.value
            assert why.startswith("learnt"), why
    assert learnt_in == "serve", learnt_in
    assert first >= served, (first, served)
    assert est.value is not None and est.value >= served

    # The old rule: the first period with two busy windows, no token waits and some blocks.
    old = next(_observation(r, e, t).busy_rate for p, r, e, t in periods if r.busy_windows >= 2 and r.blocks > 0)
    assert old < 0.05 * served, (old, served)
