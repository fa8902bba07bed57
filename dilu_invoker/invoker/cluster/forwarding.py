"""Activations forwarded between invokers through Redis streams, delivered once.

The *origin* (the invoker that received the activation) sends it to the *target* invoker's stream
``{prefix}inv:{target}:act`` (consumer group ``exec``) and waits; the target runs it on the chosen
instance and hands the result back on the origin's stream ``{prefix}inv:{origin}:res``. A claim key per
activation, ``{prefix}run:{id}``, says who may run it, and every step that reads or moves the claim is one
Lua script, so each decision below is atomic:

* **send** — claim ``q:{target}`` (queued for the target), append to its stream.
* **begin** (target, before running) — a stored result means it ran already: only hand the result back
  again. ``q:{me}`` becomes ``r:{me}:{boot}`` and the activation runs. ``r:{me}:{other boot}`` was being
  run by an earlier incarnation of this invoker that died with it: it runs again, here. Anything else (the
  origin moved it elsewhere, or the claim expired) is acknowledged and dropped.
* **finish** — store the result (``{prefix}res:{id}``, kept ``--balancer-result-ttl-s``) unless one is
  there, append it to the origin's reply stream, acknowledge and delete the entry, drop the claim.
* **steal** (origin, when the target's boot key ``{prefix}inv:{target}:boot`` is gone, i.e. its load
  reports stopped) — unless a result exists or the target is back (a restarted target claims the entries
  its predecessor had read), move the claim to ``x``, acknowledge and delete the entry; the origin then
  routes the activation elsewhere.

So an entry is acknowledged only after its result was handed back; an invoker that restarts claims the
entries its previous incarnation had read (``XAUTOCLAIM``) and runs them; an invoker that stays dead has
its entries taken back by their origins; a result is stored and delivered at most once per activation id.
The one case that runs an activation twice is an invoker that dies *while running it*: the attempt that
died produced no result, and the activation runs again elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis.exceptions import RedisError

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.invoker.api import InvokerOverloaded, never_ran
from dilu_invoker.invoker.cluster.agent import Agent
from dilu_invoker.invoker.cluster.instances import InstanceManager
from dilu_invoker.invoker.cluster.streams import ensure_group, read_group
from dilu_invoker.model import (
    Action,
    Activation,
    ActivationRequest,
    ActivationResponse,
    Identity,
    now_ms,
)
from dilu_invoker.wire import (
    ACTIVATION_GROUP,
    RouteEntry,
    WireError,
    pack,
    text,
    unpack,
)

log = structlog.get_logger(__name__)

SEND = """
redis.call('SET', KEYS[1], 'q:' .. ARGV[1], 'PX', ARGV[3])
return redis.call('XADD', KEYS[2], '*', 'v', ARGV[2])
"""

# KEYS: result, claim. ARGV: me, my boot.
BEGIN = """
local res = redis.call('GET', KEYS[1])
if res then return {'done', res} end
local v = redis.call('GET', KEYS[2])
if not v then return {'skip'} end
if v == 'q:' .. ARGV[1] then
  redis.call('SET', KEYS[2], 'r:' .. ARGV[1] .. ':' .. ARGV[2], 'KEEPTTL')
  return {'run'}
