"""How far the integral bound is from a placement under the real constraints (issue 19).

At the moment of a trace where the integral bound peaks, the live set (the trace's own, not a
policy's) is

- packed offline, node after node, by a small MILP per node (HiGHS through `highspy`, which the
  project does not depend on: `pip install highspy`): nodes of 4 GPUs of 1.0 SM and 40 GiB; a
  training gang on as many GPUs of one node, one slot per GPU; inference whole on one GPU; an LLM
  whole or spread over GPUs of one node in pieces of at least 2 GiB (at most one per GPU) whose SM
  requests are in proportion to their memory (what `dilu` may do). Each node takes, from a window of
  the largest remaining inference instances and LLMs, what fills it most (memory in GPUs plus SM
  request, each weighted); every figure is a placement that exists, an upper bound on the fewest GPUs;
- bounded from below by an LP that keeps the integral bound's gang slots (a GPU each) and treats
  inference and LLMs as divisible, except that an inference instance may sit beside a slot only where
  it fits whole (its memory and request within the slot GPU's room), memory and SM checked per slot
  GPU kind and on the other GPUs in sum: a lower bound at least the integral bound's.

    PYTHONPATH=. python3 bench/offline_pack.py --mixes 0.2:0.4,0:0.4 --seeds 1,2,3,4,5,6 --json FILE
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dilu_invoker.policy.fragmentation import integral_lit_gpu_lower_bound
from dilu_invoker.policy.types import InstanceClass
from dilu_invoker.sim.generate import dilu_mix

GPU_GIB = 40.0
NODE = 4
MIN_PART = 2.0
EPS = 1e-6
DEBUG = False
LEAN = 1.0
SYMMETRY = False


def _bound(live: dict[str, Any]) -> int:
    sm = sum(s.gpus * s.sm_request for s in live.values())
    mem = sum(s.gpus * s.mem_gib_per_gpu for s in live.values())
    train = [s for s in live.values() if s.cls is InstanceClass.TRAINING]
    return integral_lit_gpu_lower_bound(
        sm_request=sm, memory_mib=mem, memory_capacity_mib=GPU_GIB, widest=max((s.gpus for s in live.values()), default=0),
        large_memory_slots=sum(s.gpus for s in train if s.mem_gib_per_gpu > GPU_GIB / 2 + EPS),
        large_request_slots=sum(s.gpus for s in train if s.sm_request > 0.5 + EPS),
    )


def peak_moment(events: list[Any]) -> tuple[float, dict[str, Any], int]:
    """The last moment at which the integral bound of the live set is highest, and that set."""
    live: dict[str, Any] = {}
    best = (-1, 0.0, {})
    i = 0
    while i < len(events):
        t = events[i].t
        while i < len(events) and events[i].t == t:
            e = events[i]
            if e.op == "create":
                live[e.instance] = e.spec
            else:
                live.pop(e.instance, None)
            i += 1
        b = _bound(live)
        if b >= best[0]:
            best = (b, t, dict(live))
    return best[1], best[2], best[0]


def moment(events: list[Any], at: float) -> tuple[float, dict[str, Any], int]:
    """The live set just after the events at or before `at`, and its integral bound."""
    live: dict[str, Any] = {}
    t = 0.0
    for e in events:
        if e.t > at:
            break
        t = e.t
        if e.op == "create":
            live[e.instance] = e.spec
        else:
            live.pop(e.instance, None)
    return t, live, _bound(live)


def lp_lower_bound(live: dict[str, Any]) -> float:
    """Slots a GPU each, plus the fewest further GPUs of the LP above (fractional)."""
    import highspy

    slots: Counter[tuple[float, float]] = Counter()
    fill: Counter[tuple[str, float, float]] = Counter()
    for s in live.values():
        if s.cls is InstanceClass.TRAINING and s.mem_gib_per_gpu > GPU_GIB / 2 + EPS:
            slots[(round(GPU_GIB - s.mem_gib_per_gpu, 6), round(1.0 - s.sm_request, 6))] += s.gpus
        else:
            kind = "whole" if s.cls is InstanceClass.INFERENCE or s.gpus > 1 else "split"
            fill[(kind, s.mem_gib_per_gpu * s.gpus, s.sm_request * s.gpus)] += 1
    h = highspy.Highs()
    h.silent()
    n_extra = h.addVariable(lb=0, obj=1.0)
    kinds = list(slots.items())
    items = list(fill.items())
    a: dict[tuple[int, int], Any] = {}
    for i, ((kind, m, r), cnt) in enumerate(items):
        for t, ((f, sr), _c) in enumerate(kinds):
            if kind == "whole" and (m > f + EPS or r > sr + EPS):
                continue
            if kind == "split" and f < MIN_PART - EPS:
                continue
            a[(i, t)] = h.addVariable(lb=0, ub=cnt)
    for t, ((f, sr), c) in enumerate(kinds):
        vs = [(i, v) for (i, tt), v in a.items() if tt == t]
        if vs:
            h.addConstr(sum(v * items[i][0][1] for i, v in vs) <= c * f)
            h.addConstr(sum(v * items[i][0][2] for i, v in vs) <= c * sr)
    rest_m = sum(cnt * m for (_, m, _), cnt in items)
    rest_r = sum(cnt * r for (_, _, r), cnt in items)
    placed_m = [v * items[i][0][1] for (i, _), v in a.items()]
    placed_r = [v * items[i][0][2] for (i, _), v in a.items()]
    for i, ((_, _, _), cnt) in enumerate(items):
        vs = [v for (ii, _), v in a.items() if ii == i]
        if vs:
            h.addConstr(sum(vs) <= cnt)
    h.addConstr(rest_m - sum(placed_m) - GPU_GIB * n_extra <= 0) if placed_m else h.addConstr(GPU_GIB * n_extra >= rest_m)
    h.addConstr(rest_r - sum(placed_r) - 1.0 * n_extra <= 0) if placed_r else h.addConstr(n_extra >= rest_r)
    h.minimize()
    return sum(slots.values()) + h.getInfo().objective_function_value


def _node_milp(gpus: list[list[float]], infs: list[tuple[str, float, float]], llms: list[tuple[str, float, float]],
               w_mem: float, w_sm: float, time_limit: float, balance: float = 0.0) -> tuple[list[tuple[str, int]], list[tuple[str, list[float]]]]:
    """What to put on one node's GPUs (room [free GiB, free SM] each): the inference instances (and
    their GPU) and the LLMs (and their pieces' GiB per GPU) that fill it most."""
    import highspy

    h = highspy.Highs()
    h.silent()
    h.setOptionValue("time_limit", time_limit)
    h.setOptionValue("mip_rel_gap", 1e-3)
    G = range(len(gpus))
    x = {}
    for i, (_, m, r) in enumerate(infs):
        for g in G:
            if m <= gpus[g][0] + EPS and r <= gpus[g][1] + EPS:
                x[(i, g)] = h.addBinary(obj=-(w_mem * m / GPU_GIB + w_sm * r))
    y, p, z = {}, {}, {}
    for j, (_, big_m, big_r) in enumerate(llms):
        y[j] = h.addBinary(obj=-(w_mem * big_m / GPU_GIB + w_sm * big_r))
        for g in G:
            if gpus[g][0] >= min(MIN_PART, big_m) - EPS:
                p[(j, g)] = h.addVariable(lb=0, ub=big_m)
                z[(j, g)] = h.addBinary()
                h.addConstr(p[(j, g)] - big_m * z[(j, g)] <= 0)
                h.addConstr(p[(j, g)] - min(MIN_PART, big_m) * z[(j, g)] >= 0)
        parts = [p[(j, g)] for g in G if (j, g) in p]
        if parts:
            h.addConstr(sum(parts) - big_m * y[j] == 0)
        else:
            h.addConstr(y[j] <= 0)
    for i in range(len(infs)):
        vs = [x[(i, g)] for g in G if (i, g) in x]
        if len(vs) > 1:
            h.addConstr(sum(vs) <= 1)
    used_sm = []
    for g in G:
        mem = [x[(i, g)] * infs[i][1] for i in range(len(infs)) if (i, g) in x]
        mem += [p[(j, g)] for j in range(len(llms)) if (j, g) in p]
        sm = [x[(i, g)] * infs[i][2] for i in range(len(infs)) if (i, g) in x]
        sm += [p[(j, g)] * (llms[j][2] / llms[j][1]) for j in range(len(llms)) if (j, g) in p]
        used_sm.append(sum(sm) if sm else None)
        if mem:
            h.addConstr(sum(mem) <= gpus[g][0] + EPS)
            h.addConstr(sum(sm) <= gpus[g][1] + EPS)
    for g in range(len(gpus) - 1):
        # GPUs with the same room are interchangeable: order them by SM used (symmetry; `--symmetry`)
        if SYMMETRY and gpus[g] == gpus[g + 1] and used_sm[g] is not None and used_sm[g + 1] is not None:
            h.addConstr(used_sm[g] - used_sm[g + 1] >= 0)
    if balance > 0:
        # take memory and SM in the ratio of what is left (GiB per SM), so neither runs out first
        mem_all = [x[(i, g)] * infs[i][1] for (i, g) in x] + list(p.values())
        sm_all = [x[(i, g)] * infs[i][2] for (i, g) in x] + [p[(j, g)] * (llms[j][2] / llms[j][1]) for (j, g) in p]
        if mem_all:
            h.addConstr(sum(mem_all) - balance * sum(sm_all) >= 0)
    h.minimize()
    if h.getInfo().primal_solution_status != 2:
        return [], []
    sol = h.getSolution().col_value
    picked = [(infs[i][0], g) for (i, g), v in x.items() if sol[v.index] > 0.5]
    whole = []
    for j, v in y.items():
        if sol[v.index] > 0.5:
            whole.append((llms[j][0], [sol[p[(j, g)].index] if (j, g) in p else 0.0 for g in G]))
    return picked, whole


def _exact_node(infs: list[tuple[str, float, float]], llms: list[tuple[str, float, float]],
                target: float, lean: float = 1.0) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
    """A set for an empty node whose Σ request is the node's SM (`target`, or as near as the
    remaining instances allow) and whose memory follows the remaining instances' GiB per SM: take
    the largest LLM while the set is leaner in memory than what is left, else the largest inference
    instance, until one instance completes the sum exactly."""
    def unit(r: float) -> int:
        return round(r * 100)

    left_m = sum(t[1] for t in infs + llms)
    left_r = sum(t[2] for t in infs + llms)
    ratio = left_m / max(EPS, left_r)
    cap_mem = NODE * GPU_GIB
    need = unit(target)
    inf_left, llm_left = list(infs), list(llms)
    got_i: list[tuple[str, float, float]] = []
    got_l: list[tuple[str, float, float]] = []
    mem = 0.0
    while need > 0 and (inf_left or llm_left):
        by_r: dict[int, tuple[int, int]] = {}
        for k, t in enumerate(inf_left):
            by_r.setdefault(unit(t[2]), (0, k))
        for k, t in enumerate(llm_left):
            by_r.setdefault(unit(t[2]), (1, k))
        if need in by_r:
            kind, k = by_r[need]
            t = (inf_left, llm_left)[kind][k]
            if mem + t[1] <= cap_mem + EPS:
                (got_i, got_l)[kind].append(t)
                break
        sm_now = sum(t[2] for t in got_i + got_l)
        want_llm = llm_left and (not inf_left or mem < lean * ratio * (sm_now + 0.5))
        pool = llm_left if want_llm else inf_left
        fit = [k for k, t in enumerate(pool) if unit(t[2]) <= need and mem + t[1] <= cap_mem + EPS]
        if not fit:
            pool = inf_left if want_llm else llm_left
            fit = [k for k, t in enumerate(pool) if unit(t[2]) <= need and mem + t[1] <= cap_mem + EPS]
            if not fit:
                break
        # leave a remainder that some instance can complete (at least the least request)
        k = fit[0]
        t = pool.pop(k)
        (got_l if pool is llm_left else got_i).append(t)
        mem += t[1]
        need -= unit(t[2])
    return got_i, got_l


def _window(items: list[tuple[str, float, float]], per_size: int) -> list[tuple[str, float, float]]:
    """Up to `per_size` instances of each memory size, the largest requests first (items are sorted
    by size, largest first): small ones too, which fill what the large ones leave."""
    seen: Counter[float] = Counter()
    out = []
    for t in items:
        if seen[t[1]] < per_size:
            seen[t[1]] += 1
            out.append(t)
    return out


def offline_pack(live: dict[str, Any], *, window: int = 16, w_mem: float = 1.0, w_sm: float = 1.0,
                 time_limit: float = 0.5, balance: float = 0.0, exact: bool = False) -> int:
    """The live set packed node after node (see the module's text); returns the lit GPUs."""
    gangs = sorted((s for s in live.values() if s.cls is InstanceClass.TRAINING), key=lambda s: -s.gpus)
    nodes: list[list[list[float]]] = []
    twos: list[Any] = []
    for s in gangs:
        if s.gpus == NODE:
            nodes.append([[GPU_GIB - s.mem_gib_per_gpu, 1.0 - s.sm_request] for _ in range(NODE)])
        else:
            twos.append(s)
    lit_slots = sum(s.gpus for s in gangs)
    for k in range(0, len(twos), 2):
        pair = twos[k:k + 2]
        node = [[GPU_GIB - s.mem_gib_per_gpu, 1.0 - s.sm_request] for s in pair for _ in range(s.gpus)]
        node += [[GPU_GIB, 1.0] for _ in range(NODE - len(node))]
        nodes.append(node)
    infs = sorted(((s.instance, s.mem_gib_per_gpu, s.sm_request) for s in live.values()
                   if s.cls is InstanceClass.INFERENCE), key=lambda t: -(t[1] / GPU_GIB + t[2]))
    llms = sorted(((s.instance, s.mem_gib_per_gpu, s.sm_request) for s in live.values()
                   if s.cls is InstanceClass.LLM), key=lambda t: -(t[1] / GPU_GIB + t[2]))
    k = 0
    while infs or llms:
        if k == len(nodes):
            nodes.append([[GPU_GIB, 1.0] for _ in range(NODE)])
        node = nodes[k]
        k += 1
        ratio = 0.0
        if balance > 0 and all(g == [GPU_GIB, 1.0] for g in node):
            ratio = balance * sum(t[1] for t in infs + llms) / max(EPS, sum(t[2] for t in infs + llms))
        picked = whole = None
        used_exact = False
        if exact and all(g == [GPU_GIB, 1.0] for g in node):
            used_exact = True
            ci, cl = _exact_node(infs, llms, NODE * 1.0, LEAN)
            while ci or cl:
                picked, whole = _node_milp(node, ci, cl, 0.0, 1.0, time_limit)
                if len(picked) == len(ci) and len(whole) == len(cl):
                    break
                # not every one placed: drop the last LLM (or inference) and place again
                (cl if cl else ci).pop()
                picked = whole = None
        if picked is None:
            picked, whole = _node_milp(node, _window(infs, window), _window(llms, window), w_mem, w_sm, time_limit, ratio)
        if not picked and not whole and all(g == [GPU_GIB, 1.0] for g in node):
            raise RuntimeError("offline pack: nothing fits an empty node")
        gone = {i for i, _ in picked}
        for i, g in picked:
            s = live[i]
            node[g][0] -= s.mem_gib_per_gpu
            node[g][1] -= s.sm_request
        for i, parts in whole:
            s = live[i]
            gone.add(i)
            for g, m in enumerate(parts):
                node[g][0] -= m
                node[g][1] -= m * s.sm_request / s.mem_gib_per_gpu
        if DEBUG:
            print(f"node {k-1}: SM left {sum(g[1] for g in node):.2f} GiB left {sum(g[0] for g in node):.0f} "
                  f"inf {len(picked)} llm {len(whole)} remaining inf {len(infs)-len(picked)} llm {len(llms)-len(whole)}", file=sys.stderr)
        infs = [t for t in infs if t[0] not in gone]
        llms = [t for t in llms if t[0] not in gone]
        if used_exact and picked is not None and sum(g[1] for g in node) > 0.02:
            k -= 1  # what the set left on this node: the window's MILP fills it next
    if DEBUG:
        free_m = sum(g[0] for n in nodes for g in n if g[0] < GPU_GIB - EPS or g[1] < 1.0 - EPS)
        free_s = sum(g[1] for n in nodes for g in n if g[0] < GPU_GIB - EPS or g[1] < 1.0 - EPS)
        ng = len(gangs) - len(twos) + (len(twos) + 1) // 2
        def fm(ns: list[list[list[float]]]) -> float:
            return sum(g[0] for n in ns for g in n if g[0] < GPU_GIB - EPS or g[1] < 1.0 - EPS) / GPU_GIB

        print(f"gang nodes {ng}: free {fm(nodes[:ng]):.1f} GPUs; fresh {len(nodes)-ng}: {fm(nodes[ng:]):.1f}; last 5 nodes {fm(nodes[-5:]):.1f}", file=sys.stderr)
        print(f"nodes {len(nodes)} free GiB on lit {free_m:.0f} ({free_m/GPU_GIB:.1f} GPUs) free SM {free_s:.1f}", file=sys.stderr)
    lit = 0
    for node in nodes:
        lit += sum(1 for g in node if g[0] < GPU_GIB - EPS or g[1] < 1.0 - EPS)
    # every slot GPU is lit (a 40 GiB slot leaves [0, x], counted above)
    assert lit >= lit_slots
    return lit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3200)
    ap.add_argument("--mixes", default="0.2:0.4,0:0.4")
    ap.add_argument("--seeds", default="1,2,3,4,5,6")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--w-mem", type=float, default=1.0)
    ap.add_argument("--w-sm", type=float, default=1.0)
    ap.add_argument("--time-limit", type=float, default=0.5)
    ap.add_argument("--balance", type=float, default=0.0,
                    help="an empty node takes at least this share of the remaining GiB per SM (0: no such rule)")
    ap.add_argument("--exact", action="store_true",
                    help="an empty node takes a set of exactly its SM in Σ request (then placed by the MILP)")
    ap.add_argument("--lean", type=float, default=0.85,
                    help="with --exact: the set takes an LLM while its GiB are below this share of the remaining GiB per SM")
    ap.add_argument("--at", default="",
                    help="moments (s of trace time, comma-separated) instead of the integral bound's peak")
    ap.add_argument("--symmetry", action="store_true",
                    help="order a node's GPUs of equal room by SM used in the MILP")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    global LEAN, SYMMETRY
    LEAN, SYMMETRY = args.lean, args.symmetry
    rows = []
    for mix in args.mixes.split(","):
        train, llm = (float(x) for x in mix.split(":"))
        for seed in (int(x) for x in args.seeds.split(",")):
            events = dilu_mix(args.n, train_fraction=train, llm_fraction=llm, seed=seed)
            for when in (args.at.split(",") if args.at else ["peak"]):
                t, live, bound = peak_moment(events) if when == "peak" else moment(events, float(when))
                c0 = time.process_time()
                lp = lp_lower_bound(live)
                pack = offline_pack(live, window=args.window, w_mem=args.w_mem, w_sm=args.w_sm,
                                    time_limit=args.time_limit, balance=args.balance, exact=args.exact)
                row = {"mix": mix, "seed": seed, "moment": when, "t": t, "live": len(live), "integral": bound,
                       "sm": round(sum(s.gpus * s.sm_request for s in live.values()), 2),
                       "mem_gpus": round(sum(s.gpus * s.mem_gib_per_gpu for s in live.values()) / GPU_GIB, 2),
                       "lp": round(lp, 2), "lp_ceil": math.ceil(lp - 1e-6), "offline": pack,
                       "lp_ratio": round(math.ceil(lp - 1e-6) / bound, 4), "offline_ratio": round(pack / bound, 4),
                       "cpu_s": round(time.process_time() - c0, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
