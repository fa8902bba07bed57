"""Actions: PUT (create, overwrite), GET, DELETE, list, and every way a request can be refused."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from ow_support.api import OTHER_IDENTITY, PY_CODE, Api

from dilu_invoker.model import GUEST_IDENTITY, Action, Identity
from dilu_invoker.store import EntityStore


def ann(body: dict[str, Any]) -> dict[str, Any]:
    return {a["key"]: a["value"] for a in body["annotations"]}


async def test_create_returns_the_action_as_openwhisk_does(api: Api) -> None:
    status, body, headers = await api.put_action("hello", {
        "exec": {"kind": "python:3", "code": PY_CODE},
        "parameters": [{"key": "name", "value": "dilu"}, {"key": "MODEL", "value": "/m", "init": True}],
        "annotations": [{"key": "web-export", "value": True}],
        "limits": {"timeout": 5000, "memory": 512},
    })
    assert status == 200
    assert body["namespace"] == "guest" and body["name"] == "hello"
    assert body["version"] == "0.0.1" and body["publish"] is False
    assert body["exec"] == {"kind": "python:3", "code": PY_CODE, "binary": False}
    assert body["parameters"] == [{"key": "name", "value": "dilu"}, {"key": "MODEL", "value": "/m", "init": True}]
    assert ann(body) == {"web-export": True, "provide-api-key": False, "exec": "python:3"}
    assert body["limits"] == {"timeout": 5000, "memory": 512, "logs": 10, "concurrency": 1}
    assert isinstance(body["updated"], int) and body["updated"] > 0
    assert headers["X-Request-ID"]

    status, got, _ = await api.call("GET", "actions/hello")
    assert status == 200 and got == body


async def test_get_without_code(api: Api) -> None:
    await api.put_action("hello")
    status, body, _ = await api.call("GET", "actions/hello", params={"code": "false"})
    assert status == 200
    assert body["exec"] == {"kind": "python:3", "binary": False}


async def test_default_kind_resolves_to_the_family_default(api: Api) -> None:
    status, body, _ = await api.put_action("d", {"exec": {"kind": "python:default", "code": PY_CODE}})
    assert status == 200 and body["exec"]["kind"] == "python:3"


async def test_binary_code_is_detected(api: Api) -> None:
    code = base64.b64encode(b"PK\x03\x04 pretend zip").decode()
    status, body, _ = await api.put_action("z", {"exec": {"kind": "python:3", "code": code}})
    assert status == 200 and body["exec"]["binary"] is True


async def test_create_existing_without_overwrite_is_409(api: Api) -> None:
    assert (await api.put_action("hello"))[0] == 200
    status, body, headers = await api.put_action("hello")
    assert status == 409
    assert body == {"error": "resource already exists", "code": headers["X-Request-ID"]}


async def test_overwrite_bumps_version_and_merges(api: Api) -> None:
    await api.put_action("hello", {
        "exec": {"kind": "python:3", "code": PY_CODE},
        "parameters": [{"key": "a", "value": 1}],
        "limits": {"timeout": 5000, "memory": 512},
    })
    before = await api.store.get_action("guest", "hello")
    assert before is not None
    status, body, _ = await api.put_action("hello", {"limits": {"memory": 1024}}, overwrite=True)
    assert status == 200
    assert body["version"] == "0.0.2"
    assert body["exec"]["code"] == PY_CODE  # kept
    assert body["parameters"] == [{"key": "a", "value": 1}]  # kept
    assert body["limits"]["timeout"] == 5000 and body["limits"]["memory"] == 1024
    after = await api.store.get_action("guest", "hello")
    assert after is not None and after.revision != before.revision
    assert after.revision is not None and after.revision.startswith("2-")

    status, body, _ = await api.put_action("hello", {"version": "1.2.3", "parameters": []}, overwrite=True)
    assert status == 200 and body["version"] == "1.2.3" and body["parameters"] == []


async def test_overwrite_of_a_missing_action_creates_it(api: Api) -> None:
    status, body, _ = await api.put_action("fresh", overwrite=True)
    assert status == 200 and body["version"] == "0.0.1"


async def test_update_without_exec_on_create_is_exec_undefined(api: Api) -> None:
    status, body, _ = await api.put_action("x", {"parameters": []}, overwrite=True)
    assert status == 400 and body["error"] == "exec undefined"


async def test_explicit_namespace_and_underscore_are_the_same(api: Api) -> None:
    await api.put_action("hello")
    status, body, _ = await api.call("GET", "/api/v1/namespaces/guest/actions/hello")
    assert status == 200 and body["name"] == "hello"


async def test_other_namespace_is_forbidden(api: Api) -> None:
    status, body, headers = await api.call("GET", "/api/v1/namespaces/alice/actions/hello")
    assert status == 403
    assert body == {"error": "The supplied authentication is not authorized to access 'alice/actions/hello'.",
                    "code": headers["X-Request-ID"]}
    status, body, _ = await api.call("GET", "/api/v1/namespaces/alice/actions")
    assert status == 403 and "'alice/actions'" in body["error"]


async def test_namespaces_are_isolated(api: Api) -> None:
    await api.put_action("hello")
    status, _, _ = await api.call("GET", "actions/hello", identity=OTHER_IDENTITY)
    assert status == 404
    status, body, _ = await api.call("GET", "actions", identity=OTHER_IDENTITY)
    assert status == 200 and body == []


@pytest.mark.parametrize("name", ["-leading", "a/../b", "has*star", " space-first"])
async def test_invalid_entity_name_is_400(api: Api, name: str) -> None:
    from urllib.parse import quote

    status, body, _ = await api.call("PUT", f"/api/v1/namespaces/_/actions/{quote(name, safe='')}",
                                     json={"exec": {"kind": "python:3", "code": PY_CODE}})
    assert status in (400, 404)  # a slash makes it another route, which does not exist
    if status == 400:
        assert body["error"] == "The name of the entity contains illegal characters."


async def test_too_long_name_is_400(api: Api) -> None:
    status, body, _ = await api.put_action("a" * 257)
    assert status == 400 and body["error"] == "Name longer than allowed: 257 > 256."


async def test_invalid_namespace_is_400(api: Api) -> None:
    status, body, _ = await api.call("GET", "/api/v1/namespaces/-bad/actions/x")
    assert status == 400 and body["error"] == "The namespace contains illegal characters."


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "The request content was malformed: "),
        (b"[1, 2]", "expected a JSON object"),
        (b"\xff\xfe\x00", "The request content was malformed"),
        (json.dumps({"exec": "python"}).encode(), "'exec' must be an object"),
        (json.dumps({"exec": {"code": "x"}}).encode(), "exec 'kind' is missing"),
        (json.dumps({"exec": {"kind": "python:3"}}).encode(), "'code' must be a string defined in 'exec'"),
        (json.dumps({"exec": {"kind": "python:3", "code": 5}}).encode(), "exec 'code' must be a string"),
        (json.dumps({"exec": {"kind": "java:8", "code": "x"}}).encode(), "'main' must be a string"),
        (json.dumps({"exec": {"kind": "python:3", "code": "x", "binary": True}}).encode(), "not base64"),
        (json.dumps({"exec": {"kind": "python:3", "code": "x"}, "limits": {"timeout": 1}}).encode(),
         "timeout limit 1 exceeds allowed threshold"),
        (json.dumps({"exec": {"kind": "python:3", "code": "x"}, "limits": {"memory": "big"}}).encode(),
         "limit 'memory' must be an integer"),
        (json.dumps({"exec": {"kind": "python:3", "code": "x"}, "limits": 3}).encode(), "'limits' must be an object"),
        (json.dumps({"exec": {"kind": "python:3", "code": "x"}, "parameters": "a=b"}).encode(),
         "'parameters' must be an array"),
        (json.dumps({"exec": {"kind": "python:3", "code": "x"}, "annotations": [{"value": 1}]}).encode(),
         "needs a 'key'"),
        (json.dumps({"exec": {"kind": "python:3", "code": "x"}, "version": "one"}).encode(), "semantic version"),
        (json.dumps({"exec": {"kind": "python:3", "code": "x"}, "publish": "yes"}).encode(), "'publish'"),
        (b"", "exec undefined"),
    ],
)
async def test_bad_put_bodies_are_400(api: Api, raw: bytes, fragment: str) -> None:
    status, body, headers = await api.call("PUT", "actions/bad", data=raw,
                                           headers={"Content-Type": "application/json"})
    assert status == 400, body
    assert fragment in body["error"]
    assert body["code"] == headers["X-Request-ID"]
    assert await api.store.get_action("guest", "bad") is None


async def test_unknown_kind_lists_the_kinds(api: Api) -> None:
    status, body, _ = await api.put_action("x", {"exec": {"kind": "cobol:85", "code": "x"}})
    assert status == 400
    assert body["error"] == ("The specified runtime 'cobol:85' is not supported by this platform. Valid values "
                             "are: 'java:8', 'python:3', 'python:3-gpu'.")
    status, body, _ = await api.put_action("x", {"exec": {"kind": "sequence", "components": ["/guest/a"]}})
    assert status == 400 and "'sequence' is not supported" in body["error"]


async def test_deprecated_kind_is_refused(api: Api) -> None:
    status, body, _ = await api.put_action("x", {"exec": {"kind": "python:2", "code": "x"}})
    assert status == 400 and "no longer supported" in body["error"]


async def test_code_over_the_limit_is_413(make_api: Any) -> None:
    api = await make_api(max_code_mb=1)
    code = "#" * (1024 * 1024 + 1)
    status, body, _ = await api.put_action("big", {"exec": {"kind": "python:3", "code": code}})
    assert status == 413
    assert body["error"] == f"exec larger than allowed: {1024 * 1024 + 1} > {1024 * 1024} bytes."
    status, _, _ = await api.put_action("ok", {"exec": {"kind": "python:3", "code": "#" * (1024 * 1024)}})
    assert status == 200


async def test_params_and_annotations_over_the_limit_are_413(make_api: Any) -> None:
    api = await make_api(max_params_kb=1)
    big = [{"key": "k", "value": "v" * 2000}]
    status, body, _ = await api.put_action("p", {"exec": {"kind": "python:3", "code": "x"}, "parameters": big})
    assert status == 413 and body["error"].startswith("parameters larger than allowed: ")
    status, body, _ = await api.put_action("p", {"exec": {"kind": "python:3", "code": "x"}, "annotations": big})
    assert status == 413 and body["error"].startswith("annotations larger than allowed: ")


async def test_body_over_the_total_limit_is_refused_before_reading(make_api: Any) -> None:
    api = await make_api(max_code_mb=1, max_params_kb=1)
    limit = 1024 * 1024 + 2 * 1024 + 64 * 1024
    payload = b"x" * (limit + 1)
    status, body, _ = await api.call("PUT", "actions/huge", data=payload)
    assert status == 413
    assert body["error"] == f"Request larger than allowed: {limit + 1} > {limit} bytes."

    async def chunks() -> Any:  # no Content-Length: the limit applies while streaming
        for _ in range(20):
            yield b"y" * 65536

    status, body, _ = await api.call("PUT", "actions/huge", data=chunks())
    assert status == 413 and body["error"].startswith("Request larger than allowed: ")
    assert await api.store.get_action("guest", "huge") is None


async def test_gpu_annotations_are_validated(api: Api) -> None:
    gpu = {"kind": "python:3-gpu", "code": PY_CODE}
    good = [{"key": "gpu-class", "value": "training"}, {"key": "gpu-sm-request", "value": 0.3},
            {"key": "gpu-sm-limit", "value": 0.6}, {"key": "gpu-memory-mb", "value": 2048},
            {"key": "slo-ms", "value": 50}, {"key": "min-instances", "value": 1}, {"key": "max-instances", "value": 4}]
    status, body, _ = await api.put_action("g", {"exec": gpu, "annotations": good})
    assert status == 200 and ann(body)["gpu-class"] == "training"

    bad_cases = [
        ([{"key": "gpu-class", "value": "gaming"}], "Annotation 'gpu-class' must be one of inference, training, llm"),
        ([{"key": "gpu-sm-request", "value": 1.5}], "'gpu-sm-request' must be a number in (0, 1]"),
        ([{"key": "gpu-sm-request", "value": 0.5}, {"key": "gpu-sm-limit", "value": 0.2}], "must not be below"),
        ([{"key": "gpu-memory-mb", "value": "lots"}], "Annotation 'gpu-memory-mb' must be a number"),
        ([{"key": "min-instances", "value": 3}, {"key": "max-instances", "value": 2}], "min-instances"),
    ]
    for bad, message in bad_cases:
        status, body, _ = await api.put_action("g2", {"exec": gpu, "annotations": bad})
        assert status == 400 and message in body["error"], (bad, body)
    assert await api.store.get_action("guest", "g2") is None

    # an update that breaks the annotations is refused and leaves the action as it was
    status, body, _ = await api.put_action("g", {"annotations": [{"key": "gpu-sm-limit", "value": 7}]},
                                           overwrite=True)
    assert status == 400
    stored = await api.store.get_action("guest", "g")
    assert stored is not None and stored.annotation("gpu-sm-limit") == 0.6

    # a CPU kind does not interpret GPU annotations
    status, _, _ = await api.put_action("cpu", {"exec": {"kind": "python:3", "code": "x"},
                                                "annotations": [{"key": "gpu-class", "value": "gaming"}]})
    assert status == 200


async def test_delete(api: Api) -> None:
    await api.put_action("hello")
    status, body, _ = await api.call("DELETE", "actions/hello")
    assert status == 200 and body["name"] == "hello" and body["exec"]["code"] == PY_CODE
    status, body, headers = await api.call("DELETE", "actions/hello")
    assert status == 404
    assert body == {"error": "The requested resource does not exist.", "code": headers["X-Request-ID"]}
    status, _, _ = await api.call("GET", "actions/hello")
    assert status == 404
    status, body, _ = await api.call("GET", "actions")
    assert body == []


async def test_list_newest_first_with_limit_and_skip(api: Api) -> None:
    for name in ("a", "b", "c", "d"):
        assert (await api.put_action(name))[0] == 200
        await asyncio.sleep(0.002)  # distinct 'updated' milliseconds, so the order is defined
    await api.put_action("b", {"limits": {"memory": 300}}, overwrite=True)  # b becomes the newest
    status, body, _ = await api.call("GET", "actions")
    assert status == 200
    assert [a["name"] for a in body] == ["b", "d", "c", "a"]
    assert body[0]["exec"] == {"kind": "python:3", "binary": False}  # list view: no code
    assert "parameters" not in body[0] and body[0]["limits"]["memory"] == 300
    _, body, _ = await api.call("GET", "actions", params={"limit": "2", "skip": "1"})
    assert [a["name"] for a in body] == ["d", "c"]
    _, body, _ = await api.call("GET", "actions", params={"limit": "0"})
    assert len(body) == 4
    _, body, _ = await api.call("GET", "actions/", params={"count": "true"})
    assert body == {"actions": 4}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"limit": "201"}, "The value '201' is not in the range of 0 to 200 for actions."),
        ({"limit": "-1"}, "The value '-1' is not in the range of 0 to 200 for actions."),
        ({"limit": "ten"}, "The value 'ten' is not an integer for actions."),
        ({"skip": "-3"}, "The value '-3' is not greater than or equal to 0 for actions."),
        ({"count": "maybe"}, "The query parameter 'count' was malformed:\n'maybe' is not a valid Boolean value"),
    ],
)
async def test_bad_list_parameters_are_400(api: Api, params: dict[str, str], message: str) -> None:
    status, body, _ = await api.call("GET", "actions", params=params)
    assert status == 400 and body["error"] == message


async def test_bad_overwrite_flag_is_400(api: Api) -> None:
    status, body, _ = await api.call("PUT", "actions/x", params={"overwrite": "perhaps"},
                                     json={"exec": {"kind": "python:3", "code": "x"}})
    assert status == 400 and "'overwrite' was malformed" in body["error"]


class RacingStore(EntityStore):
    """Lets another writer update the action between this request's read and its write."""

    async def put_action(self, action: Action, *, expected_revision: str | None) -> Action:
        current = await self.get_action(action.namespace, action.name)
        if current is not None and expected_revision == current.revision:
            await super().put_action(current, expected_revision=current.revision)
        return await super().put_action(action, expected_revision=expected_revision)


