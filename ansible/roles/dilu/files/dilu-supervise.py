#!/usr/bin/env python3
"""Keep one service process running where systemd is not PID 1 (``dilu_service_manager: none``).

It does for containers and CI machines what the roles' systemd units do on a server, and no more:

* the environment is built like systemd builds a service's: a fixed PATH plus the ``EnvironmentFile``s,
  nothing inherited from the shell that started it;
* the command is restarted after ``--restart-delay`` seconds when it exits with a non-zero status
  (``Restart=on-failure``); a clean exit ends the supervisor too;
* SIGTERM goes to the command; whatever of its process group is still there after ``--stop-timeout``
  seconds is killed (``KillMode=mixed``);
* the command's output is appended to ``--log`` (the journal's place).

Started by the ``dilu_process`` module, stdlib only, Python >= 3.9 (``subprocess`` ``user=``/``group=``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: systemd's default PATH for services
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=value`` lines as the roles render them for systemd's ``EnvironmentFile``: values in double
    quotes with ``\\\\`` and ``\\"`` escaped; blank lines and lines starting with ``#`` or ``;`` skipped."""
    env: dict[str, str] = {}
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{path}:{number}: not a KEY=value line")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = _unescape(value[1:-1])
        env[key] = value
    return env


def _unescape(quoted: str) -> str:
    out: list[str] = []
    chars = iter(quoted)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            # systemd keeps a backslash that escapes nothing it knows; so do we.
            out.append(nxt if nxt in ('"', "\\", "$", "`") else "\\" + nxt)
        else:
            out.append(ch)
    return "".join(out)


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stopping = False
        self.stop_deadline = 0.0
        self.child: subprocess.Popen[bytes] | None = None

    def say(self, message: str) -> None:
        with open(self.args.log, "a", encoding="utf-8") as log:
            log.write(f"dilu-supervise[{self.args.name}]: {message}\n")

    def on_signal(self, signum: int, _frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            self.stop_deadline = time.monotonic() + self.args.stop_timeout
            self.say(f"signal {signum}: stopping")
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(signal.SIGTERM)

    def environment(self) -> dict[str, str]:
        env = {"PATH": SERVICE_PATH, "LANG": os.environ.get("LANG", "C.UTF-8")}
        for path in self.args.env_file:
            env.update(read_env_file(path))
        return env

    def spawn(self) -> subprocess.Popen[bytes]:
        log = open(self.args.log, "ab")
        try:
            return subprocess.Popen(
                self.args.command, env=self.environment(), cwd=self.args.chdir,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                user=self.args.user, group=self.args.group,
                # Its own process group, so that stopping can reach what the command started.
                start_new_session=True,
            )
        finally:
            log.close()

    def wait_child(self) -> int:
        assert self.child is not None
        while True:
            try:
                return self.child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if self.stopping and time.monotonic() > self.stop_deadline:
                    self.say(f"still running {self.args.stop_timeout:g} s after SIGTERM: killing")
                    self.kill_group(self.child.pid)

    @staticmethod
    def kill_group(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        Path(self.args.pidfile).write_text(f"{os.getpid()}\n")
        child_pidfile = Path(self.args.pidfile + ".child")
        rc = 0
        try:
            while not self.stopping:
                try:
                    self.child = self.spawn()
                except (OSError, ValueError, KeyError) as exc:
                    # A command that cannot even start is not retried: the module reports it.
                    self.say(f"cannot start {self.args.command[0]}: {exc}")
                    return 127
                child_pidfile.write_text(f"{self.child.pid}\n")
                self.say(f"started {' '.join(self.args.command)} (pid {self.child.pid})")
                rc = self.wait_child()
                # Leftovers of the command (its action processes) go with it, as with KillMode=mixed.
                self.kill_group(self.child.pid)
                if self.stopping:
                    self.say(f"stopped (exit status {rc})")
                    break
                if rc == 0:
                    self.say("exited cleanly: not restarting")
                    break
                self.say(f"exited with status {rc}: restarting in {self.args.restart_delay:g} s")
                until = time.monotonic() + self.args.restart_delay
                while not self.stopping and time.monotonic() < until:
                    time.sleep(0.05)
        finally:
            for path in (child_pidfile, Path(self.args.pidfile)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        return 0 if self.stopping else rc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dilu-supervise", description=__doc__.split("\n")[0])
    parser.add_argument("--name", required=True, help="service name (for the log and the module)")
    parser.add_argument("--pidfile", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--env-file", action="append", default=[])
    parser.add_argument("--chdir", default="/")
    parser.add_argument("--user", default=None)
    parser.add_argument("--group", default=None)
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    parser.add_argument("--restart-delay", type=float, default=2.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given")
    return args


if __name__ == "__main__":
    sys.exit(Supervisor(parse_args()).run())
