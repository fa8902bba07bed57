"""Wire formats of OpenWhisk's legacy controller ↔ invoker protocol (Kafka topics ``invoker{N}``,
``completed{C}``, ``health`` and ``events``).

Everything here is pure: parse bytes into frozen values, build frozen values, serialize them to the bytes
the Scala side reads (``reference/openwhisk.md`` §1, §2). Three rules shape the code:

* **Parse tolerantly.** spray writes object fields in no stable order and omits ``None`` fields; ids may
  arrive as JSON numbers; ``content`` may be an array; ``transid`` may carry a nested parent chain.
* **Echo ``transid`` unchanged.** The controller compares the parsed value, start timestamp included, so
  the raw parsed JSON value is kept and written back as is (compact, integers stay integers).
* **Write what the controller's readers require.** ``tags``/``dedicatedNamespaces`` in every
  ``InvokerInstanceId``; ``logs``, ``version``, ``publish`` and ``annotations`` in every activation.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dilu_invoker.invoker.api import never_ran
from dilu_invoker.model import (
    Action,
    Activation,
    ActivationRequest,
    ActivationResponse,
    Identity,
    JsonValue,
    Parameter,
    now_ms,
)

#: ``ActivationId.parse``: exactly 32 lower-case hex digits.
_ACTIVATION_ID_RE = re.compile(r"\A[0-9a-f]{32}\Z")
#: ``ControllerInstanceId``: the id becomes part of a topic name.
_CONTROLLER_ID_RE = re.compile(r"\A[a-zA-Z0-9._-]{1,128}\Z")
#: What the health-test identity and the controller's own system requests use (``TransactionId``).
UNKNOWN_TRANSID: list[JsonValue] = ["sid_unknown", 0]
#: ``InvokerPool.healthAction``: ``whisk.system/invokerHealthTestAction{controller}``.
HEALTH_NAMESPACE = "whisk.system"
HEALTH_ACTION_PREFIX = "invokerHealthTestAction"


def dumps(value: JsonValue) -> bytes:
    """spray's ``compactPrint``: no whitespace, UTF-8, non-ASCII written as is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


# --------------------------------------------------------------------------------------------
# ActivationMessage (controller → invoker)
# --------------------------------------------------------------------------------------------


