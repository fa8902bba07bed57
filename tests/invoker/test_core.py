"""The invoker core against real runtime processes (process backend): pooling, failures, limits."""

from __future__ import annotations

import asyncio
import base64
import io
import time
import zipfile
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from dilu_invoker.invoker.dataplane.container import State, Transition
from dilu_invoker.invoker.dataplane.core import INIT_FAILURE_LOG_LINES, Invoker, open_invoker
from dilu_invoker.model import Action, ActivationStatus, Exec, Parameter
from tests.ow_support.invoker import ECHO
from tests.ow_support.invoker import activation as _req
from tests.ow_support.invoker import config_with as _cfg
from tests.ow_support.invoker import python_action as _action


def _transitions(inv: Invoker) -> list[Transition]:
    seen: list[Transition] = []
    inv.pool.observe(seen.append)
    return seen


async def test_cold_then_warm_reuses_the_container(invoker: Invoker) -> None:
    seen = _transitions(invoker)
    action = _action()
    first = await invoker.run(_req(action, {"n": 1}))
    second = await invoker.run(_req(action, {"n": 2}))
    assert first.response.status is ActivationStatus.SUCCESS and first.response.result == {"n": 1}
    assert second.response.result == {"n": 2}
    assert first.annotation("initTime") is not None and second.annotation("initTime") is None
    assert any("hello 1" in line and "stdout:" in line for line in first.logs)
    assert any("hello 2" in line for line in second.logs) and not any("hello 1" in line for line in second.logs)
    assert len(invoker.pool.containers) == 1
    assert [(t.old, t.new) for t in seen] == [
        (State.STARTING, State.STARTING), (State.STARTING, State.INITIALIZING), (State.INITIALIZING, State.READY)]
    assert first.annotation("path") == "guest/echo" and first.annotation("kind") == "python:3"
    assert first.annotation("limits") == action.limits.to_json()


async def test_activation_finished_is_at_info_for_a_cold_start_or_a_failure_and_at_debug_otherwise(
        invoker: Invoker) -> None:
    action = _action()
    failing = _action("def main(a):\n    raise ValueError('boom')\n", name="bad")
    with capture_logs() as logs:
        await invoker.run(_req(action, {"n": 1}))
        await invoker.run(_req(action, {"n": 2}))
        await invoker.run(_req(failing))
        await invoker.run(_req(failing))
    finished = [(e["log_level"], e["action"], e["status"], e["cold"]) for e in logs
                if e["event"] == "activation finished"]
    assert finished == [
        ("info", "guest/echo", "success", True), ("debug", "guest/echo", "success", False),
        ("info", "guest/bad", "application error", True), ("info", "guest/bad", "application error", False)]


async def test_updated_action_gets_a_new_container(invoker: Invoker) -> None:
    await invoker.run(_req(_action()))
    changed = _action(ECHO.replace("hello", "bonjour"))
    result = await invoker.run(_req(changed, {"n": 3}))
    assert any("bonjour 3" in line for line in result.logs)
    assert len(invoker.pool.containers) == 2


async def test_init_args_go_to_init_env_not_to_run_params(invoker: Invoker) -> None:
    code = "import os\ndef main(args):\n    return {'secret': os.environ.get('SECRET'), 'args': sorted(args)}\n"
    action = replace(_action(code, name="initargs"), parameters=(Parameter("SECRET", "s3", init=True),))
    result = await invoker.run(_req(action, {"SECRET": "s3", "x": 1}, init_args=("SECRET",)))
    assert result.response.result == {"secret": "s3", "args": ["x"]}


async def test_instances_of_one_function_get_one_models_key_others_another(invoker: Invoker) -> None:
    code = ("import os, time\ndef main(args):\n    time.sleep(args.get('s', 0))\n"
            "    return {'key': os.environ.get('DILU_MODELS_KEY'), 'pid': os.getpid()}\n")
    action = _action(code, name="keyed")
    busy = asyncio.ensure_future(invoker.run(_req(action, {"s": 0.5})))
    await asyncio.sleep(0.2)
    second = await invoker.run(_req(action, {}))  # the first instance is busy: a second one starts
    first = await busy
    key = first.response.result["key"]
    assert key and len(key) == 64
    assert second.response.result["pid"] != first.response.result["pid"]
    assert second.response.result["key"] == key
    other = await invoker.run(_req(_action(code, name="other"), {}))  # another function: another key
    assert other.response.result["key"] not in (None, key)


