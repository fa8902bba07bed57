"""Kept weights (staged exit) are evictable room for the balancer: a GPU whose budget holds weights a process
kept after its function's last instance left takes an instance that fits only once they are gone (reserved
as if they were, `GpuBudgets.reserve(evict=True)`), or that scores better there once they are gone; all
else equal, and wherever the GPU's invoker has a GPU that takes the instance as it is, nothing is evicted.
An instance of the kept weights' own revision maps them (the sharing tier). Real Redis for the budgets; the
kept reservations are the ones `GpuNode.keep_weights` writes."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets, GpuCapacity, Reservation
from dilu_invoker.invoker.cluster.registry import FunctionRegistry
from dilu_invoker.loadbalancer.planner import Evictable, PlannerConfig, TickInput, TickPlan, plan_tick
from dilu_invoker.loadbalancer.service import Balancer, evictable_of
from dilu_invoker.model import GUEST_IDENTITY, Action, Exec, Parameter, weights_group
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
)
from tests.invoker.staged_support import staged_config

NOW = 1000.0
REV = "1-x"
LLM = "guest/llm"

# -- the planner's choice (pure) ---------------------------------------------------------------------


def _spec(fqn: str, memory_mb: int, *, weights_mb: int = 0, min_instances: int = 1) -> FunctionSpec:
    return FunctionSpec(fqn=fqn, rev=REV, kind="python:3-gpu", cls="inference", request=0.1, limit=0.2,
                        memory_mb=memory_mb, weights_mb=weights_mb, min_instances=min_instances)


def _running(iid: str, memory: float, fn: str = "guest/run") -> PlacedInstance:
    return PlacedInstance(id=iid, function=fn, cls=InstanceClass.INFERENCE, request=0.1, limit=0.2, memory_mib=memory)


def _kept(iid: str, memory: float, fn: str = "guest/old") -> PlacedInstance:
    """As the balancer reads a kept reservation: SM 0, the weights' memory."""
    return PlacedInstance(id=iid, function=fn, cls=InstanceClass.TRAINING, request=0.0, limit=0.0, memory_mib=memory)


Layout = dict[GpuRef, tuple[tuple[PlacedInstance, ...], frozenset[tuple[str, float]]]]


def _plan(layout: Layout, specs: tuple[FunctionSpec, ...], *, memory: float = 40000.0,
          evict: bool = True) -> TickPlan:
    """Plan a tick over ``layout`` (GPU → instances, weight groups); every instance whose id ends with
    "-kept" is kept weights (listed as evictable unless ``evict`` is False: records without the mark)."""
    reports: dict[str, LoadReport] = {}
    records: dict[str, InstanceRecord] = {}
    for ref in sorted(layout, key=lambda r: (r.invoker, r.gpu)):
        rep = reports.get(ref.invoker) or LoadReport(invoker=ref.invoker, boot="b0", at_ms=0)
        running = tuple(InstanceReport(id=i.id, function=i.function, rev=REV, state="ready", gpu=ref.gpu)
                        for i in layout[ref][0] if not i.id.endswith("-kept"))
        reports[ref.invoker] = replace(rep, gpus=rep.gpus + (GpuReport(index=ref.gpu, uuid=f"{ref}",
                                                                         memory_mb=int(memory)),),
                                       instances=rep.instances + running)
        for r in running:
            records[r.id] = InstanceRecord(id=r.id, function=r.function, rev=REV, invoker=ref.invoker, gpu=ref.gpu,
                                           gpu_uuid=f"{ref}", cls="inference", request=0.1, limit=0.2,
                                           memory_mb=10000, state="ready", since=NOW - 10, epoch=1, boot="b0")
    gpus = [GpuState(ref=ref, memory_mib=memory, uuid=f"{ref}", instances=inst, weight_groups=groups)
            for ref, (inst, groups) in layout.items()]
    evictable = {}
    for ref, (inst, groups) in layout.items():
        kept = [i for i in inst if i.id.endswith("-kept")]
        if kept and evict:
            own = frozenset(g for g in groups if any(g[0] == f"{i.function}@{REV}" for i in inst if i not in kept))
            evictable[ref] = Evictable(instances=frozenset(i.id for i in kept), weight_groups=own,
                                       memory_mib=sum(i.memory_mib for i in kept))
    others = {s.fqn for s in specs}
    extra = tuple(_spec(r.function, 10000) for r in records.values() if r.function not in others)
    return plan_tick(TickInput(now=NOW, epoch=3, reports=reports, known_invokers=frozenset(reports), records=records,
                               specs={s.fqn: s for s in specs + extra},
                               cluster=ClusterSnapshot.build(now=NOW, gpus=gpus), evictable=evictable),
                     PlannerConfig())


