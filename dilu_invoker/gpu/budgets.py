"""Per-GPU budgets in Redis: who holds which share of which GPU, reserved atomically with leases.

Keyspace (msgpack values; documented in docs/redis-keyspace.md)::

    {prefix}gpu:{uuid}          hash   cap          -> {node, index, name, memory_mb, sm_count, gamma, omega}
                                       r:{instance} -> {instance, function, cls, invoker, request, limit,
                                                        memory_mb, expires_ms, weights_mb, group,
                                                        shares_weights, kept}
                                       s:{instance} -> current SM share (float, written by the GPU manager)
    {prefix}node:{node}:gpus    set    uuids of the GPUs a node registered
    {prefix}gpus:seq            string the change sequence (a counter)
    {prefix}gpus:changes        zset   uuid -> the sequence of its budget's last change (`BudgetCache`)

A reservation is admitted only if, counting every unexpired reservation of the GPU,
``Σ request ≤ omega`` (1.0), ``Σ limit ≤ gamma`` (``--gpu-gamma``; by default +inf, no bound) and
``Σ memory ≤ capacity``. The check and the write are one Lua script, so two concurrent placements can never
oversubscribe a GPU. Reservations carry a lease (``expires_ms``, from Redis's own clock) that the owning
invoker renews; a dead invoker's reservations expire and are dropped by the next script that looks at that GPU.
:meth:`GpuBudgets.reconcile` lets a restarted invoker make Redis agree with the containers that really run.

Shared weights count once. A reservation may declare that ``weights_mb`` of its ``memory_mb`` are read-only
weights shared by every instance of its ``group`` on the GPU (one function revision started by one invoker,
``model.weights_group``; the models API maps them through CUDA IPC instead of copying). Of a group's live
reservations on a GPU exactly one *carries* the weights (``memory_mb`` as declared); the others are charged
``memory_mb − weights_mb`` (``shares_weights``). Every script that looks at a GPU first drops expired
reservations and gives each group whose carrier went (released or expired) a new one (the first instance
id), so the weights stay counted until the group's last reservation on the GPU is released or lapses,
whichever instance left first. ``memory_mb`` as stored is what a reservation is charged: summing it is the
budget's memory use. Reservations whose weights sizes differ belong to different groups (the weights
cannot be the same).

Kept weights (staged exit) are evictable. A reservation with ``kept`` holds only the weights a process keeps
on the GPU after its function's last instance there left (``GpuNode.keep_weights``); its invoker releases
it when a container of its own finds no room on that GPU. A reservation made with ``evict`` (the balancer,
placing on such room) is admitted as if the GPU's kept reservations were gone: their memory counts as free
and their weights are shared with no one; the invoker's own attach, which does not evict in Redis, then
finds no room, lets the kept processes of that GPU go and is admitted. A record without ``kept`` (written
before the field existed) is not kept.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast

import msgpack
import redis.asyncio as aioredis

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# The change sequence (KEYS[2], a counter) and the GPUs' last changes (KEYS[3], a sorted set uuid -> the sequence
# of its last change): a script that changed what a reader sees of a GPU's reservations or capacity calls
# bump(uuid) once, so the balancer re-reads only those GPUs (`BudgetCache`). Renewals that extend a lease and
# the SM shares do not count.
_BUMP = """
local changed = false
local function bump(uuid)
  local v = redis.call('INCR', KEYS[2])
  redis.call('ZADD', KEYS[3], v, uuid)
end
"""

# The sharing group of a record (nil: it shares nothing); settle() drops expired reservations and leaves
# every group exactly one carrier (its carrier if it has one, else its first live instance id), returning
# the live records and their instance ids in order; it sets `changed` when it wrote anything.
_SETTLE = _BUMP + """
local function gkey(r)
  local w = tonumber(r.weights_mb) or 0
  if w > 0 and type(r.group) == 'string' and r.group ~= '' then return r.group .. '#' .. w end
  return nil
