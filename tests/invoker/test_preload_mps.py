"""Pre-loaded GPU containers under MPS (the fake ``nvidia-cuda-mps-control``, the fake libcuda, real runtime
processes of the process backend): before any cold start nothing makes a CUDA context ahead; then the kind's
pre-loaded MPS clients make theirs at the thread cap its cold starts got, a cold start of that cap takes
one, a cold start of another cap takes the contextless one or misses, with its reason in /metrics."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dilu_invoker import config
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.invoker.dataplane.preload import CAP_MISS, Standby
from dilu_invoker.model import (
    GUEST_IDENTITY,
    Action,
    ActivationRequest,
    Exec,
    Parameter,
    new_activation_id,
)

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "cuda_shim"
FAKE_MPS = ROOT / "tests" / "gpu" / "fakes" / "nvidia-cuda-mps-control"
KIND = "python:3-gpu"
CAP_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
CODE = "import os\ndef main(args):\n    return {'cap': os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')}\n"


@pytest.fixture(scope="module")
def fake_driver() -> Path:
    """The shim and the fake libcuda (``make -C cuda_shim tests``); its directory goes on the loader path."""
    if not shutil.which("gcc"):
        pytest.skip("no C compiler")
    r = subprocess.run(["make", "-s", "-C", str(SHIM), "tests"], capture_output=True, text=True, timeout=300,
                       check=False)
    if r.returncode != 0 and "cuda.h" in r.stderr:
        pytest.skip("cuda.h not installed")
    assert r.returncode == 0, r.stderr
    return SHIM / "build" / "fake"


def _cfg(tmp_path: Path, per_kind: int) -> config.Config:
    inventory = tmp_path / "gpus.json"
    inventory.write_text(json.dumps([{"uuid": "GPU-pm-0", "memory_mb": 80_000}]))
    manifest = {"runtimes": {"python": [{"kind": KIND, "preload": ["json"], "preloadMemoryMB": 256,
                                         "image": {"name": "dilu-python3-gpu-runtime"}}]}}
    base = config.load(environ={})
    return replace(
        base, data_dir=str(tmp_path / "data"),
        gpu=replace(base.gpu, inventory=str(inventory), shm_dir=str(tmp_path / "shm"), mps="on",
                    mps_control=str(FAKE_MPS)),
        invoker=replace(base.invoker, preload=per_kind, runtimes_manifest=json.dumps(manifest), user_memory_mb=4096,
                        process_work_dir=str(tmp_path / "work"), idle_timeout_s=60),
        redis=replace(base.redis, prefix=f"pm{per_kind}:"))


def _hook(inv: Invoker) -> GpuNode:
    """The invoker core gives the pool on a GPU node the node's thread-cap oracle (`PreloadPool(mps_cap=...)`)."""
    node, pool = inv.gpu, inv.preload
    assert isinstance(node, GpuNode) and pool is not None
    assert pool.mps_cap == node.mps_cap
    return node


def _action(name: str, limit: float) -> Action:
    notes = {"gpu-class": "inference", "gpu-sm-request": 0.2, "gpu-sm-limit": limit, "gpu-memory-mb": 1000}
    return Action(namespace="guest", name=name, exec=Exec(kind=KIND, code=CODE), revision="1-mps",
                  annotations=tuple(Parameter(k, v) for k, v in notes.items()))


def _req(action: Action) -> ActivationRequest:
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY, content={})


def _metric(inv: Invoker, name: str, **labels: str) -> float:
    return inv.metrics.registry.get_sample_value(name, labels) or 0.0


async def _until(inv: Invoker, want: Callable[[list[Standby]], bool], timeout_s: float = 20.0) -> list[Standby]:
    assert inv.preload is not None
    for _ in range(int(timeout_s / 0.05)):
        ready = [s for s in inv.preload.standbys.get(KIND, []) if s.state == "ready"]
        if want(ready):
            return ready
        await asyncio.sleep(0.05)
    raise AssertionError(f"pre-loaded containers never got there: {inv.preload.standbys.get(KIND)}")


async def _health(standby: Standby) -> dict[str, Any]:
    container = standby.container
    assert container is not None
    headers = {"X-Dilu-Runtime-Secret": container.secret} if container.secret else {}
    async with aiohttp.ClientSession() as s, s.get(f"{container.url}/health", headers=headers) as r:
        body: dict[str, Any] = await r.json(content_type=None)
    return body


def _container_of(inv: Invoker, name: str) -> object:
    return next(p.container for p in inv.pool.containers.values() if p.action.name == name)


