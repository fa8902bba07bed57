"""The invoker core: runs activations in pooled containers and builds OpenWhisk activation records.

The fronts (the standalone REST API, the Kafka consumer of cluster mode) hand it
:class:`~dilu_invoker.model.ActivationRequest`\\ s through :meth:`Invoker.run`; it never raises for what an
action or its container did — every outcome is an :class:`~dilu_invoker.model.Activation` with OpenWhisk's
status code — and raises :class:`InvokerOverloaded` only when it cannot queue the work or stops before the work ran.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import aiohttp
import redis.asyncio as aioredis
import structlog

from dilu_invoker.config import Config
from dilu_invoker.gpu.attachment import MPS_PRIORITY_ENV, MPS_THREADS_ENV, GpuAttachment
from dilu_invoker.gpu.load import InstanceLoad, KeyQueue
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.invoker.api import MSG_ABNORMAL_RUN, InvokerOverloaded, never_ran_for
from dilu_invoker.invoker.dataplane.backends.base import (
    BackendError,
    Container,
    ContainerBackend,
    ContainerSpec,
    ImageError,
    Mount,
)
from dilu_invoker.invoker.dataplane.container import ContainerProxy, Output, PoolKey, State, Transition
from dilu_invoker.invoker.dataplane.keep import Group, WeightsKeeper, group_of
from dilu_invoker.invoker.dataplane.metrics import InvokerMetrics
from dilu_invoker.invoker.dataplane.pool import ContainerPool, NoContainer, Reserves
from dilu_invoker.invoker.dataplane.preload import PreloadPool, Taken
from dilu_invoker.invoker.dataplane.runtime_client import (
    MODELS_KEY_ENV,
    ActivationContext,
    ActivationLogReader,
    ActivationLogs,
    LogCollection,
    RunConnections,
    RuntimeClient,
    RuntimeOutcome,
    build_init_body,
    build_run_body,
    encode_body,
    models_key,
    timed_out_message,
    url_address,
)
from dilu_invoker.invoker.manifest import ImageName, Manifest, RuntimeKind
from dilu_invoker.logs import bind_activation, reset_activation
from dilu_invoker.model import (
    PRELOAD_FUNCTION_PREFIX,
    Action,
    Activation,
    ActivationRequest,
    ActivationResponse,
    ActivationStatus,
    GpuNeeds,
    Identity,
    JsonValue,
    Parameter,
    ValidationError,
    new_activation_id,
    now_ms,
)
from dilu_invoker.wire import rank_of, stage_parent

log = structlog.get_logger(__name__)

BLACKBOX = "blackbox"
DEFAULT_MAX_RESULT_BYTES = 1024 * 1024
#: what a pipeline stage's result may weigh when the next stage takes it as its params (the last stage's is
#: the activation's result: DEFAULT_MAX_RESULT_BYTES); docs/invoker.md, "Split instances"
STAGE_MAX_RESULT_BYTES = 64 * 1024 * 1024
#: the /init environment of a pipeline stage: its index, the stage count and its span of the model
STAGE_INDEX_ENV, STAGE_COUNT_ENV, STAGE_SPAN_ENV = "DILU_STAGE_INDEX", "DILU_STAGE_COUNT", "DILU_STAGE_SPAN"
#: the /init environment of a gang's rank: its rank and the gang's size (``gpu-count``) under names of ours, and
#: torch.distributed's ``env://`` rendezvous (rank 0 at MASTER_ADDR:MASTER_PORT); docs/invoker.md, "Gangs"
RANK_ENV, WORLD_SIZE_ENV = "DILU_RANK", "DILU_WORLD_SIZE"
TORCH_RANK_ENV, TORCH_WORLD_SIZE_ENV = "RANK", "WORLD_SIZE"
LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV = "LOCAL_RANK", "LOCAL_WORLD_SIZE"
MASTER_ADDR_ENV, MASTER_PORT_ENV = "MASTER_ADDR", "MASTER_PORT"
#: how long a gang's ranks still running when one rank's run failed are given to finish before the gang is held
#: broken (waiting in a collective the failed rank never joins) and stopped whole; docs/invoker.md, "Gangs"
GANG_PEER_GRACE_S = 2.0
#: OpenWhisk's message for an action killed over its memory limit (at /init or in a run)
MSG_MEMORY_EXHAUSTED = "The action exhausted its memory and was aborted."
#: the last lines of a failed instance start's /init output the invoker logs (no activation record carries them)
INIT_FAILURE_LOG_LINES = 40
#: code larger than this is encoded into the /init body on a thread while the container starts
_PARALLEL_ENCODE_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ContainerExit:
    """What an exit hook hears once a container's compute is released (processes gone, GPU share
    detached): enough to keep something of its action cached for the next instance (docs/invoker.md)."""

    container: str
    action: str
    revision: str
    gpu_index: int | None
    gpu_uuid: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class StageStart:
    """What one pipeline stage of a split instance starts with instead of its action's: its place in the
    pipeline (the /init environment) and its own GPU needs (docs/invoker.md, "Split instances")."""

    index: int
    count: int
    span: tuple[float, float]
    request: float
    limit: float
    memory_mb: int

    def env(self) -> dict[str, str]:
        start, end = self.span
        return {STAGE_INDEX_ENV: str(self.index), STAGE_COUNT_ENV: str(self.count),
                STAGE_SPAN_ENV: f"{start!r}:{end!r}"}

    def needs(self, action: Action) -> GpuNeeds:
        """The action's GPU class with the stage's share; its weights are a slice of the model's, shared with
        no other instance, and the action's measured capacity is the whole model's (ValidationError)."""
        base = GpuNeeds.from_annotations(action.annotation_map)
        return replace(base, sm_request=self.request, sm_limit=self.limit, memory_mb=self.memory_mb, weights_mb=0,
                       capacity_blocks_per_ms=None)

    @property
    def named(self) -> str:
        return f"pipeline stage {self.index}"


#: the ports a gang's rendezvous is drawn from, as far as they lie below the kernel's ephemeral range: the kernel
#: never hands such a port to an outgoing connection, so between the pick and rank 0's bind only another listener
#: could take it (an ephemeral port, as `bind(0)` picks, may go to any connection meanwhile)
GANG_PORTS = (20000, 32767)
#: where the kernel's ephemeral range is read (Linux)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: the most recently picked gang ports, not picked again while rank 0 may not have bound them yet
_RECENT_GANG_PORTS: collections.deque[int] = collections.deque(maxlen=256)


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in Path(path).read_text(encoding="ascii").split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def gang_port(ephemeral: tuple[int, int] | None = None) -> int:
    """A port for a gang's rendezvous: one of `GANG_PORTS` below the ephemeral range that every interface lets us
    bind now and that was not picked lately (`_RECENT_GANG_PORTS`), else (no room below the range, or nothing free
    in 64 draws) one the kernel picks (`bind(0)`)."""
    from dilu_invoker.invoker.dataplane.backends.process import free_port

    low = (ephemeral or ephemeral_range())[0]
    first, last = GANG_PORTS[0], min(GANG_PORTS[1], low - 1)
    if last - first >= 255:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randint(first, last)
            if port in _RECENT_GANG_PORTS:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("", port))  # rank 0's store listens on every interface
                except OSError:
                    continue
            _RECENT_GANG_PORTS.append(port)
            return port
    port = free_port()
    _RECENT_GANG_PORTS.append(port)
    return port


class Rendezvous:
    """Where a gang's ranks meet (torch.distributed's ``env://``): rank 0's address, known once its container
    started (`Container.peer_host`), and a port the invoker picked for the gang. Every rank's /init waits for
    the address; a rank 0 that does not start fails the wait (`close`)."""

    __slots__ = ("_address", "port")

    def __init__(self, port: int) -> None:
        self.port = port
        self._address: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    @classmethod
    def new(cls) -> Rendezvous:
        """A rendezvous on a port that is free on this host now (rank 0's runtime binds it later; in a Docker
        container's own network namespace any port is free): `gang_port`."""
        return cls(gang_port())

    def found(self, address: str) -> None:
        """Rank 0's container started at `address`."""
        if not self._address.done():
            self._address.set_result(address)

    def close(self, why: str) -> None:
        """Rank 0 did not start (or the gang's start is over): a rank still waiting fails with `why`."""
        if not self._address.done():
            self._address.set_exception(BackendError(why))
            self._address.exception()  # told to those that wait; no one may be left to

    async def address(self, timeout_s: float) -> str:
        """Rank 0's address (BackendError: it did not start within `timeout_s`, or at all)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._address), timeout_s)
        except TimeoutError as exc:
            raise BackendError(f"rank 0 did not start within {timeout_s:g} s") from exc


@dataclass(frozen=True, slots=True)
class RankStart:
    """What one rank of a gang (``gpu-count``) starts with instead of its action's: its rank, the gang's size and
    its rendezvous (the /init environment, `env`), and its own GPU needs (docs/invoker.md, "Gangs (gpu-count)")."""

    rank: int
    world: int
    rendezvous: Rendezvous
    request: float
    limit: float
    memory_mb: int

    @property
    def index(self) -> int:
        return self.rank

    @property
    def named(self) -> str:
        return f"rank {self.rank} of {self.world}"

    def env(self, master_addr: str) -> dict[str, str]:
        """torch.distributed's ``env://`` variables (all ranks on one host: the local rank is the rank) and ours."""
        rank, world = str(self.rank), str(self.world)
        return {TORCH_RANK_ENV: rank, TORCH_WORLD_SIZE_ENV: world, LOCAL_RANK_ENV: rank, LOCAL_WORLD_SIZE_ENV: world,
                MASTER_ADDR_ENV: master_addr, MASTER_PORT_ENV: str(self.rendezvous.port), RANK_ENV: rank,
                WORLD_SIZE_ENV: world}

    def needs(self, action: Action) -> GpuNeeds:
        """The action's GPU needs with the rank's share; it shares no weights (ValidationError). Unlike a stage's,
        the action's measured capacity holds: each rank runs the whole model on its GPU."""
        base = GpuNeeds.from_annotations(action.annotation_map)
        return replace(base, sm_request=self.request, sm_limit=self.limit, memory_mb=self.memory_mb, weights_mb=0)


#: one GPU's part of an instance over several GPUs: a pipeline stage or a gang's rank
PartStart = StageStart | RankStart


class _Whole(NamedTuple):
    """What every part's run of one activation over a split instance's stages or a gang's ranks shares: the runtime,
    when the activation arrived (epoch ms), and the action's one time limit (`limit_s`; ends at `deadline`, monotonic
    seconds, and `deadline_ms`, epoch ms)."""

    runtime: RuntimeKind
    arrived: int
    limit_s: float
    deadline: float
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class StageRun:
    """One stage's part of a pipelined activation (or one rank's of a gang's): its place, what its result may
    weigh, the time left (and the whole run's deadline, epoch ms, which every stage's run carries)."""

    index: int
    count: int
    max_result_bytes: int
    timeout_s: float
    deadline_ms: int
    #: a gang's rank (`Invoker.run_on_ranks`): a plain run, its result no next stage's params
    rank: bool = False


class GpuAllocator(Protocol):
    """The node's GPU manager as the invoker core sees it (``dilu_invoker.gpu``)."""

    async def attach(self, instance: str, function: str, needs: GpuNeeds, *,
                     gpu_index: int | None = None, revision: str | None = None,
                     mps_threads: float | None = None) -> GpuAttachment | None:
        """Reserve a GPU share for a new container (on ``gpu_index`` when the balancer placed it, else
        wherever the node sees fit); None when the node has no GPU for it. ``mps_threads``: a pre-loaded
        container's MPS thread cap, chosen ahead (`GpuNode.attach`)."""
        ...

    async def detach(self, instance: str) -> None: ...


#: the GPU share of a pre-loaded container before a function takes it
PRELOAD_GPU_NEEDS = GpuNeeds(sm_request=0.01, sm_limit=0.05, memory_mb=1024)


class Invoker:
    """One invoker: a container pool over a backend, plus what the fronts need to see of it."""

    def __init__(
        self,
        cfg: Config,
        *,
        manifest: Manifest,
        backend: ContainerBackend,
        session: aiohttp.ClientSession,
        gpu: GpuAllocator | None = None,
        metrics: InvokerMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.manifest = manifest
        self.backend = backend
        self.gpu = gpu
        self.metrics = metrics or InvokerMetrics()
        self._session = session
        #: kept connections for the /run of the project's own runtimes (the warm path's HTTP hop)
        self._run_connections = RunConnections()
        self.instance_id = cfg.invoker.id
        self.name = f"invoker{self.instance_id}"
        self._enabled = True
        self._enabled_callbacks: list[Callable[[bool], None]] = []
        self._cpu_fallback_logged = False
        self._models_secret = secrets.token_bytes(32)  # per invoker: derives each function's models key
        ic = cfg.invoker
        self.pool = ContainerPool(
            user_memory_mb=ic.user_memory_mb,
            idle_timeout_s=ic.idle_timeout_s,
            pause_grace_s=ic.pause_grace_s if ic.pause_grace_s > 0 else None,
            max_queue=ic.max_queue,
            destroy=self._destroy_container,
            name_prefix=f"{ic.container_prefix}{self.instance_id}",
            observers=(self._count_states,),
        )
        self.metrics.user_memory.set(ic.user_memory_mb)
        self.metrics.enabled.set(1)
        self._exit_hooks: list[Callable[[ContainerExit], object]] = []
        self._background: set[asyncio.Future[Any]] = set()
        # Each GPU container's own queue, reported to the GPU manager (dilu_invoker.gpu.load): by pool key
        # (waiters belong to a key) and by container name (what runs on it).
        self._gpu_queues: dict[PoolKey, KeyQueue] = {}
        self._gpu_loads: dict[str, InstanceLoad] = {}
        self.preload: PreloadPool | None = None
        if ic.preload > 0:
            pool = PreloadPool(
                manifest=manifest, backend=backend, session=session, per_kind=ic.preload,
                memory_mb=ic.preload_memory_mb, budget_mb=ic.preload_budget_mb,
                gpu_budget_mb=ic.preload_gpu_budget_mb, learn=ic.preload_learn,
                make_spec=self._preload_spec, room_mb=self._room_mb, registry=self.metrics.registry,
                name_prefix=f"{ic.container_prefix}{self.instance_id}",
                attach_gpu=self._attach_preload_gpu if gpu is not None else None,
                detach_gpu=self._detach_gpu, check_importable=backend.name == "process",
                has_gpus=bool(getattr(gpu, "has_gpus", gpu is not None)),
                mps_cap=getattr(gpu, "mps_cap", None),
            )
            if pool.enabled:
                self.preload = pool
        # Staged exit: the last instance of a GPU function with declared weights leaves its process (and
        # weights) on the GPU for a grace period (keep.py); only where the GPU node can keep weights.
        self.keeper: WeightsKeeper | None = None
        self._stopping: set[str] = set()
        #: containers that are pipeline stages of split instances (never kept at exit)
        self._stage_containers: set[str] = set()
        #: containers whose runtime said at /init that it takes stage frames over HTTP (a split instance's tensors
        #: as bytes where there is no direct lane: the Docker backend)
        self._stage_frames: set[str] = set()
        keep_weights = getattr(gpu, "keep_weights", None)
        if ic.weights_grace_s > 0 and keep_weights is not None:
            self.keeper = WeightsKeeper(grace_s=ic.weights_grace_s, keep_weights=keep_weights,
                                        destroy=self._destroy_now, members=self._members_of,
                                        registry=self.metrics.registry)
        reserves = [r for r in (self.keeper, self.preload) if r is not None]
        if reserves:
            self.pool.reserve = reserves[0] if len(reserves) == 1 else Reserves(*reserves)

    def start_preloading(self) -> None:
        """Fill the pre-loaded containers of every pre-loaded kind (``open_invoker`` calls it)."""
        if self.preload is not None:
            self.preload.start()

    def add_exit_hook(self, hook: Callable[[ContainerExit], object]) -> None:
        """Called (awaited when it returns an awaitable) after a container's compute is released."""
        self._exit_hooks.append(hook)

    def _room_mb(self) -> int:
        reserve = self.preload.memory_in_use_mb if self.preload is not None else 0
        reserve += self.keeper.memory_in_use_mb if self.keeper is not None else 0
        return self.pool.user_memory_mb - self.pool.memory_in_use_mb - reserve

    def _members_of(self, group: Group) -> int:
        """Live containers (not being removed) of a staged-exit group: its function revision on one GPU."""
        return sum(1 for p in self.pool.containers.values()
                   if p.state not in (State.REMOVING, State.REMOVED) and group_of(p) == group)

    def _preload_spec(self, name: str, runtime: RuntimeKind, env: dict[str, str]) -> ContainerSpec:
        base = {
            "__OW_API_HOST": self.cfg.api.api_host_url or f"http://{self.cfg.api.host}:{self.cfg.api.port}",
            "__OW_ALLOW_CONCURRENT": "false",
        }
        return ContainerSpec(
            name=name, kind=runtime.kind, image=str(runtime.image),
            memory_mb=runtime.preload_memory_mb or self.cfg.invoker.preload_memory_mb,
            env={**base, **env},
            labels={"dilu.invoker": str(self.instance_id), "dilu.action": "", "dilu.kind": runtime.kind,
                    "dilu.preload": "true"},
            own_runtime=True,
        )

    async def _attach_preload_gpu(self, key: str, runtime: RuntimeKind, *,
                                  mps_threads: float | None = None) -> tuple[GpuAttachment | None, int]:
        # A placeholder: the process only holds a CUDA context until a function takes it (then the share
        # becomes the function's), so it must not take SM share from the instances placed beside it.
        needs = PRELOAD_GPU_NEEDS
        if self.gpu is None:
            return None, 0
        # mps_threads: the cap a pre-loaded MPS client makes its CUDA context at (chosen ahead by the pool)
        attachment = await self.gpu.attach(key, f"{PRELOAD_FUNCTION_PREFIX}{runtime.kind}", needs,
                                           mps_threads=mps_threads)
        return attachment, needs.memory_mb if attachment is not None else 0

    async def _detach_gpu(self, key: str) -> None:
        if self.gpu is not None:
            await self.gpu.detach(key)

    # -- control -------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    def set_enabled(self, enabled: bool) -> bool:
        """Returns whether the state changed."""
        if enabled == self._enabled:
            return False
        self._enabled = enabled
        self.metrics.enabled.set(1 if enabled else 0)
        for cb in self._enabled_callbacks:
            cb(enabled)
        return True

    def on_enabled_change(self, callback: Callable[[bool], None]) -> None:
        self._enabled_callbacks.append(callback)

    def _count_states(self, _t: Transition) -> None:
        counts = {s: 0 for s in State}
        for p in self.pool.containers.values():
            counts[p.state] += 1
        for s, n in counts.items():
            self.metrics.containers.labels(s.value).set(n)
        self.metrics.memory_in_use.set(self.pool.memory_in_use_mb)

    # -- running activations -------------------------------------------------------------------

    async def run(self, req: ActivationRequest) -> Activation:
        tokens = bind_activation(activation_id=req.activation_id, transid=req.transid_id)
        try:
            runtime = self._runtime_of(req.action)
            gang = gang_refusal(req.action) if runtime is not None and runtime.gpu else None
            if gang is not None:
                log.warning("activation refused: a gang runs on balancer-placed instances only",
                            action=req.action.fqn)
                return self.refuse(req, gang)
            return await self._run(req)
        finally:
            reset_activation(**tokens)

    async def _run(self, req: ActivationRequest, *, key: PoolKey | None = None, may_start: bool = True,
                   on_lease: Callable[[], None] | None = None, stage: StageRun | None = None) -> Activation:
        arrived = req.transid_start_ms or now_ms()
        action = req.action
        runtime = self._runtime_of(action)
        if runtime is None:
            return self._failed(req, ActivationResponse.whisk_error(
                "Action version is not compatible and cannot be invoked."))
        key = key or PoolKey.of(req.identity.namespace, action)
        for _attempt in range(3):
            activation = await self._attempt(req, runtime, key, arrived, may_start=may_start, on_lease=on_lease,
                                             stage=stage)
            if activation is not None:
                return activation
            log.info("container shutting down; rescheduling the activation")
        return self._failed(req, ActivationResponse.whisk_error(
            MSG_ABNORMAL_RUN))

    async def _attempt(self, req: ActivationRequest, runtime: RuntimeKind, key: PoolKey,
                       arrived: int, *, may_start: bool = True,
                       on_lease: Callable[[], None] | None = None, stage: StageRun | None = None) -> Activation | None:
        """One try on one container; None when the runtime asked for the activation to be rescheduled.
        ``stage``: a pipeline stage's run (its result cap and time left; its record is a part of the
        activation's, not counted on its own)."""
        action = req.action
        memory = action.limits.memory_mb
        self.metrics.queue_length.set(self.pool.queue_length + 1)
        gpu_queue = self._gpu_queues.get(key)
        entered = time.monotonic()
        ticket = gpu_queue.enter(entered) if gpu_queue is not None else None
        try:
            lease = await self.pool.acquire(
                key, action, memory_mb=memory, slots=action.limits.concurrency,
                make_spec=lambda name: self._container_spec(name, action, runtime), start=may_start,
            )
        finally:
            self.metrics.queue_length.set(self.pool.queue_length)
            if gpu_queue is not None and ticket is not None:
                gpu_queue.leave(ticket)
        if on_lease is not None:
            on_lease()
        proxy = lease.proxy
        healthy = False
        release_reason = ""
        try:
            init_ms: int | None = None
            start = now_ms()
            if lease.cold:
                failure, init_ms, init_logs = await self._start_and_init(proxy, req, runtime)
                if failure is not None:
                    release_reason = "initialization failed"
                    self._refuse_if_closing()
                    return self._finish(req, runtime, start, now_ms(), failure, init_logs, arrived=arrived,
                                        start_ms=start, init_ms=init_ms, preloaded=proxy.preloaded, stage=stage)
            else:
                failure = await asyncio.shield(proxy.ready)
                if failure is not None:
                    release_reason = "container failed before this activation ran"
                    self._refuse_if_closing()
                    response = failure if isinstance(failure, ActivationResponse) else ActivationResponse.whisk_error(
                        MSG_ABNORMAL_RUN)
                    return self._finish(req, runtime, now_ms(), now_ms(), response, (), arrived=arrived,
                                        start_ms=now_ms(), init_ms=None, stage=stage)
                if not await self.pool.resume(proxy):
                    release_reason = "resume failed"
                    return self._finish(req, runtime, now_ms(), now_ms(), ActivationResponse.whisk_error(
                        MSG_ABNORMAL_RUN), (),
                        arrived=arrived, start_ms=now_ms(), init_ms=None, stage=stage)
                start = now_ms()
            run_start = now_ms()
            load = self._gpu_loads.get(proxy.name)
            began = time.monotonic()
            running = load.started(began) if load is not None else None
            try:
                outcome, logs = await self._run_once(proxy, req, stage)
            finally:
                if load is not None and running is not None:
                    # A cold start's wait is its container's start and /init, not a queue.
                    load.finished(running, time.monotonic(), waited_s=0.0 if lease.cold else began - entered)
            end = now_ms()
            if outcome.reschedule:
                release_reason = "runtime is shutting down"
                return None
            healthy = outcome.keeps_container and not outcome.timed_out
            if healthy and not proxy.run_imports_learnt and proxy.container is not None \
                    and self.preload is not None and self.preload.covers(runtime.kind):
                proxy.run_imports_learnt = True
                self._in_background(self._learn_imports(runtime.kind, proxy.container, "run_imports"))
            release_reason = "" if healthy else (
                "timed out" if outcome.timed_out else f"activation failed with status {outcome.status_code}")
            response = ActivationResponse(ActivationStatus(outcome.status_code), outcome.result, outcome.size)
            if not healthy and proxy.container is not None and proxy.container.exit_reason() == "oom":
                response = ActivationResponse.developer_error(MSG_MEMORY_EXHAUSTED)
            return self._finish(req, runtime, start, end, response, logs, arrived=arrived,
                                start_ms=start if init_ms is not None else run_start, init_ms=init_ms,
                                timed_out=outcome.timed_out, preloaded=proxy.preloaded, stage=stage)
        except InvokerOverloaded:
            raise
        except Exception as exc:
            log.exception("activation failed inside the invoker")
            release_reason = f"internal error: {exc!r}"
            return self._failed(req, ActivationResponse.whisk_error(
                MSG_ABNORMAL_RUN))
        finally:
            self.pool.release(proxy, healthy=healthy, reason=release_reason)

    def _refuse_if_closing(self) -> None:
        """An activation whose container went away before it ran, because this invoker is stopping, has
        not run: it is refused like the queue's waiters (another invoker takes it, or the client gets 503
        to retry) rather than recorded as failed."""
        if self.pool.closed:
            raise InvokerOverloaded("the invoker is shutting down")

    def runtime_for(self, action: Action) -> RuntimeKind | None:
        """The runtime an action runs in (None: its kind is not in the manifest)."""
        return self._runtime_of(action)

    def _runtime_of(self, action: Action) -> RuntimeKind | None:
        if action.exec.kind == BLACKBOX:
            # A docker action runs its image through the blackbox pseudo-kind.
            if not action.exec.image:
                return None
            return RuntimeKind(kind=BLACKBOX, family=BLACKBOX, image=ImageName(action.exec.image),
                               gpu=action.annotation("gpu-class") is not None)
        return self.manifest.resolve(action.exec.kind)

    def _container_spec(self, name: str, action: Action, runtime: RuntimeKind) -> ContainerSpec:
        env = {
            "__OW_API_HOST": self.cfg.api.api_host_url or f"http://{self.cfg.api.host}:{self.cfg.api.port}",
            "__OW_ALLOW_CONCURRENT": "true" if action.limits.concurrency > 1 else "false",
        }
        return ContainerSpec(
            name=name,
            kind=runtime.kind,
            image=str(runtime.image),
            memory_mb=action.limits.memory_mb,
            env=env,
            labels={"dilu.invoker": str(self.instance_id), "dilu.action": action.fqn, "dilu.kind": runtime.kind},
            own_runtime=runtime.kind != BLACKBOX,
        )

    async def _start_and_init(
        self, proxy: ContainerProxy, req: ActivationRequest, runtime: RuntimeKind, *,
        gpu_index: int | None = None, gpu_key: str | None = None, idle_room_only: bool = False,
        stage: PartStart | None = None,
    ) -> tuple[ActivationResponse | None, int | None, tuple[str, ...]]:
        """Start the container and send /init; returns (failure or None, init ms, init logs)."""
        action = req.action
        spec = proxy.spec
        stage_env = stage.env() if isinstance(stage, StageStart) else {}
        # Parallel setup: a large code attachment is encoded while the container starts (a rank's environment
        # is known only then: rank 0's address).
        encoding: asyncio.Future[bytes] | None = None
        if len(action.exec.code or "") > _PARALLEL_ENCODE_BYTES and not isinstance(stage, RankStart):
            encoding = asyncio.ensure_future(asyncio.to_thread(lambda: encode_body(self._init_body(req, stage_env))))
        # A model pre-load (idle_room_only) is background work: it leaves the last pre-loaded container to
        # the requests that may come meanwhile, the function's first one among them.
        taken = await self._take_preloaded(proxy, req, runtime, gpu_index=gpu_index, gpu_key=gpu_key,
                                           spare_last=idle_room_only, stage=stage)
        if taken is not None:
            container = taken.container
        else:
            try:
                if runtime.gpu:
                    spec = await self._attach_gpu(proxy, action, spec, gpu_index=gpu_index, gpu_key=gpu_key,
                                                  idle_room_only=idle_room_only, stage=stage)
                container = await self.backend.start(spec)
            except ImageError as exc:
                failure = ActivationResponse.developer_error(str(exc))
                self.pool.remove(proxy, f"image error: {exc}", failure=failure)
                await _settle(encoding)
                return failure, None, ()
            except BackendError as exc:
                log.warning("container start failed", container=proxy.name, error=str(exc))
                failure = ActivationResponse.whisk_error("Failed to provision resources to run the action." + (
                    f" ({exc})" if stage is not None else ""))
                self.pool.remove(proxy, f"start failed: {exc}", failure=failure)
                await _settle(encoding)
                return failure, None, ()
        if proxy.state is not State.STARTING:  # removed while the backend started it (shutdown)
            await container.destroy()
            await _settle(encoding)
            return ActivationResponse.whisk_error("Failed to provision resources to run the action."), None, ()
        if isinstance(stage, RankStart) and stage.rank == 0:
            stage.rendezvous.found(container.peer_host)
        if proxy.placement.gpu is not None:
            self._watch_gpu_load(proxy)
        reader = ActivationLogReader(container.stdout, container.stderr,
                                     chunk_bytes=self.cfg.invoker.log_chunk_kb * 1024)
        limit = action.limits.logs_mb * 1024 * 1024
        collection: LogCollection | None = None
        proxy.output = Output(reader)
        if proxy.slots > 1:
            # Activations sharing a container share its output streams: drain them, attribute nothing.
            proxy.output.drain = asyncio.create_task(self._drain_logs(reader, limit))
        else:
            # The init's output belongs to the first run's logs (a successful /init writes no sentinel).
            collection = reader.start(limit_bytes=limit)
        proxy.started(container)
        if isinstance(stage, RankStart):
            try:
                stage_env = stage.env(await stage.rendezvous.address(action.limits.timeout_ms / 1000))
            except BackendError as exc:
                failure = ActivationResponse.whisk_error(f"Failed to provision resources to run the action. ({exc})")
                if collection is not None:
                    await collection.finish(developer_error=True)
                self.pool.remove(proxy, f"start failed: {exc}", failure=failure)
                return failure, None, ()
        init_start = time.monotonic()
        client = RuntimeClient(self._session, container.url, max_result_bytes=DEFAULT_MAX_RESULT_BYTES,
                               secret=container.secret, alive=lambda: container.alive)
        # A pre-loaded MPS client made no CUDA context yet: its cap comes with /init's environment.
        cap = _mps_cap(taken.gpu) if taken is not None else {}
        if cap and encoding is not None:
            await _settle(encoding)
            encoding = None
        body: dict[str, object] | bytes = await encoding if encoding is not None else self._init_body(
            req, {**cap, **stage_env})
        outcome = await client.init(body, action.limits.timeout_ms / 1000)
        init_ms = int((time.monotonic() - init_start) * 1000)
        if outcome.status_code != ActivationStatus.SUCCESS:
            logs: tuple[str, ...] = ()
            if collection is not None:
                logs = (await collection.finish(developer_error=True)).lines
            failure = ActivationResponse(ActivationStatus(outcome.status_code), outcome.result, outcome.size)
            if container.exit_reason() == "oom":  # e.g. `import torch` over the action's memory limit
                failure = ActivationResponse.developer_error(MSG_MEMORY_EXHAUSTED)
            self.pool.remove(proxy, "initialization failed", failure=failure)
            return failure, init_ms, logs
        if proxy.state is not State.INITIALIZING:  # removed meanwhile (shutdown, a stopped instance)
            if collection is not None:
                await collection.finish(developer_error=True)
            return ActivationResponse.whisk_error("Failed to provision resources to run the action."), init_ms, ()
        proxy.output.pending = collection
        if outcome.stage_frames:
            self._stage_frames.add(proxy.name)
        self.pool.mark_ready(proxy, "initialized", init_ms=init_ms)
        if self.preload is not None and self.preload.covers(runtime.kind):
            self._in_background(self._learn_imports(runtime.kind, container))
        return None, init_ms, ()

    def _init_body(self, req: ActivationRequest, env: Mapping[str, str] | None = None) -> dict[str, object]:
        action = req.action
        init_env: dict[str, object] = {k: v for k, v in (req.content or {}).items() if k in req.init_args} \
            if isinstance(req.content, dict) else {}
        init_env.update(env or {})
        init_env[MODELS_KEY_ENV] = models_key(self._models_secret, action.namespace, action.name,
                                              action.revision or action.version)
        return build_init_body(name=action.name, code=action.exec.code, binary=action.exec.binary,
                               main=action.exec.main, env=init_env, context=self._context(req))

    async def _take_preloaded(self, proxy: ContainerProxy, req: ActivationRequest, runtime: RuntimeKind, *,
                              gpu_index: int | None, gpu_key: str | None, spare_last: bool = False,
                              stage: PartStart | None = None) -> Taken | None:
        """A pre-loaded container of the kind for this cold start, bound to the action (its memory limit,
        its GPU share); None: a plain cold start."""
        preload = self.preload
        if preload is None or not preload.covers(runtime.kind):
            return None
        standby = preload.take(runtime, req.action, gpu_index=gpu_index if runtime.gpu else None,
                               spare_last=spare_last)
        if standby is None:
            return None
        taken = await preload.hand_over(standby, req.action.limits.memory_mb)
        if taken is None:
            return None
        if runtime.gpu and self.gpu is not None:
            retarget = getattr(self.gpu, "retarget", None)
            ok = False
            if taken.gpu is not None and taken.gpu_key is not None and retarget is not None:
                try:
                    needs = stage.needs(req.action) if stage is not None else GpuNeeds.from_annotations(
                        req.action.annotation_map)
                    # a balancer-placed instance keeps its share under its own id (gpu_key)
                    ok = bool(await retarget(taken.gpu_key, req.action.fqn, needs, new_id=gpu_key,
                                             revision=req.action.revision or req.action.version))
                except (ValidationError, Exception) as exc:  # noqa: BLE001 - the plain path decides then
                    log.info("pre-loaded GPU container not usable for the action", action=req.action.fqn,
                             error=repr(exc))
            if ok and stage is not None and (taken.gpu is None or taken.gpu.gpu_index != gpu_index):
                ok = False  # a stage runs on its own GPU or not at all
            if not ok:
                await preload.lost(runtime.kind, taken.standby, "GPU share does not fit")
                return None
            attachment_of = getattr(self.gpu, "attachment_of", None)
            current = attachment_of(gpu_key or taken.gpu_key) if attachment_of is not None else None
            if current is not None:
                taken = replace(taken, gpu=current)
            if self.keeper is not None and stage is None and taken.gpu is not None and taken.gpu.gpu_index is not None:
                self.keeper.started_beside((req.action.fqn, proxy.key.revision, taken.gpu.gpu_index))
            proxy.placement = replace(proxy.placement, gpu=taken.gpu, gpu_key=gpu_key or taken.gpu_key)
        preload.hit(runtime.kind)
        proxy.preloaded = True
        log.info("cold start on a pre-loaded container", container=proxy.name, kind=runtime.kind,
                 modules=list(taken.modules))
        return taken

    async def runtime_health(self, container: Container) -> dict[str, Any] | None:
        """The runtime's ``GET /health`` (docs/runtime.md); None when it does not answer with a JSON object."""
        headers = {"X-Dilu-Runtime-Secret": container.secret} if container.secret else {}
        with contextlib.suppress(Exception):
            async with self._session.get(f"{container.url}/health", headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                body = await resp.json(content_type=None)
            return body if isinstance(body, dict) else None
        return None

    async def _learn_imports(self, kind: str, container: Container, field: str = "imports") -> None:
        """Learn from the runtime's /health what the action imported: ``imports`` at /init, ``run_imports``
        what its first run imported first (libraries `main` imports lazily)."""
        body = await self.runtime_health(container)
        if body is not None and self.preload is not None and isinstance(body.get(field), list) and body[field]:
            self.preload.learn(kind, body[field])

    def _in_background(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(_retrieved)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _drain_logs(reader: ActivationLogReader, limit: int) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                await reader.collect(limit_bytes=min(limit, 65536), timeout_s=3600)

    def _context(self, req: ActivationRequest) -> ActivationContext:
        action = req.action
        return ActivationContext(
            namespace=req.identity.namespace,
            action_name=action.action_name,
            action_version=action.version,
            activation_id=req.activation_id,
            transaction_id=req.transid_id,
            deadline_ms=now_ms() + action.limits.timeout_ms,
            # An instance started ahead of any activation has no caller, hence no key.
            api_key=req.identity.api_key if action.provide_api_key() and req.identity.uuid else None,
        )

    async def _attach_gpu(self, proxy: ContainerProxy, action: Action, spec: ContainerSpec, *,
                          gpu_index: int | None = None, gpu_key: str | None = None,
                          idle_room_only: bool = False, stage: PartStart | None = None) -> ContainerSpec:
        try:
            needs = stage.needs(action) if stage is not None else GpuNeeds.from_annotations(action.annotation_map)
        except ValidationError as exc:
            if stage is not None:
                raise BackendError(f"invalid GPU needs of {stage.named}: {exc}") from exc
            log.warning("invalid GPU annotations; running without a GPU", action=action.fqn, error=str(exc))
            return spec
        key = gpu_key or proxy.name
        revision = action.revision or action.version
        attachment = (await self.gpu.attach(key, action.fqn, needs, gpu_index=gpu_index, revision=revision)
                      if self.gpu is not None else None)
        if attachment is None and idle_room_only:
            raise BackendError("no GPU has idle room for it")
        if attachment is None and self.gpu is not None and self.keeper is not None:
            # Kept weights (staged exit) give way to a container that finds no room.
            if await self.keeper.evict_gpu(gpu_index):
                attachment = await self.gpu.attach(key, action.fqn, needs, gpu_index=gpu_index, revision=revision)
        if stage is not None and (attachment is None or attachment.gpu_index != gpu_index):
            # A stage holds its span of the model (a rank its copy) on its own GPU: anywhere else, or on the CPU,
            # it is no part of its instance.
            if attachment is not None and self.gpu is not None:
                await self.gpu.detach(key)
            where = "no room" if attachment is None else f"a place on GPU {attachment.gpu_index} only"
            raise BackendError(f"{stage.named}: GPU {gpu_index} gave {where}")
        if attachment is not None and self.keeper is not None and stage is None and attachment.gpu_index is not None:
            self.keeper.started_beside((action.fqn, proxy.key.revision, attachment.gpu_index))
        if attachment is None:
            if not self._cpu_fallback_logged:
                self._cpu_fallback_logged = True
                log.warning("GPU action runs on the CPU: this node has no GPU available for it",
                            action=action.fqn, reason="no GPU manager" if self.gpu is None else "no GPU capacity")
            return spec
        proxy.placement = replace(proxy.placement, gpu=attachment, gpu_key=key)
        env = dict(spec.env)
        env.update(attachment.env)
        mounts = tuple(Mount(m.source, m.target, m.read_only) for m in attachment.mounts)
        return replace(spec, env=env, mounts=spec.mounts + mounts, devices=spec.devices + attachment.devices)

    async def _run_once(self, proxy: ContainerProxy, req: ActivationRequest,
                        stage: StageRun | None = None) -> tuple[RuntimeOutcome, tuple[str, ...]]:
        assert proxy.container is not None
        action = req.action
        max_result_bytes = stage.max_result_bytes if stage is not None else DEFAULT_MAX_RESULT_BYTES
        timeout_s = stage.timeout_s if stage is not None else action.limits.timeout_ms / 1000
        client = RuntimeClient(self._session, proxy.container.url, max_result_bytes=max_result_bytes,
                               secret=proxy.container.secret,
                               connections=self._run_connections if proxy.spec.own_runtime else None,
                               lane=proxy.container.lane, stage_frames=proxy.name in self._stage_frames)
        value = req.content
        if isinstance(value, dict) and req.init_args:
            value = {k: v for k, v in value.items() if k not in req.init_args}
        context = self._context(req)
        if stage is not None:
            context = replace(context, deadline_ms=stage.deadline_ms)
        body = build_run_body(value, context)
        collection: LogCollection | None = None
        output = proxy.output
        if output is not None and proxy.slots == 1:
            collection, output.pending = output.pending, None
            collection = collection or output.reader.start(limit_bytes=action.limits.logs_mb * 1024 * 1024)
        try:
            # A stage's run goes as a stage frame on the direct lane: the tensor it hands on is never base64 or JSON
            # there, nor parsed here (every stage but the last may answer so).
            outcome = await client.run(body, timeout_s,
                                       stage=None if stage is None or stage.rank else stage.index < stage.count - 1)
        except BaseException:
            if collection is not None:
                await collection.finish(developer_error=True)
            raise
        if collection is None:
            return outcome, ()
        broken = outcome.status_code == ActivationStatus.DEVELOPER_ERROR or outcome.timed_out
        logs: ActivationLogs = await collection.finish(developer_error=broken)
        return outcome, logs.lines

    def _watch_gpu_load(self, proxy: ContainerProxy) -> None:
        """Count the GPU container's queue and runs, and let the node's GPU manager read them each period."""
        if proxy.name in self._gpu_loads:
            return
        queue = self._gpu_queues.setdefault(proxy.key, KeyQueue())
        queue.members += 1
        load = self._gpu_loads[proxy.name] = InstanceLoad(queue)
        watch = getattr(self.gpu, "watch_load", None)
        if watch is not None:
            watch(proxy.placement.gpu_key or proxy.name, load.read)

    def _forget_gpu_load(self, proxy: ContainerProxy) -> None:
        load = self._gpu_loads.pop(proxy.name, None)
        if load is None:
            return
        load.queue.members -= 1
        if load.queue.members <= 0 and self._gpu_queues.get(proxy.key) is load.queue:
            del self._gpu_queues[proxy.key]

    async def _destroy_container(self, proxy: ContainerProxy) -> None:
        """Everything the container owns goes — or, staged exit, its compute goes and its process stays
        with its weights (keep.py)."""
        stopped = proxy.name in self._stopping
        self._stopping.discard(proxy.name)
        if proxy.name in self._stage_containers:  # a stage's weights are a slice of its model: never kept
            self._stage_containers.discard(proxy.name)
        elif self.keeper is not None and self._may_keep(proxy, stopped):
            self._forget_gpu_load(proxy)
            if await self.keeper.keep(proxy):
                return
        await self._destroy_now(proxy)

    def _may_keep(self, proxy: ContainerProxy, stopped: bool) -> bool:
        """Scaled in (stopped by the balancer, idle too long), not failed, and the last of its group."""
        reason = getattr(proxy.phase, "reason", "")
        group = group_of(proxy)
        return (stopped or reason == "idle timeout") and group is not None and self._members_of(group) == 0

    async def _destroy_now(self, proxy: ContainerProxy, container: Container | None = None,
                           gpu_key: str | None = None) -> None:
        """Everything the container owns goes: its output readers, its processes and files (the backend),
        its GPU share. A kept process (keep.py) brings its backend handle (the proxy has none any more) and
        what its weights are attached under."""
        self._forget_gpu_load(proxy)
        self._stage_frames.discard(proxy.name)
        container = container or proxy.container
        log.debug("destroying container", container=proxy.name, handle=container is not None)
        if container is not None:
            with contextlib.suppress(ValueError):
                self._run_connections.discard(*url_address(container.url))
        if proxy.output is not None:
            await proxy.output.close()
        if container is not None:
            await container.destroy()
        placement = proxy.placement
        if placement.gpu is not None and self.gpu is not None:
            with contextlib.suppress(Exception):
                await self.gpu.detach(gpu_key or placement.gpu_key or proxy.name)
        if self._exit_hooks:
            reason = getattr(proxy.phase, "reason", "")
            event = ContainerExit(container=proxy.name, action=proxy.action.fqn, revision=proxy.key.revision,
                                  gpu_index=placement.gpu.gpu_index if placement.gpu is not None else None,
                                  gpu_uuid=placement.gpu.uuid if placement.gpu is not None else None,
                                  reason=str(reason))
            for hook in self._exit_hooks:
                try:
                    result = hook(event)
                    if isinstance(result, Awaitable):
                        await result
                except Exception:  # a hook never stops a removal
                    log.exception("container exit hook failed", container=proxy.name)

    # -- balancer-placed instances -------------------------------------------------------------
    #
    # An instance is one pinned container of an action, started ahead of its activations on the GPU the
    # balancer chose; its pool key carries the instance id, so only activations sent to that instance
    # (``run_on_instance``) reach it and the pool never starts a second container for it.

    @staticmethod
    def instance_key(instance_id: str, action: Action) -> PoolKey:
        return PoolKey(f"instance:{instance_id}", action.fqn, action.revision or "")

    async def start_instance(self, instance_id: str, action: Action, *, gpu_index: int | None = None,
                             idle_room_only: bool = False,
                             stage: PartStart | None = None) -> tuple[str | None, ActivationResponse | None]:
        """Start and initialize the instance's container; (container name, failure or None).
        ``idle_room_only`` (a model pre-load, model_preload.py): on a GPU with idle room or not at all —
        no kept weights are evicted for it, and no GPU means a failure, not a run on the CPU.
        ``stage``: the container is a pipeline stage of a split instance or a rank of a gang (``instance_id`` the
        stage's or rank's id): on ``gpu_index`` or not at all, with its own GPU needs and its place in its /init,
        never kept at exit."""
        runtime = self._runtime_of(action)
        if runtime is None:
            return None, ActivationResponse.whisk_error("Action version is not compatible and cannot be invoked.")
        if stage is not None and not runtime.gpu:
            return None, ActivationResponse.whisk_error(f"{stage.named} needs a GPU runtime, not {runtime.kind}")
        lease = await self.pool.acquire(
            self.instance_key(instance_id, action), action, memory_mb=action.limits.memory_mb,
            slots=action.limits.concurrency, make_spec=lambda name: self._container_spec(name, action, runtime),
            instance=instance_id,
        )
        proxy = lease.proxy
        if not lease.cold:  # the instance already has a container (a repeated command)
            self.pool.release(proxy, healthy=True)
            return proxy.name, await asyncio.shield(proxy.ready)
        if stage is not None:
            self._stage_containers.add(proxy.name)
        owner = Identity(subject=action.namespace, namespace=action.namespace, uuid="", key="")
        req = ActivationRequest(activation_id=new_activation_id(), action=action, identity=owner,
                                content=action.default_params, init_args=action.init_param_names)
        failure: ActivationResponse | None = None
        try:
            failure, _init_ms, logs = await self._start_and_init(proxy, req, runtime, gpu_index=gpu_index,
                                                                 gpu_key=instance_id, idle_room_only=idle_room_only,
                                                                 stage=stage)
            if failure is not None and logs:
                # No activation carries these logs (the balancer started the instance): the operator's only
                # way to the action's traceback.
                log.warning("instance init failed", instance=instance_id, action=action.fqn,
                            error=failure.result, logs=list(logs[-INIT_FAILURE_LOG_LINES:]))
        except Exception as exc:  # reported as the instance's failure
            log.exception("instance start failed", instance=instance_id)
            failure = ActivationResponse.whisk_error(f"instance start failed: {exc!r}")
        self.pool.release(proxy, healthy=failure is None, reason="" if failure is None else "instance start failed")
        return proxy.name, failure

    async def run_on_instance(self, instance_id: str, req: ActivationRequest, *,
                              on_lease: Callable[[], None] | None = None) -> Activation | None:
        """Run on the instance's container (waiting for one of its slots; ``on_lease`` is called when the
        activation gets one); None when the instance has no container (any more)."""
        tokens = bind_activation(activation_id=req.activation_id, transid=req.transid_id, instance=instance_id)
        try:
            return await self._run(req, key=self.instance_key(instance_id, req.action), may_start=False,
                                   on_lease=on_lease)
        except NoContainer:
            return None
        finally:
            reset_activation(**tokens)

    async def run_on_stages(self, stages: Sequence[str], req: ActivationRequest, *,
                            on_lease: Callable[[], None] | None = None) -> Activation | None:
        """Run through a split instance's pipeline stages (their ids, in order): the activation's params go to
        the first, each stage's result (a JSON object) is the next one's params, the last one's is the
        activation's result; one record for the whole run, its logs each stage's in turn. A failing stage ends
        the activation with its failure, named (``stage k of N: ...``). ``on_lease``: the first stage gave it a
        slot. None when the first stage has no container (any more)."""
        return await self._over_parts(stages, req, lambda whole: self._pipeline(stages, req, on_lease, whole))

    async def _over_parts(self, parts: Sequence[str], req: ActivationRequest,
                          run: Callable[[_Whole], Awaitable[Activation | None]]) -> Activation | None:
        """One activation over an instance's parts (`run_on_stages`, `run_on_ranks`): bound to the instance in the
        log context, refused when the action's runtime is not known here, else `run` with what every part's run
        shares (`_Whole`)."""
        tokens = bind_activation(activation_id=req.activation_id, transid=req.transid_id,
                                 instance=instance_of_parts(parts))
        try:
            action = req.action
            runtime = self._runtime_of(action)
            if runtime is None:
                return self._failed(req, ActivationResponse.whisk_error(
                    "Action version is not compatible and cannot be invoked."))
            limit_s = action.limits.timeout_ms / 1000
            # the action's time limit holds for the whole run, over every part
            return await run(_Whole(runtime=runtime, arrived=req.transid_start_ms or now_ms(), limit_s=limit_s,
                                    deadline=time.monotonic() + limit_s,
                                    deadline_ms=now_ms() + action.limits.timeout_ms))
        finally:
            reset_activation(**tokens)

    async def _pipeline(self, stages: Sequence[str], req: ActivationRequest,
                        on_lease: Callable[[], None] | None, whole: _Whole) -> Activation | None:
        action = req.action
        runtime, arrived, limit_s, deadline, deadline_ms = whole
        count = len(stages)
        content = req.content
        logs: list[str] = []
        first: Activation | None = None
        response = ActivationResponse.whisk_error(MSG_ABNORMAL_RUN)
        timed_out = False
        for k, part in enumerate(stages):
            named = f"stage {k} of {count}"
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                timed_out = True
                response = ActivationResponse.developer_error(f"{named}: {timed_out_message(limit_s, init=False)}")
                break
            final = k == count - 1
            run = StageRun(k, count, DEFAULT_MAX_RESULT_BYTES if final else STAGE_MAX_RESULT_BYTES, left_s, deadline_ms)
            try:
                activation = await self._run(replace(req, content=content, init_args=req.init_args if k == 0 else ()),
                                             key=self.instance_key(part, action), may_start=False,
                                             on_lease=on_lease if k == 0 else None, stage=run)
            except (NoContainer, InvokerOverloaded) as exc:
                if k == 0:
                    if isinstance(exc, NoContainer):
                        return None
                    raise
                response = ActivationResponse.whisk_error(f"{named}: {MSG_ABNORMAL_RUN} ({exc})")
                break
            first = first or activation
            logs.extend(_stage_line(line, k) for line in activation.logs)
            timed_out = activation.annotation("timeout") is True
            response = activation.response
            if timed_out:  # its time was what the pipeline had left of the action's limit
                response = ActivationResponse.developer_error(timed_out_message(limit_s, init=False))
            if response.status is not ActivationStatus.SUCCESS:
                response = _stage_failure(response, named)
                break
            if not final:
                if not isinstance(response.result, dict):
                    response = ActivationResponse.developer_error(
                        f"{named}: its result is not a JSON object, the next stage's params")
                    break
                content = response.result
        start = first.start if first is not None else now_ms()
        return self._finish(req, runtime, start, now_ms(), response, tuple(logs), arrived=arrived, start_ms=start,
                            init_ms=None, timed_out=timed_out)

    async def run_on_ranks(self, ranks: Sequence[str], req: ActivationRequest, *,
                           on_lease: Callable[[], None] | None = None) -> Activation | None:
        """Run on every rank of a gang at once (their ids, in rank order), each with the activation's params, under
        the action's one time limit: the result is rank 0's; one record for the whole run, its logs every rank's in
        rank order, each line naming its rank. A failing rank fails the activation, named (``rank k of N: ...``),
        the first to fail, as soon as it does; ranks still running get GANG_PEER_GRACE_S to finish in the
        background, in their slots, else the gang is stopped whole (`_stop_if_stuck`).
        ``on_lease``: rank 0 gave it a slot. None when rank 0 has no container (any more)."""
        return await self._over_parts(ranks, req, lambda whole: self._gang(ranks, req, on_lease, whole))

    async def _gang(self, ranks: Sequence[str], req: ActivationRequest,
                    on_lease: Callable[[], None] | None, whole: _Whole) -> Activation | None:
        action = req.action
        runtime, arrived, limit_s, deadline, deadline_ms = whole
        world = len(ranks)
        loop = asyncio.get_running_loop()
        # Each rank's slot is taken in rank order, the next one's once this one has it: two activations of the
        # gang never each hold a slot the other waits for. A rank that gets none (False) leaves the rest untaken.
        leased: list[asyncio.Future[bool]] = [loop.create_future() for _ in ranks]
        over = False

        async def one(k: int, part: str) -> Activation | None:
            if k and not await leased[k - 1]:
                return None
            if over:  # an earlier rank failed before this one's turn: no use running it
                return None

            def got() -> None:
                if not leased[k].done():
                    leased[k].set_result(True)
                if k == 0 and on_lease is not None:
                    on_lease()

            run = StageRun(k, world, DEFAULT_MAX_RESULT_BYTES, max(0.001, deadline - time.monotonic()), deadline_ms,
                           rank=True)
            try:
                return await self._run(req, key=self.instance_key(part, action), may_start=False, on_lease=got,
                                       stage=run)
            finally:
                if not leased[k].done():
                    leased[k].set_result(False)

        tasks = [asyncio.ensure_future(one(k, part)) for k, part in enumerate(ranks)]
        done: dict[int, Activation] = {}
        failure: tuple[int, ActivationResponse, bool] | None = None
        overloaded: InvokerOverloaded | None = None
        pending = set(tasks)
        while pending and failure is None and overloaded is None:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(finished, key=tasks.index):
                k = tasks.index(task)
                named = f"rank {k} of {world}"
                try:
                    activation = task.result()
                except NoContainer as exc:
                    if k == 0:
                        return None  # (every other rank then takes no slot and ends)
                    failure = failure or (k, ActivationResponse.whisk_error(f"{named}: {MSG_ABNORMAL_RUN} ({exc})"),
                                          False)
                    continue
                except InvokerOverloaded as exc:
                    overloaded = overloaded or exc
                    continue
                if activation is None:  # an earlier rank got no slot: its failure is the activation's
                    continue
                done[k] = activation
                response = activation.response
                timed_out = activation.annotation("timeout") is True
                if timed_out:  # its time was what the gang had left of the action's limit
                    response = ActivationResponse.developer_error(timed_out_message(limit_s, init=False))
                if response.status is not ActivationStatus.SUCCESS and failure is None:
                    failure = (k, _stage_failure(response, named), timed_out)
        over = True
        for task in pending:  # ranks still running (a failed rank's peers): their runs end in their slots
            self._background.add(task)
            task.add_done_callback(_retrieved)
            task.add_done_callback(self._background.discard)
        if pending and failure is not None and not failure[2]:  # (a rank out of time: so are its peers)
            peers = {tasks.index(task): task for task in pending}
            self._in_background(self._stop_if_stuck(ranks, action, failure[0], peers, deadline))
        if overloaded is not None and failure is None:
            raise overloaded
        logs = tuple(_stage_line(line, k, "rank") for k in sorted(done) for line in done[k].logs)
        start = min((a.start for a in done.values()), default=now_ms())
        if failure is not None:
            _k, response, timed_out = failure
        elif 0 in done and len(done) == world:
            response, timed_out = done[0].response, False
        else:  # (no rank failed, yet not every rank ran: cannot be; an abnormal run all the same)
            response, timed_out = ActivationResponse.whisk_error(MSG_ABNORMAL_RUN), False
        return self._finish(req, runtime, start, now_ms(), response, logs, arrived=arrived, start_ms=start,
                            init_ms=None, timed_out=timed_out)

    async def _stop_if_stuck(self, ranks: Sequence[str], action: Action, failed: int,
                             peers: Mapping[int, asyncio.Future[Activation | None]], deadline: float) -> None:
        """Rank `failed` of the gang failed while its `peers` (rank → run) ran on: they get GANG_PEER_GRACE_S (at
        most what is left of the time limit) to finish. A peer still running then likely waits in a collective
        the failed rank never joins, and would hold its slot until the time limit: the gang is broken, and every
        rank's container goes, which fails the instance whole as a dead rank does (`InstanceManager`)."""
        grace_s = max(0.0, min(GANG_PEER_GRACE_S, deadline - time.monotonic()))
        _, running = await asyncio.wait(peers.values(), timeout=grace_s)
        if not running:
            return
        world = len(ranks)
        stuck = sorted(k for k, task in peers.items() if task in running)
        named = f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))}"
        reason = (f"rank {failed} of {world} failed and {named} did not finish within {grace_s:.3g} s: "
                  "gang stopped")
        log.warning("gang stopped", reason=reason)  # (the activation and the instance are in the log context)
        for part in ranks:
            for proxy in list(self.pool.containers.values()):
                if proxy.key == self.instance_key(part, action):
                    self.pool.remove(proxy, reason)

    def stop_instance(self, container: str, reason: str) -> None:
        proxy = self.pool.containers.get(container)
        if proxy is not None:
            if proxy.state not in (State.REMOVING, State.REMOVED):
                self._stopping.add(proxy.name)  # scaled in: its weights may be kept (staged exit)
            self.pool.remove(proxy, reason)

    # -- activation records --------------------------------------------------------------------

    def _finish(
        self,
        req: ActivationRequest,
        runtime: RuntimeKind,
        start: int,
        end: int,
        response: ActivationResponse,
        logs: tuple[str, ...],
        *,
        arrived: int,
        start_ms: int,
        init_ms: int | None,
        timed_out: bool = False,
        preloaded: bool = False,
        stage: StageRun | None = None,
    ) -> Activation:
        action = req.action
        wait_ms = max(0, start_ms - arrived)
        annotations: list[Parameter] = [
            Parameter("path", action.fqn),
            Parameter("waitTime", wait_ms),
            Parameter("kind", runtime.kind if runtime.kind != BLACKBOX else BLACKBOX),
            Parameter("timeout", timed_out),
            Parameter("limits", action.limits.to_json()),
        ]
        if init_ms is not None:
            annotations.append(Parameter("initTime", init_ms))
            if preloaded:
                annotations.append(Parameter("preloaded", True))
        if req.cause is not None:
            annotations.append(Parameter("causedBy", "sequence"))
        if req.binding is not None:
            annotations.append(Parameter("binding", req.binding))
        activation = Activation(
            namespace=req.identity.namespace,
            name=action.name,
            subject=req.identity.subject,
            activation_id=req.activation_id,
            start=start,
            end=max(start, end),
            response=response,
            logs=logs,
            version=action.version,
            annotations=tuple(annotations),
            cause=req.cause,
        )
        if stage is not None:  # a part of a pipelined activation, counted once as a whole (`run_on_stages`)
            return activation
        self.metrics.record(activation, kind=runtime.kind, memory_mb=action.limits.memory_mb,
                            wait_ms=wait_ms, init_ms=init_ms)
        # Per activation at info only when it tells something (a cold start, a failure): a warm success
        # is counted in /metrics, and writing its line cost more than the rest of finishing it.
        notable = init_ms is not None or response.status is not ActivationStatus.SUCCESS
        (log.info if notable else log.debug)("activation finished", action=action.fqn,
                                              status=response.status.api_string,
                                              duration_ms=activation.duration, cold=init_ms is not None)
        return activation

    def refuse(self, req: ActivationRequest, message: str) -> Activation:
        """The record of an activation refused before it reached a container (a whisk internal error)."""
        return self._failed(req, ActivationResponse.whisk_error(message))

    def _failed(self, req: ActivationRequest, response: ActivationResponse) -> Activation:
        """A fallback record for an activation that never reached a container (§1.4)."""
        return never_ran_for(req, response)

    # -- lifecycle -----------------------------------------------------------------------------

    async def close(self, *, drain_s: float = 5.0) -> None:
        self.set_enabled(False)
        if self.keeper is not None:
            await self.keeper.close()  # and nothing is kept from here on
        if self.preload is not None:
            await self.preload.close()
        await self.pool.close(drain_s=drain_s)
        self._run_connections.close()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


async def _settle(future: asyncio.Future[bytes] | None) -> None:
    if future is not None:
        with contextlib.suppress(Exception):
            await future


def make_backend(cfg: Config) -> ContainerBackend:
    if cfg.invoker.backend == "docker":
        from dilu_invoker.invoker.dataplane.backends.docker import DockerBackend

        return DockerBackend(url=cfg.invoker.docker_url, network=cfg.invoker.docker_network,
                             ulimits=cfg.invoker.docker_ulimits, gpu_mode=cfg.invoker.docker_gpu_mode,
                             user=cfg.invoker.docker_user)
    from dilu_invoker.invoker.dataplane.backends.process import ProcessBackend

    ic = cfg.invoker
    return ProcessBackend(isolation=ic.process_isolation, uid_range=ic.process_uid_range,
                          work_dir=ic.process_work_dir, hide=(str(cfg.data_path),), direct_lane=ic.process_direct_lane)


@contextlib.asynccontextmanager
async def open_invoker(
    cfg: Config,
    *,
    manifest: Manifest | None = None,
    backend: ContainerBackend | None = None,
    gpu: GpuAllocator | None = None,
    redis: aioredis.Redis | None = None,
    slot: int = 0,
    invokers: int = 1,
) -> AsyncIterator[Invoker]:
    """Start an invoker and tear it down in reverse order (drain, remove containers, stop the GPU managers,
    close the backend). Without ``gpu`` it runs this node's :class:`GpuNode` (budgets in ``redis`` when
    given), which starts after leftover containers are gone: their reservations are then reconciled away."""
    manifest = manifest or Manifest.load(cfg.invoker.runtimes_manifest)
    backend = backend or make_backend(cfg)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    removed = await backend.remove_leftovers(f"{cfg.invoker.container_prefix}{cfg.invoker.id}_")
    if removed:
        log.info("removed containers left by an earlier run", count=removed)
    metrics = InvokerMetrics()
    gpu_node: GpuNode | None = None
    if gpu is None:
        # NVML discovery can take a while on a big host: off the event loop.
        gpu_node = await asyncio.to_thread(GpuNode.from_config, cfg, redis=redis, backend=backend.name,
                                           registry=metrics.registry,
                                           distinct_pids=getattr(backend, "distinct_pids", True),
                                           slot=slot, invokers=invokers)
        await gpu_node.start()
        gpu = gpu_node
    invoker = Invoker(cfg, manifest=manifest, backend=backend, session=session, gpu=gpu, metrics=metrics)
    invoker.start_preloading()
    try:
        yield invoker
    finally:
        errors: list[BaseException] = []
        steps = (invoker.close, *((gpu_node.close,) if gpu_node is not None else ()), session.close, backend.close)
        for step in steps:
            try:
                await step()
            except Exception as exc:  # noqa: BLE001 - finish the teardown, then report
                errors.append(exc)
        for error in errors:
            log.warning("error during invoker shutdown", error=repr(error))


def instance_of_parts(parts: Sequence[str]) -> str:
    """The instance of its parts' ids, a split instance's stage ids or a gang's rank ids (for the log context)."""
    if not parts:
        return ""
    gang = rank_of(parts[0])
    return gang[0] if gang is not None else stage_parent(parts[0]) or parts[0]


def gang_refusal(action: Action) -> str | None:
    """Why this invoker's own pool cannot run the action (None: it can): one annotated ``gpu-count`` N > 1 runs
    only as a gang the balancer placed (N ranks on N GPUs of one invoker, `Invoker.run_on_ranks`), never in one
    container on one GPU, nor on the CPU. On every run of the pool: an action without the annotation costs one scan
    of its annotations."""
    if action.annotation("gpu-count") is None:
        return None
    gpus = GpuNeeds.gpus_of(action.annotation_map)  # (invalid annotations: the GPU path explains them, as before)
    if gpus <= 1:
        return None
    return (f"The action cannot run: annotation 'gpu-count' of {gpus} makes each instance a gang of {gpus} GPUs, "
            "which only the balancer places (cluster mode, or standalone with balancer routing); "
            "this invoker's own containers take one GPU each.")


def _stage_line(line: str, index: int, part: str = "stage") -> str:
    """A stage's (a rank's) log line with the stage in it, after the time stamp and the stream
    (``... stdout: [stage 1] x``, ``... stdout: [rank 1] x``)."""
    head, sep, rest = line.partition(": ")
    return f"{head}: [{part} {index}] {rest}" if sep else f"[{part} {index}] {line}"


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A background task's outcome (a gang rank's run after its activation ended, ...) is nobody's to await: its
    exception, if any, is logged here."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a background task failed", error=repr(task.exception()))


def _stage_failure(response: ActivationResponse, named: str) -> ActivationResponse:
    """A stage's failed response as the activation's, with the stage named in its error."""
    result = response.result
    error = result.get("error") if isinstance(result, dict) else result
    text = error if isinstance(error, str) else json.dumps(error)
    named_result: dict[str, JsonValue] = {**result, "error": f"{named}: {text}"} if isinstance(result, dict) \
        else {"error": f"{named}: {text}"}
    return ActivationResponse(response.status, named_result, response.size)


def _mps_cap(attachment: GpuAttachment | None) -> dict[str, str]:
    """The MPS active-thread cap and client priority of a pre-loaded GPU container that was taken (empty when
    not an MPS client): its worker makes its CUDA context after /init, with these."""
    if attachment is None or not attachment.mps_client or MPS_THREADS_ENV not in attachment.env:
        return {}
    return {k: attachment.env[k] for k in (MPS_THREADS_ENV, MPS_PRIORITY_ENV) if k in attachment.env}
