"""Synthetic traces: Dilu's placement mix, request-rate patterns, an Azure-style day.

All generators are deterministic for a given seed (numpy's PCG64 / Python's Mersenne twister).

* `dilu_mix` — the instance mix of Dilu's large-scale simulation (prior-art.md §1.2): 20% LLM
  inference (`llm_fraction`) (1 GPU, 20–30 GiB, request 0.4–0.6, limit U(request+0.2, 0.8)); `train_fraction` of
  the instances training jobs (2 or 4 GPUs, 25/30/35/40 GiB per GPU, request 0.4–0.8, limit
  max(request+0.2, U(0.6, 1.0))); the rest inference (1 GPU, 3–10 GiB, request 0.2–0.4, limit
  max(request+0.2, U(0.3, 0.6))). One create per second in random order; 60% of all instances
  (LLM and inference only) are deleted 1–3 minutes after they start, and 10% (training only)
  10–15 minutes after. Dilu's artifact uses train_ratio = 2, i.e. 20% training.
* Rate patterns, per-second bins: `poisson` (constant rate), `gamma` (a renewal process whose
  inter-arrival times are Gamma-distributed with the given coefficient of variation), `bursty`
  (a two-state Markov-modulated Poisson process: bursts of `burst_factor` × the base rate),
  `periodic` (a sinusoidal rate with the given period and amplitude).
* `azure_style_day` — per-minute counts with the traits reported for Azure Functions 2019: a
  heavy-tailed popularity (log-normal mean rates), a diurnal cycle, timer-triggered functions that
  fire every few minutes, bursty queue/event functions and sporadic ones that are mostly idle.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from dilu_invoker.policy import InstanceClass
from dilu_invoker.sim.events import CREATE, DELETE, InstanceSpec, PlacementEvent
from dilu_invoker.sim.traces import (
    AzureFunction,
    FunctionTrace,
    ServingTrace,
    TrainingJob,
)

PATTERNS = ("poisson", "gamma", "bursty", "periodic", "azure")


# -- placement -----------------------------------------------------------------------------------


def dilu_mix(
    n: int, *, train_fraction: float = 0.2, seed: int = 1, llm_fraction: float = 0.2
) -> list[PlacementEvent]:
    if n < 1:
        raise ValueError("need at least one instance")
    if not 0 <= train_fraction <= 0.8:
        raise ValueError("train_fraction must be between 0 and 0.8")
    if not 0 <= llm_fraction <= 0.8 or train_fraction + llm_fraction > 1.0:
        raise ValueError("llm_fraction must be between 0 and 0.8, and train + llm fractions at most 1")
    rng = random.Random(seed)
    n_llm = int(n * llm_fraction)
    n_train = int(n * train_fraction)
    n_inf = n - n_llm - n_train
    specs: list[InstanceSpec] = []

    def share(x: float) -> float:
        return round(min(1.0, x), 2)

    for i in range(n_train):
        r = share(rng.uniform(0.4, 0.8))
        specs.append(
            InstanceSpec(
                instance=f"train-{i:05d}",
                function=f"train-{i:05d}",
                cls=InstanceClass.TRAINING,
                gpus=rng.choice((2, 4)),
                mem_gib_per_gpu=float(rng.choice((25, 30, 35, 40))),
                sm_request=r,
                sm_limit=share(max(r + 0.2, rng.uniform(0.6, 1.0))),
            )
        )
    for i in range(n_inf):
        r = share(rng.uniform(0.2, 0.4))
        specs.append(
            InstanceSpec(
                instance=f"inf-{i:05d}",
                function=f"inf-{i:05d}",
                cls=InstanceClass.INFERENCE,
                gpus=1,
                mem_gib_per_gpu=float(rng.randint(3, 10)),
                sm_request=r,
                sm_limit=share(max(r + 0.2, rng.uniform(0.3, 0.6))),
            )
        )
    for i in range(n_llm):
        r = share(rng.uniform(0.4, 0.6))
        specs.append(
            InstanceSpec(
                instance=f"llm-{i:05d}",
                function=f"llm-{i:05d}",
                cls=InstanceClass.LLM,
                gpus=1,
                mem_gib_per_gpu=float(rng.randint(20, 30)),
                sm_request=r,
                sm_limit=share(rng.uniform(r + 0.2, 0.8)),
            )
        )
    rng.shuffle(specs)
    creates = [PlacementEvent(t=float(i), op=CREATE, instance=s.instance, spec=s) for i, s in enumerate(specs)]
    deletes: list[PlacementEvent] = []
    serving = [e for e in creates if e.spec is not None and e.spec.cls is not InstanceClass.TRAINING]
    for e in rng.sample(serving, min(int(n * 0.6), len(serving))):
        deletes.append(PlacementEvent(t=e.t + 60.0 * rng.randint(1, 3), op=DELETE, instance=e.instance))
    training = [e for e in creates if e.spec is not None and e.spec.cls is InstanceClass.TRAINING]
    for e in rng.sample(training, min(int(n * 0.1), len(training))):
        deletes.append(PlacementEvent(t=e.t + 60.0 * rng.randint(10, 15), op=DELETE, instance=e.instance))
    # At equal times deletes come first, as a departure frees room for the arrival.
    events = sorted(creates + deletes, key=lambda e: (e.t, e.op != DELETE, e.instance))
    return events


# -- request-rate patterns (per-second bins) -------------------------------------------------------


def poisson_counts(rate: float, duration_s: float, rng: np.random.Generator, bin_s: float = 1.0) -> np.ndarray:
    bins = max(1, math.ceil(duration_s / bin_s))
    return rng.poisson(rate * bin_s, size=bins).astype(np.int64)


def gamma_counts(
    rate: float, cv: float, duration_s: float, rng: np.random.Generator, bin_s: float = 1.0
) -> np.ndarray:
    """Counts of a Gamma renewal process (inter-arrival CV = cv, mean 1/rate) per bin."""
    bins = max(1, math.ceil(duration_s / bin_s))
    if rate <= 0:
        return np.zeros(bins, dtype=np.int64)
    shape = 1.0 / (cv * cv)
    scale = cv * cv / rate
    times: list[np.ndarray] = []
    t = 0.0
    chunk = max(1024, int(rate * duration_s * 1.2))
    while t < duration_s:
        gaps = rng.gamma(shape, scale, size=chunk)
        ts = t + np.cumsum(gaps)
        times.append(ts)
        t = float(ts[-1])
    all_t = np.concatenate(times)
    all_t = all_t[all_t < bins * bin_s]
    return np.bincount((all_t // bin_s).astype(np.int64), minlength=bins)[:bins].astype(np.int64)


def bursty_counts(
    rate: float,
    duration_s: float,
    rng: np.random.Generator,
    *,
    burst_factor: float = 5.0,
    mean_burst_s: float = 20.0,
    mean_calm_s: float = 120.0,
    bin_s: float = 1.0,
) -> np.ndarray:
    """Markov-modulated Poisson: calm at a base rate, bursts at burst_factor × base; the base is set
    so the long-run mean rate is `rate`."""
    bins = max(1, math.ceil(duration_s / bin_s))
    frac_burst = mean_burst_s / (mean_burst_s + mean_calm_s)
    base = rate / (1 - frac_burst + burst_factor * frac_burst)
    level = np.empty(bins, dtype=np.float64)
    i = 0
    burst = bool(rng.random() < frac_burst)
    while i < bins:
        length = max(1, round(rng.exponential(mean_burst_s if burst else mean_calm_s) / bin_s))
        level[i : i + length] = base * (burst_factor if burst else 1.0)
        i += length
        burst = not burst
    return rng.poisson(level * bin_s).astype(np.int64)


def periodic_counts(
    rate: float,
    duration_s: float,
    rng: np.random.Generator,
    *,
    period_s: float = 600.0,
    amplitude: float = 0.8,
    phase: float = 0.0,
    bin_s: float = 1.0,
) -> np.ndarray:
    bins = max(1, math.ceil(duration_s / bin_s))
    t = (np.arange(bins) + 0.5) * bin_s
    level = rate * (1.0 + amplitude * np.sin(2 * math.pi * t / period_s + phase))
    return rng.poisson(np.clip(level, 0, None) * bin_s).astype(np.int64)


# -- an Azure-style day ----------------------------------------------------------------------------


def azure_style_functions(
    n: int, *, mean_rate: float, rng: np.random.Generator, minutes: int = 1440
) -> list[AzureFunction]:
    """`n` functions with per-minute counts; `mean_rate` is the day's mean total requests/second."""
    if n < 1:
        raise ValueError("need at least one function")
    kinds = rng.choice(["http", "timer", "queue", "sporadic"], size=n, p=[0.45, 0.2, 0.2, 0.15])
    weights = rng.lognormal(mean=0.0, sigma=1.6, size=n)
    weights /= weights.sum()
    t = np.arange(minutes)
    out: list[AzureFunction] = []
    for i in range(n):
        kind = str(kinds[i])
        per_min = mean_rate * 60.0 * weights[i]
        # Diurnal: trough at night, peak in the afternoon, per-function jitter of the phase.
        phase = rng.normal(0.0, 0.6)
        diurnal = 1.0 + 0.6 * np.sin(2 * math.pi * (t / minutes) - math.pi / 2 - 0.8 + phase)
        if kind == "timer":
            every = int(rng.choice([1, 5, 10, 15, 30, 60]))
            level = np.zeros(minutes)
            level[int(rng.integers(0, every)) :: every] = per_min * every
        elif kind == "queue":
            level = per_min * diurnal
            bursts = rng.random(minutes) < 0.03
            level = np.where(bursts, level * 8.0, level * 0.8)
        elif kind == "sporadic":
            active = rng.random(minutes) < 0.05
            level = np.where(active, per_min / 0.05, 0.0)
        else:
            level = per_min * diurnal
        counts = rng.poisson(np.clip(level, 0, None)).astype(np.int64)
        duration = float(np.exp(rng.normal(math.log(300.0), 1.2)))
        out.append(
            AzureFunction(
                owner=f"o{int(rng.integers(0, 2**32)):08x}",
                app=f"a{int(rng.integers(0, 2**32)):08x}",
                function=f"f{i:03d}{int(rng.integers(0, 2**24)):06x}",
                trigger=kind if kind != "sporadic" else "event",
                counts=counts,
                duration_ms=duration,
                host_memory_mb=float(rng.choice([128, 192, 256, 384, 512])),
            )
        )
    return out


