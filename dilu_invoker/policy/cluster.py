"""The cluster as placement sees it: a frozen snapshot with indexes kept up to date incrementally.

Placement must stay fast with ~15,000 GPUs and tens of thousands of decisions (the simulator replays
32,000 placements in under a minute), so a snapshot carries indexes that a decision can use without
walking every GPU: lit GPUs bucketed by their Σ request (by ordinal, and by free memory within a
bucket), unlit GPUs per invoker, invokers by the free memory of their lit GPUs, where each instance
sits, and how many instances of each function each invoker holds. `with_instance` / `without_instance`
return a new snapshot in which only the touched entries were rebuilt: the maps are persistent (hash
array mapped tries, `immutables.Map`, O(log n) per change, shared structure), the GPUs are a
persistent vector (`GpuVector`: chunks of 64, a change copies the chunk index and the chunks it
touches), so the snapshot stays a value: an old one is never changed by a later placement.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import attrgetter, is_not
from types import MappingProxyType
from typing import TypeVar, overload

from immutables import Map

from dilu_invoker.policy.types import EPS, GpuRef, GpuState, InstanceClass, PlacedInstance

#: Resolution of the Σ-request index: lit GPUs are bucketed by floor(Σ request × BUCKETS).
BUCKETS = 100


def request_bucket(used_request: float) -> int:
    """Index bucket of a lit GPU whose instances request `used_request` of it in total."""
    return min(BUCKETS, max(0, math.floor(used_request * BUCKETS + EPS)))


_CHUNK_BITS = 6
_CHUNK = 1 << _CHUNK_BITS
_LOW = _CHUNK - 1


class GpuVector(Sequence[GpuState]):
    """GPU ordinal → state, persistent: a tuple of chunks of 64 states. `replace` copies the chunk
    index and the chunks it touches (O(GPUs / 64 + 64 per chunk touched) instead of O(GPUs)), and
    unchanged chunks are shared, so `changed_since` an ancestor compares chunks by identity first."""

    __slots__ = ("_chunks", "_len")

    def __init__(self, states: Iterable[GpuState] = ()) -> None:
        flat = tuple(states)
        self._chunks: tuple[tuple[GpuState, ...], ...] = tuple(
            flat[i : i + _CHUNK] for i in range(0, len(flat), _CHUNK)
        )
        self._len = len(flat)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, o: int) -> GpuState: ...

    @overload
    def __getitem__(self, o: slice) -> tuple[GpuState, ...]: ...

    def __getitem__(self, o: int | slice) -> GpuState | tuple[GpuState, ...]:
        # The per-decision path indexes with ordinals >= 0: one comparison, two tuple lookups (an
        # ordinal past the end raises IndexError from them).
        try:
            if o >= 0:  # type: ignore[operator]
                return self._chunks[o >> _CHUNK_BITS][o & _LOW]  # type: ignore[operator]
        except TypeError:
            pass
        if isinstance(o, slice):
            return tuple(self)[o]
        if not -self._len <= o < 0:
            raise IndexError("GPU ordinal out of range")
        return self[o + self._len]

    def __iter__(self) -> Iterator[GpuState]:
        return chain.from_iterable(self._chunks)

    def states(self, ordinals: Iterable[int]) -> list[GpuState]:
        """The states of `ordinals` (each 0 <= o < len), in their order: one list built at C speed
        where indexing one by one calls `__getitem__` per ordinal."""
        chunks = self._chunks
        return [chunks[o >> _CHUNK_BITS][o & _LOW] for o in ordinals]

    def span(self, start: int, stop: int) -> tuple[GpuState, ...]:
        """The states of ordinals start..stop−1 (0 <= start < stop <= len), e.g. one invoker's GPUs
        (its ordinals are contiguous): one slice when they lie in one chunk."""
        first, last = start >> _CHUNK_BITS, (stop - 1) >> _CHUNK_BITS
        if first == last:
            return self._chunks[first][start & _LOW : ((stop - 1) & _LOW) + 1]
        return tuple(chain.from_iterable(self._chunks[first : last + 1]))[
            start - (first << _CHUNK_BITS) : stop - (first << _CHUNK_BITS)
        ]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GpuVector):
            return self._chunks == other._chunks
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._chunks)

    def __repr__(self) -> str:
        return f"GpuVector({list(self)!r})"

    def replace(self, changes: Mapping[int, GpuState]) -> GpuVector:
        """A new vector with `changes` (ordinal → state) applied; this one is left as it was."""
        chunks = list(self._chunks)
        touched: dict[int, list[GpuState]] = {}
        for o, g in changes.items():
            c = o >> _CHUNK_BITS
            chunk = touched.get(c)
            if chunk is None:
                chunk = touched[c] = list(chunks[c])
            chunk[o & _LOW] = g
        for c, chunk in touched.items():
            chunks[c] = tuple(chunk)
        new = GpuVector.__new__(GpuVector)
        new._chunks = tuple(chunks)
        new._len = self._len
        return new

    @property
    def chunks(self) -> tuple[tuple[GpuState, ...], ...]:
        """The states in chunks of 64 (ordinal o in chunk o >> 6), shared with the vectors derived from this one."""
        return self._chunks

    def changed_since(self, old: GpuVector) -> list[int]:
        """Ordinals whose state is another object than in `old` (of the same length)."""
        out: list[int] = []
        for c, (a, b) in enumerate(zip(old._chunks, self._chunks, strict=True)):
            if a is not b:
                base = c << _CHUNK_BITS
                out.extend(base + i for i in compress(range(len(b)), map(is_not, a, b)))
        return out


@dataclass(frozen=True, slots=True)
class DemandTotals:
    """Cluster-wide sums kept incrementally, for fragmentation means and the lit-GPU lower bound."""

    lit_gpus: int
    sm_request: float
    """Σ over GPUs of Σ request on that GPU (an instance on k GPUs counts k times)."""
    memory_mib: float
    """Σ over GPUs of memory placed there."""
    memory_fraction: float
    """Σ over lit GPUs of (memory placed / capacity)."""
    widest: int
    """Most GPUs any live instance spans (0 when nothing is placed)."""


_EMPTY_MAP: Map[str, int] = Map()

#: An entry of `ClusterSnapshot.lit_room`: (free MiB, ordinal), so a bucket sorts tightest first.
RoomEntry = tuple[float, int]
#: (Σ request, Σ memory MiB, Σ memory fraction of the lit GPUs) of some GPUs (`ClusterSnapshot.chunk_sums`)
ChunkSums = tuple[float, float, float]
#: What split placement reads of one lit GPU: (memory × (1 + EPS) − used MiB, free MiB, Σ request,
#: Σ limit, ordinal, used MiB, memory × (1 + EPS) MiB, schedulable): the last three for its memory
#: and schedulable filters, computed as the filters compute them.
LitRoom = tuple[float, float, float, float, int, float, float, bool]
#: An entry of `ClusterSnapshot.node_room`: (Σ free MiB of the invoker's lit GPUs, its first ordinal,
#: then bounds over those lit GPUs for split placement: the largest memory × (1 + EPS) − used, the
#: least Σ request, the least Σ limit; then its lit GPUs as `LitRoom`s, in ordinal order; then the
#: greatest Σ request and Σ limit over them, the sums of memory × (1 + EPS) − used over every
#: pair of them, ascending, and the MiB per unit of request and of limit above which memory alone
#: holds a piece back on every one of them, see `SPLIT_OMEGA`). The first two order the entries; the bounds let a split pass over an
#: invoker none of whose lit GPUs can take a large enough piece, the `LitRoom`s let it look at the
#: others without their states, and the pair sums let a split that needs two pieces pass over an
#: invoker whose pieces would all leave more room unused than the best plan so far.
NodeRoom = tuple[
    float, int, float, float, float, tuple[LitRoom, ...], float, float, tuple[float, ...], float, float
]
#: Σ request and Σ limit caps (Dilu's ω and γ) of the last two fields of a `NodeRoom`: the most MiB
#: per unit of request (limit) among its lit GPUs' memory room / (cap − Σ request (limit)). A split
#: whose instance has at least that many MiB per unit of request (limit), under caps at least these,
#: is held back by memory alone on every lit GPU of the invoker (∞: some GPU is at the cap).
SPLIT_OMEGA, SPLIT_GAMMA = 1.0, 1.5


_GROW = 1.0 + EPS


def _ceil_tolerant(x: float) -> int:
    # As `fragmentation._ceil`: ⌈2.0000000001⌉ is 2 (the sums come from floats).
    return max(0, math.ceil(x - 1e-6))


def _free(g: GpuState) -> float:
    return g.memory_mib - g.used_memory


def _node_room(invoker_ords: Sequence[int], gpus: Sequence[GpuState]) -> NodeRoom | None:
    """The `node_room` entry of an invoker (None when none of its GPUs is lit); recomputed from its
    few GPUs, never summed incrementally, so it always equals a fresh build's."""
    free = 0.0
    most = -math.inf
    least_request = least_limit = math.inf
    first = invoker_ords[0]
    states = (
        gpus.span(first, invoker_ords[-1] + 1)
        if isinstance(gpus, GpuVector)
        else [gpus[o] for o in invoker_ords]
    )
    most_request = most_limit = -math.inf
    per_request = per_limit = -math.inf
    lit: list[LitRoom] = []
    for o, g in zip(invoker_ords, states, strict=True):
        if g.instances:
            used = g.used_memory
            # The same expressions as split placement's per-GPU memory capacity and free memory,
            # so the bound is that capacity's exact maximum.
            grown = g.memory_mib * _GROW
            room = grown - used
            if room > most:
                most = room
            gpu_free = g.memory_mib - used
            free += gpu_free
            if g.used_request < least_request:
                least_request = g.used_request
            if g.used_request > most_request:
                most_request = g.used_request
            if g.used_limit < least_limit:
                least_limit = g.used_limit
            if g.used_limit > most_limit:
                most_limit = g.used_limit
            x = room / (SPLIT_OMEGA - g.used_request) if g.used_request < SPLIT_OMEGA else math.inf
            if x > per_request:
                per_request = x
            x = room / (SPLIT_GAMMA - g.used_limit) if g.used_limit < SPLIT_GAMMA else math.inf
            if x > per_limit:
                per_limit = x
            lit.append((room, gpu_free, g.used_request, g.used_limit, o, used, grown, g.schedulable))
    if not lit:
        return None
    rooms = [e[0] for e in lit]
    pairs = sorted([a + b for i, a in enumerate(rooms) for b in rooms[i + 1 :]])
    return (
        free, first, most, least_request, least_limit, tuple(lit), most_request, most_limit, tuple(pairs),
        per_request, per_limit,
    )


