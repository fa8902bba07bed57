"""Compaction's re-packing of a GPU (`CompactionConfig.repacks`, issue 19): on the nodes whose lit GPUs
waste the most, every instance of a lit GPU is placed anew on other lit GPUs, a split instance with a
stage there cut anew over any lit GPUs but that one (its other stages' GPUs included), and an instance
no lit GPU takes may displace one instance of another lit GPU of its node. A re-pack is kept only when
the GPU ends dark within `repack_moves` cold starts; no GPU is lit by it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from split_testlib import A0, A1, A2, GIB, INF, LLM, SPLIT, gpu, inst

from dilu_invoker.policy import (
    EPS,
    ClusterSnapshot,
    CompactionConfig,
    CompactionState,
    GpuRef,
    PlacedInstance,
    compaction_plan,
)
from dilu_invoker.sim.generate import dilu_mix

A3 = GpuRef("a", 3)
# Nothing to empty (every GPU is fuller than a source may be): only the re-pack acts.
REPACK = CompactionConfig(source_max_request=0.05, repacks=1)


def i(id: str, request: float, mem_gib: float = 5.0) -> PlacedInstance:
    return inst(id, request, request, mem_gib, INF)


def stage(id: str, request: float, mem_gib: float) -> PlacedInstance:
    return replace(inst(id, request, request, mem_gib, LLM), part_of="L")


# Σ request 1.65 (it binds) on three lit GPUs: u (0.45) fits on no other lit GPU (0.4 of room on each),
# but in the place of v on a/1, and v then fits on a/0: a/2 turns off for two cold starts.
SWAP = (gpu(A0, i("x", 0.6)), gpu(A1, i("y", 0.5), i("v", 0.1)), gpu(A2, i("u", 0.45)))
SWAPPED = {"u": (A1,), "v": (A0,)}
# L's stages: s0 (0.2, 20 GiB) beside x on a/0, s1 (0.2, 20 GiB) alone on a/2. s1 fits on no other GPU
# of the node (a/1 has 15 GiB free) and L whole fits on no GPU away from its stages; cut anew over a/0
# (30 GiB free once s0 leaves) and a/1, a/2 turns off for a cold start per new stage.
CUT = (
    gpu(A0, stage("s0", 0.2, 20), i("x", 0.1, 10)),
    gpu(A1, i("y", 0.2, 25)),
    gpu(A2, stage("s1", 0.2, 20)),
)

CASES = [
    ("displace-one", SWAP, REPACK, SWAPPED, SPLIT),
    ("off-by-default", SWAP, replace(REPACK, repacks=0), {}, SPLIT),
    # v is pinned: u may take no other instance's place (y leaving a/1 would find no room).
    ("pinned-stays", SWAP, REPACK, {}, SPLIT, frozenset({"v"})),
    # Two cold starts needed, one allowed.
    ("budget-exhausted", SWAP, replace(REPACK, repack_moves=1), {}, SPLIT),
    # Σ request binds: lit 3 is not above the bound 2 by more than 60 % of it.
    ("gated", SWAP, replace(REPACK, merge_above=0.6), {}, SPLIT),
    ("gated-open", SWAP, replace(REPACK, merge_above=0.4), SWAPPED, SPLIT),
    # Its own gate, beside the merges' (none here): the same bound, 2, and lit 3.
    ("repack-gated", SWAP, replace(REPACK, repack_above=0.6), {}, SPLIT),
    ("repack-gated-open", SWAP, replace(REPACK, repack_above=0.4), SWAPPED, SPLIT),
    # Both gates must open: the merges' shuts it whatever the re-pack's own.
    ("repack-gated-by-merges", SWAP, replace(REPACK, repack_above=0.4, merge_above=0.6), {}, SPLIT),
    # y asks 0.56: u beside y exceeds ω, beside x too, and x in u's place leaves x no room: a/2 stays.
    (
        "would-break-sm-request",
        (gpu(A0, i("x", 0.6)), gpu(A1, i("y", 0.56), i("v", 0.1)), gpu(A2, i("u", 0.45))),
        REPACK,
        {},
        SPLIT,
    ),
    # The same by memory: Σ memory 77 GiB is within two GPUs, but beside each 30 GiB instance only 10
    # GiB are free, and y asks 12.
    (
        "would-break-memory",
        (gpu(A0, i("x", 0.2, 30)), gpu(A1, i("y", 0.2, 12), i("v", 0.1, 5)), gpu(A2, i("u", 0.2, 30))),
        REPACK,
        {},
        SPLIT,
    ),
    # Σ request 1.9 is within two GPUs, but no two take the three instances; the dark a/3 would take
    # z, which lights no fewer GPUs: nothing moves.
    (
        "would-not-light-fewer",
        (gpu(A0, i("x", 0.7)), gpu(A1, i("y", 0.7)), gpu(A2, i("z", 0.5)), gpu(A3)),
        REPACK,
        {},
        SPLIT,
    ),
    ("cut-anew", CUT, REPACK, {"L": (A0, A1)}, SPLIT),
    # Without splitting, L cannot be cut anew (and pieces are not moved by placement whole either).
    ("cut-anew-needs-splitting", CUT, REPACK, {}, replace(SPLIT, llm_max_parts=1)),
    # A stage of L is pinned: a/2 is not tried.
    ("cut-anew-pinned", CUT, REPACK, {}, SPLIT, frozenset({"s0"})),
    # Make-before-break (`repack_live`): u would need v's room before v's replacement frees it, and L placed
    # anew on a/0 would share its memory with s0 until the new pipeline serves: neither re-pack is made.
    ("live-displaces-none", SWAP, replace(REPACK, repack_live=True), {}, SPLIT),
    ("live-cuts-away-from-its-stages", CUT, replace(REPACK, repack_live=True), {}, SPLIT),
    # Where the room is there already, the live re-pack moves as the other does: u to a/0.
    (
        "live-room-elsewhere",
        (gpu(A0, i("x", 0.5)), gpu(A1, i("y", 0.5)), gpu(A2, i("u", 0.45))),
        replace(REPACK, repack_live=True),
        {"u": (A0,)},
        SPLIT,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_repack(case: tuple) -> None:
    _, gpus, config, where, placement, *rest = case
    pinned = rest[0] if rest else frozenset()
    cluster = ClusterSnapshot.build(now=0.0, gpus=gpus)
    plan = compaction_plan(cluster, placement, config, pinned=pinned)
    after = plan.cluster
    if not where:
        assert plan.moves == () and after.lit_count == cluster.lit_count, plan.reason
        return
    assert plan.freed == (A2,) and after.lit_count == cluster.lit_count - 1, plan.reason
    assert not after.gpu(A2).lit
    for instance, refs in where.items():
        if instance == "L":
            pieces = [p for g in after.gpus for p in g.instances if p.part_of == "L"]
            assert tuple(sorted(after.instance_gpus(p.id)[0] for p in pieces)) == refs
            assert sum(p.memory_mib for p in pieces) == pytest.approx(40 * GIB)
            assert sum(p.request for p in pieces) == pytest.approx(0.4)
            assert all(p.memory_mib >= placement.min_part_mib for p in pieces)
            assert plan.cold_starts == len(pieces)
        else:
            assert after.instance_gpus(instance) == refs
    if "L" not in where:
        assert plan.cold_starts == len(where)
    for g in after.gpus:
        # Within the filters' own slack (EPS), as placement admits.
        assert g.used_request <= placement.omega + 2 * EPS and g.used_memory <= g.memory_mib * (1 + 2 * EPS)
    assert all(m.reason.startswith("re-pack") for m in plan.moves) and plan.merged == 0


def test_live_compaction_refuses_repacking_it_cannot_carry_out() -> None:
    """Live compaction takes a re-pack only make-before-break (`repack_live`, set in `LIVE_COMPACTION`)."""
    from dilu_invoker.policy.live_compaction import LIVE_COMPACTION, LiveCompaction

    assert LIVE_COMPACTION.repacks == 0 and LIVE_COMPACTION.repack_live
    with pytest.raises(ValueError, match="repacks needs repack_live"):
        LiveCompaction(config=replace(LIVE_COMPACTION, repacks=1, repack_live=False))
    assert LiveCompaction(config=replace(LIVE_COMPACTION, repacks=1)).config.repacks == 1


def test_config_bounds_and_default() -> None:
    with pytest.raises(ValueError, match="repacks"):
        CompactionConfig(repacks=-1)
    with pytest.raises(ValueError, match="repack_moves"):
        CompactionConfig(repack_moves=0)
    for bad in (-0.01, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="repack_above"):
            CompactionConfig(repack_above=bad)
    assert CompactionConfig().repacks == 0 and CompactionConfig().repack_above is None


def test_repacking_along_a_trace_holds_each_instance() -> None:
    """Replay a trace with training and LLMs: at every compaction point the re-packs turn GPUs off and
    light none, keep every instance's Σ request and Σ memory (a split instance's over its pieces, at
    least `min_part_mib` each, on distinct GPUs of one node), and keep every GPU within ω and its memory."""
    from test_compaction_state import _follow, _replay

    config = CompactionConfig(source_max_request=1.0, max_sources=8, move_pieces=True, repacks=4)
    cluster = ClusterSnapshot.uniform(invokers=120, gpus_per_invoker=4, memory_mib=40 * GIB)
    state: CompactionState | None = None
    where: dict[str, tuple[str, ...]] = {}
    repacked = 0
    for n, ev in enumerate(dilu_mix(300, train_fraction=0.2, llm_fraction=0.4, seed=7)):
        cluster = _replay(cluster, where, ev)
        if n % 5 != 4:
            continue
        plan = compaction_plan(cluster, SPLIT, config, state)
        ours = [m for m in plan.moves if m.reason.startswith("re-pack")]
        if ours:
            before = plan.state.seen if plan.state is not None else None
            assert before is not None
            assert plan.cluster.lit_count < before.lit_count
            lit_before = {g.ref for g in before.gpus if g.lit}
            assert {g.ref for g in plan.cluster.gpus if g.lit} <= lit_before
            for whole in {m.instance_id for m in ours}:
                now = _holding(plan.cluster, whole)
                then = _holding(before, whole)
                assert sum(p.request for _, p in now) == pytest.approx(sum(p.request for _, p in then))
                assert sum(p.memory_mib for _, p in now) == pytest.approx(sum(p.memory_mib for _, p in then))
                if len(now) > 1:
                    assert len({r for r, _ in now}) == len(now) and len({r.invoker for r, _ in now}) == 1
                    assert all(p.memory_mib >= SPLIT.min_part_mib - 1e-6 for _, p in now)
            repacked += len(ours)
        for g in plan.cluster.gpus:
            assert g.used_request <= SPLIT.omega + 2 * EPS and g.used_memory <= g.memory_mib * (1 + 2 * EPS)
        cluster, state = plan.cluster, plan.state
        _follow(where, plan.moves)
    assert repacked > 0


def _holding(cluster: ClusterSnapshot, whole: str) -> list[tuple[GpuRef, PlacedInstance]]:
    """Where instance `whole` is: itself on its GPU, or each of its pieces on theirs."""
    return [
        (g.ref, p) for g in cluster.gpus for p in g.instances if p.id == whole or p.part_of == whole
    ]
