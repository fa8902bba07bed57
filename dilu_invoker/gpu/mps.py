"""MPS control daemons run by the invoker, one per GPU (docs/gpu-manager.md, "MPS").

With MPS the kernels of co-located instances run *concurrently* on the GPU's SMs instead of in time slices;
on the H200 that was the best co-location mode measured. Each client's active-thread percentage (a spatial
cap MPS fixes when the client connects) is what the GPU's vertical policy chose for its start
(``GpuManager.mps_threads``; under the default ``spatial`` policy that cap is the split, with no token
rates on top). Under the process backend's isolation the clients of one GPU share a uid, kept apart by
PID and mount namespaces (backends/sandbox.py), since a daemon serves one uid's server at a time.

Per GPU the node **starts** ``nvidia-cuda-mps-control -d`` with its own pipe and log directories (under a
0700 directory the invoker owns, ``CUDA_VISIBLE_DEVICES`` set to that GPU), or **adopts** a daemon already
answering on those pipes (an invoker restart). A supervisor asks each daemon ``get_server_list`` every few
seconds and starts it again when it stopped answering; on shutdown the node sends ``quit`` to the daemons
it started (an adopted one is left running, as it was found).

``--gpu-mps``: ``off`` never; ``on`` always (a daemon that cannot start is an error at start-up);
``auto`` where the control binary exists and the GPU's compute mode allows MPS (Default or
Exclusive-process; Prohibited does not), otherwise time-slicing, the fallback. Logs and ``/metrics``
(``dilu_gpu_mps_enabled``, ``dilu_gpu_mps_restarts_total``) say which mode each GPU runs and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.gpu.attachment import MPS_PRIORITY_BELOW_NORMAL, MPS_PRIORITY_ENV

log = structlog.get_logger(__name__)

CONTROL = "nvidia-cuda-mps-control"
#: NVML compute modes (nvmlComputeMode_t) under which MPS clients can connect
COMPUTE_MODES_OK = {0: "Default", 3: "Exclusive_Process"}
COMPUTE_MODE_NAMES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
#: where a docker container finds the pipes (the same path as the host's keeps the client env identical)
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
CONTAINER_LOG_DIR = "/tmp/nvidia-log"


class MpsMode(enum.StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @classmethod
    def parse(cls, value: str) -> MpsMode:
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ValueError(f"--gpu-mps must be auto, on or off, not {value!r}") from None


class MpsError(RuntimeError):
    """An MPS daemon could not be started although the configuration requires it."""


@dataclass(frozen=True, slots=True)
class MpsDecision:
    """Whether a GPU runs its instances as MPS clients, and why (logged, and in /metrics)."""

    enabled: bool
    reason: str


def decide_mps(mode: MpsMode, *, control: str | None, compute_mode: int | None,
               separate_uids: str | None = None) -> MpsDecision:
    """Pure: the mode a GPU runs in given the flag, the control binary found (None: not found), the
    GPU's NVML compute mode (None: unknown, e.g. no NVML) and why containers run as separate uids (None:
    they share one). An MPS control daemon runs one uid's server at a time and queues the clients of any
    other uid until that server exits, so instances of separate uids cannot share a GPU through MPS."""
    if mode is MpsMode.OFF:
        return MpsDecision(False, "--gpu-mps off: time-slicing")
    if separate_uids is not None:
        why = f"{separate_uids}, and an MPS daemon serves one uid at a time"
        if mode is MpsMode.ON:
            raise MpsError(f"--gpu-mps on: {why}; pass --invoker-process-isolation off to use MPS")
        return MpsDecision(False, f"--gpu-mps auto: {why}: time-slicing")
    if control is None:
        why = f"{CONTROL} not found"
        if mode is MpsMode.ON:
            return MpsDecision(True, f"--gpu-mps on, but {why}")
        return MpsDecision(False, f"--gpu-mps auto: {why}: time-slicing")
    if compute_mode is not None and compute_mode not in COMPUTE_MODES_OK:
        name = COMPUTE_MODE_NAMES.get(compute_mode, str(compute_mode))
        if mode is MpsMode.ON:
            return MpsDecision(True, f"--gpu-mps on although the compute mode is {name}")
        return MpsDecision(False, f"--gpu-mps auto: compute mode {name} does not allow MPS: time-slicing")
    if compute_mode is None and mode is MpsMode.AUTO:
        return MpsDecision(False, "--gpu-mps auto: the GPU's compute mode is unknown (no NVML): time-slicing")
    how = "on" if mode is MpsMode.ON else "auto"
    mode_name = COMPUTE_MODE_NAMES.get(compute_mode, "unknown") if compute_mode is not None else "unknown"
    return MpsDecision(True, f"--gpu-mps {how}: {control} found, compute mode {mode_name}")


def active_thread_percentage(limit: float) -> int:
    """An instance's MPS active-thread percentage from its SM limit (1-100)."""
    return max(1, min(100, round(limit * 100)))


