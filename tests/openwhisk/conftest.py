from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from ow_support.api import NO_STORE_IDENTITY, OTHER_IDENTITY, Api, manifest_for_tests
from ow_support.runners import ScriptedRunner

from dilu_invoker.config import ApiConfig
from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.openwhisk.rest import build_api
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.store import EntityStore

ApiFactory = Callable[..., Awaitable[Api]]


@pytest.fixture
async def make_api(redis: aioredis.Redis, aiohttp_client: Any) -> ApiFactory:
    """``api = await make_api(runner=None, store_kwargs={}, **ApiConfig fields)``: the REST app over this
    test's Redis, with a :class:`ScriptedRunner` unless another runner is given."""

    async def make(*, runner: ActivationRunner | None = None, store_kwargs: dict[str, Any] | None = None,
                   store_cls: type[EntityStore] = EntityStore, drain_timeout_s: float = 2.0,
                   auth: Authenticator | None = None,
                   **cfg_fields: Any) -> Api:
        cfg = dataclasses.replace(ApiConfig(), **cfg_fields)
        store = store_cls(redis, prefix="test:", **(store_kwargs or {}))
        runner = runner or ScriptedRunner()
        auth = auth or Authenticator([GUEST_IDENTITY, OTHER_IDENTITY, NO_STORE_IDENTITY])
        app = build_api(cfg, store=store, runner=runner, manifest=manifest_for_tests(), auth=auth,
                        drain_timeout_s=drain_timeout_s)
        client = await aiohttp_client(app)
        return Api(client=client, store=store, runner=runner, cfg=cfg)

    return make


@pytest.fixture
async def api(make_api: ApiFactory) -> Api:
    return await make_api()
