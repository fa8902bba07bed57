"""Split placement sizes its pieces so that they leave as little lost SM room as they can while Σ request
binds (`_lost_room_sizes`): room is lost while no live instance fits it (SM room below the least request,
or free memory below the least memory). The GPUs and the number of pieces are those the plan chose; only
their sizes change, and only where that loses less room."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from split_testlib import A0, A1, B0, C0, D0, GIB, INF, LLM, SPLIT, gpu, inst

from dilu_invoker.policy import ClusterSnapshot, GpuRef, GpuState, PlacementRequest, place
from dilu_invoker.policy.types import EPS

# a/0: SM room 0.90 beside 16 GiB; a/1: SM room 0.20 beside 30 GiB; b/0 is nearly full. The LLM (0.5 SM,
# 20 GiB: 0.025 SM per GiB) fits no GPU whole, so it is split over a/0 and a/1. Filling a/0 first (16 GiB)
# would leave 0.50 of SM room there beside no free memory, which no instance (the least asks 2 GiB) fits.
BASE = (gpu(A0, inst("x0", 0.10, 0.10, 24, INF)), gpu(A1, inst("x1", 0.80, 0.80, 10, INF)),
        gpu(B0, inst("y", 0.95, 0.95, 2, INF)))
# Two memory-heavy GPUs more: Σ memory (3.35 GPUs) then exceeds Σ request (2.45).
HEAVY = (*BASE, gpu(C0, inst("h1", 0.05, 0.05, 39, INF)), gpu(D0, inst("h2", 0.05, 0.05, 39, INF)))


@dataclass(frozen=True)
class Case:
    id: str
    gpus: tuple[GpuState, ...]
    pieces: tuple[tuple[GpuRef, float], ...]
    """(GPU, GiB) of each piece, in the plan's order."""


CASES = [
    # a/1's SM room taken whole (8 GiB), a/0 the rest (12 GiB): 0.60 of SM room beside 4 GiB stays usable.
    Case("request-binds", BASE, ((A0, 12.0), (A1, 8.0))),
    # Memory binds: the plan as it was, a/0's memory filled first.
    Case("memory-binds", HEAVY, ((A0, 16.0), (A1, 4.0))),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_split_pieces_sized_to_leave_no_lost_room(case: Case) -> None:
    cluster = ClusterSnapshot.build(now=0.0, gpus=case.gpus)
    request = PlacementRequest(instance_id="L", function="L", cls=LLM, request=0.5, limit=0.7, memory_mib=20 * GIB)
    decision = place(cluster, request, SPLIT)
    assert decision.split, decision.reason
    got = tuple((p.gpu, p.instance.memory_mib / GIB) for p in decision.parts)
    assert [g for g, _ in got] == [g for g, _ in case.pieces]
    assert [m for _, m in got] == pytest.approx([m for _, m in case.pieces], abs=1e-3)
    # Σ memory, request and limit over the pieces are the instance's; each piece is at least the
    # smallest stage and fits its GPU.
    assert sum(p.instance.memory_mib for p in decision.parts) == pytest.approx(request.memory_mib)
    assert sum(p.instance.request for p in decision.parts) == pytest.approx(request.request)
    assert sum(p.instance.limit for p in decision.parts) == pytest.approx(request.limit)
    for p in decision.parts:
        g = cluster.gpu(p.gpu)
        assert p.instance.memory_mib >= SPLIT.min_part_mib - 1e-6
        assert g.used_memory + p.instance.memory_mib <= g.memory_mib * (1 + EPS)
        assert g.used_request + p.instance.request <= SPLIT.omega + EPS
