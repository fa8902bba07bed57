"""Warm invoke latency of two (or more) checkouts of dilu-invoker side by side in one run: a `standalone`
per checkout (process backend, embedded Redis, defaults), one no-op `python:3` action each, and sequential
blocking invokes in batches that alternate between them, so the machine's noise hits every checkout alike.

    python bench/standalone_ab.py --trees /path/to/old,/path/to/new [--batches 20] [--per 100] [--write]

A tree is a checkout (its `dilu_invoker` is imported from there; this script's environment provides the
dependencies). With --write the result goes to docs/benchmarks/standalone-ab.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.standalone import GUEST, NOOP, free_port, wait_http


def rev_of(tree: str) -> str:
    if not (Path(tree) / ".git").exists():  # not a checkout of its own (a copied or archived tree): its directory
        return Path(tree).resolve().name
    out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "?") + ("+changes" if dirty else "")


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


async def run(trees: list[str], batches: int, per: int) -> dict[str, list[float]]:
    user, key = GUEST.split(":")
    auth = aiohttp.BasicAuth(user, key)
    servers: list[tuple[subprocess.Popen[bytes], int]] = []
    for tree in trees:
        port = free_port()
        inherited = os.environ.get("PYTHONPATH")  # where the dependencies may live (the GPU machine's wheels)
        env = {**os.environ, "PYTHONPATH": tree + (os.pathsep + inherited if inherited else ""),
               "DILU_LOG_LEVEL": "warning"}
        proc = subprocess.Popen([sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir",
                                 tempfile.mkdtemp(prefix="dilu-ab-"), "--api-port", str(port)],
                                env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        servers.append((proc, port))
    lat: dict[str, list[float]] = {t: [] for t in trees}
    try:
        async with aiohttp.ClientSession() as s:
            for _, port in servers:
                await wait_http(s, f"http://127.0.0.1:{port}/api/v1", 60)
                api = f"http://127.0.0.1:{port}/api/v1/namespaces/_/actions/noop"
                async with s.put(f"{api}?overwrite=true", auth=auth,
                                 json={"exec": {"kind": "python:3", "code": NOOP}}) as r:
                    assert r.status == 200, await r.text()
                for _ in range(50):  # the cold start and the warm-up
                    async with s.post(f"{api}?blocking=true&result=true", auth=auth, json={}) as r:
                        await r.read()
            order = list(zip(servers, trees, strict=True))
            for b in range(batches):
                for (_, port), tree in (order if b % 2 == 0 else order[::-1]):
                    api = f"http://127.0.0.1:{port}/api/v1/namespaces/_/actions/noop"
                    for _ in range(per):
                        t = time.perf_counter()
                        async with s.post(f"{api}?blocking=true&result=true", auth=auth, json={}) as r:
                            await r.read()
                            if r.status != 200:
                                raise RuntimeError(f"{tree}: invoke answered {r.status}")
                        lat[tree].append((time.perf_counter() - t) * 1000)
    finally:
        for proc, _ in servers:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    return lat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="checkouts, comma-separated (the first is the baseline)")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--per", type=int, default=100, help="sequential invokes per batch")
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks/standalone-ab.md")
    args = parser.parse_args()
    trees = [t for t in args.trees.split(",") if t]
    load_before = os.getloadavg()
    lat = asyncio.run(run(trees, args.batches, args.per))
    load_after = os.getloadavg()
    base = pct(lat[trees[0]], 0.5)
    lines = ["# Standalone warm invokes: checkouts side by side", "",
             f"Machine: {platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}; load "
             f"average (1, 5, 15 min) {', '.join(f'{x:.1f}' for x in load_before)} before, "
             f"{', '.join(f'{x:.1f}' for x in load_after)} after. Command: `python bench/standalone_ab.py "
             f"--trees {','.join(rev_of(t) for t in trees)} --batches {args.batches} --per {args.per}` (trees by "
             "commit). Sequential blocking invokes of a no-op `python:3` action, one `standalone` per checkout "
             "(defaults), batches alternating between them.", "",
             "| checkout | invokes | p25 (ms) | p50 (ms) | p90 (ms) | p99 (ms) | p50 / baseline |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for tree in trees:
        v = lat[tree]
        lines.append(f"| {rev_of(tree)} | {len(v)} | {pct(v, 0.25):.3f} | {pct(v, 0.5):.3f} | {pct(v, 0.9):.3f} | "
                     f"{pct(v, 0.99):.3f} | {pct(v, 0.5) / base:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        (ROOT / "docs" / "benchmarks" / "standalone-ab.md").write_text(text)


if __name__ == "__main__":
    main()
