"""The process backend's sandboxes on their own: uid leases, the mount plan, the degraded mode."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dilu_invoker.invoker.dataplane.backends.base import ContainerSpec
from dilu_invoker.invoker.dataplane.backends.process import ProcessBackend
from dilu_invoker.invoker.dataplane.backends.sandbox import Sandboxes, mount_plan, parse_uid_range
from dilu_invoker.invoker.dataplane.runtime_client import RuntimeClient
from tests.invoker import isolation_actions as attacks
from tests.ow_support.invoker import alive

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.mark.parametrize(("text", "expected"), [
    ("200000-200999", range(200000, 201000)),
    ("300000", range(300000, 300001)),
], ids=["range", "single"])
def test_uid_range(text: str, expected: range) -> None:
    assert parse_uid_range(text) == expected


@pytest.mark.parametrize("text", ["0-10", "10-5", "a-b", ""], ids=["root", "reversed", "words", "empty"])
def test_bad_uid_range(text: str) -> None:
    with pytest.raises(ValueError, match="uid range"):
        parse_uid_range(text)


def test_mount_plan_covers_the_first_closed_directory() -> None:
    base = Path(tempfile.mkdtemp(prefix="dilu-plan-"))  # /tmp itself is open to everyone
    try:
        closed = base / "closed"
        (closed / "a" / "lib").mkdir(parents=True)
        (closed / "b").mkdir()
        (base / "open").mkdir()
        os.chmod(base, 0o755)
        os.chmod(closed, 0o700)
        plan = mount_plan([str(closed / "a"), str(closed / "a" / "lib"), str(closed / "b"), str(base / "open"),
                           str(base / "missing")])
        # the nested path folds into its parent; what is reachable needs nothing
        assert plan == {str(closed): (str(closed / "a"), str(closed / "b"))}
    finally:
        shutil.rmtree(base)


@root_only
async def test_two_backends_never_share_a_uid(tmp_path: Path) -> None:
    a = Sandboxes(uid_range=range(250000, 250002), work_dir=str(tmp_path / "w"))
    b = Sandboxes(uid_range=range(250000, 250002), work_dir=str(tmp_path / "w"))
    first = await a.create("c1", 64)
    second = await b.create("c2", 64)
    assert {first.uid, second.uid} == {250000, 250001}
    with pytest.raises(Exception, match="in use"):
        await a.create("c3", 64)
    assert (first.dir.stat().st_mode & 0o777) == 0o700 and first.dir.stat().st_uid == first.uid
    assert await a.destroy(first) and not first.dir.exists()
    third = await b.create("c3", 64)  # the uid is free again once its sandbox is gone
    assert third.uid == first.uid
    assert await b.destroy(second) and await b.destroy(third)
    a.close()
    b.close()


def test_a_backend_without_isolation_leaves_a_shared_work_root_traversable(tmp_path: Path) -> None:
    """Two invokers on one host share the default work dir; one without isolation must not lock the other's
    isolated uids out of their own dirs (its 0700 made every later start fail in chdir); its own root is 0700."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o711)  # as an isolating invoker leaves it
    Sandboxes(mode="off", work_dir=str(shared))
    assert shared.stat().st_mode & 0o777 == 0o711
    own = tmp_path / "own"
    Sandboxes(mode="off", work_dir=str(own))
    assert own.stat().st_mode & 0o777 == 0o700
    os.chmod(own, 0o755)  # anything else is tightened
    Sandboxes(mode="off", work_dir=str(own))
    assert own.stat().st_mode & 0o777 == 0o700


async def test_a_runtime_that_cannot_start_says_which_sandbox_step_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """subprocess says only "Exception occurred in preexec_fn"; the error names the step and its exception (here
    a memory cgroup gone between the sandbox's creation and the fork) and the pipe that carried it is not leaked."""
    from dilu_invoker.invoker.dataplane.backends.base import BackendError

    backend = ProcessBackend(isolation="off", work_dir=str(tmp_path / "w"))
    create = backend.sandboxes.create

    async def create_then_lose_the_dir(*args: object, **kwargs: object) -> object:
        box = await create(*args, **kwargs)  # type: ignore[arg-type]
        box.cgroup = tmp_path / "removed-cgroup"
        return box

    monkeypatch.setattr(backend.sandboxes, "create", create_then_lose_the_dir)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(BackendError) as info:
        await backend.start(ContainerSpec(name="c", kind="python:3", image="", memory_mb=256))
    assert "preexec_fn" in str(info.value) and f"joining the cgroup {tmp_path / 'removed-cgroup'}" in str(info.value)
    assert "FileNotFoundError" in str(info.value)
    assert len(os.listdir("/proc/self/fd")) <= fds
    await backend.close()


