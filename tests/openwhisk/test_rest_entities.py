"""Packages, triggers and rules (empty collections, refusals) and ``GET /namespaces/{ns}``: what ``wsk list``
and ``wsk namespace get`` ask for."""

from __future__ import annotations

import importlib.resources
import json
from typing import Any

import pytest
from ow_support.api import OTHER_IDENTITY, Api

COLLECTIONS = ["packages", "triggers", "rules"]


@pytest.mark.parametrize("collection", COLLECTIONS)
async def test_an_empty_collection_lists_as_openwhisk_does(api: Api, collection: str) -> None:
    for query in ({}, {"limit": "0", "skip": "0"}, {"limit": "200", "skip": "5"}, {"docs": "true"}):
        status, body, headers = await api.call("GET", collection, params=query)
        assert (status, body) == (200, []), query
        assert headers["Content-Type"].startswith("application/json")
    status, body, _ = await api.call("GET", collection + "/", params={"count": "true"})
    assert (status, body) == (200, {collection: 0})
    status, body, _ = await api.call("GET", f"/api/v1/namespaces/guest/{collection}", params={"count": "yes"})
    assert (status, body) == (200, {collection: 0})


@pytest.mark.parametrize("collection", COLLECTIONS)
async def test_list_bounds_are_checked_as_for_actions(api: Api, collection: str) -> None:
    cases = {
        "201": f"The value '201' is not in the range of 0 to 200 for {collection}.",
        "x": f"The value 'x' is not an integer for {collection}.",
    }
    for limit, message in cases.items():
        status, body, _ = await api.call("GET", collection, params={"limit": limit})
        assert status == 400 and body["error"] == message
    status, body, _ = await api.call("GET", collection, params={"skip": "-1"})
    assert status == 400 and body["error"] == f"The value '-1' is not greater than or equal to 0 for {collection}."
    status, body, _ = await api.call("GET", collection, params={"count": "maybe"})
    assert status == 400 and "'maybe' is not a valid Boolean value" in body["error"]


@pytest.mark.parametrize("collection", COLLECTIONS)
async def test_authentication_and_namespace_rules_apply(api: Api, collection: str) -> None:
    status, body, _ = await api.call("GET", collection, auth=False)
    assert status == 401 and body["error"].startswith("The resource requires authentication")
    status, body, _ = await api.call("GET", f"/api/v1/namespaces/alice/{collection}")
    assert status == 403 and body["error"] == f"The supplied authentication is not authorized to access 'alice/{collection}'."
    status, body, _ = await api.call("GET", f"/api/v1/namespaces/alice/{collection}", identity=OTHER_IDENTITY)
    assert (status, body) == (200, [])


@pytest.mark.parametrize("collection", COLLECTIONS)
async def test_creating_one_is_refused_naming_what_is_not_served(api: Api, collection: str) -> None:
    noun = collection.capitalize()
    for method in ("PUT", "POST"):
        status, body, headers = await api.call(method, f"{collection}/thing", json={"name": "thing"},
                                               params={"overwrite": "true"})
        assert status == 400, (method, body)
        assert body["error"].startswith(f"{noun} are not supported by dilu-invoker standalone yet")
        assert body["code"] == headers["X-Request-ID"]
    for method in ("GET", "DELETE"):
        status, body, _ = await api.call(method, f"{collection}/thing")
        assert (status, body["error"]) == (404, "The requested resource does not exist."), method
    status, body, _ = await api.call("PUT", f"{collection}/bad%20name!", json={})
    assert status == 400 and body["error"] == "The name of the entity contains illegal characters."
    # nothing was stored: the collection is still empty
    assert (await api.call("GET", collection))[:2] == (200, [])


async def test_namespace_get_lists_every_collection(api: Api) -> None:
    assert (await api.put_action("hello"))[0] == 200
    for path in ("/api/v1/namespaces/_", "/api/v1/namespaces/guest/"):
        status, body, _ = await api.call("GET", path)
        assert status == 200, body
        assert set(body) == {"actions", "packages", "triggers", "rules"}
        assert [a["name"] for a in body["actions"]] == ["hello"]
        assert "code" not in body["actions"][0]["exec"]
        assert body["packages"] == body["triggers"] == body["rules"] == []
    status, body, _ = await api.call("GET", "/api/v1/namespaces/alice")
    assert status == 403 and body["error"] == "The supplied authentication is not authorized to access 'alice'."
    status, body, _ = await api.call("GET", "/api/v1/namespaces")
    assert (status, body) == (200, ["guest"])


def _openapi() -> dict[str, Any]:
    return json.loads(importlib.resources.files("dilu_invoker.openwhisk").joinpath("openapi.json").read_text())


def _template(path: str) -> str:
    return path.rstrip("/") or "/"


async def test_every_served_route_is_in_the_openapi_document(api: Api) -> None:
    documented = {(method.upper(), path) for path, ops in _openapi()["paths"].items() for method in ops}
    served = {(r.method, _template(r.resource.canonical)) for r in api.client.app.router.routes()
              if r.method != "HEAD" and r.resource is not None}
    assert served - documented == set()
    assert documented - served == set()


@pytest.mark.parametrize("collection", COLLECTIONS)
async def test_entity_answers_are_the_documented_ones(api: Api, collection: str) -> None:
    paths = _openapi()["paths"]
    one = paths[f"/api/v1/namespaces/{{namespace}}/{collection}/{{name}}"]
    for method, body in (("GET", None), ("DELETE", None), ("PUT", {}), ("POST", {})):
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        status, answer, _ = await api.call(method, f"{collection}/x", **kwargs)
        assert str(status) in one[method.lower()]["responses"], (method, status)
        assert set(answer) == {"error", "code"}, answer
    status, answer, _ = await api.call("GET", collection, params={"count": "true"})
    assert status == 200 and list(answer) == [collection]
    status, namespace, _ = await api.call("GET", "/api/v1/namespaces/_")
    required = _openapi()["components"]["schemas"]["Namespace"]["required"]
    assert status == 200 and sorted(namespace) == sorted(required)
