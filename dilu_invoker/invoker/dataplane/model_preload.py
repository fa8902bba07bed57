"""Model pre-loading (Tyche's opportunistic pre-loading): a GPU function that declares its read-only weights
(``gpu-weights-mb``) gets its model loaded on a GPU of this invoker ahead of its first request.

When such an action is created or updated (standalone's REST API tells `ModelPreloads`; in a cluster the
balancer's ``preload`` command does, openwhisk/preload_commands.py), after a short
debounce and in the background, one invoker starts one instance of it on the GPU with the most idle room —
room its budget in Redis does not hold for anything, kept weights included: nothing is evicted for a
pre-load, and without such room (or host memory for its process) it is skipped. /init runs the action's
module-level code, so its ``models.load`` builds the model and becomes the weights' holder; the instance then
goes straight to staged exit (keep.py): its compute is released, its process stays with the weights alone in
the GPU budget, marked kept. The balancer places the function's first instance beside them (the sharing
tier) and that instance maps the weights instead of loading them, as a function woken after a scale-in does.
(A first request that came during the pre-load may map it already: the pre-load then stays an idle instance
until that one has gone, and is kept as the last of its group.)

A pre-loaded model is held until its GPU room or host memory is needed (kept weights are evicted and shed
first, keep.py), the action is updated (a new revision's pre-load replaces it) or deleted, or the invoker
stops; once an instance of the function has run beside it, it is ordinary kept weights and goes when
``--invoker-weights-grace-s`` has passed with no instance there. ``--invoker-model-preload-mb`` caps the
GPU memory (declared weights) one invoker holds in pre-loads (0: off). A failed pre-load (its /init raised,
no room) is logged and counted; it never fails the request that stored the action nor its invocations (a
later cold start just loads the model itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import structlog
from prometheus_client import Counter, Gauge

from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.invoker.dataplane.container import State
from dilu_invoker.invoker.dataplane.core import Invoker
from dilu_invoker.invoker.dataplane.keep import Group, group_of
from dilu_invoker.model import Action, GpuNeeds, ValidationError

log = structlog.get_logger(__name__)

#: a change of the action within this after the previous one replaces the pending pre-load (``wsk action
#: update`` twice in a row loads once)
DEBOUNCE_S = 0.5
#: how long the hand-over of a loaded instance to staged exit may take
HAND_OVER_S = 30.0
#: how long closing waits for pre-loads whose containers it removed to end
CLOSE_WAIT_S = 3.0
#: how often a loaded instance whose function started an instance beside it looks whether that one has gone
DEFER_CHECK_S = 0.25

RoomFn = Callable[[], Awaitable[Mapping[int, int]]]
"""GPU index → idle GPU memory (MB) of this invoker's GPUs, as their budgets show it."""


class Phase(Enum):
    LOADING = "loading"
    READY = "ready"
    GONE = "gone"


@dataclass(eq=False, slots=True)
class Preload:
    action: Action
    instance: str
    weights_mb: int
    phase: Phase = Phase.LOADING
    container: str | None = None
    """The kept process's container name once ready (`WeightsKeeper.kept`'s key)."""
    released: str | None = None
    """Why it is to go (the action changed or was deleted), set while it still loads."""
    since: float = 0.0


NO_MODEL = ("its /init loaded no model through models.load (declare it at module level for it to be "
            "pre-loaded)")


def runs_here(invoker: Invoker, action: Action) -> bool:
    """Whether ``invoker`` has a container of ``action``'s revision (not one being removed)."""
    return any(c.action.fqn == action.fqn and c.key.revision == (action.revision or "")
               and c.state not in (State.REMOVING, State.REMOVED) for c in invoker.pool.containers.values())


def declared_weights_mb(action: Action) -> int:
    """The action's ``gpu-weights-mb`` (0: none, or annotations that do not parse)."""
    try:
        return GpuNeeds.from_annotations(action.annotation_map).weights_mb
    except ValidationError:
        return 0


