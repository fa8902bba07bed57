"""RuntimeClient, the outcome mapping and the log splitter, against our runtime and the fake upstream one."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import textwrap
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dilu_invoker.actions._ipc import (
    STAGE_HEAD,
    WELCOME_BLOB,
    Blob,
    BlobView,
    pack_stage,
    put_blob,
    take_blob,
    unpack_stage,
)
from dilu_invoker.invoker.dataplane.runtime_client import (
    DEFAULT_MAX_RESULT_BYTES,
    MSG_ABNORMAL_INIT,
    MSG_ABNORMAL_RUN,
    MSG_LOG_DEVELOPER_ERROR,
    MSG_LOG_FAILURE,
    ActivationContext,
    ActivationLogReader,
    ActivationStatus,
    RunConnections,
    RuntimeClient,
    RuntimeOutcome,
    build_init_body,
    build_run_body,
    encode_body,
    env_string,
    format_log_line,
    init_outcome,
    run_outcome,
)
from tests.fakes.runtime_process import (
    FAKE_UPSTREAM,
    OURS,
    free_port,
    running_runtime,
    spawn,
    stop,
    wait_for_active_runs,
)

S = ActivationStatus
SENTINEL = b"XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX\n"
INVALID = "The action did not produce a valid JSON or JSON Array response"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


ClientFactory = Callable[[str], RuntimeClient]


@pytest.fixture(params=["aiohttp", "kept"])
async def make_client(request: pytest.FixtureRequest, http: aiohttp.ClientSession) -> AsyncIterator[ClientFactory]:
    """/run through aiohttp (any runtime) and through the kept connections (the project's own runtime)."""
    connections = RunConnections() if request.param == "kept" else None
    yield lambda url: RuntimeClient(http, url, connections=connections)
    if connections is not None:
        connections.close()


def code(source: str) -> str:
    return textwrap.dedent(source).lstrip("\n")


def context(activation_id: str = "a1", *, timeout_s: float = 60.0) -> ActivationContext:
    return ActivationContext(
        namespace="guest",
        action_name="/guest/act",
        action_version="0.0.1",
        activation_id=activation_id,
        transaction_id="tid",
        deadline_ms=int((time.time() + timeout_s) * 1000),
    )


def init_payload(source: str, **kwargs: Any) -> dict[str, Any]:
    return build_init_body(name="act", code=source, binary=False, **kwargs)


# -- pure mapping ------------------------------------------------------------------------------------------

RUN_CASES = [
    # (http_status, body, elapsed, status, result)
    (200, b'{"a":1}', 0.1, S.SUCCESS, {"a": 1}),
    (200, b'{"error":"boom!"}', 0.1, S.APPLICATION_ERROR, {"error": "boom!"}),
    (200, b'{"error":{"code":7}}', 0.1, S.APPLICATION_ERROR, {"error": {"code": 7}}),
    (200, b"[1,2,3]", 0.1, S.SUCCESS, [1, 2, 3]),
    (200, b'"just a string"', 0.1, S.DEVELOPER_ERROR, {"error": f'{INVALID}: "just a string"'}),
    (200, b"not json", 0.1, S.DEVELOPER_ERROR, {"error": f"{INVALID}: not json"}),
    (200, b'{"x": NaN}', 0.1, S.DEVELOPER_ERROR, {"error": f'{INVALID}: {{"x": NaN}}'}),
    (
        502,
        b'{"error":"The action did not return a dictionary or array."}',
        0.1,
        S.DEVELOPER_ERROR,
        {"error": "The action did not return a dictionary or array."},
    ),
    (400, b'{"error":"command exited"}', 0.1, S.DEVELOPER_ERROR, {"error": "command exited"}),
    (500, b'{"error":"no action defined yet"}', 0.1, S.DEVELOPER_ERROR, {"error": "no action defined yet"}),
    (500, b'{"other":1}', 0.1, S.DEVELOPER_ERROR, {"error": f'{INVALID}: {{"other":1}}'}),
    (500, b"[1]", 0.1, S.DEVELOPER_ERROR, {"error": f"{INVALID}: [1]"}),
    (200, b"", 0.1, S.DEVELOPER_ERROR, {"error": MSG_ABNORMAL_RUN}),
    (None, b"", 0.1, S.DEVELOPER_ERROR, {"error": MSG_ABNORMAL_RUN}),
    (
        200,
        b'{"late":true}',
        2.5,
        S.DEVELOPER_ERROR,
        {"error": "The action exceeded its time limits of 2500 milliseconds."},
    ),
    (None, b"", 2.5, S.DEVELOPER_ERROR, {"error": "The action exceeded its time limits of 2500 milliseconds."}),
    (
        503,
        b'{"error":"shutting down"}',
        0.1,
        S.WHISK_ERROR,
        {"error": "The action container is shutting down; the activation must be rescheduled."},
    ),
]


@pytest.mark.parametrize(
    ("http_status", "body", "elapsed", "status", "result"),
    RUN_CASES,
    ids=[
        "dict",
        "error-field",
        "error-object",
        "array",
        "json-string",
        "not-json",
        "nan",
        "502-error",
        "400-exited",
        "500-no-action",
        "500-no-error-field",
        "500-array",
        "empty-body",
        "no-response",
        "late-200",
        "timeout",
        "503",
    ],
)
def test_run_outcome_table(
    http_status: int | None, body: bytes, elapsed: float, status: ActivationStatus, result: Any
) -> None:
    outcome = run_outcome(http_status=http_status, body=body, elapsed_s=elapsed, timeout_s=2.5)
    assert (outcome.status_code, outcome.result) == (status, result)
    assert outcome.timed_out == (elapsed >= 2.5)
    assert outcome.reschedule == (http_status == 503)
    assert outcome.keeps_container == (status in (S.SUCCESS, S.APPLICATION_ERROR))
    if http_status not in (None, 503) and body and elapsed < 2.5:
        assert outcome.size == len(body.decode())
    else:
        assert outcome.size is None


def test_oversized_run_response_is_an_application_error_with_the_truncated_text() -> None:
    body = b'{"big":"' + "é".encode() * 10 + b'"}'
    outcome = run_outcome(
        http_status=200, body=body[:12], total_length=len(body), elapsed_s=0.1, timeout_s=1, max_result_bytes=12
    )
    prefix = body[:12].decode("utf-8", "replace")
    expected = (
        f"The action produced a response that exceeded the allowed length: {len(body)} > 12 bytes. "
        f"The truncated response was: {prefix}"
    )
    assert outcome.status_code is S.APPLICATION_ERROR
    assert outcome.result == {"error": expected}
    assert outcome.size == len(body)
    assert outcome.keeps_container


def test_size_counts_utf16_units_like_openwhisk() -> None:
    outcome = run_outcome(http_status=200, body='{"s":"é😀"}'.encode(), elapsed_s=0, timeout_s=1)
    assert outcome.size == len('{"s":"') + 1 + 2 + len('"}')


INIT_CASES = [
    (200, b'{"ok":true}', 0.1, S.SUCCESS, None),
    (200, b"OK", 9.0, S.SUCCESS, None),  # a slow but successful init still counts
    (
        502,
        b'{"error":"Cannot start action. Check logs for details."}',
        0.1,
        S.DEVELOPER_ERROR,
        {"error": "Cannot start action. Check logs for details."},
    ),
    (
        403,
        b'{"error":"Cannot initialize the action more than once."}',
        0.1,
        S.DEVELOPER_ERROR,
        {"error": "Cannot initialize the action more than once."},
    ),
    (500, b"plain text", 0.1, S.DEVELOPER_ERROR, {"error": "The action failed during initialization: plain text"}),
    (
        500,
        b'{"no":"error"}',
        0.1,
        S.DEVELOPER_ERROR,
        {"error": 'The action failed during initialization: {"no":"error"}'},
    ),
    (500, b"", 0.1, S.DEVELOPER_ERROR, {"error": MSG_ABNORMAL_INIT}),
    (None, b"", 0.1, S.DEVELOPER_ERROR, {"error": MSG_ABNORMAL_INIT}),
    (
        None,
        b"",
        2.0,
        S.DEVELOPER_ERROR,
        {"error": "The action exceeded its time limits of 2000 milliseconds during initialization."},
    ),
    (
        502,
        b'{"error":"x"}',
        2.0,
        S.DEVELOPER_ERROR,
        {"error": "The action exceeded its time limits of 2000 milliseconds during initialization."},
    ),
    (
        503,
        b"",
        0.1,
        S.WHISK_ERROR,
        {"error": "The action container is shutting down; the activation must be rescheduled."},
    ),
]


@pytest.mark.parametrize(
    ("http_status", "body", "elapsed", "status", "result"),
    INIT_CASES,
    ids=["ok", "slow-ok", "502", "403", "text", "no-error-field", "empty", "no-response", "timeout", "late-502", "503"],
)
def test_init_outcome_table(
    http_status: int | None, body: bytes, elapsed: float, status: ActivationStatus, result: Any
) -> None:
    outcome = init_outcome(http_status=http_status, body=body, elapsed_s=elapsed, timeout_s=2.0)
    assert (outcome.status_code, outcome.result) == (status, result)
    assert outcome.reschedule == (http_status == 503)
    assert outcome.timed_out == ("time limits" in json.dumps(result))


def test_oversized_init_response_is_a_developer_error() -> None:
    outcome = init_outcome(
        http_status=200, body=b"x" * 8, total_length=100, elapsed_s=0, timeout_s=1, max_result_bytes=8
    )
    assert outcome.status_code is S.DEVELOPER_ERROR
    assert outcome.result["error"].startswith(
        "The action produced a response that exceeded the allowed length: 100 > 8"
    )


def test_outcome_json_and_status_names() -> None:
    outcome = RuntimeOutcome(status_code=S.APPLICATION_ERROR, result={"error": "x"}, size=13)
    assert outcome.response_json() == {"statusCode": 1, "result": {"error": "x"}, "size": 13}
    assert [s.api_string for s in S] == ["success", "application error", "action developer error", "whisk internal error"]


# -- request bodies ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("s", "s"),
        (42, "42"),
        (1.5, "1.5"),
        (True, "true"),
        (False, "false"),
        (None, ""),
        ({"a": [1, "é"]}, '{"a":[1,"é"]}'),
        ([1, 2], "[1,2]"),
    ],
    ids=["string", "int", "float", "true", "false", "null", "object", "array"],
)
def test_env_values_are_stringified(value: Any, text: str) -> None:
    assert env_string(value) == text


