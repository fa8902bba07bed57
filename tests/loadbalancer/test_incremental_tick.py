"""An incremental tick decides as a tick from scratch: random tick sequences on a small simulated cluster, where
at every tick the plan made with the last plan's memo (`TickInput.memo`) equals the plan made without it.

The world (invokers, their reports and GPU budgets) follows the plans the memo made, as the service would, and
changes at random between ticks: functions come and go, their revision changes, traffic starts, stops and
shifts, demand signals arrive, instances fail or are slow to start, invokers are lost, come back with a new boot
(or restart in place, reporting the same instances under the new boot once) or are disabled,
the budget refuses a start (the service then drops the record and owes the instance), the registry and the
demand signals change in place (the memo must not see its own inputs change under it), the clock jumps (past
the window's staleness, the cooldown, the idle timeout) or ticks early (a demand signal), and compaction falls
due. Most ticks change little, so most functions take the repeated path.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dilu_invoker.loadbalancer.planner import (
    CompactionLoop,
    FunctionState,
    PlanMemo,
    PlannerConfig,
    TickInput,
    TickPlan,
    plan_tick,
)
from dilu_invoker.policy import (
    ClusterSnapshot,
    GpuRef,
    GpuState,
    HorizontalConfig,
    HorizontalState,
    InstanceClass,
    PlacedInstance,
    ScaleAction,
    ScaleDecision,
    ScaleTrigger,
    decide_scale,
    repeat_decision,
)
from dilu_invoker.policy.horizontal import FunctionLoad
from dilu_invoker.policy.live_compaction import LiveCompaction, live_compaction_config
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

HORIZONTAL = HorizontalConfig(window=3, scale_out_samples=2, scale_in_samples=2, cooldown_s=2.5,
                              scale_to_zero_after_s=6.0, stale_after_s=5.0)
CFG = PlannerConfig(horizontal=HORIZONTAL, start_timeout_s=4.0, failed_retry_s=2.0,
                    compaction=LiveCompaction(config=live_compaction_config(max_moves=4, max_request=1.0),
                                              period_s=3.0))


class World:
    """Invokers of two 8 GB GPUs that run what the plans say (a start is ready at the next report)."""

    def __init__(self, rng: random.Random, invokers: int = 5, functions: int = 10) -> None:
        self.rng = rng
        self.now = 1000.0
        self.boots = {f"inv{i}": "b0" for i in range(invokers)}
        self.down: set[str] = set()
        self.disabled: set[str] = set()
        self.failing: set[str] = set()
        self.slow: set[str] = set()
        """Starting instances whose invoker reports them starting (not ready yet)."""
        self.restarted: set[str] = set()
        """Invokers that restarted in place: their next report still names the instances of the boot before."""
        self.specs: dict[str, FunctionSpec] = {}
        self.rates: dict[str, float] = {}
        self.demand: dict[str, float] = {}
        self.records: dict[str, InstanceRecord] = {}
        self.states: dict[str, FunctionState] = {}
        self.routes: dict[str, RoutingTable] = {}
        self.seq = 1
        self.loop = CompactionLoop()
        self.memo: PlanMemo | None = None
        self.planned_at: float | None = None
        self.next_fn = 0
        for _ in range(functions):
            self.add_function()

    def add_function(self) -> None:
        rng = self.rng
        fqn = f"guest/f{self.next_fn}"
        self.next_fn += 1
        self.specs[fqn] = FunctionSpec(
            fqn=fqn, rev="1-a", kind="python:3-gpu", cls=rng.choice(["inference", "inference", "training"]),
            request=rng.choice([0.1, 0.2, 0.3, 0.4]), limit=rng.choice([0.4, 0.6, 1.0]),
            memory_mb=rng.choice([1000, 2000, 3000]), min_instances=rng.choice([0, 0, 1, 1, 2]),
            max_instances=rng.choice([1, 3, 6]), capacity_rps=rng.choice([0.0, 2.0, 5.0]),
            user_memory_mb=rng.choice([0, 256]), slo_ms=rng.choice([None, 100.0]))
        self.rates[fqn] = 0.0

    # -- what the plan reads -----------------------------------------------------------------------

    def reports(self) -> dict[str, LoadReport]:
        out = {}
        for inv, boot in self.boots.items():
            if inv in self.down:
                continue
            instances = []
            for r in self.records.values():
                if (r.invoker != inv or r.state == RecordState.STOPPING
                        or (r.boot not in ("", boot) and inv not in self.restarted)):
                    continue
                rate = self.rates.get(r.function, 0.0)
                failed = r.id in self.failing
                state = "failed" if failed else "starting" if r.id in self.slow else "ready"
                instances.append(InstanceReport(
                    id=r.id, function=r.function, rev=r.rev, state=state, gpu=r.gpu,
                    request=r.request, limit=r.limit, memory_mb=r.memory_mb, in_flight=int(rate > 3),
                    waiting=int(rate > 6), saturated=rate > 6, completion_rate=rate, latency_ms=200.0 if rate else None,
                    queue_delay_ms=150.0 if rate > 6 else 0.0, share=self.rng.random(), error="boom" if failed else ""))
            functions = tuple(FunctionReport(function=f, arrival_rate=rate / 2, waiting=int(rate > 8))
                              for f, rate in sorted(self.rates.items()) if rate and hash((f, inv)) % 2)
            out[inv] = LoadReport(invoker=inv, boot=boot, at_ms=int(self.now * 1000), enabled=inv not in self.disabled,
                                  user_memory_mb=6000, gpus=tuple(GpuReport(index=i, uuid=f"{inv}-g{i}", memory_mb=8000)
                                                                  for i in range(2)),
                                  instances=tuple(instances), functions=functions)
        return out

    def cluster(self, reports: dict[str, LoadReport]) -> ClusterSnapshot | None:
        placed: dict[GpuRef, list[PlacedInstance]] = {}
        for r in sorted(self.records.values(), key=lambda r: r.id):
            if r.invoker in reports and r.gpu is not None and r.state != RecordState.STOPPING:
                placed.setdefault(GpuRef(r.invoker, r.gpu), []).append(PlacedInstance(
                    id=r.id, function=r.function, cls=InstanceClass.parse(r.cls), request=r.request, limit=r.limit,
                    memory_mib=float(r.memory_mb)))
        gpus = [GpuState(ref=GpuRef(inv, i), memory_mib=8000.0, uuid=f"{inv}-g{i}",
                         instances=tuple(placed.get(GpuRef(inv, i), ())), schedulable=rep.enabled)
                for inv, rep in reports.items() for i in range(2)]
        return ClusterSnapshot.build(now=self.now, gpus=gpus) if gpus else None

    # -- one tick ----------------------------------------------------------------------------------

    def tick(self, *, compact: bool) -> tuple[TickPlan, TickPlan]:
        reports = self.reports()
        inp = TickInput(
            now=self.now, epoch=3, reports=reports, known_invokers=frozenset(self.boots), records=self.records,
            specs=self.specs, cluster=self.cluster(reports), demand=self.demand, states=self.states,
            routes=self.routes, seq=self.seq, compaction=self.loop if compact else replace(self.loop, next_at=1e18),
            memo=self.memo,
            # the service's previous tick, or not known (a new leader's first, or the rule without it)
            last_tick_at=self.planned_at if self.rng.random() < 0.7 else None)
        incremental = plan_tick(inp, CFG)
        scratch = plan_tick(replace(inp, memo=None), CFG)
        records, states = dict(incremental.records), dict(incremental.states)
        # The service: a start the budget refuses leaves the table and is owed again.
        for order in incremental.starts:
            r = order.record
            if self.rng.random() < 0.05 and not r.replaces:
                records.pop(r.id, None)
                st = states.get(r.function, FunctionState())
                states[r.function] = replace(st, owed=st.owed + 1)
        self.records, self.states, self.routes = records, states, dict(incremental.routes)
        self.seq, self.loop, self.memo = incremental.seq, incremental.compaction, incremental.memo
        self.planned_at = self.now
        return incremental, scratch

    def change(self) -> None:
        """Some random change of the world before the next tick (often none)."""
        rng = self.rng
        self.failing.clear()
        self.restarted.clear()
        # A slow start stays slow a while (past the start timeout, at times).
        self.slow = {i for i in self.slow if i in self.records and rng.random() < 0.85}
        roll = rng.random()
        fns = sorted(self.specs)
        if roll < 0.25:
            pass
        elif roll < 0.40 and fns:
            f = rng.choice(fns)
            self.rates[f] = rng.choice([0.0, 0.0, 1.0, 4.0, 7.0, 12.0])
        elif roll < 0.47:
            self.add_function()
        elif roll < 0.52 and fns:
            f = rng.choice(fns)
            del self.specs[f]
            self.rates.pop(f, None)
        elif roll < 0.56 and fns:
            f = rng.choice(fns)
            s = self.specs[f]
            self.specs[f] = replace(s, rev=f"{int(s.rev.split('-')[0]) + 1}-b")
        elif roll < 0.60 and fns:
            f = rng.choice(fns)
            self.specs[f] = replace(self.specs[f], min_instances=rng.choice([0, 1, 2, 3]))
        elif roll < 0.66 and fns:
            self.demand[rng.choice(fns)] = self.now
        elif roll < 0.70 and self.records:
            # Mostly a start that fails (its function is then blocked until the retry), else a ready instance.
            starting = sorted(i for i, r in self.records.items() if r.state == RecordState.STARTING)
            self.failing.add(rng.choice(starting or sorted(self.records)))
        elif roll < 0.74:
            inv = rng.choice(sorted(self.boots))
            if inv in self.down:
                self.down.discard(inv)
                self.boots[inv] = f"b{rng.randrange(1000)}"
            else:
                self.down.add(inv)
        elif roll < 0.77:
            inv = rng.choice(sorted(self.boots))
            self.disabled ^= {inv}
        elif roll < 0.80:
            self.boots[f"inv{len(self.boots)}"] = "b0"
        elif roll < 0.83:
            inv = rng.choice(sorted(self.boots))
            self.boots[inv] = f"b{rng.randrange(1000)}"
            self.restarted.add(inv)
        elif roll < 0.87:
            starting = sorted(i for i, r in self.records.items() if r.state == RecordState.STARTING)
            if starting:
                self.slow.add(rng.choice(starting))
        # The clock: mostly a period; sometimes early (a demand signal), a long gap or a jump past idleness.
        self.now += rng.choice([1.0] * 12 + [0.05, 0.3, 0.6, 2.0, 3.0, 5.5, 7.0, 30.0])


def same(incremental: TickPlan, scratch: TickPlan, at: int) -> None:
    assert incremental == scratch, f"tick {at}: the incremental plan differs from the plan from scratch"
    assert incremental.memo is not None and scratch.memo is not None


@pytest.mark.parametrize("seed", range(24))
def test_incremental_plans_equal_plans_from_scratch(seed: int) -> None:
    rng = random.Random(seed)
    world = World(rng)
    repeated = 0
    for at in range(120):
        incremental, scratch = world.tick(compact=rng.random() < 0.2)
        same(incremental, scratch, at)
        memo = incremental.memo
        assert memo is not None
        repeated += sum(1 for f, d in memo.decisions.items() if d.now == world.now
                        and memo.functions[f].load.now != world.now)
        world.change()
    assert repeated > 0, "no function was ever repeated: the test exercises nothing"


def test_a_memo_of_another_epoch_or_configuration_is_not_used() -> None:
    world = World(random.Random(7))
    for _ in range(5):
        world.tick(compact=False)
        world.now += 1.0
    reports = world.reports()
    inp = TickInput(now=world.now, epoch=4, reports=reports, known_invokers=frozenset(world.boots),
                    records=world.records, specs=world.specs, cluster=world.cluster(reports), states=world.states,
                    routes=world.routes, seq=world.seq, memo=world.memo)
    assert plan_tick(inp, CFG) == plan_tick(replace(inp, memo=None), CFG)
    other = replace(CFG, horizontal=replace(HORIZONTAL, window=4))
    inp = replace(inp, epoch=3)
    assert plan_tick(inp, other) == plan_tick(replace(inp, memo=None), other)


# -- the horizontal policy's repetition ------------------------------------------------------------


def _load(rate: float, *, n: int = 2, now: float, waiting: int = 0, lo: int = 0, hi: int = 6,
          last_tick_at: float | None = None) -> FunctionLoad:
    return FunctionLoad(function="f", now=now, instances=n, arrival_rate=rate, capacity_per_instance=2.0,
                        waiting=waiting, min_instances=lo, max_instances=hi, last_tick_at=last_tick_at)


def test_repeat_decision_is_decide_scale_or_declines() -> None:
    """Whenever `repeat_decision` answers, `decide_scale` answers the same; it answers for a settled hold."""
    rng = random.Random(1)
    cfg = HORIZONTAL
    answered = long_gaps = 0
    for _ in range(4000):
        rate = rng.choice([0.0, 0.0, 1.0, 3.0, 5.0])
        n, lo = rng.choice([0, 1, 2, 3]), rng.choice([0, 1])
        state = HorizontalState(rates=tuple(rng.choice([rate, rate, 0.0, 4.0]) for _ in range(rng.choice([2, 3]))),
                                last_sample_at=rng.choice([None, 99.0, 99.5]),
                                last_action_at=rng.choice([None, 90.0, 98.0, 99.0]),
                                last_busy_at=rng.choice([None, 80.0, 94.5, 99.0]))
        then = 100.0
        prev = decide_scale(_load(rate, n=n, now=then, lo=lo), state, cfg)
        later = then + rng.choice([0.05, 0.4, 1.0, 1.0, 2.0, 4.0, 6.0, 6.0])
        # the previous pass: the one that sampled (`then`), one a little after it, one long before, or not known
        tick_at = rng.choice([None, then, then + 0.3, then - 7.0])
        again = repeat_decision(prev, _load(rate, n=n, now=then, lo=lo), prev.state, later, cfg, last_tick_at=tick_at)
        if again is None:
            continue
        answered += 1
        if later - then > cfg.stale_after_s:
            long_gaps += 1
        assert again == decide_scale(_load(rate, n=n, now=later, lo=lo, last_tick_at=tick_at), prev.state, cfg)
    assert answered > 200
    assert long_gaps > 20, "no hold repeated across a slow tick: the test exercises nothing"


def test_repeat_decision_declines_a_scaling_decision() -> None:
    prev = ScaleDecision(function="f", now=1.0, current=1, desired=2, action=ScaleAction.OUT,
                         trigger=ScaleTrigger.SUSTAINED_LOAD, reason="", over_samples=3, under_samples=0,
                         state=HorizontalState(rates=(9.0, 9.0, 9.0), last_sample_at=1.0))
    assert repeat_decision(prev, _load(9.0, n=1, now=1.0), prev.state, 2.0, HORIZONTAL) is None


class _Even(random.Random):
    """The world's chances, fixed: no budget refusals, every SM share one half."""

    def random(self) -> float:
        return 0.5


