"""The front when its peers fail: the broker restarts mid-stream, the database goes away and comes back,
and an earlier incarnation left records behind. Nothing may be lost and nothing may run twice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import ActivationResponse
from dilu_invoker.openwhisk.cluster import ClusterFront
from dilu_invoker.openwhisk.invoker_main import build_front
from dilu_invoker.openwhisk.messages import activation_document, fallback_activation

from .conftest import ACTIVATIONS, get_activation, invoker_config, put_action
from .doubles import ScriptedRunner
from .harness import ControllerHarness, check_ack
from .peers import PouchServer, TansuBroker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.kafka, pytest.mark.couchdb, pytest.mark.slow]


@asynccontextmanager
async def running_front(broker: TansuBroker, pouch: PouchServer, manifest: Manifest, *, invoker_id: int,
                        runner: ScriptedRunner) -> AsyncIterator[ClusterFront]:
    cfg = invoker_config(broker, pouch, invoker_id=invoker_id)
    front = build_front(cfg, runner=runner, manifest=manifest)
    async with front:
        await asyncio.wait_for(front.assigned.wait(), 30)
        yield front


async def wait_until(predicate: object, *, timeout: float = 30.0, what: str = "condition") -> None:
    assert callable(predicate)
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_broker_restart_mid_stream_loses_and_repeats_nothing(
    broker: TansuBroker, pouch: PouchServer, manifest: Manifest
) -> None:
    runner = ScriptedRunner()
    rev = put_action(pouch, namespace="guest", name="through-restart", code=json.dumps({"sleep": 2.0}))
    quick = put_action(pouch, namespace="guest", name="after-restart", code="echo")
    async with ControllerHarness(broker.bootstrap, invoker=11) as harness, \
            running_front(broker, pouch, manifest, invoker_id=11, runner=runner) as front:
        in_flight = harness.message(path="guest", name="through-restart", revision=rev, blocking=True)
        await harness.publish(in_flight)
        await wait_until(lambda: runner.running == 1, what="the activation to start")

        broker.stop()  # Tansu keeps everything in memory: it comes back empty, like a wiped cluster
        await asyncio.sleep(1.0)
        broker.start()
        await harness.ensure_topics()
        restarted = asyncio.get_running_loop().time()

        # The ack of the activation that ran through the outage arrives once the broker is back.
        acks = await harness.wait_completion(in_flight["activationId"], timeout=60)
        assert [a.kind for a in acks] == ["result", "completion"]
        for ack in acks:
            check_ack(ack, sent_transid=in_flight["transid"], instance=11)

        after = [harness.message(path="guest", name="after-restart", revision=quick, blocking=True) for _ in range(3)]
        for msg in after:
            await harness.publish(msg)
        for msg in after:
            assert [a.kind for a in await harness.wait_completion(msg["activationId"], timeout=60)] == \
                ["result", "completion"]
        await harness.wait_ping(lambda p: p["isEnabled"] and p["name"]["instance"] == 11, after=restarted)

        assert runner.runs[in_flight["activationId"]] == 1
        assert all(runner.runs[m["activationId"]] == 1 for m in after)
        assert front.stats.activations == 4


async def test_database_down_then_back(broker: TansuBroker, pouch: PouchServer, manifest: Manifest) -> None:
    runner = ScriptedRunner()
    cached_rev = put_action(pouch, namespace="guest", name="cached", code="echo")
    async with ControllerHarness(broker.bootstrap, invoker=12) as harness, \
            running_front(broker, pouch, manifest, invoker_id=12, runner=runner) as front:
        warm = harness.message(path="guest", name="cached", revision=cached_rev, blocking=True)
        await harness.publish(warm)
        await harness.wait_completion(warm["activationId"])
        await harness.wait_ping(lambda p: p["isEnabled"] and p["name"]["instance"] == 12)
        new_rev = put_action(pouch, namespace="guest", name="uncached", code="echo")

        pouch.stop()
        uncached = harness.message(path="guest", name="uncached", revision=new_rev, blocking=True)
        cached = harness.message(path="guest", name="cached", revision=cached_rev, blocking=True)
        await harness.publish(uncached)
        await harness.publish(cached)

        # A cached action still runs and is acked; the other waits for its document.
        await harness.wait_completion(cached["activationId"])
        await wait_until(lambda: not front.pinging, what="pings to stop")
        paused = asyncio.get_running_loop().time()
        await asyncio.sleep(2.0)
        assert [p for p in harness.pings_since(paused) if p["name"]["instance"] == 12] == []
        assert not harness.acks.get(uncached["activationId"])

        pouch.start()
        acks = await harness.wait_completion(uncached["activationId"], timeout=60)
        assert [a.kind for a in acks] == ["result", "completion"]
        assert acks[0].activation is not None and acks[0].activation["response"]["statusCode"] == 0
        await harness.wait_ping(lambda p: p["isEnabled"] and p["name"]["instance"] == 12, after=paused)
        for msg in (uncached, cached):
            await wait_until(lambda m=msg: get_activation(pouch, "guest", m["activationId"]) is not None,
                             what=f"record of {msg['activationId']}")
        assert runner.runs[uncached["activationId"]] == 1 and runner.runs[cached["activationId"]] == 1


async def test_records_left_by_an_earlier_incarnation_are_not_run_again(
    broker: TansuBroker, pouch: PouchServer, manifest: Manifest
) -> None:
    runner = ScriptedRunner()
    rev = put_action(pouch, namespace="guest", name="redelivered", code="echo")
    async with ControllerHarness(broker.bootstrap, invoker=13) as harness:
        # Both were taken by an invoker that died before committing; it had finished and recorded the first.
        done = harness.message(path="guest", name="redelivered", revision=rev, blocking=True)
        pending = harness.message(path="guest", name="redelivered", revision=rev, blocking=True)
        record = fallback_activation(activation_id=done["activationId"], namespace="guest", subject="guest",
                                     action_path="guest", action_name="redelivered",
                                     response=ActivationResponse.success({"earlier": True}))
        doc = activation_document(record)
        status, _ = await asyncio.to_thread(pouch.json, "PUT", f"/{ACTIVATIONS}/guest%2F{done['activationId']}", doc)
        assert status == 201
        await harness.publish(done)
        last = await harness.publish(pending)

        async with running_front(broker, pouch, manifest, invoker_id=13, runner=runner) as front:
            await harness.wait_completion(pending["activationId"])
            await wait_until(lambda: front.stats.already_recorded == 1, what="the redelivery check")
            for _ in range(100):
                committed = await harness.committed("invoker13")
                if committed == last + 1:
                    break
                await asyncio.sleep(0.05)
            assert committed == last + 1
        assert runner.runs[done["activationId"]] == 0 and runner.runs[pending["activationId"]] == 1
        assert done["activationId"] not in harness.acks
        stored = get_activation(pouch, "guest", done["activationId"])
        assert stored is not None and stored["response"]["result"] == {"earlier": True}
