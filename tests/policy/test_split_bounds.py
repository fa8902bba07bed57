"""Split placement's vectorised bounds (`_split_bounds`, the rows of `_LitTable`) and the best-first
walk over them (`_best_first`) answer exactly as the plain walk of every invoker: no invoker left out
has a plan, every plan's key is at least its bound, the bound is the plan's own key where it says so,
and along snapshots derived by placing and removing instances split placement and `split_fits`
decide as with the bounds switched off (the table keeps rows of entries shared by those snapshots)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from split_testlib import GIB, INF

import dilu_invoker.policy.placement as placement_module
from dilu_invoker.policy import ClusterSnapshot, GpuRef, GpuState, PlacementConfig, PlacementRequest, apply_placement, place
from dilu_invoker.policy.placement import FILTERS, _InlineSplit, _place_split, _split_bounds, _SplitScan, split_fits
from dilu_invoker.policy.types import InstanceClass, PlacedInstance

pytest.importorskip("numpy")


def cluster(rng: random.Random, nodes: int = 40) -> ClusterSnapshot:
    """GPUs 30–90 % full in memory, some held back by their Σ request or Σ limit, a few draining:
    capacities then come from all three terms, and many invokers tie."""
    gpus = []
    n = 0
    for node in range(nodes):
        for k in range(4):
            placed: list[PlacedInstance] = []
            for _ in range(rng.choice((0, 1, 1, 2, 3))):
                # Round sizes, and odd ones whose sums round (a piece at its GPU's capacity may then
                # fail its filters).
                odd = rng.random() < 0.4
                r = rng.uniform(0.05, 0.6) if odd else rng.choice((0.1, 0.2, 0.3, 0.5, 0.7))
                placed.append(PlacedInstance(
                    id=f"i{n}", function=f"f{n % 5}", cls=INF, request=r,
                    limit=min(1.0, r * rng.choice((1.0, 1.5, 2.0))),
                    memory_mib=(rng.uniform(1.0, 15.0) if odd else rng.choice((2.0, 5.0, 10.0, 15.0))) * GIB,
                ))
                n += 1
            while sum(i.memory_mib for i in placed) > 40 * GIB or sum(i.request for i in placed) > 1:
                placed.pop()
            gpus.append(GpuState(ref=GpuRef(f"n{node:02d}", k), memory_mib=40 * GIB, instances=tuple(placed),
                                 schedulable=rng.random() > 0.1))
    return ClusterSnapshot.build(now=0.0, gpus=gpus)


def llm(rng: random.Random, cl: ClusterSnapshot, k: int) -> PlacementRequest:
    r = rng.choice((0.05, 0.1, 0.2, 0.3, 0.45))
    q = PlacementRequest(
        instance_id=f"q{k}", function="llm", cls=InstanceClass.LLM, request=r,
        limit=min(1.0, r + rng.choice((0.0, 0.1, 0.3))),
        memory_mib=rng.choice((6.0, 10.0, 15.0, 20.0, 25.0, 30.0, 45.0)) * GIB,
    )
    shape = rng.choice(("plain", "plain", "gpus", "invokers"))
    if shape == "gpus":
        q = replace(q, avoid_gpus=frozenset(rng.sample(cl.refs, 20)))
    elif shape == "invokers":
        q = replace(q, avoid_invokers=frozenset(rng.sample(cl.invokers, 5)))
    return q


def test_bounds_leave_out_only_invokers_without_a_plan_and_never_exceed_a_plan() -> None:
    """On three clusters, 80 requests each (two to four pieces allowed): every kind of bound occurs
    (exact, two pieces loose, three or more, left out)."""
    rng = random.Random(0)
    seen = {"exact": 0, "loose": 0, "left out": 0, "three or more": 0}
    for k in range(240):
        if k % 80 == 0:
            cl = cluster(rng)
        config = PlacementConfig(llm_max_parts=rng.choice((2, 3, 4)))
        filters = tuple(FILTERS[name] for name in config.strategy_spec().filters)
        q = llm(rng, cl, k)
        scan = _SplitScan(cl, q, config, filters, config.llm_max_parts)
        inline = _InlineSplit.of(scan, q, config, filters, config.llm_max_parts)
        assert inline is not None and scan.entries is not None
        entries = scan.entries
        placement_module._VECTOR_MIN_ENTRIES, keep = 0, placement_module._VECTOR_MIN_ENTRIES
        try:
            bounds = _split_bounds(scan, inline, entries, config.llm_max_parts)
        finally:
            placement_module._VECTOR_MIN_ENTRIES = keep
        assert bounds is not None
        sel, pieces, unused, first, exact = (b.tolist() for b in bounds)
        at = {k: i for i, k in enumerate(sel)}
        for k, e in enumerate(entries):
            plan = inline.plan(e[5])
            if k not in at:
                assert plan is None, "an invoker with a plan was left out"
                seen["left out"] += 1
                continue
            i = at[k]
            assert first[i] == e[1]
            if exact[i]:
                assert plan is not None and (len(plan[0]), plan[1]) == (2, unused[i]), \
                    "an exact bound that is not the plan's key"
            if plan is None:
                continue
            key = (len(plan[0]), plan[1], e[1])
            assert key >= (pieces[i], unused[i], first[i])
            if exact[i]:
                seen["exact"] += 1
            else:
                seen["loose" if pieces[i] == 2 else "three or more"] += 1
    assert all(seen.values()), seen


@pytest.mark.parametrize("seed", range(3))
def test_best_first_decides_as_the_walk_along_derived_snapshots(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Along 150 snapshots derived by placing LLMs (split or whole) and removing instances, split
    placement and `split_fits` with the bounds equal the walk without them, including requests
    that avoid GPUs or invokers and GPUs that drain."""
    rng = random.Random(20 + seed)
    cl = cluster(rng)
    config = PlacementConfig(llm_max_parts=rng.choice((3, 4)))
    filters = tuple(FILTERS[name] for name in config.strategy_spec().filters)
    monkeypatch.setattr(placement_module, "_VECTOR_MIN_ENTRIES", 0)
    splits = fits = 0
    placed: list[str] = []
    for k in range(150):
        q = llm(rng, cl, k)
        fast = _place_split(cl, q, config, config.strategy_spec(), filters, config.llm_max_parts)
        fast_fits = split_fits(cl, q, config)
        monkeypatch.setattr(placement_module, "_VECTOR_BOUNDS", False)
        slow = _place_split(cl, q, config, config.strategy_spec(), filters, config.llm_max_parts)
        slow_fits = split_fits(cl, q, config)
        monkeypatch.setattr(placement_module, "_VECTOR_BOUNDS", True)
        assert fast == slow
        assert fast_fits == slow_fits == (slow is not None)
        splits += slow is not None
        fits += not slow_fits
        # Derive the next snapshot: this request placed as `place` places it, or an instance removed,
        # or a GPU drained or opened.
        step = rng.random()
        if step < 0.55:
            d = place(cl, replace(q, avoid_gpus=frozenset(), avoid_invokers=frozenset()), config)
            if d.placed:
                cl = apply_placement(cl, q, d)
                placed.extend([p.instance.id for p in d.parts] if d.parts else [q.instance_id])
        elif step < 0.9 and placed:
            cl = cl.without_instance(placed.pop(rng.randrange(len(placed))))
        else:
            g = cl.gpus[rng.randrange(len(cl.gpus))]
            cl = cl.with_schedulable(g.ref, not g.schedulable)
    assert splits and fits