@dataclass(frozen=True, slots=True)
class MpsClientConfig:
    """What a container needs to be an MPS client of its GPU's daemon."""

    env: Mapping[str, str]
    mounts: tuple[tuple[str, str, bool], ...] = ()
    """(host path, container path, read-only) for docker; none for the process backend."""
    ipc_host: bool = False
    """Docker: the container must share the host's IPC namespace (MPS uses shared memory)."""


@dataclass(slots=True)
class MpsDaemon:
    """The MPS control daemon of one GPU."""

    gpu_index: int
    gpu_uuid: str
    directory: Path
    control: str
    started: bool = False
    """This node started the daemon (and quits it on shutdown)."""
    adopted: bool = False
    restarts: int = 0
    env_base: Mapping[str, str] = field(default_factory=dict)
    shared_uid: bool = False
    """Its clients run as a uid leased for this GPU, which owns the pipe and log directories (the process
    backend's sandbox chowns them): the directories above must be traversable (0711), never listable."""

    @property
    def pipe_dir(self) -> Path:
        return self.directory / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.directory / "log"

    @property
    def env(self) -> dict[str, str]:
        """The daemon's (and its clients') pipe and log directories."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _daemon_env(self) -> dict[str, str]:
        env = {k: v for k, v in (self.env_base or os.environ).items() if not k.startswith("CUDA_MPS_")}
        env.update(self.env)
        # One daemon per GPU: it sees only its GPU, numbered as NVML numbers it.
        env["CUDA_VISIBLE_DEVICES"] = self.gpu_uuid if self.gpu_uuid.startswith(("GPU-", "MIG-")) \
            else str(self.gpu_index)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        return env

    async def _control(self, *args: str, stdin: str | None = None, timeout_s: float = 10.0) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            self.control, *args, env=self._daemon_env(),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None),
                                            timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return 124, f"{self.control} {' '.join(args)} did not answer in {timeout_s:g} s"
        return proc.returncode or 0, out.decode(errors="replace").strip()

    async def alive(self) -> bool:
        """The daemon answers on its control pipe."""
        if not (self.pipe_dir / "control").exists():
            return False
        rc, _ = await self._control(stdin="get_server_list\n", timeout_s=5.0)
        return rc == 0

    def _prepare(self) -> None:
        mode = 0o711 if self.shared_uid else 0o700
        self.directory.mkdir(parents=True, exist_ok=True, mode=mode)
        for d in (self.directory, self.directory.parent, self.directory.parent.parent) if self.shared_uid \
                else (self.directory,):
            os.chmod(d, mode)
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(exist_ok=True, mode=0o700)
            os.chmod(d, 0o700)

    async def start(self) -> str:
        """Adopt a daemon that answers on the pipes, else start one; returns what happened."""
        await asyncio.to_thread(self._prepare)
        if await self.alive():
            self.adopted, self.started = True, False
            return f"adopted the MPS daemon answering on {self.pipe_dir}"
        rc, out = await self._control("-d")
        if rc != 0:
            raise MpsError(f"{self.control} -d failed (rc {rc}): {out[-300:]}")
        for _ in range(50):  # the control pipe appears once the daemon has forked
            if await self.alive():
                break
            await asyncio.sleep(0.1)
        else:
            raise MpsError(f"{self.control} -d returned but no daemon answers on {self.pipe_dir}")
        self.started, self.adopted = True, False
        return f"started {self.control} -d on {self.pipe_dir}"

    async def stop(self) -> None:
        """Quit a daemon this node started (clients still connected are ended by MPS)."""
        if not self.started:
            return
        rc, out = await self._control(stdin="quit\n", timeout_s=10.0)
        self.started = False
        if rc != 0:
            log.warning("MPS daemon did not quit", gpu=self.gpu_index, rc=rc, output=out[-200:])
        else:
            log.info("MPS daemon stopped", gpu=self.gpu_index)

    def client(self, limit: float, *, backend: str, below_normal: bool = False) -> MpsClientConfig:
        """What a client connects with: the pipe and log directories, its active-thread cap and, where
        ``below_normal``, MPS's below-normal client priority (both fixed when it makes its context)."""
        own = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(active_thread_percentage(limit))}
        if below_normal:
            own[MPS_PRIORITY_ENV] = MPS_PRIORITY_BELOW_NORMAL
        if backend == "docker":
            env = {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR, "CUDA_MPS_LOG_DIRECTORY": CONTAINER_LOG_DIR, **own}
            mounts = ((str(self.pipe_dir), CONTAINER_PIPE_DIR, False), (str(self.log_dir), CONTAINER_LOG_DIR, False))
            return MpsClientConfig(env=env, mounts=mounts, ipc_host=True)
        return MpsClientConfig(env={**self.env, **own})


