"""What compaction's moves and cold starts are made of on a placement trace (issue 19).

    PYTHONPATH=. python3 bench/compaction_moves.py [--sizes 3200] [--mixes 0.2:0,0.2:0.2,0.2:0.4,0:0.4]
        [--seeds 1,2] [--compaction merges=0,...] [--compact-every 2] [--light-split SHARE] [--json FILE]

Replays each trace under `dilu` as `bench/sim_scale.py` does (40 GiB GPUs, compaction every 2 s of
trace time, `SIM_COMPACTION` with `--compaction`'s fields replaced) and sorts every compaction move
by kind, with the cold starts (processes started) each kind cost:

- `empty_whole`: an ordinary instance (inference, LLM or training) moved whole off a GPU being emptied;
- `empty_split`: a whole LLM split into pipeline stages by the move that empties its GPU;
- `empty_stage`: a pipeline stage moved to another GPU of its node;
- `empty_anew`: a split LLM placed anew (whole or split again) because no GPU of its node took one
  of its stages (its stages count once per new piece);
- `merge_whole`, `merge_stage`: merging moves (`CompactionConfig.merges`, and `memory_merges` where memory binds).
- `resize_stage`: a pipeline stage resized where it is (`CompactionConfig.rebalances`).

`--move-parts N` (a prototype, not a simulator setting) hands compaction a placement config that
splits an LLM into at most N pieces (1: compaction's moves never split; placement at creation still
does). `--light-split SHARE` is the simulator setting `PlacementSimConfig.light_split_min_share`
(placement at creation, as `bench/sim_scale.py --light-split`).

Beside them, the trace's own processes: instances created, and the pipeline stages that creations
started (a split at creation starts one process per stage). The bench's "cold starts /100" counts
compaction's only (`details.compaction_cold_starts`); the trace's own creations are not in it.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sim_scale import DILU_COMPACT_EVERY_S, compaction_config

import dilu_invoker.sim.placement as sim_placement
from dilu_invoker.policy import CompactionPlan, compaction_plan
from dilu_invoker.policy.cluster import ClusterSnapshot
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import PlacementSimConfig, simulate_placement

KINDS = ("empty_whole", "empty_split", "empty_stage", "empty_anew", "merge_whole", "merge_stage", "resize_stage")


def classify(before: ClusterSnapshot, plan: CompactionPlan) -> list[tuple[str, str, int]]:
    """(kind, instance class, cold starts) of each move of `plan`, made on `before`."""
    out: list[tuple[str, str, int]] = []
    first_merge = len(plan.moves) - plan.merged
    for n, mv in enumerate(plan.moves):
        gpu = before.gpu(mv.source)
        inst = next((i for i in gpu.instances if i.id == mv.instance_id), None)
        if inst is None:  # a split instance placed anew: the source holds one of its stages
            inst = next(i for i in gpu.instances if i.part_of == mv.instance_id)
        if mv.source == mv.target:
            kind = "resize_stage"
        elif n >= first_merge:
            kind = "merge_stage" if inst.part_of is not None else "merge_whole"
        elif mv.replaces:
            kind = "empty_anew"
        elif inst.part_of is not None:
            kind = "empty_stage"
        elif len(mv.parts) > 1:
            kind = "empty_split"
        else:
            kind = "empty_whole"
        out.append((kind, str(inst.cls), mv.cold_starts))
    return out


def breakdown(
    n: int, train: float, llm: float, seed: int, compaction: Any, every: float, move_parts: int | None = None,
    light_split: float | None = None,
) -> dict[str, Any]:
    """One replay of `dilu` with compaction's moves sorted by kind (per 100 instances)."""
    events = dilu_mix(n, train_fraction=train, llm_fraction=llm, seed=seed)
    moves: Counter[str] = Counter()
    colds: Counter[str] = Counter()
    by_class: Counter[str] = Counter()

    def counted(cluster: ClusterSnapshot, placement: Any, *args: Any, **kwargs: Any) -> CompactionPlan:
        if move_parts is not None:
            placement = dataclasses.replace(placement, llm_max_parts=min(move_parts, placement.llm_max_parts))
        plan = compaction_plan(cluster, placement, *args, **kwargs)
        for kind, cls, cold in classify(cluster, plan):
            moves[kind] += 1
            colds[kind] += cold
            by_class[cls] += cold
        return plan

    cfg = PlacementSimConfig(policy="dilu", gpu_memory_gib=40.0, compact_every_s=every, compaction=compaction,
                             light_split_min_share=light_split)
    log: list[tuple[Any, ...]] = []
    sim_placement.compaction_plan = counted  # type: ignore[assignment]
    try:
        c0 = time.process_time()
        r = simulate_placement(events, cfg, log=log)
        cpu = time.process_time() - c0
    finally:
        sim_placement.compaction_plan = compaction_plan
    d = r.details
    created = sum(1 for e in log if e[0] == "place")
    gang = {e.instance for e in events if e.spec is not None and e.spec.gpus > 1}
    # A split LLM starts one process per stage; a gang (one instance on several GPUs) one.
    created_processes = sum(1 if e[2] in gang else len(e[3]) for e in log if e[0] == "place")
    assert sum(moves.values()) == d["compaction_moves"] and sum(colds.values()) == d["compaction_cold_starts"]
    per = 100.0 / n
    return {
        "n": n, "train": train, "llm": llm, "seed": seed, "compact_every_s": every, "move_parts": move_parts,
        "light_split": light_split,
        "cpu_s": cpu, "peak_int": d["peak_vs_integral"], "mean_int": d["mean_vs_integral"],
        "created_per_100": created * per, "created_processes_per_100": created_processes * per,
        "split_at_creation": d["split_instances"],
        "moves_per_100": d["compaction_moves"] * per, "cold_per_100": d["compaction_cold_starts"] * per,
        "moves": {k: moves[k] * per for k in KINDS}, "cold": {k: colds[k] * per for k in KINDS},
        "cold_by_class": {k: v * per for k, v in sorted(by_class.items())},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="3200")
    ap.add_argument("--mixes", default="0.2:0,0.2:0.2,0.2:0.4,0:0.4")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--compaction", default="", help="override SIM_COMPACTION fields, as sim_scale.py does")
    ap.add_argument("--compact-every", type=float, default=DILU_COMPACT_EVERY_S)
    ap.add_argument("--move-parts", type=int, default=None,
                    help="a prototype: compaction places with llm_max_parts at most N (1: its moves never split)")
    ap.add_argument("--light-split", type=float, default=None, metavar="SHARE",
                    help="PlacementSimConfig.light_split_min_share (placement at creation)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    compaction = compaction_config(args.compaction)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        for mix in args.mixes.split(","):
            train, llm = (float(x) for x in mix.split(":"))
            for seed in (int(x) for x in args.seeds.split(",")):
                r = breakdown(n, train, llm, seed, compaction, args.compact_every, args.move_parts, args.light_split)
                rows.append(r)
                print(f"{n} {train:g}:{llm:g} seed {seed}: peak/int {r['peak_int']:.3f} mean/int {r['mean_int']:.3f} "
                      f"moves/100 {r['moves_per_100']:.1f} cold/100 {r['cold_per_100']:.1f} "
                      f"created/100 {r['created_per_100']:.1f} ({r['created_processes_per_100']:.1f} processes) "
                      f"cpu {r['cpu_s']:.2f} s", flush=True)
                print("   moves " + " ".join(f"{k} {v:.1f}" for k, v in r["moves"].items()))
                print("   cold  " + " ".join(f"{k} {v:.1f}" for k, v in r["cold"].items()))
                print("   cold by class " + " ".join(f"{k} {v:.1f}" for k, v in r["cold_by_class"].items()),
                      flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
