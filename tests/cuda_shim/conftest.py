"""Fixtures for the shim tests: one `make -C cuda_shim tests` per session."""

from __future__ import annotations

import subprocess

import pytest
from shim_testlib import SHIM_DIR, ShimBuild


@pytest.fixture(scope="session")
def shim_build() -> ShimBuild:
    """Build the shim, the fake libcuda and the C test programs (needs gcc and cuda.h)."""
    result = subprocess.run(
        ["make", "-C", str(SHIM_DIR), "tests"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, (
        f"make -C cuda_shim tests failed:\n{result.stdout}\n{result.stderr}"
    )
    build = SHIM_DIR / "build"
    return ShimBuild(
        build=build,
        library=build / "libdilu_shim.so",
        fake_dir=build / "fake",
        tests=build / "tests" / "shim_tests",
        launch_loop=build / "tests" / "launch_loop",
    )
