"""The tick's snapshot derived from the last one (`SnapshotCache.cluster`) equals the snapshot built from scratch
(`cluster_of`): random sequences of changes between ticks on a small cluster, checked at every step.

Between two ticks some budgets change (an instance reserved or released, kept weights, a capacity) or are read
again unchanged (a new object, as `BudgetCache` hands back after a renewal), a GPU loses its budget, invokers come,
go, are disabled or report other GPUs, two invokers report one GPU, an instance is reserved on two GPUs, and the
specs change profile, vanish or come back. Most steps change little, so most GPUs take the kept path.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dilu_invoker.gpu.budgets import GpuBudget, GpuCapacity, Reservation
from dilu_invoker.loadbalancer.service import SnapshotCache, cluster_of
from dilu_invoker.model import weights_group
from dilu_invoker.wire import FunctionSpec, GpuReport, LoadReport

FUNCTIONS = [f"guest/f{i}" for i in range(6)]
PROFILES = [None, "compute", "memory"]


def _spec(fn: str, profile: str | None) -> FunctionSpec:
    return FunctionSpec(fqn=fn, rev="r1", kind="python:3", cls="inference", request=0.2, limit=0.4, memory_mb=1000,
                        profile=profile)


class World:
    """Reports, budgets and specs as the leader reads them; `step` changes a few of them, as the next read would."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_instance = 0
        self.specs: dict[str, FunctionSpec] = {fn: _spec(fn, rng.choice(PROFILES)) for fn in FUNCTIONS}
        self.gpus: dict[str, list[GpuReport]] = {}
        self.enabled: dict[str, bool] = {}
        self.budgets: dict[str, GpuBudget | None] = {}
        for k in range(4):
            self.add_invoker(f"invoker{k}")

    def add_invoker(self, name: str) -> None:
        self.gpus[name] = [self.new_gpu(name, i) for i in range(self.rng.randint(1, 3))]
        self.enabled[name] = True

    def new_gpu(self, invoker: str, index: int) -> GpuReport:
        uuid = f"{invoker}-u{index}-{self.rng.randrange(1000)}"
        self.budgets[uuid] = self.new_budget(uuid, invoker)
        return GpuReport(index=index, uuid=uuid, memory_mb=16000, sm_count=132)

    def reservation(self, invoker: str, instance: str | None = None) -> Reservation:
        if instance is None:
            self.next_instance += 1
            instance = f"i{self.next_instance}"
        fn = self.rng.choice(FUNCTIONS)
        shared = self.rng.random() < 0.3
        return Reservation(instance=instance, function=fn, cls=self.rng.choice(["inference", "training", "bogus"]),
                           invoker=invoker, request=self.rng.choice([0.1, 0.2, 0.3]), limit=0.5,
                           memory_mb=self.rng.choice([500, 1000, 2000]), weights_mb=400 if shared else 0,
                           group=weights_group(invoker, fn, "r1") if shared else "",
                           kept=shared and self.rng.random() < 0.5)

    def new_budget(self, uuid: str, invoker: str) -> GpuBudget | None:
        if self.rng.random() < 0.1:
            return None
        cap = GpuCapacity(node=invoker, index=0, name="t", memory_mb=self.rng.choice([16000, 24000]), sm_count=132)
        res = [self.reservation(invoker) for _ in range(self.rng.randint(0, 3))]
        return GpuBudget(uuid, cap, {r.instance: r for r in res})

    def reports(self) -> dict[str, LoadReport]:
        return {name: LoadReport(invoker=name, boot="b", at_ms=0, enabled=self.enabled[name], gpus=tuple(gpus))
                for name, gpus in self.gpus.items()}

    def some_budget(self) -> tuple[str, GpuBudget | None]:
        uuid = self.rng.choice(sorted(self.budgets))
        return uuid, self.budgets[uuid]

    def step(self) -> None:
        rng = self.rng
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            roll = rng.random()
            uuid, budget = self.some_budget()
            invoker = rng.choice(sorted(self.gpus))
            if roll < 0.15 and budget is not None:  # read again, unchanged (a renewed lease)
                self.budgets[uuid] = GpuBudget(uuid, budget.capacity, dict(budget.reservations))
            elif roll < 0.3 and budget is not None:  # an instance reserved or released
                res = dict(budget.reservations)
                if res and rng.random() < 0.5:
                    del res[rng.choice(sorted(res))]
                else:
                    r = self.reservation(budget.capacity.node)
                    res[r.instance] = r
                self.budgets[uuid] = GpuBudget(uuid, budget.capacity, res)
            elif roll < 0.36 and budget is not None:  # an instance (already counted elsewhere) also reserved here
                others = [r for b in self.budgets.values() if b is not None for r in b.reservations.values()]
                if others:
                    r = self.reservation(budget.capacity.node, rng.choice(others).instance)
                    self.budgets[uuid] = GpuBudget(uuid, budget.capacity, {**budget.reservations, r.instance: r})
            elif roll < 0.42 and budget is not None:  # kept weights marked or released
                res = {k: replace(r, kept=not r.kept) if r.group else r for k, r in budget.reservations.items()}
                self.budgets[uuid] = GpuBudget(uuid, budget.capacity, res)
            elif roll < 0.47:  # no budget (not registered, or lost), or a new one
                self.budgets[uuid] = None if budget is not None else self.new_budget(uuid, invoker)
            elif roll < 0.52 and budget is not None:  # the capacity changed (re-registered)
                cap = replace(budget.capacity, memory_mb=budget.capacity.memory_mb + 1000)
                self.budgets[uuid] = GpuBudget(uuid, cap, budget.reservations)
            elif roll < 0.6:  # a spec's profile changed, or it is gone, or back
                fn = rng.choice(FUNCTIONS)
                if fn in self.specs and rng.random() < 0.3:
                    del self.specs[fn]
                else:
                    self.specs[fn] = _spec(fn, rng.choice(PROFILES))
            elif roll < 0.64:  # a spec read again, unchanged (a new object)
                fn = rng.choice(sorted(self.specs)) if self.specs else FUNCTIONS[0]
                if fn in self.specs:
                    self.specs[fn] = replace(self.specs[fn])
            elif roll < 0.69:
                self.enabled[invoker] = not self.enabled[invoker]
            elif roll < 0.74 and len(self.gpus) > 1:  # an invoker gone
                del self.gpus[invoker]
            elif roll < 0.79:  # an invoker (back) with new GPUs
                self.add_invoker(f"invoker{rng.randrange(8)}")
            elif roll < 0.84:  # a GPU more, or one fewer
                gpus = self.gpus[invoker]
                if len(gpus) > 1 and rng.random() < 0.5:
                    gpus.pop(rng.randrange(len(gpus)))
                else:
                    gpus.append(self.new_gpu(invoker, max(g.index for g in gpus) + 1))
            elif roll < 0.88:  # another invoker reports a GPU already reported (counted for the first)
                other = rng.choice(sorted(self.gpus))
                g = rng.choice(self.gpus[other])
                mine = self.gpus[invoker]
                mine.append(replace(g, index=max(x.index for x in mine) + 1))
            elif roll < 0.92:  # a report's GPU entry changed (its memory, as the driver reports it)
                gpus = self.gpus[invoker]
                k = rng.randrange(len(gpus))
                gpus[k] = replace(gpus[k], memory_mb=gpus[k].memory_mb + 1, sm_count=gpus[k].sm_count + 1)
            elif roll < 0.96:  # invokers in another order (as their names sort)
                names = list(self.gpus)
                rng.shuffle(names)
                self.gpus = {n: self.gpus[n] for n in names}
            # else: nothing changed


