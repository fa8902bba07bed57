"""The OpenWhisk cluster front of an invoker: ``invoker{N}`` in, acks and pings out, CouchDB on the side.

Per record taken from ``invoker{N}`` (``InvokerReactive`` + ``ContainerProxy`` + ``MessagingActiveAck``,
``reference/openwhisk.md`` §1.4, §2.2):

1. parse; unreadable → a whisk-error ack when the activation id is known, else counted and skipped;
2. drop duplicates (the same activation id in work or recently finished; after a restart, one already
   recorded in the activations database);
3. the controller's health test action is answered here, without a container;
4. fetch the action (by revision, cached); fetch errors become the fallback record and a combined ack;
5. run it through the router (normally this node's invoker core);
6. send the acks the Scala invoker would send, in its order, echoing ``transid``; shrink on overflow;
7. store the record unless the user turned storing off;
8. only then mark the record's offset finished; offsets are committed up to the oldest unfinished one.

At most ``max_peek`` activations are taken at once (the pool's capacity), so a slow invoker leaves work
in its topic instead of hoarding it. A ping goes to ``health`` every second while the invoker is enabled,
Kafka takes our sends and CouchDB answers; otherwise the pings stop and the controller stops sending.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

import structlog
from aiokafka import ConsumerRecord, TopicPartition

from dilu_invoker.invoker.api import MSG_ABNORMAL_RUN, InvokerOverloaded
from dilu_invoker.model import Activation, ActivationRequest, ActivationResponse
from dilu_invoker.openwhisk.backoff import Backoff
from dilu_invoker.openwhisk.couchdb import (
    ActionFetchError,
    ActionStore,
    ActivationStore,
    CouchClient,
    CouchError,
)
from dilu_invoker.openwhisk.kafka import (
    KafkaBus,
    KafkaUnavailable,
    OffsetTracker,
    RecordTooLarge,
    TopicConsumer,
    Topics,
    retry_until_sent,
)
from dilu_invoker.openwhisk.messages import (
    UNKNOWN_TRANSID,
    Ack,
    ActivationMessage,
    InvokerInstance,
    MalformedMessage,
    acks_after_run,
    acks_without_container,
    activation_event,
    dumps,
    fallback_activation,
    fallback_for,
    health_test_activation,
    ping_message,
)
from dilu_invoker.openwhisk.routing import GpuImages, Router, gpu_image_action

log = structlog.get_logger(__name__)

_DEFAULT_TOPICS = Topics()
_NO_GPU_IMAGES = GpuImages()
_ACK_BACKOFF = Backoff(initial_s=0.05, maximum_s=2.0)

#: ``Messages.abnormalRun``: what OpenWhisk says when the platform failed while running an action.
ABNORMAL_RUN = MSG_ABNORMAL_RUN


class EnabledControl(Protocol):
    """The ``/enable``, ``/disable`` switch of the invoker's HTTP server."""

    @property
    def enabled(self) -> bool: ...

    def on_enabled_change(self, callback: Callable[[bool], None]) -> None: ...


@dataclass(frozen=True, slots=True)
class FrontOptions:
    instance: InvokerInstance
    topics: Topics = _DEFAULT_TOPICS
    #: activations taken at once (OpenWhisk's maxPeek: userMemory / 128 MB)
    max_peek: int = 16
    fetch_max_wait_ms: int = 20
    user_events: bool = False
    gpu: GpuImages = _NO_GPU_IMAGES
    ping_interval_s: float = 1.0
    drain_timeout_s: float = 30.0
    #: activation ids remembered after they finished, to drop redeliveries
    remember_done: int = 20_000
    ack_backoff: Backoff = _ACK_BACKOFF

    def __post_init__(self) -> None:
        if self.max_peek < 1:
            raise ValueError("max_peek must be at least 1")

    @property
    def max_unfinished(self) -> int:
        """Taken records whose acks or records are still being written (bounds memory while the
        database is away)."""
        return max(4 * self.max_peek, 64)


