"""The isolation matrix: through the standalone product (REST API → balancer → invoker → container), actions
try every escape — host secrets, the data dir's Redis config and the invoker's credentials, other
containers' files and runtimes, their own GPU control block, their memory limit, daemons that outlive
them, files left behind — on every backend that runs here. Each attempt must be denied or cleaned up."""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import docker
import pytest

from dilu_invoker import config
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.standalone import Running, run_standalone
from tests.invoker import isolation_actions as attacks
from tests.ow_support.invoker import alive

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="isolation needs root")]
HOST_ULIMITS = "nofile=1024:1024,nproc=32768:32768"
# Uids and container names of this module's own: the checks below look for what is left of *these*
# containers, and another invoker of the host (the other pytest process of `make test`) has the default
# range and prefix.
UID_RANGE = range(236000, 236100)
CONTAINER_PREFIX = "wskiso"


@dataclass
class Product:
    running: Running
    http: aiohttp.ClientSession
    data_dir: Path
    work_dir: Path
    backend: str
    podman: str | None = None

    async def put(self, name: str, code: str, *, kind: str = "python:3", memory: int = 256) -> None:
        body = {"exec": {"kind": kind, "code": code}, "limits": {"memory": memory, "timeout": 20000}}
        async with self.http.put(f"{self.running.api_url}/api/v1/namespaces/_/actions/{name}?overwrite=true",
                                 json=body) as r:
            assert r.status == 200, await r.text()

    async def invoke(self, name: str, params: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        async with self.http.post(f"{self.running.api_url}/api/v1/namespaces/_/actions/{name}?blocking=true",
                                  json=params or {}) as r:
            body = await r.json()
            return r.status, body

    async def result(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        status, body = await self.invoke(name, params)
        assert status == 200, body
        result: dict[str, Any] = body["response"]["result"]
        return result


def _cfg(tmp_path: Path, backend: str, podman: str | None) -> config.Config:
    (tmp_path / "inventory.json").write_text(json.dumps([{"uuid": "GPU-iso", "memory_mb": 16000}]))
    base = config.load(environ={})
    invoker = replace(base.invoker, backend=backend, process_work_dir=str(tmp_path / "work"), idle_timeout_s=60,
                      pause_grace_s=30, container_prefix=CONTAINER_PREFIX,
                      process_uid_range=f"{UID_RANGE.start}-{UID_RANGE.stop - 1}")
    if backend == "docker":
        invoker = replace(invoker, docker_url=podman, docker_ulimits=HOST_ULIMITS, docker_gpu_mode="devices")
    return replace(base, data_dir=str(tmp_path / "data"), api=replace(base.api, port=0), invoker=invoker,
                   gpu=replace(base.gpu, inventory=str(tmp_path / "inventory.json"),
                               shm_dir=str(tmp_path / "shm")),
                   balancer=replace(base.balancer, tick_s=0.2, report_period_s=0.2, report_ttl_s=1.0))


@pytest.fixture(params=["process", "docker"])
async def product(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Product]:
    podman = None
    if request.param == "docker":
        request.getfixturevalue("runtime_images")
        podman = request.getfixturevalue("podman_socket")
    cfg = _cfg(tmp_path, request.param, podman)
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token}"}) as http:
        yield Product(running, http, cfg.data_path, tmp_path / "work", request.param, podman)


def _uid_processes() -> list[int]:
    from dilu_invoker.invoker.dataplane.backends.sandbox import pids_of_uid

    return [pid for pids in pids_of_uid(UID_RANGE).values() for pid in pids]


@pytest.mark.allow_loop_block
async def test_every_escape_is_denied_or_cleaned(product: Product) -> None:
    p = product
    data_files = sorted(str(f) for f in p.data_dir.rglob("*") if f.is_file())
    assert any(f.endswith("redis.conf") for f in data_files)
    assert any("credentials" in f for f in data_files)

    # Host secrets: /etc/shadow.
    await p.put("shadow", attacks.SHADOW)
    shadow = await p.result("shadow")
    assert shadow["escaped"] is False, shadow

    # The data dir: redis.conf (the Redis password) and the invoker's control credentials.
    await p.put("datadir", attacks.READ_TREE)
    data = await p.result("datadir", {"paths": [str(p.data_dir), *data_files]})
    assert data["escaped"] is False, data

    # Another container's files and its runtime.
    await p.put("victim", attacks.VICTIM)
    victim = await p.result("victim")
    assert victim["paths"], victim
    victim_urls = []
    for inv in p.running.invokers:
        for proxy in inv.pool.containers.values():
            if proxy.action.name == "victim" and proxy.container is not None:
                victim_urls.append(proxy.container.url)
                if p.podman:
                    client = docker.DockerClient(base_url=p.podman)
                    try:
                        ip = client.containers.get(proxy.name).attrs["NetworkSettings"]["IPAddress"]
                    finally:
                        client.close()
                    if ip:
                        victim_urls.append(f"http://{ip}:8080")
    assert victim_urls
    others = await p.result("datadir", {"paths": [*victim["paths"], str(p.work_dir)]})
    assert others["escaped"] is False, others
    await p.put("network", attacks.NETWORK)
    net = await p.result("network", {"urls": victim_urls})
    assert net["escaped"] is False, net
    # The victim's runtime was reached and refused (no secret), not merely unreachable.
    assert any(url.startswith(tuple(victim_urls)) and url.endswith("/run") and status == 403
               for url, status in net["tried"]), net

    # Its own GPU control block: readable (the shim needs it), never writable.
    await p.put("control", attacks.CONTROL_BLOCK, kind="python:3-gpu")
    control = await p.result("control")
    assert not control.get("missing"), control  # the shim is built (make shim): GPU actions get a block
    assert control["escaped"] is False and control["readable"] is True, control

    # Memory: 128 MB allowed, 640 MB tried.
    await p.put("hog", attacks.MEMORY, memory=128)
    _status, hog = await p.invoke("hog", {"mb": 640})
    assert hog["response"]["status"] != "success", hog
    assert hog["response"]["result"].get("escaped") is not True
    if p.backend == "process":  # the sandbox's cgroup tells; under docker only a killed PID 1 sets OOMKilled
        assert hog["response"]["result"] == {"error": "The action exhausted its memory and was aborted."}, hog
    assert (await p.result("shadow"))["escaped"] is False  # the invoker goes on
    # The same at /init (the module's code): the cold start fails, and says why.
    await p.put("hog-init", attacks.MEMORY_AT_INIT, memory=128)
    _status, hog = await p.invoke("hog-init", {})
    assert hog["response"]["status"] != "success", hog
    if p.backend == "process":
        assert hog["response"]["result"] == {"error": "The action exhausted its memory and was aborted."}, hog
    assert (await p.result("shadow"))["escaped"] is False

    # Daemons and files outlive nothing.
    await p.put("daemon", attacks.DAEMON)
    daemon = await p.result("daemon")
    token = secrets.token_hex(4)
    await p.put("litter", attacks.LEAVE_FILES)
    litter = await p.result("litter", {"token": token})
    assert litter["left"], litter
    if p.backend == "process":
        assert all(alive(pid) for pid in daemon["pids"])
        assert _uid_processes()
        assert any(os.path.exists(f) for f in litter["left"])

    for inv in p.running.invokers:
        for proxy in list(inv.pool.containers.values()):
            inv.pool.remove(proxy, "isolation test")
    for inv in p.running.invokers:
        await inv.pool.close(drain_s=0)
    if p.backend == "process":
        for pid in daemon["pids"]:
            assert not alive(pid), f"daemon {pid} outlived its container"
        assert _uid_processes() == []
        assert [d.name for d in p.work_dir.iterdir() if d.name != "uids"] == []
    for f in litter["left"]:
        assert not os.path.exists(f), f"{f} was left behind"
    assert not list(Path("/tmp").glob(f"dilu-left-{token}")) and not list(Path("/dev/shm").glob(f"dilu-left-{token}"))
    if p.podman:
        client = docker.DockerClient(base_url=p.podman)
        try:
            left = client.containers.list(all=True, filters={"label": "dilu.invoker"})
            assert not [c.name for c in left if c.name.startswith(CONTAINER_PREFIX)]
        finally:
            client.close()


FAKE_MPS = Path(__file__).resolve().parents[1] / "gpu" / "fakes" / "nvidia-cuda-mps-control"


def _descendants_of(pid: int) -> list[int]:
    from dilu_invoker.invoker.dataplane.backends.sandbox import descendants

    return descendants(pid)


@pytest.mark.allow_loop_block
async def test_mps_clients_share_a_uid_and_nothing_else(tmp_path: Path) -> None:
    """Under MPS the GPU containers of one GPU run as one uid (an MPS daemon serves one uid at a time):
    PID and mount namespaces must keep them apart as separate uids did."""
    cfg = _cfg(tmp_path, "process", None)
    cfg = replace(cfg, gpu=replace(cfg.gpu, mps="on", mps_control=str(FAKE_MPS)))
    token_auth = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token_auth}"}) as http:
        p = Product(running, http, cfg.data_path, tmp_path / "work", "process")
        await p.put("victim", attacks.MPS_MEMBER, kind="python:3-gpu")
        await p.put("thief", attacks.MPS_MEMBER, kind="python:3-gpu")
        token = secrets.token_hex(4)
        victim = await p.result("victim", {"token": token})
        # Its own PID namespace: the runtime is its first process, the worker running the action the next, from
        # the member's own range of PIDs (CUDA IPC handles name their exporter by PID).
        assert victim["procs"][0] == 1 and victim["pid"] % 1000 == 1 and victim["pid"] > 1000, victim
        assert all(victim["pid"] <= q < victim["pid"] + 10 for q in victim["procs"][1:]), victim
        assert victim["uid"] in UID_RANGE, victim
        assert victim["pipe"] and "control" in victim["pipe_listing"], victim  # the daemon's pipes are reachable
        assert victim["pipe_writable"] is False, victim
        host_pids = [pid for inv in p.running.invokers for proxy in inv.pool.containers.values()
                     if proxy.action.name == "victim" and proxy.container is not None
                     for pid in _descendants_of(proxy.container.pid)]
        assert len(host_pids) >= 2, host_pids  # the namespace's leader and the runtime, at least
        thief = await p.result("thief", {"steal": victim["left"] + [
            os.path.join(str(p.work_dir), os.path.basename(victim["home"]), f"secret-{token}")],
            "signal": host_pids})
        assert thief["uid"] == victim["uid"], (thief, victim)  # one uid: the MPS clients of one GPU
        assert thief["procs"][0] == 1 and thief["pid"] % 1000 == 1 and thief["home"] != victim["home"], thief
        assert thief["pid"] != victim["pid"], (thief, victim)  # another range: no CUDA IPC mix-up
        assert thief["read"] == [] and thief["signalled"] == [], thief
        assert not set(thief["procs"]) & set(host_pids), thief
        assert thief["pipe_writable"] is False, thief
        # Its /tmp and /dev/shm were its own: nothing of it is on the host's.
        assert not os.path.exists(f"/tmp/secret-{token}") and not os.path.exists(f"/dev/shm/secret-{token}")
        mps_dir = p.work_dir / "mps" / "invoker0" / "gpu0"
        assert (mps_dir / "pipe").stat().st_uid == victim["uid"]  # its MPS server writes its pipes there
        assert oct((mps_dir / "pipe").stat().st_mode & 0o777) == "0o700"
        assert not (mps_dir / "pipe" / "control.planted").exists()
        # A daemon started by a member (double fork, new session) dies with the member's namespace.
        await p.put("daemon", attacks.DAEMON, kind="python:3-gpu")
        daemon = await p.result("daemon")
        assert daemon["pids"], daemon
        before = _uid_processes()
        for inv in p.running.invokers:
            for proxy in list(inv.pool.containers.values()):
                inv.pool.remove(proxy, "isolation test")
        for inv in p.running.invokers:
            await inv.pool.close(drain_s=0)
        assert not any(alive(pid) for pid in host_pids)
        assert len(before) > len(host_pids) and _uid_processes() == []
        assert sorted(d.name for d in p.work_dir.iterdir() if d.name not in ("uids", "mps")) == []