async def test_without_isolation_descendants_and_files_still_go(tmp_path: Path) -> None:
    backend = ProcessBackend(isolation="off", work_dir=str(tmp_path / "w"))
    assert not backend.sandboxes.isolating
    container = await backend.start(ContainerSpec(name="c", kind="python:3", image="", memory_mb=256))
    async with aiohttp.ClientSession() as http:
        client = RuntimeClient(http, container.url, secret=container.secret)
        init = {"value": {"name": "d", "code": attacks.DAEMON, "main": "main", "binary": False}}
        assert (await client.init(init, 30)).status_code == 0
        pids = (await client.run({"value": {}}, 30)).result["pids"]
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
    box_dir = container.sandbox.dir
    assert box_dir.is_dir() and (box_dir.stat().st_mode & 0o777) == 0o700
    await container.destroy()
    for pid in pids:
        try:
            state = next(line for line in open(f"/proc/{pid}/status") if line.startswith("State:")).split()[1]
        except OSError:
            continue
        assert state in ("Z", "X"), f"{pid} survived its container"
    assert not box_dir.exists()
    await backend.close()


@root_only
async def test_invokers_with_other_work_dirs_share_the_host_uid_leases() -> None:
    """Two invokers on one host with their own work dirs: neither hands out a uid the other holds, and one
    starting up (its sweep of leftovers) or destroying a container never kills the other's containers."""
    scratch = Path(tempfile.mkdtemp(prefix="dilu-leases-"))
    os.chmod(scratch, 0o755)
    uids = "250010-250011"
    a = ProcessBackend(uid_range=uids, work_dir=str(scratch / "a"))
    b = ProcessBackend(uid_range=uids, work_dir=str(scratch / "b"))
    try:
        assert a.sandboxes.lock_dir == b.sandboxes.lock_dir == Path("/run/dilu-invoker/uids")
        spec = ContainerSpec(name="c", kind="python:3", image="", memory_mb=128)
        first = await a.start(spec)
        second = await b.start(spec)
        assert {first.sandbox.uid, second.sandbox.uid} == {250010, 250011}
        with pytest.raises(Exception, match="in use"):
            await a.start(spec)
        # A third invoker starting on this host sweeps leftovers of the range: both containers are live.
        c = ProcessBackend(uid_range=uids, work_dir=str(scratch / "c"))
        assert await c.remove_leftovers("wsk") == 0
        c.sandboxes.close()
        await b.close()  # kill -1 as the other uid
        async with aiohttp.ClientSession() as http:
            client = RuntimeClient(http, first.url, secret=first.secret)
            init = {"value": {"name": "n", "code": "def main(a):\n    return {'ok': 1}\n", "main": "main",
                              "binary": False}}
            assert (await client.init(init, 30)).status_code == 0
            assert (await client.run({"value": {}}, 30)).result == {"ok": 1}
        assert first.alive
    finally:
        await a.close()
        await b.close()
        shutil.rmtree(scratch, ignore_errors=True)


GETUSER = """
import getpass, os
def main(a):
    return {"user": getpass.getuser(), "uid": os.getuid(), "home": os.path.expanduser("~")}
"""


@root_only
async def test_an_isolated_runtime_has_a_user_name_without_a_passwd_entry(tmp_path: Path) -> None:
    backend = ProcessBackend(isolation="auto", uid_range="251000-251009", work_dir=str(tmp_path / "w"))
    container = await backend.start(ContainerSpec(name="c", kind="python:3", image="", memory_mb=256))
    try:
        async with aiohttp.ClientSession() as http:
            client = RuntimeClient(http, container.url, secret=container.secret)
            init = {"value": {"name": "u", "code": GETUSER, "main": "main", "binary": False}}
            assert (await client.init(init, 30)).status_code == 0
            result = (await client.run({"value": {}}, 30)).result
        assert result["uid"] == container.sandbox.uid and 251000 <= result["uid"] <= 251009
        assert result["user"] == f"dilu{result['uid']}"  # getpwuid() would have raised: no passwd entry
        assert result["home"] == str(container.sandbox.dir)
    finally:
        await container.destroy()
        await backend.close()


