"""What the REST layer alone costs: warm blocking invokes through the standalone API with a runner that
answers at once (no container), over a real embedded Redis.

    python bench/rest_api_overhead.py [--requests 2000] [--concurrency 32]

Prints p50/p99 latency of sequential ``?blocking=true&result=true`` invokes and the throughput of
``--concurrency`` clients, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import aiohttp
from aiohttp import web

from dilu_invoker.config import ApiConfig
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import (
    GUEST_IDENTITY,
    Activation,
    ActivationRequest,
    ActivationResponse,
    now_ms,
)
from dilu_invoker.openwhisk.rest import build_api
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.redis_embedded import EmbeddedRedis, redis_client
from dilu_invoker.store import EntityStore

MANIFEST = {"runtimes": {"python": [{"kind": "python:3", "default": True, "image": {"name": "python"}}]}}


class InstantRunner:
    async def run(self, req: ActivationRequest) -> Activation:
        t = now_ms()
        return Activation(namespace=req.identity.namespace, name=req.action.name, subject=req.identity.subject,
                          activation_id=req.activation_id, start=t, end=t,
                          response=ActivationResponse.success({"ok": True}))


async def main(requests: int, concurrency: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis(tmp, persistent=False) as server:
            client = redis_client(server.url)
            app = build_api(ApiConfig(), store=EntityStore(client), runner=InstantRunner(),
                            manifest=Manifest.from_json(MANIFEST), auth=Authenticator([GUEST_IDENTITY]))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            base = f"http://127.0.0.1:{port}/api/v1/namespaces/_/actions/noop"
            auth = aiohttp.BasicAuth(GUEST_IDENTITY.uuid, GUEST_IDENTITY.key)
            async with aiohttp.ClientSession(auth=auth) as http:
                async with http.put(base, json={"exec": {"kind": "python:3", "code": "def main(a): return a"}}) as r:
                    assert r.status == 200, await r.text()
                url = base + "?blocking=true&result=true"

                async def one() -> float:
                    t0 = time.perf_counter()
                    async with http.post(url, json={}) as r:
                        await r.read()
                        assert r.status == 200
                    return time.perf_counter() - t0

                for _ in range(100):  # warm up
                    await one()
                lat = [await one() for _ in range(requests)]
                t0 = time.perf_counter()

                async def worker(n: int) -> None:
                    for _ in range(n):
                        await one()

                per = max(1, requests // concurrency)
                await asyncio.gather(*(worker(per) for _ in range(concurrency)))
                elapsed = time.perf_counter() - t0
            await runner.cleanup()
            await client.aclose()
    q = statistics.quantiles(lat, n=100)
    return {"p50_ms": round(q[49] * 1000, 3), "p99_ms": round(q[98] * 1000, 3),
            "throughput_rps": round(per * concurrency / elapsed, 1), "concurrency": concurrency}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.requests, args.concurrency))))
