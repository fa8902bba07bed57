"""Gangs (``gpu-count`` above 1) where no balancer places them, through standalone (REST API, invoker, embedded
Redis, two inventory GPUs): the action is refused at PUT with the reason, and an invoker's own pool refuses to run
one in a single container rather than run it on one GPU."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from dilu_invoker import config
from dilu_invoker.model import (
    GUEST_IDENTITY,
    Action,
    ActivationRequest,
    ActivationStatus,
    Exec,
    Parameter,
    new_activation_id,
)
from dilu_invoker.standalone import run_standalone

CODE = "import os\ndef main(a):\n    return {'rank': os.environ.get('RANK')}\n"


def _cfg(tmp_path: Path, *, routing: bool) -> config.Config:
    (tmp_path / "inventory.json").write_text(json.dumps([{"uuid": f"GPU-sg-{k}", "memory_mb": 16000}
                                                         for k in range(2)]))
    base = config.load(environ={})
    return replace(base, data_dir=str(tmp_path / "data"), api=replace(base.api, port=0),
                   gpu=replace(base.gpu, inventory=str(tmp_path / "inventory.json"), mps="off"),
                   balancer=replace(base.balancer, routing=routing, tick_s=0.2, report_period_s=0.2))


def _session() -> aiohttp.ClientSession:
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    return aiohttp.ClientSession(headers={"Authorization": f"Basic {token}"})


async def _put(http: aiohttp.ClientSession, api: str, name: str, gpus: int) -> tuple[int, Any]:
    body = {"exec": {"kind": "python:3-gpu", "code": CODE}, "annotations": [{"key": "gpu-count", "value": gpus}]}
    async with http.put(f"{api}/api/v1/namespaces/_/actions/{name}?overwrite=true", json=body) as r:
        return r.status, await r.json()


async def test_without_balancer_routing_a_gang_is_refused_at_put_and_by_the_pool(tmp_path: Path) -> None:
    async with run_standalone(_cfg(tmp_path, routing=False)) as running, _session() as http:
        api = running.api_url
        status, body = await _put(http, api, "gang", 2)
        assert status == 400, body
        assert body["error"] == (
            "Annotation 'gpu-count' of 2 makes each instance a gang of 2 GPUs, which only the balancer places, and "
            "this system runs without balancer routing (--no-balancer-routing): it could never run.")
        async with http.get(f"{api}/api/v1/namespaces/_/actions/gang") as r:
            assert r.status == 404  # nothing stored
        status, body = await _put(http, api, "one", 1)
        assert status == 200, body
        async with http.post(f"{api}/api/v1/namespaces/_/actions/one?blocking=true", json={}) as r:
            assert r.status == 200 and (await r.json())["response"]["result"] == {"rank": None}
        # stored some other way (before an upgrade, another front): the pool refuses it, in OpenWhisk's shape,
        # and starts nothing
        action = Action(namespace="guest", name="gang", exec=Exec(kind="python:3-gpu", code=CODE),
                        annotations=(Parameter("gpu-count", 2),))
        before = set(running.invoker.pool.containers)
        refused = await running.invoker.run(ActivationRequest(activation_id=new_activation_id(), action=action,
                                                              identity=GUEST_IDENTITY, content={}))
        assert refused.response.status is ActivationStatus.WHISK_ERROR
        assert refused.response.result == {"error": (
            "The action cannot run: annotation 'gpu-count' of 2 makes each instance a gang of 2 GPUs, which only "
            "the balancer places (cluster mode, or standalone with balancer routing); this invoker's own "
            "containers take one GPU each.")}
        assert set(running.invoker.pool.containers) == before


async def test_a_gang_wider_than_any_invoker_is_refused_at_put(tmp_path: Path) -> None:
    async with run_standalone(_cfg(tmp_path, routing=True)) as running, _session() as http:
        api = running.api_url
        status, body = await _put(http, api, "wide", 3)
        assert status == 400, body
        assert body["error"] == ("Annotation 'gpu-count' of 3 exceeds the GPUs of any invoker here (2): a gang's "
                                 "GPUs are all on one invoker, so it could never be placed.")
        status, body = await _put(http, api, "pair", 2)  # (the balancer places it: docs/balancer.md, "Gangs")
        assert status == 200, body
