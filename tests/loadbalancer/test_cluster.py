"""The balancer with real invoker processes and a real Redis (GPU inventory files stand in for GPUs).

Every invoker is a ``dilu-invoker standalone --invokers 1 --id K --no-standalone-balancer`` process (own
REST API, pool, endpoints); balancers are ``dilu-invoker balancer`` processes. Windows are short
(``lb_support.cluster.FAST``) so scaling shows in seconds. Outcomes are checked, not speeds: scaling is
judged by the decisions taken and their triggers, failures by every activation being answered once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from lb_support.cluster import ProcessCluster, open_loop, until

from dilu_invoker.redis_embedded import EmbeddedRedis

pytestmark = pytest.mark.slow

SLEEPER = ("import os, time\n"
           "def main(a):\n"
           "    time.sleep(a.get('sleep', 0))\n"
           "    if a.get('log'):\n"
           "        with open(a['log'], 'a') as f:\n"
           "            f.write(os.environ['__OW_ACTIVATION_ID'] + '\\n')\n"
           "    return {'n': a.get('n'), 'pid': os.getpid()}\n")


def gpu(uuid: str, memory_mb: int = 16000) -> dict[str, object]:
    return {"uuid": uuid, "memory_mb": memory_mb, "sm_count": 132}


def needs(cls: str, request: float, limit: float, memory_mb: int, **more: object) -> dict[str, object]:
    return {"gpu-class": cls, "gpu-sm-request": request, "gpu-sm-limit": limit, "gpu-memory-mb": memory_mb, **more}


async def test_complementary_placement_and_spread(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    inventory = {"0": [gpu("GPU-a")], "1": [gpu("GPU-b")]}
    # Placement, not scaling: with FAST's 4 s, train (invoked first) could scale to zero while the next two
    # cold-start on a loaded machine, and infer2 would then be placed beside no one (seen in a full run).
    keep = {"DILU_BALANCER_SCALE_TO_ZERO_AFTER_S": "120"}
    async with ProcessCluster(tmp_path, redis_server.url, inventory=inventory, env=keep) as c:
        inv0, inv1 = await c.invoker(0), await c.invoker(1)
        await c.balancer("balancer")
        api = inv0.api
        await c.create(api, "train", SLEEPER, annotations=needs("training", 0.4, 0.6, 10000))
        await c.create(api, "infer1", SLEEPER, annotations=needs("inference", 0.4, 0.6, 10000))
        await c.create(api, "infer2", SLEEPER, annotations=needs("inference", 0.2, 0.4, 4000))
        await c.create(api, "spready", SLEEPER, annotations=needs("inference", 0.1, 0.2, 1000, **{"min-instances": 2}))
        for name in ("train", "infer1", "infer2"):
            status, record = await c.invoke(api, name, {"n": 1})
            assert status == 200 and record["response"]["result"]["n"] == 1
        where = {r.function: (r.invoker, r.gpu) for r in await c.instances()}
        # Training lit invoker0's GPU; the first inference function did not fit beside it (memory) and lit
        # invoker1's. The second inference function fits on both lit GPUs equally well (same Σ request and
        # memory after placing) and goes beside the training job: complementary neighbours.
        assert where == {"guest/train": ("invoker0", 0), "guest/infer1": ("invoker1", 0),
                         "guest/infer2": ("invoker0", 0)}
        place = next(d for d in await c.decisions("guest/infer2") if d.kind == "place")
        assert "complementarity 80.0" in place.reason  # beside the other inference function: 20
        # min-instances 2: the two instances land on different invokers (best fit alone would stack them).
        status, _ = await c.invoke(inv1.api, "spready", {"n": 2})
        assert status == 200

        async def two() -> bool:
            return len(await c.instances("guest/spready")) == 2

        await until(two, 10, "two spready instances")
        spread = await c.instances("guest/spready")
        assert sorted(r.invoker for r in spread) == ["invoker0", "invoker1"]
        assert any("spread: kept off" in d.reason for d in await c.decisions("guest/spready"))


async def test_scaling_follows_sustained_load_not_bursts(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    inventory = {"0": [gpu("GPU-a")], "1": [gpu("GPU-b")]}
    async with ProcessCluster(tmp_path, redis_server.url, inventory=inventory) as c:
        inv0, inv1 = await c.invoker(0), await c.invoker(1)
        await c.balancer("balancer")
        apis = [inv0.api, inv1.api]
        fn = "guest/scaled"
        # The profile says one instance serves 4 requests/s at its limit.
        await c.create(inv0.api, "scaled", SLEEPER, annotations=needs("inference", 0.1, 0.2, 1000,
                                                                      **{"capacity-rps": 4}))
        assert (await c.invoke(inv0.api, "scaled", {"n": 0}))[0] == 200  # cold start: one instance
        await asyncio.sleep(1.5)

        def triggers(ds: list) -> list[str]:  # type: ignore[type-arg]
            return [d.kind for d in ds if d.kind.startswith("scale")]

        assert triggers(await c.decisions(fn)) == ["scale-out"]
        # A burst: 15 requests/s for 0.8 s, well above one instance's capacity, then quiet.
        burst = await open_loop(c, apis, "scaled", rate=15, seconds=0.8, params={"sleep": 0.05}, start_n=100)
        assert all(status == 200 for _, status, _ in burst)
        await asyncio.sleep(2.5)
        assert triggers(await c.decisions(fn)) == ["scale-out"], "a burst must not scale out"
        assert len(await c.instances(fn)) == 1
        # Sustained: 12 requests/s for 6 s (three instances' worth).
        load = await open_loop(c, apis, "scaled", rate=12, seconds=6, params={"sleep": 0.05}, start_n=1000)
        assert [status for _, status, _ in load] == [200] * len(load)
        assert sorted(r["response"]["result"]["n"] for _, _, r in load) == [n for n, _, _ in load]
        outs = [d for d in await c.decisions(fn) if d.kind == "scale-out"]
        assert len(outs) >= 2 and "sustained load" in outs[1].reason
        placed = len([d for d in await c.decisions(fn) if d.kind == "place"])
        # The cold start, then at least one more (up to 12/4 = 3 once the windowed rate has caught up with
        # the load; within 6 s it measures 8-12 requests/s, so 2 or 3 instances).
        assert 2 <= placed <= 3, [(d.kind, d.reason[:90]) for d in await c.decisions(fn)]
        # Idle: one instance at a time goes (sustained underload), then the last one after the idle time.

        async def none_left() -> bool:
            return not await c.instances(fn)

        await until(none_left, 30, "scale-in to zero")
        ins = [d for d in await c.decisions(fn) if d.kind == "scale-in"]
        assert any("sustained underload" in d.reason for d in ins)
        assert "no work" in ins[-1].reason
        assert len([d for d in await c.decisions(fn) if d.kind == "stop"]) == placed
        table = await c.route(fn)
        assert table is not None and table.instances == ()


async def test_leader_failover_without_double_decisions(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    async with ProcessCluster(tmp_path, redis_server.url, inventory={"0": [gpu("GPU-a")]}) as c:
        inv0 = await c.invoker(0)
        first = await c.balancer("balancer-a")

        async def a_leads() -> bool:
            return await c.leader_pid() == first.holder_pid

        await until(a_leads, 10, "balancer-a leading")
        second = await c.balancer("balancer-b")
        await c.create(inv0.api, "warm", SLEEPER, annotations=needs("inference", 0.2, 0.4, 1000,
                                                                    **{"min-instances": 1}))
        await c.create(inv0.api, "cold", SLEEPER, annotations=needs("inference", 0.2, 0.4, 1000))
        await c.create(inv0.api, "cold2", SLEEPER, annotations=needs("inference", 0.2, 0.4, 1000))
        assert (await c.invoke(inv0.api, "warm", {"n": 1}))[0] == 200
        _, epoch_a = await c.leader() or ("", 0)

        # The leader dies; an activation of a function without instance arrives meanwhile.
        killed = time.monotonic()
        first.signal(signal.SIGKILL)
        cold = asyncio.create_task(c.invoke(inv0.api, "cold", {"n": 2}))

        async def b_leads() -> bool:
            return await c.leader_pid() == second.holder_pid

        await until(b_leads, 10, "balancer-b leading")
        takeover_s = time.monotonic() - killed
        assert takeover_s < 3.0, f"standby took {takeover_s:.1f} s"
        status, record = await asyncio.wait_for(cold, 30)
        assert status == 200 and record["response"]["result"]["n"] == 2
        _, epoch_b = await c.leader() or ("", 0)
        assert epoch_b == epoch_a + 1

        # The new leader froze (SIGSTOP) past its lease: a third balancer takes over; work goes on.
        third = await c.balancer("balancer-c")
        second.signal(signal.SIGSTOP)

        async def c_leads() -> bool:
            return await c.leader_pid() == third.holder_pid

        await until(c_leads, 10, "balancer-c leading")
        assert (await c.invoke(inv0.api, "cold2", {"n": 3}))[0] == 200
        # The frozen leader wakes with a stale view (it never saw cold2's instance, which it would stop as
        # unknown): its lease is gone, so it writes nothing.
        second.signal(signal.SIGCONT)
        await asyncio.sleep(2.0)
        assert await c.leader_pid() == third.holder_pid
        assert any(line.get("event") == "balancer no longer leads" for line in second.lines())

        commands = await c.commands("invoker0")
        starts = Counter(cmd.function for cmd in commands if cmd.op == "start")
        assert starts == {"guest/warm": 1, "guest/cold": 1, "guest/cold2": 1}
        assert not [cmd for cmd in commands if cmd.op == "stop"]
        epochs = [cmd.epoch for cmd in commands]
        assert epochs == sorted(epochs) and epochs[0] == epoch_a and epochs[-1] == epoch_b + 1
        assert len(await c.instances()) == 3


async def test_invoker_killed_mid_load_loses_nothing(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    # invoker0 has no GPU (it only receives); invoker1 and invoker2 hold the instances. Small GPUs force
    # the two instances onto different invokers and the replacement onto invoker2's second GPU.
    inventory = {"0": [], "1": [gpu("GPU-b", 3000)], "2": [gpu("GPU-c", 3000), gpu("GPU-d", 3000)]}
    # The action records each run in one host file shared by all its containers, which container
    # isolation exists to forbid: this test runs them as the invokers' user.
    async with ProcessCluster(tmp_path, redis_server.url, inventory=inventory,
                              env={"DILU_INVOKER_PROCESS_ISOLATION": "off"}) as c:
        inv0, inv1 = await c.invoker(0), await c.invoker(1)
        await c.invoker(2)
        await c.balancer("balancer")
        await c.create(inv0.api, "sturdy", SLEEPER, annotations=needs("inference", 0.2, 0.4, 2000,
                                                                      **{"min-instances": 2}))
        fn = "guest/sturdy"
        assert (await c.invoke(inv0.api, "sturdy", {"n": -1}))[0] == 200

        async def both_ready() -> bool:
            table = await c.route(fn)
            return table is not None and len(table.instances) == 2

        await until(both_ready, 15, "two ready instances")
        assert sorted(r.invoker for r in await c.instances(fn)) == ["invoker1", "invoker2"]
        ran = tmp_path / "ran.txt"
        results: list[tuple[int, int, dict]] = []  # type: ignore[type-arg]
        stop_at = time.monotonic() + 7.0

        async def client(k: int) -> None:
            n = k * 10_000
            while time.monotonic() < stop_at:
                status, record = await c.invoke(inv0.api, "sturdy", {"n": n, "sleep": 0.2, "log": str(ran)})
                results.append((n, status, record))
                n += 1

        clients = [asyncio.create_task(client(k)) for k in range(6)]
        await asyncio.sleep(2.5)
        inv1.signal(signal.SIGKILL)
        await asyncio.gather(*clients)

        assert len(results) > 30
        bad = [(n, s, r.get("response")) for n, s, r in results if s != 200 or r["response"]["result"]["n"] != n]
        assert not bad
        ids = [r["activationId"] for _, _, r in results]
        assert len(set(ids)) == len(ids)
        completed = Counter(ran.read_text().split())
        assert set(completed) == set(ids)  # every activation ran to completion...
        # ...once, except possibly the one invoker1 was running when it died: if its code had finished but
        # its result was not yet handed back, the origin took it back and it ran again on invoker2.
        taken_back = {line["activation_id"] for line in inv0.lines()
                      if line.get("event") == "forwarded activation taken back from a gone invoker"}
        twice = {aid for aid, k in completed.items() if k > 1}
        assert twice <= taken_back and len(twice) <= 1 and max(completed.values()) <= 2

        async def replaced() -> bool:
            rs = await c.instances(fn)
            return len(rs) == 2 and all(r.invoker == "invoker2" and r.state == "ready" for r in rs)

        await until(replaced, 15, "the lost instance re-placed on invoker2")
        lost = [d for d in await c.decisions(fn) if d.kind == "lost"]
        assert lost and lost[0].invoker == "invoker1"
        assert "invoker1" not in await c.live()
