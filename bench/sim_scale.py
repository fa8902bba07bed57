"""Scale of the placement simulation over mixes and sizes, baselines side by side (issue 19), and the
serving simulation on the one-day trace (issue 7).

    PYTHONPATH=. python3 bench/sim_scale.py [--sizes 3200,32000] [--mixes 0:0,0.2:0.2,...]
        [--seeds 1,2] [--big-seeds 1] [--policies exclusive,infless-l,infless-r,fastgs,dilu]
        [--repeat N] [--baseline DIR] [--compaction merges=2,merge_sources=64] [--light-split SHARE]
        [--split-node-fit] [--json FILE]
        [--out docs/benchmarks/sim-scale.md] [--serving [--profiles FILE]]

For each size, each mix `train:llm` (training fraction : LLM fraction of `dilu_mix`, 40 GiB GPUs, one
create per second) and each seed, every policy replays the same trace, one after another in this
process. Reported per run: wall and CPU seconds (`time.process_time`: what this process used, less
sensitive than wall time to other load on a shared machine), events, CPU µs per event, peak and
time-mean lit GPUs against the fractional and the integral bound, compaction moves and cold starts
per 100 instances, and the load average (1 min) when the run ended: read wall times, and on a
shared machine CPU times too, with it. `--repeat N` runs each trace N times in a row (the same
decisions, checked) and reports the median CPU and wall time with the CPU range: on a shared host
the CPU time of one run varies by tens of per cent. `decisions` is a digest of every decision a run
carried out (`decisions_digest`): a pure speed-up of the policy keeps it. `--baseline DIR` (a
checkout of other code, e.g. `git worktree add DIR COMMIT`) then replays each `dilu` trace twice
more, with DIR's code and with this code, in two child processes started together, so both see the
same load and run in the same kind of process; the row's CPU and wall seconds are then this code's
paired replay (its run alone is kept as `alone_cpu_s`), beside the baseline's CPU seconds, the ratio
and whether the decisions are the same. `--compaction` overrides fields of the simulator's compaction
(`SIM_COMPACTION`) for `dilu` (not with `--baseline`): the trade-off curves of packing, moves
and CPU time (any `CompactionConfig` field, e.g. `repacks=8,repack_above=0.025`: re-pack only while the
lit GPUs exceed the integral bound of what is placed by more than 2.5 % of it). `--light-split SHARE` sets `dilu`'s `PlacementConfig.light_split_min_share` (an LLM that
would light a GPU whole is split over lit GPUs and one new GPU of a node instead). `--split-node-fit` sets
`dilu`'s `PlacementConfig.split_node_fit` (where memory binds, an LLM split over lit GPUs goes to the node
left with the least free memory, not the one where it needs the fewest pieces). `--json FILE` writes the rows as JSON.
Targets (issue 19): `dilu` < 5 s at 3,200 instances and < 60 s at 32,000 for any mix, ≤ 1.03× the
integral bound on peak and mean. `--serving` also times the serving simulation of the one-day,
100-function trace on 64 GPUs per policy (issue 7: < 5 minutes; `--sizes ''` for that alone).
Nothing is asserted (speed belongs here, not in tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from loadgen import cpu_model

from dilu_invoker.policy import CompactionConfig
from dilu_invoker.policy.live_compaction import LIVE_COMPACTION
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import (
    PLACEMENT_POLICIES,
    SIM_COMPACTION,
    PlacementResult,
    PlacementSimConfig,
    live_placement_config,
    simulate_placement,
)

DILU_COMPACT_EVERY_S = 2.0
DEFAULT_MIXES = "0:0,0:0.2,0:0.4,0.2:0,0.2:0.2,0.2:0.4,0.4:0,0.4:0.2,0.4:0.4"


def _describe(root: Path) -> str:
    """The baseline's commit, where git can tell."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return str(root)
    return out.stdout.strip() or str(root)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def compaction_config(spec: str, base: CompactionConfig = SIM_COMPACTION) -> CompactionConfig:
    """`base` (`SIM_COMPACTION`) with the fields of `spec` ("name=value,..."; values as Python literals) replaced."""
    if not spec:
        return base
    changes: dict[str, Any] = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        field = {f.name: f for f in dataclasses.fields(CompactionConfig)}.get(name.strip())
        if field is None:
            raise SystemExit(f"--compaction: unknown field {name.strip()!r}")
        text = value.strip()
        changes[field.name] = text == "True" if text in ("True", "False") else (
            int(text) if text.lstrip("-").isdigit() else float(text))
    return dataclasses.replace(base, **changes)


