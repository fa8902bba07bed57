"""What invokers and the balancer exchange through Redis: key names and msgpack value types.

Both sides import this module (the invoker writes load reports and reads commands and routing tables,
the balancer the reverse), so the formats are defined once. Every value is a frozen dataclass encoded as
a msgpack map of its fields; decoding ignores fields it does not know and fills missing ones with their
defaults, so a newer writer and an older reader (or the reverse) keep working during a rolling upgrade.
The keyspace is documented in docs/redis-keyspace.md and docs/balancer.md.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, TypeVar

import msgpack

from dilu_invoker.model import Action, GpuNeeds, ValidationError

#: Consumer group of the per-invoker activation streams.
ACTIVATION_GROUP = "exec"
#: Consumer group of the per-invoker command streams.
COMMAND_GROUP = "invoker"


class WireError(ValueError):
    """A value read from Redis could not be decoded."""


@dataclass(frozen=True, slots=True)
class Keys:
    """Every key of the balancer and the routing layer, under the deployment's prefix."""

    prefix: str = "dilu:"

    # -- balancer ---------------------------------------------------------------------------------
    @property
    def lease(self) -> str:
        """String ``holder|epoch`` with a TTL: the leader lease."""
        return f"{self.prefix}bal:lease"

    @property
    def epoch(self) -> str:
        """Counter: the last epoch granted (every new leader increments it)."""
        return f"{self.prefix}bal:epoch"

    @property
    def instances(self) -> str:
        """Hash instance id → :class:`InstanceRecord`: the balancer's table of instances."""
        return f"{self.prefix}bal:instances"

    @property
    def demand(self) -> str:
        """Stream: routers signal a function with work waiting and no instance."""
        return f"{self.prefix}bal:demand"

    @property
    def decisions(self) -> str:
        """Stream: every decision the leader carried out, with its reason (bounded)."""
        return f"{self.prefix}bal:decisions"

    @property
    def compaction(self) -> str:
        """Hash ``totals`` → msgpack map of the leaders' compaction counts (runs, started, done, abandoned)."""
        return f"{self.prefix}bal:compaction"

    # -- invokers ---------------------------------------------------------------------------------
    @property
    def invokers(self) -> str:
        """Set of invoker names that have reported at least once."""
        return f"{self.prefix}invokers"

    def report(self, invoker: str) -> str:
        """:class:`LoadReport` with a TTL; its absence means the invoker is gone."""
        return f"{self.prefix}inv:{invoker}:report"

    def boot(self, invoker: str) -> str:
        """The invoker's boot id with the report's TTL (read by Lua to tell a live run from a dead one)."""
        return f"{self.prefix}inv:{invoker}:boot"

    def commands(self, invoker: str) -> str:
        """Stream of :class:`InstanceCommand` for one invoker."""
        return f"{self.prefix}inv:{invoker}:cmd"

    def activations(self, invoker: str) -> str:
        """Stream of forwarded activations for one invoker (consumer group ``exec``)."""
        return f"{self.prefix}inv:{invoker}:act"

    def replies(self, invoker: str) -> str:
        """Stream of results coming back to the invoker that received the activations."""
        return f"{self.prefix}inv:{invoker}:res"

    # -- functions and activations ----------------------------------------------------------------
    @property
    def functions(self) -> str:
        """Set of the GPU functions registered by routers."""
        return f"{self.prefix}fns"

    def function(self, fqn: str) -> str:
        """Hash ``rev``, ``doc`` (action JSON), ``meta`` (:class:`FunctionSpec`)."""
        return f"{self.prefix}fn:{fqn}"

    def route(self, fqn: str) -> str:
        """:class:`RoutingTable` of one function."""
        return f"{self.prefix}route:{fqn}"

    @property
    def routes_channel(self) -> str:
        """Pub/sub channel: the name of a function whose routing table changed."""
        return f"{self.prefix}routes"

    def result(self, activation_id: str) -> str:
        """The finished activation (JSON) of a forwarded activation, kept for dedupe and redelivery."""
        return f"{self.prefix}res:{activation_id}"

    def claim(self, activation_id: str) -> str:
        """Who may run a forwarded activation: ``q:{invoker}`` queued, ``r:{invoker}:{boot}`` running,
        ``x`` moved elsewhere."""
        return f"{self.prefix}run:{activation_id}"


