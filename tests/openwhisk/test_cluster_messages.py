"""Wire formats against the captured and derived JSON of ``reference/openwhisk.md`` §1–§2."""

from __future__ import annotations

import json
import random

import pytest
from ow_cluster.harness import (
    ReceivedAck,
    check_ack,
    check_activation,
    check_ping,
    compact,
    load_fixture,
    shuffled,
)

from dilu_invoker.model import (
    Action,
    Activation,
    ActivationResponse,
    Exec,
    Parameter,
)
from dilu_invoker.openwhisk.messages import (
    AckKind,
    ActivationMessage,
    InvokerInstance,
    MalformedMessage,
    acks_after_run,
    acks_without_container,
    activation_document,
    activation_event,
    completion_ack,
    dumps,
    fallback_for,
    health_test_activation,
    ping_message,
)

INSTANCE = InvokerInstance(instance=0, user_memory_bytes=2147483648, unique_name="0")


def activation(aid: str = "0b307ee5a1304a57b07ee5a1300a57e7", *, status: ActivationResponse | None = None,
               logs: tuple[str, ...] = ("2024-01-01T12:00:00.123456789Z stdout: hello",)) -> Activation:
    return Activation(
        namespace="guest", name="hello", subject="guest", activation_id=aid, start=1000, end=1025,
        response=status or ActivationResponse.success({"greeting": "hi"}, size=17), logs=logs,
        annotations=(Parameter("path", "guest/hello"), Parameter("kind", "python:3.11"),
                     Parameter("limits", {"timeout": 60000, "memory": 256, "logs": 10, "concurrency": 1}),
                     Parameter("waitTime", 12), Parameter("initTime", 7)),
    )


@pytest.mark.parametrize("fixture", ["activation_health_test_captured.json", "activation_composition_captured.json",
                                     "activation_current_derived.json"])
def test_fixtures_parse_in_any_field_order(fixture: str) -> None:
    raw = load_fixture(fixture)
    rng = random.Random(fixture)
    for variant in (raw, shuffled(raw, rng), shuffled(raw, rng)):
        msg = ActivationMessage.parse(compact(variant))
        assert msg.activation_id == raw["activationId"]
        assert msg.transid == raw["transid"]
        assert msg.controller == "0"
        assert msg.action_path == raw["action"]["path"] and msg.action_name == raw["action"]["name"]
        assert msg.blocking is raw["blocking"]
        assert msg.revision == raw["revision"]
        assert msg.content == raw.get("content")
        assert msg.user.namespace == raw["user"]["namespace"]["name"]


def test_health_test_message() -> None:
    msg = ActivationMessage.parse(compact(load_fixture("activation_health_test_captured.json")))
    assert msg.is_health_test and msg.revision is None and msg.content is None
    assert msg.user.rights == () and msg.user.store_activations
    record = health_test_activation(msg, now=1610726320000)
    assert record.response.to_json() == {"statusCode": 0, "result": {}, "size": 2}
    assert record.namespace == "whisk.system" and record.annotation("path") == "whisk.system/invokerHealthTestAction0"
    assert record.annotation("waitTime") == 1610726320000 - 1610726319878
    check_activation(json.loads(dumps(record.to_json())))


def test_composition_message_keeps_parent_chain_and_cause() -> None:
    msg = ActivationMessage.parse(compact(load_fixture("activation_composition_captured.json")))
    assert msg.cause == "7902f85843f349df82f85843f309dfb0"
    assert msg.transid_id == "bxytKe9Qk3EYVEYQnpHs02NDFo5eKAd3"
    assert msg.transid[2][2] == ["iRFErOK5Hflz8qduy49vBKWWMFTG44IW", 1609870676273]
    assert msg.locked_args == {}
    req = msg.to_request(Action(namespace="guest", name="fn1", exec=Exec(kind="python:3.11", code="x")))
    assert req.transid is msg.transid and req.cause == msg.cause and req.blocking
    assert req.identity.api_key == load_fixture("activation_composition_captured.json")["user"]["authkey"]["api_key"]


