"""Live compaction with real invoker processes, a real balancer process and a real Redis: a fragmented
cluster is compacted make-before-break while the moved function keeps serving, with no failed
activation; the cold starts it cost are reported (GPU inventory files stand in for GPUs)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
from lb_support.cluster import KEYS, ProcessCluster, open_loop, until

from dilu_invoker.redis_embedded import EmbeddedRedis
from tests.loadbalancer.test_cluster import SLEEPER, gpu, needs

pytestmark = pytest.mark.slow

COMPACTION = {"DILU_BALANCER_COMPACTION": "1", "DILU_BALANCER_COMPACTION_PERIOD_S": "1",
              # big must live until the others are placed, then go.
              "DILU_BALANCER_SCALE_TO_ZERO_AFTER_S": "10"}


async def test_a_fragmented_cluster_is_compacted_without_failed_activations(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    inventory = {"0": [gpu("GPU-a")], "1": [gpu("GPU-b")]}
    async with ProcessCluster(tmp_path, redis_server.url, inventory=inventory, env=COMPACTION) as c:
        inv0, inv1 = await c.invoker(0), await c.invoker(1)
        await c.balancer("balancer")
        api = inv0.api
        # big (12 GB) lights invoker0's GPU; steady (10 GB) does not fit beside it and lights
        # invoker1's; small (2 GB) fits both and goes beside big (the tighter fit).
        await c.create(api, "big", SLEEPER, annotations=needs("inference", 0.3, 0.5, 12000, **{"capacity-rps": 50}))
        await c.create(api, "steady", SLEEPER, annotations=needs("inference", 0.3, 0.5, 10000,
                                                                 **{"min-instances": 1}))
        await c.create(api, "small", SLEEPER, annotations=needs("inference", 0.2, 0.4, 2000,
                                                                **{"min-instances": 1, "capacity-rps": 50}))
        # A router registers a function the first time it sees it: one call each, in this order.
        for name in ("big", "steady", "small"):
            assert (await c.invoke(api, name, {"n": -1}))[0] == 200

        async def placed() -> bool:
            return {r.function for r in await c.instances()} == {"guest/big", "guest/steady", "guest/small"}

        await until(placed, 30, "three instances placed")
        where = {r.function: r.invoker for r in await c.instances()}
        assert where == {"guest/big": "invoker0", "guest/steady": "invoker1", "guest/small": "invoker0"}
        first_small = next(r.id for r in await c.instances("guest/small"))
        # big goes idle and scales to zero (10 s here): small is left alone on invoker0's
        # GPU, which it could share with steady: fragmented. small is under load all along.
        loop = asyncio.ensure_future(open_loop(c, [inv0.api, inv1.api], "small", rate=4, seconds=25,
                                               params={"sleep": 0.02}))
        began = time.monotonic()

        async def compacted() -> bool:
            rs = await c.instances()
            return {(r.function, r.invoker, r.state) for r in rs} == {
                ("guest/steady", "invoker1", "ready"), ("guest/small", "invoker1", "ready")}

        try:
            await until(compacted, 40, "small moved beside steady, invoker0 dark")
        except AssertionError:
            for d in await c.decisions():
                print("DECISION", d.kind, d.function, d.reason[:300])
            for r in await c.instances():
                print("RECORD", r)
            raise
        moved_after = time.monotonic() - began
        results = await loop
        # Nothing failed: every activation answered 200 with its own result.
        assert [status for _, status, _ in results] == [200] * len(results)
        assert sorted(r["response"]["result"]["n"] for _, _, r in results) == [n for n, _, _ in results]
        kinds = [d.kind for d in await c.decisions("guest/small")]
        assert kinds.count("move") == 1 and kinds.count("move-done") == 1, kinds
        assert "move-abandoned" not in kinds
        move = next(d for d in await c.decisions("guest/small") if d.kind == "move")
        assert move.invoker == "invoker1" and first_small in move.reason
        # steady never moved; its GPU was the target.
        assert "move" not in [d.kind for d in await c.decisions("guest/steady")]
        # The compaction's price, as the balancer counts it: one replacement started, one cold start.
        raw = await c.redis.hget(KEYS.compaction, "totals")
        totals = msgpack.unpackb(raw)
        assert totals["started"] == 1 and totals["done"] == 1 and totals["abandoned"] == 0
        assert totals["runs"] >= 1
        starts = [cmd for cmd in await c.commands("invoker1") if cmd.op == "start" and cmd.function == "guest/small"]
        assert len(starts) == 1
        print(f"compaction: 1 move, {len(starts)} cold start(s), {len(results)} activations, 0 failed, "
              f"done {moved_after:.1f} s after the load began; totals {totals}")
