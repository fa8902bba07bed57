"""Faults under a bounded load of concurrent loopback clients, against a real `dilu-invoker standalone`.

    python bench/faults.py [--clients 200] [--seconds 10] [--fault-at 3] [--only baseline,redis,...] [--write]

Scenarios (each on a fresh standalone: process backend, embedded Redis, a warm no-op `python:3` action):

* ``baseline``: no fault;
* ``redis``: SIGKILL of the embedded redis-server (the standalone restarts it);
* ``runtime``: SIGKILL of one warm runtime process;
* ``sigterm``: SIGTERM of the standalone (drain), then a restart on the same data dir to check the records;
* ``invoker``: ``--invokers 2``, the second invoker killed (``tests/ow_support/killable_standalone.py``: its
  endpoints stop answering, its runtime processes get SIGKILL, its queue goes to the other invoker);
* ``cluster``: cluster mode, pouchdb-server and the Tansu broker restarted with 200 activations in flight
  (``tests/openwhisk/test_cluster_faults_load.py``).

For each: requests answered by status (0 = no HTTP answer: refused or reset), served per second, activations
answered 200/202 whose record `GET /activations/{id}` does not return ("answered but unrecorded"), and the
recovery time (fault → last failed answer). With --write the tables go to
docs/benchmarks/faults.md. Loopback only; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from loadgen import closed_loop, commit, cpu_ms_per, machine
from loadgen import cpu_by_part as loadgen_cpu_by_part
from ow_support.faults import AUTH, Run, Standalone, children, find_unrecorded, load, put_action

DOC = ROOT / "docs" / "benchmarks" / "faults.md"
SCENARIOS = ("baseline", "redis", "runtime", "sigterm", "invoker", "cluster")


async def _warm(server: Standalone, clients: int) -> None:
    # Three invokes per client at the load's concurrency: the pool has its containers before measuring.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        url = f"{server.url}/api/v1/namespaces/_/actions/noop?blocking=true"

        async def one() -> None:
            async with s.post(url, json={}, headers=AUTH) as r:
                await r.read()

        await closed_loop(one, clients, per_client=3)


def cpu_by_part(root: int) -> dict[str, float]:
    """CPU seconds used so far by the standalone process and each part of its tree (``loadgen.cpu_by_part``)."""
    return loadgen_cpu_by_part(root, children(root))


async def scenario(name: str, *, clients: int, seconds: float, fault_at: float, workdir: Path) -> dict[str, object]:
    server = Standalone(workdir / name, args=["--invokers", "2"] if name == "invoker" else [],
                        killable=name == "invoker")
    await server.start()
    try:
        await put_action(server.url)
        await _warm(server, clients)
        fault: Callable[[], Awaitable[None]] | None = None
        note = ""
        if name == "redis":
            pid = await server.redis_pid()

            async def fault() -> None:
                os.kill(pid, signal.SIGKILL)
        elif name == "runtime":
            async def fault() -> None:
                nonlocal note
                pids = await server.runtime_pids()
                os.kill(pids[0], signal.SIGKILL)
                note = f"1 of {len(pids)} runtime processes killed"
        elif name == "sigterm":
            async def fault() -> None:
                nonlocal note
                t = time.monotonic()
                code = await server.stop()
                note = f"exit code {code}, drained and stopped in {time.monotonic() - t:.2f} s"
        elif name == "invoker":
            took: list[float] = []

            async def fault() -> None:
                nonlocal note
                t = time.monotonic()
                killed = await server.kill_last_invoker()
                took.append(time.monotonic() - t)
                pids = killed["runtime_pids"]
                note = (f"{killed['invoker']} of 2 killed ({len(pids) if isinstance(pids, list) else '?'} runtime "
                        f"processes) in {time.monotonic() - t:.2f} s")
        probes = ([f"{u}/ping" for u in server.invoker_urls] + [f"{server.url}/"]) if name == "invoker" else []
        assert server.proc is not None
        cpu_before = cpu_by_part(server.proc.pid)
        run: Run = await load(server.url, clients=clients, seconds=seconds,
                              fault_at=fault_at if fault else None, fault=fault, probe=probes)
        cpu_ms: dict[str, float] | None = None
        if name == "baseline" and run.served():
            after = cpu_by_part(server.proc.pid)
            cpu_ms = cpu_ms_per(cpu_before, after, run.served())
        if name == "invoker" and run.fault_at is not None:
            alive, doomed = (f"{u}/ping" for u in server.invoker_urls)
            down_at = run.fault_at + (took[0] if took else 0.0)
            late = [(p, st) for t, p, st in run.probes if t > down_at + 0.2]
            seen = {p: sorted({st for q, st in late if q == p}) for p in (alive, doomed, f"{server.url}/")}
            note += (f"; once it was down /ping of invoker0 answered {seen[alive]}, of invoker1 "
                     f"{seen[doomed]} (0 = no answer), API `GET /` {seen[server.url + '/']}")
        restart_s = None
        if name == "sigterm":
            t = time.monotonic()
            await server.start()
            restart_s = time.monotonic() - t
        unrecorded = await find_unrecorded(server.url, run, timeout_s=60)
        if name == "redis":
            note = f"redis-server pid {pid} killed; restarted as pid {await server.redis_pid()}"
        return {
            "name": name, "statuses": dict(sorted(run.statuses().items())), "served": run.served(),
            "rate": run.rate(), "unrecorded": len(unrecorded),
            # A stopped standalone recovers only when started again: that time is restart_s.
            "recovery_s": None if name == "sigterm" else run.recovery_s(),
            "seconds": run.seconds, "note": note, "restart_s": restart_s, "cpu_ms": cpu_ms,
        }
    finally:
        await server.kill()


def cluster_scenarios() -> list[str]:
    """Cluster mode (e): the pytest module that restarts pouchdb-server and the Tansu broker with 200
    activations in flight (a real invoker front, controller harness on Kafka); its figure lines."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:logging", "-p", "no:cacheprovider",
         "tests/openwhisk/test_cluster_faults_load.py"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    lines = [line.strip() for line in done.stdout.splitlines() if " restart: " in line]
    verdict = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else f"exit {done.returncode}"
    return [*lines, f"pytest: {verdict}"]


