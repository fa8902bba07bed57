"""The OpenWhisk action runtime: an aiohttp proxy speaking `/init` and `/run` (stdlib + aiohttp only).

It ships into container images (Debian bookworm: Python 3.11, aiohttp 3.8), so it uses no other project
module except `dilu_invoker.actions.*` and nothing newer than aiohttp 3.8 (no `web.AppKey`).

The user's code runs in a worker process (`worker.py`) that the proxy starts ahead of the `/init`, so a
crash, `sys.exit`, `os._exit`, a segfault or a hang in the action never takes the proxy down. Status codes
and error bodies copy the upstream Go proxy with the Python launcher (see docs/runtime.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import hmac
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from dilu_invoker.actions._ipc import (
    HEADER,
    MSG_EXITED,
    SENTINEL_LINE,
    STAGE_CONTENT_TYPE,
    STAGE_FRAMES_HEADER,
    Kind,
    die_with_parent,
    frame_chunks,
    run_answer,
    unpack_stage,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_DEADLINE_GRACE_MS = 1000
DEFAULT_SHUTDOWN_GRACE_S = 5.0
# /init carries the whole action (48 MB of code is OpenWhisk's limit, base64 makes it 64 MB).
MAX_REQUEST_BYTES = 256 * 1024 * 1024

MSG_INIT_TWICE = "Cannot initialize the action more than once."
MSG_NO_CODE = "Missing main/no code to execute."
MSG_COMPILE = "The action failed to generate or locate a binary. See logs for details."
MSG_START = "Cannot start action. Check logs for details."
MSG_NO_ACTION = "no action defined yet"
MSG_DEADLINE = "The action did not finish by its deadline and was stopped."
MSG_SHUTTING_DOWN = "The action runtime is shutting down."
MSG_FORBIDDEN = "This runtime answers only the invoker that started it."
SECRET_HEADER = "X-Dilu-Runtime-Secret"
SECRET_ENV = "DILU_RUNTIME_SECRET"

_BOOTSTRAP = (
    "import sys\n"
    "root = sys.argv[1]\n"
    "del sys.path[0]\n"
    "added = root not in sys.path\n"
    "if added:\n"
    "    sys.path.insert(0, root)\n"
    "from dilu_invoker.actions import worker\n"
    "if added:\n"
    "    sys.path.remove(root)\n"
    "sys.exit(worker.main(sys.argv[2:]))\n"
)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class State(enum.Enum):
    UNINITIALIZED = "uninitialized"
    INITIALIZING = "initializing"
    READY = "ready"
    FAILED = "failed"  # the worker died after a successful /init; the container is done for
    SHUTTING_DOWN = "shutting_down"


class WorkerExited(Exception):
    def __init__(self, reason: str, *, deadline: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.deadline = deadline


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[tuple[Kind, bytes]]
    timer: asyncio.TimerHandle | None = None
    is_run: bool = True


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    allow_concurrent: bool = False
    deadline_grace_s: float | None = DEFAULT_DEADLINE_GRACE_MS / 1000
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    #: when set, every request but /ping must carry it in SECRET_HEADER (the invoker's own calls do)
    secret: str | None = None
    #: the worker's end of the invoker's direct lane (an inherited socket), handed to each worker started
    #: and closed here once one is initialised: from then on only that worker holds it
    direct_fd: int | None = None


def _json_response(status: int, error: str) -> web.Response:
    return web.Response(status=status, body=json.dumps({"error": error}).encode(), content_type="application/json")


def _write_fd(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]


def _end_activation_output(note: str | None = None) -> None:
    """Frame one activation's logs from the proxy's side (the worker could not do it itself)."""
    if note:
        _write_fd(2, f"{note}\n".encode())
    _write_fd(1, SENTINEL_LINE)
    _write_fd(2, SENTINEL_LINE)


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "the action process stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the action process was killed by {name}"
    return f"the action process exited with code {returncode}"


class _Frames(asyncio.Protocol):
    """The proxy's end of the worker socket: each reply frame is handed to ``on_frame`` as soon as it is
    complete (no reader task to wake per reply); :meth:`drain` waits while the socket's send buffer is full."""

    def __init__(self, on_frame: Any) -> None:
        self._on_frame = on_frame
        self._buf = bytearray()
        self.transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        #: resolved once the socket is closed (the worker exited, or we closed it)
        self.lost: asyncio.Future[None] = loop.create_future()
        self._writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start, size = 0, HEADER.size
        while len(buf) - start >= size:
            kind, request_id, length = HEADER.unpack_from(buf, start)
            end = start + size + length
            if len(buf) < end:
                break
            self._on_frame(kind, request_id, bytes(buf[start + size:end]))
            start = end
        if start:
            del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    async def drain(self) -> None:
        if self._writable is not None:
            await asyncio.shield(self._writable)