def _node_room_index(
    node_room: tuple[NodeRoom, ...], invoker_ords: Sequence[int], gpus: GpuVector
) -> int | None:
    """Where the invoker's entry is in `node_room` (the index of the snapshot whose GPUs are
    `gpus`), found by its Σ free memory, computed as `_node_room` does; None: it has none."""
    free = 0.0
    lit = False
    first = invoker_ords[0]
    for g in gpus.span(first, invoker_ords[-1] + 1):
        if g.instances:
            lit = True
            free += g.memory_mib - g.used_memory
    if not lit:
        return None
    i = bisect.bisect_left(node_room, (free, first))
    if i == len(node_room) or node_room[i][1] != first or node_room[i][0] != free:
        raise AssertionError(f"index out of sync: node room of ordinal {first} missing")
    return i


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Every GPU of every invoker, what is placed where, and `now`.

    Build one with `ClusterSnapshot.build` (from load reports) or `ClusterSnapshot.uniform` (for a
    simulated cluster); derive the next with `with_instance` / `without_instance` / `at`.
    """

    now: float
    invokers: tuple[str, ...]
    refs: tuple[GpuRef, ...]
    """GPU ordinal → where it is; ordinals are the fixed order used for deterministic tie-breaks."""
    gpus: GpuVector
    """GPU ordinal → state."""
    ordinals: Mapping[GpuRef, int]
    invoker_ordinals: Mapping[str, tuple[int, ...]]
    lit_buckets: tuple[tuple[int, ...], ...]
    """For k in 0..BUCKETS: ordinals (ascending) of lit GPUs whose Σ request falls in bucket k."""
    lit_room: tuple[tuple[RoomEntry, ...], ...]
    """The same GPUs per bucket as (free MiB, ordinal), ascending: a scan for an instance needing m
    MiB starts where m fits (bisect) and meets the tightest memory fits first."""
    lit_limits: tuple[tuple[RoomEntry, ...], ...]
    """The same GPUs per bucket as (Σ limit, ordinal), ascending: those with room for a limit l
    under a cap are a prefix (when limits bind before memory does)."""
    node_room: tuple[NodeRoom, ...]
    """(Σ free MiB over its lit GPUs, first ordinal, bounds) of every invoker with a lit GPU,
    ascending: the invokers whose lit GPUs together hold m MiB are a suffix (splitting an instance
    over lit GPUs); the bounds (`NodeRoom`) say how large a piece its roomiest lit GPU may take."""
    unlit: Map[str, tuple[int, ...]]
    """Invoker → ordinals (ascending) of its GPUs with nothing placed."""
    unlit_nodes: tuple[tuple[int, ...], ...]
    """For n in 0..(most GPUs of an invoker) − 1: the first ordinals (ascending, i.e. cluster order)
    of the invokers with more than n unlit GPUs: placement walks the invokers that can light a GPU
    (or a gang's n + 1) without passing over every full one."""
    locations: Map[str, tuple[int, ...]]
    """Instance id → ordinals of the GPUs it occupies."""
    function_counts: Map[str, Map[str, int]]
    """Function → invoker → number of its instances there."""
    width_counts: Mapping[int, int]
    """Instance width (GPUs) → number of live instances that wide."""
    request_counts: Map[float, int]
    """SM request (per GPU) → number of live instances asking it, pieces of split instances left
    out (a piece's request is a share of its instance's): `smallest_request`."""
    memory_counts: Map[float, int]
    """Memory (MiB per GPU) → number of live instances asking it, pieces left out: `smallest_memory`."""
    lit_count: int
    sum_request: float
    sum_memory: float
    sum_memory_fraction: float
    max_memory_mib: float
    min_memory_mib: float
    large_memory_slots: int = 0
    """Σ gpus over live training instances asking more than half of `max_memory_mib` per GPU: no two
    such slots share a GPU, and a training slot is never split (`integral_bound`)."""
    large_request_slots: int = 0
    """Σ gpus over live training instances asking SM request above 0.5 per GPU (`integral_bound`)."""
    chunk_sums: tuple[ChunkSums, ...] = field(default=(), compare=False, repr=False)
    """(Σ request, Σ memory, Σ memory fraction of the lit GPUs) of each chunk of `gpus` (`GpuVector.chunks`), each
    added in ordinal order; `sum_request`, `sum_memory` and `sum_memory_fraction` are theirs added in chunk order
    (`build`, `with_states`), except after `with_instance` / `without_instance`, which move the totals by the
    change and mark its chunks `dirty_chunks`. So `with_states` adds up the chunks instead of every GPU, walking
    only the chunks that changed."""
    dirty_chunks: frozenset[int] = field(default=frozenset(), compare=False, repr=False)
    """Chunks whose `chunk_sums` entry is stale (changed by `with_instance` / `without_instance` since)."""

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def build(cls, *, now: float, gpus: Iterable[GpuState]) -> ClusterSnapshot:
        """Index a full set of GPUs (O(GPUs + instances)); invokers keep their first-seen order."""
        states = list(gpus)
        if not states:
            raise ValueError("a cluster needs at least one GPU")
        order: dict[str, list[GpuState]] = {}
        for g in states:
            order.setdefault(g.ref.invoker, []).append(g)
        ordered = [
            g
            for group in order.values()
            for g in sorted(group, key=lambda s: s.ref.gpu)
        ]
        refs = tuple(g.ref for g in ordered)
        ordinals = {ref: i for i, ref in enumerate(refs)}
        if len(ordinals) != len(refs):
            raise ValueError("duplicate GPU in cluster snapshot")
        invoker_ordinals: dict[str, tuple[int, ...]] = {}
        for i, ref in enumerate(refs):
            invoker_ordinals[ref.invoker] = invoker_ordinals.get(ref.invoker, ()) + (i,)
        buckets: list[list[int]] = [[] for _ in range(BUCKETS + 1)]
        rooms: list[list[RoomEntry]] = [[] for _ in range(BUCKETS + 1)]
        limits: list[list[RoomEntry]] = [[] for _ in range(BUCKETS + 1)]
        unlit: dict[str, tuple[int, ...]] = {inv: () for inv in order}
        locations: dict[str, tuple[int, ...]] = {}
        seen: dict[str, PlacedInstance] = {}
        fn_counts: dict[str, dict[str, int]] = {}
        widths: dict[int, int] = {}
        requests: dict[float, int] = {}
        memories: dict[float, int] = {}
        lit = 0
        large_memory = large_request = 0
        half = max(g.memory_mib for g in ordered) / 2
        for i, g in enumerate(ordered):
            if g.lit:
                lit += 1
                buckets[request_bucket(g.used_request)].append(i)
                rooms[request_bucket(g.used_request)].append((_free(g), i))
                limits[request_bucket(g.used_request)].append((g.used_limit, i))
            else:
                unlit[g.ref.invoker] += (i,)
            for inst in g.instances:
                prev = seen.get(inst.id)
                if prev is None:
                    seen[inst.id] = inst
                    fn = fn_counts.setdefault(inst.function, {})
                    fn[g.ref.invoker] = fn.get(g.ref.invoker, 0) + 1
                    widths[inst.gpus] = widths.get(inst.gpus, 0) + 1
                    if inst.part_of is None:
                        requests[inst.request] = requests.get(inst.request, 0) + 1
                        memories[inst.memory_mib] = memories.get(inst.memory_mib, 0) + 1
                    if inst.cls is InstanceClass.TRAINING:
                        large_memory += inst.gpus if inst.memory_mib > half + EPS else 0
                        large_request += inst.gpus if inst.request > 0.5 + EPS else 0
                elif prev != inst:
                    raise ValueError(
                        f"instance {inst.id} is described differently on two GPUs"
                    )
                locations[inst.id] = locations.get(inst.id, ()) + (i,)
        node_room = sorted(
            e for ords in invoker_ordinals.values() if (e := _node_room(ords, ordered)) is not None
        )
        widest_node = max(len(ords) for ords in invoker_ordinals.values())
        unlit_nodes = tuple(
            tuple(ords[0] for inv, ords in invoker_ordinals.items() if len(unlit[inv]) > n)
            for n in range(widest_node)
        )
        vector = GpuVector(ordered)
        chunk_sums = tuple(map(_chunk_sums, vector.chunks))
        sum_req, sum_mem, sum_frac = _totals(chunk_sums)
        return cls(
            now=now,
            invokers=tuple(order),
            refs=refs,
            gpus=vector,
            ordinals=MappingProxyType(ordinals),
            invoker_ordinals=MappingProxyType(invoker_ordinals),
            lit_buckets=tuple(tuple(b) for b in buckets),
            lit_room=tuple(tuple(sorted(r)) for r in rooms),
            lit_limits=tuple(tuple(sorted(r)) for r in limits),
            node_room=tuple(node_room),
            unlit=Map(unlit),
            unlit_nodes=unlit_nodes,
            locations=Map(locations),
            function_counts=Map({f: Map(c) for f, c in fn_counts.items()}),
            width_counts=MappingProxyType(widths),
            request_counts=Map(requests),
            memory_counts=Map(memories),
            lit_count=lit,
            sum_request=sum_req,
            sum_memory=sum_mem,
            sum_memory_fraction=sum_frac,
            max_memory_mib=max(g.memory_mib for g in ordered),
            min_memory_mib=min(g.memory_mib for g in ordered),
            large_memory_slots=large_memory,
            large_request_slots=large_request,
            chunk_sums=chunk_sums,
        )

    @classmethod
    def uniform(
        cls,
        *,
        now: float = 0.0,
        invokers: int | Sequence[str],
        gpus_per_invoker: int,
        memory_mib: float,
        sm_count: int = 0,
    ) -> ClusterSnapshot:
        """An empty cluster of identical GPUs (the simulator's starting point)."""
        names = (
            [f"invoker{i}" for i in range(invokers)]
            if isinstance(invokers, int)
            else list(invokers)
        )
        if gpus_per_invoker < 1 or not names:
            raise ValueError(
                "a cluster needs at least one invoker with at least one GPU"
            )
        return cls.build(
            now=now,
            gpus=(
                GpuState(ref=GpuRef(name, i), memory_mib=memory_mib, sm_count=sm_count)
                for name in names
                for i in range(gpus_per_invoker)
            ),
        )

    # -- queries ------------------------------------------------------------------------------

    def gpu(self, ref: GpuRef) -> GpuState:
        return self.gpus[self.ordinals[ref]]

    def lit_gpus(self) -> Iterator[GpuState]:
        """Lit GPUs in ordinal order (O(GPUs); for reports, not for the per-decision path)."""
        return (g for g in self.gpus if g.lit)

    def has_instance(self, instance_id: str) -> bool:
        return instance_id in self.locations

    def instance_gpus(self, instance_id: str) -> tuple[GpuRef, ...]:
        return tuple(self.refs[o] for o in self.locations[instance_id])

    def instance(self, instance_id: str) -> PlacedInstance:
        ordinal = self.locations[instance_id][0]
        for inst in self.gpus[ordinal].instances:
            if inst.id == instance_id:
                return inst
        raise KeyError(instance_id)  # unreachable while the index is consistent

    def function_count(self, function: str, invoker: str) -> int:
        """How many instances of `function` the invoker holds."""
        return self.function_counts.get(function, _EMPTY_MAP).get(invoker, 0)

    def totals(self) -> DemandTotals:
        widest = max((w for w, n in self.width_counts.items() if n > 0), default=0)
        return DemandTotals(
            lit_gpus=self.lit_count,
            sm_request=self.sum_request,
            memory_mib=self.sum_memory,
            memory_fraction=self.sum_memory_fraction,
            widest=widest,
        )

    def integral_bound(self) -> int:
        """The integral lower bound on lit GPUs for what is placed now (`integral_lit_gpu_lower_bound`,
        the largest GPU's memory as the divisor): max(⌈Σ request⌉, ⌈Σ memory / capacity⌉, the widest
        instance, the large training slots of either kind). O(widths)."""
        widest = max((w for w, n in self.width_counts.items() if n > 0), default=0)
        ceil = _ceil_tolerant
        return max(
            ceil(self.sum_request),
            ceil(self.sum_memory / self.max_memory_mib),
            widest,
            self.large_memory_slots,
            self.large_request_slots,
        )

    def smallest_request(self) -> float | None:
        """The least SM request of a live instance (pieces of split instances left out); None: none."""
        return min(self.request_counts) if self.request_counts else None

    def smallest_memory(self) -> float | None:
        """The least memory (MiB per GPU) of a live instance (pieces of split instances left out);
        None: none."""
        return min(self.memory_counts) if self.memory_counts else None

    def __len__(self) -> int:
        return len(self.gpus)

    # -- derivation ---------------------------------------------------------------------------

    def at(self, now: float) -> ClusterSnapshot:
        return _copy(self, now=now)

    def with_instance(
        self, instance: PlacedInstance, gpus: Sequence[GpuRef]
    ) -> ClusterSnapshot:
        """A new snapshot with `instance` placed on `gpus` (no admission check: that is placement's job)."""
        if instance.id in self.locations:
            raise ValueError(f"instance {instance.id} is already placed")
        if len(gpus) != instance.gpus or len(set(gpus)) != len(gpus):
            raise ValueError(
                f"instance {instance.id} needs {instance.gpus} distinct GPUs, got {list(gpus)}"
            )
        try:
            ords = tuple(sorted(self.ordinals[ref] for ref in gpus))
        except KeyError as exc:
            raise ValueError(f"unknown GPU {exc.args[0]}") from None
        changed = {
            o: self.gpus[o].with_instances(self.gpus[o].instances + (instance,))
            for o in ords
        }
        return self._rebuild(changed, self.locations.set(instance.id, ords), instance, +1)

    def without_instance(self, instance_id: str) -> ClusterSnapshot:
        """A new snapshot with the instance gone from every GPU it occupied (KeyError if unknown)."""
        ords = self.locations[instance_id]
        instance = self.instance(instance_id)
        changed = {
            o: self.gpus[o].with_instances(
                tuple(i for i in self.gpus[o].instances if i.id != instance_id)
            )
            for o in ords
        }
        return self._rebuild(changed, self.locations.delete(instance_id), instance, -1)

    def with_schedulable(self, ref: GpuRef, schedulable: bool) -> ClusterSnapshot:
        """Mark a GPU as draining (False) or open again (True)."""
        o = self.ordinals[ref]
        old = self.gpus[o]
        new = GpuState(
            ref=old.ref,
            memory_mib=old.memory_mib,
            uuid=old.uuid,
            sm_count=old.sm_count,
            instances=old.instances,
            schedulable=schedulable,
            weight_groups=old.weight_groups,
        )
        return _copy(self, gpus=self.gpus.replace({o: new}))

    def with_states(self, now: float, changes: Mapping[int, GpuState]) -> ClusterSnapshot:
        """The snapshot `build` makes of this one's GPUs with `changes` (ordinal → new state, each of the same
        GPU, its `ref` unchanged) applied, at `now`: only the changed GPUs' index entries, their invokers'
        `node_room` entries and the instances on them are indexed again (O(changes × bucket) plus one pass
        over the GPUs for the float sums, which are summed again in ordinal order so that they are `build`'s
        to the last bit). A change that `build` indexes globally (a GPU's memory capacity, which sets the
        large-slot threshold) or an instance described differently on two GPUs falls back to `build` (which
        raises for the latter), and so does a change of more than a quarter of the GPUs
        (of more than 16), which `build` indexes faster."""
        if not changes:
            return self.at(now)
        old_gpus = self.gpus
        refs = self.refs
        for o, new in changes.items():
            if not 0 <= o < len(refs) or new.ref != refs[o]:
                raise ValueError(f"GPU ordinal {o} is {refs[o] if 0 <= o < len(refs) else 'unknown'}, "
                                 f"not {new.ref}")
        gpus = old_gpus.replace(changes)
        capacity = any(new.memory_mib != old_gpus[o].memory_mib for o, new in changes.items())
        if len(changes) > max(16, len(refs) // 4) or capacity:
            return ClusterSnapshot.build(now=now, gpus=gpus)
        derived = self._with_states(gpus, changes)
        return ClusterSnapshot.build(now=now, gpus=gpus) if derived is None else _copy(derived, now=now)

    def _with_states(self, gpus: GpuVector, changes: Mapping[int, GpuState]) -> ClusterSnapshot | None:
        old_gpus = self.gpus
        buckets = list(self.lit_buckets)
        rooms = list(self.lit_room)
        limits = list(self.lit_limits)
        unlit = self.unlit
        unlit_nodes: list[tuple[int, ...]] | None = None
        lit = self.lit_count
        touched_invokers: dict[str, None] = {}
        affected: dict[str, None] = {}
        held: dict[str, list[int]] = {}  # instance id -> the changed GPUs that hold it now
        for o in sorted(changes):
            old, new = old_gpus[o], changes[o]
            inv = new.ref.invoker
            touched_invokers[inv] = None
            affected.update(dict.fromkeys(i.id for i in old.instances))
            for i in new.instances:
                affected[i.id] = None
                held.setdefault(i.id, []).append(o)
            unlit, unlit_nodes = self._reindex(o, old, new, buckets, rooms, limits, unlit, unlit_nodes)
            lit += new.lit - old.lit
        # Each touched invoker's node-room entry, recomputed from its GPUs as `build` computes it.
        node_room = list(self.node_room)
        stale = [at for inv in touched_invokers
                 if (at := _node_room_index(self.node_room, self.invoker_ordinals[inv], old_gpus)) is not None]
        for at in sorted(stale, reverse=True):
            del node_room[at]
        for inv in touched_invokers:
            entry = _node_room(self.invoker_ordinals[inv], gpus)
            if entry is not None:
                bisect.insort_left(node_room, entry)
        # Every instance on a changed GPU: its old contribution out, its new one (from the first GPU in ordinal
        # order that holds it, as `build` counts it) in.
        locations = self.locations
        fn_counts = self.function_counts
        widths = dict(self.width_counts)
        requests, memories = self.request_counts, self.memory_counts
        large_memory, large_request = self.large_memory_slots, self.large_request_slots
        half = self.max_memory_mib / 2
        refs = self.refs
        for iid in affected:
            before = self.locations.get(iid)
            if before is not None:
                old_inst = self.instance(iid)
                fn_counts = _count(fn_counts, old_inst.function, refs[before[0]].invoker, -1)
                widths[old_inst.gpus] -= 1
                if not widths[old_inst.gpus]:
                    del widths[old_inst.gpus]
                requests, memories, large_memory, large_request = _tally(
                    old_inst, -1, half, requests, memories, large_memory, large_request)
            after = tuple(sorted([o for o in before or () if o not in changes] + held.get(iid, [])))
            if not after:
                if before is not None:
                    locations = locations.delete(iid)
                continue
            described = [i for o in after for i in gpus[o].instances if i.id == iid]
            first = described[0]
            if any(i != first for i in described[1:]):
                return None  # described differently on two GPUs: `build` raises
            locations = locations.set(iid, after)
            fn_counts = _count(fn_counts, first.function, refs[after[0]].invoker, +1)
            widths[first.gpus] = widths.get(first.gpus, 0) + 1
            requests, memories, large_memory, large_request = _tally(
                first, +1, half, requests, memories, large_memory, large_request)
        # The float sums as `build` adds them: each chunk's in ordinal order, those that changed (here or by
        # `with_instance` / `without_instance` since the last exact sums) added up again, then the chunks'.
        chunk_sums = list(self.chunk_sums)
        vector_chunks = gpus.chunks
        if len(chunk_sums) != len(vector_chunks):
            chunk_sums = list(map(_chunk_sums, vector_chunks))
        else:
            for c in self.dirty_chunks.union({o >> _CHUNK_BITS for o in changes}):
                chunk_sums[c] = _chunk_sums(vector_chunks[c])
        sums = tuple(chunk_sums)
        return self._derived(gpus, buckets, rooms, limits, tuple(node_room), unlit, unlit_nodes, locations, fn_counts,
                             widths, requests, memories, lit, _totals(sums), (large_memory, large_request),
                             (sums, frozenset()))

    def _derived(
        self, gpus: GpuVector, buckets: list[tuple[int, ...]], rooms: list[tuple[RoomEntry, ...]],
        limits: list[tuple[RoomEntry, ...]], node_room: tuple[NodeRoom, ...], unlit: Map[str, tuple[int, ...]],
        unlit_nodes: list[tuple[int, ...]] | None, locations: Map[str, tuple[int, ...]],
        fn_counts: Map[str, Map[str, int]], widths: dict[int, int], requests: Map[float, int],
        memories: Map[float, int], lit: int, sums: ChunkSums, large: tuple[int, int],
        chunks: tuple[tuple[ChunkSums, ...], frozenset[int]],
    ) -> ClusterSnapshot:
        """This snapshot with the indexes a derivation (`with_states`, `with_instance`) rebuilt."""
        return _copy(
            self,
            gpus=gpus,
            lit_buckets=tuple(buckets),
            lit_room=tuple(rooms),
            lit_limits=tuple(limits),
            node_room=node_room,
            unlit=unlit,
            unlit_nodes=self.unlit_nodes if unlit_nodes is None else tuple(unlit_nodes),
            locations=locations,
            function_counts=fn_counts,
            width_counts=MappingProxyType(widths),
            request_counts=requests,
            memory_counts=memories,
            lit_count=lit,
            sum_request=sums[0],
            sum_memory=sums[1],
            sum_memory_fraction=sums[2],
            large_memory_slots=large[0],
            large_request_slots=large[1],
            chunk_sums=chunks[0],
            dirty_chunks=chunks[1],
        )

    def _reindex(
        self, o: int, old: GpuState, new: GpuState, buckets: list[tuple[int, ...]], rooms: list[tuple[RoomEntry, ...]],
        limits: list[tuple[RoomEntry, ...]], unlit: Map[str, tuple[int, ...]], unlit_nodes: list[tuple[int, ...]] | None,
    ) -> tuple[Map[str, tuple[int, ...]], list[tuple[int, ...]] | None]:
        """GPU `o`'s entries moved from its `old` state to its `new` one: the Σ-request buckets (in place), and
        the unlit GPUs and nodes (returned; `unlit_nodes` copied from this snapshot's at its first change)."""
        inv = new.ref.invoker
        # The old state's entries out, then the new state's in: the same steps, removing then inserting.
        for g, op, removing in ((old, _remove, True), (new, _insert, False)):
            if g.lit:
                k = request_bucket(g.used_request)
                buckets[k] = op(buckets[k], o)
                rooms[k] = op(rooms[k], (_free(g), o))
                limits[k] = op(limits[k], (g.used_limit, o))
            else:
                ords = unlit[inv]
                unlit = unlit.set(inv, op(ords, o))
                unlit_nodes = unlit_nodes or list(self.unlit_nodes)
                # the node is listed under each count of unlit GPUs below its own: its last entry goes or comes
                n = len(ords) - 1 if removing else len(ords)
                unlit_nodes[n] = op(unlit_nodes[n], self.invoker_ordinals[inv][0])
        return unlit, unlit_nodes

    def _rebuild(
        self,
        changed: Mapping[int, GpuState],
        locations: Map[str, tuple[int, ...]],
        instance: PlacedInstance,
        sign: int,
    ) -> ClusterSnapshot:
        old_gpus = self.gpus
        gpus = old_gpus.replace(changed)
        buckets = list(self.lit_buckets)
        rooms = list(self.lit_room)
        limits = list(self.lit_limits)
        unlit = self.unlit
        unlit_nodes: list[tuple[int, ...]] | None = None
        lit = self.lit_count
        sum_req, sum_mem, sum_frac = (
            self.sum_request,
            self.sum_memory,
            self.sum_memory_fraction,
        )
        dirty = self.dirty_chunks
        for o, new in changed.items():
            if o >> _CHUNK_BITS not in dirty:
                dirty = dirty.union((o >> _CHUNK_BITS,))
            old = old_gpus[o]
            unlit, unlit_nodes = self._reindex(o, old, new, buckets, rooms, limits, unlit, unlit_nodes)
            if old.lit:
                sum_frac -= old.used_memory / old.memory_mib
                lit -= 1
            if new.lit:
                sum_frac += new.used_memory / new.memory_mib
                lit += 1
            sum_req += new.used_request - old.used_request
            sum_mem += new.used_memory - old.used_memory
        if lit == 0:
            # Float residue from many add/subtract pairs must not survive an empty cluster.
            sum_req = sum_mem = sum_frac = 0.0
        invoker = self.refs[next(iter(changed))].invoker
        node_ords = self.invoker_ordinals[invoker]
        node_room = self.node_room
        at = _node_room_index(node_room, node_ords, old_gpus)
        before = None if at is None else node_room[at]
        after = _node_room(node_ords, gpus)
        if before != after:
            node_room = _replace_sorted(node_room, at, after)
        fn_counts = _count(self.function_counts, instance.function, invoker, sign)
        widths = dict(self.width_counts)
        widths[instance.gpus] = widths.get(instance.gpus, 0) + sign
        if widths[instance.gpus] <= 0:
            del widths[instance.gpus]
        requests, memories, large_memory, large_request = _tally(
            instance, sign, self.max_memory_mib / 2, self.request_counts, self.memory_counts,
            self.large_memory_slots, self.large_request_slots)
        return self._derived(gpus, buckets, rooms, limits, node_room, unlit, unlit_nodes, locations, fn_counts,
                             widths, requests, memories, lit, (sum_req, sum_mem, sum_frac), (large_memory, large_request),
                             (self.chunk_sums, dirty))


def _chunk_sums(states: Iterable[GpuState]) -> ChunkSums:
    """Σ request, Σ memory and Σ memory fraction of the lit GPUs among `states` (one chunk), in their order."""
    req = mem = frac = 0.0
    for g in states:
        if g.instances:
            frac += g.used_memory / g.memory_mib
        req += g.used_request
        mem += g.used_memory
    return req, mem, frac


def _totals(chunk_sums: Iterable[ChunkSums]) -> ChunkSums:
    """The chunks' sums added up in chunk order (`ClusterSnapshot.chunk_sums`)."""
    req = mem = frac = 0.0
    for r, m, f in chunk_sums:
        req += r
        mem += m
        frac += f
    return req, mem, frac


def _count(fn_counts: Map[str, Map[str, int]], function: str, invoker: str, sign: int) -> Map[str, Map[str, int]]:
    """`function_counts` with `function`'s count on `invoker` moved by `sign`; emptied entries dropped."""
    per_inv = fn_counts.get(function, _EMPTY_MAP)
    count = per_inv.get(invoker, 0) + sign
    if count > 0:
        per_inv = per_inv.set(invoker, count)
    elif invoker in per_inv:
        per_inv = per_inv.delete(invoker)
    if per_inv:
        return fn_counts.set(function, per_inv)
    return fn_counts.delete(function) if function in fn_counts else fn_counts


def _tally(
    instance: PlacedInstance, sign: int, half: float, requests: Map[float, int], memories: Map[float, int],
    large_memory: int, large_request: int,
) -> tuple[Map[float, int], Map[float, int], int, int]:
    """The per-instance counts `build` keeps (requests and memories of whole instances, the large training
    slots over `half` a GPU's memory) with `instance` counted in (`sign` +1) or out (−1)."""
    if instance.cls is InstanceClass.TRAINING:
        if instance.memory_mib > half + EPS:
            large_memory += sign * instance.gpus
        if instance.request > 0.5 + EPS:
            large_request += sign * instance.gpus
    if instance.part_of is None:
        n = requests.get(instance.request, 0) + sign
        requests = requests.set(instance.request, n) if n > 0 else requests.delete(instance.request)
        n = memories.get(instance.memory_mib, 0) + sign
        memories = memories.set(instance.memory_mib, n) if n > 0 else memories.delete(instance.memory_mib)
    return requests, memories, large_memory, large_request


_FIELDS = tuple(ClusterSnapshot.__dataclass_fields__)
_FIELD_INDEX = {name: i for i, name in enumerate(_FIELDS)}
_ALL_FIELDS = attrgetter(*_FIELDS)


def _copy(snap: ClusterSnapshot, **changes: object) -> ClusterSnapshot:
    # Every field read at C speed, the changed ones replaced, the rest passed as they are.
    values = list(_ALL_FIELDS(snap))
    for name, value in changes.items():
        values[_FIELD_INDEX[name]] = value
    return ClusterSnapshot(*values)


_T = TypeVar("_T", int, RoomEntry, NodeRoom)


def _insert(ordered: tuple[_T, ...], value: _T) -> tuple[_T, ...]:
    i = bisect.bisect_left(ordered, value)
    return ordered[:i] + (value,) + ordered[i:]


def _replace_sorted(ordered: tuple[_T, ...], at: int | None, value: _T | None) -> tuple[_T, ...]:
    """`ordered` without its item at index `at` (None: none) and with `value` inserted in order
    (None: none), copied once: a list of the items, the removal and insertion moving pointers only,
    then the tuple (where removing and inserting by slices copy the items four times)."""
    items = list(ordered)
    if at is not None:
        del items[at]
    if value is not None:
        bisect.insort_left(items, value)
    return tuple(items)


def _remove(ordered: tuple[_T, ...], value: _T) -> tuple[_T, ...]:
    i = bisect.bisect_left(ordered, value)
    if i == len(ordered) or ordered[i] != value:
        raise AssertionError(f"index out of sync: {value} missing")
    return ordered[:i] + ordered[i + 1 :]
