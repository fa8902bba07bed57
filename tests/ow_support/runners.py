"""Two :class:`~dilu_invoker.invoker.api.ActivationRunner` doubles for front-end tests.

* :class:`ScriptedRunner` decides each outcome from the invoke parameters (``outcome``, ``sleep``,
  ``hold``, ``logs``), so REST tests can produce every kind of activation quickly and deterministically.
* :class:`PythonRunner` really runs a Python action's ``main`` in a child interpreter, so a client
  (the npm compatibility script) sees real results and logs without the invoker core.

Both return records shaped as OpenWhisk's invoker writes them (annotations ``path``, ``kind``,
``limits``, ``timeout``, ``waitTime`` and, on a cold start, ``initTime``; log lines
``<timestamp> stdout: <text>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dilu_invoker.invoker.api import InvokerOverloaded
from dilu_invoker.model import (
    Activation,
    ActivationRequest,
    ActivationResponse,
    annotations_of,
    json_size,
    now_ms,
)


def log_line(stream: str, text: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f") + "000Z"
    return f"{stamp:<30} {stream}: {text}"


def split_content(req: ActivationRequest) -> tuple[Any, dict[str, Any]]:
    """(run arguments, init arguments): init params leave ``content`` for ``/init``, as the invoker does."""
    content = req.content
    if not isinstance(content, dict):
        return content if content is not None else {}, {}
    init = {k: content[k] for k in req.init_args if k in content}
    args = {k: v for k, v in content.items() if k not in init}
    return args, init


class _RecordMaker:
    def __init__(self) -> None:
        self._warm: set[tuple[str, str | None]] = set()

    def make(
        self,
        req: ActivationRequest,
        *,
        start: int,
        end: int,
        response: ActivationResponse,
        logs: Iterable[str],
        init_ms: int | None = None,
        timeout: bool = False,
    ) -> Activation:
        action = req.action
        key = (action.fqn, action.revision)
        cold = key not in self._warm
        self._warm.add(key)
        began = req.transid_start_ms or start
        pairs: list[tuple[str, Any]] = [
            ("path", action.fqn),
            ("kind", action.exec.kind),
            ("limits", action.limits.to_json()),
            ("timeout", timeout),
            ("waitTime", max(0, start - began)),
        ]
        if cold:
            pairs.append(("initTime", init_ms if init_ms is not None else 0))
        if response.result is not None and response.size is None:
            response = ActivationResponse(response.status, response.result, json_size(response.result))
        return Activation(
            namespace=req.identity.namespace,
            name=action.name,
            subject=req.identity.subject,
            activation_id=req.activation_id,
            start=start,
            end=end,
            response=response,
            logs=tuple(logs),
            version=action.version,
            annotations=annotations_of(pairs),
            cause=req.cause,
        )


class ScriptedRunner:
    """Parameters of the invoke decide the outcome:

    ``outcome``: ``success`` (default; result ``{"echo": args, "init": init args}``), ``application``,
    ``developer``, ``whisk``, ``timeout``, ``raise`` (the runner breaks its contract), ``overload-later``
    (refuses only after a first await); ``sleep``: seconds to take; ``hold``: wait until
    :meth:`release` is called; ``logs``: lines to print.

    ``overloaded = True`` refuses every activation at once with :class:`InvokerOverloaded`.
    """

    def __init__(self) -> None:
        self.requests: list[ActivationRequest] = []
        self.finished: list[Activation] = []
        self.overloaded = False
        self._release = asyncio.Event()
        self._records = _RecordMaker()
        self.started = asyncio.Event()

    def release(self) -> None:
        self._release.set()

    async def run(self, req: ActivationRequest) -> Activation:
        if self.overloaded:
            raise InvokerOverloaded("the activation queue is full")
        self.requests.append(req)
        self.started.set()
        args, init = split_content(req)
        params = args if isinstance(args, dict) else {}
        outcome = params.get("outcome", "success")
        start = now_ms()
        if outcome == "overload-later":
            await asyncio.sleep(0.01)
            raise InvokerOverloaded("the activation queue filled up")
        if outcome == "raise":
            raise RuntimeError("runner bug")
        if params.get("hold"):
            await self._release.wait()
        if params.get("sleep"):
            await asyncio.sleep(float(params["sleep"]))
        logs = [log_line("stdout", str(line)) for line in params.get("logs", [])]
        timeout = False
        if outcome == "application":
            response = ActivationResponse.application_error(params.get("error", "it went wrong"))
        elif outcome == "developer":
            response = ActivationResponse.developer_error("The action did not return a dictionary or array.")
        elif outcome == "whisk":
            response = ActivationResponse.whisk_error("Failed to provision resources to run the action.")
        elif outcome == "timeout":
            ms = req.action.limits.timeout_ms
            response = ActivationResponse.developer_error(f"The action exceeded its time limits of {ms} milliseconds.")
            timeout = True
        else:
            response = ActivationResponse.success({"echo": args, "init": init})
        activation = self._records.make(req, start=start, end=now_ms(), response=response, logs=logs,
                                        init_ms=3, timeout=timeout)
        self.finished.append(activation)
        return activation


_DRIVER = r"""
import json, os, sys, traceback
spec = json.load(sys.stdin)
result_path = sys.argv[1]
def finish(obj):
    with open(result_path, "w") as f:
        json.dump(obj, f)
