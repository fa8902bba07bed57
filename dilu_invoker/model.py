"""Value types shared by the fronts, the invoker and the control plane.

They mirror OpenWhisk's entities (``WhiskAction``, ``WhiskActivation``, ``ActivationResponse``,
``Identity``) closely enough that the JSON they produce is what OpenWhisk clients and the controller
read. Everything here is immutable; parsing from JSON validates and raises :class:`ValidationError`
with a message fit to send back to a user.
"""

from __future__ import annotations

import enum
import json
import math
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

JsonValue = Any

#: OpenWhisk's entity-name rule (``EntityName.REGEX``) and its length bound.
ENTITY_NAME_RE = re.compile(r"\A([\w]|[\w][\w@ .-]*[\w@.-]+)\Z")
ENTITY_NAME_MAX = 256
ACTIVATION_ID_RE = re.compile(r"\A[0-9a-f]{32}\Z")
DEFAULT_VERSION = "0.0.1"


class ValidationError(ValueError):
    """Input that OpenWhisk would reject with a 400; the message is shown to the user."""


class ActivationStatus(enum.IntEnum):
    """OpenWhisk's ``ActivationResponse`` status codes (``ActivationResult.scala``)."""

    SUCCESS = 0
    APPLICATION_ERROR = 1
    DEVELOPER_ERROR = 2
    WHISK_ERROR = 3

    @property
    def api_string(self) -> str:
        return _STATUS_STRINGS[self]

    @property
    def is_system_error(self) -> bool:
        return self is ActivationStatus.WHISK_ERROR


_STATUS_STRINGS = {
    ActivationStatus.SUCCESS: "success",
    ActivationStatus.APPLICATION_ERROR: "application error",
    ActivationStatus.DEVELOPER_ERROR: "action developer error",
    ActivationStatus.WHISK_ERROR: "whisk internal error",
}


def new_activation_id() -> str:
    return secrets.token_hex(16)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def validate_entity_name(name: str, *, what: str = "name") -> str:
    if not isinstance(name, str) or len(name) > ENTITY_NAME_MAX or not ENTITY_NAME_RE.match(name):
        raise ValidationError(
            f"The {what} '{name}' is not valid: names must start with a letter, digit or underscore, "
            f"may contain letters, digits, '@', '.', '-', '_' and spaces, and be at most "
            f"{ENTITY_NAME_MAX} characters."
        )
    return name


# --------------------------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LimitBounds:
    """Bounds OpenWhisk's controller enforces on action limits (``whisk.memory`` etc.)."""

    timeout_ms: tuple[int, int] = (100, 300_000)
    memory_mb: tuple[int, int] = (128, 512 * 1024)
    logs_mb: tuple[int, int] = (0, 10)
    concurrency: tuple[int, int] = (1, 500)


