"""Pre-loaded containers against real runtime processes (process backend): the pre-loaded path is taken
and refilled, functions never see each other, --preload 0 turns it off, memory pressure sheds pre-loaded
containers before warm ones, learning, and the worker's pre-load hook."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import types
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from dilu_invoker import cli, config
from dilu_invoker.actions import worker
from dilu_invoker.invoker.dataplane.container import State
from dilu_invoker.invoker.dataplane.core import ContainerExit, Invoker, open_invoker
from dilu_invoker.invoker.manifest import Manifest, ManifestError
from dilu_invoker.model import GUEST_IDENTITY, Action, ActionLimits, ActivationRequest, Exec, new_activation_id

ROOT = Path(__file__).resolve().parents[2]


def _manifest(preload: list[str] | None) -> str:
    entry: dict[str, object] = {"kind": "python:3", "default": True,
                                "image": {"prefix": "localhost", "name": "dilu-python3-runtime", "tag": "0.1.0"}}
    if preload is not None:
        entry["preload"] = preload
    return json.dumps({"runtimes": {"python": [entry]}})


def _cfg(preload: int = 1, modules: list[str] | None = None, **invoker: object) -> config.Config:
    base = config.load(environ={})
    invoker.setdefault("runtimes_manifest", _manifest(modules if modules is not None else ["decimal"]))
    inv = replace(base.invoker, preload=preload, **invoker)  # type: ignore[arg-type]
    return replace(base, invoker=inv)


def _action(code: str, name: str, **limits: int) -> Action:
    return Action(namespace="guest", name=name, exec=Exec(kind="python:3", code=code),
                  limits=replace(ActionLimits(), **limits), revision=f"1-{abs(hash(code))}")


def _req(action: Action, content: object = None) -> ActivationRequest:
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                             content=content)


def _metric(inv: Invoker, name: str, **labels: str) -> float:
    value = inv.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def _ready(inv: Invoker, kind: str = "python:3", n: int = 1, timeout_s: float = 20.0) -> None:
    assert inv.preload is not None
    for _ in range(int(timeout_s / 0.05)):
        if sum(1 for s in inv.preload.standbys.get(kind, []) if s.state == "ready") >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no pre-loaded container became ready: {inv.preload.standbys.get(kind)}")


@pytest.fixture
async def invoker() -> AsyncIterator[Invoker]:
    async with open_invoker(_cfg(user_memory_mb=1024, idle_timeout_s=60)) as inv:
        yield inv


PROBE = (
    "import os, sys\n"
    "def main(args):\n"
    "    import decimal\n"
    "    return {'pid': os.getpid(), 'uid': os.getuid(), 'cwd': os.getcwd(), 'leak': getattr(decimal, 'LEAK', None),\n"
    "            'files': sorted(os.listdir(os.environ['HOME']))}\n"
)
# Imported by the manifest's list, not by the action: True only when the worker pre-loaded it.
SEES_PRELOAD = "import sys\nPRE = 'decimal' in sys.modules\ndef main(args):\n    return {'pre': PRE}\n"


async def test_cold_start_takes_a_preloaded_container_and_a_replacement_refills(invoker: Invoker) -> None:
    await _ready(invoker)
    first = invoker.preload.standbys["python:3"][0]  # type: ignore[union-attr]
    result = await invoker.run(_req(_action(SEES_PRELOAD, "sees")))
    assert result.response.result == {"pre": True}
    assert result.annotation("preloaded") is True and result.annotation("initTime") is not None
    assert _metric(invoker, "dilu_invoker_preload_hits_total", kind="python:3") == 1
    proxy = next(iter(invoker.pool.containers.values()))
    assert proxy.preloaded and proxy.container is first.container
    # The replacement is another container, pre-loaded in the background.
    await _ready(invoker)
    assert invoker.preload.standbys["python:3"][0] is not first  # type: ignore[union-attr]
    assert _metric(invoker, "dilu_invoker_preload_started_total", kind="python:3") == 2
    assert _metric(invoker, "dilu_invoker_preload_containers", kind="python:3", state="ready") == 1
    assert _metric(invoker, "dilu_invoker_preload_memory_mb") == invoker.cfg.invoker.preload_memory_mb
    # Warm runs are plain warm runs.
    again = await invoker.run(_req(_action(SEES_PRELOAD, "sees")))
    assert again.annotation("initTime") is None and again.annotation("preloaded") is None


async def test_a_second_function_never_sees_the_first(invoker: Invoker) -> None:
    await _ready(invoker)
    leaky = ("import os, decimal\nSECRET = 'a-secret'\n"
             "def main(args):\n    decimal.LEAK = SECRET\n"
             "    open(os.path.join(os.environ['HOME'], 'a-file'), 'w').write(SECRET)\n"
             "    return {'pid': os.getpid(), 'uid': os.getuid(), 'home': os.environ['HOME']}\n")
    a = await invoker.run(_req(_action(leaky, "first")))
    assert a.annotation("preloaded") is True
    await _ready(invoker)
    b = await invoker.run(_req(_action(PROBE, "second")))
    assert b.annotation("preloaded") is True
    ra, rb = a.response.result, b.response.result
    assert rb["leak"] is None and "a-file" not in rb["files"]
    assert ra["pid"] != rb["pid"] and ra["home"] != rb["cwd"]
    if invoker.backend.sandboxes.isolating:  # type: ignore[attr-defined]
        assert ra["uid"] != rb["uid"]
    # The first function's container is still its own (a pre-loaded container serves one function).
    names = {p.action.name for p in invoker.pool.containers.values() if p.state is State.READY}
    assert names == {"first", "second"}


async def test_preload_zero_turns_it_off() -> None:
    async with open_invoker(_cfg(preload=0, user_memory_mb=1024)) as inv:
        assert inv.preload is None
        result = await inv.run(_req(_action(SEES_PRELOAD, "plain")))
        assert result.response.result == {"pre": False}, result.logs
        assert result.annotation("initTime") is not None and result.annotation("preloaded") is None


async def test_the_budget_bounds_preloaded_containers() -> None:
    async with open_invoker(_cfg(preload=3, preload_memory_mb=256, preload_budget_mb=600,
                                 user_memory_mb=2048)) as inv:
        await _ready(inv, n=2)
        assert inv.preload is not None and len(inv.preload.standbys["python:3"]) == 2
        assert _metric(inv, "dilu_invoker_preload_memory_mb") == 512


async def test_a_kind_without_a_preload_list_is_not_preloaded() -> None:
    async with open_invoker(_cfg(modules=None, user_memory_mb=1024, runtimes_manifest=_manifest(None))) as inv:
        assert inv.preload is None


async def test_memory_pressure_sheds_preloaded_before_warm_containers() -> None:
    cfg = _cfg(user_memory_mb=512, preload_memory_mb=256, idle_timeout_s=60)
    async with open_invoker(cfg) as inv:
        exits: list[ContainerExit] = []
        inv.add_exit_hook(exits.append)
        await _ready(inv)
        warm = await inv.run(_req(_action(PROBE, "warm", memory_mb=256)))
        assert warm.annotation("preloaded") is True and "leak" in warm.response.result, warm.logs
        # 256 MB of warm container + 256 MB for the replacement: full.
        await _ready(inv)
        warm_proxy = next(p for p in inv.pool.containers.values() if p.action.name == "warm")
        # A concurrent action cannot take a pre-loaded container (its runtime is not in concurrent mode),
        # so the pre-loaded one is released for it, not the warm container.
        other = await inv.run(_req(_action(PROBE, "other", memory_mb=256, concurrency=2)))
        assert other.response.result["leak"] is None
        assert other.annotation("preloaded") is None
        assert warm_proxy.state is State.READY and warm_proxy.name in inv.pool.containers
        assert _metric(inv, "dilu_invoker_preload_discarded_total", kind="python:3",
                       reason="memory needed by an action") == 1
        assert _metric(inv, "dilu_invoker_preload_misses_total", kind="python:3", reason="concurrent action") == 1
        assert inv.preload is not None and inv.preload.memory_in_use_mb == 0  # no room to refill
        inv.stop_instance(warm_proxy.name, "test")
        for _ in range(100):
            if exits:
                break
            await asyncio.sleep(0.05)
        assert [e.action for e in exits] == ["guest/warm"] and exits[0].reason == "test"


async def test_a_cold_start_that_takes_the_preloaded_container_needs_no_room_for_it() -> None:
    # 256 MB warm + 256 MB pre-loaded = the whole user memory; the next cold start of the kind takes the
    # pre-loaded container (it becomes that container) instead of evicting anything.
    async with open_invoker(_cfg(user_memory_mb=512, preload_memory_mb=256, idle_timeout_s=60)) as inv:
        await _ready(inv)
        await inv.run(_req(_action(PROBE, "warm", memory_mb=256)))
        await _ready(inv)
        warm_proxy = next(p for p in inv.pool.containers.values() if p.action.name == "warm")
        second = await inv.run(_req(_action(PROBE, "second", memory_mb=256)))
        assert second.annotation("preloaded") is True
        assert warm_proxy.state is State.READY
        assert _metric(inv, "dilu_invoker_preload_discarded_total", kind="python:3",
                       reason="memory needed by an action") == 0


async def test_learns_installed_modules_actions_import(invoker: Invoker) -> None:
    await _ready(invoker)
    result = await invoker.run(_req(_action("import msgpack\ndef main(a):\n    return {}\n", "learner")))
    assert result.response.status.api_string == "success"
    assert invoker.preload is not None
    for _ in range(100):
        if "msgpack" in invoker.preload.modules_for("python:3"):
            break
        await asyncio.sleep(0.05)
    assert invoker.preload.modules_for("python:3") == ("decimal", "msgpack")
    # The replacement spawned when the cold start took its container started before msgpack was learnt:
    # it is started again with it, so the next cold start of the kind finds msgpack imported.
    for _ in range(200):
        ready = [s for s in invoker.preload.standbys["python:3"] if s.state == "ready"]
        if ready and all("msgpack" in s.modules for s in invoker.preload.standbys["python:3"]):
            break
        await asyncio.sleep(0.05)
    assert ready and all(s.modules == ("decimal", "msgpack") for s in invoker.preload.standbys["python:3"])
    assert "msgpack" in (ready[0].info.get("modules") or [])
    assert _metric(invoker, "dilu_invoker_preload_discarded_total", kind="python:3",
                   reason="modules learnt since it started") == 1
    # At most one such restart per kind in RELEARN_MIN_S: a new name right after waits for the next refill.
    invoker.preload.learn("python:3", ["structlog"])
    assert "structlog" in invoker.preload.modules_for("python:3")
    assert _metric(invoker, "dilu_invoker_preload_discarded_total", kind="python:3",
                   reason="modules learnt since it started") == 1
    assert all("structlog" not in s.modules for s in invoker.preload.standbys["python:3"])
    # The report comes from the action's process: the standard library, unknown names and the action's
    # own modules are never learnt.
    invoker.preload.learn("python:3", ["json", "antigravity", "no_such_package", "main__", "os.path"])
    assert invoker.preload.modules_for("python:3") == ("decimal", "msgpack", "structlog")


async def test_learns_modules_main_imports_lazily_after_the_first_run(invoker: Invoker) -> None:
    """A `main` that imports its library on its first call (common for heavy libraries): /init reports
    nothing new, the first run reports it (before its result) and the invoker learns it from that."""
    await _ready(invoker)
    code = "def main(a):\n    import msgpack\n    return {'packed': len(msgpack.packb([1, 2]))}\n"
    result = await invoker.run(_req(_action(code, "lazy")))
    assert result.response.result == {"packed": 3}
    assert invoker.preload is not None
    for _ in range(100):
        if "msgpack" in invoker.preload.modules_for("python:3"):
            break
        await asyncio.sleep(0.05)
    assert invoker.preload.modules_for("python:3") == ("decimal", "msgpack")
    proxy = next(p for p in invoker.pool.containers.values() if p.action.name == "lazy")
    assert proxy.run_imports_learnt and proxy.container is not None
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.container.url}/health", headers={
            "X-Dilu-Runtime-Secret": proxy.container.secret or ""}) as r:
        health = await r.json()
    assert health["imports"] == [] and health["run_imports"] == ["msgpack"]
    # Reported once: a second run of the same container neither reports nor counts it again.
    again = await invoker.run(_req(_action(code, "lazy")))
    assert again.response.result == {"packed": 3}
    await asyncio.sleep(0.2)
    assert invoker.preload._learnt["python:3"]["msgpack"] == 1


async def test_the_package_an_action_imports_is_learnt_before_what_it_pulls_in() -> None:
    """`import yarl` also imports idna, multidict and propcache (all installed): with room to learn one
    module, the one learnt is the package the action imported, not the first of its dependencies by name."""
    async with open_invoker(_cfg(user_memory_mb=1024, idle_timeout_s=60, preload_learn=1)) as inv:
        await _ready(inv)
        result = await inv.run(_req(_action("import yarl\ndef main(a):\n    return {}\n", "pulls")))
        assert result.response.status.api_string == "success"
        assert inv.preload is not None
        for _ in range(100):
            if len(inv.preload.modules_for("python:3")) > 1:
                break
            await asyncio.sleep(0.05)
        assert inv.preload.modules_for("python:3") == ("decimal", "yarl")


def test_manifest_preload_lists_are_checked() -> None:
    assert Manifest.load(_manifest(["torch", "a.b"])).runtimes["python:3"].preload == ("torch", "a.b")
    assert Manifest.load(_manifest(None)).runtimes["python:3"].preload is None
    with pytest.raises(ManifestError, match="not modules"):
        Manifest.load(_manifest(["os; rm"]))
    with pytest.raises(ManifestError, match="preloadMemoryMB"):
        Manifest.from_json({"runtimes": {"python": [{"kind": "python:3", "image": {"name": "x"}, "preload": [],
                                                     "preloadMemoryMB": 0}]}})
    bundled = Manifest.load()
    assert bundled.runtimes["python:3-gpu"].preload == ("torch", "torchvision")
    assert bundled.runtimes["python:3-gpu"].preload_memory_mb == 3072
    assert bundled.runtimes["python:3"].preload is None


def test_preload_flag_and_environment() -> None:
    with pytest.raises(config.ConfigError, match="--preload"):
        config.load(environ={"DILU_INVOKER_PRELOAD": "-1"})
    for command in ("standalone", "invoker"):
        args = cli.build_parser().parse_args([command, "--preload", "2"])
        assert config.load(args, environ={}).invoker.preload == 2
    assert config.load(environ={"DILU_INVOKER_PRELOAD": "0"}).invoker.preload == 0
    assert config.load(environ={}).invoker.preload == 1


def test_worker_preload_tolerates_missing_modules_and_reports_cuda_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    info = worker.preload(["json", "no_such_module_here", "bad name"], cuda=True)
    assert info["modules"] == ["json"] and info["missing"] == ["no_such_module_here", "bad name"]
    assert info["cuda"] is False and info["cuda_error"] is None  # no torch or cupy imported: skipped

    def broken_init() -> None:
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True, init=broken_init))
    monkeypatch.setitem(sys.modules, "torch", fake)
    info = worker.preload([], cuda=True)
    assert info["cuda"] is False and "no CUDA-capable device" in info["cuda_error"]


async def test_a_crashed_preloaded_container_is_discarded_and_a_plain_start_follows(invoker: Invoker) -> None:
    await _ready(invoker)
    assert invoker.preload is not None
    (standby,) = invoker.preload.standbys["python:3"]
    assert standby.container is not None
    os.killpg(standby.container.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    for _ in range(100):
        if not standby.container.alive:
            break
        await asyncio.sleep(0.02)
    result = await invoker.run(_req(_action(SEES_PRELOAD, "after-crash")))
    assert result.response.result == {"pre": False} and result.annotation("preloaded") is None
    assert _metric(invoker, "dilu_invoker_preload_discarded_total", kind="python:3",
                   reason="failed while handed over") == 1
    await _ready(invoker)  # and the kind is refilled


async def test_standalone_serves_preloaded_cold_starts_and_metrics(tmp_path: Path) -> None:
    """Through the product: `dilu-invoker standalone --preload 1`, an action created and invoked over REST."""
    api, inv_port = _free_port(), _free_port()
    data = tmp_path / "data"
    env = {**os.environ, "RUNTIMES_MANIFEST": _manifest(["decimal"]), "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir", str(data), "--api-port", str(api),
        "--invoker-port", str(inv_port), "--preload", "1", "--log-level", "warning",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    auth = {"Authorization": aiohttp.encode_basic_auth(GUEST_IDENTITY.uuid, GUEST_IDENTITY.key)}
    base = f"http://127.0.0.1:{api}/api/v1/namespaces/_/actions/sees"
    try:
        async with aiohttp.ClientSession(headers=auth) as s:
            for _ in range(400):
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(f"http://127.0.0.1:{inv_port}/metrics") as r:
                        if 'state="ready"} 1.0' in await r.text():
                            break
                assert proc.returncode is None
                await asyncio.sleep(0.05)
            async with s.put(base, json={"exec": {"kind": "python:3", "code": SEES_PRELOAD}}) as r:
                assert r.status == 200, await r.text()
            async with s.post(f"{base}?blocking=true") as r:
                record = await r.json()
            assert record["response"]["result"] == {"pre": True}
            annotations = {a["key"]: a["value"] for a in record["annotations"]}
            assert annotations["preloaded"] is True and "initTime" in annotations
            async with s.get(f"http://127.0.0.1:{inv_port}/metrics") as r:
                metrics = await r.text()
            assert 'dilu_invoker_preload_hits_total{kind="python:3"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
