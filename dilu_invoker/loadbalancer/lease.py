"""The leader lease and fenced writes.

One key, ``{prefix}bal:lease``, holds ``holder|epoch`` with a TTL. A candidate takes it only when it is
absent (the leader died or let go), and every new leader increments ``{prefix}bal:epoch``, so epochs are
unique and increasing. The leader renews the TTL well before it lapses.

Every write the leader makes (instance table, commands, routing tables, decisions) goes through one Lua
script, :data:`APPLY`, that first checks the lease still holds the leader's exact token: a leader that
paused past its lease (GC, SIGSTOP, a partition) and comes back finds its token gone and its writes
refused — it cannot undo or double the new leader's decisions. The epoch also travels inside each
command, and invokers drop commands of an epoch older than one they have obeyed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from dilu_invoker.wire import Keys, text

ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then return {0, cur} end
local epoch = redis.call('INCR', KEYS[2])
local token = ARGV[1] .. '|' .. epoch
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
return {epoch, token}
"""

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# ARGV[1]: token; then operations, each an opcode followed by its fixed number of arguments. Checked in
# full before anything is written (a script that fails half way keeps what it wrote).
APPLY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local arity = {hset = 3, hdel = 2, set = 2, xadd = 3, publish = 2, srem = 2}
local i = 2
while i <= #ARGV do
  local n = arity[ARGV[i]]
  if not n or i + n > #ARGV then return redis.error_reply('unknown operation ' .. tostring(ARGV[i])) end
  i = i + n + 1
end
i = 2
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'hset' then
    redis.call('HSET', ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
  elseif op == 'hdel' then
    redis.call('HDEL', ARGV[i + 1], ARGV[i + 2])
  elseif op == 'set' then
    redis.call('SET', ARGV[i + 1], ARGV[i + 2])
  elseif op == 'xadd' then
    redis.call('XADD', ARGV[i + 1], 'MAXLEN', '~', ARGV[i + 2], '*', 'v', ARGV[i + 3])
  elseif op == 'publish' then
    redis.call('PUBLISH', ARGV[i + 1], ARGV[i + 2])
  elseif op == 'srem' then
    redis.call('SREM', ARGV[i + 1], ARGV[i + 2])
  end
  i = i + arity[op] + 1
end
return 1
"""

Arg = str | bytes | int | float


@dataclass(frozen=True, slots=True)
class Leadership:
    epoch: int
    token: str


class Ops:
    """The writes of one tick, applied all or nothing by :meth:`LeaderLease.apply`."""

    def __init__(self) -> None:
        self.args: list[Arg] = []
        self.count = 0

    def _add(self, *args: Arg) -> None:
        self.args.extend(args)
        self.count += 1

    def hset(self, key: str, field: str, value: bytes) -> None:
        self._add("hset", key, field, value)

    def hdel(self, key: str, field: str) -> None:
        self._add("hdel", key, field)

    def set(self, key: str, value: bytes) -> None:
        self._add("set", key, value)

    def xadd(self, key: str, value: bytes, *, maxlen: int) -> None:
        self._add("xadd", key, maxlen, value)

    def publish(self, channel: str, message: str) -> None:
        self._add("publish", channel, message)

    def srem(self, key: str, member: str) -> None:
        self._add("srem", key, member)


class LeaderLease:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, holder: str, ttl_s: float) -> None:
        self.keys = keys
        self.holder = holder
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._acquire = redis.register_script(ACQUIRE)
        self._renew = redis.register_script(RENEW)
        self._release = redis.register_script(RELEASE)
        self._apply = redis.register_script(APPLY)

    async def acquire(self) -> Leadership | None:
        """Take the lease if nobody holds it; None when another leader does."""
        epoch, token = await self._acquire(keys=[self.keys.lease, self.keys.epoch], args=[self.holder, self.ttl_ms])
        if not int(epoch):
            return None
        return Leadership(int(epoch), text(token))

    async def renew(self, lead: Leadership) -> bool:
        return bool(int(await self._renew(keys=[self.keys.lease], args=[lead.token, self.ttl_ms])))

    async def release(self, lead: Leadership) -> bool:
        return bool(int(await self._release(keys=[self.keys.lease], args=[lead.token])))

    async def apply(self, lead: Leadership, ops: Ops | Sequence[Arg]) -> bool:
        """Run the writes if ``lead`` still holds the lease; False (and nothing written) otherwise."""
        args = ops.args if isinstance(ops, Ops) else list(ops)
        return bool(int(await self._apply(keys=[self.keys.lease], args=[lead.token, *args])))

    async def holder_of(self, redis: aioredis.Redis) -> tuple[str, int] | None:
        raw = await redis.get(self.keys.lease)
        if raw is None:
            return None
        holder, _, epoch = text(raw).rpartition("|")
        return holder, int(epoch)
