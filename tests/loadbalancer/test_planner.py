"""The balancer's tick as tables: reports + instance table + registry in, orders out (no Redis, no clock)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dilu_invoker.loadbalancer.planner import (
    FunctionState,
    PlannerConfig,
    ReportIndex,
    TickInput,
    TickPlan,
    estimate_capacity,
    function_load,
    plan_tick,
    victim_order,
)
from dilu_invoker.policy import (
    ClusterSnapshot,
    GpuRef,
    GpuState,
    HorizontalConfig,
    HorizontalState,
    InstanceClass,
    PlacedInstance,
)
from dilu_invoker.wire import (
    FunctionReport,
    FunctionSpec,
    GpuReport,
    InstanceRecord,
    InstanceReport,
    LoadReport,
    RecordState,
    RoutingTable,
)

NOW = 1000.0
CFG = PlannerConfig(horizontal=HorizontalConfig(window=6, scale_out_samples=3, scale_in_samples=4, cooldown_s=1.0,
                                                scale_to_zero_after_s=30.0))


def spec(fqn: str = "guest/f", **kw: object) -> FunctionSpec:
    base: dict[str, object] = {"fqn": fqn, "rev": "1-a", "kind": "python:3-gpu", "cls": "inference", "request": 0.2,
                               "limit": 0.4, "memory_mb": 2000, "slots": 1, "capacity_rps": 4.0, "max_instances": 8}
    base.update(kw)
    return FunctionSpec(**base)  # type: ignore[arg-type]


def record(iid: str, *, fn: str = "guest/f", inv: str = "invoker0", gpu: int = 0, state: str = "ready",
           boot: str = "b0", since: float = NOW - 10, rev: str = "1-a", cls: str = "inference",
           request: float = 0.2, limit: float = 0.4, memory_mb: int = 2000, missing: int = 0) -> InstanceRecord:
    return InstanceRecord(id=iid, function=fn, rev=rev, invoker=inv, gpu=gpu, gpu_uuid=f"{inv}-g{gpu}", cls=cls,
                          request=request, limit=limit, memory_mb=memory_mb, state=state, since=since, epoch=1,
                          boot=boot, missing=missing)


def inst(iid: str, *, fn: str = "guest/f", state: str = "ready", gpu: int = 0, **kw: object) -> InstanceReport:
    return InstanceReport(id=iid, function=fn, rev="1-a", state=state, gpu=gpu, request=0.2, limit=0.4,
                          memory_mb=2000, **kw)  # type: ignore[arg-type]


def report(inv: str, *, boot: str = "b0", gpus: int = 1, instances: tuple[InstanceReport, ...] = (),
           functions: tuple[FunctionReport, ...] = (), enabled: bool = True, user_memory_mb: int = 0) -> LoadReport:
    return LoadReport(invoker=inv, boot=boot, at_ms=0, enabled=enabled, user_memory_mb=user_memory_mb,
                      gpus=tuple(GpuReport(index=i, uuid=f"{inv}-g{i}", memory_mb=16000) for i in range(gpus)),
                      instances=instances, functions=functions)


def cluster(reports: dict[str, LoadReport], records: dict[str, InstanceRecord] | None = None) -> ClusterSnapshot:
    """What the GPU budgets would hold: every record that is not on a gone invoker."""
    placed: dict[GpuRef, list[PlacedInstance]] = {}
    for r in (records or {}).values():
        if r.invoker in reports and r.gpu is not None:
            placed.setdefault(GpuRef(r.invoker, r.gpu), []).append(PlacedInstance(
                id=r.id, function=r.function, cls=InstanceClass.parse(r.cls), request=r.request, limit=r.limit,
                memory_mib=r.memory_mb))
    return ClusterSnapshot.build(now=NOW, gpus=[
        GpuState(ref=GpuRef(inv, g.index), memory_mib=g.memory_mb, uuid=g.uuid,
                 instances=tuple(placed.get(GpuRef(inv, g.index), ())), schedulable=rep.enabled)
        for inv, rep in reports.items() for g in rep.gpus])


def tick(reports: dict[str, LoadReport], records: dict[str, InstanceRecord] | None = None, *,
         specs: tuple[FunctionSpec, ...] = (), known: tuple[str, ...] = (), demand: dict[str, float] | None = None,
         states: dict[str, FunctionState] | None = None, routes: dict[str, RoutingTable] | None = None,
         now: float = NOW, no_gpus: bool = False, cfg: PlannerConfig = CFG) -> TickPlan:
    records = records or {}
    return plan_tick(TickInput(
        now=now, epoch=7, reports=reports, known_invokers=frozenset(known or reports), records=records,
        specs={s.fqn: s for s in (specs or (spec(),))},
        cluster=None if no_gpus else cluster(reports, records), demand=demand or {}, states=states or {},
        routes=routes or {}, seq=1), cfg)


def kinds(plan: TickPlan) -> list[str]:
    return [d.kind for d in plan.decisions]


# -- cold start, readiness, routes ------------------------------------------------------------------


def test_demand_without_instance_starts_one_at_once() -> None:
    plan = tick({"invoker0": report("invoker0"), "invoker1": report("invoker1")}, demand={"guest/f": NOW})
    assert [o.record.id for o in plan.starts] == ["guest-f-7-1"]
    started = plan.starts[0].record
    assert (started.invoker, started.gpu, started.state, started.epoch, started.boot) == (
        "invoker0", 0, RecordState.STARTING, 7, "b0")
    assert started.gpu_uuid == "invoker0-g0"
    assert kinds(plan) == ["scale-out", "place"]
    assert plan.routes["guest/f"].instances == ()  # not ready yet
    assert plan.states["guest/f"].owed == 0 and plan.seq == 2


def test_old_demand_signal_is_not_work() -> None:
    plan = tick({"invoker0": report("invoker0")}, demand={"guest/f": NOW - 10})
    assert plan.starts == () and kinds(plan) == []


def test_no_gpu_anywhere_routes_to_the_local_pools() -> None:
    plan = tick({"invoker0": report("invoker0", gpus=0)}, demand={"guest/f": NOW}, no_gpus=True)
    assert plan.starts == ()
    assert plan.routes["guest/f"].local_fallback is True


@pytest.mark.parametrize(("reported", "age", "expect"), [
    (None, 5.0, "kept"),
    (None, 500.0, "given-up"),
    ("starting", 5.0, "kept"),
    ("ready", 5.0, "ready"),
    ("failed", 5.0, "lost"),
], ids=["not-yet-seen", "never-started", "starting", "ready", "failed"])
def test_a_starting_instance(reported: str | None, age: float, expect: str) -> None:
    rec = record("i1", state="starting", since=NOW - age)
    extra = {"error": "start failed: no memory"} if reported == "failed" else {}
    rep = report("invoker0", instances=(inst("i1", state=reported, **extra),) if reported else ())
    plan = tick({"invoker0": rep}, {"i1": rec})
    if expect == "kept":
        assert plan.records["i1"].state == RecordState.STARTING and plan.stops == ()
    elif expect == "ready":
        assert plan.records["i1"].state == RecordState.READY and plan.records["i1"].since == NOW
        assert [e.id for e in plan.routes["guest/f"].instances] == ["i1"]
    elif expect == "given-up":
        assert "i1" not in plan.records and [o.record.id for o in plan.stops] == ["i1"]
        assert "not started" in plan.forgotten[0].reason
    else:
        assert "i1" not in plan.records and [o.record.id for o in plan.stops] == ["i1"]
        # It could not start: no new start for failed_retry_s; the routing table says why meanwhile.
        assert "lost" in kinds(plan) and plan.starts == ()
        assert "i1: failed on invoker0: start failed: no memory" in plan.routes["guest/f"].blocked
        later = tick({"invoker0": report("invoker0")}, {}, states=plan.states, now=NOW + 1.0)
        assert later.starts == () and later.routes["guest/f"].blocked == plan.routes["guest/f"].blocked
        retry = tick({"invoker0": report("invoker0")}, {}, states=plan.states, now=NOW + 6.0)
        assert len(retry.starts) == 1 and retry.routes["guest/f"].blocked == ""


def test_a_ready_instance_that_fails_is_replaced_at_once() -> None:
    rec = record("i1", state="ready", since=NOW - 50)
    plan = tick({"invoker0": report("invoker0", instances=(inst("i1", state="failed"),))}, {"i1": rec})
    assert "lost" in kinds(plan) and len(plan.starts) == 1


def test_route_version_changes_only_with_the_routes() -> None:
    rec = record("i1")
    rep = report("invoker0", instances=(inst("i1", in_flight=1),))
    first = tick({"invoker0": rep}, {"i1": rec})
    table = first.routes["guest/f"]
    assert table.version == 1 and table.instances[0].in_flight == 1
    busier = report("invoker0", instances=(inst("i1", in_flight=3),))
    second = tick({"invoker0": busier}, first.records, routes=dict(first.routes), states=dict(first.states))
    assert second.routes["guest/f"].version == 1  # same instances, new load figures
    assert second.routes["guest/f"].instances[0].in_flight == 3
    gone = tick({"invoker0": report("invoker0")}, {}, routes=dict(second.routes))
    assert gone.routes["guest/f"].version == 2 and gone.routes["guest/f"].instances == ()


# -- losses -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["report-expired", "restarted", "vanished"])
def test_lost_instances_are_replaced_elsewhere(how: str) -> None:
    records = {"i1": record("i1", inv="invoker1", boot="b1"), "i2": record("i2", inv="invoker0")}
    reports = {"invoker0": report("invoker0", instances=(inst("i2"),))}
    if how == "restarted":
        reports["invoker1"] = report("invoker1", boot="b1-new")
    elif how == "vanished":
        reports["invoker1"] = report("invoker1", boot="b1")
        records["i1"] = replace(records["i1"], missing=CFG.missing_ticks - 1)
    plan = tick(reports, records, known=("invoker0", "invoker1"))
    assert "i1" not in plan.records
    assert kinds(plan)[:1] == ["lost"] and "replace" in kinds(plan)
    assert len(plan.starts) == 1
    new = plan.starts[0].record
    # The lit GPU beside the surviving instance wins over lighting invoker1's (spread never lights a GPU).
    assert (new.invoker, new.gpu) == ("invoker0", 0)
    assert plan.gone == ({"invoker1"} if how == "report-expired" else frozenset())


def test_a_ready_instance_may_miss_a_report_or_two() -> None:
    plan = tick({"invoker0": report("invoker0")}, {"i1": record("i1")})
    assert plan.records["i1"].missing == 1 and plan.starts == () and plan.stops == ()


def test_an_instance_unknown_to_the_table_is_stopped() -> None:
    rep = report("invoker0", instances=(inst("ghost"), inst("leaving", state="draining")))
    plan = tick({"invoker0": rep})
    assert [(o.record.id, o.record.invoker) for o in plan.stops] == [("ghost", "invoker0")]
    assert "unknown" in plan.stops[0].reason and "ghost" not in plan.records


def test_an_updated_action_replaces_its_instances() -> None:
    old = record("i1", rev="1-a")
    plan = tick({"invoker0": report("invoker0", instances=(inst("i1"),))}, {"i1": old},
                specs=(spec(rev="2-b"),))
    assert plan.records["i1"].state == RecordState.STOPPING
    assert [o.record.id for o in plan.stops] == ["i1"]
    assert [o.record.rev for o in plan.starts] == ["2-b"]
    assert plan.routes["guest/f"].instances == () and plan.routes["guest/f"].rev == "2-b"


def test_a_stopped_instance_leaves_the_table_once_its_invoker_dropped_it() -> None:
    stopping = record("i1", state="stopping")
    still = tick({"invoker0": report("invoker0", instances=(inst("i1", state="draining"),))}, {"i1": stopping})
    assert still.records["i1"].state == RecordState.STOPPING and still.stops == ()
    done = tick({"invoker0": report("invoker0")}, {"i1": stopping})
    assert "i1" not in done.records and kinds(done) == ["forget"] and done.starts == ()


# -- scaling ----------------------------------------------------------------------------------------


def test_min_instances_spread_over_invokers_without_traffic() -> None:
    reports = {"invoker0": report("invoker0"), "invoker1": report("invoker1")}
    other = {"o1": record("o1", fn="guest/o", inv="invoker1"), "o0": record("o0", fn="guest/o", inv="invoker0")}
    plan = tick(reports, other, specs=(spec(min_instances=2), spec("guest/o")))
    assert sorted(o.record.invoker for o in plan.starts) == ["invoker0", "invoker1"]
    assert "spread" in plan.starts[1].reason


def _rising(n: int, rate: float) -> HorizontalState:
    return HorizontalState(rates=(rate,) * n, last_sample_at=NOW - 1, last_busy_at=NOW - 1)


def test_sustained_load_scales_out_and_a_burst_does_not() -> None:
    reports = {"invoker0": report("invoker0", instances=(inst("i1"),),
                                  functions=(FunctionReport("guest/f", arrival_rate=10.0),)),
               "invoker1": report("invoker1", functions=(FunctionReport("guest/f", arrival_rate=2.0),))}
    records = {"i1": record("i1")}
    # 12 req/s against 4 per instance: 2 earlier samples over capacity + this one = 3 of the window.
    out = tick(reports, records, states={"guest/f": FunctionState(horizontal=_rising(2, 12.0))})
    assert [d.trigger.value for d in out.scale] == ["sustained-load"] and len(out.starts) == 2
    burst = tick(reports, records, states={"guest/f": FunctionState(horizontal=_rising(1, 12.0))})
    assert burst.starts == () and burst.scale[0].action.value == "hold"


def test_sustained_underload_stops_one_from_the_invoker_holding_most() -> None:
    reports = {"invoker0": report("invoker0", instances=(inst("a"), inst("b"))),
               "invoker1": report("invoker1", instances=(inst("c"),))}
    records = {"a": record("a", since=NOW - 30), "b": record("b", since=NOW - 20), "c": record("c", inv="invoker1")}
    state = FunctionState(horizontal=HorizontalState(rates=(1.0,) * 3, last_sample_at=NOW - 1,
                                                     last_busy_at=NOW - 1))
    reports["invoker0"] = replace(reports["invoker0"], functions=(FunctionReport("guest/f", arrival_rate=1.0),))
    plan = tick(reports, records, states={"guest/f": state})
    assert [d.trigger.value for d in plan.scale] == ["sustained-underload"]
    assert [o.record.id for o in plan.stops] == ["b"]  # on invoker0, the newer of its two
    assert plan.records["b"].state == RecordState.STOPPING
    assert [e.id for e in plan.routes["guest/f"].instances] == ["a", "c"]


def test_blocked_placement_is_owed_and_retried_quietly() -> None:
    full = {"x": record("x", fn="guest/big", request=0.9, limit=1.0, memory_mb=15000)}
    reports = {"invoker0": report("invoker0", instances=(inst("x", fn="guest/big"),))}
    specs = (spec(request=0.3), spec("guest/big"))
    first = tick(reports, full, specs=specs, demand={"guest/f": NOW})
    assert first.starts == () and kinds(first) == ["scale-out", "blocked"]
    assert first.states["guest/f"].owed == 1 and "sm-request" in first.states["guest/f"].blocked
    assert first.routes["guest/f"].blocked
    again = tick(reports, first.records, specs=specs, states=dict(first.states), demand={"guest/f": NOW + 0.5},
                 now=NOW + 0.5)
    assert again.starts == () and kinds(again) == []  # still blocked: nothing new to say
    roomy = {"invoker0": reports["invoker0"], "invoker1": report("invoker1")}
    later = tick(roomy, first.records, specs=specs, states=dict(again.states), now=NOW + 1)
    assert [o.record.invoker for o in later.starts] == ["invoker1"] and later.states["guest/f"].owed == 0


def test_a_disabled_invoker_gets_nothing_new() -> None:
    reports = {"invoker0": report("invoker0", enabled=False), "invoker1": report("invoker1")}
    plan = tick(reports, demand={"guest/f": NOW})
    assert [o.record.invoker for o in plan.starts] == ["invoker1"]


# -- helpers ----------------------------------------------------------------------------------------


def test_function_load_sums_every_report() -> None:
    reports = {
        "invoker0": report("invoker0", instances=(inst("a", waiting=2, in_flight=1, saturated=True,
                                                      queue_delay_ms=30.0),),
                           functions=(FunctionReport("guest/f", arrival_rate=3.0, waiting=1, queue_delay_ms=80.0),)),
        "invoker1": report("invoker1", instances=(inst("b", in_flight=1, saturated=False),),
                           functions=(FunctionReport("guest/f", arrival_rate=2.5),)),
    }
    records = [record("a"), record("b", inv="invoker1"), record("c", state="starting")]
    load = function_load(spec(slo_ms=50.0), now=NOW, records=records, reports=reports, demand_at=None,
                         demand_hold_s=2.0)
    assert (load.instances, load.starting, load.arrival_rate, load.waiting, load.in_flight) == (2, 1, 5.5, 3, 2)
    assert (load.instances_at_limit, load.queue_delay_ms, load.slo_ms) == (1, 80.0, 50.0)
    held = function_load(spec(), now=NOW, records=[], reports={}, demand_at=NOW - 1, demand_hold_s=2.0)
    assert held.waiting == 1 and held.instances == 0
    # The tick's index of the reports (made once for every function) gives the same load; another function's
    # instance and figures in the same reports change nothing.
    other = {inv: replace(rep, instances=(*rep.instances, replace(inst("z", waiting=9), function="guest/g")),
                          functions=(*rep.functions, FunctionReport("guest/g", arrival_rate=7.0, waiting=4)))
             for inv, rep in reports.items()}
    assert function_load(spec(slo_ms=50.0), now=NOW, records=records, reports=other, demand_at=None,
                         demand_hold_s=2.0, index=ReportIndex.of(other)) == load


@pytest.mark.parametrize(("rows", "expect"), [
    ([], None),
    ([(0.0, None, 1)], None),
    ([(10.0, 100.0, 1)], 10.0),
    ([(10.0, 100.0, 1), (10.0, 300.0, 1)], 5.0),
    ([(4.0, 250.0, 2)], 8.0),
], ids=["nothing", "no-completions", "one", "two-weighted", "two-slots"])
def test_estimate_capacity(rows: list[tuple[float, float | None, int]], expect: float | None) -> None:
    reports = [inst(f"i{k}", completion_rate=c, latency_ms=lat, slots=s) for k, (c, lat, s) in enumerate(rows)]
    got = estimate_capacity(reports)
    assert got == pytest.approx(expect) if expect is not None else got is None


def test_victims_keep_the_function_spread() -> None:
    recs = [record("a", inv="invoker0", since=1), record("b", inv="invoker0", since=2),
            record("c", inv="invoker1", since=3)]
    reports = {"invoker0": report("invoker0", instances=(inst("a", in_flight=1), inst("b"))),
               "invoker1": report("invoker1", instances=(inst("c"),))}
    order = [r.id for r in victim_order(recs, cluster=None, reports=reports)]
    assert order == ["b", "a", "c"]


def test_planner_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="start_timeout_s"):
        PlannerConfig(start_timeout_s=0)
    with pytest.raises(ValueError, match="missing_ticks"):
        PlannerConfig(missing_ticks=0)


@pytest.mark.parametrize(("user_memory", "held", "placed_on"), [
    (8000, 4000, "invoker0"),  # room for one more (2000 MB each)
    (4000, 4000, "invoker1"),  # invoker0 is full of placed instances: the other one
    (0, 4000, "invoker0"),  # an invoker that does not say is not judged
], ids=["fits", "full-goes-elsewhere", "unknown-user-memory"])
def test_placed_instances_hold_user_memory(user_memory: int, held: int, placed_on: str) -> None:
    other = spec(fqn="guest/g", min_instances=2, user_memory_mb=2000)
    recs = {f"g{i}": replace(record(f"g{i}", fn="guest/g"), user_memory_mb=2000) for i in range(held // 2000)}
    reps = {"invoker0": report("invoker0", user_memory_mb=user_memory,
                               instances=tuple(inst(f"g{i}", fn="guest/g") for i in range(held // 2000))),
            "invoker1": report("invoker1", user_memory_mb=8000)}
    plan = tick(reps, recs, specs=(spec(user_memory_mb=2000), other), demand={"guest/f": NOW})
    assert [o.record.invoker for o in plan.starts] == [placed_on]


def test_no_user_memory_anywhere_blocks_with_the_numbers() -> None:
    recs = {"g0": replace(record("g0", fn="guest/g"), user_memory_mb=2048)}
    reps = {"invoker0": report("invoker0", user_memory_mb=2048, instances=(inst("g0", fn="guest/g"),))}
    plan = tick(reps, recs, specs=(spec(user_memory_mb=2048), spec(fqn="guest/g", min_instances=1,
                                                                   user_memory_mb=2048)),
                demand={"guest/f": NOW})
    assert plan.starts == ()
    blocked = plan.routes["guest/f"].blocked
    assert blocked == ("invoker user memory: guest/f needs 2048 MB; invoker invoker0: 2048 of 2048 MB user memory "
                       "held by placed instances, 0 MB free"), blocked
    assert "blocked" in kinds(plan)


def test_user_memory_is_counted_across_the_placements_of_one_tick() -> None:
    """One tick that places several instances charges each to its invoker before placing the next: the fourth
    finds no invoker with 2000 MB left and the function is blocked with the numbers."""
    reps = {"invoker0": report("invoker0", user_memory_mb=4000), "invoker1": report("invoker1", user_memory_mb=2000)}
    plan = tick(reps, specs=(spec(min_instances=4, max_instances=4, user_memory_mb=2000),), demand={"guest/f": NOW})
    assert sorted(o.record.invoker for o in plan.starts) == ["invoker0", "invoker0", "invoker1"]
    assert "blocked" in kinds(plan)
    assert plan.states["guest/f"].blocked.startswith("invoker user memory: guest/f needs 2000 MB; "
                                                     "invoker invoker0: 4000 of 4000 MB")
