"""End to end without a GPU: tenant processes launch "kernels" through the fake libcuda under the real shim,
with the environment of a GpuNode attachment; the node's manager loop drives them through the control
blocks, and the tests read what the shim applied from the stats blocks.

Nothing here asserts on speed: a cut is checked by the rate the shim applied and by an upper bound on what
it admitted (tokens cannot refill faster than the rate); waits have generous time limits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis

from dilu_invoker.gpu import abi
from dilu_invoker.gpu.attachment import GpuAttachment
from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.gpu.manager import TickRecord
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.model import GpuClass, GpuNeeds
from dilu_invoker.policy.vertical import FeedbackMode
from dilu_invoker.policy.vertical_slo import SloConfig
from dilu_invoker.redis_embedded import free_port, redis_client
from tests.gpu.support import ShimBuild, Tenant, start_tenant

pytestmark = pytest.mark.slow

T = TypeVar("T")
GPU = GpuDevice(index=0, uuid="GPU-e2e-0", name="inventory GPU", memory_mb=80_000, sm_count=132, simulated=True)
CAPACITY = 200.0  # blocks/ms, as the profiler would have measured (the annotation)
TRAIN = GpuNeeds(gpu_class=GpuClass.TRAINING, sm_request=0.2, sm_limit=0.8, memory_mb=1000,
                 capacity_blocks_per_ms=CAPACITY)
INFER = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.4, sm_limit=0.7, memory_mb=1000,
                 capacity_blocks_per_ms=CAPACITY)
TRAIN_IDLE_RATE = 0.8 * CAPACITY  # training alone: its limit
SLOW = SloConfig(increase_per_s=0.05)
"""The slo policy growing training by 0.01 of the GPU per 0.2 s dwell: with no real GPU nothing stretches
inference's cycles, so the budget would otherwise climb back to training's limit while inference still runs."""
TRAIN_START_RATE = (1 - 0.4) * CAPACITY  # beside bursting inference: the room inference's request leaves
TRAIN_CUT_RATE = TRAIN_START_RATE + 0.05 * CAPACITY  # ... and what SLOW adds to it over a test's seconds
# Training launches 100 blocks roughly every 0.3 ms (~330 blocks/ms), more than any quota here allows.
TRAIN_LOAD = "run 100 200"
INFER_LOAD = "burst 20 30 300 20"


async def until(pred: Callable[[], T], what: str, timeout: float = 15.0) -> T:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def stats(a: GpuAttachment) -> abi.StatsSnapshot:
    with abi.StatsFile.open(a.env["DILU_SHIM_STATS"]) as f:
        return f.snapshot()


def control(a: GpuAttachment) -> abi.Quota:
    with abi.ControlFile.open(a.env["DILU_SHIM_CONTROL"]) as f:
        return f.read().quota


def applied(a: GpuAttachment, rate: float) -> abi.StatsSnapshot | None:
    s = stats(a)
    return s if s.published and s.rate_blocks_per_ms == pytest.approx(rate) else None


def cut_applied(a: GpuAttachment) -> abi.StatsSnapshot | None:
    """Training cut below its limit to about where the slo policy starts it (or below: the floor while
    inference's solo latency is measured), as the shim applied it."""
    s = stats(a)
    return s if s.published and s.limited and s.rate_blocks_per_ms <= TRAIN_CUT_RATE + 1e-6 else None


@pytest.fixture
async def records() -> list[TickRecord]:
    return []


@pytest.fixture
async def node(tmp_path: Path, shim_build: ShimBuild, redis: aioredis.Redis,
               records: list[TickRecord]) -> AsyncIterator[GpuNode]:
    n = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", shim_library=shim_build.library,
                budgets=GpuBudgets(redis, prefix="e2e:"), period_s=0.02, stale_after_s=0.3,
                vertical=SLOW, observers=(records.append,))
    await n.start()
    yield n
    await n.close()