def test_init_body_carries_params_and_ow_env() -> None:
    ctx = ActivationContext(
        namespace="guest",
        action_name="/guest/pkg/act",
        action_version="0.0.2",
        activation_id="abc",
        transaction_id="tid-9",
        deadline_ms=1700000060000,
        api_key="u:k",
    )
    body = build_init_body(
        name="act",
        code="def main(a): return a",
        binary=False,
        main="handler",
        env={"MODEL": "/m", "N": 3, "Z": None},
        context=ctx,
    )
    assert body == {
        "value": {
            "name": "act",
            "main": "handler",
            "binary": False,
            "code": "def main(a): return a",
            "env": {
                "MODEL": "/m",
                "N": "3",
                "Z": "",
                "__OW_NAMESPACE": "guest",
                "__OW_ACTION_NAME": "/guest/pkg/act",
                "__OW_ACTION_VERSION": "0.0.2",
                "__OW_ACTIVATION_ID": "abc",
                "__OW_TRANSACTION_ID": "tid-9",
                "__OW_DEADLINE": "1700000060000",
                "__OW_API_KEY": "u:k",
            },
        }
    }
    bare = build_init_body(name="img", code=None, binary=False)
    assert bare == {"value": {"name": "img", "main": "main", "binary": False}}


def _stage_frame(result: dict[str, Any], blob: bytes | None) -> bytes:
    return b"".join(pack_stage(json.dumps(result).encode(), blob))


