"""The node's side of shared weights: `GpuNode.attach(..., revision=)` reserves a function revision's
`gpu-weights-mb` once per GPU in Redis and in its local view, places an instance that fits only beside its
weights, keeps each instance's shim cap at its whole `gpu-memory-mb` (a mapping instance takes over as the
holder when the holder goes), and re-syncs a group with one carrier."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from dilu_invoker.gpu import abi
from dilu_invoker.gpu.budgets import GpuBudget, GpuBudgets
from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.model import GpuClass, GpuNeeds, ValidationError, weights_group
from tests.gpu.support import ShimBuild

NodeFactory = Callable[..., Coroutine[Any, Any, GpuNode]]
LLM = "guest/llm"


def gpu(index: int = 0, memory_mb: int = 10_000) -> GpuDevice:
    return GpuDevice(index=index, uuid=f"GPU-wn-{index}", name="Test GPU", memory_mb=memory_mb, sm_count=132,
                     simulated=True)


def llm(memory_mb: int = 6000, weights_mb: int = 5000) -> GpuNeeds:
    return GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.1, sm_limit=0.2, memory_mb=memory_mb,
                    weights_mb=weights_mb)


@pytest.fixture
async def make_node(tmp_path: Path, shim_build: ShimBuild) -> AsyncIterator[NodeFactory]:
    nodes: list[GpuNode] = []

    async def make(devices: tuple[GpuDevice, ...] = (gpu(),), **kw: Any) -> GpuNode:
        node = GpuNode(node="invoker0", devices=devices, shm_dir=tmp_path / "shm", shim_library=shim_build.library,
                       **kw)
        await node.start()
        nodes.append(node)
        return node

    yield make
    for n in nodes:
        await n.close()


async def _budget(budgets: GpuBudgets, uuid: str = "GPU-wn-0") -> GpuBudget:
    got = await budgets.get(uuid)
    assert got is not None
    return got


async def test_instances_of_one_revision_share_their_weights_in_the_budget(make_node: NodeFactory,
                                                                           redis: aioredis.Redis) -> None:
    budgets = GpuBudgets(redis, prefix="twn:")
    node = await make_node(budgets=budgets)
    first = await node.attach("a", LLM, llm(), revision="1-abc")
    second = await node.attach("b", LLM, llm(), revision="1-abc")
    assert first is not None and second is not None and second.gpu_index == first.gpu_index
    budget = await _budget(budgets)
    assert budget.sum_memory_mb == 7000  # 6000 + 6000 − 5000 of weights
    assert {n: r.memory_mb for n, r in budget.reservations.items()} == {"a": 6000, "b": 1000}
    # Each instance's shim cap stays its whole need: the mapped weights are not its allocations (the shim
    # does not count cuIpcOpenMemHandle), and when the holder goes a mapping instance loads them itself.
    for att in (first, second):
        with abi.ControlFile.open(att.env["DILU_SHIM_CONTROL"]) as control:
            assert control.read().quota.mem_cap_bytes == 6000 << 20
    # Another revision has other weights: a copy of its own, which does not fit.
    with capture_logs() as logs:
        assert await node.attach("c", LLM, llm(), revision="2-def") is None
    assert any("memory 7000 + 6000 MiB > 10000 MiB" in e.get("reason", "") for e in logs)
    # Without a revision nothing is shared (a function's instances may run different code).
    assert await node.attach("d", LLM, llm()) is None
    # The holder leaves first: the weights stay counted for the instance that maps them.
    await node.detach("a")
    budget = await _budget(budgets)
    assert {n: r.memory_mb for n, r in budget.reservations.items()} == {"b": 6000}
    assert await node.attach("e", LLM, llm(), revision="1-abc") is not None
    assert (await _budget(budgets)).sum_memory_mb == 7000
    await node.detach("b")
    await node.detach("e")
    assert (await _budget(budgets)).sum_memory_mb == 0


async def test_an_instance_that_fits_only_beside_its_weights_is_placed_there(make_node: NodeFactory,
                                                                             redis: aioredis.Redis) -> None:
    budgets = GpuBudgets(redis, prefix="twn:")
    node = await make_node(devices=(gpu(0), gpu(1)), budgets=budgets)
    assert (await node.attach("a", LLM, llm(), revision="1", gpu_index=0)) is not None
    assert (await node.attach("other", "guest/other", llm(memory_mb=8000, weights_mb=0), gpu_index=1)) is not None
    # A whole copy fits on neither GPU (6000 + 6000, 8000 + 6000 > 10000); beside its weights it needs 1000.
    with capture_logs() as logs:
        placed = await node.attach("b", LLM, llm(), revision="1")
    assert placed is not None and placed.gpu_index == 0
    attached = [e for e in logs if e["event"] == "GPU attached"]
    assert "its 5000 MB of weights shared there" in attached[0]["reason"]
    assert (await _budget(budgets, "GPU-wn-0")).sum_memory_mb == 7000
    # With GPU 1 empty a whole copy would fit there; the GPU that holds the weights still comes first.
    await node.detach("other")
    third = await node.attach("c", LLM, llm(), revision="1")
    assert third is not None and third.gpu_index == 0
    assert (await _budget(budgets, "GPU-wn-0")).sum_memory_mb == 8000
    # Another revision has no weights anywhere: a whole copy, where it fits (GPU 1).
    other_rev = await node.attach("d", LLM, llm(), revision="2")
    assert other_rev is not None and other_rev.gpu_index == 1


async def test_a_balancer_reserved_instance_is_re_reserved_with_its_share(make_node: NodeFactory,
                                                                           redis: aioredis.Redis) -> None:
    from dilu_invoker.gpu.budgets import Reservation

    budgets = GpuBudgets(redis, prefix="twn:")
    node = await make_node(devices=(gpu(memory_mb=13_000),), budgets=budgets)
    assert await node.attach("a", LLM, llm(), revision="1") is not None
    # The leader reserves a new instance with its whole memory (it knows no weights) before its start ...
    placed = await budgets.reserve("GPU-wn-0", Reservation(instance="inst-2", function=LLM, cls="inference",
                                                           invoker="invoker0", request=0.1, limit=0.2,
                                                           memory_mb=6000), ttl_s=30)
    assert placed.ok and placed.sum_memory_mb == 12_000
    # ... and the invoker's attach under that id re-reserves it with the weights shared.
    assert await node.attach("inst-2", LLM, llm(), gpu_index=0, revision="1") is not None
    budget = await _budget(budgets)
    assert budget.reservations["inst-2"].memory_mb == 1000 and budget.sum_memory_mb == 7000


async def test_docker_containers_reserve_a_copy_each(make_node: NodeFactory, redis: aioredis.Redis) -> None:
    # Each container has its own network namespace: the models API cannot share there, so neither does the
    # budget.
    budgets = GpuBudgets(redis, prefix="twn:")
    node = await make_node(devices=(gpu(memory_mb=13_000),), budgets=budgets, backend="docker")
    assert await node.attach("a", LLM, llm(), revision="1") is not None
    assert await node.attach("b", LLM, llm(), revision="1") is not None
    assert (await _budget(budgets)).sum_memory_mb == 12_000


async def test_two_invokers_on_one_gpu_reserve_a_copy_each(make_node: NodeFactory, redis: aioredis.Redis,
                                                             tmp_path: Path) -> None:
    # Each invoker derives its own models keys: its instances cannot map the other invoker's weights.
    n0 = await make_node(devices=(gpu(memory_mb=20_000),), budgets=GpuBudgets(redis, prefix="twn:"))
    n1 = GpuNode(node="invoker1", devices=(gpu(memory_mb=20_000),), shm_dir=tmp_path / "shm1",
                 shim_library=None, budgets=GpuBudgets(redis, prefix="twn:"))
    await n1.start()
    try:
        for node, name in ((n0, "a"), (n1, "b"), (n0, "c"), (n1, "d")):
            assert await node.attach(name, LLM, llm(), revision="1") is not None
        budget = await _budget(GpuBudgets(redis, prefix="twn:"))
        assert budget.sum_memory_mb == 2 * 6000 + 2 * 1000
        assert {n for n, r in budget.reservations.items() if not r.shares_weights} == {"a", "b"}
    finally:
        await n1.close()


async def test_concurrent_attaches_reserve_the_weights_once(make_node: NodeFactory, redis: aioredis.Redis) -> None:
    budgets = GpuBudgets(redis, prefix="twn:")
    node = await make_node(budgets=budgets)
    results = await asyncio.gather(*(node.attach(f"i{k}", LLM, llm(), revision="1") for k in range(8)))
    # 6000 + k × 1000 ≤ 10000: 5 instances.
    assert sum(r is not None for r in results) == 5
    budget = await _budget(budgets)
    assert budget.sum_memory_mb == 10_000
    assert sum(not r.shares_weights for r in budget.reservations.values()) == 1


async def test_the_local_view_counts_the_weights_once_without_redis(make_node: NodeFactory) -> None:
    node = await make_node(budgets=None)
    assert await node.attach("a", LLM, llm(), revision="1") is not None
    assert await node.attach("b", LLM, llm(), revision="1") is not None
    assert await node.attach("c", LLM, llm(), revision="1") is not None  # 8000
    with capture_logs() as logs:
        assert await node.attach("d", LLM, llm(), revision="2") is None
    assert any("memory 8000 + 6000 MiB > 10000 MiB" in e.get("reason", "") for e in logs)
    with capture_logs() as logs:  # the balancer's choice: admitted against the local view alone
        assert await node.attach("d", LLM, llm(), revision="2", gpu_index=0) is None
    assert any("GPU 0: memory would reach 14000 MB > 10000 MB" in e.get("reason", "") for e in logs)
    assert await node.attach("d", LLM, llm(), revision="1", gpu_index=0) is not None  # 9000
    await node.detach("d")
    await node.detach("a")  # the holder left: the others still count the weights once
    assert await node.attach("d", "guest/f", llm(memory_mb=3001, weights_mb=0)) is None  # 7000 + 3001
    assert await node.attach("e", "guest/f", llm(memory_mb=3000, weights_mb=0)) is not None


async def test_a_preloaded_share_taken_by_a_revision_shares_its_weights(make_node: NodeFactory,
                                                                        redis: aioredis.Redis) -> None:
    budgets = GpuBudgets(redis, prefix="twn:")
    node = await make_node(budgets=budgets)
    assert await node.attach("a", LLM, llm(), revision="1") is not None
    pre = await node.attach("pre", "preload:python:3-gpu", GpuNeeds(sm_request=0.01, sm_limit=0.05, memory_mb=1024))
    assert pre is not None
    assert await node.retarget("pre", LLM, llm(), new_id="b", revision="1")
    budget = await _budget(budgets)
    assert {n: r.memory_mb for n, r in budget.reservations.items()} == {"a": 6000, "b": 1000}


async def test_a_resync_after_lost_reservations_restores_one_carrier(make_node: NodeFactory,
                                                                     redis: aioredis.Redis) -> None:
    budgets = GpuBudgets(redis, prefix="twn:")
    node = await make_node(budgets=budgets, sync_period_s=3600)
    for name in ("a", "b", "c"):
        assert await node.attach(name, LLM, llm(memory_mb=3000, weights_mb=2000), revision="1") is not None
    await redis.delete(budgets.gpu_key("GPU-wn-0"))  # Redis restarted without persistence
    await node._sync_once()  # the renewal finds them gone; registers the GPU and reconciles
    await node._sync_once()
    budget = await _budget(budgets)
    assert set(budget.reservations) == {"a", "b", "c"} and budget.sum_memory_mb == 5000
    assert sum(not r.shares_weights for r in budget.reservations.values()) == 1


@pytest.mark.parametrize(("raw", "ok"), [({"gpu-weights-mb": 3000}, True), ({"gpu-weights-mb": 5000}, False),
                                        ({"gpu-weights-mb": -1}, False), ({"gpu-weights-mb": 1.5}, False)])
def test_the_weights_annotation(raw: dict[str, object], ok: bool) -> None:
    annotations = {"gpu-memory-mb": 4096, **raw}
    if ok:
        assert GpuNeeds.from_annotations(annotations).weights_mb == 3000
    else:
        with pytest.raises(ValidationError, match="gpu-weights-mb"):
            GpuNeeds.from_annotations(annotations)
    assert GpuNeeds.from_annotations({}).weights_mb == 0


HOLD = ("import os, time\ndef main(args):\n    time.sleep(float(args.get('hold_s', 0)))\n"
        "    return {'gpu': os.environ.get('DILU_GPU_UUID'), 'pid': os.getpid()}\n")


async def test_through_the_invoker_two_instances_of_a_revision_fit_beside_one_copy(
        tmp_path: Path, shim_build: ShimBuild, redis: aioredis.Redis) -> None:
    from dataclasses import replace

    from dilu_invoker import config
    from dilu_invoker.invoker.dataplane.core import open_invoker
    from dilu_invoker.model import GUEST_IDENTITY, Action, ActivationRequest, Exec, Parameter, new_activation_id

    inventory = tmp_path / "gpus.json"
    inventory.write_text('[{"uuid": "GPU-wi-0", "memory_mb": 10000}]')
    base = config.load(environ={})
    cfg = replace(base, gpu=replace(base.gpu, inventory=str(inventory), shm_dir=str(tmp_path / "shm"),
                                    shim_path=str(shim_build.library)),
                  redis=replace(base.redis, prefix="twi:"))
    annotations = {"gpu-memory-mb": 6000, "gpu-weights-mb": 5000, "gpu-sm-request": 0.1, "gpu-sm-limit": 0.2}
    action = Action(namespace="guest", name="llm", exec=Exec(kind="python:3-gpu", code=HOLD), revision="1-abc",
                    annotations=tuple(Parameter(k, v) for k, v in annotations.items()))
    async with open_invoker(cfg, redis=redis) as inv:
        # Two activations at once: two containers; two whole copies (12000 MB) would not fit the GPU.
        results = await asyncio.gather(*(inv.run(ActivationRequest(
            activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY, content={"hold_s": 1.0}))
            for _ in range(2)))
        got = [r.response.result for r in results]
        assert len({g["pid"] for g in got}) == 2
        assert [g["gpu"] for g in got] == ["GPU-wi-0", "GPU-wi-0"]  # both on the GPU, neither on the CPU
        budget = await _budget(GpuBudgets(redis, prefix="twi:"), "GPU-wi-0")
        assert budget.sum_memory_mb == 7000


def test_clients_whose_pids_read_the_same_count_every_copy() -> None:
    """Isolated MPS clients whose workers have the same PID in their namespaces could not map each other's
    weights on the H200 (CUDA error 201) and each loaded its own copy: there the budget counts every copy.
    With the sandbox's PID ranges (a kernel with ``ns_last_pid``) they mapped, and the copy counts once."""
    from dilu_invoker.gpu.node import _weights_of

    needs = GpuNeeds(memory_mb=20000, weights_mb=14000)
    assert _weights_of("invoker0", "guest/m", needs, "1-abc", "process") == (
        weights_group("invoker0", "guest/m", "1-abc"), 14000)
    assert _weights_of("invoker0", "guest/m", needs, "1-abc", "process", same_pids=True) is None
    assert _weights_of("invoker0", "guest/m", needs, "1-abc", "docker") is None
    assert _weights_of("invoker0", "guest/m", needs, None, "process") is None  # no revision: no sharing


