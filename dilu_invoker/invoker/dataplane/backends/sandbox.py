"""What keeps a process-backend container to itself: its own uid, directory, memory cgroup and mount view.

When the invoker runs as root (``--invoker-process-isolation auto``, the default) every container gets

* an **unprivileged uid/gid** of its own from ``--invoker-process-uid-range``, held by an exclusive lock
  file so two invokers on one host never share one, with no supplementary groups and ``no_new_privs``;
* a **private directory** ``<work dir>/u<uid>`` (0700, owned by that uid; ``HOME`` and ``TMPDIR`` point
  there), removed on destroy;
* a **memory cgroup** with the action's ``limits.memory`` (cgroup v2 ``memory.max`` where the machine has
  it, else the v1 memory controller), nested under the invoker's own cgroup;
* a **private mount namespace** in which the invoker's data directory is an empty read-only tmpfs, and
  any directory the uid could not traverse on the way to the interpreter (``/root`` for a pyenv or a
  venv under ``/root``) is replaced by a tmpfs holding only bind mounts of what Python needs;
* on destroy, **every process of the uid** is killed (``kill(-1)`` from a helper running as that uid,
  which no fork can outrun, then the cgroup is checked empty), files it left in ``/tmp``, ``/var/tmp`` and
  ``/dev/shm`` are removed, and only then is the uid handed out again.

**MPS clients of one GPU share a uid.** An MPS control daemon runs one uid's server at a time and queues
every other uid's clients until that server exits, so containers of separate uids cannot share a GPU
through MPS. The containers that are MPS clients of one daemon (``UidGroup``, keyed by its pipe directory)
therefore run as one uid leased for that GPU, and are kept apart by namespaces instead of uids:

* a **private PID namespace** with its own ``/proc`` (util-linux ``unshare --pid --fork --kill-child
  --mount-proc``, then ``setpriv`` drops to the uid): a member sees, signals and traces only its own
  processes, never another member's or the MPS server's; killing the namespace's first process kills all;
* in its mount view, **private** ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (tmpfs) and a work dir holding only
  its own directory, so the files of the other members are not there to read; the MPS pipe and log
  directories are bound in read-only (clients connect to the daemon's sockets; they cannot replace them);
* its own memory cgroup as every container; on destroy the namespace is killed (not every process of the
  uid, which would kill the other members and the MPS server);
* its **own range of PIDs** in its namespace (the namespace's ``ns_last_pid`` is set to ``PID_SLOT_SIZE`` x
  (slot + 1) before the runtime starts, a slot no other live member of the group has): without it every
  member's worker would be PID 2, and a CUDA IPC handle names its exporter by PID — two processes whose PIDs
  read the same in their namespaces could take each other for the same process (the models API's
  mapping between such members failed with CUDA error 201, invalid context, on the H200; with the ranges
  the same pair mapped, and the product's second instance added 2.3% of the weights, coldstart run 7).

Without root (or with ``--invoker-process-isolation off``) containers run as the invoker's user: the
private directory, the runtime secret and the kill of every descendant (found by a per-container marker
in their environment) remain; uid, file, memory and mount isolation do not, and the backend says so in
its log at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import signal
import site
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from dilu_invoker.config import MPS_ISOLATION_TOOLS, default_process_work_dir

log = structlog.get_logger(__name__)

MARKER_ENV = "DILU_SANDBOX"
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_MS_REMOUNT = 32
#: world-writable places where a uid can leave files behind
_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
#: the host's uid leases: one lock file per uid, shared by every invoker on the host whatever its work dir
UID_LOCK_DIR = "/run/dilu-invoker/uids"


class SandboxError(RuntimeError):
    pass


def parse_uid_range(text: str) -> range:
    """``"200000-200999"`` → ``range(200000, 201000)``."""
    lo, sep, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"bad uid range {text!r}: expected FIRST-LAST") from None
    if not 0 < first <= last < 2**32 - 1:
        raise ValueError(f"bad uid range {text!r}: need 0 < FIRST <= LAST")
    return range(first, last + 1)


# -- cgroups --------------------------------------------------------------------------------------------


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Cgroups:
    """One memory cgroup per container under ``root``: v2 (``memory.max``) or v1 (memory controller)."""

    def __init__(self, version: int, root: Path) -> None:
        self.version = version
        self.root = root

    @classmethod
    def probe(cls, name: str) -> tuple[Cgroups | None, str]:
        """The cgroup hierarchy this machine lets us use, and a sentence saying what was found."""
        base = Path("/sys/fs/cgroup")
        own = _own_cgroups()
        if (base / "cgroup.controllers").exists():
            if "memory" not in (base / "cgroup.controllers").read_text().split():
                return None, "cgroup v2 without the memory controller"
            for parent in (base / own.get("", "/").lstrip("/"), base):
                root = parent / name
                try:
                    _write(parent / "cgroup.subtree_control", "+memory +pids")
                    root.mkdir(exist_ok=True)
                    _write(root / "cgroup.subtree_control", "+memory +pids")
                    return cls(2, root), f"cgroup v2 memory.max under {root}"
                except OSError as exc:
                    last = exc
            return None, f"cgroup v2 present but not usable: {last}"
        mem = base / "memory"
        if (mem / "memory.limit_in_bytes").exists():
            parent = mem / own.get("memory", "/").lstrip("/")
            root = parent / name
            try:
                root.mkdir(exist_ok=True)
            except OSError as exc:
                return None, f"cgroup v1 memory controller not writable: {exc}"
            return cls(1, root), f"cgroup v1 memory.limit_in_bytes under {root}"
        return None, "no cgroup memory controller mounted"

    def create(self, leaf: str, memory_bytes: int) -> Path:
        path = self.root / leaf
        self.remove(path)  # a leftover of an earlier holder of this uid
        path.mkdir()
        if self.version == 2:
            _write(path / "memory.max", str(memory_bytes))
            with contextlib.suppress(OSError):
                _write(path / "memory.swap.max", "0")
        else:
            _write(path / "memory.limit_in_bytes", str(memory_bytes))
            with contextlib.suppress(OSError):  # only with swap accounting
                _write(path / "memory.memsw.limit_in_bytes", str(memory_bytes))
        return path

    def set_limit(self, path: Path, memory_bytes: int) -> None:
        """Change a container's limit (a pre-loaded container taken by an action); refuses, changing
        nothing, when its processes' anonymous memory (page cache is reclaimable and does not count)
        already exceeds 90% of the new limit."""
        used = self.anon_bytes(path)
        if used is not None and used > memory_bytes * 0.9:
            raise SandboxError(f"the container already uses {used >> 20} MB, more than the new limit allows")
        if self.version == 2:
            _write(path / "memory.max", str(memory_bytes))
            return
        # v1: memsw must never be below the plain limit, so the order depends on the direction.
        memsw = path / "memory.memsw.limit_in_bytes"
        old = int((path / "memory.limit_in_bytes").read_text())
        steps = [("memory.limit_in_bytes", memory_bytes), ("memory.memsw.limit_in_bytes", memory_bytes)]
        if memory_bytes > old:
            steps.reverse()
        for name, value in steps:
            if name.startswith("memory.memsw") and not memsw.exists():
                continue
            with contextlib.suppress(OSError) if name.startswith("memory.memsw") else contextlib.nullcontext():
                _write(path / name, str(value))

    def anon_bytes(self, path: Path) -> int | None:
        """Anonymous memory of the cgroup (``anon`` in v2's, ``total_rss`` or ``rss`` in v1's memory.stat)."""
        keys = ("anon",) if self.version == 2 else ("total_rss", "rss")
        try:
            stat = dict(line.split()[:2] for line in (path / "memory.stat").read_text().splitlines() if " " in line)
            return next(int(stat[k]) for k in keys if k in stat)
        except (OSError, ValueError, StopIteration):
            return None

    @staticmethod
    def procs(path: Path) -> list[int]:
        try:
            return [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self, path: Path) -> None:
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(path / "cgroup.kill", "1")
        for pid in self.procs(path):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def oom_killed(self, path: Path) -> bool:
        try:
            if self.version == 2:
                text = (path / "memory.events").read_text()
                return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in text.splitlines())
            text = (path / "memory.oom_control").read_text()
            kills = [int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")]
            if kills:
                return kills[0] > 0
            return int((path / "memory.failcnt").read_text()) > 0
        except (OSError, ValueError, IndexError):
            return False

    def remove(self, path: Path) -> bool:
        if not path.exists():
            return True
        for _ in range(100):
            try:
                path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    return False
                self.kill(path)
                time.sleep(0.01)
        return False


def _own_cgroups() -> dict[str, str]:
    """Controller → this process's cgroup path (``""`` for the v2 hierarchy)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


