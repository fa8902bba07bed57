"""Compaction: close the holes departures leave by moving instances off nearly empty GPUs.

Each move is make-before-break: start a replacement on the target GPU, route to it, then stop the
original; its price is one cold start (reported). A source GPU is only touched when *all* its
instances can move to GPUs that are already lit, so every accepted source turns one GPU off and no
move lights a GPU. Gangs (instances on several GPUs) and pieces of split instances are never moved;
an instance the strategy may split (an `llm` under `dilu` with `llm_max_parts` > 1) may be split
by its move when no single lit GPU can take it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dilu_invoker.policy.cluster import BUCKETS, ClusterSnapshot, request_bucket
from dilu_invoker.policy.placement import (
    PlacementConfig,
    PlacementPart,
    PlacementRequest,
    apply_placement,
    place,
)
from dilu_invoker.policy.types import GpuRef, PlacedInstance


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionConfig:
    source_max_request: float = 0.5
    """Only GPUs whose Σ request is at most this are emptied: fuller ones rarely fit elsewhere."""
    source_max_instances: int = 3
    """Only GPUs with at most this many instances: each instance moved costs a cold start."""
    max_sources: int = 32
    """How many source GPUs one call tries (bounds the work per call)."""
    max_moves: int = 64
    """How many moves one plan may contain (bounds cold starts per call)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.source_max_request <= 1.0:
            raise ValueError(
                f"source_max_request must be between 0 and 1, got {self.source_max_request!r}"
            )
        for name in ("source_max_instances", "max_sources", "max_moves"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class CompactionMove:
    instance_id: str
    function: str
    source: GpuRef
    target: GpuRef
    reason: str
    parts: tuple[PlacementPart, ...] = ()
    """Non-empty when the move split the instance: its pieces (`target` is the first's GPU)."""


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    moves: tuple[CompactionMove, ...]
    freed: tuple[GpuRef, ...]
    """GPUs that end up unlit."""
    cluster: ClusterSnapshot
    """The cluster once every move is done (equal to the input when there is nothing to do)."""
    reason: str

    @property
    def cold_starts(self) -> int:
        return len(self.moves)


def _as_request(inst: PlacedInstance, source: GpuRef) -> PlacementRequest:
    return PlacementRequest(
        instance_id=inst.id,
        function=inst.function,
        cls=inst.cls,
        request=inst.request,
        limit=inst.limit,
        memory_mib=inst.memory_mib,
        profile=inst.profile,
        avoid_gpus=frozenset({source}),
        lit_only=True,
    )


def compaction_plan(
    cluster: ClusterSnapshot,
    placement: PlacementConfig,
    config: CompactionConfig | None = None,
) -> CompactionPlan:
    """Moves that free the emptiest GPUs, found by re-running placement (lit GPUs only)."""
    config = config or CompactionConfig()
    work = cluster
    moves: list[CompactionMove] = []
    freed: list[GpuRef] = []
    tried = 0
    top = request_bucket(config.source_max_request)
    # Sources: lowest Σ request first, straight from the index (no walk over every GPU).
    sources = [o for k in range(min(top, BUCKETS) + 1) for o in cluster.lit_buckets[k]]
    for o in sources:
        if tried >= config.max_sources or len(moves) >= config.max_moves:
            break
        gpu = work.gpus[o]
        if (
            not gpu.instances
            or len(gpu.instances) > config.source_max_instances
            or gpu.used_request > config.source_max_request
            or any(i.gpus > 1 or i.part_of is not None for i in gpu.instances)
            or len(moves) + len(gpu.instances) > config.max_moves
        ):
            continue
        tried += 1
        trial = work
        trial_moves: list[CompactionMove] = []
        # Biggest first: they are the hardest to fit, so a hopeless source is abandoned early.
        for inst in sorted(
            gpu.instances, key=lambda i: (-i.request, -i.memory_mib, i.id)
        ):
            trial = trial.without_instance(inst.id)
            request = _as_request(inst, gpu.ref)
            decision = place(trial, request, placement)
            if not decision.placed:
                trial_moves = []
                break
            trial = apply_placement(trial, request, decision)
            trial_moves.append(
                CompactionMove(
                    instance_id=inst.id,
                    function=inst.function,
                    source=gpu.ref,
                    target=decision.gpus[0],
                    reason=f"empty {gpu.ref} (Σ request {gpu.used_request:.2f}): {decision.reason}",
                    parts=decision.parts,
                )
            )
        if trial_moves:
            work = trial
            moves.extend(trial_moves)
            freed.append(gpu.ref)
    if not moves:
        reason = f"nothing to compact: tried {tried} GPU(s) with Σ request ≤ {config.source_max_request:.2f}"
    else:
        reason = f"{len(moves)} move(s) turn off {len(freed)} GPU(s) at {len(moves)} cold start(s)"
    return CompactionPlan(
        moves=tuple(moves), freed=tuple(freed), cluster=work, reason=reason
    )
