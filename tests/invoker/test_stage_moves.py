"""Stage moves of split instances (`CommandOp.MOVE_STAGE`) through the instance manager: a real invoker (process
backend, three inventory GPUs, so a stage has a free one to move to), real runtime processes, a real Redis
holding the GPU budgets; the test plays the balancer (it reserves the new stage's budget, then hands the manager
its commands)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from dilu_invoker.gpu.budgets import Reservation
from dilu_invoker.invoker.dataplane.container import ContainerProxy
from dilu_invoker.model import Action, ActionLimits, Activation, ActivationStatus, Exec, Parameter
from dilu_invoker.wire import (
    InstanceCommand,
    InstanceState,
    StageRecord,
    moved_stage_id,
    stage_id,
    stage_span,
)
from tests.invoker.test_split_instances import Node, _req, running_node, until

PREFIX = "moves:"
UUIDS = ("GPU-move-0", "GPU-move-1", "GPU-move-2")
# Each stage appends where it ran to ``seen``. ``hold`` {"k": path}: stage k waits until that file exists (a run
# held on a stage as long as the test likes). On the GPUs in FAIL_ON the action cannot load (its /init fails),
# on those in SLOW_ON its /init takes that many seconds.
CODE = '''
import os, time

GPU = os.environ.get("DILU_GPU_UUID", "")
if GPU in FAIL_ON:
    raise RuntimeError(f"the model cannot load on {GPU}")
time.sleep(SLOW_ON.get(GPU, 0))

def main(args):
    k = int(os.environ["DILU_STAGE_INDEX"])
    hold = args.get("hold", {}).get(str(k))
    while hold and not os.path.exists(hold):
        time.sleep(0.02)
    time.sleep(args.get("sleep", 0))
    seen = list(args.get("seen", [])) + [{"stage": k, "gpu": GPU, "pid": os.getpid(),
                                          "span": os.environ["DILU_STAGE_SPAN"]}]
    return {**args, "seen": seen}
'''


def _action(name: str, *, fail_on: tuple[str, ...] = (), slow_on: dict[str, float] | None = None) -> Action:
    code = f"FAIL_ON = {set(fail_on)!r}\nSLOW_ON = {slow_on or {}!r}\n{CODE}"
    return Action(namespace="guest", name=name, exec=Exec(kind="python:3-gpu", code=code),
                  limits=replace(ActionLimits(), timeout_ms=60_000), revision="1-move",
                  annotations=(Parameter("gpu-sm-request", 0.2), Parameter("gpu-sm-limit", 0.5),
                               Parameter("gpu-memory-mb", 9000), Parameter("gpu-weights-mb", 3000)))


def _stages(instance: str, gpus: tuple[int, ...] = (0, 1)) -> tuple[StageRecord, ...]:
    return tuple(StageRecord(id=stage_id(instance, k), gpu=g, gpu_uuid=UUIDS[g], request=0.2 + 0.1 * k, limit=0.6,
                             memory_mb=6000 - 3000 * k) for k, g in enumerate(gpus))


def _moved(stages: tuple[StageRecord, ...], k: int, gpu: int, n: int = 1, **changes: object) -> tuple[StageRecord, ...]:
    """The stage list with stage k moved to `gpu` under its n-th moved id."""
    instance = stages[k].id.split("#")[0]
    new = replace(stages[k], id=moved_stage_id(instance, k, n), gpu=gpu,
                  gpu_uuid=UUIDS[gpu] if 0 <= gpu < len(UUIDS) else None)
    new = replace(new, **changes)  # type: ignore[arg-type]
    return stages[:k] + (new,) + stages[k + 1:]


def _move(instance: str, stages: tuple[StageRecord, ...]) -> InstanceCommand:
    return InstanceCommand(op="move-stage", epoch=1, instance=instance, function="guest/llm", rev="1-move",
                           reason="compaction", stages=stages)


def _stop(instance: str) -> InstanceCommand:
    return InstanceCommand(op="stop", epoch=1, instance=instance, function="guest/llm", reason="scaled in")


def _alive(pid: int) -> bool:
    """The process exists and is no zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