# -- the host's processes ---------------------------------------------------------------------------------


def _live_status(field: bytes) -> Iterator[tuple[int, int]]:
    """(pid, the first number of its ``field`` line, e.g. ``Uid:`` or ``PPid:``) of every live process (a
    scan of /proc/*/status; zombies, dead and waiting for a parent to reap them, do not count)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                for line in f:  # State: comes before Uid: and PPid:
                    if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                        break
                    if line.startswith(field):
                        yield int(entry.name), int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue


def pids_of_uid(uids: Iterable[int]) -> dict[int, list[int]]:
    """uid → pids of the live processes whose real uid it is."""
    wanted = set(uids)
    out: dict[int, list[int]] = {}
    for pid, uid in _live_status(b"Uid:"):
        if uid in wanted:
            out.setdefault(uid, []).append(pid)
    return out


def pids_with_marker(marker: str) -> list[int]:
    """Processes whose environment carries ``DILU_SANDBOX=<marker>`` (readable for our own uid only)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(entry.name))
        except OSError:
            continue
    return out


def _kill_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


# -- the mount view ---------------------------------------------------------------------------------------


def _traversable_by_others(path: Path) -> bool:
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


def mount_plan(needed: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """For paths an unprivileged uid must reach: the highest directory on the way to each that it cannot
    traverse → the paths below it to bind back in (nested ones folded into their parents)."""
    plan: dict[str, set[str]] = {}
    for raw in needed:
        if not raw or not os.path.exists(raw):
            continue
        path = Path(os.path.realpath(raw))
        for ancestor in list(reversed(path.parents))[1:] + [path]:
            if ancestor == path:
                break
            if not _traversable_by_others(ancestor):
                plan.setdefault(str(ancestor), set()).add(str(path))
                break
    out: dict[str, tuple[str, ...]] = {}
    for hide, paths in plan.items():
        kept = sorted(p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths))
        out[hide] = tuple(kept)
    return out