class MpsMetrics:
    """``dilu_gpu_mps_enabled`` (1: MPS, 0: time-slicing) with the reason, and daemon restarts."""

    def __init__(self, registry: Any | None) -> None:
        self._enabled: Any = None
        self._restarts: Any = None
        if registry is None:
            return
        from prometheus_client import Counter, Gauge

        self._enabled = Gauge("dilu_gpu_mps_enabled", "1 when the GPU's instances run as MPS clients, 0 when "
                              "time-sliced; reason says why", ("gpu", "uuid", "reason"), registry=registry)
        self._restarts = Counter("dilu_gpu_mps_restarts", "MPS control daemons started again after they stopped "
                                 "answering", ("gpu", "uuid"), registry=registry)

    def mode(self, index: int, uuid: str, decision: MpsDecision) -> None:
        if self._enabled is not None:
            self._enabled.labels(str(index), uuid, decision.reason).set(1 if decision.enabled else 0)

    def restarted(self, index: int, uuid: str) -> None:
        if self._restarts is not None:
            self._restarts.labels(str(index), uuid).inc()


class MpsSupervisor:
    """The daemons of one node's GPUs: decide per GPU, start or adopt, supervise, stop."""

    def __init__(
        self,
        *,
        mode: MpsMode,
        root: Path,
        gpus: tuple[tuple[int, str], ...],
        control: str = CONTROL,
        compute_mode: Callable[[int], int | None] | None = None,
        check_every_s: float = 5.0,
        metrics: MpsMetrics | None = None,
        separate_uids: str | None = None,
        shared_uid: bool = False,
        best_effort_priority: bool = True,
    ) -> None:
        self.mode = mode
        #: best-effort clients at MPS's below-normal priority (`--gpu-mps-best-effort-priority`)
        self.best_effort_priority = best_effort_priority
        self.separate_uids = separate_uids
        self.shared_uid = shared_uid
        self.root = root
        self.gpus = gpus
        resolved = shutil.which(control) if os.sep not in control else (control if Path(control).is_file() else None)
        self.control = resolved
        self._control_name = control
        self._compute_mode = compute_mode or (lambda _i: None)
        self.check_every_s = check_every_s
        self.metrics = metrics or MpsMetrics(None)
        self.decisions: dict[int, MpsDecision] = {}
        self.daemons: dict[int, MpsDaemon] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for index, uuid in self.gpus:
            try:
                cm = self._compute_mode(index)
            except Exception as exc:  # noqa: BLE001 - NVML trouble means "unknown", not a crash
                log.debug("compute mode unknown", gpu=index, error=repr(exc))
                cm = None
            decision = decide_mps(self.mode, control=self.control, compute_mode=cm, separate_uids=self.separate_uids)
            if decision.enabled:
                if self.control is None:
                    raise MpsError(f"--gpu-mps on: {self._control_name} not found")
                daemon = MpsDaemon(gpu_index=index, gpu_uuid=uuid, directory=self.root / f"gpu{index}",
                                   control=self.control, shared_uid=self.shared_uid)
                try:
                    what = await daemon.start()
                except MpsError as exc:
                    if self.mode is MpsMode.ON:
                        raise
                    decision = MpsDecision(False, f"--gpu-mps auto: the daemon did not start ({exc}): time-slicing")
                else:
                    shared = ("; isolated clients share one uid, kept apart by PID and mount namespaces"
                              if self.shared_uid else "")
                    priority = ("; best-effort clients at below-normal priority" if self.best_effort_priority
                                else "; every client at normal priority")
                    decision = MpsDecision(True, f"{decision.reason}; {what}{shared}{priority}")
                    self.daemons[index] = daemon
            self.decisions[index] = decision
            self.metrics.mode(index, uuid, decision)
            log.info("GPU sharing mode", gpu=index, uuid=uuid, mode="mps" if decision.enabled else "time-slicing",
                     reason=decision.reason)
        if self.daemons:
            self._task = asyncio.create_task(self._supervise(), name="mps-supervisor")

    def client(self, index: int, limit: float, *, backend: str, best_effort: bool = False) -> MpsClientConfig | None:
        """The MPS client configuration of an instance on GPU ``index`` (None: the GPU time-slices); a
        best-effort instance's client runs at below-normal priority unless ``best_effort_priority`` is off."""
        daemon = self.daemons.get(index)
        if daemon is None:
            return None
        return daemon.client(limit, backend=backend, below_normal=best_effort and self.best_effort_priority)

    def enabled(self, index: int) -> bool:
        return index in self.daemons

    async def check_once(self) -> None:
        for index, daemon in list(self.daemons.items()):
            if await daemon.alive():
                continue
            log.warning("MPS daemon stopped answering; starting it again", gpu=index, pipe=str(daemon.pipe_dir))
            try:
                await daemon.start()
            except MpsError as exc:
                log.error("MPS daemon restart failed; retrying", gpu=index, error=str(exc))
                continue
            daemon.restarts += 1
            self.metrics.restarted(index, daemon.gpu_uuid)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.check_every_s)
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("MPS supervision check failed")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        for daemon in self.daemons.values():
            with contextlib.suppress(Exception):
                await daemon.stop()
