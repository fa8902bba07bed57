"""Profiler search: which ⟨SM share, batch⟩ points to measure, and the `<request, limit>` and batch.

Pure: the caller passes `measure(share, batch) -> Measurement` (a real GPU run in the profiler, a
formula in tests); every point is measured at most once. Shares are on a grid of `step` (10%).

* **Hybrid growth search** (Dilu's HGSS, `gpu-sharing.md` §4.5), for latency-critical functions:
  start at the smallest share and batch 1; add one step of share until the SLO is met; then double
  the batch while throughput per share improves, adding share (one step at a time) when the SLO
  breaks at the larger batch. The best point found is the *request* and the batch.
* **Limit**: from the request, at the chosen batch, add steps while throughput still grows by at
  least `limit_gain` per step: more share than that buys (almost) nothing for this batch.
* **Grid** (`exhaustive`): every share × batch; the optimum is the best throughput per share
  among points meeting the SLO — the yardstick the search is judged against.
* **Training** (best-effort, no SLO): at the given batch, the limit is the smallest share giving at
  least `training_fraction` of the full-GPU throughput (Dilu's binary search, 98%), the request the
  share with the best throughput per share at or below it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Measurement:
    share: float
    batch: int
    latency_ms: float
    """One batch (one training iteration), e.g. the median over the measurement window."""
    throughput_rps: float
    """Requests (samples) per second sustained at this point."""

    @property
    def efficiency(self) -> float:
        """Throughput per unit of share (Dilu's TE)."""
        return self.throughput_rps / self.share if self.share > 0 else 0.0

    def meets(self, slo_ms: float | None) -> bool:
        return slo_ms is None or self.latency_ms <= slo_ms


Measure = Callable[[float, int], Measurement]


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchConfig:
    step: float = 0.1
    """Share grid step; shares are step, 2·step, …, 1."""
    max_batch: int = 64
    batches: tuple[int, ...] | None = None
    """The batch sizes the grid (and the doubling) may use; None: powers of two up to max_batch."""
    limit_gain: float = 0.10
    """Raise the limit while one more step of share adds at least this fraction of throughput. 0.05 put
    every H200 profile's limit at 0.8-1.0 (batch-64 inference keeps creeping up to the whole GPU), so a
    GPU's Σ limit ≤ 1.5 could not pair two instances; at 0.10 the limit stops at the knee (MPS profiles:
    ResNet-50 0.7, BERT-base 0.5)."""
    min_gain: float = 0.0
    """Doubling the batch continues only if efficiency improves by more than this fraction."""
    training_fraction: float = 0.98

    def __post_init__(self) -> None:
        if not (0 < self.step <= 1 and math.isfinite(self.step)):
            raise ValueError(f"step must be in (0, 1], got {self.step!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.batches is not None and (not self.batches or min(self.batches) < 1):
            raise ValueError("batches must be non-empty and >= 1")
        if not 0 <= self.limit_gain < 1 or not 0 <= self.min_gain < 1:
            raise ValueError("limit_gain and min_gain must be in [0, 1)")
        if not 0 < self.training_fraction <= 1:
            raise ValueError("training_fraction must be in (0, 1]")

    def shares(self) -> tuple[float, ...]:
        n = round(1.0 / self.step)
        out = [round(min(1.0, k * self.step), 6) for k in range(1, n + 1)]
        if out[-1] < 1.0:
            out.append(1.0)
        return tuple(out)

    def batch_sizes(self) -> tuple[int, ...]:
        if self.batches is not None:
            return tuple(sorted(set(self.batches)))
        out, b = [], 1
        while b <= self.max_batch:
            out.append(b)
            b *= 2
        return tuple(out)


@dataclass(frozen=True, slots=True)
class SearchResult:
    method: str
    """`hybrid-growth`, `grid` or `training`."""
    request: float
    limit: float
    batch: int
    feasible: bool
    """False when no probed point met the SLO (the result is then the full GPU at batch 1)."""
    best: Measurement | None
    probes: tuple[Measurement, ...]
    """Every point measured, in order."""
    reason: str

    @property
    def probe_count(self) -> int:
        return len(self.probes)


@dataclass(slots=True)
class _Memo:
    measure: Measure
    seen: dict[tuple[float, int], Measurement] = field(default_factory=dict)
    order: list[Measurement] = field(default_factory=list)

    def __call__(self, share: float, batch: int) -> Measurement:
        key = (round(share, 6), batch)
        m = self.seen.get(key)
        if m is None:
            m = self.measure(key[0], batch)
            self.seen[key] = m
            self.order.append(m)
        return m


def _limit_from(
    memo: _Memo, shares: Sequence[float], request: float, batch: int, gain: float
) -> float:
    i = _index(shares, request)
    limit = shares[i]
    prev = memo(shares[i], batch).throughput_rps
    for s in shares[i + 1 :]:
        t = memo(s, batch).throughput_rps
        if t < prev * (1 + gain):
            break
        limit, prev = s, t
    return limit


def _index(shares: Sequence[float], share: float) -> int:
    return min(range(len(shares)), key=lambda k: abs(shares[k] - share))


def hybrid_growth_search(
    measure: Measure, *, slo_ms: float, config: SearchConfig | None = None
) -> SearchResult:
    config = config or SearchConfig()
    shares = config.shares()
    batches = config.batch_sizes()
    memo = _Memo(measure)
    i = 0
    m = memo(shares[i], batches[0])
    while not m.meets(slo_ms) and i + 1 < len(shares):
        i += 1
        m = memo(shares[i], batches[0])
    if not m.meets(slo_ms):
        return SearchResult(
            method="hybrid-growth",
            request=1.0,
            limit=1.0,
            batch=batches[0],
            feasible=False,
            best=None,
            probes=tuple(memo.order),
            reason=f"batch {batches[0]} misses the SLO {slo_ms:g} ms even with the whole GPU "
            f"({m.latency_ms:.1f} ms)",
        )
    best, best_i = m, i
    why = f"SLO met at {shares[i]:.2f} with batch {batches[0]}"
    for b in batches[1:]:
        j = best_i
        cand = memo(shares[j], b)
        while not cand.meets(slo_ms) and j + 1 < len(shares):
            j += 1
            cand = memo(shares[j], b)
        if not cand.meets(slo_ms):
            why += f"; batch {b} misses the SLO even at the whole GPU: stop"
            break
        if cand.efficiency <= best.efficiency * (1 + config.min_gain):
            why += (
                f"; batch {b} at {shares[j]:.2f} is no more efficient "
                f"({cand.efficiency:.0f} vs {best.efficiency:.0f} req/s per share): stop"
            )
            break
        best, best_i = cand, j
        why += f"; batch {b} at {shares[j]:.2f} ({cand.efficiency:.0f} req/s per share)"
    limit = _limit_from(memo, shares, best.share, best.batch, config.limit_gain)
    return SearchResult(
        method="hybrid-growth",
        request=best.share,
        limit=limit,
        batch=best.batch,
        feasible=True,
        best=best,
        probes=tuple(memo.order),
        reason=why + f"; limit {limit:.2f} (throughput grows < {config.limit_gain:.0%} per step beyond)",
    )


def grid_search(
    measure: Measure, *, slo_ms: float | None, config: SearchConfig | None = None
) -> SearchResult:
    """Measure every share × batch; the optimum is the most throughput per share within the SLO."""
    config = config or SearchConfig()
    shares = config.shares()
    memo = _Memo(measure)
    for b in config.batch_sizes():
        for s in shares:
            memo(s, b)
    ok = [m for m in memo.order if m.meets(slo_ms)]
    if not ok:
        return SearchResult(
            method="grid",
            request=1.0,
            limit=1.0,
            batch=config.batch_sizes()[0],
            feasible=False,
            best=None,
            probes=tuple(memo.order),
            reason="no point of the grid meets the SLO",
        )
    # Ties: the smaller share, then the smaller batch (less to reserve, lower latency).
    best = max(ok, key=lambda m: (round(m.efficiency, 9), -m.share, -m.batch))
    limit = _limit_from(memo, shares, best.share, best.batch, config.limit_gain)
    return SearchResult(
        method="grid",
        request=best.share,
        limit=limit,
        batch=best.batch,
        feasible=True,
        best=best,
        probes=tuple(memo.order),
        reason=f"best of {len(memo.order)} points: {best.throughput_rps:.0f} req/s at "
        f"{best.share:.2f} with batch {best.batch}",
    )


def training_search(
    measure: Measure, *, batch: int, config: SearchConfig | None = None
) -> SearchResult:
    """Binary search for the smallest share reaching `training_fraction` of full throughput."""
    config = config or SearchConfig()
    shares = config.shares()
    memo = _Memo(measure)
    full = memo(shares[-1], batch).throughput_rps
    target = config.training_fraction * full
    lo, hi = 0, len(shares) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if memo(shares[mid], batch).throughput_rps >= target:
            hi = mid
        else:
            lo = mid + 1
    limit = shares[hi]
    probed = [m for m in memo.order if m.share <= limit + 1e-9]
    best = max(probed, key=lambda m: (round(m.efficiency, 9), -m.share))
    return SearchResult(
        method="training",
        request=best.share,
        limit=limit,
        batch=batch,
        feasible=True,
        best=best,
        probes=tuple(memo.order),
        reason=f"limit {limit:.2f}: smallest share with ≥ {config.training_fraction:.0%} of the "
        f"full-GPU {full:.0f} samples/s; request {best.share:.2f}: best samples/s per share probed",
    )


__all__ = [
    "Measure",
    "Measurement",
    "SearchConfig",
    "SearchResult",
    "grid_search",
    "hybrid_growth_search",
    "training_search",
]
