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

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress
from operator import and_, is_, itemgetter

from immutables import Map

from dilu_invoker.policy.cluster import BUCKETS, ClusterSnapshot, GpuVector, RoomEntry, request_bucket
from dilu_invoker.policy.placement import (
    FILTERS,
    Filter,
    PlacementConfig,
    PlacementPart,
    PlacementRequest,
    apply_placement,
    lit_fits,
    place,
    split_fits,
)
from dilu_invoker.policy.types import EPS, GpuRef, GpuState, InstanceClass, PlacedInstance


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
    max_trials: int | None = None
    """How many sources one call may try to empty by placing their instances (the sources that
    the cheap proof does not rule out; each trial re-runs placement): once spent, the call still
    proves sources hopeless but leaves those that pass to the next call, which resumes with them
    (`CompactionState.pending`). None: only `max_sources` bounds the call."""
    move_pieces: bool = False
    """Whether a GPU holding a piece of a split instance (a pipeline stage) may be emptied: the
    piece moves to another GPU of its node that holds no other piece of the instance, or else the
    whole instance is placed anew (split again where it would light a GPU). Off in the live
    default: the action must be able to hand a stage over while the pipeline serves."""
    merges: int = 0
    """How many moves one call may spend after emptying GPUs to merge SM room that no instance can
    use into room that one can (`_merge`): each move is a cold start and turns no GPU off by itself;
    arrivals and later calls use the room it merges. 0: none (the live default)."""
    merge_sources: int = 16
    """How many GPUs with lost SM room one merging move looks at, those with the most first."""
    merge_source_instances: int = 2
    """While a call merges, it empties only GPUs with at most this many instances (and at most
    `source_max_instances`): a fuller GPU is left to merging, which moves its instances one at a
    time where each fits tightest, instead of all at once wherever they fit."""
    rebalances: int = 0
    """How many split instances a merging call (`merges` > 0, Σ request binding) may then resize
    the pipeline stages of (`_rebalance`): stages on GPUs whose SM room is below the least request
    grow to fill it and one stage of the same instance shrinks by as much, so that its GPU's room
    becomes room an instance can use. Each resized stage is a cold start (the pipeline is cut
    anew). 0: none (the default, live and simulated)."""
    rebalance_min_gain: float = 0.03
    """The least SM room (fraction of a GPU) a resize must turn from lost into used or usable per
    stage it resizes, i.e. per cold start."""
    rebalance_sources: int = 64
    """How many GPUs with lost SM room that hold a stage one resize looks at, the most room first
    (bounds the work per call)."""
    memory_merges: int = 0
    """How many moves one call may spend, where memory rather than Σ request binds the lit GPUs, to
    merge free memory that no instance can use into room one can (`_merge_memory`, the memory twin
    of `merges`; each move is a cold start); the sources looked at per move are `merge_sources`.
    0: none (the default, live and simulated)."""
    memory_rebalances: int = 0
    """How many split instances a call that merges free memory (memory binding, as `memory_merges`)
    may then resize the pipeline stages of (`_rebalance_memory`, the memory twin of `rebalances`):
    stages on GPUs whose free memory is lost grow to fill it and one stage of the same instance
    shrinks by as much, so that its GPU's free memory becomes room an instance can use. Each resized
    stage is a cold start; the least gain per resized stage is `rebalance_min_gain` of a GPU's
    memory, the GPUs looked at `rebalance_sources`. 0: none (the default, live and simulated)."""
    merge_above: float | None = None
    """Merge SM room (`merges`) and resize stages (`rebalances`) only while the lit GPUs, once the
    call has emptied what it could, exceed the integral lower bound of what is placed
    (`ClusterSnapshot.integral_bound`) by more than this fraction of it (`_above_bound`): no
    placement lights fewer GPUs than the bound, so at it no merge can ever pay, and near it little
    can. None: whatever the lit GPUs (as before)."""
    memory_merge_above: float | None = None
    """The same gate for `memory_merges`: merge free memory only while the lit GPUs exceed the
    integral bound by more than this fraction of it. None: whatever the lit GPUs."""
    repacks: int = 0
    """How many lit GPUs one call may try to turn off by re-packing (`_repack`), after emptying and
    before merging, on the nodes whose lit GPUs waste the most: every instance of the GPU is placed
    anew on other lit GPUs as emptying places it, except that a split instance with a stage there
    is cut anew over any lit GPUs but that one (its other stages' included), and an instance no lit
    GPU takes may displace one instance of another lit GPU of its node that placement then puts
    elsewhere. A re-pack is kept only when the GPU ends dark (no GPU is lit by it) within
    `repack_moves` cold starts. Gated as merges are (`merge_above` where Σ request binds,
    `memory_merge_above` where memory does), and by `repack_above`. 0: none (the default, live and
    simulated). Live compaction takes it only with `repack_live` (the re-pack it can carry out)."""
    repack_moves: int = 10
    """The most cold starts one re-pack may cost (each instance whose GPU changes is one, each
    stage of an instance cut anew is one)."""
    repack_live: bool = False
    """Re-pack as the live balancer carries moves out, make-before-break: no instance is displaced (its
    replacement would need room only its own move frees), and a split instance with a stage on the GPU is
    placed anew away from every GPU its stages hold, as emptying places it (the old pipeline serves until the
    new one does). With `one_move_per_instance`, an instance this call moved before is not re-packed."""
    one_move_per_instance: bool = False
    """Move each instance at most once a call: a stage moved, no other stage of the same instance and no placing it
    anew in the same call (nor the other way round). The live balancer hands one stage of an instance over at a
    time and starts a replacement once (`policy.live_compaction.LIVE_COMPACTION` sets it), so a plan it carries out
    whole must not hold two moves of one instance. A source GPU holding a piece of an instance this call moved is
    left for the next call; merging moves leave such pieces where they are. Emptying, `merges` and `memory_merges`
    keep the rule, and `repacks` with `repack_live`; `rebalances`, `memory_rebalances` and `repacks` without it
    (which the live balancer refuses) do not look at it."""
    repack_above: float | None = None
    """Re-pack only while the lit GPUs, once the call has emptied what it could, exceed the integral
    bound of what is placed by more than this fraction of it (`_above_bound`), besides the merges'
    gate: re-packing costs several cold starts per GPU it turns off, so it is kept for when the lit
    GPUs are well above the bound (as after departures that no arrival refills). None: only the
    merges' gate."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.source_max_request <= 1.0:
            raise ValueError(
                f"source_max_request must be between 0 and 1, got {self.source_max_request!r}"
            )
        if self.max_trials is not None and self.max_trials < 1:
            raise ValueError(f"max_trials must be >= 1 or None, got {self.max_trials}")
        if self.merges < 0:
            raise ValueError(f"merges must be >= 0, got {self.merges}")
        if self.memory_merges < 0:
            raise ValueError(f"memory_merges must be >= 0, got {self.memory_merges}")
        if self.rebalances < 0:
            raise ValueError(f"rebalances must be >= 0, got {self.rebalances}")
        if self.memory_rebalances < 0:
            raise ValueError(f"memory_rebalances must be >= 0, got {self.memory_rebalances}")
        if self.repacks < 0:
            raise ValueError(f"repacks must be >= 0, got {self.repacks}")
        if not (math.isfinite(self.rebalance_min_gain) and self.rebalance_min_gain >= 0.0):
            raise ValueError(f"rebalance_min_gain must be >= 0, got {self.rebalance_min_gain!r}")
        for name in ("merge_above", "memory_merge_above", "repack_above"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be >= 0 or None, got {value!r}")
        for name in ("source_max_instances", "max_sources", "max_moves", "merge_sources", "merge_source_instances",
                     "rebalance_sources", "repack_moves"):
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
    state: CompactionState | None = None
    """Hand to the next call (after deriving the next cluster from `cluster`)."""
    merged: int = 0
    """How many of `moves` (the last ones) merge SM room (`CompactionConfig.merges`) or resize a
    pipeline stage where it is (`CompactionConfig.rebalances`, source equal to target) rather than
    empty a GPU."""

    @property
    def cold_starts(self) -> int:
        return sum(m.cold_starts for m in self.moves)


def _stages(cluster: ClusterSnapshot, part_of: str, invoker: str) -> list[tuple[GpuRef, PlacedInstance]]:
    """The pieces (pipeline stages) of split instance `part_of`, all on `invoker`, with their GPUs."""
    ords = cluster.invoker_ordinals[invoker]
    refs = cluster.refs
    return [
        (refs[o], i)
        for o, g in enumerate(cluster.gpus.span(ords[0], ords[-1] + 1), ords[0])
        for i in g.instances
        if i.part_of == part_of
    ]


def _moved_whole(work: ClusterSnapshot, move: CompactionMove) -> str:
    """The id of the whole instance `move` moved (the cluster after it): a split instance's, not its piece's."""
    if move.replaces or move.parts or not work.has_instance(move.instance_id):
        return move.instance_id
    inst = work.instance(move.instance_id)
    return inst.part_of or inst.id


def _pin_moved(work: ClusterSnapshot, moves: Iterable[tuple[str, GpuRef, GpuRef]],
               pinned: frozenset[str]) -> frozenset[str]:
    """`pinned` with the instances moved, each with every piece of it (`CompactionConfig.one_move_per_instance`):
    `moves` are (the whole instance's id, source, target)."""
    ids = set(pinned)
    for whole, source, target in moves:
        ids.add(whole)
        for inv in {source.invoker, target.invoker}:
            if inv in work.invoker_ordinals:
                ids.update(p.id for _, p in _stages(work, whole, inv))
    return frozenset(ids)


def _whole_request(piece: PlacedInstance, stages: list[tuple[GpuRef, PlacedInstance]]) -> PlacementRequest:
    """The split instance that ``piece`` is a stage of, asked for whole on lit GPUs other than its stages'."""
    assert piece.part_of is not None
    request = sum(i.request for _, i in stages)
    return PlacementRequest(
        instance_id=piece.part_of,
        function=piece.function,
        cls=piece.cls,
        request=min(1.0, request),
        limit=min(1.0, max(sum(i.limit for _, i in stages), request)),
        memory_mib=sum(i.memory_mib for _, i in stages),
        profile=piece.profile,
        avoid_gpus=frozenset(ref for ref, _ in stages),
        lit_only=True,
    )


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
    cluster: ClusterSnapshot, piece: PlacedInstance, source: GpuRef, placement: PlacementConfig,
    *, repack: bool = False, known: _Refuted | None = None,
) -> tuple[ClusterSnapshot, CompactionMove, list[GpuRef]] | None:
    """Place the split instance `piece` belongs to anew, as one request (Σ of its pieces), on lit GPUs
    away from every GPU its pieces hold, so each old stage serves until the new pipeline does
    (make-before-break) without two copies sharing a GPU's memory. `cluster` still holds every piece.
    `repack` (`_repack_gpu`): away from `source` only, its other stages' GPUs included; a placement
    `known` to fail there is not run (`_Refuted`), one that fails is learnt.
    Returns the cluster after the move, the move, and the sibling GPUs it leaves dark; None: no room."""
    assert piece.part_of is not None
    stages = _stages(cluster, piece.part_of, source.invoker)
    whole = _whole_request(piece, stages)
    if repack:
        whole = replace(whole, avoid_gpus=frozenset((source,)))
    rest = cluster
    for _, i in stages:
        rest = rest.without_instance(i.id)
    avoid = frozenset((rest.ordinals[source],))
    if known is not None and known.fails(rest, whole, avoid):
        return None
    decision = place(rest, whole, placement)
    if not decision.placed:
        if known is not None:
            splits = placement.strategy_spec().splits and placement.llm_max_parts > 1
            known.learn(rest, whole, Need(
                ids=frozenset((whole.instance_id,)), instance=whole.instance_id, memory_mib=whole.memory_mib,
                request=whole.request, limit=whole.limit, invoker=None,
                split_mib=whole.memory_mib if splits else None, split_request=whole.request,
                split_limit=whole.limit,
            ), avoid)
        return None
    after = apply_placement(rest, whole, decision)
    move = CompactionMove(
        instance_id=whole.instance_id,
        function=piece.function,
        source=source,
        target=decision.gpus[0],
        reason=(
            f"{'re-pack' if repack else 'empty'} {source}: {whole.instance_id} {'cut anew' if repack else 'anew'} "
            f"instead of its {len(stages)} piece(s): {decision.reason}"
        ),
        parts=decision.parts,
        replaces=tuple(sorted(i.id for _, i in stages)),
    )
    # A sibling stage alone on its GPU leaves that GPU dark too.
    dark = sorted(r for r in whole.avoid_gpus if r != source and not after.gpu(r).lit)
    return after, move, dark


@dataclass(frozen=True, slots=True)
class CompactionState:
    """What one plan hands the next (pass `plan.state` to the next call): the cluster the plan left
    and the sources it tried in vain, so the next call tries only what may succeed now.

    A source that failed is tried again when its own GPU changed, or when another GPU gained room
    that the instance which found none could use (whole, or a piece of it where it may be split):
    moves only ever *consume* room on lit GPUs, so without such a change it would fail again at the
    same instance. Where the source's instances were placed one after another and one found no
    room, where the others went and in which order decides it too; under node fit the state looks
    for that (`Need.others`, `Need.opened`, `_order_changed`, `_regime`), without it not: there a
    call can skip a move a plan from scratch makes, until a later change retries the source (in 10 of
    30 traces of 240 instances; the exact rules there pack neither better nor worse at 3,200 and would
    re-baseline every recorded figure: docs/benchmarks/sim-scale.md, twenty-third round). So a call looks only at GPUs that
    changed since `seen` (found by identity in O(GPUs) at C speed, plus O(changes)), at failed sources
    such a change may help, and at sources a call left untried for its limits (`pending`). Without a
    state, or with a cluster of another shape, every lit GPU is a candidate: under node fit the result
    is the same, only slower."""

    seen: ClusterSnapshot | None = None
    failed: Map[int, Need] = field(default_factory=Map)
    """Source ordinal → what the instance that found no room there needs (see `Need`)."""
    pending: frozenset[int] = frozenset()
    """Candidates a call did not get to (max_sources, max_moves)."""
    no_fit: tuple[NoFit, ...] = ()
    """Instance shapes no lit GPU took when the plan ended (see `NoFit`)."""
    retry: Map[int, tuple[int, ...]] = field(default_factory=Map)
    """Failed sources (also in `failed`) a call was to retry for room some GPUs gained but did not
    get to (max_sources, max_moves): source ordinal → those GPUs. The next call retries such a
    source only if one of them (or a GPU that gained room since) may still take what it needs;
    room the others took meanwhile would make it fail again where it failed before."""
    keyed: _Keyed | None = field(default=None, compare=False, repr=False)
    """The call's sources as it keyed them (a cache, not part of the state's value): the next
    call reuses a key where the GPU's state is the same object under the same config."""
    config: CompactionConfig | None = field(default=None, compare=False, repr=False)
    """The config the call ran under (`_call_config`): a call under another starts afresh."""


