"""A small stand-in for the upstream OpenWhisk Python runtime (Go "actionloop" proxy + Python launcher).

Written for this project from the behaviour contract in reference/openwhisk.md §10.1 (status codes, bodies,
sentinels); no upstream code. It runs the action in this process (a thread per run, one run at a time, as
actionloop runtimes do), which is enough for the contract rows the invoker must handle: results, raised
exceptions, non-dict results, arrays, `sys.exit`, re-init, init failures, run before init.

Run: `python -m tests.fakes.upstream_runtime --port N` (from the repository root).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import io
import json
import os
import sys
import tempfile
import traceback
import types
import zipfile
from collections.abc import Callable
from typing import Any

from aiohttp import web

SENTINEL_LINE = b"XXX_THE_END_OF_A_WHISK_ACTIVATION_XXX\n"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _guard() -> None:
    """Upstream's executor writes the sentinel on both streams once the action's output is through."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, SENTINEL_LINE)
    os.write(2, SENTINEL_LINE)


class FakeActionLoop:
    def __init__(self) -> None:
        self.initialized = False
        self.main: Callable[[Any], Any] | None = None
        self.lock = asyncio.Lock()

    async def init(self, request: web.Request) -> web.Response:
        if self.initialized:
            return _error(403, "Cannot initialize the action more than once.")
        try:
            value = json.loads(await request.read())["value"]
            if not isinstance(value, dict):
                raise TypeError("value is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"Error unmarshaling request: {exc}")
        code = value.get("code")
        if not isinstance(code, str) or not code:
            return _error(403, "Missing main/no code to execute.")
        for key, raw in (value.get("env") or {}).items():
            os.environ[key] = raw if isinstance(raw, str) else json.dumps(raw)
        source = code
        if value.get("binary"):
            try:
                archive = zipfile.ZipFile(io.BytesIO(base64.b64decode(code, validate=True)))
                workdir = tempfile.mkdtemp(prefix="fake-upstream-")
                archive.extractall(workdir)
                source = archive.read("__main__.py").decode()
                sys.path.insert(0, workdir)
            except (binascii.Error, ValueError, KeyError, zipfile.BadZipFile, OSError) as exc:
                sys.stderr.write(f"{exc}\n")
                _guard()
                return _error(502, "The action failed to generate or locate a binary. See logs for details.")
        try:
            compiled = compile(source, "main__.py", "exec")
        except SyntaxError:
            traceback.print_exc(limit=0)
            _guard()
            return _error(502, "The action failed to generate or locate a binary. See logs for details.")
        module = types.ModuleType("main__")
        try:
            exec(compiled, module.__dict__)
            main = getattr(module, value.get("main") or "main")
        except Exception:  # noqa: BLE001 - the launcher dies: upstream answers "Cannot start action"
            traceback.print_exc()
            _guard()
            return _error(502, "Cannot start action. Check logs for details.")
        self.main = main
        self.initialized = True
        return web.json_response({"ok": True})

    async def run(self, request: web.Request) -> web.Response:
        body = await request.read()
        if self.main is None:
            return _error(500, "no action defined yet")
        async with self.lock:
            return await asyncio.to_thread(self._run_blocking, body)

    def _run_blocking(self, body: bytes) -> web.Response:
        assert self.main is not None
        args = json.loads(body)
        payload: Any = {}
        for key, raw in args.items():
            if key == "value":
                payload = raw
            else:
                os.environ[f"__OW_{key.upper()}"] = raw if isinstance(raw, str) else json.dumps(raw)
        try:
            result = self.main(payload)
        except SystemExit:
            # The launcher process ended: this run fails and the action is gone.
            self.main = None
            _guard()
            return _error(400, "command exited")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            result = {"error": str(exc)}
        _guard()
        text = json.dumps(result, ensure_ascii=False)
        if not text.startswith(("{", "[")):
            return _error(502, "The action did not return a dictionary or array.")
        return web.Response(status=200, body=text.encode(), content_type="application/json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    fake = FakeActionLoop()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/init", fake.init)
    app.router.add_post("/run", fake.run)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