def invoker_name(invoker_id: int) -> str:
    return f"invoker{invoker_id}"


# -- encoding ----------------------------------------------------------------------------------------

T = TypeVar("T")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def pack(value: Any) -> bytes:
    return msgpack.packb(_plain(value), use_bin_type=True)


def unpack(raw: bytes | bytearray | memoryview) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"not msgpack: {exc}") from None


#: each wire class's field names: `dataclasses.fields` builds a tuple per call, and the balancer decodes one
#: object per instance and per GPU every tick (docs/benchmarks/planner-scale.md)
_FIELD_NAMES: dict[type, frozenset[str]] = {}

#: each wire class's `_builder` (None: it has none)
_BUILDERS: dict[type, Callable[[dict[str, Any]], Any] | None] = {}


def _builder(cls: type) -> Callable[[dict[str, Any]], Any] | None:
    """A function making a `cls` from a dict holding its fields, as ``cls(**{k: v for k, v in d.items() if k in
    fields})`` does: each field's value from the dict, or its default when absent; other keys are ignored. It
    raises KeyError when a field without a default is missing. A frozen dataclass's own ``__init__`` sets each
    field through ``object.__setattr__``; this sets each slot through its descriptor, about twice as fast (the
    balancer makes one object per instance and per GPU every tick). None for a class it cannot make exactly so
    (no slots, a ``__post_init__``, a field with a default factory or not in ``__init__``)."""
    if "__slots__" not in cls.__dict__ or hasattr(cls, "__post_init__"):
        return None
    fields = dataclasses.fields(cls)
    if any(not f.init or f.default_factory is not MISSING for f in fields):
        return None
    env: dict[str, Any] = {"new": object.__new__, "cls": cls}
    params, body = [], []
    for k, f in enumerate(fields):
        env[f"set{k}"] = cls.__dict__[f.name].__set__
        params.append(f"set{k}=set{k}")
        if f.default is MISSING:
            body.append(f"    set{k}(o, d[{f.name!r}])")
        else:
            env[f"default{k}"] = f.default
            params.append(f"default{k}=default{k}")
            body.append(f"    set{k}(o, d.get({f.name!r}, default{k}))")
    src = f"def build(d, new=new, cls=cls, {', '.join(params)}):\n    o = new(cls)\n" + "\n".join(body) + "\n    return o\n"
    exec(src, env)  # generated from the class's own field names, as dataclasses does
    build: Callable[[dict[str, Any]], Any] = env["build"]
    return build


def _fields_of(cls: type[T], data: Any, nested: Mapping[str, Any] | None = None) -> T:
    if nested is None and type(data) is dict:
        try:
            build = _BUILDERS[cls]
        except KeyError:
            build = _BUILDERS[cls] = _builder(cls)
        if build is not None:
            try:
                made: T = build(data)
                return made
            except KeyError:
                pass  # a field without a default is missing: the constructor below says which
    if not isinstance(data, Mapping):
        raise WireError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    # A map of known fields only (what this code's own writers send) is passed as it is; an unknown field (a
    # newer writer's) or a non-text key is dropped first.
    kwargs: Mapping[str, Any]
    if nested:
        kwargs = filtered = {k: v for k, v in data.items() if k in names}
        for name, convert in nested.items():
            if name in filtered:
                filtered[name] = convert(filtered[name])
    else:
        kwargs = data if names.issuperset(data) else {k: v for k, v in data.items() if k in names}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{cls.__name__}: {exc}") from None


