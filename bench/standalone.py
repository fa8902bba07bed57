"""Warm invoke latency and throughput through `dilu-invoker standalone`, beside calling the runtime's /run
directly — the REST + pool layer's cost, measured side by side in one run (issue 2's figures).

    python bench/standalone.py [--requests 2000] [--seconds 5] [--clients 32] [--rounds 3] [--write]

Starts a real standalone server (process backend, embedded Redis) and a bare runtime process, creates a
no-op `python:3` action, and alternates the two arms round by round so machine noise hits both alike.
With --write, the result goes to docs/benchmarks/standalone.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import closed_loop, machine, percentile, sequential

GUEST = "23bc46b1-71f6-4ed5-8c54-816aa4f8c502:123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP"
NOOP = "def main(args):\n    return {}\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_http(session: aiohttp.ClientSession, url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url) as r:
                await r.read()
                return
        except aiohttp.ClientError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


async def main_async(args: argparse.Namespace) -> dict:
    api_port, run_port = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="dilu-bench-")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DILU_LOG_LEVEL": "warning"}
    server = subprocess.Popen([sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir", data,
                               "--api-port", str(api_port)], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runtime = subprocess.Popen([sys.executable, "-m", "dilu_invoker.actions.runtime", "--port", str(run_port)],
                               env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{api_port}/api/v1/namespaces/_/actions/noop"
    run_url = f"http://127.0.0.1:{run_port}"
    user, key = GUEST.split(":")
    auth = aiohttp.BasicAuth(user, key)
    connector = aiohttp.TCPConnector(limit=0)
    results: dict = {"standalone": {"p50": [], "p99": [], "rps": []}, "direct": {"p50": [], "p99": [], "rps": []}}
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            await wait_http(session, f"http://127.0.0.1:{api_port}/api/v1")
            async with session.put(f"{api}?overwrite=true", auth=auth,
                                   json={"exec": {"kind": "python:3", "code": NOOP}}) as r:
                assert r.status == 200, await r.text()
            await wait_http(session, f"{run_url}/")
            async with session.post(f"{run_url}/init", json={"value": {"name": "noop", "main": "main",
                                                                       "code": NOOP, "binary": False}}) as r:
                assert r.status == 200, await r.text()
            run_body = json.dumps({"value": {}, "namespace": "guest", "action_name": "/guest/noop",
                                   "action_version": "0.0.1", "activation_id": "0" * 32,
                                   "transaction_id": "bench", "deadline": str(2**41)}).encode()

            async def via_api() -> None:
                async with session.post(f"{api}?blocking=true&result=true", auth=auth, json={}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"invoke answered {r.status}")

            async def direct() -> None:
                async with session.post(f"{run_url}/run", data=run_body,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"/run answered {r.status}")

            for call in (via_api, direct):  # warm up (cold start, connection pools)
                await sequential(call, 200)
            for _ in range(args.rounds):
                for name, call in (("standalone", via_api), ("direct", direct)):
                    lat = await sequential(call, args.requests)
                    results[name]["p50"].append(statistics.median(lat))
                    results[name]["p99"].append(percentile(lat, 0.99))
                    results[name]["rps"].append((await closed_loop(call, args.clients, seconds=args.seconds)).rate)
    finally:
        for proc in (server, runtime):
            proc.terminate()
        for proc in (server, runtime):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    return results


def render(results: dict, args: argparse.Namespace, cmd: str) -> str:
    def med(name: str, key: str) -> float:
        return statistics.median(results[name][key])

    s_p50, d_p50 = med("standalone", "p50"), med("direct", "p50")
    s_p99, d_p99 = med("standalone", "p99"), med("direct", "p99")
    s_rps, d_rps = med("standalone", "rps"), med("direct", "rps")
    added = s_p50 - d_p50
    rows = "\n".join(
        f"| {name} | {', '.join(f'{v:.2f}' for v in results[name]['p50'])} | {med(name, 'p50'):.2f} | "
        f"{med(name, 'p99'):.2f} | {', '.join(f'{v:.0f}' for v in results[name]['rps'])} | {med(name, 'rps'):.0f} |"
        for name in ("standalone", "direct"))

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    return f"""# Standalone: warm invoke latency and throughput

Machine: {machine(load=True)}. Command: `{cmd}` ({args.rounds} rounds, arms alternated; {args.requests} sequential
blocking invokes per round for latency, then {args.clients} concurrent clients for {args.seconds:g} s for
throughput). The client runs on the same machine and its CPU counts against both arms alike.

* **standalone**: `POST /api/v1/namespaces/_/actions/noop?blocking=true&result=true` through the REST API,
  Redis (action lookup, activation record stored before the answer), the container pool, the runtime
  client and the log collection, on a warm `python:3` container of the process backend.
* **direct**: `POST /run` straight to a bare runtime process with the same no-op action.

| arm | p50 per round (ms) | p50 (median) | p99 (median) | invokes/s per round | invokes/s (median) |
| --- | --- | --- | --- | --- | --- |
{rows}

| target (issue 2) | measured | verdict |
| --- | --- | --- |
| warm p50 ≤ 3 ms end to end | {s_p50:.2f} ms (p99 {s_p99:.2f} ms) | {verdict(s_p50 <= 3.0)} |
| ≥ 500 invokes/s with {args.clients} clients | {s_rps:.0f}/s ({s_rps / d_rps:.2f}× the direct arm's {d_rps:.0f}/s) | {verdict(s_rps >= 500)} |
| REST + pool adds ≤ 1.5 ms p50 over direct /run | +{added:.2f} ms ({s_p50:.2f} vs {d_p50:.2f}; ratio {s_p50 / d_p50:.1f}×; p99 {s_p99:.2f} vs {d_p99:.2f}) | {verdict(added <= 1.5)} |
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks/standalone.md")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    cmd = "python bench/standalone.py " + " ".join(sys.argv[1:])
    text = render(results, args, cmd.strip())
    print(text)
    if args.write:
        (ROOT / "docs" / "benchmarks" / "standalone.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
