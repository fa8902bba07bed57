from __future__ import annotations

import json
from pathlib import Path

import pytest

from dilu_invoker.gpu.devices import discover, load_inventory


def test_no_nvml_means_no_gpus_with_a_reason() -> None:
    # CI machines have no NVIDIA driver: discovery must say so instead of failing.
    found = discover(enabled=True)
    if found.has_gpus:
        pytest.skip("this machine has a real GPU")
    assert found.devices == ()
    assert "NVML" in found.reason or "nvidia-ml-py" in found.reason


def test_disabled_by_configuration() -> None:
    found = discover(enabled=False)
    assert not found.has_gpus and "disabled" in found.reason


def test_inventory_per_invoker(tmp_path: Path) -> None:
    path = tmp_path / "inv.json"
    path.write_text(json.dumps({"invokers": {"0": [{"uuid": "GPU-a", "memory_mb": 40960}],
                                             "1": [{"uuid": "GPU-b"}, {"uuid": "GPU-c", "sm_count": 108}]}}))
    assert [d.uuid for d in discover(inventory=str(path), invoker_id=1).devices] == ["GPU-b", "GPU-c"]
    zero = load_inventory(path, 0)
    assert zero[0].memory_mb == 40960 and zero[0].simulated and zero[0].device_nodes == ()
    assert not discover(inventory=str(path), invoker_id=5).has_gpus


def test_inventory_list_and_bad_entries(tmp_path: Path) -> None:
    path = tmp_path / "inv.json"
    path.write_text(json.dumps([{"uuid": "GPU-x"}, {"uuid": "GPU-y"}]))
    assert [d.index for d in load_inventory(path, 3)] == [0, 1]
    path.write_text(json.dumps([{"name": "no uuid"}]))
    with pytest.raises(ValueError, match="uuid"):
        load_inventory(path)