@dataclass(frozen=True, slots=True)
class ActionLimits:
    timeout_ms: int = 60_000
    memory_mb: int = 256
    logs_mb: int = 10
    concurrency: int = 1

    def to_json(self) -> dict[str, int]:
        return {
            "timeout": self.timeout_ms,
            "memory": self.memory_mb,
            "logs": self.logs_mb,
            "concurrency": self.concurrency,
        }

    @classmethod
    def from_json(
        cls, obj: JsonValue, *, bounds: LimitBounds | None = None, base: ActionLimits | None = None
    ) -> ActionLimits:
        base = base or cls()
        if obj is None:
            return base
        if not isinstance(obj, Mapping):
            raise ValidationError("The request content was malformed: 'limits' must be an object.")
        bounds = bounds or LimitBounds()
        values: dict[str, int] = {}
        for key, attr in (
            ("timeout", "timeout_ms"),
            ("memory", "memory_mb"),
            ("logs", "logs_mb"),
            ("concurrency", "concurrency"),
        ):
            raw = obj.get(key)
            if raw is None:
                values[attr] = getattr(base, attr)
                continue
            if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw:
                raise ValidationError(f"The request content was malformed: limit '{key}' must be an integer.")
            lo, hi = getattr(bounds, attr)
            if not lo <= raw <= hi:
                raise ValidationError(f"{key} limit {int(raw)} exceeds allowed threshold: must be in [{lo}, {hi}].")
            values[attr] = int(raw)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Exec:
    """``exec`` of an action: a runtime kind with code, or a docker image (``kind == "blackbox"``)."""

    kind: str
    code: str | None = None
    binary: bool = False
    main: str | None = None
    image: str | None = None

    def to_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {"kind": self.kind}
        if self.image is not None:
            out["image"] = self.image
        if self.code is not None:
            out["code"] = self.code
        out["binary"] = self.binary
        if self.main is not None:
            out["main"] = self.main
        return out

    @classmethod
    def from_json(cls, obj: JsonValue) -> Exec:
        if not isinstance(obj, Mapping):
            raise ValidationError("The request content was malformed: 'exec' must be an object.")
        kind = obj.get("kind")
        if not isinstance(kind, str) or not kind:
            raise ValidationError("The request content was malformed: exec 'kind' is missing.")
        code = obj.get("code")
        if code is not None and not isinstance(code, str):
            raise ValidationError("The request content was malformed: exec 'code' must be a string.")
        main = obj.get("main")
        if main is not None and (not isinstance(main, str) or not main):
            raise ValidationError("The request content was malformed: exec 'main' must be a string.")
        image = obj.get("image")
        if image is not None and not isinstance(image, str):
            raise ValidationError("The request content was malformed: exec 'image' must be a string.")
        binary = obj.get("binary")
        if binary is None:
            binary = is_binary_code(code) if code is not None else False
        elif not isinstance(binary, bool):
            raise ValidationError("The request content was malformed: exec 'binary' must be a boolean.")
        return cls(kind=kind.lower(), code=code, binary=binary, main=main, image=image)


_BASE64_RE = re.compile(r"\A[A-Za-z0-9+/]*={0,2}\Z")


def is_binary_code(code: str) -> bool:
    """OpenWhisk's ``Exec.isBinaryCode``: trimmed code is base64 with a length divisible by 4."""
    trimmed = code.strip()
    return bool(trimmed) and len(trimmed) % 4 == 0 and bool(_BASE64_RE.match(trimmed))


@dataclass(frozen=True, slots=True)
class Parameter:
    key: str
    value: JsonValue
    init: bool = False

    def to_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {"key": self.key, "value": self.value}
        if self.init:
            out["init"] = True
        return out


def parse_key_values(obj: JsonValue, what: str) -> tuple[Parameter, ...]:
    """Parse OpenWhisk's ``[{"key": k, "value": v}]`` lists (a plain object is accepted too)."""
    if obj is None:
        return ()
    if isinstance(obj, Mapping):
        return tuple(Parameter(str(k), v) for k, v in obj.items())
    if not isinstance(obj, list):
        raise ValidationError(f"The request content was malformed: '{what}' must be an array.")
    out: list[Parameter] = []
    for item in obj:
        if not isinstance(item, Mapping) or not isinstance(item.get("key"), str):
            raise ValidationError(f"The request content was malformed: every entry of '{what}' needs a 'key'.")
        out.append(Parameter(item["key"], item.get("value"), bool(item.get("init", False))))
    return tuple(out)


class GpuClass(enum.StrEnum):
    INFERENCE = "inference"
    TRAINING = "training"
    LLM = "llm"

    @property
    def latency_critical(self) -> bool:
        return self is not GpuClass.TRAINING


#: the function name prefix of a pre-loaded container's GPU placeholder (``preload:<kind>``): its budget
#: reservation holds GPU memory only, no SM request or limit — the process holds a CUDA context and launches
#: nothing until a function takes it, and the share then becomes the function's
PRELOAD_FUNCTION_PREFIX = "preload:"


def weights_group(invoker: str, function: str, revision: str) -> str:
    """The group whose read-only weights a GPU budget counts once (``GpuNeeds.weights_mb``): the instances
    of one function revision started by one invoker — each invoker derives its own models key (a secret of
    its own), so instances of two invokers on one GPU cannot map each other's weights."""
    return f"{invoker}:{function}@{revision}"


#: the most pipeline stages one instance may be split into (annotation ``gpu-stages``)
MAX_STAGES = 8
#: the most GPUs one instance may take as a gang (``gpu-count``): the GPUs of one invoker
MAX_GANG = 8


