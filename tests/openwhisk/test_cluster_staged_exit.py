"""Cold-start machinery in cluster mode: a cluster invoker (Kafka + CouchDB, the balancer beside it on Redis)
starts a GPU function's instance on a pre-loaded container, and when the balancer scales the function to zero
its last process keeps the function's weights (staged exit), so the next instance maps them instead of
loading them. The invoker core is standalone's; what this adds is the cluster's path to it: activations from
the controller's topic, the action from CouchDB, the balancer a process of its own. Runs on the CPU: the
models API shares through a memfd there, the GPU is simulated."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ow_cluster.harness import ControllerHarness
from ow_cluster.peers import PouchServer, TansuBroker, free_port
from ow_cluster.support import MANIFEST_JSON, invoker_env, metric_sum, put_action, stop_processes

from dilu_invoker.redis_embedded import EmbeddedRedis
from tests.invoker.staged_support import gpu_kind_preloaded

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.couchdb]

CODE = '''
import os
from dilu_invoker.actions import models

INSTANCE = os.urandom(8).hex()


def build():
    import numpy as np
    return {"w": np.arange(1 << 18, dtype=np.float32)}


W = models.load("w", build)


def main(args):
    m = models.info("w")
    return {"instance": INSTANCE, "role": m.role, "check": float(W["w"][123456])}
'''


def _manifest() -> str:
    """The cluster tests' manifest, the GPU kind pre-loaded with nothing but the interpreter and the runtime."""
    return gpu_kind_preloaded(MANIFEST_JSON)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_cluster_invoker_keeps_the_weights_of_a_function_scaled_to_zero(
    broker: TansuBroker, pouch: PouchServer, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    inventory = tmp_path / "gpus.json"
    inventory.write_text(json.dumps({"invokers": {"41": [{"uuid": "GPU-test-41-0", "memory_mb": 16000}]}}))
    port = free_port()
    common = {**os.environ, **invoker_env(broker, pouch), "PYTHONPATH": str(ROOT), "DILU_LOG_JSON": "true",
              "DILU_REDIS_URL": redis_server.url, "DILU_GPU_INVENTORY": str(inventory), "DILU_GPU_MPS": "off",
              "DILU_INVOKER_BACKEND": "process", "DILU_DATA_DIR": str(tmp_path), "RUNTIMES_MANIFEST": _manifest(),
              "DILU_INVOKER_PRELOAD": "1", "DILU_INVOKER_WEIGHTS_GRACE_S": "30",
              "DILU_BALANCER_TICK_S": "0.2", "DILU_BALANCER_REPORT_PERIOD_S": "0.2",
              "DILU_BALANCER_REPORT_TTL_S": "2", "DILU_BALANCER_SCALE_TO_ZERO_AFTER_S": "1",
              "DILU_BALANCER_COOLDOWN_S": "0.2",
              # the first instance must load the weights itself (model pre-loading at PUT is another test's)
              "DILU_BALANCER_MODEL_PRELOAD": "false"}
    logs_of = {"balancer": tmp_path / "balancer.log", "invoker": tmp_path / "invoker41.log"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, argv, env in (("balancer", ["balancer"], common),
                            ("invoker", ["invoker", "--id", "41"], {**common, "PORT": str(port)})):
        with open(logs_of[name], "ab") as out:
            procs[name] = subprocess.Popen([sys.executable, "-m", "dilu_invoker", *argv], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, cwd=tmp_path)

    def logs() -> str:
        return "\n".join(f"--- {n}\n{p.read_text(errors='replace')[-4000:]}" for n, p in logs_of.items())

    async def until(what: str, check: Any, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(check):
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs()}"
            await asyncio.sleep(0.2)

    rev = put_action(pouch, namespace="guest", name="llm", kind="python:3-gpu", code=CODE,
                     annotations=[{"key": "gpu-class", "value": "inference"}, {"key": "gpu-sm-request", "value": 0.1},
                                  {"key": "gpu-sm-limit", "value": 0.2}, {"key": "gpu-memory-mb", "value": 4000},
                                  {"key": "gpu-weights-mb", "value": 3000}])
    try:
        async with ControllerHarness(broker.bootstrap, invoker=41) as harness:
            await harness.wait_ping(lambda p: p["name"]["instance"] == 41 and p["isEnabled"], timeout=90)
            await until("a pre-loaded GPU container", lambda: metric_sum(
                port, "dilu_invoker_preload_containers", kind="python:3-gpu", state="ready") >= 1)

            async def invoke() -> dict[str, Any]:
                msg = harness.message(path="guest", name="llm", revision=rev, blocking=True, content={})
                await harness.publish(msg)
                acks = await harness.wait_completion(msg["activationId"], timeout=90)
                results = [a.activation for a in acks if a.activation is not None]
                assert results, logs()
                return dict(results[0]["response"]["result"])

            first = await invoke()
            assert first["role"] == "holder" and first["check"] == 123456.0, (first, logs())
            assert metric_sum(port, "dilu_invoker_preload_hits_total", kind="python:3-gpu") >= 1, logs()
            # Idle: the balancer scales the function to zero, and its last process stays with the weights.
            await until("the last instance's weights to be kept",
                        lambda: metric_sum(port, "dilu_invoker_weights_kept") == 1.0)
            second = await invoke()
            assert second["instance"] != first["instance"], (second, logs())
            assert second["role"] == "mapped" and second["check"] == 123456.0, (second, logs())
            assert metric_sum(port, "dilu_invoker_weights_kept_events_total", event="reused") == 1.0, logs()
    finally:
        await stop_processes(procs.values())