async def test_containers_started_at_once_each_serve_on_their_own_port(tmp_path: Path) -> None:
    backend = ProcessBackend(isolation="off", work_dir=str(tmp_path / "w"))
    containers = await asyncio.gather(*(
        backend.start(ContainerSpec(name=f"c{i}", kind="python:3", image="", memory_mb=256)) for i in range(8)))
    try:
        assert len({c.port for c in containers}) == len(containers)
        async with aiohttp.ClientSession() as http:
            for c in containers:
                client = RuntimeClient(http, c.url, secret=c.secret)
                init = {"value": {"name": "p", "code": "def main(a):\n    return {'ok': True}\n", "main": "main",
                                  "binary": False}}
                assert (await client.init(init, 30)).status_code == 0
                assert (await client.run({"value": {}}, 30)).result == {"ok": True}
        assert all(c.alive for c in containers)
    finally:
        await asyncio.gather(*(c.destroy() for c in containers))
        await backend.close()



async def test_a_burst_of_starts_forks_one_runtime_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork blocks the event loop until the child execs: starts of a burst fork one at a time, and the loop runs
    other work between two forks (before, all of a burst forked in one turn of the loop: 200 ms blocked for 8;
    docs/benchmarks/spawn.md)."""
    turns = 0

    async def ticker() -> None:  # counts the turns of the loop
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    spans: list[tuple[int, int]] = []
    real = asyncio.create_subprocess_exec

    async def spawn(*args: Any, **kw: Any) -> asyncio.subprocess.Process:
        begun = turns
        try:
            return await real(*args, **kw)
        finally:
            spans.append((begun, turns))

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)
    counting = asyncio.create_task(ticker())
    backend = ProcessBackend(isolation="off", work_dir=str(tmp_path / "w"))
    try:
        containers = await asyncio.gather(*(
            backend.start(ContainerSpec(name=f"c{i}", kind="python:3", image="", memory_mb=256)) for i in range(4)))
        await asyncio.gather(*(c.destroy() for c in containers))
    finally:
        counting.cancel()
        await backend.close()
    assert len(spans) == 4
    for (_, ended), (begun, _) in itertools.pairwise(sorted(spans)):
        assert begun > ended, spans

def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("dead_before_destroy", [True, False], ids=["crashed", "live"])
async def test_destroy_leaves_the_reaping_to_asyncio_and_reports_the_real_exit(
    tmp_path: Path, late_child_watcher: None, caplog: pytest.LogCaptureFixture, dead_before_destroy: bool
) -> None:
    """Destroy must not reap the runtime itself (Process.kill() polls first): the child watcher would then
    find no child, log "Unknown child process pid" and report exit 255 for a runtime killed by a signal."""
    backend = ProcessBackend(isolation="off", work_dir=str(tmp_path / "w"))
    container = await backend.start(ContainerSpec(name="c", kind="python:3", image="", memory_mb=256))
    try:
        if dead_before_destroy:  # it crashed; its exit is not yet collected when the pool destroys it
            os.kill(container.pid, signal.SIGKILL)
            async with asyncio.timeout(10):
                while _state(container.pid) != "Z":
                    await asyncio.sleep(0.005)
        caplog.set_level(logging.WARNING, logger="asyncio")
        await container.destroy()
        assert container.exit_reason() == "killed by SIGKILL"
        assert not [r for r in caplog.records if "child process" in r.getMessage()]
    finally:
        await backend.close()


@root_only
async def test_a_uid_group_is_one_uid_for_its_members_and_leased_apart(tmp_path: Path) -> None:
    """The MPS clients of one GPU (a uid group) share one uid, owned dirs and all; another group and a
    plain container get uids of their own; a member's destroy leaves the group's uid leased."""
    from dilu_invoker.invoker.dataplane.backends.sandbox import UidGroup

    boxes = Sandboxes(uid_range=range(250010, 250014), work_dir=str(tmp_path / "w"))
    pipe, logs = tmp_path / "w" / "mps" / "pipe", tmp_path / "w" / "mps" / "log"
    pipe.mkdir(parents=True)
    logs.mkdir()
    group = UidGroup(key=str(pipe), dirs=(str(pipe), str(logs)))
    a = await boxes.create("a", 64, group=group)
    b = await boxes.create("b", 64, group=group)
    other = await boxes.create("o", 64, group=UidGroup(key="/elsewhere"))
    plain = await boxes.create("p", 64)
    assert a.uid == b.uid and len({a.uid, other.uid, plain.uid}) == 3
    assert a.dir != b.dir and a.dir.stat().st_uid == a.uid and (a.dir.stat().st_mode & 0o777) == 0o700
    assert pipe.stat().st_uid == a.uid and logs.stat().st_uid == a.uid
    assert a.prefix[0].endswith("unshare") and f"--reuid={a.uid}" in a.prefix
    assert "/tmp" in a.covers and str(a.dir) in a.keep and str(pipe) in a.read_only
    # Each member's namespace allocates PIDs from a range no other live member of its group has.
    assert (a.pid_slot, b.pid_slot, other.pid_slot, plain.pid_slot) == (0, 1, 0, None)
    assert "1000" in a.prefix and "2000" in b.prefix
    assert await boxes.destroy(a) and not a.dir.exists()
    again = await boxes.create("c", 64, group=group)  # still the group's uid, not handed to anyone else
    assert again.uid == b.uid and again.pid_slot == 0  # the range a left
    last = await boxes.create("q", 64)  # 4 uids: two groups, the plain one, and this one
    with pytest.raises(Exception, match="in use"):
        await boxes.create("r", 64)
    for box in (b, other, plain, again, last):
        assert await boxes.destroy(box)
    boxes.close()


@root_only
async def test_without_unshare_a_uid_group_cannot_be_made(tmp_path: Path) -> None:
    from dilu_invoker.invoker.dataplane.backends.sandbox import SandboxError, UidGroup

    boxes = Sandboxes(uid_range=range(250020, 250022), work_dir=str(tmp_path / "w"))
    boxes._unshare = None  # as on a host without util-linux's unshare
    assert boxes.groups_unavailable is not None and "unshare" in boxes.groups_unavailable
    with pytest.raises(SandboxError, match="unshare"):
        await boxes.create("a", 64, group=UidGroup(key="/pipes"))
    boxes.close()


# A process that starts one runtime without isolation, prints its pid and waits to be killed.
_STARTS_A_RUNTIME = """
import asyncio, sys
from dilu_invoker.invoker.dataplane.backends.base import ContainerSpec
from dilu_invoker.invoker.dataplane.backends.process import ProcessBackend