@dataclass(frozen=True, slots=True)
class GpuNeeds:
    """What a GPU action asks for, read from its annotations (see docs/rest-api.md, "GPU annotations")."""

    gpu_class: GpuClass = GpuClass.INFERENCE
    sm_request: float = 0.2
    sm_limit: float = 0.5
    memory_mb: int = 4096
    slo_ms: float | None = None
    min_instances: int = 0
    max_instances: int = 8
    #: thread blocks per ms the action launches with a whole GPU, as measured by the profiler; None: the GPU
    #: manager estimates it online (docs/gpu-manager.md)
    capacity_blocks_per_ms: float | None = None
    #: how much of ``memory_mb`` is read-only weights that instances of one revision on one GPU share through
    #: the models API (docs/runtime.md): the GPU budget counts them once per GPU
    weights_mb: int = 0
    #: the most pipeline stages the action's code serves (``dilu_invoker.actions.pipeline``): the balancer may
    #: split an ``llm`` instance over up to this many GPUs of one invoker (docs/balancer.md, "Split instances")
    stages: int = 1
    #: GPUs each instance takes, all on one invoker (``gpu-count``): above 1 an instance is a *gang* of that many
    #: worker processes ("ranks"), one per GPU, each holding ``sm_request``/``sm_limit`` and ``memory_mb`` there,
    #: started and stopped together (data-parallel training; docs/balancer.md, "Gangs")
    gpus: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.sm_request <= 1.0:
            raise ValidationError("Annotation 'gpu-sm-request' must be a number in (0, 1].")
        if not 0.0 < self.sm_limit <= 1.0:
            raise ValidationError("Annotation 'gpu-sm-limit' must be a number in (0, 1].")
        if self.sm_limit < self.sm_request:
            raise ValidationError("Annotation 'gpu-sm-limit' must not be below 'gpu-sm-request'.")
        if self.memory_mb <= 0:
            raise ValidationError("Annotation 'gpu-memory-mb' must be a positive integer.")
        if self.slo_ms is not None and self.slo_ms <= 0:
            raise ValidationError("Annotation 'gpu-slo-ms' (or 'slo-ms') must be a positive number.")
        if self.min_instances < 0 or self.max_instances < max(1, self.min_instances):
            raise ValidationError(
                "Annotations 'min-instances'/'max-instances' must satisfy 0 <= min <= max and max >= 1."
            )
        if self.capacity_blocks_per_ms is not None and not (
            math.isfinite(self.capacity_blocks_per_ms) and self.capacity_blocks_per_ms > 0
        ):
            raise ValidationError("Annotation 'gpu-capacity-blocks-per-ms' must be a positive number.")
        if not 0 <= self.weights_mb <= self.memory_mb:
            raise ValidationError("Annotation 'gpu-weights-mb' must be an integer from 0 to 'gpu-memory-mb'.")
        if not 1 <= self.stages <= MAX_STAGES:
            raise ValidationError(f"Annotation 'gpu-stages' must be an integer from 1 to {MAX_STAGES}.")
        if self.stages > 1 and self.gpu_class is not GpuClass.LLM:
            raise ValidationError("Annotation 'gpu-stages' above 1 needs 'gpu-class' llm.")
        if self.stages > 1 and self.weights_mb:
            raise ValidationError("Annotation 'gpu-stages' above 1 cannot go with 'gpu-weights-mb' "
                                  "(a stage holds a part of the weights, which no other instance shares).")
        if not 1 <= self.gpus <= MAX_GANG:
            raise ValidationError(f"Annotation 'gpu-count' must be an integer from 1 to {MAX_GANG}.")
        if self.gpus > 1 and self.stages > 1:
            raise ValidationError("Annotation 'gpu-count' above 1 cannot go with 'gpu-stages' above 1 (a gang's "
                                  "ranks each hold the whole model; pipeline stages each hold a part).")
        if self.gpus > 1 and self.weights_mb:
            raise ValidationError("Annotation 'gpu-count' above 1 cannot go with 'gpu-weights-mb' (a gang's ranks "
                                  "share no weights with other instances).")

    ANNOTATIONS = (
        "gpu-class",
        "gpu-sm-request",
        "gpu-sm-limit",
        "gpu-memory-mb",
        "gpu-slo-ms",
        "slo-ms",
        "min-instances",
        "max-instances",
        "gpu-capacity-blocks-per-ms",
        "gpu-weights-mb",
        "gpu-stages",
        "gpu-count",
    )

    @classmethod
    def gpus_of(cls, annotations: Mapping[str, JsonValue]) -> int:
        """GPUs each instance of an action with these annotations takes (``gpu-count``): 1 without the annotation,
        and 1 when the annotations are invalid (whoever reads them whole explains why)."""
        if "gpu-count" not in annotations:
            return 1
        try:
            return cls.from_annotations(annotations).gpus
        except ValidationError:
            return 1

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, JsonValue], *, base: GpuNeeds | None = None) -> GpuNeeds:
        base = base or cls()

        def number(key: str, default: float | None) -> float | None:
            raw = annotations.get(key)
            if raw is None:
                return default
            try:
                if isinstance(raw, bool):
                    raise ValueError
                return float(raw)
            except (TypeError, ValueError):
                raise ValidationError(f"Annotation '{key}' must be a number, got {raw!r}.") from None

        def integer(key: str, default: int) -> int:
            value = number(key, default)
            assert value is not None
            if value != int(value):
                raise ValidationError(f"Annotation '{key}' must be an integer.")
            return int(value)

        raw_class = annotations.get("gpu-class", base.gpu_class.value)
        try:
            gpu_class = GpuClass(str(raw_class).lower())
        except ValueError:
            raise ValidationError(
                f"Annotation 'gpu-class' must be one of {', '.join(c.value for c in GpuClass)}; got {raw_class!r}."
            ) from None
        request = number("gpu-sm-request", base.sm_request)
        limit = number("gpu-sm-limit", None)
        assert request is not None
        if limit is None:
            limit = max(request, base.sm_limit)
        return cls(
            gpu_class=gpu_class,
            sm_request=request,
            sm_limit=limit,
            memory_mb=integer("gpu-memory-mb", base.memory_mb),
            # gpu-slo-ms is the vertical controller's objective; slo-ms, its older name, still counts.
            slo_ms=number("gpu-slo-ms", number("slo-ms", base.slo_ms)),
            min_instances=integer("min-instances", base.min_instances),
            max_instances=integer("max-instances", base.max_instances),
            capacity_blocks_per_ms=number("gpu-capacity-blocks-per-ms", base.capacity_blocks_per_ms),
            weights_mb=integer("gpu-weights-mb", base.weights_mb),
            stages=integer("gpu-stages", base.stages),
            gpus=integer("gpu-count", base.gpus),
        )


