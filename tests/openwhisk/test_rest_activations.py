"""GET …/activations (list and filters), …/activations/{id}, /result, /logs; and the info endpoints."""

from __future__ import annotations

import pytest
from ow_support.api import OTHER_IDENTITY, PY_CODE, Api

from dilu_invoker.model import (
    Activation,
    ActivationResponse,
    annotations_of,
    new_activation_id,
)


def record(name: str, start: int, *, ns: str = "guest", path: str | None = None, ok: bool = True,
           logs: tuple[str, ...] = ("2026-01-01T00:00:00.000000000Z stdout: hi",)) -> Activation:
    response = ActivationResponse.success({"n": start}) if ok else ActivationResponse.application_error("no")
    return Activation(
        namespace=ns, name=name, subject=ns, activation_id=new_activation_id(), start=start, end=start + 7,
        response=response, logs=logs,
        annotations=annotations_of([("path", path or f"{ns}/{name}"), ("kind", "python:3")]),
    )


async def seed(api: Api) -> list[Activation]:
    """Six activations of three actions (one in a package), start 1000..6000, newest last."""
    recs = [
        record("a", 1000), record("b", 2000), record("a", 3000, ok=False),
        record("p", 4000, path="guest/pkg/p"), record("b", 5000), record("a", 6000),
    ]
    for r in recs:
        await api.store.store_activation(r)
    await api.store.store_activation(record("a", 7000, ns="alice"))
    return recs


async def test_list_newest_first_summaries(api: Api) -> None:
    recs = await seed(api)
    status, body, _ = await api.call("GET", "activations")
    assert status == 200
    assert [a["activationId"] for a in body] == [r.activation_id for r in reversed(recs)]
    first = body[0]
    assert set(first) == {"namespace", "name", "version", "publish", "annotations", "activationId", "start",
                          "end", "duration", "statusCode"}
    assert first["duration"] == 7 and first["statusCode"] == 0
    assert body[3]["statusCode"] == 1  # the failed one


async def test_list_with_docs_has_logs_and_results(api: Api) -> None:
    recs = await seed(api)
    status, body, _ = await api.call("GET", "activations", params={"docs": "true", "limit": "1"})
    assert status == 200 and len(body) == 1
    assert body[0] == recs[-1].to_api_json()
    assert body[0]["logs"] and body[0]["response"]["result"] == {"n": 6000}


@pytest.mark.parametrize(
    ("params", "expected_starts"),
    [
        ({"limit": "2"}, [6000, 5000]),
        ({"limit": "2", "skip": "2"}, [4000, 3000]),
        ({"skip": "10"}, []),
        ({"name": "a"}, [6000, 3000, 1000]),
        ({"name": "a", "limit": "1", "skip": "1"}, [3000]),
        ({"name": "pkg/p"}, [4000]),
        ({"name": "nothing"}, []),
        ({"since": "2000", "upto": "5000"}, [5000, 4000, 3000, 2000]),
        ({"since": "5500"}, [6000]),
        ({"upto": "1500"}, [1000]),
        ({"name": "b", "since": "3000"}, [5000]),
        ({"limit": "0"}, [6000, 5000, 4000, 3000, 2000, 1000]),
        ({"name": ""}, [6000, 5000, 4000, 3000, 2000, 1000]),
    ],
)
async def test_list_filters(api: Api, params: dict[str, str], expected_starts: list[int]) -> None:
    await seed(api)
    status, body, _ = await api.call("GET", "activations", params=params)
    assert status == 200, body
    assert [a["start"] for a in body] == expected_starts


async def test_count(api: Api) -> None:
    await seed(api)
    for params, n in (({}, 6), ({"name": "a"}, 3), ({"since": "3000"}, 4), ({"skip": "4"}, 2)):
        status, body, _ = await api.call("GET", "activations", params={"count": "true", **params})
        assert status == 200 and body == {"activations": n}, params
    status, body, _ = await api.call("GET", "activations", params={"count": "true", "docs": "true"})
    assert status == 400 and body["error"] == "The parameter 'docs' is not permitted with 'count'."


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"name": "a/b/c"}, "Parameter may be a 'simple' name or 'package-name/simple' name: a/b/c"),
        ({"name": "bad*name"}, "Parameter may be a 'simple' name or 'package-name/simple' name: bad*name"),
        ({"since": "yesterday"}, "Parameter is not a valid value for epoch seconds: yesterday"),
        ({"upto": "1.5"}, "Parameter is not a valid value for epoch seconds: 1.5"),
        ({"limit": "500"}, "The value '500' is not in the range of 0 to 200 for activations."),
        ({"skip": "x"}, "The value 'x' is not an integer for activations."),
        ({"docs": "sure"}, "The query parameter 'docs' was malformed:\n'sure' is not a valid Boolean value"),
    ],
)
async def test_bad_list_parameters(api: Api, params: dict[str, str], message: str) -> None:
    status, body, headers = await api.call("GET", "activations", params=params)
    assert status == 400
    assert body == {"error": message, "code": headers["X-Request-ID"]}


