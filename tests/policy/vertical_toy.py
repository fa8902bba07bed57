"""A toy GPU with a request queue, for closed-loop tests of the vertical policy.

One latency-critical instance serves requests first come first served; each request's service time (its
request span) grows with the training share in force when it starts; training's throughput is its share.
Arrivals are paced, Poisson, or a 5× burst (a fifth of the load, with bursts up to the full load). Each
50 ms period the policy sees what the GPU manager would read from the shim (the spans completed, the span
in progress, whether anything launched) and decides training's share for the next period.

A toy, not the H200: it shows the control law's dynamics (stability, reaction, what it leaves to training)
against static splits under the same arrivals; whether the law holds on a GPU is for the GPU benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from dilu_invoker.policy import InstanceClass, VerticalInstance, VerticalSnapshot
from dilu_invoker.policy.vertical_slo import AnyVerticalConfig, decide_vertical, initial_state

PERIOD = 0.05
WARMUP_S = 2.0


@dataclass(frozen=True, slots=True)
class ToyGpu:
    """Inference's service time (s) as a function of the training share in force when a request starts."""

    solo_s: float = 0.005
    interference: float = 1.0  # × (training share − free) added to the service time
    free: float = 0.3  # the training share inference does not notice
    jitter: float = 0.1  # service × uniform(1 − jitter/2, 1 + jitter)

    def service_s(self, training: float, rng: random.Random) -> float:
        stretch = 1.0 + self.interference * max(0.0, training - self.free)
        return self.solo_s * stretch * rng.uniform(1 - self.jitter / 2, 1 + self.jitter)


def arrivals(kind: str, load: float, gpu: ToyGpu, seconds: float, seed: int) -> list[float]:
    """Arrival times: `load` is the fraction of inference's solo capacity (1 / solo_s requests/s)."""
    rng = random.Random(seed)
    rate = load / gpu.solo_s
    out: list[float] = []
    t = 0.0
    if kind == "paced":
        while t < seconds:
            out.append(t)
            t += 1.0 / rate
    elif kind == "poisson":
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            out.append(t)
    elif kind == "burst":
        # A fifth of the load, with one-second bursts up to the full load every three seconds.
        while True:
            in_burst = t % 3.0 >= 2.0
            t += rng.expovariate(rate if in_burst else rate / 5)
            if t >= seconds:
                break
            out.append(t)
    else:
        raise ValueError(kind)
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    p99_ms: float
    training: float  # mean training share over the run (its throughput, relative to the whole GPU)
    shares: tuple[float, ...]
    modes: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"p99 {self.p99_ms:.1f} ms, training {self.training:.3f}"


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def run(gpu: ToyGpu, times: list[float], *, static: float | None = None, config: AnyVerticalConfig | None = None,
        slo_ms: float | None = None, seconds: float = 30.0, seed: int = 7,
        on_decision: Callable[[str], None] | None = None) -> Outcome:
    """Serve `times` with training at a `static` share, or under the policy `config`."""
    rng = random.Random(seed)
    share = static if static is not None else 1.0
    state = initial_state(config) if config is not None else None
    free_at, j, n = 0.0, 0, len(times)
    in_service: tuple[float, float] | None = None  # (start, end)
    lat: list[float] = []
    shares: list[float] = []
    modes: list[str] = []
    periods = int(seconds / PERIOD)
    last_active: float | None = None
    for k in range(periods):
        t1 = (k + 1) * PERIOD
        spans: list[float] = []
        busy = False
        if in_service is not None and in_service[1] <= t1:
            spans.append(in_service[1] - in_service[0])
            in_service = None
            busy = True
        while in_service is None and j < n and max(times[j], free_at) < t1:
            start = max(times[j], free_at)
            end = start + gpu.service_s(share, rng)
            lat.append(end - times[j])
            free_at, j, busy = end, j + 1, True
            if end <= t1:
                spans.append(end - start)
            else:
                in_service = (start, end)
        if in_service is not None:
            busy = True
        open_s = t1 - in_service[0] if in_service is not None else 0.0
        if busy:
            last_active = t1
        shares.append(share)
        if config is None:
            continue
        inf = VerticalInstance(id="inf", cls=InstanceClass.INFERENCE, request=0.5, limit=1.0, slo_ms=slo_ms,
                               blocks=1000 if busy else 0, last_active_at=last_active, spans_s=tuple(spans),
                               open_span_s=open_s)
        train = VerticalInstance(id="train", cls=InstanceClass.TRAINING, request=0.2, limit=1.0, blocks=1000,
                                 last_active_at=t1, share=share)
        assert state is not None
        d = decide_vertical(VerticalSnapshot(now=t1, instances=(inf, train), period_s=PERIOD), state, config)
        share, state = d.share_of("train"), d.state
        modes.append(d.mode.value)
        if on_decision is not None:
            on_decision(d.reason)
    # Both measured after a warm-up (the controller's start and a static split's first queue).
    warm = [x for x, a in zip(lat, times, strict=False) if a >= WARMUP_S]
    after = shares[int(WARMUP_S / PERIOD):]
    return Outcome(p99(warm) * 1000, sum(after) / len(after), tuple(shares), tuple(modes))