def budget_room(budgets: GpuBudgets, devices: Sequence[GpuDevice]) -> RoomFn:
    """A `RoomFn` reading ``budgets`` for ``devices``: capacity minus every reservation, kept weights
    included (a GPU Redis does not know is left out)."""

    async def room() -> dict[int, int]:
        out: dict[int, int] = {}
        for d in devices:
            budget = await budgets.get(d.uuid)
            if budget is not None:
                out[d.index] = budget.capacity.memory_mb - budget.sum_memory_mb
        return out

    return room


class ModelPreloadMetrics:
    def __init__(self, preloader: ModelPreloader) -> None:
        registry = preloader.invoker.metrics.registry
        self.events = Counter("dilu_invoker_model_preloads", "Model pre-loads ahead of a function's first "
                              "request: started, ready (its weights held on a GPU), failed (its /init failed "
                              "or its weights could not be kept), no_model (its /init loaded no model: it loads "
                              "on its first call), skipped (no idle GPU room, no host memory, "
                              "over --invoker-model-preload-mb), released (the action changed or was deleted)",
                              ("event",), registry=registry)
        # Read at scrape time (maybe off the event loop): these only read.
        held = Gauge("dilu_invoker_model_preloads_held", "Pre-loaded models held on this invoker's GPUs",
                     registry=registry)
        held.set_function(lambda: float(sum(1 for p in preloader.live() if p.phase is Phase.READY)))
        memory = Gauge("dilu_invoker_model_preload_memory_mb", "GPU memory (declared weights) held by pre-loaded "
                       "models, those still loading included", registry=registry)
        memory.set_function(lambda: float(sum(p.weights_mb for p in preloader.live())))