end
local function carry(f, r, yes)
  if yes and r.shares_weights then
    r.memory_mb = r.memory_mb + r.weights_mb
    r.shares_weights = false
    redis.call('HSET', KEYS[1], f, cmsgpack.pack(r))
    changed = true
  elseif not yes and not r.shares_weights then
    r.memory_mb = r.memory_mb - r.weights_mb
    r.shares_weights = true
    redis.call('HSET', KEYS[1], f, cmsgpack.pack(r))
    changed = true
  end
end
local function settle()
  local live, order = {}, {}
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local f = all[i]
    if string.sub(f, 1, 2) == 'r:' then
      local r = cmsgpack.unpack(all[i + 1])
      local inst = string.sub(f, 3)
      if r.expires_ms < now then
        redis.call('HDEL', KEYS[1], f, 's:' .. inst)
        changed = true
      else
        if gkey(r) == nil then r.shares_weights = false end
        live[inst] = r
        order[#order + 1] = inst
      end
    end
  end
  table.sort(order)
  -- Keep a group's carrier (the first when there are several); a group without one: its first instance.
  local carrier = {}
  for _, inst in ipairs(order) do
    local g = gkey(live[inst])
    if g ~= nil and carrier[g] == nil and not live[inst].shares_weights then carrier[g] = inst end
  end
  for _, inst in ipairs(order) do
    local g = gkey(live[inst])
    if g ~= nil then
      if carrier[g] == nil then carrier[g] = inst end
      carry('r:' .. inst, live[inst], carrier[g] == inst)
    end
  end
  return live, order
end
"""

RESERVE = _NOW + _SETTLE + """
local skip = ARGV[1]
local capraw = redis.call('HGET', KEYS[1], 'cap')
if not capraw then return {0, 'unknown GPU'} end
local cap = cmsgpack.unpack(capraw)
local live, order = settle()
local r = cmsgpack.unpack(ARGV[2])
local g = gkey(r)
local sreq, slim, smem = 0, 0, 0
r.shares_weights = false
-- Evicting (ARGV[5]): kept reservations count as gone; a group whose kept carrier goes is carried by its
-- next live member (its weights counted once more), and only live members share with the new one.
local evict = ARGV[5] == '1'
local gone, heirs = {}, {}
for _, inst in ipairs(order) do
  local o = live[inst]
  if evict and inst ~= skip and o.kept and gkey(o) ~= nil and not o.shares_weights then gone[gkey(o)] = true end
end
for _, inst in ipairs(order) do
  local o = live[inst]
  if inst ~= skip and not (evict and o.kept) then
    sreq = sreq + o.request
    slim = slim + o.limit
    smem = smem + o.memory_mb
    local og = gkey(o)
    if g ~= nil and og == g and (evict or not o.shares_weights) then r.shares_weights = true end
    if og ~= nil and gone[og] and not heirs[og] then
      heirs[og] = true
      smem = smem + o.weights_mb
    end
  end
end
if r.shares_weights then r.memory_mb = r.memory_mb - r.weights_mb end
-- A re-reservation that leaves the group whose weights it carried: the group's next instance (its heir)
-- carries them from now on, so they count in this check too.
local old = live[skip]
local heir = nil
if old ~= nil and gkey(old) ~= nil and gkey(old) ~= g and not old.shares_weights then
  for _, inst in ipairs(order) do
    if inst ~= skip and gkey(live[inst]) == gkey(old) then
      heir = inst
      break
    end
  end
end
if heir ~= nil then smem = smem + old.weights_mb end
local force = ARGV[4] == '1'
local eps = 1e-9
local refused = nil
if not force then
  if sreq + r.request > cap.omega + eps then
    refused = string.format('SM requests would reach %.3f > %.3f', sreq + r.request, cap.omega)
  elseif slim + r.limit > cap.gamma + eps then
    refused = string.format('SM limits would reach %.3f > gamma %.3f', slim + r.limit, cap.gamma)
  elseif smem + r.memory_mb > cap.memory_mb then
    local shared = ''
    if r.shares_weights then shared = string.format(' (its %d MB of weights shared)', r.weights_mb) end
    refused = string.format('memory would reach %d MB > %d MB%s', smem + r.memory_mb, cap.memory_mb, shared)
  end
end
if refused ~= nil then
  if changed then bump(ARGV[6]) end
  return {0, refused}
end
r.expires_ms = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'r:' .. skip, cmsgpack.pack(r))
if heir ~= nil then carry('r:' .. heir, live[heir], true) end
bump(ARGV[6])
local sh = 0
if r.shares_weights then sh = 1 end
return {1, string.format('%.6f %.6f %d %d %d', sreq + r.request, slim + r.limit, smem + r.memory_mb,
                         r.memory_mb, sh)}
