"""A runtime that dies in the middle of an activation: the record blames the action (developer error)
and the next invoke of the action gets a fresh container (a cold start)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from dilu_invoker import config
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.model import GUEST_IDENTITY, Action, ActivationRequest, ActivationStatus, Exec, new_activation_id

CODE = """
import os, time

def main(args):
    if args.get("pidfile"):
        with open(args["pidfile"], "w") as f:
            f.write(f"{os.getppid()} {os.getpid()}")
        time.sleep(30)
    return {"pid": os.getpid()}
"""


@pytest.fixture
async def invoker() -> AsyncIterator[Invoker]:
    base = config.load(environ={})
    cfg = replace(base, invoker=replace(base.invoker, user_memory_mb=1024, idle_timeout_s=60))
    async with open_invoker(cfg) as inv:
        yield inv


def _req(content: dict[str, object]) -> ActivationRequest:
    action = Action(namespace="guest", name="dies", exec=Exec(kind="python:3", code=CODE), revision="1-a")
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                             content=content)


@pytest.mark.parametrize("victim", ["proxy", "worker"])
async def test_runtime_killed_mid_activation_is_a_developer_error_then_a_cold_start(
    invoker: Invoker, request: pytest.FixtureRequest, victim: str
) -> None:
    first = await invoker.run(_req({}))
    assert first.response.status is ActivationStatus.SUCCESS
    # The action runs as its own uid (process isolation), so it writes into a directory open to it.
    shared = Path(tempfile.mkdtemp(prefix="dilu-death-"))
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    shared.chmod(0o777)
    pidfile = shared / "pids"
    running = asyncio.create_task(invoker.run(_req({"pidfile": str(pidfile)})))
    async with asyncio.timeout(20):
        while not pidfile.exists() or not pidfile.read_text():
            await asyncio.sleep(0.02)
    proxy, worker = (int(p) for p in pidfile.read_text().split())
    os.kill(proxy if victim == "proxy" else worker, signal.SIGKILL)
    died = await asyncio.wait_for(running, 20)
    assert "pid" not in (died.response.result or {}), died.response
    assert died.response.status is ActivationStatus.DEVELOPER_ERROR
    assert isinstance(died.response.result, dict) and died.response.result.get("error")
    again = await invoker.run(_req({}))
    assert again.response.status is ActivationStatus.SUCCESS
    assert again.annotation("initTime") is not None  # a cold start: a new container was initialized
    assert again.response.result != first.response.result  # another worker process


async def test_runtime_dead_before_it_listens_fails_the_cold_start_at_once(invoker: Invoker) -> None:
    """A runtime killed before it listened (another invoker's sweep, the OOM killer, a taken port): its
    /init is not retried until the action's 60 s timeout, the activation says it exited, and the
    next invoke starts a new container."""
    start = invoker.backend.start

    async def start_then_kill(spec):
        container = await start(spec)
        os.kill(container.pid, signal.SIGKILL)
        return container

    invoker.backend.start = start_then_kill  # type: ignore[method-assign]
    died = await asyncio.wait_for(invoker.run(_req({})), 15)
    assert died.response.status is ActivationStatus.DEVELOPER_ERROR
    assert died.response.result == {"error": "The action did not initialize and exited unexpectedly."}
    assert died.annotation("timeout") is False
    invoker.backend.start = start  # type: ignore[method-assign]
    again = await invoker.run(_req({}))
    assert again.response.status is ActivationStatus.SUCCESS
