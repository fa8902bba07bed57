"""Runs action containers through a Docker-API engine (Docker, or podman's API service).

One image per kind (from the runtimes manifest) or the action's own image for docker actions; the runtime
listens on 8080 inside, published on a random 127.0.0.1 port. Containers get OpenWhisk's hardening
(``--cap-drop NET_RAW --cap-drop NET_ADMIN``, a pids limit, a nofile limit), a memory limit with no swap,
an unprivileged user (``--invoker-docker-user``, nobody by default) with ``no-new-privileges``, no mount of
anything of the host but what the spec names (the shim, its read-only control block, its stats block),
labels, and for GPU actions the GPU (by ``device_requests`` for the NVIDIA container toolkit, by CDI name
under podman, or by explicit ``/dev/nvidia*`` nodes), the shim and its control files as bind mounts.
Logs come from the attach stream, demultiplexed into stdout and stderr.

The docker SDK is synchronous: every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import docker
import docker.errors
import structlog
from docker.types import DeviceRequest, Ulimit

from dilu_invoker.invoker.dataplane.backends.base import BackendError, ContainerSpec, ImageError

if TYPE_CHECKING:
    from dilu_invoker.invoker.dataplane.runtime_client import DirectLane

log = structlog.get_logger(__name__)

RUNTIME_PORT = "8080/tcp"


class DockerContainer:
    def __init__(self, backend: DockerBackend, container: Any, name: str, url: str, secret: str | None,
                 peer_host: str = "127.0.0.1") -> None:
        self._backend = backend
        self._container = container
        self.name = name
        self.url = url
        #: its IP on its Docker network, where the other containers of the network reach it (docs/invoker.md,
        #: "Gangs (gpu-count)")
        self.peer_host = peer_host
        self.secret = secret
        #: no direct lane into a docker container: /run goes over the runtime's HTTP
        self.lane: DirectLane | None = None
        loop = asyncio.get_running_loop()
        self.stdout = asyncio.StreamReader(limit=1 << 20, loop=loop)
        self.stderr = asyncio.StreamReader(limit=1 << 20, loop=loop)
        self._exit_reason: str | None = None
        self._destroyed = False
        self._exited = threading.Event()

    @property
    def alive(self) -> bool:
        return not self._destroyed and not self._exited.is_set()

    def _pump_logs(self, stream: Iterator[tuple[bytes | None, bytes | None]], loop: asyncio.AbstractEventLoop) -> None:
        """Thread: demultiplexed attach frames → the two StreamReaders."""
        try:
            for out, err in stream:
                if out:
                    loop.call_soon_threadsafe(self.stdout.feed_data, out)
                if err:
                    loop.call_soon_threadsafe(self.stderr.feed_data, err)
        except Exception as exc:  # noqa: BLE001 - the engine closed the stream
            log.debug("log stream ended", container=self.name, error=repr(exc))
        finally:
            self._exited.set()
            self._exit_reason = self._inspect_exit()
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.stdout.feed_eof)
                loop.call_soon_threadsafe(self.stderr.feed_eof)

    def _inspect_exit(self) -> str | None:
        try:
            self._container.reload()
        except Exception:  # noqa: BLE001 - already removed
            return "removed"
        state = self._container.attrs.get("State", {})
        if state.get("OOMKilled"):
            return "oom"
        if state.get("Running"):
            return None
        return f"exit {state.get('ExitCode')}"

    async def set_memory_limit(self, memory_mb: int) -> None:
        """A pre-loaded container becomes an action's: the engine applies the action's limit (it refuses one
        below what the container already uses)."""
        memory = f"{memory_mb}m"
        await asyncio.to_thread(self._container.update, mem_limit=memory, memswap_limit=memory)

    async def pause(self) -> None:
        await asyncio.to_thread(self._container.pause)

    async def resume(self) -> None:
        await asyncio.to_thread(self._container.unpause)

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        try:
            await asyncio.to_thread(self._container.remove, force=True)
        except docker.errors.NotFound:
            pass
        except Exception as exc:  # noqa: BLE001 - never raise from destroy
            log.warning("container removal failed", container=self.name, error=repr(exc))

    def exit_reason(self) -> str | None:
        return self._exit_reason


def parse_ulimits(text: str) -> tuple[Ulimit, ...]:
    """``"nofile=1024:1024,nproc=4096"`` → docker Ulimits (a single number sets soft and hard)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, values = item.partition("=")
        soft, _, hard = values.partition(":")
        try:
            out.append(Ulimit(name=name, soft=int(soft), hard=int(hard or soft)))
        except ValueError:
            raise ValueError(f"bad ulimit {item!r}: expected name=soft[:hard]") from None
    return tuple(out)


