"""The interface every container backend implements."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import structlog

if TYPE_CHECKING:
    from dilu_invoker.invoker.dataplane.runtime_client import DirectLane

log = structlog.get_logger(__name__)


class BackendError(RuntimeError):
    """The platform could not start or manage a container (OpenWhisk: whisk internal error)."""


class ImageError(BackendError):
    """The user's image is missing or unusable (OpenWhisk: action developer error)."""


@dataclass(frozen=True, slots=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """Everything a backend needs to start one action container."""

    name: str
    kind: str
    image: str
    memory_mb: int
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    devices: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    #: the runtime is one of ours (``dilu-invoker runtime``), not an upstream image
    own_runtime: bool = True


class Container(Protocol):
    """A started container whose runtime listens at :attr:`url`."""

    name: str
    url: str
    #: the address the backend's other containers reach this one at (a gang's ``MASTER_ADDR`` when it is rank 0:
    #: docs/invoker.md, "Gangs (gpu-count)"): 127.0.0.1 for processes, the container's IP on its Docker network
    peer_host: str
    #: sent with every request to the runtime (None: the runtime takes any caller, e.g. an upstream image)
    secret: str | None
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    #: warm /run straight to the initialised worker (the process backend; docs/runtime.md, "The direct
    #: lane"); None: /run goes over the runtime's HTTP
    lane: DirectLane | None

    @property
    def alive(self) -> bool: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def destroy(self) -> None:
        """Stop and remove; idempotent; never raises."""
        ...

    def exit_reason(self) -> str | None:
        """Why the container is gone (e.g. ``"oom"``, ``"exit 1"``) when known."""
        ...


class ContainerBackend(Protocol):
    name: str

    async def start(self, spec: ContainerSpec) -> Container: ...

    async def remove_leftovers(self, prefix: str) -> int:
        """Remove containers left by an earlier run of this invoker (same name prefix)."""
        ...

    async def close(self) -> None: ...


async def drain_output(container: Container, name: str, why: str) -> None:
    """Read and drop what ``container`` prints that is no activation's output (``why``: whose it is), so that
    a full pipe never blocks it; returns when both streams end (or the task is cancelled)."""

    async def one(stream: asyncio.StreamReader, which: str) -> None:
        while chunk := await stream.read(65536):
            log.debug("container output dropped", container=name, stream=which, bytes=len(chunk), why=why)

    with contextlib.suppress(Exception):
        await asyncio.gather(one(container.stdout, "stdout"), one(container.stderr, "stderr"))
