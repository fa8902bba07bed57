"""The structures that keep placement and compaction fast at cluster scale answer exactly what a
plain scan answers: the persistent GPU vector of a snapshot, the lit-GPU walk that passes over
buckets nobody can use (when no rejection is counted), and compaction's memory of requests no lit
GPU took (`NoFit`)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from split_testlib import GIB, INF, inst

import dilu_invoker.policy.placement as placement_module
from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    CompactionState,
    GpuRef,
    GpuState,
    PlacementConfig,
    PlacementRequest,
    compaction_plan,
    place,
)
from dilu_invoker.policy.cluster import GpuVector
from dilu_invoker.policy.compaction import NoFit, _lit_fits, _still_no_fit
from dilu_invoker.policy.placement import (
    FILTERS,
    _lost_room_sizes,
    _place_split,
    _Rejects,
    _scan_lit,
    _split_plan,
    _SplitScan,
    lit_fits,
    split_fits,
)
from dilu_invoker.policy.types import InstanceClass, PlacedInstance

DILU = PlacementConfig()
INF_MIB = float("inf")


def test_gpu_vector_replace_shares_and_leaves_the_old_one() -> None:
    states = [GpuState(ref=GpuRef("n", i), memory_mib=1024.0) for i in range(200)]
    v = GpuVector(states)
    assert len(v) == 200 and list(v) == states and v == tuple(states)
    assert v[-1] is states[199] and v[64] is states[64] and v[3:5] == tuple(states[3:5])
    with pytest.raises(IndexError):
        v[200]
    new = {5: states[5].with_instances((inst("x", 0.1, 0.2, 1.0, INF),)), 130: states[1]}
    w = v.replace(new)
    assert list(v) == states, "the old vector changed"
    assert w[5] is new[5] and w[130] is states[1] and w[6] is states[6]
    assert w.changed_since(v) == [5, 130] and v.changed_since(v) == []
    assert w != v and w.replace({5: states[5], 130: states[130]}) == v


def random_cluster(rng: random.Random, nodes: int = 12) -> ClusterSnapshot:
    gpus = []
    n = 0
    for node in range(nodes):
        for k in range(4):
            placed: list[PlacedInstance] = []
            for _ in range(rng.choice((0, 1, 2, 3, 3))):
                r = rng.choice((0.05, 0.1, 0.2, 0.3, 0.4))
                placed.append(PlacedInstance(
                    id=f"i{n}", function=f"f{n % 7}", cls=INF, request=r,
                    limit=min(1.0, r * rng.choice((1.0, 2.0, 3.0))),
                    memory_mib=rng.choice((2.0, 6.0, 12.0, 20.0)) * GIB,
                ))
                n += 1
            while sum(i.memory_mib for i in placed) > 40 * GIB or sum(i.request for i in placed) > 1:
                placed.pop()
            gpus.append(GpuState(ref=GpuRef(f"n{node}", k), memory_mib=40 * GIB,
                                 instances=tuple(placed)))
    return ClusterSnapshot.build(now=0.0, gpus=gpus)


def request(rng: random.Random, avoid: GpuRef) -> PlacementRequest:
    r = rng.choice((0.05, 0.1, 0.3, 0.6, 0.9))
    return PlacementRequest(
        instance_id="q", function="f1", cls=InstanceClass.INFERENCE, request=r,
        limit=min(1.0, r * rng.choice((1.0, 1.5, 3.0))),
        memory_mib=rng.choice((1.0, 8.0, 20.0, 30.0, 39.0)) * GIB,
        avoid_gpus=frozenset({avoid}), lit_only=True,
    )


@pytest.mark.parametrize("seed", range(4))
def test_uncounted_lit_walk_finds_what_the_counting_walk_finds(seed: int) -> None:
    rng = random.Random(seed)
    cl = random_cluster(rng)
    filters = tuple(FILTERS[name] for name in DILU.strategy_spec().filters)
    found_some = found_none = 0
    for _ in range(150):
        q = request(rng, cl.refs[rng.randrange(len(cl))])
        limit = rng.choice((1, 3, 64))
        counted = _scan_lit(cl, filters, q, DILU, limit, _Rejects())
        assert lit_fits(cl, q, DILU, limit) == tuple(cl.refs[o] for o in counted)
        # And both are exactly the lit GPUs that pass every filter (up to `limit`).
        every = [o for o, g in enumerate(cl.gpus)
                 if g.lit and all(f.passes(g, q, DILU) for f in filters)]
        assert sorted(counted) == sorted(every)[: len(counted)] or len(counted) == limit
        assert set(counted) <= set(every) and len(counted) == min(limit, len(every))
        found_some += bool(counted)
        found_none += not counted
    assert found_some and found_none


@pytest.mark.parametrize("seed", range(4))
def test_no_fit_memory_answers_as_the_scan_does(seed: int) -> None:
    """Entries learnt on one cluster answer for every cluster derived from it by moves that only
    consume lit room; every answer equals a fresh scan."""
    rng = random.Random(100 + seed)
    cl = random_cluster(rng)
    memo: list[NoFit] = []
    answered = 0
    for step in range(200):
        src = cl.gpus[rng.randrange(len(cl))]
        if not src.lit:
            continue
        r = rng.choice((0.05, 0.1, 0.3, 0.6, 0.9))
        x = inst(f"probe{step}", r, min(1.0, 2 * r), rng.choice((4.0, 16.0, 30.0, 38.0)), INF)
        before = len(memo)
        got = _lit_fits(cl, x, src, DILU, 3, {}, memo)
        fresh = lit_fits(cl, PlacementRequest(
            instance_id=x.id, function=x.function, cls=x.cls, request=x.request, limit=x.limit,
            memory_mib=x.memory_mib, avoid_gpus=frozenset({src.ref}), lit_only=True), DILU, 3)
        assert got == fresh
        answered += len(memo) == before and not got
        if rng.random() < 0.3:
            # Consume room on a lit GPU (what a move does to its target).
            lit = [g for g in cl.gpus if g.lit and g.used_request <= 0.8 and g.free_memory > 2 * GIB]
            if lit:
                g = rng.choice(lit)
                cl = cl.with_instance(inst(f"fill{step}", 0.1, 0.1, 1.0, INF), (g.ref,))
    assert memo and answered, "the memory was never used"


def test_no_fit_entries_that_a_changed_gpu_may_satisfy_are_dropped() -> None:
    a0, b0 = GpuRef("a", 0), GpuRef("b", 0)

    def ask(mem_gib: float) -> PlacementRequest:
        return PlacementRequest(instance_id=f"q{mem_gib:g}", function="q", cls=INF, request=0.2,
                                limit=0.4, memory_mib=mem_gib * GIB,
                                avoid_gpus=frozenset({a0}), lit_only=True)

    entries = (NoFit(request=ask(30.0), source=0), NoFit(request=ask(10.0), source=0))
    b = GpuState(ref=b0, memory_mib=40 * GIB, instances=(inst("f", 0.2, 0.4, 20.0, INF),))
    # b/0 has 20 GiB free: it may take the 10 GiB request, not the 30 GiB one.
    assert [e.request.instance_id for e in _still_no_fit(entries, [b], DILU)] == ["q30"]
    assert _still_no_fit(entries, [], DILU) == list(entries)
    # A GPU that went dark is no lit room; one whose limits are full is none either.
    dark = GpuState(ref=b0, memory_mib=40 * GIB)
    assert _still_no_fit(entries, [dark], DILU) == list(entries)
    busy = b.with_instances(b.instances + (inst("g", 0.1, 1.0, 1.0, INF),))
    assert _still_no_fit(entries, [busy], PlacementConfig(gamma=1.5)) == list(entries)
    # Without a Σ-limit bound (the default) the same GPU may take the 10 GiB request.
    assert [e.request.instance_id for e in _still_no_fit(entries, [busy], DILU)] == ["q30"]


def test_memory_of_no_fit_keeps_compaction_equal_to_a_stateless_run() -> None:
    """Along a changing cluster, stateful plans (with `NoFit` entries carried) move what stateless
    plans move."""
    rng = random.Random(7)
    cl = random_cluster(rng, nodes=8)
    state: CompactionState | None = None
    any_source = CompactionConfig(source_max_request=1.0)
    carried = 0
    for step in range(30):
        plan = compaction_plan(cl, DILU, any_source, state)
        fresh = compaction_plan(cl, DILU, any_source)
        assert [(m.instance_id, m.target) for m in plan.moves] == [
            (m.instance_id, m.target) for m in fresh.moves
        ]
        assert plan.state is not None
        carried += bool(plan.state.no_fit)
        cl, state = plan.cluster, plan.state
        # Something departs, something arrives.
        ids = [i.id for g in cl.gpus for i in g.instances if i.gpus == 1]
        if ids:
            cl = cl.without_instance(rng.choice(ids))
        lit = [g for g in cl.gpus if g.lit and g.free_memory > 4 * GIB and g.used_request < 0.7]
        if lit:
            cl = cl.with_instance(inst(f"new{step}", 0.2, 0.3, 3.0, INF), (rng.choice(lit).ref,))
    assert carried


def test_gpu_vector_span_is_the_states_of_the_range() -> None:
    """`GpuVector.span` (an invoker's contiguous GPUs in one slice) equals indexing one by one,
    within a chunk and across chunk boundaries."""
    states = [
        GpuState(ref=GpuRef(f"n{i // 4}", i % 4), memory_mib=40 * GIB) for i in range(200)
    ]
    v = GpuVector(states)
    for start, stop in ((0, 4), (60, 64), (62, 66), (0, 200), (63, 129), (199, 200)):
        assert v.span(start, stop) == tuple(states[start:stop])
    c = ClusterSnapshot.uniform(invokers=50, gpus_per_invoker=4, memory_mib=40 * GIB)
    for ords in c.invoker_ordinals.values():
        assert ords == tuple(range(ords[0], ords[-1] + 1))  # contiguous, as span's callers assume


def _split_reference(
    cl: ClusterSnapshot, q: PlacementRequest, config: PlacementConfig
) -> tuple[tuple[int, float, int], list[tuple[int, float]]] | None:
    """The best split plan by a plain walk: every invoker, its candidates read from its GPU states,
    no bound, no pruning; the least (pieces, unused room, first ordinal)."""
    filters = tuple(FILTERS[name] for name in config.strategy_spec().filters)
    scan = _SplitScan(cl, q, config, filters, config.llm_max_parts)
    total = q.memory_mib
    min_part = min(config.min_part_mib, total)
    best = None
    for inv in cl.invokers:
        first = cl.invoker_ordinals[inv][0]
        if not any(cl.gpus[o].lit for o in cl.invoker_ordinals[inv]):
            continue
        if sum(cl.gpus[o].free_memory for o in cl.invoker_ordinals[inv] if cl.gpus[o].lit) < total - 1e-3:
            continue
        cands = scan.candidates(first, None)
        if len(cands) < 2:
            continue
        found = _split_plan(cands, q, config, filters, total, min_part, config.llm_max_parts, cl.gpus)
        if found is not None:
            key = (len(found[0]), found[1], first)
            if best is None or key < best[0]:
                best = (key, found[0])
    return best


@pytest.mark.parametrize("seed", range(6))
def test_split_placement_passes_over_only_invokers_that_cannot_win(seed: int) -> None:
    """Split placement's bounds (the node-room entries' roomiest GPU, the two-piece test, the
    tightest invokers first) choose what a plain walk of every invoker chooses, and `split_fits`
    says yes exactly when there is a plan."""
    rng = random.Random(seed)
    cl = random_cluster(rng, nodes=16)
    config = PlacementConfig(llm_max_parts=rng.choice((2, 3, 4)))
    filters = tuple(FILTERS[name] for name in config.strategy_spec().filters)
    split = plans = 0
    for k in range(200):
        r = rng.choice((0.1, 0.3, 0.45, 0.6))
        q = PlacementRequest(
            instance_id=f"q{k}", function="llm", cls=InstanceClass.LLM, request=r,
            limit=min(1.0, r + rng.choice((0.0, 0.2, 0.4))),
            memory_mib=rng.choice((6.0, 12.0, 20.0, 26.0, 30.0, 45.0)) * GIB,
        )
        want = _split_reference(cl, q, config)
        got = _place_split(cl, q, config, config.strategy_spec(), filters, config.llm_max_parts)
        if want is None:
            assert got is None
        else:
            assert got is not None
            # The pieces as the walk's plan has them, resized as split placement resizes them.
            sized = _lost_room_sizes(cl, q, config, filters, _SplitScan(cl, q, config, filters, config.llm_max_parts),
                                     want[1])
            assert [(cl.ordinals[p.gpu], p.instance.memory_mib) for p in got.parts] == sized
            plans += 1
        assert split_fits(cl, q, config) == (want is not None)
        # The bound never passes over an invoker that has a plan of that many pieces or fewer.
        scan = _SplitScan(cl, q, config, filters, config.llm_max_parts)
        for e in cl.node_room:
            cands = scan.candidates(e[1], e)
            assert cands == scan.candidates(e[1], None)
            for pieces in range(2, config.llm_max_parts + 1):
                if scan.cannot_hold(e, pieces) and len(cands) >= 2:
                    found = _split_plan(
                        cands, q, config, filters, q.memory_mib,
                        min(config.min_part_mib, q.memory_mib), config.llm_max_parts, cl.gpus,
                    )
                    assert found is None or len(found[0]) > pieces
                    split += 1
    assert plans and split


@pytest.mark.parametrize("seed", range(4))
def test_gang_scores_unlit_invokers_once_per_size_and_count(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gang's unlit invokers scored once per (GPU size, the function's count there) place it as
    scoring every invoker does: the same GPUs, candidates, scores and rejections."""
    rng = random.Random(seed)
    gpus = []
    n = 0
    for node in range(24):
        size = rng.choice((40.0, 40.0, 80.0)) * GIB
        for k in range(4):
            placed: list[PlacedInstance] = []
            if rng.random() < 0.4:
                placed.append(PlacedInstance(
                    id=f"i{n}", function=rng.choice(("train", "f1", "f2")), cls=INF,
                    request=0.3, limit=0.5, memory_mib=8 * GIB,
                ))
                n += 1
            gpus.append(GpuState(ref=GpuRef(f"n{node}", k), memory_mib=size, instances=tuple(placed),
                                 schedulable=rng.random() > 0.1))
    cl = ClusterSnapshot.build(now=0.0, gpus=gpus)
    decisions = []
    for k in range(40):
        q = PlacementRequest(
            instance_id=f"g{k}", function="train", cls=InstanceClass.TRAINING,
            request=rng.choice((0.3, 0.6, 1.0)), limit=1.0,
            memory_mib=rng.choice((8.0, 30.0, 60.0)) * GIB, gpus=rng.choice((2, 3, 4)),
        )
        decisions.append((q, place(cl, q, DILU)))
    monkeypatch.setattr(placement_module, "_unlit_scores_alike", lambda scorers: False)
    n_placed = 0
    for q, fast in decisions:
        slow = place(cl, q, DILU)
        assert fast == slow
        n_placed += fast.placed
    assert n_placed


