"""Open-loop arrival schedules of the vertical benchmark (stdlib only: the workers and their stand-ins share it)."""

from __future__ import annotations

import math
import random

PROCESSES = ("paced", "poisson")
"""``paced``: evenly spaced arrivals (the issue's anchor: solo p99 close to one request's service time);
``poisson``: exponential gaps (queueing alone puts p99 at ~4× the service time at 50% load)."""


def arrivals(phases: list[list[float]], seed: int, start: float, process: str = "poisson") -> list[float]:
    """Arrival times from ``start``: each phase is ``[seconds, requests per second]``."""
    if process not in PROCESSES:
        raise ValueError(f"arrival process must be one of {PROCESSES}, got {process!r}")
    rng = random.Random(seed)
    out: list[float] = []
    t = start
    for seconds, rate in phases:
        end = t + seconds
        if rate <= 0:
            t = end
            continue
        if process == "paced":
            # From the phase's start, not by adding gaps: no drift, no extra arrival from rounding.
            n = math.ceil(seconds * rate - 1e-9)
            out.extend(t + k / rate for k in range(1, n))
            t = end
            continue
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            out.append(t)
    return out