scope = {"__name__": "__main__"}
try:
    exec(compile(spec["code"], "__main__.py", "exec"), scope)
    fn = scope[spec["main"]]
except Exception as exc:
    traceback.print_exc()
    finish({"init_error": f"{type(exc).__name__}: {exc}"})
    sys.exit(0)
try:
    result = fn(spec["args"])
except Exception as exc:
    finish({"error": str(exc)})
    sys.exit(0)
sys.stdout.flush()
finish({"result": result})
"""


class PythonRunner:
    """Runs ``main(args)`` of a Python action in a fresh interpreter (a test double, not a sandbox)."""

    def __init__(self) -> None:
        self._records = _RecordMaker()
        self.requests: list[ActivationRequest] = []

    async def run(self, req: ActivationRequest) -> Activation:
        self.requests.append(req)
        args, init = split_content(req)
        action = req.action
        env = dict(os.environ)
        env.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in init.items()})
        env.update({
            "__OW_NAMESPACE": req.identity.namespace,
            "__OW_ACTION_NAME": action.action_name,
            "__OW_ACTION_VERSION": action.version,
            "__OW_ACTIVATION_ID": req.activation_id,
            "__OW_TRANSACTION_ID": req.transid_id,
        })
        fd, result_path = tempfile.mkstemp(prefix="dilu-result-", suffix=".json")
        os.close(fd)
        start = now_ms()
        timeout_s = action.limits.timeout_ms / 1000
        spec = json.dumps({"code": action.exec.code or "", "main": action.exec.main or "main", "args": args})
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _DRIVER, result_path,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=env,
            )
            try:
                out, err = await asyncio.wait_for(proc.communicate(spec.encode()), timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                ms = action.limits.timeout_ms
                return self._records.make(
                    req, start=start, end=now_ms(), logs=[], timeout=True,
                    response=ActivationResponse.developer_error(
                        f"The action exceeded its time limits of {ms} milliseconds."))
            text = await asyncio.to_thread(Path(result_path).read_text)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(result_path)
        logs = [log_line("stdout", line) for line in out.decode(errors="replace").splitlines()]
        logs += [log_line("stderr", line) for line in err.decode(errors="replace").splitlines()]
        outcome = json.loads(text) if text else {}
        if "init_error" in outcome:
            response = ActivationResponse.developer_error(outcome["init_error"])
        elif "error" in outcome:
            response = ActivationResponse.application_error(outcome["error"])
        elif "result" not in outcome:
            response = ActivationResponse.developer_error(
                "The action did not produce a valid response and exited unexpectedly.")
        elif not isinstance(outcome["result"], dict | list):
            response = ActivationResponse.developer_error("The action did not return a dictionary or array.")
        else:
            response = ActivationResponse.success(outcome["result"])
        return self._records.make(req, start=start, end=now_ms(), response=response, logs=logs, init_ms=20)
