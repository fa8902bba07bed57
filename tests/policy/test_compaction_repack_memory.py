"""What re-packing remembers between tries (issue 19, CPU): a lit-only placement it ran in vain is not run
again while no GPU that changed since (or that it avoided then and may use now) may take the instance
(`_Refuted`), and a node whose every GPU would be skipped as failed is passed over (`_WasteIndex.exhausted`);
a placement that `lit_fits` and `split_fits` rule out is not run either (`_may_place`). They only skip
work: the plans equal those of re-packing without them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from split_testlib import A0, A1, A2, B0, GIB, INF, LLM, SPLIT, gpu, inst
from test_compaction_state import _follow, _replay

from dilu_invoker.policy import (
    ClusterSnapshot,
    CompactionConfig,
    CompactionState,
    GpuRef,
    PlacedInstance,
    PlacementConfig,
    compaction_plan,
    place,
)
from dilu_invoker.policy import compaction as compaction_module
from dilu_invoker.policy.compaction import _as_request, _need, _Refuted
from dilu_invoker.sim.generate import dilu_mix

B1 = GpuRef("b", 1)


def small(id: str, request: float, mem_gib: float) -> PlacedInstance:
    return inst(id, request, request, mem_gib, INF)


# x (0.5, 10 GiB) on a/0 fits on no other lit GPU: a/1 and b/0 lack SM room, b/1 memory.
CLUSTER = ClusterSnapshot.build(
    now=0.0,
    gpus=[
        gpu(A0, small("x", 0.5, 10)),
        gpu(A1, small("f1", 0.7, 5)),
        gpu(A2, small("f2", 0.2, 35)),
        gpu(B0, small("f3", 0.8, 5)),
        gpu(B1, small("f4", 0.1, 34)),
    ],
)
# An LLM (24 GiB, 0.4) on a/0 of another cluster: no GPU takes it whole, no node has room for its pieces
# (a/1 and a/2 have 10 GiB free each, b/0 8, b/1 10).
LLM_CLUSTER = ClusterSnapshot.build(
    now=0.0,
    gpus=[
        gpu(A0, inst("llm", 0.4, 0.4, 24, LLM)),
        gpu(A1, small("p", 0.1, 30)),
        gpu(A2, small("q", 0.1, 30)),
        gpu(B0, small("r", 0.1, 32)),
        gpu(B1, small("s", 0.1, 30)),
    ],
)


@dataclass(frozen=True)
class Case:
    cluster: ClusterSnapshot
    instance: str
    change: Callable[[ClusterSnapshot], ClusterSnapshot]
    avoid: tuple[GpuRef, ...]
    """What the later query avoids (the fact avoided the instance's own GPU, a/0)."""
    known: bool
    """Whether the placement is still known to fail."""


def swap(iid: str, new: PlacedInstance) -> Callable[[ClusterSnapshot], ClusterSnapshot]:
    def change(c: ClusterSnapshot) -> ClusterSnapshot:
        ref = c.instance_gpus(iid)[0]
        return c.without_instance(iid).with_instance(new, (ref,))

    return change


def same(c: ClusterSnapshot) -> ClusterSnapshot:
    return c


CASES = {
    "nothing changed": Case(CLUSTER, "x", same, (A0,), True),
    # b/0 now holds 0.6: SM room 0.4 < 0.5, x still fits nowhere.
    "room too small": Case(CLUSTER, "x", swap("f3", small("f3b", 0.6, 5)), (A0,), True),
    # b/0 now holds 0.4: x fits there.
    "room enough": Case(CLUSTER, "x", swap("f3", small("f3c", 0.4, 5)), (A0,), False),
    # b/1 loses its last memory: it consumed room, x still fits nowhere.
    "room consumed": Case(CLUSTER, "x", swap("f4", small("f4b", 0.1, 39)), (A0,), True),
    # The query avoids a/1 and b/0 instead of a/0: a/0 (0.5 free beside x) would take another x.
    "what it avoided is usable now": Case(CLUSTER, "x", same, (A1, B0), False),
    # b/1 gains 4 GiB (14 free), still short of 24 GiB over node b (8 + 14).
    "pieces still short": Case(LLM_CLUSTER, "llm", swap("s", small("s2", 0.1, 26)), (A0,), True),
    # b/1 gains 10 GiB: node b has 8 + 20 GiB for the pieces.
    "pieces fit now": Case(LLM_CLUSTER, "llm", swap("s", small("s3", 0.1, 20)), (A0,), False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_failed_placement_is_known_only_while_it_would_fail(case: Case) -> None:
    cluster = case.cluster
    x = cluster.instance(case.instance)
    known = _Refuted()
    known.start(SPLIT)
    o = cluster.ordinals[A0]
    request = _as_request(cluster, x, A0)
    assert not place(cluster.without_instance(x.id), request, SPLIT).placed
    known.learn(cluster, x, _need(cluster, cluster.gpus[o], x, SPLIT, True), frozenset({o}))
    assert known.fails(cluster, x, frozenset({o}))
    later = case.change(cluster)
    avoid = frozenset(later.ordinals[r] for r in case.avoid)
    # The placement itself, on the later cluster avoiding those GPUs (x's copy where x is not avoided).
    query = replace(request, instance_id="copy", avoid_gpus=frozenset(case.avoid))
    placed = place(later, query, SPLIT).placed
    assert known.fails(later, x, avoid) is case.known
    assert placed is not case.known
    if case.known:
        # Restamped: the next check looks at what changes after, and still knows it.
        assert known.facts[(x.cls, x.request, x.limit, x.memory_mib)][0] is later.gpus
        assert known.fails(later, x, avoid)


def test_a_fact_under_another_placement_config_is_dropped() -> None:
    x = CLUSTER.instance("x")
    known = _Refuted()
    known.start(SPLIT)
    o = CLUSTER.ordinals[A0]
    known.learn(CLUSTER, x, _need(CLUSTER, CLUSTER.gpus[o], x, SPLIT, True), frozenset({o}))
    known.start(replace(SPLIT, omega=1.2))
    assert not known.fails(CLUSTER, x, frozenset({o}))


def _run(mix: tuple[float, float], placement: PlacementConfig, config: CompactionConfig) -> list[tuple[Any, ...]]:
    """Replay a small trace with compaction every five events: each plan's moves."""
    compaction_module._WASTE.clear()
    cluster = ClusterSnapshot.uniform(invokers=100, gpus_per_invoker=4, memory_mib=40 * GIB)
    state: CompactionState | None = None
    where: dict[str, tuple[str, ...]] = {}
    plans: list[tuple[Any, ...]] = []
    for n, ev in enumerate(dilu_mix(360, train_fraction=mix[0], llm_fraction=mix[1], seed=11)):
        cluster = _replay(cluster, where, ev, placement)
        if n % 5 != 4:
            continue
        plan = compaction_plan(cluster, placement, config, state)
        plans.append(tuple((m.instance_id, m.source, m.target, m.parts, m.reason) for m in plan.moves))
        cluster, state = plan.cluster, plan.state
        _follow(where, plan.moves)
    return plans


@pytest.mark.parametrize("mix", [(0.0, 0.4), (0.2, 0.4)], ids=["0:0.4", "0.2:0.4"])
@pytest.mark.parametrize("placement", [SPLIT, replace(SPLIT, split_node_fit=True)], ids=["fewest-pieces", "node-fit"])
def test_repacking_with_memory_plans_as_without(
    mix: tuple[float, float], placement: PlacementConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Along a trace with LLMs, every plan of re-packing with its memory (and its test of whether a
    placement may succeed before deriving the cluster for it) equals the plan of re-packing that places
    every time (the same moves, in the same order, for the same reasons), and the memory saves
    placements."""
    config = CompactionConfig(
        source_max_request=0.5, merges=2, rebalances=1, memory_merges=1, repacks=8, repack_moves=10
    )
    calls = {"place": 0, "known": 0, "passed over": 0}
    real_place, real_fails = compaction_module.place, _Refuted.fails

    def counted_place(*args: Any) -> Any:
        calls["place"] += 1
        return real_place(*args)

    def counted_fails(self: _Refuted, *args: Any) -> bool:
        found = real_fails(self, *args)
        calls["known"] += found
        return found

    monkeypatch.setattr(compaction_module, "place", counted_place)
    monkeypatch.setattr(_Refuted, "fails", counted_fails)
    remembered = _run(mix, placement, config)
    with_memory = calls["place"]
    known = calls["known"]

    # Without the memory: nothing is known to fail, every placement is run, no node is passed over.
    monkeypatch.setattr(_Refuted, "fails", lambda self, *args: False)
    monkeypatch.setattr(compaction_module, "_may_place", lambda *args: True)
    real_index = compaction_module._waste_index

    def forgetful_index(*args: Any) -> Any:
        index = real_index(*args)
        calls["passed over"] += len(index.exhausted)
        index.exhausted.clear()
        return index

    monkeypatch.setattr(compaction_module, "_waste_index", forgetful_index)
    calls["place"] = 0
    placed = _run(mix, placement, config)
    assert sum(1 for p in placed if any(m[4].startswith("re-pack") for m in p)) > 0
    assert remembered == placed
    assert known > 0 and calls["passed over"] > 0
    assert with_memory < calls["place"]
