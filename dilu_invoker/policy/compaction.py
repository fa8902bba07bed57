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

from dataclasses import dataclass, replace

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


def _stages(cluster: ClusterSnapshot, part_of: str, invoker: str) -> list[tuple[GpuRef, PlacedInstance]]:
    """The pieces (pipeline stages) of split instance `part_of`, all on `invoker`, with their GPUs."""
    return [
        (cluster.refs[o], i)
        for o in cluster.invoker_ordinals[invoker]
        for i in cluster.gpus[o].instances
        if i.part_of == part_of
    ]


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
        avoid.update(ref for ref, _ in _stages(cluster, inst.part_of, source.invoker))
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


def _move_whole(
    cluster: ClusterSnapshot, piece: PlacedInstance, source: GpuRef, placement: PlacementConfig
) -> tuple[ClusterSnapshot, CompactionMove, list[GpuRef]] | None:
    """Place the split instance `piece` belongs to anew, as one request (Σ of its pieces), on lit GPUs
    away from every GPU its pieces hold, so each old stage serves until the new pipeline does
    (make-before-break) without two copies sharing a GPU's memory. `cluster` still holds every piece.
    Returns the cluster after the move, the move, and the sibling GPUs it leaves dark; None: no room."""
    assert piece.part_of is not None
    stages = _stages(cluster, piece.part_of, source.invoker)
    held = frozenset(ref for ref, _ in stages)
    request = sum(i.request for _, i in stages)
    whole = PlacementRequest(
        instance_id=piece.part_of,
        function=piece.function,
        cls=piece.cls,
        request=min(1.0, request),
        limit=min(1.0, max(sum(i.limit for _, i in stages), request)),
        memory_mib=sum(i.memory_mib for _, i in stages),
        profile=piece.profile,
        avoid_gpus=held,
        lit_only=True,
    )
    rest = cluster
    for _, i in stages:
        rest = rest.without_instance(i.id)
    decision = place(rest, whole, placement)
    if not decision.placed:
        return None
    after = apply_placement(rest, whole, decision)
    move = CompactionMove(
        instance_id=whole.instance_id,
        function=piece.function,
        source=source,
        target=decision.gpus[0],
        reason=(
            f"empty {source}: {whole.instance_id} anew instead of its {len(stages)} piece(s): "
            f"{decision.reason}"
        ),
        parts=decision.parts,
        replaces=tuple(sorted(i.id for _, i in stages)),
    )
    # A sibling stage alone on its GPU leaves that GPU dark too.
    dark = sorted(r for r in held if r != source and not after.gpu(r).lit)
    return after, move, dark


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
                moved = _move_whole(trial.with_instance(inst, (gpu.ref,)), inst, gpu.ref, placement)
                if moved is not None:
                    trial, move, dark = moved
                    trial_moves.append(move)
                    trial_freed.extend(dark)
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
    plan = CompactionPlan(moves=tuple(moves), freed=tuple(freed), cluster=work, reason="")
    if not moves:
        reason = f"nothing to compact: tried {tried} GPU(s) with Σ request ≤ {config.source_max_request:.2f}"
    else:
        reason = f"{len(moves)} move(s) turn off {len(freed)} GPU(s) at {plan.cold_starts} cold start(s)"
    return replace(plan, reason=reason)
