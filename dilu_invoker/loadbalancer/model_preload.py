"""Model pre-loading in cluster mode, the balancer's half: when OpenWhisk's controller creates or updates a
GPU action that declares ``gpu-weights-mb`` (it writes the action document to CouchDB; no invoker sees the
``PUT``), the leader picks the invoker its first instance would be placed on and tells that invoker to load
the model ahead of the first request (docs/balancer.md, "Model pre-loading in cluster mode").

What it follows is any source of :class:`ActionEvent` (in a cluster, the whisks database's ``_changes``
feed, ``openwhisk/changes.py``; the composition root wires them, this package never reads CouchDB). Per
action, changes within ``debounce_s`` (0.5 s, as in standalone) collapse into the last one — the controller
writes a document, then its code attachment, as two revisions. Then, while this balancer leads:

* a GPU action declaring weights: :func:`place_first` — the placement the tick would make for the
  function's first instance (invoker user memory, then the sharing tier, then the strategy), on the
  cluster as the budgets show it now, kept weights included (a pre-load uses idle room only) — names the
  invoker and GPU; a ``preload`` command (``wire.CommandOp.PRELOAD``: ``function``, ``rev``, ``gpu``,
  ``gpu_uuid``, ``memory_mb``, ``boot``, ``reason``) goes on that invoker's command stream and a
  ``release`` (reason ``replaced``) on every other live invoker's, in one fenced write; the first
  instance is then placed beside the weights (the sharing tier), which is where the routers send the
  first activation;
* a deleted action, a GPU action that declares no weights (any more), or one that no longer reads:
  ``release`` (reason ``deleted``/``no weights declared``) on every live invoker's stream; an action no
  longer of a GPU kind, when this leader had it pre-loaded.

The invoker runs the same ``ModelPreloader`` as standalone, with its cap and its checks (idle GPU room and
host memory); nothing here reserves GPU memory. A standby writes nothing: it remembers the latest change of
each GPU action (or deletion) it saw and handles them once it leads, so a failover loses none.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import RedisError

from dilu_invoker.loadbalancer.lease import Leadership, Ops
from dilu_invoker.loadbalancer.planner import instance_id, place_new, placement_request, shares_weights, user_memory_fits
from dilu_invoker.model import Action, ValidationError
from dilu_invoker.policy import ClusterSnapshot, PlacementConfig
from dilu_invoker.wire import CommandOp, FunctionSpec, InstanceCommand, InstanceRecord, LoadReport, pack

if TYPE_CHECKING:
    from dilu_invoker.loadbalancer.service import Balancer

log = structlog.get_logger(__name__)

#: changes of one action within this collapse into the last one
DEBOUNCE_S = 0.5
#: the latest change of at most this many actions is remembered while this balancer does not lead, for when
#: it does (the oldest forgotten first)
MAX_UNHANDLED = 1024
#: how often a balancer that remembers such changes checks whether it leads now
CATCH_UP_S = 1.0
COMMAND_STREAM_MAXLEN = 1000


class ActionEvent(Protocol):
    """What the balancer needs of a change of an action (``openwhisk.changes.ActionChange`` is one)."""

    @property
    def fqn(self) -> str: ...

    @property
    def rev(self) -> str: ...

    @property
    def action(self) -> Action | None:
        """The action (its code not needed); None: deleted."""

    @property
    def gpu(self) -> bool:
        """Whether its kind is a GPU kind."""


ActionFeed = Callable[[asyncio.Event], AsyncIterator[ActionEvent]]
"""``feed(stop)``: the changes from now on, until ``stop`` is set; it never raises for its source's faults."""


def place_first(cluster: ClusterSnapshot, spec: FunctionSpec, *, reports: Mapping[str, LoadReport],
                records: Mapping[str, InstanceRecord], config: PlacementConfig) -> tuple[str, int, str | None, str]:
    """Where the tick would place the function's first instance now: (invoker, GPU index, GPU uuid, the
    placement's reason), or ("", -1, None, why not)."""
    request = placement_request(spec, instance_id(spec.fqn, 0, 0))
    fits, short = user_memory_fits(cluster, spec, reports, records)
    if fits is None:
        return "", -1, None, short
    where = place_new(fits, spec, request, config)
    if not where.placed:
        return "", -1, None, where.reason
    ref = where.gpus[0]
    return ref.invoker, ref.gpu, cluster.gpu(ref).uuid or None, where.reason


class PreloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.changes = Counter("dilu_balancer_action_changes", "Action documents changed in the whisks database, as "
                               "the balancer's changes feed saw them", registry=registry)
        self.commands = Counter("dilu_balancer_model_preloads", "Model pre-loads the leader asked for: sent (a "
                                "preload command to the chosen invoker), released (an action deleted or no longer "
                                "declaring weights), no_room (no GPU takes its first instance), invalid (bad GPU "
                                "annotations), not_leading (a change no balancer acted on)",
                                ("outcome",), registry=registry)


class ModelPreloadFollower:
    """Follows ``feed`` and turns its changes into ``preload``/``release`` commands while ``balancer`` leads."""

    def __init__(self, balancer: Balancer, feed: ActionFeed, *, debounce_s: float = DEBOUNCE_S) -> None:
        self.balancer = balancer
        self.feed = feed
        self.debounce_s = debounce_s
        self.metrics = PreloadMetrics(balancer.metrics.registry)
        #: fqn -> the invoker last told to pre-load it (a later change releases it elsewhere)
        self.sent: dict[str, str] = {}
        self._pending: dict[str, asyncio.Task[None]] = {}  # fqn -> its change, waiting or being handled
        self._debouncing: set[asyncio.Task[None]] = set()  # those still in their debounce (cancelled by a change)
        # One change handled at a time: a later change of an action never overtakes an earlier one half way.
        self._handling = asyncio.Lock()
        self.handled = 0
        #: fqn -> its latest change seen while no balancer of ours led (handled once this one leads: a
        #: failover loses no pre-load; the leader of the time may have handled it already, and a repeat is
        #: harmless: an invoker holding that revision does not load it again)
        self.unhandled: OrderedDict[str, ActionEvent] = OrderedDict()

    async def run(self) -> None:
        """Until cancelled; a fault in handling one change never stops the feed, nor one of the feed the
        balancer (it is followed again a second later)."""
        stop = asyncio.Event()
        catch_up = asyncio.create_task(self._catch_up(), name="balancer-model-preload-catch-up")
        try:
            while True:
                try:
                    async for event in self.feed(stop):
                        self.metrics.changes.inc()
                        self.changed(event)
                except Exception:  # the balancer goes on placing; the feed is followed again
                    log.exception("the balancer's action feed failed; following it again")
                await asyncio.sleep(1.0)
        finally:
            stop.set()
            catch_up.cancel()
            tasks = [catch_up, *self._pending.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _catch_up(self) -> None:
        """Once this balancer leads, the changes it remembered while it did not are handled."""
        while True:
            await asyncio.sleep(CATCH_UP_S)
            if self.unhandled and self.balancer.leading is not None:
                events = list(self.unhandled.values())
                self.unhandled.clear()
                log.info("balancer model pre-load: handling the changes seen while not leading", count=len(events))
                for event in events:
                    if event.fqn not in self._pending:  # a newer change of it is on its way already
                        self.changed(event)

    def _remember(self, event: ActionEvent) -> None:
        self.unhandled[event.fqn] = event
        self.unhandled.move_to_end(event.fqn)
        while len(self.unhandled) > MAX_UNHANDLED:
            self.unhandled.popitem(last=False)

    def changed(self, event: ActionEvent) -> None:
        self.unhandled.pop(event.fqn, None)
        previous = self._pending.pop(event.fqn, None)
        if previous is not None and previous in self._debouncing:
            previous.cancel()  # a change being handled finishes; this one comes after it
        task = asyncio.ensure_future(self._later(event))
        self._debouncing.add(task)
        self._pending[event.fqn] = task
        task.add_done_callback(partial(self._done, event.fqn))

    def _done(self, fqn: str, task: asyncio.Task[None]) -> None:
        self._debouncing.discard(task)  # one cancelled before it ran
        if self._pending.get(fqn) is task:
            del self._pending[fqn]
        if not task.cancelled() and task.exception() is not None:
            log.error("model pre-load of a changed action failed in the balancer", action=fqn,
                      error=repr(task.exception()))

    async def _later(self, event: ActionEvent) -> None:
        try:
            await asyncio.sleep(self.debounce_s)
        finally:
            self._debouncing.discard(asyncio.current_task())
        try:
            async with self._handling:
                outcome = await self.handle(event)
        except RedisError as exc:
            outcome = f"redis: {exc}"
            log.warning("model pre-load not sent: Redis", action=event.fqn, error=str(exc))
        self.handled += 1
        log.info("balancer model pre-load", action=event.fqn, rev=event.rev, outcome=outcome)

    async def handle(self, event: ActionEvent) -> str:
        """Carry out one (debounced) change; returns what was done."""
        b = self.balancer
        lead = b.leading
        if lead is None:
            self.metrics.commands.labels("not_leading").inc()
            if event.action is None or event.gpu:
                self._remember(event)
            return "not leading (remembered for when this balancer leads)"
        action = event.action
        if action is None:
            return await self._release_all(lead, event.fqn, "deleted")
        if not event.gpu:
            if event.fqn in self.sent:
                return await self._release_all(lead, event.fqn, "no longer a GPU action")
            return "not a GPU action"
        try:
            spec = FunctionSpec.of(action)
        except ValidationError as exc:
            self.metrics.commands.labels("invalid").inc()
            return f"invalid GPU annotations: {exc}"
        if not shares_weights(spec):
            # Told to every invoker (not only the one this leader told): a predecessor may have sent it.
            return await self._release_all(lead, event.fqn, "no weights declared")
        reports, invoker, gpu, uuid, reason = await b.first_placement(spec)
        if not invoker:
            self.metrics.commands.labels("no_room").inc()
            ops = self._releases(lead.epoch, event.fqn, "replaced", reports, keep="")
            if ops.count:
                await b.lease.apply(lead, ops)
            self.sent.pop(event.fqn, None)
            return f"no room: {reason}"
        ops = self._releases(lead.epoch, event.fqn, "replaced", reports, keep=invoker)
        report = reports.get(invoker)
        ops.xadd(b.keys.commands(invoker), pack(InstanceCommand(
            op=CommandOp.PRELOAD.value, epoch=lead.epoch, instance="", function=spec.fqn, rev=spec.rev, gpu=gpu,
            gpu_uuid=uuid, cls=spec.cls, request=spec.request, limit=spec.limit, memory_mb=spec.memory_mb,
            boot=report.boot if report is not None else "", reason=reason)), maxlen=COMMAND_STREAM_MAXLEN)
        if not await b.lease.apply(lead, ops):
            self.metrics.commands.labels("not_leading").inc()
            self._remember(event)
            return "lost the lease"
        self.sent[event.fqn] = invoker
        self.metrics.commands.labels("sent").inc()
        return f"preload on {invoker} GPU {gpu}: {reason}"

    def _releases(self, epoch: int, fqn: str, why: str, reports: Mapping[str, LoadReport], *, keep: str) -> Ops:
        ops = Ops()
        for name, report in sorted(reports.items()):
            if name != keep:
                ops.xadd(self.balancer.keys.commands(name), pack(InstanceCommand(
                    op=CommandOp.RELEASE.value, epoch=epoch, instance="", function=fqn, boot=report.boot,
                    reason=why)), maxlen=COMMAND_STREAM_MAXLEN)
        return ops

    async def _release_all(self, lead: Leadership, fqn: str, why: str) -> str:
        b = self.balancer
        reports = await b.read_reports()
        ops = self._releases(lead.epoch, fqn, why, reports, keep="")
        self.sent.pop(fqn, None)
        if ops.count and not await b.lease.apply(lead, ops):
            return "lost the lease"
        self.metrics.commands.labels("released").inc()
        return f"released ({why}) on {len(reports)} invoker(s)"


@contextlib.asynccontextmanager
async def following(balancer: Balancer, feed: ActionFeed | None) -> AsyncIterator[ModelPreloadFollower | None]:
    """Follow ``feed`` for the block (nothing without one)."""
    if feed is None:
        yield None
        return
    follower = ModelPreloadFollower(balancer, feed)
    task = asyncio.create_task(follower.run(), name="balancer-model-preload")
    try:
        yield follower
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