def _starts(plan: TickPlan) -> list[tuple[str, int | None, bool, int]]:
    return [(o.record.invoker, o.record.gpu, o.evicts, o.weights_mb) for o in plan.starts]


G00, G01, G10 = GpuRef("invoker0", 0), GpuRef("invoker0", 1), GpuRef("invoker1", 0)
NONE: frozenset[tuple[str, float]] = frozenset()


def test_room_that_only_kept_weights_hold_is_used_when_nothing_else_fits() -> None:
    layout: Layout = {G00: ((_kept("old-1-kept", 30000),), NONE)}
    plan = _plan(layout, (_spec("guest/new", 20000),))
    assert _starts(plan) == [("invoker0", 0, True, 0)]
    [placed] = [d for d in plan.decisions if d.kind == "place"]
    assert "evicts the kept weights there (30000 MiB: old-1-kept)" in placed.reason
    # a kept reservation the balancer cannot tell from a running one (no mark): used memory, as before
    plan = _plan(layout, (_spec("guest/new", 20000),), evict=False)
    assert plan.starts == () and "memory" in plan.states["guest/new"].blocked


def test_a_gpu_that_scores_better_once_they_are_gone_is_preferred_to_lighting_one() -> None:
    """invoker0's GPU runs an instance beside 25 GB of kept weights, invoker1's is dark: the new instance
    packs beside the running one (the strategy's lit-first) instead of lighting invoker1's GPU."""
    layout: Layout = {G00: ((_running("run-a", 10000), _kept("old-1-kept", 25000)), NONE), G10: ((), NONE)}
    plan = _plan(layout, (_spec("guest/new", 10000),))
    assert _starts(plan) == [("invoker0", 0, True, 0)]
    [placed] = [d for d in plan.decisions if d.kind == "place"]
    assert "over invoker1/gpu0 without eviction" in placed.reason
    # unmarked: it lights invoker1's GPU as before
    assert _starts(_plan(layout, (_spec("guest/new", 10000),), evict=False)) == [("invoker1", 0, False, 0)]


def test_all_else_equal_nothing_is_evicted() -> None:
    """A GPU holding only kept weights is as dark as an empty one once they go: the empty one is taken."""
    layout: Layout = {G00: ((_kept("old-1-kept", 30000),), NONE), G10: ((), NONE)}
    assert _starts(_plan(layout, (_spec("guest/new", 20000),))) == [("invoker1", 0, False, 0)]


def test_an_invoker_with_another_gpu_that_fits_is_not_asked_to_evict() -> None:
    """The invoker tries its other GPUs before it evicts kept weights: the balancer places there itself."""
    layout: Layout = {G00: ((_running("run-a", 10000), _kept("old-1-kept", 25000)), NONE), G01: ((), NONE)}
    assert _starts(_plan(layout, (_spec("guest/new", 10000),))) == [("invoker0", 1, False, 0)]


def test_placements_of_one_tick_evict_once_and_share_the_freed_room() -> None:
    layout: Layout = {G00: ((_kept("old-1-kept", 30000),), NONE)}
    plan = _plan(layout, (_spec("guest/new", 15000, min_instances=3),))
    # 40 GB once the 30 GB go: two of 15 GB, the first evicting; the third waits
    assert _starts(plan) == [("invoker0", 0, True, 0), ("invoker0", 0, False, 0)]
    assert plan.states["guest/new"].owed == 1 and "memory" in plan.states["guest/new"].blocked


