"""Capacity learning end to end without a GPU: a tenant under the real shim and the fake libcuda, driven by a
GpuNode's manager loop, with no ``gpu-capacity-blocks-per-ms`` annotation.

It replays the failure seen on the H200 through the product: the online estimate was learnt from model
loading and warm-up (slow launches between host work and copies), and a ResNet-50 instance at share 0.5 then
ran 13x slower than unlimited. Here the tenant first loads (a launch and a device allocation per step), then
warms up with slow launches and no allocations, then serves fast. A reference tenant on a second (simulated)
GPU runs the fast pattern unlimited at the same time: the instance's rate in force must reach share x that
rate (within the test's noise), which is the "never slowed by more than 1/s" promise.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from dilu_invoker.gpu import abi
from dilu_invoker.gpu.attachment import GpuAttachment
from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.gpu.manager import TickRecord
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.model import GpuClass, GpuNeeds
from tests.gpu.support import ShimBuild, Tenant, start_tenant

pytestmark = pytest.mark.slow

GPUS = (GpuDevice(index=0, uuid="GPU-cap-0", name="inventory GPU", memory_mb=80_000, sm_count=132, simulated=True),
        GpuDevice(index=1, uuid="GPU-cap-1", name="inventory GPU", memory_mb=80_000, sm_count=132, simulated=True))
SHARE = 0.5
HALF = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=SHARE, sm_limit=SHARE, memory_mb=1000)
WHOLE = GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=1.0, sm_limit=1.0, memory_mb=1000)
LOADING = "load 10 2000 65536"  # ~5 blocks/ms, a 64 KiB allocation per launch
WARM_UP = "run 10 2000"  # ~5 blocks/ms, no allocations: slow like cuDNN autotuning between launches
SERVING = "run 100 200"  # ~300+ blocks/ms: what the fast requests launch


def stats(a: GpuAttachment) -> abi.StatsSnapshot:
    with abi.StatsFile.open(a.env["DILU_SHIM_STATS"]) as f:
        return f.snapshot()


async def admitted_rate(a: GpuAttachment, seconds: float) -> float:
    """Blocks per ms the shim admitted over ``seconds``."""
    first = stats(a)
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    last = stats(a)
    return (last.blocks - first.blocks) / ((time.monotonic() - t0) * 1000)


async def test_capacity_is_not_learnt_from_loading_and_recovers_from_a_slow_warm_up(
    tmp_path: Path, shim_build: ShimBuild, tenants: list[Tenant]
) -> None:
    records: list[TickRecord] = []
    node = GpuNode(node="invoker0", devices=GPUS, shm_dir=tmp_path / "shm", shim_library=shim_build.library,
                   period_s=0.02, observers=(records.append,))
    await node.start()
    try:
        inst = await node.attach("half", "guest/resnet", HALF, gpu_index=0)
        ref = await node.attach("ref", "guest/resnet-ref", WHOLE, gpu_index=1)
        assert inst is not None and ref is not None
        mgr = node.manager(0)
        tenant = await start_tenant(tenants, shim_build.env(inst.env))
        reference = await start_tenant(tenants, shim_build.env(ref.env))

        # Loading: launches paced by allocations (and, on a GPU, the copies that follow them) teach nothing.
        await tenant.send(LOADING)
        await asyncio.sleep(1.0)
        assert stats(inst).blocks > 0
        assert mgr.capacity_of("half").value is None, mgr.capacity_of("half")
        assert not stats(inst).limited, "an instance with no trustworthy period runs unlimited"
        loading_reasons = {s.capacity_reason for r in records for s in r.instances if s.id == "half"}
        assert any(why.startswith("loading") for why in loading_reasons), loading_reasons

        # Warm-up: slow launches with no allocations look like a busy GPU; the low estimate is taken.
        await tenant.send(WARM_UP)
        deadline = time.monotonic() + 10
        while mgr.capacity_of("half").value is None:
            assert time.monotonic() < deadline, "no estimate from the warm-up"
            await asyncio.sleep(0.02)
        low = mgr.capacity_of("half").value
        assert low is not None and low < 30, low

        # Fast requests: throttled at its limit alone, the instance probes its way up; the reference runs the
        # same pattern unlimited meanwhile.
        await reference.send(SERVING)
        await tenant.send(SERVING)
        await asyncio.sleep(0.5)
        unlimited = await admitted_rate(ref, 1.0)
        assert unlimited > 10 * low, (unlimited, low)
        deadline = time.monotonic() + 15
        while True:
            s = stats(inst)
            if not s.limited or s.rate_blocks_per_ms >= SHARE * unlimited / 1.25:
                break
            assert time.monotonic() < deadline, (s.rate_blocks_per_ms, unlimited, mgr.capacity_of("half"))
            await asyncio.sleep(0.05)
        recovered = mgr.capacity_of("half")
        assert recovered.value is not None and recovered.value > 5 * low
        reasons = {st.capacity_reason for r in records for st in r.instances if st.id == "half"}
        assert any("probe" in why for why in reasons), reasons
        # Over the next seconds (probes back off once they find nothing faster) the instance keeps at least
        # about its share of the unlimited rate.
        rate = await admitted_rate(inst, 2.0)
        unlimited = await admitted_rate(ref, 1.0)
        assert rate >= SHARE * unlimited / 1.5, (rate, unlimited, mgr.capacity_of("half"))
    finally:
        for t in tenants:
            await t.stop()
        await node.close()