def test_numeric_activation_id_and_array_content() -> None:
    raw = load_fixture("activation_current_derived.json")
    raw["activationId"] = 12345678901234567890123456789012
    raw["content"] = [1, 2, 3]
    raw["action"]["binding"] = "guest/bound"
    msg = ActivationMessage.parse(compact(raw))
    assert msg.activation_id == "12345678901234567890123456789012"
    assert msg.content == [1, 2, 3]
    assert msg.binding == "guest/bound"


def test_store_activations_flag_and_unknown_user_fields() -> None:
    raw = load_fixture("activation_current_derived.json")
    raw["user"]["limits"] = {"storeActivations": False, "concurrentInvocations": 30, "somethingNew": {"x": 1}}
    raw["user"]["authkey"] = {"jwt": "not a basic key"}
    raw["newTopLevelField"] = True
    msg = ActivationMessage.parse(compact(raw))
    assert msg.user.store_activations is False
    identity = msg.user.identity()
    assert identity.uuid == raw["user"]["namespace"]["uuid"] and identity.key == ""
    assert identity.store_activations is False


@pytest.mark.parametrize(
    ("mutate", "reason", "salvaged_id"),
    [
        (lambda m: m.pop("user"), "'user' is missing", True),
        (lambda m: m.update(transid="abc"), "'transid'", True),
        (lambda m: m.update(blocking="yes"), "'blocking'", True),
        (lambda m: m.update(content="text"), "'content'", True),
        (lambda m: m.update(activationId="NOT-HEX"), "'activationId'", False),
        (lambda m: m.update(rootControllerIndex={"asString": "../etc"}), "rootControllerIndex", True),
        (lambda m: m["action"].pop("name"), "'action.name'", True),
    ],
    ids=["no-user", "bad-transid", "bad-blocking", "scalar-content", "bad-id", "bad-controller", "no-action-name"],
)
def test_malformed_messages_say_why_and_keep_what_they_can(mutate: object, reason: str, salvaged_id: bool) -> None:
    raw = load_fixture("activation_current_derived.json")
    assert callable(mutate)
    mutate(raw)
    with pytest.raises(MalformedMessage) as err:
        ActivationMessage.parse(compact(raw))
    assert reason in err.value.reason
    assert (err.value.activation_id == "0b307ee5a1304a57b07ee5a1300a57e7") is salvaged_id
    if "transid" in reason:
        assert err.value.transid is None
    else:
        assert err.value.transid == raw["transid"]


@pytest.mark.parametrize("payload", [b"", b"\xff\xfe", b"[1,2]", b"null", b'"string"'],
                         ids=["empty", "not-utf8", "array", "null", "string"])
def test_non_objects_are_malformed_without_an_id(payload: bytes) -> None:
    with pytest.raises(MalformedMessage) as err:
        ActivationMessage.parse(payload)
    assert err.value.activation_id is None


def test_instance_id_has_what_current_controllers_require() -> None:
    inst = InvokerInstance(instance=2, user_memory_bytes=4 * 1024**3, unique_name="gpu-node-1",
                           tags=("gpu",), dedicated_namespaces=("team-a",))
    assert inst.to_json() == {"instance": 2, "userMemory": "4294967296 B", "instanceType": "invoker",
                              "tags": ["gpu"], "dedicatedNamespaces": ["team-a"], "uniqueName": "gpu-node-1"}
    assert str(inst) == "invoker2/gpu-node-1"
    assert InvokerInstance(instance=0, user_memory_bytes=1).to_json()["tags"] == []


def test_ping_matches_the_derived_current_ping() -> None:
    assert json.loads(ping_message(INSTANCE)) == load_fixture("ping_current_derived.json")
    disabled = json.loads(ping_message(INSTANCE, enabled=False))
    check_ping(disabled, instance=0)
    assert disabled["isEnabled"] is False


def received(raw: bytes) -> ReceivedAck:
    return ReceivedAck(raw, json.loads(raw), 0.0)


