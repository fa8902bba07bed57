"""The vertical controller in a closed loop with one simulated GPU, at the live manager's period.

The `slo` policy counts its windows in control periods (ρ over 20 periods, arrival variability over 40,
the dwell in seconds but judged on the spans of the periods since a move), so it has to be simulated at
the period the GPU manager runs: 0.05 s (`GpuManager(period_s=0.05)`), not the serving simulator's coarser
re-decision interval. Here one latency-critical instance serves requests first come first served beside one
best-effort (training) instance; every period the policy gets what the manager would read from the shim —
the request spans completed (their GPU part: a span opens at a request's first launch and closes at its
synchronize), the span in progress, whether anything launched — and its decision sets training's share for
the next period. A static split is the same loop with training's share fixed.

The plant (`PairModel`): a request is `overhead_s` of work off the GPU (the invoke path, host code: not in
the spans, not stretched) then `gpu_s` on the GPU, stretched by (1 + interference × max(0, training share −
free)) for the training share in force when it starts, with ±jitter. Training's throughput is its share.
The pairs' GPU and overhead times are the H200's (docs/benchmarks/gpu-product.md: in-action GPU p50 and
client p50 − run p50); their interference coefficients are assumptions until the H200 matrix fits them.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dilu_invoker.policy import InstanceClass, VerticalInstance, VerticalSnapshot
from dilu_invoker.policy.vertical_slo import AnyVerticalConfig, decide_vertical, initial_state

PERIOD_S = 0.05
"""The live GPU manager's period (`GpuManager.period_s` default)."""
WARMUP_S = 2.0
"""Excluded from every measure: the controller's start (its solo measurement) and a static split's first queue."""
ARRIVALS = ("paced", "poisson", "bursty", "burst5")


@dataclass(frozen=True, slots=True, kw_only=True)
class PairModel:
    """Inference beside training on one GPU."""

    name: str
    gpu_s: float
    """Inference's GPU time per request, alone (s)."""
    overhead_s: float
    """Per-request time the instance spends off the GPU (s): its runtime's request handling and host code,
    outside the shim's spans but in the instance's queue."""
    pipelined_s: float = 0.0
    """Per-request time in the invoke path (REST API, balancer, invoker) that adds to the latency without
    holding the instance: the next request travels while this one runs."""
    interference: float
    """Stretch of the GPU time per unit of training share above `free` (dimensionless)."""
    free: float
    """The training share inference does not notice."""
    jitter: float = 0.1
    """GPU time × uniform(1 − jitter/2, 1 + jitter)."""
    fixed: float = 0.0
    """Stretch of the GPU time whenever training runs at all, whatever its share: a memory-bandwidth-bound
    job, whose few long kernels take the bandwidth even at a small launch rate (SM share cannot fix it)."""

    @property
    def capacity_rps(self) -> float:
        """Requests/s one instance serves alone, back to back (one request at a time per instance)."""
        return 1.0 / (self.gpu_s + self.overhead_s)  # the pipelined part does not hold the instance

    def gpu_time(self, training: float, rng: random.Random) -> float:
        stretch = 1.0 + self.interference * max(0.0, training - self.free) + (self.fixed if training > 0 else 0.0)
        return self.gpu_s * stretch * rng.uniform(1 - self.jitter / 2, 1 + self.jitter)


PAIRS: dict[str, PairModel] = {
    # H200 (runs 2-4): ResNet-50 fp16 batch 8, in-action GPU p50 4.4 ms, run p50 4.6 ms, client p50 8.1 ms: of
    # the 3.4 ms stack overhead about 1 ms is taken to be the runtime's own handling (serial), the rest the
    # invoke path (pipelined) — an assumption, not a measurement.
    "resnet50+train": PairModel(name="resnet50+train", gpu_s=0.0044, overhead_s=0.0012, pipelined_s=0.0024,
                                interference=1.0, free=0.3),
    # H200 (run 3): BERT-base fp16 batch 8, solo p50 11.1 ms; attention's larger kernels leave less room
    # between them: more interference, noticed earlier (assumed).
    "bert+train": PairModel(name="bert+train", gpu_s=0.0075, overhead_s=0.0012, pipelined_s=0.0024,
                            interference=1.5, free=0.2),
}
BANDWIDTH_BOUND = PairModel(name="resnet50+stream", gpu_s=0.0044, overhead_s=0.0012, pipelined_s=0.0024,
                            interference=0.2, free=0.3, fixed=1.0)
