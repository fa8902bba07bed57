"""The ctypes mirror against the C header, and the control/stats file helpers."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from shim_testlib import SHIM_DIR, ShimBuild

from dilu_invoker.gpu import abi
from dilu_invoker.gpu.shim import process_env

LAYOUT_PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include "dilu_shim_abi.h"

#define CTL(type, name, count) \
    printf("{\"block\": \"control\", \"name\": \"%s\", \"type\": \"%s\", \"count\": %d, \"offset\": %zu, \"size\": %zu}\n", \
           #name, #type, (int)(count), offsetof(dilu_shim_control_t, name), sizeof(((dilu_shim_control_t *)0)->name));
#define ST(type, name, count) \
    printf("{\"block\": \"stats\", \"name\": \"%s\", \"type\": \"%s\", \"count\": %d, \"offset\": %zu, \"size\": %zu}\n", \
           #name, #type, (int)(count), offsetof(dilu_shim_stats_t, name), sizeof(((dilu_shim_stats_t *)0)->name));
#define CONST(name) printf("{\"const\": \"%s\", \"value\": %.17g}\n", #name, (double)(name));

int main(void) {
    DILU_SHIM_CONTROL_FIELDS(CTL)
    DILU_SHIM_STATS_FIELDS(ST)
    printf("{\"block\": \"control\", \"sizeof\": %zu}\n", sizeof(dilu_shim_control_t));
    printf("{\"block\": \"stats\", \"sizeof\": %zu}\n", sizeof(dilu_shim_stats_t));
    CONST(DILU_SHIM_ABI_MAJOR) CONST(DILU_SHIM_ABI_MINOR) CONST(DILU_SHIM_ABI_VERSION)
    CONST(DILU_SHIM_CONTROL_MAGIC) CONST(DILU_SHIM_STATS_MAGIC) CONST(DILU_SHIM_CONTROL_SIZE)
    CONST(DILU_SHIM_STATS_SIZE) CONST(DILU_SHIM_TICK_NS) CONST(DILU_SHIM_WINDOW_TICKS)
    CONST(DILU_SHIM_CYCLE_RING) CONST(DILU_SHIM_SPAN_RING) CONST(DILU_SHIM_DEFAULT_BURST_MS)
    CONST(DILU_STATS_F_PASSTHROUGH) CONST(DILU_STATS_F_CONTROL_BAD) CONST(DILU_STATS_F_STALE)
    CONST(DILU_STATS_F_LIMITED) CONST(DILU_STATS_F_CAPTURE_SEEN) CONST(DILU_STATS_F_TABLE_FULL)
    CONST(DILU_STATS_F_SHARED) CONST(DILU_STATS_F_NO_DRIVER)
    return 0;
}
"""

C_TO_CTYPES = {
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "int64_t": ctypes.c_int64,
    "double": ctypes.c_double,
}

PY_CONSTANTS = {
    "DILU_SHIM_ABI_MAJOR": abi.ABI_MAJOR,
    "DILU_SHIM_ABI_MINOR": abi.ABI_MINOR,
    "DILU_SHIM_ABI_VERSION": abi.ABI_VERSION,
    "DILU_SHIM_CONTROL_MAGIC": abi.CONTROL_MAGIC,
    "DILU_SHIM_STATS_MAGIC": abi.STATS_MAGIC,
    "DILU_SHIM_CONTROL_SIZE": abi.CONTROL_SIZE,
    "DILU_SHIM_STATS_SIZE": abi.STATS_SIZE,
    "DILU_SHIM_TICK_NS": abi.TICK_NS,
    "DILU_SHIM_WINDOW_TICKS": abi.WINDOW_TICKS,
    "DILU_SHIM_CYCLE_RING": abi.CYCLE_RING,
    "DILU_SHIM_SPAN_RING": abi.SPAN_RING,
    "DILU_SHIM_DEFAULT_BURST_MS": abi.DEFAULT_BURST_MS,
    "DILU_STATS_F_PASSTHROUGH": abi.StatsFlag.PASSTHROUGH,
    "DILU_STATS_F_CONTROL_BAD": abi.StatsFlag.CONTROL_BAD,
    "DILU_STATS_F_STALE": abi.StatsFlag.STALE,
    "DILU_STATS_F_LIMITED": abi.StatsFlag.LIMITED,
    "DILU_STATS_F_CAPTURE_SEEN": abi.StatsFlag.CAPTURE_SEEN,
    "DILU_STATS_F_TABLE_FULL": abi.StatsFlag.TABLE_FULL,
    "DILU_STATS_F_SHARED": abi.StatsFlag.SHARED,
    "DILU_STATS_F_NO_DRIVER": abi.StatsFlag.NO_DRIVER,
}


