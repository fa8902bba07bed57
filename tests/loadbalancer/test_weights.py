"""Shared read-only weights in the balancer: a GPU whose budget holds a function revision's weights (its
invoker's instance declared them) takes a further instance of that revision with its memory less the
weights, the balancer reserves it so (the same charge its invoker's attach then settles), and concurrent
placements never oversubscribe a GPU. Real Redis; the invokers' budget writes are the ones `GpuNode` makes."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import msgpack
import pytest
import redis.asyncio as aioredis

from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets, GpuCapacity, Reservation
from dilu_invoker.invoker.cluster.registry import FunctionRegistry
from dilu_invoker.loadbalancer.planner import PlannerConfig, TickInput, placement_request, plan_tick
from dilu_invoker.loadbalancer.service import Balancer, weight_groups_of
from dilu_invoker.model import GUEST_IDENTITY, Action, Exec, Parameter, ValidationError, weights_group
from dilu_invoker.policy import ClusterSnapshot, GpuRef, GpuState, InstanceClass, PlacedInstance
from dilu_invoker.standalone import run_standalone
from dilu_invoker.wire import (
    Decision,
    FunctionSpec,
    GpuReport,
    InstanceCommand,
    InstanceRecord,
    InstanceReport,
    Keys,
    LoadReport,
    decode,
    from_stream,
    pack,
    text,
)

PREFIX = "wts:"
KEYS = Keys(PREFIX)
FN, REV = "guest/llm", "1-x"
TTL = 30.0


def _cfg() -> config.Config:
    base = config.load(environ={})
    return replace(base, redis=replace(base.redis, prefix=PREFIX),
                   balancer=replace(base.balancer, tick_s=0.2, lease_ttl_s=5.0))


async def _invoker(redis: aioredis.Redis, name: str, *, memory_mb: int = 16000,
                   instances: tuple[InstanceReport, ...] = ()) -> None:
    budgets = GpuBudgets(redis, PREFIX)
    report = LoadReport(invoker=name, boot="boot", at_ms=int(time.time() * 1000), instances=instances,
                        gpus=(GpuReport(index=0, uuid=f"{name}-gpu0", memory_mb=memory_mb),))
    await budgets.register_gpu(f"{name}-gpu0", GpuCapacity(node=name, index=0, name="t", memory_mb=memory_mb,
                                                           sm_count=132))
    await redis.set(KEYS.report(name), pack(report), px=60_000)
    await redis.set(KEYS.boot(name), "boot", px=60_000)
    await redis.sadd(KEYS.invokers, name)


async def _function(redis: aioredis.Redis, name: str = "llm", **annotations: object) -> None:
    ann = {"gpu-memory-mb": 10000, "gpu-weights-mb": 8000, "gpu-sm-request": 0.1, "gpu-sm-limit": 0.2,
           **annotations}
    action = Action(namespace="guest", name=name, exec=Exec(kind="python:3-gpu", code="def main(a): return a"),
                    revision=REV, annotations=tuple(Parameter(k, v) for k, v in ann.items()))
    await FunctionRegistry(redis, KEYS).ensure(action)


def _attach(instance: str, *, invoker: str = "invoker0", function: str = FN, memory_mb: int = 10000,
            weights_mb: int = 8000) -> Reservation:
    """The reservation `GpuNode.attach` makes for an instance of the revision (the group its budget uses)."""
    return Reservation(instance=instance, function=function, cls="inference", invoker=invoker, request=0.1,
                       limit=0.2, memory_mb=memory_mb, weights_mb=weights_mb,
                       group=weights_group(invoker, function, REV))


async def _starts(redis: aioredis.Redis, invoker: str = "invoker0") -> list[InstanceCommand]:
    return [c for c in (from_stream(InstanceCommand, f) for _, f in await redis.xrange(KEYS.commands(invoker)))
            if c.op == "start"]


async def _leader(redis: aioredis.Redis) -> tuple[Balancer, object]:
    balancer = Balancer(redis, _cfg(), holder="solo")
    lead = await balancer.campaign_once()
    assert lead is not None
    return balancer, lead


def test_weight_groups_of_counts_only_the_gpus_own_invoker() -> None:
    own = _attach("a")
    other_invoker = _attach("b", invoker="invoker1")
    other_fn = replace(_attach("c", function="guest/other"))
    plain = Reservation(instance="d", function=FN, cls="inference", invoker="invoker0", request=0.1, limit=0.2,
                        memory_mb=3000)
    # a group string that does not name its own function is not one its invoker made for it
    forged = replace(_attach("e"), group=weights_group("invoker0", "guest/else", REV))
    groups = weight_groups_of("invoker0", [own, other_invoker, other_fn, plain, forged])
    assert groups == {(f"{FN}@{REV}", 8000.0), (f"guest/other@{REV}", 8000.0)}
    assert weight_groups_of("invoker1", [own, other_invoker]) == {(f"{FN}@{REV}", 8000.0)}
    # the request's group names the same revision
    spec = FunctionSpec(fqn=FN, rev=REV, kind="python:3-gpu", cls="inference", request=0.1, limit=0.2,
                        memory_mb=10000, weights_mb=8000)
    r = placement_request(spec, "x")
    assert (r.weights_group, r.weights_mib) in groups
    # without a revision (or with weights beyond its memory, never accepted at PUT) nothing is shared
    assert placement_request(replace(spec, rev=""), "x").weights_mib == 0
    assert placement_request(replace(spec, weights_mb=10001), "x").weights_mib == 0


def test_the_spec_carries_the_weights_and_bad_ones_are_refused() -> None:
    def action(**ann: object) -> Action:
        return Action(namespace="guest", name="llm", exec=Exec(kind="python:3-gpu", code="x"), revision=REV,
                      annotations=tuple(Parameter(k, v) for k, v in ann.items()))

    spec = FunctionSpec.of(action(**{"gpu-memory-mb": 10000, "gpu-weights-mb": 8000}))
    assert spec.weights_mb == 8000 and decode(FunctionSpec, pack(spec)) == spec
    # a spec registered before the field existed reads as sharing nothing
    old = {k: v for k, v in msgpack.unpackb(pack(spec)).items() if k != "weights_mb"}
    assert decode(FunctionSpec, msgpack.packb(old)).weights_mb == 0  # type: ignore[union-attr]
    # weights beyond the memory: refused where the action is registered (a 400 at PUT)
    with pytest.raises(ValidationError, match="gpu-weights-mb"):
        FunctionSpec.of(action(**{"gpu-memory-mb": 4000, "gpu-weights-mb": 5000}))


async def test_second_instance_fits_beside_the_weights_its_invoker_declared(redis: aioredis.Redis) -> None:
    """16 GB GPU, 10 GB instances of which 8 GB are weights, min-instances 2. The first is reserved whole
    (nothing holds the weights yet) and the second waits; once the invoker has attached the first with its
    group, the second is placed on the same GPU and reserved 2 GB, which the invoker's attach keeps."""
    await _invoker(redis, "invoker0")
    await _function(redis, **{"min-instances": 2})
    budgets = GpuBudgets(redis, PREFIX)
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    [first] = await _starts(redis)
    got = await budgets.get("invoker0-gpu0")
    assert got is not None and set(got.reservations) == {first.instance}
    r1 = got.reservations[first.instance]
    assert (r1.memory_mb, r1.weights_mb, r1.group) == (10000, 0, "")  # whole, no group: the invoker names it
    assert "memory" in balancer._states[FN].blocked

    attached = await budgets.reserve("invoker0-gpu0", _attach(first.instance), ttl_s=TTL)
    assert attached.ok and attached.memory_mb == 10000 and not attached.shares_weights  # it carries them
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    starts = await _starts(redis)
    assert len(starts) == 2
    second = starts[1]
    assert second.gpu_uuid == "invoker0-gpu0"
    got = await budgets.get("invoker0-gpu0")
    assert got is not None
    r2 = got.reservations[second.instance]
    assert (r2.memory_mb, r2.weights_mb, r2.group, r2.shares_weights) == (
        2000, 8000, weights_group("invoker0", FN, REV), True)
    assert got.sum_memory_mb == 12000
    placed = [d for d in (from_stream(Decision, f) for _, f in await redis.xrange(KEYS.decisions))
              if d.kind == "place"]
    assert [("weights shared there" in d.reason) for d in placed] == [False, True]
    # the invoker's attach of the second settles exactly what the balancer reserved: no double counting
    again = await budgets.reserve("invoker0-gpu0", _attach(second.instance), ttl_s=TTL)
    assert again.ok and (again.memory_mb, again.shares_weights, again.sum_memory_mb) == (2000, True, 12000)