class WorkerProcess:
    """One worker and the socket to it; requests are matched to replies by id."""

    def __init__(self, *, allow_concurrent: bool, direct_fd: int | None = None) -> None:
        self._allow_concurrent = allow_concurrent
        self._direct_fd = direct_fd
        #: lane request ids of the direct runs the worker has begun and not yet answered
        self.direct_runs: set[int] = set()
        self.action_dir = tempfile.mkdtemp(prefix="dilu-action-")
        self.process: asyncio.subprocess.Process | None = None
        self._frames: _Frames | None = None
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._exit: WorkerExited | None = None
        self._deadline_killed = False
        self._reader_task: asyncio.Task[None] | None = None
        #: what the worker pre-loaded (its PRELOADED frame), None until it says (or when it pre-loads nothing)
        self.preload: dict[str, Any] | None = None
        #: installed modules the action's first run imported first (its RUN_IMPORTS frame)
        self.run_imports: list[str] = []
        #: the models /init left this process holding (its HELD_MODELS frame)
        self.held_models: list[str] = []

    async def start(self) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _BOOTSTRAP,
                _PACKAGE_ROOT,
                str(child_end.fileno()),
                self.action_dir,
                "1" if self._allow_concurrent else "0",
                str(os.getpid()),
                *(() if self._direct_fd is None else (str(self._direct_fd),)),
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(child_end.fileno(), *(() if self._direct_fd is None else (self._direct_fd,))),
                # Terminal signals (Ctrl-C) go to the proxy, which decides the worker's fate.
                start_new_session=True,
            )
        finally:
            child_end.close()
        _WORKERS.add(self.process)
        _, self._frames = await asyncio.get_running_loop().create_unix_connection(
            lambda: _Frames(self._on_frame), sock=parent_end)
        self._reader_task = asyncio.create_task(self._watch(self._frames))

    @property
    def exited(self) -> WorkerExited | None:
        return self._exit

    def pending_runs(self) -> int:
        return sum(1 for pending in self._pending.values() if pending.is_run)

    async def request(
        self, kind: Kind, payload: bytes, *, deadline_s: float | None = None, is_run: bool = True
    ) -> tuple[Kind, bytes]:
        if self._exit is not None:
            if is_run:
                # The worker died while idle; this run is the one that finds out.
                _end_activation_output(f"dilu-runtime: {self._exit.reason}")
            raise self._exit
        frames = self._frames
        assert frames is not None and frames.transport is not None
        self._next_id += 1
        request_id = self._next_id
        loop = asyncio.get_running_loop()
        pending = _Pending(loop.create_future(), is_run=is_run)
        if deadline_s is not None:
            # Owned by the loop, not by the HTTP handler: it fires even if the caller went away.
            pending.timer = loop.call_later(max(deadline_s, 0.0), self._deadline_passed)
        self._pending[request_id] = pending
        try:
            for chunk in frame_chunks(kind, request_id, payload):  # a large body is not copied behind its header
                frames.transport.write(chunk)
            await frames.drain()
        except (ConnectionError, OSError):
            pass  # the reader task reports the worker's death to this request too
        return await pending.future

    def _deadline_passed(self) -> None:
        self._deadline_killed = True
        self.kill()

    def _on_frame(self, kind: int, request_id: int, payload: bytes) -> None:
        if kind == Kind.DIRECT_BEGIN:
            self.direct_runs.add(request_id)
            return
        if kind == Kind.DIRECT_END:
            self.direct_runs.discard(request_id)
            return
        if kind == Kind.PRELOADED:
            with contextlib.suppress(ValueError):
                self.preload = json.loads(payload)
            return
        if kind == Kind.HELD_MODELS:
            with contextlib.suppress(ValueError):
                names = json.loads(payload)
                self.held_models = [str(name) for name in names] if isinstance(names, list) else []
            return
        if kind == Kind.RUN_IMPORTS:
            with contextlib.suppress(ValueError):
                names = json.loads(payload)
                self.run_imports = [str(name) for name in names] if isinstance(names, list) else []
            return
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        if not pending.future.done():
            pending.future.set_result((Kind(kind), payload))

    async def _watch(self, frames: _Frames) -> None:
        await frames.lost
        await self._on_exit()

    async def _on_exit(self) -> None:
        returncode: int | None = None
        if self.process is not None:
            try:
                returncode = await asyncio.wait_for(self.process.wait(), timeout=5.0)
            except TimeoutError:
                self.kill()
        reason = _describe_exit(returncode)
        if self._deadline_killed:
            reason = "the action process was stopped because an activation ran past its deadline"
        self._exit = WorkerExited(reason, deadline=self._deadline_killed)
        pending, self._pending = self._pending, {}
        # Runs on the direct lane end the same way: their caller sees the lane close.
        runs = sum(1 for item in pending.values() if item.is_run) + len(self.direct_runs)
        self.direct_runs.clear()
        if runs:
            # Every run that was in the worker gets its log frame, even if its caller went away.
            # (A dying /init is framed by the init handler, which knows the failure's wording.)
            _write_fd(2, f"dilu-runtime: {reason}\n".encode())
            for _ in range(runs):
                _end_activation_output()
        for item in pending.values():
            if item.timer is not None:
                item.timer.cancel()
            if not item.future.done():
                item.future.set_exception(self._exit)

    def kill(self) -> None:
        # os.kill, not Process.kill(): that polls first (waitpid WNOHANG) and would reap a worker that has just
        # died before asyncio's child watcher does, which then reports exit 255 in place of its real status.
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.process.pid, signal.SIGKILL)

    async def close(self) -> None:
        self.kill()
        if self._frames is not None and self._frames.transport is not None:
            self._frames.transport.close()
        if self._reader_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._reader_task), timeout=5.0)
        shutil.rmtree(self.action_dir, ignore_errors=True)


