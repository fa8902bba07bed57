"""Fifteenth round (docs/benchmarks/sim-scale.md): where compaction's LLM splits go, how old the
instances it moves are, and how many of its cold starts are second or later moves of one instance.

    PYTHONPATH=. python3 docs/benchmarks/data/sim_scale_round15_split_anatomy.py MIX SEED

Replays a 3,200-instance trace under `dilu` as bench/compaction_moves.py does (SIM_COMPACTION,
compaction every 2 s) and prints: split moves by (instances on the source, pieces, instances on
each piece's GPU before the move); cold starts by the instance's age at the move (seconds); cold
starts by the n-th compaction move of one instance (its pieces counted as the instance); the
trace's lifetimes. Changes no decision.
"""
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "bench"))
import statistics

from compaction_moves import DILU_COMPACT_EVERY_S, classify

import dilu_invoker.sim.placement as sp
from dilu_invoker.policy import compaction_plan
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import SIM_COMPACTION

mix, seed = sys.argv[1], int(sys.argv[2])
train, llm = (float(x) for x in mix.split(":"))
events = dilu_mix(3200, train_fraction=train, llm_fraction=llm, seed=seed)
start: dict[str, float] = {}
end: dict[str, float] = {}
for e in events:
    (start if e.spec is not None else end)[e.instance] = e.t
family: dict[str, list[tuple[float, str, int]]] = defaultdict(list)
shapes: Counter[tuple] = Counter()


def root(instance_id: str) -> str:
    return instance_id.split("#")[0].split("/")[0]


def counted(cluster, placement, *args, **kwargs):
    plan = compaction_plan(cluster, placement, *args, **kwargs)
    for (kind, _cls, cold), mv in zip(classify(cluster, plan), plan.moves):
        family[root(mv.instance_id)].append((cluster.now, kind, cold))
        if kind == "empty_split":
            src = cluster.gpu(mv.source)
            shapes[(len(src.instances), len(mv.parts),
                    tuple(sorted(len(cluster.gpu(p.gpu).instances) for p in mv.parts)))] += 1
    return plan


cfg = sp.PlacementSimConfig(policy="dilu", gpu_memory_gib=40.0, compact_every_s=DILU_COMPACT_EVERY_S,
                            compaction=SIM_COMPACTION)
sp.compaction_plan = counted
try:
    sp.simulate_placement(events, cfg)
finally:
    sp.compaction_plan = compaction_plan
total = sum(c for moves in family.values() for _, _, c in moves)
print(f"{mix} seed {seed}: {total} compaction cold starts")
print("split moves by (instances on source, pieces, instances on each piece's GPU):")
for k, v in shapes.most_common(8):
    print(f"  {v:4d} {k}")
nth: Counter[int] = Counter()
age: Counter[str] = Counter()
for f, moves in family.items():
    for n, (t, _kind, cold) in enumerate(moves):
        nth[min(n + 1, 4)] += cold
        if f in start:
            a = t - start[f]
            age[next(f"<= {b:g} s" for b in (2, 10, 30, 120, 600, float("inf")) if a <= b)] += cold
print("cold starts by the n-th move of one instance (4: 4th or later):", sorted(nth.items()))
print("cold starts by the instance's age at the move:", sorted(age.items(), key=lambda kv: float(kv[0][3:-2])))
lifes = [end[i] - start[i] for i in start if i in end]
print(f"lifetimes: median {statistics.median(lifes):.0f} s, mean {statistics.mean(lifes):.0f} s")
