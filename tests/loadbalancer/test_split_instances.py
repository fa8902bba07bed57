"""Split instances in the live balancer: an LLM of an action declaring `gpu-stages` that no lit GPU holds whole is
placed as pipeline stages over lit GPUs of one invoker (Dilu's tier before lighting a GPU), each stage reserved in Redis under its own id, all or none; the
start command names the stages; the next tick's snapshot counts each stage as a piece on its GPU; a stage
refused by its budget leaves nothing reserved and the start owed; a failed or stopped split instance releases
every stage. Real Redis; the invoker's reports are written as an invoker writes them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from bench.stage_move import GUEST_AUTH, inventory_standalone
from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets, GpuCapacity, Reservation
from dilu_invoker.invoker.cluster.registry import FunctionRegistry
from dilu_invoker.loadbalancer.service import Balancer, cluster_of
from dilu_invoker.model import Action, Exec, Parameter, ValidationError
from dilu_invoker.policy.placement import part_id
from dilu_invoker.standalone import run_standalone
from dilu_invoker.wire import (
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
    stage_id,
)

PREFIX = "split:"
KEYS = Keys(PREFIX)
FN, REV = "guest/llm", "1-x"
TTL = 30.0
GPU_MB = 16000


def _cfg(**balancer: object) -> config.Config:
    base = config.load(environ={})
    return replace(base, redis=replace(base.redis, prefix=PREFIX),
                   balancer=replace(base.balancer, **{"tick_s": 0.2, "lease_ttl_s": 5.0, **balancer}))


def _uuid(invoker: str, gpu: int) -> str:
    return f"{invoker}-gpu{gpu}"


async def _invoker(redis: aioredis.Redis, name: str, *, gpus: int = 3,
                   instances: tuple[InstanceReport, ...] = (), user_memory_mb: int = 0) -> None:
    budgets = GpuBudgets(redis, PREFIX)
    for g in range(gpus):
        await budgets.register_gpu(_uuid(name, g), GpuCapacity(node=name, index=g, name="t", memory_mb=GPU_MB,
                                                               sm_count=132))
    report = LoadReport(invoker=name, boot="boot", at_ms=int(time.time() * 1000), instances=instances,
                        user_memory_mb=user_memory_mb,
                        gpus=tuple(GpuReport(index=g, uuid=_uuid(name, g), memory_mb=GPU_MB) for g in range(gpus)))
    await redis.set(KEYS.report(name), pack(report), px=60_000)
    await redis.set(KEYS.boot(name), "boot", px=60_000)
    await redis.sadd(KEYS.invokers, name)


async def _register(redis: aioredis.Redis, name: str, ann: dict[str, object]) -> None:
    """The action ``guest/<name>`` with these annotations, in the balancer's function registry."""
    action = Action(namespace="guest", name=name, exec=Exec(kind="python:3-gpu", code="def main(a): return a"),
                    revision=REV, annotations=tuple(Parameter(k, v) for k, v in ann.items()))
    await FunctionRegistry(redis, KEYS).ensure(action)


async def _function(redis: aioredis.Redis, **annotations: object) -> None:
    await _register(redis, "llm", {"gpu-class": "llm", "gpu-memory-mb": 12000, "gpu-sm-request": 0.4,
                                   "gpu-sm-limit": 0.6, "gpu-stages": 2, "min-instances": 1, **annotations})


async def _starts(redis: aioredis.Redis, invoker: str = "invoker0", op: str = "start") -> list[InstanceCommand]:
    return [c for c in (from_stream(InstanceCommand, f) for _, f in await redis.xrange(KEYS.commands(invoker)))
            if c.op == op]


async def _leader(redis: aioredis.Redis, **balancer: object) -> tuple[Balancer, object]:
    b = Balancer(redis, _cfg(**balancer), holder="solo")
    lead = await b.campaign_once()
    assert lead is not None
    return b, lead


async def _lit(redis: aioredis.Redis) -> None:
    """GPUs 0 and 1 half full (8 GB, 0.3 SM each, another function's): neither holds the 12 GB LLM whole."""
    budgets = GpuBudgets(redis, PREFIX)
    for g in (0, 1):
        assert (await budgets.reserve(_uuid("invoker0", g), Reservation(
            instance=f"other-{g}", function="guest/other", cls="inference", invoker="invoker0", request=0.3,
            limit=0.5, memory_mb=8000), ttl_s=TTL)).ok


