"""bench/warm_path.py: the overhead is the client's p50 less the function's own, and the split of it between
the GPU kind, sleeping and GPU work is taken between the right actions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.warm_path import derived, render_run, summarize  # noqa: E402


def _raw(client_ms: list[float], run_ms: list[float]) -> dict:
    cpu = {"standalone": 1.0, "runtime proxies": 0.5}
    return {"client_ms": client_ms, "run_ms": run_ms, "cpu": [cpu, {**cpu, "standalone": 3.0}, cpu],
            "batch_overhead_ms": [2.0, 2.5]}


def test_overhead_is_client_p50_less_run_p50_and_the_split_subtracts_the_right_pairs() -> None:
    raw = {
        "cpu-noop": _raw([2.0, 2.2, 9.0], [0.0, 0.0, 0.0]),
        "gpu-noop": _raw([2.1, 2.3, 2.4], [0.0, 0.0, 0.0]),
        "cpu-sleep": _raw([9.0, 9.3, 9.9], [7.0, 7.0, 7.1]),
        "resnet50": _raw([9.6, 9.8, 30.0], [7.0, 7.1, 7.2]),
    }
    rows = summarize(raw)
    assert rows["cpu-noop"]["overhead_p50_ms"] == pytest.approx(2.2)  # medians, so the 9 ms outlier is not in
    assert rows["resnet50"]["overhead_p50_ms"] == pytest.approx(9.8 - 7.1)
    assert rows["cpu-noop"]["cpu_ms_per_invoke"]["standalone"] == 1.0  # the median over batches
    line = derived(rows)[0]
    assert "GPU kind: +0.100 ms" in line  # 2.3 - 2.2
    assert "sleeping: +0.100 ms" in line  # (9.3 - 7.0) - 2.2
    assert "GPU work: +0.400 ms" in line  # (9.8 - 7.1) - (9.3 - 7.0)
    text = render_run("t", rows, "cmd", "machine")
    assert "| resnet50 | 3 | 9.8 |" in text and "2.0–2.5" in text


def test_a_run_without_the_sleeping_action_says_so_rather_than_guess() -> None:
    rows = summarize({"cpu-noop": _raw([2.0], [0.0]), "resnet50": _raw([9.0], [7.0])})
    assert "sleeping: n/a" in derived(rows)[0] and "GPU work: n/a" in derived(rows)[0]