@pytest.fixture(scope="module")
def header_layout(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Compile a program against the header that prints every field's offset and size."""
    d = tmp_path_factory.mktemp("layout")
    src, exe = d / "layout.c", d / "layout"
    src.write_text(LAYOUT_PROGRAM)
    cc = subprocess.run(
        [
            "gcc",
            "-std=c11",
            "-Wall",
            "-Werror",
            "-I",
            str(SHIM_DIR / "include"),
            "-o",
            str(exe),
            str(src),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cc.returncode == 0, cc.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.parametrize(
    ("block", "mirror"), [("control", abi.ControlBlock), ("stats", abi.StatsBlock)]
)
def test_mirror_matches_header(
    header_layout: list[dict[str, object]], block: str, mirror: type[ctypes.Structure]
) -> None:
    rows = [r for r in header_layout if r.get("block") == block and "name" in r]
    (total,) = [
        r["sizeof"] for r in header_layout if r.get("block") == block and "sizeof" in r
    ]
    # The field list covers the struct with no gap: it is the whole layout.
    end = 0
    for r in rows:
        assert r["offset"] == end, f"{block}.{r['name']}: gap or overlap before it"
        end = int(r["offset"]) + int(r["size"])  # type: ignore[call-overload]
    assert end == total == ctypes.sizeof(mirror)

    mirror_fields: list[tuple[str, Any]] = [(f[0], f[1]) for f in mirror._fields_]
    assert [name for name, _ in mirror_fields] == [r["name"] for r in rows]
    for (name, typ), r in zip(mirror_fields, rows, strict=True):
        assert getattr(mirror, name).offset == r["offset"], name
        assert getattr(mirror, name).size == r["size"], name
        want = C_TO_CTYPES[str(r["type"])]
        if r["count"]:
            assert (
                issubclass(typ, ctypes.Array)
                and typ._type_ is want
                and typ._length_ == r["count"]
            ), name
        else:
            assert typ is want, name


def test_constants_match_header(header_layout: list[dict[str, object]]) -> None:
    consts = {str(r["const"]): r["value"] for r in header_layout if "const" in r}
    assert consts == {k: float(v) for k, v in PY_CONSTANTS.items()}


# ---- Quota ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate_blocks_per_ms": -1.0},
        {"rate_blocks_per_ms": float("nan")},
        {"rate_blocks_per_ms": float("inf")},
        {"burst_blocks": -1},
        {"burst_blocks": 1 << 63},
        {"share": 1.5},
        {"share": -0.1},
        {"capacity_blocks_per_ms": -2.0},
        {"mem_cap_bytes": -1},
        {"mem_cap_bytes": 1 << 64},
        {"stale_after_ns": -5},
    ],
    ids=lambda kw: next(iter(kw)) + "=" + repr(next(iter(kw.values()))),
)
def test_quota_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        abi.Quota(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("share", "capacity", "rate", "limited"),
    [
        (0.25, 800.0, 200.0, True),
        (1.0, 800.0, 0.0, False),
        (3.0, 800.0, 0.0, False),
        (1.0, 0.0, 0.0, False),
    ],
    ids=["quarter", "full", "over-one", "full-without-capacity"],
)
def test_quota_from_share(
    share: float, capacity: float, rate: float, limited: bool
) -> None:
    q = abi.Quota.from_share(share, capacity)
    assert q.rate_blocks_per_ms == rate
    assert q.limited is limited
    assert q.share == min(share, 1.0) and q.capacity_blocks_per_ms == capacity


@pytest.mark.parametrize(
    ("share", "capacity"),
    [
        (0.0, 800.0),
        (-0.5, 800.0),
        (float("nan"), 800.0),
        (0.5, 0.0),
        (0.5, float("inf")),
    ],
    ids=[
        "zero-would-mean-unlimited",
        "negative",
        "nan",
        "no-capacity",
        "infinite-capacity",
    ],
)
def test_quota_from_share_refuses(share: float, capacity: float) -> None:
    with pytest.raises(ValueError):
        abi.Quota.from_share(share, capacity)


# ---- control file ----------------------------------------------------------------------------


def test_control_write_is_a_seqlock_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "control"
    quota = abi.Quota(
        rate_blocks_per_ms=123.5,
        burst_blocks=600,
        share=0.3,
        capacity_blocks_per_ms=411.0,
        mem_cap_bytes=1 << 30,
        stale_after_ns=5_000_000,
    )
    with abi.ControlFile.create(path, quota, now_ns=111) as ctl:
        snap = ctl.read()
        assert (
            snap.quota == quota and snap.epoch == 2 and snap.manager_heartbeat_ns == 111
        )
        new = abi.Quota(rate_blocks_per_ms=7.0)
        assert ctl.write(new, now_ns=222) == 4
        snap = ctl.read()
        assert (
            snap.quota == new and snap.epoch == 4 and snap.manager_heartbeat_ns == 222
        )
        ctl.heartbeat(now_ns=333)
        assert ctl.read().manager_heartbeat_ns == 333 and ctl.read().epoch == 4
    raw = path.read_bytes()
    assert len(raw) == abi.CONTROL_SIZE
    assert struct.unpack_from("<III", raw) == (
        abi.CONTROL_MAGIC,
        abi.ABI_VERSION,
        abi.CONTROL_SIZE,
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_control_write_recovers_an_odd_epoch(tmp_path: Path) -> None:
    path = tmp_path / "control"
    abi.ControlFile.create(path, abi.Quota()).close()
    data = bytearray(path.read_bytes())
    struct.pack_into(
        "<Q", data, abi.ControlBlock.epoch.offset, 7
    )  # a writer died mid-update
    path.write_bytes(bytes(data))
    with abi.ControlFile.open(path) as ctl:
        assert ctl.write(abi.Quota()) == 10  # even, and newer than anything seen


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ((0, "<I", 0xDEAD), "bad magic"),
        ((4, "<I", 2 << 16), "ABI version 2"),
        ((8, "<I", 64), "block size"),
    ],
    ids=["magic", "major-version", "size"],
)
def test_control_open_rejects_foreign_blocks(
    tmp_path: Path, patch: tuple[int, str, int], message: str
) -> None:
    path = tmp_path / "control"
    abi.ControlFile.create(path, abi.Quota()).close()
    data = bytearray(path.read_bytes())
    offset, fmt, value = patch
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))
    with pytest.raises(abi.ShimAbiError, match=message):
        abi.ControlFile.open(path)