def run_one(
    n: int, train: float, llm: float, seed: int, policy: str, repeat: int = 1,
    compaction: CompactionConfig = SIM_COMPACTION, light_split: float | None = None,
    split_node_fit: bool = False, *, as_live: bool = False, every: float | None = None, live_stages: int = 1,
) -> dict[str, Any]:
    """One trace under one policy, `repeat` times in a row (the same decisions every time): the
    median CPU and wall time, and the CPU range (on a shared host one run's CPU time varies).
    `as_live`: `dilu` as the live balancer runs it (`live_placement_config`, `compaction` in place of its
    compaction; `live_stages`: the `gpu-stages` its LLM actions declare, 1: none); `every`: `dilu`'s compaction
    period (default 2 s, live 30 s)."""
    events = dilu_mix(n, train_fraction=train, llm_fraction=llm, seed=seed)
    if as_live and policy == "dilu":
        cfg = live_placement_config(gpu_memory_gib=40.0, compaction=compaction, llm_split_parts=live_stages,
                                    split_node_fit=split_node_fit,
                                    **({} if every is None else {"compact_every_s": every}))
    else:
        cfg = PlacementSimConfig(
            policy=policy,
            gpu_memory_gib=40.0,
            compact_every_s=(DILU_COMPACT_EVERY_S if every is None else every) if policy == "dilu" else 0.0,
            compaction=compaction,
            light_split_min_share=light_split,
            split_node_fit=split_node_fit,
        )
    walls: list[float] = []
    cpus: list[float] = []
    first: PlacementResult | None = None
    digest = ""
    # What is alive now (modules, the trace) out of the collector's way, in this process as in the
    # baseline's child: the two replays then pay the same for garbage collection, whatever else
    # this process imported.
    gc.collect()
    gc.freeze()
    for _ in range(repeat):
        log: list[tuple[Any, ...]] = []
        w0, c0 = time.perf_counter(), time.process_time()
        r = simulate_placement(events, cfg, log=log)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        h = decisions_digest(log, r)
        if first is None:
            first, digest = r, h
        elif (r.summary, r.samples, h) != (first.summary, first.samples, digest):
            raise AssertionError(f"{policy} on {n} {train}:{llm} seed {seed}: a repeat decided otherwise")
    gc.unfreeze()
    assert first is not None
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    s, d = r.summary, r.details
    return {
        "n": n, "train": train, "llm": llm, "seed": seed, "policy": policy,
        "events": s["events"], "wall_s": wall, "cpu_s": cpu, "us_per_event": 1e6 * cpu / s["events"],
        "cpu_min": min(cpus), "cpu_max": max(cpus), "repeat": repeat,
        "peak": s["gpus_peak"], "mean": d["gpus_mean"],
        "peak_int": d["peak_vs_integral"], "mean_int": d["mean_vs_integral"],
        "peak_frac": d["peak_vs_bound"], "mean_frac": d["mean_vs_bound"],
        "moves_per_100": 100.0 * d["compaction_moves"] / n,
        "cold_per_100": 100.0 * d["compaction_cold_starts"] / n,
        # the compaction runs' CPU (the first replay's): in all, and per run (what a leader's run takes)
        "compact_cpu_s": first.details["compaction_cpu_s"], "compact_runs": first.details["compaction_runs"],
        "compact_run_p50_ms": 1e3 * first.details["compaction_run_cpu_s"]["p50"],
        "compact_run_p99_ms": 1e3 * first.details["compaction_run_cpu_s"]["p99"],
        "compact_run_max_ms": 1e3 * first.details["compaction_run_cpu_s"]["max"],
        "splits": d["split_instances"], "rejected": s["rejected"], "load": _load().split()[0],
        "decisions": digest, "light_split": light_split, "split_node_fit": split_node_fit,
        "as_live": as_live and policy == "dilu", "compact_every_s": cfg.compact_every_s,
        "live_stages": live_stages if as_live and policy == "dilu" else None,
    }


