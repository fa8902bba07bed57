"""``dilu-invoker standalone``: the whole system in one process tree on one machine.

Start-up order (teardown runs in reverse, finishing every step even if one fails):
embedded Redis (unless ``--redis-url``) → entity store → per invoker (``--invokers N``, ids ``--id`` …
``--id + N − 1``): invoker (container pool) → its endpoints (``/ping``, ``/metrics``, …) → its balancer
routing (load reports, instance commands, forwarding; unless ``--no-balancer-routing``) → the embedded
balancer (unless ``--no-standalone-balancer``) → OpenWhisk REST API on 127.0.0.1:3233, which hands
activations to the invokers in turn, as a controller would.
Shutdown: stop listening → drain in-flight activations (bounded) → remove containers → stop Redis.

The N invokers share one process and event loop (each with its own pool, endpoints, id and routing):
action containers are child processes either way, and one loop keeps a demo on a small machine cheap.
Several ``dilu-invoker standalone --invokers 1 --id K --redis-url …`` processes sharing one Redis form the
same cluster with real process boundaries (the integration tests run it that way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

import structlog

from dilu_invoker import logs
from dilu_invoker.config import Config
from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.invoker.cluster.reports import gpu_view_of
from dilu_invoker.invoker.cluster.routing import devices_for, enable_balancer_routing
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.invoker.server import build_app as build_invoker_app
from dilu_invoker.invoker.server import invoker_credentials, serve_app
from dilu_invoker.loadbalancer.service import Balancer, open_balancer
from dilu_invoker.model import Activation, ActivationRequest
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
    invokers: tuple[Invoker, ...] = ()
    invoker_urls: tuple[str, ...] = ()
    runners: tuple[ActivationRunner, ...] = ()
    balancer: Balancer | None = None


class RoundRobin:
    """Hands activations to several invokers in turn (what OpenWhisk's controller does across invokers)."""

    def __init__(self, runners: Sequence[ActivationRunner]) -> None:
        self._next = itertools.cycle(runners)

    async def run(self, req: ActivationRequest) -> Activation:
        return await next(self._next).run(req)


@contextlib.asynccontextmanager
async def run_standalone(cfg: Config) -> AsyncIterator[Running]:
    cfg.data_path.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(cfg.invoker.runtimes_manifest)
    async with contextlib.AsyncExitStack() as stack:
        redis = await stack.enter_async_context(open_redis(cfg.redis, data_dir=cfg.data_path))
        store = EntityStore.from_config(redis, cfg.redis)
        n = cfg.standalone.invokers
        invokers: list[Invoker] = []
        urls: list[str] = []
        runners: list[ActivationRunner] = []
        first_credentials: tuple[str, str] | None = None
        for k in range(n):
            icfg = replace(cfg, invoker=replace(cfg.invoker, id=cfg.invoker.id + k,
                                                port=cfg.invoker.port + k if cfg.invoker.port else 0))
            invoker = await stack.enter_async_context(open_invoker(icfg, manifest=manifest, redis=redis))
            credentials = invoker_credentials(icfg)
            first_credentials = first_credentials or credentials
            inv_runner, inv_port = await serve_app(
                build_invoker_app(invoker, user=credentials[0], password=credentials[1]),
                icfg.invoker.host, icfg.invoker.port)
            stack.push_async_callback(inv_runner.cleanup)
            runner: ActivationRunner = invoker
            if cfg.balancer.routing:
                runner = await stack.enter_async_context(enable_balancer_routing(
                    invoker, icfg, redis=redis, devices=devices_for(icfg, invoker_id=icfg.invoker.id, invokers=n),
                    gpu_view=gpu_view_of(invoker.gpu)))
            invokers.append(invoker)
            urls.append(f"http://{icfg.invoker.host}:{inv_port}")
            runners.append(runner)
        balancer = None
        if cfg.standalone.balancer:
            balancer = await stack.enter_async_context(open_balancer(cfg, redis))
        front: ActivationRunner = runners[0] if n == 1 else RoundRobin(runners)
        api = build_api(cfg.api, store=store, runner=front, manifest=manifest, auth=Authenticator.from_config(cfg.api))
        api_runner, api_port = await serve_app(api, cfg.api.host, cfg.api.port)
        stack.push_async_callback(api_runner.cleanup)
        assert first_credentials is not None
        running = Running(f"http://{cfg.api.host}:{api_port}", urls[0], invokers[0], first_credentials,
                          tuple(invokers), tuple(urls), tuple(runners), balancer)
        log.info("standalone ready", api=running.api_url, invokers=urls, balancer=balancer is not None,
                 routing=cfg.balancer.routing, backend=cfg.invoker.backend, kinds=manifest.kinds,
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