@pytest.mark.parametrize("seed", range(4))
def test_two_piece_window_passes_over_only_invokers_that_cannot_win(seed: int) -> None:
    """The node-room entries' pair sums and greatest Σ request / Σ limit are those of the invoker's
    lit GPUs, and an invoker that the two-piece window passes over has no plan of two pieces leaving
    no more room unused than the best two-piece plan of a plain walk (so split placement, which
    passes over such invokers, chooses what the plain walk chooses, as the test above checks)."""
    rng = random.Random(50 + seed)
    cl = random_cluster(rng, nodes=16)
    for e in cl.node_room:
        lit = [g for g in cl.gpus.span(e[1], e[1] + 4) if g.lit]
        rooms = [g.memory_mib * (1 + 1e-9) - g.used_memory for g in lit]
        assert e[6] == max(g.used_request for g in lit) and e[7] == max(g.used_limit for g in lit)
        assert list(e[8]) == sorted(a + b for i, a in enumerate(rooms) for b in rooms[i + 1:])
        assert e[9] == max(x / (1.0 - g.used_request) if g.used_request < 1.0 else INF_MIB
                           for x, g in zip(rooms, lit, strict=True))
        assert e[10] == max(x / (1.5 - g.used_limit) if g.used_limit < 1.5 else INF_MIB
                            for x, g in zip(rooms, lit, strict=True))
    config = PlacementConfig(llm_max_parts=rng.choice((2, 3, 4)))
    filters = tuple(FILTERS[name] for name in config.strategy_spec().filters)
    passed_over = looked_at = 0
    for k in range(200):
        r = rng.choice((0.05, 0.1, 0.3, 0.45, 0.6))
        q = PlacementRequest(
            instance_id=f"q{k}", function="llm", cls=InstanceClass.LLM, request=r,
            limit=min(1.0, r + rng.choice((0.0, 0.2, 0.4))),
            memory_mib=rng.choice((6.0, 12.0, 20.0, 26.0, 30.0, 45.0)) * GIB,
        )
        want = _split_reference(cl, q, config)
        if want is None or want[0][0] != 2:
            continue
        scan = _SplitScan(cl, q, config, filters, config.llm_max_parts)
        # The best plan's window, and tighter ones (as a walk meets them before the best).
        for unused in (want[0][1], want[0][1] * 0.5, 0.0):
            window = q.memory_mib + unused + placement_module._PAIR_SLACK_MIB
            for e in cl.node_room:
                if not scan.outside_window(e, window):
                    looked_at += 1
                    continue
                passed_over += 1
                cands = scan.candidates(e[1], None)
                found = None if len(cands) < 2 else _split_plan(
                    cands, q, config, filters, q.memory_mib, min(config.min_part_mib, q.memory_mib),
                    config.llm_max_parts, cl.gpus,
                )
                assert found is None or len(found[0]) > 2 or found[1] > unused
    assert passed_over and looked_at


