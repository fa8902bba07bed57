"""The balancer's half of model pre-loading in cluster mode (`loadbalancer/model_preload.py`) against a real
Redis, the invokers' reports written as invokers write them, and the changes fed as the whisks database's feed
hands them out (`openwhisk.changes.ActionChange`; the feed itself is tested against pouchdb-server in
test_whisk_changes.py): which invoker is told to pre-load, what the commands carry, what is released, and that
neither a standby nor a failing feed writes anything or stops the balancer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import redis.asyncio as aioredis
from prometheus_client import generate_latest

from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets, GpuCapacity, Reservation
from dilu_invoker.loadbalancer.service import Balancer, open_balancer
from dilu_invoker.model import Action, Exec, Parameter
from dilu_invoker.openwhisk.changes import ActionChange
from dilu_invoker.wire import GpuReport, InstanceCommand, Keys, LoadReport, from_stream, pack
from tests.invoker.staged_support import metric

PREFIX = "pre:"
KEYS = Keys(PREFIX)
WEIGHTS = {"gpu-memory-mb": 4000, "gpu-weights-mb": 3000, "gpu-sm-request": 0.1, "gpu-sm-limit": 0.2}


def _cfg() -> config.Config:
    base = config.load(environ={})
    return replace(base, redis=replace(base.redis, prefix=PREFIX),
                   balancer=replace(base.balancer, tick_s=0.2, lease_ttl_s=1.0))


async def _invoker(redis: aioredis.Redis, name: str) -> None:
    """What an invoker's reporter writes: its GPU's budget, its report, its boot key, its membership."""
    report = LoadReport(invoker=name, boot=f"{name}-boot", at_ms=int(time.time() * 1000), user_memory_mb=2048,
                        gpus=(GpuReport(index=0, uuid=f"{name}-gpu0", memory_mb=16000),))
    await GpuBudgets(redis, PREFIX).register_gpu(f"{name}-gpu0", GpuCapacity(node=name, index=0, name="t",
                                                                               memory_mb=16000, sm_count=132))
    await redis.set(KEYS.report(name), pack(report), px=60_000)
    await redis.set(KEYS.boot(name), report.boot, px=60_000)
    await redis.sadd(KEYS.invokers, name)


def _change(name: str, rev: str, *, gpu: bool = True, deleted: bool = False, **annotations: object) -> ActionChange:
    action = None if deleted else Action(
        namespace="guest", name=name, exec=Exec(kind="python:3-gpu" if gpu else "python:3.11"), revision=rev,
        annotations=tuple(Parameter(k, v) for k, v in annotations.items()))
    return ActionChange(fqn=f"guest/{name}", rev=rev, action=action, gpu=gpu and not deleted)


class Feed:
    """What the whisks database's feed would hand out, in order (an exception: the feed fails there)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[ActionChange | Exception] = asyncio.Queue()
        self.follows = 0

    async def follow(self, stop: asyncio.Event) -> AsyncIterator[ActionChange]:
        self.follows += 1
        while not stop.is_set():
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item


async def _commands(redis: aioredis.Redis, invoker: str) -> list[InstanceCommand]:
    return [from_stream(InstanceCommand, f) for _, f in await redis.xrange(KEYS.commands(invoker))]


def _outcome(balancer: Balancer, outcome: str) -> float:
    return metric(generate_latest(balancer.metrics.registry).decode(), "dilu_balancer_model_preloads_total",
                  outcome=outcome)


