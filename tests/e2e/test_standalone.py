"""`dilu-invoker standalone` as a user runs it: a real process with its embedded Redis and real runtime
processes, driven by the official `openwhisk` npm client and by plain HTTP; restarted on the same data
directory; stopped cleanly."""

from __future__ import annotations

import json
import os
import shutil

import aiohttp
import pytest
from ow_support.faults import Standalone
from ow_support.npm import NPM_DIR, install_client, run_command

from dilu_invoker.model import GUEST_IDENTITY

pytestmark = pytest.mark.slow
AUTH = {"Authorization": aiohttp.encode_basic_auth(GUEST_IDENTITY.uuid, GUEST_IDENTITY.key)}


@pytest.fixture
def standalone_args() -> list[str]:
    return ["--invoker-idle-timeout-s", "30"]


async def test_openwhisk_npm_client_against_standalone(standalone: Standalone) -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node and npm are not installed")
    await install_client()
    env = {**os.environ, "__OW_API_HOST": standalone.url, "__OW_API_KEY": GUEST_IDENTITY.api_key,
           "DILU_COMPAT_POLL_MS": "20000"}
    rc, out = await run_command("node", "compat.js", cwd=NPM_DIR, env=env, timeout_s=120)
    summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    assert rc == 0 and summary.get("ok") is True, out + standalone.log.read_text()[-3000:]
    assert len(summary["checks"]) >= 20


async def test_restart_keeps_actions_and_activations(standalone: Standalone) -> None:
    action = f"{standalone.url}/api/v1/namespaces/_/actions/keep"
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.put(action, json={"exec": {"kind": "python:3-gpu",
                                                "code": "def main(a):\n    print('kept')\n    return {'v': 1}\n"},
                                       "annotations": [{"key": "gpu-class", "value": "inference"}]}) as r:
            assert r.status == 200, await r.text()
        async with s.post(f"{action}?blocking=true") as r:
            first = await r.json()
            assert r.status == 200 and first["response"]["result"] == {"v": 1}
    assert await standalone.stop() == 0
    # Containers and the embedded Redis went with it.
    await standalone.start()
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.get(action) as r:
            assert r.status == 200 and (await r.json())["exec"]["kind"] == "python:3-gpu"
        async with s.get(f"{standalone.url}/api/v1/namespaces/_/activations/{first['activationId']}/logs") as r:
            assert r.status == 200
            assert any("kept" in line for line in (await r.json())["logs"])
        async with s.post(f"{action}?blocking=true&result=true") as r:
            assert r.status == 200 and await r.json() == {"v": 1}


@pytest.mark.allow_loop_block  # the test itself encodes a 49 MB body
async def test_bad_input_keeps_the_server_serving(standalone: Standalone) -> None:
    base = f"{standalone.url}/api/v1/namespaces/_/actions"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/x") as r:
            assert r.status == 401
        s_auth = aiohttp.ClientSession(headers=AUTH)
    async with s_auth as s:
        async with s.put(f"{base}/bad", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
            body = await r.json()
            assert r.status == 400 and "error" in body and "code" in body
        async with s.put(f"{base}/bad", json={"exec": {"kind": "cobol:74", "code": "x"}}) as r:
            assert r.status == 400 and "python:3-gpu" in (await r.json())["error"]
        async with s.put(f"{base}/bad", json={"exec": {"kind": "python:3", "code": "x" * (49 * 1024 * 1024)}}) as r:
            assert r.status == 413
        crash = "import os\ndef main(a):\n    os._exit(7)\n"
        async with s.put(f"{base}/crash", json={"exec": {"kind": "python:3", "code": crash}}) as r:
            assert r.status == 200
        async with s.post(f"{base}/crash?blocking=true&result=true") as r:
            assert r.status == 502 and "error" in await r.json()
        async with s.put(f"{base}/ok", json={"exec": {"kind": "python:3", "code": "def main(a):\n    return a\n"}}) as r:
            assert r.status == 200
        async with s.post(f"{base}/ok?blocking=true&result=true", json={"still": "serving"}) as r:
            assert r.status == 200 and await r.json() == {"still": "serving"}
