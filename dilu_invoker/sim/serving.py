"""Serving simulation: a request-level discrete-event simulation of functions on a GPU cluster.

The decisions are the live ones, imported: placement (`place` with each policy's strategy),
horizontal scaling (`decide_scale`, every policy, once per second per function) and, for `dilu`,
the vertical share policy (`decide_vertical`). The simulator supplies time and a performance model
(docs/simulator.md, "Performance model"):

* A function's instance serves batches of up to its profiled batch size from one FIFO queue per
  function (join-the-idle-queue routing). A batch of b at effective SM share s takes the profile's
  latency L(s, b); its progress is tracked as a fraction, so a change of share mid-batch stretches or
  shrinks the rest of it (processor sharing).
* Spatial sharing (`dilu`, `mps-static`): a busy instance runs at its cap, of which it can use
  u = min(cap, sat(b)), where sat(b) is the smallest share within 1% of the batch's full-GPU speed (a
  batch of 1 cannot fill an H200). When Σu > 1 on a GPU, every busy instance runs at u/Σu
  (proportional sharing of SM time).
  Co-location costs a slowdown of 1 + κ·(Σ of the other busy instances' effective shares), κ =
  `interference` (memory bandwidth and caches are shared even when SMs are not).
* Temporal sharing (`static-quota`): time slices, no concurrency: an instance runs at full-GPU
  speed for its quota (its limit) of the time, so a batch takes L(1, b) / limit, busy or not its
  neighbours (a fixed quota is not work-conserving).
* Priority (`tgs`): the production (latency-critical) instance runs at full-GPU speed, slowed by
  `tgs_production_slowdown` while the opportunistic one runs; the opportunistic (training) instance
  gets `tgs_opportunistic_share` of full speed while production has a batch in flight, all of it
  otherwise (TGS's rate control keeps production within a few percent of its solo speed).
* `exclusive`: one instance per GPU at full speed, no interference.
* Training jobs are fluid: samples accrue at the profile's throughput for their effective share;
  a training instance is always busy while it runs.
* Cold start: an instance occupies its GPU (lit, reserved) from the decision and serves after
  `cold_start_s`. Requests that wait longer than `timeout_s` are dropped (an SLO violation).
* Pre-loading (the invoker's `--preload N`, docs/invoker.md): each node keeps `preload_per_node`
  pre-loaded processes (libraries imported, CUDA context made). An instance started on a node with
  one available serves after `preloaded_start_s` instead (the measured 0.30–0.35 s with the first
  inference: MEASURED_PRELOADED_START_S), and that slot is refilled `preload_refill_s` later (a fresh
  process's floor, MEASURED_COLD_START_S). Their host memory and the CUDA context's GPU memory are
  not modelled (a few hundred MiB per process, small beside an 80 GiB GPU).
* Compaction (`dilu` by default, as the live balancer; `compaction_period_s`): the live balancer's
  (docs/balancer.md, "Compaction"),
  run at the end of a scaling tick at most every period and never while a move is in flight. The
  instances of functions that are not calm (`policy.live_compaction.function_calm` on the tick's load), not ready,
  or training are pinned; each move of `compaction_plan` starts a replacement on the target GPU that
  occupies it from the decision and serves after its start; then the original leaves routing and is
  removed once its batch in flight is done. A replacement is not an instance for the scaler until
  its move is done (or its original is gone).

Vertical re-decisions are event-driven, not every 50 ms: a GPU's shares are recomputed when its set
of instances changes, when an idle latency-critical instance becomes active (at most once per 50 ms),
and every `vertical_period_s` while the GPU holds both latency-critical and best-effort instances or
has cut a latency-critical instance below its limit. A GPU without best-effort instances has no
feedback state that matters (the policy's output is a function of which instances are active), so its
decisions are memoised per active set.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionState,
    FunctionLoad,
    HorizontalConfig,
    HorizontalState,
    PlacementConfig,
    PlacementRequest,
    ScaleAction,
    VerticalInstance,
    VerticalSnapshot,
    apply_placement,
    cluster_fragmentation,
    compaction_plan,
    decide_scale,
    place,
)
from dilu_invoker.policy.live_compaction import LiveCompaction, function_calm, live_compaction_config
from dilu_invoker.policy.types import GpuRef, PlacedInstance
from dilu_invoker.policy.vertical_slo import AnyVerticalConfig, SloConfig, SloState, decide_vertical, initial_state
from dilu_invoker.sim.events import GIB
from dilu_invoker.sim.profiles import FunctionProfile, ProfileSet
from dilu_invoker.sim.traces import ServingTrace, arrivals

SERVING_POLICIES: tuple[str, ...] = ("exclusive", "mps-static", "static-quota", "tgs", "dilu")

#: Serving policy -> (placement strategy, how shares run).
POLICY_SPEC: dict[str, tuple[str, str]] = {
    "exclusive": ("exclusive", "exclusive"),
    "mps-static": ("infless-r", "spatial"),
    "static-quota": ("infless-l", "temporal"),
    "tgs": ("tgs", "priority"),
    "dilu": ("dilu", "dynamic"),
}

SERVING_TIMESERIES_COLUMNS: tuple[str, ...] = (
    "t",
    "lit_gpus",
    "instances",
    "arrivals",
    "completed",
    "violations",
    "violation_rate",
    "sm_fragmentation",
    "mem_fragmentation",
    "training_samples_per_s",
)

#: measured on the H200 (issue 18): a fresh process's cold-start floor (Python + torch/torchvision import,
#: CUDA context, building ResNet-50, the first inference) 3.9–4.5 s; with a pre-loaded process ~0.30–0.35 s
MEASURED_COLD_START_S = 4.2
MEASURED_PRELOADED_START_S = 0.33

SUMMARY_KEYS: tuple[str, ...] = (
    "policy",
    "requests",
    "completed",
    "dropped",
    "throughput",
    "throughput_per_gpu",
    "slo_violation_rate",
    "latency_p50_ms",
    "latency_p99_ms",
    "cold_starts",
    "gpus_peak",
    "gpu_seconds",
    "sm_fragmentation_mean",
    "mem_fragmentation_mean",
    "training_samples",
    "training_samples_per_s",
    "compaction_moves",
)

_SHARE_STEPS = 100  # speed tables on a 0.01 share grid
_ACTIVATION_DEBOUNCE_S = 0.05  # the live manager's period
_SATURATED_BUSY = 0.9  # busy this fraction of a tick: no headroom left (for `instances_at_limit`)

# event kinds (ordered only by time and sequence)
_DONE, _ARRIVE, _READY, _TICK, _VERTICAL, _TRAIN_START, _TRAIN_END = range(7)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingSimConfig:
    policy: str
    gpus: int
    gpus_per_node: int = 4
    gpu_memory_gib: float = 80.0
    cold_start_s: float = 5.0
    preload_per_node: int = 0
    preloaded_start_s: float = MEASURED_PRELOADED_START_S
    preload_refill_s: float = MEASURED_COLD_START_S
    timeout_s: float = 30.0
    interference: float = 0.1
    interference_training: float | None = None
    """κ for training (best-effort) instances; None: `interference`. The H200 matrix measures training
    beside inference no slower than alone (docs/benchmarks/colocation-fit.md: training κ ≈ 0)."""
    vertical_period_s: float = 0.5
    sample_every_s: float = 60.0
    seed: int = 1
    gamma: float = math.inf
    """dilu's Σ-limit bound γ per GPU; the default, none: admission by request (PlacementConfig.gamma)."""
    tgs_opportunistic_share: float = 0.05
    tgs_production_slowdown: float = 0.03
    horizontal: HorizontalConfig = field(default_factory=HorizontalConfig)
    vertical: AnyVerticalConfig = field(default_factory=SloConfig)
    """The vertical policy's configuration; its type selects the policy (`SloConfig`: `slo`)."""
    placement: PlacementConfig | None = None
    """A what-if: this placement configuration (strategy, ω, γ, scorer weights) instead of the policy's
    strategy with `gamma`; the policy still decides how shares run and how instances are sized."""
    capacity_share: str | None = None
    """A what-if: size instances for horizontal scaling at their `request` or `limit` share instead of the
    policy's own rule (`dilu`: the limit; `mps-static`: the request)."""
    compaction_period_s: float | None = None
    """Live compaction (`--balancer-compaction-period-s`): at most one run this often, none while a move is
    in flight. None: the live balancer's default for `dilu` (on, every `LiveCompaction.period_s`, 30 s),
    none for the baselines; 0: none."""
    compaction_max_moves: int = 2
    """Moves one compaction run may start, each a replacement's start (`--balancer-compaction-max-moves`);
    the rest is `policy.live_compaction.LIVE_COMPACTION`, but for the next four."""
    compaction_max_request: float = 0.5
    """Compaction empties only GPUs whose Σ SM request is at most this (`--balancer-compaction-max-request`)."""
    compaction_merges: int = 0
    """Moves a compaction run may spend merging SM room no instance can use (`--balancer-compaction-merges`)."""
    compaction_memory_merges: int = 0
    """Moves a compaction run may spend merging free memory no instance can use, where memory binds
    (`--balancer-compaction-memory-merges`)."""
    compaction_repacks: int = 0
    """Lit GPUs a compaction run may try to turn off by re-packing them, make-before-break
    (`--balancer-compaction-repacks`)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICY_SPEC:
            raise ValueError(f"unknown serving policy {self.policy!r}; known: {list(SERVING_POLICIES)}")
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("need at least one GPU and one GPU per node")
        for name in ("gpu_memory_gib", "timeout_s", "vertical_period_s", "sample_every_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if self.preload_per_node < 0:
            raise ValueError(f"preload_per_node must be >= 0, got {self.preload_per_node!r}")
        if self.interference_training is not None and not (
            math.isfinite(self.interference_training) and self.interference_training >= 0
        ):
            raise ValueError(f"interference_training must be >= 0, got {self.interference_training!r}")
        for name in ("cold_start_s", "interference", "preloaded_start_s", "preload_refill_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be >= 0, got {v!r}")
        if not 0 <= self.tgs_opportunistic_share <= 1 or not 0 <= self.tgs_production_slowdown < 1:
            raise ValueError("tgs shares must be fractions")
        if self.capacity_share not in (None, "request", "limit"):
            raise ValueError(f"capacity_share must be 'request' or 'limit', got {self.capacity_share!r}")
        if self.compaction_period_s is not None and not (
            math.isfinite(self.compaction_period_s) and self.compaction_period_s >= 0
        ):
            raise ValueError(f"compaction_period_s must be >= 0, got {self.compaction_period_s!r}")
        if self.compaction_max_moves < 1:
            raise ValueError(f"compaction_max_moves must be >= 1, got {self.compaction_max_moves!r}")
        if not 0.0 <= self.compaction_max_request <= 1.0:
            raise ValueError(f"compaction_max_request must be between 0 and 1, got {self.compaction_max_request!r}")
        if self.compaction_merges < 0:
            raise ValueError(f"compaction_merges must be >= 0, got {self.compaction_merges!r}")
        if self.compaction_memory_merges < 0:
            raise ValueError(f"compaction_memory_merges must be >= 0, got {self.compaction_memory_merges!r}")
        if self.compaction_repacks < 0:
            raise ValueError(f"compaction_repacks must be >= 0, got {self.compaction_repacks!r}")

    def live_compaction(self) -> LiveCompaction | None:
        """The balancer's compaction with these settings; None when off."""
        period = self.compaction_period_s
        if period is None:
            period = LiveCompaction().period_s if self.policy == "dilu" else 0.0
        if period <= 0:
            return None
        return LiveCompaction(config=live_compaction_config(max_moves=self.compaction_max_moves,
                                                            max_request=self.compaction_max_request,
                                                            merges=self.compaction_merges,
                                                            memory_merges=self.compaction_memory_merges,
                                                            repacks=self.compaction_repacks),
                              period_s=period)


