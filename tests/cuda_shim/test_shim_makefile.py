"""The shim's Makefile keeps its own names: a variable given to the top-level `make` (as `make test
TESTS=tests/x.py` does) reaches every sub-make, and must not turn a Python test path into a build target."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SHIM_DIR = Path(__file__).resolve().parents[2] / "cuda_shim"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_tests_variable_from_the_top_level_make_builds_nothing_under_its_name(tmp_path: Path) -> None:
    target = "tests/gpu/test_product_bench.py"
    out = subprocess.run(
        ["make", "-n", "-B", "-C", str(SHIM_DIR), "tests", f"TESTS={target}", f"BUILD={tmp_path}/build"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert f"{tmp_path}/build/tests/shim_tests" in out  # the C test program is still built...
    assert target not in out  # ...and nothing under the pytest path's name
    assert not (SHIM_DIR / target).exists()
