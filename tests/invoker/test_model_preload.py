"""Model pre-loading through the product: `standalone` (process backend, a simulated GPU, the embedded
balancer) loads a GPU action that declares `gpu-weights-mb` when it is created over the REST API — one
instance runs its /init (the module-level `models.load` makes it the weights' holder) and goes straight to
staged exit — so the function's first request maps the weights instead of loading them. Failures (an /init
that raises, the cap, the action changed or deleted while it loads) are counted and never fail the PUT.
Runs on the CPU: the models API shares through a memfd there."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest

from dilu_invoker.actions import models
from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.invoker.dataplane.model_preload import ModelPreloader, ModelPreloads
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.standalone import Running, run_standalone
from tests.invoker.staged_support import gpu_kind_preloaded, staged_config
from tests.invoker.staged_support import metric as _metric


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry.name}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    out, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def models_served(pid: int) -> int:
    """How many models the process tree of ``pid`` serves as holder, seen from outside while its /init still
    runs (abstract sockets named like the models API's endpoints among its open files)."""
    inodes: set[int] = set()
    for p in _descendants(pid):
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
    with open("/proc/net/unix") as f:
        lines = f.read().splitlines()[1:]
    return sum(1 for cols in (line.split() for line in lines)
               if len(cols) >= 8 and cols[7].startswith("@dilu-models-") and cols[6].isdigit()
               and int(cols[6]) in inodes)


pytestmark = pytest.mark.slow

CODE = '''
import os
import time
from dilu_invoker.actions import models

time.sleep(float(os.environ.get("SLOW_INIT_S", "0")))
MARK = "{mark}"


def build():
    import numpy as np
    return {{"w": np.arange(1 << 18, dtype=np.float32)}}


W = models.load("w", build)  # at module level: a pre-load's /init loads it
time.sleep({after_s})


def main(args):
    m = models.info("w")
    return {{"mark": MARK, "pid": os.getpid(), "role": m.role, "reason": m.reason, "check": float(W["w"][123456])}}
'''
SLOW = "time.sleep(float(os.environ.get(\"SLOW_INIT_S\", \"0\")))"
IN_MAIN = CODE.replace("W = models.load", "def _later():\n    return models.load").replace(
    "def main(args):\n", "def main(args):\n    W = _later()\n").replace("{after_s}", "0")
RAISES = "import os\nraise RuntimeError('no model today')\ndef main(args):\n    return {}\n"


def _code(mark: str, *, slow_s: float = 0.0, after_s: float = 0.0) -> str:
    code = CODE.format(mark=mark, after_s=after_s)
    return code.replace(SLOW, f"time.sleep({slow_s})") if slow_s else code


@dataclass
class Product:
    running: Running
    http: aiohttp.ClientSession
    budgets: GpuBudgets
    preloads: ModelPreloads

    @property
    def preloader(self) -> ModelPreloader:
        return self.preloads.preloaders[0]

    def url(self, name: str) -> str:
        return f"{self.running.api_url}/api/v1/namespaces/_/actions/{name}"

    async def put(self, name: str, code: str, weights_mb: int = 3000, memory_mb: int = 4000) -> None:
        ann = {"gpu-memory-mb": memory_mb, "gpu-weights-mb": weights_mb, "gpu-sm-request": 0.1, "gpu-sm-limit": 0.2}
        body = {"exec": {"kind": "python:3-gpu", "code": code},
                "annotations": [{"key": k, "value": v} for k, v in ann.items()]}
        async with self.http.put(f"{self.url(name)}?overwrite=true", json=body) as r:
            assert r.status == 200, await r.text()

    async def invoke(self, name: str) -> dict[str, Any]:
        async with self.http.post(f"{self.url(name)}?blocking=true&result=true", json={}) as r:
            assert r.status == 200, await r.text()
            return dict(await r.json())

    def metric(self, name: str, **labels: str) -> float:
        return _metric(generate_latest(self.running.invokers[0].metrics.registry).decode(), name, **labels)

    def events(self, event: str) -> float:
        return self.metric("dilu_invoker_model_preloads_total", event=event)

    async def kept(self) -> list[tuple[str, int, bool]]:
        [uuid] = await self.budgets.node_gpus("invoker0")
        got = await self.budgets.get(uuid)
        assert got is not None
        return sorted((r.function, r.memory_mb, r.kept) for r in got.reservations.values())


async def _until(what: str, check: Callable[[], Awaitable[bool] | bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@asynccontextmanager
async def _product(tmp_path: Path, uuid: str, *, scale_to_zero_after_s: float = 1.0,
                   **invoker: Any) -> AsyncIterator[Product]:
    cfg = staged_config(tmp_path, uuid)
    cfg = replace(cfg, invoker=replace(cfg.invoker, **{"model_preload_mb": 32768, **invoker}),
                  balancer=replace(cfg.balancer, scale_to_zero_after_s=scale_to_zero_after_s))
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token}"}) as http:
        assert running.balancer is not None and running.model_preloads is not None
        running.model_preloads.debounce_s = 0.2  # the default's 0.5 s, shortened
        yield Product(running, http, GpuBudgets(running.balancer.redis, cfg.redis.prefix), running.model_preloads)


async def test_a_created_action_is_loaded_ahead_and_its_first_request_maps_the_weights(tmp_path: Path) -> None:
    async with _product(tmp_path, "GPU-pre") as p:
        assert p.preloader.enabled and p.preloader.cap_mb == 32768
        await p.put("llm", _code("one"))
        await _until("the pre-load to be ready", lambda: p.events("ready") == 1.0)
        # Its compute released, only its weights reserved, marked kept (evictable for anything placed there).
        assert await p.kept() == [("guest/llm", 3000, True)]
        assert p.metric("dilu_invoker_model_preloads_held") == 1.0
        assert p.metric("dilu_invoker_model_preload_memory_mb") == 3000.0
        assert p.metric("dilu_invoker_weights_kept") == 1.0
        invoker = p.running.invokers[0]
        assert not [c for c in invoker.pool.containers.values() if c.action.name == "llm"]  # no instance runs

        first = await p.invoke("llm")
        assert first["role"] == "mapped" and first["check"] == 123456.0, first  # it did not load itself
        assert p.metric("dilu_invoker_weights_kept_events_total", event="reused") == 1.0
        assert (p.events("started"), p.events("failed"), p.events("skipped")) == (1.0, 0.0, 0.0)
        # one copy of the weights in the budget: the kept 3000 + the instance's own 1000
        assert sorted(m for _, m, _ in await p.kept()) == [1000, 3000]


async def test_a_pre_load_leaves_the_last_pre_loaded_container_to_the_first_request(tmp_path: Path) -> None:
    """With one pre-loaded container of the GPU kind, a model pre-load starts a container of its own: taking
    that one would leave the function's first request, if it came before the replacement is ready, waiting
    for it (or for a plain cold start). The first request then takes it, and maps the weights."""
    kind = "python:3-gpu"
    bundled = json.loads((Path(models.__file__).parent / "runtimes.json").read_text())
    async with _product(tmp_path, "GPU-spare", preload=1, user_memory_mb=8192,
                        runtimes_manifest=gpu_kind_preloaded(bundled)) as p:
        ready = lambda: p.metric("dilu_invoker_preload_containers", kind=kind, state="ready")  # noqa: E731
        await _until("a pre-loaded container", lambda: ready() == 1.0, timeout_s=30)
        await p.put("llm", _code("spare"))
        await _until("the pre-load to be ready", lambda: p.events("ready") == 1.0, timeout_s=30)
        # (restarted meanwhile with the module the pre-load's /init imported, learnt: numpy)
        await _until("the pre-loaded container ready again", lambda: ready() == 1.0, timeout_s=30)
        assert p.metric("dilu_invoker_preload_hits_total", kind=kind) == 0.0
        assert p.metric("dilu_invoker_preload_misses_total", kind=kind, reason="left for requests") == 1.0
        first = await p.invoke("llm")
        assert first["role"] == "mapped" and first["check"] == 123456.0, first
        assert p.metric("dilu_invoker_preload_hits_total", kind=kind) == 1.0  # the request took it


async def test_an_init_that_raises_or_loads_nothing_is_counted_and_never_fails_the_put(tmp_path: Path) -> None:
    async with _product(tmp_path, "GPU-bad") as p:
        await p.put("bad", RAISES, weights_mb=1000)  # answered 200 although its pre-load fails
        await _until("the failed pre-load", lambda: p.events("failed") == 1.0)
        assert await p.kept() == [] and p.metric("dilu_invoker_model_preload_memory_mb") == 0.0

        # Code that loads its model on its first call: its pre-load holds nothing, and is not kept.
        await p.put("lazy", IN_MAIN.format(mark="lazy"), weights_mb=1000)
        await _until("the pre-load that held no model", lambda: p.events("no_model") == 1.0)
        assert await p.kept() == [] and p.preloader.holding("guest/lazy") is None

        await p.put("bad", _code("fixed"), weights_mb=1000)  # fixed: pre-loaded now
        await _until("the fixed action's pre-load", lambda: p.events("ready") == 1.0)
        assert await p.kept() == [("guest/bad", 1000, True)]
        assert (p.events("started"), p.events("failed"), p.events("no_model")) == (3.0, 1.0, 1.0)


async def test_the_cap_bounds_what_pre_loads_hold(tmp_path: Path) -> None:
    async with _product(tmp_path, "GPU-cap", model_preload_mb=4000) as p:
        await p.put("a", _code("a"))
        await _until("a's pre-load", lambda: p.events("ready") == 1.0)
        await p.put("b", _code("b"))  # 3000 + 3000 > 4000: skipped
        await _until("b's pre-load to be skipped", lambda: p.events("skipped") == 1.0)
        assert await p.kept() == [("guest/a", 3000, True)]
        await p.put("c", _code("c"), weights_mb=1000)  # 3000 + 1000 fit
        await _until("c's pre-load", lambda: p.events("ready") == 2.0)
        assert await p.kept() == [("guest/a", 3000, True), ("guest/c", 1000, True)]
        assert p.metric("dilu_invoker_model_preload_memory_mb") == 4000.0
        assert p.metric("dilu_invoker_model_preloads_held") == 2.0
        assert (p.events("started"), p.events("failed")) == (2.0, 0.0)


async def test_an_action_changed_or_deleted_while_it_loads_keeps_only_what_is_current(tmp_path: Path) -> None:
    async with _product(tmp_path, "GPU-chg") as p:
        # Two updates within the debounce: one pre-load, of the second.
        await p.put("llm", _code("v1", slow_s=0.6))
        await p.put("llm", _code("v2", slow_s=0.6))
        await _until("v2's pre-load to start", lambda: p.events("started") == 1.0)
        [loading] = p.preloader.live()
        assert "v2" in (loading.action.exec.code or "")
        await p.put("llm", _code("v3"))  # while v2 loads: v2 is let go once loaded, v3 replaces it
        await _until("v3's pre-load", lambda: p.events("ready") == 2.0)
        await _until("v2's release", lambda: p.events("released") == 1.0)
        held = p.preloader.holding("guest/llm")
        assert held is not None and "v3" in (held.action.exec.code or "") and len(p.preloader.held()) == 1
        await _until("one kept copy", lambda: _eq(p.kept(), [("guest/llm", 3000, True)]))

        await p.put("gone", _code("gone", slow_s=0.6), weights_mb=2000)
        await _until("gone's pre-load to start", lambda: p.events("started") == 3.0)
        async with p.http.delete(p.url("gone")) as r:
            assert r.status == 200
        await _until("gone's release", lambda: p.events("released") == 2.0)
        await _until("gone's weights to go", lambda: _eq(p.kept(), [("guest/llm", 3000, True)]))
        assert p.preloader.holding("guest/gone") is None and p.events("failed") == 0.0


async def _eq(got: Awaitable[Any], want: Any) -> bool:
    return bool(await got == want)


async def test_a_first_request_during_the_pre_load_maps_it_and_the_pre_load_is_kept_once_it_is_alone(
        tmp_path: Path) -> None:
    """The first request arrives while the pre-load's /init still runs, after its models.load: its instance
    maps the pre-load's weights; the pre-load stays (idle, pinned) while that instance lives and is kept by
    staged exit once the balancer has scaled the function to zero, holding the weights for the next one."""
    async with _product(tmp_path, "GPU-race", scale_to_zero_after_s=0.5) as p:
        invoker = p.running.invokers[0]
        await p.put("llm", _code("race", after_s=1.2))
        await _until("the pre-load to start", lambda: p.events("started") == 1.0)
        [loading] = p.preloader.live()

        async def holds() -> bool:
            for c in list(invoker.pool.containers.values()):
                if c.key.namespace == f"instance:{loading.instance}" and c.container is not None:
                    return bool(await asyncio.to_thread(models_served, getattr(c.container, "pid", -1)))
            return False

        await _until("the pre-load's holder", holds)
        first = await p.invoke("llm")
        assert first["role"] == "mapped", first
        assert p.events("ready") == 0.0  # still an instance: the first request's may map from it
        await _until("the pre-load to be kept once alone", lambda: p.events("ready") == 1.0)
        assert await p.kept() == [("guest/llm", 3000, True)]
        assert p.metric("dilu_invoker_weights_kept_events_total", event="kept") == 1.0


async def test_a_standalone_stopping_during_a_pre_load_leaves_nothing(tmp_path: Path) -> None:
    pids: list[int] = []
    async with _product(tmp_path, "GPU-stop") as p:
        invoker = p.running.invokers[0]
        await p.put("llm", _code("stop", slow_s=3.0))
        await _until("the pre-load to start", lambda: p.events("started") == 1.0)

        def started() -> bool:
            pids.extend(getattr(c.container, "pid", 0) for c in invoker.pool.containers.values()
                        if c.key.namespace.startswith("instance:model-") and c.container is not None)
            return bool(pids)

        await _until("its container", started)
    assert pids and not any(Path(f"/proc/{pid}").exists() for pid in pids), pids


async def test_with_two_invokers_one_pre_loads_and_the_first_request_maps_there(tmp_path: Path) -> None:
    """`standalone --invokers 2`: the action's pre-load runs on one invoker (chosen by its name); the balancer
    places the first request's instance beside those weights, whichever invoker the request reached."""
    cfg = staged_config(tmp_path, "GPU-two")
    assert cfg.gpu.inventory is not None  # one GPU per invoker, each its own
    Path(cfg.gpu.inventory).write_text(json.dumps({"invokers": {str(i): [{"uuid": f"GPU-two-{i}", "memory_mb": 16000}]
                                                                for i in (0, 1)}}))
    cfg = replace(cfg, invoker=replace(cfg.invoker, model_preload_mb=32768),
                  standalone=replace(cfg.standalone, invokers=2))
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token}"}) as http:
        assert running.balancer is not None and running.model_preloads is not None
        running.model_preloads.debounce_s = 0.2
        p = Product(running, http, GpuBudgets(running.balancer.redis, cfg.redis.prefix), running.model_preloads)
        await p.put("llm", _code("two"))
        preloaders = running.model_preloads.preloaders

        def ready() -> bool:
            return sum(len(x.held()) for x in preloaders) == 1

        await _until("one invoker's pre-load", ready)
        [holder] = [x for x in preloaders if x.held()]
        first = await p.invoke("llm")
        assert first["role"] == "mapped" and first["check"] == 123456.0, first
        # the first request's instance runs where the weights are
        assert [c.action.name for c in holder.invoker.pool.containers.values()] == ["llm"]
        assert sum(_metric(generate_latest(x.invoker.metrics.registry).decode(), "dilu_invoker_model_preloads_total",
                           event="started") for x in preloaders) == 1.0


async def test_a_pre_load_uses_idle_room_only_and_evicts_nothing(tmp_path: Path) -> None:
    """16 GB: a's pre-load keeps 11 GB of weights; b (8 GB) would fit only if a's kept weights went, as they
    would for an instance the balancer places: its pre-load is skipped and a's weights stay."""
    async with _product(tmp_path, "GPU-idle") as p:
        await p.put("a", _code("a"), weights_mb=11000, memory_mb=12000)
        await _until("a's pre-load", lambda: p.events("ready") == 1.0)
        await p.put("b", _code("b"), weights_mb=3000, memory_mb=8000)
        await _until("b's pre-load to be skipped", lambda: p.events("skipped") == 1.0)
        assert await p.kept() == [("guest/a", 11000, True)]
        assert (p.events("started"), p.metric("dilu_invoker_weights_kept_events_total", event="evicted")) == (1.0, 0.0)