class Mover(Node):
    """The node, playing the balancer's part of a stage move too."""

    changes: int = 0

    async def reserve(self, stage: StageRecord) -> None:
        """What the balancer does before it sends a move: reserve the new stage's budget (its own short TTL)."""
        assert stage.gpu_uuid is not None
        result = await self.budgets.reserve(stage.gpu_uuid, Reservation(
            instance=stage.id, function=self.action.fqn, cls="inference", invoker=self.manager.name,
            request=stage.request, limit=stage.limit, memory_mb=stage.memory_mb), ttl_s=30.0)
        assert result.ok, result

    async def held(self) -> dict[str, dict[str, int]]:
        """Each GPU's reservations: id → expiry (epoch ms)."""
        return {u: await self.reservations(u) for u in UUIDS}

    async def held_ids(self) -> dict[str, set[str]]:
        return {u: set(ids) for u, ids in (await self.held()).items()}

    def containers_of(self, part: str) -> list[ContainerProxy]:
        return [p for p in self.invoker.pool.containers.values() if p.placement.instance == part]

    async def run(self, iid: str, **content: object) -> Activation:
        activation = await self.manager.run(iid, _req(self.action, **content))
        assert activation is not None, f"{iid} took no work"
        return activation

    async def use(self, action: Action) -> None:
        await self.manager.registry.ensure(action)
        self.action = action


@pytest.fixture
async def node(tmp_path: Path, redis: aioredis.Redis) -> AsyncIterator[Mover]:
    async with running_node(tmp_path, redis, UUIDS, _action("llm"), Mover) as mover:

        def changed() -> None:
            mover.changes += 1

        mover.manager.on_change = changed
        yield mover


@pytest.fixture
def gate() -> Iterator[Callable[[], str]]:
    """``gate()``: a path a held run waits for (`CODE`'s ``hold``), in a directory the runtime's uid can read;
    create the file to let the run go on."""
    made: list[str] = []

    def new() -> str:
        directory = tempfile.mkdtemp(prefix="dilu-gate-", dir="/tmp")
        os.chmod(directory, 0o755)
        made.append(directory)
        return os.path.join(directory, "open")

    yield new
    for directory in made:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def _open(path: str) -> None:
    Path(path).write_text("")
    os.chmod(path, 0o644)


async def _started(node: Mover, iid: str) -> tuple[StageRecord, ...]:
    stages = _stages(iid)
    assert await node.start(iid, stages) == "start"
    assert node.state(iid) is InstanceState.READY, node.inst(iid).failure
    return stages


async def _moving(node: Mover, iid: str, stages: tuple[StageRecord, ...]) -> StageRecord:
    """Reserve the new stage and hand the manager the move; the new stage."""
    [new] = [s for s, c in zip(stages, node.inst(iid).cmd.stages, strict=True) if s != c]
    await node.reserve(new)
    assert node.manager.handle(_move(iid, stages)) == "move-stage"
    return new


def _gpus(activation: Activation) -> list[str]:
    assert activation.response.status is ActivationStatus.SUCCESS, activation.response.result
    return [s["gpu"] for s in activation.response.result["seen"]]


