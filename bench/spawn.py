"""How long a burst of container starts blocks the invoker's event loop (process backend).

With isolation a runtime process is forked with the sandbox's steps between fork and exec (`Sandbox.preexec`), so the
fork cannot use vfork and the event loop's thread waits until the child execs; without isolation (what this bench
starts) no step runs there and subprocess vforks. The backend forks one runtime at a time
(`ProcessBackend._spawning`), so the loop runs other work between two forks. This bench starts `--burst` containers at
once, `--rounds` times, with that and without it (every fork of the burst in one turn of the loop, as before), side by
side in one run, and reports the loop's longest stall (what every other activation, report and health check on the
invoker waits at worst), the sum of the stalls, and how long the burst took.

    PYTHONPATH=. python3 bench/spawn.py [--burst 8] [--rounds 5] [--json FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dilu_invoker.config import LogConfig
from dilu_invoker.invoker.dataplane.backends.base import ContainerSpec
from dilu_invoker.invoker.dataplane.backends.process import ProcessBackend
from dilu_invoker.logs import configure

MODES = ("one fork at a time", "all forks in one turn")


async def _burst(backend: ProcessBackend, burst: int, tag: str) -> dict[str, float]:
    stalls: list[float] = []
    done = False

    async def watch() -> None:  # what a coroutine waiting 1 ms at a time sees
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls.append(max(0.0, time.perf_counter() - t - 0.001))

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.01)
    stalls.clear()
    t0 = time.perf_counter()
    containers = await asyncio.gather(*(
        backend.start(ContainerSpec(name=f"{tag}-{i}", kind="python:3", image="", memory_mb=256)) for i in range(burst)))
    took = time.perf_counter() - t0
    done = True
    await watcher
    await asyncio.gather(*(c.destroy() for c in containers))
    return {"max_stall_ms": round(1e3 * max(stalls, default=0.0), 1), "sum_stall_ms": round(1e3 * sum(stalls), 1),
            "burst_s": round(took, 3)}


async def run(burst: int, rounds: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        backend = ProcessBackend(isolation="off", work_dir=str(Path(tmp) / "w"))
        serial = backend._spawning
        try:
            await _burst(backend, 2, "warm")
            for k in range(rounds):
                for mode in (MODES if k % 2 == 0 else MODES[::-1]):  # alternate which goes first
                    backend._spawning = serial if mode == MODES[0] else contextlib.nullcontext()  # type: ignore[assignment]
                    rows.append({"round": k + 1, "mode": mode, **await _burst(backend, burst, f"r{k}")})
        finally:
            backend._spawning = serial
            await backend.close()
    return {"machine": f"{platform.node()}: {os.cpu_count()} CPU(s), {platform.processor() or platform.machine()}, "
                       f"Python {platform.python_version()}",
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "burst": burst, "rounds": rounds, "rows": rows,
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def render(raw: dict[str, Any], command: str) -> str:
    lines = [
        "# A burst of container starts and the invoker's event loop",
        "",
        f"* machine: {raw['machine']} (load average before: {raw['load']})",
        f"* date: {raw['date']}",
        f"* command: `{command}`",
        "",
        f"{raw['burst']} process containers (isolation off) started at once, {raw['rounds']} rounds, both modes in each",
        "round (bench/spawn.py's doc). The longest stall is what every other coroutine of the invoker waits at worst",
        "during the burst (a coroutine sleeping 1 ms at a time measures it).",
        "",
        "| mode | longest stall ms, median / worst | stalls in all ms, median | burst s, median |",
        "| --- | --- | --- | --- |",
    ]
    for mode in MODES:
        rs = [r for r in raw["rows"] if r["mode"] == mode]
        lines.append(f"| {mode} | {statistics.median(r['max_stall_ms'] for r in rs):g} / "
                     f"{max(r['max_stall_ms'] for r in rs):g} | {statistics.median(r['sum_stall_ms'] for r in rs):g} | "
                     f"{statistics.median(r['burst_s'] for r in rs):g} |")
    lines += ["", "Every round:", "", "| round | mode | longest stall ms | stalls in all ms | burst s |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['round']} | {r['mode']} | {r['max_stall_ms']} | {r['sum_stall_ms']} | {r['burst_s']} |"
              for r in raw["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configure(LogConfig(level="warning"))
    raw = asyncio.run(run(args.burst, args.rounds))
    command = "PYTHONPATH=. python3 bench/spawn.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(raw, command.strip())
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1) + "\n")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
