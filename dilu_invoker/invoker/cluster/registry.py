"""The GPU function registry in Redis: what routers saw of each GPU action, for the balancer and for the
invokers that start its instances.

A router registers an action the first time it sees its revision (``{prefix}fn:{fqn}``: ``rev``, ``doc``
— the action JSON with its code —, ``meta`` — its :class:`~dilu_invoker.wire.FunctionSpec`) and adds the
name to ``{prefix}fns``. A registration never replaces a newer revision with an older one (revisions are
``generation-hash``), so a router still holding an old copy of an updated action cannot flap it back.
An invoker told to start an instance loads the action from here, so instances work the same whatever
store the front reads actions from (the standalone Redis store, CouchDB in cluster mode).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import redis.asyncio as aioredis

from dilu_invoker import jsonutil
from dilu_invoker.model import Action
from dilu_invoker.wire import FunctionSpec, Keys, pack, revision_generation, text

REGISTER = """
local cur = redis.call('HGET', KEYS[1], 'rev')
if cur == ARGV[1] then return 0 end
if cur then
  local g = tonumber(string.match(cur, '^(%d+)-') or '0')
  if g > tonumber(ARGV[2]) then return -1 end
end
redis.call('HSET', KEYS[1], 'rev', ARGV[1], 'doc', ARGV[3], 'meta', ARGV[4])
redis.call('SADD', KEYS[2], ARGV[5])
return 1
"""


class FunctionRegistry:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, cache_size: int = 128) -> None:
        self.redis = redis
        self.keys = keys
        self._register = redis.register_script(REGISTER)
        self._specs: dict[str, FunctionSpec] = {}
        self._actions: OrderedDict[tuple[str, str], Action] = OrderedDict()
        self._cache_size = cache_size

    async def ensure(self, action: Action) -> FunctionSpec:
        """The action's spec, registered in Redis unless this revision already is.

        Raises :class:`~dilu_invoker.model.ValidationError` when its GPU annotations are invalid."""
        rev = action.revision or ""
        cached = self._specs.get(action.fqn)
        if cached is not None and cached.rev == rev:
            return cached
        spec = FunctionSpec.of(action)
        doc = await jsonutil.adumps(action.to_json(), size_hint=len(action.exec.code or ""))
        await self._register(keys=[self.keys.function(action.fqn), self.keys.functions],
                             args=[rev, revision_generation(rev), doc, pack(spec), action.fqn])
        self._specs[action.fqn] = spec
        self._remember(action.fqn, rev, action)
        return spec

    async def load(self, fqn: str) -> Action | None:
        """The registered (newest) revision of a function's action; None when it was never registered."""
        raw_rev = await self.redis.hget(self.keys.function(fqn), "rev")
        if raw_rev is None:
            return None
        rev = text(raw_rev)
        cached = self._actions.get((fqn, rev))
        if cached is not None:
            return cached
        raw_rev, raw_doc = await self.redis.hmget(self.keys.function(fqn), ["rev", "doc"])
        if raw_rev is None or raw_doc is None:
            return None
        rev = text(raw_rev)
        action = replace(Action.from_json(await jsonutil.aloads(raw_doc)), revision=rev or None)
        self._remember(fqn, rev, action)
        return action

    def _remember(self, fqn: str, rev: str, action: Action) -> None:
        self._actions[(fqn, rev)] = action
        self._actions.move_to_end((fqn, rev))
        while len(self._actions) > self._cache_size:
            self._actions.popitem(last=False)
