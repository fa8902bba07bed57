"""Bad input gets OpenWhisk's JSON error shape: deep JSON, and the errors aiohttp answers itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from ow_support.api import Api, basic_auth, manifest_for_tests
from ow_support.runners import ScriptedRunner

from dilu_invoker.config import ApiConfig
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.openwhisk.rest import build_api
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.openwhisk.rest_common import MAX_JSON_DEPTH, serve_api
from dilu_invoker.store import EntityStore

GUEST = basic_auth(GUEST_IDENTITY)
CODE = "def main(args):\n    return args\n"


def nested(depth: int) -> Any:
    """An object whose arrays and objects nest ``depth`` levels (the object itself counts)."""
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return {"v": value}


async def _put(api: Api) -> None:
    status, body, _ = await api.put_action("echo", {"exec": {"kind": "python:3", "code": CODE}})
    assert status == 200, body


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000], ids=["just-past-the-bound", "very-deep"])
async def test_json_nested_past_the_bound_is_400(api: Api, depth: int) -> None:
    await _put(api)
    body = ("[" * (depth - 1) + "1" + "]" * (depth - 1)).join(['{"v":', "}"]).encode()
    for method, path in (("POST", "actions/echo?blocking=true"), ("PUT", "actions/other")):
        status, answer, headers = await api.call(method, path, data=body,
                                                 headers={"Content-Type": "application/json"})
        assert status == 400
        assert answer == {"error": f"The request content was malformed: JSON nested deeper than {MAX_JSON_DEPTH} "
                                   "levels.", "code": headers["X-Request-ID"]}


async def test_json_at_the_bound_is_accepted(api: Api) -> None:
    await _put(api)
    status, answer, _ = await api.invoke("echo", nested(MAX_JSON_DEPTH), result=True)
    assert status == 200
    assert json.dumps(answer["echo"]["v"]).count("[") == MAX_JSON_DEPTH - 1


@pytest.fixture
async def served(redis: aioredis.Redis) -> AsyncIterator[str]:
    app = build_api(ApiConfig(), store=EntityStore(redis, prefix="t:"), runner=ScriptedRunner(),
                    manifest=manifest_for_tests(), auth=Authenticator([GUEST_IDENTITY]))
    runner, port = await serve_api(app, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _raw(address: str, request: bytes) -> tuple[int, str, dict[str, Any]]:
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    content_type = next(v for k, _, v in (line.partition(": ") for line in lines[1:]) if k.lower() == "content-type")
    return int(lines[0].split()[1]), content_type, json.loads(body)


async def test_a_header_too_large_is_answered_in_openwhisk_shape(served: str) -> None:
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": "Basic " + "A" * 20_000}
        async with http.get(f"http://{served}/api/v1/namespaces/_/actions", headers=headers) as resp:
            assert resp.status in (400, 431)
            assert resp.content_type == "application/json"
            body = await resp.json()
    assert set(body) == {"error", "code"}
    assert body["error"].startswith("The request could not be parsed") and body["code"]


async def test_a_bad_method_is_answered_in_openwhisk_shape(served: str) -> None:
    status, content_type, body = await _raw(served, b"G(T /api/v1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 400 and content_type.startswith("application/json")
    assert set(body) == {"error", "code"} and body["error"].startswith("The request could not be parsed")


async def test_broken_framing_is_answered_in_openwhisk_shape(served: str) -> None:
    status, content_type, body = await _raw(
        served, b"POST /api/v1 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello")
    assert status == 400 and content_type.startswith("application/json")
    assert set(body) == {"error", "code"}


async def test_unknown_routes_and_methods_are_answered_in_openwhisk_shape(served: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{served}/no/such/thing", headers=GUEST) as resp:
            assert resp.status == 404
            body = await resp.json()
            assert body == {"error": "The requested resource could not be found.",
                            "code": resp.headers["X-Request-ID"]}
        async with http.patch(f"http://{served}/api/v1/namespaces/_/actions/echo", headers=GUEST) as resp:
            assert resp.status == 405
            body = await resp.json()
            assert body["error"].startswith("HTTP method not allowed") and body["code"]
            assert "PUT" in resp.headers["Allow"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("actions?skip=" + "9" * 30, "The value '" + "9" * 30 + "' is not an integer for actions."),
        ("actions?skip=2147483648", "The value '2147483648' is not an integer for actions."),
        ("activations?skip=" + "9" * 30, "The value '" + "9" * 30 + "' is not an integer for activations."),
        ("activations?upto=" + "9" * 30, "Parameter is not a valid value for epoch seconds: " + "9" * 30),
        ("activations?since=-" + "9" * 30, "Parameter is not a valid value for epoch seconds: -" + "9" * 30),
    ],
    ids=["huge-skip", "skip-past-int32", "activations-huge-skip", "huge-upto", "huge-negative-since"],
)
async def test_integers_past_openwhisks_ranges_are_400_not_500(api: Api, path: str, message: str) -> None:
    # Found by schemathesis: a skip past Redis's integer range was a 500.
    status, body, _ = await api.call("GET", path)
    assert (status, body["error"]) == (400, message)


async def test_integers_at_the_ranges_are_served(api: Api) -> None:
    for path in ("actions?skip=2147483647", "activations?upto=9223372036854775807&since=-9223372036854775808"):
        status, body, _ = await api.call("GET", path)
        assert (status, body) == (200, [])