@dataclass(frozen=True, slots=True)
class _Keyed:
    """(Σ-request bucket, ordinal) of sources, the GPU states they were keyed from, the config."""

    keys: list[tuple[int, int]]
    states: list[GpuState]
    config: CompactionConfig


@dataclass(frozen=True, slots=True)
class NoFit:
    """A move request for which no lit GPU but its own source passed the filters.

    Moves only consume room on lit GPUs and never light one, so while no GPU that changed since
    passes this request's filters, no GPU other than `source` takes any request of the same class
    that asks at least as much request, limit and memory: `lit_fits` of it is `source` if `source`
    passes, else nothing, without a scan. A plan forgets every entry when a move frees room (a
    split instance placed anew leaves its other stages' GPUs); the next call drops those a GPU that
    changed meanwhile may satisfy."""

    request: PlacementRequest
    source: int
    """Ordinal of the GPU the request avoided (its source)."""


@dataclass(frozen=True, slots=True)
class Need:
    """What a GPU must offer to take the instance that stopped a source from being emptied.

    `invoker`: a piece (pipeline stage) moves whole only within its node. `split_mib`: the memory
    of an instance that may instead be split over lit GPUs of one node (a whole LLM, or the whole
    instance a piece belongs to, which compaction may place anew); None when it may not."""

    ids: frozenset[str]
    """The instances whose presence on the source the failure depends on (`instance` among them):
    the one that finds no lit GPU at all, the group whose GPUs lack room together, or, when
    placement failed part-way, every instance the source held. While they all stay, the source
    only becomes harder to empty, whatever else leaves it or arrives."""
    instance: str
    memory_mib: float
    request: float
    limit: float
    invoker: str | None
    split_mib: float | None
    split_request: float = 0.0
    split_limit: float = 0.0
    """The whole splittable instance's request and limit (a piece's are scaled down)."""
    deficit: tuple[float, float, float] | None = None
    """When each instance fits somewhere but the few GPUs that take any of them lack room for all
    together: how much request, limit and memory was missing. `memory_mib`, `request`, `limit`
    are then the least any of the instances needs, and the GPUs that gained room and take one of
    them must offer the deficit together."""
    members: tuple[tuple[float, float, float], ...] = ()
    """For a group (`deficit`): each member's request, limit and memory."""
    union: tuple[int, ...] = ()
    """For a group: ordinals of the GPUs known to take one of its members (those of the proof,
    and those that gained room since without making up the deficit)."""
    avoid: frozenset[int] = frozenset()
    """Ordinals of GPUs that never take the instance's pieces: its source and, for a piece, the
    GPUs of its sibling stages (the whole instance placed anew keeps away from them)."""
    also: tuple[Need, ...] = ()
    """Further blockers of the same source, found by the same proof: each must be helped too
    before the source is worth another try (a GPU that gained room for one of them is remembered
    by dropping that one)."""
    others: tuple[Need, ...] = ()
    """When placing the source's instances one after another failed at `instance` (not a proof):
    each other instance of the source, as it needs a GPU alone. Where they went decides where
    `instance` may go, and how many lit GPUs take each decides their order (the most constrained
    first): a GPU that gained room one of them could use may let the source succeed, so it makes
    the source worth another try as a GPU that helps `instance` does. Whether an LLM is split
    by node fit or by the fewest pieces, and how its pieces are sized, depends on the resource
    that binds the cluster: where that changes, such a source is tried again too
    (`_regime_bound`)."""
    opened: str | None = None
    """For such a failure, the source's invoker when a split instance of the source was placed anew
    before `instance` (its other stages' GPUs, on that invoker, held room then that they do not
    hold now): a GPU of that invoker that gained room may add to it, so it makes the source worth
    another try."""
    _blockers: tuple[Need, ...] = field(default=(), init=False, compare=False, repr=False)
    _shapes: tuple[tuple[float, float, float, str | None], ...] | None = field(
        default=None, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        # Made once: every call that looks at the record walks its blockers.
        head = replace(self, also=()) if self.also else self
        object.__setattr__(self, "_blockers", (head, *self.also))
        # The common case, tested inline (`_candidates`): instances that each need a GPU taking it
        # whole, any of which a GPU that gained room may help (the one found no room, or another).
        if not self.also and self.deficit is None and self.opened is None and all(
            x.split_mib is None for x in (self, *self.others)
        ):
            shapes = tuple((x.memory_mib, x.request, x.limit, x.invoker) for x in (self, *self.others))
            object.__setattr__(self, "_shapes", shapes)

    def shapes(self) -> tuple[tuple[float, float, float, str | None], ...] | None:
        """(memory, request, limit, invoker) of each instance a GPU may help by taking it whole, when
        that is all that may help (no group, no split, no `opened` node); else None."""
        return self._shapes

    def blockers(self) -> tuple[Need, ...]:
        return self._blockers


def _joined(blockers: list[Need]) -> Need | None:
    """One `Need` standing for all of `blockers` (None when there are none)."""
    if not blockers:
        return None
    return replace(blockers[0], also=tuple(blockers[1:])) if len(blockers) > 1 else blockers[0]


def _need(
    cluster: ClusterSnapshot,
    gpu: GpuState,
    inst: PlacedInstance,
    placement: PlacementConfig,
    alone: bool = False,
) -> Need:
    """What `inst` needs to move off `gpu`; `alone`: the failure is about it only (it finds no lit
    GPU at all, whatever else `gpu` holds), else about every instance there."""
    split: float | None = None
    split_request = split_limit = 0.0
    invoker = None
    avoid = {cluster.ordinals[gpu.ref]}
    if inst.part_of is not None:
        invoker = gpu.ref.invoker
        held = _stages(cluster, inst.part_of, invoker)
        avoid.update(cluster.ordinals[ref] for ref, _ in held)
        stages = [p for _, p in held]
        split = sum(p.memory_mib for p in stages)
        split_request = sum(p.request for p in stages)
        split_limit = sum(p.limit for p in stages)
    elif (
        inst.cls is InstanceClass.LLM
        and placement.strategy_spec().splits
        and placement.llm_max_parts > 1
    ):
        split, split_request, split_limit = inst.memory_mib, inst.request, inst.limit
    return Need(
        ids=frozenset((inst.id,)) if alone else frozenset(i.id for i in gpu.instances),
        instance=inst.id,
        memory_mib=inst.memory_mib,
        request=inst.request,
        limit=inst.limit,
        invoker=invoker,
        split_mib=split,
        split_request=split_request,
        split_limit=split_limit,
        avoid=frozenset(avoid),
    )


def _review(
    cluster: ClusterSnapshot,
    gained: list[tuple[int, GpuState]],
    need: Need,
    placement: PlacementConfig,
    source: int,
    node_free: dict[str, float] | None = None,
) -> tuple[list[int], Need | None]:
    """The GPUs of `gained` (other than `source`) that may help the source `need` describes, and what
    to remember of it: None when every blocker is helped (the source is worth a try), else its
    blockers that are not, each as `_help` leaves it (`need` itself when that is all of them as
    they were). A GPU of `gained` is seen as gained once only: a group's blocker must take into its
    `union` those that take a member, and a blocker a GPU helps is dropped, whether or not the
    source is tried now (see `_help`)."""
    found: dict[int, None] = {}
    unhelped: list[Need] = []
    changed = False
    for b in need.blockers():
        some, b2 = _help(cluster, gained, b, placement, source, node_free)
        if some:
            found.update(dict.fromkeys(some))
            changed = True
        else:
            unhelped.append(b2)
            changed = changed or b2 is not b
    # Room for another instance of a source that failed part-way (`Need.others`). Every GPU that
    # helps is listed: a plan that finds some of them taken by the time it gets to the source tries
    # it while one is left.
    others = False
    for x in need.others:
        some, _ = _help(cluster, gained, x, placement, source, node_free)
        if some:
            found.update(dict.fromkeys(some))
            others = True
    if need.opened is not None:
        near = [o for o, g in gained if o != source and g.lit and g.schedulable and g.ref.invoker == need.opened]
        if near:
            found.update(dict.fromkeys(near))
            others = True
    if not unhelped or others:
        return list(found), None
    return list(found), _joined(unhelped) if changed else need


def _order_changed(
    cluster: ClusterSnapshot,
    old: Sequence[GpuState],
    changed: list[int],
    failed: Map[int, Need],
    placement: PlacementConfig,
) -> list[int]:
    """The sources of `failed` that failed part-way (`Need.others`) and have an instance that a GPU
    of `changed` took whole in `old` and does not in `cluster`: how many lit GPUs take each
    instance decides the order they are placed in (the most constrained first), so room lost
    elsewhere may let such a source succeed."""
    grow, omega, gamma = 1.0 + EPS, placement.omega + EPS, placement.gamma + EPS
    gpus = cluster.gpus
    # (ordinal, invoker, the room it offered: free memory, Σ request, Σ limit) of each GPU that
    # changed and was lit; the most any offered, per dimension, rules most sources out at once.
    before = [
        (o, g.ref.invoker, g.memory_mib * grow - g.used_memory, g.used_request, g.used_limit)
        for o in changed
        if (g := old[o]).lit and g.schedulable
    ]
    if not before:
        return []
    most = max(b[2] for b in before)
    least_request = min(b[3] for b in before)
    least_limit = min(b[4] for b in before)
    drop: list[int] = []
    for o, need in failed.items():
        if not need.others:
            continue
        for x in (need, *need.others):
            if x.split_mib is not None or x.memory_mib > most:
                continue
            if x.request + least_request > omega or x.limit + least_limit > gamma:
                continue
            if any(
                og != o
                and (x.invoker is None or x.invoker == inv)
                and free >= x.memory_mib
                and used_request + x.request <= omega
                and used_limit + x.limit <= gamma
                and not _takes_whole(gpus[og], x, placement)
                for og, inv, free, used_request, used_limit in before
            ):
                drop.append(o)
                break
    return drop


def _takes_whole(g: GpuState, x: Need, placement: PlacementConfig) -> bool:
    """Whether lit GPU `g` has the room to take the instance `x` describes whole."""
    return (
        g.lit
        and g.schedulable
        and (x.invoker is None or x.invoker == g.ref.invoker)
        and g.memory_mib * (1.0 + EPS) - g.used_memory >= x.memory_mib
        and g.used_request + x.request <= placement.omega + EPS
        and g.used_limit + x.limit <= placement.gamma + EPS
    )


def _exact(placement: PlacementConfig) -> bool:
    """Whether the state keeps what it learns exactly (`Need.others`, `Need.opened`, a group's `union`
    kept where a plan drops a retry): under node fit (`PlacementConfig.split_node_fit`). Without it the
    state keeps the rules every recorded decision of the fewest pieces was made under; there the same
    rules find moves those missed (docs/benchmarks/sim-scale.md, twenty-third round)."""
    return placement.split_node_fit


def _regime(cluster: ClusterSnapshot) -> tuple[bool, bool]:
    """Which resource binds the cluster, as split placement asks it with the instance placed
    (`_lost_room_sizes`: Σ request ≥ Σ memory fraction; `_place_split_node_fit`: Σ memory over the
    largest GPU's ≥ Σ request). Moves keep both sums: within a call it is the call's."""
    return (
        cluster.sum_request >= cluster.sum_memory_fraction,
        cluster.sum_memory / cluster.max_memory_mib >= cluster.sum_request,
    )


def _regime_bound(need: Need) -> bool:
    """Whether the failure `need` records may depend on `_regime`: placing the source's instances
    failed part-way (`Need.others`) and one of them may be split."""
    return bool(need.others) and (
        need.split_mib is not None or any(x.split_mib is not None for x in need.others)
    )


def _out_of_reach(need: Need, top: tuple[float, float, float, float], placement: PlacementConfig) -> bool:
    """Whether no GPU offering at most `top` (free memory, request room, limit room, and the free
    memory of its node's lit GPUs) may help any blocker of `need`, nor another of its instances
    (a cheap pre-test of `_review`)."""
    # A little slack: `_help` compares sums (a + b <= c), this differences.
    free, request, limit, node = top[0] + 1e-6, top[1] + 1e-6, top[2] + 1e-6, top[3] + 1e-6
    if need.opened is not None:
        return False
    for b in (*need.blockers(), *need.others):
        if b.deficit is not None:
            if any(m <= free and r <= request and lim <= limit for r, lim, m in b.members):
                return False
        elif b.split_mib is not None:
            # `_may_help`: the instance (or piece) whole, the split instance whole, or its pieces
            # on the GPU's node, whose room is at most the node's free memory.
            if (b.memory_mib <= free and b.request <= request and b.limit <= limit) or (
                free >= min(placement.min_part_mib, b.split_mib) and (free >= b.split_mib or node >= b.split_mib)
            ):
                return False
        elif b.memory_mib <= free and b.request <= request and b.limit <= limit:
            return False
    return True


def _help(
    cluster: ClusterSnapshot,
    gained: list[tuple[int, GpuState]],
    need: Need,
    placement: PlacementConfig,
    source: int,
    node_free: dict[str, float] | None = None,
) -> tuple[list[int], Need]:
    """The GPUs of `gained` that may help the one blocker `need` (none if they cannot), and the
    blocker to remember if they cannot. For a group that lacked room together: the GPUs that take
    one of its members, and only if with the GPUs known to take one (`Need.union`) they have the
    room for all of it now; else those GPUs join `union`, so that room gained bit by bit over
    several calls is added up."""
    if need.deficit is None:
        return [o for o, g in gained if o != source and _may_help(cluster, g, need, placement, node_free)], need
    omega, gamma = placement.omega + EPS, placement.gamma + EPS
    takers = [
        o
        for o, g in gained
        if o != source
        and g.lit
        and g.schedulable
        and any(
            g.used_memory + m <= g.memory_mib * (1.0 + EPS)
            and g.used_request + r <= omega
            and g.used_limit + lim <= gamma
            for r, lim, m in need.members
        )
    ]
    if not takers:
        return [], need
    gpus = cluster.gpus
    pool = dict.fromkeys(need.union)
    pool.update(dict.fromkeys(takers))
    room = [g for g in (gpus[o] for o in pool) if g.lit]
    if (
        sum(placement.omega + EPS - g.used_request for g in room) >= sum(m[0] for m in need.members)
        and sum(placement.gamma + EPS - g.used_limit for g in room) >= sum(m[1] for m in need.members)
        and sum(g.memory_mib * (1.0 + EPS) - g.used_memory for g in room)
        >= sum(m[2] for m in need.members)
    ):
        return takers, need
    return [], replace(need, union=tuple(pool))


def _may_help(
    cluster: ClusterSnapshot, g: GpuState, need: Need, placement: PlacementConfig,
    node_free: dict[str, float] | None = None,
) -> bool:
    """Whether lit GPU `g`, having gained room, might take the instance `need` describes (whole, or
    a piece of it with the rest on other GPUs of `g`'s node). `node_free`: the free memory of each
    invoker's lit GPUs in `cluster`, as far as known (filled in here), which bounds the pieces'."""
    if not (g.lit and g.schedulable):
        # Moves go to lit GPUs only: a GPU emptied since (a source of this plan) takes nothing.
        return False
    free = g.memory_mib * (1.0 + EPS) - g.used_memory
    fits = (
        (need.invoker is None or need.invoker == g.ref.invoker)
        and free >= need.memory_mib
        and g.used_request + need.request <= placement.omega + EPS
        and g.used_limit + need.limit <= placement.gamma + EPS
    )
    if need.deficit is not None:
        # One of several GPUs that must together offer the deficit (`_help`).
        return fits
    if fits:
        return True
    whole = need.split_mib
    if whole is None or free < min(placement.min_part_mib, whole):
        return False
    if (
        free >= whole
        and g.used_request + need.split_request <= placement.omega + EPS
        and g.used_limit + need.split_limit <= placement.gamma + EPS
        and cluster.ordinals[g.ref] not in need.avoid
    ):
        # The whole instance placed anew on `g` alone (a piece's instance may go to any node so).
        return True
    if node_free is not None:
        near = node_free.get(g.ref.invoker)
        if near is None:
            near = node_free[g.ref.invoker] = _node_free(cluster, g.ref.invoker)
        if near < whole - EPS:
            return False
    # A piece takes the instance's request and limit in proportion to its memory: what each lit
    # GPU of the node can hold is bounded by its free memory and by its request and limit room.
    per_request = whole / need.split_request if need.split_request > 0 else math.inf
    per_limit = whole / need.split_limit if need.split_limit > 0 else math.inf
    gpus = cluster.gpus
    room = 0.0
    pieces = 0
    small = min(placement.min_part_mib, whole)
    omega, gamma, grow, avoid = placement.omega + EPS, placement.gamma + EPS, 1.0 + EPS, need.avoid
    ords = cluster.invoker_ordinals[g.ref.invoker]
    for o, h in enumerate(gpus.span(ords[0], ords[-1] + 1), ords[0]):
        if h.instances and h.schedulable and o not in avoid:
            # min(memory, request room, limit room) without the call (`x < c` as `min` compares).
            c = h.memory_mib * grow - h.used_memory
            x = (omega - h.used_request) * per_request
            if x < c:
                c = x
            x = (gamma - h.used_limit) * per_limit
            if x < c:
                c = x
            # Split placement uses only GPUs with room for a piece of the smallest size, two or more.
            if c >= small:
                room += c if c < whole else whole
                pieces += 1
    return pieces >= 2 and room >= whole - EPS


def _node_free(cluster: ClusterSnapshot, invoker: str) -> float:
    """The free memory of `invoker`'s lit GPUs that take instances (at most what a split's pieces
    may get there, `_may_help`)."""
    gpus = cluster.gpus
    return sum(
        h.memory_mib * (1.0 + EPS) - h.used_memory
        for h in (gpus[x] for x in cluster.invoker_ordinals[invoker])
        if h.instances and h.schedulable
    )


def _gained(old: GpuState, new: GpuState) -> bool:
    """`new` is lit and offers more room than `old` in some dimension (or was dark)."""
    if not new.lit:
        return False
    return (
        not old.lit
        or new.used_memory < old.used_memory - EPS
        or new.used_request < old.used_request - EPS
        or new.used_limit < old.used_limit - EPS
        or (new.schedulable and not old.schedulable)
    )


def _eligible(gpu: GpuState, config: CompactionConfig) -> bool:
    instances = gpu.instances
    if not instances or len(instances) > config.source_max_instances:
        return False
    if gpu.used_request > config.source_max_request + EPS:
        return False
    pieces = config.move_pieces
    for i in instances:
        if i.gpus > 1 or (i.part_of is not None and not pieces):
            return False
    return True


#: id of a GPU state → (the state, the compaction config, its Σ-request bucket if it may be a
#: source under that config, else None). States are immutable and shared by the snapshots derived
#: from one another, so a source that waits over many calls is judged once; the state is kept here
#: so that its id is not reused while the entry lives.
_SOURCE_BUCKET: dict[int, tuple[GpuState, CompactionConfig, int | None]] = {}
_SOURCE_BUCKET_MAX = 1 << 16


def _source_bucket(gpu: GpuState, config: CompactionConfig) -> int | None:
    """`request_bucket` of `gpu` if it may be a source (`_eligible`), else None."""
    hit = _SOURCE_BUCKET.get(id(gpu))
    if hit is not None and hit[0] is gpu and hit[1] is config:
        return hit[2]
    bucket = request_bucket(gpu.used_request) if _eligible(gpu, config) else None
    if len(_SOURCE_BUCKET) >= _SOURCE_BUCKET_MAX:
        _SOURCE_BUCKET.clear()
    _SOURCE_BUCKET[id(gpu)] = (gpu, config, bucket)
    return bucket


def _candidates(
    cluster: ClusterSnapshot,
    placement: PlacementConfig,
    config: CompactionConfig,
    state: CompactionState,
) -> tuple[_Keyed, Map[int, Need], dict[int, tuple[Need, list[int]]], list[NoFit]]:
    """The sources worth trying as (Σ-request bucket, ordinal), unordered (with their states); the failures still known
    to be hopeless, the failed sources retried because GPUs gained room (with those GPUs'
    ordinals), and the `NoFit` entries still true."""
    gpus = cluster.gpus
    seen = state.seen
    if seen is None or (seen.refs is not cluster.refs and seen.refs != cluster.refs):
        top = request_bucket(config.source_max_request)
        every = [o for k in range(min(top, BUCKETS) + 1) for o in cluster.lit_buckets[k]]
        return _keyed(every, Map(), gpus, config, None), Map(), {}, []
    old = seen.gpus
    changed = [o for o in gpus.changed_since(old) if old[o] != gpus[o]]
    failed = state.failed
    no_fit = _still_no_fit(state.no_fit, [gpus[o] for o in changed], placement)
    out = set(state.pending)
    gained: list[tuple[int, GpuState]] = []
    if changed:
        with failed.mutate() as m:
            for o in changed:
                g = gpus[o]
                need = m.get(o)
                # A failed source that still holds what a blocker is about stays as hopeless (its
                # own room is no matter: a source is never its own target); a blocker whose
                # instances left is gone, and with the last one the failure.
                if need is not None:
                    ids = {i.id for i in g.instances}
                    left = [b for b in need.blockers() if b.ids <= ids]
                    if not left or (need.others and len(ids) > len(need.ids)):
                        # (A source that failed part-way and received an instance: one more to
                        # place changes which are the most constrained, and so the order.)
                        del m[o]
                        need = None
                    elif len(left) < len(need.blockers()):
                        m[o] = replace(left[0], also=tuple(left[1:]))
                if need is None and _eligible(g, config):
                    out.add(o)
                if _gained(old[o], g):
                    gained.append((o, g))
            failed = m.finish()
    exact = _exact(placement)
    if exact and failed and _regime(seen) != _regime(cluster):
        # Split placement decides otherwise now: what failed part-way with an instance that may
        # split is tried again (`Need.others`).
        with failed.mutate() as m:
            for o, need in failed.items():
                if _regime_bound(need):
                    del m[o]
                    out.add(o)
            failed = m.finish()
    if exact and failed and changed:
        reordered = _order_changed(cluster, old, changed, failed, placement)
        if reordered:
            with failed.mutate() as m:
                for o in reordered:
                    del m[o]
            failed = m.finish()
            out.update(reordered)
    helped: dict[int, tuple[Need, list[int]]] = {}
    carried = state.retry
    if failed and (gained or carried):
        # The most room any GPU that gained offers, per dimension: a blocker asking more of one
        # is not helped, without looking at the GPUs one by one.
        lit_gained = [(og, g) for og, g in gained if g.lit and g.schedulable]
        lit = [g for _, g in lit_gained]
        omega, gamma = placement.omega + EPS, placement.gamma + EPS
        # And the most free memory the lit GPUs of one of their nodes offer (pieces of a split).
        node_free: dict[str, float] = {}
        for g in lit:
            if g.ref.invoker not in node_free:
                node_free[g.ref.invoker] = _node_free(cluster, g.ref.invoker)
        most = (
            max((g.memory_mib * (1.0 + EPS) - g.used_memory for g in lit), default=-math.inf),
            max((placement.omega + EPS - g.used_request for g in lit), default=-math.inf),
            max((placement.gamma + EPS - g.used_limit for g in lit), default=-math.inf),
            max(node_free.values(), default=-math.inf),
        )
        # `_out_of_reach`'s slack over `most`.
        reach = (most[0] + 1e-6, most[1] + 1e-6, most[2] + 1e-6)
        # (ordinal, invoker, free memory, Σ request, Σ limit) of each lit GPU that gained.
        rooms = [
            (og, g.ref.invoker, g.memory_mib * (1.0 + EPS) - g.used_memory, g.used_request, g.used_limit)
            for og, g in lit_gained
        ]
        with failed.mutate() as m:
            known = {og for og, _ in gained}
            for o, need in failed.items() if gained else [(o, failed[o]) for o in carried if o in failed]:
                again = gained
                room_again = rooms
                back = carried.get(o)
                shapes = need.shapes()
                simple = shapes is not None
                if back is not None:
                    extra = [(og, gpus[og]) for og in back if og not in known]
                    again = gained + extra
                    if simple:
                        room_again = rooms + [
                            (
                                og, g.ref.invoker, g.memory_mib * (1.0 + EPS) - g.used_memory,
                                g.used_request, g.used_limit,
                            )
                            for og, g in extra
                            if g.lit and g.schedulable
                        ]
                elif not simple and _out_of_reach(need, most, placement):
                    continue
                if shapes is not None:
                    # The common case, inline: instances that each need a GPU taking it whole (the
                    # test of `_may_help`), after `_out_of_reach`'s test of them against the most
                    # room any GPU that gained offers (three comparisons instead of one per GPU).
                    helpers_now = []
                    for mem, req, lim, inv in shapes:
                        if back is None and not (mem <= reach[0] and req <= reach[1] and lim <= reach[2]):
                            continue
                        helpers_now += [
                            og
                            for og, ginv, free, used_req, used_lim in room_again
                            if og != o
                            and (inv is None or inv == ginv)
                            and free >= mem
                            and used_req + req <= omega
                            and used_lim + lim <= gamma
                        ]
                    if helpers_now:
                        del m[o]
                        out.add(o)
                        helped[o] = (need, list(dict.fromkeys(helpers_now)) if len(shapes) > 1 else helpers_now)
                    continue
                # Blockers helped now are dropped; the source is retried once none is left.
                helpers, rest = _review(cluster, again, need, placement, o, node_free)
                if rest is None:
                    del m[o]
                    out.add(o)
                    helped[o] = (need, helpers)
                elif rest is not need:
                    m[o] = rest
            failed = m.finish()
    return _keyed(out, failed, gpus, config, state.keyed), failed, helped, no_fit


_SECOND = itemgetter(1)


def _keyed(
    ordinals: Iterable[int],
    failed: Map[int, Need],
    gpus: Sequence[GpuState],
    config: CompactionConfig,
    before: _Keyed | None,
) -> _Keyed:
    """(Σ-request bucket, ordinal) of each of `ordinals` that is not `failed` and may be a source,
    with the states they were keyed from. A key of `before` (the previous call's) is reused where
    the GPU's state is the same object under the same config (its bucket is a function of both):
    the sources carried over from call to call are compared at C speed, not re-judged one by one."""
    keys: list[tuple[int, int]] = []
    states_out: list[GpuState] = []
    todo_set = set(ordinals)
    if failed:
        todo_set.difference_update(failed)
    if before is not None and before.config is config and before.keys and isinstance(gpus, GpuVector):
        ords = list(map(_SECOND, before.keys))
        now = gpus.states(ords)
        # Still wanted and the same state: one mask, built at C speed.
        same = list(map(and_, map(is_, before.states, now), map(todo_set.__contains__, ords)))
        keys = list(compress(before.keys, same))
        states_out = list(compress(now, same))
        todo_set.difference_update(compress(ords, same))
    todo = list(todo_set)
    cache = _SOURCE_BUCKET
    states = gpus.states(todo) if isinstance(gpus, GpuVector) else [gpus[o] for o in todo]
    for o, g in zip(todo, states, strict=True):
        # `_source_bucket`, its cache hit inline.
        hit = cache.get(id(g))
        if hit is not None and hit[0] is g and hit[1] is config:
            bucket = hit[2]
        else:
            bucket = _source_bucket(g, config)
        if bucket is not None:
            keys.append((bucket, o))
            states_out.append(g)
    return _Keyed(keys, states_out, config)


def compaction_plan(
    cluster: ClusterSnapshot,
    placement: PlacementConfig,
    config: CompactionConfig | None = None,
    state: CompactionState | None = None,
    *,
    pinned: frozenset[str] = frozenset(),
) -> CompactionPlan:
    """Moves that free the emptiest GPUs, found by re-running placement (lit GPUs only).

    Sources are tried lowest Σ request first (then in cluster order), at most `max_sources` per
    call. `state` (the previous plan's `state`) skips sources known to fail; the moves are those a
    call without it would find among the sources it tries. A GPU holding a `pinned` instance (one
    that must not move now: starting, draining, its function in a burst) is not a source this time."""
    config = config or CompactionConfig()
    binds = _request_binds(cluster)
    merging = config.merges > 0 and binds
    config = _call_config(config, merging)
    if state is None or (state.config is not None and state.config != config):
        # What a call under other limits carried (failures, sources left pending) need not hold.
        state = CompactionState()
    work = cluster
    moves: list[CompactionMove] = []
    freed: list[GpuRef] = []
    # GPUs this plan moved something onto: never emptied again by the same plan (no ping-pong).
    targets: set[GpuRef] = set()
    tried = 0
    trials = 0  # sources tried by placing their instances (`max_trials`)
    keyed, failed, helped, no_fit = _candidates(cluster, placement, config, state)
    candidates = list(keyed.keys)
    gpus0 = cluster.gpus

    def key(o: int) -> tuple[int, int]:
        return (request_bucket(gpus0[o].used_request), o)

    heap = candidates
    heapq.heapify(heap)
    # The ordinals ever queued in this call (made when first needed: a split instance placed anew).
    queued: set[int] | None = None
    pending: list[int] = []
    # GPUs a move of this plan changed besides targets and sources: the other stages of an
    # instance placed anew lose their piece (and gain room).
    siblings: set[GpuRef] = set()
    failures = failed.mutate()
    # The instances this call moved (`one_move_per_instance`), by their whole's id.
    moved: set[str] = set()
    while heap:
        at, o = heapq.heappop(heap)
        if tried >= config.max_sources or len(moves) >= config.max_moves:
            pending.append(o)
            pending.extend(map(_SECOND, heap))
            break
        gpu = work.gpus[o]
        if gpu.ref in targets or _source_bucket(gpu, config) is None:
            continue
        if pinned and any(i.id in pinned for i in gpu.instances):
            pending.append(o)
            continue
        if moved and any((i.part_of or i.id) in moved for i in gpu.instances):
            pending.append(o)  # one move per instance a call: the next call may move it
            continue
        if len(moves) + len(gpu.instances) > config.max_moves:
            pending.append(o)
            continue
        retry = helped.get(o)
        if retry is not None:
            _, rest = _review(work, [(og, work.gpus[og]) for og in retry[1]], retry[0], placement, o)
            if rest is not None:
                # The room it was retried for went to sources tried before it in this plan. What
                # those GPUs still offer is remembered (a group's union, a blocker they still help):
                # they are not seen as gaining it again.
                failures[o] = rest if _exact(placement) else retry[0]
                continue
        tried += 1
        may_place = config.max_trials is None or trials < config.max_trials
        trial_moves, trial, trial_freed, stuck, placed = _try_source(
            work, gpu, placement, no_fit, may_place
        )
        trials += placed
        if not trial_moves:
            if stuck is None:
                # Not ruled out, but the call's trials are spent: the next call resumes with it.
                pending.append(o)
                continue
            failures[o] = stuck
            continue
        opened = {
            ref for m in trial_moves for pid in m.replaces for ref in work.instance_gpus(pid)
        } - {gpu.ref}
        work = trial
        moves.extend(trial_moves)
        for m in trial_moves:
            targets.add(m.target)
            targets.update(p.gpu for p in m.parts)
        if config.one_move_per_instance:
            moved.update(_moved_whole(work, m) for m in trial_moves)
        freed.append(gpu.ref)
        freed.extend(trial_freed)
        if opened:
            # Placing a split instance anew frees its other stages' GPUs: failed sources that
            # room may help are tried later in this plan (as a plan without the state would),
            # or next time when their turn has passed.
            siblings |= opened
            no_fit.clear()  # room appeared: what found none may find some now
            helped.clear()  # the room they were retried for is no longer all there is
            gained = [(work.ordinals[r], work.gpu(r)) for r in opened if work.gpu(r).lit]
            known = failures.finish()
            failures = known.mutate()
            if queued is None:
                queued = set(map(_SECOND, keyed.keys))
            retry_now = [og for og, _ in gained if og not in queued or og in known]
            for f, need in known.items():
                _, rest = _review(work, gained, need, placement, f)
                if rest is None:
                    retry_now.append(f)
                elif rest is not need and _exact(placement):
                    # Those GPUs are not seen as gaining this room again: what they offer is
                    # remembered (as `_candidates` remembers it).
                    failures[f] = rest
            for f in retry_now:
                if f in failures:
                    del failures[f]
                if key(f) > (at, o) and f not in queued:
                    heapq.heappush(heap, key(f))
                    queued.add(f)
                else:
                    pending.append(f)
    # A GPU a move of this plan touched (target, source, a stage's sibling) is not what a
    # failure may have recorded: forget it, and look at it again next time.
    touched = {work.ordinals[r] for r in targets | siblings} | {work.ordinals[r] for r in freed}
    for o in touched:
        if o in failures:
            del failures[o]
        if _eligible(work.gpus[o], config):
            pending.append(o)
    # Room this plan's moves took may have changed the order a failed source's instances go in
    # (the next call sees changes since the cluster the emptying left, not these).
    taken = [work.ordinals[r] for r in targets] if _exact(placement) else []
    reordered: list[int] = []
    if taken:
        known = failures.finish()
        failures = known.mutate()
        if known:
            reordered = _order_changed(work, cluster.gpus, taken, known, placement)
        for o in reordered:
            del failures[o]
            pending.append(o)
    # A source retried for room some GPUs gained, but not reached, stays failed with those GPUs:
    # the next call retries it only while one of them may still help (see `CompactionState.retry`).
    carry: dict[int, tuple[int, ...]] = {}
    waiting = frozenset(pending)
    if helped:
        # The retried sources among the (many) pending ones: by the few retried, not the pending.
        for o, r in helped.items():
            if o in waiting and o not in touched and o not in failures and o not in reordered:
                failures[o] = r[0]
                carry[o] = tuple(r[1])
    failed = failures.finish()
    # The next call sees what merging changes as it sees departures and arrivals: as changes since
    # `seen`, the cluster the emptying left.
    emptied = work
    if (
        config.repacks
        and len(moves) < config.max_moves
        and _above_bound(work, 0.0)
        and _above_bound(work, config.merge_above if binds else config.memory_merge_above)
        and _above_bound(work, config.repack_above)
    ):
        held = pinned
        if config.one_move_per_instance and config.repack_live and moves:
            held = _pin_moved(work, ((_moved_whole(work, m), m.source, m.target) for m in moves), pinned)
        work, repacked, dark = _repack(work, placement, config, config.max_moves - len(moves), targets, held)
        moves.extend(repacked)
        freed.extend(dark)
    merged: list[CompactionMove] = []
    if config.one_move_per_instance and moves:
        pinned = _pin_moved(work, ((_moved_whole(work, m), m.source, m.target) for m in moves), pinned)
    if merging and len(moves) < config.max_moves and _above_bound(work, config.merge_above):
        work, merged = _merge(work, placement, config, min(config.merges, config.max_moves - len(moves)),
                              targets, pinned)
        moves.extend(merged)
        if config.rebalances and len(moves) < config.max_moves:
            work, resized = _rebalance(
                work, placement, config, config.rebalances, config.max_moves - len(moves), targets, pinned
            )
            moves.extend(resized)
            merged += resized
    elif (
        (config.memory_merges or config.memory_rebalances)
        and not binds
        and cluster.lit_count > 0
        and len(moves) < config.max_moves
        and _above_bound(work, config.memory_merge_above)
    ):
        # Memory binds: its lost room, not SM's, is what keeps GPUs lit.
        if config.memory_merges:
            work, merged = _merge_memory(
                work, placement, config, min(config.memory_merges, config.max_moves - len(moves)), targets, pinned
            )
            moves.extend(merged)
        if config.memory_rebalances and len(moves) < config.max_moves:
            work, resized = _rebalance_memory(
                work, placement, config, config.memory_rebalances, config.max_moves - len(moves), targets, pinned
            )
            moves.extend(resized)
            merged += resized
    next_state = CompactionState(
        seen=emptied,
        failed=failed,
        pending=waiting.difference(carry) if carry else waiting,
        no_fit=tuple(no_fit),
        retry=Map(carry),
        keyed=keyed,
        config=config,
    )
    plan = CompactionPlan(
        moves=tuple(moves), freed=tuple(freed), cluster=work, reason="", state=next_state, merged=len(merged)
    )
    if not moves:
        reason = f"nothing to compact: tried {tried} GPU(s) with Σ request ≤ {config.source_max_request:.2f}"
    else:
        reason = f"{len(moves)} move(s) turn off {len(freed)} GPU(s) at {plan.cold_starts} cold start(s)"
        if merged:
            reason += f", {len(merged)} of them merging {'SM' if merging else 'memory'} room"
    return replace(plan, reason=reason)


def _merge(
    work: ClusterSnapshot,
    placement: PlacementConfig,
    config: CompactionConfig,
    budget: int,
    targets: set[GpuRef],
    pinned: frozenset[str],
) -> tuple[ClusterSnapshot, list[CompactionMove]]:
    """Up to `budget` moves that merge SM room no instance can use into room one can.

    The SM room ρ = ω − Σ request of a lit GPU is lost while no live instance fits there: ρ is less
    than the least request of any live instance, or the GPU's free memory is less than the least
    memory of any (`ClusterSnapshot.smallest_request`, `smallest_memory`; pieces of split instances
    left out). Emptying cannot use such room and neither can an arrival. Moving one of its
    instances y to the lit GPU that takes y most tightly in SM room leaves ρ + request(y) of SM
    room and memory(y) more free memory there, and ρ' = room there − request(y) on the target. A
    move is made when the room it leaves is one some instance can use, and when it gains,
    ρ − ρ' > 0, the largest gain first: the room in use is the same, and Σ room² over lit GPUs
    grows with every move (by 2·request(y)·(ρ − ρ')), so moves never undo one another. Each move
    looks at the `merge_sources` GPUs with the most lost room (the gain is at most ρ). Whole
    one-GPU instances move and, with `move_pieces`, pieces of split instances (to another GPU of
    their node that holds no piece of the same instance); not pinned ones and not off a GPU this
    plan moved something onto; a target passes the strategy's filters.

    The caller merges only while Σ request bounds the lit GPUs (`_request_binds`)."""
    moves: list[CompactionMove] = []
    omega = placement.omega
    lost = _lost_room_buckets(work, omega)
    if lost is None:
        return work, moves
    smallest, least_memory, first, stop = lost
    filters = placement.filters()
    grow = 1.0 + EPS
    # Below `first` every GPU has SM room for the least request: lost only where memory is short,
    # the GPUs with the least free memory of the bucket (`lit_room` is by free memory).
    short = (least_memory - work.max_memory_mib * EPS, -1)
    for _ in range(budget):
        gpus = work.gpus
        found: list[tuple[float, int, PlacedInstance, GpuState, int]] = []
        looked = 0
        bound = -math.inf  # the best gain so far
        # The most room first: bucket by bucket, from the least Σ request up.
        for k in range(stop):
            if looked >= config.merge_sources or omega - k / BUCKETS <= bound + EPS:
                break
            if k < first:
                entries = work.lit_room[k]
                ords: Iterable[int] = [o for _, o in entries[: bisect.bisect_left(entries, short)]]
            else:
                ords = work.lit_buckets[k]
            for o in ords:
                gpu = gpus[o]
                room = omega - gpu.used_request
                if room <= EPS or gpu.ref in targets:
                    continue
                if room >= smallest - EPS and gpu.used_memory + least_memory <= gpu.memory_mib * grow:
                    continue  # an instance fits: the room is not lost
                looked += 1
                for inst in gpu.instances:
                    if inst.gpus != 1 or inst.id in pinned:
                        continue
                    piece = inst.part_of is not None
                    if piece and not config.move_pieces:
                        continue
                    # The room the move leaves must be one some instance can use.
                    if (
                        room + inst.request < smallest - EPS
                        or gpu.used_memory - inst.memory_mib + least_memory > gpu.memory_mib * grow
                    ):
                        continue
                    t = _tightest_stage(work, gpu, inst, omega) if piece else _tightest(
                        work, inst.request, inst.memory_mib, omega
                    )
                    if t is None:
                        continue
                    gain = room - (omega - gpus[t].used_request - inst.request)
                    if gain > EPS:
                        found.append((gain, len(found), inst, gpu, t))
                        bound = max(bound, gain)
                if looked >= config.merge_sources:
                    break
        move = _first_move(
            work, placement, filters, found,
            lambda gpu, to, inst: (omega - gpu.used_request) - (omega - to.used_request - inst.request),
        )
        if move is None:
            break
        gain, inst, gpu, t = move
        target = work.refs[t]
        work = work.without_instance(inst.id).with_instance(inst, (target,))
        targets.add(target)
        if config.one_move_per_instance:
            pinned = _pin_moved(work, [(inst.part_of or inst.id, gpu.ref, target)], pinned)
        room = omega - gpu.used_request
        why = (
            f"SM room {room:.2f} < the least request {smallest:.2f}"
            if room < smallest - EPS
            else f"free memory {(gpu.memory_mib - gpu.used_memory) / 1024:.1f} GiB < the least "
            f"memory {least_memory / 1024:.1f} GiB beside SM room {room:.2f}"
        )
        moves.append(
            CompactionMove(
                instance_id=inst.id,
                function=inst.function,
                source=gpu.ref,
                target=target,
                reason=(
                    f"merge room on {gpu.ref}: {why}; it becomes {room + inst.request:.2f}, "
                    f"{gain:.2f} more than {target} keeps"
                ),
            )
        )
    return work, moves


def _first_move(
    work: ClusterSnapshot,
    placement: PlacementConfig,
    filters: Sequence[Filter],
    found: list[tuple[float, int, PlacedInstance, GpuState, int]],
    gain_of: Callable[[GpuState, GpuState, PlacedInstance], float],
) -> tuple[float, PlacedInstance, GpuState, int] | None:
    """The move a merge makes of the candidates `found` (gain, order found, instance, its GPU, target
    ordinal): the largest gain first, gains equal but for float residue in the order found. A target the
    other filters refuse is replaced by the one `lit_fits` finds, the exact search, and its gain
    recomputed by `gain_of(source, target, instance)`; None when no candidate is left with a gain."""
    gpus = work.gpus
    for gain, _, inst, gpu, t in sorted(found, key=lambda f: (-round(f[0], 9), f[1])):
        request = _as_request(work, inst, gpu.ref)
        if not all(f.passes(gpus[t], request, placement) for f in filters):
            fit = lit_fits(work, request, placement)
            if not fit:
                continue
            t = work.ordinals[fit[0]]
            gain = gain_of(gpu, gpus[t], inst)
            if gain <= EPS:
                continue
        return gain, inst, gpu, t
    return None


def _merge_memory(
    work: ClusterSnapshot,
    placement: PlacementConfig,
    config: CompactionConfig,
    budget: int,
    targets: set[GpuRef],
    pinned: frozenset[str],
) -> tuple[ClusterSnapshot, list[CompactionMove]]:
    """Up to `budget` moves that merge free memory no instance can use into room one can: `_merge`
    with memory in the place of SM room, for a cluster where memory binds.

    The free memory φ = memory − used of a lit GPU (fractions of a GPU) is lost while no live
    instance fits there: φ is less than the least memory of any live instance, or its SM room is
    less than the least request (`smallest_memory`, `smallest_request`; pieces left out). Moving one
    of its instances y to the lit GPU that takes y most tightly in free memory leaves φ + memory(y)
    there beside SM room + request(y), and φ' = free memory there − memory(y) on the target. A move
    is made when the room it leaves is one some instance can use and when it gains, φ − φ' > 0, the
    largest gain first: the memory in use is the same and Σ φ² over lit GPUs grows with every move
    (by 2·memory(y)·(φ − φ')), so moves never undo one another. Each move looks at the
    `merge_sources` GPUs with lost memory, the most free memory first (the gain is at most φ).
    Instances, targets and filters as `_merge`'s.

    The search is incremental (`_MemoryIndex`): the GPUs with lost memory, the targets of whole
    instances and, per source, the instances that may leave it with the tightest GPU of their node
    for each stage are kept from call to call and brought up to date from the GPUs that changed.

    The caller merges memory only where Σ request does not bound the lit GPUs (`_request_binds`)."""
    moves: list[CompactionMove] = []
    omega = placement.omega
    lost = _lost_room_buckets(work, omega)
    if lost is None:
        return work, moves
    smallest, least_memory, first, _ = lost
    filters = placement.filters()
    grow = 1.0 + EPS
    unit = work.max_memory_mib
    slack = unit * EPS
    for _ in range(budget):
        gpus = work.gpus
        index = _memory_index(work, smallest, least_memory, first, omega, config.move_pieces)
        pool = index.pool
        movers_of = index.movers
        found: list[tuple[float, int, PlacedInstance, GpuState, int]] = []
        looked = 0
        bound = -math.inf  # the best gain so far
        taken = {work.ordinals[r] for r in targets}
        # The lost GPUs, the most free memory first (the index holds only lost ones, with free memory).
        for free, o in reversed(index.lost):
            if looked >= config.merge_sources or free / unit <= bound + EPS:
                break
            if o in taken:
                continue
            looked += 1
            movers = movers_of.get(o)
            if movers is None:
                movers = movers_of[o] = _movers(work, o, smallest, least_memory, omega, config.move_pieces)
            for inst, stage, stage_gain in movers:
                if inst.id in pinned:
                    continue
                # A target keeping more than this free gains less than the best so far.
                most = free - bound * unit + inst.memory_mib if bound > 0 else math.inf
                if stage is not None:
                    # The tightest keeps the least free memory: past `most`, so does every other.
                    if stage[0] + inst.memory_mib > most + slack:
                        continue
                    t = stage[2]
                    gain = stage_gain
                else:
                    w = _tightest_memory(work, pool, inst.request, inst.memory_mib, omega, o, most)
                    if w is None:
                        continue
                    t = w
                    gain = (free - (gpus[t].memory_mib - gpus[t].used_memory - inst.memory_mib)) / unit
                if gain > EPS:
                    found.append((gain, len(found), inst, gpus[o], t))
                    bound = max(bound, gain)
        move = _first_move(
            work, placement, filters, found,
            lambda gpu, to, inst: ((gpu.memory_mib - gpu.used_memory)
                                   - (to.memory_mib - to.used_memory - inst.memory_mib)) / unit,
        )
        if move is None:
            break
        gain, inst, gpu, t = move
        target = work.refs[t]
        work = work.without_instance(inst.id).with_instance(inst, (target,))
        targets.add(target)
        if config.one_move_per_instance:
            pinned = _pin_moved(work, [(inst.part_of or inst.id, gpu.ref, target)], pinned)
        free_gib = (gpu.memory_mib - gpu.used_memory) / 1024
        room = omega - gpu.used_request
        why = (
            f"free memory {free_gib:.1f} GiB < the least memory {least_memory / 1024:.1f} GiB"
            if gpu.used_memory + least_memory > gpu.memory_mib * grow
            else f"SM room {room:.2f} < the least request {smallest:.2f} beside {free_gib:.1f} GiB"
        )
        moves.append(
            CompactionMove(
                instance_id=inst.id,
                function=inst.function,
                source=gpu.ref,
                target=target,
                reason=(
                    f"merge memory on {gpu.ref}: {why}; it becomes {free_gib + inst.memory_mib / 1024:.1f} GiB, "
                    f"{gain:.2f} of a GPU more than {target} keeps"
                ),
            )
        )
    return work, moves


@dataclass(slots=True)
class _MemoryIndex:
    """What `_merge_memory` searches, for the GPU states `gpus` under `key` (the least request and
    memory, the first bucket of SM room below the least request, ω, whether pieces may move, the
    largest GPU's memory): brought up to date from the GPUs that changed (`_memory_index`), so a call
    does not rebuild it from every lit GPU nor weigh again a source whose node is the same.

    `lost`: (free MiB, ordinal) of each lit GPU whose free memory is lost and that a merge looks at,
    ascending, exactly those the bucket walk of `ClusterSnapshot.lit_room` met (a GPU of a bucket
    with SM room for the least request only where its free memory is less than the least memory,
    any other one where no instance fits, never one without free memory). `pool`: (free MiB,
    ordinal) of the lit GPUs with room for the least memory and Σ request below 1, ascending, the
    targets of whole instances (`_tightest_memory`). `movers`: source ordinal → `_movers` of it,
    while its node is the same."""

    refs: tuple[GpuRef, ...]
    gpus: GpuVector
    key: tuple[float, float, int, float, bool, float]
    lost: list[RoomEntry]
    pool: list[RoomEntry]
    movers: dict[int, tuple[_Mover, ...]]


#: The index of the last `_merge_memory` search (one: the calls of a replay follow one another; any
#: other cluster is compared with it GPU by GPU, or indexed afresh).
_INDEX: list[_MemoryIndex] = []
#: More changed GPUs than this share of the cluster: index afresh rather than GPU by GPU.
_REINDEX_SHARE = 0.25


def _memory_index(
    work: ClusterSnapshot, smallest: float, least_memory: float, first: int, omega: float, pieces: bool
) -> _MemoryIndex:
    """`_MemoryIndex` of `work`: the last one brought up to date, or a new one."""
    unit = work.max_memory_mib
    key = (smallest, least_memory, first, omega, pieces, unit)
    gpus = work.gpus
    index = _INDEX[0] if _INDEX else None
    if index is not None and index.key == key and (index.refs is work.refs or index.refs == work.refs):
        if index.gpus is gpus:
            return index
        if isinstance(gpus, GpuVector) and isinstance(index.gpus, GpuVector) and len(gpus) == len(index.gpus):
            changed = gpus.changed_since(index.gpus)
            if len(changed) <= _REINDEX_SHARE * len(gpus):
                _update_index(index, work, changed, first, least_memory, smallest, omega)
                return index
    short = least_memory - unit * EPS
    rooms = work.lit_room
    lost: list[RoomEntry] = []
    pool: list[RoomEntry] = []
    for k in range(BUCKETS + 1):
        run = rooms[k]
        if not run:
            continue
        cut = bisect.bisect_left(run, (short, -1))
        lost.extend(e for e in (run[:cut] if k < first else run) if _lost_at(gpus[e[1]], e[0], smallest, least_memory, unit, omega))
        if k < BUCKETS:
            pool.extend(run[cut:])
    lost.sort()
    pool.sort()
    index = _MemoryIndex(refs=work.refs, gpus=gpus, key=key, lost=lost, pool=pool, movers={})
    _INDEX[:] = [index]
    return index


def _lost_at(g: GpuState, free: float, smallest: float, least_memory: float, unit: float, omega: float) -> bool:
    """Whether lit GPU `g` (`free` MiB free) has free memory and no instance fits there."""
    if free <= EPS * unit:
        return False
    return not (
        omega - g.used_request >= smallest - EPS and g.used_memory + least_memory <= g.memory_mib * (1.0 + EPS)
    )


def _update_index(
    index: _MemoryIndex,
    work: ClusterSnapshot,
    changed: list[int],
    first: int,
    least_memory: float,
    smallest: float,
    omega: float,
) -> None:
    """Bring `index` from its GPU states to `work`'s, of which `changed` are other objects."""
    old_gpus, gpus = index.gpus, work.gpus
    unit = work.max_memory_mib
    short = least_memory - unit * EPS
    lost, pool, movers = index.lost, index.pool, index.movers
    nodes: set[str] = set()
    refs = work.refs
    for o in changed:
        for g, add in ((old_gpus[o], False), (gpus[o], True)):
            if not g.instances:
                continue  # dark: in neither list
            free = g.memory_mib - g.used_memory
            k = request_bucket(g.used_request)
            entry = (free, o)
            if (k >= first or free < short) and _lost_at(g, free, smallest, least_memory, unit, omega):
                _sorted_edit(lost, entry, add)
            if k < BUCKETS and free >= short:
                _sorted_edit(pool, entry, add)
        nodes.add(refs[o].invoker)
    if movers:
        for inv in nodes:
            for o in work.invoker_ordinals[inv]:
                movers.pop(o, None)
    index.gpus = gpus


def _sorted_edit(entries: list[RoomEntry], entry: RoomEntry, add: bool) -> None:
    i = bisect.bisect_left(entries, entry)
    if add:
        entries.insert(i, entry)
    else:
        if i == len(entries) or entries[i] != entry:
            raise AssertionError(f"memory index out of sync: {entry} missing")
        del entries[i]


#: An instance a memory merge may move off its GPU (`_movers`): the instance; for a stage, the lit GPU
#: of its node that takes it with the least free memory left (free MiB left, SM room left, ordinal)
#: and the gain of that move, else (a whole instance, whose target is looked for per call) None, 0.
_Mover = tuple[PlacedInstance, tuple[float, float, int] | None, float]


def _movers(
    work: ClusterSnapshot, source: int, smallest: float, least_memory: float, omega: float, pieces: bool
) -> tuple[_Mover, ...]:
    """The one-GPU instances of GPU `source` (pieces only if `pieces`) whose move would leave room some
    instance can use (at least `smallest` of SM room beside at least `least_memory` MiB), in their
    order there: whole ones, and stages that some lit GPU of their node takes with a gain, with the
    one that takes them with the least free memory left (then the least SM room, then cluster
    order), other than those holding a stage of their instance. A function of the node's GPU
    states."""
    gpus = work.gpus
    gpu = gpus[source]
    room = omega - gpu.used_request
    grow = 1.0 + EPS
    free = gpu.memory_mib - gpu.used_memory
    unit = work.max_memory_mib
    out: list[_Mover] = []
    node: tuple[GpuState, ...] | None = None
    for inst in gpu.instances:
        if not (
            inst.gpus == 1
            and (pieces or inst.part_of is None)
            and room + inst.request >= smallest - EPS
            and gpu.used_memory - inst.memory_mib + least_memory <= gpu.memory_mib * grow
        ):
            continue
        if inst.part_of is None:
            out.append((inst, None, 0.0))
            continue
        ords = work.invoker_ordinals[gpu.ref.invoker]
        if node is None:
            node = gpus.span(ords[0], ords[-1] + 1)
        stage = min(((f, left, o) for left, f, o in _stage_targets(node, ords[0], inst, omega)), default=None)
        if stage is None:
            continue
        t = stage[2]
        # As `_merge_memory` computes a gain; a stage that gains nothing is never a candidate.
        gain = (free - (gpus[t].memory_mib - gpus[t].used_memory - inst.memory_mib)) / unit
        if gain > EPS:
            out.append((inst, stage, gain))
    return tuple(out)


def _tightest_memory(
    work: ClusterSnapshot,
    pool: Sequence[tuple[float, int]],
    request: float,
    memory_mib: float,
    omega: float,
    avoid: int,
    most: float,
) -> int | None:
    """The GPU of `pool` ((free MiB, ordinal) of lit GPUs, ascending) other than `avoid` that takes
    an instance asking `request` and `memory_mib` (the schedulable, sm-request and memory filters)
    with the least free memory left, then the lowest ordinal; None: none that keeps at most `most`
    MiB free before the instance."""
    gpus = work.gpus
    grow = 1.0 + EPS
    slack = work.max_memory_mib * EPS
    for n in range(bisect.bisect_left(pool, (memory_mib - slack, -1)), len(pool)):
        free, o = pool[n]
        if free > most + slack:
            return None
        g = gpus[o]
        if (
            o != avoid
            and g.schedulable
            and g.used_request + request <= omega + EPS
            and g.used_memory + memory_mib <= g.memory_mib * grow
        ):
            return o
    return None


def _lost_room_buckets(work: ClusterSnapshot, omega: float) -> tuple[float, float, int, int] | None:
    """The least live SM request and memory (MiB) and the Σ-request buckets [first, stop) whose GPUs have
    less SM room than that request (lost room); None when no instance is live."""
    smallest = work.smallest_request()
    least_memory = work.smallest_memory()
    if smallest is None or least_memory is None:
        return None
    first = max(0, math.floor((omega - smallest) * BUCKETS))
    # Bucket BUCKETS holds Σ request ≥ 1: no room there unless ω > 1.
    stop = BUCKETS + 1 if omega > 1.0 else BUCKETS
    return smallest, least_memory, first, stop


def _rebalance(
    work: ClusterSnapshot,
    placement: PlacementConfig,
    config: CompactionConfig,
    budget: int,
    max_stages: int,
    targets: set[GpuRef],
    pinned: frozenset[str],
) -> tuple[ClusterSnapshot, list[CompactionMove]]:
    """Up to `budget` split instances (at most `max_stages` stages in all) whose pipeline stages are resized so that SM room no instance
    can use is filled.

    SM room ρ = ω − Σ request (fractions of a GPU) is lost on a lit GPU while ρ is below the least
    request (`ClusterSnapshot.smallest_request`). A split instance's stages ask request and memory
    in one proportion, m MiB per unit of request. Each stage on a GPU with lost room ρ_d grows by
    x_d ≤ ρ_d (and x_d·m MiB, within its GPU's free memory) and one other stage, on GPU b, shrinks by
    Σ x_d (no lower than `PlacementConfig.min_part_mib`): Σ request and Σ memory of the instance stay,
    the grown stages' GPUs lose x_d of lost room, and b's room becomes ρ_b + Σ x_d. A resize is made
    only when that room is one an instance can use (at least the least request, beside at least
    the least memory), and when the room it turns from lost into used or usable, the gain
    Σ x_d (+ ρ_b where ρ_b was lost), is at least `CompactionConfig.rebalance_min_gain` per resized
    stage (each a cold start); the largest gain first, stages as large as these bounds allow (the
    largest x_d first). Not pinned instances, not on a GPU this plan moved something onto or off;
    stages stay on their GPUs (`CompactionMove.source` equals `target`). Each resize looks at the
    stages on the `rebalance_sources` GPUs with lost room that hold one, the most room first.

    The caller resizes only while Σ request bounds the lit GPUs (`_request_binds`)."""
    moves: list[CompactionMove] = []
    omega = placement.omega
    lost = _lost_room_buckets(work, omega)
    if lost is None:
        return work, moves
    smallest, least_memory, first, stop = lost
    for _ in range(budget):
        gpus = work.gpus
        best: tuple[tuple[float, int], list[tuple[GpuState, PlacedInstance]], int, list[tuple[float, int]]] | None = None
        wholes: set[str] = set()
        looked = 0
        # GPUs whose room is below the least request, the most room first (the buckets from
        # `first` up), at most `rebalance_sources` of them holding a stage.
        for k in range(first, stop):
            if looked >= config.rebalance_sources:
                break
            for o in work.lit_buckets[k]:
                gpu = gpus[o]
                if not EPS < omega - gpu.used_request < smallest - EPS or gpu.ref in targets:
                    continue
                if looked >= config.rebalance_sources:
                    break
                looked += any(p.part_of is not None for p in gpu.instances)
                best = _best_stage_resize(
                    work, gpu, wholes, pinned, targets, best,
                    lambda stages: _best_resize(
                        stages, omega, smallest, least_memory, placement.min_part_mib, config.rebalance_min_gain
                    ),
                )
        if best is None or len(moves) + 1 + len(best[3]) > max_stages:
            break
        work = _apply_resize(work, best, 1.0, targets, moves, "")
    return work, moves


def _rebalance_memory(
    work: ClusterSnapshot,
    placement: PlacementConfig,
    config: CompactionConfig,
    budget: int,
    max_stages: int,
    targets: set[GpuRef],
    pinned: frozenset[str],
) -> tuple[ClusterSnapshot, list[CompactionMove]]:
    """Up to `budget` split instances (at most `max_stages` stages in all) whose pipeline stages are
    resized so that free memory no instance can use is filled: `_rebalance` with memory in the place
    of SM room, for a cluster where memory binds.

    A lit GPU's free memory φ (fractions of a GPU) is lost while no live instance fits there
    (`_lost_at`: φ below the least memory, or SM room below the least request). A split instance's
    stages ask request and memory in one proportion, m MiB per unit of request. Each stage on a GPU
    with lost memory φ_d grows by y_d ≤ φ_d (and y_d / m of request, within its GPU's SM room) and one
    other stage, on GPU b, shrinks by Σ y_d (no lower than `PlacementConfig.min_part_mib`): Σ request
    and Σ memory of the instance stay, the grown stages' GPUs lose y_d of lost memory, and b's free
    memory becomes φ_b + Σ y_d beside SM room ρ_b + Σ y_d / m. A resize is made only when that room is
    one an instance can use (at least the least memory beside at least the least request), and when
    the memory it turns from lost into used or usable, Σ y_d (+ φ_b where φ_b was lost), is at least
    `CompactionConfig.rebalance_min_gain` of a GPU per resized stage; the largest gain first. Not
    pinned instances, not on a GPU this plan moved something onto or off; stages stay on their GPUs.
    Each resize looks at the stages on the `rebalance_sources` GPUs with lost memory that hold one,
    the most free memory first (`_MemoryIndex.lost`).

    The caller resizes only where Σ request does not bound the lit GPUs (`_request_binds`)."""
    moves: list[CompactionMove] = []
    omega = placement.omega
    lost = _lost_room_buckets(work, omega)
    if lost is None:
        return work, moves
    smallest, least_memory, first, _ = lost
    unit = work.max_memory_mib
    for _ in range(budget):
        gpus = work.gpus
        index = _memory_index(work, smallest, least_memory, first, omega, config.move_pieces)
        best: tuple[tuple[float, int], list[tuple[GpuState, PlacedInstance]], int, list[tuple[float, int]]] | None = None
        wholes: set[str] = set()
        looked = 0
        for _, o in reversed(index.lost):
            if looked >= config.rebalance_sources:
                break
            gpu = gpus[o]
            if gpu.ref in targets:
                continue
            looked += any(p.part_of is not None for p in gpu.instances)
            best = _best_stage_resize(
                work, gpu, wholes, pinned, targets, best,
                lambda stages: _best_memory_resize(
                    stages, omega, smallest, least_memory, unit, placement.min_part_mib, config.rebalance_min_gain
                ),
            )
        if best is None or len(moves) + 1 + len(best[3]) > max_stages:
            break
        first_stage = best[1][0][1]
        work = _apply_resize(work, best, first_stage.memory_mib / first_stage.request, targets, moves, " for memory")
    return work, moves


_Resize = tuple[tuple[float, int], list[tuple[GpuState, PlacedInstance]], int, list[tuple[float, int]]]
"""A chosen resize: its key (gain, − stages grown), the instance's stages with their GPUs, the index of the
stage that shrinks, and (size, index) of each stage that grows."""


def _best_stage_resize(
    work: ClusterSnapshot,
    gpu: GpuState,
    wholes: set[str],
    pinned: frozenset[str],
    targets: set[GpuRef],
    best: _Resize | None,
    find: Callable[[list[tuple[GpuState, PlacedInstance]]], tuple[float, int, list[tuple[float, int]]] | None],
) -> _Resize | None:
    """The better of `best` and the resizes `find` proposes for the split instances with a stage on `gpu`
    (each instance once per search: `wholes`), none pinned or with a stage on a GPU of `targets`; the larger
    gain first, then fewer stages grown."""
    for piece in gpu.instances:
        whole = piece.part_of
        if whole is None or whole in wholes or whole in pinned:
            continue
        wholes.add(whole)
        stages = _stage_gpus(work, gpu, whole)
        if any(g.ref in targets or p.id in pinned for g, p in stages):
            continue
        found = find(stages)
        if found is None:
            continue
        gain, b, chosen = found
        key = (gain, -len(chosen))
        if best is None or key > best[0]:
            best = (key, stages, b, chosen)
    return best


def _apply_resize(
    work: ClusterSnapshot, best: _Resize, per_request: float, targets: set[GpuRef], moves: list[CompactionMove], what: str
) -> ClusterSnapshot:
    """`work` with `best`'s stages resized where they are (sizes in units of `per_request` per unit of SM
    request: 1 for SM room, the instance's MiB per request for memory), each resize a move onto its own GPU."""
    _, stages, b, chosen = best
    shrink = sum(x for x, _ in chosen)
    for idx, dx in [(b, -shrink), *((d, x) for x, d in chosen)]:
        g, p = stages[idx]
        q = _resized(p, dx / per_request)
        work = work.without_instance(p.id).with_instance(q, (g.ref,))
        targets.add(g.ref)
        moves.append(
            CompactionMove(
                instance_id=p.id,
                function=p.function,
                source=g.ref,
                target=g.ref,
                reason=(
                    f"resize stage on {g.ref}{what}: SM request {p.request:.3f} -> {q.request:.3f}, "
                    f"memory {p.memory_mib / 1024:.1f} -> {q.memory_mib / 1024:.1f} GiB"
                ),
            )
        )
    return work


def _best_memory_resize(
    stages: list[tuple[GpuState, PlacedInstance]],
    omega: float,
    smallest: float,
    least_memory: float,
    unit: float,
    min_part_mib: float,
    min_gain: float,
) -> tuple[float, int, list[tuple[float, int]]] | None:
    """The resize of `stages` (see `_rebalance_memory`) with the largest gain (memory, fractions of a
    GPU of `unit` MiB): (gain, the index of the stage that shrinks, [(y_d MiB, index of a stage that
    grows by y_d)]); None: none leaves usable room for at least `min_gain` per resized stage."""
    if len(stages) < 2 or stages[0][1].request <= EPS:
        return None
    per = stages[0][1].memory_mib / stages[0][1].request  # MiB per unit of request
    slack = unit * EPS
    best: tuple[float, int, list[tuple[float, int]]] | None = None
    for b, (gb, pb) in enumerate(stages):
        spare = pb.memory_mib - min_part_mib
        if spare <= slack:
            continue
        grows = []
        for d, (gd, _) in enumerate(stages):
            free_d = gd.memory_mib - gd.used_memory
            if d != b and _lost_at(gd, free_d, smallest, least_memory, unit, omega):
                y = min(free_d, (omega - gd.used_request) * per)
                if y > slack:
                    grows.append((y, d))
        chosen, total = _largest_growths(grows, spare, slack)
        if not chosen:
            continue
        free_b = gb.memory_mib - gb.used_memory
        if free_b + total < least_memory - slack or omega - gb.used_request + total / per < smallest - EPS:
            continue
        gain = (total + (free_b if _lost_at(gb, free_b, smallest, least_memory, unit, omega) else 0.0)) / unit
        if gain < min_gain * (1 + len(chosen)) - EPS:
            continue
        if best is None or (gain, -len(chosen)) > (best[0], -len(best[2])):
            best = (gain, b, chosen)
    return best


def _stage_gpus(work: ClusterSnapshot, gpu: GpuState, whole: str) -> list[tuple[GpuState, PlacedInstance]]:
    """The stages of the split instance `whole` (`_stages`), each with its GPU's state: on `gpu`'s
    node, in GPU order."""
    return [(work.gpu(ref), p) for ref, p in _stages(work, whole, gpu.ref.invoker)]


def _best_resize(
    stages: list[tuple[GpuState, PlacedInstance]],
    omega: float,
    smallest: float,
    least_memory: float,
    min_part_mib: float,
    min_gain: float,
) -> tuple[float, int, list[tuple[float, int]]] | None:
    """The resize of `stages` (see `_rebalance`) with the largest gain (SM, fractions of a GPU):
    (gain, the index of the stage that shrinks, [(x_d, index of a stage that grows by x_d)]);
    None: none leaves usable room for at least `min_gain` per resized stage."""
    grow = 1.0 + EPS
    if len(stages) < 2 or stages[0][1].request <= EPS:
        return None
    per = stages[0][1].memory_mib / stages[0][1].request  # MiB per unit of request
    best: tuple[float, int, list[tuple[float, int]]] | None = None
    for b, (gb, pb) in enumerate(stages):
        room_b = omega - gb.used_request
        spare = (pb.memory_mib - min_part_mib) / per
        if spare <= EPS:
            continue
        grows = []
        for d, (gd, _) in enumerate(stages):
            room_d = omega - gd.used_request
            if d != b and EPS < room_d < smallest - EPS:
                x = min(room_d, (gd.memory_mib * grow - gd.used_memory) / per)
                if x > EPS:
                    grows.append((x, d))
        chosen, total = _largest_growths(grows, spare, EPS)
        if not chosen or room_b + total < smallest - EPS:
            continue
        if gb.memory_mib - gb.used_memory + total * per < least_memory:
            continue
        gain = total + (room_b if room_b < smallest - EPS else 0.0)
        if gain < min_gain * (1 + len(chosen)) - EPS:
            continue
        if best is None or (gain, -len(chosen)) > (best[0], -len(best[2])):
            best = (gain, b, chosen)
    return best


def _largest_growths(
    grows: list[tuple[float, int]], spare: float, slack: float
) -> tuple[list[tuple[float, int]], float]:
    """The growths a resize makes out of `spare`: from `grows` ((size, stage index)), the largest first (then
    the lower index), each cut to what is left of `spare`, until that is within `slack`: (chosen, their sum)."""
    chosen: list[tuple[float, int]] = []
    total = 0.0
    for x, d in sorted(grows, key=lambda xd: (-xd[0], xd[1])):
        x = min(x, spare - total)
        if x <= slack:
            break
        chosen.append((x, d))
        total += x
    return chosen, total


def _resized(p: PlacedInstance, dx: float) -> PlacedInstance:
    """`p` (a stage) with `dx` more SM request, and memory and limit in proportion."""
    f = (p.request + dx) / p.request
    return replace(p, request=p.request + dx, limit=p.limit * f, memory_mib=p.memory_mib * f)


def _tightest_stage(work: ClusterSnapshot, gpu: GpuState, piece: PlacedInstance, omega: float) -> int | None:
    """The lit GPU of `gpu`'s node that takes `piece` (a pipeline stage) most tightly in SM room
    (then the least free memory, then cluster order), other than those holding a stage of its
    instance (`gpu` among them); None: none."""
    assert piece.part_of is not None
    ords = work.invoker_ordinals[gpu.ref.invoker]
    best = min(_stage_targets(work.gpus.span(ords[0], ords[-1] + 1), ords[0], piece, omega), default=None)
    return None if best is None else best[2]


def _stage_targets(
    node: Sequence[GpuState], first: int, piece: PlacedInstance, omega: float
) -> Iterator[tuple[float, float, int]]:
    """(SM room left, free MiB left, ordinal) of each lit, schedulable GPU of a node (its GPUs from
    ordinal `first`) that takes `piece` (a pipeline stage) and holds no stage of its instance (so not
    the stage's own GPU)."""
    grow = 1.0 + EPS
    for o, g in enumerate(node, first):
        if not g.instances or not g.schedulable or any(i.part_of == piece.part_of for i in g.instances):
            continue
        left = omega - g.used_request - piece.request
        if left < -EPS or g.used_memory + piece.memory_mib > g.memory_mib * grow:
            continue
        yield left, g.memory_mib - g.used_memory - piece.memory_mib, o


def _request_binds(cluster: ClusterSnapshot) -> bool:
    """Whether Σ request bounds the lit GPUs (Σ request ≥ Σ memory in GPUs' worth): only then does
    merging SM room pay; where memory binds, SM room is not what keeps GPUs lit, and merging it
    would spend cold starts for nothing."""
    return cluster.lit_count > 0 and cluster.sum_request >= cluster.sum_memory_fraction


def _above_bound(cluster: ClusterSnapshot, above: float | None) -> bool:
    """Whether the lit GPUs exceed the integral bound of what is placed by more than `above` of it
    (None: always true). A merge turns no GPU off by itself; it pays only when emptying (this call's
    or a later one's) or an arrival then lights fewer GPUs. No placement of what is placed lights
    fewer than the bound, so where the lit GPUs are at it a merge can never pay, and within
    `above` of it at most that share of them could. O(1): the snapshot keeps the bound's sums."""
    if above is None:
        return True
    return cluster.lit_count > cluster.integral_bound() * (1.0 + above) + EPS


#: config → the config a merging call runs under (`_call_config`), one object per value.
_MERGING: dict[CompactionConfig, CompactionConfig] = {}


def _call_config(config: CompactionConfig, merging: bool) -> CompactionConfig:
    """The limits a call runs under: `config`, with `merge_source_instances` while it merges. The
    same object call after call (the source caches compare configs by identity)."""
    if not merging or config.merge_source_instances >= config.source_max_instances:
        return config
    narrowed = _MERGING.get(config)
    if narrowed is None:
        if len(_MERGING) >= 64:
            _MERGING.clear()
        narrowed = _MERGING[config] = replace(config, source_max_instances=config.merge_source_instances)
    return narrowed


def _tightest(work: ClusterSnapshot, request: float, memory_mib: float, omega: float) -> int | None:
    """The lit GPU `lit_fits` would find first for an instance asking `request` and `memory_mib`
    under the schedulable, sm-request and memory filters (the tightest Σ-request bucket, then the
    least free memory), without building the request; None: none."""
    gpus = work.gpus
    need = (memory_mib - work.max_memory_mib * EPS, -1)
    grow = 1.0 + EPS
    for k in range(min(BUCKETS, math.floor((omega - request + EPS) * BUCKETS)), -1, -1):
        entries = work.lit_room[k]
        if not entries:
            continue
        for _, o in entries[bisect.bisect_left(entries, need) :]:
            g = gpus[o]
            if (
                g.schedulable
                and g.used_request + request <= omega + EPS
                and g.used_memory + memory_mib <= g.memory_mib * grow
            ):
                return o
    return None


def _strategy_filters(placement: PlacementConfig) -> tuple[Filter, ...]:
    return placement.filters()


def _lit_fits(
    work: ClusterSnapshot,
    inst: PlacedInstance,
    gpu: GpuState,
    placement: PlacementConfig,
    k: int,
    requests: dict[str, PlacementRequest],
    no_fit: list[NoFit],
) -> tuple[GpuRef, ...]:
    """`lit_fits` of the move request of `inst` (not a piece) off `gpu`, answered from `no_fit` when
    an entry covers it (see `NoFit`); a scan that finds nothing becomes an entry."""
    cls, r, lim, m = inst.cls, inst.request, inst.limit, inst.memory_mib
    for e in no_fit:
        q = e.request
        if q.cls is cls and q.request <= r and q.limit <= lim and q.memory_mib <= m:
            s = work.gpus[e.source]
            if s.ref == gpu.ref or not s.lit:
                return ()
            request = requests.get(inst.id) or _as_request(work, inst, gpu.ref)
            requests[inst.id] = request
            if all(f.passes(s, request, placement) for f in _strategy_filters(placement)):
                return (s.ref,)
            return ()
    request = requests.get(inst.id) or _as_request(work, inst, gpu.ref)
    requests[inst.id] = request
    fits = lit_fits(work, request, placement, limit=k)
    if not fits:
        # A shape that asks no less than an entry's is covered by it: keep the smallest.
        no_fit[:] = [
            e
            for e in no_fit
            if not (
                e.request.cls is cls
                and e.request.request >= r
                and e.request.limit >= lim
                and e.request.memory_mib >= m
            )
        ]
        no_fit.append(NoFit(request=request, source=work.ordinals[gpu.ref]))
    return fits


def _still_no_fit(
    entries: tuple[NoFit, ...], changed: list[GpuState], placement: PlacementConfig
) -> list[NoFit]:
    """The entries no GPU of `changed` (those that changed since they were made) may now satisfy."""
    if not entries or not changed:
        return list(entries)
    filters = [f for f in _strategy_filters(placement) if f is not FILTERS["avoid"]]
    lit = [g for g in changed if g.lit]
    return [
        e
        for e in entries
        if not any(all(f.passes(g, e.request, placement) for f in filters) for g in lit)
    ]


def _cannot_all_fit(
    work: ClusterSnapshot,
    gpu: GpuState,
    order: list[PlacedInstance],
    placement: PlacementConfig,
    splits: bool,
    requests: dict[str, PlacementRequest],
    no_fit: list[NoFit],
    options: dict[str, int],
) -> Need | None:
    """A quick proof, without deriving a snapshot, that the instances of `gpu` cannot all move (what
    would have to change for them to, as a `Need` with every blocker found), or None: an instance
    that may not be split finds no lit GPU at all, or a group of instances that few lit GPUs take
    (all of them known) lacks the room on those GPUs together. The move requests it builds are left in `requests` (an
    instance that is not a piece asks the same whatever the cluster); `no_fit` answers, and learns,
    which requests no lit GPU takes."""
    k = len(order)
    fits_of: list[tuple[PlacedInstance, tuple[GpuRef, ...]]] = []
    blockers: list[Need] = []
    # A piece placed anew as a whole instance frees its sibling stages' GPUs: what comes after it
    # (biggest first, as `_try_source` moves instances that may split) might use that room.
    after_piece = False
    split_checks: list[PlacedInstance] = []
    for inst in order:
        if inst.part_of is not None or (splits and inst.cls is InstanceClass.LLM):
            if not after_piece:
                split_checks.append(inst)
            after_piece = after_piece or inst.part_of is not None
            continue
        fits = _lit_fits(work, inst, gpu, placement, k, requests, no_fit)
        if not fits:
            blockers.append(_need(work, gpu, inst, placement, alone=True))
            continue
        options[inst.id] = len(fits)
        if len(fits) < k:
            fits_of.append((inst, fits))
    # An instance with fewer lit GPUs to go to than there are instances has all of them known;
    # moves only consume room (an LLM split too), so each group of such instances must fit in the
    # room of the GPUs that take any of its members, in request, limit and memory (the largest
    # group that does not is a blocker).
    for size in range(len(fits_of), 1, -1):
        for group in itertools.combinations(fits_of, size):
            union = {r: None for _, fits in group for r in fits}
            room = [work.gpu(r) for r in union]
            insts = [i for i, _ in group]
            deficit = (
                sum(i.request for i in insts) - sum(placement.omega - g.used_request for g in room),
                sum(i.limit for i in insts) - sum(placement.gamma - g.used_limit for g in room),
                sum(i.memory_mib for i in insts) - sum(g.free_memory for g in room),
            )
            if max(deficit) > EPS:
                blockers.append(
                    Need(
                        ids=frozenset(i.id for i in insts),
                        instance=insts[-1].id,
                        memory_mib=min(i.memory_mib for i in insts),
                        request=min(i.request for i in insts),
                        limit=min(i.limit for i in insts),
                        invoker=None,
                        split_mib=None,
                        deficit=(max(0.0, deficit[0]), max(0.0, deficit[1]), max(0.0, deficit[2])),
                        members=tuple((i.request, i.limit, i.memory_mib) for i in insts),
                        union=tuple(work.ordinals[r] for r in union),
                    )
                )
                return _joined(blockers)
    if not blockers:
        # Dearer (every node that might take the pieces is looked at): only when nothing else
        # rules the source out.
        for inst in split_checks:
            if not _may_move_split(work, inst, gpu, placement, requests):
                return _need(work, gpu, inst, placement, alone=True)
    return _joined(blockers)


def _may_move_split(
    work: ClusterSnapshot,
    inst: PlacedInstance,
    gpu: GpuState,
    placement: PlacementConfig,
    requests: dict[str, PlacementRequest],
) -> bool:
    """Whether `inst`, an instance that may be split (a whole LLM) or a piece of one, may move off
    `gpu` at all: whole onto a lit GPU, split over lit GPUs of one node, or (a piece) onto another
    GPU of its node or as its whole instance placed anew away from its stages (`_move_whole`)."""
    request = requests.get(inst.id) or _as_request(work, inst, gpu.ref)
    if inst.part_of is None:
        requests[inst.id] = request
        return bool(lit_fits(work, request, placement)) or split_fits(work, request, placement)
    if lit_fits(work, request, placement):
        return True
    whole = _whole_request(inst, _stages(work, inst.part_of, gpu.ref.invoker))
    # The stages' GPUs are avoided, so the cluster with the stages still on them answers alike.
    return bool(lit_fits(work, whole, placement)) or split_fits(work, whole, placement)


def _try_source(
    work: ClusterSnapshot,
    gpu: GpuState,
    placement: PlacementConfig,
    no_fit: list[NoFit],
    may_place: bool = True,
) -> tuple[list[CompactionMove], ClusterSnapshot, list[GpuRef], Need | None, bool]:
    """Move every instance off `gpu` onto other lit GPUs, or nothing (empty list, and what would
    have to change for them to move); last, whether placement ran. Without `may_place` only the
    cheap proof runs: nothing and no `Need` when it does not rule the source out."""
    # Biggest first: they are the hardest to fit, so a hopeless source is abandoned early.
    order = sorted(gpu.instances, key=lambda i: (-i.request, -i.memory_mib, i.id))
    splits = placement.strategy_spec().splits and placement.llm_max_parts > 1
    requests: dict[str, PlacementRequest] = {}
    options: dict[str, int] = {}
    hopeless = _cannot_all_fit(work, gpu, order, placement, splits, requests, no_fit, options)
    if hopeless is not None:
        return [], work, [], hopeless, False
    if not may_place:
        return [], work, [], None, False
    # Most constrained first: an instance that only a few lit GPUs take (fewer than there are
    # instances to move, all of them known) moves before the others, so one with more choice does
    # not take its only GPU; the rest keep biggest first (a stable sort).
    k = len(order)
    order.sort(key=lambda i: options.get(i.id, k))
    moves, trial, freed, stuck, opened = _place_in_order(work, gpu, order, placement, requests)
    if stuck is not None:
        need = _need(work, gpu, order[stuck], placement)
        if _exact(placement):
            others = tuple(_need(work, gpu, i, placement, alone=True) for n, i in enumerate(order) if n != stuck)
            need = replace(need, others=others, opened=gpu.ref.invoker if opened else None)
        return [], work, [], need, True
    return moves, trial, freed, None, True


def _place_in_order(
    work: ClusterSnapshot,
    gpu: GpuState,
    order: list[PlacedInstance],
    placement: PlacementConfig,
    requests: dict[str, PlacementRequest],
) -> tuple[list[CompactionMove], ClusterSnapshot, list[GpuRef], int | None, bool]:
    """Move the instances of `gpu` one after another in `order` onto other lit GPUs: the moves,
    the cluster after them and the GPUs they leave dark, or ([], `work`, [], the index in `order`
    of the instance that found no room); last, whether a split instance was placed anew before
    (freeing its other stages' GPUs, on `gpu`'s node)."""
    trial = work
    trial_moves: list[CompactionMove] = []
    trial_freed: list[GpuRef] = []
    for n, inst in enumerate(order):
        trial = trial.without_instance(inst.id)
        request = requests.get(inst.id) or _as_request(trial, inst, gpu.ref)
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
            return [], work, [], n, any(m.replaces for m in trial_moves)
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
    return trial_moves, trial, trial_freed, None, False




@dataclass(slots=True)
class _WasteIndex:
    """What `_repack` searches, for the GPU states `gpus` (ω and the largest GPU's memory as `key`):
    the waste of each node with a lit GPU, brought up to date from the GPUs that changed, and the
    sources whose re-pack failed with the states of their node then, the cold starts it was allowed
    and the pinned instances (tried again once a GPU of the node changed, with more cold starts
    allowed, or other instances pinned; what changed on other nodes is not looked at)."""

    refs: tuple[GpuRef, ...]
    gpus: GpuVector
    key: tuple[float, float]
    waste: dict[str, float]
    failed: dict[int, tuple[tuple[GpuState, ...], int, frozenset[str]]]
    exhausted: dict[str, tuple[int, frozenset[str]]] = field(default_factory=dict)
    """Nodes whose every GPU a call may try was skipped or failed, with the cold starts allowed and
    the pinned instances then: while no GPU of the node changed (a node that changed since the
    index was last brought up to date is dropped; one a re-pack of this call changed is not
    trusted) and these are the same, each would be skipped again (as `failed`), so the node is
    passed over without looking at its GPUs."""
    refuted: _Refuted = field(default_factory=lambda: _Refuted())
    """Lit-only placements a re-pack tried in vain (`_Refuted`): skipped while they would fail again."""


#: Key of a `_Refuted` fact: the instance's class, request, limit and memory (MiB), all that the
#: filters and split placement read of a lit-only request besides the GPUs it avoids.
_FactKey = tuple[InstanceClass, float, float, float]


@dataclass(slots=True)
class _Refuted:
    """The lit-only placements that a re-pack ran and that found no room (of the re-packed GPU's own
    instances, and of those a displacement would move off another GPU of its node), by the shape of
    the instance, each with the GPU states it failed on, what the instance needs (`Need`) and the
    GPUs its request avoided.

    Most re-pack tries fail, and a GPU is tried again as soon as a GPU of its node changed, mostly
    at the same placements. A placement known to fail fails again on a later cluster while no GPU
    it may use that changed since, or that it avoided then and may use now, may take the instance
    (`_some_take`): whole, or as a piece of a split over its node's lit GPUs. Moves and arrivals only
    consume room elsewhere, and split placement takes a node's GPUs only where each may hold a
    piece, so the others are as they were (as `CompactionState` relies on for emptying). So such a
    placement is not run, and the re-pack decides exactly as it does placing; a fact confirmed so
    is restamped with the GPUs it was checked on, so that the next check looks only at what changed
    after (`GpuVector.changed_since`: identity, at C speed). Facts not used for `_REFUTED_CALLS`
    calls are dropped (two generations); under another placement config every fact is."""

    placement: PlacementConfig | None = None
    caps: tuple[bool, bool, bool] = (False, False, False)
    """Whether the strategy bounds a GPU by Σ request (ω), Σ limit (γ) and memory."""
    facts: dict[_FactKey, tuple[GpuVector, Need, frozenset[int]]] = field(default_factory=dict)
    older: dict[_FactKey, tuple[GpuVector, Need, frozenset[int]]] = field(default_factory=dict)
    calls: int = 0
    changes: dict[tuple[int, int], tuple[GpuVector, GpuVector, list[tuple[int, GpuState]]]] = field(
        default_factory=dict
    )
    """The lit, schedulable GPUs that changed between a fact's GPUs and those it is checked on, by
    their ids (kept with them, so that the ids stay theirs), for the call."""

    def start(self, placement: PlacementConfig) -> None:
        """A `_repack` call begins under `placement`."""
        if placement is not self.placement and placement != self.placement:
            names = {f.name for f in placement.filters()}
            self.placement = placement
            self.caps = ("sm-request" in names, "sm-limit" in names, "memory" in names)
            self.facts, self.older = {}, {}
        self.calls += 1
        if self.calls % _REFUTED_CALLS == 0:
            self.older, self.facts = self.facts, {}
        self.changes.clear()

    def fails(self, cluster: ClusterSnapshot, inst: PlacedInstance | PlacementRequest, avoid: frozenset[int]) -> bool:
        """Whether the lit-only placement of (an instance shaped as) `inst` avoiding the GPUs `avoid`
        (ordinals) is known to fail on `cluster` (as it is, or as it is but on those GPUs)."""
        key = (inst.cls, inst.request, inst.limit, inst.memory_mib)
        fact = self.facts.get(key)
        if fact is None:
            fact = self.older.pop(key, None)
            if fact is None:
                return False
        since, need, avoided = fact
        gpus = cluster.gpus
        if (
            avoided != avoid
            # What it avoided then and may use now must not take it either.
            and self._some_take(cluster, [(o, gpus[o]) for o in avoided - avoid], need, avoid)
        ) or (since is not gpus and self._some_take(cluster, self._changed(since, gpus), need, avoid)):
            self.facts.pop(key, None)
            return False
        self.facts[key] = (gpus, need, avoid)
        return True

    def learn(
        self, cluster: ClusterSnapshot, inst: PlacedInstance | PlacementRequest, need: Need, avoid: frozenset[int]
    ) -> None:
        """The lit-only placement of `inst` (which needs `need`) avoiding the GPUs `avoid` found no room
        on `cluster`."""
        self.facts[(inst.cls, inst.request, inst.limit, inst.memory_mib)] = (cluster.gpus, need, avoid)

    def _changed(self, since: GpuVector, now: GpuVector) -> list[tuple[int, GpuState]]:
        got = self.changes.get((id(since), id(now)))
        if got is None or got[0] is not since or got[1] is not now:
            lit = [(o, g) for o in now.changed_since(since) if (g := now[o]).instances and g.schedulable]
            got = self.changes[(id(since), id(now))] = (since, now, lit)
        return got[2]

    def _some_take(
        self, cluster: ClusterSnapshot, gpus: list[tuple[int, GpuState]], need: Need, avoid: frozenset[int]
    ) -> bool:
        """Whether one of `gpus` (ordinal, state; those in `avoid` aside) may take the instance
        `need` describes: whole (the filters' sums, a little slack added), or a piece of it (its
        capacity as split placement computes it, at least the least piece, a little slack taken)
        with its node's other lit GPUs holding the rest. A lit GPU that may hold no piece does not
        count: split placement never uses it, and the node's other GPUs that changed are looked at
        themselves. An over-estimate (the order of sums aside, as `_SWAP_SLACK` for the filters)."""
        if not gpus:
            return False
        placement = self.placement
        assert placement is not None
        by_request, by_limit, by_memory = self.caps
        omega, gamma, grow = placement.omega + EPS + _SWAP_SLACK, placement.gamma + EPS + _SWAP_SLACK, 1.0 + EPS
        request, limit, memory = need.request, need.limit, need.memory_mib
        whole = need.split_mib
        small = per_request = per_limit = 0.0
        if whole is not None:
            small = min(placement.min_part_mib, whole) - _REFUTED_SLACK_MIB
            per_request = whole / need.split_request if by_request and need.split_request > 0 else 0.0
            per_limit = whole / need.split_limit if by_limit and need.split_limit > 0 else 0.0
        for o, g in gpus:
            if o in avoid or not (g.instances and g.schedulable):
                continue
            if (
                (not by_request or g.used_request + request <= omega)
                and (not by_limit or g.used_limit + limit <= gamma)
                and (not by_memory or g.used_memory + memory <= g.memory_mib * grow + _SWAP_SLACK_MIB)
            ):
                return True
            if whole is None:
                continue
            c = g.memory_mib * grow - g.used_memory if by_memory else math.inf
            if per_request:
                x = (omega - g.used_request) * per_request
                c = x if x < c else c
            if per_limit:
                x = (gamma - g.used_limit) * per_limit
                c = x if x < c else c
            if c < small:
                continue
            # The node's room for pieces, the GPUs avoided aside. (The piece size is written out twice on
            # purpose: a helper for it cost 5-8% of a 3,200 0.2:0.4 re-pack replay.)
            ords = cluster.invoker_ordinals[g.ref.invoker]
            room = 0.0
            pieces = 0
            for oh, h in enumerate(cluster.gpus.span(ords[0], ords[-1] + 1), ords[0]):
                if h.instances and h.schedulable and oh not in avoid:
                    c = h.memory_mib * grow - h.used_memory if by_memory else math.inf
                    if per_request:
                        x = (omega - h.used_request) * per_request
                        c = x if x < c else c
                    if per_limit:
                        x = (gamma - h.used_limit) * per_limit
                        c = x if x < c else c
                    if c >= small:
                        room += c if c < whole else whole
                        pieces += 1
            if pieces >= 2 and room >= whole - EPS - _REFUTED_SLACK_MIB:
                return True
        return False


#: The index of the last `_repack` (one: the calls of a replay follow one another).
_WASTE: list[_WasteIndex] = []
#: Nodes a call looks at per re-pack it may try, the most waste first.
_REPACK_NODES = 16
#: Calls after which a `_Refuted` fact not used since is dropped (between one and two such spans).
_REFUTED_CALLS = 64
#: Slack (MiB) of `_Refuted`'s split test against the order in which split placement sums capacities.
_REFUTED_SLACK_MIB = 1e-3
#: Slack of `_displace`'s quick test of a pair (fraction of a GPU, MiB): far above what summing a
#: GPU's instances in another order may change.
_SWAP_SLACK, _SWAP_SLACK_MIB = 1e-9, 1e-6


def _node_waste(node: Sequence[GpuState], omega: float, unit: float) -> float | None:
    """Lit GPUs of a node less what its instances take of the resource that binds there (Σ request /
    ω, or Σ memory in GPUs of `unit` MiB); None: none lit."""
    lit = request = memory = 0.0
    for g in node:
        if g.instances:
            lit += 1
            request += g.used_request
            memory += g.used_memory
    if not lit:
        return None
    return lit - max(request / omega, memory / unit)


def _waste_index(work: ClusterSnapshot, omega: float) -> _WasteIndex:
    """`_WasteIndex` of `work`: the last one brought up to date, or a new one."""
    unit = work.max_memory_mib
    key = (omega, unit)
    gpus = work.gpus
    index = _WASTE[0] if _WASTE else None
    nodes: Iterable[str]
    if (
        index is not None
        and index.key == key
        and (index.refs is work.refs or index.refs == work.refs)
        and isinstance(gpus, GpuVector)
        and len(gpus) == len(index.gpus)
    ):
        if index.gpus is gpus:
            return index
        refs = work.refs
        nodes = {refs[o].invoker for o in gpus.changed_since(index.gpus)}
    else:
        index = _WasteIndex(refs=work.refs, gpus=gpus, key=key, waste={}, failed={})
        _WASTE[:] = [index]
        nodes = work.invoker_ordinals
    exhausted = index.exhausted
    for inv in nodes:
        exhausted.pop(inv, None)
        ords = work.invoker_ordinals[inv]
        waste = _node_waste(gpus.span(ords[0], ords[-1] + 1), omega, unit)
        if waste is None:
            index.waste.pop(inv, None)
        else:
            index.waste[inv] = waste
    index.gpus = gpus
    return index


def _repack(
    work: ClusterSnapshot,
    placement: PlacementConfig,
    config: CompactionConfig,
    budget: int,
    targets: set[GpuRef],
    pinned: frozenset[str],
) -> tuple[ClusterSnapshot, list[CompactionMove], list[GpuRef]]:
    """Up to `config.repacks` lit GPUs tried to be turned off by re-packing them (`_repack_gpu`), at
    most `budget` moves in all: the moves and the GPUs they leave dark.

    The nodes are taken by their waste, the most first: lit GPUs less what the node's instances take
    of the resource that binds there (Σ request / ω, or Σ memory in GPUs); a node whose lit GPUs
    its instances fill leaves no room a re-pack could gather, one with half a GPU of waste holds
    crumbs on several GPUs. On a node, the GPUs that hold no gang and no pinned instance (nor an
    instance whose stage is pinned) and that this plan moved nothing onto are tried, the least
    loaded first (in the resource that binds the GPU), until one turns off. A GPU whose re-pack
    failed is tried again once a GPU of its node changed (`_WasteIndex.failed`)."""
    omega = placement.omega
    unit = work.max_memory_mib
    index = _waste_index(work, omega)
    known = index.refuted
    known.start(placement)
    moves: list[CompactionMove] = []
    freed: list[GpuRef] = []
    tries = 0
    # The nodes a call looks at (bounds the work; a failed GPU is skipped at no try).
    ranked = heapq.nsmallest(
        _REPACK_NODES * config.repacks,
        ((-w, work.invoker_ordinals[inv][0], inv) for inv, w in index.waste.items() if w > EPS),
    )
    # Nodes a re-pack of this call changed (the index knows what changed before).
    touched: set[str] = set()
    for _, first, inv in ranked:
        if tries >= config.repacks or len(moves) >= budget:
            break
        allowed = min(config.repack_moves, budget - len(moves))
        spent = index.exhausted.get(inv)
        if spent is not None and spent[0] >= allowed and spent[1] == pinned and inv not in touched:
            # Each GPU it may try would be skipped as failed (below).
            continue
        ords = work.invoker_ordinals[inv]
        node = work.gpus.span(ords[0], ords[-1] + 1)
        exhausted = True
        sources = []
        for o, g in enumerate(node, first):
            if g.instances and _may_repack(work, g, pinned):
                if g.ref in targets:
                    exhausted = False
                else:
                    sources.append((max(g.used_request / omega, g.used_memory / unit), o))
        sources.sort()
        for _, o in sources:
            if tries >= config.repacks:
                exhausted = False
                break
            gone = index.failed.get(o)
            # The node as it was then, by value: a planner that derives its snapshots anew (the live balancer's)
            # skips the same GPUs as one that keeps them (the simulator's), so both spend their tries alike.
            if gone is not None and gone[1] >= allowed and gone[2] == pinned and all(
                    a is b or a == b for a, b in zip(gone[0], node, strict=True)):
                continue
            tries += 1
            found = _repack_gpu(work, o, placement, allowed, targets, pinned, known, live=config.repack_live)
            if found is None:
                index.failed[o] = (node, allowed, pinned)
                continue
            exhausted = False
            refs = work.refs
            touched.update(refs[c].invoker for c in found[0].gpus.changed_since(work.gpus))
            work, gpu_moves, dark = found
            moves.extend(gpu_moves)
            freed.extend(dark)
            for m in gpu_moves:
                targets.add(m.target)
                targets.update(p.gpu for p in m.parts)
            break
        if exhausted:
            index.exhausted[inv] = (allowed, pinned)
        else:
            index.exhausted.pop(inv, None)
    return work, moves, freed


def _may_repack(work: ClusterSnapshot, gpu: GpuState, pinned: frozenset[str]) -> bool:
    """Whether lit GPU `gpu` may be re-packed: it holds no gang and no instance that is pinned or
    has a pinned stage."""
    for i in gpu.instances:
        if i.gpus > 1 or i.id in pinned:
            return False
        if i.part_of is not None and pinned and (
            i.part_of in pinned or any(p.id in pinned for _, p in _stages(work, i.part_of, gpu.ref.invoker))
        ):
            return False
    return True


def _repack_gpu(
    work: ClusterSnapshot,
    o: int,
    placement: PlacementConfig,
    budget: int,
    targets: set[GpuRef],
    pinned: frozenset[str],
    known: _Refuted,
    *,
    live: bool = False,
) -> tuple[ClusterSnapshot, list[CompactionMove], list[GpuRef]] | None:
    """Every instance of GPU `o` placed anew on other lit GPUs (`place`, lit GPUs only, the GPU
    avoided): whole instances the largest first, where no lit GPU takes one after displacing one
    instance of another lit GPU of the node (`_displace`); then each split instance with a stage
    there cut anew as a whole, on any lit GPUs but `o` (its other stages' GPUs included). `live`
    (`CompactionConfig.repack_live`): no displacing, and a split instance is placed anew away from every
    GPU its stages hold (`_move_whole` as emptying runs it). Returns
    the cluster after, the moves and the GPUs left dark (`o` first), or None: some instance found
    no room, or the moves cost more than `budget` cold starts. A placement `known` to fail is not
    run; one that fails is learnt there."""
    gpu = work.gpus[o]
    source = gpu.ref
    trial = work
    moves: list[CompactionMove] = []
    cost = 0
    wholes = sorted(
        (i for i in gpu.instances if i.part_of is None), key=lambda i: (-i.request, -i.memory_mib, i.id)
    )
    for inst in wholes:
        request = _as_request(trial, inst, source)
        avoid = frozenset((o,))
        decision = None
        if known.fails(trial, inst, avoid):
            pass
        elif not _may_place(trial, request, placement):
            # `trial` differs from the cluster placement would see only on `o`, which it avoids.
            known.learn(trial, inst, _need(trial, gpu, inst, placement, True), avoid)
        else:
            rest = trial.without_instance(inst.id)
            decision = place(rest, request, placement)
            if not decision.placed:
                known.learn(trial, inst, _need(trial, gpu, inst, placement, True), avoid)
        if decision is not None and decision.placed:
            trial = apply_placement(rest, request, decision) if decision.parts else rest.with_instance(
                inst, decision.gpus
            )
            made = [
                CompactionMove(
                    instance_id=inst.id,
                    function=inst.function,
                    source=source,
                    target=decision.gpus[0],
                    reason=f"re-pack {source}: {decision.reason}",
                    parts=decision.parts,
                )
            ]
        else:
            displaced = None if live else _displace(trial, inst, request, source, placement, targets, pinned, known)
            if displaced is None:
                return None
            trial, made = displaced
        moves.extend(made)
        cost += sum(m.cold_starts for m in made)
        if cost > budget:
            return None
    for whole in sorted({i.part_of for i in gpu.instances if i.part_of is not None}):
        piece = next(p for p in trial.gpus[o].instances if p.part_of == whole)
        cut = _move_whole(trial, piece, source, placement, repack=not live, known=known)
        if cut is None:
            return None
        trial, move, _ = cut
        moves.append(move)
        cost += move.cold_starts
        if cost > budget:
            return None
    if trial.gpus[o].lit:
        return None
    # A split instance cut anew may leave its other stages' GPUs dark too.
    dark = sorted({ref for m in moves for pid in m.replaces for ref in work.instance_gpus(pid)} - {source})
    return trial, moves, [source, *(r for r in dark if not trial.gpu(r).lit)]


def _may_place(base: ClusterSnapshot, request: PlacementRequest, placement: PlacementConfig) -> bool:
    """Whether a lit-only `place` of `request` may succeed on a cluster that differs from `base` only
    on GPUs the request avoids: whole on a lit GPU or split over lit GPUs of a node (`lit_fits`,
    `split_fits`: placement's own tests, without scoring or deriving a snapshot)."""
    return bool(lit_fits(base, request, placement)) or split_fits(base, request, placement)


def _displace(
    base: ClusterSnapshot,
    inst: PlacedInstance,
    request: PlacementRequest,
    source: GpuRef,
    placement: PlacementConfig,
    targets: set[GpuRef],
    pinned: frozenset[str],
    known: _Refuted,
) -> tuple[ClusterSnapshot, list[CompactionMove]] | None:
    """`inst` (on `source` in `base`) placed on a lit GPU of its node in the place of one whole
    one-GPU instance there, which placement then puts on another lit GPU (neither `source` nor that
    GPU): the first such pair, the GPUs in cluster order and on each the smallest instance first;
    None: no pair. Both GPUs pass every filter of the strategy for what they take. The cluster
    placement then sees differs from `base` only on the two GPUs its request avoids, so a placement
    `known` to fail on `base` is not run (`_Refuted`)."""
    filters = placement.filters()
    ords = base.invoker_ordinals[source.invoker]
    s = base.ordinals[source]
    rest: ClusterSnapshot | None = None
    by_request, _, by_memory = known.caps
    omega, grow = placement.omega + EPS + _SWAP_SLACK, 1.0 + EPS
    for og, g in enumerate(base.gpus.span(ords[0], ords[-1] + 1), ords[0]):
        if not g.instances or g.ref == source or g.ref in targets:
            continue
        others = sorted(
            (i for i in g.instances if i.gpus == 1 and i.part_of is None and i.id not in pinned),
            key=lambda i: (i.request, i.memory_mib, i.id),
        )
        for other in others:
            # Most pairs fail here: in request or memory beyond any rounding, without building the
            # GPU's state (the filters, on that state, decide the rest).
            if (by_request and g.used_request - other.request + request.request > omega) or (
                by_memory and g.used_memory - other.memory_mib + request.memory_mib > g.memory_mib * grow + _SWAP_SLACK_MIB
            ):
                continue
            without = g.with_instances(tuple(i for i in g.instances if i.id != other.id))
            if not all(f.passes(without, request, placement) for f in filters):
                continue
            avoid = frozenset((og, s))
            if known.fails(base, other, avoid):
                continue
            moved = replace(_as_request(base, other, g.ref), avoid_gpus=frozenset((g.ref, source)))
            if not _may_place(base, moved, placement):
                known.learn(base, other, _need(base, g, other, placement, True), avoid)
                continue
            if rest is None:
                rest = base.without_instance(inst.id)
            after = rest.without_instance(other.id).with_instance(inst, (g.ref,))
            decision = place(after, moved, placement)
            if not decision.placed:
                known.learn(base, other, _need(base, g, other, placement, True), avoid)
                continue
            after = apply_placement(after, moved, decision) if decision.parts else after.with_instance(
                other, decision.gpus
            )
            return after, [
                CompactionMove(
                    instance_id=inst.id,
                    function=inst.function,
                    source=source,
                    target=g.ref,
                    reason=f"re-pack {source}: {inst.id} in the place of {other.id} on {g.ref}",
                ),
                CompactionMove(
                    instance_id=other.id,
                    function=other.function,
                    source=g.ref,
                    target=decision.gpus[0],
                    reason=f"re-pack {source}: {other.id} makes room on {g.ref}: {decision.reason}",
                    parts=decision.parts,
                ),
            ]
    return None
