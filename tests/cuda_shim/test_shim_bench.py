"""The H200 benchmark pipeline (bench/shim): analysis helpers, the report, and a dry run."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from shim_testlib import REPO


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"bench_shim_{name}", REPO / "bench" / "shim" / f"{name}.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


h200 = _load("h200")
report = _load("report")


def _step_bins(
    old: float,
    new: float,
    change_ms: float,
    total_ms: float = 3000.0,
    bin_ms: float = 2.0,
) -> list[float]:
    """Blocks per 2 ms bin of a rate that jumps from old to new at change_ms."""
    n = int(total_ms / bin_ms)
    return [(new if i * bin_ms >= change_ms else old) * bin_ms for i in range(n)]


@pytest.mark.parametrize(
    ("old", "new"), [(400.0, 1600.0), (1600.0, 400.0)], ids=["increase", "decrease"]
)
def test_reaction_times_of_a_step(old: float, new: float) -> None:
    # written at 1000 ms, effective at 1005 ms: bin [1006, 1008) is the first at the new
    # rate; a 4 ms trailing average is half-way at its end (8 ms) and there at 10 ms
    r = h200.reaction_times(_step_bins(old, new, 1005.0), 2.0, 1000.0)
    assert r["old_blocks_per_ms"] == old and r["new_blocks_per_ms"] == new
    assert r["t50_ms"] == 8.0 and r["t90_ms"] == 10.0


def test_reaction_times_when_nothing_changes() -> None:
    r = h200.reaction_times(_step_bins(500.0, 500.0, 0.0), 2.0, 1000.0)
    assert r["t50_ms"] is None and r["t90_ms"] is None


def test_pick_cpu_falls_back_to_an_allowed_cpu() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert h200.pick_cpu(str(allowed[0])) == str(allowed[0])
    assert h200.pick_cpu("100000") == str(allowed[-1])
    assert h200.pick_cpu(None) == str(allowed[-1])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('noise\n{"a": 1}\n', {"a": 1}),
        ("no json", None),
        ('{"a": 1}\n{broken\n', None),
        ("[1, 2]\n", None),
    ],
    ids=["last-line", "none", "broken-last", "not-an-object"],
)
def test_last_json(text: str, expected: dict[str, int] | None) -> None:
    assert h200.last_json(text) == expected


def test_report_of_a_partial_run_is_honest() -> None:
    doc = {
        "generated": "now",
        "command": "cmd",
        "machine": "GPU X",
        "steps": {
            "enqueue": {
                "grid_1": {
                    "native": {
                        "enqueue_us_p50": {
                            "runs": [3.0, 3.1],
                            "min": 3.0,
                            "median": 3.05,
                        }
                    },
                    "passthrough": {
                        "enqueue_us_p50": {"runs": [3.3], "min": 3.3, "median": 3.3},
                        "overhead_us_median": 0.25,
                        "overhead_us_min": 0.3,
                    },
                }
            },
            "accuracy": {"error": "Traceback ...\nRuntimeError: calibration failed"},
            "threads64": {"ok": True},
        },
    }
    md = report.render(doc)
    assert (
        "| (a) enqueue overhead, pass-through | <= 0.1 us/launch | +0.300 us (minima), "
        "+0.250 us (medians) | **not met** |" in md
    )
    assert "| 64 launching threads | no hang | ok | **met** |" in md
    assert "| (b) achieved share, two processes | within +-5 pp | n/a | n/a |" in md
    assert "- `accuracy`: RuntimeError: calibration failed" in md
    assert "DRY RUN" not in md and "GPU X" in md


def test_report_marks_a_dry_run() -> None:
    assert "DRY RUN" in report.render({"dry_run": True, "steps": {}})


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(),
    reason="needs nvcc",
)
def test_dry_run_of_the_whole_pipeline(tmp_path: Path) -> None:
    """run_h200.sh with stand-ins for the GPU programs: every step runs, merges and renders."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DILU_", "LD_PRELOAD"))
    }
    env.update(OUT=str(tmp_path), DILU_BENCH_SCALE="0.01", PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", str(REPO / "bench" / "shim" / "dry_run.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "machine.txt",
        "shim.md",
        "shim_log.txt",
        "shim_results.json",
    ]
    doc = json.loads((tmp_path / "shim_results.json").read_text())
    assert doc["dry_run"] is True
    errors = {
        name: step.get("error")
        for name, step in doc["steps"].items()
        if step.get("error")
    }
    assert errors == {}
    assert (
        doc["steps"]["c_tests"]["ok"] is True and doc["steps"]["memcap"]["ok"] is True
    )
    assert (
        len(doc["steps"]["accuracy"]["pairs"]) == 3
        and len(doc["steps"]["mps"]["pairs"]) == 3
    )
    assert "DRY RUN" in (tmp_path / "shim.md").read_text()
