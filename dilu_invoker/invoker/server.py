"""The invoker's own HTTP endpoints, as OpenWhisk's invoker serves them (reference/openwhisk.md §6).

``GET /ping`` → ``pong``; ``GET /metrics`` (Prometheus text); ``POST /invoker/enable``,
``POST /invoker/disable`` (also ``/enable`` and ``/disable``, the paths OpenWhisk's own invoker and its
Ansible role use) and ``GET /isEnabled`` behind HTTP basic auth. Binds to loopback unless configured.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dilu_invoker.invoker.core import Invoker

INVOKER: web.AppKey[Invoker] = web.AppKey("invoker", Invoker)
CREDENTIALS: web.AppKey[tuple[str, str]] = web.AppKey("credentials", tuple)


def _authorized(request: web.Request) -> bool:
    user, password = request.app[CREDENTIALS]
    header = request.headers.get("Authorization", "")
    if not header.startswith("Basic "):
        return False
    try:
        given_user, _, given_pass = base64.b64decode(header[6:], validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False
    return hmac.compare_digest(given_user, user) & hmac.compare_digest(given_pass, password)


@web.middleware
async def _auth_middleware(request: web.Request, handler: web.Handler) -> web.StreamResponse:
    if request.path in ("/ping", "/metrics") or _authorized(request):
        return await handler(request)
    return web.Response(status=401, text="The supplied authentication is invalid",
                        headers={"WWW-Authenticate": 'Basic realm="invoker"'})


def _label(invoker: Invoker) -> str:
    return f"invoker{invoker.instance_id}/{invoker.cfg.invoker.unique_name or invoker.instance_id}"


async def ping(_: web.Request) -> web.Response:
    return web.Response(text="pong")


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[INVOKER].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def enable(request: web.Request) -> web.Response:
    invoker = request.app[INVOKER]
    changed = invoker.set_enabled(True)
    return web.Response(text=f"{_label(invoker)} is {'now' if changed else 'already'} enabled.")


async def disable(request: web.Request) -> web.Response:
    invoker = request.app[INVOKER]
    changed = invoker.set_enabled(False)
    return web.Response(text=f"{_label(invoker)} is {'now' if changed else 'already'} disabled.")


async def is_enabled(request: web.Request) -> web.Response:
    return web.Response(text=json.dumps({"enabled": request.app[INVOKER].enabled}))


def build_app(invoker: Invoker, *, user: str, password: str) -> web.Application:
    app = web.Application(middlewares=[_auth_middleware])
    app[INVOKER] = invoker
    app[CREDENTIALS] = (user, password)
    app.router.add_get("/ping", ping)
    app.router.add_get("/metrics", metrics)
    for prefix in ("/invoker", ""):
        app.router.add_post(f"{prefix}/enable", enable)
        app.router.add_post(f"{prefix}/disable", disable)
    app.router.add_get("/isEnabled", is_enabled)
    return app
