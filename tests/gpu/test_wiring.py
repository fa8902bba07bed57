"""The GPU node inside the invoker: open_invoker creates it from the configuration, a GPU-kind action's
container gets its GPU, shim and blocks, the metrics land in the invoker's registry, and the blocks and the
reservation go with the container."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from dilu_invoker import config
from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.gpu.load import InstanceLoad, LoadReading
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.invoker.dataplane.core import open_invoker
from dilu_invoker.invoker.dataplane.preload import PreloadPool, Standby
from dilu_invoker.model import GUEST_IDENTITY, Action, ActivationRequest, Exec, Parameter, new_activation_id
from tests.gpu.support import ShimBuild

ENV = ("import os\ndef main(args):\n    keys = ['CUDA_VISIBLE_DEVICES', 'LD_PRELOAD', 'DILU_SHIM_CONTROL',"
       " 'DILU_SHIM_STATS', 'DILU_GPU_UUID']\n    return {k: os.environ.get(k) for k in keys}\n")


def _gpu_action(**annotations: object) -> Action:
    return Action(namespace="guest", name="gpuenv", exec=Exec(kind="python:3-gpu", code=ENV),
                  annotations=tuple(Parameter(k, v) for k, v in annotations.items()), revision="1-gpu")


def _req(action: Action) -> ActivationRequest:
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY, content={})


def _cfg(**gpu: object) -> config.Config:
    base = config.load(environ={})
    return replace(base, gpu=replace(base.gpu, **gpu))  # type: ignore[arg-type]


async def test_gpu_action_gets_its_gpu_and_shim(tmp_path: Path, shim_build: ShimBuild, redis: aioredis.Redis) -> None:
    inventory = tmp_path / "gpus.json"
    inventory.write_text(json.dumps([{"uuid": "GPU-w-0"}, {"uuid": "GPU-w-1"}]))
    cfg = _cfg(inventory=str(inventory), shm_dir=str(tmp_path / "shm"), shim_path=str(shim_build.library),
               manager_period_ms=20)
    cfg = replace(cfg, redis=replace(cfg.redis, prefix="w:"))
    async with open_invoker(cfg, redis=redis) as inv:
        node = inv.gpu
        assert isinstance(node, GpuNode) and node.has_gpus
        result = await inv.run(_req(_gpu_action(**{"gpu-class": "training", "gpu-sm-request": 0.3,
                                                  "gpu-sm-limit": 0.6})))
        env = result.response.result
        assert env["LD_PRELOAD"] == str(shim_build.library) and env["CUDA_VISIBLE_DEVICES"] in ("0", "1")
        control = Path(env["DILU_SHIM_CONTROL"])
        assert control.is_file() and Path(env["DILU_SHIM_STATS"]).is_file()
        (instance,) = [i for g in node.view() for i in g.instances]
        assert (instance.function, instance.request, instance.limit) == ("guest/gpuenv", 0.3, 0.6)
        budget = await GpuBudgets(redis, prefix="w:").get(env["DILU_GPU_UUID"])
        assert budget is not None and list(budget.reservations) == [instance.id]

        async def quota_metric() -> float | None:
            for _ in range(200):
                v = inv.metrics.registry.get_sample_value("openwhisk_action_gpu_sm_quota_ratio", {
                    "namespace": "guest", "action": "gpuenv", "instance": instance.id,
                    "gpu": env["CUDA_VISIBLE_DEVICES"], "uuid": env["DILU_GPU_UUID"]})
                if v is not None:
                    return v
                await asyncio.sleep(0.02)
            return None

        assert await quota_metric() == pytest.approx(0.3)  # idle training: its request
    # The container went with the invoker: so did its blocks and its reservation.
    assert not control.parent.exists()
    budget = await GpuBudgets(redis, prefix="w:").get(env["DILU_GPU_UUID"])
    assert budget is not None and budget.reservations == {}


async def test_without_gpus_a_gpu_action_runs_on_the_cpu(tmp_path: Path) -> None:
    async with open_invoker(_cfg(enabled=False, shm_dir=str(tmp_path / "shm"))) as inv:
        result = await inv.run(_req(_gpu_action()))
        assert result.response.result == {k: None for k in ("CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "DILU_SHIM_CONTROL",
                                                           "DILU_SHIM_STATS", "DILU_GPU_UUID")}
        assert isinstance(inv.gpu, GpuNode) and not inv.gpu.has_gpus
    assert not (tmp_path / "shm").exists()


def _preload_cfg(tmp_path: Path, shim_build: ShimBuild, uuid: str, prefix: str) -> config.Config:
    """One fake GPU and a python:3-gpu kind that pre-loads (``json``: importable everywhere)."""
    inventory = tmp_path / "gpus.json"
    inventory.write_text(json.dumps([{"uuid": uuid}]))
    cfg = _cfg(inventory=str(inventory), shm_dir=str(tmp_path / "shm"), shim_path=str(shim_build.library))
    manifest = {"runtimes": {"python": [{"kind": "python:3-gpu", "preload": ["json"],
                                         "image": {"name": "dilu-python3-gpu-runtime"}}]}}
    return replace(cfg, redis=replace(cfg.redis, prefix=prefix),
                   invoker=replace(cfg.invoker, preload=1, runtimes_manifest=json.dumps(manifest)))


async def _ready_standby(preload: PreloadPool) -> Standby:
    for _ in range(400):
        if any(s.state == "ready" for s in preload.standbys["python:3-gpu"]):
            break
        await asyncio.sleep(0.05)
    (standby,) = preload.standbys["python:3-gpu"]
    return standby


async def test_a_preloaded_gpu_container_takes_the_functions_share(tmp_path: Path, shim_build: ShimBuild,
                                                                   redis: aioredis.Redis) -> None:
    cfg = _preload_cfg(tmp_path, shim_build, "GPU-p-0", "p:")
    async with open_invoker(cfg, redis=redis) as inv:
        node, preload = inv.gpu, inv.preload
        assert isinstance(node, GpuNode) and preload is not None
        standby = await _ready_standby(preload)
        assert standby.state == "ready" and standby.gpu is not None and standby.info["cuda"] is False
        (pre,) = [i for g in node.view() for i in g.instances]
        assert pre.function == "preload:python:3-gpu"
        result = await inv.run(_req(_gpu_action(**{"gpu-sm-request": 0.3, "gpu-sm-limit": 0.6})))
        assert result.annotation("preloaded") is True
        env = result.response.result
        assert env["LD_PRELOAD"] == str(shim_build.library) and env["DILU_SHIM_CONTROL"] == standby.gpu.env[
            "DILU_SHIM_CONTROL"]
        mine = next(i for g in node.view() for i in g.instances if i.id == standby.name)
        assert (mine.function, mine.request, mine.limit) == ("guest/gpuenv", 0.3, 0.6)
        budget = await GpuBudgets(redis, prefix="p:").get("GPU-p-0")
        assert budget is not None and budget.reservations[standby.name].function == "guest/gpuenv"
    budget = await GpuBudgets(redis, prefix="p:").get("GPU-p-0")
    assert budget is not None and budget.reservations == {}


async def test_a_balancer_placed_gpu_instance_takes_a_preloaded_container_under_its_own_id(
        tmp_path: Path, shim_build: ShimBuild, redis: aioredis.Redis) -> None:
    cfg = _preload_cfg(tmp_path, shim_build, "GPU-q-0", "q:")
    async with open_invoker(cfg, redis=redis) as inv:
        node, preload = inv.gpu, inv.preload
        assert isinstance(node, GpuNode) and preload is not None
        standby = await _ready_standby(preload)
        (pre,) = [i for g in node.view() for i in g.instances]
        # the placeholder takes next to no SM share from instances placed beside it
        assert pre.function == "preload:python:3-gpu" and pre.request <= 0.01 and pre.limit <= 0.05
        action = _gpu_action(**{"gpu-sm-request": 0.4, "gpu-sm-limit": 0.9})
        container, failure = await inv.start_instance("guest-gpuenv-1-1", action, gpu_index=0)
        assert failure is None and container is not None
        by_id = {i.id: i for g in node.view() for i in g.instances}
        assert standby.name not in by_id or by_id[standby.name].function == "preload:python:3-gpu"
        mine = by_id["guest-gpuenv-1-1"]
        assert (mine.function, mine.request, mine.limit) == ("guest/gpuenv", 0.4, 0.9)
        budget = await GpuBudgets(redis, prefix="q:").get("GPU-q-0")
        assert budget is not None and budget.reservations["guest-gpuenv-1-1"].function == "guest/gpuenv"
        assert standby.name not in budget.reservations or \
            budget.reservations[standby.name].function == "preload:python:3-gpu"
        assert inv.metrics.registry.get_sample_value("dilu_invoker_preload_hits_total",
                                                     {"kind": "python:3-gpu"}) == 1.0
        result = await inv.run_on_instance("guest-gpuenv-1-1", _req(action))
        assert result is not None and standby.gpu is not None
        # the instance runs in the pre-loaded process, with the blocks it was started with
        assert result.response.result["DILU_SHIM_CONTROL"] == standby.gpu.env["DILU_SHIM_CONTROL"]
        inv.stop_instance(container, "test")
        for _ in range(200):
            budget = await GpuBudgets(redis, prefix="q:").get("GPU-q-0")
            if budget is not None and "guest-gpuenv-1-1" not in budget.reservations:
                break
            await asyncio.sleep(0.05)
        assert budget is not None and "guest-gpuenv-1-1" not in budget.reservations


async def test_the_invoker_reports_each_gpu_containers_queue_to_its_manager(
        tmp_path: Path, shim_build: ShimBuild, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    readings: list[LoadReading] = []
    real_read = InstanceLoad.read

    def spy(self: InstanceLoad) -> LoadReading:
        readings.append(real_read(self))
        return readings[-1]

    monkeypatch.setattr(InstanceLoad, "read", spy)
    inventory = tmp_path / "gpus.json"
    inventory.write_text(json.dumps([{"uuid": "GPU-q-0"}]))
    cfg = _cfg(inventory=str(inventory), shm_dir=str(tmp_path / "shm"), shim_path=str(shim_build.library),
               manager_period_ms=20)
    # Room for one container: activations beyond it wait in the pool's queue for that container.
    cfg = replace(cfg, redis=replace(cfg.redis, prefix="q:"), invoker=replace(cfg.invoker, user_memory_mb=256))
    action = Action(namespace="guest", name="sleepy", revision="1-gpu",
                    exec=Exec(kind="python:3-gpu", code="import time\ndef main(a):\n    time.sleep(a.get('s', 0))\n"
                                                         "    return {}\n"),
                    annotations=(Parameter("gpu-class", "inference"),))

    def req(seconds: float) -> ActivationRequest:
        return replace(_req(action), content={"s": seconds})

    async with open_invoker(cfg, redis=redis) as inv:
        await inv.run(req(0.0))  # the cold start: the container and its GPU share
        await asyncio.sleep(0.1)
        readings.clear()
        await asyncio.gather(*(inv.run(req(0.15)) for _ in range(3)))
        await asyncio.sleep(0.1)
    runs = [r for x in readings for r in x.runs_s]
    waits = sorted(w for x in readings for w in x.waits_s)
    assert len(runs) == 3 and min(runs) >= 0.15
    assert waits[0] < 0.1 and waits[-1] >= 0.25  # the third waited for the two before it
    assert max(x.queued for x in readings) == 2.0 and max(x.running for x in readings) == 1
    assert max(x.oldest_wait_s for x in readings) >= 0.1
    assert readings[-1].queued == 0.0 and readings[-1].running == 0