"""

# Drops the reservation and settles the GPU: a group whose carrier it was gets a new one.
RELEASE = _NOW + _SETTLE + """
redis.call('HDEL', KEYS[1], 'r:' .. ARGV[1], 's:' .. ARGV[1])
settle()
bump(ARGV[2])
return 1
"""

# ARGV: the lease (ms), the GPU's uuid, the instances. A lease cut shorter than it was counts as a change (a
# reader that cached the reservation trusts it live until the expiry it read).
RENEW = _NOW + _BUMP + """
local n = 0
for i = 3, #ARGV do
  local f = 'r:' .. ARGV[i]
  local raw = redis.call('HGET', KEYS[1], f)
  if raw then
    local r = cmsgpack.unpack(raw)
    if r.expires_ms >= now then
      local expires = now + tonumber(ARGV[1])
      if expires < r.expires_ms then changed = true end
      r.expires_ms = expires
      redis.call('HSET', KEYS[1], f, cmsgpack.pack(r))
      n = n + 1
    end
  end
end
if changed then bump(ARGV[2]) end
return n
"""

# KEYS[4]: the node's set of GPUs; ARGV: the packed capacity, the uuid.
REGISTER = _BUMP + """
redis.call('HSET', KEYS[1], 'cap', ARGV[1])
redis.call('SADD', KEYS[4], ARGV[2])
bump(ARGV[2])
return 1
"""

# Several GPUs' hashes packed into one msgpack reply (an array of flat field/value arrays): redis-py's reply
# parser costs a round of reads per field, the balancer reads every live GPU each tick
# (docs/benchmarks/planner-scale.md). `READ_CHUNK` keys a call, so that no call holds Redis long.
READ_MANY = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGETALL', key) end
return cmsgpack.pack(out)
"""
READ_CHUNK = 1000


class BudgetError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class GpuCapacity:
    node: str
    index: int
    name: str
    memory_mb: int
    sm_count: int
    gamma: float = math.inf  # no Σ-limit bound (PlacementConfig.gamma)
    omega: float = 1.0


@dataclass(frozen=True, slots=True)
class Reservation:
    instance: str
    function: str
    cls: str
    invoker: str
    request: float
    limit: float
    memory_mb: int
    """Declared when reserving; as read back, what the reservation is charged (without the weights when
    ``shares_weights``)."""
    expires_ms: int = 0
    weights_mb: int = 0
    """How much of the declared memory is read-only weights shared with the rest of ``group`` on the GPU."""
    group: str = ""
    """The sharing group (`dilu_invoker.model.weights_group`); empty: shares nothing."""
    shares_weights: bool = False
    """Another reservation of the group carries the weights: this one is charged ``memory_mb`` without them."""
    kept: bool = False
    """Staged exit: only weights a kept process holds, which its invoker evicts for room (`reserve`'s ``evict``)."""

    def __post_init__(self) -> None:
        if self.weights_mb < 0 or self.weights_mb > self.declared_mb:
            raise ValueError(f"{self.instance}: weights_mb must be within 0..{self.declared_mb}, got {self.weights_mb}")

    @property
    def declared_mb(self) -> int:
        """The instance's whole memory need (its own allocations plus the weights)."""
        return self.memory_mb + (self.weights_mb if self.shares_weights else 0)

    @property
    def sharing_key(self) -> tuple[str, int] | None:
        """The group whose weights it counts once with (None: it shares nothing)."""
        return (self.group, self.weights_mb) if self.group and self.weights_mb > 0 else None