def decode(cls: type[T], raw: bytes | str | None) -> T | None:
    """Decode a value written by :func:`pack`; None stays None. Raises :class:`WireError`."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raise WireError("expected msgpack bytes, got text")
    return cls.from_wire(unpack(raw))  # type: ignore[attr-defined]


# -- functions ---------------------------------------------------------------------------------------


#: Annotations the balancer reads beside the GPU annotations of ``model.GpuNeeds``.
CAPACITY_ANNOTATION = "capacity-rps"
PROFILE_ANNOTATION = "gpu-profile"
AFFINITY_ANNOTATION = "placement-affinity"

_GENERATION = re.compile(r"^(\d+)-")


def revision_generation(revision: str | None) -> int:
    """The generation of ``N-hash`` revisions (our store's and CouchDB's); 0 when there is none."""
    if not revision:
        return 0
    m = _GENERATION.match(revision)
    return int(m.group(1)) if m else 0


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """What the balancer needs to know of a GPU function, derived from its action by the router."""

    fqn: str
    rev: str
    kind: str
    cls: str
    request: float
    limit: float
    memory_mb: int
    slots: int = 1
    slo_ms: float | None = None
    min_instances: int = 0
    max_instances: int = 8
    capacity_rps: float | None = None
    profile: str | None = None
    affinity: str | None = None
    user_memory_mb: int = 0
    """The action's memory limit (``limits.memory``): what an instance holds of its invoker's user memory."""
    weights_mb: int = 0
    """Of ``memory_mb``, the read-only weights its instances on one GPU share (``gpu-weights-mb``)."""
    stages: int = 1
    """The most pipeline stages its code serves (``gpu-stages``): an instance may be split over that many GPUs."""
    gpus: int = 1
    """GPUs each instance takes as a gang (``gpu-count``), all on one invoker; ``request``, ``limit`` and
    ``memory_mb`` are per GPU."""

    @classmethod
    def of(cls, action: Action) -> FunctionSpec:
        """Raises :class:`~dilu_invoker.model.ValidationError` for bad annotations."""
        ann = action.annotation_map
        needs = GpuNeeds.from_annotations(ann)
        capacity = ann.get(CAPACITY_ANNOTATION)
        if capacity is not None:
            if isinstance(capacity, bool) or not isinstance(capacity, (int, float, str)):
                raise ValidationError(f"Annotation '{CAPACITY_ANNOTATION}' must be a number.")
            try:
                capacity = float(capacity)
            except ValueError:
                raise ValidationError(f"Annotation '{CAPACITY_ANNOTATION}' must be a number.") from None
            if not (math.isfinite(capacity) and capacity > 0):
                raise ValidationError(f"Annotation '{CAPACITY_ANNOTATION}' must be a positive number.")
        profile = ann.get(PROFILE_ANNOTATION)
        if profile is not None and profile not in ("compute", "memory"):
            raise ValidationError(f"Annotation '{PROFILE_ANNOTATION}' must be 'compute' or 'memory'.")
        affinity = ann.get(AFFINITY_ANNOTATION)
        if affinity is not None and affinity not in ("spread", "pack", "none"):
            raise ValidationError(f"Annotation '{AFFINITY_ANNOTATION}' must be spread, pack or none.")
        return cls(
            fqn=action.fqn,
            rev=action.revision or "",
            kind=action.exec.kind,
            cls=needs.gpu_class.value,
            request=needs.sm_request,
            limit=needs.sm_limit,
            memory_mb=needs.memory_mb,
            slots=action.limits.concurrency,
            slo_ms=needs.slo_ms,
            min_instances=needs.min_instances,
            max_instances=needs.max_instances,
            capacity_rps=capacity,
            profile=profile,
            affinity=affinity,
            user_memory_mb=action.limits.memory_mb,
            weights_mb=needs.weights_mb,
            stages=needs.stages,
            gpus=needs.gpus,
        )

    @classmethod
    def from_wire(cls, data: Any) -> FunctionSpec:
        return _fields_of(cls, data)


# -- load reports ------------------------------------------------------------------------------------


class InstanceState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class GpuReport:
    index: int
    uuid: str
    name: str = ""
    memory_mb: int = 0
    sm_count: int = 0
    simulated: bool = False

    @classmethod
    def from_wire(cls, data: Any) -> GpuReport:
        return _fields_of(cls, data)


@dataclass(frozen=True, slots=True)
class InstanceReport:
    """One instance as its invoker sees it over the last report period."""

    id: str
    function: str
    rev: str
    state: str
    cls: str = "inference"
    gpu: int | None = None
    request: float = 0.0
    limit: float = 0.0
    memory_mb: int = 0
    slots: int = 1
    share: float | None = None
    """SM share enforced now (from the GPU manager); None when unknown."""
    saturated: bool | None = None
    """At its limit and throttled (vertical scaling has nothing more to give); None when unknown."""
    throttled_s: float | None = None
    waiting: int = 0
    in_flight: int = 0
    arrival_rate: float = 0.0
    completion_rate: float = 0.0
    latency_ms: float | None = None
    """Mean run time of the activations completed in the period."""
    queue_delay_ms: float = 0.0
    """90th percentile of the time activations waited for a slot of this instance."""
    error: str = ""
    """Why the instance failed (state ``failed``): the balancer tells the waiting callers."""
    moved: str = ""
    """A split instance: the id of the stage its last stage move (`CommandOp.MOVE_STAGE`) put in place, once the
    move is done (the new stage serves, the old one is stopped and its reservation released); "" before any."""
    move_failed: str = ""
    """A split instance: ``"{new stage id}: {why}"`` of its last stage move that failed (the old stage serves
    on, the new one is gone and its reservation released); "" before any."""

    @classmethod
    def from_wire(cls, data: Any) -> InstanceReport:
        return _fields_of(cls, data)


@dataclass(frozen=True, slots=True)
class FunctionReport:
    """What the invoker's router saw of one function (each activation is counted by exactly one router)."""

    function: str
    arrival_rate: float = 0.0
    waiting: int = 0
    """Activations waiting for an instance to exist."""
    queue_delay_ms: float = 0.0

    @classmethod
    def from_wire(cls, data: Any) -> FunctionReport:
        return _fields_of(cls, data)


