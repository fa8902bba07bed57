"""``dilu-invoker invoker --id N``: this node's invoker core behind OpenWhisk's Kafka/CouchDB front.

The wiring is deliberately thin: :func:`build_front` turns the configuration into a
:class:`~dilu_invoker.openwhisk.cluster.ClusterFront` around any
:class:`~dilu_invoker.invoker.api.ActivationRunner`; :func:`serve` runs it until ``stop`` is set;
:func:`main` opens the invoker core (container pool and backend), serves its endpoints (``/ping``,
``/metrics``, ``/invoker/enable|disable``, ``/isEnabled``) and the front until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from dilu_invoker import logs
from dilu_invoker.config import Config, ConfigError
from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.invoker.manifest import Manifest, ManifestError
from dilu_invoker.openwhisk.cluster import ClusterFront, EnabledControl, FrontOptions
from dilu_invoker.openwhisk.couchdb import ActionStore, ActivationStore, CouchClient
from dilu_invoker.openwhisk.kafka import KafkaBus, Topics
from dilu_invoker.openwhisk.messages import InvokerInstance
from dilu_invoker.openwhisk.routing import GpuImages, LocalRouter, Router, split_list

if TYPE_CHECKING:
    from dilu_invoker.invoker.cluster.routing import BalancedRunner
    from dilu_invoker.invoker.dataplane.core import Invoker
    from dilu_invoker.redis_embedded import RedisHealth

log = structlog.get_logger(__name__)

#: ``MemoryLimit.MIN_MEMORY``: OpenWhisk's peek size is userMemory / 128 MB containers.
MIN_ACTION_MEMORY_MB = 128


def front_options(cfg: Config, manifest: Manifest) -> FrontOptions:
    """The front's settings; raises ConfigError for what cannot work."""
    if not cfg.kafka.hosts:
        raise ConfigError("Kafka is not configured: set --kafka-hosts or KAFKA_HOSTS")
    if not cfg.couchdb.host:
        raise ConfigError("CouchDB is not configured: set --couchdb-host or CONFIG_whisk_couchdb_host")
    inv = cfg.invoker
    if inv.id < 0:
        raise ConfigError("--id must be >= 0")
    instance = InvokerInstance(
        instance=inv.id,
        user_memory_bytes=inv.user_memory_mb * 1024 * 1024,
        unique_name=inv.unique_name or str(inv.id),
        tags=split_list(inv.tags),
        dedicated_namespaces=split_list(inv.dedicated_namespaces),
    )
    try:
        gpu = GpuImages.parse(inv.gpu_images, manifest=manifest)
    except ValueError as exc:
        raise ConfigError(f"--invoker-gpu-images: {exc}") from exc
    return FrontOptions(
        instance=instance,
        topics=Topics(prefix=cfg.kafka.topic_prefix, user_event_prefix=cfg.kafka.user_event_prefix),
        max_peek=max(1, inv.user_memory_mb // MIN_ACTION_MEMORY_MB),
        fetch_max_wait_ms=cfg.kafka.fetch_max_wait_ms,
        user_events=cfg.kafka.user_events,
        gpu=gpu,
    )


def build_front(
    cfg: Config,
    *,
    runner: ActivationRunner,
    manifest: Manifest,
    control: EnabledControl | None = None,
    router: Router | None = None,
) -> ClusterFront:
    options = front_options(cfg, manifest)
    bus = KafkaBus(cfg.kafka, client_id=f"invoker{cfg.invoker.id}",
                   replication_factor=cfg.kafka.replication_factor)
    couch = CouchClient(cfg.couchdb)
    return ClusterFront(
        options,
        bus=bus,
        couch=couch,
        actions=ActionStore(couch, cfg.whisks_db, manifest=manifest),
        activations=ActivationStore(couch, cfg.activations_db),
        router=router or LocalRouter(runner),
        control=control,
    )


async def serve(
    cfg: Config,
    *,
    runner: ActivationRunner,
    manifest: Manifest,
    stop: asyncio.Event,
    control: EnabledControl | None = None,
    router: Router | None = None,
) -> None:
    """Run the front around ``runner`` until ``stop`` is set, then shut it down in order."""
    front = build_front(cfg, runner=runner, manifest=manifest, control=control, router=router)
    async with front:
        log.info("invoker.serving", instance=str(front.instance), kafka=cfg.kafka.hosts,
                 couchdb=f"{cfg.couchdb.host}:{cfg.couchdb.port}", max_peek=front.options.max_peek)
        await stop.wait()
        log.info("invoker.stopping", in_work=front.in_work)


def stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def endpoint_app(cfg: Config, invoker: Invoker, health: RedisHealth | None) -> web.Application:
    """The invoker's endpoints, secured as in standalone mode. With a Redis (``--redis-url``: GPU budgets,
    balancer routing) ``health`` watches it: ``GET /ping`` answers 503 ``unhealthy: <reason>`` while it
    does not answer and ``pong`` again once it does, ``GET /invoker/health`` says why (``dilu_invoker/health.py``;
    without a Redis, ``"redis": null``).
    The health pings on Kafka are unchanged: the controller keeps routing to an invoker whose Redis is down
    (it still runs CPU actions and admits GPU work against its own view)."""
    from dilu_invoker.health import add_invoker_health
    from dilu_invoker.invoker.server import build_app, invoker_credentials

    user, password = invoker_credentials(cfg)
    app = build_app(invoker, user=user, password=password)
    add_invoker_health(app, health, enabled=lambda: invoker.enabled)
    return app


async def _main(cfg: Config) -> int:
    manifest = Manifest.load(cfg.invoker.runtimes_manifest)
    front_options(cfg, manifest)  # refuse a bad configuration before starting any container

    # Imported here so that the front (and its tests) do not need the container backends. The control
    # endpoints are served and secured exactly as in standalone mode.
    from dilu_invoker.invoker.dataplane.core import open_invoker
    from dilu_invoker.invoker.server import invoker_credentials, serve_app

    stop = stop_on_signals()
    # Teardown in reverse: the front stops taking work and drains its acks first, then the endpoints
    # close, then the container pool drains and removes its containers.
    async with contextlib.AsyncExitStack() as stack:
        # GPU budgets live in Redis when one is configured; without it the node admits against its own view.
        redis = None
        health = None
        if cfg.redis.url:
            from dilu_invoker.redis_embedded import RedisHealth, configured_client

            redis = configured_client(cfg.redis.url, cfg.redis)
            stack.push_async_callback(redis.aclose)
            health = await stack.enter_async_context(RedisHealth(cfg.redis.url))
        invoker = await stack.enter_async_context(open_invoker(cfg, manifest=manifest, redis=redis))
        user, _password = invoker_credentials(cfg)
        http, port = await serve_app(endpoint_app(cfg, invoker, health), cfg.invoker.host, cfg.invoker.port)
        stack.push_async_callback(http.cleanup)
        log.info("invoker.endpoints", url=f"http://{cfg.invoker.host}:{port}", user=user,
                 backend=cfg.invoker.backend, kinds=manifest.kinds)
        if cfg.redis.url and cfg.balancer.routing:
            # GPU routing mode (a), "all-dilu": GPU activations go to the instances the balancer placed,
            # wherever they run; this invoker still acks to the controller itself.
            from dilu_invoker.invoker.cluster.reports import gpu_view_of
            from dilu_invoker.invoker.cluster.routing import enable_balancer_routing

            assert redis is not None
            routed = await stack.enter_async_context(enable_balancer_routing(
                invoker, cfg, redis=redis, gpu_view=gpu_view_of(invoker.gpu)))
            log.info("invoker.balancer_routing", redis=cfg.redis.url.rsplit("@", 1)[-1])
            await stack.enter_async_context(_model_preloads(cfg, invoker, routed, manifest=manifest))
            await serve(cfg, runner=routed, manifest=manifest, stop=stop, control=invoker, router=routed)
        else:
            await serve(cfg, runner=invoker, manifest=manifest, stop=stop, control=invoker)
    return 0


@contextlib.asynccontextmanager
async def _model_preloads(cfg: Config, invoker: Invoker, routed: BalancedRunner, *,
                          manifest: Manifest) -> AsyncIterator[None]:
    """The balancer's model pre-load commands (openwhisk/preload_commands.py), the action read from CouchDB
    through a client of their own."""
    from dilu_invoker.openwhisk.preload_commands import preload_commands

    couch = CouchClient(cfg.couchdb)
    try:
        async with preload_commands(invoker, routed.instances, ActionStore(couch, cfg.whisks_db, manifest=manifest),
                                    cap_mb=cfg.invoker.model_preload_mb, gpu=front_options(cfg, manifest).gpu) as commands:
            log.info("invoker.model_preload", enabled=commands.preloads.enabled,
                     reason=commands.preloader.why_off or None, cap_mb=cfg.invoker.model_preload_mb)
            yield
    finally:
        await couch.close()


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    logs.configure(cfg.log)
    try:
        return asyncio.run(_main(cfg))
    except (ConfigError, ManifestError, OSError) as exc:
        log.error("invoker.bad_configuration", error=str(exc))
        print(f"dilu-invoker invoker: {exc}", file=sys.stderr)
        return 2