async def test_sharers_placed_in_one_tick_fill_the_gpu_exactly(redis: aioredis.Redis) -> None:
    """A carrier (10 GB, not in the balancer's table) holds the weights; min-instances 6 asks for six
    instances in one tick. Three of 2 GB
    fit (16 GB exactly), the rest wait; Redis agrees with the plan and never exceeds the GPU, also when the
    invokers then attach all three at once."""
    await _invoker(redis, "invoker0")
    await _function(redis, **{"min-instances": 6})
    budgets = GpuBudgets(redis, PREFIX)
    assert (await budgets.reserve("invoker0-gpu0", _attach("carrier"), ttl_s=TTL)).ok
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    starts = await _starts(redis)
    assert len(starts) == 3 and {s.gpu_uuid for s in starts} == {"invoker0-gpu0"}
    got = await budgets.get("invoker0-gpu0")
    assert got is not None and got.sum_memory_mb == 16000
    assert {got.reservations[s.instance].memory_mb for s in starts} == {2000}
    assert balancer._states[FN].owed == 3 and "memory" in balancer._states[FN].blocked
    results = await asyncio.gather(*(budgets.reserve("invoker0-gpu0", _attach(s.instance), ttl_s=TTL)
                                     for s in starts))
    assert all(r.ok and r.memory_mb == 2000 for r in results)
    got = await budgets.get("invoker0-gpu0")
    assert got is not None and got.sum_memory_mb == 16000 and len(got.reservations) == 4


