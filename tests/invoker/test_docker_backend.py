"""The docker backend against a real Docker-API engine: podman's API service, with the runtime image
built from a local root file system."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import docker
import pytest

from dilu_invoker import config
from dilu_invoker.invoker.dataplane.backends.base import ContainerSpec, Mount
from dilu_invoker.invoker.dataplane.backends.docker import DockerBackend
from dilu_invoker.invoker.dataplane.container import State
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.model import (
    GUEST_IDENTITY,
    Action,
    ActionLimits,
    ActivationRequest,
    ActivationStatus,
    Exec,
    new_activation_id,
)

pytestmark = [pytest.mark.podman, pytest.mark.slow]
# The CI hosts' runc refuses nproc limits above 32768 (reference/environment.md §2).
HOST_ULIMITS = "nofile=1024:1024,nproc=32768:32768"


def _req(code: str, *, name: str = "d", memory_mb: int = 256, content: object = None) -> ActivationRequest:
    action = Action(namespace="guest", name=name, exec=Exec(kind="python:3", code=code),
                    limits=replace(ActionLimits(), memory_mb=memory_mb), revision=f"1-{abs(hash(code))}")
    return ActivationRequest(activation_id=new_activation_id(), action=action, identity=GUEST_IDENTITY,
                             content=content)  # type: ignore[arg-type]


@pytest.fixture
async def invoker(podman_socket: str, runtime_images: list[str]) -> AsyncIterator[Invoker]:
    base = config.load(environ={})
    cfg = replace(base, invoker=replace(base.invoker, backend="docker", docker_url=podman_socket, id=7,
                                        idle_timeout_s=60, pause_grace_s=0.3,
                                        docker_ulimits=HOST_ULIMITS))
    async with open_invoker(cfg) as inv:
        yield inv


@pytest.mark.allow_loop_block
async def test_actions_run_in_containers(invoker: Invoker, podman_socket: str) -> None:
    code = "import os\ndef main(a):\n    print('in a container', os.getpid())\n    return {'v': a['v'] * 2}\n"
    first = await invoker.run(_req(code, content={"v": 2}))
    second = await invoker.run(_req(code, content={"v": 5}))
    assert first.response.result == {"v": 4} and second.response.result == {"v": 10}
    assert any("in a container" in line for line in first.logs)
    assert first.annotation("initTime") is not None and second.annotation("initTime") is None
    (proxy,) = invoker.pool.containers.values()
    client = docker.DockerClient(base_url=podman_socket)
    try:
        inspected = client.containers.get(proxy.name).attrs
        host = inspected["HostConfig"]
        assert host["Memory"] == 256 * 1024 * 1024
        # The same guarantees as the process backend: no root, no new privileges, bounded pids, and
        # nothing of the host mounted (no data dir) unless the spec names it.
        assert inspected["Config"]["User"] == "65534:65534"
        assert any("no-new-privileges" in opt for opt in host.get("SecurityOpt") or [])
        assert host["PidsLimit"] == 1024
        assert not inspected.get("Mounts")
        who = await invoker.run(_req("import os\ndef main(a):\n    return {'uid': os.getuid(), 'gid': os.getgid()}\n",
                                     name="who"))
        assert who.response.result == {"uid": 65534, "gid": 65534}
        caps_code = ("def main(a):\n    line = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0]\n"
                     "    return {'capeff': int(line.split()[1], 16)}\n")
        caps = await invoker.run(_req(caps_code, name="caps"))
        net_admin, net_raw = 1 << 12, 1 << 13  # capability bits, linux/capability.h
        assert caps.response.result["capeff"] & (net_admin | net_raw) == 0
        assert inspected["Config"]["Labels"]["dilu.action"] == "guest/d"
        # Idle containers are paused after the grace period and resumed for work.
        await asyncio.sleep(0.8)
        assert proxy.state is State.PAUSED
        assert client.containers.get(proxy.name).status == "paused"
        third = await invoker.run(_req(code, content={"v": 1}))
        assert third.response.result == {"v": 2}
    finally:
        client.close()


@pytest.mark.allow_loop_block
async def test_crashing_container_is_replaced(invoker: Invoker) -> None:
    crash = "import os\ndef main(a):\n    os._exit(1)\n"
    result = await invoker.run(_req(crash, name="crash"))
    assert result.response.status is ActivationStatus.DEVELOPER_ERROR
    ok = await invoker.run(_req("def main(a):\n    return {'ok': True}\n", name="ok"))
    assert ok.response.result == {"ok": True}


@pytest.mark.allow_loop_block
async def test_memory_limit_kills_and_reports(invoker: Invoker) -> None:
    hog = "def main(a):\n    blocks = []\n    while True:\n        blocks.append(bytearray(64 * 1024 * 1024))\n"
    result = await invoker.run(_req(hog, name="hog", memory_mb=128))
    assert result.response.status is ActivationStatus.DEVELOPER_ERROR


@pytest.mark.allow_loop_block
async def test_leftovers_of_an_earlier_run_are_removed(podman_socket: str, runtime_images: list[str]) -> None:
    backend = DockerBackend(url=podman_socket, ulimits=HOST_ULIMITS)
    spec = ContainerSpec(name="wsk9_1_guest_left", kind="python:3", image=runtime_images[0], memory_mb=128,
                         mounts=(Mount("/etc/hostname", "/etc/dilu-test", read_only=True),))
    container = await backend.start(spec)
    assert container.alive
    assert await backend.remove_leftovers("wsk9_") == 1
    client = docker.DockerClient(base_url=podman_socket)
    try:
        assert not client.containers.list(all=True, filters={"name": "wsk9_"})
    finally:
        client.close()
        await backend.close()


@pytest.mark.allow_loop_block
async def test_a_container_reaches_another_at_its_peer_host(podman_socket: str, runtime_images: list[str]) -> None:
    # (a gang's ranks meet at rank 0's peer_host, its MASTER_ADDR: docs/invoker.md, "Gangs (gpu-count)"; the
    # listener is not paused meanwhile, as a gang's rank 0 is not while a run waits for its peers)
    base = config.load(environ={})
    cfg = replace(base, invoker=replace(base.invoker, backend="docker", docker_url=podman_socket, id=8,
                                        idle_timeout_s=60, pause_grace_s=60, docker_ulimits=HOST_ULIMITS))
    async with open_invoker(cfg) as invoker:
        await _peers_meet(invoker)


async def _peers_meet(invoker: Invoker) -> None:
    listen = ("import socket, threading\nserver = socket.create_server(('0.0.0.0', 29500))\n"
              "def serve():\n    while True:\n        conn, _ = server.accept()\n        conn.sendall(b'pong')\n"
              "        conn.close()\nthreading.Thread(target=serve, daemon=True).start()\n"
              "def main(a):\n    return {'listening': True}\n")
    dial = ("import socket\ndef main(a):\n    with socket.create_connection((a['host'], 29500), timeout=10) as c:\n"
            "        return {'got': c.recv(16).decode()}\n")
    first = await invoker.run(_req(listen, name="rank0"))
    assert first.response.result == {"listening": True}, first.response
    [rank0] = [p for p in invoker.pool.containers.values() if p.action.name == "rank0"]
    assert rank0.container is not None
    host = rank0.container.peer_host
    assert host not in ("127.0.0.1", ""), host  # an address on the engine's network
    other = await invoker.run(_req(dial, name="rank1", content={"host": host}))
    assert other.response.result == {"got": "pong"}, other.response