"""ResNet-50 inference beside a memory-bandwidth-bound best-effort job (a STREAM-like copy): its GPU time
doubles as soon as the job runs at all, and grows little with the job's share."""
PRIORITY_IDLE_S = 0.6
"""The TGS-like priority variant: training runs at the floor while inference launched within this long."""
FLOOR_SHARE = 0.01


def arrivals(kind: str, load: float, pair: PairModel, seconds: float, seed: int) -> list[float]:
    """Arrival times (s): `load` is the fraction of the instance's solo capacity. `paced`: evenly spaced;
    `poisson`; `bursty`: a Markov-modulated Poisson process, 2× the mean rate in the first quarter of each
    second and 2/3 of it in the rest (bench/gpu_product.py's); `burst5`: a fifth of the rate, with one-second
    bursts to the full rate every three seconds (5× bursts)."""
    rng = random.Random(seed)
    rate = load * pair.capacity_rps
    out: list[float] = []
    t = 0.0
    if kind == "paced":
        t = 0.5 / rate
        while t < seconds:
            out.append(t)
            t += 1.0 / rate
        return out
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; known: {ARRIVALS}")
    while True:
        if kind == "poisson":
            r = rate
        elif kind == "bursty":
            r = 2.0 * rate if t % 1.0 < 0.25 else rate * 2.0 / 3.0
        else:
            r = rate if t % 3.0 >= 2.0 else rate / 5.0
        t += rng.expovariate(r)
        if t >= seconds:
            return out
        out.append(t)


@dataclass(frozen=True, slots=True)
class Outcome:
    p99_ms: float
    latencies_ms: tuple[float, ...]
    """Every request's latency after the warm-up."""
    training: float
    """Training's mean share after the warm-up (its throughput, relative to the whole GPU)."""
    modes: tuple[str, ...]

    def violations(self, slo_ms: float) -> float:
        return sum(1 for x in self.latencies_ms if x > slo_ms) / max(1, len(self.latencies_ms))


def p99(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))] if s else math.nan


def run(pair: PairModel, times: list[float], *, static: float | None = None, config: AnyVerticalConfig | None = None,
        priority: bool = False, slo_ms: float | None = None, seconds: float = 30.0, seed: int = 7,
        period_s: float = PERIOD_S, window: tuple[float, float] | None = None, queue: bool = True) -> Outcome:
    """Serve `times` with training at a `static` share, with its share set by the policy of `config`, or
    (`priority`) TGS-like: training at the floor while inference is active, the whole GPU when it is idle.
    Latencies are of the requests that arrive after the warm-up, or within `window` (s) when given.
    `queue`: the policy also gets what the invoker reports of the instance (`dilu_invoker.gpu.load`): each
    completed request's time in the instance and wait for it, the requests waiting and since when, the one
    running; without it only the shim's spans (the law before the queue measurement)."""
    if sum((static is not None, config is not None, priority)) != 1:
        raise ValueError("give a static share or a policy configuration (or priority)")
    rng = random.Random(seed)
    share = static if static is not None else 1.0
    state = initial_state(config) if config is not None else None
    free_at, j, n = 0.0, 0, len(times)
    gpu_span: tuple[float, float] | None = None  # the GPU part of the request in service: (start, end)
    lat: list[float] = []
    shares: list[float] = []
    modes: list[str] = []
    last_active: float | None = None
    pending: list[tuple[float, float]] = []  # GPU parts that started, not yet reported: (start, end)
    runs: list[tuple[float, float, float]] = []  # requests the instance took, not yet reported: (arrival, start, end)
    for k in range(int(seconds / period_s)):
        t1 = (k + 1) * period_s
        # Start every request that can start before the period ends (FIFO, one at a time).
        while j < n and max(times[j], free_at) < t1:
            start = max(times[j], free_at)
            g0 = start + pair.overhead_s
            end = g0 + pair.gpu_time(share, rng)
            lat.append(end - times[j] + pair.pipelined_s)
            pending.append((g0, end))
            runs.append((times[j], start, end))
            free_at, j = end, j + 1
        spans = tuple(e - s for s, e in pending if e <= t1 and s < t1)
        launched = any(s < t1 and e > t1 - period_s for s, e in pending)
        pending = [(s, e) for s, e in pending if e > t1]
        gpu_span = next(((s, e) for s, e in pending if s < t1), None)
        open_s = t1 - gpu_span[0] if gpu_span is not None else 0.0
        done = [(a, s, e) for a, s, e in runs if e <= t1]
        runs = [(a, s, e) for a, s, e in runs if e > t1]
        queued = bisect.bisect_left(times, t1, lo=j) - j  # arrived, not taken by the instance yet
        in_service = next(((a, s, e) for a, s, e in runs if s <= t1), None)
        load: dict[str, Any] = {"queue_known": True, "runs_s": tuple(e - s for _a, s, e in done),
                "waits_s": tuple(s - a for a, s, _e in done), "queued": float(queued),
                "oldest_wait_s": t1 - times[j] if queued else 0.0,
                "open_run_s": t1 - in_service[1] if in_service is not None else 0.0} if queue else {}
        if launched:
            last_active = t1
        shares.append(share)
        if priority:
            share = FLOOR_SHARE if last_active is not None and t1 - last_active < PRIORITY_IDLE_S else 1.0
            modes.append("hold" if share < 1.0 else "idle")
            continue
        if config is None:
            continue
        inf = VerticalInstance(id="inf", cls=InstanceClass.INFERENCE, request=0.5, limit=1.0, slo_ms=slo_ms,
                               blocks=1000 if launched else 0, last_active_at=last_active, spans_s=spans,
                               open_span_s=open_s, **load)
        train = VerticalInstance(id="train", cls=InstanceClass.TRAINING, request=0.2, limit=1.0, blocks=1000,
                                 last_active_at=t1, share=share)
        assert state is not None
        d = decide_vertical(VerticalSnapshot(now=t1, instances=(inf, train), period_s=period_s), state, config)
        share, state = d.share_of("train"), d.state
        modes.append(d.mode.value)
    warm = tuple(x * 1000 for x, a in zip(lat, times, strict=False) if a >= WARMUP_S)
    if window is not None:
        warm = tuple(x * 1000 for x, a in zip(lat, times, strict=False) if window[0] <= a < window[1])
    after = shares[int(WARMUP_S / period_s):]
    return Outcome(p99(warm), warm, sum(after) / max(1, len(after)), tuple(modes))