@pytest.mark.parametrize("race", ["gather", "between-read-and-reserve"])
async def test_a_concurrent_admission_never_oversubscribes(redis: aioredis.Redis, race: str) -> None:
    """The GPU holds the weights (10 GB) and 4 GB of another function: room for one 2 GB sharer. The
    balancer's tick and another admission of 2 GB race (run together, or the other one lands after the
    balancer read the budgets and before it reserves); exactly one gets the room, and a start the budget
    refused is owed, not commanded."""
    await _invoker(redis, "invoker0")
    await _function(redis, **{"min-instances": 1})
    budgets = GpuBudgets(redis, PREFIX)
    assert (await budgets.reserve("invoker0-gpu0", _attach("carrier"), ttl_s=TTL)).ok
    assert (await budgets.reserve("invoker0-gpu0", _attach("other", function="guest/other", memory_mb=4000,
                                                           weights_mb=0), ttl_s=TTL)).ok
    balancer, lead = await _leader(redis)
    rival = Reservation(instance="rival", function="guest/rival", cls="inference", invoker="invoker0",
                        request=0.1, limit=0.2, memory_mb=2000)
    rival_ok: list[bool] = []
    if race == "gather":
        ok, result = await asyncio.gather(balancer.tick(lead),  # type: ignore[arg-type]
                                          budgets.reserve("invoker0-gpu0", rival, ttl_s=TTL))
        rival_ok.append(result.ok)
    else:
        reserve = balancer.budgets.reserve

        async def rival_first(uuid: str, reservation: Reservation, **kw: object):  # type: ignore[no-untyped-def]
            rival_ok.append((await budgets.reserve(uuid, rival, ttl_s=TTL)).ok)
            return await reserve(uuid, reservation, **kw)  # type: ignore[arg-type]

        balancer.budgets.reserve = rival_first  # type: ignore[method-assign]
        ok = await balancer.tick(lead)  # type: ignore[arg-type]
        assert rival_ok == [True] and balancer._states[FN].owed == 1  # refused: owed for the next tick
    assert ok
    got = await budgets.get("invoker0-gpu0")
    assert got is not None and got.sum_memory_mb <= 16000
    starts = await _starts(redis)
    placed = [s.instance for s in starts if s.instance in got.reservations]
    assert len(placed) + int(rival_ok[0]) == 1
    assert {s.instance for s in starts} <= set(got.reservations)
    assert set(await redis.hkeys(KEYS.instances)) == {p.encode() for p in placed}


async def test_another_invokers_weights_on_the_gpu_are_not_shared(redis: aioredis.Redis) -> None:
    """invoker1's instance of the revision holds its own copy on invoker0's GPU: invoker0's instance
    cannot map it, so it needs its whole 10 GB and does not fit."""
    await _invoker(redis, "invoker0")
    await _function(redis, **{"min-instances": 1})
    budgets = GpuBudgets(redis, PREFIX)
    assert (await budgets.reserve("invoker0-gpu0", _attach("theirs", invoker="invoker1"), ttl_s=TTL)).ok
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert await _starts(redis) == []
    assert "memory" in balancer._states[FN].blocked


