"""Seventeenth round (docs/benchmarks/sim-scale.md): the LLMs that compaction moves soon after their
creation, instance by instance. A scratch script, not a bench: it replays a `dilu_mix` trace as
`bench/compaction_moves.py` does (40 GiB GPUs, compaction every 2 s, `SIM_COMPACTION`) with `place`
and `compaction_plan` wrapped to record, per LLM, how placement placed it at its creation (whole on a
lit GPU, split over lit GPUs, or whole on a GPU it lit), the room there was then, and each compaction
move of it (kind as `bench/compaction_moves.py` sorts them, its pieces). It changes no decision.

    PYTHONPATH=. python3 docs/benchmarks/data/sim_scale_round17_young_moves.py [TRAIN LLM SEED [N]]
"""
from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import dilu_invoker.sim.placement as sp
from compaction_moves import classify
from dilu_invoker.policy import compaction_plan, place
from dilu_invoker.policy.types import InstanceClass
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import PlacementSimConfig, simulate_placement

args = sys.argv[1:]
train, llm = (float(args[0]), float(args[1])) if len(args) >= 2 else (0.2, 0.4)
seed = int(args[2]) if len(args) >= 3 else 1
n = int(args[3]) if len(args) >= 4 else 3200
events = dilu_mix(n, train_fraction=train, llm_fraction=llm, seed=seed)
GIB = 1024.0

created: dict[str, dict[str, Any]] = {}
lit_events: dict[Any, list[tuple[float, str, bool]]] = {}
moves: list[dict[str, Any]] = []
now = [0.0]


def tenants(g: Any) -> str:
    return "+".join(sorted(("L" if i.cls is InstanceClass.LLM else "T" if i.cls is InstanceClass.TRAINING else "i")
                           + ("p" if i.part_of else "") for i in g.instances)) or "-"


def hooked_place(cluster: Any, req: Any, conf: Any) -> Any:
    d = place(cluster, req, conf)
    if d.placed:
        for ref in d.gpus:
            if not cluster.gpu(ref).instances:
                lit_events.setdefault(ref, []).append((now[0], str(req.cls), d.split))
    if req.cls is InstanceClass.LLM and d.placed:
        kind = f"split{len(d.parts)}" if d.split else "lights" if d.lights else "lit-whole"
        lit = [g for g in cluster.gpus if g.instances]
        fit_req = [g for g in lit if g.used_request + req.request <= 1 + 1e-9]
        # Per node, what its lit GPUs could take of the LLM (free memory, capped by request room).
        per_node: dict[str, float] = defaultdict(float)
        for g in lit:
            free, room = g.memory_mib - g.used_memory, 1.0 - g.used_request
            if free >= 2048 and room > 0.01:
                per_node[g.ref.invoker] += min(free, room / req.request * req.memory_mib)
        created[req.instance_id] = dict(
            t=now[0], kind=kind, mem=req.memory_mib, gpus=d.gpus,
            tenants0=",".join(tenants(cluster.gpu(r)) for r in d.gpus),
            best_mem=max((g.memory_mib - g.used_memory for g in fit_req), default=0.0),
            best_node=max(per_node.values(), default=0.0), snap=cluster,
        )
    return d


def hooked_compaction(cluster: Any, placement: Any, *a: Any, **k: Any) -> Any:
    plan = compaction_plan(cluster, placement, *a, **k)
    for mv, (kind, cls, cold) in zip(plan.moves, classify(cluster, plan), strict=True):
        src = cluster.gpu(mv.source)
        inst = next((i for i in src.instances if i.id == mv.instance_id or i.part_of == mv.instance_id), None)
        wid = inst.part_of if inst is not None and inst.part_of and kind != "empty_anew" else mv.instance_id
        moves.append(dict(t=cluster.now, id=wid, kind=kind, cold=cold, src_tenants=tenants(src),
                          parts=tuple((p.gpu, p.instance.memory_mib, p.instance.request) for p in mv.parts)
                          or ((mv.target, inst.memory_mib if inst else 0.0, inst.request if inst else 0.0),)))
    return plan


orig_at = sp.ClusterSnapshot.at


def at(self: Any, t: float) -> Any:
    now[0] = t
    return orig_at(self, t)


sp.ClusterSnapshot.at = at  # type: ignore[method-assign]
sp.place = hooked_place  # type: ignore[assignment]
sp.compaction_plan = hooked_compaction  # type: ignore[assignment]
r = simulate_placement(events, PlacementSimConfig(policy="dilu", gpu_memory_gib=40.0, compact_every_s=2.0))
d = r.details
print(f"{n} {train:g}:{llm:g} seed {seed}: peak/int {d['peak_vs_integral']} mean/int {d['mean_vs_integral']} "
      f"moves {d['compaction_moves']} cold starts {d['compaction_cold_starts']}")
