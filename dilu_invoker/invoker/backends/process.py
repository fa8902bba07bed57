"""Runs each action runtime as a child process on a free loopback port (the embedded default).

This backend isolates nothing but the process: no file-system, network or memory isolation. It is meant
for development, tests and single-tenant machines; use the docker backend for untrusted code. The child
is its own process group so pausing (SIGSTOP) and killing reach the runtime's worker and whatever the
user's code forked, and it dies with the invoker (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

import structlog

from dilu_invoker.invoker.backends.base import BackendError, ContainerSpec

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[3])
#: environment a runtime process inherits from the invoker; everything else comes from the spec
_INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT", "CUDA_HOME", "LD_LIBRARY_PATH", "NVIDIA_DRIVER_CAPABILITIES")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort; never fail the exec
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ProcessContainer:
    def __init__(self, name: str, proc: asyncio.subprocess.Process, port: int) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self._proc = proc
        assert proc.stdout is not None and proc.stderr is not None
        self.stdout: asyncio.StreamReader = proc.stdout
        self.stderr: asyncio.StreamReader = proc.stderr
        self._destroyed = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._destroyed and self._proc.returncode is None

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def pause(self) -> None:
        self._signal_group(signal.SIGSTOP)

    async def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._proc.wait(), 5)

    def exit_reason(self) -> str | None:
        rc = self._proc.returncode
        if rc is None:
            return None
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exit {rc}"


class ProcessBackend:
    name = "process"

    def __init__(self, *, python: str | None = None) -> None:
        self._python = python or sys.executable
        self._live: set[ProcessContainer] = set()

    async def start(self, spec: ContainerSpec) -> ProcessContainer:
        env = {k: os.environ[k] for k in _INHERITED_ENV if k in os.environ}
        env.update(spec.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        last_error: Exception | None = None
        for _ in range(3):  # a port taken between probing and binding is retried with another
            port = free_port()
            try:
                proc = await asyncio.create_subprocess_exec(
                    self._python, "-m", "dilu_invoker.actions.runtime", "--host", "127.0.0.1", "--port", str(port),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                    limit=1 << 20,
                )
            except OSError as exc:
                last_error = exc
                continue
            container = ProcessContainer(spec.name, proc, port)
            self._live.add(container)
            log.debug("process container started", container=spec.name, pid=proc.pid, port=port)
            return container
        raise BackendError(f"could not start a runtime process: {last_error}")

    async def remove_leftovers(self, prefix: str) -> int:
        # Children die with the invoker (PDEATHSIG); nothing survives a restart.
        return 0

    async def close(self) -> None:
        live = list(self._live)
        self._live.clear()
        await asyncio.gather(*(c.destroy() for c in live), return_exceptions=True)
