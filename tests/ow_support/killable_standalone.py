"""``dilu-invoker standalone`` whose last invoker can be killed from outside: fault (d) of issue 16 for
``tests/e2e/test_faults.py`` and ``bench/faults.py``.

    python tests/ow_support/killable_standalone.py --invokers 2 [standalone flags …]

The invokers of ``--invokers N`` share one process, so no signal reaches one alone; this wrapper runs the
real standalone and, on SIGUSR1, kills its last invoker as a crash would: its endpoints stop answering,
its runtime processes get SIGKILL (the activations running there end with their error records), its queue
is dropped (those activations go to the other invokers) and it takes no more work. It logs
``invoker killed`` when done. Everything else is the standalone unchanged (``dilu_invoker.cli.main``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import structlog

from dilu_invoker import standalone
from dilu_invoker.cli import main
from dilu_invoker.config import Config

log = structlog.get_logger("killable_standalone")
_real = standalone.run_standalone


async def kill_invoker(running: standalone.Running, index: int) -> None:
    invoker = running.invokers[index]
    endpoints = running.endpoints[index]
    for site in list(endpoints.sites):
        await site.stop()
    if endpoints.server is not None:  # and its open connections drop, as a dead process's would
        await endpoints.server.shutdown(0)
    # It takes no more work first (a dead process takes none): closing marks its pool closed at once and
    # drops its queue; then its runtime processes die under the activations running there.
    closing = asyncio.ensure_future(invoker.close(drain_s=0))
    await asyncio.sleep(0)
    pids = []
    for proxy in list(invoker.pool.containers.values()):
        pid = getattr(proxy.container, "pid", None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                pids.append(pid)
    await closing
    log.warning("invoker killed", invoker=invoker.name, runtime_pids=pids)


@contextlib.asynccontextmanager
async def _killable(cfg: Config) -> AsyncIterator[standalone.Running]:
    async with _real(cfg) as running:
        tasks: set[asyncio.Task[None]] = set()

        def on_signal() -> None:
            task = asyncio.ensure_future(kill_invoker(running, len(running.invokers) - 1))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, on_signal)
        yield running


if __name__ == "__main__":
    standalone.run_standalone = _killable
    sys.exit(main(["standalone", *sys.argv[1:]]))
