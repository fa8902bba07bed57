"""Stage moves in the live balancer: compaction empties a GPU that holds only one pipeline stage of a split instance
by moving that stage to another lit GPU of its invoker while the pipeline serves. The balancer reserves the new
stage under a new id beside the old one, names it in the record (the old one in `moving`) and sends the invoker a
``move-stage`` command; the invoker's report that the move is done (or failed) settles the record. Real Redis; the
invoker's reports and releases are written as an invoker writes them (tests/invoker/test_stage_moves.py runs the
invoker's side)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets, Reservation
from dilu_invoker.loadbalancer import planner
from dilu_invoker.loadbalancer.service import Balancer
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.standalone import run_standalone
from dilu_invoker.wire import (
    CommandOp,
    Decision,
    InstanceCommand,
    InstanceRecord,
    InstanceReport,
    Keys,
    decode,
    from_stream,
    stage_parent,
)
from tests.loadbalancer.test_split_instances import (
    FN,
    GPU_MB,
    KEYS,
    PREFIX,
    REV,
    TTL,
    _function,
    _invoker,
    _leader,
    _lit,
    _reservations,
    _starts,
    _uuid,
)

#: the compaction period of these tests' balancer: a tick right after a run runs none
PERIOD_S = 1.0


def _ready(cmd: InstanceCommand, **kw: object) -> InstanceReport:
    return InstanceReport(id=cmd.instance, function=FN, rev=REV, state="ready", cls="llm", gpu=cmd.gpu,
                          request=cmd.request, limit=cmd.limit, memory_mb=cmd.memory_mb, **kw)  # type: ignore[arg-type]


async def _decisions(redis: aioredis.Redis) -> list[Decision]:
    return [from_stream(Decision, f) for _, f in await redis.xrange(KEYS.decisions)]


async def _record(redis: aioredis.Redis, instance: str) -> InstanceRecord:
    rec = decode(InstanceRecord, await redis.hget(KEYS.instances, instance))
    assert rec is not None
    return rec


async def _stage_on_its_own(redis: aioredis.Redis, **balancer: object) -> tuple[Balancer, object, InstanceCommand]:
    """An llm placed as two stages over GPUs 0 and 1 (each half full of another function), ready; then GPU 0's
    other instance goes, leaving stage 0 alone there, and GPU 2 is lit by a small instance with room for it."""
    await _invoker(redis, "invoker0")
    await _lit(redis)
    await _function(redis)
    b, lead = await _leader(redis, compaction_period_s=PERIOD_S, **balancer)
    assert await b.tick(lead)  # type: ignore[arg-type]
    [cmd] = await _starts(redis)
    assert [s.gpu for s in cmd.stages] == [0, 1]
    await _invoker(redis, "invoker0", instances=(_ready(cmd),))
    assert await b.tick(lead)  # type: ignore[arg-type]
    assert b._records[cmd.instance].state == "ready"
    budgets = GpuBudgets(redis, PREFIX)
    await budgets.release(_uuid("invoker0", 0), "other-0")
    assert (await budgets.reserve(_uuid("invoker0", 2), Reservation(
        instance="other-2", function="guest/other", cls="inference", invoker="invoker0", request=0.1, limit=0.2,
        memory_mb=2000), ttl_s=TTL)).ok
    await asyncio.sleep(PERIOD_S)  # the next compaction run is due
    return b, lead, cmd


async def test_a_stage_alone_on_its_gpu_moves_make_before_break(redis: aioredis.Redis) -> None:
    b, lead, cmd = await _stage_on_its_own(redis)
    old0, old1 = cmd.stages
    assert await b.tick(lead)  # type: ignore[arg-type]
    [move] = await _starts(redis, op=CommandOp.MOVE_STAGE.value)
    new0 = move.stages[0]
    # The command: the instance's whole stage list, a new stage 0 on GPU 2 with the old one's share, stage 1 as is.
    assert move.instance == cmd.instance and move.stages[1] == old1
    assert new0.id != old0.id and stage_parent(new0.id) == cmd.instance and new0.gpu == 2
    assert new0.gpu_uuid == _uuid("invoker0", 2)
    assert (new0.request, new0.limit, new0.memory_mb) == (old0.request, old0.limit, old0.memory_mb)
    # Both stage 0s are held while the old one serves: the new one reserved on GPU 2 under its own id.
    held = await _reservations(redis)
    assert {k for k in held} == {f"0:{old0.id}", f"1:{old1.id}", f"2:{new0.id}"}
    assert (held[f"2:{new0.id}"].request, held[f"2:{new0.id}"].memory_mb) == (old0.request, old0.memory_mb)
    rec = await _record(redis, cmd.instance)
    assert rec.stages == move.stages and rec.moving == (old0,) and rec.gpu == 2
    assert rec.state == "ready"  # it serves on throughout
    kinds = [d.kind for d in await _decisions(redis)]
    assert "stage-move" in kinds
    # No second run while the move is in flight, and no other command.
    await asyncio.sleep(PERIOD_S)
    assert await b.tick(lead)  # type: ignore[arg-type]
    assert len(await _starts(redis, op=CommandOp.MOVE_STAGE.value)) == 1
    assert len(await _starts(redis)) == 1 and await _starts(redis, op="stop") == []
    # The invoker reports it done once the old stage is stopped and released: the record settles.
    await GpuBudgets(redis, PREFIX).release(_uuid("invoker0", 0), old0.id)
    await _invoker(redis, "invoker0", instances=(_ready(move, moved=new0.id),))
    assert await b.tick(lead)  # type: ignore[arg-type]
    rec = await _record(redis, cmd.instance)
    assert rec.moving == () and rec.stages == move.stages and rec.gpu_reservations() == (
        (new0.gpu_uuid, new0.id), (old1.gpu_uuid, old1.id))
    assert [d.kind for d in await _decisions(redis)].count("stage-move-done") == 1
    assert b.metrics.totals["started"] == 1 and b.metrics.totals["done"] == 1
    # GPU 0 is dark now.
    assert {k for k in await _reservations(redis)} == {f"1:{old1.id}", f"2:{new0.id}"}


async def test_a_failed_stage_move_leaves_the_old_stage_serving(redis: aioredis.Redis) -> None:
    b, lead, cmd = await _stage_on_its_own(redis)
    assert await b.tick(lead)  # type: ignore[arg-type]
    [move] = await _starts(redis, op=CommandOp.MOVE_STAGE.value)
    new0 = move.stages[0]
    await GpuBudgets(redis, PREFIX).release(_uuid("invoker0", 2), new0.id)  # as the invoker does
    await _invoker(redis, "invoker0", instances=(_ready(cmd, move_failed=f"{new0.id}: stage 0 of 2: start failed"),))
    assert await b.tick(lead)  # type: ignore[arg-type]
    rec = await _record(redis, cmd.instance)
    assert rec.stages == cmd.stages and rec.moving == () and rec.state == "ready"
    [failed] = [d for d in await _decisions(redis) if d.kind == "stage-move-failed"]
    assert "start failed" in failed.reason and failed.instance == new0.id
    assert b.metrics.totals["abandoned"] == 1
    assert await _starts(redis, op="stop") == []


async def test_a_stage_move_its_budget_refuses_is_not_made(redis: aioredis.Redis) -> None:
    """Another admission takes GPU 2 after the balancer read the budgets: no command, the record as it was."""
    b, lead, cmd = await _stage_on_its_own(redis)
    budgets = GpuBudgets(redis, PREFIX)
    reserve = b.budgets.reserve
    rival = Reservation(instance="rival", function="guest/rival", cls="inference", invoker="invoker0",
                        request=0.1, limit=0.2, memory_mb=13000)

    async def rival_first(uuid: str, reservation: Reservation, **kw: object):  # type: ignore[no-untyped-def]
        if "#p0." in reservation.instance:
            assert (await budgets.reserve(uuid, rival, ttl_s=TTL)).ok
        return await reserve(uuid, reservation, **kw)  # type: ignore[arg-type]

    b.budgets.reserve = rival_first  # type: ignore[method-assign]
    assert await b.tick(lead)  # type: ignore[arg-type]
    assert await _starts(redis, op=CommandOp.MOVE_STAGE.value) == []
    rec = await _record(redis, cmd.instance)
    assert rec.stages == cmd.stages and rec.moving == ()
    assert {r.instance for r in (await _reservations(redis)).values()} == {*(s.id for s in cmd.stages), "rival"}


async def test_a_stage_move_that_never_ends_gives_the_instance_up(redis: aioredis.Redis,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The invoker never reports the move (its command lost, say): after the start timeout and the longest drain
    (`STAGE_MOVE_DRAIN_S`, shortened here) the instance is stopped, every stage it held released (old and new), and
    a replacement owed."""
    assert planner.STAGE_MOVE_DRAIN_S == 335.0
    monkeypatch.setattr(planner, "STAGE_MOVE_DRAIN_S", 0.1)
    b, lead, cmd = await _stage_on_its_own(redis, start_timeout_s=0.2)
    assert await b.tick(lead)  # type: ignore[arg-type]
    [move] = await _starts(redis, op=CommandOp.MOVE_STAGE.value)
    await asyncio.sleep(0.4)
    assert await b.tick(lead)  # type: ignore[arg-type]
    [stop] = await _starts(redis, op="stop")
    assert stop.instance == cmd.instance
    held = {r.instance for r in (await _reservations(redis)).values()}
    assert not held & {*(s.id for s in cmd.stages), move.stages[0].id}
    assert any(d.kind == "lost" and "not done after" in d.reason for d in await _decisions(redis))