llm_moves = [m for m in moves if m["id"] in created]
first: dict[str, dict[str, Any]] = {}
for m in llm_moves:
    first.setdefault(m["id"], m)
print(f"LLMs created {len(created)}, placed at creation: {dict(Counter(c['kind'] for c in created.values()))}")
print(f"compaction moves of LLMs {len(llm_moves)}, their cold starts {sum(m['cold'] for m in llm_moves)}")
print("\nper kind of placement at creation: created, first moved within 10 s, within 30 s, ever; cold starts of "
      "their moves")
for kind in ("lit-whole", "split2", "split3", "split4", "lights"):
    ids = [i for i, c in created.items() if c["kind"] == kind]
    if ids:
        age = [first[i]["t"] - created[i]["t"] for i in ids if i in first]
        cold = sum(m["cold"] for m in llm_moves if created[m["id"]]["kind"] == kind)
        print(f"  {kind:10s} {len(ids):5d} {sum(a < 10 for a in age):5d} {sum(a < 30 for a in age):5d} "
              f"{len(age):5d}   {cold}")
for lo, hi in ((0, 10), (10, 30), (30, None)):
    sel = [m for m in llm_moves if m["t"] - created[m["id"]]["t"] >= lo and (hi is None or m["t"] - created[m["id"]]["t"] < hi)]
    firsts = [m for m in sel if first[m["id"]] is m]
    print(f"\nLLM moves at age [{lo}, {hi if hi is not None else '∞'}) s: {len(sel)} moves, "
          f"{sum(m['cold'] for m in sel)} cold starts; {len(firsts)} first moves")
    print("  placement at creation × kind of move (first moves):",
          dict(Counter((created[m['id']]['kind'], m['kind']) for m in firsts).most_common(8)))
    print("  tenants of the source GPU at the move (first moves):",
          dict(Counter(m["src_tenants"] for m in firsts).most_common(6)))

young = [m for m in first.values() if m["t"] - created[m["id"]]["t"] < 30]
print(f"\nfirst moves within 30 s of creation: {len(young)}; could placement have put the LLM where compaction did?")
verdict: Counter[tuple[str, ...]] = Counter()
for m in young:
    c = created[m["id"]]
    snap = c["snap"]
    lit_all = all(snap.gpu(ref).instances for ref, _, _ in m["parts"])
    fit = all(snap.gpu(ref).used_memory + mem <= snap.gpu(ref).memory_mib * (1 + 1e-9)
              and snap.gpu(ref).used_request + req <= 1 + 1e-9 for ref, mem, req in m["parts"])
    verdict[(c["kind"], m["kind"], "its targets lit at creation" if lit_all else "a target unlit at creation",
             "the pieces fitted there then" if fit else "the pieces did not fit then")] += 1
for k, v in verdict.most_common():
    print(f"  {v:5d} {k}")

lone = [(i, c) for i, c in created.items() if c["kind"] == "lights"]
q = [0, 0.25, 0.5, 0.75, 1]
print(f"\nLLMs that lit a GPU whole at creation: {len(lone)}")
best_mem = sorted(c["best_mem"] / GIB for _, c in lone)
best_node = sorted(c["best_node"] / c["mem"] for _, c in lone)
print("  most free memory of a lit GPU with its request's room, GiB (min, quartiles, max):",
      [round(best_mem[int(x * (len(lone) - 1))], 1) for x in q])
print("  what the best node's lit GPUs could take, share of the LLM (min, quartiles, max):",
      [round(best_node[int(x * (len(lone) - 1))], 2) for x in q])
split_young = [(i, first[i]) for i, c in lone if i in first and first[i]["t"] - c["t"] < 30
               and first[i]["kind"] == "empty_split"]
own = sum(all(ref.invoker == created[i]["gpus"][0].invoker for ref, _, _ in m["parts"]) for i, m in split_young)
print(f"  split by compaction within 30 s: {len(split_young)} (pieces: "
      f"{dict(Counter(len(m['parts']) for _, m in split_young))}); all pieces in the LLM's own node: {own}")
who: Counter[str] = Counter()
for i, m in split_young:
    t0 = created[i]["t"]
    for ref, _, _ in m["parts"]:
        ls = [x for x in lit_events.get(ref, []) if t0 < x[0] <= m["t"]]
        who["lit before the LLM's creation" if not ls else f"lit after it by a {ls[-1][1]} instance"
            + (" (split)" if ls[-1][2] else "")] += 1
print("  the GPUs their pieces went to:", dict(who.most_common()))
ages = sorted(first[i]["t"] - c["t"] for i, c in lone if i in first)
print("  age at the first move, s (min, quartiles, max):", [ages[int(x * (len(ages) - 1))] for x in q])
