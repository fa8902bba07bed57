"""The CUDA IPC entry points the models API calls, through ctypes, against the fake libcuda, between real
processes: export covers the allocation's base, the exporting process cannot open its own handle, another
process can, and a handle whose exporter died does not open."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dilu_invoker.actions import models

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "cuda_shim"
FAKE = SHIM / "build" / "fake" / "libcuda.so.1"

EXPORTER = r"""
import json, sys
from dilu_invoker.actions import models
d = models._CudaDriver(sys.argv[1])
d.ensure_context(0)
ptr = d.alloc(1 << 20)
base, size = d.address_range(ptr + 4096)
handle = d.export(ptr + 4096)
try:
    d.open(handle)
    own = "opened"
except models.ModelsError as exc:
    own = str(exc)
print(json.dumps({"ptr": ptr, "base": base, "size": size, "handle": handle.hex(), "own": own}), flush=True)
sys.stdin.readline()
"""

IMPORTER = r"""
import json, sys
from dilu_invoker.actions import models
d = models._CudaDriver(sys.argv[1])
d.ensure_context(0)
out = {}
try:
    ptr = d.open(bytes.fromhex(sys.argv[2]))
    d.close(ptr)
    out["ptr"] = ptr
except models.ModelsError as exc:
    out["error"] = str(exc)
try:
    d.open(b"x" * 64)
except models.ModelsError as exc:
    out["garbage"] = str(exc)
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def fake() -> Path:
    if not shutil.which("gcc"):
        pytest.skip("no C compiler")
    r = subprocess.run(["make", "-s", "-C", str(SHIM), "build/fake/libcuda.so.1"], capture_output=True, text=True,
                       timeout=120, check=False)
    if r.returncode != 0 and "cuda.h" in r.stderr:
        pytest.skip("cuda.h not installed")
    assert r.returncode == 0, r.stderr
    return FAKE


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_handle_exchange_through_the_driver_entry_points(fake: Path) -> None:
    exporter = subprocess.Popen([sys.executable, "-c", EXPORTER, str(fake)], env=_env(), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        got = json.loads(exporter.stdout.readline())
        assert got["base"] == got["ptr"] and got["size"] == 1 << 20  # an interior pointer finds its allocation
        assert "cuIpcOpenMemHandle failed with CUDA error 201" in got["own"]  # not in the exporting process
        r = subprocess.run([sys.executable, "-c", IMPORTER, str(fake), got["handle"]], env=_env(),
                           capture_output=True, text=True, timeout=60, check=True)
        opened = json.loads(r.stdout)
        assert opened.get("ptr", 0) > 0, opened
        assert "CUDA error 1" in opened["garbage"]  # CUDA_ERROR_INVALID_VALUE
        exporter.stdin.write("\n")
        exporter.stdin.flush()
        exporter.wait(10)
        # The exporter is gone: its handle no longer opens (the mapper then loads the weights itself).
        r = subprocess.run([sys.executable, "-c", IMPORTER, str(fake), got["handle"]], env=_env(),
                           capture_output=True, text=True, timeout=60, check=True)
        assert "CUDA error 400" in json.loads(r.stdout)["error"]  # CUDA_ERROR_INVALID_HANDLE
    finally:
        if exporter.poll() is None:
            exporter.kill()
        exporter.wait()


MAPPER_UNDER_SHIM = r"""
import json, sys
from dilu_invoker.actions import models
d = models._CudaDriver("libcuda.so.1")  # the fake, found on LD_LIBRARY_PATH; the shim is preloaded
d.ensure_context(0)
out = {"mapped": d.open(bytes.fromhex(sys.argv[1])) > 0}
for mib in (8, 16):
    try:
        d.alloc(mib << 20)
        out[str(mib)] = "allocated"
    except models.ModelsError as exc:
        out[str(mib)] = str(exc)
import os, time
from dilu_invoker.gpu import abi
stats = abi.StatsFile.open(os.environ["DILU_SHIM_STATS"])
deadline = time.monotonic() + 5
while stats.snapshot().mem_used_bytes == 0 and time.monotonic() < deadline:
    time.sleep(0.01)  # the shim publishes its accounting every tick
out["used"] = stats.snapshot().mem_used_bytes
print(json.dumps(out), flush=True)
"""


def test_the_shims_memory_cap_counts_own_allocations_not_mapped_weights(fake: Path, tmp_path: Path) -> None:
    """A mapping instance works under its cap: the GPU budget charges it its memory without the shared
    weights, and the shim does not count what cuIpcOpenMemHandle maps (it is the holder's allocation)."""
    from dilu_invoker.gpu import abi, shim

    r = subprocess.run(["make", "-s", "-C", str(SHIM), "build/libdilu_shim.so"], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    root = tmp_path / "shm"
    control, stats = abi.create_instance_files(root, "mapper", abi.Quota(mem_cap_bytes=16 << 20,
                                                                         stale_after_ns=0))
    control.close()
    stats.close()
    files = abi.instance_files(root, "mapper")
    exporter = subprocess.Popen([sys.executable, "-c", EXPORTER.replace("1 << 20", "64 << 20"), str(fake)],
                                env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        handle = json.loads(exporter.stdout.readline())["handle"]
        env = shim.process_env(control_path=files.control, stats_path=files.stats, library=SHIM / "build" /
                               "libdilu_shim.so", base_env={**_env(), "LD_LIBRARY_PATH": str(FAKE.parent)})
        r = subprocess.run([sys.executable, "-c", MAPPER_UNDER_SHIM, handle], env=env, capture_output=True,
                           text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        # 64 MiB mapped under a 16 MiB cap, 8 MiB of its own still allocated; 8 + 16 > 16 is refused; what
        # the shim counts (and publishes) is the 8 MiB.
        assert got == {"mapped": True, "8": "allocated", "16": "cuMemAlloc failed with CUDA error 2",
                       "used": 8 << 20}, got
    finally:
        if exporter.poll() is None:
            exporter.kill()
        exporter.wait()


def test_a_module_loader_without_torch_is_refused_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if models._torch() is not None:
        pytest.skip("torch installed")
    monkeypatch.delenv(models.ENV_KEY, raising=False)
    with pytest.raises(models.ModelsError, match="nn.Module, a dict"):
        models.load("odd", lambda: 42, device="cpu")
    models.reset()
