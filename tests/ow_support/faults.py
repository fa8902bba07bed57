"""Fault injection against a real ``dilu-invoker standalone``: the process, its embedded Redis and its
runtime processes; a bounded load of concurrent loopback clients; the answered-but-unrecorded check.

Used by ``tests/e2e/test_faults.py`` (small and bounded, in CI) and ``bench/faults.py`` (the figures of
``docs/benchmarks/faults.md``). Loopback only; every process started here is stopped by :meth:`Standalone.kill`
or :meth:`Standalone.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
GUEST = ("23bc46b1-71f6-4ed5-8c54-816aa4f8c502",
         "123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP")
AUTH = {"Authorization": aiohttp.encode_basic_auth(*GUEST)}
NOOP = "def main(args):\n    return {}\n"
#: what a client counts when no HTTP answer came (refused, reset, timed out)
NO_ANSWER = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[tuple[int, str]]:
    """Descendants of ``pid`` as (pid, command line), from /proc."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        cmdlines[int(entry)] = cmd.strip()
    out: list[tuple[int, str]] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                out.append((child, cmdlines[child]))
                frontier.append(child)
    return out


class Standalone:
    """``python -m dilu_invoker standalone`` on a free port with JSON logs in ``data_dir/standalone.log``."""

    def __init__(self, data_dir: Path, *, args: Sequence[str] = (), killable: bool = False) -> None:
        """``killable``: run it through ``killable_standalone.py`` (:meth:`kill_last_invoker`)."""
        self.data_dir = data_dir
        self.killable = killable
        self.port = free_port()
        self.args = list(args)
        self.proc: asyncio.subprocess.Process | None = None
        self.log = data_dir.parent / f"{data_dir.name}-standalone.log"
        self.ready: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 60.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DILU_LOG_JSON": "true"}
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            entry = ([str(Path(__file__).with_name("killable_standalone.py"))] if self.killable
                     else ["-m", "dilu_invoker", "standalone"])
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, *entry, "--data-dir", str(self.data_dir),
                "--api-port", str(self.port), *self.args,
                env=env, stdout=out, stderr=asyncio.subprocess.STDOUT, cwd=str(self.data_dir.parent))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in await asyncio.to_thread(self.events, offset):
                if event.get("event") == "standalone ready":
                    self.ready = event
                    return
            if self.proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        raise AssertionError(f"standalone did not come up:\n{self.log.read_text()[-4000:]}")

    def events(self, offset: int = 0) -> list[dict[str, Any]]:
        out = []
        with open(self.log, "rb") as f:
            f.seek(offset)
            for line in f:
                with contextlib.suppress(ValueError):
                    value = json.loads(line)
                    if isinstance(value, dict):
                        out.append(value)
        return out

    @property
    def invoker_urls(self) -> list[str]:
        return list(self.ready.get("invokers", []))

    async def processes(self, needle: str) -> list[int]:
        """Descendants whose command line contains ``needle`` (/proc is read off the event loop)."""
        assert self.proc is not None
        found = await asyncio.to_thread(children, self.proc.pid)
        return [pid for pid, cmd in found if needle in cmd]

    async def redis_pid(self) -> int:
        pids = await self.processes("redis-server")
        assert len(pids) == 1, pids
        return pids[0]

    async def runtime_pids(self) -> list[int]:
        return await self.processes("dilu_invoker.actions.runtime")

    async def kill_last_invoker(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Fault (d): the last invoker of ``--invokers N`` dies (``killable`` only); its ``invoker killed``
        log event once it is down."""
        assert self.proc is not None and self.killable
        offset = self.log.stat().st_size
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in await asyncio.to_thread(self.events, offset):
                if event.get("event") == "invoker killed":
                    return event
            await asyncio.sleep(0.05)
        raise AssertionError(f"the invoker was not killed:\n{self.log.read_text()[-4000:]}")

    async def stop(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), timeout_s)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def put_action(url: str, name: str = "noop", code: str = NOOP) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.put(f"{url}/api/v1/namespaces/_/actions/{name}?overwrite=true",
                         json={"exec": {"kind": "python:3", "code": code}}) as r:
            assert r.status == 200, await r.text()


@dataclass(frozen=True, slots=True)
class Answer:
    started: float
    ended: float
    status: int
    activation_id: str | None


@dataclass(slots=True)
class Run:
    """What one loaded run saw; times are seconds from the start of the load."""

    answers: list[Answer] = field(default_factory=list)
    fault_at: float | None = None
    probes: list[tuple[float, str, int]] = field(default_factory=list)  # (time, endpoint, status)
    unrecorded: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def statuses(self) -> Counter[int]:
        return Counter(a.status for a in self.answers)

    def served(self) -> int:
        return sum(1 for a in self.answers if a.status in (200, 202))

    def rate(self) -> float:
        return self.served() / self.seconds if self.seconds else 0.0

    def recovery_s(self) -> float | None:
        """From the fault to the last failed answer (0 when none failed); ``inf`` when nothing succeeded
        after it. Measured on answers rather than on a success started afterwards, whose own latency under
        load (about clients / rate) would be counted otherwise."""
        if self.fault_at is None:
            return None
        failed = [a.ended for a in self.answers if a.status not in (200, 202) and a.ended >= self.fault_at]
        if not failed:
            return 0.0
        last_failure = max(failed)
        if not any(a.status in (200, 202) and a.ended > last_failure for a in self.answers):
            return float("inf")
        return last_failure - self.fault_at


async def load(url: str, *, clients: int, seconds: float, action: str = "noop",
               fault_at: float | None = None, fault: Callable[[], Awaitable[None]] | None = None,
               probe: Sequence[str] = (), request_timeout_s: float = 30.0) -> Run:
    """``clients`` concurrent loops of blocking invokes for ``seconds``; ``fault`` runs at ``fault_at``;
    ``probe`` URLs are polled every 0.1 s meanwhile (their statuses are kept)."""
    run = Run()
    target = f"{url}/api/v1/namespaces/_/actions/{action}?blocking=true"
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    start = time.monotonic()
    stop_at = start + seconds
    async with aiohttp.ClientSession(headers=AUTH, connector=connector, timeout=timeout) as session:

        async def client() -> None:
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                status, aid = NO_ANSWER, None
                try:
                    async with session.post(target, json={}) as r:
                        await r.read()
                        status, aid = r.status, r.headers.get("x-openwhisk-activation-id")
                except (aiohttp.ClientError, TimeoutError, OSError):
                    await asyncio.sleep(0.1)  # the server is gone: do not spin
                run.answers.append(Answer(t0 - start, time.monotonic() - start, status, aid))

        async def inject() -> None:
            assert fault_at is not None and fault is not None
            await asyncio.sleep(fault_at)
            run.fault_at = time.monotonic() - start
            await fault()

        async def poll() -> None:
            while time.monotonic() < stop_at:
                for p in probe:
                    status = NO_ANSWER
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                        async with session.get(p, timeout=aiohttp.ClientTimeout(total=2)) as r:
                            await r.read()
                            status = r.status
                    run.probes.append((time.monotonic() - start, p, status))
                await asyncio.sleep(0.1)

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        if fault is not None:
            tasks.append(asyncio.create_task(inject()))
        if probe:
            tasks.append(asyncio.create_task(poll()))
        await asyncio.gather(*tasks)
    run.seconds = time.monotonic() - start
    return run


async def find_unrecorded(url: str, run: Run, *, timeout_s: float = 30.0) -> list[str]:
    """Activation ids answered 200/202 whose record the API does not return (retried until ``timeout_s``:
    records held while Redis was down are written when it is back)."""
    pending = {a.activation_id for a in run.answers if a.status in (200, 202) and a.activation_id}
    deadline = time.monotonic() + timeout_s
    sem = asyncio.Semaphore(64)
    async with aiohttp.ClientSession(headers=AUTH, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def recorded(aid: str) -> bool:
            async with sem:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with session.get(f"{url}/api/v1/namespaces/_/activations/{aid}") as r:
                        await r.read()
                        return r.status == 200
                return False

        while pending and time.monotonic() < deadline:
            ids = sorted(pending)
            found = await asyncio.gather(*(recorded(a) for a in ids))
            pending -= {a for a, ok in zip(ids, found, strict=True) if ok}
            if pending:
                await asyncio.sleep(0.5)
    run.unrecorded = sorted(pending)
    return run.unrecorded


def invoker_auth(standalone: Standalone) -> dict[str, str]:
    """Headers with the basic auth of the standalone's (first) invoker endpoints."""
    user, _, password = Path(standalone.ready["credentials_file"]).read_text().strip().partition(":")
    return {"Authorization": aiohttp.encode_basic_auth(user, password)}
