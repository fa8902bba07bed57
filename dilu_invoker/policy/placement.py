"""Placement: which GPU(s) of which invoker a new instance goes to. Filter → score → pick.

* **Filters** say whether one GPU can take the instance at all (typed status + reason).
* **Scorers** rate a GPU that passed, 0–100; a strategy combines them with weights.
* **Strategies** name a set of filters, weights and how the instance's share is then run
  (`dilu`, and the evaluation's baselines `exclusive`, `infless-l`, `infless-r`, `fastgs`).
  An unknown strategy name fails when the `PlacementConfig` is built, i.e. at start-up.

Speed: a decision never walks the whole cluster. Lit GPUs are visited from the snapshot's Σ-request
index, tightest fit first, and only those whose Σ request leaves room (the filters' bound); scoring
stops after `candidate_limit` GPUs have passed the filters (as kube-scheduler scores a sample of
feasible nodes). Unlit GPUs are all empty, so one per invoker stands for the rest, and they are not
looked at when no unlit GPU could outscore the best lit one.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import accumulate, combinations, compress, repeat
from operator import attrgetter, sub
from typing import Any

from dilu_invoker.policy.cluster import (
    BUCKETS,
    SPLIT_GAMMA,
    SPLIT_OMEGA,
    ClusterSnapshot,
    LitRoom,
    NodeRoom,
    _node_room,
)
from dilu_invoker.policy.types import (
    EPS,
    GpuRef,
    GpuState,
    InstanceClass,
    PlacedInstance,
    Profile,
    SharePair,
)


class Affinity(StrEnum):
    """Where instances of one function go relative to each other."""

    SPREAD = "spread"
    """Prefer invokers (and GPUs) without the function: one node's death does not take it down."""
    PACK = "pack"
    """Prefer invokers that already run the function (e.g. to share cached weights)."""
    NONE = "none"


class ShareMode(StrEnum):
    """How the placed instance's SM share is run afterwards; what the strategy reserved for it."""

    DYNAMIC = "dynamic"
    """The vertical policy moves the share between request and limit (Dilu)."""
    STATIC_LIMIT = "static-limit"
    """Fixed at the limit, reserved in full: Σ limit ≤ 1 (INFless-l)."""
    STATIC_REQUEST = "static-request"
    """Fixed at the request: Σ request ≤ 1, never more than the request (INFless-r)."""
    SPATIAL_REQUEST = "spatial-request+time-quota"
    """Static SM partition at the request plus time slices up to the limit when idle (FaST-GShare)."""
    WHOLE_GPU = "whole-gpu"
    """The instance owns its GPUs outright (exclusive)."""
    PRIORITY = "priority"
    """Two priority classes (TGS): latency-critical (production) runs unthrottled on the whole GPU,
    best-effort (opportunistic) takes what production leaves; decided at run time."""

    def static_share(self, pair: SharePair) -> float | None:
        """The fixed share the instance runs at, or None when it is decided at run time."""
        if self is ShareMode.DYNAMIC or self is ShareMode.PRIORITY:
            return None
        if self is ShareMode.STATIC_LIMIT:
            return pair.limit
        if self is ShareMode.WHOLE_GPU:
            return 1.0
        return pair.request


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementRequest:
    """A new instance to place; `request`, `limit` and `memory_mib` are per GPU."""

    instance_id: str
    function: str
    cls: InstanceClass
    request: float
    limit: float
    memory_mib: float
    gpus: int = 1
    """GPUs needed, all on one invoker (a gang, e.g. data-parallel training)."""
    profile: Profile | None = None
    affinity: Affinity | None = None
    """Per-function override of `PlacementConfig.affinity`."""
    avoid_gpus: frozenset[GpuRef] = frozenset()
    avoid_invokers: frozenset[str] = frozenset()
    only_invoker: str | None = None
    """Consider this invoker's GPUs only (compaction moving a piece of a split instance: its
    pipeline stages stay on one node)."""
    lit_only: bool = False
    """Never light a new GPU (compaction moves, or when the operator forbids growth)."""
    max_parts: int | None = None
    """A one-GPU instance whose memory may be split across up to this many GPUs of one invoker
    (an LLM served as pipeline stages, as Dilu does); None: `PlacementConfig.llm_max_parts` for
    `llm`, 1 (never split) for the other classes. Only strategies that split use it."""
    weights_mib: float = 0.0
    """How much of `memory_mib` is read-only weights that the instances of `weights_group` on one GPU
    share: on a GPU holding the group (`GpuState.weight_groups`) the instance needs `memory_mib −
    weights_mib`, and such GPUs are tried first (see `place`). 0: it shares nothing."""
    weights_group: str = ""
    """The sharing group of its weights (a function revision, `GpuState.weight_groups`)."""

    def __post_init__(self) -> None:
        # PlacedInstance validates id, shares, memory and width the same way.
        self.to_instance()
        if self.max_parts is not None and self.max_parts < 1:
            raise ValueError(f"max_parts must be >= 1, got {self.max_parts}")
        if self.gpus > 1 and (self.max_parts or 1) > 1:
            raise ValueError("a gang (gpus > 1) cannot also be split into parts")
        if self.weights_mib:
            if not (math.isfinite(self.weights_mib) and 0 < self.weights_mib <= self.memory_mib):
                raise ValueError(f"weights_mib must be within 0..memory_mib ({self.memory_mib:g}), "
                                 f"got {self.weights_mib!r}")
            if not self.weights_group:
                raise ValueError("weights_mib needs a weights_group")
            if self.gpus > 1:
                raise ValueError("a gang (gpus > 1) shares no weights")

    def parts_allowed(self, config: PlacementConfig) -> int:
        """How many GPUs this request's memory may be split across under `config`."""
        if self.gpus > 1 or not config.strategy_spec().splits:
            return 1
        if self.max_parts is not None:
            return self.max_parts
        return config.llm_max_parts if self.cls is InstanceClass.LLM else 1

    def to_instance(self) -> PlacedInstance:
        return PlacedInstance(
            id=self.instance_id,
            function=self.function,
            cls=self.cls,
            request=self.request,
            limit=self.limit,
            memory_mib=self.memory_mib,
            gpus=self.gpus,
            profile=self.profile,
        )


# -- filters -------------------------------------------------------------------------------------


class FilterStatus(StrEnum):
    SUCCESS = "success"
    UNSCHEDULABLE = "unschedulable"


@dataclass(frozen=True, slots=True)
class FilterResult:
    status: FilterStatus
    filter: str
    reason: str

    @property
    def ok(self) -> bool:
        return self.status is FilterStatus.SUCCESS


GpuPredicate = Callable[[GpuState, PlacementRequest, "PlacementConfig"], bool]
GpuExplain = Callable[[GpuState, PlacementRequest, "PlacementConfig"], str]
ScanBound = Callable[[PlacementRequest, "PlacementConfig"], float]


@dataclass(frozen=True, slots=True, eq=False)
class Filter:
    """A yes/no test of one GPU. `bound`, when given, is the largest Σ request a passing lit GPU can
    have: placement skips index buckets above it without looking at their GPUs.

    Filters are the registered singletons of `FILTERS`, compared by identity (`f in filters` on the
    per-decision path stays at C speed)."""

    name: str
    description: str
    passes: GpuPredicate
    explain: GpuExplain
    bound: ScanBound | None = None

    def check(
        self, gpu: GpuState, request: PlacementRequest, config: PlacementConfig
    ) -> FilterResult:
        if self.passes(gpu, request, config):
            return FilterResult(FilterStatus.SUCCESS, self.name, "fits")
        return FilterResult(
            FilterStatus.UNSCHEDULABLE, self.name, self.explain(gpu, request, config)
        )


def _f_schedulable(g: GpuState, r: PlacementRequest, c: PlacementConfig) -> bool:
    return g.schedulable


def _f_avoid(g: GpuState, r: PlacementRequest, c: PlacementConfig) -> bool:
    if r.only_invoker is not None and g.ref.invoker != r.only_invoker:
        return False
    if not (r.avoid_gpus or r.avoid_invokers):
        return True
    return g.ref not in r.avoid_gpus and g.ref.invoker not in r.avoid_invokers


def _f_sm_request(g: GpuState, r: PlacementRequest, c: PlacementConfig) -> bool:
    return g.used_request + r.request <= c.omega + EPS


def _f_sm_limit(g: GpuState, r: PlacementRequest, c: PlacementConfig) -> bool:
    return g.used_limit + r.limit <= c.gamma + EPS


def _f_sm_limit_static(g: GpuState, r: PlacementRequest, c: PlacementConfig) -> bool:
    return g.used_limit + r.limit <= 1.0 + EPS


def holds_weights(g: GpuState, r: PlacementRequest) -> bool:
    """Whether `g` holds `r`'s shared weights already (it then needs only the rest of its memory)."""
    return bool(r.weights_mib) and (r.weights_group, r.weights_mib) in g.weight_groups


def memory_need(g: GpuState, r: PlacementRequest) -> float:
    """The memory `r` adds to `g`: its whole memory, less its weights where `g` holds them."""
    return r.memory_mib - r.weights_mib if holds_weights(g, r) else r.memory_mib


def _f_memory(g: GpuState, r: PlacementRequest, c: PlacementConfig) -> bool:
    if r.weights_mib and (r.weights_group, r.weights_mib) in g.weight_groups:
        return g.used_memory + r.memory_mib - r.weights_mib <= g.memory_mib * (1.0 + EPS)
    return g.used_memory + r.memory_mib <= g.memory_mib * (1.0 + EPS)


def _f_exclusive(g: GpuState, r: PlacementRequest, c: PlacementConfig) -> bool:
    return not g.instances


def _f_priority_pair(g: GpuState, r: PlacementRequest, c: PlacementConfig) -> bool:
    if r.cls.latency_critical:
        return g.n_latency == 0
    return g.n_best_effort == 0


FILTERS: dict[str, Filter] = {
    f.name: f
    for f in (
        Filter(
            "schedulable",
            "the GPU (or its invoker) is not draining",
            _f_schedulable,
            lambda g, r, c: f"{g.ref} is draining",
        ),
        Filter(
            "avoid",
            "the request does not exclude this GPU or its invoker (nor keep to another invoker)",
            _f_avoid,
            lambda g, r, c: f"{g.ref} is excluded by the request",
        ),
        Filter(
            "sm-request",
            "Σ request + request ≤ ω (requests are guaranteed, never oversubscribed)",
            _f_sm_request,
            lambda g, r, c: (
                f"{g.ref}: Σ request {g.used_request:.2f} + {r.request:.2f} > ω {c.omega:.2f}"
            ),
            lambda r, c: c.omega - r.request,
        ),
        Filter(
            "sm-limit",
            "Σ limit + limit ≤ γ (limits oversubscribed by γ; vertical feedback protects)",
            _f_sm_limit,
            lambda g, r, c: (
                f"{g.ref}: Σ limit {g.used_limit:.2f} + {r.limit:.2f} > γ {c.gamma:.2f}"
            ),
            # Σ request ≤ Σ limit, so a GPU passing this filter has Σ request ≤ γ − limit.
            lambda r, c: c.gamma - r.limit,
        ),
        Filter(
            "sm-limit-static",
            "Σ limit + limit ≤ 1 (limits reserved in full, no oversubscription)",
            _f_sm_limit_static,
            lambda g, r, c: f"{g.ref}: Σ limit {g.used_limit:.2f} + {r.limit:.2f} > 1",
            lambda r, c: 1.0 - r.limit,
        ),
        Filter(
            "memory",
            "Σ memory + memory ≤ GPU memory (memory − weights where the GPU holds the instance's shared weights)",
            _f_memory,
            lambda g, r, c: (
                f"{g.ref}: memory {g.used_memory:.0f} + {memory_need(g, r):.0f} MiB > {g.memory_mib:.0f} MiB"
                + (f" (its {r.weights_mib:.0f} MiB of weights shared)" if holds_weights(g, r) else "")
            ),
        ),
        Filter(
            "exclusive",
            "the GPU holds nothing (whole-GPU allocation)",
            _f_exclusive,
            lambda g, r, c: f"{g.ref} already holds {len(g.instances)} instance(s)",
            lambda r, c: -1.0,
        ),
        Filter(
            "priority-pair",
            "at most one latency-critical (production) and one best-effort (opportunistic) instance",
            _f_priority_pair,
            lambda g, r, c: (
                f"{g.ref} already holds a "
                f"{'latency-critical' if r.cls.latency_critical else 'best-effort'} instance"
            ),
        ),
    )
}


_F_SM_REQUEST, _F_SM_LIMIT = FILTERS["sm-request"], FILTERS["sm-limit"]
_F_SM_LIMIT_STATIC, _F_MEMORY = FILTERS["sm-limit-static"], FILTERS["memory"]
#: Filters that read of a request only what a piece copies from its instance (not its size).
_SIZE_FREE = frozenset({"schedulable", "avoid", "exclusive", "priority-pair"})


# -- scorers -------------------------------------------------------------------------------------

GpuScore = Callable[
    [GpuState, PlacementRequest, ClusterSnapshot, "PlacementConfig"], float
]
UnlitBound = Callable[[PlacementRequest, ClusterSnapshot, "PlacementConfig"], float]


