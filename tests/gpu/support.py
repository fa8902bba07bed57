"""Helpers of the GPU manager tests: the shim build, tenant processes, stats blocks written as the shim does."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilu_invoker.gpu import abi

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = REPO / "cuda_shim"
TENANT = Path(__file__).resolve().parent / "fake_tenant.py"


@dataclass(frozen=True, slots=True)
class ShimBuild:
    library: Path
    fake_dir: Path

    def env(self, extra: Mapping[str, str]) -> dict[str, str]:
        """A tenant's environment: the fake driver on the loader path, the attachment's variables."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DILU_SHIM_", "LD_PRELOAD", "CUDA_"))}
        env["LD_LIBRARY_PATH"] = str(self.fake_dir)
        env.update(extra)
        return env


class Tenant:
    """A fake_tenant.py child process; commands go to its stdin and are acknowledged."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def send(self, command: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{command}\n".encode())
        await self.proc.stdin.drain()
        answer = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        assert answer.decode().strip() == f"ok {command.split()[0]}", answer

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


async def start_tenant(started: list[Tenant], env: Mapping[str, str], *args: str) -> Tenant:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(TENANT), *args, env=dict(env), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    tenant = Tenant(proc)
    started.append(tenant)
    return tenant


_SEQ = abi.StatsBlock.seq.offset  # type: ignore[attr-defined]


def snapshot(**fields: Any) -> abi.StatsSnapshot:
    """A published StatsSnapshot with every counter 0 unless given."""
    values: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(abi.StatsSnapshot)}
    values.update(pid=100, flags=abi.StatsFlag(0), heartbeat_ns=1, window_ns=5_000_000, window_blocks_ema=0.0,
                  rate_blocks_per_ms=0.0, recent_cycles=(), recent_spans_us=())
    values.update(fields)
    return abi.StatsSnapshot(**values)


class StatsWriter:
    """The single writer of a stats block, under the seqlock (as the shim's refill thread)."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, abi.STATS_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.block = abi.StatsBlock.from_buffer_copy(self._mm[: abi.STATS_SIZE])

    def publish(self, *, cycles: tuple[int, ...] = (), spans_us: tuple[int, ...] = (), **fields: Any) -> None:
        """Set ``fields``, append completed ``cycles`` (lengths in windows) and ``spans_us`` to their rings,
        then publish."""
        b = self.block
        for name, value in fields.items():
            setattr(b, name, value)
        for c in cycles:
            b.cycle_ring[b.cycles % abi.CYCLE_RING] = c
            b.cycles += 1
            b.cycle_min_windows = c if not b.cycle_min_windows else min(b.cycle_min_windows, c)
        for us in spans_us:
            b.span_ring_us[b.spans % abi.SPAN_RING] = us
            b.spans += 1
        if not b.heartbeat_ns:
            b.heartbeat_ns = 1
        if not b.window_ns:
            b.window_ns = 5_000_000
        (seq,) = struct.unpack_from("<Q", self._mm, _SEQ)
        struct.pack_into("<Q", self._mm, _SEQ, seq + 1)
        raw = bytes(b)
        self._mm[_SEQ + 8 : abi.STATS_SIZE] = raw[_SEQ + 8 :]
        self._mm[:_SEQ] = raw[:_SEQ]
        struct.pack_into("<Q", self._mm, _SEQ, seq + 2)

    def close(self) -> None:
        self._mm.close()