@dataclass(frozen=True, slots=True)
class LoadReport:
    invoker: str
    boot: str
    at_ms: int
    period_s: float = 1.0
    enabled: bool = True
    epoch: int = 0
    """The highest balancer epoch the invoker has accepted a command from."""
    user_memory_mb: int = 0
    memory_in_use_mb: int = 0
    gpus: tuple[GpuReport, ...] = ()
    instances: tuple[InstanceReport, ...] = ()
    functions: tuple[FunctionReport, ...] = ()
    schema: int = 1

    @classmethod
    def from_wire(cls, data: Any) -> LoadReport:
        return _fields_of(cls, data, {
            "gpus": lambda v: tuple(GpuReport.from_wire(x) for x in v or ()),
            "instances": lambda v: tuple(InstanceReport.from_wire(x) for x in v or ()),
            "functions": lambda v: tuple(FunctionReport.from_wire(x) for x in v or ()),
        })


#: `LoadReport`'s lists and the class of their elements
_REPORT_PARTS: dict[str, type] = {"gpus": GpuReport, "instances": InstanceReport, "functions": FunctionReport}
_UNPACK_OPTIONS: dict[str, Any] = {"raw": False, "strict_map_key": False}


class _Plain(Exception):
    """What `ReportDecoder` leaves to `decode`."""