def test_run_outcome_of_a_stage_frame() -> None:
    """A RESULT_STAGE (a stage's answer on the direct lane): its JSON part is the result, its blob the tensor's
    bytes put back at `dilu_stage.data` as a `BlobView` (of the frame, not a copy); an error beside a tensor is the
    stage's error; a frame that is not one is the action's fault; the result limit holds for the whole frame."""
    head = {"dilu_stage": {"dtype": "uint8", "shape": [3]}, "n": 1}
    body = _stage_frame(head, b"abc")
    ok = run_outcome(http_status=200, body=body, elapsed_s=0.1, timeout_s=5, staged=True)
    assert ok.status_code is ActivationStatus.SUCCESS and ok.size == len(body)
    assert ok.result == {"dilu_stage": {"dtype": "uint8", "shape": [3], "data": b"abc"}, "n": 1}
    view = ok.result["dilu_stage"]["data"]
    assert isinstance(view, BlobView) and view.view.obj is body and len(view) == 3
    # over HTTP the same result is JSON, the bytes as base64: what `encode_body` writes of it for the next stage
    assert json.loads(encode_body({"value": ok.result}))["value"]["dilu_stage"]["data"] == "YWJj"
    failed = run_outcome(http_status=200, body=_stage_frame({**head, "error": "no"}, b"abc"), elapsed_s=0.1,
                         timeout_s=5, staged=True)
    assert failed.status_code is ActivationStatus.APPLICATION_ERROR and failed.result == {"error": "no"}
    for broken in (b"\0\0", STAGE_HEAD.pack(99, 0) + b"{}"):
        bad = run_outcome(http_status=200, body=broken, elapsed_s=0.1, timeout_s=5, staged=True)
        assert bad.status_code is ActivationStatus.DEVELOPER_ERROR and "valid stage frame" in bad.result["error"]
    over = run_outcome(http_status=200, body=body[:10], elapsed_s=0.1, timeout_s=5, max_result_bytes=10,
                       total_length=len(body), staged=True)
    assert over.status_code is ActivationStatus.APPLICATION_ERROR and over.size == len(body)
    # what was kept of the frame (10 bytes) less its 9-byte head
    assert over.result["error"].endswith(f"{len(body)} > 10 bytes. The truncated response was: {{")
    # a blob with no tensor field to go to is not the tensor's: the result is its JSON part alone
    plain = run_outcome(http_status=200, body=_stage_frame({"n": 2}, b"zz"), elapsed_s=0.1, timeout_s=5, staged=True)
    assert plain.result == {"n": 2}