async def test_preloaded_mps_clients_make_their_context_at_the_learnt_cap(
        tmp_path: Path, fake_driver: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_driver))
    async with open_invoker(_cfg(tmp_path, per_kind=2)) as inv:
        _hook(inv)
        assert inv.preload is not None
        # Nothing learnt: both wait for /init to make their context (the cap of whoever takes them).
        first = await _until(inv, lambda r: len(r) == 2)
        assert all(s.slot is None and s.mps_cap is None and s.info["cuda"] is False for s in first)
        assert _metric(inv, "dilu_invoker_preload_mps_threads_percent", kind=KIND) == 0
        a = await inv.run(_req(_action("a", 0.6)))
        assert a.annotation("preloaded") is True and a.response.result == {"cap": "60"}, a.logs
        assert inv.preload.learnt_cap(KIND) == 60 and inv.preload.slot_caps(KIND) == [60, None]
        # Its replacement makes its context at 60 %; the other slot stays contextless.
        ready = await _until(inv, lambda r: any(s.mps_cap == 60 for s in r) and len(r) == 2)
        (capped,) = [s for s in ready if s.mps_cap == 60]
        (free,) = [s for s in ready if s.mps_cap is None]
        assert capped.gpu is not None and capped.gpu.env[CAP_ENV] == "60"
        health = (await _health(capped))["preload"]
        assert health["cuda"] is True and health["mps_threads"] == "60" and health["cuda_error"] is None, health
        assert (await _health(free))["preload"]["cuda"] is False
        assert _metric(inv, "dilu_invoker_preload_mps_threads_percent", kind=KIND) == 60
        # Another function of the same cap takes the container with the context ...
        b = await inv.run(_req(_action("b", 0.6)))
        assert b.annotation("preloaded") is True and b.response.result == {"cap": "60"}, b.logs
        assert _container_of(inv, "b") is capped.container
        # ... and one of another cap the contextless one, whose context /init makes at the function's cap.
        c = await inv.run(_req(_action("c", 0.3)))
        assert c.annotation("preloaded") is True and c.response.result == {"cap": "30"}, c.logs
        assert _container_of(inv, "c") is free.container
        assert _metric(inv, "dilu_invoker_preload_hits_total", kind=KIND) == 3
        assert _metric(inv, "dilu_invoker_preload_misses_total", kind=KIND, reason=CAP_MISS) == 0
        assert inv.preload.learnt_cap(KIND) == 60  # 60, 60, 30


async def test_a_cold_start_of_another_cap_misses_the_only_preloaded_container(
        tmp_path: Path, fake_driver: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_driver))
    async with open_invoker(_cfg(tmp_path, per_kind=1)) as inv:
        _hook(inv)
        assert inv.preload is not None
        await _until(inv, lambda r: len(r) == 1)
        a = await inv.run(_req(_action("a", 0.6)))
        assert a.annotation("preloaded") is True
        (capped,) = await _until(inv, lambda r: len(r) == 1 and r[0].mps_cap == 60)
        assert capped.info["cuda"] is True and capped.info["mps_threads"] == "60"
        c = await inv.run(_req(_action("c", 0.3)))
        assert c.annotation("preloaded") is None and c.response.result == {"cap": "30"}, c.logs
        assert _metric(inv, "dilu_invoker_preload_misses_total", kind=KIND, reason=CAP_MISS) == 1
        # 60 once, 30 once: with a single slot no cap is worth a context made ahead any more.
        assert inv.preload.learnt_cap(KIND) == 60 and inv.preload.slot_caps(KIND) == [None]
        (free,) = await _until(inv, lambda r: len(r) == 1 and r[0] is not capped)
        assert free.slot is None and free.mps_cap is None and free.info["cuda"] is False
        assert capped.state == "removed" and _metric(inv, "dilu_invoker_preload_discarded_total", kind=KIND,
                                                     reason="MPS thread cap no longer wanted") == 1
        b = await inv.run(_req(_action("b", 0.6)))
        assert b.annotation("preloaded") is True and _container_of(inv, "b") is free.container
        assert b.response.result == {"cap": "60"}
        assert _metric(inv, "dilu_invoker_preload_hits_total", kind=KIND) == 2
        assert _metric(inv, "dilu_invoker_preload_mps_threads_percent", kind=KIND) == 0


def test_a_worker_with_a_context_refuses_an_init_of_another_cap(tmp_path: Path) -> None:
    """The last guard: a process whose context was made at one cap never runs a function at another."""
    import socket

    from dilu_invoker.actions import worker

    ours, _theirs = socket.socketpair()
    with ours, _theirs:
        w = worker.Worker(ours, action_dir=str(tmp_path), concurrent=False)
        w.context_cap = "60"
        body = {"value": {"code": "def main(a):\n    return {}\n", "env": {CAP_ENV: "30"}}}
        with pytest.raises(worker.InitFailure, match="MPS thread cap 60%, not the function's 30%"):
            w._load(json.dumps(body).encode())
        assert not (tmp_path / "main__.py").exists()  # refused before anything of the action was written
    # (an /init at the context's own cap loads: the cold starts above that took a container with a context)