@dataclass(frozen=True, slots=True)
class Action:
    namespace: str
    name: str
    exec: Exec
    limits: ActionLimits = field(default_factory=ActionLimits)
    parameters: tuple[Parameter, ...] = ()
    annotations: tuple[Parameter, ...] = ()
    version: str = DEFAULT_VERSION
    publish: bool = False
    updated: int = 0
    revision: str | None = None

    @property
    def fqn(self) -> str:
        """``namespace[/package]/name`` without a leading slash (OpenWhisk's ``path`` annotation)."""
        return f"{self.namespace}/{self.name}"

    @property
    def action_name(self) -> str:
        """``/namespace[/package]/name`` as the runtime sees it in ``__OW_ACTION_NAME``."""
        return f"/{self.fqn}"

    def annotation(self, key: str, default: JsonValue = None) -> JsonValue:
        for a in self.annotations:
            if a.key == key:
                return a.value
        return default

    @property
    def annotation_map(self) -> dict[str, JsonValue]:
        return {a.key: a.value for a in self.annotations}

    @property
    def default_params(self) -> dict[str, JsonValue]:
        return {p.key: p.value for p in self.parameters}

    @property
    def init_param_names(self) -> tuple[str, ...]:
        return tuple(p.key for p in self.parameters if p.init)

    def provide_api_key(self) -> bool:
        value = self.annotation("provide-api-key")
        return True if value is None else bool(value)

    def to_json(self) -> dict[str, JsonValue]:
        """The REST API's view of an action (``WhiskAction`` JSON)."""
        return {
            "namespace": self.namespace,
            "name": self.name,
            "version": self.version,
            "exec": self.exec.to_json(),
            "annotations": [a.to_json() for a in self.annotations],
            "parameters": [p.to_json() for p in self.parameters],
            "limits": self.limits.to_json(),
            "publish": self.publish,
            "updated": self.updated,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, JsonValue]) -> Action:
        """Read an action stored by :meth:`to_json` (or an OpenWhisk whisks document)."""
        rev = obj.get("_rev") or obj.get("revision")
        return cls(
            namespace=str(obj["namespace"]),
            name=str(obj["name"]),
            exec=Exec.from_json(obj["exec"]),
            limits=ActionLimits.from_json(obj.get("limits"), bounds=_LAX_BOUNDS),
            parameters=parse_key_values(obj.get("parameters"), "parameters"),
            annotations=parse_key_values(obj.get("annotations"), "annotations"),
            version=str(obj.get("version", DEFAULT_VERSION)),
            publish=bool(obj.get("publish", False)),
            updated=int(obj.get("updated", 0)),
            revision=str(rev) if rev is not None else None,
        )


