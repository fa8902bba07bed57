"""Per-GPU budgets in Redis: who holds which share of which GPU, reserved atomically with leases.

Keyspace (msgpack values; documented in docs/redis-keyspace.md)::

    {prefix}gpu:{uuid}          hash   cap          -> {node, index, name, memory_mb, sm_count, gamma, omega}
                                       r:{instance} -> {instance, function, cls, invoker, request, limit,
                                                        memory_mb, expires_ms}
                                       s:{instance} -> current SM share (float, written by the GPU manager)
    {prefix}node:{node}:gpus    set    uuids of the GPUs a node registered

A reservation is admitted only if, counting every unexpired reservation of the GPU,
``Σ request ≤ omega`` (1.0), ``Σ limit ≤ gamma`` (1.5) and ``Σ memory ≤ capacity``. The check and the write
are one Lua script, so two concurrent placements can never oversubscribe a GPU. Reservations carry a lease
(``expires_ms``, from Redis's own clock) that the owning invoker renews; a dead invoker's reservations
expire and are dropped by the next script that looks at that GPU. :meth:`GpuBudgets.reconcile` lets a
restarted invoker make Redis agree with the containers that really run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import msgpack
import redis.asyncio as aioredis

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Drops expired reservations and sums the live ones, except ARGV[1]'s own (a re-reservation).
_SCAN = """
local sreq, slim, smem = 0, 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local f = all[i]
  if string.sub(f, 1, 2) == 'r:' then
    local r = cmsgpack.unpack(all[i + 1])
    local inst = string.sub(f, 3)
    if r.expires_ms < now then
      redis.call('HDEL', KEYS[1], f, 's:' .. inst)
    elseif inst ~= skip then
      sreq = sreq + r.request
      slim = slim + r.limit
      smem = smem + r.memory_mb
    end
  end
end
"""

RESERVE = _NOW + """
local skip = ARGV[1]
local capraw = redis.call('HGET', KEYS[1], 'cap')
if not capraw then return {0, 'unknown GPU'} end
local cap = cmsgpack.unpack(capraw)
""" + _SCAN + """
local r = cmsgpack.unpack(ARGV[2])
local force = ARGV[4] == '1'
local eps = 1e-9
if not force then
  if sreq + r.request > cap.omega + eps then
    return {0, string.format('SM requests would reach %.3f > %.3f', sreq + r.request, cap.omega)}
  end
  if slim + r.limit > cap.gamma + eps then
    return {0, string.format('SM limits would reach %.3f > gamma %.3f', slim + r.limit, cap.gamma)}
  end
  if smem + r.memory_mb > cap.memory_mb then
    return {0, string.format('memory would reach %d MB > %d MB', smem + r.memory_mb, cap.memory_mb)}
  end
end
r.expires_ms = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'r:' .. skip, cmsgpack.pack(r))
return {1, string.format('%.6f %.6f %d', sreq + r.request, slim + r.limit, smem + r.memory_mb)}
"""

RENEW = _NOW + """
local n = 0
for i = 2, #ARGV do
  local f = 'r:' .. ARGV[i]
  local raw = redis.call('HGET', KEYS[1], f)
  if raw then
    local r = cmsgpack.unpack(raw)
    if r.expires_ms >= now then
      r.expires_ms = now + tonumber(ARGV[1])
      redis.call('HSET', KEYS[1], f, cmsgpack.pack(r))
      n = n + 1
    end
  end
end
return n
"""


class BudgetError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class GpuCapacity:
    node: str
    index: int
    name: str
    memory_mb: int
    sm_count: int
    gamma: float = 1.5
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
    expires_ms: int = 0


@dataclass(frozen=True, slots=True)
class ReserveResult:
    ok: bool
    reason: str
    sum_request: float = 0.0
    sum_limit: float = 0.0
    sum_memory_mb: int = 0


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

    def gpu_key(self, uuid: str) -> str:
        return f"{self._prefix}gpu:{uuid}"

    def node_key(self, node: str) -> str:
        return f"{self._prefix}node:{node}:gpus"

    async def register_gpu(self, uuid: str, capacity: GpuCapacity) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(self.gpu_key(uuid), "cap", _pack(asdict(capacity)))
        pipe.sadd(self.node_key(capacity.node), uuid)
        await pipe.execute()

    async def reserve(self, uuid: str, reservation: Reservation, *, ttl_s: float, force: bool = False) -> ReserveResult:
        """Atomically admit ``reservation`` on GPU ``uuid`` (re-reserving an instance replaces it)."""
        body = asdict(reservation)
        body.pop("expires_ms")
        ok, detail = await self._reserve(
            keys=[self.gpu_key(uuid)],
            args=[reservation.instance, _pack(body), int(ttl_s * 1000), "1" if force else "0"],
        )
        detail = detail.decode() if isinstance(detail, bytes) else str(detail)
        if not ok:
            return ReserveResult(False, detail)
        req, lim, mem = detail.split()
        return ReserveResult(True, "reserved", float(req), float(lim), int(mem))

    async def renew(self, uuid: str, instances: Iterable[str], *, ttl_s: float) -> int:
        names = list(instances)
        if not names:
            return 0
        return int(await self._renew(keys=[self.gpu_key(uuid)], args=[int(ttl_s * 1000), *names]))

    async def release(self, uuid: str, instance: str) -> None:
        await self._r.hdel(self.gpu_key(uuid), f"r:{instance}", f"s:{instance}")

    async def set_shares(self, uuid: str, shares: Mapping[str, float]) -> None:
        if shares:
            await self._r.hset(self.gpu_key(uuid), mapping={f"s:{k}": _pack(float(v)) for k, v in shares.items()})

    async def get(self, uuid: str, *, include_expired: bool = False) -> GpuBudget | None:
        raw = cast("dict[bytes, bytes]", await self._r.hgetall(self.gpu_key(uuid)))
        if not raw or b"cap" not in raw:
            return None
        now_ms = await self._now_ms()
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


