"""ctypes mirror of ``cuda_shim/include/dilu_shim_abi.h`` and the per-instance shim files.

Each GPU instance has two small files in a directory the invoker owns (for example
``/dev/shm/dilu/<instance>/``):

* ``control``: written only by the GPU manager through :class:`ControlFile`; the
  container mounts it read-only, so a tenant can never raise its own share.
* ``stats``: written only by the shim inside the container; read with
  :class:`StatsFile`.

The header is the source of truth; ``tests/cuda_shim/test_abi.py`` compiles a program
against it and compares every field's name, offset and size with the structures here.

Multi-field updates use the header's seqlock: the writer makes ``epoch`` odd, writes
the fields, and makes it even again. Python issues no memory fences, so the writer
relies on the store ordering of x86-64 (TSO), which is what the GPU nodes run.

This module is stdlib-only on purpose: benchmarks load it by path on machines that
have none of the service's dependencies.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass, fields
from enum import IntFlag
from pathlib import Path
from types import TracebackType
from typing import Self

ABI_MAJOR = 1
ABI_MINOR = 1
ABI_VERSION = (ABI_MAJOR << 16) | ABI_MINOR
CONTROL_MAGIC = 0x4C544344  # bytes "DCTL"
STATS_MAGIC = 0x53545344  # bytes "DSTS"
CONTROL_SIZE = 256
STATS_SIZE = 512
TICK_NS = 1_000_000
WINDOW_TICKS = 5
CYCLE_RING = 16
SPAN_RING = 24
DEFAULT_BURST_MS = 5.0
# The manager ticks every 50-100 ms; ten missed ticks mean it is gone.
DEFAULT_STALE_AFTER_NS = 1_000_000_000

_U64_MAX = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1


class StatsFlag(IntFlag):
    """``DILU_STATS_F_*`` bits of the stats block's ``flags`` word."""

    PASSTHROUGH = 1 << 0
    CONTROL_BAD = 1 << 1
    STALE = 1 << 2
    LIMITED = 1 << 3
    CAPTURE_SEEN = 1 << 4
    TABLE_FULL = 1 << 5
    SHARED = 1 << 6
    NO_DRIVER = 1 << 7


class ControlBlock(ctypes.Structure):
    """``dilu_shim_control_t``."""

    _fields_ = [
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("epoch", ctypes.c_uint64),
        ("rate_blocks_per_ms", ctypes.c_double),
        ("burst_blocks", ctypes.c_uint64),
        ("share", ctypes.c_double),
        ("capacity_blocks_per_ms", ctypes.c_double),
        ("mem_cap_bytes", ctypes.c_uint64),
        ("manager_heartbeat_ns", ctypes.c_uint64),
        ("stale_after_ns", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 22),
    ]


