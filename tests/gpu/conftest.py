"""Fixtures of the GPU manager tests: the real shim and the fake driver, and tenant processes under them."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator

import pytest

from tests.gpu.support import SHIM_DIR, ShimBuild, Tenant


@pytest.fixture(scope="session")
def shim_build() -> ShimBuild:
    """``make -C cuda_shim tests``: the shim and the fake libcuda (needs gcc and cuda.h)."""
    result = subprocess.run(["make", "-C", str(SHIM_DIR), "tests"], capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, f"make -C cuda_shim tests failed:\n{result.stdout}\n{result.stderr}"
    build = SHIM_DIR / "build"
    return ShimBuild(library=build / "libdilu_shim.so", fake_dir=build / "fake")


@pytest.fixture
async def tenants() -> AsyncIterator[list[Tenant]]:
    """Tenants started with ``start_tenant(tenants, env, ...)``; all are killed afterwards."""
    started: list[Tenant] = []
    yield started
    for t in started:
        await t.stop()