async def test_a_stage_moves_while_activations_keep_running_and_none_fails(node: Mover) -> None:
    stages = await _started(node, "llm-1")
    inst = node.inst("llm-1")
    old_pid = node.pid("llm-1#p1")
    first = await node.run("llm-1")
    assert _gpus(first) == ["GPU-move-0", "GPU-move-1"]
    old_worker = first.response.result["seen"][1]["pid"]
    changes = node.changes
    # three callers keep running activations from before the move to after it
    runs: list[tuple[float, Activation]] = []
    done_at: float | None = None

    async def caller() -> None:
        while done_at is None or sum(1 for t, _ in runs if t > done_at) < 9:
            arrived = time.monotonic()
            runs.append((arrived, await node.run("llm-1", sleep=0.05)))

    callers = [asyncio.create_task(caller()) for _ in range(3)]
    await until(lambda: len(runs) >= 6, "runs before the move")
    moving_at = time.monotonic()
    moved = _moved(stages, 1, 2)
    new = await _moving(node, "llm-1", moved)
    assert new.id == "llm-1#p1.1"
    assert inst.state is InstanceState.READY and inst.parts == ("llm-1#p0", "llm-1#p1")  # it serves on the old
    await until(lambda: inst.moved == new.id, "the move done", timeout_s=60)
    done_at = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*callers), 60)

    failed = [a.response for _, a in runs if a.response.status is not ActivationStatus.SUCCESS]
    assert not failed, failed[:3]
    before = [a for t, a in runs if t < moving_at]
    after = [a for t, a in runs if t > done_at]
    assert len(before) >= 6 and all(_gpus(a) == ["GPU-move-0", "GPU-move-1"] for a in before)
    assert len(after) >= 9 and all(_gpus(a) == ["GPU-move-0", "GPU-move-2"] for a in after)
    # the new stage is its own process, in the old stage's place of the pipeline (the same span)
    seen = after[-1].response.result["seen"]
    assert seen[1]["pid"] != old_worker and seen[1]["span"] == first.response.result["seen"][1]["span"]
    assert seen[1]["span"] == "{!r}:{!r}".format(*stage_span(moved, 1))
    assert inst.parts == ("llm-1#p0", "llm-1#p1.1") and inst.cmd.stages == moved and inst.move is None
    # the old stage is gone: its container, its process, its reservation
    assert not node.containers_of("llm-1#p1")
    await until(lambda: not _alive(old_pid) and not _alive(old_worker), "the old stage's processes gone")
    assert await node.held_ids() == {UUIDS[0]: {"llm-1#p0"}, UUIDS[1]: set(), UUIDS[2]: {"llm-1#p1.1"}}
    [report] = node.manager.reports()
    assert (report.state, report.moved, report.move_failed, report.gpu) == ("ready", "llm-1#p1.1", "", 0)
    assert node.changes == changes + 1  # the report went out once the move was done
    assert node.manager.handle(_move("llm-1", moved)) == "duplicate"  # sent again: done already, nothing reported
    assert (inst.moved, inst.move_failed, inst.move) == (new.id, "", None)
    # the moved stage is a stage like any other: its death fails the instance
    os.kill(node.pid("llm-1#p1.1"), signal.SIGKILL)
    await until(lambda: node.state("llm-1") is InstanceState.FAILED, "llm-1 failed")
    assert "stage 1 of 2" in (inst.failure.reason if inst.failure else "")


async def test_both_stages_are_held_and_renewed_until_the_old_one_drained(
        node: Mover, gate: Callable[[], str]) -> None:
    await node.use(_action("llm-slow", slow_on={UUIDS[2]: 3.0}))
    stages = await _started(node, "llm-2")
    inst = node.inst("llm-2")
    hold = gate()
    busy = asyncio.create_task(node.run("llm-2", hold={"0": hold}))  # held on stage 0, which moves
    await until(lambda: inst.in_flight == 1, "a run in flight")
    moved = _moved(stages, 0, 2)
    new = await _moving(node, "llm-2", moved)
    # while the new stage starts: old and new held, each renewed for the manager's TTL (the balancer's and the
    # node's own, when it attaches the new stage, are 30 s)
    assert inst.move is not None and inst.parts == ("llm-2#p0", "llm-2#p1")

    def attached() -> bool:
        return any(p.placement.gpu is not None for p in node.containers_of(new.id))

    await until(attached, "the new stage on its GPU", timeout_s=30)
    await node.manager.renew_reservations()
    held = await node.held()
    assert {u: set(ids) for u, ids in held.items()} == {
        UUIDS[0]: {"llm-2#p0"}, UUIDS[1]: {"llm-2#p1"}, UUIDS[2]: {new.id}}
    now_ms = int(time.time() * 1000)
    assert all(expires > now_ms + 200_000 for ids in held.values() for expires in ids.values()), held
    # switched: new runs go through the new stage, while the held one keeps the old stage busy
    await until(lambda: inst.parts[0] == new.id, "the switch", timeout_s=60)
    assert not busy.done() and inst.moved == "" and inst.move is not None
    assert _gpus(await node.run("llm-2")) == ["GPU-move-2", "GPU-move-1"]
    before = await node.held()
    await asyncio.sleep(0.05)
    await node.manager.renew_reservations()
    during = await node.held()
    assert set(during[UUIDS[0]]) == {"llm-2#p0"} and set(during[UUIDS[2]]) == {new.id}
    assert during[UUIDS[0]]["llm-2#p0"] > before[UUIDS[0]]["llm-2#p0"]  # the draining stage is renewed
    assert during[UUIDS[2]][new.id] > before[UUIDS[2]][new.id]
    [report] = node.manager.reports()
    assert (report.moved, report.gpu) == ("", 2)  # not done yet; stage 0 is now on GPU 2
    _open(hold)
    finished = await asyncio.wait_for(busy, 60)
    assert _gpus(finished) == ["GPU-move-0", "GPU-move-1"]  # it ended on the stages it started with
    await until(lambda: inst.moved == new.id, "the move done", timeout_s=30)
    assert await node.held_ids() == {UUIDS[0]: set(), UUIDS[1]: {"llm-2#p1"}, UUIDS[2]: {new.id}}
    assert not node.containers_of("llm-2#p0") and inst.cmd.gpu == 2 and inst.cmd.gpu_uuid == UUIDS[2]


