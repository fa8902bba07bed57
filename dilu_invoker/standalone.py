"""``dilu-invoker standalone``: the whole system in one process tree on one machine.

Start-up order (teardown runs in reverse, finishing every step even if one fails):
embedded Redis (unless ``--redis-url``) → entity store → GPU node manager → invoker (container pool) →
invoker endpoints (``/ping``, ``/metrics``, …) → OpenWhisk REST API on 127.0.0.1:3233.
Shutdown: stop listening → drain in-flight activations (bounded) → remove containers → stop Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog

from dilu_invoker import logs
from dilu_invoker.config import Config
from dilu_invoker.invoker.core import Invoker, open_invoker
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.invoker.server import build_app as build_invoker_app
from dilu_invoker.invoker.server import invoker_credentials, serve_app
from dilu_invoker.openwhisk.rest import build_api
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.redis_embedded import open_redis
from dilu_invoker.store import EntityStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Running:
    api_url: str
    invoker_url: str
    invoker: Invoker
    credentials: tuple[str, str]


@contextlib.asynccontextmanager
async def run_standalone(cfg: Config) -> AsyncIterator[Running]:
    cfg.data_path.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(cfg.invoker.runtimes_manifest)
    async with contextlib.AsyncExitStack() as stack:
        redis = await stack.enter_async_context(open_redis(cfg.redis, data_dir=cfg.data_path))
        store = EntityStore.from_config(redis, cfg.redis)
        invoker = await stack.enter_async_context(open_invoker(cfg, manifest=manifest, redis=redis))
        credentials = invoker_credentials(cfg)
        inv_runner, inv_port = await serve_app(build_invoker_app(invoker, user=credentials[0], password=credentials[1]),
                                                cfg.invoker.host, cfg.invoker.port)
        stack.push_async_callback(inv_runner.cleanup)
        api = build_api(cfg.api, store=store, runner=invoker, manifest=manifest, auth=Authenticator.from_config(cfg.api))
        api_runner, api_port = await serve_app(api, cfg.api.host, cfg.api.port)
        stack.push_async_callback(api_runner.cleanup)
        running = Running(f"http://{cfg.api.host}:{api_port}", f"http://{cfg.invoker.host}:{inv_port}", invoker,
                          credentials)
        log.info("standalone ready", api=running.api_url, invoker=running.invoker_url,
                 backend=cfg.invoker.backend, kinds=manifest.kinds,
                 credentials_file=str(cfg.data_path / f"invoker{cfg.invoker.id}-credentials"))
        yield running
        log.info("standalone shutting down")


async def _main(cfg: Config) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with run_standalone(cfg):
        await stop.wait()
    return 0


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    logs.configure(cfg.log)
    try:
        return asyncio.run(_main(cfg))
    except OSError as exc:
        log.error("standalone could not start", error=str(exc))
        return 1