def interpreter_paths() -> list[str]:
    """What the runtime's Python needs to read: its prefixes, site-packages and ``sys.path``."""
    paths = [sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    with contextlib.suppress(Exception):
        paths += site.getsitepackages()
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    paths.append(str(Path(__file__).resolve().parents[4]))  # the package itself
    return paths


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it. In a PID namespace whose first process is a child of
    ``root`` this is the whole namespace: orphans there are adopted by that first process, never by a
    process outside."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _live_status(b"PPid:"):
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid == root and not os.path.exists(f"/proc/{pid}"):
            continue
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


@dataclass(frozen=True, slots=True)
class UidGroup:
    """Containers that must run as one uid: the MPS clients of one GPU's daemon (``key``: its pipe
    directory). ``dirs``: directories the group's uid owns (its MPS server writes its pipes and log there)
    and its members see read-only."""

    key: str
    dirs: tuple[str, ...] = ()


# -- one container's sandbox ------------------------------------------------------------------------------


#: Group members: the PIDs of a member's processes start at PID_SLOT_SIZE x (its slot + 1) + 1 in its namespace
PID_SLOT_SIZE = 1000
#: slots 0..PID_SLOTS - 1: PIDs stay below 32768, the smallest pid_max a kernel has
PID_SLOTS = 31
_SET_LAST_PID = '{ echo "$0" > /proc/sys/kernel/ns_last_pid; } 2>/dev/null; exec "$@"'


#: the most a failed preexec writes about its failure
_PREEXEC_REPORT_BYTES = 512


def preexec_failure(read_fd: int) -> str | None:
    """What a failed :meth:`Sandbox.preexec` wrote to its report pipe (None: nothing); closes ``read_fd``."""
    try:
        os.set_blocking(read_fd, False)
        data = os.read(read_fd, _PREEXEC_REPORT_BYTES)
    except OSError:
        data = b""
    finally:
        os.close(read_fd)
    return data.decode(errors="replace") or None


@dataclass(slots=True, eq=False)
class Sandbox:
    """One container's confinement; :meth:`preexec` runs in the forked child before ``exec``."""

    name: str
    dir: Path
    marker: str
    uid: int | None = None
    gid: int | None = None
    cgroup: Path | None = None
    hide: tuple[str, ...] = ()
    plan: dict[str, tuple[str, ...]] = field(default_factory=dict)
    group: str | None = None
    """The uid group (``UidGroup.key``) whose uid this container shares: namespaces keep it apart."""
    covers: tuple[str, ...] = ()
    """Group members: directories replaced by a private tmpfs in its mount view."""
    keep: tuple[str, ...] = ()
    """Group members: paths below ``covers`` bound back in (its own dir, what Python and the shim need)."""
    read_only: tuple[str, ...] = ()
    """Group members: paths bound back in read-only (the MPS pipe and log directories)."""
    prefix: tuple[str, ...] = ()
    """Group members: the command the runtime is started under (a private PID namespace, then the uid)."""
    leader: int | None = None
    """Group members: the pid of the process the backend started (the namespace's first process is its child)."""
    pid_slot: int | None = None
    """Group members: which range of PIDs its namespace allocates from (distinct among the live members)."""
    _lock_fd: int | None = None

    @property
    def isolated(self) -> bool:
        return self.uid is not None

    def env(self) -> dict[str, str]:
        env = {"HOME": str(self.dir), "TMPDIR": str(self.dir), MARKER_ENV: self.marker}
        if self.uid is not None:
            # A leased uid has no passwd entry: getpass.getuser() (torch's and triton's cache paths ask it)
            # reads these before it falls back to getpwuid(), which would fail.
            env["USER"] = env["LOGNAME"] = f"dilu{self.uid}"
        return env

    def command(self, argv: Sequence[str]) -> list[str]:
        """The command line that starts ``argv`` in this sandbox (group members: under ``prefix``)."""
        return [*self.prefix, *argv]

    def preexec(self, report_fd: int | None = None) -> Callable[[], None] | None:
        """What the child does between fork and exec. subprocess reports only "Exception occurred in
        preexec_fn" when it fails; with ``report_fd`` (a close-on-exec pipe's write end) the child first writes
        there which step failed and why, for :func:`preexec_failure` to read. None without isolation (no uid, no
        cgroup): the directory and umask are subprocess's own arguments and the runtime makes itself die with the
        invoker (``--die-with``), so nothing runs between fork and exec and subprocess may use vfork, which
        holds the invoker's event loop for far less than a fork does (docs/benchmarks/spawn.md)."""
        if self.uid is None and self.cgroup is None:
            return None
        uid, gid, cgroup, plan, hide, home = self.uid, self.gid, self.cgroup, self.plan, self.hide, str(self.dir)
        grouped, covers, keep, read_only = self.group is not None, self.covers, self.keep, self.read_only
        step = "loading libc"

        def steps() -> None:
            nonlocal step
            libc = ctypes.CDLL(None, use_errno=True)
            if cgroup is not None:
                step = f"joining the cgroup {cgroup}"
                _write(cgroup / "cgroup.procs", str(os.getpid()))
            if uid is not None:
                step = "the private mounts"
                _private_mounts(libc, plan, hide)
            if uid is not None and grouped:
                # The uid change happens after the PID namespace is made (``prefix``: unshare, then setpriv).
                step = "covering and keeping paths"
                _cover_and_keep(libc, covers, keep, read_only)
            elif uid is not None:
                step = f"the change to uid {uid}"
                libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
                os.setgroups([])
                os.setgid(gid if gid is not None else uid)
                os.setuid(uid)
            # after the uid change: a change of credentials clears the parent-death signal
            step = f"entering {home}"
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.chdir(home)
            os.umask(0o077)

        def run() -> None:  # in the child, between fork and exec: only what must happen there
            try:
                steps()
            except BaseException as exc:
                if report_fd is not None:
                    with contextlib.suppress(OSError):
                        os.write(report_fd, f"{step}: {exc!r}"[:_PREEXEC_REPORT_BYTES].encode(errors="replace"))
                raise

        return run

    def members(self, cgroups: Cgroups | None) -> list[int]:
        if self.cgroup is not None and cgroups is not None:
            return Cgroups.procs(self.cgroup)
        if self.group is not None:
            return descendants(self.leader) if self.leader is not None else []
        if self.uid is not None:
            return pids_of_uid([self.uid]).get(self.uid, [])
        return pids_with_marker(self.marker)

    def oom_killed(self, cgroups: Cgroups | None) -> bool:
        return self.cgroup is not None and cgroups is not None and cgroups.oom_killed(self.cgroup)


def _private_mounts(libc: ctypes.CDLL, plan: dict[str, tuple[str, ...]], hide: tuple[str, ...]) -> None:
    def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                      data.encode() if data else None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")

    if libc.unshare(_CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    mount("none", "/", None, _MS_REC | _MS_PRIVATE)
    for covered, keep in plan.items():
        # Held open across the cover, then bound back through /proc/self/fd: no staging place needed.
        held = [(path, os.open(path, os.O_PATH)) for path in keep]
        mount("tmpfs", covered, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
        for path, fd in held:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o444))
            mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            os.close(fd)
    for path in hide:
        mount("tmpfs", path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=0555,size=4k")


def _cover_and_keep(libc: ctypes.CDLL, covers: tuple[str, ...], keep: tuple[str, ...],
                    read_only: tuple[str, ...]) -> None:
    """A private tmpfs on each of ``covers``; then ``keep`` bound back in, and ``read_only`` read-only."""
    def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                      data.encode() if data else None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")

    held = [(path, os.open(path, os.O_PATH), path in read_only) for path in (*keep, *read_only)
            if os.path.lexists(path)]
    for path in covers:
        mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777" if path in _SHARED_TMP else "mode=0755")
    for path, fd, ro in held:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            if not os.path.exists(path):
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o444))
        mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        if ro:
            mount("none", path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        os.close(fd)


class Sandboxes:
    """Makes and removes the sandboxes of one backend; decides once what this host lets it enforce."""

    def __init__(self, *, mode: str = "auto", uid_range: range = range(200000, 201000),
                 work_dir: str | None = None, hide: Sequence[str] = (), lock_dir: str | None = None) -> None:
        if mode not in ("auto", "off"):
            raise ValueError(f"process isolation must be auto or off, not {mode!r}")
        root = os.geteuid() == 0
        self.isolating = mode == "auto" and root
        self.work_root = Path(work_dir or default_process_work_dir())
        self.uid_range = uid_range
        self._next = secrets.randbelow(len(uid_range))
        self._kill = shutil.which("kill") or "/bin/kill"
        self._unshare, self._setpriv = (shutil.which(t) for t in MPS_ISOLATION_TOOLS)
        self._groups: dict[str, tuple[int, int]] = {}  # UidGroup.key -> (uid, its lease's fd)
        self._pid_slots: dict[str, set[int]] = {}  # UidGroup.key -> the PID slots its live members hold
        self._sh = shutil.which("sh")
        self._group_lock = asyncio.Lock()
        #: members of one uid group get PID ranges of their own (a shell to set ``ns_last_pid`` with, on a
        #: kernel that has it); without them every member's worker reads the same PID in its namespace
        self.member_pid_ranges = self._sh is not None and Path("/proc/sys/kernel/ns_last_pid").exists()
        self.cgroups: Cgroups | None = None
        self.cgroup_note = "not used"
        self.work_root.mkdir(parents=True, exist_ok=True)
        # An isolating invoker's containers enter their own 0700 dirs through the root (0711: traverse, list
        # nothing). A non-isolating invoker sharing the root (the default work dir is per host user) leaves it
        # traversable, or the other invoker's next containers fail to start (chdir: permission denied).
        shared = not self.isolating and (self.work_root.stat().st_mode & 0o777) == 0o711
        os.chmod(self.work_root, 0o711 if self.isolating or shared else 0o700)
        self.lock_dir = self.work_root / "uids"
        if self.isolating:
            self.lock_dir = self._host_lock_dir(lock_dir or UID_LOCK_DIR)
            self.cgroups, self.cgroup_note = Cgroups.probe(f"dilu-{os.getpid()}")
            self.plan = mount_plan([*interpreter_paths(), str(self.work_root)])
            self.hide = tuple(p for p in (os.path.realpath(h) for h in hide) if self._may_hide(p))
            log.info("process containers are isolated", uids=f"{uid_range.start}-{uid_range.stop - 1}",
                     work_dir=str(self.work_root), memory=self.cgroup_note, hidden=sorted(self.plan) + list(self.hide))
            if self.cgroups is None:
                log.warning("process containers: memory limits are NOT enforced", reason=self.cgroup_note)
        else:
            self.plan, self.hide = {}, ()
            log.warning("process containers are NOT isolated: they run as the invoker's user and can read "
                        "what it can read (data dir, Redis config, credentials, other actions' files); memory "
                        "limits are not enforced. Still enforced: a private work dir removed on destroy, the "
                        "runtime secret, killing every descendant on destroy",
                        reason="not running as root" if not root else "--invoker-process-isolation off")

    @property
    def groups_unavailable(self) -> str | None:
        """Why containers cannot share a uid under isolation (None: they can, or isolation is off)."""
        if not self.isolating:
            return None
        missing = [name for name, path in (("unshare", self._unshare), ("setpriv", self._setpriv)) if path is None]
        if missing:
            return (f"process isolation needs util-linux {' and '.join(missing)} to run the MPS clients of a GPU "
                    "as one uid in PID namespaces of their own")
        return None

    def _may_hide(self, path: str) -> bool:
        """A directory can be covered unless that would cover the work dir or what Python needs (one
        already inside a covered directory needs nothing more)."""
        if not os.path.isdir(path) or path == "/":
            return False
        needed = [os.path.realpath(p) for p in (str(self.work_root), *interpreter_paths()) if p]
        if any(n == path or n.startswith(path + "/") for n in needed):
            return False
        return not any(path.startswith(k + "/") for k in self.plan)

    # -- uids ---------------------------------------------------------------------------------------

    def _host_lock_dir(self, wanted: str) -> Path:
        """The uid leases live where every invoker of the host sees them, not in the work dir: two invokers
        with different work dirs would otherwise hand out the same uid, and each would kill the other's
        containers (at start, as leftovers; on destroy, ``kill -1`` as the uid)."""
        path = Path(wanted)
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path, 0o700)
            if path.stat().st_uid != os.geteuid():
                raise OSError(f"{path} is owned by uid {path.stat().st_uid}")
            return path
        except OSError as exc:
            log.warning("process containers: uid leases kept in the work dir; invokers with other work dirs "
                        "may hand out the same uids", lock_dir=wanted, error=str(exc))
            (self.work_root / "uids").mkdir(mode=0o700, exist_ok=True)
            return self.work_root / "uids"

    def _lock_uid(self) -> tuple[int, int]:
        n = len(self.uid_range)
        for i in range(n):
            uid = self.uid_range[(self._next + i) % n]
            fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._next = (self._next + i + 1) % n
            return uid, fd
        raise SandboxError(f"all {n} uids of the process uid range are in use")

    async def _kill_uid(self, uid: int) -> None:
        """SIGKILL every process of ``uid``: ``kill(-1)`` as that uid is atomic against its forks."""
        proc = await asyncio.create_subprocess_exec(
            self._kill, "-9", "-1", user=uid, group=uid, extra_groups=[],
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        await proc.wait()

    # -- make and remove ------------------------------------------------------------------------------

    async def create(self, name: str, memory_mb: int, *, writable: Sequence[str] = (),
                     readable: Sequence[str] = (), group: UidGroup | None = None,
                     preload: Sequence[str] = ()) -> Sandbox:
        """A sandbox for one container; ``group``: it shares that group's uid (an MPS client of a GPU),
        ``preload``: libraries its environment preloads (kept visible in a group member's view)."""
        marker = secrets.token_hex(8)
        if not self.isolating:
            d = self.work_root / f"p{os.getpid()}-{marker}"
            d.mkdir(mode=0o700)
            return Sandbox(name=name, dir=d, marker=marker)
        if group is not None:
            return await self._create_member(name, memory_mb, marker, writable, readable, group, preload)
        uid, fd = self._lock_uid()
        box = Sandbox(name=name, dir=self.work_root / f"u{uid}", marker=marker, uid=uid, gid=uid, _lock_fd=fd)
        try:
            await self._kill_uid(uid)  # whatever an earlier holder (a crashed invoker) left running
            await asyncio.to_thread(self._prepare, box, memory_mb, writable, readable)
        except BaseException:
            self._unlock(box)
            raise
        return box

    def _prepare(self, box: Sandbox, memory_mb: int, writable: Sequence[str], readable: Sequence[str]) -> None:
        assert box.uid is not None
        if box.group is None:  # an own uid: what an earlier holder of it left goes first
            self._sweep_files(box.uid)
            shutil.rmtree(box.dir, ignore_errors=True)
        box.dir.mkdir(mode=0o700)
        os.chown(box.dir, box.uid, box.uid)
        if self.cgroups is not None:
            box.cgroup = self.cgroups.create(box.dir.name, memory_mb * 1024 * 1024)
        extra = mount_plan(readable)
        box.plan = {**self.plan, **{k: tuple(sorted(set(v) | set(self.plan.get(k, ())))) for k, v in extra.items()}}
        box.hide = self.hide
        for path in writable:  # its own stats block: its uid alone may write it
            with contextlib.suppress(OSError):
                os.chown(path, box.uid, box.uid)
                os.chmod(path, 0o600)
        for path in readable:  # its control block: readable, never writable by it
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if st.st_uid == box.uid or st.st_mode & 0o022:
                    os.chown(path, 0, 0)
                    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)

    async def _group_uid(self, group: UidGroup) -> int:
        """The uid of ``group``, leased for as long as this backend runs (its MPS server runs as it)."""
        async with self._group_lock:
            held = self._groups.get(group.key)
            if held is None:
                if self.groups_unavailable:
                    raise SandboxError(self.groups_unavailable)
                uid, fd = self._lock_uid()
                try:
                    await self._kill_uid(uid)  # an earlier holder's leftovers (a crashed invoker's MPS server)
                    await asyncio.to_thread(self._sweep_files, uid)
                except BaseException:
                    os.close(fd)
                    raise
                held = self._groups[group.key] = (uid, fd)
                log.info("process containers share a uid", group=group.key, uid=uid,
                         why="MPS clients of one GPU: an MPS daemon serves one uid; PID and mount namespaces keep "
                             "them apart")
            uid = held[0]
        for d in group.dirs:  # the server (as the uid) writes its pipes and log there; again after a daemon restart
            with contextlib.suppress(OSError):
                os.chown(d, uid, uid)
                os.chmod(d, 0o700)
        return uid

    async def _create_member(self, name: str, memory_mb: int, marker: str, writable: Sequence[str],
                             readable: Sequence[str], group: UidGroup, preload: Sequence[str]) -> Sandbox:
        uid = await self._group_uid(group)
        assert self._unshare is not None and self._setpriv is not None
        box = Sandbox(name=name, dir=self.work_root / f"g{uid}-{marker}", marker=marker, uid=uid, gid=uid,
                      group=group.key)
        # As root, in the new namespace, before the uid drops: where its PIDs start (see the module docstring).
        last_pid: tuple[str, ...] = ()
        if self.member_pid_ranges and self._sh is not None:
            box.pid_slot = self._take_pid_slot(group.key)
            last_pid = (self._sh, "-c", _SET_LAST_PID, str(PID_SLOT_SIZE * (box.pid_slot + 1)))
        box.prefix = (self._unshare, "--pid", "--fork", "--kill-child", "--mount-proc", *last_pid,
                      self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                      "--pdeathsig", "KILL", "--")
        try:
            await asyncio.to_thread(self._prepare_member, box, memory_mb, writable, readable, group, preload)
        except BaseException:
            self._release_pid_slot(box)
            raise
        return box

    def _take_pid_slot(self, group: str) -> int:
        """The lowest PID slot no live member of ``group`` holds (past ``PID_SLOTS`` members, one they share)."""
        held = self._pid_slots.setdefault(group, set())
        free = next((k for k in range(PID_SLOTS) if k not in held), None)
        if free is None:
            free = len(held) % PID_SLOTS
            log.warning("more MPS clients on one GPU than PID ranges: two of them share one", group=group,
                        members=len(held) + 1, ranges=PID_SLOTS)
        held.add(free)
        return free

    def _release_pid_slot(self, box: Sandbox) -> None:
        if box.group is not None and box.pid_slot is not None:
            self._pid_slots.get(box.group, set()).discard(box.pid_slot)
            box.pid_slot = None

    def _prepare_member(self, box: Sandbox, memory_mb: int, writable: Sequence[str], readable: Sequence[str],
                        group: UidGroup, preload: Sequence[str]) -> None:
        assert box.uid is not None
        covers = [p for p in (*_SHARED_TMP, str(self.work_root)) if os.path.isdir(p)]
        covers = [c for c in covers if not any(c != o and c.startswith(o + "/") for o in covers)]
        wanted = [str(box.dir), *interpreter_paths(), *writable, *readable, *preload]
        under = [os.path.realpath(p) if os.path.exists(p) else p for p in wanted]
        box.covers = tuple(covers)
        box.keep = tuple(dict.fromkeys(p for p in under if any(p == c or p.startswith(c + "/") for c in covers)
                                       and p not in covers))
        box.read_only = tuple(os.path.realpath(d) for d in group.dirs if os.path.isdir(d))
        self._prepare(box, memory_mb, writable, readable)

    def set_memory(self, box: Sandbox, memory_mb: int) -> None:
        """A new memory limit for a live container (no-op where memory is not enforced)."""
        if box.cgroup is not None and self.cgroups is not None:
            self.cgroups.set_limit(box.cgroup, memory_mb * 1024 * 1024)

    async def signal(self, box: Sandbox, sig: int) -> None:
        pids = await asyncio.to_thread(box.members, self.cgroups)
        _kill_all(pids, sig)

    async def destroy(self, box: Sandbox) -> bool:
        """Kill every process of the sandbox and remove its files; True when nothing is left."""
        uid = box.uid

        def kill_cgroup() -> None:
            if box.cgroup is not None and self.cgroups is not None:
                self.cgroups.kill(box.cgroup)

        if box.group is not None:
            # Not kill(-1) as the uid: the other members and the MPS server run as it too. The namespace's
            # first process dies with the leader (--kill-child), and the kernel kills the rest of it.
            clean = await self._kill_until_gone(lambda: box.members(self.cgroups), tries=50, first=kill_cgroup)
        elif uid is not None:
            async def kill_uid() -> None:
                kill_cgroup()
                await self._kill_uid(uid)

            clean = await self._kill_until_gone(lambda: box.members(self.cgroups), tries=5, first_async=kill_uid)
        else:
            clean = await self._kill_until_gone(lambda: pids_with_marker(box.marker), tries=5)
        clean = await asyncio.to_thread(self._remove_files, box) and clean
        if clean:
            self._release_pid_slot(box)  # (a member whose processes outlive it keeps its range)
            self._unlock(box)
        else:
            # a process that would not die keeps its uid out of circulation until the invoker restarts
            log.warning("sandbox not fully cleaned; its uid is not reused", container=box.name, uid=box.uid)
        return clean

    @staticmethod
    async def _kill_until_gone(find: Callable[[], list[int]], *, tries: int, first: Callable[[], None] | None = None,
                               first_async: Callable[[], Awaitable[None]] | None = None) -> bool:
        """SIGKILL what ``find`` finds (after ``first`` / ``first_async`` each round) until nothing is left;
        False when something still lives after ``tries`` rounds."""
        for _ in range(tries):
            if first is not None:
                first()
            if first_async is not None:
                await first_async()
            pids = await asyncio.to_thread(find)
            if not pids:
                return True
            _kill_all(pids, signal.SIGKILL)
            await asyncio.sleep(0.02)
        return False

    def _remove_files(self, box: Sandbox) -> bool:
        ok = True
        if box.cgroup is not None and self.cgroups is not None:
            ok = self.cgroups.remove(box.cgroup)
        shutil.rmtree(box.dir, ignore_errors=True)
        if box.uid is not None and box.group is None:  # a member's /tmp, /var/tmp and /dev/shm were its own tmpfs
            self._sweep_files(box.uid)
        return ok and not box.dir.exists()

    @staticmethod
    def _sweep_files(uid: int) -> None:
        for top in _SHARED_TMP:
            with contextlib.suppress(OSError), os.scandir(top) as entries:
                for entry in entries:
                    try:
                        if entry.stat(follow_symlinks=False).st_uid != uid:
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path, ignore_errors=True)
                        else:
                            os.unlink(entry.path)
                    except OSError:
                        continue

    def _unlock(self, box: Sandbox) -> None:
        if box._lock_fd is not None:
            os.close(box._lock_fd)
            box._lock_fd = None

    async def remove_leftovers(self) -> int:
        """Kill what earlier runs left under uids of the range that nobody holds now; remove stale dirs."""
        removed = 0
        if self.isolating:
            found = await asyncio.to_thread(pids_of_uid, self.uid_range)
            for uid in found:
                fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live invoker holds it
                else:
                    await self._kill_uid(uid)
                    await asyncio.to_thread(self._sweep_files, uid)
                    removed += 1
                finally:
                    os.close(fd)
        removed += await asyncio.to_thread(self._remove_stale_dirs)
        return removed

    def _remove_stale_dirs(self) -> int:
        removed = 0
        for entry in list(os.scandir(self.work_root)):
            # u<uid>: a container's own uid; g<uid>-<marker>: a member of a uid group (MPS clients of a GPU)
            uid = entry.name[1:].split("-", 1)[0] if entry.name[:1] == "g" else entry.name[1:]
            if entry.name[:1] in ("u", "g") and uid.isdigit() and self.isolating:
                fd = os.open(self.lock_dir / uid, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed += 1
                except BlockingIOError:
                    pass  # a live invoker holds it
                finally:
                    os.close(fd)
            elif entry.name.startswith("p") and "-" in entry.name:
                pid = entry.name[1:].split("-", 1)[0]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed += 1
        if self.cgroups is not None:  # cgroups of invokers that are gone, beside ours
            for sibling in self.cgroups.root.parent.glob("dilu-*"):
                pid = sibling.name[5:]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    for leaf in sibling.iterdir():
                        if leaf.is_dir():
                            self.cgroups.remove(leaf)
                    with contextlib.suppress(OSError):
                        sibling.rmdir()
        return removed

    def close(self) -> None:
        for _uid, fd in self._groups.values():
            os.close(fd)
        self._groups.clear()
        if self.cgroups is not None:
            with contextlib.suppress(OSError):
                self.cgroups.root.rmdir()