def test_take_and_put_blob_are_each_others_inverse() -> None:
    result = {"dilu_stage": {"dtype": "uint8", "shape": [2], "data": Blob(b"hi")}, "k": [1]}
    rest, blob = take_blob(result)
    assert blob == b"hi" and rest == {"dilu_stage": {"dtype": "uint8", "shape": [2]}, "k": [1]}
    assert result["dilu_stage"]["data"] == b"hi"  # the result itself is left as it was
    text, got, flags = unpack_stage(b"".join(pack_stage(json.dumps(rest).encode(), blob, WELCOME_BLOB)))
    back = json.loads(text)
    put_blob(back, got)
    assert back == result and flags == WELCOME_BLOB
    # no Blob (a base64 string, or plain bytes the runtime does not write): nothing is taken
    for other in ({"dilu_stage": {"data": "aGk="}}, {"dilu_stage": {"data": b"hi"}}, [1], None):
        assert take_blob(other) == (other, None)
    kept = {"dilu_stage": {"data": "x"}}
    put_blob(kept, b"y")  # a tensor field that has its data already keeps it
    assert kept == {"dilu_stage": {"data": "x"}}
    # the invoker's view of a blob goes on as its bytes, and as base64 where the next stage takes JSON
    viewed = {"dilu_stage": {"dtype": "uint8"}}
    put_blob(viewed, memoryview(b"..hi")[2:], view=True)
    assert take_blob(viewed)[1] == b"hi" and json.loads(encode_body(viewed))["dilu_stage"]["data"] == "aGk="


def test_run_body_fields() -> None:
    ctx = ActivationContext(
        namespace="guest",
        action_name="/guest/act",
        action_version="0.0.1",
        activation_id="abc",
        transaction_id="tid",
        deadline_ms=1700000060000,
    )
    body = build_run_body({"name": "world"}, ctx)
    assert body == {
        "value": {"name": "world"},
        "namespace": "guest",
        "action_name": "/guest/act",
        "action_version": "0.0.1",
        "activation_id": "abc",
        "transaction_id": "tid",
        "deadline": "1700000060000",
    }
    assert build_run_body(None, ctx)["value"] == {}
    assert build_run_body([1, 2], ctx)["value"] == [1, 2]
    assert json.loads(encode_body(body)) == body


# -- the contract through the client, against both runtimes ----------------------------------------------------

RUNTIMES = pytest.mark.parametrize("module", [OURS, FAKE_UPSTREAM], ids=["ours", "fake-upstream"])

SCENARIO_SOURCE = code(
    """
    import os, sys

    def main(args):
        mode = args.get("mode")
        print("stdout", mode)
        print("stderr", mode, file=sys.stderr)
        if mode == "raise":
            raise Exception("boom!")
        if mode == "string":
            return "not a dict"
        if mode == "list":
            return [1, 2, 3]
        if mode == "exit":
            sys.exit(3)
        return {"mode": mode, "id": os.environ["__OW_ACTIVATION_ID"], "param": os.environ.get("PARAM")}
    """
)