async def _reservations(redis: aioredis.Redis, invoker: str = "invoker0", gpus: int = 3,
                        ) -> dict[str, Reservation]:
    budgets = GpuBudgets(redis, PREFIX)
    out: dict[str, Reservation] = {}
    for g in range(gpus):
        got = await budgets.get(_uuid(invoker, g))
        assert got is not None
        out.update({f"{g}:{k}": r for k, r in got.reservations.items() if not k.startswith("other-")})
    return out


async def _placed_split(redis: aioredis.Redis) -> tuple[Balancer, object, InstanceCommand]:
    """GPUs 0 and 1 half full, the llm function, one tick of a leader: its start command."""
    await _invoker(redis, "invoker0")
    await _lit(redis)
    await _function(redis)
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    [cmd] = await _starts(redis)
    return balancer, lead, cmd


def test_the_annotation_is_checked_when_the_action_is_stored() -> None:
    def spec(**ann: object) -> FunctionSpec:
        return FunctionSpec.of(Action(namespace="guest", name="x", exec=Exec(kind="python:3-gpu", code=""),
                                      annotations=tuple(Parameter(k, v) for k, v in ann.items())))

    assert spec(**{"gpu-class": "llm", "gpu-stages": 3}).stages == 3
    assert spec().stages == 1
    for bad in ({"gpu-stages": 2}, {"gpu-class": "llm", "gpu-stages": 0}, {"gpu-class": "llm", "gpu-stages": 9},
                {"gpu-class": "llm", "gpu-stages": "two"}, {"gpu-class": "llm", "gpu-stages": 2,
                                                            "gpu-weights-mb": 100}):
        with pytest.raises(ValidationError, match="gpu-stages"):
            spec(**bad)
    # The stage ids the invoker runs are the piece ids placement gives.
    assert all(stage_id("fn-1-2", k) == part_id("fn-1-2", k) for k in range(4))


async def test_an_llm_no_lit_gpu_holds_is_placed_as_stages_each_reserved(redis: aioredis.Redis) -> None:
    balancer, lead, cmd = await _placed_split(redis)
    assert len(cmd.stages) == 2
    assert {s.gpu for s in cmd.stages} == {0, 1}
    assert [s.id for s in cmd.stages] == [stage_id(cmd.instance, 0), stage_id(cmd.instance, 1)]
    assert (cmd.gpu, cmd.gpu_uuid) == (cmd.stages[0].gpu, cmd.stages[0].gpu_uuid)
    assert (cmd.request, cmd.memory_mb) == (0.4, 12000)  # the whole instance's
    assert sum(s.memory_mb for s in cmd.stages) == 12000 and all(s.memory_mb <= 8000 for s in cmd.stages)
    assert sum(s.request for s in cmd.stages) == pytest.approx(0.4)
    # Each stage is reserved on its own GPU under its own id, with its own share of the instance.
    held = await _reservations(redis)
    assert {r.instance for r in held.values()} == {s.id for s in cmd.stages}
    for s in cmd.stages:
        r = held[f"{s.gpu}:{s.id}"]
        assert (r.request, r.limit, r.memory_mb, r.cls) == (s.request, s.limit, s.memory_mb, "llm")
    # The instance table holds the record with its stages.
    rec = decode(InstanceRecord, await redis.hget(KEYS.instances, cmd.instance))
    assert rec is not None and rec.stages == cmd.stages
    # The next snapshot counts each stage as a piece of the instance on its GPU.
    budgets = GpuBudgets(redis, PREFIX)
    reports = await balancer.read_reports()
    snap, _ = cluster_of(0.0, reports, {FN: FunctionSpec(fqn=FN, rev=REV, kind="python:3-gpu", cls="llm",
                                                        request=0.4, limit=0.6, memory_mb=12000, stages=2)},
                         {u: await budgets.get(u) for u in (_uuid("invoker0", g) for g in range(3))})
    assert snap is not None
    pieces = [i for g in snap.gpus for i in g.instances if i.function == FN]
    assert {(i.id, i.part_of) for i in pieces} == {(s.id, cmd.instance) for s in cmd.stages}
    # A second tick places nothing more (min-instances 1) and keeps the reservations.
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert len(await _starts(redis)) == 1 and len(await _reservations(redis)) == 2
    assert snap.gpus[2].instances == ()  # no GPU was lit for it


