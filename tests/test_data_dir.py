"""The standalone's data directory: one standalone at a time (an exclusive lock naming its holder), and
everything in it private to its user (dirs 0700, files 0600)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dilu_invoker.redis_embedded import EmbeddedRedis
from dilu_invoker.standalone import DataDirInUse, lock_data_dir, secure_data_dir


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with lock_data_dir(data):
        assert (data / "standalone.lock").read_text().strip() == str(os.getpid())
        with pytest.raises(DataDirInUse, match=rf"in use by another dilu-invoker standalone \(pid {os.getpid()}\)"):
            with lock_data_dir(data):
                pass
    with lock_data_dir(data):  # released at the end of the block
        pass


def test_a_second_standalone_process_exits_with_one_line_naming_the_holder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with lock_data_dir(data):
        done = subprocess.run(
            [sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir", str(data), "--api-port", "0"],
            capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (f"dilu-invoker standalone: data dir {data} is in use by another dilu-invoker "
                         f"standalone (pid {os.getpid()})")
    assert not any("embedded redis started" in line for line in lines)


def test_loose_modes_left_by_older_versions_are_tightened(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "redis" / "appendonlydir").mkdir(parents=True)
    files = [data / "invoker0-credentials", data / "redis" / "redis.conf",
             data / "redis" / "appendonlydir" / "dilu.aof.1.incr.aof"]
    for f in files:
        f.write_text("secret")
        f.chmod(0o644)
    for d in (data, data / "redis", data / "redis" / "appendonlydir"):
        d.chmod(0o755)
    other = data / "README.txt"
    other.write_text("not ours")
    other.chmod(0o644)
    secure_data_dir(data)
    assert [_mode(d) for d in (data, data / "redis", data / "redis" / "appendonlydir")] == [0o700] * 3
    assert [_mode(f) for f in files] == [0o600] * 3
    assert _mode(other) == 0o644


async def test_embedded_redis_files_are_private(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", persistent=True)
    await server.start()
    try:
        assert server.url
    finally:
        await server.stop()
    assert _mode(tmp_path / "redis") == 0o700
    made = [p for p in (tmp_path / "redis").rglob("*")]
    assert any(p.name.startswith("dilu.aof") for p in made)
    for p in made:
        assert _mode(p) == (0o700 if p.is_dir() else 0o600), p
