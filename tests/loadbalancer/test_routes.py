"""A tick's routing tables (`planner._routes`): the table published last is handed back as it is when the tick would
make an equal one (the service then writes nothing for it); otherwise a new table, whose version moves when its
routes (not its load figures) changed (`RoutingTable.same_routes`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dilu_invoker.loadbalancer.planner import FunctionState, TickInput, _routes
from dilu_invoker.wire import (
    FunctionSpec,
    InstanceRecord,
    InstanceReport,
    LoadReport,
    RecordState,
    RouteEntry,
    RoutingTable,
)

FN = "guest/f"
SPEC = FunctionSpec(fqn=FN, rev="2-a", kind="python:3-gpu", cls="inference", request=0.2, limit=0.4, memory_mb=1000)


def _record(rid: str, *, rev: str = "2-a", state: str = RecordState.READY.value, slots: int = 1) -> InstanceRecord:
    return InstanceRecord(id=rid, function=FN, rev=rev, invoker="inv0", gpu=0, gpu_uuid=None, cls="inference",
                          request=0.2, limit=0.4, memory_mb=1000, slots=slots, state=state, since=0.0, epoch=3)


RECORDS = {"r1": _record("r1"), "r2": _record("r2", slots=2)}
PUBLISHED = RoutingTable(function=FN, rev="2-a", epoch=3, version=7, instances=(
    RouteEntry("r1", "inv0", 1, 1, 0), RouteEntry("r2", "inv0", 2, 0, 1)))


def _plan(prev: RoutingTable, *, records: dict[str, InstanceRecord] = RECORDS, in_flight: int = 1,
          blocked: str = "") -> RoutingTable:
    report = LoadReport(invoker="inv0", boot="b", at_ms=0, instances=(
        InstanceReport(id="r1", function=FN, rev="2-a", state="ready", in_flight=in_flight),
        InstanceReport(id="r2", function=FN, rev="2-a", state="ready", waiting=1)))
    inp = TickInput(now=10.0, epoch=3, reports={"inv0": report}, known_invokers=frozenset({"inv0"}), records=records,
                    specs={FN: SPEC}, cluster=None, routes={FN: prev})
    states = {FN: FunctionState(blocked=blocked)}
    return _routes(inp, records, states, None)[FN]


def test_an_equal_table_is_the_published_one() -> None:
    assert _plan(replace(PUBLISHED, local_fallback=True)) is not PUBLISHED
    prev = replace(PUBLISHED, local_fallback=True)
    assert _plan(prev) is prev


@pytest.mark.parametrize(("prev", "kw", "version"), [
    (dict(epoch=2), {}, 7),  # another epoch's table: made anew, the same routes
    (dict(function="guest/g"), {}, 7),  # a table under another name
    ({}, dict(in_flight=3), 7),  # the load figures moved: a new table, the same routes
    (dict(rev="1-a"), {}, 8),
    (dict(blocked="no room"), {}, 8),
    (dict(version=9), dict(records={"r1": RECORDS["r1"]}), 10),  # an instance less
    (dict(version=9), dict(records={**RECORDS, "r2": replace(RECORDS["r2"], slots=3)}), 10),
    (dict(version=9), dict(records={**RECORDS, "r2": replace(RECORDS["r2"], invoker="inv1")}), 10),
    ({}, dict(records={"r1": RECORDS["r1"], "r3": _record("r3")}), 8),  # another instance's id
    ({}, dict(records={**RECORDS, "r2": replace(RECORDS["r2"], rev="1-a")}), 8),  # an outdated instance
], ids=["epoch", "name", "figures", "rev", "blocked", "fewer", "slots", "invoker", "id", "outdated"])
def test_another_table_is_made_anew(prev: dict[str, object], kw: dict[str, object], version: int) -> None:
    published = replace(PUBLISHED, local_fallback=True, **prev)  # type: ignore[arg-type]
    table = _plan(published, **kw)  # type: ignore[arg-type]
    assert table is not published and table != published
    assert table.version == version and table.function == FN and table.epoch == 3 and table.local_fallback
    # what `RoutingTable.same_routes` says of the two
    assert (version == published.version) == replace(table, version=published.version).same_routes(published)


def test_a_blocked_function_without_instances_carries_why() -> None:
    prev = RoutingTable(function=FN, rev="2-a", epoch=3, version=4, local_fallback=True)
    table = _plan(prev, records={}, blocked="no room")
    assert table == replace(prev, version=5, blocked="no room")
    assert _plan(table, records={}, blocked="no room") is table
