"""With JSON logging on, every line on stderr is JSON: our own, the standard logging module's (asyncio's
child-watcher warnings among them), warnings, and an uncaught exception."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import asyncio, logging, warnings
    import structlog
    from dilu_invoker import logs
    from dilu_invoker.config import LogConfig

    logs.configure(LogConfig(level="info", json=True))
    structlog.get_logger("dilu_invoker.test").info("ours", n=1)
    logging.getLogger("asyncio").warning("Unknown child process pid %d, will report returncode 255", 4242)
    logging.getLogger("aiohttp.server").error("Error handling request", exc_info=ValueError("bad"))
    logging.getLogger("quiet").info("below WARNING: dropped")
    warnings.warn("something is deprecated", DeprecationWarning, stacklevel=1)

    async def main():
        # A real asyncio child process; its exit is reaped by asyncio's own watcher.
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()
    asyncio.run(main())
    raise RuntimeError("the end")
    """
)


def test_every_stderr_line_is_json_when_the_log_is_json() -> None:
    done = subprocess.run([sys.executable, "-W", "always", "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # fails on the first non-JSON line
    by_event = {e["event"]: e for e in events}
    assert by_event["ours"]["n"] == 1 and by_event["ours"]["level"] == "info"
    pid_warning = by_event["Unknown child process pid 4242, will report returncode 255"]
    assert pid_warning["logger"] == "asyncio" and pid_warning["level"] == "warning" and "timestamp" in pid_warning
    assert "ValueError: bad" in by_event["Error handling request"]["exception"]
    assert not any("dropped" in e["event"] for e in events)
    assert any("something is deprecated" in e["event"] and e["logger"] == "py.warnings" for e in events)
    fatal = by_event["uncaught exception"]
    assert fatal["level"] == "critical" and "RuntimeError: the end" in fatal["exception"]
