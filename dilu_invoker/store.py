"""Redis-backed entity store of the standalone mode: actions per namespace and activation records.

The keyspace is documented in ``docs/redis-keyspace.md``. In short, under the configured prefix:

* ``action:{ns}/{name}`` — hash ``rev``, ``doc`` (the action JSON with code), ``summary`` (the list view);
* ``actions:{ns}`` — sorted set of action names by ``updated`` (ms);
* ``activation:{ns}/{id}`` — hash ``doc`` (``Activation.to_json()``, logs included), ``summary`` (no logs,
  no result), ``index`` (the by-name index key it is listed in);
* ``activations:{ns}`` — sorted set of activation ids by ``start`` (ms), bounded per namespace;
* ``activations:{ns}/{path}`` — the same, per action (``name`` or ``package/name``).

Writes that touch several keys run as Lua scripts, so a reader never sees half an update, an action update
with a stale revision is refused (:class:`RevisionConflict`), and retention trims documents and indexes
together. The scripts name keys they compute, so the store needs a single Redis instance (not a cluster).

**An answered activation always gets its record.** When Redis cannot take an activation record (it died,
is restarting, or the pool stayed busy), :meth:`EntityStore.store_activation` does not fail: the record is
held in memory (bounded by ``max_unstored``) and a background task writes the held records, oldest first,
as soon as Redis answers again. Held records are served by :meth:`EntityStore.get_activation` meanwhile.
At :meth:`EntityStore.close` whatever is still held is appended to ``spill_path`` (one JSON record per
line, mode 0600) when one is configured, and :meth:`EntityStore.replay_spilled` writes that file back at the
next start. ``docs/rest-api.md`` ("Errors and faults") states the guarantee.

**Concurrent invokes share round trips.** The two commands every invoke sends — the action's revision check
and the activation record's write — go through a :class:`Pipeliner`: while one pipeline is in flight, the
commands that arrive meanwhile wait and leave together in the next one (group commit), and revision checks
of one action in the same pipeline are sent once. Each command is still sent after its caller asked for it
and answered only after Redis did, so the cache stays exact and a record is in Redis before its activation
is answered; a lone invoke pays no wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
import structlog

from dilu_invoker import jsonutil
from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.config import RedisConfig
from dilu_invoker.model import Action, Activation

log = structlog.get_logger(__name__)

DEFAULT_MAX_ACTIVATIONS = 10_000
#: activation records held in memory while Redis cannot take them
DEFAULT_MAX_UNSTORED = 10_000
#: the longest an activation record's write waits for the blocking caller's answer to go out first
AFTER_WAIT_S = 1.0

#: what redis-py raises while Redis cannot serve: down, restarting (``BusyLoadingError``), or no pooled
#: connection free within the pool timeout (``MaxConnectionsError``, "No connection available.")
STORE_UNAVAILABLE: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class Pipeliner:
    """Group commit for small Redis commands: commands asked for while a pipeline is in flight leave
    together in the next one (at most ``max_batch``); a command asked for when none is in flight leaves on
    the next turn of the loop with whatever else was asked for in this one. Identical read commands
    (``shared=True``) in one pipeline are sent once and all their callers get the answer. A connection
    error fails every caller of that pipeline; a command's own error (``ResponseError``) fails only it."""

    def __init__(self, redis: aioredis.Redis, *, max_batch: int = 128) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._shared: dict[tuple[Any, ...], asyncio.Future[Any]] = {}
        self._task: asyncio.Task[None] | None = None
        #: pipelines sent and commands they carried (the batching ratio, for tests and benchmarks)
        self.pipelines = 0
        self.commands = 0

    async def call(self, *args: Any, shared: bool = False) -> Any:
        if shared:
            joined = self._shared.get(args)
            if joined is not None:
                return await asyncio.shield(joined)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((args, future))
        if shared:
            self._shared[args] = future
        if self._task is None:
            self._task = asyncio.create_task(self._flush(), name="redis-pipeliner")
        # Shielded: a caller that goes away must not cancel a future others share or the pipeline awaits.
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
                for args, _ in batch:
                    if self._shared.get(args) is not None:
                        del self._shared[args]  # sent from here on: later callers need a later read
                try:
                    if len(batch) == 1:
                        # Alone (no concurrent caller): a plain command costs less than a pipeline of one.
                        try:
                            results = [await self.redis.execute_command(*batch[0][0])]
                        except redis.exceptions.ResponseError as exc:
                            results = [exc]
                    else:
                        async with self.redis.pipeline(transaction=False) as pipe:
                            for args, _ in batch:
                                pipe.execute_command(*args)
                            results = await pipe.execute(raise_on_error=False)
                except BaseException as exc:  # every caller of the batch gets the failure
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                self.pipelines += 1
                self.commands += len(batch)
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._task = None
            for _args, future in self._pending:  # only after a cancel
                if not future.done():
                    future.set_exception(redis.exceptions.ConnectionError("the store is closing"))
            self._pending.clear()
            self._shared.clear()