@pytest.mark.parametrize(
    ("code", "status", "message"),
    [
        ("def main(a):\n    raise ValueError('boom')\n", ActivationStatus.APPLICATION_ERROR, "boom"),
        ("def main(a):\n    return 'not a dict'\n", ActivationStatus.DEVELOPER_ERROR, "dictionary"),
        ("import os\ndef main(a):\n    os._exit(3)\n", ActivationStatus.DEVELOPER_ERROR, None),
        ("import ctypes\ndef main(a):\n    ctypes.string_at(0)\n", ActivationStatus.DEVELOPER_ERROR, None),
        ("def main(a:\n", ActivationStatus.DEVELOPER_ERROR, None),
        ("def other(a):\n    return {}\n", ActivationStatus.DEVELOPER_ERROR, None),
    ],
    ids=["raises", "non-dict", "os-exit", "segfault", "syntax-error", "missing-main"],
)
async def test_user_code_failures(invoker: Invoker, code: str, status: ActivationStatus, message: str | None) -> None:
    action = _action(code, name="bad")
    result = await invoker.run(_req(action))
    assert result.response.status is status
    assert "error" in result.response.result
    if message:
        assert message in str(result.response.result["error"])
    # Only successes and application errors keep their container.
    await asyncio.sleep(0.2)
    alive = [p for p in invoker.pool.containers.values() if p.state is not State.REMOVED]
    assert (len(alive) == 1) is (status is ActivationStatus.APPLICATION_ERROR)
    # The invoker keeps serving others.
    ok = await invoker.run(_req(_action(), {"n": 7}))
    assert ok.response.result == {"n": 7}


async def test_timeout_replaces_the_container(invoker: Invoker) -> None:
    hang = _action("import time\ndef main(a):\n    time.sleep(30)\n    return {}\n", name="hang", timeout_ms=2000)
    started = time.monotonic()
    result = await invoker.run(_req(hang))
    assert time.monotonic() - started < 5
    assert result.response.status is ActivationStatus.DEVELOPER_ERROR
    assert result.response.result == {"error": "The action exceeded its time limits of 2000 milliseconds."}
    assert result.annotation("timeout") is True
    await asyncio.sleep(0.3)
    assert not invoker.pool.containers
    quick = replace(hang, exec=Exec(kind="python:3", code="def main(a):\n    return {'ok': 1}\n"), revision="2-x")
    assert (await invoker.run(_req(quick))).response.result == {"ok": 1}


async def test_log_flood_is_truncated_and_memory_bounded(invoker: Invoker) -> None:
    flood = _action("import sys\ndef main(a):\n    for _ in range(100):\n        sys.stdout.write('x' * 1048575 + '\\n')\n"
                    "    print('last line')\n    return {'done': True}\n", name="flood", logs_mb=1)
    result = await invoker.run(_req(flood))
    assert result.response.result == {"done": True}
    assert "Logs were truncated because the total bytes size exceeds the limit of 1048576 bytes." in result.logs[-1]
    assert sum(len(line) for line in result.logs) < 3 * 1024 * 1024
    # The sentinel was still found: the next activation's logs are its own.
    again = await invoker.run(_req(_action(), {"n": 9}))
    assert any("hello 9" in line for line in again.logs)


async def test_concurrency_shares_one_container(invoker: Invoker) -> None:
    slow = _action("import time\ndef main(a):\n    time.sleep(0.5)\n    return {'i': a['i']}\n", name="conc",
                   concurrency=4)
    started = time.monotonic()
    results = await asyncio.gather(*(invoker.run(_req(slow, {"i": i})) for i in range(4)))
    assert sorted(r.response.result["i"] for r in results) == [0, 1, 2, 3]
    assert len(invoker.pool.containers) == 1
    assert time.monotonic() - started < 1.9  # ran side by side, not one after the other


