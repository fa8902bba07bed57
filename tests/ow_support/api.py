"""Builds the standalone REST app over a real Redis for tests, with helpers to call it as a client would."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from dataclasses import dataclass
from typing import Any

from aiohttp.test_utils import TestClient

from dilu_invoker.config import ApiConfig
from dilu_invoker.invoker.api import ActivationRunner
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import GUEST_IDENTITY, Activation, Identity
from dilu_invoker.store import EntityStore

OTHER_IDENTITY = Identity(subject="alice", namespace="alice", uuid="0f7d3f34-1111-4a4e-9c3e-0123456789ab",
                          key="alicealicealicealicealicealicealicealicealicealicealicealice0001")
NO_STORE_IDENTITY = Identity(subject="ghost", namespace="ghost", uuid="aa7d3f34-2222-4a4e-9c3e-0123456789ab",
                             key="ghostghostghostghostghostghostghostghostghostghostghostghost0002",
                             store_activations=False)

MANIFEST_JSON: dict[str, Any] = {
    "runtimes": {
        "python": [
            {"kind": "python:3", "default": True,
             "image": {"prefix": "dilu", "name": "action-python-v3", "tag": "latest"}},
            {"kind": "python:3-gpu", "image": {"prefix": "dilu", "name": "action-python-v3-gpu", "tag": "latest"}},
            {"kind": "python:2", "deprecated": True, "image": {"prefix": "openwhisk", "name": "python2action"}},
        ],
        "java": [
            {"kind": "java:8", "requireMain": True, "image": {"prefix": "openwhisk", "name": "java8action"}},
        ],
    }
}

PY_CODE = "def main(args):\n    return {'greeting': 'hello ' + args.get('name', 'world')}\n"


def manifest_for_tests() -> Manifest:
    return Manifest.from_json(MANIFEST_JSON)


def basic_auth(identity: Identity) -> dict[str, str]:
    token = base64.b64encode(identity.api_key.encode()).decode()
    return {"Authorization": f"Basic {token}"}


@dataclass
class Api:
    """A test client of the REST app, calling as ``identity`` unless told otherwise."""

    client: TestClient
    store: EntityStore
    runner: ActivationRunner
    cfg: ApiConfig
    identity: Identity = GUEST_IDENTITY

    def url(self, path: str) -> str:
        return path if path.startswith("/") else f"/api/v1/namespaces/_/{path}"

    async def call(self, method: str, path: str, *, identity: Identity | None = None, auth: bool = True,
                   **kwargs: Any) -> tuple[int, Any, Any]:
        headers = dict(kwargs.pop("headers", {}))
        if auth:
            headers.update(basic_auth(identity or self.identity))
        if "json" in kwargs:  # large bodies as a stream, as a real client would send them
            kwargs["data"] = json.dumps(kwargs.pop("json")).encode()
            headers.setdefault("Content-Type", "application/json")
        if isinstance(kwargs.get("data"), bytes) and len(kwargs["data"]) > 512 * 1024:
            kwargs["data"] = io.BytesIO(kwargs["data"])
        async with self.client.request(method, self.url(path), headers=headers, **kwargs) as resp:
            text = await resp.text()
            body = await resp.json(content_type=None) if text else None
            return resp.status, body, resp.headers

    async def put_action(self, name: str, body: dict[str, Any] | None = None, *, overwrite: bool = False,
                         **kwargs: Any) -> tuple[int, Any, Any]:
        if body is None:
            body = {"exec": {"kind": "python:3", "code": PY_CODE}}
        params = {"overwrite": "true"} if overwrite else {}
        return await self.call("PUT", f"actions/{name}", json=body, params=params, **kwargs)

    async def invoke(self, name: str, payload: Any = None, *, blocking: bool = True, result: bool = False,
                     **kwargs: Any) -> tuple[int, Any, Any]:
        params = {"blocking": str(blocking).lower(), "result": str(result).lower()}
        params.update(kwargs.pop("params", {}))
        return await self.call("POST", f"actions/{name}", json=payload if payload is not None else {},
                               params=params, **kwargs)

    async def wait_stored(self, activation_id: str, namespace: str = "guest", timeout_s: float = 10.0) -> Activation:
        """Polls the store until the activation record exists (background activations store late)."""
        async with asyncio.timeout(timeout_s):
            while True:
                found = await self.store.get_activation(namespace, activation_id)
                if found is not None:
                    return found
                await asyncio.sleep(0.01)