async def main():
    backend = ProcessBackend(isolation="off", work_dir=sys.argv[1])
    container = await backend.start(ContainerSpec(name="c", kind="python:3", image="", memory_mb=256))
    print(container.sandbox.leader, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_without_isolation_nothing_runs_between_fork_and_exec_and_the_runtime_dies_with_its_invoker(
        tmp_path: Path) -> None:
    """Without isolation the sandbox has no step for the child to take between fork and exec (so subprocess may
    vfork and the invoker's loop is held far less): the runtime gets its umask from subprocess and makes itself
    die with the invoker (`--die-with`). An invoker killed with SIGKILL takes its runtime along."""
    boxes = Sandboxes(mode="off", work_dir=str(tmp_path / "boxes"))
    box = await boxes.create("c", 256)
    assert box.preexec() is None
    box.uid = 12345  # an isolated sandbox's steps still run in the child
    assert callable(box.preexec())
    invoker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _STARTS_A_RUNTIME, str(tmp_path / "w"), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert invoker.stdout is not None
    try:
        line = b""
        while not line.strip().isdigit():  # (the backend's own log lines come first)
            line = await asyncio.wait_for(invoker.stdout.readline(), 60)
            assert line, "the process ended before it started a runtime"
        runtime = int(line)
        status = Path(f"/proc/{runtime}/status").read_text()
        assert "\nUmask:\t0077\n" in status, status
        assert f"\nPPid:\t{invoker.pid}\n" in status
    finally:
        invoker.kill()
        await invoker.wait()
    deadline = time.monotonic() + 10
    while alive(runtime):
        assert time.monotonic() < deadline, f"runtime {runtime} outlived its invoker"
        await asyncio.sleep(0.05)