class ReportDecoder:
    """``decode(LoadReport, raw)`` for a reader of every invoker's report every period (the balancer's leader),
    reusing what it decoded from the reports since its last-but-one `turn` where the bytes are the same: a whole
    list of the report (its GPUs, its instances, its functions) or one element of it.

    A report's bytes change every period (its clock, and the figures of its busy instances), but most of its
    elements' bytes do not (the GPUs, and every idle instance). The walk finds each list's and each element's
    bytes with a `msgpack.Unpacker` (`skip`, `tell`). The same bytes decode to the same values of the same types
    (1, 1.0 and True, or 0.0 and -0.0, are different bytes), so what was decoded from them before is equal to,
    and indistinguishable from, what `decode` makes of them now. An element not seen before is decoded on its own
    at the depth it has in the report, so msgpack's limits apply as they do to the whole. The answer is always
    `decode`'s: anything the walk does not expect (not a map, a list that is not an array, a field holding a map
    or an array, trailing bytes, any error) is left to `decode` itself, which raises `WireError` on bad data as it
    always has. Unknown fields are dropped, as `decode` drops them. Not thread-safe: one reader at a time."""

    def __init__(self) -> None:
        #: per list field, its bytes → the tuple; per element class, its bytes → the object: since the last
        #: `turn`, and between the two before
        self._seen: dict[Any, dict[bytes, Any]] = self._empty()
        self._last: dict[Any, dict[bytes, Any]] = self._empty()

    @staticmethod
    def _empty() -> dict[Any, dict[bytes, Any]]:
        return {k: {} for k in (*_REPORT_PARTS, *_REPORT_PARTS.values())}

    def turn(self) -> None:
        """Forget what only the reports decoded before the last turn held (call it after each round of reads)."""
        self._last, self._seen = self._seen, self._empty()

    def decode(self, raw: bytes | str | None) -> LoadReport | None:
        """`decode(LoadReport, raw)`: the same answer, or the same exception."""
        if type(raw) is bytes:
            try:
                return self._walk(raw)
            except Exception:  # noqa: BLE001 - left to decode, which answers or raises as it always has
                pass
        return decode(LoadReport, raw)

    def _walk(self, raw: bytes) -> LoadReport:
        unpacker = msgpack.Unpacker(None, max_buffer_size=len(raw), **_UNPACK_OPTIONS)
        unpacker.feed(raw)
        data: dict[Any, Any] = {}
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            cls = _REPORT_PARTS.get(key)
            if cls is None:
                value = unpacker.unpack()
                if type(value) is dict or type(value) is list:
                    raise _Plain  # a newer writer's nested field: msgpack's depth limit counts from the report
                data[key] = value
                continue
            start = unpacker.tell()
            unpacker.skip()
            chunk = raw[start : unpacker.tell()]
            seen = self._seen[key]
            value = seen.get(chunk)
            if value is None:
                value = self._last[key].get(chunk)
                if value is None:
                    value = self._elements(chunk, cls)
                seen[chunk] = value
            data[key] = value
        if unpacker.tell() != len(raw):
            raise _Plain
        # What `_fields_of` makes of the map, its lists made of the elements' objects: the known fields, the
        # others dropped (a key that is not text too), a missing field with no default an error (left to `decode`).
        report: LoadReport = _REPORT_BUILDER(data)
        return report

    def _elements(self, chunk: bytes, cls: type) -> tuple[Any, ...]:
        """The elements of one list of a report (`chunk`: its bytes, an array)."""
        unpacker = msgpack.Unpacker(None, max_buffer_size=len(chunk), **_UNPACK_OPTIONS)
        unpacker.feed(chunk)
        seen, last = self._seen[cls], self._last[cls]
        out: list[Any] = []
        start = unpacker.tell()
        for _ in range(unpacker.read_array_header()):
            if not out:
                start = unpacker.tell()
            unpacker.skip()
            end = unpacker.tell()
            element = chunk[start:end]
            start = end
            obj = seen.get(element)
            if obj is None:
                obj = last.get(element)
                if obj is None:
                    # Decoded at the depth it has in the report (a map in an array in a map), as `decode` would.
                    obj = _fields_of(cls, msgpack.unpackb(b"\x91\x91" + element, **_UNPACK_OPTIONS)[0][0])
                seen[element] = obj
            out.append(obj)
        return tuple(out)


_REPORT_BUILDER: Callable[[dict[str, Any]], Any] = _builder(LoadReport)  # type: ignore[assignment]


# -- commands ----------------------------------------------------------------------------------------


class CommandOp(enum.StrEnum):
    START = "start"
    STOP = "stop"
    #: load ``function`` at ``rev`` ahead of its first request (model pre-loading, docs/balancer.md)
    PRELOAD = "preload"
    #: let go of the model pre-loaded for ``function`` (its action was deleted, or replaced elsewhere)
    RELEASE = "release"
    #: hand one pipeline stage of split instance ``instance`` over to another GPU of the invoker while the pipeline
    #: serves (compaction, make-before-break): ``stages`` is the instance's whole new stage list, equal to its
    #: current one but at one index, where a stage with a new id (`moved_stage_id`) on another GPU takes the old
    #: stage's place. docs/invoker.md, "Stage moves".
    MOVE_STAGE = "move-stage"