@RUNTIMES
async def test_contract_rows_through_the_client(http: aiohttp.ClientSession, make_client: ClientFactory, module: str) -> None:
    async with running_runtime(module, frames=False) as rt:
        assert rt.process.stdout is not None and rt.process.stderr is not None
        reader = ActivationLogReader(rt.process.stdout, rt.process.stderr)
        client = make_client(rt.url)

        collection = reader.start(limit_bytes=1 << 20)
        early = await client.run(build_run_body({}, context()), 10)
        assert (early.status_code, early.result) == (S.DEVELOPER_ERROR, {"error": "no action defined yet"})

        init = await client.init(init_payload(SCENARIO_SOURCE, env={"PARAM": "p"}, context=context()), 10)
        assert init.ok and init.result is None

        again = await client.init(init_payload(SCENARIO_SOURCE), 10)
        assert again.result == {"error": "Cannot initialize the action more than once."}

        expectations = [
            ("ok", S.SUCCESS, {"mode": "ok", "id": "run-ok", "param": "p"}),
            ("raise", S.APPLICATION_ERROR, {"error": "boom!"}),
            ("string", S.DEVELOPER_ERROR, {"error": "The action did not return a dictionary or array."}),
            ("list", S.SUCCESS, [1, 2, 3]),
            ("exit", S.DEVELOPER_ERROR, {"error": "command exited"}),
        ]
        for mode, status, result in expectations:
            outcome = await client.run(build_run_body({"mode": mode}, context(f"run-{mode}")), 10)
            assert (outcome.status_code, outcome.result) == (status, result), mode
            logs = await collection.finish(developer_error=status is S.DEVELOPER_ERROR, timeout_s=10, settle_s=10)
            assert logs.complete, mode
            texts = [line.split(" ", 1)[1].strip() for line in logs.lines]
            assert f"stdout: stdout {mode}" in texts
            assert f"stderr: stderr {mode}" in texts
            assert not any("XXX_THE_END" in line for line in logs.lines)
            collection = reader.start(limit_bytes=1 << 20)

        after = await client.run(build_run_body({}, context()), 10)
        assert after.result == {"error": "no action defined yet"}
        await collection.finish(developer_error=True, settle_s=0)


@RUNTIMES
@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            init_payload("def main(args)\n    return {}\n"),
            "The action failed to generate or locate a binary. See logs for details.",
        ),
        (init_payload("def other(args):\n    return {}\n"), "Cannot start action. Check logs for details."),
        (build_init_body(name="act", code=None, binary=False), "Missing main/no code to execute."),
    ],
    ids=["syntax-error", "missing-main", "no-code"],
)
async def test_init_failures_through_the_client(
    http: aiohttp.ClientSession, module: str, body: dict[str, Any], error: str
) -> None:
    async with running_runtime(module) as rt:
        outcome = await RuntimeClient(http, rt.url).init(body, 10)
        assert (outcome.status_code, outcome.result) == (S.DEVELOPER_ERROR, {"error": error})
        assert not outcome.keeps_container


async def test_init_retries_until_the_runtime_listens(http: aiohttp.ClientSession) -> None:
    port = free_port()
    client = RuntimeClient(http, f"http://127.0.0.1:{port}")
    pending = asyncio.create_task(client.init(init_payload("def main(args):\n    return {}\n"), 60))
    await asyncio.sleep(0.3)
    assert not pending.done()  # refused connections are being retried
    process = await spawn(OURS, port=port)
    try:
        outcome = await pending
        assert outcome.ok
        assert outcome.elapsed_s >= 0.3
        assert (await client.run(build_run_body({}, context()), 10)).ok
    finally:
        await stop(process)


async def test_init_gives_up_at_the_timeout(http: aiohttp.ClientSession) -> None:
    client = RuntimeClient(http, f"http://127.0.0.1:{free_port()}")
    outcome = await client.init(init_payload("def main(a):\n    return {}\n"), 0.3)
    assert outcome.timed_out
    assert outcome.result == {"error": "The action exceeded its time limits of 300 milliseconds during initialization."}


async def test_run_is_not_retried(http: aiohttp.ClientSession, make_client: ClientFactory) -> None:
    client = make_client(f"http://127.0.0.1:{free_port()}")
    outcome = await client.run(build_run_body({}, context()), 30)
    assert outcome.result == {"error": MSG_ABNORMAL_RUN}
    assert not outcome.timed_out