async def test_burst_cuts_training_idle_restores_stale_fails_static(
    node: GpuNode, shim_build: ShimBuild, tenants: list[Tenant], redis: aioredis.Redis,
    records: list[TickRecord],
) -> None:
    train = await node.attach("train", "guest/train", TRAIN)
    infer = await node.attach("infer", "guest/classify", INFER)
    assert train is not None and infer is not None
    trainer = await start_tenant(tenants, shim_build.env(train.env))
    server = await start_tenant(tenants, shim_build.env(infer.env))
    await trainer.send(TRAIN_LOAD)

    # Training alone: idle mode, it rises to its limit and the shim enforces that rate.
    await until(lambda: applied(train, TRAIN_IDLE_RATE), "training at its limit")
    assert node.manager(0).last is not None and node.manager(0).last.mode is FeedbackMode.IDLE

    # Inference bursts: training drops to its floor while inference's solo latency is measured, then runs at the
    # room inference's request leaves (1 - 0.4), growing only slowly; the shim applies each rate.
    await server.send(INFER_LOAD)
    await until(lambda: control(train).share <= 0.6 + 1e-9, "training share cut")
    first = await until(lambda: cut_applied(train), "cut rate applied by the shim")
    assert control(infer).share == pytest.approx(0.7)
    await asyncio.sleep(0.5)
    last = stats(train)
    assert last.limited and last.rate_blocks_per_ms <= TRAIN_CUT_RATE + 1e-6, "the cut holds"
    elapsed_ms = (last.heartbeat_ns - first.heartbeat_ns) / 1e6
    admitted = last.blocks - first.blocks
    # Tokens refill at the rate in force (at most the cut rate here): at most rate × time, plus one bucket
    # (5 ms of rate), one launch of debt, and a tick of publishing skew on each side.
    bound = TRAIN_CUT_RATE * (elapsed_ms + 5 + 2) + 100
    assert 0 < admitted <= bound, (admitted, bound, elapsed_ms)
    assert admitted / elapsed_ms < 0.85 * TRAIN_IDLE_RATE  # the admitted rate dropped
    assert last.throttled_ns > first.throttled_ns and stats(infer).blocks > 0
    assert any(s.id == "infer" and s.active and r.mode is not FeedbackMode.IDLE for r in records for s in r.instances)

    # Inference stops: after idle_after_s (0.6 s) training gets its limit back.
    await server.send("idle")
    await until(lambda: applied(train, TRAIN_IDLE_RATE), "training back at its limit")
    assert node.manager(0).last is not None and node.manager(0).last.mode is FeedbackMode.IDLE
    budget = await GpuBudgets(redis, prefix="e2e:").get(GPU.uuid)
    assert budget is not None and set(budget.reservations) == {"train", "infer"}
    await until(lambda: node.manager(0).last is not None, "a tick")
    end = time.monotonic() + 15
    while (b := await GpuBudgets(redis, prefix="e2e:").get(GPU.uuid)) is None or b.shares.get("train") != 0.8:
        assert time.monotonic() < end, "shares were never published"
        await asyncio.sleep(0.05)
    assert b.shares["infer"] == pytest.approx(0.7)

    # The manager stops: heartbeats age past stale_after_s and the shim keeps the last quota (fail-static).
    await node.manager(0).stop()
    stale = await until(lambda: (s := stats(train)).stale and s, "fail-static")
    assert stale.rate_blocks_per_ms == pytest.approx(TRAIN_IDLE_RATE) and trainer.proc.returncode is None

    # Detach removes the blocks and the reservations.
    await trainer.stop()
    await server.stop()
    for name, a in (("train", train), ("infer", infer)):
        await node.detach(name)
        assert not Path(a.env["DILU_SHIM_CONTROL"]).parent.exists()
    budget = await GpuBudgets(redis, prefix="e2e:").get(GPU.uuid)
    assert budget is not None and budget.reservations == {}


# Load-sensitive: the stretch the manager must see is timed by the fake tenants' own loops; on a host busy
# with other work (load 3 on 2 cores) no emergency came within 60 s once in three runs. Tried once more.
@pytest.mark.flaky(reruns=1)
async def test_stretched_cycles_cut_training(tmp_path: Path, shim_build: ShimBuild, tenants: list[Tenant]) -> None:
    """The feedback loop end to end: the inference tenant's bursts take longer the faster training is
    admitted (fake_tenant --contend), so its request spans stretch; the manager reads them from the real shim's
    stats block and the slo policy cuts training below where it started it.

    The slo policy measures inference's solo spans with training at its floor (the stretch 1 + 2 × rate /
    capacity about 1.02 there), starts training at 1 − 0.4 (a stretch of 2.2), and without an SLO annotation
    holds inference to 2 × its solo latency: 2.2× spans at a higher busy fraction are above that target, so
    it decreases the budget (or clamps it to the floor)."""
    seen: list[TickRecord] = []
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", shim_library=shim_build.library,
                   period_s=0.02, observers=(seen.append,), vertical=SLOW)
    await node.start()
    try:
        train = await node.attach("train", "guest/train", TRAIN)
        infer = await node.attach("infer", "guest/classify", INFER)
        assert train is not None and infer is not None
        trainer = await start_tenant(tenants, shim_build.env(train.env))
        await trainer.send(TRAIN_LOAD)
        await until(lambda: applied(train, TRAIN_IDLE_RATE), "training at its limit")
        server = await start_tenant(tenants, shim_build.env(infer.env), "--contend", train.env["DILU_SHIM_STATS"],
                                    "--contend-capacity", str(CAPACITY))
        await server.send("burst 10 12 500 40 sync")  # requests: each burst one span, stretched by training
        measuring = await until(lambda: next((r for r in seen if r.mode is FeedbackMode.MEASURE), None),
                                "inference's solo latency measured")
        assert measuring.status("train").share == pytest.approx(0.01)  # training at its floor meanwhile
        started = await until(lambda: next((r for r in seen if r.mode is FeedbackMode.HOLD
                                            and r.now > measuring.now), None), "training started beside inference")
        assert started.status("train").share == pytest.approx(0.6)
        cut = await until(lambda: next((r for r in seen if r.mode in (FeedbackMode.DECREASE, FeedbackMode.EMERGENCY)
                                        and r.now > started.now), None), "a cut", timeout=60)
        assert "error" in cut.reason or "emergency" in cut.reason, cut.reason
        assert cut.status("train").share < 0.6 - 1e-9
        applied_cut = await until(lambda: (s := stats(train)).rate_blocks_per_ms < TRAIN_START_RATE - 1e-6 and s,
                                  "the cut applied by the shim")
        assert applied_cut.limited
    finally:
        await node.close()