async def test_the_old_stage_killed_while_it_drains_fails_no_instance(node: Mover, gate: Callable[[], str]) -> None:
    stages = await _started(node, "llm-3")
    inst = node.inst("llm-3")
    old_pid = node.pid("llm-3#p1")
    busy = asyncio.create_task(node.run("llm-3", hold={"1": gate()}))  # never let go: held on stage 1
    await until(lambda: inst.in_flight == 1, "a run in flight")
    new = await _moving(node, "llm-3", _moved(stages, 1, 2))
    await until(lambda: inst.parts[1] == new.id, "the switch", timeout_s=60)
    assert inst.moved == "" and not busy.done()
    os.kill(old_pid, signal.SIGKILL)
    cut: Activation = await asyncio.wait_for(busy, 30)
    assert cut.response.status is not ActivationStatus.SUCCESS  # the run on the killed process is lost with it
    await until(lambda: inst.moved == new.id, "the move done", timeout_s=30)
    assert inst.state is InstanceState.READY and inst.failure is None
    assert _gpus(await node.run("llm-3")) == ["GPU-move-0", "GPU-move-2"]
    assert await node.held_ids() == {UUIDS[0]: {"llm-3#p0"}, UUIDS[1]: set(), UUIDS[2]: {new.id}}
    [report] = node.manager.reports()
    assert (report.state, report.moved, report.error) == ("ready", new.id, "")


async def test_a_new_stage_that_fails_to_start_fails_the_move_only(node: Mover) -> None:
    await node.use(_action("llm-picky", fail_on=(UUIDS[2],)))
    stages = await _started(node, "llm-4")
    inst = node.inst("llm-4")
    changes = node.changes
    new = await _moving(node, "llm-4", _moved(stages, 0, 2, n=7))
    assert new.id == "llm-4#p0.7"
    await until(lambda: inst.move_failed != "", "the move failed", timeout_s=60)
    assert inst.move_failed.startswith("llm-4#p0.7: start failed: "), inst.move_failed
    assert "Cannot start action" in inst.move_failed  # its /init failed (the runtime's answer; the why is in its logs)
    # the instance serves on its old stages; the new one left nothing behind
    assert inst.state is InstanceState.READY and inst.failure is None and inst.move is None
    assert inst.cmd.stages == stages and inst.moved == ""
    assert not node.containers_of(new.id)
    assert await node.held_ids() == {UUIDS[0]: {"llm-4#p0"}, UUIDS[1]: {"llm-4#p1"}, UUIDS[2]: set()}
    assert _gpus(await node.run("llm-4")) == ["GPU-move-0", "GPU-move-1"]
    [report] = node.manager.reports()
    assert (report.state, report.moved, report.move_failed) == ("ready", "", inst.move_failed)
    assert node.changes == changes + 1
    # a later move is taken again (and fails again: the action cannot load on GPU 2)
    again = await _moving(node, "llm-4", _moved(stages, 0, 2, n=8))
    await until(lambda: inst.move_failed.startswith(f"{again.id}: "), "the second move failed", timeout_s=60)
    assert inst.state is InstanceState.READY and await node.reservations(UUIDS[2]) == {}


