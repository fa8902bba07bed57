"""Runs each action runtime as a child process on a free loopback port (the embedded default).

Each container is confined by a :class:`~dilu_invoker.invoker.dataplane.backends.sandbox.Sandbox`: as root, its own
uid, private directory, memory cgroup and mount view; without root, a private directory and the kill of
every descendant only (the backend logs what is not enforced). Its runtime answers only requests that carry
the container's secret (``X-Dilu-Runtime-Secret``), so code of another container cannot call its ``/run``.
The runtime dies with the invoker (PR_SET_PDEATHSIG); destroy kills every process the container started,
in its own session or not, and removes every file it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import structlog

from dilu_invoker.invoker.dataplane.backends.base import BackendError, ContainerSpec
from dilu_invoker.invoker.dataplane.backends.sandbox import (
    Sandbox,
    SandboxError,
    Sandboxes,
    UidGroup,
    parse_uid_range,
    preexec_failure,
)
from dilu_invoker.invoker.dataplane.runtime_client import DirectLane

log = structlog.get_logger(__name__)

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[4])
#: environment a runtime process inherits from the invoker; everything else comes from the spec
_INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT", "CUDA_HOME", "LD_LIBRARY_PATH", "NVIDIA_DRIVER_CAPABILITIES")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ProcessContainer:
    def __init__(self, backend: ProcessBackend, name: str, proc: asyncio.subprocess.Process, port: int,
                 sandbox: Sandbox, secret: str, lane: DirectLane | None = None) -> None:
        self.name = name
        #: /run straight to the initialised worker (docs/runtime.md, "The direct lane")
        self.lane = lane
        self.url = f"http://127.0.0.1:{port}"
        #: every runtime process shares the host's network namespace (no sandbox makes one of its own)
        self.peer_host = "127.0.0.1"
        self.port = port
        self.secret: str | None = secret
        self.sandbox = sandbox
        self._backend = backend
        self._proc = proc
        assert proc.stdout is not None and proc.stderr is not None
        self.stdout: asyncio.StreamReader = proc.stdout
        self.stderr: asyncio.StreamReader = proc.stderr
        self._destroyed = False
        self._oom = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._destroyed and self._proc.returncode is None

    async def _signal_all(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)
        await self._backend.sandboxes.signal(self.sandbox, sig)

    async def set_memory_limit(self, memory_mb: int) -> None:
        """A pre-loaded container becomes an action's: its cgroup gets the action's limit (raises
        SandboxError when its processes already use more)."""
        await asyncio.to_thread(self._backend.sandboxes.set_memory, self.sandbox, memory_mb)

    async def pause(self) -> None:
        await self._signal_all(signal.SIGSTOP)

    async def resume(self) -> None:
        await self._signal_all(signal.SIGCONT)

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        if self.lane is not None:
            self.lane.close()
        self._oom = self.sandbox.oom_killed(self._backend.sandboxes.cgroups)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._kill_runtime()
        try:
            clean = await self._backend.sandboxes.destroy(self.sandbox)
        except Exception as exc:  # noqa: BLE001 - destroy never raises
            log.warning("sandbox removal failed", container=self.name, error=repr(exc))
        else:
            log.debug("process container destroyed", container=self.name, clean=clean)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._proc.wait(), 5)
        self._backend._live.discard(self)

    def _kill_runtime(self) -> None:
        # Not Process.kill(): it polls first (waitpid WNOHANG), and a runtime that is already dead then is
        # reaped by that poll instead of by asyncio's child watcher, which logs "Unknown child process pid"
        # and reports exit 255 in place of the real status (a crash read as "exit 255", not "killed by ...").
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self._proc.pid, signal.SIGKILL)

    def exit_reason(self) -> str | None:
        # The kernel's OOM killer takes the largest process (the action's worker), not the runtime.
        if self._oom or self.sandbox.oom_killed(self._backend.sandboxes.cgroups):
            return "oom"
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

    def __init__(self, *, python: str | None = None, isolation: str = "auto", uid_range: str = "200000-200999",
                 work_dir: str | None = None, hide: tuple[str, ...] = (), direct_lane: bool = True) -> None:
        self._python = python or sys.executable
        #: containers get a direct lane for /run (docs/runtime.md, "The direct lane")
        self.direct_lane = direct_lane
        self._live: set[ProcessContainer] = set()
        #: one runtime process is forked at a time: a fork (with isolation's steps in the child) blocks the event loop
        #: until the child execs, about 25 ms here; starts of a burst forked back to back in one turn of the loop
        #: blocked it for all of them at once (200 ms for 8; docs/benchmarks/spawn.md)
        self._spawning = asyncio.Lock()
        self.sandboxes = Sandboxes(mode=isolation, uid_range=parse_uid_range(uid_range), work_dir=work_dir,
                                   hide=hide)

    @property
    def distinct_pids(self) -> bool:
        """Whether the workers of two containers always have different PIDs as they see them (what a CUDA IPC
        handle names its exporter by): yes, except for MPS clients in PID namespaces of their own without
        the sandbox's PID ranges."""
        return self.sandboxes.member_pid_ranges

    @staticmethod
    def uid_group(env: dict[str, str]) -> UidGroup | None:
        """The MPS clients of one GPU's daemon share a uid (an MPS daemon serves one uid at a time)."""
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
        if not pipe:
            return None
        return UidGroup(key=pipe, dirs=tuple(d for d in (pipe, env.get("CUDA_MPS_LOG_DIRECTORY")) if d))

    async def start(self, spec: ContainerSpec) -> ProcessContainer:
        try:
            box = await self.sandboxes.create(
                spec.name, spec.memory_mb,
                writable=[m.source for m in spec.mounts if not m.read_only],
                readable=[m.source for m in spec.mounts if m.read_only],
                group=self.uid_group(dict(spec.env)),
                preload=[p for p in spec.env.get("LD_PRELOAD", "").split(":") if p])
        except (OSError, SandboxError) as exc:
            raise BackendError(f"could not prepare the container's sandbox: {exc}") from exc
        env = {k: os.environ[k] for k in _INHERITED_ENV if k in os.environ}
        env.update(spec.env)
        env.update(box.env())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        secret = secrets.token_urlsafe(24)
        env["DILU_RUNTIME_SECRET"] = secret
        last_error: Exception | None = None
        for _ in range(3):
            # The invoker binds and listens, the runtime inherits the socket: probing for a free port and
            # binding it later let two containers started at once get the same port (one then exited).
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # The direct lane: our end stays here, the other goes to the runtime, which hands it to its worker.
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            # Where a failing preexec says which step failed (close-on-exec: the runtime never holds it).
            report_r, report_w = os.pipe2(os.O_CLOEXEC)
            try:
                listener.bind(("127.0.0.1", 0))
                listener.listen(128)
                port = int(listener.getsockname()[1])
                fd = listener.fileno()
                argv = [self._python, "-m", "dilu_invoker.actions.runtime", "--host", "127.0.0.1", "--port",
                        str(port), "--listen-fd", str(fd), "--direct-fd", str(theirs.fileno())]
                preexec = box.preexec(report_w)
                # (the sandbox's steps set the umask last: earlier, it would close what they make to its uid)
                umask = -1
                if preexec is None:  # nothing between fork and exec (no isolation): vfork, and these instead
                    argv += ["--die-with", str(os.getpid())]
                    umask = 0o077
                async with self._spawning:
                    proc = await asyncio.create_subprocess_exec(
                        *box.command(argv),
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                        env=env,
                        cwd=str(box.dir),
                        start_new_session=True,
                        preexec_fn=preexec,
                        umask=umask,
                        pass_fds=(fd, theirs.fileno()),
                        limit=1 << 20,
                    )
            except (OSError, subprocess.SubprocessError) as exc:
                why = preexec_failure(report_r)  # closes it
                report_r = -1
                last_error = RuntimeError(f"{exc} ({why})") if why else exc
                log.warning("runtime process did not start", container=spec.name, error=str(last_error))
                ours.close()
                continue
            finally:
                listener.close()  # the runtime holds its own copies
                theirs.close()
                for end in (report_r, report_w):
                    if end >= 0:
                        os.close(end)
            box.leader = proc.pid
            lane: DirectLane | None = None
            if self.direct_lane:
                try:
                    lane = await DirectLane.open(ours)
                except OSError as exc:
                    log.warning("no direct lane to the runtime; /run goes over HTTP", container=spec.name,
                                error=str(exc))
                    ours.close()
            else:
                ours.close()
            container = ProcessContainer(self, spec.name, proc, port, box, secret, lane)
            self._live.add(container)
            log.debug("process container started", container=spec.name, pid=proc.pid, port=port, uid=box.uid)
            return container
        await self.sandboxes.destroy(box)
        raise BackendError(f"could not start a runtime process: {last_error}")

    async def remove_leftovers(self, prefix: str) -> int:
        # Runtimes die with the invoker (PDEATHSIG); what their actions started is swept by uid or marker.
        return await self.sandboxes.remove_leftovers()

    async def close(self) -> None:
        live = list(self._live)
        self._live.clear()
        await asyncio.gather(*(c.destroy() for c in live), return_exceptions=True)
        self.sandboxes.close()