@dataclass(frozen=True, slots=True)
class StageRecord:
    """One GPU's part of an instance over several GPUs of one invoker: a pipeline stage of a split instance (an
    LLM, ids by `stage_id`) or a rank of a gang (``gpu-count``, ids by `rank_id`): its own id, its GPU and what it
    holds there. Each runs as its own process on its GPU, with its own budget reservation, shim control block and
    memory cap (docs/balancer.md, "Split instances" and "Gangs")."""

    id: str
    gpu: int
    gpu_uuid: str | None
    request: float
    limit: float
    memory_mb: int

    @classmethod
    def from_wire(cls, data: Any) -> StageRecord:
        return _fields_of(cls, data)


def stage_id(instance: str, index: int) -> str:
    """The id of stage `index` of a split instance (the id placement gives the piece, `placement.part_id`)."""
    return f"{instance}#p{index}"


def moved_stage_id(instance: str, index: int, move: int) -> str:
    """The id of stage `index` of a split instance once a stage move (`CommandOp.MOVE_STAGE`) put it on another
    GPU: a new id, so that the old stage and its replacement are reserved side by side until the move is done;
    `move` tells the moves of one balancer apart (its sequence number)."""
    return f"{instance}#p{index}.{move}"


def rank_id(instance: str, rank: int, world: int) -> str:
    """The id of rank `rank` of a gang of `world` ranks (an instance over `world` GPUs of one invoker,
    ``gpu-count``): the gang's size is in every rank's id, so a GPU's reservations alone say what the gang is
    (`rank_of`)."""
    return f"{instance}#r{rank}of{world}"


def rank_of(reservation: str) -> tuple[str, int, int] | None:
    """(gang instance, rank, world size) of a rank id (`rank_id`); None for any other id."""
    head, sep, tail = reservation.rpartition("#r")
    rank, of, world = tail.partition("of")
    if not (sep and head and of and rank.isdigit() and world.isdigit()):
        return None
    k, n = int(rank), int(world)
    return (head, k, n) if 0 <= k < n else None


def stage_index(reservation: str) -> int | None:
    """The index of the stage a stage id (`stage_id`, `moved_stage_id`) names; None for any other id."""
    if stage_parent(reservation) is None:
        return None
    return int(reservation.rpartition("#p")[2].partition(".")[0])


def stage_parent(reservation: str) -> str | None:
    """The split instance a stage id (`stage_id`, `moved_stage_id`) belongs to; None for any other id (instance
    ids have no ``#``: `planner.instance_id`)."""
    head, sep, index = reservation.rpartition("#p")
    if not (sep and head):
        return None
    k, dot, move = index.partition(".")
    return head if k.isdigit() and (not dot or move.isdigit()) else None


def stages_of(value: Any) -> tuple[StageRecord, ...]:
    """The ``stages`` field as read from the wire (a list of maps, or empty)."""
    if not value:
        return ()
    if not isinstance(value, (list, tuple)):
        raise WireError(f"stages: expected a list, got {type(value).__name__}")
    stages = tuple(s if isinstance(s, StageRecord) else StageRecord.from_wire(s) for s in value)
    if len(stages) < 2:
        raise WireError("stages: a split instance has at least two")
    return stages


def is_gang(stages: tuple[StageRecord, ...]) -> bool:
    """Whether an instance's parts (``stages``) are the ranks of a gang (`rank_id`) rather than pipeline stages."""
    return bool(stages) and rank_of(stages[0].id) is not None


def gpu_reservations(instance: str, gpu_uuid: str | None, stages: tuple[StageRecord, ...],
                     ) -> tuple[tuple[str, str], ...]:
    """(GPU uuid, reservation id) of each GPU an instance holds: each stage's of a split one (under the stage's
    id), else its own (the balancer's record and the invoker's start command alike)."""
    if stages:
        return tuple((s.gpu_uuid, s.id) for s in stages if s.gpu_uuid)
    return ((gpu_uuid, instance),) if gpu_uuid else ()


