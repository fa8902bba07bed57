"""A cluster of real processes on one machine: ``dilu-invoker standalone`` invokers (each its own process,
REST API and id, no embedded balancer) and ``dilu-invoker balancer`` processes, sharing one Redis, with a
GPU inventory file (control plane only). Tests drive it through the REST APIs and observe it in Redis."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import redis.asyncio as aioredis

from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.redis_embedded import redis_client
from dilu_invoker.wire import (
    Decision,
    InstanceCommand,
    InstanceRecord,
    Keys,
    RoutingTable,
    decode,
    from_stream,
    text,
)

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "cl:"
KEYS = Keys(PREFIX)

#: Short windows so scaling shows in seconds (the defaults are Dilu's 40 s).
FAST = {
    "DILU_BALANCER_TICK_S": "0.5",
    "DILU_BALANCER_REPORT_PERIOD_S": "0.5",
    "DILU_BALANCER_REPORT_TTL_S": "1.5",
    "DILU_BALANCER_LEASE_TTL_S": "1.5",
    "DILU_BALANCER_WINDOW": "10",
    "DILU_BALANCER_SCALE_OUT_SAMPLES": "6",
    "DILU_BALANCER_SCALE_IN_SAMPLES": "6",
    "DILU_BALANCER_COOLDOWN_S": "1",
    "DILU_BALANCER_SCALE_TO_ZERO_AFTER_S": "4",
    "DILU_BALANCER_ROUTE_WAIT_S": "30",
}


@dataclass
class Proc:
    name: str
    proc: asyncio.subprocess.Process
    log: Path
    api: str = ""
    holder_pid: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float, what: str = "condition") -> float:
    """Wait for ``predicate``; returns the seconds it took."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


class ProcessCluster:
    def __init__(self, tmp: Path, redis_url: str, *, inventory: Mapping[str, Any],
                 env: Mapping[str, str] | None = None) -> None:
        self.tmp = tmp
        self.redis_url = redis_url
        self.inventory = tmp / "inventory.json"
        self.inventory.write_text(json.dumps({"invokers": inventory}))
        self.env = {**os.environ, "DILU_LOG_JSON": "1", "DILU_LOG_LEVEL": "info", "DILU_REDIS_PREFIX": PREFIX,
                    "PYTHONPATH": str(ROOT), **FAST, **(env or {})}
        self.procs: list[Proc] = []
        self.redis: aioredis.Redis = redis_client(redis_url)
        token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
        self.http = aiohttp.ClientSession(headers={"Authorization": f"Basic {token}"})

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for p in self.procs:
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        for p in self.procs:
            try:
                await asyncio.wait_for(p.proc.wait(), 15)
            except TimeoutError:
                p.signal(signal.SIGKILL)
                await p.proc.wait()
        await self.http.close()
        await self.redis.aclose()

    async def _spawn(self, name: str, args: list[str], ready: str, timeout_s: float = 30.0) -> Proc:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as f:  # a new empty file: nothing to wait for
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "dilu_invoker", *args, cwd=str(ROOT), env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=f, stderr=f)
        p = Proc(name, proc, log)
        self.procs.append(p)

        async def up() -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            return any(line.get("event") == ready for line in p.lines())

        await until(up, timeout_s, f"{name} ready")
        return p

    async def invoker(self, k: int) -> Proc:
        p = await self._spawn(f"invoker{k}", [
            "standalone", "--redis-url", self.redis_url, "--id", str(k), "--invokers", "1",
            "--no-standalone-balancer", "--api-port", "0", "--data-dir", str(self.tmp / f"data{k}"),
            "--gpu-inventory", str(self.inventory)], "standalone ready")
        p.api = next(line["api"] for line in p.lines() if line.get("event") == "standalone ready")
        return p

    async def balancer(self, name: str) -> Proc:
        p = await self._spawn(name, ["balancer", "--redis-url", self.redis_url], "balancer started")
        p.holder_pid = p.proc.pid
        return p

    # -- observing ---------------------------------------------------------------------------------

    async def leader(self) -> tuple[str, int] | None:
        raw = await self.redis.get(KEYS.lease)
        if raw is None:
            return None
        holder, _, epoch = text(raw).rpartition("|")
        return holder, int(epoch)

    async def leader_pid(self) -> int | None:
        lead = await self.leader()
        return int(lead[0].split("/")[1]) if lead else None

    async def instances(self, function: str | None = None) -> list[InstanceRecord]:
        out = []
        for raw in (await self.redis.hgetall(KEYS.instances)).values():
            rec = decode(InstanceRecord, raw)
            if rec is not None and (function is None or rec.function == function):
                out.append(rec)
        return sorted(out, key=lambda r: r.id)

    async def decisions(self, function: str | None = None) -> list[Decision]:
        out = [from_stream(Decision, f) for _, f in await self.redis.xrange(KEYS.decisions)]
        return [d for d in out if function is None or d.function == function]

    async def commands(self, invoker: str) -> list[InstanceCommand]:
        return [from_stream(InstanceCommand, f) for _, f in await self.redis.xrange(KEYS.commands(invoker))]

    async def route(self, function: str) -> RoutingTable | None:
        return decode(RoutingTable, await self.redis.get(KEYS.route(function)))

    async def live(self) -> set[str]:
        names = [text(n) for n in await self.redis.smembers(KEYS.invokers)]
        return {n for n in names if await self.redis.exists(KEYS.report(n))}

    # -- driving -----------------------------------------------------------------------------------

    async def create(self, api: str, name: str, code: str, *, annotations: Mapping[str, Any],
                     concurrency: int = 1, timeout_ms: int = 60_000) -> None:
        body = {"exec": {"kind": "python:3-gpu", "code": code},
                "annotations": [{"key": k, "value": v} for k, v in annotations.items()],
                "limits": {"concurrency": concurrency, "timeout": timeout_ms, "memory": 128}}
        async with self.http.put(f"{api}/api/v1/namespaces/_/actions/{name}?overwrite=true", json=body) as r:
            assert r.status == 200, await r.text()

    async def invoke(self, api: str, name: str, params: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """A blocking invoke; (HTTP status, the activation record)."""
        async with self.http.post(f"{api}/api/v1/namespaces/_/actions/{name}?blocking=true",
                                  json=dict(params), timeout=aiohttp.ClientTimeout(total=120)) as r:
            return r.status, await r.json()


async def open_loop(cluster: ProcessCluster, apis: list[str], name: str, *, rate: float, seconds: float,
                    params: Mapping[str, Any] | None = None, start_n: int = 0,
                    ) -> list[tuple[int, int, dict[str, Any]]]:
    """Send ``rate`` invokes per second for ``seconds`` (open loop, APIs in turn); (n, status, record) each."""
    count = int(rate * seconds)
    began = time.monotonic()

    async def one(i: int) -> tuple[int, int, dict[str, Any]]:
        await asyncio.sleep(max(0.0, began + i / rate - time.monotonic()))
        n = start_n + i
        status, record = await cluster.invoke(apis[i % len(apis)], name, {**(params or {}), "n": n})
        return n, status, record

    return list(await asyncio.gather(*(one(i) for i in range(count))))
