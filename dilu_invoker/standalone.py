"""``dilu-invoker standalone``: the whole system in one process tree on one machine.

Start-up order (teardown runs in reverse, finishing every step even if one fails):
embedded Redis (unless ``--redis-url``) → entity store → per invoker (``--invokers N``, ids ``--id`` …
``--id + N − 1``): invoker (container pool) → its endpoints (``/ping``, ``/metrics``, …) → its balancer
routing (load reports, instance commands, forwarding; unless ``--no-balancer-routing``) → the embedded
balancer (unless ``--no-standalone-balancer``) → OpenWhisk REST API on 127.0.0.1:3233, which hands
activations to the invokers in turn, as a controller would.
Shutdown: stop listening → drain in-flight activations (bounded) → remove containers → stop Redis.

The REST API hands activations to the N invokers in turn, skipping disabled or stopped ones
(:class:`RoundRobin`). They share one process and event loop (each with its own pool, endpoints, id and routing):
action containers are child processes either way, and one loop keeps a demo on a small machine cheap.
Several ``dilu-invoker standalone --invokers 1 --id K --redis-url …`` processes sharing one Redis form the
same cluster with real process boundaries (the integration tests run it that way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import itertools
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import structlog
from aiohttp import web

from dilu_invoker import logs
from dilu_invoker.banner import standalone_banner
from dilu_invoker.config import Config
from dilu_invoker.gpu.budgets import GpuBudgets
from dilu_invoker.health import HEALTH, add_invoker_health
from dilu_invoker.invoker.api import ActivationRunner, InvokerOverloaded
from dilu_invoker.invoker.cluster.reports import gpu_view_of
from dilu_invoker.invoker.cluster.routing import devices_for, enable_balancer_routing
from dilu_invoker.invoker.dataplane.core import Invoker, open_invoker
from dilu_invoker.invoker.dataplane.model_preload import ModelPreloader, ModelPreloads, budget_room
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.invoker.server import build_app as build_invoker_app
from dilu_invoker.invoker.server import invoker_credentials, serve_app
from dilu_invoker.loadbalancer.service import Balancer, open_balancer
from dilu_invoker.model import Activation, ActivationRequest
from dilu_invoker.openwhisk.rest import build_api
from dilu_invoker.openwhisk.rest_actions import ActionFit
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.openwhisk.rest_common import serve_api
from dilu_invoker.redis_embedded import open_redis_with_health
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
    #: each invoker's endpoint server (``/ping``, ``/invoker/...``), in invoker order
    endpoints: tuple[web.AppRunner, ...] = ()
    #: model pre-loading of actions stored through the REST API (dataplane/model_preload.py)
    model_preloads: ModelPreloads | None = None


def _is_enabled(invoker: Invoker) -> bool:
    return invoker.enabled


class RoundRobin:
    """Hands activations to several invokers in turn (what OpenWhisk's controller does across invokers),
    skipping the ones that are disabled (``/invoker/disable``) or down. An activation an invoker refuses
    because it went down meanwhile (its queue is dropped when it stops) goes to the next one; one that was
    running there ends with that invoker's error record. No invoker enabled: :class:`InvokerOverloaded`
    (the API answers 503, retry)."""

    def __init__(self, runners: Sequence[ActivationRunner], invokers: Sequence[Invoker]) -> None:
        self._pairs = list(zip(runners, invokers, strict=True))
        self._turn = itertools.count()

    def _pick(self) -> tuple[ActivationRunner, Invoker]:
        start = next(self._turn)
        for i in range(len(self._pairs)):
            runner, invoker = self._pairs[(start + i) % len(self._pairs)]
            if invoker.enabled:
                return runner, invoker
        raise InvokerOverloaded("no invoker is enabled")

    async def run(self, req: ActivationRequest) -> Activation:
        for _ in self._pairs:
            runner, invoker = self._pick()
            try:
                return await runner.run(req)
            except InvokerOverloaded:
                if invoker.enabled:
                    raise  # a full queue: back-pressure to the client
        raise InvokerOverloaded("no invoker is enabled")


# --------------------------------------------------------------------------------------------
# The data directory: one standalone at a time, private to its user
# --------------------------------------------------------------------------------------------

LOCK_FILE = "standalone.lock"


class DataDirInUse(OSError):
    """Another standalone holds the data directory's lock."""


def _holder_pid(lock_path: Path) -> str:
    try:
        return lock_path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def secure_data_dir(path: Path) -> None:
    """Make the data directory 0700 and what the standalone keeps in it 0600 (dirs 0700), including what
    an older version left with looser modes: it holds all action code, parameters, results and the
    Redis and invoker passwords."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    redis_dir = path / "redis"
    ours = [p for p in path.iterdir() if p.is_file() and not p.is_symlink()
            and (p.name.endswith("-credentials") or p.suffix in (".jsonl", ".lock"))]
    if redis_dir.is_dir() and not redis_dir.is_symlink():
        os.chmod(redis_dir, 0o700)
        for root, dirs, files in os.walk(redis_dir):
            for d in dirs:
                os.chmod(Path(root) / d, 0o700)
            ours += [Path(root) / f for f in files]
    for file in ours:
        if not file.is_symlink():
            os.chmod(file, 0o600)


@contextlib.contextmanager
def lock_data_dir(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the block (``flock``: released by the kernel however the
    process ends); raise :class:`DataDirInUse` naming the holder's pid when another process has it."""
    secure_data_dir(path)
    lock_path = path / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataDirInUse(f"data dir {path} is in use by another dilu-invoker standalone "
                               f"(pid {_holder_pid(lock_path)})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)
def _action_fit(cfg: Config, invokers: Sequence[Invoker]) -> ActionFit:
    """What the invokers of this standalone can ever run: PUT refuses actions whose limits exceed it."""
    each = [tuple(getattr(inv.gpu, "devices", ())) if inv.gpu is not None else () for inv in invokers]
    gpus = [d for devices in each for d in devices]
    largest = max(gpus, key=lambda d: d.memory_mb, default=None)
    return ActionFit(user_memory_mb=cfg.invoker.user_memory_mb,
                     gpu_memory_mb=largest.memory_mb if largest is not None else None,
                     gpu_name=f"GPU {largest.index} {largest.name}" if largest is not None else "",
                     invoker_gpus=max((len(devices) for devices in each), default=0), gangs=cfg.balancer.routing)


@contextlib.asynccontextmanager
async def run_standalone(cfg: Config) -> AsyncIterator[Running]:
    manifest = Manifest.load(cfg.invoker.runtimes_manifest)
    async with contextlib.AsyncExitStack() as stack:
        stack.enter_context(lock_data_dir(cfg.data_path))
        redis, health = await stack.enter_async_context(open_redis_with_health(cfg.redis, data_dir=cfg.data_path))
        # Records Redis could not take by shutdown are saved here and written back at the next start.
        store = EntityStore.from_config(redis, cfg.redis, spill_path=cfg.data_path / "unstored-activations.jsonl")
        await store.replay_spilled()
        stack.push_async_callback(store.close)
        n = cfg.standalone.invokers
        invokers: list[Invoker] = []
        urls: list[str] = []
        runners: list[ActivationRunner] = []
        endpoints: list[web.AppRunner] = []
        first_credentials: tuple[str, str] | None = None
        preloaders: list[ModelPreloader] = []
        for k in range(n):
            icfg = replace(cfg, invoker=replace(cfg.invoker, id=cfg.invoker.id + k,
                                                port=cfg.invoker.port + k if cfg.invoker.port else 0))
            invoker = await stack.enter_async_context(open_invoker(icfg, manifest=manifest, redis=redis, slot=k,
                                                                   invokers=n))
            credentials = invoker_credentials(icfg)
            first_credentials = first_credentials or credentials
            inv_app = build_invoker_app(invoker, user=credentials[0], password=credentials[1])
            add_invoker_health(inv_app, health, enabled=partial(_is_enabled, invoker))
            inv_runner, inv_port = await serve_app(inv_app, icfg.invoker.host, icfg.invoker.port)
            stack.push_async_callback(inv_runner.cleanup)
            endpoints.append(inv_runner)
            runner: ActivationRunner = invoker
            if cfg.balancer.routing:
                runner = await stack.enter_async_context(enable_balancer_routing(
                    invoker, icfg, redis=redis, devices=devices_for(icfg, slot=k, invokers=n),
                    gpu_view=gpu_view_of(invoker.gpu)))
            preloaders.append(ModelPreloader(invoker, cap_mb=icfg.invoker.model_preload_mb, room=budget_room(
                GpuBudgets(redis, prefix=cfg.redis.prefix), getattr(invoker.gpu, "devices", ()))))
            invokers.append(invoker)
            urls.append(f"http://{icfg.invoker.host}:{inv_port}")
            runners.append(runner)
        balancer = None
        if cfg.standalone.balancer:
            balancer = await stack.enter_async_context(open_balancer(cfg, redis))
        front: ActivationRunner = runners[0] if n == 1 else RoundRobin(runners, invokers)
        # Closed before the invokers (and after the API stops taking changes): what it holds goes with them.
        model_preloads = ModelPreloads(preloaders)
        stack.push_async_callback(model_preloads.close)
        api = build_api(cfg.api, store=store, runner=front, manifest=manifest, auth=Authenticator.from_config(cfg.api),
                        action_fit=_action_fit(cfg, invokers),
                        action_listener=model_preloads if model_preloads.enabled else None)
        api[HEALTH] = health
        api_runner, api_port = await serve_api(api, cfg.api.host, cfg.api.port)
        stack.push_async_callback(api_runner.cleanup)
        assert first_credentials is not None
        running = Running(f"http://{cfg.api.host}:{api_port}", urls[0], invokers[0], first_credentials,
                          tuple(invokers), tuple(urls), tuple(runners), balancer, tuple(endpoints), model_preloads)
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
    async with run_standalone(cfg) as running:
        if sys.stdout.isatty():
            print(standalone_banner(cfg, running.api_url), flush=True)
        await stop.wait()
    return 0


def main(cfg: Config, args: argparse.Namespace | None = None) -> int:
    logs.configure(cfg.log)
    try:
        return asyncio.run(_main(cfg))
    except DataDirInUse as exc:
        print(f"dilu-invoker standalone: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        log.error("standalone could not start", error=str(exc))
        return 1