def _pool(per_kind: int, caps: dict[str, float | None], registry: Any = None) -> Any:
    """A pool of the GPU kind whose GPU node answers ``caps`` (function name → its cap now)."""
    from prometheus_client import CollectorRegistry

    from dilu_invoker.invoker.dataplane.preload import PreloadPool
    from dilu_invoker.invoker.manifest import Manifest

    manifest = Manifest.load(json.dumps({"runtimes": {"python": [{"kind": KIND, "preload": [],
                                                                   "image": {"name": "x"}}]}}))
    return PreloadPool(manifest=manifest, backend=None, session=None, per_kind=per_kind,  # type: ignore[arg-type]
                       memory_mb=256, budget_mb=1024, gpu_budget_mb=4096, learn=0, make_spec=None,  # type: ignore[arg-type]
                       room_mb=lambda: 0, registry=registry or CollectorRegistry(), name_prefix="t", has_gpus=True,
                       check_importable=False, mps_cap=lambda fn, _needs, _gpu: caps[fn.split("/")[1]])


async def test_the_learnt_cap_is_the_most_frequent_and_a_tie_keeps_the_one_in_use() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    pool = _pool(3, {"a": 0.6, "b": 0.3, "c": 0.704, "off": None}, registry)
    runtime = pool.kinds[KIND]
    assert pool.learnt_cap(KIND) is None and pool.slot_caps(KIND) == [None, None, None]
    pool.take(runtime, _action("off", 0.5))  # a GPU not under MPS: nothing learnt
    assert pool.learnt_cap(KIND) is None
    for name in ("a", "b"):
        pool.take(runtime, _action(name, 0.5))
    assert pool.learnt_cap(KIND) == 60  # a tie: the first stays
    assert pool.slot_caps(KIND) == [60, 60, None]
    pool.take(runtime, _action("b", 0.5))
    assert pool.learnt_cap(KIND) == 30 and pool.slot_caps(KIND) == [30, 30, None]
    pool.take(runtime, _action("c", 0.5))  # 0.704 is MPS's 70 %
    pool.take(runtime, _action("c", 0.5))
    assert pool.learnt_cap(KIND) == 30  # 60: 1, 30: 2, 70: 2 → the one in use
    # One slot: a context made ahead only while nearly every cold start got that cap.
    sole = _pool(1, {"a": 0.6, "b": 0.3})
    assert sole.slot_caps(KIND) == [None]
    sole.take(runtime, _action("a", 0.5))
    assert sole.slot_caps(KIND) == [60]
    sole.take(runtime, _action("b", 0.5))
    assert sole.learnt_cap(KIND) == 60 and sole.slot_caps(KIND) == [None]
    for _ in range(3):
        sole.take(runtime, _action("a", 0.5))
    assert sole.slot_caps(KIND) == [60]  # 4 of 5
    # Every take was a miss (nothing pre-loaded here), counted as such.
    assert registry.get_sample_value("dilu_invoker_preload_misses_total",
                                     {"kind": KIND, "reason": "none available"}) == 6
    await asyncio.sleep(0)  # the refills (no room: nothing starts)
    assert pool.standbys[KIND] == []


async def test_containers_of_a_cap_no_longer_wanted_are_replaced() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    pool = _pool(2, {"a": 0.6, "b": 0.3}, registry)
    runtime = pool.kinds[KIND]
    old = Standby(name="old", kind=KIND, memory_mb=256, slot=60, state="ready")
    free = Standby(name="free", kind=KIND, memory_mb=256, slot=None, state="ready")
    pool.standbys[KIND] = [old, free]
    pool.take(runtime, _action("b", 0.3))  # learns 30; takes the contextless one (the 60 one does not fit)
    assert pool.standbys[KIND] == [old] and free.state == "taken"
    pool.refill(KIND)
    assert pool.standbys[KIND] == [] and old.state == "removed"
    assert registry.get_sample_value("dilu_invoker_preload_discarded_total",
                                     {"kind": KIND, "reason": "MPS thread cap no longer wanted"}) == 1
    await pool.close()


async def test_without_mps_nothing_is_learnt_and_every_preloaded_container_has_its_context(
        tmp_path: Path, fake_driver: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_driver))
    cfg = _cfg(tmp_path, per_kind=1)
    cfg = replace(cfg, gpu=replace(cfg.gpu, mps="off"))
    async with open_invoker(cfg) as inv:
        _hook(inv)
        assert inv.preload is not None
        (standby,) = await _until(inv, lambda r: len(r) == 1)
        # time-sliced: the context is made ahead whatever the function (the driver's, no torch here)
        assert standby.info["cuda"] is True and standby.info["mps_threads"] is None and standby.mps_cap is None
        a = await inv.run(_req(_action("a", 0.6)))
        assert a.annotation("preloaded") is True and a.response.result == {"cap": None}
        assert inv.preload.learnt_cap(KIND) is None and inv.preload.slot_caps(KIND) == [None]
        (again,) = await _until(inv, lambda r: len(r) == 1)
        assert again.slot is None and again.info["cuda"] is True
