"""Staged exit through the product: `standalone` (process backend, a simulated GPU, the embedded balancer)
scales a GPU function that declares its weights (`gpu-weights-mb`) to zero; its last instance's process
stays with its weights (its compute released, only the weights in the GPU budget), the next instance maps
them from it instead of loading them, and after `--invoker-weights-grace-s` with no instance the kept
process goes and the budget is empty. Runs on the CPU: the models API shares through a memfd there."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest

from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.standalone import run_standalone
from tests.invoker.staged_support import metric as _metric
from tests.invoker.staged_support import staged_config

pytestmark = pytest.mark.slow

CODE = '''
import os
from dilu_invoker.actions import models

INSTANCE = os.urandom(8).hex()


def build():
    import numpy as np
    return {"w": np.arange(1 << 18, dtype=np.float32)}


def main(args):
    w = models.load("w", build)
    m = models.info("w")
    return {"instance": INSTANCE, "pid": os.getpid(), "role": m.role, "reason": m.reason,
            "check": float(w["w"][123456])}
'''
ANNOTATIONS = {"gpu-memory-mb": 4000, "gpu-weights-mb": 3000, "gpu-sm-request": 0.1, "gpu-sm-limit": 0.2}


async def _until(what: str, check: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_the_last_instance_keeps_its_weights_for_the_next_one(tmp_path: Path) -> None:
    cfg = staged_config(tmp_path, "GPU-keep")
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token}"}) as http:
        assert running.balancer is not None
        invoker = running.invokers[0]
        keeper = invoker.keeper
        assert keeper is not None and keeper.grace_s == 30.0
        budgets = GpuBudgets(running.balancer.redis, cfg.redis.prefix)
        api = f"{running.api_url}/api/v1/namespaces/_/actions/llm"
        body = {"exec": {"kind": "python:3-gpu", "code": CODE},
                "annotations": [{"key": k, "value": v} for k, v in ANNOTATIONS.items()]}
        async with http.put(api, json=body) as r:
            assert r.status == 200, await r.text()

        async def invoke() -> dict[str, Any]:
            async with http.post(f"{api}?blocking=true&result=true", json={}) as r:
                assert r.status == 200, await r.text()
                return dict(await r.json())

        async def metrics() -> str:
            return generate_latest(invoker.metrics.registry).decode()

        first = await invoke()
        assert first["role"] == "holder" and first["check"] == 123456.0, first
        [uuid] = await budgets.node_gpus("invoker0")

        async def kept() -> bool:
            return any(not k.gone for k in keeper.kept.values()) and not any(
                p.action.name == "llm" for p in invoker.pool.containers.values())

        # Idle: the balancer scales the function to zero; the instance's process stays with its weights only.
        await _until("the last instance to be kept", kept)
        [k] = keeper.kept.values()
        assert k.container.alive and k.drain is not None and not k.drain.done()
        got = await budgets.get(uuid)
        assert got is not None and [(r.memory_mb, r.request, r.limit) for r in got.reservations.values()] == [
            (3000, 0.0, 0.0)], got
        text = await metrics()
        assert _metric(text, "dilu_invoker_weights_kept") == 1.0
        assert _metric(text, "dilu_invoker_weights_kept_events_total", event="kept") == 1.0

        # The next instance maps the kept weights: the budget holds one copy (3000 + its own 1000).
        second = await invoke()
        assert second["instance"] != first["instance"] and second["role"] == "mapped", second
        assert second["check"] == 123456.0
        got = await budgets.get(uuid)
        assert got is not None and got.sum_memory_mb == 4000, got
        assert _metric(await metrics(), "dilu_invoker_weights_kept_events_total", event="reused") == 1.0

        # Scaled to zero again: the mapping instance is not kept (the kept process holds the weights), and
        # the grace (shortened here) then runs out: nothing of the function is left, on the host or in the
        # budget.
        keeper.grace_s = 0.5
        async def all_gone() -> bool:
            live = [p for p in invoker.pool.containers.values() if p.action.name == "llm"]
            budget = await budgets.get(uuid)
            return not live and not keeper.kept and budget is not None and budget.sum_memory_mb == 0

        await _until("the kept weights to expire", all_gone)
        assert not k.container.alive
        text = await metrics()
        assert _metric(text, "dilu_invoker_weights_kept_events_total", event="expired") == 1.0
        assert _metric(text, "dilu_invoker_weights_kept_events_total", event="kept") == 1.0
        assert _metric(text, "dilu_invoker_weights_kept") == 0.0


class _Proxy:
    """What the keeper reads of a container proxy."""

    def __init__(self, name: str, gpu_index: int = 0) -> None:
        from dilu_invoker.gpu.attachment import GpuAttachment
        from dilu_invoker.invoker.dataplane.container import Placement, PoolKey

        self.name, self.memory_mb, self.output = name, 256, None
        self.action = type("A", (), {"fqn": "guest/llm"})()
        self.key = PoolKey(f"instance:{name}", "guest/llm", "1-abc")
        self.placement = Placement(gpu=GpuAttachment(gpu_index=gpu_index, uuid="GPU-k", env={}), gpu_key=name)
        self.container = type("C", (), {"alive": True, "stdout": asyncio.StreamReader(),
                                        "stderr": asyncio.StreamReader()})()


async def test_two_instances_of_a_group_removed_at_once_keep_one() -> None:
    from prometheus_client import CollectorRegistry

    from dilu_invoker.invoker.dataplane.keep import WeightsKeeper

    kept_ids: list[str] = []
    destroyed: list[str] = []

    async def keep_weights(key: str) -> str | None:
        await asyncio.sleep(0.01)  # Redis: the other removal runs meanwhile
        kept_ids.append(key)
        return f"{key}-kept"

    async def destroy(proxy: Any, container: Any, gpu_key: str) -> None:
        destroyed.append(gpu_key)

    keeper = WeightsKeeper(grace_s=30.0, keep_weights=keep_weights, destroy=destroy, members=lambda g: 0,
                           registry=CollectorRegistry())
    a, b = _Proxy("a"), _Proxy("b")
    assert await asyncio.gather(keeper.keep(a), keeper.keep(b)) == [True, False]  # type: ignore[arg-type]
    assert kept_ids == ["a"] and list(keeper.kept) == ["a"] and keeper.memory_in_use_mb == 256
    # Host memory wanted: the kept process is shed (and destroyed under its kept id).
    assert keeper.shed(100, None) == 256  # type: ignore[arg-type]
    await keeper.close()
    assert destroyed == ["a-kept"] and not keeper.kept
