"""This node's GPUs as the invoker sees them: admission, shim files, vertical managers, Redis budgets.

:class:`GpuNode` implements the invoker core's ``GpuAllocator``: ``attach`` picks a GPU (the balancer's
choice when given, else the placement policy over this node's GPUs), reserves the instance's
``<request, limit>`` and memory in the GPU's Redis budget, writes its control and stats blocks and returns
what its container needs; ``detach`` undoes all of it. One :class:`~dilu_invoker.gpu.manager.GpuManager`
per GPU re-divides the shares every period. See docs/gpu-manager.md.

Redis is the shared truth of the budgets but never a dependency of running work: when it does not answer,
admission falls back to the node's last-known view (its own instances plus the other invokers'
reservations it last read), the managers keep enforcing shares, and a background sync re-registers the
GPUs and reconciles the reservations once Redis is back. Without any Redis (``budgets=None``) the node
admits locally only.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import structlog

from dilu_invoker.aiotasks import cancel_and_wait
from dilu_invoker.gpu import abi, shim
from dilu_invoker.gpu.attachment import GpuAttachment, GpuMount
from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.gpu.load import LoadReading
from dilu_invoker.gpu.manager import (
    CapacityConfig,
    GpuManager,
    InstanceSpec,
    ManagerMetrics,
    TickRecord,
)
from dilu_invoker.gpu.mps import MpsSupervisor, active_thread_percentage
from dilu_invoker.model import PRELOAD_FUNCTION_PREFIX, GpuNeeds, weights_group
from dilu_invoker.policy.cluster import ClusterSnapshot
from dilu_invoker.policy.placement import PlacementConfig, PlacementRequest, place
from dilu_invoker.policy.types import EPS, GpuRef, GpuState, InstanceClass, PlacedInstance
from dilu_invoker.policy.vertical_slo import AnyVerticalConfig, PerGpuVertical, SloConfig, policy_name, resolve_vertical

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from prometheus_client import CollectorRegistry

    from dilu_invoker.config import Config
    from dilu_invoker.gpu.budgets import GpuBudget, GpuBudgets, Reservation

try:
    from redis.exceptions import RedisError as _RedisError
except ImportError:  # the GPU benchmark runs the node without Redis and without the redis package
    _RedisError = OSError  # type: ignore[assignment,misc]

log = structlog.get_logger(__name__)

T = TypeVar("T")
DOCKER_GPU_MODES = ("device-requests", "cdi", "devices")


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance on a GPU of this node (the balancer's load reports are built from these)."""

    id: str
    function: str
    cls: InstanceClass
    request: float
    limit: float
    share: float
    memory_mb: int
    active: bool
    saturated: bool
    throttled_s: float


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    uuid: str
    memory_mb: int
    sm_count: int
    instances: tuple[InstanceView, ...]


class _Failed:
    """A Redis call that did not answer."""


_FAILED = _Failed()


_Weights = tuple[str, int] | None
"""(sharing group, `weights_group`, and weights MB): what an instance counts once with the other
instances of its group on its GPU (`GpuNeeds.weights_mb`, docs/runtime.md "GPU memory budget")."""


def _weights_of(node: str, function: str, needs: GpuNeeds, revision: str | None, backend: str,
                same_pids: bool = False) -> _Weights:
    """Only a known revision shares (its instances at other revisions have other weights), and only where
    the models API can share: not between Docker containers (each has its own network namespace, so no
    holder's endpoint is reachable and every instance loads its own copy), and not between processes whose
    PIDs read the same in their PID namespaces (``same_pids``: isolated MPS clients on a kernel without
    ``ns_last_pid``, so without the sandbox's PID ranges): a CUDA IPC handle names its exporter by PID, and
    on the H200 two such workers, both PID 2, failed to map (cuIpcOpenMemHandle, CUDA error 201) while the
    same pair with distinct PIDs mapped (coldstart run 7), so there the budget counts every copy."""
    if not revision or needs.weights_mb <= 0 or function.startswith(PRELOAD_FUNCTION_PREFIX) \
            or backend == "docker" or same_pids:
        return None
    return weights_group(node, function, revision), needs.weights_mb


@dataclass(slots=True)
class _Attached:
    spec: InstanceSpec
    device: GpuDevice
    files: abi.InstanceFiles
    control: abi.ControlFile
    stats: abi.StatsFile
    attachment: GpuAttachment
    reserved: bool
    """Redis holds its reservation (False: admitted locally while Redis was unreachable)."""
    weights: _Weights = None
    """Its function revision's shared weights (counted once per GPU in the budget), if it declares any."""
    kept: bool = False
    """Staged exit: its compute is released, only its weights stay reserved (`GpuNode.keep_weights`)."""
    capped: bool = True
    """Its MPS client's thread cap is fixed (False only for a pre-loaded container that makes no CUDA
    context before /init: its cap comes with the function that takes it)."""