async def test_a_new_stage_killed_before_the_switch_fails_the_move_only(node: Mover) -> None:
    await node.use(_action("llm-slow", slow_on={UUIDS[2]: 60.0}))
    stages = await _started(node, "llm-5")
    inst = node.inst("llm-5")
    new = await _moving(node, "llm-5", _moved(stages, 1, 2))

    def starting() -> bool:
        return any(p.container is not None for p in node.containers_of(new.id))

    await until(starting, "the new stage's process", timeout_s=30)
    [proxy] = node.containers_of(new.id)
    assert proxy.container is not None
    os.kill(int(proxy.container.pid), signal.SIGKILL)  # type: ignore[attr-defined]
    await until(lambda: inst.move_failed != "", "the move failed", timeout_s=30)
    assert inst.move_failed.startswith(f"{new.id}: start failed: "), inst.move_failed
    assert inst.state is InstanceState.READY and inst.failure is None and inst.parts == ("llm-5#p0", "llm-5#p1")
    assert not node.containers_of(new.id)
    assert await node.held_ids() == {UUIDS[0]: {"llm-5#p0"}, UUIDS[1]: {"llm-5#p1"}, UUIDS[2]: set()}
    assert _gpus(await node.run("llm-5")) == ["GPU-move-0", "GPU-move-1"]


async def test_bad_moves_are_refused_and_touch_nothing(node: Mover) -> None:
    stages = await _started(node, "llm-6")
    inst = node.inst("llm-6")
    assert await _started(node, "llm-7") == _stages("llm-7")  # another split instance on the same GPUs
    p1 = stages[1]
    cases: list[tuple[str, tuple[StageRecord, ...], str | None, str, bool]] = [
        # (what, new list, the new stage's id in the report (None: not reported, it names a stage of the
        # instance), the reason, reserved by the balancer and released)
        ("two stages", _moved(_moved(stages, 0, 2), 1, 2, n=2), "llm-6#p0.1,llm-6#p1.2",
         "invalid stage move: exactly one stage must change, got stages [0, 1]", False),
        ("one stage less", stages[:1], "", "invalid stage move: 1 stages, the instance has 2", False),
        ("onto another stage's GPU", _moved(stages, 1, 0), "llm-6#p1.1",
         "invalid stage move: stage 1 is moved to GPU 0, which holds stage 0", True),
        ("onto its own GPU", _moved(stages, 1, 1), "llm-6#p1.1",
         "invalid stage move: stage 1 is moved to GPU 1, which holds stage 1", True),
        ("a GPU the invoker lacks", _moved(stages, 1, 5), "llm-6#p1.1",
         "invalid stage move: stage 1 is placed on GPU 5, which this invoker does not have (its GPUs: [0, 1, 2])",
         False),
        ("another GPU's uuid", _moved(stages, 1, 2, gpu_uuid=UUIDS[1]), "llm-6#p1.1",
         f"invalid stage move: stage 1 is placed on {UUIDS[1]}, but GPU 2 of this invoker is {UUIDS[2]}", True),
        ("a bad share", _moved(stages, 1, 2, request=0.8, limit=0.5), "llm-6#p1.1",
         "invalid stage move: stage 1 asks for request 0.8, limit 0.5, memory 3000 MB", False),
        ("a stale id", stages[:1] + (replace(p1, gpu=2, gpu_uuid=UUIDS[2]),), None,
         "invalid stage move: stage id 'llm-6#p1' is not a new stage id of llm-6", False),
        ("another instance's id", stages[:1] + (replace(p1, id="llm-7#p1.1", gpu=2, gpu_uuid=UUIDS[2]),),
         "llm-7#p1.1", "invalid stage move: stage id 'llm-7#p1.1' is not a new stage id of llm-6", False),
        ("another instance's stage", stages[:1] + (replace(p1, id="llm-7#p1", gpu=2, gpu_uuid=UUIDS[2]),),
         "llm-7#p1", "invalid stage move: stage id 'llm-7#p1' is not a new stage id of llm-6", False),
    ]
    for what, new_stages, named, reason, released in cases:
        changes, before = node.changes, inst.move_failed
        [new] = [s for s in new_stages if s.id == named] if released else [None]
        if new is not None:  # as the balancer does before it sends a move
            await node.reserve(new)
        assert node.manager.handle(_move("llm-6", new_stages)) == "refused", what
        if named is None:
            assert (inst.move_failed, node.changes) == (before, changes), what
        else:
            assert inst.move_failed.startswith(f"{named}: {reason}"), (what, inst.move_failed)
            assert node.changes == changes + 1, what
        assert inst.move is None and inst.cmd.stages == stages and inst.state is InstanceState.READY, what
        assert not [p for p in node.invoker.pool.containers.values()
                    if p.placement.instance not in {*inst.parts, "llm-7#p0", "llm-7#p1"}], what
        if new is not None:
            await until(partial(_not_held, node, new), f"{what}: the balancer's reservation released")
        # nothing of this instance's nor the other's was touched
        assert await node.held_ids() == {UUIDS[0]: {"llm-6#p0", "llm-7#p0"}, UUIDS[1]: {"llm-6#p1", "llm-7#p1"},
                                         UUIDS[2]: set()}, what
    assert node.state("llm-7") is InstanceState.READY and node.inst("llm-7").move_failed == ""
    assert _gpus(await node.run("llm-6")) == ["GPU-move-0", "GPU-move-1"]
    assert _gpus(await node.run("llm-7")) == ["GPU-move-0", "GPU-move-1"]
    reports = {r.id: r for r in node.manager.reports()}
    assert reports["llm-6"].move_failed == inst.move_failed and reports["llm-7"].move_failed == ""