@dataclass(frozen=True, slots=True)
class ServingResult:
    summary: dict[str, Any]
    functions: dict[str, Any]
    """Per function: requests, completed, violations, p50/p99, instances started, profile."""
    samples: list[tuple[float, ...]]
    details: dict[str, Any]


# -- runtime objects (plain slotted classes: this is the hot path) ---------------------------------


class _Fn:
    __slots__ = (
        "active",
        "arr",
        "batch",
        "blocked_until",
        "calm",
        "capacity",
        "cls",
        "completed",
        "dropped",
        "head",
        "hstate",
        "idle",
        "instances",
        "lat",
        "limit",
        "memory_mib",
        "n",
        "name",
        "norm",
        "prof",
        "request",
        "sat",
        "slo_ms",
        "speed",
        "started",
        "starting",
        "violations",
        "wake",
    )  # fmt: skip

    def __init__(self, name: str, prof: FunctionProfile, slo_ms: float | None, arr: np.ndarray) -> None:
        self.name = name
        self.prof = prof
        self.slo_ms = slo_ms
        rec = prof.recommended
        self.batch = rec.batch
        self.request = rec.request
        self.limit = rec.limit
        self.memory_mib = prof.memory_mib
        self.cls = prof.cls
        self.arr = arr
        self.n = len(arr)
        self.head = 0
        self.lat = np.full(self.n, np.nan, dtype=np.float32)
        # speed[b][k]: batches per second of a batch of b at share k/100; sat[b]: useful share.
        self.speed: list[list[float]] = [[0.0]]
        self.sat: list[float] = [1.0]
        for b in range(1, self.batch + 1):
            row = [0.0] + [1000.0 / prof.latency_ms(k / _SHARE_STEPS, b) for k in range(1, _SHARE_STEPS + 1)]
            self.speed.append(row)
            self.sat.append(prof.saturation_share(b, within=0.01))
        # The policy normalises cycles of b requests to cycles of one (see _Gpu cycles).
        self.norm = [0.0] + [self.speed[b][_SHARE_STEPS] / self.speed[1][_SHARE_STEPS] for b in range(1, self.batch + 1)]
        self.capacity = 0.0
        self.instances: list[_Inst] = []
        self.idle: list[_Inst] = []
        self.starting = 0
        self.hstate = HorizontalState()
        self.wake = False
        self.active = False
        self.started = 0
        self.violations = 0
        self.completed = 0
        self.dropped = 0
        self.blocked_until = -math.inf
        self.calm = False  # compaction may move its instances (set every tick while compaction is on)


