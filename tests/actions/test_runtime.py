"""Our action runtime against the upstream behaviour contract (reference/openwhisk.md §4, §10.1).

Every test starts the runtime as a real child process on a free loopback port and drives it over HTTP.
"""

from __future__ import annotations

import asyncio
import signal
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from tests.fakes.bodies import init_body, post, run_body, zip_base64
from tests.fakes.runtime_process import running_runtime, wait_for_active_runs

SENTINEL = "XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX"


def code(source: str) -> str:
    return textwrap.dedent(source).lstrip("\n")


ECHO_ENV = code(
    """
    import os

    def main(args):
        return {
            "args": args,
            "env": {k: v for k, v in os.environ.items() if k.startswith("__OW_") or k.startswith("PARAM_")},
        }
    """
)


# -- the contract table ---------------------------------------------------------------------------------


async def test_init_and_run_pass_params_init_env_and_ow_variables(http: aiohttp.ClientSession) -> None:
    async with running_runtime(env={"__OW_API_HOST": "http://api.example:3233"}) as rt:
        env = {
            "PARAM_MODEL_DIR": "/models",
            "__OW_NAMESPACE": "guest",
            "__OW_ACTION_NAME": "/guest/echo",
            "__OW_ACTIVATION_ID": "init-activation",
            "__OW_DEADLINE": "1700000060000",
        }
        assert await post(http, rt.url + "/init", init_body(ECHO_ENV, env=env)) == (200, {"ok": True})
        fields = {
            "namespace": "guest",
            "action_name": "/guest/echo",
            "action_version": "0.0.1",
            "activation_id": "a1",
            "transaction_id": "tid-1",
            "deadline": str(int(time.time() * 1000) + 60_000),
            "api_key": "uuid:key",
        }
        status, result = await post(http, rt.url + "/run", run_body({"name": "world"}, **fields))
        assert status == 200
        assert result["args"] == {"name": "world"}
        seen = result["env"]
        for key, value in fields.items():
            assert seen[f"__OW_{key.upper()}"] == value
        assert seen["PARAM_MODEL_DIR"] == "/models"
        assert seen["__OW_API_HOST"] == "http://api.example:3233"


