"""Action logs: read a runtime's stdout and stderr continuously and cut them at the sentinel.

Each runtime prints ``XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX`` on both streams after every run (and after
a failed init). A :class:`LogCollector` drains both streams all the time — so a runtime never blocks on a
full pipe, whatever the user prints and whenever — and turns each stream into *segments*, one per
sentinel. An activation takes the next segment of each stream. A segment keeps at most the action's log
limit; beyond that, bytes are counted and dropped while the pump keeps looking for the sentinel, so a
user printing 100 MB costs no memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections import deque
from dataclasses import dataclass, field

SENTINEL = b"XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX"


@dataclass(slots=True)
class Segment:
    #: (wall-clock ns, stream name, text) in arrival order per stream
    lines: list[tuple[int, str, str]] = field(default_factory=list)
    dropped_bytes: int = 0
    #: ended by a sentinel (False: cut at EOF or taken early on a timeout)
    complete: bool = True


class _StreamPump:
    def __init__(self, reader: asyncio.StreamReader, stream: str, limit_bytes: int, chunk: int) -> None:
        self._reader = reader
        self._stream = stream
        self._limit = limit_bytes
        self._chunk = chunk
        self._segments: deque[Segment] = deque()
        self._current = Segment()
        self._kept = 0
        self._partial = bytearray()
        self._partial_dropped = 0
        self._eof = False
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._pump(), name=f"log-pump-{stream}")

    async def _pump(self) -> None:
        try:
            while True:
                data = await self._reader.read(self._chunk)
                if not data:
                    break
                self._feed(data)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            if self._partial or self._current.lines or self._current.dropped_bytes:
                self._end_line()
                self._close_segment(complete=False)
            self._eof = True
            self._changed.set()

    def _feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                self._append_partial(data[start:])
                return
            self._append_partial(data[start:nl])
            self._end_line()
            start = nl + 1

    def _append_partial(self, piece: bytes) -> None:
        room = self._limit - self._kept - len(self._partial)
        if room >= len(piece):
            self._partial += piece
        else:
            keep = max(0, room)
            # Keep enough to recognise a sentinel even when the segment is over its limit.
            if keep < len(SENTINEL) and len(self._partial) < len(SENTINEL):
                keep = min(len(piece), len(SENTINEL) - len(self._partial))
            self._partial += piece[:keep]
            self._partial_dropped += len(piece) - keep

    def _end_line(self) -> None:
        line = bytes(self._partial)
        dropped = self._partial_dropped
        self._partial.clear()
        self._partial_dropped = 0
        if line.rstrip(b"\r") == SENTINEL and not dropped:
            self._close_segment(complete=True)
            return
        if self._kept + len(line) > self._limit:
            self._current.dropped_bytes += len(line) + dropped
            return
        self._kept += len(line) + 1
        self._current.dropped_bytes += dropped
        self._current.lines.append((time.time_ns(), self._stream, line.decode("utf-8", "replace")))

    def _close_segment(self, *, complete: bool) -> None:
        self._current.complete = complete
        self._segments.append(self._current)
        self._current = Segment()
        self._kept = 0
        self._changed.set()

    async def take(self, timeout_s: float) -> Segment:
        deadline = time.monotonic() + timeout_s
        while not self._segments and not self._eof:
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        if self._segments:
            return self._segments.popleft()
        # No sentinel in time (a crashed or hung runtime): hand over what has arrived so far.
        taken = self._current
        taken.complete = False
        self._current = Segment()
        self._kept = 0
        return taken

    def close(self) -> None:
        self.task.cancel()


class LogCollector:
    def __init__(self, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader, *, limit_bytes: int,
                 chunk: int = 65536) -> None:
        self.limit_bytes = limit_bytes
        self._pumps = (_StreamPump(stdout, "stdout", limit_bytes, chunk),
                       _StreamPump(stderr, "stderr", limit_bytes, chunk))

    async def next_segment(self, *, timeout_s: float) -> Segment:
        """The next activation's output from both streams, merged in arrival order."""
        out, err = await asyncio.gather(*(p.take(timeout_s) for p in self._pumps))
        lines = sorted(out.lines + err.lines, key=lambda x: x[0])
        return Segment(lines=lines, dropped_bytes=out.dropped_bytes + err.dropped_bytes,
                       complete=out.complete and err.complete)

    def close(self) -> None:
        for p in self._pumps:
            p.close()


def _timestamp(ns: int) -> str:
    secs, frac = divmod(ns, 1_000_000_000)
    base = dt.datetime.fromtimestamp(secs, tz=dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{frac:09d}Z"


def format_log_lines(segment: Segment, *, limit_bytes: int | None = None,
                     missing_note: str | None = None) -> tuple[str, ...]:
    """OpenWhisk's stored log lines: ``"<time padded to 30> <stream>: <text>"``."""
    out: list[str] = []
    total = 0
    truncated = segment.dropped_bytes > 0
    for ns, stream, text in segment.lines:
        if limit_bytes is not None and total + len(text) > limit_bytes:
            truncated = True
            break
        total += len(text)
        out.append(f"{_timestamp(ns):<30} {stream}: {text}")
    if truncated and limit_bytes is not None:
        out.append(f"{_timestamp(time.time_ns()):<30} stderr: Logs were truncated because the total bytes size "
                   f"exceeds the limit of {limit_bytes} bytes.")
    if missing_note:
        out.append(f"{_timestamp(time.time_ns()):<30} stderr: {missing_note}")
    return tuple(out)
