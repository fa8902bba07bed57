"""GpuNode without tenant processes: the no-GPU state, attachments per backend, admission against real Redis
budgets (placement, the balancer's choice, two nodes on one GPU), detach, restart reconciliation."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from dilu_invoker.config import Config, GpuConfig
from dilu_invoker.gpu import abi
from dilu_invoker.gpu.budgets import GpuBudgets, GpuCapacity, Reservation
from dilu_invoker.gpu.devices import GpuDevice, load_inventory
from dilu_invoker.gpu.node import GpuNode, GpuView, InstanceView
from dilu_invoker.model import GpuClass, GpuNeeds, ValidationError
from dilu_invoker.policy.types import InstanceClass
from tests.gpu.support import ShimBuild

NodeFactory = Callable[..., Coroutine[Any, Any, GpuNode]]


def needs(cls: str = "inference", request: float = 0.2, limit: float = 0.5, memory_mb: int = 1000,
          **kw: Any) -> GpuNeeds:
    return GpuNeeds(gpu_class=GpuClass(cls), sm_request=request, sm_limit=limit, memory_mb=memory_mb, **kw)


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps([{"uuid": "GPU-n-0", "memory_mb": 10_000, "name": "Test GPU"},
                                {"uuid": "GPU-n-1", "memory_mb": 10_000}]))
    return path


@pytest.fixture
async def make_node(tmp_path: Path, shim_build: ShimBuild, inventory: Path) -> AsyncIterator[NodeFactory]:
    nodes: list[GpuNode] = []

    async def make(*, devices: tuple[GpuDevice, ...] | None = None, name: str = "invoker0",
                   shm: Path | None = None, **kw: Any) -> GpuNode:
        kw.setdefault("shim_library", shim_build.library)
        node = GpuNode(node=name, devices=devices if devices is not None else load_inventory(inventory),
                       shm_dir=shm or tmp_path / "shm", **kw)
        await node.start()
        nodes.append(node)
        return node

    yield make
    for n in nodes:
        await n.close()


async def test_no_gpus_is_a_clear_state_logged_once() -> None:
    node = GpuNode.from_config(Config(gpu=GpuConfig(enabled=False)))
    with capture_logs() as logs:
        await node.start()
        assert await node.attach("i1", "guest/f", needs()) is None
        assert await node.attach("i2", "guest/f", needs()) is None
    assert not node.has_gpus and node.view() == ()
    said = [e for e in logs if e["event"].startswith("no GPUs")]
    assert len(said) == 1 and "disabled" in said[0]["reason"]
    await node.close()


async def test_unreadable_inventory_means_no_gpus(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[{\"name\": \"no uuid\"}]")
    node = GpuNode.from_config(Config(gpu=GpuConfig(inventory=str(bad))))
    assert not node.has_gpus and "inventory" in node.no_gpu_reason
    assert await node.attach("i", "guest/f", needs()) is None


async def test_process_attachment(make_node: NodeFactory, shim_build: ShimBuild) -> None:
    node = await make_node()
    a = await node.attach("wsk0_1_f", "guest/f", needs("inference", 0.3, 0.6, memory_mb=2048))
    assert a is not None and a.devices == ()
    env = dict(a.env)
    # No bind mounts for a host process: the mounts tell its sandbox what it may read and write.
    assert {(m.source, m.target, m.read_only) for m in a.mounts} == {
        (env["DILU_SHIM_CONTROL"], env["DILU_SHIM_CONTROL"], True),
        (env["DILU_SHIM_STATS"], env["DILU_SHIM_STATS"], False),
        (str(shim_build.library), str(shim_build.library), True)}
    assert env["CUDA_VISIBLE_DEVICES"] == str(a.gpu_index) and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["LD_PRELOAD"] == str(shim_build.library) and env["DILU_GPU_UUID"] == a.uuid
    control = abi.ControlFile.open(env["DILU_SHIM_CONTROL"])
    try:
        quota = control.read().quota
        # Latency-critical: starts at its limit so its first request runs unthrottled; memory cap in bytes.
        assert quota.share == pytest.approx(0.6) and quota.mem_cap_bytes == 2048 << 20
        assert quota.stale_after_ns > 0
    finally:
        control.close()
    assert abi.StatsFile.open(env["DILU_SHIM_STATS"]).snapshot().published is False


@pytest.mark.parametrize("mode", ["device-requests", "cdi", "devices"])
async def test_docker_attachment(make_node: NodeFactory, shim_build: ShimBuild, mode: str) -> None:
    gpu = GpuDevice(index=0, uuid="GPU-real-0", name="H200", memory_mb=140_000, sm_count=132, minor=4)
    node = await make_node(devices=(gpu,), backend="docker", docker_gpu_mode=mode)
    a = await node.attach("wsk0_2_g", "guest/g", needs("training", 0.2, 0.9))
    assert a is not None
    env = dict(a.env)
    assert env["DILU_GPU_UUID"] == "GPU-real-0"
    assert env["LD_PRELOAD"] == "/run/dilu-shim/libdilu_shim.so"
    assert env["DILU_SHIM_CONTROL"] == "/run/dilu-shim/control" and env["DILU_SHIM_STATS"] == "/run/dilu-shim/stats"
    mounts = {m.target: m for m in a.mounts}
    assert mounts["/run/dilu-shim/control"].read_only and not mounts["/run/dilu-shim/stats"].read_only
    assert mounts["/run/dilu-shim/libdilu_shim.so"].source == str(shim_build.library)
    assert Path(mounts["/run/dilu-shim/control"].source).is_file()
    if mode == "devices":
        assert a.devices == ("/dev/nvidia4", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-real-0"
    else:
        assert a.devices == () and "CUDA_VISIBLE_DEVICES" not in env


async def test_without_the_shim_the_gpu_is_given_unenforced(make_node: NodeFactory, tmp_path: Path) -> None:
    node = await make_node(shim_library=tmp_path / "missing.so")
    a = await node.attach("i", "guest/f", needs())
    assert a is not None and "LD_PRELOAD" not in a.env and a.env["CUDA_VISIBLE_DEVICES"] == str(a.gpu_index)


async def test_admission_in_redis_view_and_detach(make_node: NodeFactory, redis: aioredis.Redis) -> None:
    budgets = GpuBudgets(redis, prefix="t:")
    gpu0 = load_inventory_one("GPU-only", memory_mb=10_000)
    node = await make_node(devices=(gpu0,), budgets=budgets)
    a = await node.attach("a", "guest/infer", needs("inference", 0.5, 0.8, memory_mb=4000))
    b = await node.attach("b", "guest/train", needs("training", 0.5, 0.7, memory_mb=4000))
    assert a is not None and b is not None
    with capture_logs() as logs:
        assert await node.attach("c", "guest/more", needs("inference", 0.1, 0.1)) is None
    refused = [e for e in logs if e["event"] == "no GPU admitted the instance"]
    assert refused and "sm-request" in refused[0]["reason"]

    budget = await budgets.get("GPU-only")
    assert budget is not None and set(budget.reservations) == {"a", "b"}
    assert {r.invoker for r in budget.reservations.values()} == {"invoker0"}
    assert budget.capacity.memory_mb == 10_000 and budget.sum_request == pytest.approx(1.0)

    (view,) = node.view()
    assert isinstance(view, GpuView) and (view.index, view.uuid, view.memory_mb) == (0, "GPU-only", 10_000)
    by_id = {i.id: i for i in view.instances}
    assert by_id["a"] == InstanceView(id="a", function="guest/infer", cls=InstanceClass.INFERENCE, request=0.5,
                                      limit=0.8, share=pytest.approx(by_id["a"].share), memory_mb=4000,
                                      active=False, saturated=False, throttled_s=0.0)
    assert by_id["b"].cls is InstanceClass.TRAINING

    directory = Path(a.env["DILU_SHIM_CONTROL"]).parent
    await node.detach("a")
    await node.detach("a")  # idempotent
    assert not directory.exists()
    budget = await budgets.get("GPU-only")
    assert budget is not None and set(budget.reservations) == {"b"}
    assert [i.id for i in node.view()[0].instances] == ["b"]


async def test_balancer_choice_and_fallback(make_node: NodeFactory, redis: aioredis.Redis) -> None:
    node = await make_node(budgets=GpuBudgets(redis, prefix="t:"))
    first = await node.attach("x", "guest/f", needs(request=0.6, limit=0.6), gpu_index=1)
    assert first is not None and first.gpu_index == 1
    # GPU 1 cannot take another 0.6: the node falls back to its own choice and says why.
    with capture_logs() as logs:
        second = await node.attach("y", "guest/f", needs(request=0.6, limit=0.6), gpu_index=1)
    assert second is not None and second.gpu_index == 0
    attached = [e for e in logs if e["event"] == "GPU attached"]
    assert "SM requests" in attached[0]["reason"]
    third = await node.attach("z", "guest/f", needs(request=0.1, limit=0.1), gpu_index=7)
    assert third is not None and third.gpu_index in (0, 1)


async def test_two_nodes_on_one_gpu_never_oversubscribe(make_node: NodeFactory, redis: aioredis.Redis,
                                                        tmp_path: Path) -> None:
    gpu = load_inventory_one("GPU-shared", memory_mb=100_000)
    n0 = await make_node(devices=(gpu,), name="invoker0", budgets=GpuBudgets(redis, prefix="t:"))
    n1 = await make_node(devices=(gpu,), name="invoker1", budgets=GpuBudgets(redis, prefix="t:"),
                         shm=tmp_path / "shm1")
    results = await asyncio.gather(*(
        node.attach(f"{node.node}-{k}", "guest/f", needs(request=0.15, limit=0.15))
        for k in range(6) for node in (n0, n1)
    ))
    assert sum(r is not None for r in results) == 6  # 6 × 0.15 = 0.9; a 7th would pass 1.0
    budget = await GpuBudgets(redis, prefix="t:").get("GPU-shared")
    assert budget is not None and budget.sum_request == pytest.approx(0.9)


async def test_restart_reconciles_reservations_and_files(make_node: NodeFactory, redis: aioredis.Redis,
                                                         tmp_path: Path) -> None:
    budgets = GpuBudgets(redis, prefix="t:")
    gpu = load_inventory_one("GPU-r", memory_mb=100_000)
    # Another invoker's reservation on the same GPU must survive this node's restart.
    await budgets.register_gpu("GPU-r", GpuCapacity(node="invoker9", index=0, name="", memory_mb=100_000,
                                                    sm_count=132))
    assert (await budgets.reserve("GPU-r", Reservation(instance="other", function="guest/o", cls="training",
                                                       invoker="invoker9", request=0.1, limit=0.1,
                                                       memory_mb=10), ttl_s=60)).ok
    shm = tmp_path / "shm-r"
    before = GpuNode(node="invoker0", devices=(gpu,), shm_dir=shm, budgets=budgets, shim_library=None)
    await before.start()
    for name in ("p", "q"):
        assert await before.attach(name, "guest/f", needs(request=0.2, limit=0.2)) is not None
    # The invoker dies: no detach, no release; its managers simply stop.
    await before.manager(0).stop()
    assert before._sync_task is not None
    before._sync_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await before._sync_task
    assert (shm / "invoker0" / "p" / "control").exists()

    after = await make_node(devices=(gpu,), budgets=budgets, shm=shm)
    budget = await budgets.get("GPU-r")
    assert budget is not None and set(budget.reservations) == {"other"}
    assert not (shm / "invoker0" / "p").exists() and not (shm / "invoker0" / "q").exists()
    assert after.view()[0].instances == ()


def load_inventory_one(uuid: str, *, memory_mb: int) -> GpuDevice:
    return GpuDevice(index=0, uuid=uuid, name="Test GPU", memory_mb=memory_mb, sm_count=132, simulated=True)


@pytest.mark.parametrize(("raw", "value"), [("250", 250.0), (12.5, 12.5), (None, None)])
def test_capacity_annotation(raw: object, value: float | None) -> None:
    annotations = {} if raw is None else {"gpu-capacity-blocks-per-ms": raw}
    assert GpuNeeds.from_annotations(annotations).capacity_blocks_per_ms == value


@pytest.mark.parametrize("raw", [0, -3, "fast", float("inf")])
def test_bad_capacity_annotation(raw: object) -> None:
    with pytest.raises(ValidationError, match="gpu-capacity-blocks-per-ms"):
        GpuNeeds.from_annotations({"gpu-capacity-blocks-per-ms": raw})


async def test_measured_capacity_sets_the_starting_rate(make_node: NodeFactory) -> None:
    node = await make_node()
    a = await node.attach("c", "guest/f", needs("inference", 0.2, 0.5, capacity_blocks_per_ms=200.0))
    assert a is not None
    with abi.ControlFile.open(a.env["DILU_SHIM_CONTROL"]) as control:
        quota = control.read().quota
    assert quota.rate_blocks_per_ms == pytest.approx(100.0) and quota.capacity_blocks_per_ms == 200.0


async def test_retarget_hands_a_preloaded_share_to_a_function(make_node: NodeFactory, redis: aioredis.Redis) -> None:
    budgets = GpuBudgets(redis, prefix="t:")
    node = await make_node(devices=(load_inventory_one("GPU-only", memory_mb=10_000),), budgets=budgets)
    pre = await node.attach("pre", "preload:python:3-gpu", GpuNeeds())
    other = await node.attach("other", "guest/other", needs("inference", 0.5, 0.5, memory_mb=4000))
    assert pre is not None and other is not None
    control = Path(pre.env["DILU_SHIM_CONTROL"])
    assert await node.retarget("pre", "guest/resnet", needs("inference", 0.3, 0.6, memory_mb=2000))
    budget = await budgets.get("GPU-only")
    assert budget is not None and budget.reservations["pre"].function == "guest/resnet"
    assert budget.reservations["pre"].memory_mb == 2000 and budget.sum_request == pytest.approx(0.8)
    by_id = {i.id: i for i in node.view()[0].instances}
    assert (by_id["pre"].function, by_id["pre"].limit, by_id["pre"].memory_mb) == ("guest/resnet", 0.6, 2000)
    assert control.exists()  # the same blocks: the process keeps its mapping
    # No room for these needs beside the other instance: nothing changes.
    assert not await node.retarget("pre", "guest/big", needs("inference", 0.6, 0.8, memory_mb=2000))
    budget = await budgets.get("GPU-only")
    assert budget is not None and budget.reservations["pre"].function == "guest/resnet"
    assert {i.id: i.function for i in node.view()[0].instances}["pre"] == "guest/resnet"
    assert not await node.retarget("missing", "guest/x", needs())
    # under a new id (a balancer-placed instance keeps its share under its own id)
    assert not await node.retarget("pre", "guest/resnet", needs("inference", 0.3, 0.6), new_id="other")
    assert await node.retarget("pre", "guest/resnet", needs("inference", 0.3, 0.6, memory_mb=2000), new_id="inst-1")
    budget = await budgets.get("GPU-only")
    assert budget is not None and "pre" not in budget.reservations
    assert budget.reservations["inst-1"].function == "guest/resnet"
    assert {i.id for i in node.view()[0].instances} == {"inst-1", "other"}
    await node.detach("inst-1")
    assert control.parent.exists() is False or not control.exists()


async def test_a_preload_placeholder_holds_memory_but_no_sm_in_the_budget(
        make_node: NodeFactory, redis: aioredis.Redis) -> None:
    # On the H200 a refilled placeholder (0.05 SM limit) beside inference at limit 0.8 refused training at
    # 0.7: Σ limit 1.55 > γ 1.5. The placeholder launches nothing, so it holds only its memory.
    budgets = GpuBudgets(redis, prefix="t:")
    node = await make_node(devices=(load_inventory_one("GPU-only", memory_mb=40_000),), budgets=budgets)
    pre = await node.attach("pre", "preload:python:3-gpu", needs("inference", 0.01, 0.05, memory_mb=1024))
    infer = await node.attach("infer", "guest/infer", needs("inference", 0.5, 0.8, memory_mb=4000))
    train = await node.attach("train", "guest/train", needs("training", 0.3, 0.7, memory_mb=16000))
    assert pre is not None and infer is not None and train is not None
    budget = await budgets.get("GPU-only")
    assert budget is not None
    assert (budget.reservations["pre"].request, budget.reservations["pre"].limit) == (0.0, 0.0)
    assert budget.reservations["pre"].memory_mb == 1024 and budget.sum_memory_mb == 21024
    assert budget.sum_limit == pytest.approx(1.5) and budget.sum_request == pytest.approx(0.8)
    # the shim still lets the placeholder's process run (its own small share)
    with abi.ControlFile.open(pre.env["DILU_SHIM_CONTROL"]) as control:
        assert control.read().quota.share > 0
    # memory still counts: a fourth instance that would pass the GPU's memory is refused
    assert await node.attach("big", "guest/big", needs("inference", 0.1, 0.1, memory_mb=19_500)) is None
    # taken by a function, the share is the function's again in the budget
    await node.detach("train")
    assert await node.retarget("pre", "guest/train", needs("training", 0.3, 0.7, memory_mb=16000), new_id="t2")
    budget = await budgets.get("GPU-only")
    assert budget is not None and budget.reservations["t2"].limit == 0.7 and "pre" not in budget.reservations