@pytest.mark.parametrize("why", ["undeclared", "switched-off"])
async def test_without_stages_the_llm_lights_a_gpu_of_its_own(redis: aioredis.Redis, why: str) -> None:
    await _invoker(redis, "invoker0")
    await _lit(redis)
    if why == "undeclared":
        await _function(redis, **{"gpu-stages": 1})
        balancer, lead = await _leader(redis)
    else:
        await _function(redis)
        balancer, lead = await _leader(redis, max_stages=1)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    [cmd] = await _starts(redis)
    assert cmd.stages == () and (cmd.gpu, cmd.gpu_uuid) == (2, _uuid("invoker0", 2))
    assert {k: (r.request, r.memory_mb) for k, r in (await _reservations(redis)).items()} == {
        f"2:{cmd.instance}": (0.4, 12000)}


@pytest.mark.parametrize(("user_memory_mb", "stages"), [(600, 2), (400, 0)])
async def test_each_stage_holds_the_actions_memory_of_its_invoker(redis: aioredis.Redis, user_memory_mb: int,
                                                                  stages: int) -> None:
    """Each stage is a container holding the action's memory limit (256 MB here) of its invoker's user memory:
    with room for two it is split, with room for one it is placed whole, lighting a GPU."""
    await _invoker(redis, "invoker0", user_memory_mb=user_memory_mb)
    await _lit(redis)
    await _function(redis)
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    [cmd] = await _starts(redis)
    assert len(cmd.stages) == stages
    rec = decode(InstanceRecord, await redis.hget(KEYS.instances, cmd.instance))
    assert rec is not None and rec.user_memory_mb == 256 * max(1, stages)
    if not stages:
        assert cmd.gpu == 2


async def test_a_stage_its_budget_refuses_leaves_nothing_reserved(redis: aioredis.Redis) -> None:
    """Another admission takes GPU 1 after the balancer read the budgets: the second stage is refused, the
    first stage's reservation is released, nothing is commanded and the start is owed."""
    await _invoker(redis, "invoker0")
    await _lit(redis)
    await _function(redis)
    balancer, lead = await _leader(redis)
    budgets = GpuBudgets(redis, PREFIX)
    reserve = balancer.budgets.reserve
    rival = Reservation(instance="rival", function="guest/rival", cls="inference", invoker="invoker0",
                        request=0.1, limit=0.2, memory_mb=8000)

    async def rival_first(uuid: str, reservation: Reservation, **kw: object):  # type: ignore[no-untyped-def]
        if reservation.instance.endswith("#p1"):
            assert (await budgets.reserve(uuid, rival, ttl_s=TTL)).ok
        return await reserve(uuid, reservation, **kw)  # type: ignore[arg-type]

    balancer.budgets.reserve = rival_first  # type: ignore[method-assign]
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert await _starts(redis) == []
    assert {r.instance for r in (await _reservations(redis)).values()} == {"rival"}
    assert balancer._states[FN].owed == 1
    assert await redis.hkeys(KEYS.instances) == []


async def test_a_failed_split_instance_releases_every_stage(redis: aioredis.Redis) -> None:
    balancer, lead, cmd = await _placed_split(redis)
    assert len(await _reservations(redis)) == 2
    failed = InstanceReport(id=cmd.instance, function=FN, rev=REV, state="failed", cls="llm", gpu=cmd.gpu,
                            request=cmd.request, limit=cmd.limit, memory_mb=cmd.memory_mb,
                            error="stage 1 of 2: start failed")
    await _invoker(redis, "invoker0", instances=(failed,))
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert not any(r.instance.startswith(cmd.instance) for r in (await _reservations(redis)).values())
    [stop] = await _starts(redis, op="stop")
    assert stop.instance == cmd.instance


async def test_a_lost_split_instance_is_replaced_on_the_room_its_stages_left(redis: aioredis.Redis) -> None:
    """A ready split instance its invoker no longer runs is replaced in the same tick, split again over the
    GPUs its stages left (the snapshot drops every stage of a forgotten instance, not only its id)."""
    balancer, lead, cmd = await _placed_split(redis)
    ready = InstanceReport(id=cmd.instance, function=FN, rev=REV, state="ready", cls="llm", gpu=cmd.gpu,
                           request=cmd.request, limit=cmd.limit, memory_mb=cmd.memory_mb)
    await _invoker(redis, "invoker0", instances=(ready,))
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert balancer._records[cmd.instance].state == "ready"
    failed = replace(ready, state="failed", error="stage 0 of 2: container removed: its process exited")
    await _invoker(redis, "invoker0", instances=(failed,))
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    first, second = await _starts(redis)
    assert first.instance == cmd.instance and second.instance != cmd.instance
    assert {s.gpu for s in second.stages} == {0, 1}
    held = {r.instance for r in (await _reservations(redis)).values()}
    assert held == {s.id for s in second.stages}


