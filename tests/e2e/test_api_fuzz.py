"""Schemathesis fuzzes the served REST API from its own OpenAPI document (GET /api/v1/api-docs) against a
real standalone: no 500, no crash, every answer as documented (status, content type, body schema)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from ow_support.faults import Standalone, put_action
from ow_support.fuzz import fuzz, schemathesis_command

pytestmark = pytest.mark.slow


async def test_the_openapi_document_is_served_and_lists_the_routes(standalone: Standalone) -> None:
    packaged = json.loads((Path(__file__).resolve().parents[2] / "dilu_invoker" / "openwhisk" / "openapi.json")
                          .read_text())
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{standalone.url}/api/v1/api-docs") as r:
            assert r.status == 200 and r.content_type == "application/json"
            served = await r.json()
    assert served == packaged and served["openapi"].startswith("3.")
    assert "/api/v1/namespaces/{namespace}/actions/{name}" in served["paths"]


async def test_schemathesis_finds_no_server_error(standalone: Standalone, tmp_path: Path) -> None:
    if not Path(schemathesis_command()[0]).exists():
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    await put_action(standalone.url, "hello")
    result = await fuzz(standalone.url, tmp_path, max_examples=15, timeout_s=170)
    assert result.returncode == 0, result.output[-6000:]
    assert result.requests >= 300, result.statuses
    assert not [s for s in result.statuses if s >= 500 and s not in (502, 503)], result.statuses
    failures = [e for e in await asyncio.to_thread(standalone.events) if e.get("event") == "request failed"]
    assert failures == []
    assert standalone.proc is not None and standalone.proc.returncode is None  # still serving
