"""Stage moves in the live balancer: compaction empties a GPU that holds only one pipeline stage of a split instance
by moving that stage to another lit GPU of its invoker while the pipeline serves. The balancer reserves the new
stage under a new id beside the old one, names it in the record (the old one in `moving`) and sends the invoker a
``move-stage`` command; the invoker's report that the move is done (or failed) settles the record. Real Redis; the
invoker's reports and releases are written as an invoker writes them (tests/invoker/test_stage_moves.py runs the
invoker's side)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis

from bench.stage_move import render, stage_move_trial
from dilu_invoker.gpu.budgets import GpuBudgets, Reservation
from dilu_invoker.loadbalancer import planner
from dilu_invoker.loadbalancer.planner import CompactionLoop
from dilu_invoker.loadbalancer.service import Balancer, compaction_held
from dilu_invoker.wire import (
    CommandOp,
    Decision,
    InstanceCommand,
    InstanceRecord,
    InstanceReport,
    LoadReport,
    decode,
    from_stream,
    stage_parent,
)
from tests.loadbalancer.test_split_instances import (
    FN,
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
    # Each run's CPU is a metric: as many as there were runs (the set-up's ticks ran one too).
    runs = b.metrics.registry.get_sample_value("dilu_balancer_compaction_runs_total")
    assert runs is not None and runs >= 1
    assert b.metrics.registry.get_sample_value("dilu_balancer_compaction_run_cpu_seconds_count") == runs
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


async def test_a_failed_stage_move_leaves_the_old_stage_serving(redis: aioredis.Redis,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """... and compaction leaves the instance where it is for `FAILED_MOVE_COOLDOWN_RUNS` periods (2 here), and
    keeps the function's processes off the GPU the new stage failed on for `FAILED_TARGET_HOLD_S` (4 periods here):
    after its cool-down the move is held (`move-held`), after the GPU's hold it is tried again."""
    monkeypatch.setattr(planner, "FAILED_MOVE_COOLDOWN_RUNS", 2)
    monkeypatch.setattr(planner, "FAILED_TARGET_HOLD_S", 4 * PERIOD_S)
    b, lead, cmd = await _stage_on_its_own(redis, lease_ttl_s=30.0)  # it ticks for longer than the tests' lease
    assert await b.tick(lead)  # type: ignore[arg-type]
    [move] = await _starts(redis, op=CommandOp.MOVE_STAGE.value)
    new0 = move.stages[0]
    await GpuBudgets(redis, PREFIX).release(_uuid("invoker0", 2), new0.id)  # as the invoker does
    await _invoker(redis, "invoker0", instances=(_ready(cmd, move_failed=f"{new0.id}: stage 0 of 2: start failed"),))
    failed_at = time.monotonic()
    assert await b.tick(lead)  # type: ignore[arg-type]
    rec = await _record(redis, cmd.instance)
    assert rec.stages == cmd.stages and rec.moving == () and rec.state == "ready"
    [failed] = [d for d in await _decisions(redis) if d.kind == "stage-move-failed"]
    assert "start failed" in failed.reason and failed.instance == new0.id
    assert b.metrics.totals["abandoned"] == 1
    assert await _starts(redis, op="stop") == []
    # The cool-down and the GPU held against the function are in Redis: a new leader carries them on.
    assert b._compaction.cooling[0][0] == cmd.instance
    assert b._compaction.failed_targets[0][:3] == (FN, "invoker0", 2)
    heir = Balancer(redis, b.cfg, holder="heir")
    await heir._take_over(lead)  # type: ignore[arg-type]
    assert (heir._compaction.cooling, heir._compaction.failed_targets) == (
        b._compaction.cooling, b._compaction.failed_targets)
    # The next run is due but the instance cools down: no second try yet.
    await asyncio.sleep(PERIOD_S)
    assert await b.tick(lead)  # type: ignore[arg-type]
    assert len(await _starts(redis, op=CommandOp.MOVE_STAGE.value)) == 1
    # Two periods after the failure it has cooled down, but GPU 2 is still held against the function.
    await asyncio.sleep(PERIOD_S + 0.1)
    assert await b.tick(lead)  # type: ignore[arg-type]
    assert len(await _starts(redis, op=CommandOp.MOVE_STAGE.value)) == 1
    [held] = [d for d in await _decisions(redis) if d.kind == "move-held"]
    assert held.instance == cmd.instance and "onto invoker0/gpu2 failed lately" in held.reason
    # Once the GPU's hold is over (and the instance's new cool-down), it moves again (a new stage id), not before.
    while len(await _starts(redis, op=CommandOp.MOVE_STAGE.value)) == 1:
        assert time.monotonic() - failed_at < 8 * PERIOD_S
        await asyncio.sleep(PERIOD_S / 4)
        assert await b.tick(lead)  # type: ignore[arg-type]
    assert time.monotonic() - failed_at >= 4 * PERIOD_S
    first, again = await _starts(redis, op=CommandOp.MOVE_STAGE.value)
    assert again.stages[0].id not in (first.stages[0].id, cmd.stages[0].id) and again.stages[0].gpu == 2


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
    assert b.metrics.totals["started"] == 0  # not a move begun


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



