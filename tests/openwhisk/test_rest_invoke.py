"""POST …/actions/{name}: blocking, result-only, non-blocking, the blocking wait, failures, overload."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ow_support.api import NO_STORE_IDENTITY, PY_CODE, Api
from ow_support.runners import ScriptedRunner

from dilu_invoker.model import Action, Exec


def runner_of(api: Api) -> ScriptedRunner:
    assert isinstance(api.runner, ScriptedRunner)
    return api.runner


async def _action(api: Api, name: str = "echo", **extra: Any) -> None:
    body = {"exec": {"kind": "python:3", "code": PY_CODE}, **extra}
    status, resp, _ = await api.put_action(name, body)
    assert status == 200, resp


async def test_blocking_result_merges_params_over_the_action_params(api: Api) -> None:
    await _action(api, parameters=[
        {"key": "greeting", "value": "hi"}, {"key": "name", "value": "default"},
        {"key": "MODEL_DIR", "value": "/models", "init": True},
    ])
    status, body, headers = await api.invoke("echo", {"name": "dilu", "n": 1}, result=True)
    assert status == 200
    assert body == {"echo": {"greeting": "hi", "name": "dilu", "n": 1}, "init": {"MODEL_DIR": "/models"}}
    req = runner_of(api).requests[-1]
    assert req.blocking is True
    assert req.init_args == ("MODEL_DIR",)
    assert req.content == {"greeting": "hi", "name": "dilu", "n": 1, "MODEL_DIR": "/models"}
    assert req.identity.namespace == "guest"
    assert req.action.revision is not None
    assert req.transid_id == headers["X-Request-ID"]
    assert headers["x-openwhisk-activation-id"] == req.activation_id


async def test_blocking_full_activation_and_it_is_stored(api: Api) -> None:
    await _action(api)
    status, body, headers = await api.invoke("echo", {"logs": ["line one", "line two"]})
    assert status == 200
    aid = headers["x-openwhisk-activation-id"]
    assert body["activationId"] == aid
    assert body["namespace"] == "guest" and body["name"] == "echo" and body["subject"] == "guest"
    assert body["response"]["status"] == "success" and body["response"]["success"] is True
    assert body["response"]["result"]["echo"]["logs"] == ["line one", "line two"]
    assert [line.split(" stdout: ")[1] for line in body["logs"]] == ["line one", "line two"]
    annotations = {a["key"]: a["value"] for a in body["annotations"]}
    assert annotations["path"] == "guest/echo" and annotations["kind"] == "python:3"
    assert body["duration"] == body["end"] - body["start"]
    stored = await api.store.get_activation("guest", aid)
    assert stored is not None and stored.to_api_json() == body


async def test_non_blocking_answers_202_and_stores_later(api: Api) -> None:
    await _action(api)
    status, body, headers = await api.invoke("echo", {"hold": True}, blocking=False)
    assert status == 202
    aid = body["activationId"]
    assert body == {"activationId": aid} and headers["x-openwhisk-activation-id"] == aid
    assert await api.store.get_activation("guest", aid) is None  # still running
    runner_of(api).release()
    stored = await api.wait_stored(aid)
    assert stored.response.is_success
    assert runner_of(api).requests[-1].blocking is False


async def test_result_without_blocking_is_non_blocking(api: Api) -> None:
    await _action(api)
    status, body, _ = await api.invoke("echo", {}, blocking=False, result=True)
    assert status == 202 and set(body) == {"activationId"}
    await api.wait_stored(body["activationId"])


async def test_blocking_call_past_the_wait_answers_202_and_continues(make_api: Any) -> None:
    api = await make_api(blocking_wait_s=0.2)
    await _action(api)
    status, body, _ = await api.invoke("echo", {"hold": True}, result=True)
    assert status == 202
    aid = body["activationId"]
    runner_of(api).release()
    stored = await api.wait_stored(aid)
    assert stored.response.is_success and stored.response.result["echo"] == {"hold": True}
    status, got, _ = await api.call("GET", f"activations/{aid}/result")
    assert status == 200 and got["result"]["echo"] == {"hold": True}


async def test_timeout_query_parameter(api: Api) -> None:
    await _action(api)
    status, body, _ = await api.invoke("echo", {"hold": True}, params={"timeout": "50"})
    assert status == 202
    runner_of(api).release()
    await api.wait_stored(body["activationId"])
    for bad in ("0", "-5", "60001", "soon"):
        status, body, _ = await api.invoke("echo", {}, params={"timeout": bad})
        assert status == 400 and body["error"] == "Timeout must be number of milliseconds up to 60000.", bad


@pytest.mark.parametrize(
    ("outcome", "http", "status_text", "error"),
    [
        ("application", 502, "application error", "it went wrong"),
        ("developer", 502, "action developer error", "The action did not return a dictionary or array."),
        ("timeout", 502, "action developer error", "The action exceeded its time limits of 60000 milliseconds."),
        ("whisk", 500, "whisk internal error", "Failed to provision resources to run the action."),
    ],
)
async def test_failed_activations(api: Api, outcome: str, http: int, status_text: str, error: str) -> None:
    await _action(api)
    status, body, headers = await api.invoke("echo", {"outcome": outcome}, result=True)
    assert status == http and body == {"error": error}
    assert headers["x-openwhisk-activation-id"]
    status, body, _ = await api.invoke("echo", {"outcome": outcome})
    assert status == http
    assert body["response"]["status"] == status_text and body["response"]["success"] is False
    assert body["response"]["result"] == {"error": error}
    stored = await api.store.get_activation("guest", body["activationId"])
    assert stored is not None and not stored.response.is_success


async def test_a_runner_that_breaks_its_contract_gives_a_stored_whisk_error(api: Api) -> None:
    await _action(api)
    status, body, headers = await api.invoke("echo", {"outcome": "raise"})
    assert status == 500
    assert body["response"]["status"] == "whisk internal error"
    assert (await api.store.get_activation("guest", headers["x-openwhisk-activation-id"])) is not None


async def test_overloaded_runner_is_503(api: Api) -> None:
    await _action(api)
    runner_of(api).overloaded = True
    for blocking in (True, False):
        status, body, headers = await api.invoke("echo", {}, blocking=blocking)
        assert status == 503
        assert body == {"error": "System is overloaded, try again later.", "code": headers["X-Request-ID"]}
    runner_of(api).overloaded = False
    status, _, _ = await api.invoke("echo", {})
    assert status == 200


async def test_overload_after_answering_is_recorded(api: Api) -> None:
    await _action(api)
    status, body, _ = await api.invoke("echo", {"outcome": "overload-later"}, blocking=False)
    assert status == 202
    stored = await api.wait_stored(body["activationId"])
    assert stored.response.status.name == "WHISK_ERROR"
    assert stored.response.result == {"error": "System is overloaded, try again later."}
    assert stored.annotation("path") == "guest/echo"


async def test_identity_that_does_not_store_activations(api: Api) -> None:
    status, _, _ = await api.put_action("echo", identity=NO_STORE_IDENTITY)
    assert status == 200
    status, _, headers = await api.invoke("echo", {}, identity=NO_STORE_IDENTITY)
    assert status == 200
    aid = headers["x-openwhisk-activation-id"]
    status, _, _ = await api.call("GET", f"activations/{aid}", identity=NO_STORE_IDENTITY)
    assert status == 404


async def test_invoke_errors(make_api: Any) -> None:
    api = await make_api(max_params_kb=1)
    status, body, _ = await api.invoke("missing", {})
    assert status == 404 and body["error"] == "The requested resource does not exist."
    await _action(api)
    status, body, _ = await api.call("POST", "actions/echo", data=b"{oops",
                                     headers={"Content-Type": "application/json"})
    assert status == 400 and body["error"].startswith("The request content was malformed: ")
    status, body, _ = await api.call("POST", "actions/echo", data=b"5")
    assert status == 400 and "must be a JSON object" in body["error"]
    status, body, _ = await api.invoke("echo", {"blob": "x" * 2000})
    assert status == 413 and body["error"].startswith("Request larger than allowed: ")
    status, body, _ = await api.invoke("echo", {}, params={"blocking": "sometimes"})
    assert status == 400 and "'blocking' was malformed" in body["error"]
    assert runner_of(api).requests == []  # nothing reached the runner


async def test_empty_body_and_array_payload(api: Api) -> None:
    await _action(api)
    status, body, _ = await api.call("POST", "actions/echo", params={"blocking": "true", "result": "true"})
    assert status == 200 and body["echo"] == {}
    status, body, _ = await api.invoke("echo", [1, 2, 3])
    assert status == 200
    assert runner_of(api).requests[-1].content == [1, 2, 3]


async def test_final_parameters_cannot_be_overridden(api: Api) -> None:
    await _action(api, parameters=[{"key": "mode", "value": "safe"}],
                  annotations=[{"key": "final", "value": True}])
    status, body, _ = await api.invoke("echo", {"mode": "fast"})
    assert status == 400
    assert body["error"] == "Request defines parameters that are not allowed (e.g., reserved properties)."
    status, _, _ = await api.invoke("echo", {"other": 1})
    assert status == 200


async def test_action_of_a_kind_no_longer_in_the_manifest(api: Api) -> None:
    stale = Action(namespace="guest", name="old", exec=Exec(kind="cobol:85", code="x"), updated=1)
    await api.store.put_action(stale, expected_revision=None)
    status, body, _ = await api.invoke("old", {})
    assert status == 400 and "The specified runtime 'cobol:85' is not supported" in body["error"]


async def test_bad_requests_do_not_disturb_others(api: Api) -> None:
    await _action(api)
    good = [api.invoke("echo", {"i": i}, result=True) for i in range(20)]
    bad = [api.call("POST", "actions/echo", data=b"{broken") for _ in range(10)]
    bad += [api.invoke("missing", {}) for _ in range(5)]
    bad += [api.invoke("echo", {"outcome": "raise"}) for _ in range(5)]
    results = await asyncio.gather(*good, *bad)
    for i, (status, body, _) in enumerate(results[:20]):
        assert status == 200 and body == {"echo": {"i": i}, "init": {}}
    assert sorted({r[0] for r in results[20:]}) == [400, 404, 500]


async def test_activation_keeps_running_when_the_client_goes_away(make_api: Any) -> None:
    api = await make_api()
    await _action(api)
    runner = runner_of(api)
    request = asyncio.create_task(api.invoke("echo", {"hold": True}))
    await runner.started.wait()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    runner.release()
    aid = runner.requests[-1].activation_id
    stored = await api.wait_stored(aid)
    assert stored.response.is_success


async def test_shutdown_waits_for_running_activations(make_api: Any) -> None:
    api = await make_api()
    await _action(api)
    runner = runner_of(api)
    status, body, _ = await api.invoke("echo", {"hold": True}, blocking=False)
    assert status == 202
    await runner.started.wait()
    closing = asyncio.create_task(api.client.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # the drain is waiting for the held activation
    runner.release()
    await closing
    assert await api.store.get_activation("guest", body["activationId"]) is not None


async def test_shutdown_cancels_what_outlives_the_drain(make_api: Any) -> None:
    api = await make_api(drain_timeout_s=0.2)
    await _action(api)
    runner = runner_of(api)
    status, body, _ = await api.invoke("echo", {"sleep": 30}, blocking=False)
    assert status == 202
    await runner.started.wait()
    await api.client.close()  # returns after the drain bound, the activation cancelled
    assert runner.finished == []
    assert await api.store.get_activation("guest", body["activationId"]) is None


async def test_a_blocking_answer_does_not_wait_for_the_record_which_reads_find_meanwhile(api: Api) -> None:
    await _action(api)
    redis = api.store.redis
    # Writes (the record's script) wait while Redis pauses them; reads go on.
    await redis.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
    try:
        status, body, headers = await api.invoke("echo", {"name": "x"})
        assert status == 200 and body["response"]["result"]["echo"]["name"] == "x"
        aid = headers["x-openwhisk-activation-id"]
        # Answered before the record reached Redis ...
        assert not await redis.exists(api.store.activation_key("guest", aid))
        assert api.store.unstored == 1
        # ... and the API finds it meanwhile; a list waits for the write and shows it.
        status, got, _ = await api.call("GET", f"activations/{aid}")
        assert status == 200 and got["activationId"] == aid and got["response"]["result"] == body["response"]["result"]
        status, listed, _ = await api.call("GET", "activations")
        assert status == 200 and [a["activationId"] for a in listed] == [aid]
    finally:
        await redis.execute_command("CLIENT", "UNPAUSE")
    assert await redis.exists(api.store.activation_key("guest", aid))
    assert api.store.unstored == 0 and await api.store.flush(1.0)


async def test_the_record_is_encoded_and_written_after_the_blocking_answer_is_built(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding and writing the record is off a blocking caller's path: it begins once the answer is built."""
    from dilu_invoker.openwhisk import rest_actions

    await _action(api)
    order: list[str] = []
    answer, write = rest_actions._activation_result_response, api.store._write_activation

    async def answering(*args: Any, **kwargs: Any) -> Any:
        order.append("answer")
        return await answer(*args, **kwargs)

    async def writing(activation: Any) -> None:
        order.append("write")
        await write(activation)

    monkeypatch.setattr(rest_actions, "_activation_result_response", answering)
    monkeypatch.setattr(api.store, "_write_activation", writing)
    for result in (False, True):
        status, body, headers = await api.invoke("echo", {"name": "x"}, result=result)
        assert status == 200, body
        assert await api.store.flush(1.0)
        assert await api.store.get_activation("guest", headers["x-openwhisk-activation-id"]) is not None
    assert order == ["answer", "write"] * 2
    # A non-blocking invoke has nobody to answer first: its record is written at once.
    status, body, _ = await api.invoke("echo", {"name": "y"}, blocking=False)
    assert status == 202
    for _ in range(100):
        if len(order) == 5:
            break
        await asyncio.sleep(0.01)
    assert order[4:] == ["write"]
