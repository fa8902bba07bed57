"""The shared guards of tests/conftest.py: the event-loop guard fails an async test that blocks its loop, the
collector guard a test that leaves the garbage collector changed."""

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


_GC_TESTS = '''
import gc


def test_leaves_a_threshold_raised():
    gc.set_threshold(700, 10, 1 << 30)


def test_sees_the_thresholds_back():
    assert gc.get_threshold()[2] != 1 << 30


def test_leaves_objects_frozen():
    gc.freeze()


def test_sees_nothing_frozen():
    assert gc.get_freeze_count() == 0
'''


def test_collector_guard_fails_the_test_that_changes_it(pytester: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that leaves the garbage collector's thresholds changed or objects frozen fails at teardown, and the
    next test runs with the settings put back."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_gc=_GC_TESTS)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaves_a_threshold_raised*",
                                 "the test left the garbage collector changed: thresholds (700, 10, 1073741824)*"])
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaves_objects_frozen*"])
