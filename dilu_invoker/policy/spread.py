"""Spread a function's instances across invokers, among lit GPUs, before best fit decides.

`place` weighs spread as one scorer among others (weight 1 against fragmentation's 4), so when the lit
GPUs differ in fit the second instance of a function usually lands on the invoker that already runs the
first — one node's death would then take the function down. `place_spread` makes spread a tier of its
own between "lit" and "best fit": it first asks `place` for a lit GPU on an invoker that does not run the
function yet; only if there is none does it fall back to plain `place` (which may then pick a lit GPU
beside the function's other instances, or light a new one). Spread never lights a GPU by itself: the
first tier (lit before unlit) still wins, as in Dilu.

Pure: same inputs, same decision; the live balancer and the simulator can both call it.
"""

from __future__ import annotations

from dataclasses import replace

from dilu_invoker.policy.cluster import ClusterSnapshot
from dilu_invoker.policy.placement import (
    Affinity,
    PlacementConfig,
    PlacementDecision,
    PlacementRequest,
    place,
)


def invokers_running(cluster: ClusterSnapshot, function: str) -> frozenset[str]:
    return frozenset(inv for inv, n in cluster.function_counts.get(function, {}).items() if n > 0)


def place_spread(
    cluster: ClusterSnapshot, request: PlacementRequest, config: PlacementConfig
) -> PlacementDecision:
    """`place`, preferring a lit GPU on an invoker without the function when affinity is spread."""
    if (request.affinity or config.affinity) is not Affinity.SPREAD:
        return place(cluster, request, config)
    holders = invokers_running(cluster, request.function) - request.avoid_invokers
    if not holders or holders >= set(cluster.invokers):
        return place(cluster, request, config)
    elsewhere = place(
        cluster,
        replace(request, avoid_invokers=request.avoid_invokers | holders, lit_only=True),
        config,
    )
    if elsewhere.placed:
        where = ", ".join(sorted(holders))
        return replace(
            elsewhere,
            reason=f"{elsewhere.reason}; spread: kept off {where}, which already run {request.function}",
        )
    return place(cluster, request, config)
