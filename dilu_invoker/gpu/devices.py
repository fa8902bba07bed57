"""GPU discovery through NVML (the ``pynvml`` module of the ``nvidia-ml-py`` distribution).

No NVML library or no GPU gives an empty :class:`Discovery` with the reason; the invoker then runs GPU
actions on the CPU and says so. ``--gpu-inventory FILE`` replaces NVML with a described set of GPUs —
**for testing the control plane on machines without GPUs only**: nothing is enforced on such "GPUs".

Inventory file (JSON), either a list of GPUs that every invoker gets, or per invoker id::

    {"invokers": {"0": [{"uuid": "GPU-test-0-0", "name": "Test GPU", "memory_mb": 81920, "sm_count": 132}],
                  "1": [...]}}

Fields per GPU: ``uuid`` (required), ``index`` (default: position), ``name``, ``memory_mb`` (default
81920), ``sm_count`` (default 132).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

#: CUDA cores per SM by NVML architecture id (nvmlDeviceGetArchitecture), to derive SM counts.
_CORES_PER_SM = {2: 192, 3: 128, 4: 64, 5: 64, 6: 64, 7: 128, 8: 128, 9: 128, 10: 128}


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    memory_mb: int
    sm_count: int
    #: minor number of /dev/nvidiaN (None for inventory GPUs)
    minor: int | None = None
    #: described by an inventory file, not a real device
    simulated: bool = False

    @property
    def device_nodes(self) -> tuple[str, ...]:
        if self.minor is None:
            return ()
        return (f"/dev/nvidia{self.minor}", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "memory_mb": self.memory_mb,
                "sm_count": self.sm_count, "simulated": self.simulated}


@dataclass(frozen=True, slots=True)
class Discovery:
    devices: tuple[GpuDevice, ...]
    #: why there are no (real) GPUs, for the logs
    reason: str = ""
    driver_version: str | None = None

    @property
    def has_gpus(self) -> bool:
        return bool(self.devices)


def load_inventory(path: str | Path, invoker_id: int = 0) -> tuple[GpuDevice, ...]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        entries = data.get("invokers", {}).get(str(invoker_id), [])
    elif isinstance(data, list):
        entries = data
    else:
        raise ValueError("a GPU inventory is a list of GPUs or {\"invokers\": {id: [GPUs]}}")
    out: list[GpuDevice] = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("uuid"), str):
            raise ValueError(f"GPU inventory entry {i} needs a string 'uuid'")
        out.append(GpuDevice(
            index=int(e.get("index", i)), uuid=e["uuid"], name=str(e.get("name", "inventory GPU")),
            memory_mb=int(e.get("memory_mb", 81920)), sm_count=int(e.get("sm_count", 132)), simulated=True,
        ))
    return tuple(out)


def discover_for(*, enabled: bool = True, inventory: str | None = None, invoker_id: int = 0, slot: int = 0,
                 invokers: int = 1) -> Discovery:
    """The GPUs of invoker ``invoker_id``, the ``slot``-th (0-based) of ``invokers`` on one machine (standalone
    ``--invokers N``): they must not claim a GPU twice. Real GPUs are dealt out round robin (GPU i to slot
    i mod N); an inventory in the list form (every invoker reads the same list) gets per-invoker UUIDs
    (``<uuid>-i<id>``: test inventories only); the ``{"invokers": {id: [...]}}`` form lists each one's own.
    The GPU node and the invoker's load reports both use this, so the balancer sees the GPUs the node
    manages."""
    found = discover(enabled=enabled, inventory=inventory, invoker_id=invoker_id)
    if invokers <= 1:
        return found
    if inventory:
        try:
            listed = isinstance(json.loads(Path(inventory).read_text()), list)
        except (OSError, ValueError):
            listed = False
        if not listed:
            return found
        return Discovery(tuple(replace(d, uuid=f"{d.uuid}-i{invoker_id}") for d in found.devices), found.reason,
                         found.driver_version)
    mine = tuple(d for d in found.devices if d.index % invokers == slot % invokers)
    reason = found.reason if not found.devices else (
        "" if mine else f"this machine's {len(found.devices)} GPU(s) are dealt to its other invokers")
    return Discovery(mine, reason, found.driver_version)


def discover_nvml() -> Discovery:
    try:
        import pynvml
    except ImportError:
        return Discovery((), "the nvidia-ml-py package is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Discovery((), f"NVML is not available ({exc}); no NVIDIA driver on this machine")
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            devices.append(GpuDevice(
                index=i,
                uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                name=_text(pynvml.nvmlDeviceGetName(h)),
                memory_mb=int(pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024)),
                sm_count=_sm_count(pynvml, h),
                minor=int(pynvml.nvmlDeviceGetMinorNumber(h)),
            ))
        if not devices:
            return Discovery((), "NVML found no GPUs", driver)
        return Discovery(tuple(devices), "", driver)
    except pynvml.NVMLError as exc:
        return Discovery((), f"NVML failed while listing GPUs: {exc}")


def _sm_count(pynvml: Any, handle: Any) -> int:
    try:
        cores = int(pynvml.nvmlDeviceGetNumGpuCores(handle))
        arch = int(pynvml.nvmlDeviceGetArchitecture(handle))
        per_sm = _CORES_PER_SM.get(arch, 128)
        if cores > 0:
            return cores // per_sm
    except (pynvml.NVMLError, AttributeError):
        pass
    return 0


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def discover(*, enabled: bool = True, inventory: str | None = None, invoker_id: int = 0) -> Discovery:
    if not enabled:
        return Discovery((), "GPUs are disabled by configuration (--no-gpu-enabled)")
    if inventory:
        devices = load_inventory(inventory, invoker_id)
        log.warning("using a GPU inventory file: for testing the control plane only, nothing is enforced",
                    inventory=inventory, gpus=len(devices))
        return Discovery(devices, "" if devices else f"inventory {inventory} lists no GPU for invoker {invoker_id}")
    return discover_nvml()


def sm_utilization(device: GpuDevice) -> float | None:
    """GPU utilisation (0..1, the share of time a kernel ran) from NVML; None when unknown."""
    if device.simulated:
        return None
    try:
        import pynvml

        h = pynvml.nvmlDeviceGetHandleByIndex(device.index)
        return float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) / 100.0
    except Exception:  # noqa: BLE001 - metrics must not fail the manager
        return None


def compute_mode(index: int) -> int | None:
    """The GPU's NVML compute mode (0 Default, 1 Exclusive_Thread, 2 Prohibited, 3 Exclusive_Process);
    None when NVML cannot tell (no NVML, a simulated GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return int(pynvml.nvmlDeviceGetComputeMode(h))
    except Exception:  # noqa: BLE001 - unknown is an answer
        return None