class _Inst:
    __slots__ = (
        "a",
        "b",
        "busy_acc",
        "busy_since",
        "cap",
        "cls",
        "cycles",
        "fn",
        "gpu",
        "id",
        "last_end",
        "limit",
        "moved_to",
        "rate",
        "ready_at",
        "replaces",
        "request",
        "samples",
        "share_eff",
        "start_t",
        "state",
        "t_rate",
        "tb",
        "training",
        "version",
        "work",
    )  # fmt: skip

    def __init__(self, iid: str, fn: _Fn, gpu: _Gpu, cap: float, training: bool) -> None:
        self.id = iid
        self.fn = fn
        self.gpu = gpu
        self.cls = fn.cls
        self.request = fn.request
        self.limit = fn.limit
        self.cap = cap
        self.state = "starting"
        self.training = training
        self.a = 0  # first request index of the batch in flight
        self.b = 0  # its size (0: idle)
        self.work = 0.0  # fraction of the batch done
        self.rate = 0.0  # batches (training: samples) per second now
        self.t_rate = 0.0  # when `rate` took effect
        self.version = 0
        self.start_t = 0.0
        self.last_end = -math.inf
        self.busy_acc = 0.0
        self.busy_since = 0.0
        self.cycles: list[float] = []
        self.share_eff = 0.0
        self.samples = 0.0
        self.tb = fn.batch
        self.ready_at = 0.0
        self.replaces: _Inst | None = None  # a compaction replacement in flight: the instance it takes over
        self.moved_to: _Inst | None = None  # the replacement taking this instance over


class _Gpu:
    __slots__ = ("busy", "insts", "last_v", "memo", "n_be", "name", "ordinal", "v_pending", "v_periodic", "vstate")

    def __init__(self, ordinal: int, name: str) -> None:
        self.ordinal = ordinal
        self.name = name
        self.insts: list[_Inst] = []
        self.busy: list[_Inst] = []
        self.vstate: SloState | None = None  # the policy's state; None: its initial state
        self.memo: dict[tuple[str, ...], dict[str, float]] = {}
        self.last_v = -math.inf
        self.v_pending = False
        self.v_periodic = False
        self.n_be = 0


# -- the simulation ------------------------------------------------------------------------------