def test_open_rejects_a_short_file(tmp_path: Path) -> None:
    path = tmp_path / "stats"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(abi.ShimAbiError, match="smaller"):
        abi.StatsFile.open(path)


# ---- stats file ------------------------------------------------------------------------------


def test_fresh_stats_file_is_unpublished(tmp_path: Path) -> None:
    with abi.StatsFile.create(tmp_path / "stats") as st:
        snap = st.snapshot()
    assert (
        not snap.published
        and snap.age_ns() == 0
        and snap.recent_cycles == ()
        and snap.flags == 0
    )
    assert stat.S_IMODE((tmp_path / "stats").stat().st_mode) == 0o666


def _write_stats(
    path: Path,
    *,
    cycle_ring: list[int] | None = None,
    span_ring: list[int] | None = None,
    version: int = abi.ABI_VERSION,
    **values: float,
) -> None:
    block = abi.StatsBlock()
    block.magic, block.version, block.size = (
        abi.STATS_MAGIC,
        version,
        abi.STATS_SIZE,
    )
    for i, v in enumerate(cycle_ring or []):
        block.cycle_ring[i] = v
    for i, v in enumerate(span_ring or []):
        block.span_ring_us[i] = v
    for name, value in values.items():
        setattr(block, name, value)
    path.write_bytes(bytes(block))


