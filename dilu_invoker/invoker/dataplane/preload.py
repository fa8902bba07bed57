"""Pre-loaded containers (after Tyche): per runtime kind, a few idle containers started ahead of any
request whose worker has already imported the kind's libraries and, on a GPU node, created its CUDA
context. A cold start of any action of that kind takes one — its ``/init`` then runs only the action's
own code — and a replacement starts in the background.

A pre-loaded container is an ordinary container of the backend, confined like any other (process
backend: its own uid, private directory, memory cgroup and mount view, made when it starts), with a
memory limit of ``--invoker-preload-memory-mb`` until an action takes it; taking it sets the action's
``limits.memory`` on its cgroup and it then serves that one action for the rest of its life (its worker
loads the action into a fresh module; only the imported libraries were there before). A worker whose
pre-load failed (it died, or its CUDA context could not be made) is discarded, never handed out.

Which kinds: those whose runtimes manifest entry has a ``"preload"`` list, when at least one module of
the list can be imported on this node (process backend; with the docker backend the image's libraries
cannot be checked from the invoker, so there a GPU kind is pre-loaded only on a node with GPUs). An empty
list pre-starts the interpreter and the runtime only;
besides the list, up to ``--invoker-preload-learn`` installed modules that recent actions of the kind
imported (their ``/init`` reports them) are pre-loaded too, the most frequent first.

Under MPS (docs/invoker.md, "Pre-loaded containers"): an MPS client's thread cap is fixed when it makes its
CUDA context, so a pre-loaded MPS client makes it only at a cap chosen ahead — per kind, the most frequent
cap that the recent cold starts of the kind got on this node (`GpuNode.mps_cap`). Of ``--preload`` per
kind, one slot then stays contextless (its context waits for /init and the cap of whoever takes it) and the
others make their context at that cap (with ``--preload 1`` the one slot does when nearly all recent cold
starts got that cap, `CAP_SOLE_SHARE`). A cold start takes a contextful one only when its function's cap
there now is the container's; otherwise a contextless one, or it misses (``reason="MPS thread cap
differs"``). Before any cap is learnt all are contextless.

Budgets: pre-loaded containers together hold at most ``--invoker-preload-budget-mb`` of host memory (and,
on GPU kinds, ``--invoker-preload-gpu-budget-mb`` of GPU memory reservations); they count against the
invoker's user memory, and the pool sheds them before it evicts a warm container of any action.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import itertools
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from dilu_invoker.actions._ipc import installed_roots
from dilu_invoker.gpu.attachment import MPS_THREADS_ENV, GpuAttachment
from dilu_invoker.gpu.mps import active_thread_percentage
from dilu_invoker.invoker.dataplane.backends.base import (
    Container,
    ContainerBackend,
    ContainerSpec,
    Mount,
    drain_output,
)
from dilu_invoker.invoker.manifest import Manifest, RuntimeKind
from dilu_invoker.model import Action, GpuNeeds, ValidationError

log = structlog.get_logger(__name__)

PRELOAD_MODULES_ENV = "DILU_PRELOAD_MODULES"
PRELOAD_CUDA_ENV = "DILU_PRELOAD_CUDA"
#: how long a pre-loaded container may take to import its libraries before it is given up
LOAD_TIMEOUT_S = 120.0
#: pre-loaded containers of a kind are restarted for newly learnt modules at most once in this many seconds
#: (actions with ever-changing imports must not keep every container from becoming ready)
RELEARN_MIN_S = 30.0
#: how many recent cold starts of a kind its MPS thread cap is learnt from
CAP_HISTORY = 32
#: the miss of a cold start whose function's MPS thread cap no pre-loaded container of the kind has
CAP_MISS = "MPS thread cap differs"
#: the miss of a model pre-load (background work) that would have taken the last pre-loaded container a
#: request's cold start could take there: it starts a container of its own instead
SPARED = "left for requests"
#: with one pre-loaded container per kind, the share of recent cold starts that must have got the learnt
#: cap for it to make its context at that cap: a context made ahead saves a cold start of that cap its
#: context and library loading (~0.5-0.7 s on the H200) but makes every cold start of another cap miss
#: (losing the pre-loaded imports, 2 s and more), so only when the cap is nearly the only one
CAP_SOLE_SHARE = 0.8
_POLL_S = 0.05


class PreloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hits = Counter("dilu_invoker_preload_hits", "Cold starts that took a pre-loaded container",
                            ("kind",), registry=r)
        self.misses = Counter("dilu_invoker_preload_misses", "Cold starts of a pre-loaded kind that found none "
                              "usable", ("kind", "reason"), registry=r)
        self.started = Counter("dilu_invoker_preload_started", "Pre-loaded containers started", ("kind",),
                               registry=r)
        self.discarded = Counter("dilu_invoker_preload_discarded", "Pre-loaded containers removed without "
                                 "serving", ("kind", "reason"), registry=r)
        self.size = Gauge("dilu_invoker_preload_containers", "Pre-loaded containers by state (loading, ready)",
                          ("kind", "state"), registry=r)
        self.memory = Gauge("dilu_invoker_preload_memory_mb", "Host memory held by pre-loaded containers (MB)",
                            registry=r)
        self.gpu_memory = Gauge("dilu_invoker_preload_gpu_memory_mb", "GPU memory reserved by pre-loaded "
                                "containers (MB)", registry=r)
        self.cap = Gauge("dilu_invoker_preload_mps_threads_percent", "MPS thread cap (active-thread percentage) "
                         "the kind's pre-loaded MPS clients make their CUDA context at, learnt from its recent cold "
                         "starts (0: none makes it before /init)", ("kind",), registry=r)
        self.load_time = Gauge("dilu_invoker_preload_load_seconds", "Time the last pre-loaded container of the "
                               "kind took to import its libraries (and make its CUDA context)", ("kind",),
                               registry=r)


@dataclass(eq=False, slots=True)
class Standby:
    """One pre-loaded container."""

    name: str
    kind: str
    memory_mb: int
    gpu_memory_mb: int = 0
    modules: tuple[str, ...] = ()
    state: str = "starting"  # starting → loading → ready; removed
    container: Container | None = None
    gpu: GpuAttachment | None = None
    gpu_key: str | None = None
    slot: int | None = None
    """The MPS thread cap (whole percent) it was started to make its CUDA context at; None: the slot whose
    context waits for /init (or a kind that is not pre-loaded at a cap)."""
    mps_cap: int | None = None
    """The cap its MPS client made its CUDA context at, once attached; None: it is no MPS client, or it made
    no context before /init (either way any function of the kind may take it)."""
    info: dict[str, Any] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    drain: asyncio.Task[None] | None = None
    since: float = field(default_factory=time.monotonic)

    async def stop_draining(self) -> None:
        if self.drain is not None:
            self.drain.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.drain
            self.drain = None


@dataclass(frozen=True, slots=True)
class Taken:
    """A pre-loaded container handed to an action's cold start."""

    standby: Standby
    container: Container
    kind: str
    modules: tuple[str, ...]
    gpu: GpuAttachment | None
    gpu_key: str | None
    waited_loading: bool