#: The child that replays one trace with the code of another checkout (`--baseline`): argv is
#: DIR N TRAIN LLM SEED POLICY REPEAT; it prints the median CPU and wall seconds and the digest.
_BASELINE_CHILD = """
import gc, hashlib, json, statistics, sys, time
root, n, train, llm, seed, policy, repeat = sys.argv[1:8]
sys.path.insert(0, root)
from dilu_invoker.sim.generate import dilu_mix
from dilu_invoker.sim.placement import PlacementSimConfig, simulate_placement
events = dilu_mix(int(n), train_fraction=float(train), llm_fraction=float(llm), seed=int(seed))
cfg = PlacementSimConfig(policy=policy, gpu_memory_gib=40.0, compact_every_s=float(sys.argv[8]))
cpus, walls = [], []
gc.collect()
gc.freeze()
for _ in range(int(repeat)):
    log = []
    w0, c0 = time.perf_counter(), time.process_time()
    r = simulate_placement(events, cfg, log=log)
    walls.append(time.perf_counter() - w0)
    cpus.append(time.process_time() - c0)
# As `decisions_digest` computes it (the baseline's bench may not have it).
text = repr(log) + repr(r.summary) + repr(r.details["split_instances"]) + repr(r.details["compaction_moves"])
print(json.dumps({"cpu_s": statistics.median(cpus), "wall_s": statistics.median(walls),
                  "decisions": hashlib.sha256(text.encode()).hexdigest()[:16]}))
"""


def start_baseline(root: Path, n: int, train: float, llm: float, seed: int, policy: str, repeat: int) -> subprocess.Popen[str]:
    """The baseline's replay of the trace, started now (`--baseline`); `finish_baseline` reads it."""
    every = DILU_COMPACT_EVERY_S if policy == "dilu" else 0.0
    argv = [sys.executable, "-c", _BASELINE_CHILD, str(root), str(n), repr(train), repr(llm), str(seed), policy,
            str(repeat), repr(every)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=root)


def finish_baseline(child: subprocess.Popen[str], row: dict[str, Any]) -> None:
    out, _ = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"the baseline's replay failed (exit {child.returncode})")
    got = json.loads(out.strip().splitlines()[-1])
    row["base_cpu_s"], row["base_wall_s"], row["base_decisions"] = got["cpu_s"], got["wall_s"], got["decisions"]


def decisions_digest(log: list[tuple[Any, ...]], r: PlacementResult) -> str:
    """sha256 (first 16 hex digits) of every decision the run carried out (`simulate_placement`'s
    `log`: placements with their GPUs, refusals, compaction runs, moves) and of its summary: equal
    digests mean the same placements, moves and splits (a speed-up must keep them)."""
    text = repr(log) + repr(r.summary) + repr(r.details["split_instances"]) + repr(r.details["compaction_moves"])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