# Stored documents were validated when they were written; reading them back must not fail on a bound
# that has since been tightened.
_LAX_BOUNDS = LimitBounds(
    timeout_ms=(1, 2**62), memory_mb=(1, 2**62), logs_mb=(0, 2**62), concurrency=(1, 2**62)
)


def bump_version(version: str) -> str:
    """OpenWhisk's ``SemVer.upPatch``: ``0.0.1`` → ``0.0.2``."""
    parts = version.split(".")
    try:
        major, minor, patch = (int(p) for p in parts)
    except ValueError:
        return DEFAULT_VERSION
    return f"{major}.{minor}.{patch + 1}"


# --------------------------------------------------------------------------------------------
# Identities and activations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Identity:
    subject: str
    namespace: str
    uuid: str
    key: str
    store_activations: bool = True

    @property
    def api_key(self) -> str:
        return f"{self.uuid}:{self.key}"


#: OpenWhisk's well-known guest key (``ansible/files/auth.guest``).
GUEST_IDENTITY = Identity(
    subject="guest",
    namespace="guest",
    uuid="23bc46b1-71f6-4ed5-8c54-816aa4f8c502",
    key="123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP",
)


def new_transid() -> list[JsonValue]:
    """A user transaction id as OpenWhisk serializes it: ``[32-char alphanumeric id, start epoch ms]``
    (hex digits: one call per invoke instead of 32 ``secrets.choice`` calls, 5% of a warm invoke's CPU)."""
    return [secrets.token_hex(16), now_ms()]


@dataclass(frozen=True, slots=True)
class ActivationRequest:
    """One activation for the invoker: OpenWhisk's ``ActivationMessage`` with the action resolved."""

    activation_id: str
    action: Action
    identity: Identity
    content: dict[str, JsonValue] | list[JsonValue] | None = None
    transid: JsonValue = field(default_factory=new_transid)
    init_args: tuple[str, ...] = ()
    blocking: bool = False
    cause: str | None = None
    binding: str | None = None

    @property
    def transid_id(self) -> str:
        if isinstance(self.transid, list) and self.transid and isinstance(self.transid[0], str):
            return self.transid[0]
        return str(self.transid)

    @property
    def transid_start_ms(self) -> int | None:
        if isinstance(self.transid, list) and len(self.transid) > 1 and isinstance(self.transid[1], int):
            return self.transid[1]
        return None


