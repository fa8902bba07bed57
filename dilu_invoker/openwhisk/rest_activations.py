"""``/api/v1/namespaces/{ns}/activations``: list, get, ``/result`` and ``/logs``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dilu_invoker import jsonutil
from dilu_invoker.model import ACTIVATION_ID_RE, Activation
from dilu_invoker.openwhisk.rest_common import (
    STORE,
    ApiError,
    Msg,
    authenticate,
    json_response,
    query_bool,
    query_limit,
    query_skip,
    resolve_namespace,
    valid_entity_name,
)

COLLECTION = "activations"


def activation_summary_view(activation: Activation) -> dict[str, Any]:
    """One entry of ``GET …/activations`` without ``docs``: OpenWhisk's activation summary."""
    out: dict[str, Any] = {
        "namespace": activation.namespace,
        "name": activation.name,
        "version": activation.version,
        "publish": activation.publish,
        "annotations": [a.to_json() for a in activation.annotations],
        "activationId": activation.activation_id,
        "start": activation.start,
        "end": activation.end,
        "duration": activation.duration,
        "statusCode": int(activation.response.status),
    }
    if activation.cause is not None:
        out["cause"] = activation.cause
    return out


def _name_filter(request: web.Request) -> str | None:
    raw = request.query.get("name")
    if raw is None or not raw.strip():
        return None
    parts = raw.strip().strip("/").split("/")
    if len(parts) > 2 or not all(valid_entity_name(p) for p in parts):
        raise ApiError(400, Msg.bad_name_filter(raw))
    return "/".join(parts)


def _epoch_ms(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, Msg.bad_epoch(raw)) from None
    # OpenWhisk reads epochs as 64-bit integers; Redis refuses scores beyond that range too.
    if not -(2**63) <= value < 2**63:
        raise ApiError(400, Msg.bad_epoch(raw))
    return value


def _activation_id(request: web.Request) -> str:
    aid = request.match_info["id"]
    if len(aid) != 32:
        raise ApiError(400, Msg.activation_id_length(len(aid)))
    if not ACTIVATION_ID_RE.match(aid):
        raise ApiError(400, Msg.ACTIVATION_ID_ILLEGAL)
    return aid


async def list_activations(request: web.Request) -> web.Response:
    identity = authenticate(request)
    ns = resolve_namespace(identity, request.match_info["namespace"], COLLECTION)
    skip = query_skip(request, COLLECTION)
    limit = query_limit(request, COLLECTION)
    count = query_bool(request, "count")
    docs = query_bool(request, "docs")
    name = _name_filter(request)
    since = _epoch_ms(request, "since")
    upto = _epoch_ms(request, "upto")
    store = request.app[STORE]
    if count and docs:
        raise ApiError(400, Msg.DOCS_NOT_ALLOWED_WITH_COUNT)
    if count:
        n = await store.count_activations(ns, name=name, skip=skip, since=since, upto=upto)
        return json_response({COLLECTION: n})
    found = await store.list_activations(ns, name=name, skip=skip, limit=limit, since=since, upto=upto,
                                         docs=docs)
    if docs:
        body: list[dict[str, Any]] = [a.to_api_json() for a in found]
        size_hint = sum(len(line) for a in found for line in a.logs)
    else:
        body = [activation_summary_view(a) for a in found]
        size_hint = 0
    return json_response(None, encoded=await jsonutil.adumps(body, size_hint=size_hint))


async def _fetch(request: web.Request) -> Activation:
    identity = authenticate(request)
    aid = _activation_id(request)
    ns = resolve_namespace(identity, request.match_info["namespace"], f"{COLLECTION}/{aid}")
    activation = await request.app[STORE].get_activation(ns, aid)
    if activation is None:
        raise ApiError(404, Msg.NOT_FOUND)
    return activation


async def get_activation(request: web.Request) -> web.Response:
    activation = await _fetch(request)
    size_hint = sum(len(line) for line in activation.logs)
    return json_response(None, encoded=await jsonutil.adumps(activation.to_api_json(), size_hint=size_hint))


async def get_activation_result(request: web.Request) -> web.Response:
    activation = await _fetch(request)
    return json_response(None, encoded=await jsonutil.adumps(
        activation.response.to_api_json(), size_hint=activation.response.size or 0))


async def get_activation_logs(request: web.Request) -> web.Response:
    activation = await _fetch(request)
    size_hint = sum(len(line) for line in activation.logs)
    return json_response(None, encoded=await jsonutil.adumps({"logs": list(activation.logs)}, size_hint=size_hint))
