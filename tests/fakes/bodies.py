"""Request bodies and HTTP helpers for driving a runtime in tests."""

from __future__ import annotations

import base64
import io
import json
import zipfile
from collections.abc import Mapping
from typing import Any

import aiohttp


def init_body(
    code: str, *, main: str = "main", env: Mapping[str, Any] | None = None, binary: bool = False
) -> dict[str, Any]:
    value: dict[str, Any] = {"name": "action", "main": main, "binary": binary, "code": code}
    if env is not None:
        value["env"] = dict(env)
    return {"value": value}


def run_body(value: Any = None, **fields: Any) -> dict[str, Any]:
    return {"value": {} if value is None else value, **fields}


def zip_base64(files: Mapping[str, str | bytes]) -> str:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, content in files.items():
            bundle.writestr(name, content)
    return base64.b64encode(buffer.getvalue()).decode()


async def post(session: aiohttp.ClientSession, url: str, body: Any, *, timeout_s: float = 60.0) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        raw = await response.read()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode("utf-8", "replace")