@pytest.mark.parametrize("distinct_pids", [True, False])
async def test_the_backend_says_whether_isolated_mps_clients_can_share(make_node: NodeFactory, redis: aioredis.Redis,
                                                                       tmp_path: Path, distinct_pids: bool) -> None:
    """Between MPS clients kept apart by PID namespaces (one uid per GPU's daemon) the weights count once only
    when the backend gives its containers PIDs of their own (`ProcessBackend.distinct_pids`)."""
    from dilu_invoker.gpu.mps import MpsMode, MpsSupervisor

    fake = str(Path(__file__).resolve().parent / "fakes" / "nvidia-cuda-mps-control")
    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, "GPU-wn-0"),), control=fake,
                        check_every_s=3600, shared_uid=True)
    budgets = GpuBudgets(redis, prefix=f"tdp{int(distinct_pids)}:")
    node = await make_node(budgets=budgets, mps=sup, distinct_pids=distinct_pids)
    assert node.mps is not None and node.mps.daemons
    assert await node.attach("a", LLM, llm(memory_mb=4000, weights_mb=3000), revision="1-abc") is not None
    assert await node.attach("b", LLM, llm(memory_mb=4000, weights_mb=3000), revision="1-abc") is not None
    assert (await _budget(budgets)).sum_memory_mb == (5000 if distinct_pids else 8000)


