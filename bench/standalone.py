"""Warm invoke latency and throughput through `dilu-invoker standalone`, beside calling the runtime's /run
directly — the REST + pool layer's cost, measured side by side in one run (issue 2's figures).

    python bench/standalone.py [--requests 2000] [--seconds 5] [--clients 32] [--rounds 3] [--gpu-dry] [--write]

Starts a real standalone server (process backend, embedded Redis) and a bare runtime process, creates a
no-op `python:3` action, and alternates the two arms round by round so machine noise hits both alike.
Besides latency and rate, every phase reports the CPU each process spent per invoke (/proc: the standalone,
its redis-server, the runtime proxies, their action workers, this client) — a figure that a shared machine's
load bends far less than a rate.

``--gpu-dry`` adds a third arm on the GPU path without a GPU: the standalone gets a simulated GPU (an
inventory file; the GPU manager and its policy run), and a `python:3-gpu` action (class inference, request
0.5, limit 1.0) runs on a balancer-placed instance with the CUDA shim preloaded over the fake libcuda of the
tests, each run one kernel launch and a synchronize. Its *overhead* is issue 13's figure: client p50 minus
the action's own run time p50 (what ``bench/gpu_product.py`` reports on the H200).
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
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]

from loadgen import CPU_PARTS, closed_loop, commit, cpu_by_part, cpu_ms_per, machine, percentile, sequential
from ow_support.faults import children

GUEST = "23bc46b1-71f6-4ed5-8c54-816aa4f8c502:123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP"
NOOP = "def main(args):\n    return {}\n"
FAKE_CUDA = ROOT / "cuda_shim" / "build" / "fake" / "libcuda.so.1"
#: the GPU arm's action: one launch through the (fake) driver and a synchronize, timed inside the action
GPU_NOOP = r'''
import ctypes, os, time
_cu = []

def main(args):
    t0 = time.perf_counter()
    if not _cu:
        lib = ctypes.CDLL(args["fake_cuda"], mode=ctypes.RTLD_GLOBAL)
        launch = lib.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        lib.cuInit(0)
        _cu.extend([launch, lib.cuCtxSynchronize])
    launch, sync = _cu
    launch(None, 8, 1, 1, 1, 1, 1, 0, 0x100, None, None)
    sync()
    return {"run_ms": (time.perf_counter() - t0) * 1000}
'''


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
    gpu_flags: list[str] = []
    if args.gpu_dry:
        inventory = Path(data) / "inventory.json"
        inventory.write_text(json.dumps([{"uuid": "GPU-dry-run-0", "name": "dry-run GPU", "memory_mb": 81920}]))
        gpu_flags = ["--gpu-inventory", str(inventory), "--gpu-mps", "off", "--gpu-shm-dir", str(Path(data) / "shm")]
    server = subprocess.Popen([sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir", data,
                               "--api-port", str(api_port), *gpu_flags, *args.server_flag], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runtime = subprocess.Popen([sys.executable, "-m", "dilu_invoker.actions.runtime", "--port", str(run_port)],
                               env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{api_port}/api/v1/namespaces/_/actions/noop"
    run_url = f"http://127.0.0.1:{run_port}"
    user, key = GUEST.split(":")
    auth = aiohttp.BasicAuth(user, key)
    connector = aiohttp.TCPConnector(limit=0)
    arms = ("standalone", "direct", *(("gpu",) if args.gpu_dry else ()))
    results: dict = {name: {"p50": [], "p99": [], "rps": [], "run_p50": [], "cpu_seq": [], "cpu_rps": []}
                     for name in arms}
    run_ms: list[float] = []
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
            if args.gpu_dry:
                gpu_action = {"exec": {"kind": "python:3-gpu", "code": GPU_NOOP},
                              "annotations": [{"key": "gpu-class", "value": "inference"},
                                              {"key": "gpu-sm-request", "value": 0.5},
                                              {"key": "gpu-sm-limit", "value": 1.0},
                                              {"key": "gpu-memory-mb", "value": 1024}]}
                async with session.put(f"{api[:-len('noop')]}gpunoop?overwrite=true", auth=auth,
                                       json=gpu_action) as r:
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

            async def via_gpu() -> None:
                async with session.post(f"{api[:-len('noop')]}gpunoop?blocking=true&result=true", auth=auth,
                                        json={"fake_cuda": str(FAKE_CUDA)}) as r:
                    body = await r.json()
                    if r.status != 200 or "run_ms" not in body:
                        raise RuntimeError(f"GPU invoke answered {r.status}: {body}")
                    run_ms.append(float(body["run_ms"]))

            calls = {"standalone": via_api, "direct": direct, "gpu": via_gpu}

            def cpu_now(name: str) -> dict[str, float]:
                if name == "direct":
                    return cpu_by_part(None, [(runtime.pid, "dilu_invoker.actions.runtime"), *children(runtime.pid)])
                return cpu_by_part(server.pid, children(server.pid))

            for name in arms:  # warm up (cold starts at the clients' concurrency, connection pools)
                await sequential(calls[name], 200)
                await closed_loop(calls[name], args.clients, per_client=3)
            for _ in range(args.rounds):
                for name in arms:
                    call = calls[name]
                    run_ms.clear()
                    before = cpu_now(name)
                    lat = await sequential(call, args.requests)
                    results[name]["cpu_seq"].append(cpu_ms_per(before, cpu_now(name), len(lat)))
                    results[name]["p50"].append(statistics.median(lat))
                    results[name]["p99"].append(percentile(lat, 0.99))
                    if run_ms:
                        results[name]["run_p50"].append(statistics.median(run_ms))
                    before = cpu_now(name)
                    loop = await closed_loop(call, args.clients, seconds=args.seconds)
                    results[name]["cpu_rps"].append(cpu_ms_per(before, cpu_now(name), loop.calls))
                    results[name]["rps"].append(loop.rate)
    finally:
        for proc in (server, runtime):
            proc.terminate()
        for proc in (server, runtime):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    return results


def _cpu_row(name: str, phase: str, readings: list[dict[str, float]]) -> str:
    med = {k: statistics.median(r[k] for r in readings) for k in CPU_PARTS}
    served = sum(v for k, v in med.items() if k != "load generator")
    return (f"| {name} | {phase} | " + " | ".join(f"{med[k]:.3f}" for k in CPU_PARTS)
            + f" | {served:.2f} | {sum(med.values()):.2f} |")


def render(results: dict, args: argparse.Namespace, cmd: str) -> str:
    def med(name: str, key: str) -> float:
        return statistics.median(results[name][key])

    arms = [name for name in ("standalone", "direct", "gpu") if name in results]
    s_p50, d_p50 = med("standalone", "p50"), med("direct", "p50")
    s_p99, d_p99 = med("standalone", "p99"), med("direct", "p99")
    s_rps, d_rps = med("standalone", "rps"), med("direct", "rps")
    added = s_p50 - d_p50
    rows = "\n".join(
        f"| {name} | {', '.join(f'{v:.2f}' for v in results[name]['p50'])} | {med(name, 'p50'):.2f} | "
        f"{med(name, 'p99'):.2f} | {', '.join(f'{v:.0f}' for v in results[name]['rps'])} | {med(name, 'rps'):.0f} |"
        for name in arms)
    cpu_rows = "\n".join(
        row for name in arms for row in (_cpu_row(name, "sequential", results[name]["cpu_seq"]),
                                         _cpu_row(name, f"{args.clients} clients", results[name]["cpu_rps"])))

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    gpu_text = ""
    if "gpu" in results:
        g_p50, g_run = med("gpu", "p50"), med("gpu", "run_p50")
        overhead = g_p50 - g_run
        per_round = ", ".join(f"{p - r:.2f}" for p, r in zip(results["gpu"]["p50"], results["gpu"]["run_p50"],
                                                               strict=True))
        gpu_text = f"""
