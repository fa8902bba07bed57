"""Gangs in the live balancer: an action annotated `gpu-count N` takes N GPUs of one invoker per instance (a gang
of N ranks, e.g. data-parallel training). Placement finds N GPUs of one invoker that each hold the per-GPU request
and memory, all or none; the start command names the ranks (`rank_id`), each reserved on its own GPU; the next
tick's snapshot holds the gang as one instance on each of its GPUs; compaction never moves it; a failed or lost
gang releases every rank. Real Redis; the invoker's reports are written as an invoker writes them."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from bench.stage_move import GUEST_AUTH, inventory_standalone
from dilu_invoker.gpu.budgets import GpuBudgets, Reservation
from dilu_invoker.loadbalancer.planner import placement_request, snapshot_ids
from dilu_invoker.loadbalancer.service import cluster_of
from dilu_invoker.model import Action, Exec, GpuNeeds, Parameter, ValidationError
from dilu_invoker.policy import PlacementRequest
from dilu_invoker.standalone import run_standalone
from dilu_invoker.wire import (
    FunctionSpec,
    InstanceRecord,
    InstanceReport,
    Keys,
    decode,
    rank_id,
    rank_of,
    stage_parent,
)
from tests.invoker.test_gangs import CODE as GANG_CODE
from tests.loadbalancer.test_split_instances import (
    KEYS,
    PREFIX,
    REV,
    TTL,
    _invoker,
    _leader,
    _register,
    _reservations,
    _starts,
    _uuid,
)

FN = "guest/train"


async def _gang(redis: aioredis.Redis, **annotations: object) -> None:
    await _register(redis, "train", {"gpu-class": "training", "gpu-memory-mb": 9000, "gpu-sm-request": 0.5,
                                     "gpu-sm-limit": 0.8, "gpu-count": 2, "min-instances": 1, **annotations})


def _spec(**ann: object) -> FunctionSpec:
    return FunctionSpec.of(Action(namespace="guest", name="x", exec=Exec(kind="python:3-gpu", code=""),
                                  annotations=tuple(Parameter(k, v) for k, v in ann.items())))


def test_the_annotation_is_checked_when_the_action_is_stored() -> None:
    assert _spec(**{"gpu-count": 4}).gpus == 4
    assert _spec().gpus == 1
    for bad in ({"gpu-count": 0}, {"gpu-count": 9}, {"gpu-count": "two"}, {"gpu-count": 1.5},
                {"gpu-count": 2, "gpu-class": "llm", "gpu-stages": 2}, {"gpu-count": 2, "gpu-weights-mb": 100}):
        with pytest.raises(ValidationError, match="gpu-count"):
            _spec(**bad)
    # What the invoker and the REST API read: 1 without the annotation or with invalid ones.
    assert [GpuNeeds.gpus_of(a) for a in ({"gpu-count": 3}, {}, {"gpu-count": 0}, {"gpu-count": 2, "gpu-weights-mb": 9})
            ] == [3, 1, 1, 1]
    request = placement_request(_spec(**{"gpu-count": 3, "gpu-class": "llm"}), "x-1-1", max_stages=4)
    assert isinstance(request, PlacementRequest) and (request.gpus, request.max_parts) == (3, 1)


def test_rank_ids_carry_the_gang_and_are_no_stage_ids() -> None:
    ids = [rank_id("train-3-7", k, 4) for k in range(4)]
    assert [rank_of(i) for i in ids] == [("train-3-7", k, 4) for k in range(4)]
    assert all(stage_parent(i) is None for i in ids)
    assert rank_of("train-3-7#p1") is None and rank_of("train-3-7") is None and rank_of("x#r4of4") is None


async def test_a_gang_takes_gpus_of_one_invoker_each_reserved(redis: aioredis.Redis) -> None:
    """Two invokers of three GPUs; invoker0's GPUs 0 and 1 are nearly full, so only invoker1 has two GPUs that
    each hold a rank (9 GB, 0.5 SM): the gang goes there, one rank on each of two GPUs, each reserved under its
    rank id with the per-GPU share; the record and the command name the ranks; the next snapshot holds the gang as
    one instance of two GPUs on both."""
    await _invoker(redis, "invoker0")
    await _invoker(redis, "invoker1")
    budgets = GpuBudgets(redis, PREFIX)
    for g in (0, 1):
        assert (await budgets.reserve(_uuid("invoker0", g), Reservation(
            instance=f"other-{g}", function="guest/other", cls="inference", invoker="invoker0", request=0.6,
            limit=0.6, memory_mb=10000), ttl_s=TTL)).ok
    await _gang(redis)
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert await _starts(redis, "invoker0") == []
    [cmd] = await _starts(redis, "invoker1")
    assert cmd.gang and len(cmd.stages) == 2 and len({s.gpu for s in cmd.stages}) == 2
    assert [s.id for s in cmd.stages] == [rank_id(cmd.instance, 0, 2), rank_id(cmd.instance, 1, 2)]
    assert all((s.request, s.limit, s.memory_mb) == (0.5, 0.8, 9000) for s in cmd.stages)
    assert (cmd.gpu, cmd.gpu_uuid) == (cmd.stages[0].gpu, cmd.stages[0].gpu_uuid)
    held = await _reservations(redis, "invoker1")
    assert {k: (r.request, r.limit, r.memory_mb, r.cls) for k, r in held.items()} == {
        f"{s.gpu}:{s.id}": (0.5, 0.8, 9000, "training") for s in cmd.stages}
    rec = decode(InstanceRecord, await redis.hget(KEYS.instances, cmd.instance))
    assert rec is not None and rec.gang and rec.stages == cmd.stages and rec.memory_mb == 18000
    assert snapshot_ids(rec) == [rec.id]
    reports = await balancer.read_reports()
    spec = _spec(**{"gpu-count": 2})
    snap, _ = cluster_of(0.0, reports, {FN: replace(spec, fqn=FN)},
                         {u: await budgets.get(u) for u in (_uuid(i, g) for i in ("invoker0", "invoker1")
                                                            for g in range(3))})
    assert snap is not None
    on = [(g.ref, i) for g in snap.gpus for i in g.instances if i.function == FN]
    assert {ref.gpu for ref, _ in on} == {s.gpu for s in cmd.stages} and {ref.invoker for ref, _ in on} == {"invoker1"}
    assert {(i.id, i.gpus, i.part_of, i.request, i.memory_mib) for _, i in on} == {(cmd.instance, 2, None, 0.5, 9000.0)}
    assert snap.locations[cmd.instance] and len(snap.locations[cmd.instance]) == 2
    # A second tick places nothing more (min-instances 1) and keeps both reservations.
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert len(await _starts(redis, "invoker1")) == 1 and len(await _reservations(redis, "invoker1")) == 2


async def test_no_invoker_with_enough_gpus_blocks_the_gang_and_says_why(redis: aioredis.Redis) -> None:
    """Two invokers of two GPUs and a gang of three: nothing is reserved or started, and the function's state says
    that it needs three GPUs of one invoker."""
    await _invoker(redis, "invoker0", gpus=2)
    await _invoker(redis, "invoker1", gpus=2)
    await _gang(redis, **{"gpu-count": 3})
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert await _starts(redis, "invoker0") == [] and await _starts(redis, "invoker1") == []
    assert await _reservations(redis, "invoker0", gpus=2) == {} and await _reservations(redis, "invoker1", gpus=2) == {}
    state = balancer._states[FN]
    assert state.owed == 1 and "3 GPUs of one invoker" in state.blocked


@pytest.mark.parametrize(("user_memory_mb", "placed"), [(512, True), (400, False)])
async def test_each_rank_holds_the_actions_memory_of_its_invoker(redis: aioredis.Redis, user_memory_mb: int,
                                                                 placed: bool) -> None:
    """Each rank is a container holding the action's memory limit (256 MB) of its invoker's user memory: with room
    for two the gang is placed, with room for one it is not (a gang is whole or nothing)."""
    await _invoker(redis, "invoker0", user_memory_mb=user_memory_mb)
    await _gang(redis)
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    starts = await _starts(redis)
    assert bool(starts) is placed
    if placed:
        rec = decode(InstanceRecord, await redis.hget(KEYS.instances, starts[0].instance))
        assert rec is not None and rec.user_memory_mb == 512
    else:
        assert "user memory" in balancer._states[FN].blocked


async def test_a_failed_gang_releases_every_rank_and_is_placed_again(redis: aioredis.Redis) -> None:
    await _invoker(redis, "invoker0")
    await _gang(redis)
    balancer, lead = await _leader(redis)
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    [cmd] = await _starts(redis)
    ready = InstanceReport(id=cmd.instance, function=FN, rev=REV, state="ready", cls="training", gpu=cmd.gpu,
                           request=cmd.request, limit=cmd.limit, memory_mb=cmd.memory_mb)
    await _invoker(redis, "invoker0", instances=(ready,))
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    assert balancer._records[cmd.instance].state == "ready"
    await _invoker(redis, "invoker0", instances=(replace(ready, state="failed", error="rank 1 of 2: exited"),))
    assert await balancer.tick(lead)  # type: ignore[arg-type]
    [stop] = await _starts(redis, op="stop")
    assert stop.instance == cmd.instance
    first, second = await _starts(redis)
    assert first.instance == cmd.instance and second.instance != cmd.instance and second.gang
    # The lost gang left the snapshot whole (by its own id): its replacement finds two GPUs again.
    held = {r.instance for r in (await _reservations(redis)).values()}
    assert held == {s.id for s in second.stages}


# -- through the product: `standalone`, an action created over the REST API ------------------------------------


async def _gang_in_standalone(tmp_path: Path, code: str, params: list[dict[str, object]], *, memory_mb: int = 256,
                              ) -> tuple[InstanceRecord, list[dict[str, object]]]:
    """`standalone` with two 16 GB GPUs (an inventory file) and its embedded balancer: the action ``gang`` with
    `code` and a memory limit of `memory_mb` per rank, annotated gpu-count 2, created over the REST API and
    registered; once its gang is ready (each rank's reservation checked), one blocking invocation per entry of
    `params`. Its record and the results."""
    cfg = inventory_standalone(tmp_path, ["GPU-g0", "GPU-g1"])
    cfg = replace(cfg, invoker=replace(cfg.invoker, user_memory_mb=max(cfg.invoker.user_memory_mb, 2 * memory_mb)))
    async with run_standalone(cfg) as running, aiohttp.ClientSession(headers=GUEST_AUTH) as http:
        assert running.balancer is not None
        redis = running.balancer.redis
        keys = Keys(cfg.redis.prefix)
        url = f"{running.api_url}/api/v1/namespaces/_/actions/gang"
        body = {"exec": {"kind": "python:3-gpu", "code": code}, "limits": {"memory": memory_mb},
                "annotations": [{"key": k, "value": v} for k, v in (
                    ("gpu-count", 2), ("gpu-memory-mb", 6000), ("gpu-sm-request", 0.3), ("gpu-sm-limit", 0.6),
                    ("min-instances", 1))]}
        async with http.put(url, json=body) as r:
            assert r.status == 200, await r.text()
        async with http.post(url, json={"word": "register"}) as r:  # registers the function
            assert r.status == 202
        deadline = time.monotonic() + 60.0
        while True:
            got = [r for r in (decode(InstanceRecord, raw) for raw in (await redis.hgetall(keys.instances)).values())
                   if r is not None and r.function == "guest/gang"]
            if got and got[0].state == "ready":
                break
            assert time.monotonic() < deadline, f"the gang never became ready: {got}"
            await asyncio.sleep(0.05)
        [gang] = got
        budgets = GpuBudgets(redis, cfg.redis.prefix)
        for s in gang.stages:
            held = await budgets.get(s.gpu_uuid or "")
            assert held is not None and held.reservations[s.id].memory_mb == 6000
        results = []
        for p in params:
            async with http.post(f"{url}?blocking=true&result=true", json=p) as r:
                assert r.status == 200, await r.text()
                results.append(await r.json())
        return gang, results


async def test_standalone_runs_a_gang_over_two_gpus(tmp_path: Path) -> None:
    """An action annotated gpu-count 2 in standalone is placed as a gang of two ranks, one on each GPU, each
    reserved there; its ranks meet at the MASTER_ADDR:MASTER_PORT the invoker gives them (rank 0 listens, rank 1
    connects, during /init, over a TCP socket), and a blocking invocation over the REST API reaches both ranks at
    once and answers rank 0's result."""
    gang, [result] = await _gang_in_standalone(tmp_path, GANG_CODE, [{"word": "hello"}])
    assert gang.gang and {s.gpu for s in gang.stages} == {0, 1}
    assert result["rank"] == 0  # rank 0's result, with what each rank saw in the same run
    seen = result["seen"]
    assert isinstance(seen, dict)
    assert [(seen[k]["env"]["RANK"], seen[k]["env"]["WORLD_SIZE"]) for k in ("0", "1")] == [("0", "2"), ("1", "2")]
    assert seen["0"]["pid"] != seen["1"]["pid"] and seen["1"]["word"] == "hello"
    assert seen["0"]["aid"] == seen["1"]["aid"]


# torch.distributed's own env:// rendezvous at import (rank 0 hosts the store at MASTER_ADDR:MASTER_PORT) and a
# collective in every run: docs/runtime.md's example with the gloo backend, on the CPU.
TORCH_CODE = """
import torch
import torch.distributed as dist

dist.init_process_group(backend="gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()

def main(args):
    x = torch.tensor([float(RANK + 1) * args.get("scale", 1)])
    dist.all_reduce(x)
    return {"rank": RANK, "world": WORLD, "sum": x.item(), "torch": torch.__version__}
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed here")
async def test_a_gang_rendezvous_with_torch_distributed(tmp_path: Path) -> None:
    """Real torch.distributed in a gang's ranks: `init_process_group` at import finds its peers through the
    invoker's env:// variables, and each invocation's all_reduce sums both ranks' tensors (1 + 2, then twice that),
    answered by rank 0. `import torch` needs more than the default 256 MB (the memory cgroup kills it there)."""
    _, results = await _gang_in_standalone(tmp_path, TORCH_CODE, [{"scale": 1}, {"scale": 2}], memory_mb=3072)
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, 3.0), (0, 2, 6.0)]