async def _not_held(node: Mover, stage: StageRecord) -> bool:
    return stage.id not in await node.reservations(stage.gpu_uuid or "")


async def test_a_move_is_refused_unless_the_instance_is_ready_and_not_moving(node: Mover) -> None:
    # unknown: nothing to report it on
    assert node.manager.handle(_move("nobody", _moved(_stages("nobody"), 1, 2))) == "unknown"
    assert not node.manager.instances
    # starting
    await node.use(_action("llm-slow", slow_on={UUIDS[2]: 60.0}))
    stages = _stages("llm-8")
    early = _moved(stages, 1, 2)
    await node.reserve(early[1])
    assert node.manager.handle(InstanceCommand(
        op="start", epoch=1, instance="llm-8", function=node.action.fqn, rev="1-move", gpu=0, gpu_uuid=UUIDS[0],
        request=0.5, limit=1.2, memory_mb=9000, stages=stages)) == "start"
    assert node.manager.handle(_move("llm-8", early)) == "refused"
    inst = node.inst("llm-8")
    assert inst.move_failed == "llm-8#p1.1: stage move refused: the instance is starting, not ready"
    await until(partial(_not_held, node, early[1]), "the refused stage's reservation released")
    await until(lambda: inst.state is InstanceState.READY, "llm-8 ready")
    # a second move while one is in flight (its new stage takes a minute to start)
    first = await _moving(node, "llm-8", _moved(stages, 1, 2, n=2))
    second = _moved(stages, 0, 2, n=3)
    await node.reserve(second[0])
    assert node.manager.handle(_move("llm-8", second)) == "refused"
    assert inst.move_failed == ("llm-8#p0.3: stage move refused: a stage move of the instance is in flight "
                                "(to llm-8#p1.2)")
    await until(partial(_not_held, node, second[0]), "the second move's reservation released")
    assert inst.move is not None and inst.move.new == first and first.id in await node.reservations(UUIDS[2])
    # the move in flight sent again (a command read twice) is no failure of it: nothing is done, nothing reported
    refused = inst.move_failed
    assert node.manager.handle(_move("llm-8", _moved(stages, 1, 2, n=2))) == "duplicate"
    assert inst.move_failed == refused and inst.move is not None and inst.move.new == first
    # the same new stage with another share is refused, but not reported: that would say the move in flight
    # failed; its reservation (the one in flight's) is left alone
    assert node.manager.handle(_move("llm-8", _moved(stages, 1, 2, n=2, memory_mb=2000))) == "refused"
    assert inst.move_failed == refused
    assert first.id in await node.reservations(UUIDS[2]) and inst.move is not None and inst.move.new == first
    # draining (a stop ordered): a new move is refused, the one in flight goes with the instance
    assert node.manager.handle(_stop("llm-8")) == "stop"
    assert node.manager.handle(_move("llm-8", _moved(stages, 0, 2, n=4))) == "refused"
    assert inst.move_failed == "llm-8#p0.4: stage move refused: the instance is draining, not ready"
    await until(lambda: "llm-8" not in node.manager.instances, "llm-8 stopped", timeout_s=30)
    await until(lambda: not node.invoker.pool.containers, "every container gone", timeout_s=30)
    await until(lambda: inst.move_failed == f"{first.id}: the instance was stopped", "the move over", timeout_s=30)

    async def released() -> bool:
        return await node.held_ids() == {u: set() for u in UUIDS}

    await until(released, "every reservation released", timeout_s=30)