@dataclass(frozen=True, slots=True)
class ReserveResult:
    ok: bool
    reason: str
    sum_request: float = 0.0
    sum_limit: float = 0.0
    sum_memory_mb: int = 0
    memory_mb: int = 0
    """What the reservation is charged (its declared memory, less its weights when it shares them)."""
    shares_weights: bool = False


@dataclass(frozen=True, slots=True)
class GpuBudget:
    uuid: str
    capacity: GpuCapacity
    reservations: Mapping[str, Reservation] = field(default_factory=dict)
    shares: Mapping[str, float] = field(default_factory=dict)

    @property
    def sum_request(self) -> float:
        return sum(r.request for r in self.reservations.values())

    @property
    def sum_limit(self) -> float:
        return sum(r.limit for r in self.reservations.values())

    @property
    def sum_memory_mb(self) -> int:
        return sum(r.memory_mb for r in self.reservations.values())

    @property
    def fragmentation(self) -> float:
        """Dilu's SM fragmentation of a lit GPU: ``1 − Σ request``."""
        return max(0.0, 1.0 - self.sum_request) if self.reservations else 0.0


def _settled(reservations: dict[str, Reservation]) -> dict[str, Reservation]:
    """As the next script will leave them: a group whose carrier lapsed (and no script ran since) shows its
    first instance carrying the weights, so a reader's sum never misses them."""
    carried = {r.sharing_key for r in reservations.values() if r.sharing_key and not r.shares_weights}
    for name in sorted(reservations):
        r = reservations[name]
        if r.sharing_key is not None and r.sharing_key not in carried:
            reservations[name] = replace(r, memory_mb=r.declared_mb, shares_weights=False)
            carried.add(r.sharing_key)
    return reservations


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False)