def test_the_revisions_own_kept_weights_are_mapped_not_evicted() -> None:
    """The sharing tier counts kept weights: an instance of their revision goes to their GPU, needing only
    the rest of its memory (over spreading to invoker1, whose GPU runs another function)."""
    group = frozenset({(f"{LLM}@{REV}", 8000.0)})
    layout: Layout = {G00: ((_kept("llm-1-kept", 8000, fn=LLM),), group),
                      G10: ((_running("run-b", 10000),), NONE)}
    assert _starts(_plan(layout, (_spec(LLM, 10000, weights_mb=8000),), memory=16000.0)) == [
        ("invoker0", 0, False, 8000)]


def test_room_beside_the_revisions_own_kept_weights_held_by_others_kept_evicts_them_all() -> None:
    """16 GB: the revision's own kept 8 GB and another function's kept 7 GB; the rest (2 GB) does not fit
    beside both. The invoker evicts every kept process of the GPU for room, its own revision's too, so the
    instance is placed needing its whole 10 GB and reserved whole."""
    group = frozenset({(f"{LLM}@{REV}", 8000.0)})
    layout: Layout = {G00: ((_kept("llm-1-kept", 8000, fn=LLM), _kept("old-1-kept", 7000)), group)}
    assert _starts(_plan(layout, (_spec(LLM, 10000, weights_mb=8000),), memory=16000.0)) == [
        ("invoker0", 0, True, 0)]


# -- the balancer and the GPU budgets in Redis ------------------------------------------------------

PREFIX = "kept:"
KEYS = Keys(PREFIX)
TTL = 30.0
UUID = "invoker0-gpu0"


def _cfg() -> config.Config:
    base = config.load(environ={})
    return replace(base, redis=replace(base.redis, prefix=PREFIX),
                   balancer=replace(base.balancer, tick_s=0.2, lease_ttl_s=5.0))


async def _invoker(redis: aioredis.Redis, memory_mb: int = 16000) -> GpuBudgets:
    budgets = GpuBudgets(redis, PREFIX)
    report = LoadReport(invoker="invoker0", boot="boot", at_ms=int(time.time() * 1000),
                        gpus=(GpuReport(index=0, uuid=UUID, memory_mb=memory_mb),))
    await budgets.register_gpu(UUID, GpuCapacity(node="invoker0", index=0, name="t", memory_mb=memory_mb,
                                                 sm_count=132))
    await redis.set(KEYS.report("invoker0"), pack(report), px=60_000)
    await redis.set(KEYS.boot("invoker0"), "boot", px=60_000)
    await redis.sadd(KEYS.invokers, "invoker0")
    return budgets


async def _function(redis: aioredis.Redis, name: str, memory_mb: int, weights_mb: int = 0) -> None:
    ann = {"gpu-memory-mb": memory_mb, "gpu-sm-request": 0.1, "gpu-sm-limit": 0.2, "min-instances": 1}
    if weights_mb:
        ann["gpu-weights-mb"] = weights_mb
    action = Action(namespace="guest", name=name, exec=Exec(kind="python:3-gpu", code="def main(a): return a"),
                    revision=REV, annotations=tuple(Parameter(k, v) for k, v in ann.items()))
    await FunctionRegistry(redis, KEYS).ensure(action)


def _kept_reservation(instance: str, function: str, weights_mb: int, *, kept: bool = True) -> Reservation:
    """What `GpuNode.keep_weights` reserves: SM 0, the weights alone, the revision's group."""
    return Reservation(instance=instance, function=function, cls="training", invoker="invoker0", request=0.0,
                       limit=0.0, memory_mb=weights_mb, weights_mb=weights_mb,
                       group=weights_group("invoker0", function, REV), kept=kept)


def _attach(cmd: InstanceCommand, weights_mb: int = 0) -> Reservation:
    """The reservation the invoker's attach of a started instance makes (what `GpuNode.attach` reserves)."""
    return Reservation(instance=cmd.instance, function=cmd.function, cls="inference", invoker="invoker0",
                       request=cmd.request, limit=cmd.limit, memory_mb=cmd.memory_mb, weights_mb=weights_mb,
                       group=weights_group("invoker0", cmd.function, REV) if weights_mb else "")


async def _tick(redis: aioredis.Redis) -> list[InstanceCommand]:
    balancer = Balancer(redis, _cfg(), holder="solo")
    lead = await balancer.campaign_once()
    assert lead is not None and await balancer.tick(lead)
    return [c for c in (from_stream(InstanceCommand, f) for _, f in await redis.xrange(KEYS.commands("invoker0")))
            if c.op == "start"]