class _Sim:
    def __init__(self, trace: ServingTrace, profiles: ProfileSet, config: ServingSimConfig) -> None:
        self.cfg = config
        self.trace = trace
        strategy, self.mode = POLICY_SPEC[config.policy]
        self.pconf = config.placement or PlacementConfig(strategy=strategy, gamma=config.gamma)
        nodes = math.ceil(config.gpus / config.gpus_per_node)
        names = [f"node{i:03d}" for i in range(nodes)]
        cluster = ClusterSnapshot.uniform(
            invokers=names, gpus_per_invoker=config.gpus_per_node, memory_mib=config.gpu_memory_gib * GIB
        )
        if len(cluster) > config.gpus:
            # A last, partial node: mark the GPUs beyond the requested count as draining.
            for ref in cluster.refs[config.gpus :]:
                cluster = cluster.with_schedulable(ref, False)
        self.cluster = cluster
        self.gpus = [_Gpu(i, str(ref)) for i, ref in enumerate(cluster.refs)]
        rng = np.random.default_rng(config.seed)
        self.fns: list[_Fn] = []
        for ft in trace.functions:
            prof = profiles[ft.profile]
            fn = _Fn(ft.name, prof, ft.slo_ms if ft.slo_ms is not None else prof.slo_ms, arrivals(ft, rng))
            fn.capacity = self._capacity(fn)
            self.fns.append(fn)
        self.jobs = []
        for job in trace.jobs:
            prof = profiles[job.profile]
            fn = _Fn(job.name, prof, None, np.empty(0))
            self.jobs.append((job, fn))
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = 0
        self.now = 0.0
        self.inst_seq = 0
        self.active_fns: set[_Fn] = set()
        self.pending_jobs: list[tuple[Any, _Fn]] = []
        self.running_jobs: dict[str, _Inst] = {}
        self.cold_starts = 0
        self.preloaded_starts = 0
        #: per node, when each of its pre-loaded slots is (again) available
        self.preload_slots: list[list[float]] = [[0.0] * config.preload_per_node for _ in range(nodes)]
        self.placement_failures = 0
        self.vertical_calls = 0
        self.vertical_memo_hits = 0
        # accounting
        self.t_acct = 0.0
        self.lit_area = 0.0
        self.sm_area = 0.0
        self.mem_area = 0.0
        self.frag_time = 0.0
        self.peak = 0
        self.frag = cluster_fragmentation(cluster)
        self.samples: list[tuple[float, ...]] = []
        self.win = [0, 0, 0, 0.0]  # arrivals, completed, violations, training samples in this interval
        self.training_samples = 0.0
        # packing: ∫ over lit GPUs of (instances, Σ request, Σ limit, Σ memory fraction) dt, and per
        # placement that lit a GPU, the constraint the lit GPUs failed (or "score": one passed every check)
        self.pack_area = [0.0, 0.0, 0.0, 0.0]
        self.lit_by: dict[str, int] = {}
        # compaction (dilu by default, the baselines never; ServingSimConfig.live_compaction)
        self.compaction = config.live_compaction()
        # Its functions declare no gpu-stages (placement never splits here): nor does placement for compaction.
        self.compaction_pconf = replace(self.pconf, llm_max_parts=1)
        self.compaction_next = 0.0
        self.compaction_state: CompactionState | None = None
        self.moving: list[_Inst] = []  # replacements in flight
        self.compaction_runs = 0
        self.compaction_moves = 0
        self.compaction_done = 0
        self.compaction_drained = 0  # of those done, originals with a batch in flight at the take-over
        self.compaction_promoted = 0  # moves whose original the scaler removed first
        self.compaction_freed = 0

    # -- helpers ------------------------------------------------------------------------------

    def _capacity(self, fn: _Fn) -> float:
        """Requests/s one instance sustains at the share this policy runs it at (for scaling)."""
        b = fn.batch
        if self.cfg.capacity_share is not None:
            return fn.prof.throughput_rps(fn.request if self.cfg.capacity_share == "request" else fn.limit, b)
        if self.mode in ("exclusive", "priority"):
            return fn.prof.throughput_rps(1.0, b)
        if self.mode == "temporal":
            return fn.prof.throughput_rps(1.0, b) * fn.limit
        if self.mode == "spatial":
            return fn.prof.throughput_rps(fn.request, b)
        return fn.prof.throughput_rps(fn.limit, b)

    def _static_cap(self, fn: _Fn) -> float:
        if self.mode in ("exclusive", "priority"):
            return 1.0
        if self.mode == "temporal":
            return fn.limit
        if self.mode == "spatial":
            return fn.request
        # dilu: an idle latency-critical instance stands at its limit; training starts at its request.
        return fn.limit if fn.cls.latency_critical else fn.request

    def push(self, t: float, kind: int, obj: Any, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, version))

    def _account(self) -> None:
        dt = self.now - self.t_acct
        if dt > 0:
            end = min(self.now, self.trace.duration_s)
            span = max(0.0, end - self.t_acct)
            lit = self.cluster.lit_count
            self.lit_area += span * lit
            if lit and span > 0:
                area = self.pack_area
                for g in self.cluster.lit_gpus():
                    area[0] += span * len(g.instances)
                    area[1] += span * g.used_request
                    area[2] += span * g.used_limit
                    area[3] += span * g.used_memory / g.memory_mib
            if lit:
                self.sm_area += span * self.frag.sm_mean
                self.mem_area += span * self.frag.memory_mean
                self.frag_time += span
            self.t_acct = self.now

    def _cluster_changed(self) -> None:
        self.frag = cluster_fragmentation(self.cluster)
        self.peak = max(self.peak, self.cluster.lit_count)

    # -- speeds -------------------------------------------------------------------------------

    def _speed(self, fn: _Fn, b: int, share: float) -> float:
        b = min(b, fn.batch)
        x = share * _SHARE_STEPS
        if x >= _SHARE_STEPS:
            return fn.speed[b][_SHARE_STEPS]
        if x <= 0:
            return 0.0
        i = int(x)
        w = x - i
        row = fn.speed[b]
        if i == 0:
            return row[1] * w
        return row[i] * (1 - w) + row[i + 1] * w

    def _refresh(self, g: _Gpu) -> None:
        """Re-derive every busy instance's speed on `g` and reschedule its completion."""
        now = self.now
        busy = g.busy
        if not busy:
            return
        mode = self.mode
        kappa = self.cfg.interference
        kappa_t = kappa if self.cfg.interference_training is None else self.cfg.interference_training
        rates: list[float] = []
        if mode == "exclusive":
            for inst in busy:
                rates.append(self._speed(inst.fn, inst.b, 1.0))
                inst.share_eff = 1.0
        elif mode == "temporal":
            for inst in busy:
                rates.append(self._speed(inst.fn, inst.b, 1.0) * inst.cap)
                inst.share_eff = inst.cap
        elif mode == "priority":
            prod = any(i.cls.latency_critical for i in busy)
            opp = any(not i.cls.latency_critical for i in busy)
            for inst in busy:
                r = self._speed(inst.fn, inst.b, 1.0)
                if inst.cls.latency_critical:
                    if opp:
                        r *= 1.0 - self.cfg.tgs_production_slowdown
                    inst.share_eff = 1.0
                elif prod:
                    r *= self.cfg.tgs_opportunistic_share
                    inst.share_eff = self.cfg.tgs_opportunistic_share
                else:
                    inst.share_eff = 1.0
                rates.append(r)
        else:
            # What each busy batch can use of its cap; when that oversubscribes the GPU, SM time is
            # divided in proportion to it. Otherwise each runs at its cap.
            useful = [min(inst.cap, inst.fn.sat[inst.b]) for inst in busy]
            total = sum(useful)
            scale = 1.0 / total if total > 1.0 else 1.0
            used_total = total * scale
            for inst, u in zip(busy, useful, strict=True):
                used = u * scale
                s = used if scale < 1.0 else inst.cap
                inst.share_eff = used
                r = self._speed(inst.fn, inst.b, s)
                k = kappa_t if inst.training else kappa
                if k and len(busy) > 1:
                    r /= 1.0 + k * (used_total - used)
                rates.append(r)
        for inst, r in zip(busy, rates, strict=True):
            if inst.training:
                if inst.rate:
                    inst.samples += (now - inst.t_rate) * inst.rate
                inst.rate = r * inst.b  # samples per second (b = training batch)
                inst.t_rate = now
                continue
            if inst.rate:
                inst.work += (now - inst.t_rate) * inst.rate
            inst.rate = r
            inst.t_rate = now
            inst.version += 1
            left = max(0.0, 1.0 - inst.work)
            self.push(now + (left / r if r > 0 else 1e9), _DONE, inst, inst.version)

    # -- dispatch -----------------------------------------------------------------------------

    def _available(self, fn: _Fn) -> int:
        """Requests that have arrived and wait, after dropping those past the timeout."""
        now = self.now
        arr = fn.arr
        head = fn.head
        if head >= fn.n or arr[head] > now:
            return 0
        cutoff = now - self.cfg.timeout_s
        if arr[head] < cutoff:
            new_head = int(arr.searchsorted(cutoff, "left"))
            dropped = new_head - head
            fn.dropped += dropped
            fn.violations += dropped
            self.win[2] += dropped
            fn.head = head = new_head
        return int(arr.searchsorted(now, "right")) - head

    def _start_batch(self, inst: _Inst, k: int) -> None:
        fn = inst.fn
        g = inst.gpu
        inst.a = fn.head
        inst.b = k
        fn.head += k
        inst.work = 0.0
        inst.rate = 0.0
        inst.start_t = self.now
        inst.busy_since = self.now
        was_active = inst.state == "busy" or (self.now - inst.last_end) <= self.cfg.vertical.idle_after_s
        inst.state = "busy"
        g.busy.append(inst)
        if self.mode == "dynamic" and not was_active:
            self._vertical_soon(g)
        self._refresh(g)

    def _dispatch(self, fn: _Fn) -> None:
        """Give waiting requests to idle instances; wake up again at the next arrival if needed."""
        while fn.idle:
            avail = self._available(fn)
            if avail <= 0:
                break
            inst = fn.idle.pop()
            self._start_batch(inst, min(avail, fn.batch))
        self._schedule_wake(fn)

    def _schedule_wake(self, fn: _Fn) -> None:
        if fn.wake or fn.head >= fn.n:
            return
        if fn.idle or not fn.instances:
            nxt = float(fn.arr[fn.head])
            if nxt <= self.now:
                if not fn.instances:
                    self._activate(fn)
                return
            fn.wake = True
            self.push(nxt, _ARRIVE, fn)

    def _activate(self, fn: _Fn) -> None:
        if not fn.active:
            fn.active = True
            self.active_fns.add(fn)

    def _on_done(self, inst: _Inst) -> None:
        fn = inst.fn
        g = inst.gpu
        now = self.now
        a, b = inst.a, inst.b
        if b == 1:
            lat_ms = (now - fn.arr[a]) * 1000.0
            fn.lat[a] = lat_ms
            viol = 1 if (fn.slo_ms is not None and lat_ms > fn.slo_ms) else 0
        else:
            lat = (now - fn.arr[a : a + b]) * 1000.0
            fn.lat[a : a + b] = lat
            viol = int(np.count_nonzero(lat > fn.slo_ms)) if fn.slo_ms is not None else 0
        fn.completed += b
        fn.violations += viol
        self.win[1] += b
        self.win[2] += viol
        # One completed batch is one kernel-launch cycle; scaled to a batch of one so the policy
        # compares like with like (its minimum must not be set by batch size).
        if self.mode == "dynamic" and g.n_be:
            inst.cycles.append((now - inst.start_t) / fn.norm[b])
        inst.busy_acc += now - inst.busy_since
        inst.last_end = now
        inst.b = 0
        inst.rate = 0.0
        g.busy.remove(inst)
        if inst.state == "stopping":
            self._remove(inst)
            self._refresh(g)
            return
        avail = self._available(fn)
        if avail > 0:
            inst.state = "idle"  # _start_batch marks it busy again, keeping it active
            inst.last_end = now
            self._start_batch(inst, min(avail, fn.batch))
            return
        inst.state = "idle"
        fn.idle.append(inst)
        self._refresh(g)
        self._schedule_wake(fn)

    # -- instances ----------------------------------------------------------------------------

    def _new_instance(self, fn: _Fn, training: bool = False) -> _Inst | None:
        self.inst_seq += 1
        iid = f"{fn.name}.{self.inst_seq}"
        req = PlacementRequest(
            instance_id=iid,
            function=fn.name,
            cls=fn.cls,
            request=fn.request,
            limit=fn.limit,
            memory_mib=fn.memory_mib,
        )
        snap = self.cluster.at(self.now)
        d = place(snap, req, self.pconf)
        if not d.placed:
            self.placement_failures += 1
            self.lit_by["failed"] = self.lit_by.get("failed", 0) + 1
            return None
        if not snap.gpu(d.gpus[0]).lit:
            why = self._why_unlit(snap, req)
            self.lit_by[why] = self.lit_by.get(why, 0) + 1
        self._account()
        self.cluster = apply_placement(self.cluster, req, d)
        self._cluster_changed()
        g = self.gpus[self.cluster.ordinals[d.gpus[0]]]
        inst = _Inst(iid, fn, g, self._static_cap(fn), training)
        fn.instances.append(inst)
        fn.starting += 1
        self._occupy(inst)
        return inst

    def _occupy(self, inst: _Inst) -> None:
        """A new instance (placed in `cluster` already) holds its GPU from now and serves after its start."""
        fn = inst.fn
        g = inst.gpu
        g.insts.append(inst)
        if not fn.cls.latency_critical:
            g.n_be += 1
        fn.started += 1
        self.cold_starts += 1
        inst.ready_at = self.now + self._start_cost(g.ordinal // self.cfg.gpus_per_node)
        self.push(inst.ready_at, _READY, inst)
        g.memo.clear()
        if self.mode == "dynamic":
            self._vertical_now(g)

    def _why_unlit(self, snap: ClusterSnapshot, req: PlacementRequest) -> str:
        """Why a placement lit a GPU: the first check every lit, schedulable GPU failed, in the order
        Σ request ≤ ω, Σ limit ≤ γ, memory, or `score` where some lit GPU passed all three (the scorer or a
        filter of the strategy other than these preferred an unlit GPU)."""
        c = self.pconf
        worst = ""
        order = ("sm-request", "sm-limit", "memory")
        limits = "sm-limit" in c.strategy_spec().filters
        for g in snap.lit_gpus():
            if not g.schedulable:
                continue
            if g.used_request + req.request > c.omega + 1e-9:
                fail = "sm-request"
            elif limits and g.used_limit + req.limit > c.gamma + 1e-9:
                fail = "sm-limit"
            elif g.used_memory + req.memory_mib > g.memory_mib:
                fail = "memory"
            else:
                return "score"
            # the check that let the most GPUs through: the one that binds last
            if not worst or order.index(fail) > order.index(worst):
                worst = fail
        return f"{worst}-bound" if worst else "none-lit"

    def _start_cost(self, node: int) -> float:
        """Seconds until a new instance on ``node`` serves: a pre-loaded process's when one is available
        there (its slot refills ``preload_refill_s`` later), else a plain cold start's."""
        slots = self.preload_slots[node] if node < len(self.preload_slots) else []
        for i, available_at in enumerate(slots):
            if available_at <= self.now:
                slots[i] = self.now + self.cfg.preload_refill_s
                self.preloaded_starts += 1
                return self.cfg.preloaded_start_s
        return self.cfg.cold_start_s

    def _remove(self, inst: _Inst) -> None:
        fn = inst.fn
        g = inst.gpu
        if inst.state == "starting":
            fn.starting -= 1
        if inst in fn.idle:
            fn.idle.remove(inst)
        fn.instances.remove(inst)
        g.insts.remove(inst)
        if inst in g.busy:
            g.busy.remove(inst)
        if not fn.cls.latency_critical:
            g.n_be -= 1
        inst.state = "gone"
        inst.version += 1
        rep = inst.moved_to
        if rep is not None:
            # The original went (a scale-in) before its move was done: the replacement is an ordinary
            # instance now, still starting (as the live planner turns it).
            self._end_move(rep)
            self.compaction_promoted += 1
            fn.instances.append(rep)
            fn.starting += 1
        self._account()
        self.cluster = self.cluster.without_instance(inst.id)
        self._cluster_changed()
        g.memo.clear()
        if self.mode == "dynamic":
            self._vertical_now(g)

    def _on_ready(self, inst: _Inst) -> None:
        if inst.state != "starting":
            return
        fn = inst.fn
        if inst.replaces is not None:
            self._take_over(inst)
            return
        fn.starting -= 1
        if inst.training:
            inst.state = "busy"
            inst.b = inst.tb
            inst.t_rate = self.now
            inst.gpu.busy.append(inst)
            if self.mode == "dynamic":
                self._vertical_now(inst.gpu)
            self._refresh(inst.gpu)
            return
        inst.state = "idle"
        fn.idle.append(inst)
        self._dispatch(fn)

    def _scale_in(self, fn: _Fn, count: int) -> None:
        for _ in range(count):
            # Prefer an idle instance on the emptiest GPU (it may turn the GPU off), then one still
            # starting, then a busy one (it finishes its batch first).
            cands = [i for i in fn.instances if i.state == "idle"]
            if cands:
                victim = min(cands, key=lambda i: (self.cluster.gpus[i.gpu.ordinal].used_request, i.id))
                self._remove(victim)
                continue
            cands = [i for i in fn.instances if i.state == "starting"]
            if cands:
                self._remove(cands[-1])
                continue
            cands = [i for i in fn.instances if i.state == "busy"]
            if cands:
                cands[-1].state = "stopping"

    # -- the vertical policy (dilu) -----------------------------------------------------------

    def _vertical_soon(self, g: _Gpu) -> None:
        if g.v_pending:
            return
        when = max(self.now, g.last_v + _ACTIVATION_DEBOUNCE_S)
        if when <= self.now:
            self._vertical_now(g)
        else:
            g.v_pending = True
            self.push(when, _VERTICAL, g)

    def _vertical_now(self, g: _Gpu) -> None:
        g.last_v = self.now
        if not g.insts:
            return
        now = self.now
        idle_after = self.cfg.vertical.idle_after_s
        if g.n_be == 0:
            key = tuple(
                sorted(
                    i.id
                    for i in g.insts
                    if i.state == "busy" or (i.state != "starting" and now - i.last_end <= idle_after)
                )
            )
            shares = g.memo.get(key)
            if shares is None:
                shares = self._decide(g, None)[0]
                g.memo[key] = shares
            else:
                self.vertical_memo_hits += 1
        else:
            shares, g.vstate = self._decide(g, g.vstate)
        changed = False
        cut = False
        for inst in g.insts:
            s = shares.get(inst.id)
            if s is None:
                continue
            if abs(s - inst.cap) > 1e-9:
                inst.cap = s
                changed = True
            if inst.cls.latency_critical and s < inst.limit - 1e-9:
                cut = True
        if changed:
            self._refresh(g)
        want_periodic = (g.n_be > 0 and len(g.insts) > g.n_be) or cut
        if want_periodic and not g.v_periodic:
            g.v_periodic = True
            self.push(now + self.cfg.vertical_period_s, _VERTICAL, g, 1)
        elif not want_periodic:
            g.v_periodic = False

    def _decide(self, g: _Gpu, state: SloState | None) -> tuple[dict[str, float], SloState]:
        now = self.now
        vis = []
        for inst in g.insts:
            busy = inst.state == "busy"
            last = now if busy else (inst.last_end if inst.last_end > -math.inf else None)
            if inst.state == "starting":
                last = None
            vis.append(
                VerticalInstance(
                    id=inst.id,
                    cls=inst.cls,
                    request=inst.request,
                    limit=inst.limit,
                    # The latency-critical instance's objective (the slo policy's target).
                    slo_ms=inst.fn.slo_ms if inst.cls.latency_critical else None,
                    blocks=1 if busy else 0,
                    last_active_at=last,
                    cycles_s=tuple(inst.cycles[-16:]),
                    share=inst.cap,
                )
            )
            inst.cycles.clear()
        d = decide_vertical(
            VerticalSnapshot(now=now, instances=tuple(vis), period_s=self.cfg.vertical_period_s, gpu=g.name),
            state if state is not None else initial_state(self.cfg.vertical),
            self.cfg.vertical,
        )
        self.vertical_calls += 1
        return {s.id: s.share for s in d.shares}, d.state

    # -- horizontal scaling (every policy) ----------------------------------------------------

    def _tick(self) -> None:
        now = self.now
        hconf = self.cfg.horizontal
        compacting = self.compaction is not None
        for fn in sorted(self.active_fns, key=lambda f: f.name):
            avail = self._available(fn)
            arr = fn.arr
            lo = int(arr.searchsorted(now - 1.0, "right"))
            hi = int(arr.searchsorted(now, "right"))
            ready = 0
            at_limit = 0
            in_flight = 0
            stopping = 0
            for inst in fn.instances:
                st = inst.state
                if st == "starting":
                    continue
                if st == "stopping":
                    stopping += 1
                    continue
                ready += 1
                busy = inst.busy_acc + (now - inst.busy_since if st == "busy" else 0.0)
                if busy >= _SATURATED_BUSY * hconf.sample_period_s:
                    at_limit += 1
                inst.busy_acc = 0.0
                if st == "busy":
                    inst.busy_since = now
                    in_flight += inst.b
            delay = (now - float(arr[fn.head])) * 1000.0 if avail > 0 else 0.0
            load = FunctionLoad(
                function=fn.name,
                now=now,
                instances=ready,
                starting=fn.starting,
                stopping=stopping,
                arrival_rate=float(hi - lo),
                capacity_per_instance=fn.capacity if fn.capacity > 0 else None,
                waiting=max(0, avail),
                in_flight=in_flight,
                queue_delay_ms=delay,
                slo_ms=fn.slo_ms,
                instances_at_limit=at_limit,
            )
            d = decide_scale(load, fn.hstate, hconf)
            fn.hstate = d.state
            if d.action is ScaleAction.OUT and now >= fn.blocked_until:
                for _ in range(d.desired - d.current):
                    if self._new_instance(fn) is None:
                        # No GPU fits: as the live balancer, retry after the cooldown.
                        fn.blocked_until = now + hconf.cooldown_s
                        break
            elif d.action is ScaleAction.IN:
                self._scale_in(fn, d.current - d.desired)
            if compacting:
                fn.calm = function_calm(d, load, 1 if now < fn.blocked_until else 0)
            if not fn.instances and avail <= 0 and fn.starting == 0:
                fn.calm = False
                fn.active = False
                self.active_fns.discard(fn)
                fn.hstate = HorizontalState()
                self._schedule_wake(fn)
        # Training jobs waiting for a GPU retry every tick.
        if self.pending_jobs:
            still: list[tuple[Any, _Fn]] = []
            for job, fn in self.pending_jobs:
                if job.end_s <= now:
                    continue
                started = self._new_instance(fn, training=True)
                if started is None:
                    still.append((job, fn))
                else:
                    self.running_jobs[job.name] = started
            self.pending_jobs = still
        if compacting and now >= self.compaction_next and not self.moving:
            self._compact()

    # -- compaction (dilu by default, as the live balancer) -----------------------------------

    def _compact(self) -> None:
        """One run of the live balancer's compaction (`planner._compact`, on the simulator's state)."""
        live = self.compaction
        assert live is not None
        now = self.now
        # Movable: ready instances of calm functions that no move is taking over; the rest are pinned
        # (starting, stopping, replacements in flight, training jobs, functions in a burst).
        movable = {
            i.id
            for f in self.active_fns
            if f.calm
            for i in f.instances
            if i.state in ("idle", "busy") and i.moved_to is None
        }
        pinned = frozenset(i for i in self.cluster.locations if i not in movable)
        plan = compaction_plan(
            self.cluster.at(now), self.compaction_pconf, live.config, self.compaction_state, pinned=pinned
        )
        self.compaction_state = plan.state
        self.compaction_runs += 1
        self.compaction_next = now + live.period_s
        for mv in plan.moves:
            if mv.parts or mv.replaces:
                continue  # never with llm_max_parts = 1 and whole instances only
            src = self.gpus[self.cluster.ordinals[mv.source]]
            orig = next((i for i in src.insts if i.id == mv.instance_id), None)
            if orig is None:
                continue
            self._start_replacement(orig, mv.target)
        self.compaction_freed += len(plan.freed)

    def _start_replacement(self, orig: _Inst, target: GpuRef) -> None:
        """Make-before-break, step 1: a replacement reserved on `target` from now; the original serves on."""
        fn = orig.fn
        self.inst_seq += 1
        iid = f"{fn.name}.{self.inst_seq}"
        held = self.cluster.instance(orig.id)
        self._account()
        self.cluster = self.cluster.with_instance(
            PlacedInstance(id=iid, function=held.function, cls=held.cls, request=held.request, limit=held.limit,
                           memory_mib=held.memory_mib, profile=held.profile),
            (target,),
        )
        self._cluster_changed()
        rep = _Inst(iid, fn, self.gpus[self.cluster.ordinals[target]], self._static_cap(fn), orig.training)
        rep.replaces = orig
        orig.moved_to = rep
        self.moving.append(rep)
        self.compaction_moves += 1
        self._occupy(rep)

    def _end_move(self, rep: _Inst) -> None:
        orig = rep.replaces
        assert orig is not None
        rep.replaces = None
        orig.moved_to = None
        self.moving.remove(rep)

    def _take_over(self, rep: _Inst) -> None:
        """Make-before-break, steps 2 and 3: the ready replacement is routed to; the original leaves
        routing and goes once its batch in flight is done."""
        orig = rep.replaces
        assert orig is not None
        fn = rep.fn
        self._end_move(rep)
        fn.instances.append(rep)
        rep.state = "idle"
        fn.idle.append(rep)
        if orig.state == "idle":
            self.compaction_done += 1
            self._remove(orig)
        elif orig.state == "busy":
            self.compaction_done += 1
            self.compaction_drained += 1
            orig.state = "stopping"
        self._dispatch(fn)

    def _sample(self) -> None:
        arrivals_n, completed, violations, _ = self.win
        train_now = self.training_samples + sum(
            i.samples + (self.now - i.t_rate) * i.rate for i in self.running_jobs.values() if i.state == "busy"
        )
        prev_train = self.win[3]
        dt = self.cfg.sample_every_s
        self.samples.append(
            (
                self.now,
                self.cluster.lit_count,
                sum(len(f.instances) for f in self.fns) + len(self.running_jobs) + len(self.moving),
                arrivals_n,
                completed,
                violations,
                violations / arrivals_n if arrivals_n else 0.0,
                self.frag.sm_mean,
                self.frag.memory_mean,
                (train_now - prev_train) / dt,
            )
        )
        self.win = [0, 0, 0, train_now]

    # -- main loop ----------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None) -> None:
        end = self.trace.duration_s
        for fn in self.fns:
            self._schedule_wake(fn)
        for job, fn in self.jobs:
            self.push(job.start_s, _TRAIN_START, (job, fn))
            self.push(job.end_s, _TRAIN_END, (job, fn))
        self.push(1.0, _TICK, None)
        sample_every = self.cfg.sample_every_s
        next_sample = sample_every
        # Arrival counts per sample interval, precomputed (arrivals are known in advance).
        drain_until = end + self.cfg.timeout_s
        heap = self.heap
        pop = heapq.heappop
        last_progress = 0.0
        while heap:
            t, _, kind, obj, version = pop(heap)
            if t > drain_until:
                break
            while t >= next_sample and next_sample <= end:
                self.now = next_sample
                self._account()
                self.win[0] = sum(
                    int(f.arr.searchsorted(next_sample, "right"))
                    - int(f.arr.searchsorted(next_sample - sample_every, "right"))
                    for f in self.fns
                )
                self._sample()
                next_sample += sample_every
            self.now = t
            if kind == _DONE:
                if obj.version == version and obj.state in ("busy", "stopping"):
                    self._on_done(obj)
            elif kind == _ARRIVE:
                obj.wake = False
                if not obj.instances:
                    self._activate(obj)
                else:
                    self._dispatch(obj)
            elif kind == _READY:
                self._on_ready(obj)
            elif kind == _TICK:
                if t <= end:
                    self._tick()
                    self.push(t + self.cfg.horizontal.sample_period_s, _TICK, None)
                    if progress is not None and t - last_progress >= 60.0:
                        last_progress = t
                        progress(t)
            elif kind == _VERTICAL:
                if version == 1:
                    obj.v_periodic = False
                else:
                    obj.v_pending = False
                self._vertical_now(obj)
            elif kind == _TRAIN_START:
                job, fn = obj
                inst = self._new_instance(fn, training=True)
                if inst is None:
                    self.pending_jobs.append((job, fn))
                else:
                    self.running_jobs[job.name] = inst
            elif kind == _TRAIN_END:
                job, fn = obj
                self.pending_jobs = [(j, f) for j, f in self.pending_jobs if j.name != job.name]
                inst = self.running_jobs.pop(job.name, None)
                if inst is not None:
                    if inst.state == "busy":
                        inst.samples += (t - inst.t_rate) * inst.rate
                    self.training_samples += inst.samples
                    self._remove(inst)
                    self._refresh(inst.gpu)
        self.now = max(self.now, end)
        self._account()
        for inst in list(self.running_jobs.values()):
            if inst.state == "busy":
                inst.samples += (min(self.now, end) - inst.t_rate) * inst.rate
            self.training_samples += inst.samples
        if progress is not None:
            progress(end)


def simulate_serving(
    trace: ServingTrace,
    profiles: ProfileSet,
    config: ServingSimConfig,
    *,
    progress: Callable[[float], None] | None = None,
) -> ServingResult:
    wall0 = time.perf_counter()
    trace.check_profiles(profiles)
    sim = _Sim(trace, profiles, config)
    sim.run(progress)
    duration = trace.duration_s
    lats = [f.lat for f in sim.fns if f.n]
    all_lat = np.concatenate(lats) if lats else np.empty(0, dtype=np.float32)
    done = all_lat[~np.isnan(all_lat)]
    requests = int(sum(f.n for f in sim.fns))
    completed = int(done.size)
    # Requests never served by the end (still queued or in flight after the drain) are dropped.
    unserved = requests - completed - sum(f.dropped for f in sim.fns)
    violations = sum(f.violations for f in sim.fns) + unserved
    p50, p99 = (float(np.percentile(done, 50)), float(np.percentile(done, 99))) if completed else (math.nan, math.nan)
    gpu_seconds = sim.lit_area
    summary: dict[str, Any] = {
        "policy": config.policy,
        "requests": requests,
        "completed": completed,
        "dropped": requests - completed,
        "throughput": round(completed / duration, 4),
        "throughput_per_gpu": round(completed / gpu_seconds, 4) if gpu_seconds else 0.0,
        "slo_violation_rate": round(violations / requests, 6) if requests else 0.0,
        "latency_p50_ms": round(p50, 3),
        "latency_p99_ms": round(p99, 3),
        "cold_starts": sim.cold_starts,
        "gpus_peak": sim.peak,
        "gpu_seconds": round(gpu_seconds, 3),
        "sm_fragmentation_mean": round(sim.sm_area / sim.frag_time, 6) if sim.frag_time else 0.0,
        "mem_fragmentation_mean": round(sim.mem_area / sim.frag_time, 6) if sim.frag_time else 0.0,
        "training_samples": round(sim.training_samples, 1),
        "training_samples_per_s": round(sim.training_samples / duration, 3),
        "compaction_moves": sim.compaction_moves,
    }
    assert tuple(summary) == SUMMARY_KEYS
    functions: dict[str, Any] = {}
    for f in sim.fns:
        done_f = f.lat[~np.isnan(f.lat)]
        functions[f.name] = {
            "profile": f.prof.name,
            "slo_ms": f.slo_ms,
            "request": f.request,
            "limit": f.limit,
            "batch": f.batch,
            "requests": f.n,
            "completed": int(done_f.size),
            "slo_violations": f.violations + (f.n - int(done_f.size) - f.dropped),
            "latency_p50_ms": round(float(np.percentile(done_f, 50)), 3) if done_f.size else None,
            "latency_p99_ms": round(float(np.percentile(done_f, 99)), 3) if done_f.size else None,
            "instances_started": f.started,
        }
    details = {
        "policy": config.policy,
        "placement_strategy": sim.pconf.strategy,
        "share_mode": sim.mode,
        "gpus": config.gpus,
        "duration_s": duration,
        "placement_failures": sim.placement_failures,
        "preload_per_node": config.preload_per_node,
        "preloaded_starts": sim.preloaded_starts,
        "plain_cold_starts": sim.cold_starts - sim.preloaded_starts,
        "vertical_calls": sim.vertical_calls,
        "compaction": {
            "period_s": live.period_s if (live := config.live_compaction()) is not None else 0.0,
            "max_moves": config.compaction_max_moves,
            "runs": sim.compaction_runs,
            "moves": sim.compaction_moves,
            "done": sim.compaction_done,
            "drained": sim.compaction_drained,
            "promoted": sim.compaction_promoted,
            "gpus_freed_planned": sim.compaction_freed,
        },
        "packing": {
            "instances_per_lit_gpu": round(sim.pack_area[0] / gpu_seconds, 4) if gpu_seconds else 0.0,
            "request_per_lit_gpu": round(sim.pack_area[1] / gpu_seconds, 4) if gpu_seconds else 0.0,
            "limit_per_lit_gpu": round(sim.pack_area[2] / gpu_seconds, 4) if gpu_seconds else 0.0,
            "memory_per_lit_gpu": round(sim.pack_area[3] / gpu_seconds, 4) if gpu_seconds else 0.0,
            "instance_seconds": round(sim.pack_area[0], 1),
            "lit_by": dict(sorted(sim.lit_by.items())),
        },
        "vertical_memo_hits": sim.vertical_memo_hits,
        "profiles_synthetic": profiles.synthetic,
        "profiles_source": profiles.source,
        "wall_s": round(time.perf_counter() - wall0, 3),
    }
    return ServingResult(summary=summary, functions=functions, samples=sim.samples, details=details)