async def test_capacity_bound_queues_work() -> None:
    async with open_invoker(_cfg(user_memory_mb=256, idle_timeout_s=60)) as inv:
        a = _action("import time\ndef main(x):\n    time.sleep(0.4)\n    return {'a': 1}\n", name="a")
        b = _action("def main(x):\n    return {'b': 1}\n", name="b")
        first = asyncio.create_task(inv.run(_req(a)))
        await asyncio.sleep(0.15)
        second = asyncio.create_task(inv.run(_req(b)))
        await asyncio.sleep(0.1)
        assert inv.pool.queue_length == 1  # b waits: a's container holds all 256 MB
        ra, rb = await asyncio.gather(first, second)
        assert ra.response.result == {"a": 1} and rb.response.result == {"b": 1}
        assert rb.annotation("waitTime") >= 150
        # a's idle container was evicted to make room for b.
        assert [p.action.name for p in inv.pool.containers.values()] == ["b"]


async def test_idle_containers_are_removed() -> None:
    async with open_invoker(_cfg(idle_timeout_s=0.3, pause_grace_s=0.1)) as inv:
        seen = _transitions(inv)
        await inv.run(_req(_action()))
        await asyncio.sleep(0.8)
        assert not inv.pool.containers
        states = [t.new for t in seen]
        assert states[-3:] == [State.PAUSED, State.REMOVING, State.REMOVED]


async def test_paused_container_resumes_for_work() -> None:
    async with open_invoker(_cfg(idle_timeout_s=30, pause_grace_s=0.1)) as inv:
        await inv.run(_req(_action(), {"n": 1}))
        await asyncio.sleep(0.3)
        (proxy,) = inv.pool.containers.values()
        assert proxy.state is State.PAUSED
        result = await inv.run(_req(_action(), {"n": 2}))
        assert result.response.result == {"n": 2} and result.annotation("initTime") is None


async def test_zip_action_with_main_module(invoker: Invoker) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("__main__.py", "from helper import twice\ndef main(a):\n    return {'v': twice(a['v'])}\n")
        z.writestr("helper.py", "def twice(x):\n    return 2 * x\n")
    action = Action(namespace="guest", name="zipped",
                    exec=Exec(kind="python:3", code=base64.b64encode(buf.getvalue()).decode(), binary=True))
    assert (await invoker.run(_req(action, {"v": 21}))).response.result == {"v": 42}


async def test_unknown_kind_is_a_whisk_error(invoker: Invoker) -> None:
    result = await invoker.run(_req(_action(kind="cobol:74")))
    assert result.response.status is ActivationStatus.WHISK_ERROR
    assert result.annotation("kind") == "unknown"


async def test_metrics_count_activations(invoker: Invoker) -> None:
    await invoker.run(_req(_action(), {"n": 1}))
    await invoker.run(_req(_action(), {"n": 2}))
    registry = invoker.metrics.registry
    labels = {"namespace": "guest", "initiator": "guest", "action": "echo"}
    assert registry.get_sample_value("openwhisk_action_activations_total",
                                     {**labels, "kind": "python:3", "memory": "256"}) == 2
    assert registry.get_sample_value("openwhisk_action_coldStarts_total", labels) == 1
    assert registry.get_sample_value("openwhisk_action_status_total", {**labels, "status": "success"}) == 2


async def test_a_failed_instance_start_logs_the_actions_output(invoker: Invoker) -> None:
    """An instance the balancer starts has no activation to carry its /init's output: when the init fails, the
    invoker logs its last lines (the action's traceback) with the instance, and the instance's failure is
    reported as before."""
    code = ("import sys\nfor k in range(50):\n    print('loading the model', k, file=sys.stderr)\n"
            "raise ImportError('no module named wheel_x')\n")
    action = _action(code, name="broken")
    with capture_logs() as logs:
        name, failure = await invoker.start_instance("broken-1", action)
    assert name is not None and failure is not None
    assert failure.status is ActivationStatus.DEVELOPER_ERROR
    [event] = [e for e in logs if e["event"] == "instance init failed"]
    assert event["instance"] == "broken-1" and event["action"] == "guest/broken"
    lines = event["logs"]
    assert "ImportError: no module named wheel_x" in lines[-2]  # the tail: the traceback's last line kept
    assert len(lines) == INIT_FAILURE_LOG_LINES  # the first of the 50 lines it printed are left out
    assert not any(line.endswith("loading the model 0") for line in lines)