@pytest.mark.parametrize("names", [
    ("schedulable", "avoid", "sm-request", "sm-limit", "memory"),
    ("schedulable", "avoid", "sm-limit-static", "memory"),
    ("avoid", "sm-request"),
])
def test_inline_split_gives_the_filters_verdicts_and_the_plan(names: tuple[str, ...]) -> None:
    """Split placement's inline pass over a node-room entry says what `_piece_passes` says on the
    GPU states (pieces at, just under and just over each GPU's capacity and memory room, where
    rounding decides; draining GPUs; requests avoiding GPUs or invokers or keeping to one), and plans
    what `_split_plan` plans from `candidates`; another filter is left to `_piece_passes`."""
    rng = random.Random(len(names))
    cl = random_cluster(rng, nodes=16)
    cl = ClusterSnapshot.build(now=0.0, gpus=[
        GpuState(ref=g.ref, memory_mib=g.memory_mib, instances=g.instances, schedulable=rng.random() > 0.2)
        for g in cl.gpus
    ])
    filters = tuple(FILTERS[n] for n in names)
    verdicts = {True: 0, False: 0}
    plans = 0
    for k in range(60):
        config = PlacementConfig(llm_max_parts=rng.choice((2, 3, 4)))
        r = rng.choice((0.05, 0.1, 0.3, 0.45, 0.6))
        q = PlacementRequest(
            instance_id=f"q{k}", function="llm", cls=InstanceClass.LLM, request=r,
            limit=min(1.0, r + rng.choice((0.0, 0.2, 0.4))),
            memory_mib=rng.choice((6.0, 12.0, 20.0, 26.0, 30.0)) * GIB,
        )
        shape = rng.choice(("plain", "gpus", "invokers", "only"))
        if shape == "gpus":
            q = replace(q, avoid_gpus=frozenset(rng.sample(cl.refs, 12)))
        elif shape == "invokers":
            q = replace(q, avoid_invokers=frozenset(rng.sample(cl.invokers, 4)))
        elif shape == "only":
            q = replace(q, only_invoker=rng.choice(cl.invokers))
        scan = _SplitScan(cl, q, config, filters, config.llm_max_parts)
        inline = placement_module._InlineSplit.of(scan, q, config, filters, config.llm_max_parts)
        assert inline is not None
        caps = dict((o, c) for e in cl.node_room for c, o in scan.candidates(e[1], e))
        for e in cl.node_room:
            if q.only_invoker is not None and cl.refs[e[1]].invoker != q.only_invoker:
                continue  # the walk looks at that invoker only
            for lr in e[5]:
                g = cl.gpus[lr[4]]
                for take in {caps.get(lr[4], lr[0]), lr[0], lr[1], lr[0] * (1 - 1e-15), lr[0] * (1 + 1e-15),
                             q.memory_mib / 2, 2048.0}:
                    want = placement_module._piece_passes(g, q, take, config, filters)
                    assert inline.passes(lr, take) == want
                    verdicts[want] += 1
            cands = scan.candidates(e[1], e)
            planned = None if len(cands) < 2 else _split_plan(
                cands, q, config, filters, q.memory_mib, min(config.min_part_mib, q.memory_mib),
                config.llm_max_parts, cl.gpus,
            )
            assert inline.plan(e[5]) == planned
            plans += planned is not None
    assert verdicts[True] and verdicts[False] and plans
    other = filters + (FILTERS["priority-pair"],)
    scan = _SplitScan(cl, q, config, other, 2)
    assert placement_module._InlineSplit.of(scan, q, config, other, 2) is None