@pytest.mark.parametrize(
    ("blocking", "split", "kinds"),
    [(True, True, ["result", "completion"]), (True, False, ["combined"]),
     (False, True, ["completion"]), (False, False, ["completion"])],
    ids=["blocking-split", "blocking-combined", "nonblocking-split", "nonblocking-nolog"],
)
def test_ack_plan_follows_the_container_proxy(blocking: bool, split: bool, kinds: list[str]) -> None:
    transid = ["iud25hHHjA0mtOTri9nKePhEnDhcMpH2", 1612889790960, True, ["parent", 1612889790000]]
    acks = acks_after_run(transid=transid, activation=activation(), instance=INSTANCE, blocking=blocking, split=split)
    assert [str(a.kind) for a in acks] == kinds
    for ack in acks:
        got = received(ack.serialize())
        assert got.kind == str(ack.kind)  # the controller's reader tells them apart by fields alone
        check_ack(got, sent_transid=transid, instance=0)
        if got.activation is not None:
            assert got.activation["logs"] == []  # results go out before log collection


def test_acks_are_compact_and_keep_integers() -> None:
    transid = ["x" * 32, 1612889790960]
    raw = completion_ack(transid, activation(), INSTANCE).serialize()
    assert raw == compact(json.loads(raw))  # no whitespace between tokens
    assert raw.startswith(b'{"transid":["' + b"x" * 32 + b'",1612889790960]')
    assert isinstance(json.loads(raw)["transid"][1], int)


def test_shrunk_acks_name_only_the_activation() -> None:
    aid = "50bd97db9fef433abd97db9fef933ab1"
    failed = activation(aid, status=ActivationResponse.whisk_error("Action could not be fetched."))
    (ack,) = acks_without_container(transid=["t", 1], activation=failed, instance=INSTANCE, blocking=False)
    assert ack.kind is AckKind.COMBINED and ack.shrunk
    obj = json.loads(ack.serialize())
    assert obj["response"] == aid and obj["isSystemError"] is True
    (blocking,) = acks_without_container(transid=["t", 1], activation=failed, instance=INSTANCE, blocking=True)
    assert json.loads(blocking.serialize())["response"]["response"]["statusCode"] == 3
    completion = completion_ack(["t", 1], failed, INSTANCE)
    assert completion.shrink() is completion


@pytest.mark.parametrize("fixture", ["ack_completion_captured.json", "ack_combined_captured.json"])
def test_our_acks_have_the_fields_of_captured_scala_acks(fixture: str) -> None:
    captured = load_fixture(fixture)
    ours = acks_after_run(transid=captured["transid"], activation=activation(), instance=INSTANCE, blocking=True,
                          split=fixture.startswith("ack_completion"))
    mine = json.loads(ours[-1].serialize())
    assert set(captured) <= set(mine)
    assert set(captured["instance"]) <= set(mine["instance"])
    if isinstance(captured.get("response"), dict):
        assert set(captured["response"]) <= set(mine["response"])
        assert set(captured["response"]["response"]) == set(mine["response"]["response"])


def test_fallback_record_and_document() -> None:
    msg = ActivationMessage.parse(compact(load_fixture("activation_composition_captured.json")))
    record = fallback_for(msg, ActivationResponse.application_error("Action could not be found or may have been deleted."),
                          now=5)
    assert (record.start, record.end, record.duration) == (5, 5, 0)
    assert {a.key: a.value for a in record.annotations} == {
        "path": "guest/fn1", "kind": "unknown", "causedBy": "sequence"}
    assert record.version == "0.0.2" and record.cause == msg.cause
    doc = activation_document(record, updated=9)
    assert doc["_id"] == f"guest/{msg.activation_id}" and doc["entityType"] == "activation" and doc["updated"] == 9
    check_activation(doc)


def test_activation_event_body() -> None:
    act = activation(status=ActivationResponse.application_error({"statusCode": 404, "msg": "nope"}))
    event = activation_event(act, source="invoker0", user_uuid="u-1", now=77)
    assert event is not None
    assert event == {
        "source": "invoker0", "subject": "guest", "namespace": "guest", "userId": "u-1",
        "eventType": "Activation", "timestamp": 77,
        "body": {"name": "guest/hello", "activationId": act.activation_id, "statusCode": 1, "duration": 25,
                 "waitTime": 12, "initTime": 7, "kind": "python:3.11", "conductor": False, "memory": 256,
                 "userDefinedStatusCode": 404},
    }
    no_kind = Activation(namespace="g", name="n", subject="g", activation_id="a" * 32, start=0, end=0,
                         response=ActivationResponse.success([1]))
    assert activation_event(no_kind, source="invoker0", user_uuid="u") is None
