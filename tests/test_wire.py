"""Wire formats shared by invokers and the balancer: round trips, tolerance, validation."""

from __future__ import annotations

import msgpack
import pytest

from dilu_invoker.model import Action, Exec, Parameter, ValidationError
from dilu_invoker.wire import (
    FunctionReport,
    FunctionSpec,
    GpuReport,
    InstanceCommand,
    InstanceReport,
    LoadReport,
    RouteEntry,
    RoutingTable,
    WireError,
    decode,
    pack,
    revision_generation,
)


def test_load_report_round_trip() -> None:
    report = LoadReport(
        invoker="invoker3", boot="abc", at_ms=123, enabled=False, epoch=4, user_memory_mb=2048,
        gpus=(GpuReport(index=1, uuid="GPU-x", memory_mb=81920, sm_count=132, simulated=True),),
        instances=(InstanceReport(id="i", function="ns/f", rev="1-a", state="ready", gpu=1, share=None,
                                  saturated=True, latency_ms=12.5),),
        functions=(FunctionReport(function="ns/f", arrival_rate=3.5, waiting=2),))
    assert decode(LoadReport, pack(report)) == report


def test_newer_writers_and_older_readers_get_along() -> None:
    raw = msgpack.packb({"invoker": "invoker0", "boot": "b", "at_ms": 1, "from_the_future": [1, 2],
                         "instances": [{"id": "i", "function": "f", "rev": "", "state": "ready", "new": 1}]})
    report = decode(LoadReport, raw)
    assert report is not None and report.instances[0].id == "i" and report.gpus == ()


@pytest.mark.parametrize("raw", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"boot": "b"}), "text"],
                         ids=["not-msgpack", "not-a-map", "missing-field", "text"])
def test_garbage_is_a_wire_error(raw: bytes | str) -> None:
    with pytest.raises(WireError):
        decode(LoadReport, raw)


def test_routes_compare_without_load_figures() -> None:
    a = RoutingTable(function="f", rev="1", epoch=1, version=3, instances=(RouteEntry("i", "invoker0", in_flight=2),))
    b = RoutingTable(function="f", rev="1", epoch=2, version=4, instances=(RouteEntry("i", "invoker0", waiting=7),))
    assert a.same_routes(b) and not a.same_routes(None)
    assert not a.same_routes(RoutingTable(function="f", rev="1", epoch=1, version=3))
    assert decode(RoutingTable, pack(a)) == a
    assert decode(InstanceCommand, pack(InstanceCommand(op="stop", epoch=2, instance="i", function="f"))).op == "stop"


def _action(**annotations: object) -> Action:
    return Action(namespace="ns", name="f", exec=Exec(kind="python:3-gpu", code="x"), revision="3-abc",
                  annotations=tuple(Parameter(k, v) for k, v in annotations.items()))


def test_function_spec_from_annotations() -> None:
    spec = FunctionSpec.of(_action(**{"gpu-class": "training", "gpu-sm-request": 0.3, "gpu-sm-limit": 0.6,
                                      "gpu-memory-mb": 9000, "capacity-rps": "12.5", "gpu-profile": "memory",
                                      "placement-affinity": "pack", "min-instances": 1, "max-instances": 3}))
    assert (spec.fqn, spec.rev, spec.cls, spec.request, spec.limit, spec.memory_mb) == (
        "ns/f", "3-abc", "training", 0.3, 0.6, 9000)
    assert (spec.capacity_rps, spec.profile, spec.affinity, spec.min_instances, spec.max_instances) == (
        12.5, "memory", "pack", 1, 3)
    assert decode(FunctionSpec, pack(spec)) == spec


@pytest.mark.parametrize(("annotations", "message"), [
    ({"capacity-rps": 0}, "capacity-rps"),
    ({"capacity-rps": True}, "capacity-rps"),
    ({"capacity-rps": "fast"}, "capacity-rps"),
    ({"gpu-profile": "disk"}, "gpu-profile"),
    ({"placement-affinity": "near"}, "placement-affinity"),
    ({"gpu-sm-request": 2}, "gpu-sm-request"),
])
def test_function_spec_refuses_bad_annotations(annotations: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FunctionSpec.of(_action(**annotations))


@pytest.mark.parametrize(("rev", "gen"), [(None, 0), ("", 0), ("7-abc", 7), ("12-x-y", 12), ("abc", 0)])
def test_revision_generation(rev: str | None, gen: int) -> None:
    assert revision_generation(rev) == gen
