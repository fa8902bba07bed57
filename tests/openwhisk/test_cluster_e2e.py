"""Controller harness → Tansu → the invoker's OpenWhisk front → runner → acks + records in pouchdb.

One broker, one database and one running front per module (a Tansu group join takes ~5 s); each test
uses its own activation ids and actions. The runner is a double of the invoker core (``doubles.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from ow_cluster.doubles import ScriptedRunner, Switch
from ow_cluster.harness import (
    ControllerHarness,
    annotation_map,
    check_ack,
    check_activation,
    check_ping,
)
from ow_cluster.peers import PouchServer, TansuBroker
from ow_cluster.support import ACTIVATIONS, get_activation, put_action, running_front

from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import ActivationRequest
from dilu_invoker.openwhisk.cluster import ClusterFront
from dilu_invoker.openwhisk.couchdb import (
    ACTION_FETCH_ERROR,
    ACTION_MISMATCH,
    ACTION_REMOVED,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.kafka, pytest.mark.couchdb]

INVOKER_ID = 3


@dataclass
class Setup:
    broker: TansuBroker
    pouch: PouchServer
    harness: ControllerHarness
    front: ClusterFront
    runner: ScriptedRunner
    switch: Switch


class RecordingRouter:
    """Mode (a) seam: a router that would forward GPU activations to the placed instance."""

    def __init__(self, local: ScriptedRunner) -> None:
        self.local = local
        self.routed: list[ActivationRequest] = []

    async def route(self, req: ActivationRequest) -> ScriptedRunner:
        self.routed.append(req)
        return self.local


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(broker: TansuBroker, pouch: PouchServer, ow_manifest: Manifest) -> AsyncIterator[Setup]:
    runner = ScriptedRunner()
    switch = Switch()
    env = {"CONFIG_whisk_invoker_resource_tags": " 'gpu,v100' ", "CONFIG_whisk_userEvents_enabled": "true",
           "DILU_INVOKER_GPU_IMAGES": "myorg/gpu-python"}
    async with ControllerHarness(broker.bootstrap, invoker=INVOKER_ID) as harness, \
            running_front(broker, pouch, ow_manifest, invoker_id=INVOKER_ID, runner=runner, env=env, control=switch,
                          router=RecordingRouter(runner)) as front:
        yield Setup(broker, pouch, harness, front, runner, switch)


def code(**spec: Any) -> str:
    return json.dumps(spec)


async def test_user_activation_blocking_split_acks_and_record(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="hello", code=code(logs=["hi"]))
    msg = setup.harness.message(path="guest", name="hello", revision=rev, blocking=True)
    await setup.harness.publish(msg)
    aid = msg["activationId"]

    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["result", "completion"]  # limits.logs = 10 → split
    for ack in acks:
        check_ack(ack, sent_transid=msg["transid"], instance=INVOKER_ID)
    result = acks[0].activation
    assert result is not None
    assert result["response"] == {"statusCode": 0, "result": {"name": "world"}, "size": 16}
    assert result["namespace"] == "guest" and result["name"] == "hello" and result["subject"] == "guest"
    assert acks[1].obj["isSystemError"] is False
    assert acks[1].obj["instance"]["tags"] == ["gpu", "v100"]
    assert acks[1].obj["instance"]["userMemory"] == f"{1024 * 1024 * 1024} B"
    assert setup.runner.runs[aid] == 1

    record = await wait_record(setup.pouch, "guest", aid)
    check_activation(record, activation_id=aid)
    assert record["_id"] == f"guest/{aid}" and record["entityType"] == "activation"
    assert record["logs"] == ["2026-01-01T00:00:00.000000000Z stdout: hi"]
    assert annotation_map(record)["path"] == "guest/hello"


async def wait_record(pouch: PouchServer, namespace: str, aid: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        record = await asyncio.to_thread(get_activation, pouch, namespace, aid)
        if record is not None:
            return record
        assert asyncio.get_running_loop().time() < deadline, f"no record {namespace}/{aid} in {ACTIVATIONS}"
        await asyncio.sleep(0.05)


async def test_blocking_without_log_collection_gets_one_combined_ack(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="nologs", code=code(result={"ok": 1}),
                     limits={"timeout": 1000, "memory": 128, "logs": 0, "concurrency": 1})
    msg = setup.harness.message(path="guest", name="nologs", revision=rev, blocking=True)
    await setup.harness.publish(msg)
    acks = await setup.harness.wait_completion(msg["activationId"])
    assert [a.kind for a in acks] == ["combined"]
    check_ack(acks[0], sent_transid=msg["transid"], instance=INVOKER_ID)
    activation = acks[0].activation
    assert activation is not None and activation["response"]["result"] == {"ok": 1}
    assert acks[0].obj["isSystemError"] is False


async def test_non_blocking_gets_only_a_completion_and_a_stored_result(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="async", code=code(result={"done": True}))
    msg = setup.harness.message(path="guest", name="async", revision=rev, blocking=False)
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["completion"]
    check_ack(acks[0], sent_transid=msg["transid"], instance=INVOKER_ID)
    assert acks[0].obj["activationId"] == aid
    record = await wait_record(setup.pouch, "guest", aid)
    assert record["response"]["result"] == {"done": True}


async def test_health_test_action_is_answered_without_container_or_database(setup: Setup) -> None:
    fetches = setup.front.actions.fetches
    msg = setup.harness.message("activation_health_test_captured.json")
    assert msg["revision"] is None and "content" not in msg and msg["user"]["rights"] == []
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["completion"]  # non-blocking, like the controller sends it
    check_ack(acks[0], sent_transid=msg["transid"], instance=INVOKER_ID)
    assert acks[0].obj["isSystemError"] is False
    assert setup.runner.runs[aid] == 0
    assert setup.front.actions.fetches == fetches
    record = await wait_record(setup.pouch, "whisk.system", aid)
    assert record["response"] == {"statusCode": 0, "result": {}, "size": 2}
    assert annotation_map(record)["path"] == "whisk.system/invokerHealthTestAction0"


async def test_captured_composition_message_with_parent_transid_and_stale_revision(setup: Setup) -> None:
    # The captured message names revision 2-2bd48…; the stored action has moved on, so the invoker
    # reads the latest revision (InvokerReactive's DocumentRevisionMismatch path).
    put_action(setup.pouch, namespace="guest", name="fn1", code=code(logs=["composed"]))
    msg = setup.harness.message("activation_composition_captured.json")
    assert len(msg["transid"]) == 3 and isinstance(msg["transid"][2], list)
    assert "lockedArgs" not in msg
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["result", "completion"]
    for ack in acks:
        check_ack(ack, sent_transid=msg["transid"], instance=INVOKER_ID)
    result = acks[0].activation
    assert result is not None
    assert result["cause"] == "7902f85843f349df82f85843f309dfb0"
    assert annotation_map(result)["causedBy"] == "sequence"
    assert result["response"]["result"] == {"sleep_time": 15, "user": "Kira"}
    assert setup.runner.requests[aid].action.version == "0.0.1"


async def test_field_order_numeric_id_and_array_payload_are_read(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="arrays", code="echo")
    msg = setup.harness.message(path="guest", name="arrays", revision=rev, blocking=True, content=[1, "two", {"3": 3}])
    numeric_id = "".join(str((i * 7) % 10) for i in range(1, 33))  # 32 decimal digits are valid hex too
    msg["activationId"] = int(numeric_id)
    await setup.harness.publish(msg, shuffle=True)
    acks = await setup.harness.wait_completion(numeric_id)
    assert [a.kind for a in acks] == ["result", "completion"]
    for ack in acks:
        check_ack(ack, sent_transid=msg["transid"], instance=INVOKER_ID)
    assert acks[1].obj["activationId"] == numeric_id
    assert setup.runner.requests[numeric_id].content == [1, "two", {"3": 3}]
    result = acks[0].activation
    assert result is not None and result["response"]["result"] == [1, "two", {"3": 3}]


async def test_missing_action_is_an_application_error_with_a_fallback_record(setup: Setup) -> None:
    msg = setup.harness.message(path="guest", name="never-created", revision="1-abc", blocking=True)
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["combined"]
    check_ack(acks[0], sent_transid=msg["transid"], instance=INVOKER_ID)
    activation = acks[0].activation
    assert activation is not None
    assert activation["response"] == {"statusCode": 1, "result": {"error": ACTION_REMOVED}}
    assert acks[0].obj["isSystemError"] is False
    assert annotation_map(activation) == {"path": "guest/never-created", "kind": "unknown"}
    assert activation["duration"] == 0
    record = await wait_record(setup.pouch, "guest", aid)
    assert record["response"]["statusCode"] == 1
    assert setup.runner.runs[aid] == 0


async def test_unknown_kind_is_a_whisk_error_and_non_blocking_acks_are_shrunk(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="swifty", kind="swift:5.7", code="func main() {}")
    msg = setup.harness.message(path="guest", name="swifty", revision=rev, blocking=False)
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["combined"]
    check_ack(acks[0], sent_transid=msg["transid"], instance=INVOKER_ID)
    assert acks[0].shrunk and acks[0].obj["response"] == aid
    assert acks[0].obj["isSystemError"] is True
    record = await wait_record(setup.pouch, "guest", aid)
    assert record["response"] == {"statusCode": 3, "result": {"error": ACTION_MISMATCH}}


async def test_a_document_that_is_not_an_action_is_incompatible(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="pkg-not-action", code="x", entity_type="package")
    msg = setup.harness.message(path="guest", name="pkg-not-action", revision=rev, blocking=True)
    await setup.harness.publish(msg)
    acks = await setup.harness.wait_completion(msg["activationId"])
    activation = acks[0].activation
    assert activation is not None and activation["response"]["result"] == {"error": ACTION_MISMATCH}
    assert ACTION_FETCH_ERROR != ACTION_MISMATCH


async def test_user_without_stored_activations_gets_acks_but_no_record(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="private", code=code(result={"secret": 1}))
    msg = setup.harness.message(path="guest", name="private", revision=rev, blocking=True,
                                limits={"storeActivations": False})
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["result", "completion"]
    # A record of a later activation shows the store path ran meanwhile; this one must still be absent.
    marker = setup.harness.message(path="guest", name="private", revision=rev, blocking=False)
    await setup.harness.publish(marker)
    await setup.harness.wait_completion(marker["activationId"])
    await wait_record(setup.pouch, "guest", marker["activationId"])
    assert get_activation(setup.pouch, "guest", aid) is None


@pytest.mark.parametrize(("status", "system_error"), [(1, False), (2, False), (3, True)],
                         ids=["application-error", "developer-error", "whisk-error"])
async def test_only_whisk_errors_are_system_errors(setup: Setup, status: int, system_error: bool) -> None:
    rev = put_action(setup.pouch, namespace="guest", name=f"fails{status}", code=code(status=status, error="boom"))
    msg = setup.harness.message(path="guest", name=f"fails{status}", revision=rev, blocking=True)
    await setup.harness.publish(msg)
    acks = await setup.harness.wait_completion(msg["activationId"])
    assert [a.kind for a in acks] == ["result", "completion"]
    assert acks[1].obj["isSystemError"] is system_error
    result = acks[0].activation
    assert result is not None and result["response"] == {"statusCode": status, "result": {"error": "boom"}}


async def test_malformed_messages_never_stall_the_consumer(setup: Setup) -> None:
    skipped = setup.front.stats.malformed_skipped
    await setup.harness.publish(b"\x00not json at all")
    await setup.harness.publish(b'{"activationId": 42}')  # JSON, but no usable id: skipped
    broken = setup.harness.message(path="guest", name="whatever", blocking=True)
    del broken["user"]
    await setup.harness.publish(broken)
    rev = put_action(setup.pouch, namespace="guest", name="after-garbage", code="echo")
    good = setup.harness.message(path="guest", name="after-garbage", revision=rev, blocking=True)
    await setup.harness.publish(good)

    acks = await setup.harness.wait_completion(broken["activationId"])
    assert [a.kind for a in acks] == ["combined"]
    check_ack(acks[0], sent_transid=broken["transid"], instance=INVOKER_ID)
    assert acks[0].obj["isSystemError"] is True
    activation = acks[0].activation
    assert activation is not None and "'user' is missing" in activation["response"]["result"]["error"]
    assert [a.kind for a in await setup.harness.wait_completion(good["activationId"])] == ["result", "completion"]
    assert setup.front.stats.malformed_skipped == skipped + 2


async def test_a_result_too_large_for_the_bus_is_acked_by_id(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="huge", code=code(big=1_200_000))
    msg = setup.harness.message(path="guest", name="huge", revision=rev, blocking=True)
    shrunk_before = setup.front.stats.acks_shrunk
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["result", "completion"]
    check_ack(acks[0], sent_transid=msg["transid"], instance=INVOKER_ID)
    assert acks[0].shrunk and acks[0].obj["response"] == aid
    assert setup.front.stats.acks_shrunk == shrunk_before + 1
    # The controller then reads the result from the database (PrimitiveActions polls it).
    record = await wait_record(setup.pouch, "guest", aid)
    assert len(record["response"]["result"]["blob"]) == 1_200_000


async def test_a_redelivered_activation_runs_once(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="once", code=code(sleep=0.3))
    msg = setup.harness.message(path="guest", name="once", revision=rev, blocking=True)
    duplicates = setup.front.stats.duplicates
    await setup.harness.publish(msg)
    await setup.harness.publish(msg)  # while the first is in work
    aid = msg["activationId"]
    await setup.harness.wait_completion(aid)
    await setup.harness.publish(msg)  # after it finished
    await setup.harness.wait_for(lambda: setup.front.stats.duplicates >= duplicates + 2)
    assert setup.runner.runs[aid] == 1
    # Marker: a later activation's acks arrive after anything the duplicates could have caused.
    marker = setup.harness.message(path="guest", name="once", revision=rev, blocking=True)
    await setup.harness.publish(marker)
    await setup.harness.wait_completion(marker["activationId"])
    assert [a.kind for a in setup.harness.acks[aid]] == ["result", "completion"]


async def test_offsets_are_committed_only_after_the_ack(setup: Setup) -> None:
    rev_slow = put_action(setup.pouch, namespace="guest", name="slow", code=code(sleep=1.5))
    rev_fast = put_action(setup.pouch, namespace="guest", name="fast", code="echo")
    slow = setup.harness.message(path="guest", name="slow", revision=rev_slow, blocking=False)
    fast = setup.harness.message(path="guest", name="fast", revision=rev_fast, blocking=False)
    slow_offset = await setup.harness.publish(slow)
    fast_offset = await setup.harness.publish(fast)
    await setup.harness.wait_completion(fast["activationId"])
    assert not setup.harness.acks.get(slow["activationId"])
    committed = await setup.harness.committed(f"invoker{INVOKER_ID}")
    assert committed is not None and committed <= slow_offset
    await setup.harness.wait_completion(slow["activationId"])
    for _ in range(100):
        committed = await setup.harness.committed(f"invoker{INVOKER_ID}")
        if committed is not None and committed > fast_offset:
            break
        await asyncio.sleep(0.05)
    assert committed == fast_offset + 1


async def test_no_more_activations_are_taken_than_the_pool_holds(setup: Setup) -> None:
    max_peek = setup.front.options.max_peek
    assert max_peek == 1024 // 128
    rev = put_action(setup.pouch, namespace="guest", name="crowd", code=code(sleep=0.4))
    setup.runner.max_running = 0
    msgs = [setup.harness.message(path="guest", name="crowd", revision=rev, blocking=False)
            for _ in range(max_peek + 5)]
    for msg in msgs:
        await setup.harness.publish(msg)
    for msg in msgs:
        await setup.harness.wait_completion(msg["activationId"])
    assert setup.runner.max_running == max_peek


async def test_an_overloaded_pool_is_retried_without_losing_the_activation(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="busy", code=code(overloaded=2))
    msg = setup.harness.message(path="guest", name="busy", revision=rev, blocking=True)
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    assert [a.kind for a in acks] == ["result", "completion"]
    assert setup.runner.refused[aid] == 2 and setup.runner.runs[aid] == 1


async def test_a_failing_runner_gives_a_whisk_error_not_silence(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="buggy", code=code(raise_=True).replace("raise_", "raise"))
    msg = setup.harness.message(path="guest", name="buggy", revision=rev, blocking=True)
    await setup.harness.publish(msg)
    acks = await setup.harness.wait_completion(msg["activationId"])
    assert acks[-1].obj["isSystemError"] is True
    result = acks[0].activation
    assert result is not None and result["response"]["statusCode"] == 3


async def test_binary_code_from_an_attachment_reaches_the_runner_as_base64(setup: Setup) -> None:
    zipped = b"PK\x03\x04" + bytes(range(256)) * 4
    rev = put_action(setup.pouch, namespace="guest", name="zipped", code=zipped, binary=True, store="couch")
    msg = setup.harness.message(path="guest", name="zipped", revision=rev, blocking=True)
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    await setup.harness.wait_completion(aid)
    exec_ = setup.runner.requests[aid].action.exec
    assert exec_.binary is True
    import base64

    assert base64.b64decode(exec_.code or "") == zipped


async def test_gpu_image_docker_actions_run_as_the_gpu_kind(setup: Setup) -> None:
    """Routing mode (b): docker actions with a configured GPU image run in our GPU runtime."""
    gpu_rev = put_action(setup.pouch, namespace="guest", name="gpujob", kind="blackbox", code="def main(a): return a",
                         image="myorg/gpu-python:1.0", store="mem")
    other_rev = put_action(setup.pouch, namespace="guest", name="cpujob", kind="blackbox", code=None,
                           image="someone/else:2")
    gpu = setup.harness.message(path="guest", name="gpujob", revision=gpu_rev, blocking=True)
    other = setup.harness.message(path="guest", name="cpujob", revision=other_rev, blocking=True)
    await setup.harness.publish(gpu)
    await setup.harness.publish(other)
    await setup.harness.wait_completion(gpu["activationId"])
    await setup.harness.wait_completion(other["activationId"])
    gpu_exec = setup.runner.requests[gpu["activationId"]].action.exec
    assert (gpu_exec.kind, gpu_exec.image, gpu_exec.code) == ("python:3-gpu", None, "def main(a): return a")
    other_exec = setup.runner.requests[other["activationId"]].action.exec
    assert (other_exec.kind, other_exec.image) == ("blackbox", "someone/else:2")


async def test_every_activation_passes_the_router(setup: Setup) -> None:
    """Routing mode (a) seam: the router decides where a request runs; the front acks it anyway."""
    router = setup.front.router
    assert isinstance(router, RecordingRouter)
    rev = put_action(setup.pouch, namespace="guest", name="routed", kind="python:3-gpu", code="echo")
    msg = setup.harness.message(path="guest", name="routed", revision=rev, blocking=True)
    msg["action"]["binding"] = "guest/shared-binding"
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    acks = await setup.harness.wait_completion(aid)
    routed = [r for r in router.routed if r.activation_id == aid]
    assert len(routed) == 1 and routed[0].action.exec.kind == "python:3-gpu"
    assert routed[0].binding == "guest/shared-binding"
    assert routed[0].identity.api_key.startswith("23bc46b1-71f6-4ed5-8c54-816aa4f8c502:")
    result = acks[0].activation
    assert result is not None and annotation_map(result)["binding"] == "guest/shared-binding"


async def test_user_events_follow_the_slot_freeing_ack(setup: Setup) -> None:
    rev = put_action(setup.pouch, namespace="guest", name="metered", code=code(result={"statusCode": 201}))
    msg = setup.harness.message(path="guest", name="metered", revision=rev, blocking=True)
    await setup.harness.publish(msg)
    aid = msg["activationId"]
    await setup.harness.wait_completion(aid)
    await setup.harness.wait_for(lambda: any(e["body"]["activationId"] == aid for e in setup.harness.events))
    event = next(e for e in setup.harness.events if e["body"]["activationId"] == aid)
    assert event["source"] == f"invoker{INVOKER_ID}" and event["eventType"] == "Activation"
    assert event["userId"] == msg["user"]["namespace"]["uuid"]
    assert event["namespace"] == "guest" and event["subject"] == "guest"
    body = event["body"]
    assert body["name"] == "guest/metered" and body["kind"] == "python:3.11" and body["statusCode"] == 0
    assert body["memory"] == 256 and body["userDefinedStatusCode"] == 201 and body["conductor"] is False


async def test_pings_carry_the_instance_and_stop_while_disabled(setup: Setup) -> None:
    ping = await setup.harness.wait_ping(lambda p: p["isEnabled"])
    check_ping(ping, instance=INVOKER_ID)
    assert ping["name"]["uniqueName"] == str(INVOKER_ID)
    assert ping["name"]["tags"] == ["gpu", "v100"] and ping["name"]["dedicatedNamespaces"] == []
    assert ping["name"]["userMemory"] == f"{1024 * 1024 * 1024} B"

    setup.switch.set(False)
    disabled = await setup.harness.wait_ping(lambda p: not p["isEnabled"])
    check_ping(disabled, instance=INVOKER_ID)
    since = asyncio.get_running_loop().time()
    await asyncio.sleep(1.5)  # more than a ping interval
    assert [p["isEnabled"] for p in setup.harness.pings_since(since)] == []

    setup.switch.set(True)
    await setup.harness.wait_ping(lambda p: p["isEnabled"])
