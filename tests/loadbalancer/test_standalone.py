"""``standalone --invokers N``: N invokers in one process behind one REST API, with the embedded balancer."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from dilu_invoker import config
from dilu_invoker.invoker.cluster.routing import BalancedRunner, devices_for
from dilu_invoker.model import GUEST_IDENTITY
from dilu_invoker.standalone import run_standalone

CODE = "import os\ndef main(a):\n    return {'n': a.get('n'), 'pid': os.getpid()}\n"


def _cfg(tmp_path: Path, inventory: object, **balancer: object) -> config.Config:
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    base = config.load(environ={})
    return replace(base, data_dir=str(tmp_path / "data"), api=replace(base.api, port=0),
                   gpu=replace(base.gpu, inventory=str(tmp_path / "inventory.json")),
                   standalone=replace(base.standalone, invokers=2),
                   balancer=replace(base.balancer, tick_s=0.2, report_period_s=0.2, report_ttl_s=1.0, **balancer))


async def test_two_invokers_share_one_instance(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, [{"uuid": "GPU-x", "memory_mb": 16000}])
    second = replace(cfg, invoker=replace(cfg.invoker, id=1))
    assert [d.uuid for d in devices_for(second, slot=1, invokers=2)] == ["GPU-x-i1"]
    token = base64.b64encode(GUEST_IDENTITY.api_key.encode()).decode()
    async with run_standalone(cfg) as running, aiohttp.ClientSession(
            headers={"Authorization": f"Basic {token}"}) as http:
        assert [i.instance_id for i in running.invokers] == [0, 1]
        # The GPU node manages the GPU its load reports name (the balancer reads its budget under that UUID).
        assert [[d.uuid for d in getattr(i.gpu, "devices", ())] for i in running.invokers] == [["GPU-x-i0"],
                                                                                                ["GPU-x-i1"]]
        assert len(set(running.invoker_urls)) == 2 and running.balancer is not None
        body = {"exec": {"kind": "python:3-gpu", "code": CODE}}
        async with http.put(f"{running.api_url}/api/v1/namespaces/_/actions/g", json=body) as r:
            assert r.status == 200
        pids = set()
        for n in range(6):
            async with http.post(f"{running.api_url}/api/v1/namespaces/_/actions/g?blocking=true&result=true",
                                 json={"n": n}) as r:
                assert r.status == 200
                result = await r.json()
                assert result["n"] == n
                pids.add(result["pid"])
        assert len(pids) == 1  # one instance served both invokers' activations
        runners = [r for r in running.runners if isinstance(r, BalancedRunner)]
        assert len(runners) == 2
        # The API alternates between the invokers: one ran its three locally, the other forwarded three.
        assert sorted((r.local_runs, r.forwarded_runs) for r in runners) == [(0, 3), (3, 0)]


async def test_routing_off_runs_in_each_pool(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, {"invokers": {"0": [{"uuid": "GPU-a"}], "1": [{"uuid": "GPU-b"}]}}, routing=False)
    async with run_standalone(cfg) as running:
        assert running.runners == running.invokers


def test_real_gpus_are_dealt_out_round_robin_among_a_machines_invokers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an inventory (NVML; faked here: no GPU driver in CI) the slot-th of N invokers gets GPUs
    i with i mod N = slot, and one that gets none says why."""
    from dilu_invoker.gpu import devices as devs

    found = devs.Discovery(tuple(devs.GpuDevice(index=i, uuid=f"GPU-{i}", name="H200", memory_mb=143771,
                                                sm_count=132) for i in range(3)), "", "580")
    monkeypatch.setattr(devs, "discover", lambda **_kw: found)
    dealt = [[d.uuid for d in devs.discover_for(invoker_id=7 + k, slot=k, invokers=2).devices] for k in range(2)]
    assert dealt == [["GPU-0", "GPU-2"], ["GPU-1"]]
    none = devs.discover_for(invoker_id=9, slot=3, invokers=4)
    assert none.devices == () and "dealt to its other invokers" in none.reason
    assert devs.discover_for(invoker_id=7).devices == found.devices