async def _until(check, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _leading(balancer: Balancer) -> None:
    async def leads() -> bool:
        return balancer.leading is not None

    await _until(leads)


async def test_the_invoker_the_first_instance_would_go_to_is_told_once_and_the_others_release(
        redis: aioredis.Redis) -> None:
    await _invoker(redis, "invoker0")
    await _invoker(redis, "invoker1")
    # invoker0's GPU has 2000 MB left: the first instance (4000 MB) can only go to invoker1
    await GpuBudgets(redis, PREFIX).reserve("invoker0-gpu0", Reservation(
        instance="big", function="guest/big", cls="inference", invoker="invoker0", request=0.1, limit=0.2,
        memory_mb=14000), ttl_s=60)
    feed = Feed()
    async with open_balancer(_cfg(), redis, holder="solo", action_feed=feed.follow) as balancer:
        await _leading(balancer)
        # the controller's two writes of one action (document, then code attachment): one pre-load, of the last
        feed.queue.put_nowait(_change("llm", "1-a", **WEIGHTS))
        feed.queue.put_nowait(_change("llm", "2-b", **WEIGHTS))

        async def sent() -> bool:
            return _outcome(balancer, "sent") == 1.0

        await _until(sent)
        [cmd] = await _commands(redis, "invoker1")
        assert (cmd.op, cmd.function, cmd.rev, cmd.gpu, cmd.gpu_uuid, cmd.memory_mb, cmd.boot) == (
            "preload", "guest/llm", "2-b", 0, "invoker1-gpu0", 4000, "invoker1-boot")
        assert cmd.epoch == balancer.leading.epoch and cmd.reason  # type: ignore[union-attr]
        [other] = await _commands(redis, "invoker0")
        assert (other.op, other.function, other.reason) == ("release", "guest/llm", "replaced")
        await asyncio.sleep(0.7)  # past the debounce of the first write: nothing more
        assert len(await _commands(redis, "invoker1")) == 1

        feed.queue.put_nowait(_change("llm", "3-c", deleted=True))

        async def released() -> bool:
            return _outcome(balancer, "released") == 1.0

        await _until(released)
        for name in ("invoker0", "invoker1"):
            last = (await _commands(redis, name))[-1]
            assert (last.op, last.function, last.reason) == ("release", "guest/llm", "deleted"), name


async def test_no_room_an_invalid_spec_and_actions_without_weights_send_no_preload(redis: aioredis.Redis) -> None:
    await _invoker(redis, "invoker0")
    feed = Feed()
    async with open_balancer(_cfg(), redis, holder="solo", action_feed=feed.follow) as balancer:
        await _leading(balancer)
        feed.queue.put_nowait(_change("huge", "1-a", **{**WEIGHTS, "gpu-memory-mb": 20000, "gpu-weights-mb": 3000}))
        feed.queue.put_nowait(_change("bad", "1-a", **{**WEIGHTS, "gpu-sm-request": "lots"}))
        feed.queue.put_nowait(_change("cpu", "1-a", gpu=False, **WEIGHTS))
        feed.queue.put_nowait(_change("plain", "1-a", **{"gpu-memory-mb": 4000}))

        async def done() -> bool:
            return bool(_outcome(balancer, "no_room") == 1.0 and _outcome(balancer, "invalid") == 1.0
                        and _outcome(balancer, "released") == 1.0)

        await _until(done)
        # an older revision pre-loaded anywhere goes: the one that fits nowhere, the one without weights
        cmds = await _commands(redis, "invoker0")
        assert sorted((c.op, c.function, c.reason) for c in cmds) == [
            ("release", "guest/huge", "replaced"), ("release", "guest/plain", "no weights declared")], cmds
        assert _outcome(balancer, "sent") == 0.0


async def test_a_standby_writes_nothing_until_it_leads_then_handles_what_it_saw_and_a_failing_feed_is_followed_again(
        redis: aioredis.Redis) -> None:
    await _invoker(redis, "invoker0")
    await redis.set(KEYS.lease, "other|99", px=60_000)  # another balancer leads
    feed = Feed()
    async with open_balancer(_cfg(), redis, holder="standby", action_feed=feed.follow) as balancer:
        feed.queue.put_nowait(_change("llm", "1-a", **WEIGHTS))

        async def skipped() -> bool:
            return _outcome(balancer, "not_leading") == 1.0

        await _until(skipped)
        assert await _commands(redis, "invoker0") == [] and balancer.leading is None

        await redis.delete(KEYS.lease)  # the leader went: this one leads
        await _leading(balancer)

        # what it saw as a standby is handled now (its leader may have died before handling it)
        async def caught_up() -> bool:
            return _outcome(balancer, "sent") == 1.0

        await _until(caught_up)
        assert [(c.op, c.rev) for c in await _commands(redis, "invoker0")] == [("preload", "1-a")]
        feed.queue.put_nowait(RuntimeError("the feed broke"))

        async def again() -> bool:
            return feed.follows == 2

        await _until(again)
        feed.queue.put_nowait(_change("llm", "2-b", **WEIGHTS))

        async def sent() -> bool:
            return _outcome(balancer, "sent") == 2.0

        await _until(sent)
        assert [(c.op, c.rev) for c in await _commands(redis, "invoker0")] == [("preload", "1-a"), ("preload", "2-b")]