class ModelPreloader:
    """The pre-loads of one invoker (one per action at most)."""

    def __init__(self, invoker: Invoker, *, cap_mb: int, room: RoomFn | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.invoker = invoker
        self.cap_mb = cap_mb
        self._room = room
        self._clock = clock
        self.preloads: dict[str, Preload] = {}  # instance id -> pre-load (loading or ready)
        self._closed = False
        self.metrics = ModelPreloadMetrics(self)
        self.why_off = self._why_off()
        if cap_mb > 0 and self.why_off:
            log.info("model pre-loading off on this invoker", invoker=invoker.name, reason=self.why_off)

    def _why_off(self) -> str:
        inv = self.invoker
        if self.cap_mb <= 0:
            return "--invoker-model-preload-mb is 0"
        if inv.keeper is None:
            return "staged exit is off (--invoker-weights-grace-s 0, or no GPU node that keeps weights)"
        if not getattr(inv.gpu, "has_gpus", False):
            return "no GPU on this node"
        if inv.backend.name != "process":
            return "the models API shares weights only under the process backend"
        return ""

    @property
    def enabled(self) -> bool:
        return not self.why_off and not self._closed

    def wants(self, action: Action) -> bool:
        """An action of a GPU kind that declares weights."""
        runtime = self.invoker.runtime_for(action)
        return runtime is not None and runtime.gpu and declared_weights_mb(action) > 0

    # -- what is held --------------------------------------------------------------------------------

    def _is_live(self, p: Preload) -> bool:
        """Loading, or ready with its kept process still there (it goes when evicted, shed or expired)."""
        if p.phase is Phase.LOADING:
            return True
        if p.phase is not Phase.READY:
            return False
        keeper = self.invoker.keeper
        k = keeper.kept.get(p.container or "") if keeper is not None else None
        return k is not None and not k.gone

    def live(self) -> list[Preload]:
        """What holds (or is about to hold) GPU memory: pre-loads loading and ready ones still kept."""
        return [p for p in list(self.preloads.values()) if self._is_live(p)]

    def held(self) -> list[Preload]:
        """The ready pre-loads; forgets those staged exit let go meanwhile."""
        for iid, p in list(self.preloads.items()):
            if not self._is_live(p):
                del self.preloads[iid]
                if p.phase is Phase.READY:
                    p.phase = Phase.GONE
                    log.info("pre-loaded model let go by staged exit", action=p.action.fqn, container=p.container,
                             held_s=round(self._clock() - p.since, 1))
        return [p for p in self.preloads.values() if p.phase is Phase.READY]

    @property
    def memory_held_mb(self) -> int:
        self.held()
        return sum(p.weights_mb for p in self.preloads.values())

    def holding(self, fqn: str) -> Preload | None:
        """The ready pre-load of action ``fqn``, if one is held."""
        return next((p for p in self.held() if p.action.fqn == fqn), None)

    # -- loading ---------------------------------------------------------------------------------------

    async def _why_not(self, action: Action, weights_mb: int, prefer: int | None = None) -> tuple[str, int | None]:
        """Why it cannot be pre-loaded here now ('' when it can), and the GPU to put it on (``prefer`` when it
        has the room)."""
        if not self.enabled:
            return self.why_off or "closed", None
        if not self.invoker.enabled:
            return "the invoker is disabled", None
        if runs_here(self.invoker, action):
            return "the function already runs here (its instances hold their weights)", None
        if self.memory_held_mb + weights_mb > self.cap_mb:
            return f"over --invoker-model-preload-mb ({self.memory_held_mb} + {weights_mb} > {self.cap_mb} MB)", None
        pool = self.invoker.pool
        reserves = sum(r.memory_in_use_mb for r in (self.invoker.keeper, self.invoker.preload) if r is not None)
        free = pool.user_memory_mb - pool.memory_in_use_mb - reserves
        if free < action.limits.memory_mb:
            return f"no idle host memory ({free} MB free, {action.limits.memory_mb} MB needed)", None
        if self._room is None:
            return "", None
        try:
            needs = GpuNeeds.from_annotations(action.annotation_map)
            room = await self._room()
        except Exception as exc:  # noqa: BLE001 - no view of the room: the node's own admission decides
            log.info("GPU room not readable; the node places the pre-load", error=repr(exc))
            return "", None
        fits = sorted(((free_mb, -index) for index, free_mb in room.items() if free_mb >= needs.memory_mb),
                      reverse=True)
        if not fits:
            return (f"no GPU has {needs.memory_mb} MB of idle room (free: "
                    f"{', '.join(f'GPU {i}: {m} MB' for i, m in sorted(room.items())) or 'none'})"), None
        if prefer is not None and room.get(prefer, -1) >= needs.memory_mb:
            return "", prefer
        return "", -fits[0][1]

    async def load(self, action: Action, *, gpu_index: int | None = None) -> str:
        """Pre-load ``action`` here (on GPU ``gpu_index`` when it has the room, as the cluster's balancer
        chose): '' when its weights are held now, else why not ('no room: …' when another invoker may have
        room)."""
        weights_mb = declared_weights_mb(action)
        why, gpu_index = await self._why_not(action, weights_mb, gpu_index)
        if why:
            self.metrics.events.labels("skipped").inc()
            log.info("model pre-load skipped", action=action.fqn, revision=action.revision, invoker=self.invoker.name,
                     reason=why)
            return f"no room: {why}"
        p = Preload(action=action, instance=f"model-{secrets.token_hex(6)}", weights_mb=weights_mb,
                    since=self._clock())
        self.release(action.fqn, "replaced")
        self.preloads[p.instance] = p
        self.metrics.events.labels("started").inc()
        log.info("model pre-load started", action=action.fqn, revision=action.revision, instance=p.instance,
                 invoker=self.invoker.name, gpu=gpu_index, weights_mb=weights_mb)
        try:
            failure = await self._load(p, gpu_index)
        except Exception as exc:  # a pre-load never fails anything else
            log.exception("model pre-load failed inside the invoker", action=action.fqn)
            failure = repr(exc)
        if failure:
            p.phase = Phase.GONE
            self.preloads.pop(p.instance, None)
            if self._closed:
                log.info("model pre-load stopped: the invoker stops", action=action.fqn, instance=p.instance)
                return failure
            no_model = failure == NO_MODEL
            self.metrics.events.labels("no_model" if no_model else "failed").inc()
            (log.info if no_model else log.warning)("model pre-load failed", action=action.fqn,
                                                    revision=action.revision, instance=p.instance, error=failure)
            return failure
        self.metrics.events.labels("ready").inc()
        log.info("model pre-loaded: weights held on the GPU", action=action.fqn, revision=action.revision,
                 container=p.container, weights_mb=weights_mb, load_s=round(self._clock() - p.since, 3))
        if p.released is not None:  # the action changed or went while it loaded
            self.preloads.pop(p.instance, None)
            self._let_go(p, p.released)
        return ""

    async def _load(self, p: Preload, gpu_index: int | None) -> str:
        inv = self.invoker
        name, failure = await inv.start_instance(p.instance, p.action, gpu_index=gpu_index, idle_room_only=True)
        if failure is not None or name is None:
            if name is not None:
                await self._removed(name)  # what it reserved is back when the failure is counted
            error = failure.result if failure is not None else "no container"
            return f"the instance did not start: {error}"
        proxy = inv.pool.containers.get(name)
        if proxy is None or proxy.state in (State.REMOVING, State.REMOVED):
            await self._removed(name)
            return "the instance went away before its hand-over"
        if proxy.placement.gpu is None:
            inv.stop_instance(name, "model pre-load without a GPU")
            await self._removed(name)
            return "the instance got no GPU"
        # Only a process that holds a model is worth keeping: code that loads it on its first call instead of
        # at module level left nothing on the GPU (nor a process that mapped another instance's copy). The
        # runtime says which models /init left its process holding (/health "models").
        health = await inv.runtime_health(proxy.container) if proxy.container is not None else None
        held = health.get("models") if health is not None else None
        if not held:
            inv.pool.remove(proxy, "model pre-load holds no model")
            await self._removed(name)
            return NO_MODEL if isinstance(held, list) else "the runtime does not say which models it holds"
        # Straight to staged exit: compute released, the weights kept (keep.py) — unless the function's first
        # instance started beside it meanwhile and may map from it: then it stays (idle, pinned: no activation
        # reaches it) until that one has gone and it is the last of its group, which staged exit keeps, or
        # until the pool's idle timeout removes it.
        group = group_of(proxy)
        while (group is not None and self._others(group, name) and name in inv.pool.containers
               and p.released is None and not self._closed):
            await asyncio.sleep(DEFER_CHECK_S)
        if name in inv.pool.containers:
            inv.stop_instance(name, "model pre-loaded")
        if not await self._removed(name):
            return "the hand-over to staged exit did not finish"
        keeper = inv.keeper
        k = keeper.kept.get(name) if keeper is not None else None
        if k is None or k.gone:
            return "its weights could not be kept (the GPU budget refused them, or it was removed meanwhile)"
        # Held until its room is needed, the action changes or the invoker stops; once an instance has run
        # beside it, the keeper's grace applies (it restarts the clock while instances are there).
        k.until = math.inf
        p.container = name
        p.phase = Phase.READY
        return ""

    def _others(self, group: Group, name: str) -> int:
        """Live containers of ``group`` (the function revision on that GPU) other than ``name``."""
        return sum(1 for c in self.invoker.pool.containers.values() if c.name != name and group_of(c) == group
                   and c.state not in (State.REMOVING, State.REMOVED))

    async def _removed(self, name: str) -> bool:
        """Wait until the pool has finished removing container ``name`` (kept or destroyed); False: not in time."""
        deadline = self._clock() + HAND_OVER_S
        while name in self.invoker.pool.containers:
            if self._clock() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    # -- letting go ------------------------------------------------------------------------------------

    def release(self, fqn: str, why: str) -> None:
        """The action ``fqn`` changed or was deleted: its pre-load goes (at once, or once it has loaded: until
        then it still counts against the cap)."""
        for p in [p for p in self.preloads.values() if p.action.fqn == fqn]:
            if p.phase is Phase.LOADING:
                p.released = why
                continue
            del self.preloads[p.instance]
            self._let_go(p, why)

    def _let_go(self, p: Preload, why: str) -> None:
        was = p.phase
        p.phase = Phase.GONE
        keeper = self.invoker.keeper
        k = keeper.kept.get(p.container or "") if keeper is not None else None
        if k is None or k.gone or was is Phase.GONE:
            return
        self.metrics.events.labels("released").inc()
        log.info("pre-loaded model released", action=p.action.fqn, revision=p.action.revision, reason=why)
        # Through the keeper's own expiry: instances of that revision still running keep it while they live.
        k.until = -math.inf
        assert keeper is not None
        keeper.check()

    def close(self) -> None:
        """Take no more; a pre-load still loading loses its container (its load then ends as failed)."""
        self._closed = True
        loading = {f"instance:{p.instance}" for p in self.preloads.values() if p.phase is Phase.LOADING}
        for proxy in list(self.invoker.pool.containers.values()):
            if proxy.key.namespace in loading:
                self.invoker.pool.remove(proxy, "invoker shutting down")


class ModelPreloads:
    """The standalone REST API's listener (``rest_actions.ActionListener``): an action stored or deleted
    there is pre-loaded on, or released from, this standalone's invokers."""

    def __init__(self, preloaders: Sequence[ModelPreloader], *, debounce_s: float = DEBOUNCE_S) -> None:
        self.preloaders = tuple(preloaders)
        self.debounce_s = debounce_s
        self._waiting: dict[str, asyncio.Task[None]] = {}  # fqn -> its debounce (cancelled by a change)
        self._loading: dict[str, asyncio.Task[None]] = {}  # fqn -> its load (never cancelled half way)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return any(p.enabled for p in self.preloaders)

    def stored(self, action: Action, *, gpu_index: int | None = None) -> None:
        """``gpu_index``: the GPU to load it on where it has the room (a cluster balancer's choice)."""
        self._forget(action.fqn, "replaced")
        if not any(p.enabled and p.wants(action) for p in self.preloaders):
            return
        task = asyncio.ensure_future(self._later(action, gpu_index))
        self._waiting[action.fqn] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def deleted(self, action: Action) -> None:
        self._forget(action.fqn, "deleted")

    def released(self, fqn: str, why: str) -> None:
        """The pre-load of action ``fqn`` goes, whatever its revision (a cluster balancer's ``release``)."""
        self._forget(fqn, why)

    def _forget(self, fqn: str, why: str) -> None:
        waiting = self._waiting.pop(fqn, None)
        if waiting is not None:
            waiting.cancel()
        for p in self.preloaders:
            p.release(fqn, why)

    def _order(self, fqn: str) -> list[ModelPreloader]:
        """The invokers to try, starting at one chosen by the action's name (spreads pre-loads)."""
        ready = [p for p in self.preloaders if p.enabled]
        if not ready:
            return []
        start = zlib.crc32(fqn.encode()) % len(ready)
        return ready[start:] + ready[:start]

    async def _later(self, action: Action, gpu_index: int | None = None) -> None:
        fqn = action.fqn
        await asyncio.sleep(self.debounce_s)
        previous = self._loading.get(fqn)
        if previous is not None:  # an earlier revision still loads: one load of an action at a time
            with contextlib.suppress(Exception):
                await asyncio.shield(previous)
        if self._waiting.get(fqn) is not asyncio.current_task():
            return
        del self._waiting[fqn]
        load = asyncio.ensure_future(self._load(action, gpu_index))
        self._loading[fqn] = load
        try:
            await asyncio.shield(load)
        finally:
            if self._loading.get(fqn) is load:
                del self._loading[fqn]

    async def _load(self, action: Action, gpu_index: int | None = None) -> None:
        if any(runs_here(p.invoker, action) for p in self.preloaders):
            log.info("model pre-load skipped: the function already runs", action=action.fqn)
            return
        for preloader in self._order(action.fqn):
            outcome = await preloader.load(action, gpu_index=gpu_index)
            if not outcome.startswith("no room: "):
                return

    async def close(self) -> None:
        """Stop pre-loading (before the invokers close: what is held goes with their keepers)."""
        for waiting in self._waiting.values():
            waiting.cancel()
        for p in self.preloaders:
            p.close()
        tasks = list(self._tasks) + list(self._loading.values())
        if tasks:  # the loads end once their containers are gone; what does not in time is cancelled
            _, late = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._waiting.clear()
        self._loading.clear()
