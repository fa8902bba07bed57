"""bench/split_hop.py runs a real two-stage instance through the invoker's instance manager and times what handing
a result on costs; here tiny, for its plumbing (the figures are the benchmark page's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_hop_bench_hands_each_size_on_and_reports_it(tmp_path: Path) -> None:
    out, page = tmp_path / "hop.json", tmp_path / "hop.md"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "split_hop.py"), "--sizes", "0.01,0.05",
                           "--requests", "2", "--json", str(out), "--out", str(page)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    raw = json.loads(out.read_text())
    rows = raw["rows"]
    # each size in each way, alternating in one run: a tensor as a stage frame and as base64 JSON, a string as JSON
    assert [(r["mib"], r["payload"], r["mode"]) for r in rows] == [
        (mib, payload, mode) for mib in (0.01, 0.05)
        for payload, mode in (("tensor", "frames"), ("tensor", "json"), ("string", "json"))]
    for r in rows:
        assert r["bytes"] == int(r["mib"] * (1 << 20))
        assert len(r["empty_all"]) == len(r["with_all"]) == 2 and min(r["empty_all"] + r["with_all"]) > 0
        assert r["hop_ms"] == r["with_ms"] - r["empty_ms"] - r["stages_work_ms"]
    assert raw["direct_lane"] is True
    text = page.read_text()
    assert "bench/split_hop.py --sizes 0.01,0.05" in text and "| 0.05 | tensor | frames |" in text
    for flag, value in (("--sizes", "100"), ("--payloads", "video")):
        bad = subprocess.run([sys.executable, str(ROOT / "bench" / "split_hop.py"), flag, value],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and flag in bad.stderr


def test_the_hop_bench_runs_over_http_without_the_direct_lane(tmp_path: Path) -> None:
    out, page = tmp_path / "hop.json", tmp_path / "hop.md"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "split_hop.py"), "--sizes", "0.01", "--requests", "1",
                           "--payloads", "tensor", "--no-direct-lane", "--json", str(out), "--out", str(page)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    raw = json.loads(out.read_text())
    assert raw["direct_lane"] is False and [(r["payload"], r["mode"]) for r in raw["rows"]] == [
        ("tensor", "frames"), ("tensor", "json")]
    assert "* path: the runtimes' HTTP endpoints" in page.read_text()
