"""Live compaction in the balancer's tick, as tables: the simulator's `compaction_plan`, carried out
make-before-break (start a replacement, route to it once ready, drain the original), rate-limited, never
for a function in a burst, off unless configured."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from dilu_invoker.loadbalancer.planner import (
    FAILED_MOVE_COOLDOWN_RUNS,
    FAILED_TARGET_HOLD_S,
    CompactionLoop,
    PlannerConfig,
    TickInput,
    TickPlan,
    plan_tick,
)
from dilu_invoker.policy.live_compaction import LIVE_COMPACTION, LiveCompaction
from dilu_invoker.sim.placement import SIM_COMPACTION
from dilu_invoker.wire import FunctionReport, RecordState
from tests.loadbalancer.test_planner import CFG, NOW, cluster, inst, record, report, spec, tick

ON = replace(CFG, compaction=LiveCompaction(period_s=10.0))
F, G = "guest/f", "guest/g"
SPECS = (spec(F), spec(G))


def two_gpus(**reports_kw: object) -> tuple[dict, dict]:
    """f's instance a alone on invoker0's GPU, g's instance b alone on invoker1's: one GPU can go dark."""
    records = {"a": record("a", fn=F, inv="invoker0"), "b": record("b", fn=G, inv="invoker1")}
    reports = {
        "invoker0": report("invoker0", instances=(inst("a", fn=F),), **reports_kw),  # type: ignore[arg-type]
        "invoker1": report("invoker1", instances=(inst("b", fn=G),)),
    }
    return reports, records


def moves(plan: TickPlan) -> list[tuple[str, str, str]]:
    """(replacement's function, the instance it replaces, its invoker) of each move started."""
    return [(o.record.function, o.record.replaces, o.record.invoker) for o in plan.starts if o.record.replaces]


@dataclass(frozen=True)
class Case:
    cfg: PlannerConfig
    waiting: tuple[str, ...] = ()
    """Functions with activations waiting at a router (a burst)."""
    loop: CompactionLoop = field(default_factory=CompactionLoop)
    expect: tuple[tuple[str, str, str], ...] = ()


CASES = {
    "off by default": Case(CFG),
    # Sources lowest Σ request first, then cluster order: invoker0's GPU empties into invoker1's.
    "calm: a moves beside b": Case(ON, expect=((F, "a", "invoker1"),)),
    # f waits for a slot: its instance stays; g's moves beside it instead.
    "f in a burst: b moves instead": Case(ON, waiting=(F,), expect=((G, "b", "invoker0"),)),
    "both in a burst: nothing moves": Case(ON, waiting=(F, G)),
    "within the period of the last run": Case(ON, loop=CompactionLoop(next_at=NOW + 5)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_compaction_decides_moves(case: Case) -> None:
    reports, records = two_gpus()
    reports = {
        inv: replace(rep, functions=tuple(FunctionReport(function=f, waiting=1) for f in case.waiting
                                          if any(i.function == f for i in rep.instances)))
        for inv, rep in reports.items()
    }
    plan = _tick(reports, records, cfg=case.cfg, loop=case.loop)
    assert tuple(moves(plan)) == case.expect
    # A run is timed (the leader's metric dilu_balancer_compaction_run_cpu_seconds); no run, no time.
    ran = plan.compaction.next_at != case.loop.next_at
    assert ran is (case.cfg.compaction is not None and case.loop.next_at <= NOW)
    assert (plan.compaction_cpu_s is not None) is ran and (plan.compaction_cpu_s or 0.0) >= 0.0
    # Make-before-break: the originals still serve, the replacement is not routed to yet.
    assert plan.records["a"].state == RecordState.READY and plan.records["b"].state == RecordState.READY
    assert [e.id for e in plan.routes[F].instances] == ["a"]
    assert plan.stops == ()
    if case.expect:
        assert [d.kind for d in plan.decisions] == ["move"]
        assert plan.compaction.next_at == NOW + 10.0
        # A replacement is not one more instance of the function: nothing scales in.
        again = _tick(reports, plan.records, cfg=case.cfg, loop=replace(plan.compaction, next_at=0.0),
                      states=dict(plan.states))
        assert "scale-in" not in [d.kind for d in again.decisions]
        assert moves(again) == []  # one move in flight: no new run


def _tick(reports: dict, records: dict, *, cfg: PlannerConfig, loop: CompactionLoop | None = None,
          states: dict | None = None, now: float = NOW) -> TickPlan:


    return plan_tick(TickInput(
        now=now, epoch=7, reports=reports, known_invokers=frozenset(reports), records=records,
        specs={s.fqn: s for s in SPECS}, cluster=cluster(reports, records), states=states or {}, seq=1,
        compaction=loop or CompactionLoop()), cfg)


def started() -> tuple[dict, dict, TickPlan]:
    reports, records = two_gpus()
    plan = _tick(reports, records, cfg=ON)
    assert moves(plan) == [(F, "a", "invoker1")]
    return reports, dict(plan.records), plan


def test_a_ready_replacement_takes_over_and_the_original_drains() -> None:
    reports, records, first = started()
    rid = next(o.record.id for o in first.starts)
    reports["invoker1"] = replace(reports["invoker1"], instances=(*reports["invoker1"].instances, inst(rid, fn=F)))
    plan = _tick(reports, records, cfg=ON, loop=first.compaction, now=NOW + 1)
    assert plan.records[rid].state == RecordState.READY and plan.records[rid].replaces == ""
    assert plan.records["a"].state == RecordState.STOPPING
    assert [(o.record.id, o.record.invoker) for o in plan.stops] == [("a", "invoker0")]
    assert [e.id for e in plan.routes[F].instances] == [rid]
    assert "move-done" in [d.kind for d in plan.decisions]
    assert plan.starts == ()


def test_a_failed_replacement_is_abandoned_and_owes_nothing() -> None:
    reports, records, first = started()
    rid = next(o.record.id for o in first.starts)
    reports["invoker1"] = replace(reports["invoker1"],
                                  instances=(*reports["invoker1"].instances, inst(rid, fn=F, state="failed")))
    plan = _tick(reports, records, cfg=ON, loop=first.compaction, now=NOW + 1)
    assert rid not in plan.records
    assert plan.records["a"].state == RecordState.READY
    assert [e.id for e in plan.routes[F].instances] == ["a"]
    assert "move-abandoned" in [d.kind for d in plan.decisions]
    assert plan.starts == ()  # no replacement for a replacement
    assert plan.states[F].owed == 0
    # a cools down: the next runs leave it where it is (b moves beside it instead) until FAILED_MOVE_COOLDOWN_RUNS
    # periods have passed; then it may move again.
    until = NOW + 1 + FAILED_MOVE_COOLDOWN_RUNS * 10.0
    assert plan.compaction.cooling == (("a", until),)
    reports["invoker1"] = report("invoker1", instances=(inst("b", fn=G),))
    later = _tick(reports, dict(plan.records), cfg=ON, loop=replace(plan.compaction, next_at=0.0), now=NOW + 20)
    assert moves(later) == [(G, "b", "invoker0")]
    assert later.compaction.cooling == (("a", until),)
    # The GPU the replacement failed on is remembered for FAILED_TARGET_HOLD_S: once a has cooled down, a plan that
    # moves f's instance there again is not carried out (move-held; a cools down again) and b moves instead ...
    assert plan.compaction.failed_targets == ((F, "invoker1", 0, NOW + 1 + FAILED_TARGET_HOLD_S),)
    after = _tick(reports, dict(plan.records), cfg=ON, loop=replace(plan.compaction, next_at=0.0), now=until + 1)
    assert moves(after) == [(G, "b", "invoker0")]
    [held] = [d for d in after.decisions if d.kind == "move-held"]
    assert held.instance == "a" and "onto invoker1/gpu0 failed lately" in held.reason
    assert after.compaction.cooling == (("a", until + 1 + FAILED_MOVE_COOLDOWN_RUNS * 10.0),)
    # ... until the GPU is no longer held against f: then a may move there again.
    later = NOW + 2 + FAILED_TARGET_HOLD_S
    again = _tick(reports, dict(plan.records), cfg=ON, loop=replace(plan.compaction, next_at=0.0), now=later)
    assert moves(again) == [(F, "a", "invoker1")]
    assert again.compaction.cooling == () and again.compaction.failed_targets == ()


def test_live_defaults() -> None:
    assert (LIVE_COMPACTION.source_max_request, LIVE_COMPACTION.max_sources, LIVE_COMPACTION.max_moves,
            LIVE_COMPACTION.move_pieces, LIVE_COMPACTION.merges) == (0.5, 32, 2, True, 0)
    # A run that merges (--balancer-compaction-merges) looks as the simulator's does.
    assert (LIVE_COMPACTION.merge_sources, LIVE_COMPACTION.merge_source_instances) == (
        SIM_COMPACTION.merge_sources, SIM_COMPACTION.merge_source_instances) == (256, 1)
    # No memory merges by default; a run that merges memory (--balancer-compaction-memory-merges) does so only
    # while the lit GPUs are more than 0.5% over the integral bound.
    assert (LIVE_COMPACTION.memory_merges, LIVE_COMPACTION.memory_merge_above) == (0, 0.005)
    with pytest.raises(ValueError, match="period_s"):
        LiveCompaction(period_s=0)
    assert tick({"invoker0": report("invoker0")}).compaction == CompactionLoop()


# -- user memory (docs/balancer.md, "User memory") ------------------------------------------------------------------


#: (invoker0's user memory, invoker1's) → the moves made, the instances held back by memory
MEMORY_CASES = {
    "room on both: a moves beside b": ((4000, 4000), [(F, "a", "invoker1")], set()),
    "invoker1 full: a stays, b moves beside it": ((4000, 2000), [(G, "b", "invoker0")], {"a"}),
    "both full: nothing moves": ((2000, 2000), [], {"a", "b"}),
    "an invoker that does not say has room": ((0, 0), [(F, "a", "invoker1")], set()),
}


@pytest.mark.parametrize(("memory", "expect", "held"), MEMORY_CASES.values(), ids=MEMORY_CASES.keys())
def test_a_move_needs_user_memory_on_its_target(memory: tuple[int, int], expect: list, held: set[str]) -> None:
    """A replacement is a pinned container holding its action's memory on its target invoker while the original
    still holds its own: compaction makes no move the target's user memory cannot hold; that instance stays (and
    cools down) and the run plans again without it."""
    reports, records = two_gpus()
    reports = {inv: replace(rep, user_memory_mb=mb) for (inv, rep), mb in zip(reports.items(), memory, strict=True)}
    records = {i: replace(r, user_memory_mb=2000) for i, r in records.items()}
    specs = (spec(F, user_memory_mb=2000), spec(G, user_memory_mb=2000))
    plan = plan_tick(TickInput(
        now=NOW, epoch=7, reports=reports, known_invokers=frozenset(reports), records=records,
        specs={s.fqn: s for s in specs}, cluster=cluster(reports, records), states={}, seq=1,
        compaction=CompactionLoop()), ON)
    assert moves(plan) == expect
    assert {d.instance for d in plan.decisions if d.kind == "move-held"} == held
    for d in plan.decisions:
        if d.kind == "move-held":
            assert "needs 2000 MB" in d.reason and "0 of 2000 MB free" in d.reason
    until = NOW + FAILED_MOVE_COOLDOWN_RUNS * 10.0
    assert plan.compaction.cooling == tuple((i, until) for i in sorted(held))
    # What a move starts is held at once: the replacement's memory on its invoker, beside the original's.
    for o in plan.starts:
        assert o.record.user_memory_mb == 2000 and o.record.invoker in reports
