"""The `spatial` policy in the GPU manager and node, and `--gpu-vertical-policy auto` choosing per GPU: no token
gate (the control blocks say unlimited, the real shim over the fake driver admits every launch without a
wait), MPS thread caps chosen at each client's start (against the fake ``nvidia-cuda-mps-control``), and the
policy each GPU runs with its reason in the log and /metrics."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dilu_invoker.gpu import abi
from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.gpu.manager import GpuManager, InstanceSpec
from dilu_invoker.gpu.metrics import GpuMetrics
from dilu_invoker.gpu.mps import MpsMode, MpsSupervisor
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.model import GpuClass, GpuNeeds
from dilu_invoker.policy.types import InstanceClass
from dilu_invoker.policy.vertical_slo import PerGpuVertical, SloConfig, SpatialConfig
from tests.gpu.support import ShimBuild, StatsWriter, Tenant, start_tenant

FAKE = str(Path(__file__).resolve().parent / "fakes" / "nvidia-cuda-mps-control")
GPU = GpuDevice(index=0, uuid="GPU-spatial-0", name="inventory GPU", memory_mb=80_000, sm_count=132, simulated=True)
CAPACITY = 200.0  # blocks/ms: with it every share below 1 would be a finite token rate under a gating policy
INFER = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.3, sm_limit=0.6, memory_mb=1000,
                 capacity_blocks_per_ms=CAPACITY)
BIG_INFER = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=0.4, sm_limit=0.8, memory_mb=1000)
SMALL_TRAIN = GpuNeeds(gpu_class=GpuClass.TRAINING, sm_request=0.1, sm_limit=0.9, memory_mb=1000)
TRAIN = GpuNeeds(gpu_class=GpuClass.TRAINING, sm_request=0.2, sm_limit=0.9, memory_mb=1000,
                 capacity_blocks_per_ms=CAPACITY)
AUTO = PerGpuVertical(name="auto", mps=SpatialConfig(), time_sliced=SloConfig())


def _metric(registry: CollectorRegistry, gpu: str = "0") -> dict[str, str]:
    for family in registry.collect():
        if family.name == "dilu_gpu_vertical_policy":
            found = [s.labels for s in family.samples if s.labels["gpu"] == gpu and s.value == 1]
            assert len(found) == 1, found
            return found[0]
    raise AssertionError("dilu_gpu_vertical_policy not exported")


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns


def test_the_manager_writes_unlimited_rates_under_spatial_and_still_enforces_a_pin(tmp_path: Path) -> None:
    """With a capacity known (annotated) every share below 1 would be a token rate; under `spatial` the control
    block stays unlimited from the first quota on, at any share, whatever the capacity estimator learns."""
    clock = Clock()
    mgr = GpuManager(uuid="GPU-t", index=0, period_s=0.05, clock_ns=clock, vertical=SpatialConfig())
    inf = InstanceSpec(id="inf", function="guest/classify", cls=InstanceClass.INFERENCE, request=0.3, limit=0.6,
                       capacity_blocks_per_ms=CAPACITY)
    train = InstanceSpec(id="train", function="guest/train", cls=InstanceClass.TRAINING, request=0.2, limit=0.9,
                         capacity_blocks_per_ms=CAPACITY)
    writers, controls = {}, {}
    for spec in (inf, train):
        quota = mgr.initial_quota(spec)
        assert not quota.limited and quota.rate_blocks_per_ms == 0.0
        ctl, st = abi.create_instance_files(tmp_path, spec.id, quota)
        controls[spec.id], writers[spec.id] = ctl, StatsWriter(st.path)
        mgr.add(spec, ctl, st)
    # inference added first: training's cap leaves max(its request 0.3, the reserve 0.5) to latency-critical work
    assert mgr.mps_threads_of("inf") == pytest.approx(0.6) and mgr.mps_threads_of("train") == pytest.approx(0.5)
    try:
        for _ in range(10):
            clock.ns += 50_000_000
            for w in writers.values():
                w.publish(blocks=w.block.blocks + 20_000, launches=w.block.launches + 1, windows=w.block.windows + 10,
                          pid=4242)
            rec = mgr.tick()
            for name in ("inf", "train"):
                q = controls[name].read().quota
                assert not q.limited, (name, q)
                assert rec.status(name).rate_blocks_per_ms == 0.0
        assert rec.status("inf").share == pytest.approx(0.6) and rec.status("train").share == pytest.approx(0.5)
        assert "no token cap" in rec.status("train").reason
        mgr.pin("train", 0.25)  # an explicit pin (experiments) is still a token rate
        clock.ns += 50_000_000
        mgr.tick()
        pinned = controls["train"].read().quota
        assert pinned.limited and pinned.rate_blocks_per_ms == pytest.approx(0.25 * CAPACITY)
    finally:
        for w in writers.values():
            w.close()


async def test_auto_runs_spatial_under_mps_with_thread_caps_chosen_at_start(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        check_every_s=3600)
    # γ 4: room for several limits (Σ request ≤ 1 still holds), so the caps can be seen with neighbours
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", backend="process", mps=sup,
                   vertical=AUTO, metrics=GpuMetrics(registry), gamma=4.0)
    await node.start()
    try:
        mgr = node.manager(0)
        assert isinstance(mgr.vertical, SpatialConfig) and not mgr.gates_launches
        assert "auto: spatial, the GPU runs MPS" in mgr.policy_reason
        labels = _metric(registry)
        assert labels["policy"] == "spatial" and "runs MPS" in labels["reason"]

        # Best-effort alone: its cap keeps the reserve (0.5) free for latency-critical work arriving later.
        t1 = await node.attach("t1", "guest/train", TRAIN)
        assert t1 is not None and t1.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        # Latency-critical: its SM limit; its control block is unlimited despite the annotated capacity.
        i1 = await node.attach("i1", "guest/classify", INFER)
        assert i1 is not None and i1.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
        big = await node.attach("i2", "guest/big", BIG_INFER)  # Σ latency-critical requests now 0.7
        assert big is not None and big.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "80"
        # Best-effort beside them: their requests (0.7 > the reserve) stay free: 1 - 0.7.
        t2 = await node.attach("t2", "guest/train2", SMALL_TRAIN)
        assert t2 is not None and t2.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        await node.detach("i2")
        await node.detach("t1")
        # One latency-critical neighbour (request 0.3 < the reserve): the reserve decides again.
        t3 = await node.attach("t3", "guest/train3", TRAIN)
        assert t3 is not None and t3.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        for a in (i1, t2, t3):
            with abi.ControlFile.open(a.env["DILU_SHIM_CONTROL"]) as f:
                assert not f.read().quota.limited
        rec = mgr.tick()
        # the shares reported are the caps each client started with, not what a later start would get
        assert {s.id: round(s.share, 2) for s in rec.instances} == {"i1": 0.6, "t2": 0.3, "t3": 0.5}
        assert all(s.rate_blocks_per_ms == 0.0 for s in rec.instances)
    finally:
        await node.close()


@pytest.mark.parametrize(("policy", "fallback"), [("auto", False), ("spatial", True)])
async def test_a_time_sliced_gpu_runs_slo(tmp_path: Path, policy: str, fallback: bool) -> None:
    """`auto` picks slo where the GPU time-slices; an explicit `spatial` there falls back to slo with a
    warning (without MPS nothing would divide the SMs): both say so in /metrics."""
    registry = CollectorRegistry()
    sup = MpsSupervisor(mode=MpsMode.OFF, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE)
    vertical = AUTO if policy == "auto" else PerGpuVertical(name="spatial", mps=SpatialConfig(),
                                                            time_sliced=SloConfig())
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", backend="process", mps=sup,
                   vertical=vertical, metrics=GpuMetrics(registry))
    await node.start()
    try:
        mgr = node.manager(0)
        assert isinstance(mgr.vertical, SloConfig) and mgr.gates_launches
        labels = _metric(registry)
        assert labels["policy"] == "slo" and "time-slices" in labels["reason"]
        assert ("needs MPS" in labels["reason"]) is fallback
        i1 = await node.attach("i1", "guest/classify", INFER)
        assert i1 is not None and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in i1.env
        with abi.ControlFile.open(i1.env["DILU_SHIM_CONTROL"]) as f:
            assert f.read().quota.limited  # slo: the limit 0.6 as a token rate
    finally:
        await node.close()


def test_the_node_built_from_the_default_config_resolves_auto(tmp_path: Path) -> None:
    """Before start (no MPS decision yet) the node's managers run the time-sliced choice: never a policy
    that would leave launches ungated on a GPU whose MPS daemon is not known to run."""
    from dilu_invoker.config import Config, GpuConfig

    inventory = tmp_path / "inv.json"
    inventory.write_text('{"invokers": {"0": [{"uuid": "GPU-a"}]}}')
    node = GpuNode.from_config(Config(gpu=GpuConfig(inventory=str(inventory), shm_dir=str(tmp_path / "shm"))))
    assert isinstance(node.manager(0).vertical, SloConfig) and node.manager(0).gates_launches


@pytest.mark.slow
async def test_the_shim_admits_every_launch_under_spatial(tmp_path: Path, shim_build: ShimBuild,
                                                          tenants: list[Tenant]) -> None:
    """The real shim over the fake driver: a training tenant launching ~330 blocks/ms beside inference, both
    with an annotated capacity (200 blocks/ms) that a gating policy would turn into rates below it; under
    `auto` on an MPS GPU the shim applies no rate and never makes a launch wait."""
    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        check_every_s=3600)
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", shim_library=shim_build.library,
                   period_s=0.02, mps=sup, vertical=AUTO)
    await node.start()
    try:
        train = await node.attach("train", "guest/train", TRAIN)
        infer = await node.attach("infer", "guest/classify", INFER)
        assert train is not None and infer is not None
        trainer = await start_tenant(tenants, shim_build.env(train.env))
        server = await start_tenant(tenants, shim_build.env(infer.env))
        await trainer.send("run 100 200")
        await server.send("burst 20 30 300 20")

        def snap(a: object) -> abi.StatsSnapshot:
            with abi.StatsFile.open(a.env["DILU_SHIM_STATS"]) as f:  # type: ignore[attr-defined]
                return f.snapshot()

        end = time.monotonic() + 15
        while not (snap(train).published and snap(train).blocks > 0 and snap(infer).blocks > 0):
            assert time.monotonic() < end, "the tenants never launched"
            await asyncio.sleep(0.02)
        first = snap(train)
        await asyncio.sleep(0.6)  # 30 manager periods
        last, other = snap(train), snap(infer)
        for s in (last, other):
            assert s.published and not s.limited and s.rate_blocks_per_ms == 0.0
            assert s.throttled_ns == 0  # no launch ever waited for tokens
        assert last.blocks > first.blocks
        assert node.manager(0).last is not None
        assert node.manager(0).last.status("train").share == pytest.approx(0.5)
    finally:
        await node.close()


async def test_retargeting_under_spatial_gives_a_preloaded_client_the_cap_and_keeps_a_running_ones(
        tmp_path: Path) -> None:
    """A pre-loaded container makes no CUDA context before /init, so its retarget takes the function's spatial
    cap; a client that runs keeps the cap it connected with, so where a start now would get another its
    retarget is refused."""
    sup = MpsSupervisor(mode=MpsMode.ON, root=tmp_path / "mps", gpus=((0, GPU.uuid),), control=FAKE,
                        check_every_s=3600)
    node = GpuNode(node="invoker0", devices=(GPU,), shm_dir=tmp_path / "shm", backend="process", mps=sup,
                   vertical=AUTO, gamma=4.0)
    await node.start()
    try:
        pre = await node.attach("pre", "preload:python:3-gpu",
                                GpuNeeds(gpu_class=GpuClass.TRAINING, sm_request=0.01, sm_limit=0.05, memory_mb=100))
        assert pre is not None and pre.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "5"
        assert await node.retarget("pre", "guest/train", TRAIN, new_id="t1")
        taken = node.attachment_of("t1")
        assert taken is not None and taken.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert node.manager(0).mps_threads_of("t1") == pytest.approx(0.5)
        # Latency-critical work arrives: a new best-effort start would get 1 - 0.7; the running one keeps 0.5
        # and cannot be handed to a function that would start at 0.3 now.
        assert await node.attach("i1", "guest/big", BIG_INFER) is not None
        assert await node.attach("i2", "guest/classify", INFER) is not None
        assert node.mps_cap("guest/train-v2", TRAIN) == pytest.approx(0.3)
        assert not await node.retarget("t1", "guest/train-v2", TRAIN)
        kept = node.attachment_of("t1")
        assert kept is not None and kept.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert node.manager(0).mps_threads_of("t1") == pytest.approx(0.5)
        fresh = await node.attach("t2", "guest/small", SMALL_TRAIN)
        assert fresh is not None and fresh.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    finally:
        await node.close()


def test_the_policy_gauge_follows_a_reconfiguration() -> None:
    registry = CollectorRegistry()
    mgr = GpuManager(uuid="GPU-g", index=2, metrics=GpuMetrics(registry))
    mgr.set_vertical_config(SpatialConfig(), reason="because MPS")
    assert _metric(registry, "2") == {"gpu": "2", "uuid": "GPU-g", "policy": "spatial", "reason": "because MPS"}
    mgr.set_vertical_config(SloConfig(), reason="time-sliced")
    assert _metric(registry, "2")["policy"] == "slo"  # the old series is gone, not left at 1
    samples = [s for f in registry.collect() if f.name == "dilu_gpu_vertical_policy" for s in f.samples]
    assert len(samples) == 1