class StoreError(RuntimeError):
    pass


class RevisionConflict(StoreError):
    """The action changed (or appeared, or vanished) since the caller read it."""

    def __init__(self, current: str | None) -> None:
        super().__init__(f"revision conflict (current revision {current!r})")
        self.current = current


_PUT_ACTION = """
local cur = redis.call('HGET', KEYS[1], 'rev')
if ARGV[1] == '' then
  if cur then return {0, cur} end
elseif cur ~= ARGV[1] then
  return {0, cur or ''}
end
redis.call('HSET', KEYS[1], 'rev', ARGV[2], 'doc', ARGV[3], 'summary', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
return {1, ARGV[2]}
"""

_DELETE_ACTION = """
local doc = redis.call('HMGET', KEYS[1], 'rev', 'doc')
if not doc[1] then return false end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return doc
"""

# KEYS: doc hash, namespace index, name index.
# ARGV: id, start, doc, summary, max per namespace, doc key prefix of this namespace.
_STORE_ACTIVATION = """
redis.call('HSET', KEYS[1], 'doc', ARGV[3], 'summary', ARGV[4], 'index', KEYS[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if excess > 0 then
  local old = redis.call('ZRANGE', KEYS[2], 0, excess - 1)
  for _, id in ipairs(old) do
    local key = ARGV[6] .. id
    local index = redis.call('HGET', key, 'index')
    if index then redis.call('ZREM', index, id) end
    redis.call('DEL', key)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, excess - 1)
end
return excess
"""


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def action_summary_json(action: Action) -> dict[str, Any]:
    """OpenWhisk's action list view: no code, no parameters, ``exec`` reduced to its flags."""
    exec_view: dict[str, Any] = {"kind": action.exec.kind, "binary": action.exec.binary}
    return {
        "namespace": action.namespace,
        "name": action.name,
        "version": action.version,
        "exec": exec_view,
        "annotations": [a.to_json() for a in action.annotations],
        "limits": action.limits.to_json(),
        "publish": action.publish,
        "updated": action.updated,
    }


def activation_index_path(activation: Activation) -> str:
    """What the ``name`` filter of the activations list matches: ``name`` or ``package/name``.

    The ``path`` annotation is ``namespace[/package]/name``; the namespace part is dropped because the
    list is already per (invoking) namespace.
    """
    path = activation.annotation("path")
    if isinstance(path, str) and path.count("/") >= 1:
        return path.split("/", 1)[1]
    return activation.name


def activation_summary_json(activation: Activation) -> dict[str, Any]:
    out = activation.to_json()
    out.pop("logs", None)
    out["response"] = {"statusCode": int(activation.response.status)}
    return out