def test_recent_cycles_are_oldest_first_after_the_ring_wraps(tmp_path: Path) -> None:
    path = tmp_path / "stats"
    # 20 cycles of lengths 1..20: cycle n (from 0) sits at n % 16, the oldest kept is n = 4
    ring = [0] * abi.CYCLE_RING
    for n in range(20):
        ring[n % abi.CYCLE_RING] = n + 1
    _write_stats(
        path,
        pid=42,
        seq=8,
        cycles=20,
        cycle_ring=ring,
        flags=int(abi.StatsFlag.STALE | abi.StatsFlag.LIMITED),
        heartbeat_ns=1_000,
        tokens=-5,
        window_blocks_ema=2.5,
    )
    with abi.StatsFile.open(path) as st:
        snap = st.snapshot()
    assert snap.recent_cycles == tuple(range(5, 21))
    assert (
        snap.stale
        and snap.limited
        and snap.pid == 42
        and snap.tokens == -5
        and snap.window_blocks_ema == 2.5
    )
    assert snap.age_ns(now_ns=4_000) == 3_000


def test_recent_spans_are_oldest_first_after_the_ring_wraps(tmp_path: Path) -> None:
    path = tmp_path / "stats"
    # 30 spans of 100..129 us: span n sits at n % 24, the oldest kept is n = 6
    ring = [0] * abi.SPAN_RING
    for n in range(30):
        ring[n % abi.SPAN_RING] = 100 + n
    _write_stats(
        path, pid=7, seq=2, heartbeat_ns=5, spans=30, span_open_ns=4, span_ring=ring
    )
    with abi.StatsFile.open(path) as st:
        snap = st.snapshot()
    assert snap.recent_spans_us == tuple(range(106, 130))
    assert (snap.spans, snap.span_open_ns) == (30, 4)


def test_a_minor_0_block_has_no_spans(tmp_path: Path) -> None:
    """A 1.0 shim never writes the span words (reserved then): whatever they hold reads as none."""
    path = tmp_path / "stats"
    _write_stats(
        path,
        version=abi.ABI_MAJOR << 16,
        pid=7,
        seq=2,
        heartbeat_ns=5,
        cycles=1,
        cycle_ring=[3],
        spans=9,
        span_open_ns=4,
        span_ring=[1] * abi.SPAN_RING,
    )
    with abi.StatsFile.open(path) as st:
        snap = st.snapshot()
    assert (snap.spans, snap.span_open_ns, snap.recent_spans_us) == (0, 0, ())
    assert snap.recent_cycles == (3,) and snap.pid == 7


def test_snapshot_gives_up_on_a_writer_that_never_finishes(tmp_path: Path) -> None:
    path = tmp_path / "stats"
    _write_stats(path, pid=1, seq=9)  # odd: mid-publish forever
    with abi.StatsFile.open(path) as st, pytest.raises(abi.StatsBusyError):
        st.snapshot(attempts=200)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "x\0y"])
def test_instance_names_are_checked(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        abi.instance_files(tmp_path, name)


def test_create_instance_files(tmp_path: Path) -> None:
    ctl, st = abi.create_instance_files(
        tmp_path / "shm", "fn-1", abi.Quota(rate_blocks_per_ms=5.0)
    )
    with ctl, st:
        files = abi.instance_files(tmp_path / "shm", "fn-1")
        assert ctl.path == files.control and st.path == files.stats
        assert (
            ctl.read().quota.rate_blocks_per_ms == 5.0 and not st.snapshot().published
        )


# ---- the real shim reading Python-written blocks ----------------------------------------------

T = TypeVar("T")


def _wait(pred: Callable[[], T], timeout: float = 10.0) -> T:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.005)
    return pred()


