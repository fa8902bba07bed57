"""Gangs (``gpu-count`` N: one instance of N ranks, one per GPU of one invoker) through the instance manager: a
real invoker (process backend, three inventory GPUs), real runtime processes that meet over a plain TCP socket at
the MASTER_ADDR:MASTER_PORT the invoker gives them, a real Redis holding the GPU budgets; the test plays the
balancer (it hands the manager its commands)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from dilu_invoker.invoker.dataplane import core
from dilu_invoker.invoker.dataplane.core import GANG_PEER_GRACE_S, GANG_PORTS, ephemeral_range, gang_port
from dilu_invoker.model import Action, ActionLimits, ActivationStatus, Exec, Parameter
from dilu_invoker.wire import CommandOp, InstanceCommand, InstanceState, StageRecord, rank_id, stage_id
from tests.invoker.test_split_instances import Node, _req, running_node, until

UUIDS = ("GPU-gang-0", "GPU-gang-1", "GPU-gang-2")
# Rank 0 listens at MASTER_ADDR:MASTER_PORT from its /init on and waits there for every other rank, which connects
# and says which rank it is (as torch.distributed's env:// store does): a gang whose ranks do not start together,
# or whose address is wrong, never gets past /init. A run meets again over those connections: each rank k > 0 sends
# rank 0 what it sees, rank 0 waits for all of them, so a run that does not reach every rank at once hangs.
# ``fail_rank`` makes that rank raise after it spoke, ``fail_early`` before (rank 0 then waits for its word, as in a
# collective the failed rank never joins); ``linger`` (rank → s) makes a rank wait that long before it returns.
CODE = '''
import json, os, socket, time

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ADDR, PORT = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DILU_RANK",
         "DILU_WORLD_SIZE", "DILU_STAGE_INDEX", "DILU_GPU_UUID")
if RANK == 0:
    server = socket.create_server((ADDR, PORT))
    server.settimeout(20)
    peers = {}
    while len(peers) < WORLD - 1:
        conn, _ = server.accept()
        conn.settimeout(20)
        f = conn.makefile("rwb")
        peers[int(f.readline())] = f
else:
    deadline = time.time() + 20
    while True:
        try:
            conn = socket.create_connection((ADDR, PORT), timeout=20)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    master = conn.makefile("rwb")
    master.write(f"{RANK}\\n".encode())
    master.flush()

def main(args):
    print(f"rank {RANK} says {args.get('word')}", flush=True)
    if args.get("fail_early") == RANK:
        raise RuntimeError(f"no luck at {RANK}")
    me = {"env": {n: os.environ.get(n) for n in NAMES}, "pid": os.getpid(), "word": args.get("word"),
          "aid": os.environ["__OW_ACTIVATION_ID"]}
    if RANK == 0:
        seen = {"0": me, **{str(k): json.loads(f.readline()) for k, f in sorted(peers.items())}}
    else:
        master.write((json.dumps(me) + "\\n").encode())
        master.flush()
        seen = {}
    if args.get("fail_rank") == RANK:
        raise RuntimeError(f"no luck at {RANK}")
    time.sleep(args.get("linger", {}).get(str(RANK), 0))
    return {"rank": RANK, "seen": seen}
'''


def _action(name: str = "trainer", gpus: int = 2, **limits: int) -> Action:
    return Action(namespace="guest", name=name, exec=Exec(kind="python:3-gpu", code=CODE),
                  limits=replace(ActionLimits(), **limits), revision="1-gang",
                  annotations=(Parameter("gpu-sm-request", 0.3), Parameter("gpu-sm-limit", 0.6),
                               Parameter("gpu-memory-mb", 4000), Parameter("gpu-count", gpus)))


def _ranks(instance: str, gpus: tuple[int, ...] = (0, 1), world: int | None = None) -> tuple[StageRecord, ...]:
    n = world or len(gpus)
    return tuple(StageRecord(id=rank_id(instance, k, n), gpu=g, gpu_uuid=UUIDS[g] if g < len(UUIDS) else None,
                             request=0.3, limit=0.6, memory_mb=4000) for k, g in enumerate(gpus))


def _start(instance: str, ranks: tuple[StageRecord, ...], action: Action) -> InstanceCommand:
    return InstanceCommand(op="start", epoch=1, instance=instance, function=action.fqn, rev=action.revision or "",
                           gpu=ranks[0].gpu if ranks else 0, gpu_uuid=ranks[0].gpu_uuid if ranks else UUIDS[0],
                           request=0.3, limit=0.6, memory_mb=sum(r.memory_mb for r in ranks) or 4000, stages=ranks)


class GangNode(Node):
    async def start_gang(self, iid: str, ranks: tuple[StageRecord, ...]) -> str:
        done = self.manager.handle(_start(iid, ranks, self.action))
        await until(lambda: self.state(iid) in (InstanceState.READY, InstanceState.FAILED), f"{iid} started")
        return done


@pytest.fixture
async def node(tmp_path: Path, redis: aioredis.Redis) -> AsyncIterator[GangNode]:
    async with running_node(tmp_path, redis, UUIDS, _action(), GangNode) as n:
        yield n


async def test_a_gang_starts_its_ranks_together_each_with_its_rank_and_the_rendezvous(node: GangNode) -> None:
    ranks = _ranks("gang-1")
    assert await node.start_gang("gang-1", ranks) == "start"
    inst = node.inst("gang-1")
    assert inst.state is InstanceState.READY, inst.failure
    assert set(inst.proxies) == {"gang-1#r0of2", "gang-1#r1of2"}
    # each rank attached on its own GPU under its own id, with the per-GPU share and memory
    for r in ranks:
        placement = inst.proxies[r.id].placement
        assert placement.gpu_key == r.id and placement.gpu is not None and placement.gpu.gpu_index == r.gpu
        budget = await node.budgets.get(r.gpu_uuid or "")
        assert budget is not None and set(budget.reservations) == {r.id}
        held = budget.reservations[r.id]
        assert (held.request, held.limit, held.memory_mb) == (0.3, 0.6, 4000)

    activation = await node.manager.run("gang-1", _req(node.action, word="hi"))
    assert activation is not None and activation.response.status is ActivationStatus.SUCCESS, activation
    result = activation.response.result
    assert result["rank"] == 0  # rank 0's result
    seen = result["seen"]
    env = {k: seen[k]["env"] for k in ("0", "1")}
    port = env["0"]["MASTER_PORT"]
    assert port is not None and int(port) > 0
    for k in (0, 1):
        assert env[str(k)] == {
            "RANK": str(k), "WORLD_SIZE": "2", "LOCAL_RANK": str(k), "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DILU_RANK": str(k), "DILU_WORLD_SIZE": "2",
            "DILU_STAGE_INDEX": None, "DILU_GPU_UUID": UUIDS[k]}, k
    # the same params and the same activation at every rank, in two processes
    assert [seen[k]["word"] for k in ("0", "1")] == ["hi", "hi"]
    assert {seen[k]["aid"] for k in ("0", "1")} == {activation.activation_id}
    assert seen["0"]["pid"] != seen["1"]["pid"]
    # one record: the logs of both ranks, each line naming its rank
    lines = [line for line in activation.logs if " says " in line]
    assert len(lines) == 2 and "stdout: [rank 0] rank 0 says hi" in lines[0] and \
        "stdout: [rank 1] rank 1 says hi" in lines[1], activation.logs
    assert activation.annotation("path") == "guest/trainer"
    again = await node.manager.run("gang-1", _req(node.action, word="again"))  # the rendezvous holds
    assert again is not None and again.response.status is ActivationStatus.SUCCESS, again
    assert [again.response.result["seen"][k]["word"] for k in ("0", "1")] == ["again", "again"]
    [report] = node.manager.reports()
    assert (report.id, report.state, report.completion_rate > 0) == ("gang-1", "ready", True)


async def test_two_gangs_get_rendezvous_ports_of_their_own(node: GangNode) -> None:
    assert await node.start_gang("gang-a", _ranks("gang-a", (0, 1))) == "start"
    assert await node.start_gang("gang-b", _ranks("gang-b", (2, 0))) == "start"
    assert node.state("gang-a") is InstanceState.READY and node.state("gang-b") is InstanceState.READY
    ports = set()
    for iid in ("gang-a", "gang-b"):
        activation = await node.manager.run(iid, _req(node.action, word=iid))
        assert activation is not None and activation.response.status is ActivationStatus.SUCCESS, activation
        ports.add(activation.response.result["seen"]["1"]["env"]["MASTER_PORT"])
    assert len(ports) == 2


async def test_a_failing_rank_fails_the_activation_named(node: GangNode) -> None:
    assert await node.start_gang("gang-2", _ranks("gang-2")) == "start"
    failed = await node.manager.run("gang-2", _req(node.action, word="x", fail_rank=1))
    assert failed is not None and failed.response.status is ActivationStatus.APPLICATION_ERROR
    assert failed.response.result == {"error": "rank 1 of 2: no luck at 1"}
    assert any("[rank 1] rank 1 says x" in line for line in failed.logs), failed.logs
    first = await node.manager.run("gang-2", _req(node.action, word="y", fail_rank=0))
    assert first is not None and first.response.result == {"error": "rank 0 of 2: no luck at 0"}
    # an application error keeps the containers: the gang serves on
    ok = await node.manager.run("gang-2", _req(node.action, word="z"))
    assert ok is not None and ok.response.status is ActivationStatus.SUCCESS, ok
    assert node.state("gang-2") is InstanceState.READY


async def test_a_rank_that_fails_while_its_peer_waits_for_it_stops_the_gang(node: GangNode) -> None:
    ranks = _ranks("gang-6")
    assert await node.start_gang("gang-6", ranks) == "start"
    inst = node.inst("gang-6")
    pids = [node.pid(r.id) for r in ranks]
    containers = [p.name for p in inst.proxies.values()]
    began = time.monotonic()
    # rank 1 fails before it speaks: rank 0 waits for its word (20 s, the action's limit is 60 s)
    failed = await node.manager.run("gang-6", _req(node.action, word="x", fail_early=1))
    assert time.monotonic() - began < 10  # at once: the grace and the teardown are no part of the activation
    assert failed is not None and failed.response.status is ActivationStatus.APPLICATION_ERROR
    assert failed.response.result == {"error": "rank 1 of 2: no luck at 1"}
    behind = asyncio.ensure_future(node.manager.run("gang-6", _req(node.action, word="y")))  # waits for rank 0
    # rank 0 is still running after the grace: the gang is broken and stopped whole, as when a rank dies
    await until(lambda: node.state("gang-6") is InstanceState.FAILED, "gang-6 failed", timeout_s=15)
    assert inst.failure is not None and inst.failure.reason == (
        "rank 0 of 2: container removed: rank 1 of 2 failed and rank 0 did not finish within "
        f"{GANG_PEER_GRACE_S:g} s: gang stopped"), inst.failure
    await until(lambda: not any(c in node.invoker.pool.containers for c in containers), "ranks stopped", 15)
    await until(lambda: not any(_alive(pid) for pid in pids), "ranks' processes gone", 15)

    async def released() -> bool:
        return all([await node.reservations(r.gpu_uuid or "") == {} for r in ranks])

    await until(released, "both ranks' reservations released", 15)
    # the activation behind it is not kept waiting until rank 0's wait ends: the failed gang takes no work
    assert await asyncio.wait_for(behind, 10) is None
    assert time.monotonic() - began < 19  # all of it before rank 0 would have given up waiting (20 s)
    [report] = node.manager.reports()
    assert report.state == "failed" and "gang stopped" in report.error
    # the balancer's next gang on those GPUs serves
    assert await node.start_gang("gang-7", _ranks("gang-7")) == "start"
    ok = await node.manager.run("gang-7", _req(node.action, word="anew"))
    assert ok is not None and ok.response.status is ActivationStatus.SUCCESS, ok


async def test_a_rank_that_fails_while_its_peer_finishes_in_the_grace_keeps_the_gang(node: GangNode) -> None:
    ranks = _ranks("gang-8")
    assert await node.start_gang("gang-8", ranks) == "start"
    inst = node.inst("gang-8")
    containers = {part: p.name for part, p in inst.proxies.items()}
    # rank 1 fails after it spoke; rank 0 returns a little later, well within the grace
    failed = await node.manager.run("gang-8", _req(node.action, word="x", fail_rank=1, linger={"0": 0.5}))
    assert failed is not None and failed.response.result == {"error": "rank 1 of 2: no luck at 1"}
    await asyncio.sleep(GANG_PEER_GRACE_S + 1.0)  # the grace is over
    assert node.state("gang-8") is InstanceState.READY, inst.failure
    assert {part: p.name for part, p in inst.proxies.items()} == containers
    assert all(name in node.invoker.pool.containers for name in containers.values())
    ok = await node.manager.run("gang-8", _req(node.action, word="z"))
    assert ok is not None and ok.response.status is ActivationStatus.SUCCESS, ok
    assert [ok.response.result["seen"][k]["word"] for k in ("0", "1")] == ["z", "z"]


async def test_a_dead_rank_fails_the_gang_and_releases_every_rank(node: GangNode) -> None:
    ranks = _ranks("gang-3")
    assert await node.start_gang("gang-3", ranks) == "start"
    for r in ranks:
        assert r.id in await node.reservations(r.gpu_uuid or "")
    inst = node.inst("gang-3")
    other = inst.proxies[ranks[0].id]
    os.kill(node.pid(ranks[1].id), signal.SIGKILL)
    await until(lambda: node.state("gang-3") is InstanceState.FAILED, "gang-3 failed")
    assert inst.failure is not None and inst.failure.reason.startswith("rank 1 of 2: container removed"), \
        inst.failure
    await until(lambda: other.name not in node.invoker.pool.containers, "rank 0 stopped")

    async def released() -> bool:
        return all([await node.reservations(r.gpu_uuid or "") == {} for r in ranks])

    await until(released, "both ranks' reservations released")
    assert await node.manager.run("gang-3", _req(node.action)) is None  # a failed instance takes no work
    [report] = node.manager.reports()
    assert report.state == "failed" and "rank 1 of 2" in report.error


async def test_a_stop_releases_every_rank(node: GangNode) -> None:
    ranks = _ranks("gang-4", (1, 2))
    assert await node.start_gang("gang-4", ranks) == "start"
    containers = [p.name for p in node.inst("gang-4").proxies.values()]
    assert node.manager.handle(InstanceCommand(op="stop", epoch=1, instance="gang-4", function="guest/trainer",
                                               reason="scaled in")) == "stop"
    await until(lambda: "gang-4" not in node.manager.instances, "gang-4 stopped")
    await until(lambda: not any(c in node.invoker.pool.containers for c in containers), "rank containers gone")
    for u in UUIDS:
        assert await node.reservations(u) == {}


async def test_a_stage_move_of_a_gang_is_refused(node: GangNode) -> None:
    ranks = _ranks("gang-5")
    assert await node.start_gang("gang-5", ranks) == "start"
    moved = (ranks[0], replace(ranks[1], id=f"{ranks[1].id}.1", gpu=2, gpu_uuid=UUIDS[2]))
    changes = 0

    def changed() -> None:
        nonlocal changes
        changes += 1

    node.manager.on_change = changed
    assert node.manager.handle(InstanceCommand(op=CommandOp.MOVE_STAGE, epoch=1, instance="gang-5",
                                               function="guest/trainer", stages=moved)) == "refused"
    inst = node.inst("gang-5")
    assert inst.move is None and "is a gang of 2 ranks" in inst.move_failed and changes == 1, inst.move_failed
    assert {part: p.placement.gpu_key for part, p in inst.proxies.items()} == {r.id: r.id for r in ranks}
    assert inst.cmd.stages == ranks and node.state("gang-5") is InstanceState.READY
    [report] = node.manager.reports()
    assert "is a gang" in report.move_failed
    ok = await node.manager.run("gang-5", _req(node.action, word="still"))
    assert ok is not None and ok.response.status is ActivationStatus.SUCCESS, ok


@pytest.mark.parametrize(("ranks", "reason"), [
    ((), "annotation 'gpu-count' 2 makes each instance a gang of 2 ranks, got one GPU"),
    (tuple(StageRecord(id=stage_id("bad", k), gpu=k, gpu_uuid=UUIDS[k], request=0.3, limit=0.6, memory_mb=4000)
           for k in range(2)),
     "annotation 'gpu-count' 2 makes each instance a gang of 2 ranks, got 2 pipeline stages"),
    (_ranks("bad", (0, 1), world=3), "invalid gang: its ranks' ids must be rank 0 to 1 of 2 of bad"),
    (_ranks("bad", (0, 0)), "invalid gang: each rank needs a GPU of its own, got GPUs [0, 0]"),
    (_ranks("bad", (0, 3)), "invalid gang: rank 1 is placed on GPU 3, which this invoker does not have"),
], ids=["one-gpu", "as-stages", "ids-of-another-size", "duplicate-gpu", "out-of-range"])
async def test_a_bad_gang_start_fails_clearly(node: GangNode, ranks: tuple[StageRecord, ...], reason: str) -> None:
    assert node.manager.handle(_start("bad", ranks, node.action)) == "start"
    await until(lambda: node.state("bad") is InstanceState.FAILED, "bad failed")
    inst = node.inst("bad")
    assert inst.failure is not None and reason in inst.failure.reason, inst.failure
    assert not node.invoker.pool.containers  # nothing was started for it
    assert await node.manager.run("bad", _req(node.action)) is None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_gang_port_lies_below_the_ephemeral_range_free_and_not_picked_lately(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel hands ephemeral ports to outgoing connections at any time: a gang's port comes from below that
    range (`GANG_PORTS`), is bindable on every interface when picked, and is not picked again while rank 0 may not
    have bound it yet. Where the range leaves no room below it, the kernel's pick (`bind(0)`) is the fallback."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert ephemeral_range(str(ranges)) == (32768, 60999)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    ports = [gang_port((32768, 60999)) for _ in range(100)]
    assert all(GANG_PORTS[0] <= p < 32768 for p in ports) and len(set(ports)) == 100
    # Ports other sockets hold are never picked: 255 of a window of 256 held here, the window made GANG_PORTS.
    window = range(24000, 24256)
    held: list[socket.socket] = []
    try:
        for port in window[1:]:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            with contextlib.suppress(OSError):  # (one some other process holds is just as taken)
                sock.bind(("", port))
        monkeypatch.setattr(core, "GANG_PORTS", (window[0], window[-1]))
        picked = [gang_port((window[-1] + 1, 60999)) for _ in range(20)]
        assert not set(picked) & set(window[1:])  # the free one, or (64 draws missed it) the kernel's pick
    finally:
        for sock in held:
            sock.close()
    ranges.write_text("1024 65535\n")  # no room below the range: the kernel's pick
    low = ephemeral_range(str(ranges))
    assert low == (1024, 65535)
    fallback = gang_port(low)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", fallback))  # free when picked