def test_split_scan_bounds_equal_the_filters_bounds_on_the_smallest_piece() -> None:
    """The split scan's Σ-request cut-off (`too_full`), from the size filters' bounds computed
    inline, equals the one from every filter's bound on the smallest piece built as a request."""
    import math

    from dilu_invoker.policy.cluster import BUCKETS
    from dilu_invoker.policy.placement import _part_request

    rng = random.Random(7)
    cl = random_cluster(rng, nodes=4)
    for k in range(300):
        names = rng.choice([
            ("schedulable", "avoid", "sm-request", "sm-limit", "memory"),
            ("schedulable", "avoid", "sm-limit-static", "memory"),
            ("avoid", "sm-request", "sm-limit-static", "exclusive"),
            ("memory",),
        ])
        filters = tuple(FILTERS[n] for n in names)
        config = PlacementConfig(omega=rng.choice((1.0, 0.8)), gamma=rng.choice((1.5, 1.0, 2.0)),
                                 min_part_mib=rng.choice((2048.0, 4096.0, 512.0)))
        r = rng.choice((0.05, 0.1, 0.3, 0.45, 0.6, 0.9))
        q = PlacementRequest(
            instance_id=f"q{k}", function="llm", cls=InstanceClass.LLM, request=r,
            limit=min(1.0, r + rng.choice((0.0, 0.2, 0.4))),
            memory_mib=rng.choice((1.0, 6.0, 20.0, 30.0)) * GIB,
        )
        min_part = min(config.min_part_mib, q.memory_mib)
        piece = _part_request(q, min_part, 0)
        bound = min((f.bound(piece, config) for f in filters if f.bound is not None), default=math.inf)
        kmax = BUCKETS if bound == math.inf else (-1 if bound < -1e-9 else min(BUCKETS, math.floor((bound + 1e-9) * BUCKETS)))
        want = (kmax + 1 - 1e-9) / BUCKETS if kmax < BUCKETS else math.inf
        assert _SplitScan(cl, q, config, filters, 4).too_full == want
