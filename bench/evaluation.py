"""Produce docs/evaluation.md and its figures from the traces in examples/.

    PYTHONPATH=. python3 bench/evaluation.py [--jobs 2] [--profiles FILE] [--quick]

* Placement: examples/placement/dilu-mix-{100..3200}.jsonl.gz (Dilu's mix, 40 GiB GPUs, 4 per node),
  every policy; the lower bound on lit GPUs and each policy's peak and time-mean against it; an
  ablation of dilu's splitting and compaction, baselines given the same compaction, the mix with 10%
  training, and an offline reference packing of the live set at the bound's peak.
* Serving: examples/serving/azure-day.jsonl.gz (100 functions, one day, 64 GPUs) and
  examples/serving/bursty.jsonl.gz (10 functions, one hour, 16 GPUs), every policy.

Profiles: examples/profiles.json when it exists and is measured, else the SYNTHETIC fixture
tests/sim/data/synthetic_profiles.json (the document then says so at the top of the serving part).
`--quick` runs the serving traces on their first two hours only (a smoke test; the document says so).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dilu_invoker.policy import (
    ClusterSnapshot,
    InstanceClass,
    PlacementConfig,
    PlacementRequest,
    apply_placement,
    lit_gpu_lower_bound,
    place,
)
from dilu_invoker.policy.live_compaction import live_compaction_config
from dilu_invoker.sim import report
from dilu_invoker.sim.cli import DILU_COMPACT_EVERY_S
from dilu_invoker.sim.events import GIB, PlacementEvent, load_events
from dilu_invoker.sim.placement import (
    PLACEMENT_POLICIES,
    SIM_COMPACTION,
    PlacementSimConfig,
    live_placement_config,
    simulate_placement,
)
from dilu_invoker.sim.profiles import load_profiles
from dilu_invoker.sim.serving import (
    SERVING_POLICIES,
    ServingSimConfig,
    simulate_serving,
)
from dilu_invoker.sim.traces import FunctionTrace, ServingTrace, load_trace

SIZES = (100, 200, 400, 800, 1600, 3200)
GPU_GIB = 40.0
NODE = 4
COMPACT = SIM_COMPACTION
LIVE = live_placement_config()
"""`dilu` as the live balancer runs it by default (the ablation's last row)."""
LIVE_LABEL = "dilu as the live balancer runs it (`--as-live`)"
LIVE_STAGES = 4
LIVE_STAGES_LABEL = f"… with the LLM actions declaring `gpu-stages {LIVE_STAGES}` (`--as-live --llm-split-parts {LIVE_STAGES}`)"
#: the live compaction flags with which the live balancer packs as `dilu` does (docs/benchmarks/sim-scale.md, round 26)
LIVE_FLAGS = live_compaction_config(max_moves=64, max_request=1.0, merges=1)
LIVE_FLAGS_EVERY_S = 2.0
LIVE_FLAGS_LABEL = ("… and `--balancer-compaction-max-request 1.0 --balancer-compaction-merges 1 "
                    "--balancer-compaction-max-moves 64 --balancer-compaction-period-s 2`")
SERVING = (
    ("azure-day", "examples/serving/azure-day.jsonl.gz", 64, "an Azure-style day: 100 functions, 24 h"),
    ("bursty", "examples/serving/bursty.jsonl.gz", 16, "a bursty hour: 10 functions, 5× bursts"),
)
STATIC_BASELINES = ("exclusive", "infless-l", "infless-r", "fastgs")
GAMMAS = (1.5, 2.0, 3.0)
"""Σ-limit bounds γ for extra dilu runs on the serving traces (the default run has none)."""
CALIBRATION = Path("docs/benchmarks/data/colocation_fit.json")
"""The co-location slowdown κ fitted to the H200 matrix (bench/fit_colocation.py); the serving runs use it."""


def fitted_kappa(path: Path = CALIBRATION) -> tuple[float, str]:
    """κ for the serving runs and where it comes from: the fit when it has been run, else the model's 0.1."""
    if (ROOT / path).exists():
        fit = json.loads((ROOT / path).read_text())["fit"]
        return float(fit["kappa"]), (f"fitted to the H200 matrix ({fit['summary']['kappa_gpu']['n']} static-MPS "
                                     f"trials, `{path}`; docs/benchmarks/colocation-fit.md)")
    return 0.1, "assumed (no fit in this checkout)"


def _placement_config(policy: str, **kw: Any) -> PlacementSimConfig:
    base: dict[str, Any] = {
        "policy": policy,
        "gpu_memory_gib": GPU_GIB,
        "gpus_per_node": NODE,
        "compact_every_s": DILU_COMPACT_EVERY_S if policy == "dilu" else 0.0,
        "compaction": COMPACT,
    }
    base.update(kw)
    return PlacementSimConfig(**base)


def _run_placement(task: tuple[str, str, str, dict[str, Any]]) -> dict[str, Any]:
    label, path, policy, kw = task
    events = load_events(ROOT / path)
    r = simulate_placement(events, _placement_config(policy, **kw))
    xs = [s.t / 60.0 for s in r.samples]
    return {
        "label": label,
        "path": path,
        "policy": policy,
        "summary": r.summary,
        "details": r.details,
        "lit": report.downsample(xs, [s.lit_gpus for s in r.samples], 1500),
        "bound": report.downsample(xs, [s.lower_bound for s in r.samples], 1500),
    }


def _run_serving(task: tuple[str, str, int, str, bool, float]) -> dict[str, Any]:
    name, path, gpus, profiles_path, quick, kappa = task
    profiles = load_profiles(ROOT / profiles_path)
    trace = load_trace(ROOT / path, profiles)
    if quick:
        trace = _head(trace, 7200.0)
    results = {}
    for policy in SERVING_POLICIES:
        r = simulate_serving(trace, profiles, ServingSimConfig(policy=policy, gpus=gpus, seed=1, interference=kappa))
        results[policy] = {
            "summary": r.summary,
            "details": r.details,
            "lit": report.downsample([row[0] / 3600.0 for row in r.samples], [row[1] for row in r.samples], 1500),
        }
    gammas = {}
    for gamma in GAMMAS:
        r = simulate_serving(trace, profiles, ServingSimConfig(policy="dilu", gpus=gpus, seed=1, gamma=gamma,
                                                               interference=kappa))
        gammas[gamma] = {"summary": r.summary, "details": r.details}
    return {"name": name, "requests": trace.requests, "functions": len(trace.functions), "jobs": len(trace.jobs),
            "duration_s": trace.duration_s, "results": results, "gammas": gammas}


def _head(trace: ServingTrace, seconds: float) -> ServingTrace:
    fns = []
    for f in trace.functions:
        bins = max(1, int(seconds // f.bin_s))
        fns.append(FunctionTrace(f.name, f.profile, f.counts[:bins], f.bin_s, f.start_s, f.slo_ms, f.meta))
    jobs = tuple(replace(j, end_s=min(j.end_s, seconds)) for j in trace.jobs if j.start_s < seconds)
    return ServingTrace(seconds, tuple(fns), jobs, trace.source + " (first 2 h)")


# -- analysis of the 3,200-instance trace ------------------------------------------------------------


def bound_peak_moment(events: Sequence[PlacementEvent]) -> tuple[float, dict[str, Any]]:
    """The live instances at the moment the issue's bound peaks (first such moment)."""
    live: dict[str, Any] = {}
    best_t, best_b, best_live = 0.0, -1, {}
    cap = GPU_GIB * GIB
    for e in events:
        if e.spec is not None:
            live[e.instance] = e.spec
        else:
            live.pop(e.instance, None)
        b = lit_gpu_lower_bound(
            sm_request=sum(s.gpus * s.sm_request for s in live.values()),
            memory_mib=sum(s.gpus * s.memory_mib for s in live.values()),
            memory_capacity_mib=cap,
            widest=max((s.gpus for s in live.values()), default=0),
        )
        if b > best_b:
            best_t, best_b, best_live = e.t, b, dict(live)
    return best_t, {"bound": best_b, "live": best_live}


def offline_reference(live: dict[str, Any], split: bool) -> int:
    """The live set placed at once, biggest first (training gangs, inference by size, then LLMs,
    split when they would light a GPU) by the dilu policy: what knowing the future buys."""
    n = sum(s.gpus for s in live.values())
    nodes = math.ceil(n * 1.3 / NODE) + 2
    cl = ClusterSnapshot.uniform(invokers=nodes, gpus_per_invoker=NODE, memory_mib=GPU_GIB * GIB)
    conf = PlacementConfig(strategy="dilu", llm_max_parts=NODE if split else 1)
    order = {InstanceClass.TRAINING: 0, InstanceClass.INFERENCE: 1, InstanceClass.LLM: 2}
    for s in sorted(live.values(), key=lambda s: (order[s.cls], -s.gpus * s.memory_mib, s.instance)):
        req = PlacementRequest(instance_id=s.instance, function=s.function, cls=s.cls, request=s.sm_request,
                               limit=s.sm_limit, memory_mib=s.memory_mib, gpus=s.gpus)
        d = place(cl, req, conf)
        if not d.placed:
            raise RuntimeError(f"offline reference: {d.reason}")
        cl = apply_placement(cl, req, d)
    return cl.lit_count


def big_slots(live: dict[str, Any]) -> int:
    """GPU slots of training gangs holding more than half a GPU's memory: no two can share a GPU and
    a gang's slot is never split, so any placement lights at least this many GPUs."""
    return sum(
        s.gpus for s in live.values() if s.cls is InstanceClass.TRAINING and s.mem_gib_per_gpu > GPU_GIB / 2
    )


# -- the document ----------------------------------------------------------------------------------


def calibration_note(path: Path = CALIBRATION) -> list[str]:
    """Where the serving runs' κ comes from, in a paragraph."""
    if not (ROOT / path).exists():
        return ["**Model.** No fit of the co-location slowdown in this checkout: the serving runs use the assumed "
                "κ 0.1 (`bench/fit_colocation.py` fits it to the H200 matrix).", ""]
    fit = json.loads((ROOT / path).read_text())["fit"]
    ci = fit["summary"]["kappa_gpu"].get("ci90")
    return [f"**Calibrated model.** κ = {fit['kappa']:.3f}"
            + (f" (90% interval {ci[0]:.2f}–{ci[1]:.2f})" if ci else "")
            + f", fitted to the H200 matrix (`bench/fit_colocation.py`, {fit['summary']['kappa_gpu']['n']} static-MPS "
            "trials; docs/benchmarks/colocation-fit.md, which also has the sensitivity to κ and the reduced-trace "
            "comparison that led to admission by request).", ""]


def _ok(cond: bool) -> str:
    return "✓ met" if cond else "✗ not met"


def placement_table(rows: list[dict[str, Any]]) -> str:
    cols = ["policy", "peak", "bound peak", "peak / bound", "mean", "bound mean", "mean / bound",
            "integral peak", "peak / integral", "mean / integral",
            "SM frag", "mem frag", "LLMs split", "moves", "cold starts", "sim time"]
    body = []
    for r in rows:
        s, d = r["summary"], r["details"]
        body.append([
            r.get("name", r["policy"]), s["gpus_peak"], d["lower_bound_peak"], f"{d['peak_vs_bound']:.3f}×",
            f"{d['gpus_mean']:.1f}", f"{d['lower_bound_mean']:.1f}", f"{d['mean_vs_bound']:.3f}×",
            d["integral_bound_peak"], f"{d['peak_vs_integral']:.3f}×", f"{d['mean_vs_integral']:.3f}×",
            f"{s['sm_fragmentation_mean']:.3f}", f"{s['mem_fragmentation_mean']:.3f}", d["split_instances"],
            d["compaction_moves"], d.get("compaction_cold_starts", d["compaction_moves"]), f"{d['wall_s']:.2f} s",
        ])
    return report.markdown_table(cols, body)


def gamma_table(s: dict[str, Any]) -> str:
    cols = ["dilu γ", "req per GPU-s", "SLO violations", "p99 ms", "cold starts", "GPUs peak", "GPU-hours", "training samples/s"]
    rows = [("none (default)", s["results"]["dilu"])] + [(f"{g:g}", s["gammas"][g]) for g in GAMMAS]
    body = []
    for g, r in rows:
        x = r["summary"]
        body.append([g, f"{x['throughput_per_gpu']:.3f}", f"{100 * x['slo_violation_rate']:.2f}%",
                     f"{x['latency_p99_ms']:.1f}", x["cold_starts"], x["gpus_peak"], f"{x['gpu_seconds'] / 3600:.1f}",
                     f"{x['training_samples_per_s']:.0f}"])
    return report.markdown_table(cols, body)


def serving_table(res: dict[str, Any]) -> str:
    cols = ["policy", "completed", "dropped", "req/s", "req per GPU-s", "× exclusive", "SLO violations",
            "p50 ms", "p99 ms", "cold starts", "GPUs peak", "GPU-hours", "SM frag", "training samples/s", "sim time"]
    ex = res["exclusive"]["summary"]["throughput_per_gpu"] or math.nan
    body = []
    for p in SERVING_POLICIES:
        s, d = res[p]["summary"], res[p]["details"]
        body.append([
            p, s["completed"], s["dropped"], f"{s['throughput']:.1f}", f"{s['throughput_per_gpu']:.3f}",
            f"{s['throughput_per_gpu'] / ex:.2f}×", f"{100 * s['slo_violation_rate']:.2f}%",
            f"{s['latency_p50_ms']:.1f}", f"{s['latency_p99_ms']:.1f}", s["cold_starts"], s["gpus_peak"],
            f"{s['gpu_seconds'] / 3600:.1f}", f"{s['sm_fragmentation_mean']:.3f}",
            f"{s['training_samples_per_s']:.0f}", f"{d['wall_s']:.0f} s",
        ])
    return report.markdown_table(cols, body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=min(2, multiprocessing.cpu_count()))
    ap.add_argument("--profiles", default=None, help="default: examples/profiles.json if measured, else the synthetic fixture")
    ap.add_argument("--quick", action="store_true", help="serving traces: first two hours only")
    ap.add_argument("--doc", default="docs/evaluation.md")
    ap.add_argument("--figures", default="docs/evaluation")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--interference", type=float, default=None,
                    help="co-location slowdown κ of the serving runs (default: the H200 fit, else 0.1)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    profiles_path = args.profiles
    if profiles_path is None:
        measured = ROOT / "examples/profiles.json"
        profiles_path = "examples/profiles.json" if measured.exists() and not load_profiles(measured).synthetic else "tests/sim/data/synthetic_profiles.json"
    profiles = load_profiles(ROOT / profiles_path)
    fig_dir = ROOT / args.figures
    fig_dir.mkdir(parents=True, exist_ok=True)

    big = "examples/placement/dilu-mix-3200.jsonl.gz"
    tasks: list[tuple[str, str, str, dict[str, Any]]] = []
    for n in SIZES:
        for p in PLACEMENT_POLICIES:
            tasks.append((f"size-{n}", f"examples/placement/dilu-mix-{n}.jsonl.gz", p, {}))
    ablation: list[tuple[str, str, dict[str, Any]]] = [
        ("dilu, no split, no compaction", "dilu", {"llm_split_parts": 1, "compact_every_s": 0.0}),
        ("dilu, split only", "dilu", {"compact_every_s": 0.0}),
        ("dilu, compaction only", "dilu", {"llm_split_parts": 1}),
        ("dilu, split + compaction (default)", "dilu", {}),
        ("infless-r + the same compaction", "infless-r", {"compact_every_s": DILU_COMPACT_EVERY_S}),
        ("fastgs + the same compaction", "fastgs", {"compact_every_s": DILU_COMPACT_EVERY_S}),
        (LIVE_LABEL, "dilu",
         {"llm_split_parts": LIVE.llm_split_parts, "compact_every_s": LIVE.compact_every_s,
          "compaction": LIVE.compaction, "compaction_splits": LIVE.compaction_splits,
          "whole_mib_stages": LIVE.whole_mib_stages}),
        (LIVE_STAGES_LABEL, "dilu",
         {"llm_split_parts": LIVE_STAGES, "compact_every_s": LIVE.compact_every_s,
          "compaction": LIVE.compaction, "compaction_splits": LIVE.compaction_splits,
          "whole_mib_stages": LIVE.whole_mib_stages}),
        (LIVE_FLAGS_LABEL, "dilu",
         {"llm_split_parts": LIVE_STAGES, "compact_every_s": LIVE_FLAGS_EVERY_S,
          "compaction": LIVE_FLAGS, "compaction_splits": LIVE_FLAGS.move_pieces,
          "whole_mib_stages": LIVE.whole_mib_stages}),
    ]
    for name, p, kw in ablation:
        tasks.append((f"ablation:{name}", big, p, kw))
    t10 = "examples/placement/dilu-mix-3200-train10.jsonl.gz"
    for p in ("exclusive", "infless-l", "infless-r", "fastgs"):
        tasks.append((f"train10:{p}", t10, p, {}))
    tasks.append(("train10:dilu (default: no γ)", t10, "dilu", {}))
    tasks.append(("train10:dilu (γ 1.5)", t10, "dilu", {"gamma": 1.5}))
    tasks.append(("train10:dilu (γ 2.0)", t10, "dilu", {"gamma": 2.0}))

    kappa, kappa_from = fitted_kappa() if args.interference is None else (args.interference, "given (--interference)")
    serving_tasks = ([(n, path, g, profiles_path, args.quick, kappa) for n, path, g, _ in SERVING]
                     if not args.skip_serving else [])
    with multiprocessing.get_context("fork").Pool(max(1, args.jobs)) as pool:
        serving_async = [pool.apply_async(_run_serving, (t,)) for t in serving_tasks]
        placed = pool.map(_run_placement, tasks)
        served = [a.get() for a in serving_async]

    by_label: dict[str, list[dict[str, Any]]] = {}
    for r in placed:
        by_label.setdefault(r["label"], []).append(r)
    # -- figures
    big_runs = {r["policy"]: r for r in by_label["size-3200"]}
    series = {"lower bound": big_runs["dilu"]["bound"]}
    series.update({p: big_runs[p]["lit"] for p in PLACEMENT_POLICIES})
    report.plot_series(fig_dir / "placement_lit_gpus_3200.png", series, title="Lit GPUs, 3,200-instance Dilu mix (40 GiB GPUs)",
                       xlabel="trace time (min)", ylabel="lit GPUs", styles={"lower bound": "--"})
    ratio_series = {
        p: ([float(n) for n in SIZES], [next(r for r in by_label[f"size-{n}"] if r["policy"] == p)["details"]["peak_vs_bound"] for n in SIZES])
        for p in PLACEMENT_POLICIES
    }
    report.plot_series(fig_dir / "placement_peak_vs_bound.png", ratio_series, title="Peak lit GPUs / lower bound",
                       xlabel="instances in the trace", ylabel="peak / bound", step=False)
    frag = {p: [next(r for r in by_label[f"size-{n}"] if r["policy"] == p)["summary"]["sm_fragmentation_mean"] for n in SIZES]
            for p in PLACEMENT_POLICIES}
    report.plot_bars(fig_dir / "placement_sm_fragmentation.png", [str(n) for n in SIZES], frag,
                     title="SM fragmentation (time-mean over lit GPUs of 1 − Σ sm_request)", ylabel="SM fragmentation")
    for s in served:
        report.plot_series(fig_dir / f"serving_{s['name']}_lit_gpus.png", {p: s["results"][p]["lit"] for p in SERVING_POLICIES},
                           title=f"Lit GPUs: {s['name']}", xlabel="time (h)", ylabel="lit GPUs")
        report.plot_bars(fig_dir / f"serving_{s['name']}.png", list(SERVING_POLICIES),
                         {"requests per GPU-second": [s["results"][p]["summary"]["throughput_per_gpu"] for p in SERVING_POLICIES]},
                         title=f"Throughput per GPU: {s['name']}", ylabel="completed requests / GPU-s")

    # -- analysis of the 3,200 trace
    events = load_events(ROOT / big)
    t_peak, at_peak = bound_peak_moment(events)
    live = at_peak["live"]
    slots = big_slots(live)
    offline_split = offline_reference(live, split=True)
    offline_plain = offline_reference(live, split=False)

    # -- document
    d32 = big_runs["dilu"]
    dd, ds = d32["details"], d32["summary"]
    ex = big_runs["exclusive"]["summary"]
    fewer = 1 - ds["gpus_peak"] / ex["gpus_peak"]
    frag_ok = all(ds["sm_fragmentation_mean"] < big_runs[p]["summary"]["sm_fragmentation_mean"] for p in STATIC_BASELINES)
    live_row = next(r for r in placed if r["label"] == f"ablation:{LIVE_LABEL}")["details"]
    staged_row = next(r for r in placed if r["label"] == f"ablation:{LIVE_STAGES_LABEL}")["details"]
    flags_row = next(r for r in placed if r["label"] == f"ablation:{LIVE_FLAGS_LABEL}")["details"]
    figs = Path(args.figures).relative_to(Path(args.doc).parent) if Path(args.figures).is_relative_to(Path(args.doc).parent) else Path(args.figures)
    L: list[str] = []
    L += [
        "# Evaluation",
        "",
        ("Generated by `PYTHONPATH=. python3 bench/evaluation.py` "
        f"({time.strftime('%Y-%m-%d', time.gmtime())}, {time.perf_counter() - t0:.0f} s on this machine with "
        f"{args.jobs} worker process(es); the \"sim time\" columns are wall times with the workers sharing the "
        "CPUs, `bench/sim_scale.py` times one simulation at a time); every number below comes from that run. "
        "The simulators run the live "
        "policy code (`dilu_invoker/policy`); how they work, and the performance model of the serving simulation, "
        "is in [simulator.md](simulator.md). The traces are in `examples/` (regenerate: `examples/regenerate.sh`)."),
        "",
        "## Targets (issue 7)",
        "",
        "| target | measured (3,200-instance trace; serving traces) | |",
        "| --- | --- | --- |",
        f"| `dilu` within 1.05× of the lower bound at peak | {dd['peak_vs_bound']:.3f}× ({ds['gpus_peak']} vs {dd['lower_bound_peak']}) | {_ok(dd['peak_vs_bound'] <= 1.05)} |",
        f"| … and on the time-mean | {dd['mean_vs_bound']:.3f}× ({dd['gpus_mean']:.1f} vs {dd['lower_bound_mean']:.1f}) | {_ok(dd['mean_vs_bound'] <= 1.05)} |",
        f"| ≥ 30% fewer peak GPUs than `exclusive` | {100 * fewer:.1f}% fewer ({ds['gpus_peak']} vs {ex['gpus_peak']}) | {_ok(fewer >= 0.30)} |",
        f"| lower SM fragmentation than every static baseline | {ds['sm_fragmentation_mean']:.3f} vs "
        + ", ".join(f"{p} {big_runs[p]['summary']['sm_fragmentation_mean']:.3f}" for p in STATIC_BASELINES)
        + f" | {_ok(frag_ok)} |",
    ]
    for s in served:
        res = s["results"]
        tput = res["dilu"]["summary"]["throughput_per_gpu"] / (res["exclusive"]["summary"]["throughput_per_gpu"] or math.nan)
        v_d, v_m = res["dilu"]["summary"]["slo_violation_rate"], res["mps-static"]["summary"]["slo_violation_rate"]
        L.append(f"| serving ({s['name']}): ≥ 1.5× the throughput per GPU of `exclusive` | {tput:.2f}× | {_ok(tput >= 1.5)} |")
        L.append(f"| serving ({s['name']}): SLO violations ≤ `mps-static` | {100 * v_d:.2f}% vs {100 * v_m:.2f}% | {_ok(v_d <= v_m)} |")
    L += [
        "",
        (f"Compaction's price: {dd['compaction_moves']} moves on the 3,200-instance trace, "
        f"{dd['compaction_cold_starts']} cold starts (make-before-break: the replacement starts before the original "
        "stops; a move that places a split LLM anew starts each of its stages), "
        f"{100 * dd['compaction_cold_starts'] / ds['instances']:.1f} per 100 instances; {dd['split_instances']} LLM "
        "placements were split over GPUs of one node."),
        "",
        (f"These are the simulator's `dilu`, which splits LLMs over GPUs and compacts every 2 s. The live balancer "
        f"compacts less by default (`LIVE_COMPACTION`, 2 moves every 30 s; it moves pipeline stages and splits what "
        f"it moves as `dilu` does: docs/balancer.md, \"Stage moves\") and splits only the LLMs of "
        f"actions that declare `gpu-stages` (docs/balancer.md, \"Split instances\"). With its defaults and no such "
        f"action this trace peaks at {live_row['peak_vs_bound']:.3f}× the bound and averages "
        f"{live_row['mean_vs_bound']:.3f}× (the ablation's third-last row); with every LLM action declaring "
        f"`gpu-stages {LIVE_STAGES}`, {staged_row['peak_vs_bound']:.3f}× and {staged_row['mean_vs_bound']:.3f}× (its "
        f"second-last row). So with stages the live product "
        f"{'meets' if max(staged_row['peak_vs_bound'], staged_row['mean_vs_bound']) <= 1.05 else 'does not meet'} "
        f"the first two targets with its defaults; with the compaction flags of the last row it packs "
        f"{flags_row['peak_vs_bound']:.3f}× and {flags_row['mean_vs_bound']:.3f}× "
        f"({100 * flags_row['compaction_cold_starts'] / ds['instances']:.1f} cold starts per 100 instances), and "
        f"{'meets' if max(flags_row['peak_vs_bound'], flags_row['mean_vs_bound']) <= 1.05 else 'does not meet'} "
        "them; docs/benchmarks/sim-scale.md (twenty-fourth to thirtieth "
        "rounds) has every mix, the twenty-sixth and twenty-seventh the trade-off curve of those flags, and the "
        "thirtieth the packing-first flags with which every default mix is within 1.03× of the integral bound "
        "(training actions as gangs, `gpu-count`)."),
        "",
        "### How close to the bound can a placement get on this mix",
        "",
        (f"The bound is a fractional relaxation: max(⌈Σ gpus·sm_request⌉, ⌈Σ gpus·memory / 40 GiB⌉, widest). On "
        f"Dilu's mix memory binds, and most memory comes in pieces larger than half a GPU. At the moment the bound "
        f"peaks (t = {t_peak:.0f} s, bound {at_peak['bound']}), training gangs hold {slots} GPU slots of 25–40 "
        f"GiB each: no two fit one 40 GiB GPU and a gang's slot is never split, so **no placement whatsoever can "
        f"light fewer than {slots} GPUs ({slots / at_peak['bound']:.3f}× the bound)**. Every other instance — "
        "LLMs of 20–30 GiB included — must then fit into the 0–15 GiB holes those slots leave, on the right "
        "node, within Σ request ≤ 1; an LLM fits only if split over several GPUs of one node."),
        "",
        (f"An offline reference — the same live set placed all at once by the dilu policy, biggest first "
        f"(training gangs, then inference, then LLMs, split when they would light a GPU) — lights "
        f"{offline_split} GPUs ({offline_split / at_peak['bound']:.3f}× the bound); without splitting "
        f"{offline_plain} ({offline_plain / at_peak['bound']:.3f}×). The online policy sees instances in random "
        f"order, one per second, and departures reopen holes; compaction after each departure (every "
        f"{DILU_COMPACT_EVERY_S:g} s of trace time at most) closes them, moving pieces of split LLMs too, and "
        f"the online policy peaks at {ds['gpus_peak']} ({dd['peak_vs_bound']:.3f}×) and averages "
        f"{dd['gpus_mean']:.1f} ({dd['mean_vs_bound']:.3f}×), paid for in the cold starts above."),
        "",
        "## Placement",
        "",
        ("Dilu's mix (`dilu-invoker simulate gen placement --instances N --train-fraction 0.2 --seed 1`): 20% "
        "LLM inference, 20% 2- or 4-GPU training jobs, the rest small inference; one create per second; 60% of "
        "the instances leave after 1–3 min, 10% (training) after 10–15 min. 40 GiB GPUs, 4 per node, a cluster "
        "big enough for every policy (no rejections). `dilu`: split LLMs over up to 4 GPUs of a node, compaction "
        f"after departures, at most every {DILU_COMPACT_EVERY_S:g} s of trace time (lit GPUs with Σ request ≤ 1 and at most 3 "
        "instances, pieces of split LLMs included, 64 per run); baselines as "
        "defined (no splitting, no compaction). Ratios are to the issue's lower bound, computed from the live "
        "instances of the trace at every event."),
        "",
        ("For reference, on the Dilu artifact's own 3,200-instance trace the issue reports: bound 1,151 peak / 746 "
        "mean; the artifact's Dilu scheduler 1,322 / 869 (1.15× / 1.16×); static-at-request 1,356 / 890; "
        "exclusive 1,879 / 1,207. Our generator follows the artifact's description (same mix and lifetimes, our "
        "own random draws): bound "
        f"{dd['lower_bound_peak']} / {dd['lower_bound_mean']:.0f}."),
        "",
    ]
    for n in SIZES:
        rows = by_label[f"size-{n}"]
        first = rows[0]
        L += [f"### {n} instances (`examples/placement/dilu-mix-{n}.jsonl.gz`, {first['summary']['events']} events)", "",
              placement_table(rows), ""]
    L += [
        f"![lit GPUs over time]({figs}/placement_lit_gpus_3200.png)",
        "",
        f"![peak / bound by trace size]({figs}/placement_peak_vs_bound.png)",
        "",
        f"![SM fragmentation by trace size]({figs}/placement_sm_fragmentation.png)",
        "",
        "### Ablation on the 3,200-instance trace",
        "",
        ("What each part of `dilu` contributes, the baselines given the same compaction (a fairer comparison of "
        "packing alone), and `dilu` as the live balancer runs it by default: `LIVE_COMPACTION` every 30 s, one-GPU "
        "instances only when no LLM action declares `gpu-stages`, and LLMs split into pipeline stages (which "
        "compaction may move) when every one does (`simulate placement --as-live [--llm-split-parts N]`; what a "
        "live cluster packs on every mix: docs/benchmarks/sim-scale.md, twenty-fourth to thirtieth rounds):"),
        "",
    ]
    abl_rows = []
    for r in placed:
        if r["label"].startswith("ablation:"):
            abl_rows.append({**r, "name": r["label"].split(":", 1)[1]})
    L += [placement_table(abl_rows), ""]
    t10_rows = [{**r, "name": r["label"].split(":", 1)[1]} for r in placed if r["label"].startswith("train10:")]
    L += [
        "### Fewer training jobs (10%): SM binds, and a Σ-limit bound would",
        "",
        ("`examples/placement/dilu-mix-3200-train10.jsonl.gz`. With half the training jobs the SM requests bind "
        "instead of memory. By default `dilu` admits by Σ request ≤ 1 (and memory) as `infless-r` does; an "
        "operator's Σ-limit bound γ (`--gpu-gamma`, docs/policies.md §2 \"Admission by request\") would bind "
        "first here, since the mix's limits are request + 0.2 or more: γ = 1.5 and 2 show what that headroom "
        "for bursts costs in GPUs."),
        "",
        placement_table(t10_rows),
        "",
    ]
    if served:
        L += ["## Serving", ""]
        if profiles.synthetic:
            L += [
                ("> **These serving results use the SYNTHETIC profile fixture "
                f"(`{profiles_path}`: a latency formula, not measurements).** They show the mechanisms, not H200 "
                "performance. Once `bench/profile_h200.sh` has run and `examples/profiles.json` holds the measured "
                "profiles, `PYTHONPATH=. python3 bench/evaluation.py` regenerates this document with them (same "
                "profile names)."),
                "",
            ]
        else:
            L += [f"Profiles: `{profiles_path}` ({profiles.source}).", ""]
        if args.quick:
            L += ["> `--quick`: only the first two hours of each serving trace were simulated.", ""]
        L += [
            ("Every policy uses the same horizontal policy (`decide_scale`, 1 s tick, 40 s window, scale to zero after "
            f"600 s idle), cold starts of 5 s, requests dropped after waiting 30 s, co-location interference κ = {kappa:.3f} "
            f"({kappa_from}); "
            "placement by each policy's strategy (`exclusive`: whole GPUs; `mps-static`: `infless-r`, share fixed at "
            "the request, spatial; `static-quota`: `infless-l`, a time quota fixed at the limit; `tgs`: one production "
            "and one opportunistic instance per GPU, priority; `dilu`: the live placement, vertical and horizontal "
            "policies and the live balancer's compaction, a run every 30 s of at most 2 make-before-break moves, "
            "each a cold start; the baselines never compact). A request violates its SLO when it completes later than the SLO after arriving, or is dropped. "
            "Throughput per GPU is completed requests per lit-GPU-second."),
            "",
            ("Reading the tables: `mps-static` and `dilu` admit alike (Σ request ≤ 1 and memory); `mps-static` pins "
             "each instance at its request, `dilu` lets it run up to its limit out of its neighbours' idle share, so "
             "under bursts the pinned instances queue, scale out and cold-start while `dilu` absorbs the burst up to "
             "the limits. A Σ-limit bound γ (the `dilu γ` tables) reserves that headroom at placement and lights "
             "more GPUs for it, since the profiled limits are several times the requests. Most "
             "violations at light load are requests that arrive at a function scaled to zero and wait for a cold "
             "start (the same horizontal policy for all). `exclusive` and `tgs` cannot give 100 functions a GPU "
             "each on 64 GPUs: functions without an instance time out. The `<request, limit>` of each function "
             "come from the profiler's search over the measured points, the limit at the knee (`limit_gain` 0.10, "
             "docs/simulator.md §4)."),
            "",
            *calibration_note(),
        ]
        for s, (name, path, gpus, what) in zip(served, SERVING, strict=True):
            L += [
                f"### {what} on {gpus} GPUs (`{path}`)",
                "",
                (f"{s['functions']} functions, {s['jobs']} training jobs, {s['requests']:,} requests over "
                f"{s['duration_s'] / 3600:.1f} h."),
                "",
                serving_table(s["results"]),
                "",
                f"![throughput per GPU]({figs}/serving_{name}.png)",
                "",
                f"![lit GPUs]({figs}/serving_{name}_lit_gpus.png)",
                "",
                "`dilu` with a Σ-limit bound γ: burst headroom reserved at placement against GPUs lit.",
                "",
                gamma_table(s),
                "",
            ]
    L += [
        '## Beyond this page: the GPU measurements and the reviewer questions',
        '',
        "This page is the simulators' view. What was measured on the GPU, through the product, and the answers to the questions a reviewer asks of vertical scaling live beside it (each with its commands and raw data):",
        '',
        '* the workload matrix, dominance against static MPS splits and no control, trial by trial: [benchmarks/gpu-product.md](benchmarks/gpu-product.md);',
        '* the absorption limit of vertical scaling (how high and how long a burst one instance holds, and how the horizontal scaler is told), how the `spatial` default differs from TGS, and interference an SM share cannot fix (a memory-bandwidth-bound neighbour): [policies.md](policies.md) §1.1.1, with runs M22, M25 and M27–M29 in gpu-product.md;',
        '* the co-location model these serving runs use, fitted to that matrix: [benchmarks/colocation-fit.md](benchmarks/colocation-fit.md);',
        '* the serving comparison over seeds, `dilu` with and without live compaction against `mps-static` with and without it: [benchmarks/serving-seeds-compaction.md](benchmarks/serving-seeds-compaction.md); placement at cluster scale: [benchmarks/sim-scale.md](benchmarks/sim-scale.md).',
        '',
        "## Reproduce",
        "",
        "```",
        "examples/regenerate.sh                         # the traces (deterministic)",
        "PYTHONPATH=. python3 bench/evaluation.py       # this document and docs/evaluation/*.png",
        "dilu-invoker simulate placement --events examples/placement/dilu-mix-3200.jsonl.gz --policy all --gpu-memory-gib 40 --out out/p3200",
        f"dilu-invoker simulate serving --trace examples/serving/azure-day.jsonl.gz --profiles {profiles_path} --policy all --gpus 64 --out out/day",
        f"dilu-invoker simulate serving --trace examples/serving/bursty.jsonl.gz --profiles {profiles_path} --policy all --gpus 16 --out out/bursty",
        "```",
        "",
    ]
    (ROOT / args.doc).write_text("\n".join(L), encoding="utf-8")
    print(f"wrote {args.doc} and {args.figures}/ in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