end
local prefix = 'r:' .. ARGV[1] .. ':'
if string.sub(v, 1, #prefix) == prefix then
  if string.sub(v, #prefix + 1) == ARGV[2] then return {'dup'} end
  redis.call('SET', KEYS[2], prefix .. ARGV[2], 'KEEPTTL')
  return {'rerun'}
end
return {'skip'}
"""

# KEYS: result, claim, origin's reply stream, this invoker's activation stream.
# ARGV: payload, result ttl ms, group, entry id, activation id, reply maxlen, '1' to reply even if stored.
FINISH = """
local stored = redis.call('EXISTS', KEYS[1]) == 1
if not stored then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
if not stored or ARGV[7] == '1' then
  local payload = ARGV[1]
  if stored then payload = redis.call('GET', KEYS[1]) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'id', ARGV[5], 'v', payload)
end
redis.call('DEL', KEYS[2])
redis.call('XACK', KEYS[4], ARGV[3], ARGV[4])
redis.call('XDEL', KEYS[4], ARGV[4])
return stored and 0 or 1
"""

# KEYS: result, claim, target's boot key, target's activation stream. ARGV: target, group, entry id, ttl ms.
# A live target (any boot) keeps the entry: a restarted one claims what its predecessor had read.
STEAL = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'done' end
if redis.call('EXISTS', KEYS[3]) == 1 then return 'wait' end
redis.call('SET', KEYS[2], 'x', 'PX', ARGV[4])
redis.call('XACK', KEYS[4], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[4], ARGV[3])
return 'moved'
"""

REPLY_STREAM_MAXLEN = 10_000
#: how often the origin checks that targets of pending forwards are alive
CHECK_S = 0.5
#: how often the origin also looks for a stored result (a reply it could have missed)
RESULT_POLL_S = 5.0
#: executions of forwarded activations running at once on this invoker (the instances queue the rest)
MAX_EXECUTIONS = 4096


@dataclass(frozen=True, slots=True)
class Forwarded:
    """A forwarded activation: the request without its action (the target has the instance's)."""

    aid: str
    origin: str
    instance: str
    function: str
    rev: str
    identity: Mapping[str, Any]
    content: Any = None
    transid: Any = None
    init_args: tuple[str, ...] = ()
    blocking: bool = False
    cause: str | None = None
    binding: str | None = None
    timeout_ms: int = 60_000
    sent_ms: int = 0

    @classmethod
    def of(cls, req: ActivationRequest, *, origin: str, instance: str) -> Forwarded:
        i = req.identity
        return cls(
            aid=req.activation_id, origin=origin, instance=instance, function=req.action.fqn,
            rev=req.action.revision or "",
            identity={"subject": i.subject, "namespace": i.namespace, "uuid": i.uuid, "key": i.key,
                      "store_activations": i.store_activations},
            content=req.content, transid=req.transid, init_args=tuple(req.init_args), blocking=req.blocking,
            cause=req.cause, binding=req.binding, timeout_ms=req.action.limits.timeout_ms, sent_ms=now_ms(),
        )

    @classmethod
    def from_wire(cls, data: Any) -> Forwarded:
        if not isinstance(data, Mapping):
            raise WireError("forwarded activation: expected a map")
        kwargs = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "init_args" in kwargs:
            kwargs["init_args"] = tuple(kwargs["init_args"] or ())
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise WireError(f"forwarded activation: {exc}") from None

    def request(self, action: Action) -> ActivationRequest:
        i = self.identity
        identity = Identity(subject=str(i.get("subject", "")), namespace=str(i.get("namespace", "")),
                            uuid=str(i.get("uuid", "")), key=str(i.get("key", "")),
                            store_activations=bool(i.get("store_activations", True)))
        return ActivationRequest(activation_id=self.aid, action=action, identity=identity, content=self.content,
                                 transid=self.transid, init_args=self.init_args, blocking=self.blocking,
                                 cause=self.cause, binding=self.binding)


def failed_activation(*, aid: str, function: str, identity: Mapping[str, Any], message: str,
                      cause: str | None = None) -> Activation:
    """The record of an activation that could not run (a whisk internal error)."""
    namespace = str(identity.get("namespace", ""))
    return never_ran(activation_id=aid, namespace=namespace, subject=str(identity.get("subject", namespace)),
                     path=function, response=ActivationResponse.whisk_error(message), cause=cause)


def encode_activation(activation: Activation) -> bytes:
    return pack(activation.to_json())


def decode_activation(raw: bytes | str) -> Activation:
    if isinstance(raw, str):
        raise WireError("expected msgpack bytes, got text")
    try:
        return Activation.from_json(unpack(raw))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"activation: {exc}") from None


@dataclass(slots=True)
class ForwardStats:
    sent: int = 0
    moved: int = 0
    executed: int = 0
    reruns: int = 0
    redelivered: int = 0
    skipped: int = 0
    claimed: int = 0
    late_results: int = 0
    by_target: dict[str, int] = field(default_factory=dict)


