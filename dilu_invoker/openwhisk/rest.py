"""The OpenWhisk-compatible REST API of ``dilu-invoker standalone`` (the subset ``wsk`` and the
``openwhisk`` npm client use); ``docs/rest-api.md`` lists every endpoint, parameter and error.

:func:`build_api` returns the aiohttp application; the caller owns the store, the runner and the server.
"""

from __future__ import annotations

import asyncio
import importlib.resources
from collections.abc import AsyncIterator
from typing import Any

import structlog
from aiohttp import web

from dilu_invoker import __version__
from dilu_invoker.config import ApiConfig
from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import LimitBounds
from dilu_invoker.openwhisk import rest_actions, rest_activations, rest_entities
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.openwhisk.rest_common import (
    AUTH,
    CONFIG,
    MANIFEST,
    RUNNER,
    STORE,
    TASKS,
    authenticate,
    json_response,
    openwhisk_middleware,
)
from dilu_invoker.store import EntityStore

__all__ = ["AUTH", "CONFIG", "MANIFEST", "RUNNER", "STORE", "TASKS", "build_api"]

log = structlog.get_logger(__name__)

API_PREFIX = "/api/v1"
OPENAPI: web.AppKey[bytes] = web.AppKey("openapi", bytes)


def runtimes_json(manifest: Manifest) -> dict[str, list[dict[str, Any]]]:
    """The manifest as OpenWhisk's controller lists it (``ExecManifest.runtimesManifest.toJson``)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for runtime in sorted(manifest.runtimes.values(), key=lambda r: (r.family, r.kind)):
        out.setdefault(runtime.family, []).append({
            "kind": runtime.kind,
            "image": str(runtime.image),
            "deprecated": runtime.deprecated,
            "default": runtime.default,
            "attached": runtime.attached,
            "requireMain": runtime.require_main,
            "gpu": runtime.gpu,
        })
    return out


def limits_json(cfg: ApiConfig) -> dict[str, int]:
    bounds = LimitBounds()
    return {
        "min_action_duration": bounds.timeout_ms[0],
        "max_action_duration": bounds.timeout_ms[1],
        "min_action_memory": bounds.memory_mb[0] * 1024 * 1024,
        "max_action_memory": bounds.memory_mb[1] * 1024 * 1024,
        "min_action_logs": bounds.logs_mb[0] * 1024 * 1024,
        "max_action_logs": bounds.logs_mb[1] * 1024 * 1024,
        "max_action_concurrency": bounds.concurrency[1],
        "max_action_code": cfg.max_code_mb * 1024 * 1024,
        "max_parameters": cfg.max_params_kb * 1024,
    }


async def api_info(request: web.Request) -> web.Response:
    """``GET /api/v1``: no authentication, as in OpenWhisk."""
    app = request.app
    return json_response({
        "description": "OpenWhisk API",
        "api_version": "1.0.0",
        "api_version_path": "v1",
        "build": f"dilu-invoker {__version__}",
        "buildno": __version__,
        "runtimes": runtimes_json(app[MANIFEST]),
        "limits": limits_json(app[CONFIG]),
    })


async def root_info(request: web.Request) -> web.Response:
    """``GET /``: the controller's description of itself."""
    app = request.app
    return json_response({
        "description": "OpenWhisk",
        "api_paths": [API_PREFIX],
        "runtimes": runtimes_json(app[MANIFEST]),
        "limits": limits_json(app[CONFIG]),
    })


#: the OpenAPI 3 document of the served subset, in the package; served at ``GET /api/v1/api-docs``
OPENAPI_PATH = "openapi.json"


async def api_docs(request: web.Request) -> web.Response:
    """``GET /api/v1/api-docs``: the OpenAPI document (no authentication; OpenWhisk's path for its own)."""
    return json_response(None, encoded=request.app[OPENAPI])


async def list_namespaces(request: web.Request) -> web.Response:
    identity = authenticate(request)
    return json_response([identity.namespace])


def _route(app: web.Application, method: str, path: str, handler: Any) -> None:
    """``path`` and ``path/``: clients differ (the npm client adds a slash in some versions)."""
    app.router.add_route(method, path, handler)
    app.router.add_route(method, path + "/", handler)


def build_api(
    cfg: ApiConfig,
    *,
    store: EntityStore,
    runner: ActivationRunner,
    manifest: Manifest,
    auth: Authenticator,
    drain_timeout_s: float = 10.0,
    action_fit: rest_actions.ActionFit | None = None,
    action_listener: rest_actions.ActionListener | None = None,
) -> web.Application:
    """The REST application. On cleanup, activations still running for answered requests get
    ``drain_timeout_s`` to finish (and be stored) before they are cancelled."""
    app = web.Application(
        middlewares=[openwhisk_middleware],
        # Bodies are read through read_body with per-route limits; this only bounds other readers.
        client_max_size=rest_actions.put_body_limit(cfg),
    )
    app[CONFIG] = cfg
    app[STORE] = store
    app[RUNNER] = runner
    app[MANIFEST] = manifest
    app[AUTH] = auth
    if action_fit is not None:
        app[rest_actions.ACTION_FIT] = action_fit
    if action_listener is not None:
        app[rest_actions.ACTION_LISTENER] = action_listener
    running: set[asyncio.Task[Any]] = set()
    app[TASKS] = running

    async def drain(app: web.Application) -> AsyncIterator[None]:
        yield
        running_now = app[TASKS]
        tasks = set(running_now)
        if not tasks:
            return
        log.info("waiting for running activations", count=len(tasks))
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("cancelled activations still running at shutdown", count=len(pending))
            await asyncio.gather(*pending, return_exceptions=True)

    app.cleanup_ctx.append(drain)

    app.router.add_get("/", root_info)
    app.router.add_get(API_PREFIX, api_info)
    app.router.add_get(API_PREFIX + "/", api_info)
    app[OPENAPI] = importlib.resources.files("dilu_invoker.openwhisk").joinpath(OPENAPI_PATH).read_bytes()
    _route(app, "GET", f"{API_PREFIX}/api-docs", api_docs)
    _route(app, "GET", f"{API_PREFIX}/namespaces", list_namespaces)

    ns = f"{API_PREFIX}/namespaces/{{namespace}}"
    _route(app, "GET", f"{ns}/actions", rest_actions.list_actions)
    for method, handler in (
        ("GET", rest_actions.get_action),
        ("PUT", rest_actions.put_action),
        ("DELETE", rest_actions.delete_action),
        ("POST", rest_actions.invoke_action),
    ):
        _route(app, method, f"{ns}/actions/{{name}}", handler)

    _route(app, "GET", f"{ns}/activations", rest_activations.list_activations)
    _route(app, "GET", f"{ns}/activations/{{id}}", rest_activations.get_activation)
    _route(app, "GET", f"{ns}/activations/{{id}}/result", rest_activations.get_activation_result)
    _route(app, "GET", f"{ns}/activations/{{id}}/logs", rest_activations.get_activation_logs)
    rest_entities.add_routes(app, API_PREFIX)
    return app
