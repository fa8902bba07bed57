"""The data plane with real invokers (process backend) and a real Redis; the test plays the balancer
(writes instance commands and routing tables) so each case is exact."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import pytest

from dilu_invoker import config
from dilu_invoker.invoker.cluster.routing import BalancedRunner, enable_balancer_routing
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.model import (
    GUEST_IDENTITY,
    Action,
    ActionLimits,
    ActivationRequest,
    ActivationStatus,
    Exec,
    Parameter,
    new_activation_id,
)
from dilu_invoker.redis_embedded import EmbeddedRedis, redis_client
from dilu_invoker.wire import (
    ACTIVATION_GROUP,
    InstanceCommand,
    Keys,
    LoadReport,
    RouteEntry,
    RoutingTable,
    decode,
    pack,
    stream_fields,
)

PREFIX = "rt:"
KEYS = Keys(PREFIX)
CODE = ("import os, time\n"
        "def main(a):\n"
        "    time.sleep(a.get('sleep', 0))\n"
        "    return {'n': a.get('n'), 'pid': os.getpid()}\n")


def _cfg(url: str, invoker_id: int) -> config.Config:
    base = config.load(environ={})
    return replace(base, redis=replace(base.redis, url=url, prefix=PREFIX),
                   invoker=replace(base.invoker, id=invoker_id, user_memory_mb=2048),
                   balancer=replace(base.balancer, report_period_s=0.2, report_ttl_s=1.0, route_wait_s=10.0))


def _action(name: str = "g", kind: str = "python:3-gpu", **limits: int) -> Action:
    return Action(namespace="guest", name=name, exec=Exec(kind=kind, code=CODE),
                  limits=replace(ActionLimits(), **limits), revision="1-abc",
                  annotations=(Parameter("gpu-sm-request", 0.2),))


def _req(action: Action, **content: object) -> ActivationRequest:
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                             content=dict(content))


@dataclass
class Node:
    invoker: Invoker
    runner: BalancedRunner
    name: str


class Cluster:
    """In-process invokers with balancer routing, sharing one Redis."""

    def __init__(self, server: EmbeddedRedis, stack: contextlib.AsyncExitStack) -> None:
        self.server = server
        self.stack = stack
        self.redis = redis_client(server.url)
        self.epoch = 1

    async def node(self, invoker_id: int) -> Node:
        cfg = _cfg(self.server.url, invoker_id)
        inv = await self.stack.enter_async_context(open_invoker(cfg))
        runner = await self.stack.enter_async_context(enable_balancer_routing(inv, cfg, redis=self.redis, devices=()))
        return Node(inv, runner, inv.name)

    async def start_instance(self, node: Node, iid: str, action: Action) -> None:
        """What the balancer does: register (a router would have), command, wait for readiness."""
        await node.runner.registry.ensure(action)
        await self.redis.xadd(KEYS.commands(node.name), stream_fields(InstanceCommand(
            op="start", epoch=self.epoch, instance=iid, function=action.fqn, rev=action.revision or "")))
        await until(lambda: _ready(node, iid))

    async def publish(self, action: Action, *entries: RouteEntry) -> None:
        table = RoutingTable(function=action.fqn, rev=action.revision or "", epoch=self.epoch, version=1,
                             instances=entries)
        await self.redis.set(KEYS.route(action.fqn), pack(table))
        await self.redis.publish(KEYS.routes_channel, action.fqn)


async def _ready(node: Node, iid: str) -> bool:
    inst = node.runner.instances.instances.get(iid)
    return inst is not None and inst.state.value == "ready"


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def cluster(redis_server: EmbeddedRedis) -> AsyncIterator[Cluster]:
    async with contextlib.AsyncExitStack() as stack:
        c = Cluster(redis_server, stack)
        stack.push_async_callback(c.redis.aclose)
        yield c


async def test_local_and_forwarded_runs_and_the_reports(cluster: Cluster) -> None:
    n0, n1 = await cluster.node(0), await cluster.node(1)
    action = _action()
    await cluster.start_instance(n1, "g-1", action)
    await cluster.publish(action, RouteEntry("g-1", n1.name))
    there = await n0.runner.run(_req(action, n=1))
    here = await n1.runner.run(_req(action, n=2))
    assert there.response.status is ActivationStatus.SUCCESS and there.response.result["n"] == 1
    assert here.response.result["n"] == 2 and here.response.result["pid"] == there.response.result["pid"]
    assert (n0.runner.forwarded_runs, n1.runner.local_runs) == (1, 1)
    assert await cluster.redis.xlen(KEYS.activations(n1.name)) == 0  # acknowledged and deleted
    assert await cluster.redis.exists(KEYS.result(there.activation_id), KEYS.claim(there.activation_id)) == 1
    report = n1.runner.instances.reports()
    assert [(r.id, r.state, r.function) for r in report] == [("g-1", "ready", "guest/g")]
    raw = await cluster.redis.get(KEYS.report(n1.name))
    published = decode(LoadReport, raw)
    assert published is not None and published.invoker == n1.name and published.boot


async def test_other_kinds_stay_in_the_local_pool(cluster: Cluster) -> None:
    n0 = await cluster.node(0)
    result = await n0.runner.run(_req(_action("cpu", kind="python:3"), n=5))
    assert result.response.result["n"] == 5
    assert await cluster.redis.scard(KEYS.functions) == 0


async def test_a_waiting_activation_signals_demand_and_runs_once_an_instance_is_ready(cluster: Cluster) -> None:
    n0 = await cluster.node(0)
    action = _action()
    task = asyncio.create_task(n0.runner.run(_req(action, n=3)))

    async def demanded() -> bool:
        return any(f.get(b"f") == b"guest/g" for _, f in await cluster.redis.xrange(KEYS.demand))

    await until(demanded)
    assert not task.done()
    assert [f.waiting for f in n0.runner.stats.take()] == [1]
    await cluster.start_instance(n0, "g-1", action)
    await cluster.publish(action, RouteEntry("g-1", n0.name))
    result = await asyncio.wait_for(task, 10)
    assert result.response.result["n"] == 3 and n0.runner.local_runs == 1


async def test_a_gone_target_gives_the_activation_back(cluster: Cluster) -> None:
    n0 = await cluster.node(0)
    action = _action()
    await n0.runner.registry.ensure(action)
    # invoker9 is listed but reports nothing: it died.
    await cluster.publish(action, RouteEntry("g-9", "invoker9"))
    task = asyncio.create_task(n0.runner.run(_req(action, n=4)))
    await until(lambda: _moved(n0))
    assert await cluster.redis.xlen(KEYS.activations("invoker9")) == 0
    await cluster.start_instance(n0, "g-1", action)
    await cluster.publish(action, RouteEntry("g-9", "invoker9"), RouteEntry("g-1", n0.name))
    result = await asyncio.wait_for(task, 10)
    assert result.response.result["n"] == 4 and n0.runner.local_runs == 1
    assert await cluster.redis.get(KEYS.claim(result.activation_id)) == b"x"


async def _moved(node: Node) -> bool:
    return node.runner.forwarder.stats.moved == 1


async def test_a_restarted_invoker_runs_what_its_predecessor_had_read(cluster: Cluster) -> None:
    n0 = await cluster.node(0)
    action = _action()
    await n0.runner.registry.ensure(action)
    # invoker1's previous incarnation ("old") read the entry and died while running it.
    stream = KEYS.activations("invoker1")
    await cluster.redis.xgroup_create(stream, ACTIVATION_GROUP, id="0", mkstream=True)
    await cluster.redis.set(KEYS.boot("invoker1"), "old", px=60_000)
    await cluster.publish(action, RouteEntry("g-1", "invoker1"))
    req = _req(action, n=6)
    task = asyncio.create_task(n0.runner.run(req))

    async def read_by_old() -> bool:
        got = await cluster.redis.xreadgroup(ACTIVATION_GROUP, "old", {stream: ">"}, count=1)
        return bool(got)

    await until(read_by_old)
    await cluster.redis.set(KEYS.claim(req.activation_id), "r:invoker1:old")
    await asyncio.sleep(1.0)  # the origin keeps waiting: invoker1 counts as alive
    assert not task.done()
    n1 = await cluster.node(1)  # the restart: a new boot claims the pending entry
    result = await asyncio.wait_for(task, 10)
    assert result.response.status is ActivationStatus.SUCCESS and result.response.result["n"] == 6
    stats = n1.runner.forwarder.stats
    assert (stats.claimed, stats.reruns, stats.executed) == (1, 1, 1)
    assert n0.runner.forwarder.stats.moved == 0


async def test_a_finished_activation_is_handed_back_not_run_again(cluster: Cluster) -> None:
    n0, n1 = await cluster.node(0), await cluster.node(1)
    action = _action()
    await cluster.start_instance(n1, "g-1", action)
    req = _req(action, n=7)
    first = await n0.runner.forwarder.forward(RouteEntry("g-1", n1.name), req)
    assert first is not None and first.response.result["n"] == 7
    # The same activation delivered again (e.g. an origin that retried): the stored result answers.
    again = await n0.runner.forwarder.forward(RouteEntry("g-1", n1.name), req)
    assert again is not None and again.activation_id == first.activation_id
    assert again.response.result == first.response.result
    stats = n1.runner.forwarder.stats
    assert (stats.executed, stats.redelivered) == (1, 1)


async def test_commands_of_a_deposed_leader_or_another_boot_are_ignored(cluster: Cluster) -> None:
    n0 = await cluster.node(0)
    manager = n0.runner.instances
    cmd = InstanceCommand(op="stop", epoch=5, instance="x", function="guest/g")
    assert manager.handle(cmd) == "unknown" and manager.max_epoch == 5
    assert manager.handle(replace(cmd, epoch=4)) == "stale-epoch"
    assert manager.handle(replace(cmd, op="start", epoch=5, boot="someone-else")) == "other-boot"
    assert manager.handle(replace(cmd, op="reboot")) == "unknown-op"


async def test_stopping_an_instance_lets_its_work_finish(cluster: Cluster) -> None:
    n0 = await cluster.node(0)
    action = _action()
    await cluster.start_instance(n0, "g-1", action)
    await cluster.publish(action, RouteEntry("g-1", n0.name))
    container = n0.runner.instances.instances["g-1"].container
    slow = asyncio.create_task(n0.runner.run(_req(action, n=8, sleep=0.5)))
    await until(lambda: _busy(n0, "g-1"))
    await cluster.redis.xadd(KEYS.commands(n0.name), stream_fields(InstanceCommand(
        op="stop", epoch=cluster.epoch, instance="g-1", function=action.fqn, reason="scale in")))
    result = await asyncio.wait_for(slow, 10)
    assert result.response.status is ActivationStatus.SUCCESS

    async def gone() -> bool:
        return "g-1" not in n0.runner.instances.instances and container not in n0.invoker.pool.containers

    await until(gone)


async def _busy(node: Node, iid: str) -> bool:
    inst = node.runner.instances.instances.get(iid)
    return inst is not None and inst.in_flight == 1


async def test_a_crashed_instance_fails_and_its_work_goes_on_elsewhere(cluster: Cluster) -> None:
    n0 = await cluster.node(0)
    action = _action(timeout_ms=1500)
    await cluster.start_instance(n0, "g-1", action)
    await cluster.publish(action, RouteEntry("g-1", n0.name))
    timed_out = await n0.runner.run(_req(action, n=9, sleep=5))
    assert timed_out.response.status is ActivationStatus.DEVELOPER_ERROR  # the container is replaced...

    async def failed() -> bool:
        return n0.runner.instances.instances["g-1"].state.value == "failed"

    await until(failed)  # ...and the instance is reported failed for the balancer to replace
    assert [r.state for r in n0.runner.instances.reports()] == ["failed"]
    # An activation routed to the dead instance waits for its replacement instead of failing.
    later = asyncio.create_task(n0.runner.run(_req(action, n=10)))
    await asyncio.sleep(0.3)
    assert not later.done()
    await cluster.start_instance(n0, "g-2", action)
    await cluster.publish(action, RouteEntry("g-2", n0.name))
    result = await asyncio.wait_for(later, 10)
    assert result.response.result["n"] == 10 and n0.runner.fallback_runs == 0