async def test_with_stage_moves_switched_off_no_stage_moves(redis: aioredis.Redis) -> None:
    b, lead, cmd = await _stage_on_its_own(redis, compaction_stages=False)
    for _ in range(3):
        assert await b.tick(lead)  # type: ignore[arg-type]
        await asyncio.sleep(PERIOD_S)
    assert await _starts(redis, op=CommandOp.MOVE_STAGE.value) == []
    assert len(await _starts(redis)) == 1
    assert (await _record(redis, cmd.instance)).stages == cmd.stages
    assert not any(d.kind.startswith("stage-move") for d in await _decisions(redis))


# -- through the product: `standalone`, actions created over the REST API ------------------------------------

MOVE_CODE = """
import os

def main(args):
    seen = list(args.get("seen", []))
    seen.append([int(os.environ["DILU_STAGE_INDEX"]), os.environ.get("DILU_GPU_UUID", ""), os.getpid()])
    return {"seen": seen, "n": args["n"]}
"""


async def test_standalone_moves_a_stage_while_it_serves(tmp_path: Path) -> None:
    """`standalone` with three 16 GB inventory GPUs and its embedded balancer (compaction every 0.5 s). A filler
    that scales to zero when idle and a second filler light GPUs 0 and 1; an llm declaring gpu-stages 2 is split
    over them; a small function lights GPU 2. Once the first filler has scaled to zero, GPU 0 holds stage 0
    alone: compaction moves it to GPU 2 while a client keeps invoking the llm over the REST API. Not one
    activation fails, runs after the move go through a new stage-0 process on GPU 2, GPU 0 is left dark, and the
    move cost one cold start."""
    gpus = [{"uuid": f"GPU-m{g}", "memory_mb": GPU_MB} for g in range(3)]
    (tmp_path / "inventory.json").write_text(json.dumps(gpus))
    base = config.load(environ={})
    cfg = replace(base, data_dir=str(tmp_path / "data"), api=replace(base.api, port=0),
                  gpu=replace(base.gpu, inventory=str(tmp_path / "inventory.json")),
                  balancer=replace(base.balancer, tick_s=0.2, report_period_s=0.2, report_ttl_s=1.0,
                                   compaction_period_s=0.5, scale_to_zero_after_s=2.0, cooldown_s=0.2))
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()

    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token}"}) as http:
        assert running.balancer is not None
        redis = running.balancer.redis
        keys = Keys(cfg.redis.prefix)
        url = f"{running.api_url}/api/v1/namespaces/_/actions"

        async def create(name: str, code: str, ann: dict[str, object], **limits: int) -> None:
            body = {"exec": {"kind": "python:3-gpu", "code": code}, "limits": limits,
                    "annotations": [{"key": k, "value": v} for k, v in ann.items()]}
            async with http.put(f"{url}/{name}", json=body) as r:
                assert r.status == 200, await r.text()
            async with http.post(f"{url}/{name}?blocking=true", json={"n": 0}) as r:  # registers the function
                assert r.status == 200, await r.text()

        async def records(function: str, n: int, timeout_s: float = 30.0) -> list[InstanceRecord]:
            deadline = time.monotonic() + timeout_s
            while True:
                got = [r for r in (decode(InstanceRecord, raw) for raw in (await redis.hgetall(keys.instances)).values())
                       if r is not None and r.function == function]
                if len(got) == n and all(r.state == "ready" and not r.moving for r in got):
                    return got
                assert time.monotonic() < deadline, f"{function}: never {n} settled instances: {got}"
                await asyncio.sleep(0.05)

        filler = "def main(a):\n    return a\n"
        await create("fill0", filler, {"gpu-memory-mb": 10000, "gpu-sm-request": 0.3, "gpu-sm-limit": 0.5})
        [fill0] = await records("guest/fill0", 1)
        await create("fill1", filler, {"gpu-memory-mb": 10000, "gpu-sm-request": 0.3, "gpu-sm-limit": 0.5,
                                       "min-instances": 1})
        [fill1] = await records("guest/fill1", 1)
        assert {fill0.gpu, fill1.gpu} == {0, 1}
        await create("llm", MOVE_CODE, {"gpu-class": "llm", "gpu-stages": 2, "gpu-memory-mb": 9000,
                                        "gpu-sm-request": 0.4, "gpu-sm-limit": 0.6, "min-instances": 1,
                                        "max-instances": 1}, concurrency=4)
        [llm] = await records("guest/llm", 1)
        assert [s.gpu for s in llm.stages] == [fill0.gpu, fill1.gpu]
        await create("small", filler, {"gpu-memory-mb": 3500, "gpu-sm-request": 0.6, "gpu-sm-limit": 0.7,
                                       "min-instances": 1})
        [small] = await records("guest/small", 1)
        assert small.gpu == 2

        results: list[tuple[int, list[list[object]]]] = []
        failures: list[str] = []
        done = asyncio.Event()

        async def client() -> None:
            n = 0
            while not done.is_set():
                n += 1
                async with http.post(f"{url}/llm?blocking=true&result=true", json={"n": n}) as r:
                    body = await r.json()
                    if r.status != 200 or body.get("n") != n:
                        failures.append(f"{r.status}: {body}")
                    else:
                        results.append((n, body["seen"]))
                await asyncio.sleep(0.02)

        task = asyncio.create_task(client())
        try:
            await records("guest/fill0", 0)  # scaled to zero: stage 0 is alone on GPU 0
            deadline = time.monotonic() + 30.0
            while True:
                [now] = await records("guest/llm", 1)
                if now.stages[0].gpu == 2:
                    break
                assert time.monotonic() < deadline, f"stage 0 never moved: {now}"
                await asyncio.sleep(0.1)
            before = len(results)
            while len(results) < before + 5:
                await asyncio.sleep(0.05)
        finally:
            done.set()
            await task
        assert failures == []
        assert now.id == llm.id and now.stages[1] == llm.stages[1] and now.stages[0].id != llm.stages[0].id
        first, last = results[0][1], results[-1][1]
        assert first[0][1] == f"GPU-m{fill0.gpu}" and last[0][1] == "GPU-m2"  # stage 0's GPU, before and after
        assert first[0][2] != last[0][2] and first[1][2] == last[1][2]  # a new stage-0 process; stage 1 the same
        assert [n for n, _ in results] == sorted(n for n, _ in results)
        budgets = GpuBudgets(redis, cfg.redis.prefix)
        dark = await budgets.get(f"GPU-m{fill0.gpu}")
        assert dark is not None and dark.reservations == {}
        totals = running.balancer.metrics.totals
        assert (totals["started"], totals["done"], totals["abandoned"]) == (1, 1, 0)
