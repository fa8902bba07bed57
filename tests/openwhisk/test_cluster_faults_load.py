"""Cluster mode under load while a peer restarts: 200 activations in flight when the CouchDB-API server
(pouchdb-server) or the Kafka-protocol broker (Tansu) goes away and comes back. Every activation is
answered once (result + completion acks), runs once, and has its record in the activations database."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from ow_cluster.doubles import ScriptedRunner
from ow_cluster.harness import ControllerHarness
from ow_cluster.peers import PouchServer, TansuBroker, TcpProxy
from ow_cluster.support import get_activation, put_action, running_front

from dilu_invoker.invoker.manifest import Manifest

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.kafka, pytest.mark.couchdb, pytest.mark.slow]
IN_FLIGHT = 200


async def _answered_and_recorded(harness: ControllerHarness, pouch: PouchServer, runner: ScriptedRunner,
                                 msgs: list[dict[str, object]]) -> float:
    """Waits for every activation's acks and record; returns when the last ack arrived (monotonic)."""
    acks = await asyncio.gather(*(harness.wait_completion(str(m["activationId"]), timeout=120) for m in msgs))
    last = time.monotonic()
    for got in acks:
        assert [a.kind for a in got] == ["result", "completion"]
    missing = {str(m["activationId"]) for m in msgs}
    deadline = time.monotonic() + 60
    while missing and time.monotonic() < deadline:
        missing = {aid for aid in missing if get_activation(pouch, "guest", aid) is None}
        if missing:
            await asyncio.sleep(0.2)
    assert missing == set(), f"{len(missing)} answered activations have no record"
    assert all(runner.runs[str(m["activationId"])] == 1 for m in msgs)
    return last


async def test_couchdb_restart_with_200_in_flight(broker: TansuBroker, pouch: PouchServer,
                                                   ow_manifest: Manifest) -> None:
    runner = ScriptedRunner()
    rev = put_action(pouch, namespace="guest", name="load-couch", code=json.dumps({"sleep": 0.3}))
    async with ControllerHarness(broker.bootstrap, invoker=21) as harness, \
            running_front(broker, pouch, ow_manifest, invoker_id=21, runner=runner):
        warm = harness.message(path="guest", name="load-couch", revision=rev, blocking=True)
        await harness.publish(warm)
        await harness.wait_completion(warm["activationId"], timeout=60)
        msgs = [harness.message(path="guest", name="load-couch", revision=rev, blocking=True)
                for _ in range(IN_FLIGHT)]
        for msg in msgs[: IN_FLIGHT // 2]:
            await harness.publish(msg)
        await asyncio.to_thread(pouch.stop)
        for msg in msgs[IN_FLIGHT // 2 :]:
            await harness.publish(msg)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(pouch.start)
        back = time.monotonic()
        last = await _answered_and_recorded(harness, pouch, runner, msgs)
        print(f"couchdb restart: {IN_FLIGHT} answered and recorded, last ack {last - back:.2f} s after it was back")


async def test_broker_restart_with_200_in_flight(proxied_broker: tuple[TansuBroker, TcpProxy], pouch: PouchServer,
                                                  ow_manifest: Manifest) -> None:
    broker, proxy = proxied_broker
    runner = ScriptedRunner()
    rev = put_action(pouch, namespace="guest", name="load-kafka", code=json.dumps({"sleep": 0.3}))
    async with ControllerHarness(broker.bootstrap, invoker=22) as harness, \
            running_front(broker, pouch, ow_manifest, invoker_id=22, runner=runner):
        msgs = [harness.message(path="guest", name="load-kafka", revision=rev, blocking=True)
                for _ in range(IN_FLIGHT)]
        for msg in msgs:
            await harness.publish(msg)
        # The broker goes away while they run (their acks cannot go out) and comes back with its data.
        await asyncio.to_thread(proxy.cut)
        await asyncio.sleep(2.0)
        await asyncio.to_thread(proxy.restore)
        back = time.monotonic()
        last = await _answered_and_recorded(harness, pouch, runner, msgs)
        print(f"broker restart: {IN_FLIGHT} answered and recorded, last ack {last - back:.2f} s after it was back")