def _targets(results: list[dict[str, object]]) -> list[str]:
    """The issue's targets against this run, stated either way."""
    out = []
    for r in results:
        statuses = r["statuses"]
        assert isinstance(statuses, dict)
        allowed = {"baseline": {200, 202, 503}, "redis": {200, 202, 503}, "runtime": {200, 202, 502, 503},
                   "sigterm": {0, 200, 202, 503}, "invoker": {200, 202, 500, 502, 503}}[str(r["name"])]
        outside = sum(n for s, n in statuses.items() if s not in allowed)
        line = (f"* {r['name']}: {outside} answers outside {sorted(allowed)} (target 0), {r['unrecorded']} "
                "answered but unrecorded (target 0)")
        if r["name"] == "baseline":
            rate = float(str(r["rate"]))
            line += f", {rate:.0f} served/s (target ≥ 500: {'met' if rate >= 500 else 'NOT met'})"
            cpu = r.get("cpu_ms")
            if isinstance(cpu, dict):
                total = sum(cpu.values())
                line += (". CPU per served invoke: " + ", ".join(f"{k} {v:.2f} ms" for k, v in cpu.items())
                         + f" — {total:.2f} ms in all, so two idle cores would serve at most about "
                         f"{2000 / total:.0f}/s with the load generator on them")
        if r["name"] == "redis" and r["recovery_s"] is not None:
            rec = float(str(r["recovery_s"]))
            line += f", recovery {rec:.2f} s (target ≤ 5 s: {'met' if rec <= 5 else 'NOT met'})"
        out.append(line)
    return ["Against the targets:", "", *out] if out else []