class DockerBackend:
    name = "docker"

    def __init__(
        self,
        *,
        url: str | None = None,
        network: str | None = None,
        gpu_mode: str = "device-requests",
        pids_limit: int = 1024,
        ulimits: str = "nofile=1024:1024",
        user: str = "65534:65534",
    ) -> None:
        self._url = url
        self._network = network
        self._gpu_mode = gpu_mode
        self._pids_limit = pids_limit
        self._ulimits = parse_ulimits(ulimits)
        self._user = user
        self._client: docker.DockerClient | None = None

    def _docker(self) -> docker.DockerClient:
        if self._client is None:
            self._client = docker.DockerClient(base_url=self._url) if self._url else docker.from_env()
        return self._client

    async def start(self, spec: ContainerSpec) -> DockerContainer:
        loop = asyncio.get_running_loop()
        # Our runtime answers only callers with the container's secret; an upstream image ignores it.
        secret = secrets.token_urlsafe(24) if spec.own_runtime else None
        if secret is not None:
            spec = replace(spec, env={**spec.env, "DILU_RUNTIME_SECRET": secret})
        container, port, stream = await asyncio.to_thread(self._start_sync, spec)
        wrapped = DockerContainer(self, container, spec.name, f"http://127.0.0.1:{port}", secret,
                                  peer_host=network_address(container.attrs, self._network))
        threading.Thread(target=wrapped._pump_logs, args=(stream, loop), name=f"logs-{spec.name}",
                         daemon=True).start()
        log.debug("docker container started", container=spec.name, image=spec.image, port=port)
        return wrapped

    def _create_kwargs(self, spec: ContainerSpec) -> dict[str, Any]:
        memory = f"{spec.memory_mb}m"
        kwargs: dict[str, Any] = {
            "name": spec.name,
            "detach": True,
            "labels": dict(spec.labels),
            "environment": dict(spec.env),
            "mem_limit": memory,
            "memswap_limit": memory,
            "cap_drop": ["NET_RAW", "NET_ADMIN"],
            "security_opt": ["no-new-privileges"],
            "pids_limit": self._pids_limit,
            "ulimits": list(self._ulimits),
            "ports": {RUNTIME_PORT: ("127.0.0.1", None)},
            "volumes": {m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"} for m in spec.mounts},
        }
        if self._user:
            kwargs["user"] = self._user
        if self._network:
            kwargs["network"] = self._network
        devices = [f"{d}:{d}:rwm" for d in spec.devices]
        gpus = spec.env.get("DILU_GPU_UUID")
        if gpus and self._gpu_mode == "device-requests":  # NVIDIA container toolkit
            kwargs["device_requests"] = [DeviceRequest(device_ids=gpus.split(","), capabilities=[["gpu"]])]
        elif gpus and self._gpu_mode == "cdi":
            devices += [f"nvidia.com/gpu={g}" for g in gpus.split(",")]
        if devices:
            kwargs["devices"] = devices
        if spec.env.get("CUDA_MPS_PIPE_DIRECTORY"):  # an MPS client: MPS shares memory with its daemon
            kwargs["ipc_mode"] = "host"
        return kwargs

    def _start_sync(self, spec: ContainerSpec) -> tuple[Any, str, Iterator[tuple[bytes | None, bytes | None]]]:
        client = self._docker()
        try:
            container = client.containers.create(spec.image, **self._create_kwargs(spec))
        except docker.errors.ImageNotFound as exc:
            if spec.own_runtime:
                raise BackendError(f"runtime image {spec.image} is not present on this node") from exc
            try:
                client.images.pull(spec.image)
                container = client.containers.create(spec.image, **self._create_kwargs(spec))
            except docker.errors.DockerException:
                raise ImageError(f"Failed to pull container image '{spec.image}'.") from exc
        except docker.errors.DockerException as exc:
            raise BackendError(f"could not create container {spec.name}: {exc}") from exc
        try:
            stream = client.api.attach(container.id, stdout=True, stderr=True, stream=True, logs=True, demux=True)
            container.start()
            container.reload()
            port = container.attrs["NetworkSettings"]["Ports"][RUNTIME_PORT][0]["HostPort"]
        except Exception as exc:
            with contextlib.suppress(Exception):
                container.remove(force=True)
            raise BackendError(f"could not start container {spec.name}: {exc}") from exc
        return container, port, stream

    async def remove_leftovers(self, prefix: str) -> int:
        def sync() -> int:
            removed = 0
            for c in self._docker().containers.list(all=True, filters={"name": prefix}):
                if c.name.startswith(prefix):
                    with contextlib.suppress(docker.errors.DockerException):
                        c.remove(force=True)
                        removed += 1
            return removed

        try:
            return await asyncio.to_thread(sync)
        except docker.errors.DockerException as exc:
            raise BackendError(f"the Docker engine is not reachable: {exc}") from exc

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await asyncio.to_thread(client.close)


def network_address(attrs: dict[str, Any], network: str | None) -> str:
    """A started container's IP on its network (`network`, else the engine's default bridge) from its inspect
    data; 127.0.0.1 when it has none (host networking)."""
    settings = attrs.get("NetworkSettings") or {}
    networks = settings.get("Networks") or {}
    named = networks.get(network) if network else None
    for candidate in (named, {"IPAddress": settings.get("IPAddress")}, *networks.values()):
        address = (candidate or {}).get("IPAddress")
        if address:
            return str(address)
    return "127.0.0.1"
