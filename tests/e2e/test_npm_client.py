"""The official ``openwhisk`` npm client against the REST API (``tests/e2e/npm/compat.js``).

Here the API runs with a test runner that really executes the Python action; the same script runs
unchanged against ``dilu-invoker standalone`` (see docs/rest-api.md, "Compatibility check").
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import redis.asyncio as aioredis
from ow_support.api import manifest_for_tests
from ow_support.npm import NPM_DIR, install_client, run_command
from ow_support.runners import PythonRunner

from dilu_invoker.config import ApiConfig
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.openwhisk.rest import build_api
from dilu_invoker.openwhisk.rest_auth import Authenticator
from dilu_invoker.store import EntityStore

pytestmark = pytest.mark.slow


async def test_openwhisk_npm_client(redis: aioredis.Redis, aiohttp_server: Any) -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node and npm are not installed")
    await install_client()
    app = build_api(
        ApiConfig(), store=EntityStore(redis, prefix="e2e:"), runner=PythonRunner(),
        manifest=manifest_for_tests(), auth=Authenticator([GUEST_IDENTITY]),
    )
    server = await aiohttp_server(app)
    env = dict(os.environ)
    env.update({
        "__OW_API_HOST": f"http://127.0.0.1:{server.port}",
        "__OW_API_KEY": GUEST_IDENTITY.api_key,
        "DILU_COMPAT_POLL_MS": "20000",
    })
    rc, out = await run_command("node", "compat.js", cwd=NPM_DIR, env=env, timeout_s=120)
    summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    assert rc == 0 and summary.get("ok") is True, out
    assert len(summary["checks"]) >= 20
