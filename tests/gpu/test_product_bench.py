"""bench/gpu_product.py --dry-run end to end on a machine without a GPU: a real standalone (REST API,
balancer, invoker, embedded Redis, action processes) on a simulated GPU (its shim and manager run; the actions
launch through the fake libcuda where it is built, else sleep), actions created over the REST API, the
scenarios driven from the client, the JSON, the report and the matrix tables written. This checks the
harness, not any speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_dry_run_writes_every_mode_and_scenario(tmp_path: Path) -> None:
    out, report = tmp_path / "r.json", tmp_path / "r.md"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", str(ROOT / "bench/gpu_product.py"), "--dry-run",
         "--seconds", "0.6", "--modes", "noshim,slo-ts", "--pairs", "resnet50+train", "--loads", "0.5",
         "--scenarios", "cold,solo,share,paced,burst,idle", "--arrivals", "paced,bursty", "--out", str(out),
         "--report", str(report), "--matrix", str(tmp_path / "page.md")],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["dry_run"] is True
    assert doc["errors"] == [], doc["errors"]  # in full: a failed cold start carries its standalone's log lines
    assert [c["mode"] for c in doc["cells"]] == ["noshim", "slo-ts"]
    for cell in doc["cells"]:
        assert cell["solo"]["requests"] > 0 and cell["solo"]["failed"] == 0
        assert cell["cold_start_ms"]["infer"] > 0 and cell["solo_train_it_s"] > 0
        assert {"paced@0.5", "bursty@0.5", "burst", "idle"} <= set(cell["scenarios"])
        assert cell["scenarios"]["paced@0.5"]["failed"] == 0 and cell["scenarios"]["paced@0.5"]["train_it_s"]
        assert cell["scenarios"]["bursty@0.5"]["failed"] == 0 and cell["scenarios"]["bursty@0.5"]["train_vs_ref"]
        assert cell["log_levels"].get("info", 0) > 0
        assert cell["effective"]["mps"] is False  # time-slicing: --gpu-mps off in both modes
        # The stack's floor on the host: a warm CPU no-op through the same standalone.
        assert cell["noop"]["requests"] > 0 and cell["noop"]["failed"] == 0 and cell["noop"]["p50_ms"] > 0
    assert doc["machine"]["fsync_p50_ms"] is not None and doc["machine"]["fsync_p50_ms"] >= 0
    # What the invoker ran, from its log: the simulated GPU's shim and manager under the selected policy.
    assert doc["cells"][0]["effective"]["shim"] is False
    assert doc["cells"][1]["effective"]["policy"] == "slo" and doc["cells"][1]["effective"]["shim"] is True
    # Each class's start cap as the manager logged it: time-sliced, every client at its limit.
    assert doc["cells"][1]["effective"]["mps_threads"] == {"inference": [0.8], "training": [0.7]}
    shim = doc["cells"][1]["scenarios"]
    assert {"share@0.5", "share@0.8", "share@1"} <= set(shim)
    for share in ("share@0.5", "share@0.8", "share@1"):
        got = {k: v for k, v in shim[share].items() if k != "per_second"}
        # The message is one string (a tuple would be cut short): what failed and the share stack's warnings.
        assert shim[share]["failed"] == 0 and shim[share]["p50_vs_unlimited"] is not None, json.dumps(
            [share, got, doc["cells"][1].get("warnings"), doc["cells"][1]["share_log_problems"]], indent=1)
    text = report.read_text()
    assert "**dry run**" in text and "| paced@0.5 | slo-ts |" in text and "| 0.5 | slo-ts |" in text
    page = (tmp_path / "page.md").read_text()
    assert "| bursty@0.5 | slo-ts |" in page and "time-slicing, slo" in page
