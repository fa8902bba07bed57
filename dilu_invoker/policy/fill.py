"""Proportional division of an amount with per-item caps ("water filling")."""

from __future__ import annotations

from collections.abc import Sequence

from dilu_invoker.policy.types import EPS


def water_fill(
    total: float, weights: Sequence[float], caps: Sequence[float]
) -> list[float]:
    """Divide `total` in proportion to `weights`, never giving an item more than its cap.

    What a capped item cannot take is shared among the others, again by weight. When every weight is
    zero the split is equal. The result sums to min(total, Σ caps) and each item is within [0, cap].
    """
    n = len(weights)
    if len(caps) != n:
        raise ValueError("weights and caps must have the same length")
    alloc = [0.0] * n
    open_ = [i for i in range(n) if caps[i] > EPS]
    remaining = max(0.0, total)
    while remaining > EPS and open_:
        wsum = sum(max(0.0, weights[i]) for i in open_)
        equal = wsum <= EPS
        portion = {
            i: remaining * (1.0 / len(open_) if equal else max(0.0, weights[i]) / wsum)
            for i in open_
        }
        capped = [i for i in open_ if alloc[i] + portion[i] >= caps[i] - EPS]
        if not capped:
            for i in open_:
                alloc[i] += portion[i]
            break
        for i in capped:
            remaining -= caps[i] - alloc[i]
            alloc[i] = caps[i]
        open_ = [i for i in open_ if i not in capped]
    return alloc