async def test_concurrent_modification_is_409(make_api: Any) -> None:
    api = await make_api(store_cls=RacingStore)
    await api.put_action("hello")
    status, body, _ = await api.put_action("hello", {"limits": {"memory": 300}}, overwrite=True)
    assert status == 409 and body["error"] == "Concurrent modification to resource detected."


async def test_missing_and_bad_credentials_are_401(api: Api) -> None:
    status, body, headers = await api.call("GET", "actions", auth=False)
    assert status == 401
    assert body["error"] == "The resource requires authentication, which was not supplied with the request"
    assert headers["WWW-Authenticate"].startswith("Basic")
    wrong = Identity(subject="guest", namespace="guest", uuid=GUEST_IDENTITY.uuid, key="x" * 64)
    status, body, _ = await api.call("GET", "actions", identity=wrong)
    assert status == 401 and body["error"] == "The supplied authentication is invalid"
    for header in ("Bearer abc", "Basic !!!notbase64", "Basic " + base64.b64encode(b"no-colon").decode(), "Basic"):
        status, body, _ = await api.call("GET", "actions", auth=False, headers={"Authorization": header})
        assert status == 401, header


async def test_unknown_route_and_method(api: Api) -> None:
    status, body, headers = await api.call("GET", "/api/v1/nothing-here")
    assert status == 404 and body["error"] == "The requested resource could not be found."
    assert body["code"] == headers["X-Request-ID"]
    status, body, _ = await api.call("PATCH", "actions/hello")
    assert status == 405 and body["error"].startswith("HTTP method not allowed, supported methods: ")


async def test_request_id_is_taken_from_the_caller(api: Api) -> None:
    status, body, headers = await api.call("GET", "actions/none", headers={"X-Request-ID": "abc-123"})
    assert status == 404 and headers["X-Request-ID"] == "abc-123" and body["code"] == "abc-123"
    _, _, headers = await api.call("GET", "actions", headers={"X-Request-ID": "bad id with spaces"})
    assert headers["X-Request-ID"] != "bad id with spaces" and len(headers["X-Request-ID"]) == 32
