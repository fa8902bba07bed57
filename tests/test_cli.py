"""The command line as a user meets it: short grouped help, OpenWhisk's spellings, one-line errors,
the start-up banner on a terminal, the missing-extra message, and ``doctor`` — each in a real process."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dilu_invoker.model import GUEST_IDENTITY

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def dilu(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dilu_invoker", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV, cwd=ROOT, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_standalone_help_is_short_and_grouped() -> None:
    out = dilu("standalone", "--help")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    titles = ["general:", "API (OpenWhisk REST):", "invoker:", "GPU:", "Redis:", "logging:"]
    positions = [text.index(t) for t in titles]
    assert positions == sorted(positions), "groups in the documented order"
    for flag in ("-p INT, --port INT, --api-port INT", "--data-dir", "--api-auth-file", "--no-api-guest-key",
                 "--redis-url", "--invoker-backend", "--gpu-shim-path", "--log-level", "--help-all"):
        assert flag in text, flag
    for hidden in ("--kafka", "--couchdb", "--balancer-", "--invoker-docker-ulimits", "--gpu-gamma"):
        assert hidden not in text, hidden
    assert len(text.splitlines()) < 80
    assert "is always accepted" not in text and "instead of it with --no-api-" in text


def test_help_all_lists_every_standalone_flag_but_no_cluster_ones() -> None:
    out = dilu("standalone", "--help-all")
    assert out.returncode == 0, out.stderr
    for flag in ("--balancer-tick-s", "--invoker-docker-ulimits", "--gpu-gamma", "--redis-prefix", "--api-max-code-mb"):
        assert flag in out.stdout, flag
    assert "--kafka-hosts" not in out.stdout and "--couchdb-host" not in out.stdout
    assert "balancer:" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--no-api-guest-key"], "no API key is accepted"),
    (["--api-auth-file", "/nonexistent/keys"], "--api-auth-file /nonexistent/keys"),
    (["-p", "99999"], "--api-port 99999 is not a port"),
    (["--port", "x"], "argument -p/--port/--api-port: invalid int value"),
    (["--redis-url", "garbage://x"], "unsupported Redis URL scheme"),
    (["--redis-url", "redis://127.0.0.1:1/0"], "--redis-url does not answer PING"),
    (["--gpu-inventory", "/nonexistent.json"], "--gpu-inventory /nonexistent.json: no such file"),
    (["--invoker-backend", "docker", "--invoker-docker-url", "unix:///nonexistent.sock"], "does not answer"),
    (["--invoker-backend", "lxc"], "--invoker-backend must be 'process' or 'docker'"),
    (["--invokers", "0"], "--invokers must be at least 1"),
    (["--log-level", "loud"], "--log-level must be"),
    (["--kafka-hosts", "k:9092"], "unrecognized arguments: --kafka-hosts"),
], ids=lambda v: "-".join(v) if isinstance(v, list) else None)
def test_every_invalid_combination_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    out = dilu("standalone", "--data-dir", str(tmp_path / "data"), *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "data" / "redis").exists(), "nothing started"


def test_banner_on_a_terminal_and_the_port_as_openwhisk_spells_it(tmp_path: Path) -> None:
    port = free_port()
    pid, fd = pty.fork()
    if pid == 0:  # child: stdout and stderr are the terminal
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir",
                                   str(tmp_path), "--port", str(port)], ENV)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"Stop with Ctrl-C" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1)
            if ready:
                try:
                    seen += os.read(fd, 65536)
                except OSError:
                    break
        text = seen.decode(errors="replace")
        assert "Stop with Ctrl-C" in text, text
        url = f"http://127.0.0.1:{port}"
        assert f"OpenWhisk REST API at {url}" in text
        assert "guest key (namespace guest)" in text
        assert f'wsk property set --apihost {url} --auth "{GUEST_IDENTITY.api_key}"' in text
        with urllib.request.urlopen(f"{url}/api/v1", timeout=5) as resp:
            assert resp.status == 200
    finally:
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            with_data, _, _ = select.select([fd], [], [], 0.2)
            if with_data:
                try:
                    os.read(fd, 65536)
                except OSError:
                    pass
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert status is not None and os.waitstatus_to_exitcode(status) == 0


def test_no_banner_when_output_is_not_a_terminal(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir", str(tmp_path),
                             "-p", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert b"standalone ready" in out and b"wsk property set" not in out


BLOCK_NUMPY = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('numpy', 'matplotlib'):
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, Block())
import importlib.util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] in ('numpy', 'matplotlib') else _find(name, *a)
from dilu_invoker.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["simulate", "profile"])
def test_a_command_without_its_extra_says_so_in_one_line(command: str) -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK_NUMPY, command, "--help"], capture_output=True, text=True,
                         timeout=60, env=ENV, cwd=ROOT, check=False)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"dilu-invoker {command} needs the [sim] extra" in lines[0]
    assert "-m pip install '" in lines[0] and "[sim]'" in lines[0]


def test_commands_with_their_extra_run() -> None:
    out = dilu("simulate", "--help")
    assert out.returncode == 0 and "placement" in out.stdout, out.stderr


def test_doctor_reports_every_piece_with_a_fix(tmp_path: Path) -> None:
    out = dilu("doctor", "--data-dir", str(tmp_path), "-p", str(free_port()))
    assert out.returncode == 0, out.stdout + out.stderr
    names = [line.split()[1] for line in out.stdout.splitlines() if line.split()[0] in ("ok", "missing", "error")]
    assert names == ["python", "data-dir", "api-port", "redis", "gpus", "shim", "mps", "docker"]
    lines = out.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("missing"):
            assert lines[i + 1].strip().startswith("fix: "), line
    assert out.stdout.splitlines()[-1].startswith("standalone can start")


def test_doctor_fails_on_what_standalone_needs(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = dilu("doctor", "--data-dir", str(tmp_path), "--api-port", str(port),
                   "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 1
    text = out.stdout
    assert "error    api-port" in text and "error    redis" in text and "fix: start that Redis" in text
    assert text.splitlines()[-1] == "standalone cannot start as configured: fix api-port, redis"


def test_doctor_finds_a_docker_api(tmp_path: Path, podman_socket: str) -> None:
    out = dilu("doctor", "--data-dir", str(tmp_path), "--api-port", str(free_port()),
               "--invoker-backend", "docker", "--invoker-docker-url", podman_socket)
    docker_line = next(line for line in out.stdout.splitlines() if line.split()[1] == "docker")
    assert docker_line.startswith("ok") and podman_socket in docker_line, out.stdout


@pytest.mark.parametrize("command", ["balancer", "invoker"])
def test_cluster_commands_refuse_a_bad_redis_url_in_one_line(command: str) -> None:
    out = dilu(command, "--redis-url", "garbage://x", "--kafka-hosts", "127.0.0.1:1") if command == "invoker" \
        else dilu(command, "--redis-url", "garbage://x")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dilu-invoker {command}: error: --redis-url"), out.stderr


def test_banner_with_an_auth_file_points_at_the_file_without_printing_its_key(tmp_path: Path) -> None:
    from dilu_invoker import config
    from dilu_invoker.banner import standalone_banner

    keys = tmp_path / "my keys"
    keys.write_text("# team keys\n\n0f7d3f34-1111-4a4e-9c3e-0123456789ab:s3cr3t alice\n")
    cfg = config.load(environ={}, api=config.ApiConfig(auth_file=str(keys), guest_key=False, host="0.0.0.0"))
    text = standalone_banner(cfg, "http://0.0.0.0:3233")
    assert "s3cr3t" not in text and f"API keys: {keys}" in text and "guest key" not in text
    wsk_line = next(line.strip() for line in text.splitlines() if line.strip().startswith("wsk property set"))
    assert wsk_line.startswith("wsk property set --apihost http://127.0.0.1:3233 --auth ")
    # the line, pasted into a shell, reads the file's first key
    shown = subprocess.run(["bash", "-c", wsk_line.replace("wsk property set", "printf '%s\\n'", 1)],
                           capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["--apihost", "http://127.0.0.1:3233", "--auth", "0f7d3f34-1111-4a4e-9c3e-0123456789ab:s3cr3t"]