@dataclass(frozen=True, slots=True)
class ActivationResponse:
    status: ActivationStatus
    result: JsonValue = None
    size: int | None = None

    @classmethod
    def success(cls, result: JsonValue, size: int | None = None) -> ActivationResponse:
        return cls(ActivationStatus.SUCCESS, result, size)

    @classmethod
    def application_error(cls, error: JsonValue) -> ActivationResponse:
        return cls(ActivationStatus.APPLICATION_ERROR, {"error": error})

    @classmethod
    def developer_error(cls, error: JsonValue) -> ActivationResponse:
        return cls(ActivationStatus.DEVELOPER_ERROR, {"error": error})

    @classmethod
    def whisk_error(cls, error: JsonValue) -> ActivationResponse:
        return cls(ActivationStatus.WHISK_ERROR, {"error": error})

    @property
    def is_success(self) -> bool:
        return self.status is ActivationStatus.SUCCESS

    def to_json(self) -> dict[str, JsonValue]:
        """Stored/acked form: ``{"statusCode", "result"?, "size"?}``."""
        out: dict[str, JsonValue] = {"statusCode": int(self.status)}
        if self.result is not None:
            out["result"] = self.result
        if self.size is not None:
            out["size"] = self.size
        return out

    def to_api_json(self) -> dict[str, JsonValue]:
        """REST API form (``toExtendedJson``)."""
        out: dict[str, JsonValue] = {
            "status": self.status.api_string,
            "statusCode": int(self.status),
            "success": self.is_success,
        }
        if self.result is not None:
            out["result"] = self.result
        if self.size is not None:
            out["size"] = self.size
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, JsonValue]) -> ActivationResponse:
        if "statusCode" in obj:
            status = ActivationStatus(int(obj["statusCode"]))
        else:
            status = {v: k for k, v in _STATUS_STRINGS.items()}.get(str(obj.get("status")), ActivationStatus.WHISK_ERROR)
        return cls(status, obj.get("result"), obj.get("size"))


@dataclass(frozen=True, slots=True)
class Activation:
    """OpenWhisk's ``WhiskActivation``."""

    namespace: str
    name: str
    subject: str
    activation_id: str
    start: int
    end: int
    response: ActivationResponse
    logs: tuple[str, ...] = ()
    version: str = DEFAULT_VERSION
    publish: bool = False
    annotations: tuple[Parameter, ...] = ()
    cause: str | None = None

    @property
    def duration(self) -> int:
        return max(0, self.end - self.start)

    def annotation(self, key: str, default: JsonValue = None) -> JsonValue:
        for a in self.annotations:
            if a.key == key:
                return a.value
        return default

    def without_logs(self) -> Activation:
        return replace(self, logs=())

    def to_json(self) -> dict[str, JsonValue]:
        """The form written to the activations database and sent in acks."""
        out: dict[str, JsonValue] = {
            "namespace": self.namespace,
            "name": self.name,
            "subject": self.subject,
            "activationId": self.activation_id,
            "start": self.start,
            "end": self.end,
            "duration": self.duration,
            "response": self.response.to_json(),
            "logs": list(self.logs),
            "version": self.version,
            "publish": self.publish,
            "annotations": [a.to_json() for a in self.annotations],
        }
        if self.cause is not None:
            out["cause"] = self.cause
        return out

    def to_api_json(self) -> dict[str, JsonValue]:
        out = self.to_json()
        out["response"] = self.response.to_api_json()
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, JsonValue]) -> Activation:
        return cls(
            namespace=str(obj["namespace"]),
            name=str(obj["name"]),
            subject=str(obj.get("subject", obj["namespace"])),
            activation_id=str(obj["activationId"]),
            start=int(obj.get("start", 0)),
            end=int(obj.get("end", 0)),
            response=ActivationResponse.from_json(obj.get("response") or {}),
            logs=tuple(str(x) for x in obj.get("logs") or ()),
            version=str(obj.get("version", DEFAULT_VERSION)),
            publish=bool(obj.get("publish", False)),
            annotations=parse_key_values(obj.get("annotations"), "annotations"),
            cause=obj.get("cause"),
        )


def json_size(value: JsonValue) -> int:
    """Bytes of the compact JSON encoding, as OpenWhisk sizes results and payloads."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def merge_params(*layers: Mapping[str, JsonValue] | None) -> dict[str, JsonValue]:
    out: dict[str, JsonValue] = {}
    for layer in layers:
        if layer:
            out.update(layer)
    return out


def annotations_of(pairs: Iterable[tuple[str, JsonValue]]) -> tuple[Parameter, ...]:
    return tuple(Parameter(k, v) for k, v in pairs)
