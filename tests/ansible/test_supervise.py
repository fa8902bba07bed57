"""dilu-supervise, the stand-in for systemd where it is not PID 1 (``dilu_service_manager: none``): it
must read the environment file as systemd reads what the roles render, restart a failed command, leave a
cleanly exiting one alone, and stop the command's whole process group."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ansible" / "roles" / "dilu" / "files" / "dilu-supervise.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dilu_supervise", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


supervise = _load()


def _eventually(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.parametrize(("line", "value"), [
    ('A="plain"', "plain"),
    ('A="with \\"quotes\\" and \\\\ backslash"', 'with "quotes" and \\ backslash'),
    ('A="$HOME `cmd` stays"', "$HOME `cmd` stays"),
    ("A=unquoted value", "unquoted value"),
    ('A="\\x is kept"', "\\x is kept"),
    ('A=""', ""),
], ids=["plain", "quotes-backslash", "no-expansion", "unquoted", "unknown-escape", "empty"])
def test_env_file_values_read_as_systemd_reads_them(tmp_path: Path, line: str, value: str) -> None:
    env = tmp_path / "env"
    env.write_text(f"# comment\n\n; also a comment\n{line}\n")
    assert supervise.read_env_file(str(env)) == {"A": value}


def test_env_file_refuses_a_line_without_a_value(tmp_path: Path) -> None:
    env = tmp_path / "env"
    env.write_text("JUSTANAME\n")
    with pytest.raises(ValueError, match="not a KEY=value line"):
        supervise.read_env_file(str(env))


def _start(tmp_path: Path, script: str, *, env: dict[str, str] | None = None,
           stop_timeout: float = 5) -> subprocess.Popen[bytes]:
    env_file = tmp_path / "service.env"
    env_file.write_text("".join(f'{k}="{v}"\n' for k, v in (env or {}).items()))
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--name", "svc", "--pidfile", str(tmp_path / "svc.pid"),
         "--log", str(tmp_path / "svc.log"), "--env-file", str(env_file), "--chdir", str(tmp_path),
         "--restart-delay", "0.2", "--stop-timeout", str(stop_timeout), "--", "/bin/sh", "-c", script],
        start_new_session=True,
    )


def _child(tmp_path: Path) -> int:
    path = tmp_path / "svc.pid.child"
    return int(path.read_text()) if path.exists() else 0


def test_a_failing_command_is_restarted_with_only_the_env_file(tmp_path: Path) -> None:
    # First run: record the environment and fail; second run: stay up. "second" appears whole (written, then
    # renamed): a redirection creates the file before it writes, and the check below would race it.
    script = ('if [ -f ran ]; then echo "$GREETING" > second.part && mv second.part second; exec sleep 60; '
              'else env > first-env; touch ran; exit 3; fi')
    proc = _start(tmp_path, script, env={"GREETING": "hello again"})
    try:
        _eventually(lambda: (tmp_path / "second").exists(), "the command ran a second time")
        assert (tmp_path / "second").read_text() == "hello again\n"
        names = {line.split("=", 1)[0] for line in (tmp_path / "first-env").read_text().splitlines()}
        # systemd's service environment: PATH, LANG and the file; nothing of the caller's.
        assert "GREETING" in names and "PATH" in names
        assert "PYTEST_CURRENT_TEST" not in names and "HOME" not in names
        log = (tmp_path / "svc.log").read_text()
        assert "exited with status 3: restarting" in log
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not (tmp_path / "svc.pid").exists() and not (tmp_path / "svc.pid.child").exists()


def test_a_clean_exit_ends_the_supervisor(tmp_path: Path) -> None:
    proc = _start(tmp_path, "exit 0")
    assert proc.wait(30) == 0
    assert "exited cleanly: not restarting" in (tmp_path / "svc.log").read_text()
    assert not (tmp_path / "svc.pid").exists()


def test_stop_reaches_what_the_command_started(tmp_path: Path) -> None:
    # The command ignores SIGTERM and leaves a grandchild: both must be gone after the stop timeout.
    script = "trap '' TERM; sleep 120 & echo $! > grandchild; wait"
    proc = _start(tmp_path, script, stop_timeout=0.5)
    _eventually(lambda: (tmp_path / "grandchild").exists() and _child(tmp_path) > 0, "the command started")
    child, grandchild = _child(tmp_path), int((tmp_path / "grandchild").read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    _eventually(lambda: not _alive(child) and not _alive(grandchild), "the command and its child are gone")
    assert "killing" in (tmp_path / "svc.log").read_text()