# -- the planner's choice (pure) --------------------------------------------------------------------


def _spec(**kw: object) -> FunctionSpec:
    base: dict[str, object] = {"fqn": FN, "rev": REV, "kind": "python:3-gpu", "cls": "inference", "request": 0.1,
                               "limit": 0.2, "memory_mb": 10000, "weights_mb": 8000, "min_instances": 2}
    base.update(kw)
    return FunctionSpec(**base)  # type: ignore[arg-type]


def _report(inv: str) -> LoadReport:
    return LoadReport(invoker=inv, boot="b0", at_ms=0,
                      gpus=(GpuReport(index=0, uuid=f"{inv}-g0", memory_mb=40000),),
                      instances=(InstanceReport(id=f"{inv}-a", function=FN if inv == "invoker0" else "guest/o",
                                                rev=REV, state="ready", gpu=0),))


def _plan(spec: FunctionSpec, held: bool = True) -> list[tuple[str, int]]:
    """invoker0's GPU holds the weights (its instance of the revision), invoker1's runs another function."""
    reports = {inv: _report(inv) for inv in ("invoker0", "invoker1")}
    records = {f"{inv}-a": InstanceRecord(id=f"{inv}-a", function=FN if inv == "invoker0" else "guest/o", rev=REV,
                                          invoker=inv, gpu=0, gpu_uuid=f"{inv}-g0", cls="inference", request=0.1,
                                          limit=0.2, memory_mb=10000, state="ready", since=0.0, epoch=1, boot="b0")
               for inv in reports}
    gpus = [GpuState(ref=GpuRef(inv, 0), memory_mib=40000, uuid=f"{inv}-g0",
                     instances=(PlacedInstance(id=f"{inv}-a", function=records[f"{inv}-a"].function,
                                               cls=InstanceClass.INFERENCE, request=0.1, limit=0.2,
                                               memory_mib=10000),),
                     weight_groups=frozenset({(f"{FN}@{REV}", 8000.0)}) if inv == "invoker0" and held else frozenset())
            for inv in reports]
    other = replace(_spec(fqn="guest/o", weights_mb=0, min_instances=1))
    plan = plan_tick(TickInput(now=1000.0, epoch=3, reports=reports, known_invokers=frozenset(reports),
                               records=records, specs={FN: spec, "guest/o": other},
                               cluster=ClusterSnapshot.build(now=1000.0, gpus=gpus)), PlannerConfig())
    return [(o.record.invoker, o.weights_mb) for o in plan.starts]


@pytest.mark.parametrize(("spec", "held", "expect"), [
    # default affinity: the GPU holding the weights first, over spreading to invoker1
    (_spec(), True, [("invoker0", 8000)]),
    # nothing holds them: spread as before, reserved whole
    (_spec(), False, [("invoker1", 0)]),
    # spread asked for explicitly: kept off invoker0, a whole copy on invoker1
    (_spec(affinity="spread"), True, [("invoker1", 0)]),
    # a spec without weights (or without a revision) places exactly as before
    (_spec(weights_mb=0), True, [("invoker1", 0)]),
    (_spec(rev=""), True, [("invoker1", 0)]),
])
def test_planner_prefers_the_gpu_holding_the_weights(spec: FunctionSpec, held: bool,
                                                     expect: list[tuple[str, int]]) -> None:
    assert _plan(spec, held) == expect


# -- end to end: standalone's balancer and its invoker's GPU node -----------------------------------


