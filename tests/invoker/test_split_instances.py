"""Split instances (an LLM served as pipeline stages over several GPUs of one invoker) through the instance
manager: a real invoker (process backend, two inventory GPUs), real runtime processes, a real Redis holding the
GPU budgets; the test plays the balancer (it hands the manager its START and STOP commands)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import pytest
import redis.asyncio as aioredis

from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.invoker.cluster.agent import Agent
from dilu_invoker.invoker.cluster.instances import InstanceManager, LocalInstance, _share_of
from dilu_invoker.invoker.dataplane.core import (
    DEFAULT_MAX_RESULT_BYTES,
    STAGE_MAX_RESULT_BYTES,
    Invoker,
    open_invoker,
)
from dilu_invoker.model import (
    GUEST_IDENTITY,
    Action,
    ActionLimits,
    Activation,
    ActivationRequest,
    ActivationStatus,
    Exec,
    Parameter,
    new_activation_id,
)
from dilu_invoker.wire import InstanceCommand, InstanceState, StageRecord, stage_id, stage_span
from tests.invoker.test_model_preload import _until

PREFIX = "split:"
UUIDS = ("GPU-split-0", "GPU-split-1")
# Each stage appends what it saw to ``seen``; ``fail_at`` makes that stage raise, ``pad`` makes every stage but
# the last return that many bytes more (an intermediate result), ``sleep`` keeps a run busy.
CODE = '''
import os, time

if os.environ.get("DILU_STAGE_INDEX") == "1":
    time.sleep(0.3)  # the last stage is ready a moment after the first

def main(args):
    k, n = int(os.environ["DILU_STAGE_INDEX"]), int(os.environ["DILU_STAGE_COUNT"])
    print(f"at stage {k}", flush=True)
    time.sleep(args.get("sleep", 0))
    if args.get("fail_at") == k:
        raise RuntimeError(f"no luck at {k}")
    seen = list(args.get("seen", [])) + [{"stage": k, "count": n, "span": os.environ["DILU_STAGE_SPAN"],
                                          "pid": os.getpid(), "got_pad": len(args.get("pad", "")),
                                          "aid": os.environ["__OW_ACTIVATION_ID"],
                                          "deadline": os.environ["__OW_DEADLINE"]}]
    out = {**args, "seen": seen}
    out["pad"] = "x" * args["pad_bytes"] if args.get("pad_bytes") and k < n - 1 else ""
    return out
'''


def _action(name: str = "llm", **limits: int) -> Action:
    return Action(namespace="guest", name=name, exec=Exec(kind="python:3-gpu", code=CODE),
                  limits=replace(ActionLimits(), **limits), revision="1-split",
                  annotations=(Parameter("gpu-sm-request", 0.2), Parameter("gpu-sm-limit", 0.5),
                               Parameter("gpu-memory-mb", 9000), Parameter("gpu-weights-mb", 3000)))


def _stages(instance: str, gpus: tuple[int, ...] = (0, 1), memory: tuple[int, ...] = (6000, 3000),
            uuids: tuple[str | None, ...] | None = None) -> tuple[StageRecord, ...]:
    uuids = uuids or tuple(UUIDS[g] if 0 <= g < len(UUIDS) else None for g in gpus)
    return tuple(StageRecord(id=stage_id(instance, k), gpu=g, gpu_uuid=u, request=0.2 + 0.1 * k, limit=0.6,
                             memory_mb=m) for k, (g, u, m) in enumerate(zip(gpus, uuids, memory, strict=True)))


def _start(instance: str, stages: tuple[StageRecord, ...], action: Action) -> InstanceCommand:
    return InstanceCommand(op="start", epoch=1, instance=instance, function=action.fqn, rev=action.revision or "",
                           gpu=stages[0].gpu, gpu_uuid=stages[0].gpu_uuid, request=0.5, limit=1.2,
                           memory_mb=sum(s.memory_mb for s in stages), stages=stages)


def _req(action: Action, **content: object) -> ActivationRequest:
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                             content=dict(content))


async def until(predicate: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    """`test_model_preload._until`, the predicate first as these tests (and the stage-move tests) name it."""
    await _until(what, predicate, timeout_s)


@dataclass
class Node:
    invoker: Invoker
    manager: InstanceManager
    budgets: GpuBudgets
    action: Action

    def inst(self, iid: str) -> LocalInstance:
        return self.manager.instances[iid]

    def state(self, iid: str) -> InstanceState | None:
        inst = self.manager.instances.get(iid)
        return inst.state if inst is not None else None

    def pid(self, part: str) -> int:
        """The pid of the runtime process a stage runs in."""
        proxy = self.inst(part.split("#")[0]).proxies[part]
        assert proxy.container is not None
        return int(proxy.container.pid)  # type: ignore[attr-defined]

    def stage_containers(self, iid: str) -> list[str]:
        """The states of the containers started for its stages (before the instance knows them)."""
        return [p.state.value for p in self.invoker.pool.containers.values()
                if (p.placement.instance or "").startswith(f"{iid}#")]

    async def start(self, iid: str, stages: tuple[StageRecord, ...]) -> str:
        done = self.manager.handle(_start(iid, stages, self.action))
        await until(lambda: self.state(iid) in (InstanceState.READY, InstanceState.FAILED), f"{iid} started")
        return done

    async def reservations(self, uuid: str) -> dict[str, int]:
        budget = await self.budgets.get(uuid)
        return {r.instance: r.expires_ms for r in budget.reservations.values()} if budget is not None else {}


N = TypeVar("N", bound=Node)


@contextlib.asynccontextmanager
async def running_node(tmp_path: Path, redis: aioredis.Redis, uuids: Sequence[str], action: Action,
                       kind: type[N], *, direct_lane: bool = True) -> AsyncIterator[N]:
    """An invoker with the inventory GPUs `uuids` (16 GB each) and its instance manager, `action` registered;
    `direct_lane` False: its process containers take no direct lane (runs go over HTTP, as in Docker)."""
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps([{"uuid": u, "memory_mb": 16000} for u in uuids]))
    base = config.load(environ={})
    cfg = replace(base, data_dir=str(tmp_path / "data"), redis=replace(base.redis, prefix=PREFIX),
                  gpu=replace(base.gpu, inventory=str(inventory), mps="off"),
                  invoker=replace(base.invoker, user_memory_mb=4096, preload=0, model_preload_mb=0,
                                  weights_grace_s=30.0, process_direct_lane=direct_lane))
    async with open_invoker(cfg, redis=redis) as invoker:
        agent = Agent.of(invoker, redis, prefix=PREFIX, boot="b1")
        manager = InstanceManager(agent, reservation_ttl_s=300.0)
        await agent.registry.ensure(action)
        try:
            yield kind(invoker, manager, GpuBudgets(redis, PREFIX), action)
        finally:
            await manager.close()


@pytest.fixture
async def node(tmp_path: Path, redis: aioredis.Redis) -> AsyncIterator[Node]:
    async with running_node(tmp_path, redis, UUIDS, _action(), Node) as n:
        yield n


async def test_a_two_stage_instance_runs_its_stages_in_order_as_one_activation(node: Node) -> None:
    stages = _stages("llm-1")
    seen: set[tuple[int, InstanceState]] = set()
    changes = 0

    def changed() -> None:
        nonlocal changes
        changes += 1

    node.manager.on_change = changed
    assert node.manager.handle(_start("llm-1", stages, node.action)) == "start"
    inst = node.inst("llm-1")
    # STARTING until both stages are ready (the second is 0.3 s later than the first)
    deadline = time.monotonic() + 20
    while inst.state is not InstanceState.READY:
        assert inst.state is InstanceState.STARTING and time.monotonic() < deadline, inst.failure
        seen.add((node.stage_containers("llm-1").count("ready"), inst.state))
        await asyncio.sleep(0.01)
    assert (1, InstanceState.STARTING) in seen and all(s is InstanceState.STARTING for _, s in seen), seen
    assert node.stage_containers("llm-1") == ["ready", "ready"]
    assert set(inst.proxies) == {"llm-1#p0", "llm-1#p1"} and changes == 1
    assert len({p.name for p in inst.proxies.values()}) == 2
    # each stage attached on its own GPU under its own id, with its own share and memory
    for k, s in enumerate(stages):
        placement = inst.proxies[s.id].placement
        assert placement.gpu_key == s.id and placement.gpu is not None and placement.gpu.gpu_index == s.gpu
        budget = await node.budgets.get(s.gpu_uuid or "")
        assert budget is not None and set(budget.reservations) == {s.id}, k
        held = budget.reservations[s.id]
        assert (held.request, held.limit, held.memory_mb) == (s.request, s.limit, s.memory_mb)

    activation = await node.manager.run("llm-1", _req(node.action, n=7))
    assert activation is not None and activation.response.status is ActivationStatus.SUCCESS, activation
    result = activation.response.result
    assert result["n"] == 7
    spans = [stage_span(stages, k) for k in range(2)]
    assert [(s["stage"], s["count"], s["span"]) for s in result["seen"]] == [
        (0, 2, f"{spans[0][0]!r}:{spans[0][1]!r}"), (1, 2, f"{spans[1][0]!r}:{spans[1][1]!r}")]
    assert spans[0] == (0.0, 6000 / 9000)
    assert result["seen"][0]["pid"] != result["seen"][1]["pid"]  # two processes
    # one activation: its id and its deadline (the whole pipeline's) at every stage
    assert {s["aid"] for s in result["seen"]} == {activation.activation_id}
    assert len({s["deadline"] for s in result["seen"]}) == 1
    # one record: the whole run, the logs of both stages in order, each naming its stage
    assert activation.duration >= 0 and activation.annotation("path") == "guest/llm"
    lines = [line for line in activation.logs if "at stage" in line]
    assert len(lines) == 2 and "stdout: [stage 0] at stage 0" in lines[0] and \
        "stdout: [stage 1] at stage 1" in lines[1], activation.logs
    reports = node.manager.reports()
    assert [(r.id, r.state, r.gpu, r.request, r.limit, r.memory_mb, r.completion_rate > 0) for r in reports] == [
        ("llm-1", "ready", 0, 0.5, 1.2, 9000, True)]


async def test_an_ordinary_instance_gets_no_stage_environment(node: Node) -> None:
    assert node.manager.handle(InstanceCommand(
        op="start", epoch=1, instance="one-1", function=node.action.fqn, rev=node.action.revision or "", gpu=1,
        gpu_uuid=UUIDS[1])) == "start"
    await until(lambda: node.state("one-1") is not None and node.state("one-1") is not InstanceState.STARTING,
                "one-1 started")
    assert node.state("one-1") is InstanceState.READY
    activation = await node.manager.run("one-1", _req(node.action))
    # main reads DILU_STAGE_INDEX: an ordinary instance has none
    assert activation is not None and activation.response.status is ActivationStatus.APPLICATION_ERROR
    assert "DILU_STAGE_INDEX" in str(activation.response.result)


async def test_a_failing_stage_fails_the_activation_and_no_later_stage_runs(node: Node) -> None:
    assert await node.start("llm-2", _stages("llm-2")) == "start"
    assert node.state("llm-2") is InstanceState.READY
    failed = await node.manager.run("llm-2", _req(node.action, fail_at=0))
    assert failed is not None and failed.response.status is ActivationStatus.APPLICATION_ERROR
    assert failed.response.result == {"error": "stage 0 of 2: no luck at 0"}
    assert any("[stage 0] at stage 0" in line for line in failed.logs)
    assert not any("at stage 1" in line for line in failed.logs), failed.logs
    late = await node.manager.run("llm-2", _req(node.action, fail_at=1))
    assert late is not None and late.response.result == {"error": "stage 1 of 2: no luck at 1"}
    assert [("at stage 0" in line, "at stage 1" in line) for line in late.logs if "at stage" in line] == [
        (True, False), (False, True)]
    # an application error keeps the containers: the instance serves on
    ok = await node.manager.run("llm-2", _req(node.action))
    assert ok is not None and ok.response.status is ActivationStatus.SUCCESS
    assert node.state("llm-2") is InstanceState.READY


async def test_the_time_limit_holds_for_the_whole_pipeline(node: Node) -> None:
    # (the limit holds for /init too: 3 s leaves a loaded machine room to start the stages' runtimes)
    action = _action("llm-short", timeout_ms=3000)
    await node.manager.registry.ensure(action)
    node.action = action
    assert await node.start("llm-8", _stages("llm-8")) == "start"
    assert node.state("llm-8") is InstanceState.READY, node.inst("llm-8").failure
    # each stage alone is within the limit, both together are not: the last stage gets what is left
    timed_out = await node.manager.run("llm-8", _req(action, sleep=1.8))
    assert timed_out is not None and timed_out.response.status is ActivationStatus.DEVELOPER_ERROR
    assert timed_out.response.result == {
        "error": "stage 1 of 2: The action exceeded its time limits of 3000 milliseconds."}
    assert timed_out.annotation("timeout") is True and timed_out.duration < 4500
    # its container is removed for the timeout (as any instance's): the pipeline fails whole
    await until(lambda: node.state("llm-8") is InstanceState.FAILED, "llm-8 failed")


async def test_an_intermediate_result_may_be_larger_than_a_result(node: Node) -> None:
    assert await node.start("llm-3", _stages("llm-3")) == "start"
    pad = 3 * DEFAULT_MAX_RESULT_BYTES
    assert pad < STAGE_MAX_RESULT_BYTES
    activation = await node.manager.run("llm-3", _req(node.action, pad_bytes=pad))
    assert activation is not None and activation.response.status is ActivationStatus.SUCCESS, \
        str(activation.response.result)[:300] if activation else None
    assert [s["got_pad"] for s in activation.response.result["seen"]] == [0, pad]
    assert activation.response.result["pad"] == ""


async def test_a_dead_stage_fails_the_instance_and_stops_the_other(node: Node) -> None:
    assert await node.start("llm-4", _stages("llm-4")) == "start"
    inst = node.inst("llm-4")
    other = inst.proxies["llm-4#p0"]
    os.kill(node.pid("llm-4#p1"), signal.SIGKILL)
    await until(lambda: node.state("llm-4") is InstanceState.FAILED, "llm-4 failed")
    assert inst.failure is not None and inst.failure.reason.startswith("stage 1 of 2: container removed"), \
        inst.failure
    await until(lambda: other.name not in node.invoker.pool.containers, "stage 0 stopped")

    async def released() -> bool:
        return all([await node.reservations(u) == {} for u in UUIDS])

    await until(released, "both stages' reservations released")
    assert await node.manager.run("llm-4", _req(node.action)) is None  # a failed instance takes no work
    [report] = node.manager.reports()
    assert report.state == "failed" and "stage 1 of 2" in report.error
    assert node.manager.handle(InstanceCommand(op="stop", epoch=1, instance="llm-4", function="guest/llm")) == "stop"
    await until(lambda: "llm-4" not in node.manager.instances, "llm-4 gone")


async def test_stop_releases_and_renew_renews_every_stage(node: Node) -> None:
    stages = _stages("llm-5")
    assert await node.start("llm-5", stages) == "start"
    before = {s.id: (await node.reservations(s.gpu_uuid or ""))[s.id] for s in stages}
    now_ms = int(time.time() * 1000)
    assert all(expires < now_ms + 100_000 for expires in before.values())  # the node's own 30 s
    await node.manager.renew_reservations()
    after = {s.id: (await node.reservations(s.gpu_uuid or ""))[s.id] for s in stages}
    assert all(after[i] > now_ms + 200_000 for i in after), after  # the manager's 300 s, for each stage
    containers = [p.name for p in node.inst("llm-5").proxies.values()]
    busy = asyncio.create_task(node.manager.run("llm-5", _req(node.action, sleep=0.3)))
    await until(lambda: node.inst("llm-5").in_flight == 1, "a run in flight")
    assert node.manager.handle(InstanceCommand(op="stop", epoch=1, instance="llm-5", function="guest/llm",
                                               reason="scaled in")) == "stop"
    assert node.state("llm-5") is InstanceState.DRAINING
    finished: Activation | None = await busy  # drained: the run in flight ends well
    assert finished is not None and finished.response.status is ActivationStatus.SUCCESS
    await until(lambda: "llm-5" not in node.manager.instances, "llm-5 stopped")
    await until(lambda: not any(c in node.invoker.pool.containers for c in containers), "stage containers gone")
    for u in UUIDS:  # nor is a stage kept for its weights (staged exit would leave "<stage id>-kept")
        assert await node.reservations(u) == {}
    assert node.invoker.keeper is not None and not node.invoker.keeper.kept


@pytest.mark.parametrize(("gpus", "uuids", "reason"), [
    ((0, 0), None, "each stage needs a GPU of its own, got GPUs [0, 0]"),
    ((0, 2), None, "stage 1 is placed on GPU 2, which this invoker does not have (its GPUs: [0, 1])"),
    ((0, -1), None, "stage 1 is placed on GPU -1, which this invoker does not have"),
    ((0, 1), (UUIDS[0], "GPU-elsewhere"), "stage 1 is placed on GPU-elsewhere, but GPU 1 of this invoker is"),
], ids=["duplicate-gpu", "out-of-range", "negative", "other-invokers-gpu"])
async def test_a_bad_start_fails_clearly_and_the_invoker_serves_on(
        node: Node, gpus: tuple[int, ...], uuids: tuple[str | None, ...] | None, reason: str) -> None:
    assert await node.start("bad-1", _stages("bad-1", gpus, uuids=uuids)) == "start"
    inst = node.inst("bad-1")
    assert inst.state is InstanceState.FAILED and inst.failure is not None
    assert inst.failure.reason.startswith("invalid split instance: ") and reason in inst.failure.reason, inst.failure
    assert not node.invoker.pool.containers  # nothing was started for it
    [report] = node.manager.reports()
    assert report.state == "failed" and reason in report.error
    # the same invoker starts and runs a good one next
    assert await node.start("llm-6", _stages("llm-6")) == "start"
    ok = await node.manager.run("llm-6", _req(node.action))
    assert ok is not None and ok.response.status is ActivationStatus.SUCCESS


async def test_stage_ids_taken_by_another_instance_are_refused(node: Node) -> None:
    assert await node.start("llm-7", _stages("llm-7")) == "start"
    clash = tuple(replace(s, id=stage_id("llm-7", k)) for k, s in enumerate(_stages("bad-2")))
    assert await node.start("bad-2", clash) == "start"
    assert node.state("bad-2") is InstanceState.FAILED
    assert "stage ids must be distinct and new" in (node.inst("bad-2").failure or "").__str__()
    # the refused one touched nothing of the first: stopping it leaves llm-7's reservations and containers
    assert node.manager.handle(InstanceCommand(op="stop", epoch=1, instance="bad-2", function="guest/llm")) == "stop"
    await until(lambda: "bad-2" not in node.manager.instances, "bad-2 gone")
    assert node.state("llm-7") is InstanceState.READY
    assert set(await node.reservations(UUIDS[0])) == {"llm-7#p0"}
    assert set(await node.reservations(UUIDS[1])) == {"llm-7#p1"}


async def test_a_stop_while_the_stages_start_stops_them_all(node: Node) -> None:
    stages = _stages("llm-9")
    assert node.manager.handle(_start("llm-9", stages, node.action)) == "start"
    await until(lambda: len(node.stage_containers("llm-9")) == 2, "both stages starting")
    assert node.state("llm-9") is InstanceState.STARTING  # the last stage takes 0.3 s more
    assert node.manager.handle(InstanceCommand(op="stop", epoch=1, instance="llm-9", function="guest/llm")) == "stop"
    await until(lambda: "llm-9" not in node.manager.instances, "llm-9 stopped")
    await until(lambda: not node.stage_containers("llm-9"), "its stage containers gone")
    for s in stages:
        assert s.id not in await node.reservations(s.gpu_uuid or "")


S = (0.4, False, 0.0)


@pytest.mark.parametrize(("parts", "shares", "expected"), [
    (("a",), {"a": S}, S),
    (("a",), {}, (None, None, None)),
    (("a#p0", "a#p1"), {"a#p0": (0.4, False, 0.0), "a#p1": (0.2, True, 0.3)}, (0.2, True, 0.3)),
    (("a#p0", "a#p1"), {"a#p0": S}, (None, None, None)),  # one stage not seen yet: unknown
    (("a#p0", "a#p1"), {"a#p0": S, "a#p1": (None, None, None)}, (None, False, 0.0)),
], ids=["one", "one-unknown", "slowest-stage", "stage-missing", "stage-share-unknown"])
def test_a_split_instance_reports_its_slowest_stage(
        parts: tuple[str, ...], shares: dict[str, tuple[float | None, bool | None, float | None]],
        expected: tuple[float | None, bool | None, float | None]) -> None:
    assert _share_of(parts, shares) == expected