async def test_run_and_init_timeouts(http: aiohttp.ClientSession, make_client: ClientFactory) -> None:
    hang_in_main = "import time\n\ndef main(args):\n    time.sleep(3600)\n"
    async with running_runtime(args=["--shutdown-grace-s", "0"]) as rt:
        client = make_client(rt.url)
        assert (await client.init(init_payload(hang_in_main), 10)).ok
        outcome = await client.run(build_run_body({}, context()), 0.5)
        assert outcome.timed_out and outcome.status_code is S.DEVELOPER_ERROR
        assert outcome.result == {"error": "The action exceeded its time limits of 500 milliseconds."}
    async with running_runtime(args=["--shutdown-grace-s", "0"]) as rt:
        outcome = await make_client(rt.url).init(init_payload("import time\ntime.sleep(3600)\n"), 0.5)
        assert outcome.timed_out
        assert outcome.result == {
            "error": "The action exceeded its time limits of 500 milliseconds during initialization."
        }


async def test_oversized_result_from_a_live_runtime(http: aiohttp.ClientSession, make_client: ClientFactory) -> None:
    source = "def main(args):\n    return {'blob': 'x' * args['n']}\n"
    async with running_runtime() as rt:
        client = make_client(rt.url)
        await client.init(init_payload(source), 10)
        n = 3 * DEFAULT_MAX_RESULT_BYTES
        outcome = await client.run(build_run_body({"n": n}, context()), 30)
        length = len(json.dumps({"blob": "x" * n}, separators=(",", ":")))
        assert outcome.status_code is S.APPLICATION_ERROR
        message = outcome.result["error"]
        assert message.startswith(
            f"The action produced a response that exceeded the allowed length: {length} > {DEFAULT_MAX_RESULT_BYTES} "
            'bytes. The truncated response was: {"blob":"xxx'
        )
        assert outcome.size == length
        # The same client and runtime keep working after the oversized body was cut off.
        assert (await client.run(build_run_body({"n": 3}, context()), 10)).result == {"blob": "xxx"}


async def test_a_crashing_action_and_a_dead_runtime(http: aiohttp.ClientSession, make_client: ClientFactory) -> None:
    source = "import ctypes\n\ndef main(args):\n    ctypes.string_at(0)\n"
    async with running_runtime() as rt:
        client = make_client(rt.url)
        await client.init(init_payload(source), 10)
        crashed = await client.run(build_run_body({}, context()), 10)
        assert crashed.result == {"error": "command exited"} and not crashed.keeps_container
        rt.process.kill()
        await rt.process.wait()
        gone = await client.run(build_run_body({}, context()), 10)
        assert gone.result == {"error": MSG_ABNORMAL_RUN}


async def test_shutting_down_runtime_asks_for_a_reschedule(http: aiohttp.ClientSession, make_client: ClientFactory, tmp_path: Path) -> None:
    release = tmp_path / "go"
    source = code(
        f"""
        import os, time

        def main(args):
            while not os.path.exists({str(release)!r}):
                time.sleep(0.01)
            return {{}}
        """
    )
    async with running_runtime(args=["--shutdown-grace-s", "60"]) as rt:
        client = make_client(rt.url)
        await client.init(init_payload(source), 10)
        busy = asyncio.create_task(client.run(build_run_body({}, context()), 60))
        await wait_for_active_runs(http, rt.url, 1)
        rt.process.send_signal(signal.SIGTERM)
        outcome = await client.run(build_run_body({}, context()), 10)
        assert outcome.reschedule and outcome.status_code is S.WHISK_ERROR
        release.write_text("go")
        assert (await busy).ok


# -- the log splitter ----------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000_000_000_000

    def __call__(self) -> int:
        self.now += 1_000
        return self.now


def fed_reader(clock: Clock) -> tuple[ActivationLogReader, asyncio.StreamReader, asyncio.StreamReader]:
    out, err = asyncio.StreamReader(), asyncio.StreamReader()
    return ActivationLogReader(out, err, clock_ns=clock, chunk_bytes=7), out, err


def text_of(line: str) -> str:
    return line[31:]


def test_log_line_format() -> None:
    line = format_log_line(1_704_110_400_123_456_789, "stdout", "hello")
    assert line == "2024-01-01T12:00:00.123456789Z stdout: hello"
    assert format_log_line(1_704_110_400_000_000_000, "stderr", "x").startswith("2024-01-01T12:00:00.000000000Z ")


