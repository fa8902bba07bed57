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
import os
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dilu_invoker.config import Config
from dilu_invoker.invoker.dataplane.core import Invoker

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
async def _auth_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
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


def invoker_credentials(cfg: Config) -> tuple[str, str]:
    """The control endpoints' basic-auth pair: configured, or a random password kept in the data dir."""
    if cfg.invoker.password:
        return cfg.invoker.user, cfg.invoker.password
    path = cfg.data_path / f"invoker{cfg.invoker.id}-credentials"
    if path.exists():
        user, _, password = path.read_text().strip().partition(":")
        if user == cfg.invoker.user and password:
            return user, password
    password = secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{cfg.invoker.user}:{password}\n")
    return cfg.invoker.user, password


async def serve_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = port
    sockets = getattr(site._server, "sockets", None)
    if sockets:
        bound = int(sockets[0].getsockname()[1])
    return runner, bound