def burst_times(pair: PairModel, *, base: float, height: float, start_s: float, duration_s: float,
                seconds: float) -> list[float]:
    """Paced arrivals at `base` × the solo capacity, `height` × that from `start_s` for `duration_s`."""
    out: list[float] = []
    t = 0.0
    while t < seconds:
        out.append(t)
        rate = base * pair.capacity_rps * (height if start_s <= t < start_s + duration_s else 1.0)
        t += 1.0 / rate
    return out


STATIC_SHARES = tuple(round(0.1 * i, 1) for i in range(11))


@dataclass(frozen=True, slots=True)
class CellResult:
    """One (pair, arrivals, load, SLO given or derived, seed): the controller against every static share."""

    slo_ms: float
    controller: Outcome
    statics: dict[float, Outcome]

    @property
    def best_static(self) -> float:
        """The largest static training share whose p99 meets the SLO (an operator's choice with hindsight)."""
        return max((s for s, o in self.statics.items() if o.p99_ms <= self.slo_ms), default=0.0)

    def dominating(self, tolerance: float = 0.01) -> list[float]:
        """Static shares with a p99 at or below the controller's that give training more."""
        c = self.controller
        return [s for s, o in self.statics.items() if o.p99_ms <= c.p99_ms and s > c.training + tolerance]


def cell(pair: PairModel, kind: str, load: float, *, seed: int, annotated: bool, config: AnyVerticalConfig,
         seconds: float = 30.0, period_s: float = PERIOD_S) -> CellResult:
    """SLO = 2 × inference's p99 alone under the same arrivals (annotated as `gpu-slo-ms`, or left for the
    controller to derive from its own solo measurement)."""
    times = arrivals(kind, load, pair, seconds, seed)
    statics = {s: run(pair, times, static=s, seconds=seconds, period_s=period_s) for s in STATIC_SHARES}
    slo_ms = 2.0 * statics[0.0].p99_ms
    ctl = run(pair, times, config=config, slo_ms=slo_ms if annotated else None, seconds=seconds, period_s=period_s)
    return CellResult(slo_ms, ctl, statics)


__all__ = ["ARRIVALS", "BANDWIDTH_BOUND", "PAIRS", "PERIOD_S", "CellResult", "Outcome", "PairModel", "arrivals",
           "burst_times", "cell", "run"]