async def test_ow_variables_follow_each_run(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        await post(http, rt.url + "/init", init_body(ECHO_ENV))
        for activation in ("first", "second", "third"):
            status, result = await post(http, rt.url + "/run", run_body(activation_id=activation))
            assert status == 200
            assert result["env"]["__OW_ACTIVATION_ID"] == activation


async def test_init_env_values_are_strings(http: aiohttp.ClientSession) -> None:
    # The invoker stringifies env values; a client that does not still gets strings in os.environ.
    async with running_runtime() as rt:
        env = {"PARAM_S": "text", "PARAM_N": 42, "PARAM_B": True, "PARAM_O": {"a": [1, 2]}, "PARAM_Z": None}
        assert (await post(http, rt.url + "/init", init_body(ECHO_ENV, env=env)))[0] == 200
        _, result = await post(http, rt.url + "/run", run_body())
        assert result["env"] == {
            "PARAM_S": "text",
            "PARAM_N": "42",
            "PARAM_B": "true",
            "PARAM_O": '{"a": [1, 2]}',
            "PARAM_Z": "null",
        }


async def test_exception_is_an_error_result_and_the_runtime_stays_warm(http: aiohttp.ClientSession) -> None:
    source = code(
        """
        def main(args):
            if args.get("fail"):
                raise Exception("boom!")
            return {"ok": 1}
        """
    )
    async with running_runtime() as rt:
        await post(http, rt.url + "/init", init_body(source))
        assert await post(http, rt.url + "/run", run_body({"fail": True})) == (200, {"error": "boom!"})
        _stdout, stderr = await rt.frames()
        assert any("Exception: boom!" in line for line in stderr.lines)
        assert not any("worker.py" in line for line in stderr.lines)  # the user's frames, not ours
        assert await post(http, rt.url + "/run", run_body()) == (200, {"ok": 1})


@pytest.mark.parametrize(
    ("returned", "status", "body"),
    [
        ('"a string"', 502, {"error": "The action did not return a dictionary or array."}),
        ("None", 502, {"error": "The action did not return a dictionary or array."}),
        ("42", 502, {"error": "The action did not return a dictionary or array."}),
        ("[1, 2, 3]", 200, [1, 2, 3]),
        ("(1, 2)", 200, [1, 2]),
        ('{"nested": {"x": [1, None, True]}}', 200, {"nested": {"x": [1, None, True]}}),
    ],
    ids=["string", "none", "number", "list", "tuple", "dict"],
)
async def test_result_shapes(http: aiohttp.ClientSession, returned: str, status: int, body: object) -> None:
    async with running_runtime() as rt:
        await post(http, rt.url + "/init", init_body(f"def main(args):\n    return {returned}\n"))
        assert await post(http, rt.url + "/run", run_body()) == (status, body)
        # A bad result is the action's fault, not the runtime's: it keeps serving.
        assert (await post(http, rt.url + "/run", run_body()))[0] == status


async def test_unserializable_result_is_a_developer_error(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        await post(http, rt.url + "/init", init_body("def main(args):\n    return {'x': object()}\n"))
        status, body = await post(http, rt.url + "/run", run_body())
        assert status == 502
        assert body["error"].startswith("The action returned a result that is not valid JSON")


async def test_second_init_is_forbidden(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        assert (await post(http, rt.url + "/init", init_body(ECHO_ENV)))[0] == 200
        forbidden = (403, {"error": "Cannot initialize the action more than once."})
        assert await post(http, rt.url + "/init", init_body(ECHO_ENV)) == forbidden
        assert (await post(http, rt.url + "/run", run_body()))[0] == 200


async def test_run_before_init_has_no_action_and_no_sentinel(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        assert await post(http, rt.url + "/run", run_body()) == (500, {"error": "no action defined yet"})
        await post(http, rt.url + "/init", init_body("def main(args):\n    print('ran')\n    return {}\n"))
        await post(http, rt.url + "/run", run_body())
        stdout, stderr = await rt.frames()
        # The first frame is the run's: the early /run wrote no sentinel.
        assert stdout.lines == ["ran"]
        assert stderr.lines == []


async def test_init_without_code_is_forbidden(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        body = {"value": {"name": "action", "main": "main", "binary": False}}
        assert await post(http, rt.url + "/init", body) == (403, {"error": "Missing main/no code to execute."})
        await rt.frames()  # a failed init is framed on both streams
        assert (await post(http, rt.url + "/init", init_body(ECHO_ENV)))[0] == 200


async def test_syntax_error_fails_init_with_the_upstream_message(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        status, body = await post(http, rt.url + "/init", init_body("def main(args)\n    return {}\n"))
        assert (status, body) == (
            502,
            {"error": "The action failed to generate or locate a binary. See logs for details."},
        )
        _stdout, stderr = await rt.frames()
        assert any("SyntaxError" in line for line in stderr.lines)
        assert await post(http, rt.url + "/run", run_body()) == (500, {"error": "no action defined yet"})


@pytest.mark.parametrize(
    ("source", "main", "log_text"),
    [
        ("def main(args):\n    return {}\n", "handler", "no function named 'handler'"),
        ("handler = 3\n", "handler", "no function named 'handler'"),
        ("raise RuntimeError('bad import')\n", "main", "RuntimeError: bad import"),
        ("import no_such_module_here\n", "main", "ModuleNotFoundError"),
        ("import os\nos._exit(9)\n", "main", "exited with code 9"),
        ("import sys\nsys.exit(2)\n", "main", "exited with code 2"),
    ],
    ids=[
        "missing-main",
        "main-not-callable",
        "raises-at-import",
        "import-error",
        "os-exit-at-import",
        "sys-exit-at-import",
    ],
)
async def test_failures_while_loading_cannot_start_the_action(
    http: aiohttp.ClientSession, source: str, main: str, log_text: str
) -> None:
    async with running_runtime() as rt:
        status, body = await post(http, rt.url + "/init", init_body(source, main=main))
        assert (status, body) == (502, {"error": "Cannot start action. Check logs for details."})
        _stdout, stderr = await rt.frames()
        assert any(log_text in line for line in stderr.lines), stderr.lines
        # As upstream, a failed init leaves the runtime uninitialized: a later /init may succeed.
        assert (await post(http, rt.url + "/init", init_body(ECHO_ENV)))[0] == 200
        assert (await post(http, rt.url + "/run", run_body()))[0] == 200


async def test_main_name_comes_from_init(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        source = "def handler(args):\n    return {'via': 'handler'}\n\ndef main(args):\n    return {'via': 'main'}\n"
        await post(http, rt.url + "/init", init_body(source, main="handler"))
        assert await post(http, rt.url + "/run", run_body()) == (200, {"via": "handler"})


# -- a broken action never kills the proxy ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("statement", "note"),
    [
        ("sys.exit(3)", "exited with code 3"),
        ("os._exit(4)", "exited with code 4"),
        ("ctypes.string_at(0)", "killed by SIGSEGV"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ],
    ids=["sys-exit", "os-exit", "segfault", "sigkill"],
)
async def test_a_dying_action_gets_command_exited_then_no_action(
    http: aiohttp.ClientSession, statement: str, note: str
) -> None:
    source = f"import ctypes, os, signal, sys\n\ndef main(args):\n    print('before')\n    {statement}\n"
    async with running_runtime() as rt:
        await post(http, rt.url + "/init", init_body(source))
        assert await post(http, rt.url + "/run", run_body()) == (400, {"error": "command exited"})
        _stdout, stderr = await rt.frames()
        assert any(note in line for line in stderr.lines), stderr.lines
        assert await post(http, rt.url + "/run", run_body()) == (500, {"error": "no action defined yet"})
        async with http.get(rt.url + "/health") as response:
            assert (await response.json())["state"] == "failed"
        assert rt.process.returncode is None


async def test_a_hanging_action_does_not_block_the_proxy(http: aiohttp.ClientSession) -> None:
    source = "import time\n\ndef main(args):\n    time.sleep(3600)\n"
    async with running_runtime(args=["--deadline-grace-ms", "-1", "--shutdown-grace-s", "0"]) as rt:
        await post(http, rt.url + "/init", init_body(source))
        run = asyncio.create_task(post(http, rt.url + "/run", run_body()))
        await wait_for_active_runs(http, rt.url, 1)
        async with http.get(rt.url + "/ping") as response:
            assert (response.status, await response.text()) == (200, "pong")
        assert not run.done()
        run.cancel()


async def test_deadline_guard_stops_a_hanging_action(http: aiohttp.ClientSession) -> None:
    source = "import time\n\ndef main(args):\n    time.sleep(3600)\n"
    async with running_runtime(args=["--deadline-grace-ms", "100"]) as rt:
        await post(http, rt.url + "/init", init_body(source))
        deadline = str(int(time.time() * 1000) + 200)
        status, body = await post(http, rt.url + "/run", run_body(deadline=deadline))
        assert (status, body) == (502, {"error": "The action did not finish by its deadline and was stopped."})
        _stdout, stderr = await rt.frames()
        assert any("past its deadline" in line for line in stderr.lines)
        assert await post(http, rt.url + "/run", run_body()) == (500, {"error": "no action defined yet"})


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


async def test_a_hundred_megabytes_of_prints_pass_through(http: aiohttp.ClientSession) -> None:
    source = code(
        """
        import sys

        def main(args):
            line = "x" * 1023 + "\\n"
            block = line * 1024
            for _ in range(100):
                sys.stdout.write(block)
            sys.stderr.write("done\\n")
            return {"printed_mib": 100}
        """
    )
    async with running_runtime() as rt:
        await post(http, rt.url + "/init", init_body(source))
        assert await post(http, rt.url + "/run", run_body(), timeout_s=300) == (200, {"printed_mib": 100})
        stdout, stderr = await rt.frames(timeout_s=300)
        assert stdout.total_bytes == 100 * 1024 * 1024
        assert stdout.line_count == 100 * 1024
        assert stderr.lines == ["done"]
        # The output went from the worker straight to the pipe: the proxy buffered none of it.
        assert _peak_rss_kib(rt.pid) < 100 * 1024
        assert await post(http, rt.url + "/run", run_body(), timeout_s=300) == (200, {"printed_mib": 100})


async def test_sentinels_follow_the_output_on_both_streams(http: aiohttp.ClientSession) -> None:
    source = code(
        """
        import ctypes, sys

        print("loading")  # init output belongs to the first run's logs

        def main(args):
            print("out", args["n"])
            print("err", args["n"], file=sys.stderr)
            ctypes.CDLL(None).printf(b"from C %d\\n", args["n"])  # libc's buffer is flushed too
            print("no newline", end="")
            return {}
        """
    )
    async with running_runtime() as rt:
        await post(http, rt.url + "/init", init_body(source))
        for n in (1, 2):
            await post(http, rt.url + "/run", run_body({"n": n}))
        first_out, first_err = await rt.frames()
        second_out, second_err = await rt.frames()
        assert first_out.lines[0] == "loading"
        assert sorted(first_out.lines[1:]) == sorted(["out 1", "from C 1", "no newline"])
        assert first_err.lines == ["err 1"]
        assert sorted(second_out.lines) == sorted(["out 2", "from C 2", "no newline"])
        assert second_err.lines == ["err 2"]


# -- zip actions ------------------------------------------------------------------------------------------


async def test_zip_with_main_and_helper_module(http: aiohttp.ClientSession) -> None:
    files = {
        "__main__.py": "import helper\n\ndef main(args):\n    return {'answer': helper.answer(), 'cwd_file': open('data.txt').read()}\n",
        "helper.py": "def answer():\n    return 42\n",
        "data.txt": "from the zip",
    }
    async with running_runtime() as rt:
        assert (await post(http, rt.url + "/init", init_body(zip_base64(files), binary=True)))[0] == 200
        assert await post(http, rt.url + "/run", run_body()) == (200, {"answer": 42, "cwd_file": "from the zip"})


ACTIVATE_THIS = code(
    """
    # What virtualenv's activate_this.py does that matters here: put site-packages first on sys.path.
    import os, site, sys
    base = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    before = list(sys.path)
    site.addsitedir(os.path.join(base, "lib", "python3.11", "site-packages"))
    sys.path[:] = [p for p in sys.path if p not in before] + before
    os.environ["VIRTUAL_ENV"] = base
    """
)
USES_PACKAGE = "import vendored\nimport os\n\ndef main(args):\n    return {'v': vendored.VERSION, 've': os.environ.get('VIRTUAL_ENV', '').endswith('virtualenv')}\n"


@pytest.mark.parametrize(
    "extra",
    [{"virtualenv/bin/activate_this.py": ACTIVATE_THIS}, {}],
    ids=["virtualenv-tool", "python-venv"],
)
async def test_zip_with_virtualenv(http: aiohttp.ClientSession, extra: dict[str, str]) -> None:
    files = {
        "__main__.py": USES_PACKAGE,
        "virtualenv/lib/python3.11/site-packages/vendored/__init__.py": "VERSION = '1.2.3'\n",
        "virtualenv/bin/python": "",
        **extra,
    }
    async with running_runtime() as rt:
        assert (await post(http, rt.url + "/init", init_body(zip_base64(files), binary=True)))[0] == 200
        assert await post(http, rt.url + "/run", run_body()) == (200, {"v": "1.2.3", "ve": True})


@pytest.mark.parametrize(
    ("code_value", "status", "error", "log_text"),
    [
        (
            zip_base64({"main.py": "def main(a):\n    return {}\n"}),
            502,
            "The action failed to generate or locate a binary. See logs for details.",
            "does not include __main__.py",
        ),
        (
            "bm90IGEgemlw",
            502,
            "The action failed to generate or locate a binary. See logs for details.",
            "not a usable zip",
        ),
        (
            zip_base64({"__main__.py": "def main(a):\n    return {}\n", "virtualenv/README": "empty"}),
            502,
            "Cannot start action. Check logs for details.",
            "Invalid virtualenv",
        ),
        ("%%% not base64 %%%", 400, None, "cannot decode the request"),
    ],
    ids=["no-main-file", "not-a-zip", "virtualenv-without-packages", "bad-base64"],
)
async def test_bad_zip_actions(
    http: aiohttp.ClientSession, code_value: str, status: int, error: str | None, log_text: str
) -> None:
    async with running_runtime() as rt:
        got_status, body = await post(http, rt.url + "/init", init_body(code_value, binary=True))
        assert got_status == status
        if error is not None:
            assert body == {"error": error}
        else:
            assert body["error"].startswith("cannot decode the request")
        _stdout, stderr = await rt.frames()
        assert any(log_text in line for line in stderr.lines), stderr.lines


# -- concurrency --------------------------------------------------------------------------------------------

BARRIER = code(
    """
    import threading

    barrier = threading.Barrier(2, timeout=float(__import__("os").environ["PARAM_WAIT"]))

    def main(args):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return {"error": "alone"}
        return {"together": args["n"]}
    """
)


async def test_concurrent_runs_share_one_worker_when_allowed(http: aiohttp.ClientSession) -> None:
    async with running_runtime(env={"__OW_ALLOW_CONCURRENT": "true"}) as rt:
        await post(http, rt.url + "/init", init_body(BARRIER, env={"PARAM_WAIT": "60"}))
        results = await asyncio.gather(*(post(http, rt.url + "/run", run_body({"n": n})) for n in (1, 2)))
        assert sorted(results, key=str) == [(200, {"together": 1}), (200, {"together": 2})]
        for _ in range(2):  # one sentinel pair per run
            await rt.frames()


async def test_large_results_of_concurrent_runs_reach_their_own_callers(http: aiohttp.ClientSession) -> None:
    # Replies of several MB arrive from the worker in many socket reads, interleaved between runs: each
    # caller gets its own result whole.
    code = "def main(args):\n    n = args['n']\n    return {'n': n, 'blob': str(n) * (n * 1_000_000)}\n"
    async with running_runtime(env={"__OW_ALLOW_CONCURRENT": "true"}) as rt:
        assert (await post(http, rt.url + "/init", init_body(code)))[0] == 200
        results = await asyncio.gather(*(post(http, rt.url + "/run", run_body({"n": n})) for n in (1, 2, 3)))
        for n, (status, body) in zip((1, 2, 3), results, strict=True):
            assert status == 200 and body["n"] == n and body["blob"] == str(n) * (n * 1_000_000)
        for _ in range(3):
            await rt.frames()


async def test_runs_are_serialized_without_the_concurrency_flag(http: aiohttp.ClientSession) -> None:
    async with running_runtime(env={"__OW_ALLOW_CONCURRENT": "false"}) as rt:
        await post(http, rt.url + "/init", init_body(BARRIER, env={"PARAM_WAIT": "0.5"}))
        results = await asyncio.gather(*(post(http, rt.url + "/run", run_body({"n": n})) for n in (1, 2)))
        # Each run meets the barrier alone: they never overlapped.
        assert results == [(200, {"error": "alone"}), (200, {"error": "alone"})]


# -- housekeeping endpoints, bad requests, shutdown ---------------------------------------------------------


async def test_ping_health_and_root(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        async with http.get(rt.url + "/") as response:
            assert response.status == 200
        async with http.get(rt.url + "/ping") as response:
            assert await response.text() == "pong"
        async with http.get(rt.url + "/health") as response:
            health = await response.json()
        assert health["state"] == "uninitialized"
        assert health["concurrent"] is False


async def test_malformed_bodies_get_400_and_harm_nothing(http: aiohttp.ClientSession) -> None:
    async with running_runtime() as rt:
        status, body = await post(http, rt.url + "/init", b"{not json")
        assert status == 400 and body["error"].startswith("Error unmarshaling request")
        status, body = await post(http, rt.url + "/init", {"value": "not an object"})
        assert status == 400
        assert (await post(http, rt.url + "/init", init_body(ECHO_ENV)))[0] == 200
        status, body = await post(http, rt.url + "/run", b"[1, 2")
        assert status == 400 and body["error"].startswith("Error reading request body")
        assert (await post(http, rt.url + "/run", run_body({"still": "works"})))[1]["args"] == {"still": "works"}


async def test_large_init_code_is_accepted(http: aiohttp.ClientSession) -> None:
    padding = "# " + "p" * 1022 + "\n"
    source = padding * (8 * 1024) + "def main(args):\n    return {'big': True}\n"  # 8 MiB of source
    async with running_runtime() as rt:
        assert (await post(http, rt.url + "/init", init_body(source)))[0] == 200
        assert await post(http, rt.url + "/run", run_body()) == (200, {"big": True})


async def test_sigterm_drains_running_activations_and_refuses_new_ones(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    source = code(
        f"""
        import os, time

        def main(args):
            while not os.path.exists({str(release)!r}):
                time.sleep(0.01)
            return {{"released": True}}
        """
    )
    async with running_runtime(args=["--shutdown-grace-s", "60"]) as rt:
        await post(http, rt.url + "/init", init_body(source))
        running = asyncio.create_task(post(http, rt.url + "/run", run_body()))
        await wait_for_active_runs(http, rt.url, 1)
        # A run queued behind the running one when the signal comes is refused too: it never started.
        queued = asyncio.create_task(post(http, rt.url + "/run", run_body()))
        rt.process.send_signal(signal.SIGTERM)
        shutting = (503, {"error": "The action runtime is shutting down."})
        assert await queued == shutting
        assert await post(http, rt.url + "/run", run_body()) == shutting
        assert await post(http, rt.url + "/init", init_body(ECHO_ENV)) == shutting
        release.write_text("go")
        assert await running == (200, {"released": True})
        assert await asyncio.wait_for(rt.process.wait(), 30) == 0


def test_cli_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from dilu_invoker.actions import runtime

    monkeypatch.delenv("DILU_RUNTIME_PORT", raising=False)
    monkeypatch.delenv("DILU_RUNTIME_HOST", raising=False)
    args = runtime.parse_args([])
    assert (args.host, args.port) == ("127.0.0.1", 8080)
    monkeypatch.setenv("DILU_RUNTIME_PORT", "9999")
    monkeypatch.setenv("DILU_RUNTIME_HOST", "0.0.0.0")
    args = runtime.parse_args([])
    assert (args.host, args.port) == ("0.0.0.0", 9999)
    args = runtime.parse_args(["--host", "127.0.0.2", "--port", "8081"])
    assert (args.host, args.port) == ("127.0.0.2", 8081)
    assert runtime.main(["--port", "70000"]) == 2


def test_sentinel_is_openwhisks() -> None:
    from dilu_invoker.actions._ipc import SENTINEL_LINE

    assert SENTINEL_LINE == (SENTINEL + "\n").encode()


# -- the runtime secret -----------------------------------------------------------------------------------


async def test_runtime_secret_guards_every_endpoint_but_ping(http: aiohttp.ClientSession) -> None:
    secret = "s3cret-for-this-container"
    echo = code(
        """
        import os

        def main(args):
            return {"seen": os.environ.get("DILU_RUNTIME_SECRET")}
        """
    )
    async with running_runtime(env={"DILU_RUNTIME_SECRET": secret}) as rt:
        # Without the secret (another container's code): refused, and nothing is initialized.
        assert (await post(http, f"{rt.url}/init", init_body(echo)))[0] == 403
        assert (await post(http, f"{rt.url}/run", run_body()))[0] == 403
        async with http.get(f"{rt.url}/health") as r:
            assert r.status == 403
        async with http.post(f"{rt.url}/run", json=run_body(),
                             headers={"X-Dilu-Runtime-Secret": "wrong"}) as r:
            assert r.status == 403
        async with http.get(f"{rt.url}/ping") as r:
            assert r.status == 200
        headers = {"X-Dilu-Runtime-Secret": secret}
        async with http.post(f"{rt.url}/init", json=init_body(echo), headers=headers) as r:
            assert r.status == 200
        async with http.post(f"{rt.url}/run", json=run_body(), headers=headers) as r:
            # The action's code never sees the secret.
            assert r.status == 200 and await r.json() == {"seen": None}


def test_reap_once_reaps_strays_and_leaves_its_workers() -> None:
    """As PID 1 of a namespace the runtime adopts the action's orphans: they are reaped, its own workers
    (waited for by asyncio) are not."""
    import os
    import subprocess
    import sys
    import time

    from dilu_invoker.actions.runtime import reap_once

    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stray = os.fork()
        if stray == 0:
            os._exit(7)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the stray is a zombie
            with open(f"/proc/{stray}/status") as f:
                if any(line.startswith("State:") and line.split()[1] == "Z" for line in f):
                    break
            time.sleep(0.01)
        assert reap_once({own.pid}) == 1
        assert not os.path.exists(f"/proc/{stray}")
        assert own.poll() is None  # still its own, still running, still waitable
    finally:
        own.kill()
        assert own.wait() == -9