class GpuBudgets:
    def __init__(self, client: aioredis.Redis, prefix: str = "dilu:") -> None:
        self._r = client
        self._prefix = prefix
        self._reserve = client.register_script(RESERVE)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)
        self._register = client.register_script(REGISTER)
        self._read_many = client.register_script(READ_MANY)

    def gpu_key(self, uuid: str) -> str:
        return f"{self._prefix}gpu:{uuid}"

    def node_key(self, node: str) -> str:
        return f"{self._prefix}node:{node}:gpus"

    @property
    def seq_key(self) -> str:
        """Counter: the last change of any GPU's budget (`BudgetCache`)."""
        return f"{self._prefix}gpus:seq"

    @property
    def changes_key(self) -> str:
        """Sorted set uuid → the `seq_key` value of its budget's last change."""
        return f"{self._prefix}gpus:changes"

    def _keys(self, uuid: str) -> list[str]:
        return [self.gpu_key(uuid), self.seq_key, self.changes_key]

    async def register_gpu(self, uuid: str, capacity: GpuCapacity) -> None:
        await self._register(keys=[*self._keys(uuid), self.node_key(capacity.node)],
                             args=[_pack(asdict(capacity)), uuid])

    async def reserve(self, uuid: str, reservation: Reservation, *, ttl_s: float, force: bool = False,
                      evict: bool = False) -> ReserveResult:
        """Atomically admit ``reservation`` on GPU ``uuid`` (re-reserving an instance replaces it); its
        ``memory_mb`` is the declared need, less ``weights_mb`` when its group already has them there.
        ``evict``: admit it as if the GPU's kept reservations were gone (their invoker evicts them when it
        attaches the instance); the sums returned are those after the eviction."""
        body = asdict(reservation)
        body.pop("expires_ms")
        body["memory_mb"] = reservation.declared_mb
        body.pop("shares_weights")
        if reservation.sharing_key is None:
            body["weights_mb"], body["group"] = 0, ""
        ok, detail = await self._reserve(
            keys=self._keys(uuid),
            args=[reservation.instance, _pack(body), int(ttl_s * 1000), "1" if force else "0", "1" if evict else "0",
                  uuid],
        )
        detail = detail.decode() if isinstance(detail, bytes) else str(detail)
        if not ok:
            return ReserveResult(False, detail)
        req, lim, mem, charged, shares = detail.split()
        return ReserveResult(True, "reserved", float(req), float(lim), int(mem), int(charged), shares == "1")

    async def renew(self, uuid: str, instances: Iterable[str], *, ttl_s: float) -> int:
        names = list(instances)
        if not names:
            return 0
        return int(await self._renew(keys=self._keys(uuid), args=[int(ttl_s * 1000), uuid, *names]))

    async def release(self, uuid: str, instance: str) -> None:
        """Drop the reservation; when it carried its group's weights, the group's next one carries them."""
        await self._release(keys=self._keys(uuid), args=[instance, uuid])

    async def set_shares(self, uuid: str, shares: Mapping[str, float]) -> None:
        if shares:
            await self._r.hset(self.gpu_key(uuid), mapping={f"s:{k}": _pack(float(v)) for k, v in shares.items()})

    async def get(self, uuid: str, *, include_expired: bool = False) -> GpuBudget | None:
        raw = cast("dict[bytes, bytes]", await self._r.hgetall(self.gpu_key(uuid)))
        if not raw or b"cap" not in raw:
            return None
        return self._parse(uuid, raw, await self._now_ms(), include_expired)

    async def get_many(self, uuids: Sequence[str], *, include_expired: bool = False) -> dict[str, GpuBudget | None]:
        """`get` for several GPUs in one round trip (a pipeline: the GPUs' hashes packed by `READ_MANY`, then
        Redis's clock), as the balancer reads every live GPU each tick; None where a GPU is not registered."""
        if not uuids:
            return {}
        async with self._r.pipeline(transaction=False) as pipe:
            for k in range(0, len(uuids), READ_CHUNK):
                await self._read_many(keys=[self.gpu_key(u) for u in uuids[k : k + READ_CHUNK]], client=pipe)
            pipe.time()
            *packed, (secs, micros) = await pipe.execute()
        now_ms = int(secs) * 1000 + int(micros) // 1000
        if len(uuids) <= READ_CHUNK:
            return self._parse_many(uuids, packed, now_ms, include_expired)
        # Thousands of GPUs take the event loop long enough to delay what shares it (a leader's lease renewal).
        return await asyncio.to_thread(self._parse_many, uuids, packed, now_ms, include_expired)

    @classmethod
    def _parse_many(cls, uuids: Sequence[str], packed: Sequence[bytes], now_ms: int,
                    include_expired: bool) -> dict[str, GpuBudget | None]:
        raws = [dict(zip(flat[::2], flat[1::2], strict=True)) for chunk in packed
                for flat in msgpack.unpackb(chunk, raw=True)]
        return {uuid: cls._parse(uuid, raw, now_ms, include_expired) if raw and b"cap" in raw else None
                for uuid, raw in zip(uuids, raws, strict=True)}

    @staticmethod
    def _parse(uuid: str, raw: Mapping[bytes, bytes], now_ms: int, include_expired: bool) -> GpuBudget:
        cap = GpuCapacity(**_unpack(raw[b"cap"]))
        reservations: dict[str, Reservation] = {}
        shares: dict[str, float] = {}
        for k, v in raw.items():
            key = k.decode()
            if key.startswith("r:"):
                r = Reservation(**_unpack(v))
                if include_expired or r.expires_ms >= now_ms:
                    reservations[r.instance] = r
            elif key.startswith("s:"):
                shares[key[2:]] = float(_unpack(v))
        reservations = _settled(reservations)
        return GpuBudget(uuid, cap, reservations, {k: v for k, v in shares.items() if k in reservations})

    async def node_gpus(self, node: str) -> list[str]:
        return sorted(m.decode() for m in cast("set[bytes]", await self._r.smembers(self.node_key(node))))

    async def reconcile(self, uuid: str, *, invoker: str, live: Mapping[str, Reservation], ttl_s: float) -> tuple[int, int]:
        """Make Redis agree with what runs: drop this invoker's reservations of containers that are gone,
        and re-add (forcibly: they exist) live instances whose reservation was lost. Returns
        (dropped, restored)."""
        budget = await self.get(uuid, include_expired=True)
        if budget is None:
            raise BudgetError(f"GPU {uuid} is not registered")
        dropped = 0
        for name, r in budget.reservations.items():
            if r.invoker == invoker and name not in live:
                await self.release(uuid, name)
                dropped += 1
        restored = 0
        for name, r in live.items():
            have = budget.reservations.get(name)
            if have is None or have.expires_ms < await self._now_ms():
                await self.reserve(uuid, r, ttl_s=ttl_s, force=True)
                restored += 1
        return dropped, restored

    async def _now_ms(self) -> int:
        secs, micros = await self._r.time()
        return int(secs) * 1000 + int(micros) // 1000

    async def changes_since(self, seq: int | None) -> tuple[int, set[str], int]:
        """The change sequence, the GPUs marked after ``seq`` (None: the sequence only, no GPUs) and Redis's clock
        in ms, read together in one ``MULTI`` (`BudgetCache`)."""
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.get(self.seq_key)
            pipe.zrangebyscore(self.changes_key, "+inf" if seq is None else f"({seq}", "+inf")
            pipe.time()
            raw_seq, changed, (secs, micros) = await pipe.execute()
        return (int(raw_seq or 0), {m.decode() if isinstance(m, bytes) else str(m) for m in changed},
                int(secs) * 1000 + int(micros) // 1000)



@dataclass(frozen=True, slots=True)
class _Cached:
    budget: GpuBudget | None
    read_ms: int
    """Redis's clock when it was read."""
    expires_ms: float
    """Its reservations' earliest lease end as read (renewals only push it later; inf: none)."""


class BudgetCache:
    """The balancer's read of every live GPU's budget each tick, re-reading only the GPUs whose budget may have
    changed since: those the scripts bumped in the change set (``gpus:changes`` past the sequence last seen),
    those with a reservation whose lease as read has passed (renewals, which extend leases, do not bump), those
    not read for ``max_age_s`` (a writer that does not bump: an older version during an upgrade), and all of
    them when the sequence went back (Redis lost its data). What it returns equals `GpuBudgets.get_many`'s
    answer but for each reservation's ``expires_ms`` and the ``shares``, which are as of the GPU's last read
    (the snapshot uses neither)."""

    def __init__(self, budgets: GpuBudgets, *, max_age_s: float = 60.0) -> None:
        self._budgets = budgets
        self._max_age_ms = int(max_age_s * 1000)
        self._seq: int | None = None
        self._cached: dict[str, _Cached] = {}
        #: GPUs read from Redis by the last `get_many` (for tests and the benchmark)
        self.last_read = 0

    async def get_many(self, uuids: Sequence[str]) -> dict[str, GpuBudget | None]:
        b = self._budgets
        # (the first read reads every GPU: no need of the change set)
        seq, changed, now_ms = await b.changes_since(self._seq)
        if self._seq is None or seq < self._seq:
            self._cached = {}
        todo = []
        for uuid in uuids:
            c = self._cached.get(uuid)
            if (c is None or uuid in changed or c.expires_ms < now_ms or now_ms - c.read_ms > self._max_age_ms):
                todo.append(uuid)
        fresh = await b.get_many(todo) if todo else {}
        for uuid, budget in fresh.items():
            expires = min((r.expires_ms for r in budget.reservations.values()), default=math.inf) if budget else math.inf
            self._cached[uuid] = _Cached(budget, now_ms, expires)
        self._seq = seq
        self.last_read = len(todo)
        wanted = set(uuids)
        for uuid in [u for u in self._cached if u not in wanted]:
            del self._cached[uuid]
        return {uuid: self._cached[uuid].budget for uuid in uuids}
