"""Open-loop arrival schedules of the vertical benchmark (stdlib only: the workers and their stand-ins share it)."""

from __future__ import annotations

import random


def arrivals(phases: list[list[float]], seed: int, start: float) -> list[float]:
    """Poisson arrival times from ``start``: each phase is ``[seconds, requests per second]``."""
    rng = random.Random(seed)
    out: list[float] = []
    t = start
    for seconds, rate in phases:
        end = t + seconds
        if rate <= 0:
            t = end
            continue
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            out.append(t)
    return out