class GpuNode:
    """The GPUs of one invoker."""

    def __init__(
        self,
        *,
        node: str,
        devices: Sequence[GpuDevice],
        shm_dir: Path | str,
        no_gpu_reason: str = "",
        backend: str = "process",
        docker_gpu_mode: str = "device-requests",
        shim_library: Path | str | None = None,
        budgets: GpuBudgets | None = None,
        gamma: float = math.inf,
        omega: float = 1.0,
        reservation_ttl_s: float = 30.0,
        sync_period_s: float | None = None,
        redis_timeout_s: float = 2.0,
        period_s: float = 0.05,
        vertical: AnyVerticalConfig | PerGpuVertical | None = None,
        capacity: CapacityConfig | None = None,
        stale_after_s: float | None = None,
        metrics: ManagerMetrics | None = None,
        utilization: Callable[[GpuDevice], float | None] | None = None,
        observers: tuple[Callable[[TickRecord], None], ...] = (),
        mps: MpsSupervisor | None = None,
        distinct_pids: bool = True,
    ) -> None:
        if backend == "docker" and docker_gpu_mode not in DOCKER_GPU_MODES:
            raise ValueError(f"docker GPU mode must be one of {DOCKER_GPU_MODES}, not {docker_gpu_mode!r}")
        if not (math.isfinite(reservation_ttl_s) and reservation_ttl_s > 0):
            raise ValueError(f"reservation_ttl_s must be > 0, got {reservation_ttl_s!r}")
        self.node = node
        self.devices = tuple(sorted(devices, key=lambda d: d.index))
        self.no_gpu_reason = no_gpu_reason if not self.devices else ""
        self.root = Path(shm_dir) / node
        self.backend = backend
        #: the backend's word: its containers' workers never read the same PID (`ProcessBackend.distinct_pids`)
        self.distinct_pids = distinct_pids
        self.docker_gpu_mode = docker_gpu_mode
        self.gamma = gamma
        self.omega = omega
        self.ttl_s = reservation_ttl_s
        self.sync_period_s = sync_period_s if sync_period_s is not None else max(0.2, reservation_ttl_s / 3)
        self.redis_timeout_s = redis_timeout_s
        self._budgets = budgets
        self._shim: Path | None = None
        self._shim_problem = ""
        try:
            self._shim = Path(shim_library) if shim_library is not None else shim.find_library()
            if not self._shim.is_file():
                raise shim.ShimNotFoundError(f"{self._shim} does not exist")
        except shim.ShimNotFoundError as exc:
            self._shim, self._shim_problem = None, str(exc)
        # `auto` and `spatial` pick each GPU's policy once its MPS decision is known (`start`); until then, and
        # for good where no MPS supervisor exists, the time-sliced choice.
        self._vertical = vertical or SloConfig()
        provisional, _why, _fallback = resolve_vertical(self._vertical, mps=False)
        self._managers: dict[str, GpuManager] = {
            d.uuid: GpuManager(
                uuid=d.uuid, index=d.index, period_s=period_s, vertical=provisional, capacity=capacity,
                stale_after_s=stale_after_s, publish=self._publish if budgets is not None else None,
                metrics=metrics, observers=observers,
                utilization=(lambda d=d: utilization(d)) if utilization is not None else None,  # type: ignore[misc]
            )
            for d in self.devices
        }
        self._attached: dict[str, _Attached] = {}
        self._known: dict[str, GpuBudget] = {}
        self._admit_lock = asyncio.Lock()
        self._redis_ok = True
        self._needs_sync = budgets is not None
        self._sync_task: asyncio.Task[None] | None = None
        self._wake_sync = asyncio.Event()
        self._started = False
        self.mps = mps

    # -- construction from the configuration ------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        redis: aioredis.Redis | None = None,
        backend: str = "process",
        registry: CollectorRegistry | None = None,
        distinct_pids: bool = True,
        slot: int = 0,
        invokers: int = 1,
    ) -> GpuNode:
        """Discovery (NVML, or ``--gpu-inventory``), budgets on ``redis`` and metrics in ``registry``; the
        ``slot``-th of ``invokers`` on the machine gets its share of the GPUs (`devices.discover_for`)."""
        from dilu_invoker.gpu.devices import discover_for, sm_utilization

        g = cfg.gpu
        try:
            found = discover_for(enabled=g.enabled, inventory=g.inventory, invoker_id=cfg.invoker.id, slot=slot,
                                 invokers=invokers)
            devices, reason = found.devices, found.reason
        except (OSError, ValueError) as exc:
            devices, reason = (), f"the GPU inventory could not be read: {exc}"
        budgets = None
        metrics = None
        if devices and redis is not None:
            from dilu_invoker.gpu.budgets import GpuBudgets

            budgets = GpuBudgets(redis, prefix=cfg.redis.prefix)
        if devices and registry is not None:
            from dilu_invoker.gpu.metrics import GpuMetrics

            metrics = GpuMetrics(registry)
        mps = None
        if devices:
            from dilu_invoker.gpu.devices import compute_mode
            from dilu_invoker.gpu.mps import MpsMetrics, MpsMode

            separate, shared_uid, mps_root = None, False, Path(g.mps_dir or cfg.data_path / "mps")
            if backend == "process" and cfg.invoker.process_isolation == "auto" and os.geteuid() == 0:
                # Isolated containers have uids of their own, but the MPS clients of one GPU share one (its
                # server runs as it) and are kept apart by PID and mount namespaces (backends/sandbox.py).
                # Their server and clients must reach the pipes: outside the data dir, which is root's alone.
                from dilu_invoker.config import default_process_work_dir, missing_mps_isolation_tools

                missing = missing_mps_isolation_tools()
                if missing:
                    separate = (f"process isolation runs every container as its own uid (util-linux "
                                f"{' and '.join(missing)} not found to run a GPU's MPS clients as one uid)")
                else:
                    shared_uid = True
                    mps_root = Path(g.mps_dir or Path(cfg.invoker.process_work_dir or default_process_work_dir()) / "mps")
            mps = MpsSupervisor(
                mode=MpsMode.parse(g.mps), root=mps_root / f"invoker{cfg.invoker.id}",
                gpus=tuple((d.index, d.uuid) for d in devices),
                control=g.mps_control, compute_mode=compute_mode, metrics=MpsMetrics(registry),
                separate_uids=separate, shared_uid=shared_uid, best_effort_priority=g.mps_best_effort_priority)
        return cls(
            node=f"invoker{cfg.invoker.id}", devices=devices, no_gpu_reason=reason, shm_dir=g.shm_dir, mps=mps,
            backend=backend, docker_gpu_mode=cfg.invoker.docker_gpu_mode, shim_library=g.shim_path,
            budgets=budgets, gamma=g.gamma, reservation_ttl_s=g.reservation_ttl_s,
            period_s=g.manager_period_ms / 1000, metrics=metrics, utilization=sm_utilization,
            vertical=g.vertical(), distinct_pids=distinct_pids,
        )

    # -- state -------------------------------------------------------------------------------------

    @property
    def has_gpus(self) -> bool:
        return bool(self.devices)

    @property
    def redis_reachable(self) -> bool:
        return self._budgets is not None and self._redis_ok

    def manager(self, uuid_or_index: str | int) -> GpuManager:
        for d in self.devices:
            if uuid_or_index in (d.uuid, d.index):
                return self._managers[d.uuid]
        raise KeyError(uuid_or_index)

    def view(self) -> tuple[GpuView, ...]:
        out = []
        for d in self.devices:
            instances = []
            for spec, status in self._managers[d.uuid].statuses():
                instances.append(InstanceView(
                    id=spec.id, function=spec.function, cls=spec.cls, request=spec.request, limit=spec.limit,
                    share=status.share if status else spec.starting_share, memory_mb=spec.memory_mb,
                    active=status.active if status else False, saturated=status.saturated if status else False,
                    throttled_s=status.throttled_s if status else 0.0,
                ))
            out.append(GpuView(index=d.index, uuid=d.uuid, memory_mb=d.memory_mb, sm_count=d.sm_count,
                               instances=tuple(instances)))
        return tuple(out)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if not self.devices:
            log.warning("no GPUs: GPU actions run on the CPU", reason=self.no_gpu_reason)
            return
        try:
            await asyncio.to_thread(self._prepare_root)
        except OSError as exc:
            self.no_gpu_reason = f"the shim directory {self.root} is unusable: {exc}"
            self.devices = ()
            log.error("no GPUs: GPU actions run on the CPU", reason=self.no_gpu_reason)
            return
        if self._shim is None:
            log.error("libdilu_shim.so not found: GPU actions get their GPU but shares are NOT enforced",
                      problem=self._shim_problem)
        if self.mps is not None:
            await self.mps.start()
        self._choose_policies()
        for mgr in self._managers.values():
            mgr.start()
        log.info("GPU node started", node=self.node, gpus=[d.index for d in self.devices], backend=self.backend,
                 redis=self._budgets is not None, shim=str(self._shim) if self._shim else None)
        if self._budgets is not None:
            await self._sync_once()  # registers the GPUs and drops reservations of an earlier life
            self._sync_task = asyncio.create_task(self._sync_loop(), name=f"gpu-budgets-{self.node}")

    @property
    def _same_pids(self) -> bool:
        """The node's GPU containers are MPS clients in PID namespaces of their own (shared-uid isolation)
        whose PIDs may read the same: the backend cannot give them PID ranges of their own."""
        return self.mps is not None and self.mps.shared_uid and bool(self.mps.daemons) and not self.distinct_pids

    def _choose_policies(self) -> None:
        """Each GPU's vertical policy, now that its sharing mode is known (`resolve_vertical`): logged and in
        /metrics (``dilu_gpu_vertical_policy``) with the reason."""
        for d in self.devices:
            mps = self.mps is not None and self.mps.enabled(d.index)
            decision = self.mps.decisions.get(d.index) if self.mps is not None else None
            config, why, fallback = resolve_vertical(self._vertical, mps=mps,
                                                     mps_reason=decision.reason if decision is not None else "")
            mgr = self._managers[d.uuid]
            mgr.set_vertical_config(config, reason=why)
            (log.warning if fallback else log.info)(
                "GPU vertical policy", gpu=d.index, uuid=d.uuid, mode="mps" if mps else "time-slicing",
                policy=policy_name(config), gates_launches=mgr.gates_launches, reason=why)

    def _lc_requests(self, device: GpuDevice, *, besides: str) -> float:
        """Σ SM request (as budgeted) of the latency-critical instances on ``device`` other than ``besides``:
        this node's and, as last read from Redis, other invokers' (the `spatial` policy's reserve)."""
        return sum(p.request for p in self._placed_on(device) if p.cls.latency_critical and p.id != besides)

    def _prepare_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o755)
        # Blocks of an earlier run: its containers were removed before this node started.
        for leftover in self.root.iterdir():
            if leftover.is_dir() and (leftover / "control").exists():
                shutil.rmtree(leftover, ignore_errors=True)

    async def close(self) -> None:
        """Stop the sync and the managers, detach whatever is still attached (best effort)."""
        if self._sync_task is not None:
            # cancel_and_wait: a wake of its wait_for that meets the cancel swallows it on 3.11 (close hung)
            await cancel_and_wait(self._sync_task)
            self._sync_task = None
        for instance in list(self._attached):
            with contextlib.suppress(Exception):
                await self.detach(instance)
        for mgr in self._managers.values():
            await mgr.stop()
        if self.mps is not None:
            await self.mps.stop()

    # -- attach / detach ---------------------------------------------------------------------------

    async def attach(self, instance: str, function: str, needs: GpuNeeds, *,
                     gpu_index: int | None = None, revision: str | None = None,
                     mps_threads: float | None = None) -> GpuAttachment | None:
        """``revision``: the function's code revision; with it, ``needs.weights_mb`` count once among the
        instances of that revision on the GPU (without it every instance reserves its whole memory).
        ``mps_threads``: a pre-loaded container's MPS thread cap, chosen ahead for the functions expected to
        take it (it makes its CUDA context at that cap); without it a pre-loaded container is taken as one
        that makes none before /init, and any other instance connects at what `mps_cap` gives."""
        if not self.devices:
            return None
        have = self._attached.get(instance)
        if have is not None:
            return have.attachment
        try:
            spec = _spec_of(instance, function, needs)
            abi.instance_files(self.root, instance)
        except ValueError as exc:
            log.warning("GPU not attached: bad instance", instance=instance, error=str(exc))
            return None
        async with self._admit_lock:
            weights = _weights_of(self.node, function, needs, revision, self.backend, self._same_pids)
            device, reserved, why = await self._admit(spec, gpu_index, weights)
        if device is None:
            log.warning("no GPU admitted the instance", instance=instance, function=function,
                        reason=why)
            return None
        mgr = self._managers[device.uuid]
        lc = self._lc_requests(device, besides=instance)
        threads = mgr.mps_threads(spec, lc_requests=lc)
        if mps_threads is not None and self.mps is not None and self.mps.enabled(device.index):
            threads = min(1.0, max(0.01, mps_threads))  # a pre-loaded client's cap, chosen ahead
        try:
            control, stats = await asyncio.to_thread(
                abi.create_instance_files, self.root, instance, mgr.initial_quota(spec, lc_requests=lc))
        except OSError as exc:
            log.error("could not create the shim blocks; the instance runs on the CPU", instance=instance,
                      error=str(exc))
            await self._release(device, instance)
            return None
        files = abi.instance_files(self.root, instance)
        attachment = self._attachment(device, files, spec, mps_threads=threads)
        mgr.add(spec, control, stats, mps_threads=threads)
        self._attached[instance] = _Attached(spec, device, files, control, stats, attachment, reserved)
        self._attached[instance].capped = mps_threads is not None or not function.startswith(PRELOAD_FUNCTION_PREFIX)
        log.info("GPU attached", instance=instance, function=function, gpu=device.index, uuid=device.uuid,
                 cls=spec.cls.value, request=spec.request, limit=spec.limit, memory_mb=spec.memory_mb,
                 budget="redis" if reserved else "local", reason=why)
        self._attached[instance].weights = weights
        return attachment

    async def retarget(self, instance: str, function: str, needs: GpuNeeds, *, new_id: str | None = None,
                       revision: str | None = None) -> bool:
        """Hand an attached instance — a pre-loaded container's GPU share, made before its function was
        known — to ``function`` with ``needs``, on the same GPU: its shim blocks, environment and CUDA
        context stay; its spec, budget reservation and quota become the function's, under ``new_id`` when
        given (a balancer-placed instance keeps its share under the instance's id). False, changing
        nothing, when that GPU has no room for the new needs, when ``new_id`` is attached already, or when
        the instance is an MPS client whose thread cap is fixed (it made its CUDA context, or runs) and is
        not the cap ``function`` gets there now (`mps_cap`, compared in whole percent as MPS takes it): its
        cap cannot change, and a function never runs at another cap than its own. ``revision`` as for
        `attach`."""
        a = self._attached.get(instance)
        target = new_id or instance
        if a is None or (target != instance and target in self._attached):
            return False
        try:
            spec = _spec_of(target, function, needs)
        except ValueError:
            return False
        mgr = self._managers[a.device.uuid]
        # A client with a fixed cap keeps it; a pre-loaded one without a context connects at /init, which
        # brings the function's cap, so only its attachment changes.
        keep = a.attachment.mps_client and a.capped
        async with self._admit_lock:
            old_threads = mgr.mps_threads_of(instance)
            if keep and old_threads is not None:
                wanted = mgr.mps_threads(spec, lc_requests=self._lc_requests(a.device, besides=target))
                if active_thread_percentage(wanted) != active_thread_percentage(old_threads):
                    log.info("GPU share not retargeted: the MPS client's thread cap is fixed at another value",
                             instance=instance, function=function, gpu=a.device.index,
                             cap=active_thread_percentage(old_threads), wanted=active_thread_percentage(wanted))
                    return False
            del self._attached[instance]  # its old needs must not count against its new ones
            await self._release(a.device, instance)
            weights = _weights_of(self.node, function, needs, revision, self.backend, self._same_pids)
            ok, reserved, why = await self._reserve(a.device, spec, weights)
            if not ok:
                _ok, old_reserved, _why = await self._reserve(a.device, a.spec, a.weights)
                a.reserved = old_reserved
                self._attached[instance] = a
                log.info("GPU share not retargeted: no room for the function's needs", instance=instance,
                         function=function, gpu=a.device.index, reason=why)
                return False
            mgr.remove(instance)
            lc = self._lc_requests(a.device, besides=target)
            threads = old_threads if keep and old_threads is not None else mgr.mps_threads(spec, lc_requests=lc)
            a.control.write(mgr.initial_quota(spec, lc_requests=lc))
            mgr.add(spec, a.control, a.stats, mps_threads=threads)
            if a.attachment.mps_client and not keep:
                a.attachment = self._attachment(a.device, a.files, spec, mps_threads=threads)
            a.spec, a.reserved, a.capped = spec, reserved, True
            self._attached[target] = a
        log.info("GPU share retargeted", instance=target, was=instance, function=function, gpu=a.device.index,
                 request=spec.request, limit=spec.limit, memory_mb=spec.memory_mb)
        a.weights = weights
        return True

    def mps_cap(self, function: str, needs: GpuNeeds, gpu_index: int | None = None) -> float | None:
        """The MPS thread cap (active-thread fraction) an instance of ``function`` with ``needs`` would
        connect with if it started now on GPU ``gpu_index`` (None: the first GPU under MPS) — what a
        pre-loaded container that made its CUDA context must have for ``retarget`` to give it to the
        function. None where that GPU is not under MPS (or not on this node) or the needs are not valid."""
        if self.mps is None:
            return None
        devices = [d for d in self.devices if self.mps.enabled(d.index)
                   and (gpu_index is None or d.index == gpu_index)]
        if not devices:
            return None
        device = devices[0]
        probe = f"{function}#cap"
        try:
            spec = _spec_of(probe, function, needs)
        except ValueError:
            return None
        mgr = self._managers[device.uuid]
        return mgr.mps_threads(spec, lc_requests=self._lc_requests(device, besides=probe))

    async def keep_weights(self, instance: str) -> str | None:
        """Staged exit: release an attached instance's compute but keep its shared weights on the GPU — its
        SM request and limit go to 0, its reservation to the weights alone (``gpu-weights-mb``, counted once
        with the other instances of its function revision there), and the manager stops steering it — until
        `detach`. The next instance of the revision on the GPU then needs only the rest of its memory and
        maps the weights from the kept process. Returns the id the kept weights are attached and reserved
        under from then on (``<instance>-kept``: whoever placed the instance may release its reservation),
        for `detach`; None, changing nothing, when the instance shares no weights here (no revision or
        `gpu-weights-mb`, or instances that cannot map each other, see `_weights_of`)."""
        a = self._attached.get(instance)
        new_id = f"{instance}-kept"
        if a is None or a.weights is None or a.kept or new_id in self._attached:
            return None
        group, weights_mb = a.weights
        try:
            kept = InstanceSpec(id=new_id, function=a.spec.function, cls=InstanceClass.TRAINING, request=0.0,
                                limit=0.0, memory_mb=weights_mb)
        except ValueError:
            return None
        async with self._admit_lock:
            del self._attached[instance]
            await self._release(a.device, instance)
            ok, reserved, why = await self._reserve(a.device, kept, a.weights, kept=True)
            if not ok:  # the weights alone must fit where the whole instance did; put it back if not
                _ok, a.reserved, _why = await self._reserve(a.device, a.spec, a.weights)
                self._attached[instance] = a
                log.warning("weights not kept: the GPU budget refused them", instance=instance, reason=why)
                return None
            self._managers[a.device.uuid].remove(instance)
            a.spec, a.reserved, a.kept = kept, reserved, True
            self._attached[new_id] = a
        log.info("GPU compute released, weights kept", instance=new_id, was=instance, function=kept.function,
                 gpu=a.device.index, weights_mb=weights_mb, group=group)
        return new_id

    def attachment_of(self, instance: str) -> GpuAttachment | None:
        """What an attached instance was given (after a retarget: its new MPS cap among it)."""
        a = self._attached.get(instance)
        return a.attachment if a is not None else None

    async def detach(self, instance: str) -> None:
        a = self._attached.pop(instance, None)
        if a is None:
            return
        if not a.kept:
            self._managers[a.device.uuid].remove(instance)
        a.control.close()
        a.stats.close()
        await asyncio.to_thread(shutil.rmtree, a.files.directory, True)
        async with self._admit_lock:  # not in the middle of a re-sync that still counts it as live
            await self._release(a.device, instance)
        log.info("GPU detached", instance=instance, gpu=a.device.index)

    def pin(self, instance: str, share: float | None) -> None:
        """Fix an instance's share (static placement strategies); None gives it back to the policy."""
        a = self._attached[instance]
        self._managers[a.device.uuid].pin(instance, share)

    def set_slo(self, instance: str, slo_ms: float | None) -> None:
        """An SLO learnt after the instance started (the benchmarks: 2 × the measured solo p99)."""
        a = self._attached[instance]
        self._managers[a.device.uuid].set_slo(instance, slo_ms)

    def watch_load(self, instance: str, reader: Callable[[], LoadReading] | None) -> bool:
        """Let the instance's GPU manager read its queue from the invoker every period (``reader``, e.g.
        `InstanceLoad.read`; None: stop); False when the instance is not attached."""
        a = self._attached.get(instance)
        if a is None:
            return False
        self._managers[a.device.uuid].watch_load(instance, reader)
        return True

    def set_capacity(self, instance: str, blocks_per_ms: float | None) -> None:
        """A capacity measured after the instance started (the profiler); None: the online estimate."""
        a = self._attached[instance]
        self._managers[a.device.uuid].set_capacity(instance, blocks_per_ms)

    def _attachment(self, device: GpuDevice, files: abi.InstanceFiles, spec: InstanceSpec, *,
                    mps_threads: float | None = None) -> GpuAttachment:
        env: dict[str, str] = {"DILU_GPU_UUID": device.uuid}
        mounts: tuple[GpuMount, ...] = ()
        threads = spec.limit if mps_threads is None else mps_threads
        client = (self.mps.client(device.index, threads, backend=self.backend,
                                  best_effort=not spec.cls.latency_critical)
                  if self.mps is not None else None)
        if client is not None:
            # An MPS client of the GPU's daemon; its spatial cap (active threads) is what the policy chose for
            # its start (`GpuManager.mps_threads`: its SM limit, a best-effort one lower under `slo`), and a
            # best-effort one runs at below-normal priority; both fixed when it connects. The docker backend
            # shares the host's IPC namespace for it.
            env.update(client.env)
            mounts += tuple(GpuMount(src, dst, ro) for src, dst, ro in client.mounts)
        devices: tuple[str, ...] = ()
        if self.backend == "docker":
            if self._shim is not None:
                cc = shim.container_config(control_path=files.control, stats_path=files.stats, library=self._shim)
                env.update(cc.env)
                mounts += tuple(GpuMount(str(m.source), m.target, m.read_only) for m in cc.mounts)
            if self.docker_gpu_mode == "devices":
                devices = device.device_nodes
                env["CUDA_VISIBLE_DEVICES"] = device.uuid
        else:
            # NVML numbers GPUs by PCI bus; CUDA only does so when told.
            env.update({"CUDA_VISIBLE_DEVICES": str(device.index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
            if self._shim is not None:
                env.update(shim.process_env(control_path=files.control, stats_path=files.stats,
                                            library=self._shim, base_env={}))
                # No bind mounts for a host process: these tell its sandbox what it may read (the control
                # block, the shim) and write (its stats block).
                mounts = (GpuMount(str(files.control), str(files.control), True),
                          GpuMount(str(files.stats), str(files.stats), False),
                          GpuMount(str(self._shim), str(self._shim), True))
        return GpuAttachment(env=env, mounts=mounts, devices=devices, gpu_index=device.index, uuid=device.uuid)

    # -- admission ---------------------------------------------------------------------------------

    async def _admit(self, spec: InstanceSpec, gpu_index: int | None,
                     weights: _Weights = None) -> tuple[GpuDevice | None, bool, str]:
        tried: set[str] = set()
        reasons: list[str] = []
        preferred = None
        if gpu_index is not None:
            preferred = next((d for d in self.devices if d.index == gpu_index), None)
            if preferred is None:
                reasons.append(f"GPU {gpu_index} is not on this node")
        for _ in range(len(self.devices) + 1):
            device: GpuDevice | None
            if preferred is not None and preferred.uuid not in tried:
                device, why = preferred, f"GPU {preferred.index} chosen by the balancer"
            else:
                device, why = self._place(spec, avoid=tried, weights=weights)
            if device is None:
                reasons.append(why)
                break
            tried.add(device.uuid)
            ok, reserved, detail = await self._reserve(device, spec, weights)
            if ok:
                if reasons:
                    why += f" (after: {'; '.join(reasons)})"
                return device, reserved, why
            reasons.append(f"GPU {device.index}: {detail}")
        return None, False, "; ".join(reasons) or "no GPU fits"

    def _placed_on(self, device: GpuDevice) -> list[PlacedInstance]:
        """What this node believes is on ``device``: its own instances plus other invokers' reservations,
        each with the memory it is charged (a function revision's shared weights once)."""
        others = []
        known = self._known.get(device.uuid)
        if known is not None:
            for r in known.reservations.values():
                if r.invoker != self.node and r.instance not in self._attached:
                    others.append((r.sharing_key, r.shares_weights, PlacedInstance(
                        id=r.instance, function=r.function or "?", cls=_parse_class(r.cls), request=r.request,
                        limit=max(r.limit, r.request), memory_mib=float(r.memory_mb))))
        # weights another invoker's reservation carries: Redis charges them already
        carried = {key for key, shares, _ in others if key is not None and not shares}
        own = []
        for a in sorted((a for a in self._attached.values() if a.device.uuid == device.uuid),
                        key=lambda a: a.spec.id):
            memory = a.spec.memory_mb
            if a.weights is not None:
                if a.weights in carried:
                    memory -= a.weights[1]
                carried.add(a.weights)
            own.append(PlacedInstance(id=a.spec.id, function=a.spec.function, cls=a.spec.cls,
                                      request=_budgeted(a.spec)[0], limit=_budgeted(a.spec)[1],
                                      memory_mib=float(memory)))
        return own + [p for _, _, p in others]

    def _weights_held(self, device: GpuDevice, weights: _Weights) -> bool:
        """Some instance on ``device`` (this node's, or another's as last read) counts ``weights`` already."""
        if weights is None:
            return False
        if any(a.weights == weights for a in self._attached.values() if a.device.uuid == device.uuid):
            return True
        known = self._known.get(device.uuid)
        return known is not None and any(r.sharing_key == weights for r in known.reservations.values()
                                         if r.invoker != self.node and r.instance not in self._attached)

    def _place(self, spec: InstanceSpec, *, avoid: set[str],
               weights: _Weights = None) -> tuple[GpuDevice | None, str]:
        states = [
            GpuState(ref=GpuRef(self.node, d.index), memory_mib=float(max(d.memory_mb, 1)), uuid=d.uuid,
                     sm_count=d.sm_count, instances=tuple(self._placed_on(d)))
            for d in self.devices
        ]
        snapshot = ClusterSnapshot.build(now=0.0, gpus=states)
        config = PlacementConfig(omega=self.omega, gamma=max(self.gamma, self.omega))

        def ask(memory_mb: int, avoided: set[str]) -> tuple[GpuDevice | None, str]:
            request = PlacementRequest(
                instance_id=spec.id, function=spec.function, cls=spec.cls, request=spec.request, limit=spec.limit,
                memory_mib=float(memory_mb),
                avoid_gpus=frozenset(GpuRef(self.node, d.index) for d in self.devices if d.uuid in avoided),
            )
            decision = place(snapshot, request, config)
            if not decision.placed:
                return None, f"placement: {decision.reason}"
            index = decision.gpus[0].gpu
            return next(d for d in self.devices if d.index == index), f"placement: {decision.reason}"

        if weights is not None:
            # The GPUs that hold its revision's weights first: there it needs only the rest, and it maps the
            # weights in milliseconds instead of loading a copy (another GPU is lit only when none takes it).
            holding = {d.uuid for d in self.devices if d.uuid not in avoid and self._weights_held(d, weights)}
            if holding:
                device, why = ask(spec.memory_mb - weights[1], {d.uuid for d in self.devices} - holding)
                if device is not None:
                    return device, f"{why} (its {weights[1]} MB of weights shared there)"
        return ask(spec.memory_mb, avoid)

    def _fits_locally(self, device: GpuDevice, spec: InstanceSpec, weights: _Weights = None) -> tuple[bool, str]:
        placed = self._placed_on(device)
        req = sum(p.request for p in placed) + _budgeted(spec)[0]
        lim = sum(p.limit for p in placed) + _budgeted(spec)[1]
        mem = sum(p.memory_mib for p in placed) + spec.memory_mb
        if weights is not None and self._weights_held(device, weights):
            mem -= weights[1]
        if req > self.omega + EPS:
            return False, f"SM requests would reach {req:.3f} > {self.omega:.3f} (local view)"
        if lim > self.gamma + EPS:
            return False, f"SM limits would reach {lim:.3f} > gamma {self.gamma:.3f} (local view)"
        if mem > device.memory_mb:
            return False, f"memory would reach {mem:.0f} MB > {device.memory_mb} MB (local view)"
        return True, "admitted against the local view"

    async def _reserve(self, device: GpuDevice, spec: InstanceSpec,
                       weights: _Weights = None, *, kept: bool = False) -> tuple[bool, bool, str]:
        """(admitted, held in Redis, detail). ``kept``: a kept process's weights (evictable, see `keep_weights`)."""
        budgets = self._budgets
        if budgets is None or not self._redis_ok:
            ok, why = self._fits_locally(device, spec, weights)
            return ok, False, why + ("" if budgets is None else " (Redis unreachable)")
        reservation = self._reservation(spec, weights, kept=kept)
        for _ in range(2):
            result = await self._call("reserve", partial(budgets.reserve, device.uuid, reservation, ttl_s=self.ttl_s))
            if isinstance(result, _Failed):
                ok, why = self._fits_locally(device, spec, weights)
                return ok, False, why + " (Redis unreachable)"
            if result.ok or result.reason != "unknown GPU":
                return result.ok, result.ok, result.reason
            # Redis lost the GPU (a restart without persistence): register it again and retry.
            self._needs_sync = True
            if isinstance(await self._call("register", partial(self._register, device)), _Failed):
                ok, why = self._fits_locally(device, spec, weights)
                return ok, False, why + " (Redis unreachable)"
        return False, False, "the GPU could not be registered in Redis"

    async def _release(self, device: GpuDevice, instance: str) -> None:
        budgets = self._budgets
        if budgets is None or not self._redis_ok:
            return  # the next re-sync drops reservations of instances that are gone
        await self._call("release", partial(budgets.release, device.uuid, instance))

    def _reservation(self, spec: InstanceSpec, weights: _Weights = None, *, kept: bool = False) -> Reservation:
        from dilu_invoker.gpu.budgets import Reservation

        request, limit = _budgeted(spec)
        group, weights_mb = weights if weights is not None else ("", 0)
        return Reservation(instance=spec.id, function=spec.function, cls=spec.cls.value, invoker=self.node,
                           request=request, limit=limit, memory_mb=spec.memory_mb, weights_mb=weights_mb,
                           group=group, kept=kept)

    # -- Redis -------------------------------------------------------------------------------------

    async def _call(self, what: str, factory: Callable[[], Awaitable[T]]) -> T | _Failed:
        try:
            result = await asyncio.wait_for(factory(), self.redis_timeout_s)
        except asyncio.CancelledError:
            raise
        except (_RedisError, OSError, TimeoutError) as exc:
            if self._redis_ok:
                log.warning("Redis unreachable: admitting against this node's last-known view, shares keep "
                            "being enforced", operation=what, error=repr(exc))
            self._redis_ok = False
            self._needs_sync = True
            self._wake_sync.set()
            return _FAILED
        if not self._redis_ok:
            log.info("Redis reachable again; re-syncing GPU budgets", operation=what)
            self._redis_ok = True
            self._wake_sync.set()
        return result

    async def _register(self, device: GpuDevice) -> None:
        from dilu_invoker.gpu.budgets import GpuCapacity

        assert self._budgets is not None
        await self._budgets.register_gpu(device.uuid, GpuCapacity(
            node=self.node, index=device.index, name=device.name, memory_mb=device.memory_mb,
            sm_count=device.sm_count, gamma=self.gamma, omega=self.omega))

    async def _publish(self, uuid: str, shares: Mapping[str, float]) -> None:
        budgets = self._budgets
        if budgets is None or not self._redis_ok or self._needs_sync:
            return  # the re-sync publishes them; no pile of failing calls meanwhile
        await self._call("set shares", partial(budgets.set_shares, uuid, shares))

    async def _sync_loop(self) -> None:
        while True:
            period = min(self.sync_period_s, 1.0) if self._needs_sync else self.sync_period_s
            with contextlib.suppress(TimeoutError):  # (not wait_for, which can swallow a cancellation: service._sleep)
                async with asyncio.timeout(period):
                    await self._wake_sync.wait()
            self._wake_sync.clear()
            try:
                await self._sync_once()
            except Exception:
                log.exception("GPU budget sync failed; retrying")
                self._needs_sync = True

    async def _sync_once(self) -> None:
        """Renew the leases, or re-sync everything after an outage or a lost reservation."""
        budgets = self._budgets
        if budgets is None:
            return
        if not self._needs_sync:
            for d in self.devices:
                ids = [a.spec.id for a in self._attached.values() if a.device.uuid == d.uuid]
                if not ids:
                    continue
                renewed = await self._call("renew", partial(budgets.renew, d.uuid, ids, ttl_s=self.ttl_s))
                if isinstance(renewed, _Failed):
                    return
                if renewed < len(ids):
                    log.warning("GPU reservations were lost (expired or Redis restarted); re-syncing",
                                gpu=d.index, held=len(ids), renewed=renewed)
                    self._needs_sync = True
        if self._needs_sync:
            # Attach and detach wait meanwhile: the set of live instances must not change under the reconcile.
            async with self._admit_lock:
                synced = await self._resync(budgets)
            if not synced:
                return
        for d in self.devices:
            got = await self._call("read budget", partial(budgets.get, d.uuid))
            if isinstance(got, _Failed):
                return
            if got is not None:
                self._known[d.uuid] = got

    async def _resync(self, budgets: GpuBudgets) -> bool:
        """Register every GPU and make Redis agree with the instances attached here (GpuBudgets.reconcile)."""
        summary: dict[int, tuple[int, int]] = {}
        for d in self.devices:
            if isinstance(await self._call("register", partial(self._register, d)), _Failed):
                return False
            live = {a.spec.id: self._reservation(a.spec, a.weights, kept=a.kept) for a in self._attached.values()
                    if a.device.uuid == d.uuid}
            done = await self._call("reconcile", partial(budgets.reconcile, d.uuid, invoker=self.node, live=live,
                                                         ttl_s=self.ttl_s))
            if isinstance(done, _Failed):
                return False
            summary[d.index] = done
            shares = {st.id: st.share for _, st in self._managers[d.uuid].statuses() if st is not None}
            if shares and isinstance(await self._call("set shares", partial(budgets.set_shares, d.uuid, shares)),
                                     _Failed):
                return False
        for a in self._attached.values():
            a.reserved = True
        self._needs_sync = False
        log.info("GPU budgets in sync with Redis", node=self.node,
                 dropped={i: s[0] for i, s in summary.items() if s[0]},
                 restored={i: s[1] for i, s in summary.items() if s[1]})
        return True


def _spec_of(instance: str, function: str, needs: GpuNeeds) -> InstanceSpec:
    """The manager's view of an instance of ``function`` with ``needs`` (ValueError when they are invalid)."""
    return InstanceSpec(id=instance, function=function, cls=InstanceClass(needs.gpu_class.value),
                        request=needs.sm_request, limit=needs.sm_limit, memory_mb=needs.memory_mb,
                        slo_ms=needs.slo_ms, capacity_blocks_per_ms=needs.capacity_blocks_per_ms)


def _budgeted(spec: InstanceSpec) -> tuple[float, float]:
    """The SM request and limit an instance holds in the GPU's budget: a pre-loaded container's placeholder
    holds none (it launches nothing; the shim still gives it its small share), so it never keeps a placed
    instance off the GPU (Σ limit 0.8 + 0.05 + 0.7 > γ 1.5 refused a training instance beside inference)."""
    if spec.function.startswith(PRELOAD_FUNCTION_PREFIX):
        return 0.0, 0.0
    return spec.request, spec.limit


def _parse_class(value: str) -> InstanceClass:
    try:
        return InstanceClass.parse(value)
    except ValueError:
        return InstanceClass.INFERENCE

