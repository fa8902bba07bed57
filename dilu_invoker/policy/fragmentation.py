"""Dilu's fragmentation metrics and the lower bound on lit GPUs used by the evaluation.

Definitions (Dilu's artifact, `prior-art.md` §1.3), per *lit* GPU:
    SM_frag  = 1 − Σ sm_request
    Mem_frag = 1 − Σ memory / capacity
    score    = 0.6·SM_frag + 0.4·Mem_frag     (lower is better; placement minimises it after placing)
Cluster values are means over lit GPUs. An unlit GPU is not fragmented: it is simply off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dilu_invoker.policy.cluster import ClusterSnapshot
from dilu_invoker.policy.types import GpuState

#: Dilu's weights of SM and memory fragmentation in the placement score.
SM_WEIGHT = 0.6
MEMORY_WEIGHT = 0.4


@dataclass(frozen=True, slots=True)
class Fragmentation:
    sm: float
    memory: float
    score: float


def fragmentation_after(
    *,
    used_request: float,
    used_memory: float,
    capacity: float,
    sm_weight: float = SM_WEIGHT,
    memory_weight: float = MEMORY_WEIGHT,
) -> Fragmentation:
    """Fragmentation of one GPU with `used_request` of its SMs and `used_memory` MiB placed."""
    sm = 1.0 - used_request
    mem = 1.0 - used_memory / capacity
    return Fragmentation(sm=sm, memory=mem, score=sm_weight * sm + memory_weight * mem)


def gpu_fragmentation(gpu: GpuState) -> Fragmentation | None:
    """Fragmentation of one GPU; None for an unlit GPU (it is off, not fragmented)."""
    if not gpu.lit:
        return None
    return fragmentation_after(
        used_request=gpu.used_request,
        used_memory=gpu.used_memory,
        capacity=gpu.memory_mib,
    )


@dataclass(frozen=True, slots=True)
class ClusterFragmentation:
    lit_gpus: int
    sm_mean: float
    """Mean over lit GPUs of 1 − Σ sm_request (0 when nothing is lit)."""
    memory_mean: float
    """Mean over lit GPUs of 1 − Σ memory / capacity (0 when nothing is lit)."""
    score_mean: float


def cluster_fragmentation(
    cluster: ClusterSnapshot,
    *,
    sm_weight: float = SM_WEIGHT,
    memory_weight: float = MEMORY_WEIGHT,
) -> ClusterFragmentation:
    """Means over lit GPUs, in O(1) from the snapshot's running sums.

    Σ over lit GPUs of Σ request equals the cluster-wide Σ (unlit GPUs hold nothing), so the mean of
    1 − used over n lit GPUs is 1 − Σ/n; likewise for memory fractions.
    """
    n = cluster.lit_count
    if n == 0:
        return ClusterFragmentation(
            lit_gpus=0, sm_mean=0.0, memory_mean=0.0, score_mean=0.0
        )
    sm = 1.0 - cluster.sum_request / n
    mem = 1.0 - cluster.sum_memory_fraction / n
    return ClusterFragmentation(
        lit_gpus=n,
        sm_mean=sm,
        memory_mean=mem,
        score_mean=sm_weight * sm + memory_weight * mem,
    )


def _ceil(x: float) -> int:
    # ⌈2.0000000001⌉ must be 2: the sums come from floats.
    return max(0, math.ceil(x - 1e-6))


def lit_gpu_lower_bound(
    *, sm_request: float, memory_mib: float, memory_capacity_mib: float, widest: int
) -> int:
    """No placement can light fewer GPUs than this (issue 7's bound).

    max(⌈Σ gpus·sm_request⌉, ⌈Σ gpus·memory / capacity⌉, widest live instance), where the sums run
    over live instances and `widest` is the most GPUs one of them spans.
    """
    if memory_capacity_mib <= 0:
        raise ValueError("memory capacity must be > 0")
    return max(_ceil(sm_request), _ceil(memory_mib / memory_capacity_mib), widest)


def integral_lit_gpu_lower_bound(
    *,
    sm_request: float,
    memory_mib: float,
    memory_capacity_mib: float,
    widest: int,
    large_memory_slots: int,
    large_request_slots: int,
) -> int:
    """A tighter bound where training gangs hold large per-GPU slots (the integral bound).

    A gang's slot never shares its GPU with another slot bigger than half a GPU in the same
    dimension (two such would exceed the GPU), and a gang's slot is never split, so every such slot
    needs a GPU of its own: at least max(large-memory slots, large-request slots) GPUs are lit. All
    else is counted as divisible filler, which the fractional bound covers, so the bound is
    max(that, `lit_gpu_lower_bound`). `large_memory_slots`: Σ gpus over live training instances
    with more than half a GPU's memory per GPU; `large_request_slots`: likewise with SM request
    above 0.5.
    """
    return max(
        lit_gpu_lower_bound(
            sm_request=sm_request,
            memory_mib=memory_mib,
            memory_capacity_mib=memory_capacity_mib,
            widest=widest,
        ),
        large_memory_slots,
        large_request_slots,
    )


def cluster_lower_bound(cluster: ClusterSnapshot) -> int:
    """The lower bound for what is placed in `cluster` now (largest GPU capacity as the divisor)."""
    totals = cluster.totals()
    return lit_gpu_lower_bound(
        sm_request=totals.sm_request,
        memory_mib=totals.memory_mib,
        memory_capacity_mib=cluster.max_memory_mib,
        widest=totals.widest,
    )


__all__ = [
    "MEMORY_WEIGHT",
    "SM_WEIGHT",
    "ClusterFragmentation",
    "Fragmentation",
    "cluster_fragmentation",
    "cluster_lower_bound",
    "fragmentation_after",
    "gpu_fragmentation",
    "integral_lit_gpu_lower_bound",
    "lit_gpu_lower_bound",
]