async def test_the_balancer_places_on_kept_room_and_the_invokers_attach_is_admitted_after_eviction(
        redis: aioredis.Redis) -> None:
    """16 GB GPU holding 8 GB of kept weights; a 12 GB function is placed there, reserved as if they were
    gone. The invoker's attach (which does not evict in Redis) is refused until it lets the kept process go,
    then admitted: the budget holds the new instance alone."""
    budgets = await _invoker(redis)
    assert (await budgets.reserve(UUID, _kept_reservation("llm-1-kept", LLM, 8000), ttl_s=TTL)).ok
    await _function(redis, "big", 12000)
    [start] = await _tick(redis)
    assert (start.function, start.gpu_uuid, start.memory_mb) == ("guest/big", UUID, 12000)
    assert "evicts the kept weights there (8000 MiB: llm-1-kept)" in start.reason
    got = await budgets.get(UUID)
    assert got is not None and set(got.reservations) == {"llm-1-kept", start.instance}
    assert got.reservations["llm-1-kept"].kept and not got.reservations[start.instance].kept
    assert got.sum_memory_mb == 20000  # over the GPU until the invoker evicts: no start runs before that
    refused = await budgets.reserve(UUID, _attach(start), ttl_s=TTL)
    assert not refused.ok and "memory would reach 20000 MB > 16000 MB" in refused.reason
    await budgets.release(UUID, "llm-1-kept")  # what the invoker's eviction of the kept process releases
    admitted = await budgets.reserve(UUID, _attach(start), ttl_s=TTL)
    assert admitted.ok and admitted.sum_memory_mb == 12000


async def test_a_record_without_the_kept_mark_is_used_memory(redis: aioredis.Redis) -> None:
    """A kept reservation written before the field existed (no ``kept`` key) reads as not kept: the
    placement waits as before."""
    budgets = await _invoker(redis)
    body = {k: v for k, v in msgpack.unpackb(msgpack.packb({
        "instance": "llm-1-kept", "function": LLM, "cls": "training", "invoker": "invoker0", "request": 0.0,
        "limit": 0.0, "memory_mb": 8000, "weights_mb": 8000, "group": weights_group("invoker0", LLM, REV),
        "shares_weights": False, "expires_ms": int(time.time() * 1000) + 60_000})).items()}
    await redis.hset(budgets.gpu_key(UUID), "r:llm-1-kept", msgpack.packb(body, use_bin_type=True))
    got = await budgets.get(UUID)
    assert got is not None and not got.reservations["llm-1-kept"].kept
    assert evictable_of("invoker0", got.reservations.values()) is None
    await _function(redis, "big", 12000)
    assert await _tick(redis) == []
    got = await budgets.get(UUID)
    assert got is not None and set(got.reservations) == {"llm-1-kept"}


async def test_the_revisions_kept_weights_are_shared_by_its_next_instance(redis: aioredis.Redis) -> None:
    """The kept weights of the revision (8 GB): its next instance (10 GB, 8 of them the weights) is placed
    beside them, reserved 2 GB (the kept reservation carries the weights), nothing evicted; the invoker's
    attach settles the same charge."""
    budgets = await _invoker(redis)
    assert (await budgets.reserve(UUID, _kept_reservation("llm-1-kept", LLM, 8000), ttl_s=TTL)).ok
    await _function(redis, "llm", 10000, weights_mb=8000)
    [start] = await _tick(redis)
    assert start.gpu_uuid == UUID and "weights shared there" in start.reason and "evicts" not in start.reason
    got = await budgets.get(UUID)
    assert got is not None and got.sum_memory_mb == 10000
    assert (got.reservations[start.instance].memory_mb, got.reservations[start.instance].shares_weights) == (2000, True)
    again = await budgets.reserve(UUID, _attach(start, weights_mb=8000), ttl_s=TTL)
    assert again.ok and (again.memory_mb, again.sum_memory_mb) == (2000, 10000)


