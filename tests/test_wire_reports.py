"""The balancer's fast decoding of load reports (`wire.ReportDecoder`, and `_fields_of`'s builders) answers as the
plain path does: equal objects whose fields have the same types, the same exceptions on bad data, unknown fields
dropped, over random reports that change from one read to the next."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import msgpack
import pytest

from dilu_invoker import wire
from dilu_invoker.wire import (
    Decision,
    FunctionReport,
    FunctionSpec,
    GpuReport,
    InstanceCommand,
    InstanceRecord,
    InstanceReport,
    LoadReport,
    ReportDecoder,
    RouteEntry,
    WireError,
    decode,
)

#: values that compare equal across types (1 == 1.0 == True, 0.0 == -0.0 == 0 == False) or not at all (nan)
TRICKY = [0, 1, 0.0, -0.0, 1.0, True, False, None, 2**53, float(2**53), math.nan, math.inf, "", "1", b"1", -1]


def same(a: Any, b: Any) -> bool:
    """Equal, and indistinguishable: the same type at every level, floats with the same bits."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return repr(a) == repr(b)
    return bool(a == b)


def plain(cls: type, data: Any) -> Any:
    """What a dataclass's own constructor makes of a map (the path before the builders)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
        return "raised", (type(exc), str(exc))


def assert_same_outcome(got: tuple[str, Any], want: tuple[str, Any]) -> None:
    assert got[0] == want[0], (got, want)
    if got[0] == "ok":
        assert same(got[1], want[1]), (got[1], want[1])
    else:
        assert got[1] == want[1]


# -- _fields_of's builders -----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [GpuReport, InstanceReport, FunctionReport, FunctionSpec, InstanceCommand,
                                 InstanceRecord, RouteEntry, Decision])
def test_a_builder_makes_what_the_constructor_makes(cls: type) -> None:
    rng = random.Random(cls.__name__)
    # A split instance's stages (and a stage move's) are checked on top of the builder (tests/test_wire_stages.py).
    fields = [f for f in dataclasses.fields(cls) if f.name not in ("stages", "moving")]
    for _ in range(300):
        data: dict[Any, Any] = {f.name: rng.choice(TRICKY) for f in fields if rng.random() < 0.9}
        if rng.random() < 0.3:
            data[rng.choice(["new", 7, b"id", 1.5])] = rng.choice(TRICKY)
        want = outcome(plain, cls, data)
        got = outcome(cls.from_wire, data)  # type: ignore[attr-defined]
        assert got[0] == want[0], (data, got, want)
        if got[0] == "ok":
            assert same(got[1], want[1])
        else:
            assert got[1][0] is WireError  # a missing field names itself as before
            assert got[1][1] == f"{cls.__name__}: {want[1][1]}"


def test_a_builder_uses_the_default_objects_and_needs_the_fields_without_one() -> None:
    r = InstanceReport.from_wire({"id": "i", "function": "f", "rev": "", "state": "ready"})
    assert same(r, InstanceReport(id="i", function="f", rev="", state="ready"))
    with pytest.raises(WireError, match="missing 1 required positional argument: 'state'"):
        InstanceReport.from_wire({"id": "i", "function": "f", "rev": ""})
    # Not a plain dict (a mapping of another type): the constructor's path, the same answer.
    class Other(dict):  # type: ignore[type-arg]
        pass

    assert same(GpuReport.from_wire(Other(index=1, uuid="u")), GpuReport(index=1, uuid="u"))


# -- ReportDecoder --------------------------------------------------------------------------------------


def _instance(rng: random.Random, n: int) -> dict[Any, Any]:
    d: dict[Any, Any] = {"id": f"i{n}", "function": f"ns/f{n % 5}", "rev": "1-a", "state": "ready",
                         "cls": "inference", "gpu": n % 4, "request": 0.25, "limit": 0.5, "memory_mb": 1024,
                         "slots": 1, "share": 0.25, "saturated": False, "throttled_s": 0.0, "waiting": 0,
                         "in_flight": 0, "arrival_rate": 0.0, "completion_rate": 0.0, "latency_ms": None,
                         "queue_delay_ms": 0.0, "error": ""}
    return d


def _mutate_element(rng: random.Random, d: dict[Any, Any]) -> None:
    roll = rng.random()
    key = rng.choice([*d, "id"])
    if roll < 0.4:
        d[key] = rng.choice(TRICKY)  # often the same value of another type
    elif roll < 0.55:
        d[rng.choice(["new", "newer", 3])] = rng.choice([1, [1, {"a": 2}], {"x": None}, "s"])  # a newer writer's
    elif roll < 0.65:
        d.pop(key, None)  # an older writer's (or a required field missing)
    else:
        d[key] = rng.uniform(0, 100) if isinstance(d.get(key), float) else d.get(key)


class Cluster:
    """Invokers' reports as msgpack maps, changed a little every tick (figures, types, fields, invokers)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.reports: dict[str, dict[Any, Any]] = {}
        for k in range(6):
            self._new(f"invoker{k}")

    def _new(self, name: str) -> None:
        rng = self.rng
        self.reports[name] = {
            "invoker": name, "boot": "b", "at_ms": 0, "period_s": 1.0, "enabled": True, "epoch": 1,
            "gpus": [{"index": i, "uuid": f"{name}-g{i}", "name": "H100", "memory_mb": 81920, "sm_count": 132,
                      "simulated": False} for i in range(rng.randint(0, 3))],
            "instances": [_instance(rng, rng.randint(0, 30)) for _ in range(rng.randint(0, 4))],
            "functions": [{"function": f"ns/f{i}", "arrival_rate": 1.0} for i in range(rng.randint(0, 2))],
        }

    def tick(self) -> dict[str, bytes | None]:
        rng = self.rng
        for name, rep in list(self.reports.items()):
            rep["at_ms"] += 1000
            roll = rng.random()
            if roll < 0.05:
                del self.reports[name]  # gone (its key expired)
                continue
            for part in ("gpus", "instances", "functions"):
                items = rep.get(part)
                if isinstance(items, list):
                    for d in items:
                        if isinstance(d, dict) and rng.random() < 0.3:
                            _mutate_element(rng, d)
            if roll < 0.15:
                rep["instances"].append(_instance(rng, rng.randint(0, 30))) if isinstance(
                    rep.get("instances"), list) else None
            elif roll < 0.2 and isinstance(rep.get("instances"), list) and rep["instances"]:
                rep["instances"].pop(0)
            elif roll < 0.25:
                rep[rng.choice(["enabled", "epoch", "period_s", "user_memory_mb"])] = rng.choice(TRICKY)
            elif roll < 0.28:
                rep[rng.choice(["future", 5])] = rng.choice([1, [1, 2], {"k": [3]}])
        if rng.random() < 0.3:
            self._new(f"invoker{rng.randint(0, 9)}")  # back (or new)
        out: dict[str, bytes | None] = {}
        for name, rep in self.reports.items():
            raw = msgpack.packb(rep, use_bin_type=True)
            roll = rng.random()
            if roll < 0.02:
                raw = raw[: rng.randrange(len(raw))]  # truncated
            elif roll < 0.04:
                raw += b"\x01"  # trailing bytes
            elif roll < 0.05:
                raw = msgpack.packb([rep["invoker"]])  # not a map
            elif roll < 0.06:
                raw = msgpack.packb({**rep, "instances": rng.choice([{"a": 1}, "xy", None, 3, [1], [[]]])})
            elif roll < 0.07:
                raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))  # garbage
            out[name] = raw
        out["missing"] = None
        return out