@dataclass(frozen=True, slots=True)
class Scorer:
    """Rates a GPU that passed the filters, 0 (worst) to 100 (best). `unlit_bound` is the most any
    unlit (empty) GPU can score, so placement can skip unlit GPUs that cannot win."""

    name: str
    description: str
    score: GpuScore
    unlit_bound: UnlitBound


def _s_lit(
    g: GpuState, r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    return 100.0 if g.instances else 0.0


def _frag_score(
    used_request: float, used_memory: float, capacity: float, c: PlacementConfig
) -> float:
    frag = c.sm_weight * (1.0 - used_request) + c.memory_weight * (
        1.0 - used_memory / capacity
    )
    return min(100.0, max(0.0, 100.0 * (1.0 - frag)))


def _s_fragmentation(
    g: GpuState, r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    if r.weights_mib and (r.weights_group, r.weights_mib) in g.weight_groups:
        return _frag_score(
            g.used_request + r.request, g.used_memory + r.memory_mib - r.weights_mib, g.memory_mib, c
        )
    return _frag_score(
        g.used_request + r.request, g.used_memory + r.memory_mib, g.memory_mib, c
    )


def _s_sm_fit(
    g: GpuState, r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    return 100.0 * min(1.0, g.used_request + r.request)


def _s_limit_fit(
    g: GpuState, r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    return 100.0 * min(1.0, g.used_limit + r.limit)


def _s_dominant_fit(
    g: GpuState, r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    # Fit on the resource that runs out first: where memory cannot bind (small instances on a large
    # GPU), a weighted sum would let the non-binding memory pick among GPUs that fit SM equally.
    sm = (g.used_request + r.request) / c.omega
    memory = (g.used_memory + memory_need(g, r)) / g.memory_mib
    return 100.0 * min(1.0, max(sm, memory))


def _complementarity(g: GpuState, r: PlacementRequest, c: PlacementConfig, *, lc_seeks: bool) -> float:
    """100·(w·class part + (1 − w)·profile part), 50 on an empty GPU. Class part: the share of neighbours
    of the other class; for a latency-critical request 0.5 (neutral) unless `lc_seeks`."""
    n = len(g.instances)
    if n == 0:
        return 50.0
    if r.cls.latency_critical:
        class_part = g.n_best_effort / n if lc_seeks else 0.5
    else:
        class_part = g.n_latency / n
    profiled = g.n_compute + g.n_memory
    if r.profile is None or profiled == 0:
        profile_part = 0.5
    else:
        opposite = g.n_memory if r.profile is Profile.COMPUTE else g.n_compute
        profile_part = opposite / profiled
    w = c.complement_class_weight
    return 100.0 * (w * class_part + (1.0 - w) * profile_part)


def _s_complementarity(
    g: GpuState, r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    return _complementarity(g, r, c, lc_seeks=True)


def _s_complementarity_be(
    g: GpuState, r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    # A best-effort job leaves before the latency-critical neighbours it seeks, so their GPU is lit
    # anyway; a latency-critical instance drawn beside a job outlives it and keeps that GPU lit.
    return _complementarity(g, r, c, lc_seeks=False)


def _s_affinity(
    g: GpuState, r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    mode = r.affinity or c.affinity
    if mode is Affinity.NONE:
        return 50.0
    count = cl.function_count(r.function, g.ref.invoker)
    if mode is Affinity.SPREAD:
        score = 100.0 / (1 + count)
        # Two instances of one function on one GPU compete for the same thing at the same time.
        if count and any(i.function == r.function for i in g.instances):
            score *= 0.5
        return score
    return 100.0 * count / (1 + count)


def _unlit_fragmentation(
    r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    return _frag_score(r.request, r.memory_mib, cl.min_memory_mib, c)


def _unlit_dominant_fit(
    r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    return 100.0 * min(1.0, max(r.request / c.omega, r.memory_mib / cl.min_memory_mib))


def _unlit_affinity(
    r: PlacementRequest, cl: ClusterSnapshot, c: PlacementConfig
) -> float:
    return 50.0 if (r.affinity or c.affinity) is Affinity.NONE else 100.0


SCORERS: dict[str, Scorer] = {
    s.name: s
    for s in (
        Scorer(
            "lit",
            "100 on an already-lit GPU, 0 on one that would have to be lit (Dilu's tier order)",
            _s_lit,
            lambda r, cl, c: 0.0,
        ),
        Scorer(
            "fragmentation",
            "100·(1 − (sm_weight·SM_frag + memory_weight·Mem_frag)) after placing: best fit",
            _s_fragmentation,
            _unlit_fragmentation,
        ),
        Scorer(
            "sm-fit",
            "100·Σ request after placing: best fit on SM requests only",
            _s_sm_fit,
            lambda r, cl, c: 100.0 * min(1.0, r.request),
        ),
        Scorer(
            "dominant-fit",
            "100·max(Σ request / ω, Σ memory / GPU memory) after placing: best fit on the resource that "
            "runs out first",
            _s_dominant_fit,
            _unlit_dominant_fit,
        ),
        Scorer(
            "limit-fit",
            "100·Σ limit after placing: best fit on reserved limits",
            _s_limit_fit,
            lambda r, cl, c: 100.0 * min(1.0, r.limit),
        ),
        Scorer(
            "complementarity",
            "share of neighbours of the other class (inference beside training) and opposite profile",
            _s_complementarity,
            lambda r, cl, c: 50.0,
        ),
        Scorer(
            "complementarity-be",
            "as complementarity, with the class part for best-effort requests only (training beside "
            "inference; neutral for a latency-critical request, which would outlive a job it joins)",
            _s_complementarity_be,
            lambda r, cl, c: 50.0,
        ),
        Scorer(
            "affinity",
            "spread: 100/(1+n) for n instances of the function on the invoker (halved on a GPU holding "
            "one); pack: 100·n/(1+n)",
            _s_affinity,
            _unlit_affinity,
        ),
    )
}


# -- strategies ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    description: str
    filters: tuple[str, ...]
    weights: tuple[tuple[str, float], ...]
    share_mode: ShareMode
    splits: bool = False
    """Whether it may split a one-GPU instance's memory across GPUs of one invoker (Dilu's LLMs)."""

    def __post_init__(self) -> None:
        for f in self.filters:
            if f not in FILTERS:
                raise ValueError(
                    f"strategy {self.name}: unknown filter {f!r}; known: {sorted(FILTERS)}"
                )
        _check_weights(self.weights, f"strategy {self.name}")


def _check_weights(weights: tuple[tuple[str, float], ...], where: str) -> None:
    if not weights:
        raise ValueError(f"{where}: needs at least one scorer weight")
    for name, w in weights:
        if name not in SCORERS:
            raise ValueError(
                f"{where}: unknown scorer {name!r}; known: {sorted(SCORERS)}"
            )
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(
                f"{where}: weight of {name} must be a finite number >= 0, got {w!r}"
            )


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
    """Add a strategy by name (at import / start-up time); a name can be registered once."""
    if strategy.name in STRATEGIES:
        raise ValueError(f"strategy {strategy.name!r} is already registered")
    STRATEGIES[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown placement strategy {name!r}; known: {sorted(STRATEGIES)}"
        ) from None


_BASE_FILTERS = ("schedulable", "avoid")

register_strategy(
    Strategy(
        "dilu",
        "Dilu: Σ request ≤ ω, Σ limit ≤ γ, memory; lit GPUs first, then best fit on 0.6·SM + 0.4·memory "
        "fragmentation, then complementary neighbours and spread; shares scaled at run time",
        _BASE_FILTERS + ("sm-request", "sm-limit", "memory"),
        (
            ("lit", 10.0),
            ("fragmentation", 4.0),
            ("complementarity", 1.0),
            ("affinity", 1.0),
        ),
        ShareMode.DYNAMIC,
        splits=True,
    )
)
register_strategy(
    Strategy(
        "dilu-lifetime",
        "dilu with lifetimes in mind: best fit on the resource that runs out first, and only training drawn "
        "beside inference (an inference instance beside a job outlives it and keeps the GPU lit); serves "
        "the day trace as densely as a static MPS split, packs LLM-heavy mixes looser (docs/policies.md)",
        _BASE_FILTERS + ("sm-request", "sm-limit", "memory"),
        (
            ("lit", 10.0),
            ("dominant-fit", 4.0),
            ("complementarity-be", 1.0),
            ("affinity", 1.0),
        ),
        ShareMode.DYNAMIC,
        splits=True,
    )
)
register_strategy(
    Strategy(
        "exclusive",
        "one instance per whole GPU (a gang takes that many empty GPUs of one invoker)",
        _BASE_FILTERS + ("exclusive", "memory"),
        (("affinity", 1.0),),
        ShareMode.WHOLE_GPU,
    )
)
register_strategy(
    Strategy(
        "infless-l",
        "INFless-l: static share at the limit, Σ limit ≤ 1, memory; lit first, best fit on limits",
        _BASE_FILTERS + ("sm-limit-static", "memory"),
        (("lit", 10.0), ("limit-fit", 4.0)),
        ShareMode.STATIC_LIMIT,
    )
)
register_strategy(
    Strategy(
        "infless-r",
        "INFless-r: static share at the request, Σ request ≤ ω, memory; lit first, best fit on SM requests",
        _BASE_FILTERS + ("sm-request", "memory"),
        (("lit", 10.0), ("sm-fit", 4.0)),
        ShareMode.STATIC_REQUEST,
    )
)
register_strategy(
    Strategy(
        "fastgs",
        "FaST-GShare: static SM partition at the request (partitions never overlap: Σ request ≤ ω) plus a "
        "time quota up to the limit that reserves nothing; lit first, best fit on SM and memory",
        _BASE_FILTERS + ("sm-request", "memory"),
        (("lit", 10.0), ("fragmentation", 4.0)),
        ShareMode.SPATIAL_REQUEST,
    )
)
register_strategy(
    Strategy(
        "tgs",
        "TGS: one production (latency-critical) and one opportunistic (best-effort) instance per GPU, "
        "memory; lit first, best fit on SM and memory; production runs unthrottled, opportunistic "
        "takes what it leaves",
        _BASE_FILTERS + ("priority-pair", "memory"),
        (("lit", 10.0), ("fragmentation", 4.0)),
        ShareMode.PRIORITY,
    )
)


# -- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementConfig:
    """Every constant of placement; see docs/policies.md for why each default."""

    strategy: str = "dilu"
    omega: float = 1.0
    """ω: Σ request per GPU may reach ω·1. Dilu's 1: requests are guarantees."""
    gamma: float = math.inf
    """γ: Σ limit per GPU may reach γ·1. The default, no bound: placement admits by request (ω) and memory,
    and a limit is the ceiling the vertical policy may grant from idle neighbours' share, not a
    reservation (docs/policies.md §2). A finite γ (Dilu's 1.5) keeps the `sm-limit` filter: headroom
    for bursts reserved at placement, paid for in GPUs lit."""
    sm_weight: float = 0.6
    """Weight of SM fragmentation in the fragmentation scorer (Dilu's 0.6)."""
    memory_weight: float = 0.4
    """Weight of memory fragmentation in the fragmentation scorer (Dilu's 0.4)."""
    affinity: Affinity = Affinity.SPREAD
    """Default placement of a function's instances relative to each other."""
    complement_class_weight: float = 0.6
    """In the complementarity scorer, the weight of class (vs. 1 − it for compute/memory profile)."""
    weights: tuple[tuple[str, float], ...] | None = None
    """Scorer weights overriding the strategy's, e.g. (("lit", 10), ("fragmentation", 4))."""
    candidate_limit: int = 64
    """Stop scoring once this many lit GPUs (or unlit invokers) passed the filters."""
    report_candidates: int = 3
    """How many of the best candidates a decision lists with their scores."""
    llm_max_parts: int = 1
    """Strategies that split (dilu) may split an `llm` instance's memory across up to this many
    GPUs of one invoker when it would otherwise light a GPU. 1: never (the live default: the
    action must be able to run as pipeline stages); Dilu's artifact splits within a node."""
    min_part_mib: float = 2048.0
    """The smallest piece of a split instance: a stage must hold at least a few layers."""
    light_split_min_share: float | None = None
    """Where an instance that may split would light a GPU whole (no lit GPU takes it whole, no lit
    GPUs of one invoker hold its pieces), split it over lit GPUs of one invoker plus one new GPU of
    that invoker when the lit GPUs take at least this share of its memory (`_place_split_lighting`).
    None: never, it lights a GPU whole (the default, live and simulated)."""
    split_node_fit: bool = False
    """Where memory binds the cluster (Σ memory / capacity ≥ Σ request), split an instance over the lit
    GPUs of the invoker left with the least free memory once it is placed (node-level best fit), then
    the fewest pieces (`_place_split_node_fit`). False: the invoker where it needs the fewest pieces
    (the default, live and simulated)."""

    def __post_init__(self) -> None:
        get_strategy(self.strategy)
        if not (math.isfinite(self.omega) and 0 < self.omega):
            raise ValueError(f"omega must be > 0, got {self.omega!r}")
        if not self.gamma >= self.omega:  # NaN fails too; +inf is "no bound"
            raise ValueError(
                f"gamma must be >= omega ({self.omega}), got {self.gamma!r}"
            )
        for name in ("sm_weight", "memory_weight", "complement_class_weight"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"{name} must be between 0 and 1, got {v!r}")
        if self.weights is not None:
            _check_weights(self.weights, "PlacementConfig.weights")
        if self.candidate_limit < 1:
            raise ValueError(
                f"candidate_limit must be >= 1, got {self.candidate_limit}"
            )
        if self.report_candidates < 0:
            raise ValueError(
                f"report_candidates must be >= 0, got {self.report_candidates}"
            )
        if self.llm_max_parts < 1:
            raise ValueError(f"llm_max_parts must be >= 1, got {self.llm_max_parts}")
        if not (math.isfinite(self.min_part_mib) and self.min_part_mib > 0):
            raise ValueError(f"min_part_mib must be > 0, got {self.min_part_mib!r}")
        share = self.light_split_min_share
        if share is not None and not (0.0 <= share < 1.0):  # NaN fails too
            raise ValueError(f"light_split_min_share must be None or within [0, 1), got {share!r}")

    def strategy_spec(self) -> Strategy:
        return get_strategy(self.strategy)

    def filters(self) -> tuple[Filter, ...]:
        """The strategy's filters, in order; without `sm-limit` when γ is unbounded (it would pass every
        GPU, and the scans' limit indexes are then not needed)."""
        names = self.strategy_spec().filters
        if math.isinf(self.gamma):
            names = tuple(n for n in names if n != "sm-limit")
        return tuple(FILTERS[name] for name in names)

    def scorer_weights(self) -> tuple[tuple[Scorer, float], ...]:
        pairs = (
            self.weights if self.weights is not None else self.strategy_spec().weights
        )
        return tuple((SCORERS[name], w) for name, w in pairs if w > 0)


# -- decisions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CandidateScore:
    gpus: tuple[GpuRef, ...]
    total: float
    scores: tuple[tuple[str, float], ...]
    """Per scorer, the 0–100 score (mean over the gang's GPUs)."""
    lights: int
    """How many of these GPUs are unlit now."""
    reason: str


@dataclass(frozen=True, slots=True)
class Rejection:
    filter: str
    count: int
    example: str


@dataclass(frozen=True, slots=True)
class PlacementPart:
    """One piece of a split instance: the GPU and what is placed there (`instance.part_of` set)."""

    gpu: GpuRef
    instance: PlacedInstance


def part_id(instance_id: str, index: int) -> str:
    """The id placement gives piece `index` of a split instance."""
    return f"{instance_id}#p{index}"


def whole_mib_pieces(memories: Sequence[float], total: int) -> list[int]:
    """The pieces of a split instance in whole MiB, as GPU budgets hold its stages: each piece's memory rounded, in
    stage order, the last taking what makes their sum `total` (the live balancer's records and the simulator's
    `whole_mib_stages` alike)."""
    mibs = [round(m) for m in memories[:-1]]
    mibs.append(max(0, total - sum(mibs)))
    return mibs


@dataclass(frozen=True, slots=True)
class PlacementDecision:
    instance_id: str
    strategy: str
    gpus: tuple[GpuRef, ...]
    """Where to place; empty when nothing fits."""
    share_mode: ShareMode
    static_share: float | None
    """The share to run the instance at for static strategies; None: the vertical policy decides."""
    lights: int
    total: float
    reason: str
    candidates: tuple[CandidateScore, ...] = ()
    """The best few candidates, best first (the chosen one first)."""
    rejections: tuple[Rejection, ...] = ()
    """GPUs examined and rejected, counted by the first filter that failed."""
    parts: tuple[PlacementPart, ...] = ()
    """Non-empty when the instance's memory was split: one piece per GPU of `gpus` (same order)."""

    @property
    def placed(self) -> bool:
        return bool(self.gpus)

    @property
    def split(self) -> bool:
        return bool(self.parts)

    @property
    def invoker(self) -> str | None:
        return self.gpus[0].invoker if self.gpus else None


def apply_placement(
    cluster: ClusterSnapshot, request: PlacementRequest, decision: PlacementDecision
) -> ClusterSnapshot:
    """The cluster after carrying out a successful decision (each piece of a split one placed)."""
    if not decision.placed:
        raise ValueError(
            f"cannot apply a failed placement of {decision.instance_id}: {decision.reason}"
        )
    if decision.parts:
        for part in decision.parts:
            cluster = cluster.with_instance(part.instance, (part.gpu,))
        return cluster
    instance = request.to_instance()
    if request.weights_mib and holds_weights(cluster.gpu(decision.gpus[0]), request):
        # charged as its invoker's budget will charge it: the GPU's copy of the weights counts once
        instance = replace(instance, memory_mib=request.memory_mib - request.weights_mib)
    return cluster.with_instance(instance, decision.gpus)


# -- the decision --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Rejects:
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def note(
        self,
        f: Filter,
        g: GpuState,
        r: PlacementRequest,
        c: PlacementConfig,
        count: int = 1,
    ) -> None:
        n = self.counts.get(f.name, 0)
        self.counts[f.name] = n + count
        if n == 0:
            self.examples[f.name] = f.explain(g, r, c)

    def frozen(self) -> tuple[Rejection, ...]:
        return tuple(
            Rejection(name, n, self.examples[name]) for name, n in self.counts.items()
        )

    def summary(self) -> str:
        if not self.counts:
            return "no GPU was eligible"
        return "; ".join(
            f"{name} rejected {n} (e.g. {self.examples[name]})"
            for name, n in self.counts.items()
        )


class _Uncounted(_Rejects):
    """Rejections nobody will read (a feasibility check): noting them costs nothing."""

    def note(self, f: Filter, g: GpuState, r: PlacementRequest, c: PlacementConfig, count: int = 1) -> None:
        return None


_NO_REJECTS = _Uncounted()


def _first_failure(
    g: GpuState, filters: tuple[Filter, ...], r: PlacementRequest, c: PlacementConfig
) -> Filter | None:
    for f in filters:
        if not f.passes(g, r, c):
            return f
    return None


#: Filters whose verdict on an unlit (empty) GPU depends only on its memory and whether it is
#: schedulable, for a request that keeps to no invoker and avoids nothing.
_UNLIT_ALIKE = frozenset(
    {"schedulable", "avoid", "sm-request", "sm-limit", "sm-limit-static", "memory", "exclusive", "priority-pair"}
)


def _unlit_memo(filters: tuple[Filter, ...], request: PlacementRequest) -> dict[tuple[float, bool], Filter | None] | None:
    """A memo for `_unlit_failure` when every filter judges empty GPUs alike (by memory and
    schedulable) for `request`, else None."""
    if request.only_invoker is not None or request.avoid_gpus or request.avoid_invokers:
        return None
    if not all(f.name in _UNLIT_ALIKE and FILTERS.get(f.name) is f for f in filters):
        return None
    return {}


def _unlit_failure(
    g: GpuState,
    filters: tuple[Filter, ...],
    r: PlacementRequest,
    c: PlacementConfig,
    memo: dict[tuple[float, bool], Filter | None] | None,
) -> Filter | None:
    """`_first_failure` of an unlit GPU, from `memo` (see `_unlit_memo`) when there is one."""
    if memo is None:
        return _first_failure(g, filters, r, c)
    key = (g.memory_mib, g.schedulable)
    if key in memo:
        return memo[key]
    failed = memo[key] = _first_failure(g, filters, r, c)
    return failed


def _scan_lit(
    cluster: ClusterSnapshot,
    filters: tuple[Filter, ...],
    request: PlacementRequest,
    config: PlacementConfig,
    limit: int,
    rejects: _Rejects,
) -> list[int]:
    """Ordinals of lit GPUs passing every filter, tightest Σ request first, at most `limit`
    (`rejects` counts the others unless it is `_NO_REJECTS`)."""
    if request.only_invoker is not None:
        return _scan_invoker(cluster, filters, request, config, limit, rejects)
    bounded = [(f.bound(request, config), f) for f in filters if f.bound is not None]
    if not bounded:
        kmax = BUCKETS
    else:
        bound, tightest = min(bounded, key=lambda b: b[0])
        kmax = -1 if bound < -EPS else min(BUCKETS, math.floor((bound + EPS) * BUCKETS))
        # GPUs in buckets above the bound fail `tightest` without being looked at; count
        # them so a refusal still says why.
        skipped = [b for b in cluster.lit_buckets[kmax + 1 :] if b] if rejects is not _NO_REJECTS else []
        if skipped:
            rejects.note(
                tightest,
                cluster.gpus[skipped[0][0]],
                request,
                config,
                count=sum(len(b) for b in skipped),
            )
    gpus = cluster.gpus
    found: list[int] = []
    for o in _lit_order(cluster, filters, request, config, kmax, rejects):
        g = gpus[o]
        for f in filters:
            if not f.passes(g, request, config):
                rejects.note(f, g, request, config)
                break
        else:
            found.append(o)
            if len(found) >= limit:
                return found
    return found


def _lit_order(
    cluster: ClusterSnapshot,
    filters: tuple[Filter, ...],
    request: PlacementRequest,
    config: PlacementConfig,
    kmax: int,
    rejects: _Rejects,
) -> Iterator[int]:
    """The lit GPUs `_scan_lit` looks at, in its order: buckets from `kmax` down, within a bucket
    only those the memory and limit indexes do not rule out (those ruled out are counted in
    `rejects` as they are passed)."""
    gpus = cluster.gpus
    memory = FILTERS["memory"]
    if memory not in filters:
        for k in range(kmax, -1, -1):
            yield from cluster.lit_buckets[k]
        return
    # Within a bucket, GPUs with less free memory than the request needs fail `memory`, and
    # those whose Σ limit leaves no room for its limit fail the limit filter: the indexes by
    # free memory and by Σ limit give both sets by bisection; walk the smaller remainder.
    need = (request.memory_mib - cluster.max_memory_mib * EPS, -1)
    cap = None
    if FILTERS["sm-limit"] in filters:
        cap = config.gamma
    if FILTERS["sm-limit-static"] in filters:
        cap = 1.0 if cap is None else min(cap, 1.0)
    limit_filter = FILTERS["sm-limit" if cap is not None and cap > 1.0 else "sm-limit-static"]
    room_limit = (cap - request.limit + 2 * EPS, math.inf) if cap is not None else None
    # Nobody reads the rejections: a bucket whose GPUs with room for the limit all lack the
    # memory (the most free memory among them, from a cached prefix maximum) is passed over.
    uncounted = rejects is _NO_REJECTS
    rooms = cluster.lit_room
    limits = cluster.lit_limits
    # The non-empty buckets from kmax down (`compress` tests the bucket tuples at C speed).
    for k in compress(range(kmax, -1, -1), rooms[kmax::-1] if kmax >= 0 else ()):
        bucket = rooms[k]
        if room_limit is not None:
            by_limit = limits[k]
            end = bisect.bisect_right(by_limit, room_limit)
            if uncounted and (end == 0 or _most_free(by_limit, gpus)[end - 1] < need[0]):
                continue
        start = bisect.bisect_left(bucket, need)
        visit = bucket[start:]
        if room_limit is not None and end < len(visit):
            if end < len(by_limit):
                rejects.note(
                    limit_filter, gpus[by_limit[end][1]], request, config,
                    count=len(by_limit) - end,
                )
            visit = by_limit[:end]
            start = 0
        if start:
            rejects.note(memory, gpus[bucket[0][1]], request, config, count=start)
        for _, o in visit:
            yield o


#: id of a `lit_limits` bucket → (the bucket, the most free MiB among its first i + 1 GPUs). A
#: bucket tuple is rebuilt whenever one of its GPUs changes, so its identity fixes the answer; the
#: tuple is kept here so that its id is not reused while the entry lives.
_MOST_FREE: dict[int, tuple[tuple[tuple[float, int], ...], list[float]]] = {}
_MOST_FREE_MAX = 4096


def _most_free(by_limit: tuple[tuple[float, int], ...], gpus: Sequence[GpuState]) -> list[float]:
    hit = _MOST_FREE.get(id(by_limit))
    if hit is not None and hit[0] is by_limit:
        return hit[1]
    states = [gpus[o] for _, o in by_limit]
    most = list(accumulate(map(sub, map(_MEMORY, states), map(_USED_MEMORY, states)), max))
    if len(_MOST_FREE) >= _MOST_FREE_MAX:
        _MOST_FREE.clear()
    _MOST_FREE[id(by_limit)] = (by_limit, most)
    return most


_MEMORY = attrgetter("memory_mib")
_USED_MEMORY = attrgetter("used_memory")


def _scan_invoker(
    cluster: ClusterSnapshot,
    filters: tuple[Filter, ...],
    request: PlacementRequest,
    config: PlacementConfig,
    limit: int,
    rejects: _Rejects,
) -> list[int]:
    """`_scan_lit` for a request kept to one invoker: its few GPUs instead of the whole index."""
    ords = cluster.invoker_ordinals.get(request.only_invoker or "", ())
    gpus = cluster.gpus
    lit = sorted((o for o in ords if gpus[o].lit), key=lambda o: (-gpus[o].used_request, o))
    found: list[int] = []
    for o in lit:
        failed = _first_failure(gpus[o], filters, request, config)
        if failed is not None:
            rejects.note(failed, gpus[o], request, config)
            continue
        found.append(o)
        if len(found) >= limit:
            break
    return found


def _unlit_invokers(cluster: ClusterSnapshot, request: PlacementRequest, n: int) -> Iterator[str]:
    """The invokers a request may use that have at least `n` (>= 1) unlit GPUs, in cluster order."""
    if request.only_invoker is not None:
        ords = cluster.unlit.get(request.only_invoker)
        if ords is not None and len(ords) >= n:
            yield request.only_invoker
        return
    if n > len(cluster.unlit_nodes):
        return
    refs = cluster.refs
    for first in cluster.unlit_nodes[n - 1]:
        yield refs[first].invoker


def _score(
    g: GpuState,
    request: PlacementRequest,
    cluster: ClusterSnapshot,
    config: PlacementConfig,
    scorers: tuple[tuple[Scorer, float], ...],
) -> tuple[float, tuple[float, ...]]:
    parts = tuple([s.score(g, request, cluster, config) for s, _ in scorers])
    return sum([p * w for p, (_, w) in zip(parts, scorers, strict=True)]), parts


def _unlit_bound(
    request: PlacementRequest,
    cluster: ClusterSnapshot,
    config: PlacementConfig,
    scorers: tuple[tuple[Scorer, float], ...],
) -> float:
    return sum(w * s.unlit_bound(request, cluster, config) for s, w in scorers)


def _describe(
    gpus: tuple[GpuState, ...],
    request: PlacementRequest,
    total: float,
    parts: tuple[float, ...],
    scorers: tuple[tuple[Scorer, float], ...],
) -> str:
    where = ", ".join(
        f"{g.ref} ({'lit' if g.lit else 'unlit'}, Σ request {g.used_request:.2f}→{g.used_request + request.request:.2f},"
        f" Σ limit {g.used_limit:.2f}→{g.used_limit + request.limit:.2f})"
        for g in gpus
    )
    terms = ", ".join(
        f"{s.name} {p:.1f}×{w:g}" for p, (s, w) in zip(parts, scorers, strict=True)
    )
    return f"{where}: score {total:.1f} = {terms}"


def _decision(
    request: PlacementRequest,
    config: PlacementConfig,
    strategy: Strategy,
    ranked: list[CandidateScore],
    rejects: _Rejects,
    examined: str,
) -> PlacementDecision:
    share_mode = strategy.share_mode
    static = share_mode.static_share(SharePair(request.request, request.limit))
    if not ranked:
        what = f"{request.request:.2f}/{request.limit:.2f} SM, {request.memory_mib:.0f} MiB"
        if request.gpus > 1:
            what += f" on each of {request.gpus} GPUs of one invoker"
        reason = f"no GPU fits {request.instance_id} ({what}) under {strategy.name}: {rejects.summary()}{examined}"
        return PlacementDecision(
            instance_id=request.instance_id,
            strategy=strategy.name,
            gpus=(),
            share_mode=share_mode,
            static_share=static,
            lights=0,
            total=0.0,
            reason=reason,
            candidates=(),
            rejections=rejects.frozen(),
        )
    best = ranked[0]
    lights = f", lights {best.lights} GPU(s)" if best.lights else ", no GPU lit"
    reason = f"{strategy.name}: {request.instance_id} → {best.reason}{lights}"
    return PlacementDecision(
        instance_id=request.instance_id,
        strategy=strategy.name,
        gpus=best.gpus,
        share_mode=share_mode,
        static_share=static,
        lights=best.lights,
        total=best.total,
        reason=reason,
        candidates=tuple(ranked[: config.report_candidates]),
        rejections=rejects.frozen(),
    )


def place(
    cluster: ClusterSnapshot, request: PlacementRequest, config: PlacementConfig
) -> PlacementDecision:
    """Choose GPU(s) for `request` on `cluster` under `config.strategy`; never raises for "no room"."""
    if request.weights_mib:
        return _place_weights(cluster, request, config)
    strategy = config.strategy_spec()
    filters = config.filters()
    scorers = config.scorer_weights()
    if request.gpus > 1:
        return _place_gang(cluster, request, config, strategy, filters, scorers)
    decision = _place_one(cluster, request, config, strategy, filters, scorers)
    max_parts = request.parts_allowed(config)
    if max_parts > 1 and (not decision.placed or decision.lights):
        # Dilu's tiers for an LLM: whole on a lit GPU, else split over lit GPUs of one invoker,
        # else whole on a new GPU.
        if config.split_node_fit:
            split = _place_split_node_fit(cluster, request, config, strategy, filters, max_parts)
        else:
            split = _place_split(cluster, request, config, strategy, filters, max_parts)
        if split is not None:
            return split
        if config.light_split_min_share is not None and decision.lights and not request.lit_only:
            lighting = _place_split_lighting(cluster, request, config, strategy, filters, max_parts)
            if lighting is not None:
                return lighting
    return decision


def place_sharing(
    cluster: ClusterSnapshot, request: PlacementRequest, config: PlacementConfig
) -> PlacementDecision | None:
    """The first tier of a request declaring shared weights (`place` tries it first): the lit GPUs that
    hold them already (there it needs only the rest of its memory and maps the weights in milliseconds
    instead of loading a copy), ranked by the strategy's scorers; None when it declares none or none of
    those GPUs passes the filters."""
    decision, _ = _sharing_tier(cluster, request, config)
    return decision if decision is not None and decision.placed else None


def _sharing_tier(
    cluster: ClusterSnapshot, request: PlacementRequest, config: PlacementConfig
) -> tuple[PlacementDecision | None, str]:
    """`place_sharing`'s decision, placed or not (None: no GPU holds the weights), and why holders were
    refused. Looks at every GPU: only requests declaring weights come here."""
    if not request.weights_mib:
        return None, ""
    strategy = config.strategy_spec()
    filters = config.filters()
    scorers = config.scorer_weights()
    rejects = _Rejects()
    ranked: list[_Ranked] = []
    seen = False
    for o, g in enumerate(cluster.gpus[:]):
        if not (g.weight_groups and g.instances and holds_weights(g, request)):
            continue
        seen = True
        failed = _first_failure(g, filters, request, config)
        if failed is not None:
            rejects.note(failed, g, request, config)
            continue
        total, parts = _score(g, request, cluster, config, scorers)
        ranked.append((total, 1, -o, (o,), parts))
    if not seen:
        return None, ""
    ranked.sort(reverse=True)
    decision = _decision(request, config, strategy, _candidates(cluster, request, ranked, scorers, config),
                         rejects, "")
    if decision.placed:
        decision = replace(decision, reason=f"{decision.reason}; its {request.weights_mib:.0f} MiB of weights "
                                            "shared there")
    return decision, rejects.summary()


def _place_weights(
    cluster: ClusterSnapshot, request: PlacementRequest, config: PlacementConfig
) -> PlacementDecision:
    """`place` of a request declaring shared weights: on a GPU holding them if one takes it, else as
    `place` would place it whole (where nothing holds them it needs its whole memory)."""
    tier, why = _sharing_tier(cluster, request, config)
    if tier is not None and tier.placed:
        return tier
    decision = place(cluster, replace(request, weights_mib=0.0, weights_group=""), config)
    if tier is not None and not decision.placed:
        decision = replace(decision, reason=f"{decision.reason}; on the GPUs holding its {request.weights_mib:.0f} "
                                            f"MiB of weights: {why}")
    return decision


def lit_fits(
    cluster: ClusterSnapshot, request: PlacementRequest, config: PlacementConfig, limit: int = 1
) -> tuple[GpuRef, ...]:
    """Up to `limit` lit GPUs that pass every filter for a one-GPU `request`, whole (no split, no
    scoring): the cheap necessary condition of a lit-only `place` of an instance that may not
    split. Fewer than `limit` means these are all there are."""
    filters = config.filters()
    return tuple(cluster.refs[o] for o in _scan_lit(cluster, filters, request, config, limit, _NO_REJECTS))


def split_fits(cluster: ClusterSnapshot, request: PlacementRequest, config: PlacementConfig) -> bool:
    """Whether `request` may be split over lit GPUs of one invoker as `place` would split it (the
    same test, without building the decision): the cheap necessary condition of a lit-only `place`
    of an instance that no lit GPU takes whole."""
    max_parts = request.parts_allowed(config)
    if max_parts < 2:
        return False
    strategy = config.strategy_spec()
    if not strategy.splits:
        return False
    filters = config.filters()
    total = request.memory_mib
    if total <= 0:
        return False
    min_part = min(config.min_part_mib, total)
    gpus = cluster.gpus
    scan = _SplitScan(cluster, request, config, filters, max_parts)
    # The first invoker that can take it answers (placement would compare them all); those with
    # the most free memory first, as they are the likeliest to.
    inline = _InlineSplit.of(scan, request, config, filters, max_parts)
    if inline is not None and scan.entries is not None and _VECTOR_BOUNDS:
        bounds = _split_bounds(scan, inline, scan.entries, max_parts)
        if bounds is not None:
            # Only the invokers whose bound leaves room for a plan: those whose plan is known
            # first, then the others, the roomiest first.
            entries = scan.entries
            sel, exact = bounds[0], bounds[4]
            order = [*sel[exact][::-1].tolist(), *sel[~exact][::-1].tolist()]
            return any(inline.plan(entries[k][5]) is not None for k in order)
    for first, entry in scan.firsts(request, roomiest_first=True):
        if scan.cannot_hold(entry, max_parts):
            continue
        if inline is not None:
            lit = entry[5] if entry is not None else scan.lit(first)
            if inline.plan(lit) is not None:
                return True
            continue
        cands = scan.candidates(first, entry)
        if len(cands) >= 2 and (
            _split_plan(cands, request, config, filters, total, min_part, max_parts, gpus) is not None
        ):
            return True
    return False


# Candidates are ranked by (total, lit, -ordinal): best score, then an already-lit GPU, then the
# earliest GPU in cluster order, so equal scores resolve the same way on every run.
_Ranked = tuple[float, int, int, tuple[int, ...], tuple[float, ...]]


def _place_one(
    cluster: ClusterSnapshot,
    request: PlacementRequest,
    config: PlacementConfig,
    strategy: Strategy,
    filters: tuple[Filter, ...],
    scorers: tuple[tuple[Scorer, float], ...],
) -> PlacementDecision:
    rejects = _Rejects()
    gpus = cluster.gpus
    ranked: list[_Ranked] = []
    for o in _scan_lit(
        cluster, filters, request, config, config.candidate_limit, rejects
    ):
        total, parts = _score(gpus[o], request, cluster, config, scorers)
        ranked.append((total, 1, -o, (o,), parts))
    best_lit = max((r[0] for r in ranked), default=-math.inf)
    examined = ""
    if request.lit_only:
        examined = "; unlit GPUs not considered (lit only)"
    elif _unlit_bound(request, cluster, config, scorers) > best_lit + EPS:
        found = 0
        memo = _unlit_memo(filters, request)
        for inv in _unlit_invokers(cluster, request, 1):
            for o in cluster.unlit[inv]:
                g = gpus[o]
                failed = _unlit_failure(g, filters, request, config, memo)
                if failed is None:
                    total, parts = _score(g, request, cluster, config, scorers)
                    ranked.append((total, 0, -o, (o,), parts))
                    found += 1
                    break  # the invoker's other unlit GPUs are alike; one stands for them
                rejects.note(failed, g, request, config)
            if found >= config.candidate_limit:
                break
        if not cluster.unlit_nodes[0]:
            examined = "; no unlit GPU left"
    ranked.sort(reverse=True)
    return _decision(
        request,
        config,
        strategy,
        _candidates(cluster, request, ranked, scorers, config),
        rejects,
        examined,
    )


def _candidates(
    cluster: ClusterSnapshot,
    request: PlacementRequest,
    ranked: list[_Ranked],
    scorers: tuple[tuple[Scorer, float], ...],
    config: PlacementConfig,
) -> list[CandidateScore]:
    out = []
    for total, _, _, ords, parts in ranked[: max(1, config.report_candidates)]:
        states = tuple(cluster.gpus[o] for o in ords)
        out.append(
            CandidateScore(
                gpus=tuple(g.ref for g in states),
                total=total,
                scores=tuple(
                    (s.name, p) for p, (s, _) in zip(parts, scorers, strict=True)
                ),
                lights=sum(1 for g in states if not g.lit),
                reason=_describe(states, request, total, parts, scorers),
            )
        )
    return out


def _place_gang(
    cluster: ClusterSnapshot,
    request: PlacementRequest,
    config: PlacementConfig,
    strategy: Strategy,
    filters: tuple[Filter, ...],
    scorers: tuple[tuple[Scorer, float], ...],
) -> PlacementDecision:
    k = request.gpus
    rejects = _Rejects()
    gpus = cluster.gpus
    by_invoker: dict[str, list[int]] = {}
    for o in _scan_lit(
        cluster, filters, request, config, config.candidate_limit * k, rejects
    ):
        by_invoker.setdefault(cluster.refs[o].invoker, []).append(o)
    # Invokers holding feasible lit GPUs first (they can avoid lighting some), then invokers with
    # enough unlit GPUs, in cluster order, up to the candidate limit.
    # (Cluster order is the order of the invokers' first ordinals.)
    invokers = sorted(by_invoker, key=lambda inv: cluster.invoker_ordinals[inv][0])
    if not request.lit_only:
        extra = 0
        for inv in _unlit_invokers(cluster, request, k):
            if inv not in by_invoker:
                invokers.append(inv)
                extra += 1
                if extra >= config.candidate_limit:
                    break
    ranked: list[_Ranked] = []
    memo = _unlit_memo(filters, request)
    # An invoker with no feasible lit GPU whose unlit GPUs are all of one size chooses its first k
    # that pass, and (built-in scorers) they score alike on every such invoker holding as many
    # instances of the function: the mean scores are computed once per (size, that count).
    alike_scores = memo is not None and not request.lit_only and _unlit_scores_alike(scorers)
    by_count = any(s.name == "affinity" for s, _ in scorers)
    unlit_means: dict[tuple[float, int], tuple[float, tuple[float, ...]]] = {}
    for inv in invokers:
        unlit = cluster.unlit[inv]
        if (
            alike_scores
            and unlit
            and inv not in by_invoker
            and all(gpus[o].memory_mib == gpus[unlit[0]].memory_mib for o in unlit)
        ):
            passing: list[int] = []
            for o in unlit:
                g = gpus[o]
                failed = _unlit_failure(g, filters, request, config, memo)
                if failed is not None:
                    rejects.note(failed, g, request, config)
                    continue
                passing.append(o)
            if len(passing) < k:
                continue
            key = (
                gpus[unlit[0]].memory_mib,
                cluster.function_count(request.function, inv) if by_count else 0,
            )
            means = unlit_means.get(key)
            if means is None:
                # The means as the general case below computes them, over k alike GPUs.
                one = _score(gpus[passing[0]], request, cluster, config, scorers)
                alike_k = [one] * k
                means = unlit_means[key] = (
                    sum(c[0] for c in alike_k) / k,
                    tuple(sum(c[1][i] for c in alike_k) / k for i in range(len(scorers))),
                )
            # Equal scores: the first k by ordinal, as the sort below would choose.
            ords = tuple(passing[:k])
            ranked.append((means[0], 0, -ords[0], ords, means[1]))
            continue
        per_gpu: list[tuple[float, int, int, tuple[float, ...]]] = []
        for o in by_invoker.get(inv, ()):
            total, parts = _score(gpus[o], request, cluster, config, scorers)
            per_gpu.append((total, 1, -o, parts))
        if not request.lit_only:
            # Unlit GPUs of one invoker are empty: those of one size score alike.
            alike: dict[float, tuple[float, tuple[float, ...]]] = {}
            for o in cluster.unlit[inv]:
                g = gpus[o]
                failed = _unlit_failure(g, filters, request, config, memo)
                if failed is not None:
                    rejects.note(failed, g, request, config)
                    continue
                scored = alike.get(g.memory_mib)
                if scored is None:
                    scored = alike[g.memory_mib] = _score(g, request, cluster, config, scorers)
                per_gpu.append((scored[0], 0, -o, scored[1]))
        if len(per_gpu) < k:
            continue
        per_gpu.sort(reverse=True)
        chosen = per_gpu[:k]
        mean_total = sum(c[0] for c in chosen) / k
        mean_parts = tuple(
            sum(c[3][i] for c in chosen) / k for i in range(len(scorers))
        )
        ords = tuple(sorted(-c[2] for c in chosen))
        lit = sum(c[1] for c in chosen)
        ranked.append((mean_total, lit, -ords[0], ords, mean_parts))
    ranked.sort(reverse=True)
    examined = "" if invokers else f"; no invoker has {k} GPUs that pass the filters"
    return _decision(
        request,
        config,
        strategy,
        _candidates(cluster, request, ranked, scorers, config),
        rejects,
        examined,
    )


#: Built-in scorers whose score of an unlit (empty) GPU depends only on its memory size and, for
#: affinity, the function's instance count on its invoker.
_UNLIT_SCORE_ALIKE = frozenset(
    {"lit", "fragmentation", "sm-fit", "dominant-fit", "limit-fit", "complementarity", "complementarity-be", "affinity"}
)


def _unlit_scores_alike(scorers: tuple[tuple[Scorer, float], ...]) -> bool:
    return all(s.name in _UNLIT_SCORE_ALIKE and SCORERS.get(s.name) is s for s, _ in scorers)


def describe_strategies() -> Mapping[str, str]:
    """Name → one-line description of every registered strategy (for `--help` and docs)."""
    return {name: s.description for name, s in sorted(STRATEGIES.items())}


# -- splitting one instance's memory across GPUs of one invoker ----------------------------------


def _place_split_lighting(
    cluster: ClusterSnapshot,
    request: PlacementRequest,
    config: PlacementConfig,
    strategy: Strategy,
    filters: tuple[Filter, ...],
    max_parts: int,
) -> PlacementDecision | None:
    """Split the instance over lit GPUs of one invoker and one new GPU of it (lighting that GPU),
    instead of lighting a GPU for it whole (`PlacementConfig.light_split_min_share`).

    An instance that lights a GPU alone is the cheapest GPU for compaction to empty, and compaction
    splits it into the lit room that departures open soon after (docs/benchmarks/sim-scale.md,
    seventeenth round); this puts its pieces into the lit room there is now. Per invoker with an
    unlit GPU: its lit GPUs' capacities as `_place_split` computes them, the largest first, at most
    `max_parts` − 1 pieces, each leaving at least `min_part_mib` for the new GPU's piece; the rest on
    the invoker's first unlit GPU that passes the filters. The invoker whose lit GPUs take the most
    wins (then the fewest pieces, then cluster order), if they take at least the share; None where
    no invoker qualifies.
    """
    share = config.light_split_min_share
    total = request.memory_mib
    if share is None or total <= 0:
        return None
    min_part = min(config.min_part_mib, total)
    least = max(min_part, share * total)
    if total - min_part < least - EPS:
        return None
    gpus = cluster.gpus
    scan = _SplitScan(cluster, request, config, filters, max_parts)
    if request.only_invoker is None:
        # The most free lit memory first: an invoker's lit GPUs take at most their free memory
        # (grown by the filters' relative EPS), so once that is below the least share or the best
        # taken so far, so is every later invoker's.
        entries: Iterable[NodeRoom] = reversed(cluster.node_room)
    else:
        ords = cluster.invoker_ordinals.get(request.only_invoker, ())
        one = _node_room(ords, gpus) if ords else None
        entries = () if one is None else (one,)
    slack = 2 * max_parts * cluster.max_memory_mib * EPS + _SPLIT_SLACK_MIB
    best: tuple[tuple[float, int, int], list[tuple[int, float]]] | None = None
    for entry in entries:
        if entry[0] + slack < least - EPS or (best is not None and entry[0] + slack + 1.0 < -best[0][0]):
            break
        unlit = cluster.unlit.get(cluster.refs[entry[1]].invoker)
        if not unlit:
            continue
        cands = scan.candidates(entry[1], entry)
        cands.sort(key=lambda c: (-c[0], c[1]))
        remaining = total
        plan: list[tuple[int, float]] = []
        for cap, o in cands:
            if len(plan) >= max_parts - 1:
                break
            take = min(cap, remaining - min_part)
            if take < min_part or not _piece_passes(gpus[o], request, take, config, filters):
                continue
            plan.append((o, take))
            remaining -= take
        taken = total - remaining
        if not plan or taken < least - EPS:
            continue
        # In whole MiB: the filters' relative EPS lets a lit GPU take a hair more than its free
        # memory, which must not decide between invokers whose lit GPUs take the same room.
        key = (-float(round(taken)), len(plan) + 1, entry[1])
        if best is not None and key >= best[0]:
            continue
        fresh = next((o for o in unlit if _piece_passes(gpus[o], request, remaining, config, filters)), None)
        if fresh is not None:
            best = (key, [*plan, (fresh, remaining)])
    if best is None:
        return None
    parts = tuple(
        PlacementPart(gpu=cluster.refs[o], instance=replace(
            _part_request(request, mem, k).to_instance(), part_of=request.instance_id))
        for k, (o, mem) in enumerate(best[1])
    )
    return _split_decision(
        request, strategy, parts, 1,
        f"split over {len(parts) - 1} lit GPU(s) of {parts[0].gpu.invoker} and one it lights, instead of "
        f"lighting one for it whole (lit GPUs take {-best[0][0] / total:.0%})",
    )


def _split_decision(
    request: PlacementRequest, strategy: Strategy, parts: Sequence[PlacementPart], lights: int, how: str
) -> PlacementDecision:
    """The decision placing `request` as `parts` (one pipeline stage each), lighting `lights` GPUs; its
    reason says `how` and where each stage goes."""
    where = ", ".join(
        f"{p.gpu} ({p.instance.memory_mib / 1024:.1f} GiB, {p.instance.request:.2f}/{p.instance.limit:.2f} SM)"
        for p in parts
    )
    return PlacementDecision(
        instance_id=request.instance_id,
        strategy=strategy.name,
        gpus=tuple(p.gpu for p in parts),
        share_mode=strategy.share_mode,
        static_share=strategy.share_mode.static_share(SharePair(request.request, request.limit)),
        lights=lights,
        total=0.0,
        reason=f"{strategy.name}: {request.instance_id} {how}: {where}",
        parts=tuple(parts),
    )


def _part_request(request: PlacementRequest, memory_mib: float, index: int) -> PlacementRequest:
    f = memory_mib / request.memory_mib
    return PlacementRequest(
        instance_id=part_id(request.instance_id, index),
        function=request.function,
        cls=request.cls,
        request=min(request.request, request.request * f),
        limit=min(request.limit, request.limit * f),
        memory_mib=memory_mib,
        profile=request.profile,
        affinity=request.affinity,
        avoid_gpus=request.avoid_gpus,
        avoid_invokers=request.avoid_invokers,
        only_invoker=request.only_invoker,
        max_parts=1,
    )


def _piece_passes(
    g: GpuState,
    request: PlacementRequest,
    memory_mib: float,
    config: PlacementConfig,
    filters: tuple[Filter, ...],
) -> bool:
    """Whether `g` passes every filter for the piece of `memory_mib` that `_part_request` would
    build, without building it: the size filters are evaluated on the piece's request, limit and
    memory exactly as the filters compute them, the others on `request` (a piece copies the fields
    they read)."""
    f = memory_mib / request.memory_mib
    r = min(request.request, request.request * f)
    lim = min(request.limit, request.limit * f)
    for flt in filters:
        if flt is _F_SM_REQUEST:
            ok = g.used_request + r <= config.omega + EPS
        elif flt is _F_SM_LIMIT:
            ok = g.used_limit + lim <= config.gamma + EPS
        elif flt is _F_SM_LIMIT_STATIC:
            ok = g.used_limit + lim <= 1.0 + EPS
        elif flt is _F_MEMORY:
            ok = g.used_memory + memory_mib <= g.memory_mib * (1.0 + EPS)
        elif flt.name in _SIZE_FREE:
            ok = flt.passes(g, request, config)
        else:
            return _first_failure(g, filters, _part_request(request, memory_mib, 0), config) is None
        if not ok:
            return False
    return True


def _split_plan(
    cands: list[tuple[float, int]],
    request: PlacementRequest,
    config: PlacementConfig,
    filters: tuple[Filter, ...],
    total: float,
    min_part: float,
    max_parts: int,
    gpus: Sequence[GpuState],
) -> tuple[list[tuple[int, float]], float] | None:
    """The pieces (ordinal, MiB) one invoker's candidates (capacity, ordinal) take, largest
    first, and the room they leave unused; None: they cannot hold the instance."""
    if sum([c if c < total else total for c, _ in cands]) < total - EPS:  # Σ min(c, total)
        return None
    cands.sort(key=lambda c: (-c[0], c[1]))
    remaining = total
    plan: list[tuple[int, float]] = []
    unused = 0.0
    for cap, o in cands[:max_parts]:
        take = min(cap, remaining)
        left = remaining - take
        if 0 < left < min_part:
            # Leave a last piece that is not too small to be a stage.
            take = remaining - min_part
            if take < min_part:
                continue
        g = gpus[o]
        if not _piece_passes(g, request, take, config, filters):
            continue
        plan.append((o, take))
        unused += cap - take
        remaining -= take
        if remaining <= EPS:
            break
    if remaining > EPS or len(plan) < 2:
        return None
    return plan, unused


#: Slack (MiB) of `_split_cannot_win`'s bounds against the rounding of the plan's own sums: an
#: invoker is passed over only when it loses by more than this.
_SPLIT_SLACK_MIB = 1e-6


def _split_cannot_win(
    cands: list[tuple[float, int]], total: float, max_parts: int, pieces: int, unused: float
) -> bool:
    """Whether no plan `_split_plan` may make from one invoker's candidates (capacity, ordinal) has
    fewer pieces than `pieces`, or as many and less unused room than `unused` (the best so far).

    A plan's pieces come from the `max_parts` largest capacities, together they hold at least
    `total` (less EPS), and each takes at most its capacity, so the room a plan leaves unused is at
    least Σ capacity of its GPUs − `total`: bounds over the few subsets of those capacities."""
    caps = sorted([c for c, _ in cands], reverse=True)[:max_parts]
    need = total - EPS - _SPLIT_SLACK_MIB
    if pieces == 2 and 2 <= len(caps) <= 5:
        # The common case inline, the same sums as below: the largest alone, or the two largest
        # together hold it (else the fewest pieces are more than two), then the tightest pair.
        if caps[0] >= need:
            return False
        if caps[0] + caps[1] < need:
            return True
        least = math.inf
        for i, a in enumerate(caps):
            for b in caps[i + 1 :]:
                room = a + b
                if room >= need and room - total < least:
                    least = room - total
        return least > unused + _SPLIT_SLACK_MIB
    held = 0.0
    fewest = 0
    for c in caps:
        held += c
        fewest += 1
        if held >= need:
            break
    else:
        return True  # the largest ones together cannot hold it: `_split_plan` finds nothing
    if fewest < pieces:
        return False
    if fewest > pieces:
        return True
    if len(caps) > 5:
        return False  # too many subsets to bound cheaply
    least = math.inf
    for subset in combinations(caps, pieces):
        room = sum(subset)
        if room >= need and room - total < least:
            least = room - total
    return least > unused + _SPLIT_SLACK_MIB


class _InlineSplit:
    """`scan.candidates` and `_split_plan` of one invoker in one pass over its node-room entry, the
    pieces' filters (`_piece_passes`) read from its `LitRoom`s, for the registered size filters,
    `schedulable` and `avoid`: the same candidates, order, pieces, sums and verdicts (the same
    expressions as the filters), so the same plan."""

    __slots__ = ("avoid", "gamma", "limit", "limit_cap", "max_parts", "memory", "min_part", "omega",
                 "omega_eps", "per_limit", "per_request", "request", "schedulable", "sm_limit",
                 "sm_request", "static", "too_full", "total")

    def __init__(
        self,
        scan: _SplitScan,
        request: PlacementRequest,
        config: PlacementConfig,
        names: frozenset[str],
        max_parts: int,
        avoid: frozenset[int],
    ) -> None:
        self.total, self.min_part, self.max_parts = scan.total, scan.min_part, max_parts
        self.too_full, self.per_request, self.per_limit = scan.too_full, scan.per_request, scan.per_limit
        self.omega, self.limit_cap = scan.omega, scan.limit_cap
        self.request, self.limit = request.request, request.limit
        self.omega_eps, self.gamma = config.omega + EPS, config.gamma + EPS
        self.sm_request = "sm-request" in names
        self.sm_limit = "sm-limit" in names
        self.static = "sm-limit-static" in names
        self.memory = "memory" in names
        self.schedulable = "schedulable" in names
        self.avoid = avoid if "avoid" in names else frozenset()

    @classmethod
    def of(
        cls,
        scan: _SplitScan,
        request: PlacementRequest,
        config: PlacementConfig,
        filters: tuple[Filter, ...],
        max_parts: int,
    ) -> _InlineSplit | None:
        """The inline plan for `request`, or None where `_piece_passes` must be asked (a filter
        other than those)."""
        if not all(FILTERS.get(f.name) is f and f.name in _INLINE_PIECE_FILTERS for f in filters):
            return None
        # `avoid` as ordinals: the GPUs and invokers the request excludes (a request keeping to
        # one invoker looks at that invoker's GPUs only).
        cluster = scan.cluster
        avoid = {o for ref in request.avoid_gpus if (o := cluster.ordinals.get(ref)) is not None}
        for inv in request.avoid_invokers:
            avoid.update(cluster.invoker_ordinals.get(inv, ()))
        return cls(scan, request, config, frozenset(f.name for f in filters), max_parts, frozenset(avoid))

    def passes(self, lr: LitRoom, memory_mib: float) -> bool:
        """`_piece_passes` of a piece of `memory_mib` on the lit GPU `lr` describes."""
        if self.schedulable and not lr[7]:
            return False
        if self.avoid and lr[4] in self.avoid:
            return False
        if self.memory and not lr[5] + memory_mib <= lr[6]:
            return False
        # `_part_request`'s request and limit of the piece, as `_piece_passes` computes them.
        f = memory_mib / self.total
        r = min(self.request, self.request * f)
        lim = min(self.limit, self.limit * f)
        if self.sm_request and not lr[2] + r <= self.omega_eps:
            return False
        if self.sm_limit and not lr[3] + lim <= self.gamma:
            return False
        return not (self.static and not lr[3] + lim <= 1.0 + EPS)

    def plan(self, lit: Sequence[LitRoom]) -> tuple[list[tuple[int, float]], float] | None:
        """`_split_plan(scan.candidates(...), ...)` of the invoker whose lit GPUs `lit` describes
        (in ordinal order): the pieces (ordinal, MiB) and the room they leave unused, or None."""
        total, min_part, too_full = self.total, self.min_part, self.too_full
        per_request, per_limit, omega, limit_cap = self.per_request, self.per_limit, self.omega, self.limit_cap
        caps: list[float] = []
        ranked: list[tuple[float, int, LitRoom]] = []
        for lr in lit:
            c, free, used_request, used_limit = lr[0], lr[1], lr[2], lr[3]
            if used_request >= too_full or free < min_part:
                continue
            if per_request:
                x = (omega - used_request) * per_request
                c = x if x < c else c
            if per_limit:
                x = (limit_cap - used_limit) * per_limit
                c = x if x < c else c
            if c >= min_part:
                caps.append(c if c < total else total)
                ranked.append((-c, lr[4], lr))
        if len(ranked) < 2 or sum(caps) < total - EPS:
            return None
        ranked.sort()  # (-capacity, ordinal): `_split_plan`'s order (ordinals are unique)
        remaining = total
        plan: list[tuple[int, float]] = []
        unused = 0.0
        for neg, o, lr in ranked[: self.max_parts]:
            cap = -neg
            take = remaining if remaining < cap else cap
            left = remaining - take
            if 0 < left < min_part:
                # Leave a last piece that is not too small to be a stage.
                take = remaining - min_part
                if take < min_part:
                    continue
            if not self.passes(lr, take):
                continue
            plan.append((o, take))
            unused += cap - take
            remaining -= take
            if remaining <= EPS:
                break
        if remaining > EPS or len(plan) < 2:
            return None
        return plan, unused


_INLINE_PIECE_FILTERS = frozenset({"schedulable", "avoid", "sm-request", "sm-limit", "sm-limit-static", "memory"})


#: Relative slack of `_SplitScan.memory_bound_ratios` against the rounding of the capacities.
_RATIO_SLACK = 1.0 + 1e-6


#: Slack (MiB) of the two-piece window of `_place_split` against rounding: a pair of GPUs whose
#: memory rooms add up to within this of the window is looked at.
_PAIR_SLACK_MIB = 1e-3


class _SplitScan:
    """How split placement looks at the invokers whose lit GPUs could take pieces of `request`
    (memory > 0): which invokers (`firsts`, by first ordinal), which of them cannot hold it in few
    enough pieces without looking at their GPUs (`cannot_hold`), and each one's candidates
    (`candidates`: [(capacity MiB, ordinal)] of its lit GPUs that could take a piece)."""

    __slots__ = (
        "cluster",
        "entries",
        "limit_cap",
        "min_part",
        "need",
        "omega",
        "per_limit",
        "per_request",
        "too_full",
        "total",
    )

    def __init__(
        self,
        cluster: ClusterSnapshot,
        request: PlacementRequest,
        config: PlacementConfig,
        filters: tuple[Filter, ...],
        max_parts: int,
    ) -> None:
        total = request.memory_mib
        self.cluster = cluster
        self.total = total
        self.min_part = min_part = min(config.min_part_mib, total)
        # A GPU whose Σ request leaves no room for even the smallest piece's request (or, as Σ
        # request ≤ Σ limit, its limit) is never looked at: its bucket and the ones above are skipped.
        bound = math.inf
        # The smallest piece's request and limit as `_part_request` computes them; the size
        # filters' bounds on them inline (the same expressions), others on the built piece.
        share = min_part / total
        piece_request = min(request.request, request.request * share)
        piece_limit = min(request.limit, request.limit * share)
        piece: PlacementRequest | None = None
        for f in filters:
            if f.bound is not None:
                if f is _F_SM_REQUEST:
                    b = config.omega - piece_request
                elif f is _F_SM_LIMIT:
                    b = config.gamma - piece_limit
                elif f is _F_SM_LIMIT_STATIC:
                    b = 1.0 - piece_limit
                else:
                    piece = piece or _part_request(request, min_part, 0)
                    b = f.bound(piece, config)
                bound = min(bound, b)
        kmax = BUCKETS
        if bound < math.inf:
            kmax = -1 if bound < -EPS else min(BUCKETS, math.floor((bound + EPS) * BUCKETS))
        # The most memory (MiB) one piece on a GPU may take, given that a piece's request and limit
        # are the instance's scaled by its share of the memory; computed inline: the scan visits
        # every lit GPU of every invoker that could hold the instance.
        names = {f.name for f in filters}
        self.per_request = total / request.request if "sm-request" in names and request.request > 0 else 0.0
        limit_cap = 0.0
        if request.limit > 0:
            if "sm-limit" in names:
                limit_cap = config.gamma
            if "sm-limit-static" in names:
                limit_cap = min(limit_cap, 1.0) if limit_cap else 1.0
        self.per_limit = total / request.limit if limit_cap else 0.0
        self.omega = config.omega + EPS
        self.limit_cap = limit_cap + EPS
        # request_bucket(u) > kmax  ⇔  u·BUCKETS + EPS ≥ kmax + 1: one comparison per GPU.
        self.too_full = (
            (kmax + 1 - EPS) / BUCKETS if request.only_invoker is None and kmax < BUCKETS else math.inf
        )
        self.need = total - EPS - _SPLIT_SLACK_MIB
        # Node-room entries of the invokers to look at; None: only `request.only_invoker`.
        self.entries: Sequence[NodeRoom] | None = None
        if request.only_invoker is None:
            # A piece never takes more than its GPU's free memory, so only invokers whose lit GPUs
            # together have `total` free can hold the instance: a suffix of the index.
            slack = EPS + 2 * max_parts * cluster.max_memory_mib * EPS
            lo = bisect.bisect_left(cluster.node_room, (total - slack, -1))
            self.entries = cluster.node_room[lo:]

    def firsts(self, request: PlacementRequest, roomiest_first: bool = False) -> list[tuple[int, NodeRoom | None]]:
        """(first ordinal, node-room entry) of the invokers to look at: those whose lit GPUs have
        the least free memory in all first (the likeliest to leave the least room unused), or with
        `roomiest_first` the most."""
        if self.entries is None:
            ords = self.cluster.invoker_ordinals.get(request.only_invoker or "", ())
            return [(ords[0], None)] if ords else []
        if roomiest_first:
            return [(e[1], e) for e in reversed(self.entries)]
        return [(e[1], e) for e in self.entries]

    def cannot_hold(self, entry: NodeRoom | None, pieces: int) -> bool:
        """Whether the invoker cannot hold the instance in `pieces` pieces or fewer, known from its
        node-room bounds alone: no lit GPU of it may take more than the bound (capacities are
        min(memory × (1 + EPS) − used, (ω − Σ request) × MiB per request, (γ − Σ limit) × MiB per
        limit), each term at least its value at any of the invoker's lit GPUs, as rounding is
        monotone), and `pieces` such pieces hold less than the instance."""
        if entry is None:
            return False
        most = entry[2]
        if self.per_request:
            x = (self.omega - entry[3]) * self.per_request
            most = x if x < most else most
        if self.per_limit:
            x = (self.limit_cap - entry[4]) * self.per_limit
            most = x if x < most else most
        return pieces * most < self.need

    def memory_bound_ratios(self) -> tuple[float, float]:
        """Bounds on a node-room entry's last two fields (`SPLIT_OMEGA`) under which memory alone
        holds a piece back on every lit GPU of the invoker: the instance's MiB per unit of request
        (limit), less a relative slack far above rounding, where its caps are at least Dilu's (else
        −∞: the entry's greatest Σ request and Σ limit decide)."""
        ratio_request = ratio_limit = -math.inf
        if self.omega >= SPLIT_OMEGA:
            ratio_request = self.per_request / _RATIO_SLACK
        if self.limit_cap >= SPLIT_GAMMA:
            ratio_limit = self.per_limit / _RATIO_SLACK
        return ratio_request, ratio_limit

    def outside_window(self, entry: NodeRoom | None, window: float) -> bool:
        """Whether the invoker has no two-piece plan whose capacities add up to at most `window`
        (`total` + the best two-piece plan's unused room + `_PAIR_SLACK_MIB`), known from its
        node-room entry alone: on none of its lit GPUs does the request's or limit's room hold a
        piece back below the memory room (both at their tightest GPU, by monotone rounding, are
        above its roomiest GPU's memory room), so a capacity is the memory room, and no pair of
        those rooms adds up to between the instance (less `_PAIR_SLACK_MIB`) and `window`."""
        if entry is None:
            return False
        ratio_request, ratio_limit = self.memory_bound_ratios()
        if (
            self.per_request
            and entry[9] > ratio_request
            and (self.omega - entry[6]) * self.per_request < entry[2]
        ):
            return False
        if self.per_limit and entry[10] > ratio_limit and (self.limit_cap - entry[7]) * self.per_limit < entry[2]:
            return False
        pairs = entry[8]
        i = bisect.bisect_left(pairs, self.need - _PAIR_SLACK_MIB)
        return i == len(pairs) or pairs[i] > window

    def lit(self, first: int) -> tuple[LitRoom, ...]:
        """The `LitRoom`s of the lit GPUs of the invoker whose first ordinal is `first`, as its
        node-room entry holds them."""
        cluster = self.cluster
        built = _node_room(cluster.invoker_ordinals[cluster.refs[first].invoker], cluster.gpus)
        return () if built is None else built[5]

    def candidates(self, first: int, entry: NodeRoom | None) -> list[tuple[float, int]]:
        """[(capacity MiB, ordinal)] of the invoker's lit GPUs that could take a piece, in ordinal
        order (from its node-room entry where there is one)."""
        min_part = self.min_part
        too_full = self.too_full
        per_request, per_limit = self.per_request, self.per_limit
        omega, limit_cap = self.omega, self.limit_cap
        lit = entry[5] if entry is not None else self.lit(first)
        cands: list[tuple[float, int]] = []
        for c, free, used_request, used_limit, o, _, _, _ in lit:
            if used_request >= too_full or free < min_part:
                continue
            # `x if x < c else c` is `min(c, x)`, without the call.
            if per_request:
                x = (omega - used_request) * per_request
                c = x if x < c else c
            if per_limit:
                x = (limit_cap - used_limit) * per_limit
                c = x if x < c else c
            if c >= min_part:
                cands.append((c, o))
        return cands


#: Split placement's vectorised bounds (`_LitTable`) need numpy (the `[sim]` extra); without it
#: the walk below runs alone, to the same decisions.
try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed with the `[sim]` and `[test]` extras
    _np = None  # type: ignore[assignment]

#: Slack (MiB) of `_split_bounds` against the rounding of the plan's own sums (float64 in numpy is
#: IEEE double as Python's float, but its sums are taken in another order).
_TABLE_SLACK_MIB = 1e-6
#: Whether split placement uses them (tests switch them off to compare with the walk), and from how
#: many invokers on (fewer are walked faster than numpy is called).
_VECTOR_BOUNDS = True
_VECTOR_MIN_ENTRIES = 256


class _LitTable:
    """The `LitRoom`s of node-room entries as rows of one array, so that split placement bounds
    every invoker's plan at C speed and plans only those whose bound may beat the best so far.

    A row is made the first time a split meets an entry and kept by the entry's identity (entries
    are immutable tuples shared by the snapshots derived from one another while the invoker is
    unchanged; the table keeps each entry it holds alive, so its id is not reused). A cache, not
    part of any snapshot's value: it starts afresh when full."""

    __slots__ = ("first", "keep", "rows", "size", "values", "width")

    MAX_ENTRIES = 1 << 17
    #: A row's fields per lit GPU: memory room, free memory, Σ request, Σ limit, used memory, grown
    #: memory, ordinal, schedulable (1.0 / 0.0); an empty slot has no free memory (-∞), so it is
    #: never a candidate.
    FIELDS = 8

    def __init__(self, width: int = 4, size: int = 4096) -> None:
        self.width, self.size = width, size
        self.rows: dict[int, int] = {}
        self.keep: list[NodeRoom] = []
        self.values = self._empty(size)
        self.first = _np.zeros(size, dtype=_np.int64)

    def _empty(self, size: int) -> Any:
        values = _np.zeros((size, self.FIELDS, self.width))
        values[:, 1] = -_np.inf
        return values

    def indexes(self, entries: Sequence[NodeRoom]) -> Any:
        """The rows of `entries` (made where missing), as an array in their order; None when an
        entry has more lit GPUs than the table is wide."""
        rows = self.rows
        got = list(map(rows.get, map(id, entries), repeat(-1)))
        if -1 in got:
            missing = [k for k, r in enumerate(got) if r < 0]
            if len(self.keep) + len(missing) > self.MAX_ENTRIES:
                self.__init__(self.width, self.size)  # type: ignore[misc]
                return self.indexes(entries)
            width = self.width
            if any(len(entries[k][5]) > width for k in missing):
                return None
            start = len(self.keep)
            for k in missing:
                e = entries[k]
                rows[id(e)] = got[k] = len(self.keep)
                self.keep.append(e)
            if len(self.keep) > self.size:
                size = self.size
                while size < len(self.keep):
                    size *= 2
                values, first = self._empty(size), _np.zeros(size, dtype=_np.int64)
                values[: self.size] = self.values
                first[: self.size] = self.first
                self.values, self.first, self.size = values, first, size
            # The new rows in one assignment: (row, slot) of each lit GPU and its fields.
            where_row: list[int] = []
            where_slot: list[int] = []
            fields: list[tuple[float, ...]] = []
            for r in range(start, len(self.keep)):
                lit = self.keep[r][5]
                where_row.extend([r] * len(lit))
                where_slot.extend(range(len(lit)))
                fields.extend((lr[0], lr[1], lr[2], lr[3], lr[5], lr[6], lr[4], lr[7]) for lr in lit)
            self.first[start : len(self.keep)] = [e[1] for e in self.keep[start:]]
            if fields:
                self.values[where_row, :, where_slot] = fields
        return _np.array(got, dtype=_np.int64)


_TABLE: list[_LitTable] = []


def _table_rows(entries: Sequence[NodeRoom]) -> tuple[_LitTable, Any]:
    """The table and the rows of `entries` in it (a wider table replaces it when an entry needs
    one)."""
    if not _TABLE:
        _TABLE.append(_LitTable())
    idx = _TABLE[0].indexes(entries)
    if idx is None:
        _TABLE[0] = _LitTable(width=max(len(e[5]) for e in entries))
        idx = _TABLE[0].indexes(entries)
    return _TABLE[0], idx


#: `_split_bounds`' answer: for the invokers that may hold a plan, their indexes in the entries, the
#: lower bounds on their plan's pieces and unused room, their first ordinals, and whether the bound
#: is the plan's own (pieces, unused room).
_Bounds = tuple[Any, Any, Any, Any, Any]


def _split_bounds(
    scan: _SplitScan, inline: _InlineSplit, entries: Sequence[NodeRoom], max_parts: int
) -> _Bounds | None:
    """Bounds on the plans of `inline` of the invokers of `entries` (see `_Bounds`); an invoker
    left out has no plan. None: numpy is missing or there are too few invokers to be worth it
    (walk instead).

    The bounds, from the capacities `inline.plan` computes (the same float64 expressions):

    * A plan's pieces lie on GPUs that pass the piece filters, so not on a GPU the request avoids or
      a draining one (where those filters apply); each takes at most its capacity and together they
      take the instance (less EPS): at least as many pieces as the fewest largest of those
      capacities that add up to the instance, and two; a plan of two pieces leaves unused at least
      the least sum of two capacities that holds the instance, less the instance; any plan leaves
      unused at least nothing.
    * Where the plan is known from its first steps, exactly: its first piece goes to the roomiest
      such GPU (then the first in ordinal order); if that GPU takes the whole instance (its filters,
      evaluated as `_InlineSplit.passes` does, pass), there is no plan; if it takes its capacity c₀
      and leaves a rest r = instance − c₀ of at least the smallest piece, and the next such GPU
      (capacity c₁ ≥ r, ranked among the `max_parts` largest candidates) passes for r, the plan is
      those two pieces and leaves c₁ − r unused."""
    if _np is None or len(entries) < _VECTOR_MIN_ENTRIES:
        return None
    table, idx = _table_rows(entries)
    np = _np
    n = len(idx)
    cols = np.arange(n)
    values = np.ascontiguousarray(table.values.take(idx, axis=0).transpose(1, 2, 0))
    cap, free, request, limit, used, grown, ordinal, schedulable = values
    base = free >= scan.min_part
    if scan.too_full < math.inf:
        base &= request < scan.too_full
    # `x if x < c else c` as `inline.plan` takes it: the same value as the least of the two.
    if scan.per_request:
        cap = np.minimum(cap, (scan.omega - request) * scan.per_request)
    if scan.per_limit:
        cap = np.minimum(cap, (scan.limit_cap - limit) * scan.per_limit)
    base &= cap >= scan.min_part
    usable = base
    if inline.schedulable:
        usable = usable & (schedulable > 0.0)
    for o in inline.avoid:
        usable = usable & (ordinal != o)
    total = scan.total
    need = total - EPS - _TABLE_SLACK_MIB
    # The two roomiest usable GPUs, the first in ordinal order among equals (the plan's order).
    u = np.where(usable, cap, -np.inf)
    i0 = u.argmax(axis=0)
    c0 = u[i0, cols]
    u[i0, cols] = -np.inf
    i1 = u.argmax(axis=0)
    c1 = u[i1, cols]
    u[i0, cols] = c0
    count = usable.sum(axis=0)
    two_hold = c0 + c1 >= need
    maybe = (count >= 2) & two_hold
    pieces = np.full(n, 2)
    if max_parts > 2:
        # Three or more pieces: the fewest largest capacities that hold the instance.
        more = np.flatnonzero((count >= 3) & ~two_hold)
        if len(more):
            held = np.cumsum(np.maximum(-np.sort(-u[:, more], axis=0), 0.0), axis=0)
            reach = held >= need
            fewest = reach.argmax(axis=0) + 1
            ok = reach[-1] & (fewest <= max_parts)
            maybe[more[ok]] = True
            pieces[more] = fewest
    known = maybe & two_hold
    if max_parts < len(cap):
        # Where the second one ranks among the plan's candidates (the first ranks before it).
        ahead = (cap > c1) | ((cap == c1) & (np.arange(len(cap))[:, None] < i1))
        known &= (ahead & base).sum(axis=0) < max_parts

    def passes(at: Any, take: Any) -> Any:
        # `_InlineSplit.passes` of a piece of `take` on the GPU in slot `at` of each invoker
        # (schedulable and avoid are in `usable`).
        ok = np.ones(n, dtype=bool)
        if inline.memory:
            ok &= used[at, cols] + take <= grown[at, cols]
        f = take / total
        if inline.sm_request:
            ok &= request[at, cols] + np.minimum(inline.request, inline.request * f) <= inline.omega_eps
        if inline.sm_limit or inline.static:
            lim = limit[at, cols] + np.minimum(inline.limit, inline.limit * f)
            if inline.sm_limit:
                ok &= lim <= inline.gamma
            if inline.static:
                ok &= lim <= 1.0 + EPS
        return ok

    whole = maybe & (c0 >= total)
    if whole.any():
        # Its first piece takes all of it (and passes): one piece, no plan.
        maybe &= ~(whole & passes(i0, np.full(n, total)))
    rest = total - c0
    take1 = np.where(rest < c1, rest, c1)
    exact = known & (c0 < total) & (rest >= scan.min_part) & (c1 >= rest)
    if exact.any():
        exact &= passes(i0, c0) & passes(i1, take1)
    sel = np.flatnonzero(maybe)
    pieces = pieces[sel]
    unused = np.zeros(len(sel))
    exact = exact[sel]
    at = sel[exact]
    unused[exact] = c1[at] - take1[at]
    loose = np.flatnonzero(~exact & (pieces == 2))
    if len(loose):
        w = len(cap)
        a, b = _PAIRS.get(w) or _PAIRS.setdefault(w, np.triu_indices(w, 1))
        sub = u[:, sel[loose]]
        pairs = sub[a] + sub[b]
        least = np.where(pairs >= need, pairs, np.inf).min(axis=0) - total - _TABLE_SLACK_MIB
        unused[loose] = np.maximum(least, 0.0)
    return sel, pieces, unused, table.first[idx[sel]], exact


_PAIRS: dict[int, tuple[Any, Any]] = {}


def _best_first(
    bounds: _Bounds, plan_of: Callable[[int], tuple[list[tuple[int, float]], float] | None]
) -> tuple[tuple[int, float, int], list[tuple[int, float]]] | None:
    """The least (pieces, unused room, first ordinal) and its plan over the invokers `bounds`
    describes, `plan_of(k)` planning the invoker of index k: the one of least bound first, then,
    in the order of their bounds, those whose bound is less than the best plan so far (every plan's
    key is at least its bound's, so no other can be less)."""
    sel, pieces, unused, first, _ = bounds
    if not len(sel):
        return None
    np = _np
    best: tuple[tuple[int, float, int], list[tuple[int, float]]] | None = None
    # The least bound, found without sorting them all.
    m = pieces == pieces.min()
    m &= unused == unused[m].min()
    j = int(np.flatnonzero(m & (first == first[m].min()))[0])
    found = plan_of(int(sel[j]))
    if found is not None:
        best = ((len(found[0]), found[1], int(first[j])), found[0])
        p, u, f = best[0]
        below = (pieces < p) | ((pieces == p) & ((unused < u) | ((unused == u) & (first < f))))
        below[j] = False
        rest = np.flatnonzero(below)
    else:
        rest = np.flatnonzero(np.arange(len(sel)) != j)
    if len(rest):
        rest = rest[np.lexsort((first[rest], unused[rest], pieces[rest]))]
        for k, lb_p, lb_u, f in zip(sel[rest].tolist(), pieces[rest].tolist(), unused[rest].tolist(),
                                    first[rest].tolist(), strict=True):
            if best is not None and (lb_p, lb_u, f) >= best[0]:
                break
            found = plan_of(k)
            if found is None:
                continue
            key = (len(found[0]), found[1], f)
            if best is None or key < best[0]:
                best = (key, found[0])
    return best


def _lost_room_sizes(
    cluster: ClusterSnapshot,
    request: PlacementRequest,
    config: PlacementConfig,
    filters: tuple[Filter, ...],
    scan: _SplitScan,
    plan: list[tuple[int, float]],
) -> list[tuple[int, float]]:
    """The pieces of `plan` (ordinal, MiB) resized on the same GPUs so that they leave as little
    lost SM room as they can, while Σ request bounds the lit GPUs (Σ request ≥ Σ memory in GPUs'
    worth, this instance included; else `plan`). SM room is lost while no live instance fits it:
    it is below the least request, or the free memory beside it below the least memory (this
    instance included). `plan` fills its first GPUs to capacity and leaves the rest to the last; on
    a GPU where memory binds first, a full piece leaves SM room beside no free memory. Each piece
    may instead fill its GPU's SM room exactly, or leave room some instance can use (then any size
    up to that), or take its capacity; the least lost room over these choices wins, `plan` where it
    is as good. Same GPUs, pieces and Σ memory, so the plan's key (pieces, unused room) holds."""
    total = request.memory_mib
    if total <= 0 or request.request <= 0:
        return plan
    if cluster.sum_request + request.request < cluster.sum_memory_fraction + total / cluster.max_memory_mib:
        return plan  # memory binds: `plan` fills memory first already
    smallest = cluster.smallest_request()
    least = cluster.smallest_memory()
    s_r = request.request if smallest is None else min(smallest, request.request)
    s_m = request.memory_mib if least is None else min(least, request.memory_mib)
    rho = request.request / total
    omega = config.omega
    min_part = scan.min_part
    gpus = cluster.gpus
    grow = 1.0 + EPS

    def lost(g: GpuState, x: float) -> float:
        room = omega - g.used_request - x * rho
        if room >= s_r - EPS and g.used_memory + x + s_m <= g.memory_mib * grow:
            return 0.0
        return max(0.0, room)

    # Per GPU: (capacity, the size that fills the binding dimension or None, the most that leaves
    # usable room or None).
    shapes: list[tuple[float, float | None, float | None]] = []
    for o, _ in plan:
        g = gpus[o]
        cap = g.memory_mib * grow - g.used_memory
        if scan.per_request:
            cap = min(cap, (scan.omega - g.used_request) * scan.per_request)
        if scan.per_limit:
            cap = min(cap, (scan.limit_cap - g.used_limit) * scan.per_limit)
        fill = (omega - g.used_request) / rho
        usable = min(cap, (omega - g.used_request - s_r) / rho, g.memory_mib - g.used_memory - s_m)
        shapes.append((
            cap,
            fill if min_part <= fill <= cap else None,
            usable if usable >= min_part else None,
        ))
    now = sum(lost(gpus[o], x) for o, x in plan)
    if now <= EPS:
        return plan
    best: tuple[float, list[tuple[int, float]]] | None = None
    for choice in itertools.product(range(3), repeat=len(plan)):
        fixed = 0.0
        flexible: list[int] = []
        miss = 0.0
        ok = True
        for j, c in enumerate(choice):
            most, exact, keep = shapes[j]
            if c == 0:
                fixed += most
                miss += lost(gpus[plan[j][0]], most)
            elif c == 1:
                if exact is None:
                    ok = False
                    break
                fixed += exact
            else:
                if keep is None:
                    ok = False
                    break
                flexible.append(j)
        if not ok or (best is not None and miss >= best[0]):
            continue
        rest = total - fixed
        if flexible:
            if not len(flexible) * min_part - EPS <= rest <= sum(shapes[j][2] or 0.0 for j in flexible) + EPS:
                continue
        elif abs(rest) > EPS:
            continue
        sizes = [shapes[j][0] if c == 0 else (shapes[j][1] or 0.0) for j, c in enumerate(choice)]
        left = rest - len(flexible) * min_part
        for j in flexible:
            add = min(left, (shapes[j][2] or 0.0) - min_part)
            sizes[j] = min_part + max(0.0, add)
            left -= max(0.0, add)
        # Σ memory exactly the instance's: the rounding goes to the largest piece.
        big = max(range(len(sizes)), key=lambda j: sizes[j])
        sizes[big] += total - sum(sizes)
        best = (miss, [(plan[j][0], sizes[j]) for j in range(len(plan))])
    if best is None or best[0] >= now - EPS:
        return plan
    resized = best[1]
    for o, x in resized:
        if not (min_part - EPS <= x <= gpus[o].memory_mib * grow - gpus[o].used_memory) or not _piece_passes(
            gpus[o], request, x, config, filters
        ):
            return plan
    return resized


def _place_split(
    cluster: ClusterSnapshot,
    request: PlacementRequest,
    config: PlacementConfig,
    strategy: Strategy,
    filters: tuple[Filter, ...],
    max_parts: int,
) -> PlacementDecision | None:
    """Split the instance's memory over 2..max_parts lit GPUs of one invoker, never lighting one.

    Each piece's request and limit are the instance's scaled by the piece's share of the memory,
    so Σ request, Σ limit and Σ memory over the pieces equal the instance's (nothing is reserved
    twice); pipeline stages keep the instance's throughput, while one request passes the stages one
    after another. Per invoker the GPUs that can take the largest pieces are used first (fewest
    pieces); the invoker needing the fewest pieces wins, then the one leaving the least room unused
    on the GPUs it uses, then cluster order.
    """
    total = request.memory_mib
    if total <= 0:
        return None
    min_part = min(config.min_part_mib, total)
    gpus = cluster.gpus
    scan = _SplitScan(cluster, request, config, filters, max_parts)
    best: tuple[tuple[int, float, int], list[tuple[int, float]]] | None = None
    # The best plan is the least key over every invoker, whatever order they are looked at in (an
    # invoker is passed over only when its plans are all worse than the best so far); the tightest
    # first, so that the best so far is good early. One that cannot hold the instance in as few
    # pieces as the best so far is passed over without looking at its GPUs.
    per_request, per_limit, omega, limit_cap = scan.per_request, scan.per_limit, scan.omega, scan.limit_cap
    need = scan.need
    pieces = max_parts
    # Once the best plan so far has two pieces, only a two-piece plan leaving no more room unused
    # can beat it, and such a plan uses two GPUs whose capacities add up to between `need` and
    # `total` + its unused room. An invoker on which no piece is held back by
    # its request or limit (capacity = memory × (1 + EPS) − used on each of its lit GPUs) and no pair
    # of lit GPUs' memory rooms adds up to that window is passed over: one bisection of its pair sums.
    window = -math.inf
    low = need - _PAIR_SLACK_MIB
    if scan.entries is not None:
        entries: Sequence[NodeRoom] = scan.entries
    else:
        # The one invoker the request keeps to, its entry built as the snapshot builds them.
        ords = cluster.invoker_ordinals.get(request.only_invoker or "", ())
        one = _node_room(ords, gpus) if ords else None
        entries = () if one is None else (one,)
    too_full = scan.too_full
    ratio_request, ratio_limit = scan.memory_bound_ratios()
    inline = _InlineSplit.of(scan, request, config, filters, max_parts)
    bounds = None
    if inline is not None and scan.entries is not None and _VECTOR_BOUNDS:
        bounds = _split_bounds(scan, inline, entries, max_parts)
    if bounds is not None:
        # Best first, by the bounds (the same least key as the walk below).
        best = _best_first(bounds, lambda k: inline.plan(entries[k][5]))  # type: ignore[union-attr]
        entries = ()
    for entry in entries:
        # `scan.cannot_hold(entry, pieces)` inline: this loop visits every invoker with the free
        # memory for the instance.
        most = entry[2]
        if per_request:
            x = (omega - entry[3]) * per_request
            most = x if x < most else most
        if per_limit:
            x = (limit_cap - entry[4]) * per_limit
            most = x if x < most else most
        if pieces * most < need:
            continue
        # `scan.outside_window(entry, window)` inline.
        if (
            window > low
            and (not per_request or entry[9] <= ratio_request or (omega - entry[6]) * per_request >= entry[2])
            and (not per_limit or entry[10] <= ratio_limit or (limit_cap - entry[7]) * per_limit >= entry[2])
        ):
            pairs = entry[8]
            i = bisect.bisect_left(pairs, low)
            if i == len(pairs) or pairs[i] > window:
                continue
        if inline is None:
            # `scan.candidates(entry[1], entry)` inline.
            cands: list[tuple[float, int]] = []
            for c, free, used_request, used_limit, o, _, _, _ in entry[5]:
                if used_request >= too_full or free < min_part:
                    continue
                if per_request:
                    x = (omega - used_request) * per_request
                    c = x if x < c else c
                if per_limit:
                    x = (limit_cap - used_limit) * per_limit
                    c = x if x < c else c
                if c >= min_part:
                    cands.append((c, o))
            if len(cands) < 2:
                continue
            if best is not None and _split_cannot_win(cands, total, max_parts, best[0][0], best[0][1]):
                continue
            found = _split_plan(cands, request, config, filters, total, min_part, max_parts, gpus)
            if found is None:
                continue
            plan, unused = found
        else:
            found = inline.plan(entry[5])
            if found is None:
                continue
            plan, unused = found
        key = (len(plan), unused, entry[1])
        if best is None or key < best[0]:
            best = (key, plan)
            pieces = key[0]
            if pieces == 2:
                window = total + unused + _PAIR_SLACK_MIB
    if best is None:
        return None
    plan = _lost_room_sizes(cluster, request, config, filters, scan, best[1])
    parts = []
    for k, (o, mem) in enumerate(plan):
        piece = _part_request(request, mem, k)
        inst = piece.to_instance()
        parts.append(
            PlacementPart(
                gpu=cluster.refs[o],
                instance=PlacedInstance(
                    id=inst.id,
                    function=inst.function,
                    cls=inst.cls,
                    request=inst.request,
                    limit=inst.limit,
                    memory_mib=inst.memory_mib,
                    profile=inst.profile,
                    part_of=request.instance_id,
                ),
            )
        )
    return _split_decision(
        request, strategy, parts, 0, f"split over {len(parts)} lit GPUs of {parts[0].gpu.invoker} instead of lighting one"
    )


def _place_split_node_fit(
    cluster: ClusterSnapshot,
    request: PlacementRequest,
    config: PlacementConfig,
    strategy: Strategy,
    filters: tuple[Filter, ...],
    max_parts: int,
) -> PlacementDecision | None:
    """`_place_split` choosing the invoker by node-level best fit on memory where memory binds the
    cluster (`PlacementConfig.split_node_fit`); where Σ request binds, `_place_split` itself.

    Room a node keeps after a split is only of use to what fits its GPUs, and a stage pairs only with
    its own node's GPUs: the fewest pieces first sends an instance to the node where it needs fewest
    GPUs and leaves the tight nodes (a training gang's crumbs, which only instances of about their
    size fill) to no one. Here the invoker whose lit GPUs have the least free memory left once the
    instance is placed wins (in whole MiB), then the fewest pieces, then the least room left unused on
    the GPUs it uses, then cluster order; per invoker the plan is `_place_split`'s (the largest
    capacities first). Invokers are visited by their lit GPUs' free memory, ascending, and the visit
    stops at the first with more than the best. Memory binds where Σ memory / capacity ≥ Σ request,
    this instance included; where Σ request binds, node fit on either resource packed worse than the
    fewest pieces (docs/benchmarks/sim-scale.md, twenty-second round)."""
    total = request.memory_mib
    if total <= 0:
        return None
    capacity = cluster.max_memory_mib
    if (cluster.sum_memory + total) / capacity < cluster.sum_request + request.request:
        return _place_split(cluster, request, config, strategy, filters, max_parts)
    gpus = cluster.gpus
    scan = _SplitScan(cluster, request, config, filters, max_parts)
    if scan.entries is not None:
        entries: Sequence[NodeRoom] = scan.entries
    else:
        ords = cluster.invoker_ordinals.get(request.only_invoker or "", ())
        one = _node_room(ords, gpus) if ords else None
        entries = () if one is None else (one,)
    inline = _InlineSplit.of(scan, request, config, filters, max_parts)
    min_part = scan.min_part
    best: tuple[tuple[float, int, float, int], list[tuple[int, float]]] | None = None
    for entry in entries:
        room = float(round(entry[0] - total))
        if best is not None and room > best[0][0]:
            break
        if scan.cannot_hold(entry, max_parts):
            continue
        if inline is not None:
            found = inline.plan(entry[5])
        else:
            cands = scan.candidates(entry[1], entry)
            found = (
                _split_plan(cands, request, config, filters, total, min_part, max_parts, gpus)
                if len(cands) >= 2 else None
            )
        if found is None:
            continue
        key = (room, len(found[0]), found[1], entry[1])
        if best is None or key < best[0]:
            best = (key, found[0])
    if best is None:
        return None
    plan = _lost_room_sizes(cluster, request, config, filters, scan, best[1])
    parts = tuple(
        PlacementPart(gpu=cluster.refs[o], instance=replace(
            _part_request(request, mem, k).to_instance(), part_of=request.instance_id))
        for k, (o, mem) in enumerate(plan)
    )
    return _split_decision(
        request, strategy, parts, 0,
        f"split over {len(parts)} lit GPUs of {parts[0].gpu.invoker} instead of lighting one (the node "
        f"left with the least free memory)",
    )
