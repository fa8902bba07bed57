"""Compaction: close the holes departures leave by moving instances off nearly empty GPUs.

Each move is make-before-break: start a replacement on the target GPU, route to it, then stop the
original; its price is a cold start per process started (reported). A source GPU is only touched
when *all* its instances can move to GPUs that are already lit, so every accepted source turns one GPU
off and no move lights a GPU. Gangs (instances on several GPUs) never move; an instance the strategy
may split (an `llm` under `dilu` with `llm_max_parts` > 1) may be split by its move when no single lit
GPU can take it. With `move_pieces`, a piece of a split instance moves within its node, or else the
whole instance is placed anew (away from its current stages, so the old pipeline serves until the new
one does).
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
    move_pieces: bool = False
    """Whether a GPU holding a piece of a split instance (a pipeline stage) may be emptied: the
    piece moves to another GPU of its node that holds no other piece of the instance, or else the
    whole instance is placed anew (split again where it would light a GPU). Off in the live
    default: the action must be able to hand a stage over while the pipeline serves."""

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
    replaces: tuple[str, ...] = ()
    """Non-empty when a split instance was placed anew as a whole: the ids of the pieces it stops
    (`instance_id` is then the whole instance's id, `parts` its new pieces if it is split again)."""

    @property
    def cold_starts(self) -> int:
        """Processes the move starts: one per new piece (pipeline stage), else one."""
        return max(1, len(self.parts))


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
        return sum(m.cold_starts for m in self.moves)


def _as_request(
    cluster: ClusterSnapshot, inst: PlacedInstance, source: GpuRef
) -> PlacementRequest:
    avoid = {source}
    only_invoker = None
    max_parts = None
    if inst.part_of is not None:
        # A pipeline stage stays on its node, whole, and apart from its sibling stages.
        only_invoker = source.invoker
        max_parts = 1
        for o in cluster.invoker_ordinals[source.invoker]:
            if any(i.part_of == inst.part_of for i in cluster.gpus[o].instances):
                avoid.add(cluster.refs[o])
    return PlacementRequest(
        instance_id=inst.id,
        function=inst.function,
        cls=inst.cls,
        request=inst.request,
        limit=inst.limit,
        memory_mib=inst.memory_mib,
        profile=inst.profile,
        avoid_gpus=frozenset(avoid),
        only_invoker=only_invoker,
        lit_only=True,
        max_parts=max_parts,
    )


def _whole_request(
    cluster: ClusterSnapshot, piece: PlacedInstance
) -> tuple[PlacementRequest, tuple[str, ...], frozenset[GpuRef]]:
    """The split instance `piece` belongs to as one request (Σ of its pieces), its pieces' ids, and
    the GPUs they hold. The new pieces avoid those GPUs, so every old stage can serve until the new
    pipeline does (make-before-break) without two copies sharing a GPU's memory."""
    assert piece.part_of is not None
    ids: list[str] = []
    where: set[GpuRef] = set()
    request = limit = memory = 0.0
    invoker = cluster.refs[cluster.locations[piece.id][0]].invoker
    for o in cluster.invoker_ordinals[invoker]:
        for i in cluster.gpus[o].instances:
            if i.part_of == piece.part_of:
                ids.append(i.id)
                where.add(cluster.refs[o])
                request += i.request
                limit += i.limit
                memory += i.memory_mib
    whole = PlacementRequest(
        instance_id=piece.part_of,
        function=piece.function,
        cls=piece.cls,
        request=min(1.0, request),
        limit=min(1.0, max(limit, request)),
        memory_mib=memory,
        profile=piece.profile,
        avoid_gpus=frozenset(where),
        lit_only=True,
    )
    return whole, tuple(sorted(ids)), frozenset(where)


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
    # GPUs this plan moved something onto: never emptied again by the same plan (no ping-pong).
    targets: set[GpuRef] = set()
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
            or gpu.ref in targets
            or len(gpu.instances) > config.source_max_instances
            or gpu.used_request > config.source_max_request
            or any(
                i.gpus > 1 or (i.part_of is not None and not config.move_pieces)
                for i in gpu.instances
            )
            or len(moves) + len(gpu.instances) > config.max_moves
        ):
            continue
        tried += 1
        trial = work
        trial_moves: list[CompactionMove] = []
        trial_freed: list[GpuRef] = []
        # Biggest first: they are the hardest to fit, so a hopeless source is abandoned early.
        for inst in sorted(
            gpu.instances, key=lambda i: (-i.request, -i.memory_mib, i.id)
        ):
            trial = trial.without_instance(inst.id)
            request = _as_request(trial, inst, gpu.ref)
            decision = place(trial, request, placement)
            if not decision.placed and inst.part_of is not None:
                # No other GPU of its node takes the stage: place the whole instance anew.
                back = trial.with_instance(inst, (gpu.ref,))
                whole, ids, held = _whole_request(back, inst)
                rest = back
                for pid in ids:
                    rest = rest.without_instance(pid)
                decision = place(rest, whole, placement)
                if decision.placed:
                    trial = apply_placement(rest, whole, decision)
                    # A sibling stage alone on its GPU leaves that GPU dark too.
                    trial_freed.extend(
                        sorted(r for r in held if r != gpu.ref and not trial.gpu(r).lit)
                    )
                    trial_moves.append(
                        CompactionMove(
                            instance_id=whole.instance_id,
                            function=inst.function,
                            source=gpu.ref,
                            target=decision.gpus[0],
                            reason=(
                                f"empty {gpu.ref} (Σ request {gpu.used_request:.2f}): "
                                f"{whole.instance_id} anew instead of its {len(ids)} piece(s): "
                                f"{decision.reason}"
                            ),
                            parts=decision.parts,
                            replaces=ids,
                        )
                    )
                    continue
            if not decision.placed:
                trial_moves = []
                break
            if decision.parts:
                trial = apply_placement(trial, request, decision)
            else:
                # The same instance on its new GPU (a piece keeps `part_of`).
                trial = trial.with_instance(inst, decision.gpus)
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
            for m in trial_moves:
                targets.add(m.target)
                targets.update(p.gpu for p in m.parts)
            freed.append(gpu.ref)
            freed.extend(trial_freed)
    if not moves:
        reason = f"nothing to compact: tried {tried} GPU(s) with Σ request ≤ {config.source_max_request:.2f}"
    else:
        starts = sum(m.cold_starts for m in moves)
        reason = f"{len(moves)} move(s) turn off {len(freed)} GPU(s) at {starts} cold start(s)"
    return CompactionPlan(
        moves=tuple(moves), freed=tuple(freed), cluster=work, reason=reason
    )
