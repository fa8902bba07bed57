"""A controller harness: plays OpenWhisk's controller on a real Kafka-protocol broker.

It publishes ActivationMessages as spray's ``compactPrint`` writes them (the captured and derived JSON
of ``reference/openwhisk.md`` §1.2/§1.3 under ``fixtures/``), collects what arrives on ``completed{C}``
and ``health``, and checks every field the controller's readers need (``AcknowledegmentMessage.serdes``,
``WhiskActivation``, ``InvokerInstanceId``, ``PingMessage``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import re
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

FIXTURES = Path(__file__).parent / "fixtures"
UNSET: Any = object()
_BYTE_SIZE_RE = re.compile(r"\A\d+ (B|KB|MB|GB)\Z")
_ACTIVATION_ID_RE = re.compile(r"\A[0-9a-f]{32}\Z")


def load_fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def compact(value: Any) -> bytes:
    """spray's ``compactPrint``."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON with every object's fields in another order (spray's maps have none)."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


def new_transid() -> list[Any]:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    return ["".join(secrets.choice(alphabet) for _ in range(32)), int(time.time() * 1000)]


@dataclass(frozen=True)
class ReceivedAck:
    raw: bytes
    obj: dict[str, Any]
    received: float

    @property
    def kind(self) -> str:
        """``AcknowledegmentMessage.serdes.read``: by field presence only."""
        if "instance" in self.obj and "response" in self.obj:
            return "combined"
        if "instance" in self.obj:
            return "completion"
        return "result"

    @property
    def activation_id(self) -> str:
        if self.kind == "completion":
            return str(self.obj["activationId"])
        response = self.obj["response"]
        return response if isinstance(response, str) else str(response["activationId"])

    @property
    def activation(self) -> dict[str, Any] | None:
        response = self.obj.get("response")
        return response if isinstance(response, dict) else None

    @property
    def shrunk(self) -> bool:
        return self.kind != "completion" and isinstance(self.obj.get("response"), str)


def check_instance(inst: Any, *, instance: int | None = None) -> None:
    """``InvokerInstanceId.serdes.read`` of a current controller."""
    assert isinstance(inst, dict), inst
    assert isinstance(inst["instance"], int) and not isinstance(inst["instance"], bool)
    if instance is not None:
        assert inst["instance"] == instance
    assert inst["instanceType"] == "invoker"
    assert _BYTE_SIZE_RE.match(inst["userMemory"]), inst["userMemory"]
    assert isinstance(inst["tags"], list) and all(isinstance(t, str) for t in inst["tags"])
    assert isinstance(inst["dedicatedNamespaces"], list)
    if "uniqueName" in inst:
        assert isinstance(inst["uniqueName"], str)


def check_activation(act: Any, *, activation_id: str | None = None) -> None:
    """The ``WhiskActivation`` reader: ``jsonFormat13`` fields, the required ones present."""
    assert isinstance(act, dict), act
    for key in ("namespace", "name", "subject", "activationId", "version"):
        assert isinstance(act.get(key), str) and act[key], (key, act.get(key))
    if activation_id is not None:
        assert act["activationId"] == activation_id
    for key in ("start", "end"):
        assert isinstance(act.get(key), int) and not isinstance(act[key], bool), (key, act.get(key))
    assert act["end"] >= act["start"]
    if "duration" in act:
        assert isinstance(act["duration"], int) and act["duration"] == act["end"] - act["start"]
    response = act["response"]
    assert isinstance(response, dict) and response["statusCode"] in (0, 1, 2, 3), response
    assert isinstance(act["logs"], list) and all(isinstance(line, str) for line in act["logs"])
    assert isinstance(act["publish"], bool)
    assert re.match(r"\A\d+\.\d+\.\d+\Z", act["version"])
    assert isinstance(act["annotations"], list)
    for a in act["annotations"]:
        assert isinstance(a, dict) and isinstance(a.get("key"), str) and "value" in a, a
    if "cause" in act:
        assert _ACTIVATION_ID_RE.match(act["cause"])


def annotation_map(act: dict[str, Any]) -> dict[str, Any]:
    return {a["key"]: a["value"] for a in act["annotations"]}


def check_ack(ack: ReceivedAck, *, sent_transid: Any, instance: int | None = None) -> None:
    """Everything ``CommonLoadBalancer.processAcknowledgement`` and the readers rely on."""
    obj = ack.obj
    # transid: value-equal and written back byte for byte (integers stay integers, chain kept).
    assert obj["transid"] == sent_transid
    assert b'"transid":' + compact(sent_transid) in ack.raw, ack.raw[:200]
    if ack.kind in ("completion", "combined"):
        assert isinstance(obj["isSystemError"], bool)
        check_instance(obj["instance"], instance=instance)
    if ack.kind == "completion":
        assert _ACTIVATION_ID_RE.match(obj["activationId"])
    else:
        response = obj["response"]
        if isinstance(response, str):
            assert _ACTIVATION_ID_RE.match(response)
        else:
            check_activation(response)
            assert response["logs"] == [], "acks never carry logs"
            if ack.kind == "combined":
                assert obj["isSystemError"] == (response["response"]["statusCode"] == 3)


def check_ping(obj: Any, *, instance: int | None = None) -> None:
    assert set(obj) == {"name", "isEnabled"}, obj
    assert isinstance(obj["isEnabled"], bool)
    check_instance(obj["name"], instance=instance)


class ControllerHarness:
    def __init__(self, bootstrap: str, *, invoker: int, controller: str = "0", prefix: str = "",
                 fetch_wait_ms: int = 20) -> None:
        self.bootstrap = bootstrap
        self.fetch_wait_ms = fetch_wait_ms
        self.invoker = invoker
        self.controller = controller
        self.prefix = prefix
        self.invoker_topic = f"{prefix}invoker{invoker}"
        self.completed_topic = f"{prefix}completed{controller}"
        self.health_topic = f"{prefix}health"
        self.acks: dict[str, list[ReceivedAck]] = defaultdict(list)
        self.pings: list[tuple[float, dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.sent: dict[str, dict[str, Any]] = {}
        self._changed = asyncio.Condition()
        self._producer: AIOKafkaProducer | None = None
        self._consumers: list[AIOKafkaConsumer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random(6)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def ensure_topics(self) -> None:
        """What a persistent Kafka keeps across restarts (and what OpenWhisk's components create)."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(t, 1, 1) for t in
                                       (self.invoker_topic, self.completed_topic, self.health_topic,
                                        f"{self.prefix}events")])
        finally:
            await admin.close()

    async def start(self) -> None:
        await self.ensure_topics()
        self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=0)
        await self._producer.start()
        for topic, sink in ((self.completed_topic, self._on_ack), (self.health_topic, self._on_ping),
                            (f"{self.prefix}events", self._on_event)):
            # No group (nothing to join), every partition, from the beginning: a broker that restarts
            # empty is read from its new beginning too.
            consumer = AIOKafkaConsumer(topic, bootstrap_servers=self.bootstrap, group_id=None,
                                        enable_auto_commit=False, auto_offset_reset="earliest",
                                        fetch_max_wait_ms=self.fetch_wait_ms, metadata_max_age_ms=1000)
            await consumer.start()
            self._consumers.append(consumer)
            self._tasks.append(asyncio.create_task(self._collect(consumer, sink)))

    async def rewind(self) -> None:
        """After the broker lost its data: read the new, empty topics from their beginning."""
        for consumer in self._consumers:
            if consumer.assignment():
                await consumer.seek_to_beginning()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for consumer in self._consumers:
            await consumer.stop()
        if self._producer is not None:
            await self._producer.stop()

    async def _collect(self, consumer: AIOKafkaConsumer, sink: Any) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    sink(record.value)
            if batches:
                async with self._changed:
                    self._changed.notify_all()

    def _on_ack(self, raw: bytes) -> None:
        ack = ReceivedAck(raw, json.loads(raw), time.monotonic())
        self.acks[ack.activation_id].append(ack)

    def _on_ping(self, raw: bytes) -> None:
        self.pings.append((time.monotonic(), json.loads(raw)))

    def _on_event(self, raw: bytes) -> None:
        self.events.append(json.loads(raw))

    # ------------------------------------------------------------------------------------ messages

    def message(
        self,
        fixture: str = "activation_current_derived.json",
        *,
        path: str | None = None,
        name: str | None = None,
        revision: Any = UNSET,
        blocking: bool | None = None,
        content: Any = UNSET,
        limits: dict[str, Any] | None = None,
        drop: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """A fixture message with a fresh activation id and transid start, addressed to this harness's
        controller; the parent chain of a captured transid is kept."""
        msg = copy.deepcopy(load_fixture(fixture))
        msg["activationId"] = secrets.token_hex(16)
        fresh = new_transid()
        tid = msg["transid"]
        msg["transid"] = [fresh[0], fresh[1], *tid[2:]]
        msg["rootControllerIndex"] = {"asString": self.controller, "instanceType": "controller"}
        if path is not None:
            msg["action"]["path"] = path
        if name is not None:
            msg["action"]["name"] = name
        if revision is not UNSET:
            msg["revision"] = revision
        if blocking is not None:
            msg["blocking"] = blocking
        if content is not UNSET:
            if content is None:
                msg.pop("content", None)
            else:
                msg["content"] = content
        if limits is not None:
            msg["user"]["limits"] = limits
        for key in drop:
            msg.pop(key, None)
        return msg

    async def publish(self, msg: dict[str, Any] | bytes, *, shuffle: bool = False) -> int:
        """Put one record on ``invoker{N}``; returns its offset."""
        assert self._producer is not None
        if isinstance(msg, dict):
            self.sent[str(msg.get("activationId", ""))] = msg
            payload = compact(shuffled(msg, self._rng) if shuffle else msg)
        else:
            payload = msg
        metadata = await self._producer.send_and_wait(self.invoker_topic, payload)
        return int(metadata.offset)

    async def committed(self, group: str) -> int | None:
        """The group's committed offset of ``invoker{N}`` partition 0 (what a restart resumes from)."""
        # Not subscribed, so it never joins the group (which would take the partition from the invoker).
        probe = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=group, enable_auto_commit=False)
        await probe.start()
        try:
            offset = await probe.committed(TopicPartition(self.invoker_topic, 0))
        finally:
            await probe.stop()
        return None if offset is None else int(offset)

    async def wait_for(self, predicate: Any, *, timeout: float = 20.0) -> Any:
        async with self._changed:
            return await asyncio.wait_for(self._changed.wait_for(predicate), timeout)

    async def wait_acks(self, activation_id: str, count: int, *, timeout: float = 20.0) -> list[ReceivedAck]:
        await self.wait_for(lambda: len(self.acks.get(activation_id, ())) >= count, timeout=timeout)
        return list(self.acks[activation_id])

    async def wait_completion(self, activation_id: str, *, timeout: float = 20.0) -> list[ReceivedAck]:
        """All acks of the activation up to the one that frees the slot (the last one the invoker sends)."""
        await self.wait_for(lambda: any(a.kind != "result" for a in self.acks.get(activation_id, ())),
                            timeout=timeout)
        return list(self.acks[activation_id])

    async def wait_ping(self, predicate: Any, *, after: float | None = None, timeout: float = 20.0) -> dict[str, Any]:
        since = time.monotonic() if after is None else after

        def found() -> dict[str, Any] | None:
            return next((p for t, p in self.pings if t >= since and predicate(p)), None)

        await self.wait_for(lambda: found() is not None, timeout=timeout)
        ping = found()
        assert ping is not None
        return ping

    def pings_since(self, since: float) -> list[dict[str, Any]]:
        return [p for t, p in self.pings if t >= since]
