"""Model pre-loading at PUT in cluster mode: OpenWhisk's controller writes a GPU action that declares
`gpu-weights-mb` to CouchDB (no invoker sees the PUT); the balancer, following the whisks database's
`_changes` feed, picks the invoker its first instance would be placed on and sends it a `preload` command;
that invoker loads the model (one instance's /init, then straight to staged exit: weights kept, compute
released), so the first activation from the controller's topic maps the weights instead of loading them.
A deleted document releases the pre-load; CouchDB going away and coming back neither stops the balancer
nor loses the feed.

Real processes: Tansu (Kafka protocol), pouchdb-server (CouchDB API), redis-server, one balancer and two
invokers (`python -m dilu_invoker …`, process backend, one simulated GPU each). Runs on the CPU: the models API
shares through a memfd there. The processes are started once for the module (about 3 s); each test then
takes a few seconds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from ow_cluster.harness import ControllerHarness
from ow_cluster.peers import PouchServer, TansuBroker, free_port
from ow_cluster.support import MANIFEST_JSON, WHISKS, invoker_env, metric_sum, put_action, stop_processes

from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.redis_embedded import EmbeddedRedis, redis_client

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.couchdb,
              pytest.mark.asyncio(loop_scope="module")]

INVOKERS = (43, 44)


def gpu_of(invoker: int) -> str:
    return f"GPU-test-{invoker}-0"

CODE = '''
import os
from dilu_invoker.actions import models

MARK = "{mark}"


def build():
    import numpy as np
    return {{"w": np.arange(1 << 18, dtype=np.float32)}}


W = models.load("w", build)  # at module level: a pre-load's /init loads it


def main(args):
    m = models.info("w")
    return {{"mark": MARK, "pid": os.getpid(), "role": m.role, "check": float(W["w"][123456])}}
'''
GPU_ANNOTATIONS = [{"key": "gpu-class", "value": "inference"}, {"key": "gpu-sm-request", "value": 0.1},
                   {"key": "gpu-sm-limit", "value": 0.2}, {"key": "gpu-memory-mb", "value": 4000},
                   {"key": "gpu-weights-mb", "value": 3000}]


@dataclass
class Cluster:
    broker: TansuBroker
    pouch: PouchServer
    redis: EmbeddedRedis
    ports: dict[int, int]
    procs: dict[str, subprocess.Popen[bytes]]
    logs_of: dict[str, Path]

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{p.read_text(errors='replace')[-4000:]}" for n, p in self.logs_of.items())

    def events(self, event: str) -> float:
        """Pre-load events of both invokers."""
        return self.metric("dilu_invoker_model_preloads_total", event=event)

    def metric(self, name: str, *, invoker: int | None = None, **labels: str) -> float:
        """A metric of one invoker, or summed over both."""
        ports = [self.ports[invoker]] if invoker is not None else list(self.ports.values())
        return sum(metric_sum(port, name, **labels) for port in ports)

    def balancer_log(self, message: str, *, of: str = "balancer") -> int:
        """How many lines of the balancer's (or the invoker's) log carry ``message`` as their event."""
        n = 0
        for line in self.logs_of[of].read_text(errors="replace").splitlines():
            try:
                if json.loads(line).get("event") == message:
                    n += 1
            except ValueError:
                continue
        return n

    async def until(self, what: str, check: Callable[[], Any], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            got = await asyncio.to_thread(check)
            if got:
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{self.logs()}"
            await asyncio.sleep(0.1)

    async def kept(self, invoker: int | None = None) -> list[tuple[str, int, bool]]:
        """(function, MB, kept) of the reservations on one invoker's GPU, or on both."""
        client = redis_client(self.redis.url)
        out: list[tuple[str, int, bool]] = []
        try:
            for inv in [invoker] if invoker is not None else INVOKERS:
                got = await GpuBudgets(client, "dilu:").get(gpu_of(inv))
                assert got is not None
                out += [(r.function, r.memory_mb, r.kept) for r in got.reservations.values()]
        finally:
            await client.aclose()
        return sorted(out)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(broker: TansuBroker, pouch: PouchServer,
                  tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    tmp = tmp_path_factory.mktemp("preload-cluster")
    redis = EmbeddedRedis(tmp / "redis")
    await redis.start()
    inventory = tmp / "gpus.json"
    inventory.write_text(json.dumps({"invokers": {str(i): [{"uuid": gpu_of(i), "memory_mb": 16000}] for i in INVOKERS}}))
    ports = {i: free_port() for i in INVOKERS}
    common = {**os.environ, **invoker_env(broker, pouch), "PYTHONPATH": str(ROOT), "DILU_LOG_JSON": "true",
              "DILU_REDIS_URL": redis.url, "DILU_GPU_INVENTORY": str(inventory), "DILU_GPU_MPS": "off",
              "DILU_INVOKER_BACKEND": "process", "DILU_DATA_DIR": str(tmp), "RUNTIMES_MANIFEST": json.dumps(MANIFEST_JSON),
              "DILU_INVOKER_PRELOAD": "0", "DILU_INVOKER_WEIGHTS_GRACE_S": "30",
              "DILU_BALANCER_TICK_S": "0.2", "DILU_BALANCER_REPORT_PERIOD_S": "0.2", "DILU_BALANCER_REPORT_TTL_S": "2",
              "DILU_BALANCER_COOLDOWN_S": "0.2"}
    runs = [("balancer", ["balancer"], common)] + [
        (f"invoker{i}", ["invoker", "--id", str(i)], {**common, "PORT": str(ports[i])}) for i in INVOKERS]
    logs_of = {name: tmp / f"{name}.log" for name, _, _ in runs}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, argv, env in runs:
        with open(logs_of[name], "ab") as out:
            procs[name] = subprocess.Popen([sys.executable, "-m", "dilu_invoker", *argv], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, cwd=tmp)
    c = Cluster(broker, pouch, redis, ports, procs, logs_of)
    try:
        await c.until("the balancer's changes feed", lambda: c.balancer_log("couchdb changes feed connected") >= 1)
        for i in INVOKERS:  # its routing joined the balancer's cluster and its pre-loads take commands
            await c.until(f"invoker{i}'s pre-loading", lambda i=i: c.balancer_log("invoker.model_preload",
                                                                                  of=f"invoker{i}") >= 1)
        yield c
    finally:
        await stop_processes(procs.values())
        await redis.stop()


def _put(pouch: PouchServer, name: str, mark: str, *, annotations: list[dict[str, Any]] = GPU_ANNOTATIONS) -> str:
    return put_action(pouch, namespace="guest", name=name, kind="python:3-gpu", code=CODE.format(mark=mark),
                      annotations=annotations)


def _delete(pouch: PouchServer, name: str) -> None:
    quoted = f"guest%2F{name}"
    status, doc = pouch.json("GET", f"/{WHISKS}/{quoted}")
    assert status == 200, doc
    status, body = pouch.json("DELETE", f"/{WHISKS}/{quoted}?rev={doc['_rev']}")
    assert status == 200, body


async def test_an_action_written_to_couchdb_is_pre_loaded_and_its_first_activation_maps_the_weights(
        cluster: Cluster) -> None:
    """The controller sends the first activation to the invoker that does not hold the weights: it is routed
    to the instance the balancer placed beside them, which maps them."""
    c = cluster
    rev = await asyncio.to_thread(_put, c.pouch, "llm", "one")  # a document, then its code: two revisions
    stored = time.monotonic()
    await c.until("the pre-load to start", lambda: c.events("started") == 1.0)
    started = time.monotonic()
    await c.until("the pre-load to be held", lambda: c.metric("dilu_invoker_model_preloads_held") == 1.0)
    held = time.monotonic()
    [holder] = [i for i in INVOKERS if c.metric("dilu_invoker_model_preloads_held", invoker=i) == 1.0]
    [other] = [i for i in INVOKERS if i != holder]
    # Its compute released, its weights alone reserved on the chosen invoker's GPU, marked kept; one load for
    # the two revisions, on the invoker the balancer chose by placing the first instance.
    assert await c.kept(holder) == [("guest/llm", 3000, True)] and await c.kept(other) == [], c.logs()
    assert c.events("started") == 1.0 and c.events("failed") == 0.0, c.logs()
    assert c.metric("dilu_invoker_model_preload_memory_mb") == 3000.0
    assert c.balancer_log("balancer model pre-load") == 1, c.logs()

    async with ControllerHarness(c.broker.bootstrap, invoker=other) as harness:
        await harness.wait_ping(lambda p: p["name"]["instance"] == other and p["isEnabled"], timeout=30)
        msg = harness.message(path="guest", name="llm", revision=rev, blocking=True, content={})
        sent = time.monotonic()
        await harness.publish(msg)
        acks = await harness.wait_completion(msg["activationId"], timeout=30)
        answered = time.monotonic()
    print(f"stored -> pre-load started {started - stored:.2f} s (debounce 0.5 s), -> held {held - stored:.2f} s; "
          f"first activation via invoker{other} to the instance beside invoker{holder}'s weights: "
          f"{(answered - sent) * 1000:.0f} ms")
    [result] = [a.activation["response"]["result"] for a in acks if a.activation is not None]
    # The first instance was placed beside the kept weights and mapped them: it did not load a copy.
    assert result["role"] == "mapped" and result["check"] == 123456.0, (result, c.logs())
    assert c.metric("dilu_invoker_weights_kept_events_total", invoker=holder, event="reused") == 1.0, c.logs()
    assert sorted(m for _, m, _ in await c.kept(holder)) == [1000, 3000]  # one copy of the weights in the budget
    assert await c.kept(other) == []


async def test_a_deleted_action_document_releases_its_pre_load(cluster: Cluster) -> None:
    c = cluster
    ready, released = c.events("ready"), c.events("released")
    await asyncio.to_thread(_put, c.pouch, "gone", "gone")
    await c.until("gone's pre-load", lambda: c.events("ready") == ready + 1)
    assert ("guest/gone", 3000, True) in await c.kept()
    await asyncio.to_thread(_delete, c.pouch, "gone")
    await c.until("gone's release", lambda: c.events("released") == released + 1)

    async def gone() -> bool:
        return all(f != "guest/gone" for f, _, _ in await c.kept())

    deadline = time.monotonic() + 10
    while not await gone():
        assert time.monotonic() < deadline, c.logs()
        await asyncio.sleep(0.1)
    assert c.balancer_log("balancer model pre-load") >= 2


async def test_a_newer_revision_replaces_the_pre_load_and_one_without_weights_releases_it(cluster: Cluster) -> None:
    c = cluster
    ready, released = c.events("ready"), c.events("released")
    await asyncio.to_thread(_put, c.pouch, "upd", "v1")
    await c.until("v1's pre-load", lambda: c.events("ready") == ready + 1)
    await asyncio.to_thread(_put, c.pouch, "upd", "v2")
    await c.until("v2's pre-load", lambda: c.events("ready") == ready + 2)
    assert c.events("released") == released + 1, c.logs()  # v1's
    assert [k for k in await c.kept() if k[0] == "guest/upd"] == [("guest/upd", 3000, True)]
    no_weights = [a for a in GPU_ANNOTATIONS if a["key"] != "gpu-weights-mb"]
    await asyncio.to_thread(_put, c.pouch, "upd", "v3", annotations=no_weights)
    await c.until("the release of a pre-load no longer declared", lambda: c.events("released") == released + 2)


async def test_couchdb_stopped_and_restarted_leaves_the_balancer_running_and_the_feed_resumes(
        cluster: Cluster) -> None:
    c = cluster
    ready = c.events("ready")
    connected = c.balancer_log("couchdb changes feed connected")
    await asyncio.to_thread(c.pouch.stop)
    await c.until("the balancer to see CouchDB gone",
                  lambda: c.balancer_log("couchdb changes feed lost; reconnecting") >= 1, timeout_s=10)
    await asyncio.sleep(1.0)  # a few reconnection attempts against nothing
    assert c.procs["balancer"].poll() is None, c.logs()
    await asyncio.to_thread(c.pouch.start)
    # Written at once, most likely before the feed is back (it backs off): it resumes from its last sequence,
    # not from "now", so the change is not missed either way.
    await asyncio.to_thread(_put, c.pouch, "after", "after")
    await c.until("the feed to reconnect", lambda: c.balancer_log("couchdb changes feed connected") > connected)
    await c.until("the pre-load of an action written after the restart", lambda: c.events("ready") == ready + 1)
    assert all(p.poll() is None for p in c.procs.values()), c.logs()