# Known flake: once in three whole-suite runs this test hung (the loop idle, a Redis server of the test
# still running; 0.9 s alone). Bounded, and tried once more, until the cause is found.
@pytest.mark.flaky(reruns=1)
async def test_redis_outage_keeps_enforcing_and_resyncs(tmp_path: Path, shim_build: ShimBuild,
                                                        tenants: list[Tenant], redis_server_factory: Any) -> None:
    async with asyncio.timeout(90):
        await _redis_outage_keeps_enforcing_and_resyncs(tmp_path, shim_build, tenants, redis_server_factory)


async def _redis_outage_keeps_enforcing_and_resyncs(tmp_path: Path, shim_build: ShimBuild,
                                                    tenants: list[Tenant], redis_server_factory: Any) -> None:
    server = await redis_server_factory(port=free_port(), persistent=False)
    client = redis_client(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    budgets = GpuBudgets(client, prefix="o:")
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", shim_library=shim_build.library,
                   budgets=budgets, period_s=0.02, reservation_ttl_s=1.5, redis_timeout_s=1.0, vertical=SLOW)
    await node.start()
    try:
        train = await node.attach("train", "guest/train", TRAIN)
        assert train is not None
        trainer = await start_tenant(tenants, shim_build.env(train.env))
        await trainer.send(TRAIN_LOAD)
        await until(lambda: applied(train, TRAIN_IDLE_RATE), "training at its limit")

        await server.stop()
        # Admission during the outage: against the node's own view.
        infer = await node.attach("infer", "guest/classify", INFER)
        assert infer is not None and not node.redis_reachable
        assert await node.attach("too-much", "guest/x", GpuNeeds(sm_request=0.5, sm_limit=0.5)) is None
        burster = await start_tenant(tenants, shim_build.env(infer.env))
        await burster.send(INFER_LOAD)
        # Shares keep being decided and enforced, heartbeats keep the shim from failing static.
        cut = await until(lambda: cut_applied(train), "cut enforced while Redis is down")
        assert not cut.stale and not node.redis_reachable

        await server.start()  # same port and password, but empty: GPUs and reservations must be re-synced
        await until(lambda: node.redis_reachable, "Redis reachable again")

        async def synced() -> bool:
            b = await budgets.get(GPU.uuid)
            return b is not None and set(b.reservations) == {"train", "infer"} and set(b.shares) == {"train",
                                                                                                     "infer"}

        end = time.monotonic() + 15
        while not await synced():
            assert time.monotonic() < end, "budgets never re-synced"
            await asyncio.sleep(0.05)
        b = await budgets.get(GPU.uuid)
        assert b is not None and b.shares["train"] <= TRAIN_CUT_RATE / CAPACITY + 1e-9
        assert b.shares["infer"] == pytest.approx(0.7)
        assert {r.invoker for r in b.reservations.values()} == {"invoker0"}
    finally:
        await node.close()
        await client.aclose()


async def test_request_spans_reach_the_tick_records(tmp_path: Path, shim_build: ShimBuild,
                                                    tenants: list[Tenant]) -> None:
    """Requests as PyTorch serves them (launches, then cuCtxSynchronize) through the real shim: every
    period's record carries the spans that completed in it, each at least the request's GPU time on the
    fake driver's timeline (5 launches × 100 blocks × 10 µs = 5 ms)."""
    seen: list[TickRecord] = []
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", shim_library=shim_build.library,
                   period_s=0.02, observers=(seen.append,))
    await node.start()
    try:
        infer = await node.attach("infer", "guest/classify", INFER)
        assert infer is not None
        started = time.monotonic()
        server = await start_tenant(tenants, shim_build.env({**infer.env, "FAKE_CUDA_BLOCK_NS": "10000"}))
        await server.send("requests 100 5 20")

        def spans() -> list[float]:
            return [x for r in list(seen) for s in r.instances if s.id == "infer" for x in s.spans_s]

        done = await until(lambda: len(spans()) >= 5 and spans(), "five request spans in the tick records")
        assert all(0.005 <= x <= time.monotonic() - started for x in done), done
        await server.send("idle")

        def settled() -> abi.StatsSnapshot | None:
            s = stats(infer)
            quiet = s.span_open_ns == 0 and seen[-1].status("infer").open_span_s == 0.0
            return s if quiet and len(spans()) == s.spans else None

        # Once the requests stop no span stays open, and every completed span reached exactly one record
        # (a few per period, far below the ring's 24).
        snap = await until(settled, "the records caught up with the stats block, no span open")
        assert snap.recent_spans_us and all(us >= 5000 for us in snap.recent_spans_us)
    finally:
        await node.close()
