"""What the health endpoints report, and the endpoints the standalone adds to its apps.

* OpenWhisk REST API (``openwhisk_middleware``): while Redis is unhealthy, ``GET /`` answers 503 with
  the reason and every other request 503 "System is overloaded, try again later." (clients retry).
* Invoker endpoints (:func:`add_invoker_health`): ``GET /ping`` answers ``pong`` (200) while healthy and
  503 ``unhealthy: <reason>`` otherwise; ``GET /invoker/health`` (basic auth, like the other
  ``/invoker/...`` endpoints) answers JSON ``{"healthy", "reasons", "enabled", "redis": {...} or null}``, and the
  other ``/invoker/...`` endpoints carry the reason in an ``X-Dilu-Unhealthy`` header while unhealthy.

``docs/invoker.md`` ("Health endpoints") documents the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from dilu_invoker.redis_embedded import RedisHealth

#: the Redis health monitor an app reports (absent: the app does not depend on a monitored Redis)
HEALTH: web.AppKey[RedisHealth] = web.AppKey("redis_health", RedisHealth)
UNHEALTHY_HEADER = "X-Dilu-Unhealthy"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def unhealthy_reason(app: web.Application) -> str | None:
    health = app.get(HEALTH)
    return None if health is None or health.healthy else health.reason


def add_invoker_health(app: web.Application, health: RedisHealth | None, *, enabled: Callable[[], bool]) -> None:
    """Make an invoker's endpoint app report ``health`` (call before the app is served); ``None``: the
    invoker uses no Redis (a cluster invoker without ``--redis-url``), so it is healthy while it serves and
    ``"redis"`` is ``null``."""
    if health is not None:
        app[HEALTH] = health

    @web.middleware
    async def report(request: web.Request, handler: Handler) -> web.StreamResponse:
        reason = unhealthy_reason(request.app)
        if request.path == "/ping" and reason is not None:
            return web.Response(status=503, text=f"unhealthy: {reason}")
        response = await handler(request)
        if reason is not None and request.path.startswith("/invoker/"):
            response.headers[UNHEALTHY_HEADER] = reason
        return response

    async def health_json(request: web.Request) -> web.Response:
        reason = unhealthy_reason(request.app)
        body: dict[str, Any] = {
            "healthy": reason is None,
            "reasons": [] if reason is None else [reason],
            "enabled": enabled(),
            "redis": None if health is None else health.snapshot(),
        }
        return web.json_response(body, status=200 if reason is None else 503)

    app.middlewares.append(report)
    app.router.add_get("/invoker/health", health_json)
