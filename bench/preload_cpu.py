"""Pre-loaded against plain cold starts through the invoker's data plane on a machine without a GPU
(process backend, real runtime processes; docs/benchmarks/preload-cpu.md).

    PYTHONPATH=. python3 bench/preload_cpu.py [--starts 8] [--warm 50] [--module numpy] [--write]

Each cold start is a new action (its own container) whose module imports `--module`; with `--preload 1`
the kind's manifest entry pre-loads that module, with 0 it is pre-warming only. Between cold starts the
bench waits until the replacement is ready (what an idle invoker has). Warm runs repeat one action.
Figures are activation durations from the records (init included for a cold start), in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dilu_invoker import config
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.model import GUEST_IDENTITY, Action, ActivationRequest, Exec, new_activation_id

OUT = ROOT / "docs" / "benchmarks" / "preload-cpu.md"


def _cfg(preload: int, module: str) -> config.Config:
    base = config.load(environ={})
    manifest = {"runtimes": {"python": [{"kind": "python:3", "default": True, "preload": [module],
                                         "image": {"name": "dilu-python3-runtime"}}]}}
    inv = replace(base.invoker, preload=preload, runtimes_manifest=json.dumps(manifest), user_memory_mb=8192,
                  idle_timeout_s=600)
    return replace(base, invoker=inv, log=replace(base.log, level="warning"))


def _action(name: str, module: str) -> Action:
    code = f"import {module}\ndef main(args):\n    return {{'n': args.get('n', 0)}}\n"
    return Action(namespace="guest", name=name, exec=Exec(kind="python:3", code=code), revision=f"1-{name}")


def _req(action: Action, n: int = 0) -> ActivationRequest:
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                             content={"n": n})


async def _wait_ready(inv: Invoker) -> None:
    if inv.preload is None:
        await asyncio.sleep(0.5)
        return
    for _ in range(600):
        if any(s.state == "ready" for s in inv.preload.standbys.get("python:3", [])):
            return
        await asyncio.sleep(0.05)


async def measure(preload: int, starts: int, warm: int, module: str) -> dict[str, Any]:
    cold: list[int] = []
    init: list[int] = []
    taken = 0
    async with open_invoker(_cfg(preload, module)) as inv:
        for i in range(starts):
            await _wait_ready(inv)
            t0 = time.perf_counter()
            act = await inv.run(_req(_action(f"cold{preload}x{i}", module)))
            cold.append(int((time.perf_counter() - t0) * 1000))
            init.append(int(act.annotation("initTime") or 0))
            taken += act.annotation("preloaded") is True
            assert act.response.status.api_string == "success", act.response.result
        action = _action(f"warm{preload}", module)
        await inv.run(_req(action))
        warm_ms = []
        for n in range(warm):
            t0 = time.perf_counter()
            await inv.run(_req(action, n))
            warm_ms.append((time.perf_counter() - t0) * 1000)
    return {"preload": preload, "cold_ms": cold, "init_ms": init, "preloaded": taken,
            "warm_p50": statistics.median(warm_ms), "warm_mean": statistics.fmean(warm_ms)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=8)
    ap.add_argument("--warm", type=int, default=50)
    ap.add_argument("--module", default="numpy")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    rows = [asyncio.run(measure(p, args.starts, args.warm, args.module)) for p in (0, 1)]
    lines = ["| --preload | cold starts | pre-loaded | cold p50 ms (min–max) | initTime p50 ms | warm p50 ms | warm mean ms |",
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['preload']} | {len(r['cold_ms'])} | {r['preloaded']} | {statistics.median(r['cold_ms']):.0f} "
                     f"({min(r['cold_ms'])}–{max(r['cold_ms'])}) | {statistics.median(r['init_ms']):.0f} | "
                     f"{r['warm_p50']:.2f} | {r['warm_mean']:.2f} |")
    print("\n".join(lines))
    if args.write:
        cmd = "PYTHONPATH=. python3 bench/preload_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        load = os.getloadavg()
        OUT.write_text("\n".join([
            "# Pre-loaded against plain cold starts on a CPU-only machine",
            "",
            f"Machine: {platform.node()}, {os.cpu_count()} cores shared with other work (load average "
            f"{load[0]:.1f} / {load[1]:.1f} at the end), no GPU, Python {platform.python_version()}, process "
            f"backend with isolation {'on (root)' if os.geteuid() == 0 else 'off'}. Command: `{cmd.strip()}`.",
            "",
            f"Each cold start is a new action whose module imports `{args.module}`; `--preload 1` pre-loads it "
            "(the kind's manifest list), `--preload 0` is pre-warming only. Times are from the client's side of "
            "`Invoker.run` (the data plane, no REST hop); `initTime` is the record's annotation.",
            "",
            *lines,
            "",
            "The GPU figures (torch, CUDA context, ResNet-50 on the H200) are in docs/benchmarks/coldstart.md.",
            "",
        ]))
        print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