async def test_logs_are_split_at_sentinels_and_carried_over() -> None:
    reader, out, err = fed_reader(Clock())
    out.feed_data(b"one\r\ntwo\n" + SENTINEL + b"next activation\n" + SENTINEL)
    err.feed_data(b"warn\n" + SENTINEL + SENTINEL)
    first = await reader.collect(limit_bytes=1 << 20)
    assert [text_of(line) for line in first.lines if "stdout" in line] == ["stdout: one", "stdout: two"]
    assert [text_of(line) for line in first.lines if "stderr" in line] == ["stderr: warn"]
    assert first.complete and not first.truncated and not first.collecting_error
    assert all(line[30] == " " and line[29] == "Z" for line in first.lines)
    second = await reader.collect(limit_bytes=1 << 20)
    assert [text_of(line) for line in second.lines] == ["stdout: next activation"]


async def test_output_glued_to_the_sentinel_is_kept() -> None:
    reader, out, err = fed_reader(Clock())
    out.feed_data(b"partial" + SENTINEL)
    err.feed_data(SENTINEL)
    logs = await reader.collect(limit_bytes=1 << 20)
    assert [text_of(line) for line in logs.lines] == ["stdout: partial"]


async def test_truncation_keeps_whole_lines_and_the_next_activation_is_clean() -> None:
    reader, out, err = fed_reader(Clock())
    out.feed_data(b"0123456789\n" * 3 + b"y" * 1000 + b"\nsmall\n" + SENTINEL + b"after\n" + SENTINEL)
    err.feed_data(SENTINEL + SENTINEL)
    logs = await reader.collect(limit_bytes=30)
    assert [text_of(line) for line in logs.lines] == [
        "stdout: 0123456789",
        "stdout: 0123456789",
        "stderr: Logs were truncated because the total bytes size exceeds the limit of 30 bytes.",
    ]
    assert logs.truncated and logs.complete and logs.collecting_error
    nxt = await reader.collect(limit_bytes=30)
    assert [text_of(line) for line in nxt.lines] == ["stdout: after"]
    assert not nxt.truncated


async def test_missing_sentinel_times_out_with_openwhisks_notice() -> None:
    reader, out, err = fed_reader(Clock())
    out.feed_data(b"started\n" + SENTINEL)
    err.feed_data(b"still going\n")
    logs = await reader.collect(limit_bytes=1 << 20, timeout_s=0.1)
    assert [text_of(line) for line in logs.lines] == [
        "stdout: started",
        "stderr: still going",
        f"stderr: {MSG_LOG_FAILURE}",
    ]
    assert not logs.complete
    err.feed_data(b"more\n" + SENTINEL)
    out.feed_data(SENTINEL)
    late = await reader.collect(limit_bytes=1 << 20)
    assert [text_of(line) for line in late.lines] == ["stderr: more"]


async def test_developer_error_does_not_wait_and_says_logs_may_be_missing() -> None:
    reader, out, _err = fed_reader(Clock())
    out.feed_data(b"before the crash\n")
    logs = await reader.collect(limit_bytes=1 << 20, developer_error=True, settle_s=0.05)
    assert [text_of(line) for line in logs.lines] == ["stdout: before the crash", f"stderr: {MSG_LOG_DEVELOPER_ERROR}"]


async def test_end_of_stream_without_sentinel() -> None:
    reader, out, err = fed_reader(Clock())
    out.feed_data(b"last words")
    out.feed_eof()
    err.feed_eof()
    logs = await reader.collect(limit_bytes=1 << 20)
    assert [text_of(line) for line in logs.lines] == ["stdout: last words", f"stderr: {MSG_LOG_FAILURE}"]
    assert not logs.complete


async def test_one_collection_at_a_time_and_cancellation_frees_the_reader() -> None:
    reader, out, err = fed_reader(Clock())
    collection = reader.start(limit_bytes=100)
    with pytest.raises(RuntimeError):
        reader.start(limit_bytes=100)
    waiting = asyncio.create_task(collection.finish(timeout_s=3600))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    out.feed_data(b"fine\n" + SENTINEL)
    err.feed_data(SENTINEL)
    assert [text_of(line) for line in (await reader.collect(limit_bytes=100)).lines] == ["stdout: fine"]


