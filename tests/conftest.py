"""Fixtures every area shares: real redis-server processes, and a guard against blocking the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import structlog

from dilu_invoker.redis_embedded import EmbeddedRedis, redis_client
from tests.host_lock import host_lock

# --------------------------------------------------------------------------------------------
# Event-loop guard
# --------------------------------------------------------------------------------------------

#: an async test whose event loop stops turning for longer than this fails (override with the variable)
LOOP_BLOCK_LIMIT_S = float(os.environ.get("DILU_TEST_LOOP_BLOCK_S", "0.5"))


def pytest_configure(config: pytest.Config) -> None:
    # structlog's default console renderer draws tracebacks with rich (locals included) when rich is
    # installed, which takes long enough to trip the loop guard; tests log plain tracebacks instead.
    structlog.configure(processors=[
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.StackInfoRenderer(),
        structlog.dev.set_exc_info,
        structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
        structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
    ])
    config.addinivalue_line(
        "markers", "allow_loop_block: this async test may block its event loop (the guard does not fail it)"
    )


class LoopWatchdog:
    """A loop callback stamps a heartbeat every 20 ms; a thread notices when the stamp gets old while the
    loop is running and keeps the stack of the loop's thread at the worst moment."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float) -> None:
        self.loop = loop
        self.limit_s = limit_s
        self.worst_s = 0.0
        self.where = ""
        self._last = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._handle: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._handle is not None:
            self._handle.cancel()

    def _beat(self) -> None:
        self._last = time.monotonic()
        self._handle = self.loop.call_later(0.02, self._beat)

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            if not self.loop.is_running():
                # Between fixture steps pytest-asyncio stops the loop; that is not a block.
                self._last = time.monotonic()
                continue
            lag = time.monotonic() - self._last
            if lag > self.limit_s and lag > self.worst_s:
                self.worst_s = lag
                frame = sys._current_frames().get(self._loop_thread)
                self.where = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"


@pytest_asyncio.fixture(autouse=True)
async def _event_loop_block_guard(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    if not inspect.iscoroutinefunction(getattr(request, "function", None)) or request.node.get_closest_marker(
        "allow_loop_block"
    ):
        yield
        return
    watchdog = LoopWatchdog(asyncio.get_running_loop(), LOOP_BLOCK_LIMIT_S)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.stop()
    if watchdog.worst_s > LOOP_BLOCK_LIMIT_S:
        pytest.fail(
            f"the event loop was blocked for {watchdog.worst_s:.2f} s (limit {LOOP_BLOCK_LIMIT_S} s; "
            f"mark the test allow_loop_block if that is intended). Loop thread at the time:\n{watchdog.where}",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _collector_settings_guard() -> Iterator[None]:
    """The cyclic collector's thresholds and frozen objects are the process's: a test that leaves them changed
    (a balancer leader not stopped, `service.LongLived`) would change how every later test collects garbage.
    The test that did so fails, and the settings are put back for the next."""
    import gc

    thresholds = gc.get_threshold()
    yield
    after, frozen = gc.get_threshold(), gc.get_freeze_count()
    if after != thresholds or frozen:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        pytest.fail(f"the test left the garbage collector changed: thresholds {after} (were {thresholds}), "
                    f"{frozen} objects frozen", pytrace=False)


# --------------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------------

RedisFactory = Callable[..., Awaitable[EmbeddedRedis]]


@pytest.fixture
async def redis_server_factory(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RedisFactory]:
    """``server = await redis_server_factory(data_dir=None, persistent=False, **kw)`` starts a real
    redis-server on a free loopback port with a random password; all are stopped after the test."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(*, data_dir: Path | None = None, persistent: bool = False, **kwargs: Any) -> EmbeddedRedis:
            server = EmbeddedRedis(data_dir or tmp_path_factory.mktemp("redis"), persistent=persistent, **kwargs)
            stack.push_async_callback(server.stop)
            await server.start()
            return server

        yield start


@pytest.fixture
async def redis_server(redis_server_factory: RedisFactory) -> EmbeddedRedis:
    return await redis_server_factory()


@pytest.fixture
async def redis(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """A client of a fresh, empty redis-server of this test."""
    client = redis_client(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


# --------------------------------------------------------------------------------------------
# Containers: the runtime images and podman's Docker-compatible API service
# --------------------------------------------------------------------------------------------

IMAGE_BUILD = Path(__file__).resolve().parents[1] / "dilu_invoker" / "actions" / "images" / "build_local.sh"


def _can_run_containers() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("podman", "debootstrap", "runc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (scripts/setup-test-env.sh installs it)"
    return None


@pytest.fixture(scope="session")
def runtime_images() -> list[str]:
    """Builds the runtime images once per session from a local root file system (no registry)."""
    reason = _can_run_containers()
    if reason:
        pytest.skip(reason)
    with host_lock("runtime-images"):  # one build at a time, whichever pytest process asks
        built = subprocess.run([str(IMAGE_BUILD)], check=True, capture_output=True, text=True, timeout=900)
    return built.stdout.split()


@pytest.fixture(scope="session")
def podman_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``unix://…`` of a private ``podman system service`` (the Docker API for the docker SDK)."""
    reason = _can_run_containers()
    if reason:
        pytest.skip(reason)
    sock = tmp_path_factory.mktemp("podman") / "api.sock"
    # In its own directory: conmon, the service's child per container, inherits the working directory and
    # writes an `oom` marker file there when a container is OOM-killed.
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"], cwd=sock.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def late_child_watcher() -> Iterator[None]:
    """asyncio's own child watcher, whose thread reaps each child 0.3 s late: as on a loaded host, where
    that thread is scheduled after the event loop has already acted on a child's death."""
    if not hasattr(asyncio, "set_child_watcher"):
        pytest.skip("this Python has no pluggable child watcher")

    class LateWatcher(asyncio.ThreadedChildWatcher):
        def _do_waitpid(self, loop: asyncio.AbstractEventLoop, expected_pid: int, callback: Any,
                        args: Any) -> None:
            time.sleep(0.3)
            super()._do_waitpid(loop, expected_pid, callback, args)  # type: ignore[misc]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        before = asyncio.get_child_watcher()
        asyncio.set_child_watcher(LateWatcher())
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_child_watcher(before)
