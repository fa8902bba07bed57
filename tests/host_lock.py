"""A lock every pytest process of the host shares: ``make test`` runs two side by side
(scripts/run_tests.py), and both may reach for the same one-time set-up (an npm install, the runtime
image build)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def host_lock(name: str) -> Iterator[None]:
    """Held by one process at a time; the others wait. The kernel drops it when its holder dies."""
    fd = os.open(os.path.join(tempfile.gettempdir(), f"dilu-tests-{name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
