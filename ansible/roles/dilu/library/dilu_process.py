#!/usr/bin/python
# Apache-2.0; part of dilu-invoker's Ansible roles.
"""Ansible module: a supervised process where systemd is not PID 1 (``dilu_service_manager: none``)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dilu_process
short_description: Start, stop or restart a process under dilu-supervise
description:
  - The stand-in for C(ansible.builtin.systemd_service) on machines without systemd as PID 1 (containers,
    CI). The process runs under C(dilu-supervise), which restarts it after a failure, builds its
    environment from the same EnvironmentFile the systemd unit uses and stops it with SIGTERM, then
    SIGKILL after I(stop_timeout).
  - C(started) changes nothing when the supervisor of I(name) is alive; C(restarted) always restarts.
options:
  name:
    description: Service name; the pid file is I(run_dir)/I(name).pid.
    type: str
    required: true
  state:
    description: Wanted state.
    type: str
    choices: [started, stopped, restarted]
    default: started
  command:
    description: The command (argv), as the unit's ExecStart. Required to start.
    type: list
    elements: str
  env_files:
    description: EnvironmentFile paths, read at every (re)start.
    type: list
    elements: path
    default: []
  chdir:
    description: Working directory.
    type: path
    default: /
  user:
    description: Run the command as this user (the supervisor itself runs as the connecting user).
    type: str
  group:
    description: Run the command with this group.
    type: str
  supervisor:
    description: Path of dilu-supervise.py on the target.
    type: path
    required: true
  run_dir:
    description: Directory of the pid files.
    type: path
    required: true
  log_file:
    description: The command's output is appended here.
    type: path
    required: true
  stop_timeout:
    description: Seconds between SIGTERM and SIGKILL.
    type: float
    default: 30
  restart_delay:
    description: Seconds before a failed command is started again.
    type: float
    default: 2
author: dilu-invoker
"""

EXAMPLES = r"""
- name: Start dilu-invoker without systemd
  dilu_process:
    name: dilu-invoker
    command: [/opt/dilu-invoker/current/bin/dilu-invoker, invoker, --id, "3"]
    env_files: [/etc/dilu-invoker/invoker.env]
    supervisor: /var/lib/dilu/supervise/dilu-supervise.py
    run_dir: /var/lib/dilu/supervise
    log_file: /var/log/dilu-invoker/dilu-invoker.log
"""

RETURN = r"""
pid:
  description: Pid of the supervisor (0 when stopped).
  type: int
  returned: always
child_pid:
  description: Pid of the supervised command (0 when unknown or stopped).
  type: int
  returned: always
"""

import os  # noqa: E402 - Ansible modules open with their documentation
import signal  # noqa: E402 - Ansible modules open with their documentation
import subprocess  # noqa: E402 - Ansible modules open with their documentation
import sys  # noqa: E402 - Ansible modules open with their documentation
import time  # noqa: E402 - Ansible modules open with their documentation

from ansible.module_utils.basic import AnsibleModule  # noqa: E402 - Ansible modules open with their documentation

SUPERVISOR_MARK = "dilu-supervise"


def _read_pid(path):
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _alive(pid, name):
    """The pid is a live (not zombie) dilu-supervise for this name."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state in ("Z", "X"):
        return False
    joined = b" ".join(argv)
    return SUPERVISOR_MARK.encode() in joined and b"--name" in argv and name.encode() in argv


def _log_tail(path, lines=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _stop(pid, name, timeout):
    with _suppress():
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout + 5
    while time.monotonic() < deadline:
        if not _alive(pid, name):
            return True
        time.sleep(0.1)
    with _suppress():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    return not _alive(pid, name)


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, (ProcessLookupError, PermissionError))


def _start(module, p, pidfile):
    for path in [p["supervisor"], *p["env_files"]]:
        if not os.path.exists(path):
            module.fail_json(msg=f"{path} does not exist")
    argv = [sys.executable, p["supervisor"], "--name", p["name"], "--pidfile", pidfile, "--log", p["log_file"],
            "--chdir", p["chdir"], "--stop-timeout", str(p["stop_timeout"]),
            "--restart-delay", str(p["restart_delay"])]
    for env_file in p["env_files"]:
        argv += ["--env-file", env_file]
    if p["user"]:
        argv += ["--user", p["user"]]
    if p["group"]:
        argv += ["--group", p["group"]]
    argv += ["--", *p["command"]]
    os.makedirs(os.path.dirname(p["log_file"]) or "/", exist_ok=True)
    # A new session, no inherited descriptors: Ansible must not wait for it, nor take it down.
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True, cwd="/")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            module.fail_json(msg=f"{p['name']}: dilu-supervise exited with status {proc.returncode}",
                             log=_log_tail(p["log_file"]))
        pid = _read_pid(pidfile)
        child = _read_pid(pidfile + ".child")
        if pid and child and _alive(pid, p["name"]):
            return pid, child
        time.sleep(0.05)
    module.fail_json(msg=f"{p['name']} did not start under dilu-supervise", log=_log_tail(p["log_file"]))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            state=dict(type="str", default="started", choices=["started", "stopped", "restarted"]),
            command=dict(type="list", elements="str"),
            env_files=dict(type="list", elements="path", default=[]),
            chdir=dict(type="path", default="/"),
            user=dict(type="str"),
            group=dict(type="str"),
            supervisor=dict(type="path", required=True),
            run_dir=dict(type="path", required=True),
            log_file=dict(type="path", required=True),
            stop_timeout=dict(type="float", default=30.0),
            restart_delay=dict(type="float", default=2.0),
        ),
        required_if=[("state", "started", ["command"]), ("state", "restarted", ["command"])],
        supports_check_mode=True,
    )
    p = module.params
    os.makedirs(p["run_dir"], exist_ok=True)
    pidfile = os.path.join(p["run_dir"], f"{p['name']}.pid")
    pid = _read_pid(pidfile)
    running = _alive(pid, p["name"])
    state = p["state"]

    if state == "started" and running:
        module.exit_json(changed=False, pid=pid, child_pid=_read_pid(pidfile + ".child"))
    if state == "stopped" and not running:
        module.exit_json(changed=False, pid=0, child_pid=0)
    if module.check_mode:
        module.exit_json(changed=True, pid=pid if running else 0, child_pid=0)

    if running and not _stop(pid, p["name"], p["stop_timeout"]):
        module.fail_json(msg=f"{p['name']} (pid {pid}) did not stop", log=_log_tail(p["log_file"]))
    if state == "stopped":
        module.exit_json(changed=True, pid=0, child_pid=0)
    pid, child = _start(module, p, pidfile)
    module.exit_json(changed=True, pid=pid, child_pid=child)


if __name__ == "__main__":
    main()
