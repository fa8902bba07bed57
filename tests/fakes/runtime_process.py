"""Start an OpenWhisk runtime (ours or the fake upstream one) as a real child process on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[2]
SENTINEL = b"XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX"
OURS = "dilu_invoker.actions.runtime"
FAKE_UPSTREAM = "tests.fakes.upstream_runtime"
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class Frame:
    """One stream's output up to a sentinel: the first lines (capped) and the total size."""

    lines: list[str] = field(default_factory=list)
    total_bytes: int = 0
    line_count: int = 0


class FrameReader:
    """Drains one pipe in the background (so the runtime never blocks on a full pipe) and cuts it at sentinels.

    Keeps at most `max_lines` lines of at most `max_line_bytes` each per frame, so a flood costs no memory.
    """

    def __init__(self, stream: asyncio.StreamReader, *, max_lines: int = 200, max_line_bytes: int = 4096) -> None:
        self.frames: asyncio.Queue[Frame] = asyncio.Queue()
        self.eof = asyncio.Event()
        self._stream = stream
        self._max_lines = max_lines
        self._max_line_bytes = max_line_bytes
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        frame = Frame()
        head, tail, line_len = bytearray(), b"", 0
        while chunk := await self._stream.read(1 << 16):
            start = 0
            while start < len(chunk):
                newline = chunk.find(b"\n", start)
                piece = chunk[start : len(chunk) if newline < 0 else newline]
                line_len += len(piece)
                if len(head) < self._max_line_bytes:
                    head += piece[: self._max_line_bytes - len(head)]
                tail = (tail + piece)[-len(SENTINEL) :]
                if newline < 0:
                    break
                start = newline + 1
                if tail == SENTINEL:
                    # Output without a final newline shares the sentinel's line.
                    prefix_len = line_len - len(SENTINEL)
                    if prefix_len:
                        self._add(frame, bytes(head[:prefix_len]), prefix_len)
                    self.frames.put_nowait(frame)
                    frame = Frame()
                else:
                    self._add(frame, bytes(head), line_len)
                head, tail, line_len = bytearray(), b"", 0
        if line_len:
            self._add(frame, bytes(head), line_len)
        if frame.line_count:
            self.frames.put_nowait(frame)
        self.eof.set()

    def _add(self, frame: Frame, line: bytes, length: int) -> None:
        frame.total_bytes += length + 1
        frame.line_count += 1
        if len(frame.lines) < self._max_lines:
            frame.lines.append(line.decode("utf-8", "replace"))

    async def next(self, timeout_s: float = 30.0) -> Frame:
        return await asyncio.wait_for(self.frames.get(), timeout_s)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@dataclass(slots=True)
class RuntimeProcess:
    process: asyncio.subprocess.Process
    port: int
    stdout: FrameReader | None
    stderr: FrameReader | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    async def frames(self, timeout_s: float = 30.0) -> tuple[Frame, Frame]:
        """The next activation's (stdout, stderr) frames."""
        assert self.stdout is not None and self.stderr is not None
        return await self.stdout.next(timeout_s), await self.stderr.next(timeout_s)


async def _wait_listening(port: int, process: asyncio.subprocess.Process) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    while loop.time() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"runtime exited with {process.returncode} before listening")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
    raise RuntimeError(f"runtime did not listen on {port} within {START_TIMEOUT_S} s")


async def spawn(
    module: str = OURS,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    wait: bool = True,
) -> asyncio.subprocess.Process:
    port = free_port() if port is None else port
    child_env = dict(os.environ)
    child_env.pop("__OW_ALLOW_CONCURRENT", None)
    child_env.update(env or {})
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        "--port",
        str(port),
        *args,
        cwd=str(REPO_ROOT),
        env=child_env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        limit=1 << 20,
    )


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def running_runtime(
    module: str = OURS,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    frames: bool = True,
) -> AsyncIterator[RuntimeProcess]:
    """A runtime child process on a free loopback port, stopped (SIGTERM, then SIGKILL) afterwards.

    With `frames` the pipes are drained into sentinel-cut frames; without, the caller reads
    `process.stdout` / `process.stderr` itself (and must keep reading them).
    """
    port = free_port()
    # Its own TMPDIR, removed afterwards, so that even a SIGKILLed runtime leaves nothing behind.
    scratch = tempfile.mkdtemp(prefix="dilu-test-runtime-")
    process = await spawn(module, args=args, env={"TMPDIR": scratch, **(env or {})}, port=port)
    stdout = stderr = None
    try:
        if frames:
            assert process.stdout is not None and process.stderr is not None
            stdout, stderr = FrameReader(process.stdout), FrameReader(process.stderr)
        await _wait_listening(port, process)
        yield RuntimeProcess(process, port, stdout, stderr)
    finally:
        await stop(process)
        for reader in (stdout, stderr):
            if reader is not None:
                await reader.close()
        shutil.rmtree(scratch, ignore_errors=True)


async def wait_for_active_runs(session: aiohttp.ClientSession, url: str, count: int, timeout_s: float = 30.0) -> None:
    """Wait until our runtime reports `count` runs inside its worker (GET /health)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        async with session.get(url + "/health") as response:
            if (await response.json())["active_runs"] == count:
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the runtime never had {count} active runs")
