"""What the parts of the cluster agent share: one object instead of the same 8–13 constructor parameters.

The cluster agent (routing, forwarding, instances, reports, registry, streams) joins this invoker to the
balancer's cluster over Redis. Each part gets an :class:`Agent`: the data plane it drives, the Redis link,
the keyspace, this invoker's identity (its name and the boot id of this run), the function registry and
the GPU budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.invoker.cluster.registry import FunctionRegistry
from dilu_invoker.invoker.dataplane.core import Invoker
from dilu_invoker.wire import Keys


@dataclass(frozen=True, slots=True)
class Agent:
    invoker: Invoker
    redis: aioredis.Redis
    keys: Keys
    #: ``invoker{N}``: the name reports, commands and forwarded activations are addressed to
    name: str
    #: this run's boot id: commands and forwards meant for an earlier run are told apart by it
    boot: str
    registry: FunctionRegistry
    budgets: GpuBudgets | None = None

    @classmethod
    def of(cls, invoker: Invoker, redis: aioredis.Redis, *, prefix: str, boot: str) -> Agent:
        keys = Keys(prefix)
        return cls(invoker=invoker, redis=redis, keys=keys, name=invoker.name, boot=boot,
                   registry=FunctionRegistry(redis, keys), budgets=GpuBudgets(redis, prefix))
