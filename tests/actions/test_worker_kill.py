"""The runtime proxy kills its worker without reaping it: asyncio's child watcher collects the exit, so the
reason reported for a worker that died just before the kill is its real signal, not "exit 255"."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from dilu_invoker.actions.runtime import WorkerProcess, _describe_exit


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("dead_before_kill", [True, False], ids=["crashed", "live"])
async def test_kill_leaves_the_reaping_to_asyncio(late_child_watcher: None, caplog: pytest.LogCaptureFixture,
                                                  dead_before_kill: bool) -> None:
    worker = WorkerProcess(allow_concurrent=False)
    await worker.start()
    assert worker.process is not None
    pid = worker.process.pid
    try:
        if dead_before_kill:  # it crashed; its exit is not yet collected when the proxy kills it
            os.kill(pid, signal.SIGKILL)
            async with asyncio.timeout(10):
                while _state(pid) != "Z":
                    await asyncio.sleep(0.005)
        caplog.set_level(logging.WARNING, logger="asyncio")
        worker.kill()
        async with asyncio.timeout(10):
            returncode = await worker.process.wait()
        assert returncode == -signal.SIGKILL
        assert _describe_exit(returncode) == "the action process was killed by SIGKILL"
        assert not [r for r in caplog.records if "child process" in r.getMessage()]
    finally:
        await worker.close()