class MalformedMessage(ValueError):
    """An ``invoker{N}`` record that is not a readable ActivationMessage.

    Carries what could still be read, so the caller can answer with a whisk-error ack when the
    activation id (and hence the controller's bookkeeping entry) is known.
    """

    def __init__(
        self,
        reason: str,
        *,
        activation_id: str | None = None,
        controller: str | None = None,
        transid: JsonValue = None,
        namespace: str | None = None,
        subject: str | None = None,
        action_path: str | None = None,
        action_name: str | None = None,
        blocking: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.activation_id = activation_id
        self.controller = controller
        self.transid = transid
        self.namespace = namespace
        self.subject = subject
        self.action_path = action_path
        self.action_name = action_name
        self.blocking = blocking


@dataclass(frozen=True, slots=True)
class UserInfo:
    """The ``user`` (``Identity``) of an ActivationMessage, as far as the invoker needs it."""

    subject: str
    namespace: str
    namespace_uuid: str
    api_key: str | None = None
    limits: Mapping[str, JsonValue] = field(default_factory=dict)
    rights: tuple[str, ...] = ()

    @property
    def store_activations(self) -> bool:
        """``UserLimits.storeActivations``: only an explicit ``false`` turns storing off."""
        return self.limits.get("storeActivations") is not False

    def identity(self) -> Identity:
        uuid, key = self.namespace_uuid, ""
        if self.api_key and ":" in self.api_key:
            uuid, _, key = self.api_key.partition(":")
        return Identity(
            subject=self.subject,
            namespace=self.namespace,
            uuid=uuid,
            key=key,
            store_activations=self.store_activations,
        )


@dataclass(frozen=True, slots=True)
class ActivationMessage:
    """``ActivationMessage`` (``common/.../connector/Message.scala``, ``jsonFormat12``)."""

    transid: JsonValue
    action_path: str
    action_name: str
    user: UserInfo
    activation_id: str
    controller: str
    blocking: bool = False
    revision: str | None = None
    action_version: str | None = None
    binding: str | None = None
    content: dict[str, JsonValue] | list[JsonValue] | None = None
    init_args: tuple[str, ...] = ()
    locked_args: Mapping[str, str] = field(default_factory=dict)
    cause: str | None = None
    trace_context: Mapping[str, str] | None = None

    @property
    def fqn(self) -> str:
        """``path/name`` without version: the document id and the ``path`` annotation."""
        return f"{self.action_path}/{self.action_name}"

    @property
    def is_health_test(self) -> bool:
        return self.action_path == HEALTH_NAMESPACE and self.action_name.startswith(HEALTH_ACTION_PREFIX)

    @property
    def transid_id(self) -> str:
        return transid_id(self.transid)

    def to_request(self, action: Action) -> ActivationRequest:
        return ActivationRequest(
            activation_id=self.activation_id,
            action=action,
            identity=self.user.identity(),
            content=self.content,
            transid=self.transid,
            init_args=self.init_args,
            blocking=self.blocking,
            cause=self.cause,
            binding=self.binding,
        )

    @classmethod
    def parse(cls, data: bytes | str) -> ActivationMessage:
        """Read one record value; raises :class:`MalformedMessage` with whatever could be salvaged."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedMessage(f"not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise MalformedMessage(f"not a JSON object but {type(obj).__name__}")
        salvage = _salvage(obj)
        try:
            return cls._from_object(obj)
        except _FieldError as exc:
            raise MalformedMessage(str(exc), **salvage) from None

    @classmethod
    def _from_object(cls, obj: Mapping[str, Any]) -> ActivationMessage:
        transid = _required(obj, "transid")
        if not _valid_transid(transid):
            raise _FieldError(f"'transid' must be [id, startMillis, ...], got {_short(transid)}")
        action = _object(obj, "action")
        user = _parse_user(_object(obj, "user"))
        activation_id = _activation_id(_required(obj, "activationId"))
        controller = _controller(_required(obj, "rootControllerIndex"))
        blocking = obj.get("blocking", False)
        if not isinstance(blocking, bool):
            raise _FieldError("'blocking' must be a boolean")
        revision = obj.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise _FieldError("'revision' must be a string or null")
        content = obj.get("content")
        if content is not None and not isinstance(content, (dict, list)):
            raise _FieldError("'content' must be an object or an array")
        init_args = obj.get("initArgs", [])
        if not isinstance(init_args, list) or not all(isinstance(a, str) for a in init_args):
            raise _FieldError("'initArgs' must be an array of strings")
        locked_args = obj.get("lockedArgs", {})
        if not isinstance(locked_args, dict):
            raise _FieldError("'lockedArgs' must be an object")
        cause = obj.get("cause")
        if cause is not None:
            cause = _activation_id(cause, what="cause")
        trace_context = obj.get("traceContext")
        if trace_context is not None and not isinstance(trace_context, dict):
            raise _FieldError("'traceContext' must be an object")
        return cls(
            transid=transid,
            action_path=_string(action, "path", where="action"),
            action_name=_string(action, "name", where="action"),
            action_version=_optional_string(action, "version", where="action"),
            binding=_optional_string(action, "binding", where="action"),
            user=user,
            activation_id=activation_id,
            controller=controller,
            blocking=blocking,
            revision=revision or None,
            content=content,
            init_args=tuple(init_args),
            locked_args={str(k): str(v) for k, v in locked_args.items()},
            cause=cause,
            trace_context=trace_context,
        )


class _FieldError(ValueError):
    pass


def _short(value: JsonValue) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _required(obj: Mapping[str, Any], key: str) -> Any:
    if key not in obj or obj[key] is None:
        raise _FieldError(f"'{key}' is missing")
    return obj[key]


def _object(obj: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = _required(obj, key)
    if not isinstance(value, dict):
        raise _FieldError(f"'{key}' must be an object")
    return value


def _string(obj: Mapping[str, Any], key: str, *, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise _FieldError(f"'{where}.{key}' must be a non-empty string")
    return value


def _optional_string(obj: Mapping[str, Any], key: str, *, where: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _FieldError(f"'{where}.{key}' must be a string")
    return value


def _valid_transid(value: JsonValue) -> bool:
    """``TransactionId.serdes``: ``[id, start]`` + optional ``true`` + optional parent (recursively)."""
    return (
        isinstance(value, list)
        and len(value) >= 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    )


def transid_id(transid: JsonValue) -> str:
    if isinstance(transid, list) and transid and isinstance(transid[0], str):
        return transid[0]
    return "sid_unknown"


def _activation_id(value: JsonValue, *, what: str = "activationId") -> str:
    # The Scala reader accepts a JSON number and reads its decimal digits (``ActivationId.serdes``).
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not _ACTIVATION_ID_RE.match(value):
        raise _FieldError(f"'{what}' must be 32 lower-case hex digits, got {_short(value)}")
    return value


def _controller(value: JsonValue) -> str:
    if isinstance(value, dict):
        value = value.get("asString")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not _CONTROLLER_ID_RE.match(value):
        raise _FieldError("'rootControllerIndex.asString' must be a controller id ([a-zA-Z0-9._-]+)")
    return value


def _parse_user(user: Mapping[str, Any]) -> UserInfo:
    namespace = user.get("namespace")
    if not isinstance(namespace, dict):
        raise _FieldError("'user.namespace' must be an object")
    ns_name = namespace.get("name")
    if not isinstance(ns_name, str) or not ns_name:
        raise _FieldError("'user.namespace.name' must be a non-empty string")
    ns_uuid = namespace.get("uuid", "")
    subject = user.get("subject", ns_name)
    if not isinstance(subject, str) or not isinstance(ns_uuid, str):
        raise _FieldError("'user.subject' and 'user.namespace.uuid' must be strings")
    authkey = user.get("authkey")
    api_key = authkey.get("api_key") if isinstance(authkey, dict) else None
    limits = user.get("limits") or {}
    if not isinstance(limits, dict):
        raise _FieldError("'user.limits' must be an object")
    rights = user.get("rights") or []
    return UserInfo(
        subject=subject,
        namespace=ns_name,
        namespace_uuid=ns_uuid,
        api_key=api_key if isinstance(api_key, str) else None,
        limits=limits,
        rights=tuple(str(r) for r in rights) if isinstance(rights, list) else (),
    )


def _salvage(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Best-effort fields of a broken message, for an error ack and an error record."""
    out: dict[str, Any] = {}
    try:
        out["activation_id"] = _activation_id(obj.get("activationId"))
    except _FieldError:
        pass
    try:
        out["controller"] = _controller(obj.get("rootControllerIndex"))
    except _FieldError:
        pass
    if _valid_transid(obj.get("transid")):
        out["transid"] = obj["transid"]
    user = obj.get("user")
    if isinstance(user, dict):
        ns = user.get("namespace")
        if isinstance(ns, dict) and isinstance(ns.get("name"), str):
            out["namespace"] = ns["name"]
        if isinstance(user.get("subject"), str):
            out["subject"] = user["subject"]
    action = obj.get("action")
    if isinstance(action, dict):
        if isinstance(action.get("path"), str):
            out["action_path"] = action["path"]
        if isinstance(action.get("name"), str):
            out["action_name"] = action["name"]
    if isinstance(obj.get("blocking"), bool):
        out["blocking"] = obj["blocking"]
    return out


# --------------------------------------------------------------------------------------------
# InvokerInstanceId, PingMessage
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InvokerInstance:
    """``InvokerInstanceId``. ``userMemory`` is the capacity the controller books against this invoker;
    it must stay the same for the life of the process (the controller sizes its slots once)."""

    instance: int
    user_memory_bytes: int
    unique_name: str | None = None
    displayed_name: str | None = None
    tags: tuple[str, ...] = ()
    dedicated_namespaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.instance < 0:
            raise ValueError("invoker id must be >= 0")
        if self.user_memory_bytes <= 0:
            raise ValueError("user memory must be positive")

    @property
    def source(self) -> str:
        """``InstanceId.source``, the ``source`` of event messages."""
        return f"invoker{self.instance}"

    def __str__(self) -> str:
        return "/".join([f"invoker{self.instance}", *(n for n in (self.unique_name, self.displayed_name) if n)])

    def to_json(self) -> dict[str, JsonValue]:
        # Field order of ``InvokerInstanceId.serdes.write``; the reader needs tags and dedicatedNamespaces.
        out: dict[str, JsonValue] = {
            "instance": self.instance,
            "userMemory": f"{self.user_memory_bytes} B",
            "instanceType": "invoker",
            "tags": list(self.tags),
            "dedicatedNamespaces": list(self.dedicated_namespaces),
        }
        if self.unique_name is not None:
            out["uniqueName"] = self.unique_name
        if self.displayed_name is not None:
            out["displayedName"] = self.displayed_name
        return out


def ping_message(instance: InvokerInstance, *, enabled: bool = True) -> bytes:
    """``PingMessage`` for topic ``health``."""
    return dumps({"name": instance.to_json(), "isEnabled": enabled})


# --------------------------------------------------------------------------------------------
# Acknowledgements (invoker → completed{C})
# --------------------------------------------------------------------------------------------


class AckKind(enum.StrEnum):
    """``AcknowledegmentMessage.messageType``; the controller tells them apart by field presence."""

    COMPLETION = "completion"
    RESULT = "result"
    COMBINED = "combined"


@dataclass(frozen=True, slots=True)
class Ack:
    kind: AckKind
    transid: JsonValue
    activation_id: str
    #: the record without logs; None for a completion or once shrunk to the id
    activation: Activation | None
    is_system_error: bool | None = None
    instance: InvokerInstance | None = None

    @property
    def frees_slot(self) -> bool:
        return self.kind is not AckKind.RESULT

    @property
    def shrunk(self) -> bool:
        return self.kind is not AckKind.COMPLETION and self.activation is None

    def shrink(self) -> Ack:
        """The form that fits the bus: the activation replaced by its id (``AcknowledegmentMessage.shrink``)."""
        return self if self.kind is AckKind.COMPLETION else replace(self, activation=None)

    def to_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {"transid": self.transid}
        if self.kind is AckKind.COMPLETION:
            out["activationId"] = self.activation_id
        else:
            out["response"] = self.activation.to_json() if self.activation is not None else self.activation_id
        if self.kind is not AckKind.RESULT:
            assert self.instance is not None
            out["isSystemError"] = bool(self.is_system_error)
            out["instance"] = self.instance.to_json()
        return out

    def serialize(self) -> bytes:
        return dumps(self.to_json())


def completion_ack(transid: JsonValue, activation: Activation, instance: InvokerInstance) -> Ack:
    return Ack(AckKind.COMPLETION, transid, activation.activation_id, None,
               activation.response.status.is_system_error, instance)


def result_ack(transid: JsonValue, activation: Activation) -> Ack:
    return Ack(AckKind.RESULT, transid, activation.activation_id, activation.without_logs(),
               activation.response.status.is_system_error)


def combined_ack(transid: JsonValue, activation: Activation, instance: InvokerInstance) -> Ack:
    return Ack(AckKind.COMBINED, transid, activation.activation_id, activation.without_logs(),
               activation.response.status.is_system_error, instance)


def acks_after_run(
    *, transid: JsonValue, activation: Activation, instance: InvokerInstance, blocking: bool, split: bool
) -> list[Ack]:
    """The acks ``ContainerProxy`` sends for an activation that reached a container, in order.

    ``split`` is ``action.limits.logs != 0``: the result goes out before log collection and the slot is
    freed after it. Non-blocking activations never carry their result (``MessagingActiveAck`` shrinks
    them anyway).
    """
    if blocking:
        if split:
            return [result_ack(transid, activation), completion_ack(transid, activation, instance)]
        return [combined_ack(transid, activation, instance)]
    return [completion_ack(transid, activation, instance)]


def acks_without_container(
    *, transid: JsonValue, activation: Activation, instance: InvokerInstance, blocking: bool
) -> list[Ack]:
    """Errors before a container exists (fetch failure, malformed message): one combined ack,
    shrunk to the id when nobody waits for the result."""
    ack = combined_ack(transid, activation, instance)
    return [ack if blocking else ack.shrink()]


# --------------------------------------------------------------------------------------------
# Activations built by the front itself
# --------------------------------------------------------------------------------------------

def fallback_activation(
    *,
    activation_id: str,
    namespace: str,
    subject: str,
    action_path: str,
    action_name: str,
    response: ActivationResponse,
    version: str | None = None,
    cause: str | None = None,
    now: int | None = None,
) -> Activation:
    """``InvokerReactive.generateFallbackActivation``: zero duration, ``kind: unknown`` (:func:`never_ran`)."""
    return never_ran(activation_id=activation_id, namespace=namespace, subject=subject,
                     path=f"{action_path}/{action_name}", response=response, version=version, cause=cause, now=now)


def fallback_for(msg: ActivationMessage, response: ActivationResponse, *, now: int | None = None) -> Activation:
    return fallback_activation(
        activation_id=msg.activation_id,
        namespace=msg.user.namespace,
        subject=msg.user.subject,
        action_path=msg.action_path,
        action_name=msg.action_name,
        response=response,
        version=msg.action_version,
        cause=msg.cause,
        now=now,
    )


#: ``InvokerPool.healthAction``: kind ``nodejs:default``, ``MemoryLimit.MIN_MEMORY``, other limits default.
HEALTH_ACTION_LIMITS = {"timeout": 60_000, "memory": 128, "logs": 10, "concurrency": 1}


def health_test_activation(msg: ActivationMessage, *, now: int | None = None) -> Activation:
    """The record of the controller's health test action, answered without a container.

    The action is ``function main(params) { return params; }``: the result is the parameters.
    """
    at = now_ms() if now is None else now
    start = transid_start(msg.transid)
    annotations = [
        Parameter("path", msg.fqn),
        Parameter("waitTime", max(0, at - start) if start is not None else 0),
        Parameter("kind", "nodejs:default"),
        Parameter("timeout", False),
        Parameter("limits", dict(HEALTH_ACTION_LIMITS)),
    ]
    result = msg.content if msg.content is not None else {}
    return Activation(
        namespace=msg.user.namespace,
        name=msg.action_name,
        subject=msg.user.subject,
        activation_id=msg.activation_id,
        start=at,
        end=at,
        response=ActivationResponse.success(result, size=len(dumps(result))),
        version=msg.action_version or "0.0.1",
        annotations=tuple(annotations),
        cause=msg.cause,
    )


def transid_start(transid: JsonValue) -> int | None:
    if _valid_transid(transid):
        return int(transid[1])
    return None


def activation_document(activation: Activation, *, updated: int | None = None) -> dict[str, JsonValue]:
    """The activations-database form (``WhiskEntity.toDocumentRecord``): logs included,
    ``_id = "{namespace}/{activationId}"``."""
    doc = activation.to_json()
    doc["_id"] = activation_doc_id(activation.namespace, activation.activation_id)
    doc["entityType"] = "activation"
    doc["updated"] = now_ms() if updated is None else updated
    return doc


def activation_doc_id(namespace: str, activation_id: str) -> str:
    return f"{namespace}/{activation_id}"


# --------------------------------------------------------------------------------------------
# User events (topic ``events``)
# --------------------------------------------------------------------------------------------


def activation_event(
    activation: Activation, *, source: str, user_uuid: str, now: int | None = None
) -> dict[str, JsonValue] | None:
    """``EventMessage.from``: None when the record lacks the ``path`` or ``kind`` annotation (the Scala
    side logs and drops those too)."""
    path = activation.annotation("path")
    kind = activation.annotation("kind")
    if not isinstance(path, str) or not isinstance(kind, str):
        return None

    def millis(key: str) -> int:
        value = activation.annotation(key)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0

    limits = activation.annotation("limits")
    memory = limits.get("memory", 0) if isinstance(limits, Mapping) else 0
    body: dict[str, JsonValue] = {
        "name": path,
        "activationId": activation.activation_id,
        "statusCode": int(activation.response.status),
        "duration": activation.duration,
        "waitTime": millis("waitTime"),
        "initTime": millis("initTime"),
        "kind": kind,
        "conductor": activation.annotation("conductor") is True,
        "memory": int(memory) if isinstance(memory, int) else 0,
    }
    caused_by = activation.annotation("causedBy")
    if isinstance(caused_by, str):
        body["causedBy"] = caused_by
    if activation.response.size is not None:
        body["size"] = activation.response.size
    status = _user_defined_status_code(activation.response.result)
    if status is not None:
        body["userDefinedStatusCode"] = status
    return {
        "source": source,
        "body": body,
        "subject": activation.subject,
        "namespace": activation.namespace,
        "userId": user_uuid,
        "eventType": "Activation",
        "timestamp": now_ms() if now is None else now,
    }


def _user_defined_status_code(result: JsonValue) -> int | None:
    """``Activation.userDefinedStatusCode``: ``error.statusCode`` or ``statusCode`` of the result; a
    value that is not an integer reads as 400."""
    if not isinstance(result, Mapping):
        return None
    error = result.get("error")
    raw = error.get("statusCode") if isinstance(error, Mapping) and "statusCode" in error else result.get("statusCode")
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw:
        return 400
    return int(raw)