@dataclass(slots=True)
class FrontStats:
    assignments: int = 0
    received: int = 0
    activations: int = 0
    health_tests: int = 0
    fetch_errors: int = 0
    malformed_acked: int = 0
    malformed_skipped: int = 0
    duplicates: int = 0
    already_recorded: int = 0
    acks_sent: int = 0
    acks_shrunk: int = 0
    events_sent: int = 0
    pings_sent: int = 0
    commits: int = 0
    overloaded_retries: int = 0
    runner_failures: int = 0


class _Slot:
    """One unit of pool capacity held by an activation; released exactly once."""

    __slots__ = ("_front", "_held")

    def __init__(self, front: ClusterFront, *, held: bool) -> None:
        self._front = front
        self._held = held
        if held:
            front._busy += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self._front._busy -= 1
            self._front._room.set()


class ClusterFront:
    def __init__(
        self,
        options: FrontOptions,
        *,
        bus: KafkaBus,
        couch: CouchClient,
        actions: ActionStore,
        activations: ActivationStore,
        router: Router,
        control: EnabledControl | None = None,
    ) -> None:
        self.options = options
        self.instance = options.instance
        self.topics = options.topics
        self.bus = bus
        self.couch = couch
        self.actions = actions
        self.activations = activations
        self.router = router
        self.control = control
        self.stats = FrontStats()
        self.ready = asyncio.Event()  # consumer started
        self.assigned = asyncio.Event()  # partitions assigned at least once
        self._stopping = asyncio.Event()
        self._room = asyncio.Event()
        self._commit_wanted = asyncio.Event()
        self._ping_wake = asyncio.Event()
        self._tracker = OffsetTracker()
        self._backlog_end: dict[TopicPartition, int] = {}
        self._in_work: dict[str, list[tuple[TopicPartition, int]]] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._busy = 0
        self._work: set[asyncio.Task[None]] = set()
        self._side: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._consumer: TopicConsumer | None = None
        self._consumer_ok = False
        self._paused_reason: str | None = None
        self._last_ping_enabled: bool | None = None

    # ------------------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Returns at once; connecting (with retries) happens in the background."""
        if self.control is not None:
            self.control.on_enabled_change(lambda _enabled: self._ping_wake.set())
        self._loops = [
            asyncio.create_task(self._main_loop(), name="openwhisk-consume"),
            asyncio.create_task(self._ping_loop(), name="openwhisk-ping"),
            asyncio.create_task(self._commit_loop(), name="openwhisk-commit"),
        ]

    async def stop(self) -> None:
        """Stop taking work, drain what is in work (bounded), commit, say goodbye, close."""
        self._stopping.set()
        consume = self._loops[0] if self._loops else None
        if consume is not None:
            consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
        if self._work:
            _, pending = await asyncio.wait(set(self._work), timeout=self.options.drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("front.drain_timeout", cancelled=len(pending))
                await asyncio.gather(*pending, return_exceptions=True)
        await self._commit_now()
        for task in self._loops[1:]:
            task.cancel()
        await asyncio.gather(*self._loops[1:], return_exceptions=True)
        if self.bus.available:
            # The controller marks us offline at once instead of after its 10 s ping timeout.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.bus.send(self.topics.health(),
                                                   ping_message(self.instance, enabled=False)), 2.0)
        for task in list(self._side):
            task.cancel()
        await asyncio.gather(*self._side, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.close()
        await self.bus.close()
        await self.couch.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._side.add(task)
        task.add_done_callback(self._side_done)
        return task

    def _side_done(self, task: asyncio.Task[Any]) -> None:
        self._side.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("front.task_failed", task=task.get_name(), error=repr(task.exception()))

    # ------------------------------------------------------------------------------------ consuming

    async def _main_loop(self) -> None:
        if not await self.bus.start(self._stopping):
            return
        consumer = self.bus.consumer(
            self.topics.invoker(self.instance.instance),
            group=f"{self.topics.prefix}invoker{self.instance.instance}",
            fetch_max_wait_ms=self.options.fetch_max_wait_ms,
            on_assigned=self._on_assigned,
            on_revoked=self._on_revoked,
        )
        self._consumer = consumer
        if not await consumer.start(self._stopping):
            return
        self._consumer_ok = True
        self.ready.set()
        while not self._stopping.is_set():
            room = min(self.options.max_peek - self._busy, self.options.max_unfinished - len(self._work))
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                records = await consumer.getmany(max_records=room, timeout_ms=200)
            except KafkaUnavailable as exc:
                self._consumer_ok = False
                log.warning("front.consumer_failed", error=str(exc))
                if not await consumer.restart(self._stopping):
                    return
                self._consumer_ok = True
                continue
            for record in records:
                self._dispatch(record)

    def _on_assigned(self, ends: Mapping[TopicPartition, int | None]) -> None:
        for tp, end in ends.items():
            if end is None:
                self._backlog_end.pop(tp, None)
            else:
                self._backlog_end[tp] = end
        self.stats.assignments += 1
        self.assigned.set()

    def _on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        # In-work activations go on; their records come back after the rebalance and are matched by id.
        self._tracker.forget(partitions)
        for tp in partitions:
            self._backlog_end.pop(tp, None)

    def _dispatch(self, record: ConsumerRecord) -> None:
        tp = TopicPartition(record.topic, record.partition)
        self._tracker.taken(tp, record.offset)
        self.stats.received += 1
        end = self._backlog_end.get(tp)
        backlog = end is not None and record.offset < end
        try:
            msg = ActivationMessage.parse(record.value or b"")
        except MalformedMessage as exc:
            self._take_malformed(exc, tp, record.offset)
            return
        if not self._claim(msg.activation_id, tp, record.offset):
            return
        # The health test needs no container, so it takes no pool capacity.
        slot = _Slot(self, held=not msg.is_health_test)
        self._start_work(self._handle(msg, slot, backlog=backlog), msg.activation_id)

    def _claim(self, activation_id: str, tp: TopicPartition, offset: int) -> bool:
        """False for a duplicate: its offset finishes together with (or already finished as) the first."""
        waiting = self._in_work.get(activation_id)
        if waiting is not None:
            waiting.append((tp, offset))
            self.stats.duplicates += 1
            log.info("front.duplicate_in_work", activation_id=activation_id, offset=offset)
            return False
        if activation_id in self._done:
            self.stats.duplicates += 1
            log.info("front.duplicate_done", activation_id=activation_id, offset=offset)
            self._tracker.finished(tp, offset)
            self._commit_wanted.set()
            return False
        self._in_work[activation_id] = [(tp, offset)]
        return True

    def _start_work(self, coro: Coroutine[Any, Any, None], activation_id: str) -> None:
        task = asyncio.create_task(coro, name=f"activation-{activation_id}")
        self._work.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._work.discard(t)
            self._room.set()
            if t.cancelled():
                # Shutdown: not acked, not committed; the record is delivered again after a restart.
                self._in_work.pop(activation_id, None)
                return
            if t.exception() is not None:
                log.error("front.activation_task_failed", activation_id=activation_id, error=repr(t.exception()))
            self._finish(activation_id)

        task.add_done_callback(done)

    def _finish(self, activation_id: str) -> None:
        for tp, offset in self._in_work.pop(activation_id, ()):
            self._tracker.finished(tp, offset)
        self._done[activation_id] = None
        while len(self._done) > self.options.remember_done:
            self._done.popitem(last=False)
        self._commit_wanted.set()

    # ------------------------------------------------------------------------------------ one activation

    async def _handle(self, msg: ActivationMessage, slot: _Slot, *, backlog: bool) -> None:
        structlog.contextvars.bind_contextvars(activation_id=msg.activation_id, transid=msg.transid_id)
        try:
            if backlog and await self._already_recorded(msg):
                self.stats.already_recorded += 1
                log.info("front.already_recorded")
                return
            if msg.is_health_test:
                self.stats.health_tests += 1
                activation = health_test_activation(msg)
                await self._send_acks(msg, acks_after_run(transid=msg.transid, activation=activation,
                                                          instance=self.instance, blocking=msg.blocking, split=True),
                                      activation)
                await self._store(msg, activation)
                return
            try:
                action = await self.actions.get(msg.action_path, msg.action_name, msg.revision)
            except ActionFetchError as exc:
                self.stats.fetch_errors += 1
                log.warning("front.action_fetch_failed", action=msg.fqn, revision=msg.revision,
                            error=exc.detail, status=int(exc.response.status))
                slot.release()
                await self._fail(msg, exc.response)
                return
            if msg.locked_args:
                log.warning("front.locked_args_unsupported", params=sorted(msg.locked_args))
            action = gpu_image_action(action, self.options.gpu)
            activation = await self._run(msg.to_request(action))
            slot.release()
            self.stats.activations += 1
            await self._send_acks(msg, acks_after_run(transid=msg.transid, activation=activation,
                                                      instance=self.instance, blocking=msg.blocking,
                                                      split=action.limits.logs_mb != 0), activation)
            await self._store(msg, activation)
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug of ours must not leave the controller waiting for an ack it will never get.
            log.exception("front.activation_failed")
            self.stats.runner_failures += 1
            with contextlib.suppress(Exception):
                await self._fail(msg, ActivationResponse.whisk_error(ABNORMAL_RUN), store=False)
        finally:
            slot.release()

    async def _run(self, req: ActivationRequest) -> Activation:
        for delay in self.options.ack_backoff.delays():
            try:
                runner = await self.router.route(req)
                return await runner.run(req)
            except InvokerOverloaded:
                # The record stays unacknowledged and uncommitted; the pool will have room soon.
                self.stats.overloaded_retries += 1
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("front.runner_failed")
                self.stats.runner_failures += 1
                msg_activation = fallback_activation(
                    activation_id=req.activation_id, namespace=req.identity.namespace,
                    subject=req.identity.subject, action_path=req.action.namespace,
                    action_name=req.action.name, response=ActivationResponse.whisk_error(ABNORMAL_RUN),
                    version=req.action.version, cause=req.cause,
                )
                return msg_activation
        raise AssertionError("unreachable")

    async def _fail(self, msg: ActivationMessage, response: ActivationResponse, *, store: bool = True) -> None:
        activation = fallback_for(msg, response)
        await self._send_acks(msg, acks_without_container(transid=msg.transid, activation=activation,
                                                          instance=self.instance, blocking=msg.blocking),
                              activation)
        if store:
            await self._store(msg, activation)

    async def _already_recorded(self, msg: ActivationMessage) -> bool:
        if not msg.user.store_activations:
            return False
        try:
            return await self.activations.exists(msg.user.namespace, msg.activation_id)
        except CouchError as exc:
            log.warning("front.redelivery_check_failed", error=str(exc))
            return False

    async def _store(self, msg: ActivationMessage, activation: Activation) -> None:
        if msg.user.store_activations:
            await self.activations.store(activation)

    async def _send_acks(self, msg: ActivationMessage, acks: list[Ack], activation: Activation) -> None:
        topic = self.topics.completed(msg.controller)
        for ack in acks:
            # MessagingActiveAck: nobody waits for the result of a non-blocking activation.
            ack = ack if msg.blocking else ack.shrink()
            await self._send_ack(topic, ack)
            if ack.frees_slot and self.options.user_events:
                self._spawn(self._send_event(msg, activation), name=f"event-{msg.activation_id}")

    async def _send_ack(self, topic: Any, ack: Ack) -> None:
        payload = ack.serialize()
        try:
            await retry_until_sent(lambda: self.bus.send(topic, payload), backoff=self.options.ack_backoff,
                                   stop=None, what=f"{ack.kind} {ack.activation_id}")
        except RecordTooLarge as exc:
            shrunk = ack.shrink()
            self.stats.acks_shrunk += 1
            log.warning("front.ack_too_large", kind=str(ack.kind), bytes=len(payload), error=str(exc))
            payload = shrunk.serialize()
            await retry_until_sent(lambda: self.bus.send(topic, payload), backoff=self.options.ack_backoff,
                                   stop=None, what=f"shrunk {ack.kind} {ack.activation_id}")
        self.stats.acks_sent += 1

    async def _send_event(self, msg: ActivationMessage, activation: Activation) -> None:
        event = activation_event(activation, source=self.instance.source, user_uuid=msg.user.namespace_uuid)
        if event is None:
            log.warning("front.event_skipped", reason="record lacks path or kind annotation")
            return
        try:
            await self.bus.send(self.topics.events(), dumps(event))
            self.stats.events_sent += 1
        except (KafkaUnavailable, RecordTooLarge) as exc:
            log.warning("front.event_failed", error=str(exc))

    def _take_malformed(self, exc: MalformedMessage, tp: TopicPartition, offset: int) -> None:
        if exc.activation_id is None:
            self.stats.malformed_skipped += 1
            log.error("front.malformed_skipped", reason=exc.reason, offset=offset, partition=tp.partition)
            self._tracker.finished(tp, offset)
            self._commit_wanted.set()
            return
        if not self._claim(exc.activation_id, tp, offset):
            return
        self.stats.malformed_acked += 1
        log.error("front.malformed_acked", reason=exc.reason, activation_id=exc.activation_id, offset=offset)
        self._start_work(self._answer_malformed(exc), exc.activation_id)

    async def _answer_malformed(self, exc: MalformedMessage) -> None:
        assert exc.activation_id is not None
        namespace = exc.namespace or "unknown"
        activation = fallback_activation(
            activation_id=exc.activation_id,
            namespace=namespace,
            subject=exc.subject or namespace,
            action_path=exc.action_path or namespace,
            action_name=exc.action_name or "unknown",
            response=ActivationResponse.whisk_error(f"The activation message could not be read: {exc.reason}"),
        )
        controller = exc.controller or "0"
        if exc.controller is None:
            log.warning("front.malformed_without_controller", assumed=controller)
        transid = exc.transid if exc.transid is not None else UNKNOWN_TRANSID
        for ack in acks_without_container(transid=transid, activation=activation, instance=self.instance,
                                          blocking=exc.blocking):
            await self._send_ack(self.topics.completed(controller), ack)
        if exc.namespace is not None:
            await self.activations.store(activation)

    # ------------------------------------------------------------------------------------ commits

    async def _commit_loop(self) -> None:
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            if not await self._commit_now():
                await asyncio.sleep(0.5)
                self._commit_wanted.set()

    async def _commit_now(self) -> bool:
        """Commit what is finished; False if something still assigned could not be committed."""
        consumer = self._consumer
        if consumer is None:
            return True
        offsets = self._tracker.committable()
        if not offsets:
            return True
        committed = await consumer.commit(offsets)
        if committed:
            self._tracker.committed(committed)
            self.stats.commits += 1
        assigned = consumer.assignment()
        return all(tp in committed for tp in offsets if tp in assigned)

    # ------------------------------------------------------------------------------------ health

    def _enabled(self) -> bool:
        return True if self.control is None else bool(self.control.enabled)

    async def _why_not_working(self) -> str | None:
        if not self._consumer_ok and self.ready.is_set():
            return "kafka consumer is reconnecting"
        if not self.couch.available:
            reason = await self.couch.probe(self.actions.db, self.activations.db)
            if reason is not None:
                return f"couchdb: {reason}"
        return None

    async def _ping_loop(self) -> None:
        loop = asyncio.get_running_loop()
        health = self.topics.health()
        while True:
            started = loop.time()
            enabled = self._enabled()
            if not enabled:
                if self._last_ping_enabled is not False:
                    await self._ping(health, enabled=False)
            else:
                reason = await self._why_not_working()
                if reason != self._paused_reason:
                    if reason is not None:
                        log.warning("front.pings_paused", reason=reason)
                    elif self._paused_reason is not None:
                        log.info("front.pings_resumed")
                    self._paused_reason = reason
                if reason is None:
                    await self._ping(health, enabled=True)
            # scheduleWaitAtMost: the next ping a second after this one started, at once if late
            self._ping_wake.clear()
            delay = self.options.ping_interval_s - (loop.time() - started)
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._ping_wake.wait(), delay)

    async def _ping(self, health: Any, *, enabled: bool) -> None:
        try:
            await self.bus.send(health, ping_message(self.instance, enabled=enabled))
        except (KafkaUnavailable, RecordTooLarge) as exc:
            if self._last_ping_enabled is not None:
                log.warning("front.ping_failed", error=str(exc))
            self._last_ping_enabled = None
            return
        self.stats.pings_sent += 1
        self._last_ping_enabled = enabled

    # ------------------------------------------------------------------------------------ introspection

    @property
    def in_work(self) -> int:
        return len(self._work)

    @property
    def pinging(self) -> bool:
        return self._paused_reason is None and self._last_ping_enabled is True