@pytest.mark.parametrize("seed", range(30))
def test_the_snapshot_from_the_last_equals_the_snapshot_from_scratch(seed: int) -> None:
    rng = random.Random(seed)
    world = World(rng)
    cache = SnapshotCache()
    for k in range(60):
        now = float(k)
        reports, specs, budgets = world.reports(), dict(world.specs), dict(world.budgets)
        got = cache.cluster(now, reports, specs, budgets)
        want = cluster_of(now, reports, specs, budgets)
        assert got == want, f"step {k}"
        world.step()


def _small() -> tuple[dict[str, LoadReport], dict[str, FunctionSpec], dict[str, GpuBudget | None]]:
    def res(iid: str) -> Reservation:
        return Reservation(instance=iid, function="guest/f", cls="inference", invoker="a", request=0.2, limit=0.4,
                           memory_mb=1000)

    cap = GpuCapacity(node="a", index=0, name="t", memory_mb=16000, sm_count=132)
    budgets: dict[str, GpuBudget | None] = {"u0": GpuBudget("u0", cap, {"i1": res("i1")}),
                                            "u1": GpuBudget("u1", cap, {"i2": res("i2")})}
    reports = {"a": LoadReport(invoker="a", boot="b", at_ms=0, gpus=(GpuReport(index=0, uuid="u0", memory_mb=16000),
                                                                     GpuReport(index=1, uuid="u1", memory_mb=16000)))}
    return reports, {"guest/f": _spec("guest/f", "compute")}, budgets


def test_a_tick_with_nothing_changed_keeps_the_last_snapshot() -> None:
    """Budgets read again unchanged (new objects) and a new report with the same GPUs: every GPU keeps its state,
    and the snapshot is the last one at the new time (nothing is indexed again)."""
    reports, specs, budgets = _small()
    cache = SnapshotCache()
    first, _ = cache.cluster(0.0, reports, specs, budgets)
    again = {u: GpuBudget(b.uuid, b.capacity, dict(b.reservations)) for u, b in budgets.items() if b is not None}
    second, _ = cache.cluster(1.0, {"a": replace(reports["a"], at_ms=1000)}, specs, dict(again))
    assert first is not None and second is not None
    assert second.now == 1.0 and second.gpus is first.gpus and second == cluster_of(1.0, reports, specs, budgets)[0]


def test_a_changed_budget_rebuilds_its_gpu_only() -> None:
    reports, specs, budgets = _small()
    cache = SnapshotCache()
    first, _ = cache.cluster(0.0, reports, specs, budgets)
    b1 = budgets["u1"]
    assert b1 is not None and first is not None
    budgets["u1"] = GpuBudget("u1", b1.capacity, {})
    second, _ = cache.cluster(1.0, reports, specs, budgets)
    assert second is not None and second == cluster_of(1.0, reports, specs, budgets)[0]
    assert second.gpus[0] is first.gpus[0] and second.gpus[1] is not first.gpus[1] and not second.gpus[1].lit