def test_the_process_backend_gives_mps_clients_pid_ranges_where_it_can() -> None:
    from dilu_invoker.invoker.dataplane.backends.process import ProcessBackend

    backend = ProcessBackend(isolation="off")
    assert backend.distinct_pids is backend.sandboxes.member_pid_ranges
    backend.sandboxes.member_pid_ranges = False
    assert backend.distinct_pids is False


async def test_kept_weights_release_the_compute_and_keep_only_the_weights(make_node: NodeFactory,
                                                                          redis: aioredis.Redis) -> None:
    """Staged exit: a kept instance holds its weights alone (no SM), the next instance of its revision needs
    only the rest, and the weights go with the last of them."""
    budgets = GpuBudgets(redis, prefix="twn:")
    node = await make_node(budgets=budgets)
    assert await node.attach("a", LLM, llm(), revision="1-abc") is not None
    assert await node.attach("plain", "guest/plain", llm(memory_mb=1000, weights_mb=0)) is not None
    assert await node.keep_weights("plain") is None  # it declares no weights: nothing to keep
    assert await node.keep_weights("nobody") is None
    # Kept under an id of its own: whoever placed "a" may release "a"'s reservation.
    assert await node.keep_weights("a") == "a-kept"
    assert await node.keep_weights("a-kept") is None  # kept already
    await budgets.release("GPU-wn-0", "a")  # the instance's placer lets go of it: the kept weights stay
    budget = await _budget(budgets)
    assert set(budget.reservations) == {"a-kept", "plain"}
    kept = budget.reservations["a-kept"]
    assert (kept.memory_mb, kept.request, kept.limit) == (5000, 0.0, 0.0)
    assert node.attachment_of("a-kept") is not None and node.attachment_of("a") is None
    assert not {"a", "a-kept"} & {spec.id for spec, _ in node.manager(0).statuses()}
    # Beside the kept weights a new instance of the revision needs 1000, another revision a whole copy.
    assert await node.attach("b", LLM, llm(), revision="1-abc") is not None
    assert (await _budget(budgets)).sum_memory_mb == 5000 + 1000 + 1000
    assert await node.attach("c", LLM, llm(), revision="2-def") is None  # 7000 + 6000 > 10000
    # The kept process goes first: the instance that maps from it carries the weights from then on.
    await node.detach("a-kept")
    assert {n: r.memory_mb for n, r in (await _budget(budgets)).reservations.items()} == {"b": 6000, "plain": 1000}
    assert node.attachment_of("a-kept") is None
    await node.detach("b")
    await node.detach("plain")
    assert (await _budget(budgets)).sum_memory_mb == 0
