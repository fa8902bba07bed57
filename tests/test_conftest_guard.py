"""The shared event-loop guard of tests/conftest.py fails an async test that blocks its loop."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

_TESTS = '''
import asyncio
import time

import pytest


async def test_blocks():
    time.sleep(0.7)


@pytest.mark.allow_loop_block
async def test_blocks_but_allowed():
    time.sleep(0.7)


async def test_awaits():
    await asyncio.sleep(0.7)


def test_sync_may_sleep():
    time.sleep(0.5)
'''


def test_guard_fails_only_the_blocking_test(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_guarded=_TESTS)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("DILU_TEST_LOOP_BLOCK_S", "0.3")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_blocks *", "the event loop was blocked for *"])
    result.stdout.fnmatch_lines(["*test_guarded.py*in test_blocks", "*time.sleep(0.7)"])  # where it blocked