COLUMNS = (
    ("size", lambda r: f"{r['n']:,}"),
    ("train:llm", lambda r: f"{r['train']:g}:{r['llm']:g}"),
    ("seed", lambda r: str(r["seed"])),
    ("policy", lambda r: r["policy"]),
    ("events", lambda r: str(r["events"])),
    ("wall s", lambda r: f"{r['wall_s']:.2f}"),
    ("CPU s", lambda r: f"{r['cpu_s']:.2f}"),
    ("CPU s min–max", lambda r: f"{r['cpu_min']:.2f}–{r['cpu_max']:.2f}" if r["repeat"] > 1 else "–"),
    ("CPU µs/event", lambda r: f"{r['us_per_event']:.0f}"),
    ("peak", lambda r: str(r["peak"])),
    ("peak / integral", lambda r: f"{r['peak_int']:.3f}"),
    ("mean / integral", lambda r: f"{r['mean_int']:.3f}"),
    ("peak / fractional", lambda r: f"{r['peak_frac']:.3f}"),
    ("mean / fractional", lambda r: f"{r['mean_frac']:.3f}"),
    ("moves /100", lambda r: f"{r['moves_per_100']:.1f}"),
    ("cold starts /100", lambda r: f"{r['cold_per_100']:.1f}"),
    ("rejected", lambda r: str(r["rejected"])),
    ("load (1 min) after", lambda r: r["load"]),
    ("decisions", lambda r: r["decisions"]),
)


BASELINE_COLUMNS = (
    ("baseline CPU s", lambda r: f"{r['base_cpu_s']:.2f}" if "base_cpu_s" in r else "–"),
    ("CPU / baseline", lambda r: f"{r['cpu_s'] / r['base_cpu_s']:.2f}" if r.get("base_cpu_s") else "–"),
    ("baseline decisions", lambda r: ("same" if r["base_decisions"] == r["decisions"] else r["base_decisions"])
     if "base_decisions" in r else "–"),
)