@pytest.mark.parametrize(("kept", "rest", "evict", "ok", "charged", "total"), [
    # another function's kept 8 GB: 12 GB fit only with evict, counted as if they were gone
    ("other", 12000, False, False, 0, 0),
    ("other", 12000, True, True, 12000, 12000),
    ("other", 16001, True, False, 0, 0),
    # a live instance maps the kept weights: evicting the kept process leaves it carrying them (its 1 GB
    # + 8 GB), so evict frees nothing: 7 GB fit, 7 GB + 1 MB never
    ("mapped", 7000, True, True, 7000, 16000),
    ("mapped", 7001, True, False, 0, 0),
    ("mapped", 7001, False, False, 0, 0),
])
async def test_an_evicting_reservation_counts_kept_weights_as_gone(
        redis: aioredis.Redis, kept: str, rest: int, evict: bool, ok: bool, charged: int, total: int) -> None:
    budgets = await _invoker(redis)
    assert (await budgets.reserve(UUID, _kept_reservation("llm-1-kept", LLM, 8000), ttl_s=TTL)).ok
    if kept == "mapped":
        mapper = Reservation(instance="llm-2", function=LLM, cls="inference", invoker="invoker0", request=0.1,
                             limit=0.2, memory_mb=9000, weights_mb=8000, group=weights_group("invoker0", LLM, REV))
        assert (await budgets.reserve(UUID, mapper, ttl_s=TTL)).memory_mb == 1000
    new = Reservation(instance="new", function="guest/big", cls="inference", invoker="invoker0", request=0.1,
                      limit=0.2, memory_mb=rest)
    result = await budgets.reserve(UUID, new, ttl_s=TTL, evict=evict)
    assert (result.ok, result.memory_mb, result.sum_memory_mb) == (ok, charged, total), result.reason


async def test_an_evicting_instance_of_the_revision_does_not_share_with_kept_weights(redis: aioredis.Redis) -> None:
    """Its own revision's kept weights go with the rest (the invoker evicts every kept process of the GPU):
    reserved evicting, the instance is charged whole; without evict it shares them."""
    budgets = await _invoker(redis)
    assert (await budgets.reserve(UUID, _kept_reservation("llm-1-kept", LLM, 8000), ttl_s=TTL)).ok
    new = Reservation(instance="llm-3", function=LLM, cls="inference", invoker="invoker0", request=0.1, limit=0.2,
                      memory_mb=10000, weights_mb=8000, group=weights_group("invoker0", LLM, REV))
    evicting = await budgets.reserve(UUID, new, ttl_s=TTL, evict=True)
    assert evicting.ok and (evicting.memory_mb, evicting.shares_weights, evicting.sum_memory_mb) == (10000, False, 10000)
    plain = await budgets.reserve(UUID, replace(new, instance="llm-4"), ttl_s=TTL)
    assert plain.ok and (plain.memory_mb, plain.shares_weights) == (2000, True)


# -- end to end: standalone's balancer, its invoker's GPU node and keeper -----------------------------

KEEP_CODE = '''
import os
from dilu_invoker.actions import models


def build():
    import numpy as np
    return {"w": np.arange(1 << 16, dtype=np.float32)}


def main(args):
    models.load("w", build)
    return {"role": models.info("w").role, "gpu": os.environ.get("DILU_GPU_UUID", "")}
'''
BIG_CODE = '''
import os


def main(args):
    return {"gpu": os.environ.get("DILU_GPU_UUID", "")}
'''