def serving_trace(
    pattern: str,
    *,
    functions: int,
    duration_s: float,
    rate: float,
    profiles: Sequence[str],
    seed: int = 1,
    cv: float = 2.0,
    burst_factor: float = 5.0,
    period_s: float = 600.0,
    slo_ms: float | None = None,
    training_profiles: Sequence[str] = (),
    training_jobs: int = 0,
    training_duration_s: float | None = None,
) -> ServingTrace:
    """`functions` functions following `pattern`; `rate` is the mean total requests/second (split
    over functions by a heavy-tailed popularity for azure, evenly otherwise)."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; known: {list(PATTERNS)}")
    if not profiles:
        raise ValueError("need at least one inference profile name")
    if functions < 1 or duration_s <= 0 or rate < 0:
        raise ValueError("need functions >= 1, duration > 0 and rate >= 0")
    rng = np.random.default_rng(seed)
    fns: list[FunctionTrace] = []
    if pattern == "azure":
        minutes = max(1, math.ceil(duration_s / 60.0))
        az = azure_style_functions(functions, mean_rate=rate, rng=rng, minutes=minutes)
        for i, a in enumerate(az):
            fns.append(
                FunctionTrace(
                    name=f"fn{i:03d}",
                    profile=profiles[i % len(profiles)],
                    counts=a.counts,
                    bin_s=60.0,
                    slo_ms=slo_ms,
                    meta={"trigger": a.trigger},
                )
            )
    else:
        per_fn = rate / functions
        for i in range(functions):
            if pattern == "poisson":
                counts = poisson_counts(per_fn, duration_s, rng)
            elif pattern == "gamma":
                counts = gamma_counts(per_fn, cv, duration_s, rng)
            elif pattern == "bursty":
                counts = bursty_counts(per_fn, duration_s, rng, burst_factor=burst_factor)
            else:
                counts = periodic_counts(
                    per_fn, duration_s, rng, period_s=period_s, phase=2 * math.pi * i / functions
                )
            fns.append(
                FunctionTrace(
                    name=f"fn{i:03d}", profile=profiles[i % len(profiles)], counts=counts, bin_s=1.0, slo_ms=slo_ms
                )
            )
    jobs: list[TrainingJob] = []
    if training_jobs:
        if not training_profiles:
            raise ValueError("training jobs need a training profile")
        length = training_duration_s or duration_s / 4
        for j in range(training_jobs):
            start = float(rng.uniform(0, max(0.0, duration_s - length)))
            jobs.append(
                TrainingJob(
                    name=f"train{j:02d}",
                    profile=training_profiles[j % len(training_profiles)],
                    start_s=round(start, 1),
                    end_s=round(min(duration_s, start + length), 1),
                )
            )
    return ServingTrace(
        duration_s=float(duration_s),
        functions=tuple(fns),
        jobs=tuple(jobs),
        source=f"synthetic {pattern}: {functions} functions, {rate:g} req/s mean, seed {seed}",
    )
