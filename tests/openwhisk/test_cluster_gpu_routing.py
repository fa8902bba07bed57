"""GPU routing mode (a), "all-dilu": every invoker is a dilu-invoker sharing one Redis with the balancer.

A GPU activation the controller sends to an invoker without GPUs is run on the instance the balancer
placed on another invoker's GPU (forwarded through Redis), and the receiving invoker acks to the
controller itself, so the controller's slot accounting stays right.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ow_cluster.harness import ControllerHarness, check_ack
from ow_cluster.peers import PouchServer, TansuBroker, free_port
from ow_cluster.support import invoker_env, metric_sum, put_action, stop_processes

from dilu_invoker.redis_embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.couchdb]

GPU_ACTION = "import os\ndef main(args):\n    return {'twice': 2 * args.get('n', 0)}\n"


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "dilu_invoker", *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=log.parent)


def _activations_counted(port: int) -> float:
    return metric_sum(port, "openwhisk_action_activations_total")


@pytest.mark.asyncio(loop_scope="module")
async def test_gpu_activation_is_routed_to_the_placed_instance_and_acked_by_the_receiver(
    broker: TansuBroker, pouch: PouchServer, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    inventory = tmp_path / "gpus.json"
    # Invoker 31 (the one the controller talks to) has no GPU; invoker 32 has one.
    inventory.write_text(json.dumps({"invokers": {"32": [{"uuid": "GPU-test-32-0", "memory_mb": 81920}]}}))
    common = {**os.environ, **invoker_env(broker, pouch), "PYTHONPATH": str(ROOT), "DILU_LOG_JSON": "true",
              "DILU_REDIS_URL": redis_server.url, "DILU_GPU_INVENTORY": str(inventory),
              "DILU_INVOKER_BACKEND": "process", "DILU_DATA_DIR": str(tmp_path)}
    ports = {31: free_port(), 32: free_port()}
    procs = {
        "balancer": _spawn(["balancer"], common, tmp_path / "balancer.log"),
        **{n: _spawn(["invoker", "--id", str(n)], {**common, "PORT": str(ports[n])}, tmp_path / f"invoker{n}.log")
           for n in (31, 32)},
    }

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    rev = put_action(pouch, namespace="guest", name="gpu-twice", kind="python:3-gpu", code=GPU_ACTION,
                     annotations=[{"key": "gpu-class", "value": "inference"},
                                  {"key": "gpu-sm-request", "value": 0.2}, {"key": "gpu-sm-limit", "value": 0.5},
                                  {"key": "gpu-memory-mb", "value": 2048}])
    try:
        async with ControllerHarness(broker.bootstrap, invoker=31) as harness:
            for n in (31, 32):  # both up (pings go to one topic that every controller reads)
                await harness.wait_ping(lambda p, n=n: p["name"]["instance"] == n and p["isEnabled"], timeout=90)
            before = await asyncio.to_thread(_activations_counted, ports[32])
            sent = []
            for n in range(3):
                msg = harness.message(path="guest", name="gpu-twice", revision=rev, blocking=True,
                                      content={"n": n})
                await harness.publish(msg)
                sent.append(msg)
            for n, msg in enumerate(sent):
                acks = await harness.wait_completion(msg["activationId"], timeout=90)
                for ack in acks:
                    check_ack(ack, sent_transid=msg["transid"], instance=31)  # acked by the receiver
                results = [a.activation for a in acks if a.activation is not None]
                assert results and results[0]["response"]["result"] == {"twice": 2 * n}, logs()
            # They ran on invoker 32's instance, not in invoker 31's own pool.
            after = await asyncio.to_thread(_activations_counted, ports[32])
            assert after - before == 3, logs()
            assert await asyncio.to_thread(_activations_counted, ports[31]) == 0, logs()
    finally:
        await stop_processes(procs.values())