@pytest.mark.slow
async def test_standalone_evicts_kept_weights_for_what_the_balancer_placed_on_their_room(tmp_path: Path) -> None:
    """`standalone` (process backend, a 16 GB GPU, the embedded balancer): ``llm`` (4 GB, 3 GB weights) is
    scaled to zero and its process kept with its 3 GB of weights. ``big`` (14 GB) fits only once they go:
    the balancer places it on the GPU, the invoker evicts the kept process and attaches it there, and it
    answers from the GPU; the budget then holds ``big`` alone."""
    cfg = staged_config(tmp_path, "GPU-kept")
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token}"}) as http:
        assert running.balancer is not None
        invoker = running.invokers[0]
        keeper = invoker.keeper
        assert keeper is not None
        redis = running.balancer.redis
        budgets = GpuBudgets(redis, cfg.redis.prefix)
        api = f"{running.api_url}/api/v1/namespaces/_/actions"
        for name, code, ann in (("llm", KEEP_CODE, {"gpu-memory-mb": 4000, "gpu-weights-mb": 3000}),
                                ("big", BIG_CODE, {"gpu-memory-mb": 14000})):
            body = {"exec": {"kind": "python:3-gpu", "code": code},
                    "annotations": [{"key": k, "value": v} for k, v in
                                    {**ann, "gpu-sm-request": 0.1, "gpu-sm-limit": 0.2}.items()]}
            async with http.put(f"{api}/{name}", json=body) as r:
                assert r.status == 200, await r.text()

        async def invoke(name: str) -> dict[str, Any]:
            async with http.post(f"{api}/{name}?blocking=true&result=true", json={}) as r:
                assert r.status == 200, await r.text()
                return dict(await r.json())

        async def until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
            deadline = time.monotonic() + timeout_s
            while not await check():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.05)

        first = await invoke("llm")
        assert first["role"] == "holder" and first["gpu"] == "GPU-kept", first
        [uuid] = await budgets.node_gpus("invoker0")

        async def kept() -> bool:
            got = await budgets.get(uuid)
            return got is not None and [(r.memory_mb, r.kept) for r in got.reservations.values()] == [(3000, True)]

        await until("llm's weights to be kept", kept)
        assert len([k for k in keeper.kept.values() if not k.gone]) == 1

        answer = await invoke("big")
        assert answer["gpu"] == "GPU-kept", answer  # attached to the GPU, not run on the CPU
        got = await budgets.get(uuid)
        assert got is not None and [(r.function, r.memory_mb) for r in got.reservations.values()] == [
            ("guest/big", 14000)], got
        assert not keeper.kept
        text = generate_latest(invoker.metrics.registry).decode()
        assert 'dilu_invoker_weights_kept_events_total{event="evicted"} 1.0' in text
        records = [decode(InstanceRecord, raw) for raw in (await redis.hgetall(Keys(cfg.redis.prefix).instances)).values()]
        assert [(r.function, r.gpu_uuid) for r in records if r is not None] == [("guest/big", uuid)]
        reasons = [from_stream(Decision, f).reason for _, f in await redis.xrange(Keys(cfg.redis.prefix).decisions)]
        assert sum("evicts the kept weights there (3000 MiB" in r for r in reasons) == 1


async def test_the_node_marks_kept_weights_and_a_resync_keeps_the_mark(tmp_path: Path, redis: aioredis.Redis) -> None:
    """`GpuNode.keep_weights` reserves the weights alone under `<instance>-kept`, marked kept; a re-sync
    after Redis lost the GPU's reservations restores them marked, so the balancer still sees them as
    evictable."""
    from dilu_invoker.gpu.devices import GpuDevice
    from dilu_invoker.gpu.node import GpuNode
    from dilu_invoker.model import GpuClass, GpuNeeds

    budgets = GpuBudgets(redis, PREFIX)
    device = GpuDevice(index=0, uuid="GPU-kn-0", name="Test GPU", memory_mb=16000, sm_count=132, simulated=True)
    node = GpuNode(node="invoker0", devices=(device,), shm_dir=tmp_path / "shm", budgets=budgets, sync_period_s=3600)
    await node.start()
    try:
        needs = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.1, sm_limit=0.2, memory_mb=4000, weights_mb=3000)
        assert await node.attach("a", LLM, needs, revision=REV) is not None
        assert await node.keep_weights("a") == "a-kept"

        async def marks() -> list[tuple[str, int, float, bool]]:
            got = await budgets.get("GPU-kn-0")
            assert got is not None
            return [(r.instance, r.memory_mb, r.request, r.kept) for r in got.reservations.values()]

        assert await marks() == [("a-kept", 3000, 0.0, True)]
        await redis.delete(budgets.gpu_key("GPU-kn-0"))  # Redis restarted without persistence
        await node._sync_once()  # the renewal finds it gone; registers the GPU and reconciles
        await node._sync_once()
        assert await marks() == [("a-kept", 3000, 0.0, True)]
        got = await budgets.get("GPU-kn-0")
        assert got is not None
        ev = evictable_of("invoker0", got.reservations.values())
        assert ev is not None and (ev.instances, ev.memory_mib, ev.weight_groups) == (
            frozenset({"a-kept"}), 3000.0, frozenset())
    finally:
        await node.close()
