"""``/api/v1/namespaces/{ns}/packages``, ``/triggers``, ``/rules`` and ``/api/v1/namespaces/{ns}``.

Standalone serves actions in the default package only. The three other entity collections still answer
as OpenWhisk answers for a namespace that has none of them, so ``wsk list``, ``wsk namespace get`` and
the npm client's ``list()`` calls work: ``200 []`` (``limit`` and ``skip`` checked as for actions),
``{"packages": 0}`` with ``count=true``. Reading or deleting one entity answers 404 (there is none);
creating or updating one, firing a trigger or changing a rule's state is refused with 400 and a message
naming what standalone does not serve yet, so a client never mistakes the refusal for a missing route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from dilu_invoker.openwhisk.rest_common import (
    MAX_LIST_LIMIT,
    STORE,
    ApiError,
    Msg,
    authenticate,
    check_entity_name,
    json_response,
    query_bool,
    query_limit,
    query_skip,
    resolve_namespace,
    valid_entity_name,
)
from dilu_invoker.store import action_summary_json

#: collection path segment -> what users call one of them (for the refusal message)
COLLECTIONS: dict[str, str] = {"packages": "Packages", "triggers": "Triggers", "rules": "Rules"}


def not_served(collection: str) -> str:
    return (f"{COLLECTIONS[collection]} are not supported by dilu-invoker standalone yet: it serves actions "
            "in the default package only (docs/rest-api.md).")


Handler = Callable[[web.Request], Awaitable[web.Response]]


def _lister(collection: str) -> Handler:
    async def list_entities(request: web.Request) -> web.Response:
        """An empty collection, with OpenWhisk's checks of ``limit``, ``skip`` and ``count``."""
        identity = authenticate(request)
        resolve_namespace(identity, request.match_info["namespace"], collection)
        query_skip(request, collection)
        query_limit(request, collection)
        if query_bool(request, "count"):
            return json_response({collection: 0})
        return json_response([])

    return list_entities


def _one(collection: str, *, status: int, message: str) -> Handler:
    async def one_entity(request: web.Request) -> web.Response:
        identity = authenticate(request)
        name = request.match_info["name"]
        resolve_namespace(identity, request.match_info["namespace"], f"{collection}/{name}")
        check_entity_name(name)
        raise ApiError(status, message)

    return one_entity


async def get_namespace(request: web.Request) -> web.Response:
    """``GET /api/v1/namespaces/{ns}``: every entity of the namespace by collection (OpenWhisk's
    ``getAllEntitiesInNamespace``), at most 200 actions, most recently updated first."""
    identity = authenticate(request)
    segment = request.match_info["namespace"]
    if segment not in ("_", identity.namespace):
        if not valid_entity_name(segment):
            raise ApiError(400, Msg.NAMESPACE_ILLEGAL)
        raise ApiError(403, Msg.forbidden(segment))
    actions = await request.app[STORE].list_actions(identity.namespace, skip=0, limit=MAX_LIST_LIMIT)
    return json_response({
        "actions": [action_summary_json(a) for a in actions],
        "packages": [],
        "triggers": [],
        "rules": [],
    })


def add_routes(app: web.Application, prefix: str) -> None:
    """Registers the routes under ``prefix`` (``/api/v1``), with and without a trailing slash."""

    def route(method: str, path: str, handler: Handler) -> None:
        app.router.add_route(method, path, handler)
        app.router.add_route(method, path + "/", handler)

    ns = f"{prefix}/namespaces/{{namespace}}"
    route("GET", ns, get_namespace)
    for collection in COLLECTIONS:
        route("GET", f"{ns}/{collection}", _lister(collection))
        missing = _one(collection, status=404, message=Msg.NOT_FOUND)
        refused = _one(collection, status=400, message=not_served(collection))
        for method, handler in (("GET", missing), ("DELETE", missing), ("PUT", refused), ("POST", refused)):
            route(method, f"{ns}/{collection}/{{name}}", handler)