def test_a_first_piece_that_fails_its_filters_by_rounding_is_not_a_known_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Σ request 0.464 and a request of 0.6 for 20 GiB: the roomiest GPU's capacity (its request room
    × MiB per request) is 18,295.47 MiB, and a piece of exactly that fails `sm-request` by rounding,
    so the plan skips that GPU and takes three pieces elsewhere; the bound must not claim the two
    pieces its capacities suggest (nor must split placement choose otherwise than the walk)."""
    def gpu(node: int, k: int, request: float, mem_gib: float) -> GpuState:
        i = PlacedInstance(id=f"i{node}-{k}", function="f", cls=INF, request=request, limit=request,
                           memory_mib=mem_gib * GIB)
        return GpuState(ref=GpuRef(f"n{node:02d}", k), memory_mib=40 * GIB, instances=(i,))
    gpus = [gpu(0, 0, 0.464, 2.0), gpu(0, 1, 0.1, 30.0), gpu(0, 2, 0.1, 34.0), gpu(0, 3, 0.1, 36.0)]
    # Other invokers whose best plan (two pieces on 18 and 16 GiB of room) leaves more unused than
    # the two pieces the rounding GPU would suggest.
    gpus += [gpu(n, k, 0.1, 22.0 if k < 2 else 24.0) for n in range(1, 6) for k in range(4)]
    cl = ClusterSnapshot.build(now=0.0, gpus=gpus)
    config = PlacementConfig(llm_max_parts=4)
    filters = tuple(FILTERS[name] for name in config.strategy_spec().filters)
    q = PlacementRequest(instance_id="q", function="llm", cls=InstanceClass.LLM, request=0.6, limit=0.6,
                         memory_mib=20 * GIB)
    scan = _SplitScan(cl, q, config, filters, 4)
    inline = _InlineSplit.of(scan, q, config, filters, 4)
    assert inline is not None and scan.entries is not None
    entry = next(e for e in scan.entries if e[1] == 0)
    cap0 = (scan.omega - 0.464) * scan.per_request
    assert cap0 < entry[5][0][0] and not inline.passes(entry[5][0], cap0), "no rounding here"
    plan = inline.plan(entry[5])
    assert plan is not None and len(plan[0]) == 3 and 0 not in [o for o, _ in plan[0]]
    monkeypatch.setattr(placement_module, "_VECTOR_MIN_ENTRIES", 0)
    bounds = _split_bounds(scan, inline, scan.entries, 4)
    assert bounds is not None
    first, exact = bounds[3].tolist(), bounds[4].tolist()
    i = first.index(0)
    assert not exact[i]
    fast = _place_split(cl, q, config, config.strategy_spec(), filters, 4)
    monkeypatch.setattr(placement_module, "_VECTOR_BOUNDS", False)
    assert fast == _place_split(cl, q, config, config.strategy_spec(), filters, 4)
    assert fast is not None and len(fast.parts) == 2