class EntityStore:
    """Actions and activation records in Redis; see the module docstring for the keys."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        prefix: str = "dilu:",
        max_activations_per_namespace: int = DEFAULT_MAX_ACTIVATIONS,
        action_cache_size: int = 256,
        action_cache_max_code: int = 4 * 1024 * 1024,
        action_recheck_s: float = 0.0,
        max_unstored: int = DEFAULT_MAX_UNSTORED,
        spill_path: str | Path | None = None,
        retry_period_s: float = 0.2,
    ) -> None:
        if max_activations_per_namespace < 1:
            raise ValueError("max_activations_per_namespace must be at least 1")
        # Records Redis could not take yet, oldest first, keyed (namespace, activation id).
        self._unstored: OrderedDict[tuple[str, str], Activation] = OrderedDict()
        self.max_unstored = max_unstored
        self.spill_path = Path(spill_path) if spill_path is not None else None
        self.retry_period_s = retry_period_s
        self._flusher: asyncio.Task[None] | None = None
        # Records being written now (visible to reads meanwhile); per namespace, the writes' futures, so a
        # listing waits for them and shows what was answered before it.
        self._writing: dict[tuple[str, str], tuple[Activation, asyncio.Future[None]]] = {}
        #: records dropped because more than ``max_unstored`` were held (logged as errors; should stay 0)
        self.dropped = 0
        self.redis = redis
        self.prefix = prefix
        self.max_activations = max_activations_per_namespace
        self._put_action = redis.register_script(_PUT_ACTION)
        self._delete_action = redis.register_script(_DELETE_ACTION)
        self._store_activation = redis.register_script(_STORE_ACTIVATION)
        self.pipeliner = Pipeliner(redis)
        # Invokes read the action every time; a revision check (one small HGET) keeps this cache exact, at
        # most every ``action_recheck_s`` per action (changes made through this store update it at once).
        self._cache: OrderedDict[tuple[str, str], Action] = OrderedDict()
        self._checked: dict[tuple[str, str], float] = {}
        self.action_recheck_s = action_recheck_s
        self._cache_size = action_cache_size
        self._cache_max_code = action_cache_max_code

    @classmethod
    def from_config(cls, redis: aioredis.Redis, cfg: RedisConfig, *,
                    spill_path: str | Path | None = None) -> EntityStore:
        return cls(redis, prefix=cfg.prefix, max_activations_per_namespace=cfg.max_activations,
                   spill_path=spill_path, action_recheck_s=cfg.action_recheck_s)

    # ----------------------------------------------------------------------------------------
    # Keys
    # ----------------------------------------------------------------------------------------
    def action_key(self, namespace: str, name: str) -> str:
        return f"{self.prefix}action:{namespace}/{name}"

    def actions_index_key(self, namespace: str) -> str:
        return f"{self.prefix}actions:{namespace}"

    def activation_key(self, namespace: str, activation_id: str) -> str:
        return f"{self.prefix}activation:{namespace}/{activation_id}"

    def activations_index_key(self, namespace: str, path: str | None = None) -> str:
        base = f"{self.prefix}activations:{namespace}"
        return base if path is None else f"{base}/{path}"

    # ----------------------------------------------------------------------------------------
    # Actions
    # ----------------------------------------------------------------------------------------
    async def get_action(self, namespace: str, name: str) -> Action | None:
        key = self.action_key(namespace, name)
        cached = self._cache.get((namespace, name))
        if cached is not None:
            now = time.monotonic()
            if now - self._checked.get((namespace, name), -math.inf) < self.action_recheck_s:
                self._cache.move_to_end((namespace, name))
                return cached
            rev = _text(await self.pipeliner.call("HGET", key, "rev", shared=True))
            if rev is None:
                self._forget((namespace, name))
                return None
            if rev == cached.revision:
                # the hget awaited: a delete or update may have dropped the entry meanwhile
                if (namespace, name) in self._cache:
                    self._cache.move_to_end((namespace, name))
                    self._checked[(namespace, name)] = now
                return cached
        raw_rev, raw_doc = await self.redis.hmget(key, ["rev", "doc"])
        if raw_rev is None or raw_doc is None:
            self._forget((namespace, name))
            return None
        action = replace(Action.from_json(await jsonutil.aloads(raw_doc)), revision=_text(raw_rev))
        self._remember(action)
        return action

    def _remember(self, action: Action) -> None:
        """Cache ``action`` as just read from (or written to) Redis."""
        key = (action.namespace, action.name)
        if len(action.exec.code or "") > self._cache_max_code:
            self._forget(key)
            return
        self._cache[key] = action
        self._cache.move_to_end(key)
        self._checked[key] = time.monotonic()
        while len(self._cache) > self._cache_size:
            old, _ = self._cache.popitem(last=False)
            self._checked.pop(old, None)

    def _forget(self, key: tuple[str, str]) -> None:
        self._cache.pop(key, None)
        self._checked.pop(key, None)

    async def put_action(self, action: Action, *, expected_revision: str | None) -> Action:
        """Create (``expected_revision=None``: the action must not exist) or replace the revision the
        caller read. Returns the action with its new revision; raises :class:`RevisionConflict`."""
        code_len = len(action.exec.code or "")
        doc = await jsonutil.adumps(action.to_json(), size_hint=code_len)
        summary = jsonutil.dumps(action_summary_json(action))
        generation = 1
        if expected_revision:
            head = expected_revision.split("-", 1)[0]
            generation = int(head) + 1 if head.isdigit() else 1
        digest = hashlib.md5(doc, usedforsecurity=False).hexdigest()
        revision = f"{generation}-{digest}"
        ok, current = await self._put_action(
            keys=[self.action_key(action.namespace, action.name), self.actions_index_key(action.namespace)],
            args=[expected_revision or "", revision, doc, summary, action.updated, action.name],
        )
        if not int(ok):
            self._forget((action.namespace, action.name))
            raise RevisionConflict(_text(current) or None)
        stored = replace(action, revision=revision)
        self._remember(stored)
        return stored

    async def delete_action(self, namespace: str, name: str) -> Action | None:
        """Delete and return the action (None when it did not exist)."""
        self._forget((namespace, name))
        found = await self._delete_action(
            keys=[self.action_key(namespace, name), self.actions_index_key(namespace)], args=[name]
        )
        if not found:
            return None
        rev, doc = found
        return replace(Action.from_json(await jsonutil.aloads(doc)), revision=_text(rev))

    async def list_actions(self, namespace: str, *, skip: int = 0, limit: int = 30) -> list[Action]:
        """Most recently updated first. These are summaries: no code and no parameters."""
        names = await self.redis.zrevrange(self.actions_index_key(namespace), skip, skip + limit - 1)
        if not names:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for n in names:
                pipe.hget(self.action_key(namespace, _text(n) or ""), "summary")
            summaries = await pipe.execute()
        return [Action.from_json(jsonutil.loads(s)) for s in summaries if s is not None]

    async def count_actions(self, namespace: str, *, skip: int = 0) -> int:
        return max(0, int(await self.redis.zcard(self.actions_index_key(namespace))) - skip)

    # ----------------------------------------------------------------------------------------
    # Activations
    # ----------------------------------------------------------------------------------------
    async def store_activation(self, activation: Activation, *, after: asyncio.Future[None] | None = None) -> None:
        """Write the record; while Redis cannot take it, hold it and write it when Redis is back (this
        method then returns at once: the caller may answer its client).

        The record is readable from the call on. `after`: the write (encoding the record, the Redis call)
        begins once it is done, or after `AFTER_WAIT_S`: a blocking caller's answer goes out first."""
        key = (activation.namespace, activation.activation_id)
        if not self._unstored:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._writing[key] = (activation, done)
            try:
                if after is not None and not after.done():
                    await asyncio.wait({after}, timeout=AFTER_WAIT_S)
                await self._write_activation(activation)
                return
            except STORE_UNAVAILABLE as exc:
                log.warning("redis cannot take activation records; holding them until it is back",
                            error=f"{type(exc).__name__}: {exc}")
                self._hold(key, activation)
            finally:
                if self._writing.get(key, (None, None))[1] is done:
                    del self._writing[key]
                done.set_result(None)
            return
        self._hold(key, activation)

    async def _settled(self, namespace: str, timeout_s: float = 2.0) -> None:
        """Wait (briefly) for the namespace's records being written now, so that a listing shows every
        activation answered before it; records held while Redis is unavailable are not waited for."""
        writes = {done for (ns, _), (_, done) in self._writing.items() if ns == namespace}
        if writes:
            await asyncio.wait(writes, timeout=timeout_s)

    @property
    def unstored(self) -> int:
        """Activation records answered to clients but not yet in Redis (being written, or held)."""
        return len(self._unstored.keys() | self._writing.keys())

    def _hold(self, key: tuple[str, str], activation: Activation) -> None:
        self._unstored[key] = activation
        while len(self._unstored) > self.max_unstored:
            (ns, aid), _ = self._unstored.popitem(last=False)
            self.dropped += 1
            log.error("activation record dropped: too many held while redis is unavailable",
                      namespace=ns, activation_id=aid, max_unstored=self.max_unstored)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="store-unstored-flush")

    async def _flush_loop(self) -> None:
        delay = self.retry_period_s
        while self._unstored:
            key, activation = next(iter(self._unstored.items()))
            try:
                await self._write_activation(activation)
            except STORE_UNAVAILABLE:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            except Exception:
                # Not a Redis outage (the record cannot be encoded, a script error): retrying cannot help.
                log.exception("activation record could not be stored", activation_id=key[1])
                self._unstored.pop(key, None)
                continue
            delay = self.retry_period_s
            # Compare by identity: a newer record of the same id may have replaced it meanwhile.
            if self._unstored.get(key) is activation:
                del self._unstored[key]
        log.info("held activation records written to redis")

    async def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the records being written and the held ones to be written; True when
        none is left."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        writes = {done for _, done in self._writing.values()}
        if writes:
            await asyncio.wait(writes, timeout=timeout_s)
        task = self._flusher
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - asyncio.get_running_loop().time()))
        return not self._unstored and not self._writing

    async def close(self, *, flush_timeout_s: float = 2.0) -> None:
        """Stop the background writer; records still held go to ``spill_path`` (or are logged as lost)."""
        await self.flush(flush_timeout_s)
        task, self._flusher = self._flusher, None
        if task is not None:
            await cancel_and_wait(task)
        if not self._unstored:
            return
        held = list(self._unstored.values())
        if self.spill_path is None:
            log.error("activation records lost: redis unavailable at shutdown", count=len(held))
            return
        lines = [jsonutil.dumps(a.to_json()) + b"\n" for a in held]
        await asyncio.to_thread(_append_private, self.spill_path, lines)
        self._unstored.clear()
        log.warning("activation records saved for the next start: redis unavailable at shutdown",
                    count=len(held), path=str(self.spill_path))

    async def replay_spilled(self) -> int:
        """Write the records a previous run saved at ``spill_path``; returns how many. The file is removed
        only after every record is in Redis."""
        path = self.spill_path
        if path is None or not await asyncio.to_thread(path.exists):
            return 0
        raw = await asyncio.to_thread(path.read_bytes)
        count = 0
        for line in raw.splitlines():
            if not line.strip():
                continue
            try:
                activation = Activation.from_json(jsonutil.loads(line))
            except (ValueError, KeyError, TypeError):
                log.error("unreadable saved activation record skipped", path=str(path))
                continue
            await self._write_activation(activation)
            count += 1
        await asyncio.to_thread(path.unlink)
        log.info("saved activation records written to redis", count=count, path=str(path))
        return count

    async def _write_activation(self, activation: Activation) -> None:
        ns = activation.namespace
        log_bytes = sum(len(line) for line in activation.logs)
        doc = await jsonutil.adumps(activation.to_json(), size_hint=log_bytes)
        summary = jsonutil.dumps(activation_summary_json(activation))
        keys = [
            self.activation_key(ns, activation.activation_id),
            self.activations_index_key(ns),
            self.activations_index_key(ns, activation_index_path(activation)),
        ]
        args: list[str | int | bytes] = [activation.activation_id, activation.start, doc, summary,
                                         self.max_activations, self.activation_key(ns, "")]
        try:
            await self.pipeliner.call("EVALSHA", self._store_activation.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            # A fresh or restarted Redis has no scripts: this call loads it (and the pipelines after use it).
            await self._store_activation(keys=keys, args=args)

    async def get_activation(self, namespace: str, activation_id: str) -> Activation | None:
        writing = self._writing.get((namespace, activation_id))
        held = writing[0] if writing is not None else self._unstored.get((namespace, activation_id))
        if held is not None:
            return held
        doc = await self.redis.hget(self.activation_key(namespace, activation_id), "doc")
        if doc is None:
            return None
        return Activation.from_json(await jsonutil.aloads(doc))

    async def list_activations(
        self,
        namespace: str,
        *,
        name: str | None = None,
        skip: int = 0,
        limit: int = 30,
        since: int | None = None,
        upto: int | None = None,
        docs: bool = False,
    ) -> list[Activation]:
        """Newest (by ``start``) first; ``since``/``upto`` bound ``start`` in ms, both inclusive.

        Without ``docs`` the activations are summaries: no logs and no result."""
        await self._settled(namespace)
        ids = await self.redis.zrevrangebyscore(
            self.activations_index_key(namespace, name),
            "+inf" if upto is None else upto,
            "-inf" if since is None else since,
            start=skip,
            num=limit,
        )
        if not ids:
            return []
        field = "doc" if docs else "summary"
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hget(self.activation_key(namespace, _text(i) or ""), field)
            raw: Sequence[bytes | None] = await pipe.execute()
        out: list[Activation] = []
        for r in raw:
            # An id can outlive its document for a moment when retention trims concurrently.
            if r is not None:
                out.append(Activation.from_json(await jsonutil.aloads(r)))
        return out

    async def count_activations(
        self,
        namespace: str,
        *,
        name: str | None = None,
        skip: int = 0,
        since: int | None = None,
        upto: int | None = None,
    ) -> int:
        await self._settled(namespace)
        n = await self.redis.zcount(
            self.activations_index_key(namespace, name),
            "-inf" if since is None else since,
            "+inf" if upto is None else upto,
        )
        return max(0, int(n) - skip)


def _append_private(path: Path, lines: Sequence[bytes]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