class StatsBlock(ctypes.Structure):
    """``dilu_shim_stats_t``."""

    _fields_ = [
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("seq", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("heartbeat_ns", ctypes.c_uint64),
        ("ticks", ctypes.c_uint64),
        ("control_epoch", ctypes.c_uint64),
        ("control_applied_ns", ctypes.c_uint64),
        ("rate_blocks_per_ms", ctypes.c_double),
        ("burst_blocks", ctypes.c_uint64),
        ("mem_cap_bytes", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("graph_launches", ctypes.c_uint64),
        ("blocks", ctypes.c_uint64),
        ("waits", ctypes.c_uint64),
        ("throttled_ns", ctypes.c_uint64),
        ("inflight_waits", ctypes.c_uint64),
        ("inflight_wait_ns", ctypes.c_uint64),
        ("waiting_threads", ctypes.c_uint64),
        ("tokens", ctypes.c_int64),
        ("mem_used_bytes", ctypes.c_uint64),
        ("mem_peak_bytes", ctypes.c_uint64),
        ("mem_allocs", ctypes.c_uint64),
        ("mem_refused", ctypes.c_uint64),
        ("gpa_lookups", ctypes.c_uint64),
        ("gpa_unmatched", ctypes.c_uint64),
        ("window_ns", ctypes.c_uint64),
        ("windows", ctypes.c_uint64),
        ("window_blocks_last", ctypes.c_uint64),
        ("window_blocks_ema", ctypes.c_double),
        ("cycles", ctypes.c_uint64),
        ("cycle_current_windows", ctypes.c_uint64),
        ("cycle_min_windows", ctypes.c_uint64),
        ("cycle_ring", ctypes.c_uint64 * CYCLE_RING),
        ("spans", ctypes.c_uint64),
        ("span_open_ns", ctypes.c_uint64),
        ("span_ring_us", ctypes.c_uint32 * SPAN_RING),
        ("reserved", ctypes.c_uint64 * 1),
    ]


assert ctypes.sizeof(ControlBlock) == CONTROL_SIZE
assert ctypes.sizeof(StatsBlock) == STATS_SIZE


class ShimAbiError(ValueError):
    """A control or stats file that is not a version-1 block of this ABI."""


class StatsBusyError(RuntimeError):
    """The stats writer never left the block consistent while we read it."""


def _offset(block: type[ctypes.Structure], name: str) -> int:
    return int(getattr(block, name).offset)


# struct formats for the fields the helpers touch (little-endian, as the header says)
_CTL_EPOCH = _offset(ControlBlock, "epoch")
_CTL_HEARTBEAT = _offset(ControlBlock, "manager_heartbeat_ns")
_CTL_QUOTA_FIELDS: tuple[tuple[str, str], ...] = (
    ("rate_blocks_per_ms", "<d"),
    ("burst_blocks", "<Q"),
    ("share", "<d"),
    ("capacity_blocks_per_ms", "<d"),
    ("mem_cap_bytes", "<Q"),
    ("stale_after_ns", "<Q"),
)
_ST_SEQ = _offset(StatsBlock, "seq")


@dataclass(frozen=True, slots=True)
class Quota:
    """What the manager grants one instance.

    ``rate_blocks_per_ms`` is thread blocks per millisecond per device; 0 means
    unlimited. ``burst_blocks`` 0 means ``DEFAULT_BURST_MS`` of rate. ``share`` and
    ``capacity_blocks_per_ms`` only record how the manager got the rate.
    ``mem_cap_bytes`` 0 means no memory cap. ``stale_after_ns`` 0 means the shim never
    treats the manager as gone.
    """

    rate_blocks_per_ms: float = 0.0
    burst_blocks: int = 0
    share: float = 1.0
    capacity_blocks_per_ms: float = 0.0
    mem_cap_bytes: int = 0
    stale_after_ns: int = DEFAULT_STALE_AFTER_NS

    def __post_init__(self) -> None:
        if not math.isfinite(self.rate_blocks_per_ms) or self.rate_blocks_per_ms < 0:
            raise ValueError(
                f"rate_blocks_per_ms must be finite and >= 0 (0 = unlimited), got {self.rate_blocks_per_ms!r}"
            )
        if not 0 <= self.burst_blocks <= _I64_MAX:
            raise ValueError(f"burst_blocks out of range: {self.burst_blocks!r}")
        if not (math.isfinite(self.share) and 0.0 <= self.share <= 1.0):
            raise ValueError(f"share must be within 0..1, got {self.share!r}")
        if (
            not math.isfinite(self.capacity_blocks_per_ms)
            or self.capacity_blocks_per_ms < 0
        ):
            raise ValueError(
                f"capacity_blocks_per_ms must be finite and >= 0, got {self.capacity_blocks_per_ms!r}"
            )
        if not 0 <= self.mem_cap_bytes <= _U64_MAX:
            raise ValueError(f"mem_cap_bytes out of range: {self.mem_cap_bytes!r}")
        if not 0 <= self.stale_after_ns <= _U64_MAX:
            raise ValueError(f"stale_after_ns out of range: {self.stale_after_ns!r}")

    @classmethod
    def from_share(
        cls,
        share: float,
        capacity_blocks_per_ms: float,
        *,
        burst_blocks: int = 0,
        mem_cap_bytes: int = 0,
        stale_after_ns: int = DEFAULT_STALE_AFTER_NS,
    ) -> Quota:
        """rate = share x capacity; a share of 1 or more means unlimited.

        A share of 0 is refused rather than mapped to rate 0, which the shim reads as
        *unlimited*: pausing a tenant takes a small positive share.
        """
        if not math.isfinite(share) or share <= 0:
            raise ValueError(f"share must be finite and > 0, got {share!r}")
        clipped = min(share, 1.0)
        if clipped < 1.0 and not (
            math.isfinite(capacity_blocks_per_ms) and capacity_blocks_per_ms > 0
        ):
            raise ValueError(
                f"a share below 1 needs a capacity > 0, got {capacity_blocks_per_ms!r}"
            )
        rate = 0.0 if clipped >= 1.0 else clipped * capacity_blocks_per_ms
        return cls(
            rate_blocks_per_ms=rate,
            burst_blocks=burst_blocks,
            share=clipped,
            capacity_blocks_per_ms=capacity_blocks_per_ms,
            mem_cap_bytes=mem_cap_bytes,
            stale_after_ns=stale_after_ns,
        )

    @property
    def limited(self) -> bool:
        return self.rate_blocks_per_ms > 0.0


@dataclass(frozen=True, slots=True)
class ControlSnapshot:
    quota: Quota
    epoch: int
    manager_heartbeat_ns: int


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """A consistent copy of the stats block (see the header for each field's meaning)."""

    pid: int
    flags: StatsFlag
    heartbeat_ns: int
    ticks: int
    control_epoch: int
    control_applied_ns: int
    rate_blocks_per_ms: float
    burst_blocks: int
    mem_cap_bytes: int
    launches: int
    graph_launches: int
    blocks: int
    waits: int
    throttled_ns: int
    inflight_waits: int
    inflight_wait_ns: int
    waiting_threads: int
    tokens: int
    mem_used_bytes: int
    mem_peak_bytes: int
    mem_allocs: int
    mem_refused: int
    gpa_lookups: int
    gpa_unmatched: int
    window_ns: int
    windows: int
    window_blocks_last: int
    window_blocks_ema: float
    cycles: int
    cycle_current_windows: int
    cycle_min_windows: int
    recent_cycles: tuple[int, ...]
    """Completed cycle lengths in windows, oldest first (at most ``CYCLE_RING``)."""
    spans: int = 0
    """Completed request spans (ABI 1.1; 0 from a 1.0 shim)."""
    span_open_ns: int = 0
    """CLOCK_MONOTONIC time the span in progress opened; 0: none."""
    recent_spans_us: tuple[int, ...] = ()
    """Completed span lengths in microseconds, oldest first (at most ``SPAN_RING``)."""

    @property
    def published(self) -> bool:
        """False until a shim has published the block at least once.

        ``pid`` alone does not say it: a shim claims the block (sets ``pid``) at init,
        up to one tick before its first publish.
        """
        return self.heartbeat_ns != 0

    @property
    def stale(self) -> bool:
        return StatsFlag.STALE in self.flags

    @property
    def limited(self) -> bool:
        return StatsFlag.LIMITED in self.flags

    def age_ns(self, now_ns: int | None = None) -> int:
        """Time since the shim last published (0 if it never did)."""
        if not self.published:
            return 0
        now = time.monotonic_ns() if now_ns is None else now_ns
        return max(0, now - self.heartbeat_ns)


def _check_header(
    magic: int, version: int, size: int, *, want_magic: int, min_size: int, path: Path
) -> None:
    if magic != want_magic:
        raise ShimAbiError(f"{path}: bad magic {magic:#x} (want {want_magic:#x})")
    if version >> 16 != ABI_MAJOR:
        raise ShimAbiError(
            f"{path}: ABI version {version >> 16}.{version & 0xFFFF}, this code speaks {ABI_MAJOR}.x"
        )
    if size < min_size:
        raise ShimAbiError(f"{path}: block size {size} < {min_size}")


def _write_new_file(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` atomically (write a temporary, then rename over it).

    Only before a container mounts the file: a bind mount pins the inode, so later
    updates must go through the mapping, never by replacing the file.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)  # regardless of the umask
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _map(path: Path, size: int, *, writable: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < size:
            raise ShimAbiError(f"{path}: file is smaller than a {size}-byte block")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


class ControlFile:
    """The manager's handle on one instance's control block (single writer)."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        self._lock = threading.Lock()

    @classmethod
    def create(
        cls, path: Path | str, quota: Quota, *, now_ns: int | None = None
    ) -> ControlFile:
        """Write a fresh control block (mode 0644) and open it for writing."""
        path = Path(path)
        block = ControlBlock()
        block.magic = CONTROL_MAGIC
        block.version = ABI_VERSION
        block.size = CONTROL_SIZE
        block.epoch = 2
        block.rate_blocks_per_ms = quota.rate_blocks_per_ms
        block.burst_blocks = quota.burst_blocks
        block.share = quota.share
        block.capacity_blocks_per_ms = quota.capacity_blocks_per_ms
        block.mem_cap_bytes = quota.mem_cap_bytes
        block.stale_after_ns = quota.stale_after_ns
        block.manager_heartbeat_ns = time.monotonic_ns() if now_ns is None else now_ns
        _write_new_file(path, bytes(block), 0o644)
        return cls.open(path)

    @classmethod
    def open(cls, path: Path | str) -> ControlFile:
        path = Path(path)
        mm = _map(path, CONTROL_SIZE, writable=True)
        try:
            magic, version, size = struct.unpack_from("<III", mm, 0)
            _check_header(
                magic,
                version,
                size,
                want_magic=CONTROL_MAGIC,
                min_size=CONTROL_SIZE,
                path=path,
            )
        except BaseException:
            mm.close()
            raise
        return cls(path, mm)

    def write(self, quota: Quota, *, now_ns: int | None = None) -> int:
        """Publish a new quota and bump the heartbeat; returns the new (even) epoch."""
        with self._lock:
            mm = self._mm
            (epoch,) = struct.unpack_from("<Q", mm, _CTL_EPOCH)
            epoch += epoch & 1  # a writer that died mid-update left it odd
            struct.pack_into("<Q", mm, _CTL_EPOCH, epoch + 1)
            for name, fmt in _CTL_QUOTA_FIELDS:
                struct.pack_into(
                    fmt, mm, _offset(ControlBlock, name), getattr(quota, name)
                )
            hb = time.monotonic_ns() if now_ns is None else now_ns
            struct.pack_into("<Q", mm, _CTL_HEARTBEAT, hb)
            struct.pack_into("<Q", mm, _CTL_EPOCH, epoch + 2)
            return epoch + 2

    def heartbeat(self, *, now_ns: int | None = None) -> None:
        """Say that the manager is alive (one aligned 8-byte store)."""
        with self._lock:
            struct.pack_into(
                "<Q",
                self._mm,
                _CTL_HEARTBEAT,
                time.monotonic_ns() if now_ns is None else now_ns,
            )

    def read(self) -> ControlSnapshot:
        block = ControlBlock.from_buffer_copy(self._mm[:CONTROL_SIZE])
        quota = Quota(
            rate_blocks_per_ms=block.rate_blocks_per_ms,
            burst_blocks=block.burst_blocks,
            share=block.share,
            capacity_blocks_per_ms=block.capacity_blocks_per_ms,
            mem_cap_bytes=block.mem_cap_bytes,
            stale_after_ns=block.stale_after_ns,
        )
        return ControlSnapshot(
            quota=quota,
            epoch=block.epoch,
            manager_heartbeat_ns=block.manager_heartbeat_ns,
        )

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class StatsFile:
    """Read side of one instance's stats block."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm

    @classmethod
    def create(cls, path: Path | str) -> StatsFile:
        """Write an empty stats block. Mode 0666: the container's user may differ from ours."""
        path = Path(path)
        block = StatsBlock()
        block.magic = STATS_MAGIC
        block.version = ABI_VERSION
        block.size = STATS_SIZE
        _write_new_file(path, bytes(block), 0o666)
        return cls.open(path)

    @classmethod
    def open(cls, path: Path | str) -> StatsFile:
        path = Path(path)
        mm = _map(path, STATS_SIZE, writable=False)
        try:
            magic, version, size = struct.unpack_from("<III", mm, 0)
            _check_header(
                magic,
                version,
                size,
                want_magic=STATS_MAGIC,
                min_size=STATS_SIZE,
                path=path,
            )
        except BaseException:
            mm.close()
            raise
        return cls(path, mm)

    def snapshot(self, *, attempts: int = 10_000) -> StatsSnapshot:
        """Copy the block between two equal, even reads of its sequence counter."""
        mm = self._mm
        for i in range(attempts):
            (s1,) = struct.unpack_from("<Q", mm, _ST_SEQ)
            if not s1 & 1:
                raw = mm[:STATS_SIZE]
                (s2,) = struct.unpack_from("<Q", mm, _ST_SEQ)
                if s1 == s2:
                    return _stats_from_block(StatsBlock.from_buffer_copy(raw))
            if i % 64 == 63:
                time.sleep(0)  # the writer may need the CPU we are spinning on
        raise StatsBusyError(
            f"{self.path}: no consistent snapshot after {attempts} attempts"
        )

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_SPAN_FIELDS = ("spans", "span_open_ns", "recent_spans_us")
_SNAPSHOT_SCALARS = tuple(
    f.name
    for f in fields(StatsSnapshot)
    if f.name not in ("flags", "recent_cycles", *_SPAN_FIELDS)
)


def _ring(ring: ctypes.Array[ctypes.c_uint64] | ctypes.Array[ctypes.c_uint32], count: int) -> tuple[int, ...]:
    """The last entries of a ring whose entry n lives at n % len, oldest first."""
    size = len(ring)
    return tuple(int(ring[n % size]) for n in range(count - min(count, size), count))


def _stats_from_block(b: StatsBlock) -> StatsSnapshot:
    values = {name: getattr(b, name) for name in _SNAPSHOT_SCALARS}
    if b.version & 0xFFFF >= 1:
        # A 1.0 shim never writes these words (they were reserved): read them only from 1.1 on.
        spans = int(b.spans)
        values.update(
            spans=spans,
            span_open_ns=int(b.span_open_ns),
            recent_spans_us=_ring(b.span_ring_us, spans),
        )
    return StatsSnapshot(
        flags=StatsFlag(b.flags), recent_cycles=_ring(b.cycle_ring, int(b.cycles)), **values
    )


@dataclass(frozen=True, slots=True)
class InstanceFiles:
    """Where one instance's control and stats blocks live on the host."""

    directory: Path
    control: Path
    stats: Path


def instance_files(root: Path | str, instance: str) -> InstanceFiles:
    """Paths of ``instance``'s blocks under ``root`` (``root/<instance>/{control,stats}``)."""
    if not instance or instance in (".", "..") or "/" in instance or "\0" in instance:
        raise ValueError(f"invalid instance name {instance!r}")
    directory = Path(root) / instance
    return InstanceFiles(
        directory=directory, control=directory / "control", stats=directory / "stats"
    )


def create_instance_files(
    root: Path | str, instance: str, quota: Quota, *, now_ns: int | None = None
) -> tuple[ControlFile, StatsFile]:
    """Create both blocks of a new instance; call before its container starts."""
    files = instance_files(root, instance)
    files.directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    stats = StatsFile.create(files.stats)
    try:
        control = ControlFile.create(files.control, quota, now_ns=now_ns)
    except BaseException:
        stats.close()
        raise
    return control, stats