@pytest.mark.parametrize("seed", range(12))
def test_the_decoder_answers_as_decode_over_changing_reports(seed: int) -> None:
    cluster, decoder = Cluster(seed), ReportDecoder()
    reused = 0
    for _ in range(40):
        previous = {id(x) for x in decoder._last[InstanceReport].values()}
        for raw in cluster.tick().values():
            got = outcome(decoder.decode, raw)
            assert_same_outcome(got, outcome(decode, LoadReport, raw))
            if got[0] == "ok" and got[1] is not None:
                reused += sum(id(i) in previous for i in got[1].instances)
        decoder.turn()
    assert reused > 10  # the elements whose bytes did not change are the objects decoded before


def test_the_same_bytes_of_another_type_are_not_the_same_element() -> None:
    decoder = ReportDecoder()
    base = {"invoker": "i", "boot": "b", "at_ms": 1}
    for value in (1, 1.0, True, 0.0, -0.0, 0, False, None):
        for key, element in (("gpus", {"index": 0, "uuid": "u", "memory_mb": value}),
                             ("instances", {"id": "i", "function": "f", "rev": "", "state": "s", "share": value}),
                             ("functions", {"function": "f", "arrival_rate": value})):
            raw = msgpack.packb({**base, key: [element]})
            got = decoder.decode(raw)
            assert same(got, decode(LoadReport, raw)), (key, value)
        decoder.turn()