class PreloadPool:
    def __init__(
        self,
        *,
        manifest: Manifest,
        backend: ContainerBackend,
        session: aiohttp.ClientSession,
        per_kind: int,
        memory_mb: int,
        budget_mb: int,
        gpu_budget_mb: int,
        learn: int,
        make_spec: Callable[[str, RuntimeKind, dict[str, str]], ContainerSpec],
        room_mb: Callable[[], int],
        registry: CollectorRegistry,
        name_prefix: str,
        attach_gpu: Callable[[str, RuntimeKind], Awaitable[tuple[GpuAttachment | None, int]]] | None = None,
        detach_gpu: Callable[[str], Awaitable[None]] | None = None,
        check_importable: bool = True,
        has_gpus: bool = False,
        mps_cap: Callable[[str, GpuNeeds, int | None], float | None] | None = None,
    ) -> None:
        """``mps_cap``: the MPS thread cap a function with these needs would connect with now on that GPU
        (`GpuNode.mps_cap`; None: not under MPS). Without it nothing is learnt and, under MPS, no pre-loaded
        container makes its CUDA context before /init; with it, ``attach_gpu`` is also called with the
        cap chosen ahead (``mps_threads=``)."""
        self.manifest = manifest
        self.backend = backend
        self.session = session
        self.per_kind = per_kind
        self.memory_mb = memory_mb
        self.budget_mb = budget_mb
        self.gpu_budget_mb = gpu_budget_mb
        self.learn_limit = learn
        self._make_spec = make_spec
        self._room_mb = room_mb
        self._attach_gpu = attach_gpu
        self._detach_gpu = detach_gpu
        self.mps_cap = mps_cap
        self._caps: dict[str, collections.deque[int]] = collections.defaultdict(
            lambda: collections.deque(maxlen=CAP_HISTORY))
        self._cap: dict[str, int] = {}
        self._prefix = name_prefix
        self._counter = itertools.count(1)
        self.metrics = PreloadMetrics(registry)
        self.standbys: dict[str, list[Standby]] = collections.defaultdict(list)
        self._learnt: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._restarted_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.kinds: dict[str, RuntimeKind] = {}
        self._check = check_importable
        self._no_room_logged: set[str] = set()
        if per_kind > 0:
            for kind, runtime in manifest.runtimes.items():
                if runtime.preload is None or runtime.deprecated:
                    continue
                if runtime.gpu and not has_gpus and not check_importable:
                    # An image's libraries cannot be checked from here: a GPU kind waits for a GPU node.
                    log.info("pre-loading skipped: a GPU kind on a node without GPUs", kind=kind)
                    continue
                usable = [m for m in runtime.preload if not check_importable or _importable(m)]
                if runtime.preload and not usable:
                    log.info("pre-loading skipped: none of the kind's libraries is installed here", kind=kind,
                             preload=list(runtime.preload))
                    continue
                self.kinds[kind] = runtime

    # -- views -------------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return bool(self.kinds)

    def covers(self, kind: str) -> bool:
        return kind in self.kinds

    @property
    def memory_in_use_mb(self) -> int:
        return sum(s.memory_mb for items in self.standbys.values() for s in items)

    @property
    def gpu_memory_in_use_mb(self) -> int:
        return sum(s.gpu_memory_mb for items in self.standbys.values() for s in items)

    def modules_for(self, kind: str) -> tuple[str, ...]:
        """The manifest's list, then the most frequently learnt installed modules (bounded)."""
        runtime = self.kinds[kind]
        declared = [m for m in runtime.preload or () if not self._check or _importable(m)]
        learnt = [m for m, _n in self._learnt[kind].most_common() if m not in declared][: self.learn_limit]
        return tuple(declared + learnt)

    def learnt_cap(self, kind: str) -> int | None:
        """The MPS thread cap (whole percent) the kind's pre-loaded MPS clients make their CUDA context at:
        the most frequent among the caps its recent cold starts got (`CAP_HISTORY`; on a tie the one in use
        stays, else the latest); None before any was learnt."""
        history = self._caps.get(kind)
        if not history:
            return None
        counts = collections.Counter(history)
        top = max(counts.values())
        tied = [c for c, n in counts.items() if n == top]
        current = self._cap.get(kind)
        if current in tied:
            return current
        return next(c for c in reversed(history) if c in tied)

    def slot_caps(self, kind: str) -> list[int | None]:
        """What each of the kind's ``per_kind`` slots is pre-loaded as: a cap (a context made at it) or None
        (no context before /init). With a learnt cap and two or more slots, one stays contextless (it serves
        a cold start of any cap) and the others take the cap; a single slot takes it only when at least
        `CAP_SOLE_SHARE` of the recent cold starts got it."""
        cap = self._cap.get(kind)
        if cap is None or self.per_kind <= 0:
            return [None] * self.per_kind
        if self.per_kind == 1:
            history = self._caps[kind]
            return [cap] if history.count(cap) >= CAP_SOLE_SHARE * len(history) else [None]
        return [cap] * (self.per_kind - 1) + [None]

    def _next_slot(self, kind: str, items: list[Standby]) -> int | None:
        need = collections.Counter(self.slot_caps(kind))
        for standby in items:
            if need[standby.slot] > 0:
                need[standby.slot] -= 1
        return next((c for c in self.slot_caps(kind) if need[c] > 0), None)

    def _update_gauges(self) -> None:
        for kind in self.kinds:
            items = self.standbys.get(kind, [])
            for state in ("loading", "ready"):
                n = sum(1 for s in items if (s.state == state or (state == "loading" and s.state == "starting")))
                self.metrics.size.labels(kind, state).set(n)
            self.metrics.cap.labels(kind).set(next((c for c in self.slot_caps(kind) if c is not None), 0))
        self.metrics.memory.set(self.memory_in_use_mb)
        self.metrics.gpu_memory.set(self.gpu_memory_in_use_mb)

    # -- filling ---------------------------------------------------------------------------------------

    def start(self) -> None:
        for kind in self.kinds:
            self.refill(kind)

    def refill(self, kind: str) -> None:
        """Start pre-loaded containers of ``kind`` up to ``per_kind``, within the budgets and the room left
        in the invoker's user memory."""
        if self._closed or kind not in self.kinds:
            return
        runtime = self.kinds[kind]
        memory_mb = runtime.preload_memory_mb or self.memory_mb
        wanted = self.slot_caps(kind)
        for stale in [s for s in self.standbys[kind] if s.slot is not None and s.slot not in wanted]:
            self._discard(stale, "MPS thread cap no longer wanted")
        while len(self.standbys[kind]) < self.per_kind:
            if self.memory_in_use_mb + memory_mb > self.budget_mb or self._room_mb() < memory_mb:
                if kind not in self._no_room_logged:
                    self._no_room_logged.add(kind)
                    log.info("no room for a pre-loaded container now", kind=kind, memory_mb=memory_mb,
                             budget_mb=self.budget_mb, preloaded_mb=self.memory_in_use_mb, room_mb=self._room_mb())
                break
            name = f"{self._prefix}_{next(self._counter)}_preload_{_slug(kind)}"
            standby = Standby(name=name, kind=kind, memory_mb=memory_mb, modules=self.modules_for(kind),
                              slot=self._next_slot(kind, self.standbys[kind]))
            self.standbys[kind].append(standby)
            standby.task = self._spawn(self._start(standby, runtime))
        self._update_gauges()

    async def _start(self, standby: Standby, runtime: RuntimeKind) -> None:
        # Always set (empty: nothing but the interpreter and the runtime), so the worker reports when done.
        env = {PRELOAD_MODULES_ENV: ",".join(standby.modules)}
        spec = self._make_spec(standby.name, runtime, env)
        try:
            if runtime.gpu and self._attach_gpu is not None:
                if self.gpu_memory_in_use_mb >= self.gpu_budget_mb:
                    raise _Skip("GPU budget of pre-loading is used up")
                if standby.slot is not None:
                    attachment, gpu_mb = await self._attach_gpu(standby.name, runtime,  # type: ignore[call-arg]
                                                                mps_threads=standby.slot / 100)
                else:
                    attachment, gpu_mb = await self._attach_gpu(standby.name, runtime)
                if attachment is not None:
                    if self.gpu_memory_in_use_mb + gpu_mb > self.gpu_budget_mb:
                        standby.gpu_key = standby.name
                        raise _Skip("GPU budget of pre-loading is used up")
                    standby.gpu, standby.gpu_key, standby.gpu_memory_mb = attachment, standby.name, gpu_mb
                    # An MPS client fixes its cap when it makes its CUDA context: it makes it now only in a
                    # slot of a cap chosen ahead; otherwise the context waits for /init, which brings the cap
                    # of the function that takes the container.
                    contextful = not attachment.mps_client or standby.slot is not None
                    if attachment.mps_client and contextful:
                        standby.mps_cap = _percent(attachment.env.get(MPS_THREADS_ENV))
                    env = {**dict(spec.env), **attachment.env, PRELOAD_CUDA_ENV: "1" if contextful else "0"}
                    spec = ContainerSpec(
                        name=spec.name, kind=spec.kind, image=spec.image, memory_mb=spec.memory_mb, env=env,
                        mounts=spec.mounts + tuple(Mount(m.source, m.target, m.read_only) for m in attachment.mounts),
                        devices=spec.devices + attachment.devices, labels=spec.labels, own_runtime=spec.own_runtime)
            self.metrics.started.labels(standby.kind).inc()
            container = await self.backend.start(spec)
            standby.container = container
            if standby.state == "removed":
                raise _Skip("removed while starting")
            standby.state = "loading"
            standby.drain = asyncio.create_task(drain_output(container, standby.name, "pre-loading"))
            self._update_gauges()
            info = await self._wait_loaded(container)
            standby.info = info
            if info.get("state") != "done":
                raise _Skip(f"pre-load failed: {info.get('cuda_error') or info.get('error') or info.get('state')}")
            if standby.state != "loading":
                return
            standby.state = "ready"
            self.metrics.load_time.labels(standby.kind).set(info.get("ms", 0) / 1000)
            log.info("pre-loaded container ready", container=standby.name, kind=standby.kind,
                     modules=info.get("modules"), missing=info.get("missing"), cuda=info.get("cuda"),
                     mps_threads=standby.mps_cap, load_ms=info.get("ms"))
            self._update_gauges()
        except asyncio.CancelledError:
            raise
        except _Skip as skip:
            self._discard(standby, str(skip))
        except Exception as exc:  # noqa: BLE001 - a pre-loaded container that fails is dropped, not fatal
            log.warning("pre-loaded container failed to start", container=standby.name, kind=standby.kind,
                        error=repr(exc))
            self._discard(standby, "start failed")

    async def _wait_loaded(self, container: Container) -> dict[str, Any]:
        headers = {"X-Dilu-Runtime-Secret": container.secret} if container.secret else {}
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        pause = _POLL_S
        while time.monotonic() < deadline:
            if not container.alive:
                return {"state": "failed", "error": f"container exited ({container.exit_reason()})"}
            try:
                async with self.session.get(f"{container.url}/health", headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        body = await resp.json(content_type=None)
                        state = (body.get("preload") or {}).get("state")
                        if state in ("done", "failed"):
                            return dict(body["preload"])
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass  # not listening yet
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 0.5)  # heavy imports take seconds: no need to ask 20 times a second
        return {"state": "failed", "error": "pre-loading timed out"}

    # -- taking ----------------------------------------------------------------------------------------

    def take(self, runtime: RuntimeKind, action: Action, *, gpu_index: int | None = None,
             spare_last: bool = False) -> Standby | None:
        """A pre-loaded container of the action's kind (ready ones first; under MPS one whose CUDA context
        has the thread cap the action's function gets now, else one without a context), or None (a miss:
        the caller does a plain cold start). A replacement is started in the background either way.
        ``spare_last`` (background work, a model pre-load): never the last one there (counted as a miss,
        `SPARED`): a request's cold start would wait for its replacement instead (~10 s on the H200)."""
        kind = runtime.kind
        if kind not in self.kinds:
            return None
        if spare_last and len(self._on_gpu(kind, gpu_index if runtime.gpu else None)) <= 1:
            self.metrics.misses.labels(kind, SPARED).inc()
            return None
        if runtime.gpu and action.limits.concurrency <= 1:  # (a concurrent action never takes one)
            self._learn_cap(kind, action, gpu_index)
        standby, reason = self._choose(kind, action, gpu_index if runtime.gpu else None)
        if standby is None:
            self.metrics.misses.labels(kind, reason).inc()
            self._spawn_refill(kind)
            return None
        self.standbys[kind].remove(standby)
        standby.state = "taken"
        self._update_gauges()
        self._spawn_refill(kind)
        return standby

    def _on_gpu(self, kind: str, gpu_index: int | None) -> list[Standby]:
        """The kind's pre-loaded containers a cold start on that GPU (None: any, or not a GPU kind) may take."""
        return [s for s in self.standbys.get(kind, [])
                if gpu_index is None or (s.gpu is not None and s.gpu.gpu_index == gpu_index)]

    def _choose(self, kind: str, action: Action, gpu_index: int | None) -> tuple[Standby | None, str]:
        """The container a cold start of ``action`` would take, or None and the reason of the miss."""
        items = self._on_gpu(kind, gpu_index)
        if action.limits.concurrency > 1:
            return None, "concurrent action"
        if not items:
            return None, "none available"
        caps: dict[int | None, int | None] = {}

        def fits(s: Standby) -> bool:
            have = s.mps_cap if s.gpu is not None else s.slot
            if have is None:
                return True
            index = s.gpu.gpu_index if s.gpu is not None else gpu_index
            if index not in caps:
                caps[index] = self._cap_now(action, index)
            return caps[index] == have

        def ranked(group: list[Standby]) -> list[Standby]:
            # a context made at the function's cap first: it is what pre-loading it was for
            fitting = [s for s in group if fits(s)]
            return sorted(fitting, key=lambda s: (s.mps_cap if s.gpu is not None else s.slot) is None)

        ready = [s for s in items if s.state == "ready"]
        usable = ranked(ready) or ranked([s for s in items if s.state in ("loading", "starting")])
        if usable:
            return usable[0], ""
        if any((s.mps_cap if s.gpu is not None else s.slot) is not None for s in items):
            return None, CAP_MISS
        return None, "none available"

    def _cap_now(self, action: Action, gpu_index: int | None) -> int | None:
        """The MPS thread cap (whole percent) the action's function gets on that GPU now (None: unknown, not
        under MPS, or invalid GPU annotations: then no container with a context made at a cap fits it)."""
        if self.mps_cap is None:
            return None
        try:
            needs = GpuNeeds.from_annotations(action.annotation_map)
            threads = self.mps_cap(action.fqn, needs, gpu_index)
        except (ValidationError, ValueError, KeyError):
            return None
        return active_thread_percentage(threads) if threads is not None else None

    def _learn_cap(self, kind: str, action: Action, gpu_index: int | None) -> None:
        """Record the cap this cold start of ``kind`` gets: on the GPU it was placed on, else on the GPU of
        the kind's first pre-loaded container (the GPU node's first MPS GPU when there is none)."""
        if self.mps_cap is None:
            return
        if gpu_index is None:
            gpu_index = next((s.gpu.gpu_index for s in self.standbys.get(kind, []) if s.gpu is not None), None)
        cap = self._cap_now(action, gpu_index)
        if cap is None:
            return
        self._caps[kind].append(cap)
        learnt = self.learnt_cap(kind)
        if learnt is not None and learnt != self._cap.get(kind):
            log.info("pre-loaded MPS clients of the kind make their CUDA context at a new thread cap", kind=kind,
                     mps_threads=learnt, was=self._cap.get(kind), cold_starts=len(self._caps[kind]))
            self._cap[kind] = learnt

    async def hand_over(self, standby: Standby, memory_mb: int) -> Taken | None:
        """Finish a take: wait for the container's pre-load (when it was still loading), stop draining its
        output and set the action's memory limit. None: it failed meanwhile (a plain cold start follows)."""
        task = standby.task
        waited = standby.container is None or standby.info.get("state") != "done"
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        container = standby.container
        if container is None or standby.info.get("state") != "done" or not container.alive:
            await self.lost(standby.kind, standby, "failed while handed over")
            return None
        await standby.stop_draining()
        set_limit = getattr(container, "set_memory_limit", None)
        if set_limit is not None:
            try:
                await set_limit(memory_mb)
            except Exception as exc:  # noqa: BLE001 - the action's limit cannot be applied: not usable
                log.warning("pre-loaded container refused the action's memory limit", container=standby.name,
                            error=repr(exc))
                await self.lost(standby.kind, standby, "memory limit not applicable")
                return None
        return Taken(standby=standby, container=container, kind=standby.kind,
                     modules=tuple(standby.info.get("modules") or ()), gpu=standby.gpu, gpu_key=standby.gpu_key,
                     waited_loading=waited)

    async def lost(self, kind: str, standby: Standby, reason: str) -> None:
        """A taken container turned out unusable for the cold start: a miss, and it is destroyed."""
        self.metrics.misses.labels(kind, reason).inc()
        self.metrics.discarded.labels(kind, reason).inc()
        log.info("pre-loaded container not usable; a plain cold start follows", container=standby.name,
                 reason=reason)
        await self._destroy(standby, reason)

    def hit(self, kind: str) -> None:
        self.metrics.hits.labels(kind).inc()

    def learn(self, kind: str, imports: Iterable[str]) -> None:
        """An action of ``kind`` imported these installed modules at /init."""
        if kind not in self.kinds or self.learn_limit <= 0:
            return
        counter = self._learnt[kind]
        before = self.modules_for(kind)
        for name in imports:
            # The report comes from the action's own process: only names of installed packages that this
            # node has in site-packages are believed (never the standard library, never the action's files).
            if isinstance(name, str) and name.isidentifier() and (not self._check or _installed_package(name)):
                counter[name] += 1
        # Bounded: keep the most frequent few times the limit, so an endless stream of names stays small.
        if len(counter) > 4 * self.learn_limit:
            self._learnt[kind] = collections.Counter(dict(counter.most_common(2 * self.learn_limit)))
        wanted = self.modules_for(kind)
        now = time.monotonic()
        if wanted != before and not self._closed and now >= self._restarted_at.get(kind, -math.inf) + RELEARN_MIN_S:
            # The replacement a cold start spawned when it took its container started before that start's
            # imports were learnt: a pre-loaded container without a module now wanted is started again,
            # so the next cold start of the kind finds it imported.
            lacking = [st for st in self.standbys[kind] if set(wanted) - set(st.modules)]
            for standby in lacking:
                self._discard(standby, "modules learnt since it started")
            if lacking:
                self._restarted_at[kind] = now
                log.info("pre-loaded containers restarted with learnt modules", kind=kind, modules=list(wanted),
                         restarted=len(lacking))
                self._spawn_refill(kind)

    # -- shedding and removal ------------------------------------------------------------------------

    def _would_take(self, action: Action) -> Standby | None:
        runtime = self.manifest.resolve(action.exec.kind)
        if runtime is None or runtime.kind not in self.kinds:
            return None
        return self._choose(runtime.kind, action, None)[0]

    def memory_for(self, action: Action) -> int:
        spared = self._would_take(action)
        return self.memory_in_use_mb - (spared.memory_mb if spared is not None else 0)

    def shed(self, need_mb: int, action: Action | None = None) -> int:
        """Remove pre-loaded containers (those still loading first; never the one ``action``'s cold start
        is about to take) until ``need_mb`` is freed or none is left; returns what was freed (MB). Called
        when an action needs the memory."""
        freed = 0
        spared = self._would_take(action) if action is not None else None
        candidates = sorted((s for items in self.standbys.values() for s in items if s is not spared),
                            key=lambda s: (s.state == "ready", -s.since))
        for standby in candidates:
            if freed >= need_mb:
                break
            freed += standby.memory_mb
            self._discard(standby, "memory needed by an action")
        return freed

    def _discard(self, standby: Standby, reason: str) -> None:
        items = self.standbys.get(standby.kind, [])
        if standby in items:
            items.remove(standby)
        if standby.state != "removed":
            standby.state = "removed"
            self.metrics.discarded.labels(standby.kind, reason).inc()
            log.debug("pre-loaded container discarded", container=standby.name, reason=reason)
            self._spawn(self._destroy(standby, reason))
        self._update_gauges()

    async def _destroy(self, standby: Standby, reason: str) -> None:
        standby.state = "removed"
        task = standby.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await standby.stop_draining()
        if standby.container is not None:
            await standby.container.destroy()
        if standby.gpu_key is not None and self._detach_gpu is not None:
            with contextlib.suppress(Exception):
                await self._detach_gpu(standby.gpu_key)
            standby.gpu_key = None

    def _spawn_refill(self, kind: str) -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(self.refill, kind)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        self._closed = True
        for standby in [s for items in self.standbys.values() for s in items]:
            self._discard(standby, "invoker shutting down")
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class _Skip(Exception):
    pass


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _installed_package(name: str) -> bool:
    """``name`` is a top-level module of an installed package (its file lies in a site-packages dir)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or ())
    return bool(places) and all(os.path.realpath(p).startswith(installed_roots()) for p in places if p)


def _percent(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "" for c in text)[:32] or "x"