def test_a_repeated_function_whose_failed_start_may_be_retried_gets_a_new_table() -> None:
    """A repeated function keeps its routing table only while it is blocked for the same reason: a function with
    no instance, blocked by a failed start, is repeated until its retry time passes in a repeated tick, and then
    its table (no instance, so it carried the reason) must say it is no longer blocked."""
    cfg = replace(CFG, failed_retry_s=5.0)
    world = World(_Even(), invokers=1, functions=0)
    fqn = "guest/f"
    world.specs[fqn] = FunctionSpec(fqn=fqn, rev="1-a", kind="python:3-gpu", cls="inference", request=0.2,
                                    limit=0.4, memory_mb=1000, min_instances=1, max_instances=1, capacity_rps=2.0)
    world.rates[fqn] = 0.0

    def tick() -> TickPlan:
        reports = world.reports()
        inp = TickInput(now=world.now, epoch=3, reports=reports, known_invokers=frozenset(world.boots),
                        records=world.records, specs=world.specs, cluster=world.cluster(reports), demand={},
                        states=world.states, routes=world.routes, seq=world.seq,
                        compaction=replace(world.loop, next_at=1e18), memo=world.memo)
        plan = plan_tick(inp, cfg)
        assert plan == plan_tick(replace(inp, memo=None), cfg), f"at {world.now}: the incremental plan differs"
        world.records, world.states, world.routes = dict(plan.records), dict(plan.states), dict(plan.routes)
        world.seq, world.memo = plan.seq, plan.memo
        world.failing.clear()
        world.now += 1.0
        return plan

    (start,) = tick().starts
    # Its start fails, and at the same time its bounds drop to none (nothing is owed: the retry places nothing).
    world.failing.add(start.record.id)
    world.specs[fqn] = replace(world.specs[fqn], min_instances=0, max_instances=0)
    failed_at = world.now
    reason = tick().routes[fqn].blocked
    assert reason and "failed" in reason and world.states[fqn].owed == 0
    retried_repeated = None
    while world.now <= failed_at + cfg.failed_retry_s + 1.0:
        now = world.now
        plan = tick()
        assert plan.memo is not None
        assert plan.routes[fqn].blocked == (reason if now < failed_at + cfg.failed_retry_s else "")
        if retried_repeated is None and now >= failed_at + cfg.failed_retry_s:
            retried_repeated = plan.memo.decisions[fqn].now == now and plan.memo.functions[fqn].load.now != now
    assert retried_repeated, "the retry time did not pass in a repeated tick: the test exercises nothing"


def test_without_gpus_only_functions_with_records_demand_a_table_or_a_state_get_a_table() -> None:
    """Without a cluster no function is planned (no state is made): a registered function that nothing names yet
    gets no routing table, planned with a memo or without."""
    world = World(random.Random(3), invokers=0, functions=3)
    named = sorted(world.specs)[0]
    world.demand[named] = world.now
    for _ in range(3):
        incremental, scratch = world.tick(compact=False)
        assert incremental == scratch
        assert set(incremental.routes) == {named}
        world.now += 1.0
