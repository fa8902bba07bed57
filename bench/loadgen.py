"""What the load-generating benchmarks share (``bench/faults.py``, ``bench/standalone.py``,
``bench/openwhisk_path.py``): the machine line of a figures page and the client loops.

* :func:`machine`: OS, CPU, cores and Python (and the load average: the development machine is shared);
* :func:`commit`: the checkout's short commit;
* :func:`sequential`: one call after another, each call's latency;
* :func:`closed_loop`: ``clients`` concurrent loops, each calling again as soon as its call returns, for a
  time or a count — the load shape of every throughput figure here;
* :func:`wait_for_api`: wait for a standalone started as a child process to answer its REST API;
* :func:`stop_process_tree`: SIGTERM it, then SIGKILL what is left of its process group;
* :func:`cpu_by_part`: CPU seconds used so far by a standalone, its redis-server, its runtime proxies, their
  action workers and this process — divided by the invokes served in between (:func:`cpu_ms_per`), the CPU
  per invoke of each part (robust to a shared machine's load, unlike a rate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]

Call = Callable[[], Awaitable[object]]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def machine(*, load: bool = False) -> str:
    """``Linux 6.1, <CPU>, 2 cores, Python 3.11.7`` and, with ``load``, the load average now."""
    text = (f"{platform.system()} {platform.release()}, {cpu_model()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}")
    return f"{text}; load average (1, 5, 15 min) {load_average()}" if load else text


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() or "unknown"


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: the parts :func:`cpu_by_part` reports, in this order
CPU_PARTS = ("standalone", "redis-server", "runtime proxies", "action workers", "load generator")


def cpu_by_part(root: int | None, tree: list[tuple[int, str]]) -> dict[str, float]:
    """CPU seconds used so far by the standalone ``root`` (the API, the invoker and the GPU manager share its
    process), and by ``tree`` — (pid, command line) of its descendants (``ow_support.faults.children``), or
    of a bare runtime: its redis-server, its runtime proxies (``dilu_invoker.actions.runtime``), their action
    workers — and by this process (the load generator)."""
    out = dict.fromkeys(CPU_PARTS, 0.0)
    out["load generator"] = proc_cpu_s(os.getpid())
    if root is not None:
        out["standalone"] = proc_cpu_s(root)
    for pid, cmd in tree:
        if "redis-server" in cmd:
            part = "redis-server"
        elif "worker.main" in cmd:
            part = "action workers"  # the proxy's bootstrap of its worker process (actions/runtime.py)
        else:
            part = "runtime proxies"
        out[part] += proc_cpu_s(pid)
    return out


def cpu_ms_per(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """Milliseconds of CPU per call of each part between two :func:`cpu_by_part` readings."""
    return {k: round((after[k] - before[k]) * 1000 / n, 3) if n else 0.0 for k in after}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sequential(call: Call, n: int) -> list[float]:
    """``n`` calls one after another; each one's latency in milliseconds."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t) * 1000)
    return out


@dataclass(frozen=True, slots=True)
class LoopResult:
    calls: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0


async def closed_loop(call: Call, clients: int, *, seconds: float | None = None,
                      per_client: int | None = None) -> LoopResult:
    """``clients`` concurrent loops of ``call`` until ``seconds`` have passed (a loop finishes the call it
    is in) or each made ``per_client`` calls; exactly one of the two bounds."""
    if (seconds is None) == (per_client is None):
        raise ValueError("closed_loop needs exactly one of seconds and per_client")
    done = 0
    start = time.monotonic()
    stop = start + seconds if seconds is not None else None

    async def loop() -> None:
        nonlocal done
        n = 0
        while (stop is None or time.monotonic() < stop) and (per_client is None or n < per_client):
            await call()
            n += 1
            done += 1

    await asyncio.gather(*(loop() for _ in range(clients)))
    return LoopResult(done, time.monotonic() - start)


async def wait_for_api(session: aiohttp.ClientSession, api_url: str, proc: subprocess.Popen[bytes], *,
                       what: str, timeout_s: float = 60.0) -> None:
    """Poll ``GET api_url`` until it answers 200; RuntimeError naming ``what`` when ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(api_url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up")
        await asyncio.sleep(0.1)


async def put_gpu_action(session: aiohttp.ClientSession, api: str, name: str, code: str,
                         annotations: list[dict[str, Any]], *, memory_mb: int, **request: Any) -> None:
    """``PUT`` a ``python:3-gpu`` action as `wsk action create --kind python:3-gpu` would (timeout 300 s);
    ``request`` carries the credentials (``auth=`` or ``headers=``)."""
    body = {"exec": {"kind": "python:3-gpu", "code": code}, "annotations": annotations,
            "limits": {"timeout": 300000, "memory": memory_mb}}
    async with session.put(f"{api}/{name}?overwrite=true", json=body, **request) as r:
        if r.status != 200:
            raise RuntimeError(f"PUT {name}: {r.status} {await r.text()}")


async def invoke_result(session: aiohttp.ClientSession, api: str, name: str, params: dict[str, Any],
                        **request: Any) -> tuple[float, int, Any]:
    """One blocking invoke (``?blocking=true&result=true``): client ms, HTTP status and the body, parsed
    where it is JSON (else its text); ``request`` carries the credentials."""
    t = time.perf_counter()
    async with session.post(f"{api}/{name}?blocking=true&result=true", json=params, **request) as r:
        text = await r.text()
        status = r.status
    ms = (time.perf_counter() - t) * 1000
    try:
        return ms, status, json.loads(text)
    except ValueError:
        return ms, status, text


async def stop_process_tree(proc: subprocess.Popen[bytes] | None, *, grace_s: float) -> None:
    """SIGTERM ``proc`` (started with ``start_new_session``) and wait ``grace_s``, then SIGKILL its process
    group: anything left of its tree goes too."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
