"""Refusals that say why, at once, through standalone (REST API, balancer, invoker, embedded Redis, real
action processes): an instance that cannot be placed or started fails its waiting activations with the
reason and the numbers instead of letting them wait; an action whose own limits can never fit is refused
at PUT."""

from __future__ import annotations

import base64
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from dilu_invoker import config
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.standalone import run_standalone

CODE = "def main(a):\n    return {'ok': True}\n"
BROKEN = "def main(a):\n    return {'ok': True}\nraise RuntimeError('model weights missing')\n"


def _cfg(tmp_path: Path, *, user_memory_mb: int = 4096, gamma: float = math.inf) -> config.Config:
    (tmp_path / "inventory.json").write_text(json.dumps([{"uuid": "GPU-r", "memory_mb": 16000, "name": "Test"}]))
    base = config.load(environ={})
    # route_wait_s stays long: a refusal must come from the reason, not from the wait running out.
    return replace(base, data_dir=str(tmp_path / "data"), api=replace(base.api, port=0),
                   invoker=replace(base.invoker, user_memory_mb=user_memory_mb),
                   gpu=replace(base.gpu, inventory=str(tmp_path / "inventory.json"), mps="off", gamma=gamma),
                   balancer=replace(base.balancer, tick_s=0.2, report_period_s=0.2, report_ttl_s=1.0,
                                    route_wait_s=60.0))


def _session() -> aiohttp.ClientSession:
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    return aiohttp.ClientSession(headers={"Authorization": f"Basic {token}"})


async def _put(http: aiohttp.ClientSession, api: str, name: str, *, code: str = CODE, memory: int = 256,
               **annotations: Any) -> tuple[int, Any]:
    body = {"exec": {"kind": "python:3-gpu", "code": code}, "limits": {"memory": memory},
            "annotations": [{"key": k.replace("_", "-"), "value": v} for k, v in annotations.items()]}
    async with http.put(f"{api}/api/v1/namespaces/_/actions/{name}?overwrite=true", json=body) as r:
        return r.status, await r.json()


async def _invoke(http: aiohttp.ClientSession, api: str, name: str) -> tuple[int, Any, float]:
    t = time.monotonic()
    async with http.post(f"{api}/api/v1/namespaces/_/actions/{name}?blocking=true", json={}) as r:
        return r.status, await r.json(), time.monotonic() - t


async def _activation(http: aiohttp.ClientSession, api: str, aid: str) -> Any:
    async with http.get(f"{api}/api/v1/namespaces/_/activations/{aid}") as r:
        assert r.status == 200
        return await r.json()


async def test_sum_of_limits_above_gamma_is_refused_at_once_with_the_numbers(tmp_path: Path) -> None:
    # An operator's Σ-limit bound (`--gpu-gamma 1.5`; the default has none).
    async with run_standalone(_cfg(tmp_path, gamma=1.5)) as running, _session() as http:
        api = running.api_url
        for name in ("a", "b"):
            status, _ = await _put(http, api, name, gpu_sm_request=0.4, gpu_sm_limit=1.0)
            assert status == 200
        status, body, _ = await _invoke(http, api, "a")
        assert status == 200 and body["response"]["result"] == {"ok": True}
        status, body, waited = await _invoke(http, api, "b")
        assert status == 500, body  # a whisk internal error, as OpenWhisk answers it
        error = body["response"]["result"]["error"]
        assert error.startswith("The action cannot run: "), error
        assert "limit" in error and "1.5" in error, error  # names the resource and the numbers
        assert body["response"]["status"] == "whisk internal error"
        # Answered from the reason, long before the 60 s routing wait (the bound is 2 s).
        assert waited < 10, waited
        stored = await _activation(http, api, body["activationId"])
        assert stored["response"]["result"]["error"] == error


async def test_sum_of_requests_above_one_is_refused_at_once_and_limits_alone_are_not(tmp_path: Path) -> None:
    async with run_standalone(_cfg(tmp_path)) as running, _session() as http:
        api = running.api_url
        # Without a Σ-limit bound (the default) two limits of 1.0 share the GPU: requests 0.4 + 0.4 fit.
        for name in ("a", "b"):
            status, _ = await _put(http, api, name, gpu_sm_request=0.4, gpu_sm_limit=1.0)
            assert status == 200
            status, body, _ = await _invoke(http, api, name)
            assert status == 200 and body["response"]["result"] == {"ok": True}, body
        # A third request of 0.4 would reach Σ request 1.2 > ω 1: refused with the numbers.
        status, _ = await _put(http, api, "c", gpu_sm_request=0.4, gpu_sm_limit=1.0)
        assert status == 200
        status, body, waited = await _invoke(http, api, "c")
        assert status == 500, body
        error = body["response"]["result"]["error"]
        assert error.startswith("The action cannot run: ") and "Σ request 0.80 + 0.40 > ω 1.00" in error, error
        assert waited < 10, waited


async def test_pinned_instances_do_not_starve_another_function_of_user_memory(tmp_path: Path) -> None:
    async with run_standalone(_cfg(tmp_path, user_memory_mb=1024)) as running, _session() as http:
        api = running.api_url
        for name in ("first", "second"):
            status, _ = await _put(http, api, name, memory=1024, gpu_sm_request=0.2, gpu_sm_limit=0.5)
            assert status == 200
        status, body, _ = await _invoke(http, api, "first")
        assert status == 200, body
        status, body, waited = await _invoke(http, api, "second")
        assert status == 500, body  # a whisk internal error, as OpenWhisk answers it
        error = body["response"]["result"]["error"]
        assert "invoker user memory: guest/second needs 1024 MB" in error, error
        assert "1024 of 1024 MB user memory held by placed instances" in error, error
        assert waited < 10, waited


async def test_an_instance_that_cannot_start_fails_its_callers_with_the_cause(tmp_path: Path) -> None:
    async with run_standalone(_cfg(tmp_path)) as running, _session() as http:
        api = running.api_url
        status, _ = await _put(http, api, "broken", code=BROKEN, gpu_sm_request=0.2, gpu_sm_limit=0.5)
        assert status == 200
        status, body, waited = await _invoke(http, api, "broken")
        assert status == 500, body  # a whisk internal error, as OpenWhisk answers it
        error = body["response"]["result"]["error"]
        assert error.startswith("The action cannot run: ") and "start failed" in error, error
        assert waited < 15, waited


async def test_put_of_limits_that_can_never_fit_is_refused(tmp_path: Path) -> None:
    async with run_standalone(_cfg(tmp_path, user_memory_mb=2048)) as running, _session() as http:
        api = running.api_url
        status, body = await _put(http, api, "big", memory=4096)
        assert status == 400
        assert body["error"] == ("The action's memory limit of 4096 MB exceeds the invoker user memory of 2048 MB: "
                                 "it could never run."), body
        status, body = await _put(http, api, "wide", gpu_memory_mb=32000)
        assert status == 400
        assert "Annotation 'gpu-memory-mb' of 32000 MB exceeds the largest GPU here (16000 MB" in body["error"]
        async with http.get(f"{api}/api/v1/namespaces/_/actions/big") as r:
            assert r.status == 404  # nothing stored
        status, _ = await _put(http, api, "fits", memory=2048, gpu_memory_mb=16000)
        assert status == 200