def render(results: list[dict[str, object]], args: argparse.Namespace, command: str,
           cluster: list[str] | None = None) -> str:
    rows = ["| scenario | requests | by status (0 = no answer) | served/s | answered but unrecorded | "
            "recovery | note |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        statuses = r["statuses"]
        assert isinstance(statuses, dict)
        rec = r["recovery_s"]
        recovery = "–" if rec is None else f"{rec:.2f} s"
        note = str(r["note"])
        if r["restart_s"] is not None:
            note += f"; restart on the same data dir {r['restart_s']:.2f} s"
        rows.append(f"| {r['name']} | {sum(statuses.values())} | "
                    + ", ".join(f"{k}: {v}" for k, v in statuses.items())
                    + f" | {r['rate']:.0f} | {r['unrecorded']} | {recovery} | {note} |")
    return "\n".join([
        "# Faults under load (`bench/faults.py`)",
        "",
        f"Machine: {machine(load=True)} when the report was written. Commit {commit()}. Generated by `{command}`.",
        "",
        f"Load: {args.clients} concurrent loopback clients, each a loop of blocking invokes of a warm no-op "
        f"`python:3` action for {args.seconds:g} s; the fault at {args.fault_at:g} s. One fresh "
        "`dilu-invoker standalone` per scenario (process backend, embedded Redis). The machine may be shared: "
        "compare scenarios of one run with each other rather than across runs.",
        "",
        *rows,
        "",
        *_targets(results),
        "",
        "* *served/s*: answers 200 or 202 per second of the whole load (fault included).",
        "* *answered but unrecorded*: activations answered 200/202 whose record `GET …/activations/{id}` did not "
        "return within 60 s after the load (for `sigterm`: after the restart).",
        "* *recovery*: from the fault to the last failed answer, successes following (0 when no request "
        "failed).",
        "* The runtime scenario's 502s are the activations that ran in the killed process: a developer error "
        "record; the next invoke of that container's slot cold-starts.",
        "* `sigterm`: the standalone stops listening, drains the activations in flight and exits; clients "
        "then get no answer (0; each client retries every 100 ms, so these count attempts) until it is started "
        "again.",
        "* `invoker`: the two invokers of `--invokers 2` share one process, so the fault is injected inside it "
        "(`tests/ow_support/killable_standalone.py`, SIGUSR1): the second invoker's endpoints stop answering, it "
        "takes no more work, its queue goes to the first invoker and its runtime processes get SIGKILL. The "
        "activations running there end with an error record (502 developer error; 500 whisk internal error "
        "when the container went before the activation ran); everything after is served by the first invoker.",
        "",
        "## Cluster mode: the broker and the database restart with 200 activations in flight",
        "",
        "`tests/openwhisk/test_cluster_faults_load.py` (run by this script): an invoker front on Kafka "
        "(Tansu) and CouchDB (pouchdb-server), a controller harness publishing 200 blocking activations of a "
        "0.3 s action; pouchdb-server stopped for 1 s (data kept), or the broker unreachable for 2 s (data kept). "
        "Each activation must get its result and completion acks once, run once and have its record in the "
        "activations database. *last ack* is measured from the peer's return and includes working off the "
        "backlog.",
        "",
        *(f"* {line}" for line in (cluster or ["not run (--only without `cluster`)"])),
        "",
        "## Throughput (the ≥ 500 req/s target)",
        "",
        "The baseline row above is the figure; the CPU line under *Against the targets* says where the time "
        "goes (user + system time of each process from /proc over the loaded phase, divided by the invokes "
        "served: a figure the machine's other work bends far less than a rate). What was cut, found with "
        "py-spy on the standalone, a runtime proxy and its worker under this load:",
        "",
        "* the container pool's queue pass: every release walked all ~190 queued activations (an earlier fix "
        "had made it O(queue), not O(queue × containers)); it now ends once every queued key is stuck, "
        "and the choices read the live containers instead of a frozen snapshot of each per decision "
        "(`ContainerPool._drain_queue`, `pick_warm`; 11% of the standalone's samples before);",
        "* Redis: the action's revision check and the activation record's write — the two commands of every "
        "invoke — go through a group-commit pipeline (`store.Pipeliner`): commands asked for while one "
        "pipeline is in flight leave together in the next, and one action's revision checks in a pipeline "
        "are one `HGET`. Each command still leaves after its caller asked and is answered only after Redis "
        "answered, so the action cache stays exact and a record is in Redis (and in its append-only file, "
        "`appendfsync always`: one sync per pipeline) before its activation is answered;",
        "* structlog's context: the request's transaction id and the activation's ids are bound and reset by "
        "token (`bound_contextvars` and `clear_contextvars` copied the whole context per request); the "
        "invoker's Prometheus children of an action are looked up once;",
        "* the runtime: a free run lock is taken without two racing tasks, worker replies are matched in the "
        "socket protocol's `data_received` instead of a reader task woken per reply, and the worker looks "
        "libc's `fflush` up once (`ctypes.CDLL(None)` per activation cost ~20 µs) and sets only the "
        "`__OW_*` variables that changed.",
        "",
        "A/B on this machine (the same command, `python bench/faults.py --only baseline --seconds 8`, run "
        "alternately in a checkout of 741a3b7 — the code before — and of this one, three times each; load "
        "average 4.3–6.3), CPU per served invoke in ms, median of three (range):",
        "",
        "| part | before | after |",
        "| --- | --- | --- |",
        "| standalone (API, invoker, pool) | 2.91 (2.90–3.27) | 1.73 (1.72–2.13) |",
        "| redis-server | 0.235 (0.235–0.263) | 0.095 (0.090–0.105) |",
        "| runtime proxies | 1.06 (1.04–1.09) | 0.89 (0.85–0.93) |",
        "| action workers | 0.40 (0.39–0.41) | 0.28 (0.27–0.30) |",
        "| load generator | 0.61 (0.61–0.65) | 0.45 (0.43–0.54) |",
        "| all | 5.22 (5.20–5.64) | 3.44 (3.37–4.00) |",
        "| served/s on this loaded machine | 126, 128, 176 | 179, 199, 206 |",
        "",
        "At 3.44 ms in all, two idle cores would serve about 580/s with the load generator on them (2.99 ms "
        "without it: about 670/s); before, about 380/s. An earlier A/B series at load average 5–6 gave the "
        "same picture (all 4.64–5.25 ms before, 3.00–3.48 after; the standalone 2.67–3.02 → 1.46–1.86). "
        "What remains per invoke is mostly aiohttp on both HTTP hops (the client's request and the runtime "
        "call: parsing, the response, the loop's wakeups) and the kernel's loopback sends; the runtime proxy "
        "is an aiohttp server whose floor on this machine is about 0.3 ms a request on its own.",
        "",
        "## Still missing",
        "",
        "* ≥ 500 served/s with 200 clients on 2 cores sits at the edge: with the machine's other work stopped "
        "(load average 1.1–2.3), `python bench/faults.py --only baseline,baseline --seconds 8` served 514 and "
        "531/s (docs/benchmarks/data/faults_baseline_idle.md), and the baseline row above — the first load on "
        "a freshly started standalone, in the full run — 483/s; with the other work on (load 4–6) about "
        "200/s. The load generator shares the two cores (0.3–0.4 ms of the ~3 ms per invoke).",
        "* Fault (d) is in-process: the invokers of one standalone cannot die separately; separate "
        "`dilu-invoker standalone --invokers 1 --id K --redis-url …` processes are the real process "
        "boundary. A container that goes before its activation ran can still end that activation with a "
        "500 record instead of moving it to the other invoker.",
        "",
    ])


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--fault-at", type=float, default=3.0)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {sorted(unknown)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="dilu-faults-") as tmp:
        for name in names:
            if name == "cluster":
                continue
            result = await scenario(name, clients=args.clients, seconds=args.seconds, fault_at=args.fault_at,
                                    workdir=Path(tmp))
            print(result, flush=True)
            results.append(result)
    cluster = cluster_scenarios() if "cluster" in names else None
    command = "python bench/faults.py " + " ".join(sys.argv[1:])
    text = render(results, args, command.strip(), cluster)
    print(text)
    if args.write:
        DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