class Forwarder:
    """Both ends of forwarding for one invoker: sending (origin) and executing (target)."""

    def __init__(
        self,
        agent: Agent,
        *,
        instances: InstanceManager,
        result_ttl_s: float = 300.0,
    ) -> None:
        self.redis = redis = agent.redis
        self.keys = agent.keys
        self.name = agent.name
        self.boot = agent.boot
        self.invoker = agent.invoker
        self.instances = instances
        self.registry = agent.registry
        self.result_ttl_ms = int(result_ttl_s * 1000)
        self.stats = ForwardStats()
        self._send = redis.register_script(SEND)
        self._begin = redis.register_script(BEGIN)
        self._finish = redis.register_script(FINISH)
        self._steal = redis.register_script(STEAL)
        self._waiters: dict[str, asyncio.Future[Activation]] = {}
        self._alive: dict[str, tuple[float, bool]] = {}
        self._executions: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_EXECUTIONS)

    # -- origin ----------------------------------------------------------------------------------

    async def forward(self, entry: RouteEntry, req: ActivationRequest) -> Activation | None:
        """Run ``req`` on ``entry``'s instance on another invoker and wait for the result; None when the
        target died before running it (the caller routes it elsewhere)."""
        aid = req.activation_id
        target = entry.invoker
        timeout_s = req.action.limits.timeout_ms / 1000
        # The claim outlives any wait the origin is prepared for; a claim that expires means nobody waits.
        hard_s = 2 * timeout_s + 300.0
        fut: asyncio.Future[Activation] = asyncio.get_running_loop().create_future()
        self._waiters[aid] = fut
        try:
            payload = pack(Forwarded.of(req, origin=self.name, instance=entry.id))
            entry_id = text(await self._send(keys=[self.keys.claim(aid), self.keys.activations(target)],
                                             args=[target, payload, int(hard_s * 1000)]))
            self.stats.sent += 1
            self.stats.by_target[target] = self.stats.by_target.get(target, 0) + 1
            started = time.monotonic()
            polled = started
            while True:
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(fut), CHECK_S)
                now = time.monotonic()
                try:
                    if not await self._is_alive(target):
                        outcome = text(await self._steal(
                            keys=[self.keys.result(aid), self.keys.claim(aid), self.keys.boot(target),
                                  self.keys.activations(target)],
                            args=[target, ACTIVATION_GROUP, entry_id, int(hard_s * 1000)]))
                        if outcome == "moved":
                            self.stats.moved += 1
                            log.info("forwarded activation taken back from a gone invoker", activation_id=aid,
                                     target=target)
                            return None
                        if outcome == "done":
                            polled = 0.0
                    if now - polled >= RESULT_POLL_S:
                        polled = now
                        raw = await self.redis.get(self.keys.result(aid))
                        if raw is not None:
                            self.stats.late_results += 1
                            return decode_activation(raw)
                except RedisError as exc:
                    log.warning("cannot check a forwarded activation", activation_id=aid, error=str(exc))
                if now - started > hard_s:
                    return failed_activation(aid=aid, function=req.action.fqn, identity={
                        "namespace": req.identity.namespace, "subject": req.identity.subject},
                        message="The activation was lost by the invoker running it.", cause=req.cause)
        finally:
            self._waiters.pop(aid, None)

    async def _is_alive(self, invoker: str) -> bool:
        now = time.monotonic()
        cached = self._alive.get(invoker)
        if cached is not None and now - cached[0] < CHECK_S:
            return cached[1]
        alive = bool(await self.redis.exists(self.keys.boot(invoker)))
        self._alive[invoker] = (now, alive)
        return alive

    async def listen_replies(self) -> None:
        """Hand results coming back from other invokers to the activations waiting for them."""
        stream = self.keys.replies(self.name)
        last = "$"
        while True:
            try:
                got: Any = await self.redis.xread({stream: last}, count=200, block=1000)
            except RedisError as exc:
                log.warning("cannot read forwarded results", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            for _stream, entries in got or ():
                for entry_id, fields in entries:
                    last = text(entry_id)
                    aid = fields.get(b"id")
                    fut = self._waiters.get(text(aid)) if aid is not None else None
                    if fut is None or fut.done():
                        continue
                    try:
                        fut.set_result(decode_activation(fields[b"v"]))
                    except (WireError, KeyError) as exc:
                        log.warning("unreadable forwarded result", activation_id=text(aid), error=str(exc))

    # -- target ----------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Run what other invokers forward here, until cancelled (running executions continue)."""
        stream = self.keys.activations(self.name)
        await ensure_group(self.redis, stream, ACTIVATION_GROUP)
        await self._claim_pending(stream)
        async for entry_id, fields in read_group(self.redis, stream, ACTIVATION_GROUP, self.boot, count=64,
                                                 what="forwarded activations"):
            await self._slots.acquire()
            self._spawn(self._execute(stream, text(entry_id), fields))

    async def drain(self, timeout_s: float) -> None:
        """Wait for running executions (after :meth:`serve` was cancelled)."""
        if self._executions:
            await asyncio.wait(set(self._executions), timeout=timeout_s)

    async def close(self) -> None:
        await cancel_and_wait(*self._executions)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._executions.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._executions.discard(t)
            self._slots.release()

        task.add_done_callback(done)

    async def _claim_pending(self, stream: str) -> None:
        """Entries an earlier incarnation of this invoker read but did not finish."""
        start = "0-0"
        while True:
            res: Any = await self.redis.xautoclaim(stream, ACTIVATION_GROUP, self.boot, min_idle_time=0,
                                                   start_id=start, count=100)
            start, claimed = text(res[0]), res[1]
            for entry_id, fields in claimed:
                if fields is None:
                    continue
                self.stats.claimed += 1
                await self._slots.acquire()
                self._spawn(self._execute(stream, text(entry_id), fields))
            if start == "0-0" or not claimed:
                break
        with contextlib.suppress(RedisError):
            for c in await self.redis.xinfo_consumers(stream, ACTIVATION_GROUP):
                name = text(c.get("name", b""))
                if name != self.boot and int(c.get("pending", 0)) == 0:
                    await self.redis.xgroup_delconsumer(stream, ACTIVATION_GROUP, name)

    async def _execute(self, stream: str, entry_id: str, fields: Mapping[Any, Any]) -> None:
        try:
            raw = fields.get(b"v")
            fwd = Forwarded.from_wire(unpack(raw)) if raw is not None else None
        except WireError as exc:
            fwd = None
            log.warning("unreadable forwarded activation; dropped", entry=entry_id, error=str(exc))
        if fwd is None:
            with contextlib.suppress(RedisError):
                await self.redis.xack(stream, ACTIVATION_GROUP, entry_id)
                await self.redis.xdel(stream, entry_id)
            return
        aid = fwd.aid
        try:
            verdict: Any = await self._begin(keys=[self.keys.result(aid), self.keys.claim(aid)],
                                             args=[self.name, self.boot])
        except RedisError as exc:
            log.warning("cannot claim a forwarded activation; left for redelivery", activation_id=aid,
                        error=str(exc))
            return
        kind = text(verdict[0])
        if kind == "dup":
            return
        if kind == "skip":
            self.stats.skipped += 1
            with contextlib.suppress(RedisError):
                await self.redis.xack(stream, ACTIVATION_GROUP, entry_id)
                await self.redis.xdel(stream, entry_id)
            return
        if kind == "done":
            self.stats.redelivered += 1
            await self._hand_back(fwd, stream, entry_id, bytes(verdict[1]), again=True)
            return
        if kind == "rerun":
            self.stats.reruns += 1
            log.info("running again an activation whose earlier run died with this invoker", activation_id=aid)
        activation = await self._run(fwd)
        self.stats.executed += 1
        await self._hand_back(fwd, stream, entry_id, encode_activation(activation), again=False)

    async def _run(self, fwd: Forwarded) -> Activation:
        action = self.instances.action_of(fwd.instance)
        if action is None:
            try:
                action = await self.registry.load(fwd.function)
            except (RedisError, WireError, ValueError) as exc:
                log.warning("cannot load a forwarded activation's action", function=fwd.function, error=str(exc))
        if action is None:
            return failed_activation(aid=fwd.aid, function=fwd.function, identity=fwd.identity, cause=fwd.cause,
                                     message="The requested resource does not exist.")
        req = fwd.request(action)
        activation = await self.instances.run(fwd.instance, req)
        if activation is None:
            # The instance was stopped or failed meanwhile: another one here, else the plain pool.
            other = self.instances.pick_local(fwd.function, exclude=frozenset({fwd.instance}))
            if other is not None:
                activation = await self.instances.run(other, req)
        if activation is None:
            try:
                activation = await self.invoker.run(req)
            except InvokerOverloaded as exc:
                activation = failed_activation(aid=fwd.aid, function=fwd.function, identity=fwd.identity,
                                               cause=fwd.cause, message=f"The invoker is overloaded: {exc}")
        return activation

    async def _hand_back(self, fwd: Forwarded, stream: str, entry_id: str, payload: bytes, *, again: bool) -> None:
        keys = [self.keys.result(fwd.aid), self.keys.claim(fwd.aid), self.keys.replies(fwd.origin), stream]
        args: list[bytes | str | int] = [payload, self.result_ttl_ms, ACTIVATION_GROUP, entry_id, fwd.aid,
                                          REPLY_STREAM_MAXLEN, "1" if again else "0"]
        for attempt in range(5):
            try:
                await self._finish(keys=keys, args=args)
                return
            except RedisError as exc:
                log.warning("cannot hand back a forwarded result; retrying", activation_id=fwd.aid, error=str(exc))
                await asyncio.sleep(0.2 * (attempt + 1))
        # Left pending: a restart of this invoker claims and runs it again; its origin may take it back.
        log.error("forwarded result could not be handed back", activation_id=fwd.aid)