async def test_get_result_logs(api: Api) -> None:
    recs = await seed(api)
    target = recs[2]  # the application error
    aid = target.activation_id
    for suffix in ("", "/"):  # clients differ on the trailing slash
        status, body, _ = await api.call("GET", f"activations/{aid}{suffix}")
        assert status == 200 and body == target.to_api_json()
    assert body["response"]["status"] == "application error" and body["response"]["success"] is False
    status, body, _ = await api.call("GET", f"activations/{aid}/result")
    assert status == 200
    assert body == {"status": "application error", "statusCode": 1, "success": False, "result": {"error": "no"}}
    status, body, _ = await api.call("GET", f"activations/{aid}/logs")
    assert status == 200 and body == {"logs": list(target.logs)}


async def test_get_errors(api: Api) -> None:
    recs = await seed(api)
    status, body, _ = await api.call("GET", f"activations/{new_activation_id()}")
    assert status == 404 and body["error"] == "The requested resource does not exist."
    status, body, _ = await api.call("GET", "activations/abc")
    assert status == 400 and body["error"] == "Activation id length is 3 but must be 32."
    status, body, _ = await api.call("GET", "activations/" + "Z" * 32)
    assert status == 400 and body["error"] == "The activation id is not valid."
    aid = recs[0].activation_id
    status, body, _ = await api.call("GET", f"/api/v1/namespaces/alice/activations/{aid}")
    assert status == 403 and body["error"] == f"The supplied authentication is not authorized to access 'alice/activations/{aid}'."
    status, body, _ = await api.call("GET", f"activations/{aid}", identity=OTHER_IDENTITY)
    assert status == 404  # alice's own namespace does not have guest's activation
    status, body, _ = await api.call("GET", f"activations/{aid}/logs", auth=False)
    assert status == 401


async def test_other_namespace_list_is_forbidden_but_own_works(api: Api) -> None:
    await seed(api)
    status, body, _ = await api.call("GET", "/api/v1/namespaces/alice/activations")
    assert status == 403 and body["error"].endswith("'alice/activations'.")
    status, body, _ = await api.call("GET", "activations", identity=OTHER_IDENTITY)
    assert status == 200 and [a["start"] for a in body] == [7000]


async def test_invoked_activations_are_listed(api: Api) -> None:
    status, _, _ = await api.put_action("echo", {"exec": {"kind": "python:3", "code": PY_CODE}})
    assert status == 200
    ids = []
    for i in range(3):
        _, _, headers = await api.invoke("echo", {"i": i})
        ids.append(headers["x-openwhisk-activation-id"])
    status, body, _ = await api.call("GET", "activations", params={"name": "echo"})
    assert status == 200 and {a["activationId"] for a in body} == set(ids)


# --------------------------------------------------------------------------------------------
# Info endpoints
# --------------------------------------------------------------------------------------------


async def test_api_info_lists_runtimes_without_auth(api: Api) -> None:
    status, body, headers = await api.call("GET", "/api/v1", auth=False)
    assert status == 200 and headers["X-Request-ID"]
    assert body["description"] == "OpenWhisk API" and body["api_version_path"] == "v1"
    kinds = {r["kind"]: r for family in body["runtimes"].values() for r in family}
    assert {"python:3", "python:3-gpu"} <= set(kinds)
    assert kinds["python:3-gpu"]["gpu"] is True and kinds["python:3"]["default"] is True
    assert body["limits"]["max_action_code"] == api.cfg.max_code_mb * 1024 * 1024
    status, same, _ = await api.call("GET", "/api/v1/", auth=False)
    assert status == 200 and same["runtimes"] == body["runtimes"]


async def test_root_info(api: Api) -> None:
    status, body, _ = await api.call("GET", "/", auth=False)
    assert status == 200 and body["api_paths"] == ["/api/v1"] and "python" in body["runtimes"]


async def test_namespaces(api: Api) -> None:
    status, body, _ = await api.call("GET", "/api/v1/namespaces")
    assert status == 200 and body == ["guest"]
    status, body, _ = await api.call("GET", "/api/v1/namespaces/", identity=OTHER_IDENTITY)
    assert status == 200 and body == ["alice"]
    status, _, _ = await api.call("GET", "/api/v1/namespaces", auth=False)
    assert status == 401


async def test_cors_preflight(api: Api) -> None:
    status, _, headers = await api.call("OPTIONS", "/api/v1/namespaces/_/actions/x", auth=False)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert "Authorization" in headers["Access-Control-Allow-Headers"]


async def test_error_and_success_bodies_carry_json_content_type(api: Api) -> None:
    async with api.client.get("/api/v1/namespaces/_/actions") as resp:
        assert resp.status == 401 and resp.content_type == "application/json"
    async with api.client.get("/api/v1") as resp:
        assert resp.status == 200 and resp.content_type == "application/json"