@pytest.mark.parametrize(("user_memory_mb", "moves"), [(512, 0), (768, 1)])
async def test_a_stage_move_needs_one_more_container_of_user_memory(redis: aioredis.Redis, user_memory_mb: int,
                                                                    moves: int) -> None:
    """The new stage is one more container (the action's 256 MB) on the instance's invoker until the old one is
    drained: with exactly the two stages' 512 MB of user memory the move is held back (`move-held`) and the
    instance cools down; with one container more it is made, and while it is in flight the invoker's user memory
    counts three containers."""
    b, lead, cmd = await _stage_on_its_own(redis)
    assert (await _record(redis, cmd.instance)).user_memory_mb == 512
    await _invoker(redis, "invoker0", instances=(_ready(cmd),), user_memory_mb=user_memory_mb)
    assert await b.tick(lead)  # type: ignore[arg-type]
    assert len(await _starts(redis, op=CommandOp.MOVE_STAGE.value)) == moves
    held = [d for d in await _decisions(redis) if d.kind == "move-held"]
    rec = await _record(redis, cmd.instance)
    if moves:
        assert held == [] and len(rec.moving) == 1
        report = LoadReport(invoker="invoker0", boot="boot", at_ms=0, user_memory_mb=user_memory_mb)
        memory = planner.UserMemory({"invoker0": report}, {rec.id: rec})
        assert memory.held["invoker0"] == 768 and not memory.holds("invoker0", 1)
    else:
        assert [d.instance for d in held] == [cmd.instance]
        assert "needs 256 MB on invoker0, which has 0 of 512 MB free" in held[0].reason
        assert rec.stages == cmd.stages and rec.moving == ()
        assert (b.metrics.totals["started"], b.metrics.totals["held"]) == (0, 1)
        # Cooling down: the next runs leave it where it is, and say nothing more.
        await asyncio.sleep(PERIOD_S)
        assert await b.tick(lead)  # type: ignore[arg-type]
        assert await _starts(redis, op=CommandOp.MOVE_STAGE.value) == []
        assert len([d for d in await _decisions(redis) if d.kind == "move-held"]) == 1

# -- through the product: `standalone`, actions created over the REST API ------------------------------------


async def test_standalone_moves_a_stage_while_it_serves(tmp_path: Path) -> None:
    """`bench/stage_move.py`'s scenario, one trial: `standalone` with three inventory GPUs and its embedded balancer
    moves stage 0 of an llm declaring gpu-stages 2 to another GPU while two clients keep invoking it over the REST
    API. Not one activation fails, runs after the move go through a new stage-0 process on the new GPU while stage
    1's process is the same, the GPU it left is dark, and the move cost one cold start."""
    trial = await stage_move_trial(tmp_path, clients=2, after=5)
    assert trial.failures == []
    before, after = trial.before, trial.after
    assert after.id == before.id and after.stages[1] == before.stages[1]
    assert after.stages[0].id != before.stages[0].id and after.stages[0].gpu == 2 != before.stages[0].gpu
    assert after.moving == ()
    first = min(trial.results, key=lambda r: r[2])[4]
    last = max(trial.results, key=lambda r: r[2])[4]
    assert first[0][1] == f"GPU-m{before.stages[0].gpu}" and last[0][1] == "GPU-m2"  # stage 0's GPU
    assert first[0][2] != last[0][2] and first[1][2] == last[1][2]  # a new stage-0 process; stage 1 the same
    for c in (0, 1):  # each client's requests, in order, none lost
        assert [n for k, n, *_ in sorted(trial.results, key=lambda r: r[2]) if k == c] == list(
            range(1, 1 + sum(1 for r in trial.results if r[0] == c)))
    assert trial.left_behind == {}
    assert (trial.totals["started"], trial.totals["done"], trial.totals["abandoned"]) == (1, 1, 0)
    s = trial.summary()
    assert 0 < trial.ordered_at < trial.done_at and s["move_s"] > 0 and s["requests_during"] > 0
    md = render({"machine": "m", "date": "d", "command": "c", "clients": 2, "trials": [s]})
    assert f"| 1 | {s['requests']} | 0 | {s['move_s']} |" in md and "failed requests 0 in all" in md


def test_what_compaction_held_back_is_read_back_without_what_is_over_or_unreadable() -> None:
    raw = msgpack.packb({"cooling": [["a", 50.0], ["b", 150.0]],
                         "failed_targets": [["guest/f", "invoker0", 1, 120.0], ["guest/g", "invoker1", 0, 90.0]]})
    loop = compaction_held(raw, 100.0)
    assert loop.cooling == (("b", 150.0),)
    assert loop.failed_targets == (("guest/f", "invoker0", 1, 120.0),)
    assert loop.next_at == 0.0 and loop.state is None
    for bad in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"cooling": [["a"]]}), "text"):
        assert compaction_held(bad, 100.0) == CompactionLoop()