class Runtime:
    """The protocol state and the HTTP handlers; one per runtime process."""

    def __init__(self, options: RuntimeOptions) -> None:
        self.options = options
        self.state = State.UNINITIALIZED
        self._direct_fd = options.direct_fd
        self.worker: WorkerProcess | None = None
        self._standby: asyncio.Task[WorkerProcess] | None = None
        self._run_lock = asyncio.Lock()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._stopping = asyncio.Event()
        self._closing: set[asyncio.Task[None]] = set()
        #: top-level installed modules the action imported at /init (the invoker learns pre-loads from it)
        self.imports: list[str] = []
        #: the worker pre-loads libraries (DILU_PRELOAD_MODULES / DILU_PRELOAD_CUDA are set)
        self.preloading = "DILU_PRELOAD_MODULES" in os.environ or "DILU_PRELOAD_CUDA" in os.environ

    # -- lifecycle ----------------------------------------------------------------------------------

    def prepare_worker(self) -> None:
        """Start a worker before any /init arrives, so its interpreter start-up is off the cold path."""
        if self._stopping.is_set() or self._standby is not None:
            return
        self._standby = asyncio.create_task(self._spawn())

    async def _spawn(self) -> WorkerProcess:
        worker = WorkerProcess(allow_concurrent=self.options.allow_concurrent, direct_fd=self._direct_fd)
        await worker.start()
        return worker

    async def _take_worker(self) -> WorkerProcess:
        standby, self._standby = self._standby, None
        if standby is not None:
            try:
                worker = await standby
                if worker.exited is None and worker.process is not None and worker.process.returncode is None:
                    return worker
                self._discard(worker)
            except OSError:
                pass
        return await self._spawn()

    async def begin_shutdown(self) -> None:
        self.state = State.SHUTTING_DOWN
        self._stopping.set()
        if self._in_flight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=self.options.shutdown_grace_s)

    async def close(self) -> None:
        workers = [] if self.worker is None else [self.worker]
        if self._standby is not None:
            with contextlib.suppress(Exception):
                workers.append(await self._standby)
        for worker in workers:
            await worker.close()
        if self._closing:
            await asyncio.wait(self._closing)

    def _enter(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    # -- handlers -----------------------------------------------------------------------------------

    async def handle_init(self, request: web.Request) -> web.Response:
        if self.state is State.SHUTTING_DOWN:
            return _json_response(503, MSG_SHUTTING_DOWN)
        if self.state is not State.UNINITIALIZED:
            return _json_response(403, MSG_INIT_TWICE)
        self.state = State.INITIALIZING
        self._enter()
        try:
            response = await self._init(await request.read())
        except BaseException:
            if self.state is State.INITIALIZING:
                self.state = State.UNINITIALIZED
            raise
        finally:
            self._leave()
        return response

    async def _init(self, body: bytes) -> web.Response:
        try:
            message = json.loads(body)
            value = message["value"]
            if not isinstance(value, dict):
                raise TypeError("'value' is not an object")
            env = value.get("env")
            if env is not None and not isinstance(env, dict):
                raise TypeError("'env' is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            return self._init_failed(400, f"Error unmarshaling request: {exc}")
        code = value.get("code")
        if not isinstance(code, str) or not code:
            return self._init_failed(403, MSG_NO_CODE)

        # Owned from now on, so that shutdown stops it even while the action is still loading.
        self.worker = worker = await self._take_worker()
        try:
            kind, detail = await worker.request(Kind.INIT, body, is_run=False)
        except WorkerExited as exited:
            # The module killed its own process while loading (sys.exit, os._exit, a crash).
            self._discard(worker)
            return self._init_failed(502, MSG_START, note=f"dilu-runtime: {exited.reason}")
        if kind is Kind.INIT_OK:
            with contextlib.suppress(ValueError):
                imports = json.loads(detail) if detail else []
                self.imports = [str(name) for name in imports] if isinstance(imports, list) else []
            if self.state is State.INITIALIZING:
                self.state = State.READY
            self._close_direct()
            # Stage frames (a split instance's tensors as bytes, docs/runtime.md "Stage frames") are welcome on /run.
            return web.json_response({"ok": True}, headers={STAGE_FRAMES_HEADER: "1"})
        # The worker wrote its own sentinels after explaining the failure on stderr.
        self._discard(worker)
        self.state = State.UNINITIALIZED
        self.prepare_worker()
        if kind is Kind.INIT_DECODE_ERROR:
            return _json_response(400, detail.decode("utf-8", "replace"))
        return _json_response(502, MSG_COMPILE if kind is Kind.INIT_COMPILE_ERROR else MSG_START)

    def _close_direct(self) -> None:
        """The initialised worker holds the direct lane now: the proxy's copy goes, so the invoker sees the
        lane close when that worker dies. A worker started later (a standby) gets no lane."""
        fd, self._direct_fd = self._direct_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _init_failed(self, status: int, error: str, *, note: str | None = None) -> web.Response:
        if self.state is State.INITIALIZING:
            self.state = State.UNINITIALIZED
        self.prepare_worker()
        _end_activation_output(note)
        return _json_response(status, error)

    def _discard(self, worker: WorkerProcess) -> None:
        """Stop a worker that will not serve (its init failed) and remove the code it was given."""
        if self.worker is worker:
            self.worker = None
        task = asyncio.create_task(worker.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def handle_run(self, request: web.Request) -> web.Response:
        if self.state is State.SHUTTING_DOWN:
            return _json_response(503, MSG_SHUTTING_DOWN)
        if self.state is not State.READY:
            return _json_response(500, MSG_NO_ACTION)
        self._enter()
        try:
            body = await request.read()
            staged = request.content_type == STAGE_CONTENT_TYPE
            if self.options.allow_concurrent:
                return await self._run(body, staged)
            if not await self._wait_turn():
                # Queued behind a running activation when shutdown began: it never started, so OpenWhisk
                # may run it elsewhere.
                return _json_response(503, MSG_SHUTTING_DOWN)
            try:
                if self.state is not State.READY:
                    return _json_response(500, MSG_NO_ACTION)
                return await self._run(body, staged)
            finally:
                self._run_lock.release()
        finally:
            self._leave()

    async def _wait_turn(self) -> bool:
        """Take the run lock, unless shutdown begins first (then False, lock not held)."""
        if self._stopping.is_set():
            return False
        if not self._run_lock.locked():
            # The common case, nobody running: take the lock at once (acquiring a free asyncio.Lock does not
            # suspend, so shutdown cannot begin in between) instead of racing two tasks.
            await self._run_lock.acquire()
            return True
        acquire = asyncio.ensure_future(self._run_lock.acquire())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({acquire, stopping}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Our caller went away: never leave the lock held by a request that will not run.
            acquire.cancel()
            if acquire.done() and not acquire.cancelled():
                self._run_lock.release()
            raise
        finally:
            stopping.cancel()
        if not acquire.done():
            acquire.cancel()
            await asyncio.wait({acquire})
        if acquire.cancelled():
            return False
        if self._stopping.is_set():
            self._run_lock.release()
            return False
        return True

    async def _run(self, body: bytes, staged: bool = False) -> web.Response:
        """One /run: a JSON body, or (`staged`) a stage frame whose JSON part is the body, handed to the worker as
        it is (`Kind.RUN_STAGE`); a stage frame's answer (`Kind.RESULT_STAGE`) goes back as one."""
        try:
            message = json.loads(unpack_stage(body)[0] if staged else body)
            if not isinstance(message, dict):
                raise TypeError("the body is not a JSON object")
        except (ValueError, TypeError) as exc:
            _end_activation_output()
            return _json_response(400, f"Error reading request body: {exc}")
        worker = self.worker
        assert worker is not None
        try:
            kind, payload = await worker.request(Kind.RUN_STAGE if staged else Kind.RUN, body,
                                                 deadline_s=self._guard_delay(message))
        except WorkerExited as exited:
            self.state = State.FAILED
            if exited.deadline:
                return _json_response(502, MSG_DEADLINE)
            return _json_response(400, MSG_EXITED)
        if kind is Kind.RESULT_STAGE:
            return web.Response(status=200, body=payload, content_type=STAGE_CONTENT_TYPE)
        status, answer = run_answer(kind, payload)
        return web.Response(status=status, body=answer, content_type="application/json")

    def _guard_delay(self, message: dict[str, Any]) -> float | None:
        grace = self.options.deadline_grace_s
        deadline = message.get("deadline")
        if grace is None or deadline is None:
            return None
        try:
            deadline_ms = int(deadline)
        except (TypeError, ValueError):
            return None
        remaining = deadline_ms / 1000 - time.time()
        if remaining <= 0:
            # Already past on arrival: a clock that disagrees with the invoker's, not a hang. The invoker
            # enforces its own timeout, so no guard rather than killing every run.
            return None
        return remaining + grace

    def _preload_state(self) -> dict[str, Any] | None:
        """``loading`` until the worker's PRELOADED frame, then ``done`` (or ``failed``: it died, or its CUDA
        context could not be created) with what it imported."""
        if not self.preloading:
            return None
        worker = self.worker
        if worker is None and self._standby is not None and self._standby.done() and not self._standby.cancelled():
            if self._standby.exception() is None:
                worker = self._standby.result()
        if worker is None:
            return {"state": "loading"}
        info = worker.preload
        if worker.exited is not None:
            return {"state": "failed", "error": worker.exited.reason, **(info or {})}
        if info is None:
            return {"state": "loading"}
        return {"state": "failed" if info.get("cuda_error") else "done", **info}

    async def handle_health(self, request: web.Request) -> web.Response:
        worker = self.worker
        return web.json_response(
            {
                "state": self.state.value,
                "concurrent": self.options.allow_concurrent,
                "worker_pid": worker.process.pid if worker and worker.process else None,
                "active_runs": worker.pending_runs() if worker else 0,
                "preload": self._preload_state(),
                "imports": self.imports,
                "run_imports": worker.run_imports if worker else [],
                "models": worker.held_models if worker else [],
            }
        )


async def _ping(request: web.Request) -> web.Response:
    return web.Response(text="pong")


async def _root(request: web.Request) -> web.Response:
    return web.Response(text="dilu-invoker action runtime\n")


def _secret_middleware(secret: str) -> Any:
    expected = secret.encode()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get(SECRET_HEADER, "").encode()
        if request.path != "/ping" and not hmac.compare_digest(given, expected):
            return _json_response(403, MSG_FORBIDDEN)
        return await handler(request)

    return check


def build_app(runtime: Runtime) -> web.Application:
    middlewares = [_secret_middleware(runtime.options.secret)] if runtime.options.secret else []
    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=middlewares)
    app.router.add_post("/init", runtime.handle_init)
    app.router.add_post("/run", runtime.handle_run)
    app.router.add_get("/ping", _ping)
    app.router.add_get("/health", runtime.handle_health)
    app.router.add_get("/", _root)
    return app


_WORKERS: weakref.WeakSet[asyncio.subprocess.Process] = weakref.WeakSet()
"""The worker processes this runtime started (asyncio waits for them)."""


def reap_once(own: set[int]) -> int:
    """Reap exited children that are not in ``own`` (never blocks); returns how many."""
    reaped = 0
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or info.si_pid in own:
            return reaped
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, os.WNOHANG)
            reaped += 1


async def reap_orphans(period_s: float = 1.0) -> None:
    """As the first process of a PID namespace of its own (a process container that shares its uid with
    other MPS clients: backends/sandbox.py) the runtime adopts every orphan of the action — a daemon it
    started, a double fork — and must reap them, or they stay zombies; its own workers are left to asyncio."""
    while True:
        await asyncio.sleep(period_s)
        reap_once({p.pid for p in _WORKERS if p.returncode is None})


async def serve(host: str, port: int, options: RuntimeOptions, *, listen_fd: int | None = None) -> int:
    runtime = Runtime(options)
    reaper = asyncio.create_task(reap_orphans()) if os.getpid() == 1 else None
    runtime.prepare_worker()
    # No access log: the proxy's stdout and stderr are the action's logs.
    runner = web.AppRunner(build_app(runtime), access_log=None, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        try:
            if listen_fd is not None:
                # a socket the invoker bound and listens on: no window in which another process takes the port
                await web.SockSite(runner, socket.socket(fileno=listen_fd)).start()
            else:
                await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            _write_fd(2, f"dilu-runtime: cannot listen on {host}:{port}: {exc}\n".encode())
            return 1
        await stop.wait()
        # New requests now get 503 (OpenWhisk reschedules them) while running ones finish.
        await runtime.begin_shutdown()
        return 0
    finally:
        # Workers first: a handler still waiting on one then gets its answer, so the runner's cleanup
        # (which waits for handlers) does not hang on an action that never returns.
        await runtime.close()
        await runner.cleanup()
        if reaper is not None:
            reaper.cancel()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dilu-invoker runtime", description="OpenWhisk action runtime (/init, /run).")
    parser.add_argument("--host", default=os.environ.get("DILU_RUNTIME_HOST", DEFAULT_HOST))
    parser.add_argument("--port", type=int, default=int(os.environ.get("DILU_RUNTIME_PORT", DEFAULT_PORT)))
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="serve on this inherited, listening socket instead of binding --host/--port")
    parser.add_argument("--direct-fd", type=int, default=None,
                        help="an inherited socket: the worker's end of the invoker's direct lane for /run")
    parser.add_argument(
        "--deadline-grace-ms",
        type=int,
        default=int(os.environ.get("DILU_RUNTIME_DEADLINE_GRACE_MS", DEFAULT_DEADLINE_GRACE_MS)),
        help="stop the action this long after the run's deadline; negative disables the guard",
    )
    parser.add_argument("--die-with", type=int, default=None, metavar="PID",
                        help="die with this parent process (SIGKILL when it dies; exit at once if it is gone)")
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=float(os.environ.get("DILU_RUNTIME_SHUTDOWN_GRACE_S", DEFAULT_SHUTDOWN_GRACE_S)),
        help="on SIGTERM, how long running activations may take before the runtime exits",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.die_with is not None:
        die_with_parent(args.die_with)
    if not 0 <= args.port <= 65535:
        sys.stderr.write(f"dilu-runtime: invalid port {args.port}\n")
        return 2
    options = RuntimeOptions(
        # Taken out of the environment before the action's worker starts: its code never sees it.
        secret=os.environ.pop(SECRET_ENV, None) or None,
        allow_concurrent=_env_flag("__OW_ALLOW_CONCURRENT"),
        deadline_grace_s=None if args.deadline_grace_ms < 0 else args.deadline_grace_ms / 1000,
        shutdown_grace_s=max(args.shutdown_grace_s, 0.0),
        direct_fd=args.direct_fd,
    )
    return asyncio.run(serve(args.host, args.port, options, listen_fd=args.listen_fd))


if __name__ == "__main__":
    sys.exit(main())