def markdown(rows: list[dict[str, Any]]) -> str:
    columns = COLUMNS + (BASELINE_COLUMNS if any("base_cpu_s" in r for r in rows) else ())
    head = "| " + " | ".join(c for c, _ in columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    return "\n".join([head, sep, *("| " + " | ".join(f(r) for _, f in columns) + " |" for r in rows)])


def serving(profiles_path: str) -> None:
    from dilu_invoker.sim.profiles import load_profiles
    from dilu_invoker.sim.serving import SERVING_POLICIES, ServingSimConfig, simulate_serving
    from dilu_invoker.sim.traces import load_trace

    profiles = load_profiles(ROOT / profiles_path)
    trace = load_trace(ROOT / "examples/serving/azure-day.jsonl.gz", profiles)
    print(f"serving, {len(trace.functions)} functions, {trace.requests:,} requests over 24 h, 64 GPUs"
          f"{' (SYNTHETIC profiles)' if profiles.synthetic else ''}:")
    for p in SERVING_POLICIES:
        w0, c0 = time.perf_counter(), time.process_time()
        r = simulate_serving(trace, profiles, ServingSimConfig(policy=p, gpus=64))
        print(f"  {p:12s} wall {time.perf_counter() - w0:6.1f} s cpu {time.process_time() - c0:6.1f} s "
              f"({r.summary['completed']:,} completed)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="3200,32000")
    ap.add_argument("--mixes", default=DEFAULT_MIXES, help="train:llm fractions, comma-separated")
    ap.add_argument("--big-mixes", default=None, help="mixes for sizes above 3,200 (default: --mixes)")
    ap.add_argument("--seeds", default="1,2", help="seeds at 3,200 instances and below")
    ap.add_argument("--big-seeds", default="1", help="seeds above 3,200 instances")
    ap.add_argument("--policies", default=",".join(PLACEMENT_POLICIES))
    ap.add_argument("--big-policies", default=None, help="policies above 3,200 instances (default: --policies)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    ap.add_argument("--serving", action="store_true", help="also time the one-day serving trace per policy")
    ap.add_argument("--profiles", default="tests/sim/data/synthetic_profiles.json")
    ap.add_argument("--repeat", type=int, default=1, help="runs per trace and policy (median CPU reported)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a checkout of other code: replay each dilu trace with it at the same time")
    ap.add_argument("--compaction", default="",
                    help="override SIM_COMPACTION fields for dilu, e.g. merges=2,merge_sources=64")
    ap.add_argument("--light-split", type=float, default=None, metavar="SHARE",
                    help="dilu splits an LLM that would light a GPU whole over lit GPUs and one new GPU of a "
                         "node when the lit GPUs take at least SHARE of it (PlacementConfig.light_split_min_share)")
    ap.add_argument("--split-node-fit", action="store_true",
                    help="where memory binds, dilu splits an LLM over the lit GPUs of the node left with the "
                         "least free memory (PlacementConfig.split_node_fit; with --as-live the balancer's "
                         "--balancer-split-node-fit)")
    ap.add_argument("--as-live", action="store_true",
                    help="dilu as the live balancer runs it by default (no LLM split unless --live-stages, "
                         "LIVE_COMPACTION every 30 s; "
                         "--compaction then overrides LIVE_COMPACTION's fields)")
    ap.add_argument("--live-stages", type=int, default=1, metavar="N",
                    help="with --as-live: the trace's LLM actions declare gpu-stages N, so the live balancer splits "
                         "an LLM no lit GPU holds over up to N GPUs of a node (default 1: none declares it)")
    ap.add_argument("--compact-every", type=float, default=None, metavar="SECONDS",
                    help="dilu's compaction period in trace seconds (default 2, with --as-live 30)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    compaction = compaction_config(args.compaction, LIVE_COMPACTION if args.as_live else SIM_COMPACTION)
    if (args.compaction or args.light_split is not None or args.split_node_fit or args.as_live
            or args.compact_every is not None) and args.baseline is not None:
        raise SystemExit("--compaction, --light-split, --split-node-fit, --as-live or --compact-every and --baseline: "
                         "the paired replays run the defaults")
    if args.live_stages != 1 and not args.as_live:
        raise SystemExit("--live-stages needs --as-live (the simulator's own dilu splits by default)")
    if args.live_stages < 1:
        raise SystemExit("--live-stages must be at least 1")
    if args.as_live and args.light_split is not None:
        raise SystemExit("--as-live: the live balancer has no light split (not with --light-split)")

    def mixes(spec: str) -> list[tuple[float, float]]:
        return [(float(a), float(b)) for a, b in (m.split(":") for m in spec.split(","))]

    load_before = _load()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in args.sizes.split(",") if x):
        big = n > 3200
        seeds = [int(x) for x in (args.big_seeds if big else args.seeds).split(",")]
        policies = (args.big_policies if big and args.big_policies else args.policies).split(",")
        for train, llm in mixes(args.big_mixes if big and args.big_mixes else args.mixes):
            for seed in seeds:
                for policy in policies:
                    r = run_one(n, train, llm, seed, policy, args.repeat, compaction, args.light_split,
                               args.split_node_fit, as_live=args.as_live, every=args.compact_every,
                               live_stages=args.live_stages)
                    child = None
                    if args.baseline is not None and policy == "dilu":
                        # This code and the baseline's, each in a child process of its own started
                        # together (the same load, and the same kind of process: a replay in this
                        # process, which imported more, ran 5-15 % slower than the same code in a
                        # child); the times reported are those of the pair, the other columns this
                        # process's run's.
                        child = start_baseline(args.baseline.resolve(), n, train, llm, seed, policy, args.repeat)
                        mine = start_baseline(ROOT, n, train, llm, seed, policy, args.repeat)
                        finish_baseline(child, r)
                        paired: dict[str, Any] = {}
                        finish_baseline(mine, paired)
                        if paired["base_decisions"] != r["decisions"]:
                            raise AssertionError(f"{n} {train}:{llm} seed {seed}: the paired replay decided otherwise")
                        r["alone_cpu_s"] = r["cpu_s"]
                        r["cpu_s"], r["wall_s"] = paired["base_cpu_s"], paired["base_wall_s"]
                        r["us_per_event"] = 1e6 * r["cpu_s"] / r["events"]
                    rows.append(r)
                    print(
                        f"{n:6d} {train:g}:{llm:g} seed {seed} {policy:10s} wall {r['wall_s']:6.2f} s "
                        f"cpu {r['cpu_s']:6.2f} s ({r['cpu_min']:.2f}–{r['cpu_max']:.2f}) "
                        f"{r['us_per_event']:6.0f} µs/ev peak {r['peak']:5d} "
                        f"peak/int {r['peak_int']:.3f} mean/int {r['mean_int']:.3f} "
                        f"cold/100 {r['cold_per_100']:.1f} compaction {r['compact_cpu_s']:.1f} s in "
                        f"{r['compact_runs']} runs (p50 {r['compact_run_p50_ms']:.1f} ms, p99 "
                        f"{r['compact_run_p99_ms']:.0f} ms, max {r['compact_run_max_ms']:.0f} ms) "
                        f"decisions {r['decisions']} load {_load()}",
                        flush=True,
                    )
                    if child is not None:
                        same = "the same decisions" if r["base_decisions"] == r["decisions"] else (
                            f"OTHER decisions {r['base_decisions']}")
                        print(f"  baseline cpu {r['base_cpu_s']:6.2f} s ({r['cpu_s'] / r['base_cpu_s']:.2f}×), {same}",
                              flush=True)
    if args.serving:
        serving(args.profiles)
    total = time.perf_counter() - t0
    load_after = _load()
    print(f"total {total:.0f} s; load average before {load_before}, after {load_after}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "cpu": cpu_model(), "rows": rows}, indent=1) + "\n",
                             encoding="utf-8")
        print(f"wrote {args.json}")
    if args.out is not None:
        cmd = "PYTHONPATH=. python3 bench/sim_scale.py " + " ".join(sys.argv[1:])
        if args.baseline is not None:
            cmd += f" (baseline: {_describe(args.baseline)})"
        text = "\n".join(
            [
                "# Placement simulation at scale",
                "",
                f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
                f"{os.cpu_count()} CPU(s), {cpu_model()}, Python {platform.python_version()}; "
                f"load average (1/5/15 min) {load_before} before, {load_after} after ({total:.0f} s in all). "
                "The machine is shared: wall times include waiting for a core; CPU seconds are the "
                "replaying process's own (`time.process_time`)"
                + ("; for `dilu`, those of this code's replay in a child process started together with "
                   "the baseline's." if args.baseline is not None else "."),
                "",
                "Traces: `dilu_mix(N, train_fraction, llm_fraction, seed)` (`dilu-invoker simulate gen "
                "placement --instances N --train-fraction T --llm-fraction L --seed S`), 40 GiB GPUs, 4 per "
                "node, the cluster sized by the simulator; "
                + (("`dilu` as the live balancer runs it (`--as-live`: "
                    + (f"LLM actions declaring `gpu-stages {args.live_stages}`" if args.live_stages > 1 else "no LLM split")
                    + ", `LIVE_COMPACTION`")
                   if args.as_live else "`dilu` with splitting and compaction (`SIM_COMPACTION`")
                + (f" with `{args.compaction}`" if args.compaction else "")
                + f") every {args.compact_every if args.compact_every is not None else 30 if args.as_live else 2:g} s "
                "of trace time"
                + (f", LLMs that would light a GPU split over lit room and one new GPU from a share of "
                   f"{args.light_split:g} on (`--light-split`)" if args.light_split is not None else "")
                + (", LLMs split over the lit GPUs of the node left with the least free memory where memory "
                   "binds (`--split-node-fit`)"
                   if args.split_node_fit else "")
                + ", the baselines without. Bounds: fractional "
                "max(⌈Σ request⌉, ⌈Σ memory / 40 GiB⌉, widest) and integral (also at least one GPU per "
                "training slot over half a GPU), docs/simulator.md.",
                "",
                markdown(rows),
                "",
            ]
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