def _set_stages(obj: Any) -> None:
    """Converts a just-decoded object's ``stages`` in place (each record carries the field, mostly empty: the
    builder's fast path stays, and only a split instance pays for its stages)."""
    raw = obj.stages
    if raw.__class__ is not tuple or raw:
        object.__setattr__(obj, "stages", stages_of(raw))


def _set_moving(rec: Any) -> None:
    """`_set_stages` for a record's ``moving`` (the stages a stage move replaces: one or more)."""
    raw = rec.moving
    if raw.__class__ is not tuple or raw:
        if not isinstance(raw, (list, tuple)):
            raise WireError(f"moving: expected a list, got {type(raw).__name__}")
        object.__setattr__(rec, "moving", tuple(s if isinstance(s, StageRecord) else StageRecord.from_wire(s)
                                                for s in raw))


def stage_span(stages: tuple[StageRecord, ...], index: int) -> tuple[float, float]:
    """The share of the model stage `index` holds, as a [start, end) span of [0, 1]: its memory over the
    stages' total, in stage order (`actions.pipeline.Stage.layers` turns it into a range of layers)."""
    total = sum(max(0, s.memory_mb) for s in stages)
    if total <= 0:
        return index / len(stages), (index + 1) / len(stages)
    before = sum(max(0, s.memory_mb) for s in stages[:index])
    end = 1.0 if index == len(stages) - 1 else (before + max(0, stages[index].memory_mb)) / total
    return before / total, end


@dataclass(frozen=True, slots=True)
class InstanceCommand:
    op: str
    epoch: int
    instance: str
    function: str
    rev: str = ""
    gpu: int | None = None
    gpu_uuid: str | None = None
    cls: str = "inference"
    request: float = 0.0
    limit: float = 0.0
    memory_mb: int = 0
    boot: str = ""
    """The invoker's boot id the command is meant for ("" any); another incarnation ignores it."""
    reason: str = ""
    stages: tuple[StageRecord, ...] = ()
    """A split instance's pipeline stages, or a gang's ranks (`gang`), in order (``gpu``/``gpu_uuid`` are the
    first's); empty: one GPU."""

    @classmethod
    def from_wire(cls, data: Any) -> InstanceCommand:
        cmd = _fields_of(cls, data)
        _set_stages(cmd)
        return cmd

    @property
    def gang(self) -> bool:
        """Its `stages` are the ranks of a gang (`rank_id`), not pipeline stages."""
        return is_gang(self.stages)


# -- the balancer's instance table and routing tables ------------------------------------------------


class RecordState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """One instance as the balancer decided it; the invoker's report says how it is doing."""

    id: str
    function: str
    rev: str
    invoker: str
    gpu: int | None
    gpu_uuid: str | None
    cls: str
    request: float
    limit: float
    memory_mb: int
    slots: int = 1
    state: str = RecordState.STARTING.value
    since: float = 0.0
    """When it entered its state (the balancer's clock, seconds)."""
    epoch: int = 0
    boot: str = ""
    """The invoker's boot id once it reported the instance; a different boot means it was lost."""
    missing: int = 0
    """Consecutive fresh reports of its invoker that did not list it."""
    replaces: str = ""
    """Set while this instance is the replacement a compaction move started for another instance of
    the function (make-before-break): once it is ready, the original is drained and this is cleared."""
    user_memory_mb: int = 0
    """Of its invoker's user memory, what it holds (its action's memory limit)."""
    stages: tuple[StageRecord, ...] = ()
    """A split instance's pipeline stages, or a gang's ranks (`gang`), in order, each on its own GPU of `invoker`
    (`gpu`/`gpu_uuid` are the first's; `request` and `limit` the whole instance's, per GPU for a gang; `memory_mb`
    the whole instance's, the ranks' sum for a gang); empty: the instance is on one GPU."""
    moving: tuple[StageRecord, ...] = ()
    """While a stage move (`CommandOp.MOVE_STAGE`) is in flight: the stage it replaces, which the instance still
    holds until its invoker reports the move done (`stages` already names the new one); empty otherwise."""
    moving_since: float = 0.0
    """When the stage move in flight was ordered (the balancer's clock, seconds)."""

    @classmethod
    def from_wire(cls, data: Any) -> InstanceRecord:
        rec = _fields_of(cls, data)
        _set_stages(rec)
        _set_moving(rec)
        return rec

    @property
    def gang(self) -> bool:
        """Its `stages` are the ranks of a gang (`rank_id`), not pipeline stages."""
        return is_gang(self.stages)

    def gpu_reservations(self) -> tuple[tuple[str, str], ...]:
        """(GPU uuid, reservation id) of each GPU it holds: one per stage of a split instance (the stage a move
        replaces too, until the move is done), else its own."""
        held = gpu_reservations(self.id, self.gpu_uuid, self.stages)
        return held + tuple((s.gpu_uuid, s.id) for s in self.moving if s.gpu_uuid) if self.moving else held

    def stage_move(self) -> tuple[StageRecord, StageRecord] | None:
        """The stage move in flight, as (the stage it replaces, the stage that takes its place); None: none."""
        if not self.moving:
            return None
        old = self.moving[0]
        k = stage_index(old.id)
        fresh = next((s for s in self.stages if stage_index(s.id) == k), None)
        return (old, fresh) if fresh is not None else None

    def stage_move_undone(self) -> InstanceRecord:
        """The record as it was before its stage move (the old stage back in its place, nothing moving)."""
        move = self.stage_move()
        if move is None:
            return dataclasses.replace(self, moving=(), moving_since=0.0)
        old, fresh = move
        stages = tuple(old if s is fresh else s for s in self.stages)
        return dataclasses.replace(self, stages=stages, moving=(), moving_since=0.0, gpu=stages[0].gpu,
                                   gpu_uuid=stages[0].gpu_uuid)


