"""The Kafka side of the legacy invoker protocol, on aiokafka.

* :class:`KafkaBus` owns the producer (acks, pings, events) and topic creation. Sends are single
  attempts that raise :class:`KafkaUnavailable` or :class:`RecordTooLarge`; the caller decides whether to
  retry (acks: until sent; pings: never, the next one is a second away).
* :class:`TopicConsumer` reads ``invoker{N}`` in group ``invoker{N}`` from the committed offsets and
  commits only what it is told to. A new group starts at the earliest offset so that the controller's
  first messages (the health test action) are not skipped while the group join is still running.
* :class:`OffsetTracker` turns "record finished" events, which arrive out of order because
  activations run concurrently, into the offsets that are safe to commit.

Startup and every later connection loss are retried with backoff; nothing here gives up on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError

from dilu_invoker.config import KafkaConfig
from dilu_invoker.openwhisk.backoff import Backoff, sleep_or_stop

log = structlog.get_logger(__name__)

_CONNECT_BACKOFF = Backoff(initial_s=0.1, maximum_s=5.0)

#: ``whisk.activation.payload.max`` (1 MB) + ``serdes-overhead`` (6068): the largest record OpenWhisk
#: puts on ``invoker{N}`` and ``completed{C}`` (``ActivationEntityLimit.MAX_ACTIVATION_LIMIT``).
MAX_ACTIVATION_BYTES = 1024 * 1024 + 6068

_TOPIC_EXISTS = 36  # TOPIC_ALREADY_EXISTS


class KafkaUnavailable(ConnectionError):
    """The broker could not be reached or refused the request; retry later."""


class RecordTooLarge(ValueError):
    """The record exceeds the producer's or the topic's size limit (Kafka's RecordTooLargeException)."""


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic as OpenWhisk creates it (``KafkaMessagingProvider.ensureTopic``): one partition."""

    name: str
    retention_ms: int
    max_message_bytes: int | None = None

    def configs(self) -> dict[str, str]:
        out = {"retention.ms": str(self.retention_ms)}
        if self.max_message_bytes is not None:
            out["max.message.bytes"] = str(self.max_message_bytes)
        return out


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic names and their OpenWhisk defaults (``whisk.kafka.topics.*`` in ``application.conf``)."""

    prefix: str = ""
    user_event_prefix: str = ""

    def invoker(self, instance: int) -> TopicSpec:
        return TopicSpec(f"{self.prefix}invoker{instance}", 48 * 3600 * 1000, MAX_ACTIVATION_BYTES)

    def completed(self, controller: str) -> TopicSpec:
        return TopicSpec(f"{self.prefix}completed{controller}", 3600 * 1000, MAX_ACTIVATION_BYTES)

    def health(self) -> TopicSpec:
        return TopicSpec(f"{self.prefix}health", 3600 * 1000)

    def events(self) -> TopicSpec:
        return TopicSpec(f"{self.user_event_prefix}events", 3600 * 1000)


def _ssl_context(cfg: KafkaConfig) -> ssl.SSLContext | None:
    if cfg.security_protocol.upper() != "SSL":
        return None
    return ssl.create_default_context(cafile=cfg.ssl_cafile)


class KafkaBus:
    """Producer and topic administration against one Kafka cluster."""

    def __init__(
        self,
        cfg: KafkaConfig,
        *,
        client_id: str,
        replication_factor: int = 1,
        max_request_size: int = MAX_ACTIVATION_BYTES,
        request_timeout_ms: int = 5000,
        backoff: Backoff = _CONNECT_BACKOFF,
    ) -> None:
        if not cfg.hosts:
            raise ValueError("Kafka bootstrap servers are not set (--kafka-hosts / KAFKA_HOSTS)")
        self.cfg = cfg
        self.client_id = client_id
        self.replication_factor = replication_factor
        self.max_request_size = max_request_size
        self.request_timeout_ms = request_timeout_ms
        self.backoff = backoff
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._ensured: set[str] = set()
        self._ensure_lock = asyncio.Lock()
        #: outcome of the last send; the pinger reads it
        self.available = False

    def _common(self) -> dict[str, object]:
        return {
            "bootstrap_servers": self.cfg.hosts,
            "client_id": self.client_id,
            "security_protocol": self.cfg.security_protocol.upper(),
            "ssl_context": _ssl_context(self.cfg),
        }

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        """Connect the producer, retrying with backoff; False if ``stop`` was set first."""
        for delay in self.backoff.delays():
            producer = AIOKafkaProducer(
                acks=1,
                max_request_size=self.max_request_size,
                request_timeout_ms=self.request_timeout_ms,
                linger_ms=0,
                **self._common(),
            )
            try:
                await producer.start()
            except KafkaError as exc:
                await producer.stop()
                log.warning("kafka.connect_failed", hosts=self.cfg.hosts, error=repr(exc), retry_in_s=round(delay, 2))
                if await sleep_or_stop(delay, stop):
                    return False
                continue
            self._producer = producer
            self.available = True
            log.info("kafka.connected", hosts=self.cfg.hosts)
            return True
        raise AssertionError("unreachable")

    async def close(self) -> None:
        errors: list[BaseException] = []
        for client in (self._producer, self._admin):
            if client is None:
                continue
            try:
                await (client.stop() if isinstance(client, AIOKafkaProducer) else client.close())
            except Exception as exc:  # noqa: BLE001 - teardown collects, it does not stop half way
                errors.append(exc)
        self._producer = self._admin = None
        if errors:
            log.warning("kafka.close_errors", errors=[repr(e) for e in errors])

    # ----------------------------------------------------------------------------------------

    async def ensure_topics(self, specs: Iterable[TopicSpec]) -> None:
        """Create the topics that do not exist yet (one partition each); raises KafkaUnavailable."""
        missing = [s for s in specs if s.name not in self._ensured]
        if not missing:
            return
        async with self._ensure_lock:
            missing = [s for s in missing if s.name not in self._ensured]
            if not missing:
                return
            try:
                if self._admin is None:
                    admin = AIOKafkaAdminClient(request_timeout_ms=self.request_timeout_ms,
                                                **self._common())
                    await admin.start()
                    self._admin = admin
                response = await self._admin.create_topics(
                    [NewTopic(s.name, 1, self.replication_factor, topic_configs=s.configs()) for s in missing]
                )
            except (KafkaError, OSError) as exc:
                await self._drop_admin()
                raise KafkaUnavailable(f"cannot create topics {[s.name for s in missing]}: {exc!r}") from exc
            for name, code, message in (tuple(e)[:3] for e in response.topic_errors):
                if code not in (0, _TOPIC_EXISTS):
                    raise KafkaUnavailable(f"cannot create topic {name}: error {code} {message}")
                if code == 0:
                    log.info("kafka.topic_created", topic=name)
                self._ensured.add(name)

    async def _drop_admin(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            with contextlib.suppress(Exception):  # already broken; nothing to save
                await admin.close()

    def forget_topics(self) -> None:
        """After a connection loss the broker may have come back without its topics (or a new broker
        answers at the same address): create them again before the next send."""
        self._ensured.clear()

    async def send(self, topic: TopicSpec, value: bytes) -> None:
        """One attempt to put ``value`` (no key, like OpenWhisk) on ``topic``."""
        if self._producer is None:
            raise KafkaUnavailable("producer not started")
        try:
            await self.ensure_topics([topic])
            await self._producer.send_and_wait(topic.name, value)
        except (MessageSizeTooLargeError, RecordTooLargeError) as exc:
            raise RecordTooLarge(f"{len(value)} bytes for {topic.name}: {exc!r}") from exc
        except KafkaUnavailable:
            self.available = False
            raise
        except KafkaError as exc:
            self.available = False
            self.forget_topics()
            raise KafkaUnavailable(f"send to {topic.name} failed: {exc!r}") from exc
        self.available = True

    def consumer(self, topic: TopicSpec, *, group: str, fetch_max_wait_ms: int,
                 on_assigned: Callable[[Mapping[TopicPartition, int | None]], None] | None = None,
                 on_revoked: Callable[[Sequence[TopicPartition]], None] | None = None) -> TopicConsumer:
        return TopicConsumer(self, topic, group=group, fetch_max_wait_ms=fetch_max_wait_ms,
                             on_assigned=on_assigned, on_revoked=on_revoked)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, owner: TopicConsumer) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        if self.owner.on_revoked is not None and revoked:
            self.owner.on_revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        await self.owner._assigned(list(assigned))


class TopicConsumer:
    """One topic, one consumer group, manual commits."""

    def __init__(
        self,
        bus: KafkaBus,
        topic: TopicSpec,
        *,
        group: str,
        fetch_max_wait_ms: int,
        on_assigned: Callable[[Mapping[TopicPartition, int | None]], None] | None = None,
        on_revoked: Callable[[Sequence[TopicPartition]], None] | None = None,
    ) -> None:
        self.bus = bus
        self.topic = topic
        self.group = group
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.on_assigned = on_assigned
        self.on_revoked = on_revoked
        self._consumer: AIOKafkaConsumer | None = None

    def _new(self) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=self.fetch_max_wait_ms,
            max_partition_fetch_bytes=max(MAX_ACTIVATION_BYTES, 1024 * 1024),
            fetch_max_bytes=8 * MAX_ACTIVATION_BYTES,
            request_timeout_ms=max(self.bus.request_timeout_ms, 40_000),
            # Kafka's smallest allowed session (group.min.session.timeout.ms): a restarted invoker's
            # old membership expires quickly (and Tansu's join takes half the session timeout).
            session_timeout_ms=6_000,
            heartbeat_interval_ms=2_000,
            # a GPU activation may run for minutes; the loop keeps polling anyway
            max_poll_interval_ms=1_800_000,
            # notice soon when a broker that lost its topics has them again
            metadata_max_age_ms=30_000,
            **self.bus._common(),
        )
        consumer.subscribe([self.topic.name], listener=_Listener(self))
        return consumer

    async def _assigned(self, assigned: list[TopicPartition]) -> None:
        """Remember where each partition ended when it was (re)assigned: records below that mark were
        already in the topic and may have been handled by an earlier incarnation."""
        ends: dict[TopicPartition, int | None] = {tp: None for tp in assigned}
        if self._consumer is not None and assigned:
            try:
                ends.update(await asyncio.wait_for(self._consumer.end_offsets(assigned), 5.0))
            except (KafkaError, TimeoutError) as exc:
                log.warning("kafka.end_offsets_failed", error=repr(exc))
        log.info("kafka.assigned", topic=self.topic.name, group=self.group,
                 partitions={tp.partition: end for tp, end in ends.items()})
        if self.on_assigned is not None:
            self.on_assigned(ends)

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        for delay in self.bus.backoff.delays():
            try:
                await self.bus.ensure_topics([self.topic])
                consumer = self._consumer = self._new()
                try:
                    await consumer.start()
                except BaseException:
                    self._consumer = None
                    await consumer.stop()
                    raise
            except (KafkaError, KafkaUnavailable, OSError) as exc:
                log.warning("kafka.consumer_start_failed", topic=self.topic.name, error=repr(exc),
                            retry_in_s=round(delay, 2))
                if await sleep_or_stop(delay, stop):
                    return False
                continue
            log.info("kafka.consumer_started", topic=self.topic.name, group=self.group)
            return True
        raise AssertionError("unreachable")

    async def restart(self, stop: asyncio.Event | None = None) -> bool:
        await self.close()
        self.bus.forget_topics()
        return await self.start(stop)

    async def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                await consumer.stop()
            except Exception as exc:  # noqa: BLE001 - closing must not fail the shutdown
                log.warning("kafka.consumer_close_failed", error=repr(exc))

    async def getmany(self, *, max_records: int, timeout_ms: int) -> list[ConsumerRecord]:
        """Up to ``max_records`` records; raises KafkaUnavailable when the consumer needs a restart."""
        if self._consumer is None:
            raise KafkaUnavailable("consumer not started")
        try:
            batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        except KafkaError as exc:
            raise KafkaUnavailable(f"fetch from {self.topic.name} failed: {exc!r}") from exc
        records: list[ConsumerRecord] = []
        for batch in batches.values():
            records.extend(batch)
        return records

    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Commit what is still assigned to this member; returns what was committed."""
        if self._consumer is None:
            return {}
        assigned = self.assignment()
        mine = {tp: off for tp, off in offsets.items() if tp in assigned}
        if not mine:
            return {}
        try:
            await self._consumer.commit(mine)
        except KafkaError as exc:
            log.warning("kafka.commit_failed", offsets={tp.partition: o for tp, o in mine.items()}, error=repr(exc))
            return {}
        return mine


class OffsetTracker:
    """Offsets safe to commit: per partition, everything below the oldest record still in work."""

    def __init__(self) -> None:
        self._open: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def taken(self, tp: TopicPartition, offset: int) -> None:
        self._open.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def finished(self, tp: TopicPartition, offset: int) -> None:
        open_ = self._open.get(tp)
        if open_ is not None:
            open_.discard(offset)

    def in_work(self) -> int:
        return sum(len(s) for s in self._open.values())

    def committable(self) -> dict[TopicPartition, int]:
        out: dict[TopicPartition, int] = {}
        for tp, nxt in self._next.items():
            open_ = self._open.get(tp)
            position = min(open_) if open_ else nxt
            if position > self._committed.get(tp, -1):
                out[tp] = position
        return out

    def committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        for tp, off in offsets.items():
            self._committed[tp] = max(off, self._committed.get(tp, -1))

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """A partition moved away (rebalance): its uncommitted records will be delivered again."""
        for tp in partitions:
            self._open.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)


async def retry_until_sent(
    send: Callable[[], Awaitable[None]], *, backoff: Backoff, stop: asyncio.Event | None, what: str
) -> bool:
    """Call ``send`` until it succeeds; False if ``stop`` was set first. RecordTooLarge propagates."""
    attempt = 0
    for delay in backoff.delays():
        try:
            await send()
            if attempt:
                log.info("kafka.send_recovered", what=what, attempts=attempt + 1)
            return True
        except KafkaUnavailable as exc:
            attempt += 1
            if attempt == 1 or attempt % 20 == 0:
                log.warning("kafka.send_retry", what=what, attempt=attempt, error=str(exc))
            if await sleep_or_stop(delay, stop):
                return False
    raise AssertionError("unreachable")
