"""A tiny progress bar on stderr for long simulations (no dependency).

On a terminal it redraws one line at most ~5 times a second; otherwise, once a run has taken 2 s, it writes a
plain line at every quarter so logs stay short. It stays silent for the first half second, so quick runs print nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        label: str,
        total: float,
        *,
        unit: str = "",
        enabled: bool = True,
        stream: TextIO | None = None,
        clock: object = time.monotonic,
    ) -> None:
        self._label = label
        self._total = max(float(total), 1e-12)
        self._unit = unit
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._clock = clock
        self._start = self._now()
        self._last_draw = self._start
        self._last_decile = -1
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._drawn = False

    def _now(self) -> float:
        return float(self._clock())  # type: ignore[operator]

    def update(self, done: float, note: str = "") -> None:
        if not self._enabled:
            return
        now = self._now()
        elapsed = now - self._start
        if elapsed < 0.5:
            return
        frac = min(1.0, max(0.0, done / self._total))
        if self._tty:
            if now - self._last_draw < 0.2:
                return
            self._last_draw = now
            width = 28
            filled = int(frac * width)
            eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
            bar = "#" * filled + "-" * (width - filled)
            extra = f" {note}" if note else ""
            self._stream.write(
                f"\r{self._label} [{bar}] {100 * frac:5.1f}% {elapsed:5.1f}s eta {eta:5.1f}s{extra}\x1b[K"
            )
            self._stream.flush()
            self._drawn = True
        elif elapsed >= 2.0:
            decile = int(frac * 4)
            if decile > self._last_decile:
                self._last_decile = decile
                self._stream.write(f"{self._label}: {100 * frac:.0f}% after {elapsed:.1f}s {note}".rstrip() + "\n")
                self._stream.flush()

    def close(self, note: str = "") -> None:
        if not self._enabled:
            return
        elapsed = self._now() - self._start
        if self._tty and self._drawn:
            self._stream.write(f"\r{self._label}: done in {elapsed:.1f}s {note}".rstrip() + "\x1b[K\n")
            self._stream.flush()
        elif not self._tty and self._last_decile >= 0:
            self._stream.write(f"{self._label}: done in {elapsed:.1f}s {note}".rstrip() + "\n")
            self._stream.flush()