# -- through the product: `standalone`, actions created over the REST API ------------------------------------

STAGE_CODE = """
import os

def main(args):
    seen = list(args.get("seen", []))
    seen.append([int(os.environ["DILU_STAGE_INDEX"]), int(os.environ["DILU_STAGE_COUNT"]),
                 os.environ["DILU_STAGE_SPAN"], os.getpid()])
    return {"seen": seen, "prompt": args["prompt"]}
"""


async def test_standalone_serves_an_llm_as_two_stages(tmp_path: Path) -> None:
    """`standalone` with two 16 GB GPUs (an inventory file) and its embedded balancer. A filler function's two
    10 GB instances light both GPUs; then an llm action declaring gpu-stages 2 and 9 GB, which no lit GPU holds
    whole, is placed as two stages, one on each GPU, each reserved there; a blocking invocation over the REST API
    runs both stages in order, each in its own process with its own span, and answers the last stage's result."""
    cfg = inventory_standalone(tmp_path, ["GPU-s0", "GPU-s1"])
    async with run_standalone(cfg) as running, aiohttp.ClientSession(headers=GUEST_AUTH) as http:
        assert running.balancer is not None
        redis = running.balancer.redis
        keys = Keys(cfg.redis.prefix)
        url = f"{running.api_url}/api/v1/namespaces/_/actions"

        async def create(name: str, code: str, ann: dict[str, object]) -> None:
            body = {"exec": {"kind": "python:3-gpu", "code": code},
                    "annotations": [{"key": k, "value": v} for k, v in ann.items()]}
            async with http.put(f"{url}/{name}", json=body) as r:
                assert r.status == 200, await r.text()
            async with http.post(f"{url}/{name}", json={"prompt": "register"}) as r:  # registers the function
                assert r.status == 202

        async def records(function: str, n: int) -> list[InstanceRecord]:
            deadline = time.monotonic() + 20.0
            while True:
                got = [r for r in (decode(InstanceRecord, raw) for raw in (await redis.hgetall(keys.instances)).values())
                       if r is not None and r.function == function]
                if len(got) == n and all(r.state == "ready" for r in got):
                    return got
                assert time.monotonic() < deadline, f"{function}: never {n} ready instances: {got}"
                await asyncio.sleep(0.05)

        # A bad annotation is refused in OpenWhisk's error shape, and nothing is stored.
        bad = {"exec": {"kind": "python:3-gpu", "code": STAGE_CODE},
               "annotations": [{"key": "gpu-stages", "value": 2}]}
        async with http.put(f"{url}/plain", json=bad) as r:
            assert r.status == 400
            err = await r.json()
            assert "gpu-stages" in err["error"] and err["code"]

        await create("fill", "def main(a):\n    return a\n",
                     {"gpu-memory-mb": 10000, "gpu-sm-request": 0.3, "gpu-sm-limit": 0.5, "min-instances": 2})
        fill = await records("guest/fill", 2)
        assert {r.gpu for r in fill} == {0, 1}
        await create("llm", STAGE_CODE, {"gpu-class": "llm", "gpu-stages": 2, "gpu-memory-mb": 9000,
                                         "gpu-sm-request": 0.4, "gpu-sm-limit": 0.6, "min-instances": 1})
        [llm] = await records("guest/llm", 1)
        assert len(llm.stages) == 2 and {s.gpu for s in llm.stages} == {0, 1}
        budgets = GpuBudgets(redis, cfg.redis.prefix)
        for s in llm.stages:
            got = await budgets.get(s.gpu_uuid or "")
            assert got is not None and got.reservations[s.id].memory_mb == s.memory_mb
            assert got.sum_memory_mb <= GPU_MB

        async with http.post(f"{url}/llm?blocking=true&result=true", json={"prompt": "hello"}) as r:
            assert r.status == 200, await r.text()
            result = await r.json()
        assert result["prompt"] == "hello"
        seen = result["seen"]
        assert [(i, n) for i, n, _, _ in seen] == [(0, 2), (1, 2)]
        spans = [tuple(float(x) for x in span.split(":")) for _, _, span, _ in seen]
        assert spans[0][0] == 0.0 and spans[0][1] == spans[1][0] and spans[1][1] == 1.0
        assert seen[0][3] != seen[1][3]  # two processes