async def test_standalone_places_the_second_instance_beside_the_weights(tmp_path: Path) -> None:
    """`standalone` (one invoker, a 16 GB GPU from an inventory file, the embedded balancer): an action
    with 10 GB of which 8 GB are weights and min-instances 2. Its invoker attaches the first with the
    revision's group; the balancer then places the second on the same GPU, reserved 2 GB, and the
    invoker's attach of it leaves the budget at 12 GB — one copy of the weights."""
    (tmp_path / "inventory.json").write_text(json.dumps([{"uuid": "GPU-w", "memory_mb": 16000}]))
    base = config.load(environ={})
    cfg = replace(base, data_dir=str(tmp_path / "data"), api=replace(base.api, port=0),
                  gpu=replace(base.gpu, inventory=str(tmp_path / "inventory.json")),
                  balancer=replace(base.balancer, tick_s=0.2, report_period_s=0.2, report_ttl_s=1.0))
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    ann = {"gpu-memory-mb": 10000, "gpu-weights-mb": 8000, "gpu-sm-request": 0.1, "gpu-sm-limit": 0.2,
           "min-instances": 2}
    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token}"}) as http:
        assert running.balancer is not None
        redis = running.balancer.redis
        budgets = GpuBudgets(redis, cfg.redis.prefix)
        # weights beyond the memory: 400 in OpenWhisk's error shape, and nothing is stored
        bad = {"exec": {"kind": "python:3-gpu", "code": "def main(a):\n    return a\n"},
               "annotations": [{"key": k, "value": v} for k, v in {**ann, "gpu-weights-mb": 12000}.items()]}
        async with http.put(f"{running.api_url}/api/v1/namespaces/_/actions/llm", json=bad) as r:
            assert r.status == 400
            err = await r.json()
            assert "gpu-weights-mb" in err["error"] and err["code"]
        async with http.get(f"{running.api_url}/api/v1/namespaces/_/actions/llm") as r:
            assert r.status == 404
        body = {"exec": {"kind": "python:3-gpu", "code": "def main(a):\n    return a\n"},
                "annotations": [{"key": k, "value": v} for k, v in ann.items()]}
        async with http.put(f"{running.api_url}/api/v1/namespaces/_/actions/llm", json=body) as r:
            assert r.status == 200, await r.text()
        # the first activation registers the function with the balancer (as a router does); its outcome is
        # not what this test is about (it may be refused while the second instance cannot be placed yet)
        async with http.post(f"{running.api_url}/api/v1/namespaces/_/actions/llm", json={"n": 1}) as r:
            assert r.status == 202
        [uuid] = await budgets.node_gpus("invoker0")
        deadline = time.monotonic() + 8.0
        while True:
            got = await budgets.get(uuid)
            charged = sorted(r.memory_mb for r in got.reservations.values()) if got is not None else []
            if charged == [2000, 10000] and all(r.group for r in got.reservations.values()):  # type: ignore[union-attr]
                break
            assert time.monotonic() < deadline, f"budget never held one copy of the weights: {got}"
            await asyncio.sleep(0.05)
        assert got is not None and got.sum_memory_mb == 12000
        rev = text(await redis.hget(Keys(cfg.redis.prefix).function("guest/llm"), "rev"))
        assert {r.group for r in got.reservations.values()} == {weights_group("invoker0", "guest/llm", rev)}
        # both instances start and run on that GPU, and the second was placed as sharing the weights
        while True:
            records = [decode(InstanceRecord, raw)
                       for raw in (await redis.hgetall(Keys(cfg.redis.prefix).instances)).values()]
            if [r.state for r in records if r is not None] == ["ready", "ready"]:
                break
            assert time.monotonic() < deadline, f"instances never became ready: {records}"
            await asyncio.sleep(0.05)
        assert sorted((r.gpu_uuid, r.memory_mb) for r in records if r is not None) == [(uuid, 10000), (uuid, 10000)]
        got = await budgets.get(uuid)
        assert got is not None and got.sum_memory_mb == 12000
        reasons = [from_stream(Decision, f).reason for _, f in await redis.xrange(Keys(cfg.redis.prefix).decisions)]
        assert sum("weights shared there" in r for r in reasons) == 1


def test_live_compaction_leaves_instances_sharing_weights_where_they_are() -> None:
    """The compaction table's first case (f's a moves beside g's b): with f declaring shared weights, a
    stays and b moves beside it instead; without weights, as before."""
    from tests.loadbalancer.test_planner import cluster as cluster_of
    from tests.loadbalancer.test_planner import spec as spec_of
    from tests.loadbalancer.test_planner_compaction import ON, F, G, moves, two_gpus

    reports, records = two_gpus()

    def run(f_spec: FunctionSpec) -> list[tuple[str, str, str]]:
        return moves(plan_tick(TickInput(
            now=1000.0, epoch=7, reports=reports, known_invokers=frozenset(reports), records=records,
            specs={F: f_spec, G: spec_of(G)}, cluster=cluster_of(reports, records), seq=1), ON))

    assert run(spec_of(F)) == [(F, "a", "invoker1")]
    assert run(spec_of(F, weights_mb=1500)) == [(G, "b", "invoker0")]

