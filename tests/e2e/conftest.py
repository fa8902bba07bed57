"""Fixtures of the end-to-end tests: a real ``dilu-invoker standalone`` process per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ow_support.faults import Standalone


@pytest.fixture
def standalone_args() -> list[str]:
    """Flags the ``standalone`` fixture's process gets besides its data dir and API port (a module overrides
    this fixture for its own)."""
    return []


@pytest.fixture
async def standalone(tmp_path: Path, standalone_args: list[str]) -> AsyncIterator[Standalone]:
    """A standalone on a free port with its data in ``tmp_path/data``, up (its ``standalone ready`` logged);
    killed with whatever it started at the end."""
    server = Standalone(tmp_path / "data", args=standalone_args)
    await server.start()
    try:
        yield server
    finally:
        await server.kill()