@RUNTIMES
async def test_a_flood_is_truncated_in_bounded_memory(http: aiohttp.ClientSession, module: str) -> None:
    flood = code(
        """
        import sys

        def main(args):
            line = "z" * 1023 + "\\n"
            block = line * 1024
            for _ in range(args["mib"]):
                sys.stdout.write(block)
            print("tail", file=sys.stderr)
            return {"ok": True}
        """
    )
    async with running_runtime(module, frames=False) as rt:
        assert rt.process.stdout is not None and rt.process.stderr is not None
        reader = ActivationLogReader(rt.process.stdout, rt.process.stderr)
        client = RuntimeClient(http, rt.url)
        limit = 1024 * 1024
        collection = reader.start(limit_bytes=limit)
        assert (await client.init(init_payload(flood), 30)).ok
        tracemalloc.start()
        try:
            outcome = await client.run(build_run_body({"mib": 100}, context()), 300)
            logs = await collection.finish(timeout_s=300)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert outcome.ok
        assert logs.truncated and logs.complete
        kept = logs.lines[:-1]
        assert len(kept) == limit // 1024  # whole 1 KiB lines up to the limit, then nothing
        assert logs.lines[-1].endswith(
            f"stderr: Logs were truncated because the total bytes size exceeds the limit of {limit} bytes."
        )
        assert peak < 32 * 1024 * 1024  # 100 MiB went through; a few MiB stayed
        # The reader stopped at the flood's sentinels: the next activation is framed correctly.
        collection = reader.start(limit_bytes=limit)
        assert (await client.run(build_run_body({"mib": 0}, context()), 30)).ok
        nxt = await collection.finish(timeout_s=30)
        assert [text_of(line) for line in nxt.lines] == ["stderr: tail"]


async def test_init_stops_retrying_once_the_runtime_has_exited(http: aiohttp.ClientSession) -> None:
    """A runtime that exits before it listens (here: its port is taken) is not waited for until the
    action's timeout: /init answers at once that it exited."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()  # nothing accepts: connects are queued, then refused once this closes
        port = taken.getsockname()[1]
        process = await spawn(OURS, port=port)
        rc = await asyncio.wait_for(process.wait(), 30)
    assert rc == 1  # "cannot listen"
    client = RuntimeClient(http, f"http://127.0.0.1:{port}", alive=lambda: process.returncode is None)
    outcome = await client.init(init_payload("def main(a):\n    return {}\n"), 20)
    assert not outcome.timed_out
    assert outcome.result == {"error": MSG_ABNORMAL_INIT}
    assert outcome.elapsed_s < 20


# -- kept connections for /run ----------------------------------------------------------------------------------


async def _raw_server(answers: list[bytes]) -> tuple[asyncio.Server, list[int], str]:
    """A loopback server answering each request (read to its body) with the next of ``answers``; counts the
    connections it accepted."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(answers.pop(0))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, accepted, f"http://127.0.0.1:{port}"


def _answer(body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def test_kept_connections_are_reused_and_close_where_the_answer_says(http: aiohttp.ClientSession) -> None:
    answers = [_answer(b'{"a":1}'), _answer(b'{"a":2}'), _answer(b'{"a":3}', "Connection: close"), _answer(b'{"a":4}')]
    server, accepted, url = await _raw_server(answers)
    connections = RunConnections()
    client = RuntimeClient(http, url, connections=connections, secret="s3")
    try:
        results = [(await client.run(build_run_body({}, context()), 5)).result for _ in range(4)]
        assert results == [{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}]
        assert len(accepted) == 2  # one connection until the answer that closed it
        connections.discard(*client.address)
        assert not connections._idle
    finally:
        connections.close()
        server.close()


@pytest.mark.parametrize(("answer", "reused"), [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\n{\"a\":1}\r\n0\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 7\r\n\r\n{\"a\":1}", False),
    (b"garbage\r\n\r\n", False),
], ids=["chunked", "empty", "http-1.0", "garbage"])
async def test_kept_connections_map_odd_answers_as_aiohttp_does(http: aiohttp.ClientSession, answer: bytes,
                                                                reused: bool) -> None:
    server, accepted, url = await _raw_server([answer, _answer(b'{"next":true}')])
    connections = RunConnections()
    kept = RuntimeClient(http, url, connections=connections)
    try:
        outcome = await kept.run(build_run_body({}, context()), 5)
        if answer.startswith(b"HTTP/1.0"):
            assert outcome.result == {"a": 1}
        else:  # no usable entity: OpenWhisk's "no response"
            assert outcome.result == {"error": MSG_ABNORMAL_RUN}
        assert (await kept.run(build_run_body({}, context()), 5)).result == {"next": True}
        assert len(accepted) == (1 if reused else 2)
    finally:
        connections.close()
        server.close()
