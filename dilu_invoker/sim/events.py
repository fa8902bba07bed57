"""Placement event files: JSON lines, one `create` or `delete` of an instance each.

    {"t": 12.0, "op": "create", "instance": "llm-7", "function": "llm-7", "class": "llm",
     "gpus": 1, "mem_gib_per_gpu": 24.0, "sm_request": 0.5, "sm_limit": 0.7}
    {"t": 130.0, "op": "delete", "instance": "llm-7"}

A `delete` needs only `t`, `op` and `instance` (other fields are ignored). Blank lines and lines
starting with `#` are skipped. Events are replayed in order of `t`; events with equal `t` keep their
order in the file. Errors name the file and line and stop the run before anything is simulated.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dilu_invoker.policy import InstanceClass

GIB = 1024.0
"""MiB per GiB: the policies count memory in MiB."""

CREATE = "create"
DELETE = "delete"
_FIELDS = ("t", "op", "instance", "function", "class", "gpus", "mem_gib_per_gpu", "sm_request", "sm_limit")


class EventError(ValueError):
    """A malformed event file; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What a `create` event asks for (memory per GPU, shares per GPU)."""

    instance: str
    function: str
    cls: InstanceClass
    gpus: int
    mem_gib_per_gpu: float
    sm_request: float
    sm_limit: float

    @property
    def memory_mib(self) -> float:
        return self.mem_gib_per_gpu * GIB


@dataclass(frozen=True, slots=True)
class PlacementEvent:
    t: float
    op: str
    instance: str
    spec: InstanceSpec | None = None
    """Set for `create`."""
    line: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.t, "op": self.op, "instance": self.instance}
        if self.spec is not None:
            s = self.spec
            out.update(
                {
                    "function": s.function,
                    "class": s.cls.value,
                    "gpus": s.gpus,
                    "mem_gib_per_gpu": s.mem_gib_per_gpu,
                    "sm_request": s.sm_request,
                    "sm_limit": s.sm_limit,
                }
            )
        return out


def _number(obj: dict[str, Any], key: str, where: str) -> float:
    if key not in obj:
        raise EventError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise EventError(f"{where}: {key} must be a finite number, got {v!r}")
    return float(v)


def parse_event(obj: Any, where: str) -> PlacementEvent:
    """One event from its decoded JSON object; raises EventError naming `where`."""
    if not isinstance(obj, dict):
        raise EventError(f"{where}: an event must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise EventError(f"{where}: unknown field(s) {unknown}; known: {list(_FIELDS)}")
    t = _number(obj, "t", where)
    if t < 0:
        raise EventError(f"{where}: t must be >= 0, got {t}")
    op = obj.get("op")
    if op not in (CREATE, DELETE):
        raise EventError(f"{where}: op must be 'create' or 'delete', got {op!r}")
    inst = obj.get("instance")
    if not isinstance(inst, str) or not inst:
        raise EventError(f"{where}: instance must be a non-empty string, got {inst!r}")
    if op == DELETE:
        return PlacementEvent(t=t, op=op, instance=inst)
    function = obj.get("function", inst)
    if not isinstance(function, str) or not function:
        raise EventError(f"{where}: function must be a non-empty string, got {function!r}")
    if "class" not in obj:
        raise EventError(f"{where}: missing field 'class'")
    try:
        cls = InstanceClass.parse(str(obj["class"]))
    except ValueError as exc:
        raise EventError(f"{where}: {exc}") from None
    gpus = obj.get("gpus", 1)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise EventError(f"{where}: gpus must be an integer >= 1, got {gpus!r}")
    mem = _number(obj, "mem_gib_per_gpu", where)
    if mem < 0:
        raise EventError(f"{where}: mem_gib_per_gpu must be >= 0, got {mem}")
    req = _number(obj, "sm_request", where)
    lim = _number(obj, "sm_limit", where)
    if not (0.0 <= req <= 1.0 and 0.0 <= lim <= 1.0):
        raise EventError(f"{where}: sm_request and sm_limit must be between 0 and 1, got {req}, {lim}")
    if req > lim + 1e-9:
        raise EventError(f"{where}: sm_request {req} exceeds sm_limit {lim}")
    spec = InstanceSpec(
        instance=inst,
        function=function,
        cls=cls,
        gpus=gpus,
        mem_gib_per_gpu=mem,
        sm_request=req,
        sm_limit=lim,
    )
    return PlacementEvent(t=t, op=op, instance=inst, spec=spec)


def read_events(lines: Iterable[str], name: str = "<events>") -> list[PlacementEvent]:
    """Parse and order a whole event stream; raises EventError at the first bad line."""
    events: list[PlacementEvent] = []
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{name}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EventError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        ev = parse_event(obj, where)
        events.append(PlacementEvent(t=ev.t, op=ev.op, instance=ev.instance, spec=ev.spec, line=n))
    if not events:
        raise EventError(f"{name}: no events")
    # Stable: events at the same time keep their file order.
    events.sort(key=lambda e: e.t)
    return events


def open_text(path: Path, mode: str = "r") -> IO[str]:
    """A text file, gzip-compressed when its name ends in `.gz`."""
    if path.suffix == ".gz":
        if "w" in mode:
            # mtime 0: regenerating a trace gives the same bytes.
            raw = gzip.GzipFile(path, mode="wb", mtime=0)
            return io.TextIOWrapper(raw, encoding="utf-8")
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return path.open(mode, encoding="utf-8")


def load_events(path: str | Path) -> list[PlacementEvent]:
    """Read an event file (`.gz` is decompressed)."""
    p = Path(path)
    try:
        with open_text(p) as fh:
            return read_events(fh, str(p))
    except (OSError, EOFError) as exc:
        raise EventError(f"cannot read {p}: {getattr(exc, 'strerror', None) or exc}") from None


def write_events(events: Iterable[PlacementEvent], out: IO[str]) -> int:
    n = 0
    for ev in events:
        out.write(json.dumps(ev.to_json(), separators=(",", ":")) + "\n")
        n += 1
    return n


def iter_specs(events: Iterable[PlacementEvent]) -> Iterator[InstanceSpec]:
    for ev in events:
        if ev.spec is not None:
            yield ev.spec