def test_the_decoder_reuses_unchanged_lists_and_elements() -> None:
    decoder = ReportDecoder()
    rep: dict[str, Any] = {"invoker": "i", "boot": "b", "at_ms": 1,
                           "gpus": [{"index": 0, "uuid": "u"}],
                           "instances": [{"id": "a", "function": "f", "rev": "", "state": "ready"},
                                         {"id": "b", "function": "f", "rev": "", "state": "ready"}]}
    first = decoder.decode(msgpack.packb(rep))
    decoder.turn()
    rep["at_ms"], rep["instances"][1]["in_flight"] = 2, 1
    second = decoder.decode(msgpack.packb(rep))
    assert first is not None and second is not None and second.at_ms == 2
    assert second.gpus is first.gpus and second.instances[0] is first.instances[0]
    assert second.instances[1] is not first.instances[1] and second.instances[1].in_flight == 1
    # What no read since the last-but-one turn held is forgotten.
    decoder.turn()
    decoder.turn()
    assert all(not d for d in decoder._last.values())


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"


@pytest.mark.parametrize("where", ["element", "top"])
def test_msgpack_s_depth_limit_counts_from_the_report(where: str) -> None:
    """An element (or a newer writer's field) nested just deep enough that the whole report is too deep for
    msgpack, though the part alone is not: a WireError, as decode raises."""
    for depth in range(1018, 1026):
        inner = _nested(depth)
        if where == "element":
            element = (b"\x85\xa2id\xa1i\xa8function\xa1f\xa3rev\xa0\xa5state\xa1s\xa1x" + inner)
            raw = b"\x84\xa7invoker\xa1i\xa4boot\xa1b\xa5at_ms\x01\xa9instances\x91" + element
        else:
            raw = b"\x84\xa7invoker\xa1i\xa4boot\xa1b\xa5at_ms\x01\xa6future" + inner
        decoder = ReportDecoder()
        for _ in range(2):  # the second time from what the first left
            assert_same_outcome(outcome(decoder.decode, raw), outcome(decode, LoadReport, raw))
            decoder.turn()


def test_the_decoder_leaves_text_and_other_buffers_to_decode() -> None:
    decoder = ReportDecoder()
    assert decoder.decode(None) is None
    with pytest.raises(WireError, match="got text"):
        decoder.decode("text")
    raw = msgpack.packb({"invoker": "i", "boot": "b", "at_ms": 1})
    assert same(decoder.decode(bytearray(raw)), decode(LoadReport, raw))


def test_the_report_builder_is_loadreport_s() -> None:
    assert wire._REPORT_BUILDER is not None
    assert same(wire._REPORT_BUILDER({"invoker": "i", "boot": "b", "at_ms": 1, 2: 3, "new": 4}),
                LoadReport(invoker="i", boot="b", at_ms=1))