@dataclass(frozen=True, slots=True)
class RouteEntry:
    id: str
    invoker: str
    slots: int = 1
    in_flight: int = 0
    waiting: int = 0

    @classmethod
    def from_wire(cls, data: Any) -> RouteEntry:
        return _fields_of(cls, data)


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Where a function's activations may go: its ready instances on live invokers."""

    function: str
    rev: str
    epoch: int
    version: int
    instances: tuple[RouteEntry, ...] = ()
    local_fallback: bool = False
    """No GPU anywhere in the cluster: run activations in the receiving invoker's own pool (on the CPU)."""
    blocked: str = ""
    """Why no instance could be placed, when that is the case."""

    @classmethod
    def from_wire(cls, data: Any) -> RoutingTable:
        return _fields_of(cls, data, {"instances": lambda v: tuple(RouteEntry.from_wire(x) for x in v or ())})

    def same_routes(self, other: RoutingTable | None) -> bool:
        """Equal but for the load figures (those change every tick and do not warrant a notification)."""
        return other is not None and routes_equal(other, self.rev, self.local_fallback, self.blocked, self.instances)


def routes_equal(table: RoutingTable, rev: str, local_fallback: bool, blocked: str,
                 instances: Sequence[RouteEntry]) -> bool:
    """`RoutingTable.same_routes` of `table` and a table of these fields, without making that table (the balancer
    asks it for every function each tick): the same revision, fallback, blocked reason and instances, an instance
    compared by id, invoker and slots (not its load figures)."""
    if (table.rev != rev or table.local_fallback != local_fallback or table.blocked != blocked
            or len(table.instances) != len(instances)):
        return False
    for a, b in zip(table.instances, instances, strict=True):
        if a.id != b.id or a.invoker != b.invoker or a.slots != b.slots:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Decision:
    """One line of the decisions stream."""

    at: float
    epoch: int
    kind: str
    function: str
    reason: str
    instance: str = ""
    invoker: str = ""
    gpu: int | None = None

    @classmethod
    def from_wire(cls, data: Any) -> Decision:
        return _fields_of(cls, data)


def stream_fields(value: Any) -> dict[str, bytes]:
    """A stream entry carrying one packed value."""
    return {"v": pack(value)}


def from_stream(cls: type[T], fields: Mapping[Any, Any]) -> T:
    raw = fields.get(b"v", fields.get("v"))
    if raw is None:
        raise WireError("stream entry without a value")
    return cls.from_wire(unpack(raw))  # type: ignore[attr-defined]


def text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)