def test_shim_runs_under_python_written_blocks(
    shim_build: ShimBuild, tmp_path: Path
) -> None:
    ctl, st = abi.create_instance_files(
        tmp_path, "inst", abi.Quota(rate_blocks_per_ms=2000.0, burst_blocks=500)
    )
    with ctl, st:
        env = process_env(
            control_path=ctl.path,
            stats_path=st.path,
            library=shim_build.library,
            base_env=shim_build.env(preload=False),
        )
        out = subprocess.run(
            [str(shim_build.launch_loop), "100", "100"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert (
            report["shim"] and report["launches"] == 100 and report["blocks"] == 10_000
        )
        assert (
            report["waits"] > 0
        )  # 10000 blocks from a 500-block bucket at 2000/ms must wait
        snap = st.snapshot()
    # published once more at exit: the counts are complete
    assert (
        snap.published
        and snap.rate_blocks_per_ms == 2000.0
        # a burst below one tick of refill (2000 blocks) is raised to one tick
        and snap.burst_blocks == 2000
    )
    assert snap.limited and snap.control_epoch == 2
    assert snap.blocks == 10_000 and snap.launches == 100 and snap.waits > 0


def test_quota_written_from_python_reaches_a_running_shim(
    shim_build: ShimBuild, tmp_path: Path
) -> None:
    ctl, st = abi.create_instance_files(
        tmp_path, "inst", abi.Quota(rate_blocks_per_ms=100.0)
    )
    with ctl, st:
        env = process_env(
            control_path=ctl.path,
            stats_path=st.path,
            library=shim_build.library,
            base_env=shim_build.env(preload=False),
        )
        proc = subprocess.Popen(
            [str(shim_build.launch_loop), "1", "1000000", "200"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            first = _wait(lambda: (s := st.snapshot()).published and s)
            assert first and first.pid == proc.pid and first.rate_blocks_per_ms == 100.0
            epoch = ctl.write(
                abi.Quota(rate_blocks_per_ms=7777.0, mem_cap_bytes=1 << 20)
            )
            applied = _wait(lambda: (s := st.snapshot()).control_epoch == epoch and s)
            assert (
                applied
                and applied.rate_blocks_per_ms == 7777.0
                and applied.mem_cap_bytes == 1 << 20
            )
            assert applied.launches > 0 and applied.heartbeat_ns > first.heartbeat_ns
        finally:
            proc.kill()
            proc.wait(timeout=10)


def test_stale_manager_is_reported_and_recovers(
    shim_build: ShimBuild, tmp_path: Path
) -> None:
    ctl, st = abi.create_instance_files(
        tmp_path, "inst", abi.Quota(rate_blocks_per_ms=100.0, stale_after_ns=20_000_000)
    )
    with ctl, st:
        env = process_env(
            control_path=ctl.path,
            stats_path=st.path,
            library=shim_build.library,
            base_env=shim_build.env(preload=False),
        )
        proc = subprocess.Popen(
            [str(shim_build.launch_loop), "1", "1000000", "200"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            assert _wait(lambda: st.snapshot().stale), "never went stale"
            ctl.write(
                abi.Quota(rate_blocks_per_ms=55.0, stale_after_ns=20_000_000)
            )  # bumps the heartbeat
            fresh = _wait(lambda: (s := st.snapshot()).rate_blocks_per_ms == 55.0 and s)
            assert fresh
            assert proc.poll() is None  # still running under the kept quota
        finally:
            proc.kill()
            proc.wait(timeout=10)


def test_abi_module_loads_without_the_package(tmp_path: Path) -> None:
    """Benchmarks import abi.py by path on machines without the service's dependencies."""
    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('abi', {str(Path(abi.__file__))!r});"
        "m = importlib.util.module_from_spec(spec); sys.modules['abi'] = m; spec.loader.exec_module(m);"
        "print(m.STATS_SIZE)"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "512"
