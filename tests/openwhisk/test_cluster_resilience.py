"""The front when its peers fail: the broker restarts mid-stream, the database goes away and comes back,
and an earlier incarnation left records behind. Nothing may be lost and nothing may run twice."""

from __future__ import annotations

import asyncio
import json

import pytest
from ow_cluster.doubles import ScriptedRunner
from ow_cluster.harness import ControllerHarness, check_ack
from ow_cluster.peers import PouchServer, TansuBroker, TcpProxy
from ow_cluster.support import ACTIVATIONS, get_activation, put_action, running_front, wait_until

from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import ActivationResponse
from dilu_invoker.openwhisk.messages import activation_document, fallback_activation

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.kafka, pytest.mark.couchdb, pytest.mark.slow]


async def test_broker_outage_mid_stream_loses_and_repeats_nothing(
    proxied_broker: tuple[TansuBroker, TcpProxy], pouch: PouchServer, ow_manifest: Manifest
) -> None:
    """The broker becomes unreachable while an activation runs and comes back with its data (a Kafka
    broker restart): the ack goes out afterwards, later work flows, nothing runs twice."""
    broker, proxy = proxied_broker
    runner = ScriptedRunner()
    rev = put_action(pouch, namespace="guest", name="through-outage", code=json.dumps({"sleep": 2.0}))
    quick = put_action(pouch, namespace="guest", name="after-outage", code="echo")
    async with ControllerHarness(broker.bootstrap, invoker=11) as harness, \
            running_front(broker, pouch, ow_manifest, invoker_id=11, runner=runner) as front:
        in_flight = harness.message(path="guest", name="through-outage", revision=rev, blocking=True)
        await harness.publish(in_flight)
        await wait_until(lambda: runner.running == 1, what="the activation to start")

        await asyncio.to_thread(proxy.cut)
        await asyncio.sleep(3.0)  # the activation finishes meanwhile; its acks cannot go out
        assert runner.running == 0
        await asyncio.to_thread(proxy.restore)
        back = asyncio.get_running_loop().time()

        acks = await harness.wait_completion(in_flight["activationId"], timeout=60)
        assert [a.kind for a in acks] == ["result", "completion"]
        for ack in acks:
            check_ack(ack, sent_transid=in_flight["transid"], instance=11)
        after = [harness.message(path="guest", name="after-outage", revision=quick, blocking=True)
                 for _ in range(3)]
        for msg in after:
            await harness.publish(msg)
        for msg in after:
            kinds = [a.kind for a in await harness.wait_completion(msg["activationId"], timeout=60)]
            assert kinds == ["result", "completion"]
        await harness.wait_ping(lambda p: p["isEnabled"] and p["name"]["instance"] == 11, after=back)
        for _ in range(100):
            if await harness.committed("invoker11") == 4:
                break
            await asyncio.sleep(0.05)
        assert await harness.committed("invoker11") == 4
    assert runner.runs[in_flight["activationId"]] == 1
    assert all(runner.runs[m["activationId"]] == 1 for m in after)
    assert front.stats.activations == 4 and front.stats.duplicates == 0


async def test_broker_wiped_and_restarted(broker: TansuBroker, pouch: PouchServer, ow_manifest: Manifest) -> None:
    """The broker restarts without its data (Tansu keeps everything in memory): the invoker recreates
    its topics, rejoins its group from the earliest offset and delivers the ack it still owed."""
    runner = ScriptedRunner()
    rev = put_action(pouch, namespace="guest", name="through-restart", code=json.dumps({"sleep": 2.0}))
    quick = put_action(pouch, namespace="guest", name="after-restart", code="echo")
    async with ControllerHarness(broker.bootstrap, invoker=14) as harness, \
            running_front(broker, pouch, ow_manifest, invoker_id=14, runner=runner) as front:
        in_flight = harness.message(path="guest", name="through-restart", revision=rev, blocking=True)
        await harness.publish(in_flight)
        await wait_until(lambda: runner.running == 1, what="the activation to start")
        assignments = front.stats.assignments

        await asyncio.to_thread(broker.stop)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(broker.start)
        await harness.ensure_topics()
        await harness.rewind()

        acks = await harness.wait_completion(in_flight["activationId"], timeout=60)
        assert [a.kind for a in acks] == ["result", "completion"]
        for ack in acks:
            check_ack(ack, sent_transid=in_flight["transid"], instance=14)
        await wait_until(lambda: front.stats.assignments > assignments, what="the group to be joined again")
        after = [harness.message(path="guest", name="after-restart", revision=quick, blocking=True) for _ in range(3)]
        for msg in after:
            await harness.publish(msg)
        for msg in after:
            assert [a.kind for a in await harness.wait_completion(msg["activationId"], timeout=60)] == \
                ["result", "completion"]
    assert runner.runs[in_flight["activationId"]] == 1
    assert all(runner.runs[m["activationId"]] == 1 for m in after)


async def test_database_down_then_back(broker: TansuBroker, pouch: PouchServer, ow_manifest: Manifest) -> None:
    runner = ScriptedRunner()
    cached_rev = put_action(pouch, namespace="guest", name="cached", code="echo")
    async with ControllerHarness(broker.bootstrap, invoker=12) as harness, \
            running_front(broker, pouch, ow_manifest, invoker_id=12, runner=runner) as front:
        warm = harness.message(path="guest", name="cached", revision=cached_rev, blocking=True)
        await harness.publish(warm)
        await harness.wait_completion(warm["activationId"])
        await harness.wait_ping(lambda p: p["isEnabled"] and p["name"]["instance"] == 12)
        new_rev = put_action(pouch, namespace="guest", name="uncached", code="echo")

        await asyncio.to_thread(pouch.stop)
        uncached = harness.message(path="guest", name="uncached", revision=new_rev, blocking=True)
        cached = harness.message(path="guest", name="cached", revision=cached_rev, blocking=True)
        await harness.publish(uncached)
        await harness.publish(cached)

        # A cached action still runs and is acked; the other waits for its document.
        await harness.wait_completion(cached["activationId"])
        await wait_until(lambda: not front.pinging, what="pings to stop")
        paused = asyncio.get_running_loop().time()
        await asyncio.sleep(1.5)  # more than a ping interval
        assert [p for p in harness.pings_since(paused) if p["name"]["instance"] == 12] == []
        assert not harness.acks.get(uncached["activationId"])

        await asyncio.to_thread(pouch.start)
        acks = await harness.wait_completion(uncached["activationId"], timeout=60)
        assert [a.kind for a in acks] == ["result", "completion"]
        assert acks[0].activation is not None and acks[0].activation["response"]["statusCode"] == 0
        await harness.wait_ping(lambda p: p["isEnabled"] and p["name"]["instance"] == 12, after=paused)
        for msg in (uncached, cached):
            await wait_until(lambda m=msg: get_activation(pouch, "guest", m["activationId"]) is not None,
                             what=f"record of {msg['activationId']}")
        assert runner.runs[uncached["activationId"]] == 1 and runner.runs[cached["activationId"]] == 1


async def test_records_left_by_an_earlier_incarnation_are_not_run_again(
    broker: TansuBroker, pouch: PouchServer, ow_manifest: Manifest
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

        async with running_front(broker, pouch, ow_manifest, invoker_id=13, runner=runner) as front:
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