* **gpu**: `POST …/actions/gpunoop?blocking=true&result=true`, a `python:3-gpu` action (class inference,
  request 0.5, limit 1.0) on a simulated GPU (`--gpu-inventory`, `--gpu-mps off`): the balancer's routing
  to its placed instance, the CUDA shim preloaded over the fake libcuda of the tests, one kernel launch
  and a synchronize per run; the GPU manager's control loop runs beside it (the whole server runs with
  the simulated GPU in this mode, the two other arms included). It shows what the GPU path adds on the
  CPU side — the routing, the placed instance's slot, the shim in the worker — against the CPU no-op in
  the same server; the H200 figure with real kernels is `bench/gpu_product.py`'s.

| GPU arm (`--gpu-dry`) | measured |
| --- | --- |
| client p50 | {g_p50:.2f} ms (p99 {med("gpu", "p99"):.2f} ms) |
| in-action run p50 | {g_run:.3f} ms |
| overhead of the stack (client p50 − in-action p50; issue 13's target ≤ 2 ms on the H200) | {overhead:.2f} ms (per round {per_round}) — {"within" if overhead <= 2 else "above"} 2 ms on this machine |
| beside the CPU no-op | +{g_p50 - s_p50:.2f} ms p50 |
"""

    return f"""# Standalone: warm invoke latency and throughput

Machine: {machine(load=True)}. Commit {commit()}. Command: `{cmd}` ({args.rounds} rounds, arms alternated;
{args.requests} sequential blocking invokes per round for latency, then {args.clients} concurrent clients for
{args.seconds:g} s for throughput). The client runs on the same machine and its CPU counts against every arm alike.

* **standalone**: `POST /api/v1/namespaces/_/actions/noop?blocking=true&result=true` through the REST API,
  Redis (action lookup, activation record stored before the answer), the container pool, the runtime
  client and the log collection, on a warm `python:3` container of the process backend.
* **direct**: `POST /run` straight to a bare runtime process with the same no-op action.
{gpu_text}
| arm | p50 per round (ms) | p50 (median) | p99 (median) | invokes/s per round | invokes/s (median) |
| --- | --- | --- | --- | --- | --- |
{rows}

CPU per invoke (ms, median of the rounds; from /proc: user + system time of each process over the phase,
divided by the invokes it served). *served* is everything but the load generator: what the server side
costs per invoke, whatever else the machine runs.

| arm | phase | {" | ".join(CPU_PARTS)} | served | all |
| --- | --- | {" | ".join("---" for _ in CPU_PARTS)} | --- | --- |
{cpu_rows}

| target (issue 2) | measured | verdict |
| --- | --- | --- |
| warm p50 ≤ 3 ms end to end | {s_p50:.2f} ms (p99 {s_p99:.2f} ms) | {verdict(s_p50 <= 3.0)} |
| ≥ 500 invokes/s with {args.clients} clients | {s_rps:.0f}/s ({s_rps / d_rps:.2f}× the direct arm's {d_rps:.0f}/s) | {verdict(s_rps >= 500)} |
| REST + pool adds ≤ 1.5 ms p50 over direct /run | +{added:.2f} ms ({s_p50:.2f} vs {d_p50:.2f}; ratio {s_p50 / d_p50:.1f}×; p99 {s_p99:.2f} vs {d_p99:.2f}) | {verdict(added <= 1.5)} |

Reading the figures:

* The sequential phase's CPU per invoke includes what the server does per second whatever the load (the
  invoker's heartbeat and reports, the balancer; with `--gpu-dry` the GPU manager's 50 ms control loop)
  divided by the few hundred invokes a second one client makes; under {args.clients} clients that share
  is spread thin, and concurrent invokes share Redis pipelines and loop wakeups.
* Latency on a shared machine is mostly waiting: each invoke crosses five processes (client, standalone,
  redis-server, runtime proxy, worker), and every hop waits for a core when the machine's other work holds
  both. The same code's sequential p50 moves between about 1.5 and 12 ms with the load average on the
  2-core development VM, while its CPU per invoke moves far less; compare arms of one run, not runs.
* The embedded Redis syncs its append-only file before each reply (`--redis-appendfsync always`): one
  sync per stored record in the sequential phase (one per pipeline under load). Since 4bbee45 and
  c29a680 a blocking invoke is answered while its record is written and a warm invoke checks its action's
  revision at most once a second (`--redis-action-recheck-s`), so neither that sync nor any other
  Redis round trip is on the path of a warm invoke; `bench/standalone_ab.py` measures a checkout against
  another side by side (docs/benchmarks/standalone-ab.md).
* Before and after the hot-path changes that followed 741a3b7 (`python bench/standalone.py --requests 1500
  --seconds 4 --rounds 2 --gpu-dry`, run alternately in a checkout of 741a3b7 and of the change, load
  average 3.0–4.9): under 32 clients the served CPU per invoke fell from 4.18 to 2.79 ms (standalone
  2.56 → 1.60, redis-server 0.246 → 0.111, runtime proxies 0.98 → 0.81, action workers 0.40 → 0.28) and
  the GPU arm's from 3.87 to 3.45 ms; sequentially it stayed about 4.5 ms (4.54 → 4.46: one invoke at a
  time has no pipeline to share, and each hop's aiohttp and loop costs remain). Sequential p50 was 8.23
  vs 8.12 ms (standalone) and 9.65 vs 6.74 ms (GPU arm) — the machine's waits, not the code. On a quieter
  machine the page of 741a3b7 measured 1.62 ms p50 for the standalone arm.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-dry", action="store_true",
                        help="add the GPU arm: a simulated GPU, the shim over the fake libcuda (no GPU needed)")
    parser.add_argument("--server-flag", action="append", default=[],
                        help="one more flag for the standalone, repeatable (e.g. --server-flag=--redis-appendfsync "
                             "--server-flag=everysec)")
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