@pytest.mark.parametrize("when", ["starting", "draining"])
async def test_a_stop_during_a_move_stops_and_releases_everything(
        node: Mover, gate: Callable[[], str], when: str) -> None:
    await node.use(_action("llm-slow", slow_on={UUIDS[2]: 60.0 if when == "starting" else 0.0}))
    stages = await _started(node, "llm-9")
    inst = node.inst("llm-9")
    hold = gate()
    busy = asyncio.create_task(node.run("llm-9", hold={"1": hold}))
    await until(lambda: inst.in_flight == 1, "a run in flight")
    new = await _moving(node, "llm-9", _moved(stages, 1, 2))
    if when == "starting":
        await until(lambda: bool(node.containers_of(new.id)), "the new stage starting", timeout_s=30)
    else:
        await until(lambda: inst.parts[1] == new.id, "the switch", timeout_s=60)
    assert await node.held_ids() == {UUIDS[0]: {"llm-9#p0"}, UUIDS[1]: {"llm-9#p1"}, UUIDS[2]: {new.id}}
    assert node.manager.handle(_stop("llm-9")) == "stop"
    assert node.state("llm-9") is InstanceState.DRAINING
    _open(hold)  # the stop drains the run in flight first
    finished = await asyncio.wait_for(busy, 60)
    assert _gpus(finished) == ["GPU-move-0", "GPU-move-1"]
    await until(lambda: "llm-9" not in node.manager.instances, "llm-9 stopped", timeout_s=60)
    await until(lambda: not node.invoker.pool.containers, "every container gone (old, new)", timeout_s=30)

    async def released() -> bool:
        return await node.held_ids() == {u: set() for u in UUIDS}

    await until(released, "every reservation released (old, new)", timeout_s=30)
    assert inst.moved == ""
    if when == "starting":  # the move is over once its new stage is gone, after the instance
        await until(lambda: inst.move_failed == f"{new.id}: the instance was stopped", "the move over", timeout_s=30)
    else:  # switched: the new stage was the instance's, stopped with it
        assert inst.move_failed == ""


async def test_a_failure_of_the_instance_during_a_move_takes_the_new_stage_too(node: Mover) -> None:
    await node.use(_action("llm-slow", slow_on={UUIDS[2]: 60.0}))
    stages = await _started(node, "llm-10")
    inst = node.inst("llm-10")
    new = await _moving(node, "llm-10", _moved(stages, 0, 2))
    await until(lambda: bool(node.containers_of(new.id)), "the new stage starting", timeout_s=30)
    os.kill(node.pid("llm-10#p1"), signal.SIGKILL)  # a stage the move does not touch dies
    await until(lambda: inst.state is InstanceState.FAILED, "llm-10 failed", timeout_s=30)
    await until(lambda: not node.invoker.pool.containers, "every container gone (new one included)", timeout_s=30)

    async def released() -> bool:
        return await node.held_ids() == {u: set() for u in UUIDS}

    await until(released, "every reservation released (new one included)", timeout_s=30)
    await until(lambda: inst.move is None, "the move over", timeout_s=30)
    assert inst.move_failed == f"{new.id}: the instance failed"
    [report] = node.manager.reports()
    assert report.state == "failed" and "stage 1 of 2" in report.error and report.move_failed == inst.move_failed
    # a failed instance moves no stage
    again = _moved(stages, 0, 2, n=2)
    assert node.manager.handle(_move("llm-10", again)) == "refused"
    assert inst.move_failed == f"{again[0].id}: stage move refused: the instance is failed, not ready"
