"""`dilu-invoker simulate placement|serving|gen …` (docs/simulator.md)."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("out")
#: dilu's default compaction period (seconds of trace time); baselines never compact unless asked.
DILU_COMPACT_EVERY_S = 2.0


class CliError(Exception):
    """Bad input: printed as one line, exit status 2."""


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    return parse


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _fraction(text: str) -> float:
    v = _nonneg_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _vertical_policy(text: str) -> str:
    from dilu_invoker.policy.vertical_slo import VERTICAL_POLICIES, check_policy_name

    try:
        check_policy_name(text, choices=VERTICAL_POLICIES, flag="policy")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _compact(text: str) -> float | None:
    return None if text == "auto" else _nonneg_float(text)


def build_parser() -> argparse.ArgumentParser:
    from dilu_invoker.policy.vertical_slo import VERTICAL_POLICIES
    from dilu_invoker.sim.generate import PATTERNS
    from dilu_invoker.sim.placement import PLACEMENT_POLICIES
    from dilu_invoker.sim.serving import SERVING_POLICIES

    parser = argparse.ArgumentParser(
        prog="dilu-invoker simulate",
        description="Trace-driven simulation of the live placement, vertical and horizontal policies "
        "against baselines (docs/simulator.md).",
    )
    sub = parser.add_subparsers(dest="what", metavar="placement|serving|gen", required=True)

    p = sub.add_parser("placement", help="replay instance create/delete events through a placement policy")
    p.add_argument("--events", required=True, type=Path, help="JSON-lines event file")
    p.add_argument("--policy", required=True, choices=[*PLACEMENT_POLICIES, "all"])
    p.add_argument("--gpu-memory-gib", type=_positive(float), default=80.0)
    p.add_argument("--out", type=Path, default=None, help="output directory (default out/placement)")
    p.add_argument("--gpus", type=_positive(int), default=None, help="cluster size (default: enough for the trace)")
    p.add_argument("--gpus-per-node", type=_positive(int), default=4)
    p.add_argument("--gamma", type=_positive(float), default=math.inf,
                   help="dilu's Σ-limit bound γ per GPU (default: none, admission by request; Dilu's 1.5 reserves "
                        "burst headroom)")
    p.add_argument(
        "--llm-split-parts",
        type=_positive(int),
        default=None,
        help="dilu splits an LLM's memory over up to N GPUs of one node when it would light a GPU (default 4; "
             "1: never)",
    )
    p.add_argument(
        "--compact-every",
        type=_compact,
        default=None,
        metavar="SECONDS|auto",
        help=f"compaction period in trace seconds; auto: {DILU_COMPACT_EVERY_S:g} for dilu, never for baselines; 0: never",
    )
    p.add_argument("--compact-max-request", type=_nonneg_float, default=None,
                   help="compaction empties only GPUs whose Σ request is at most this (default 1.0)")
    p.add_argument("--compact-max-sources", type=_positive(int), default=None,
                   help="GPUs one compaction run tries to empty (the rest wait for the next run; default 8)")
    p.add_argument("--compact-max-instances", type=_positive(int), default=None,
                   help="compaction empties only GPUs holding at most this many instances (default 3)")
    p.add_argument("--no-compact-pieces", action="store_true",
                   help="compaction leaves GPUs holding pieces of split instances alone (and, with --as-live, never "
                        "splits a move: --balancer-compaction-stages false)")
    p.add_argument("--compact-merges", type=_nonneg_int, default=None,
                   help="moves a compaction run may spend merging SM room no instance can use, while Σ request "
                        "binds (default: the simulator's, 1; 0: none)")
    p.add_argument("--compact-memory-merges", type=_nonneg_int, default=None,
                   help="moves a compaction run may spend merging free memory no instance can use, while memory "
                        "binds (default: the simulator's, 0; with --as-live the balancer's "
                        "--balancer-compaction-memory-merges)")
    p.add_argument("--compact-repacks", type=_nonneg_int, default=None,
                   help="lit GPUs a compaction run may try to turn off by re-packing them (default: the "
                        "simulator's, 0; with --as-live the balancer's --balancer-compaction-repacks, make-before-break)")
    p.add_argument("--split-node-fit", action="store_true",
                   help="where memory binds, dilu splits an LLM over the lit GPUs of the node left with the least "
                        "free memory (node-level best fit; with --as-live the balancer's --balancer-split-node-fit)")
    p.add_argument("--as-live", action="store_true",
                   help="dilu as the live balancer runs it: no LLM action declares gpu-stages (no split), the live compaction (by default GPUs "
                        "with Σ request <= 0.5 and at most 3 instances, 2 moves a run, no merges) every 30 s; "
                        "--compact-every, --compact-max-request, --compact-merges, --compact-memory-merges and "
                        "--compact-repacks then set the balancer's --balancer-compaction-period-s, -max-request, "
                        "-merges, -memory-merges and -repacks, and "
                        "--llm-split-parts N has the "
                        "trace's LLM actions declare gpu-stages N (the live balancer then splits an LLM no lit GPU "
                        "holds, default 1: none declares it); not with the other --compact-* flags")
    p.add_argument("--seed", type=int, default=0, help="accepted for symmetry; placement is deterministic")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--jobs", type=_positive(int), default=None,
                   help="with --policy all: policies simulated in parallel (default: one per CPU)")

    s = sub.add_parser("serving", help="request-level simulation of serving functions on a GPU cluster")
    s.add_argument("--trace", required=True, type=Path, help="dilu-serving-trace JSON lines or Azure 2019 invocations CSV")
    s.add_argument("--profiles", required=True, type=Path)
    s.add_argument("--policy", required=True, choices=[*SERVING_POLICIES, "all"])
    s.add_argument("--gpus", required=True, type=_positive(int))
    s.add_argument("--out", type=Path, default=None, help="output directory (default out/serving)")
    s.add_argument("--durations", type=Path, default=None, help="Azure durations CSV (default: found beside the trace)")
    s.add_argument("--memory", type=Path, default=None, help="Azure memory CSV, per app or per function")
    s.add_argument("--top", type=_positive(int), default=None, help="keep the N most invoked functions")
    s.add_argument("--slo-ms", type=_positive(float), default=None, help="one SLO for every function")
    s.add_argument("--gpus-per-node", type=_positive(int), default=4)
    s.add_argument("--gpu-memory-gib", type=_positive(float), default=80.0)
    s.add_argument("--cold-start-s", type=_nonneg_float, default=5.0)
    s.add_argument("--preload", type=_nonneg_int, default=0, metavar="N",
                   help="pre-loaded processes per node (the invoker's --preload): an instance started where one "
                        "is available serves after --preloaded-start-s")
    s.add_argument("--preloaded-start-s", type=_nonneg_float, default=None,
                   help="start of an instance on a pre-loaded process (default: the measured 0.33 s)")
    s.add_argument("--preload-refill-s", type=_nonneg_float, default=None,
                   help="until a taken pre-loaded process is replaced (default: the measured 4.2 s)")
    s.add_argument("--timeout-s", type=_positive(float), default=30.0, help="drop requests waiting longer")
    s.add_argument("--interference", type=_nonneg_float, default=0.1, help="co-location slowdown κ (docs)")
    s.add_argument("--interference-training", type=_nonneg_float, default=None,
                   help="κ for training instances (default: --interference; the H200 fit gives 0)")
    s.add_argument("--vertical-period", type=_positive(float), default=0.5,
                   help="seconds between vertical re-decisions of a GPU with training (the slo policy counts its windows "
                        "in these periods and is calibrated at the live manager's 0.05 s: docs/benchmarks/vertical-sim.md)")
    s.add_argument("--vertical-policy", type=_vertical_policy, default="slo", metavar="|".join(VERTICAL_POLICIES),
                   help="dilu's vertical share policy: slo (the SLO controller, docs/policies.md) or static (every "
                        "instance at its limit)")
    s.add_argument("--sample-every", type=_positive(float), default=60.0, help="time-series resolution (s)")
    s.add_argument("--gamma", type=_positive(float), default=math.inf,
                   help="dilu's Σ-limit bound γ per GPU (default: none, admission by request; Dilu's 1.5 reserves "
                        "burst headroom)")
    s.add_argument("--placement-strategy", default=None, metavar="STRATEGY",
                   help="what-if: place with this strategy (e.g. infless-r) instead of the policy's own, at --gamma; "
                        "shares still run the policy's way (docs/simulator.md)")
    s.add_argument("--capacity-share", choices=("request", "limit"), default=None,
                   help="what-if: size instances for horizontal scaling at their request or limit share")
    s.add_argument("--compaction-period-s", type=_nonneg_float, default=None,
                   help="run the live balancer's compaction at most this often, make-before-break moves "
                        "(default: as the balancer, every 30 s for dilu, never for baselines; 0: off)")
    s.add_argument("--compaction-max-moves", type=_positive(int), default=2,
                   help="moves one compaction run may start (--balancer-compaction-max-moves)")
    s.add_argument("--compaction-max-request", type=_fraction, default=0.5,
                   help="compaction empties only GPUs whose Σ request is at most this (--balancer-compaction-max-request)")
    s.add_argument("--compaction-merges", type=_nonneg_int, default=0,
                   help="moves one compaction run may spend merging SM room (--balancer-compaction-merges)")
    s.add_argument("--compaction-memory-merges", type=_nonneg_int, default=0,
                   help="moves one compaction run may spend merging free memory, where memory binds "
                        "(--balancer-compaction-memory-merges)")
    s.add_argument("--compaction-repacks", type=_nonneg_int, default=0,
                   help="lit GPUs one compaction run may try to turn off by re-packing them, make-before-break "
                        "(--balancer-compaction-repacks)")
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--no-plots", action="store_true")
    s.add_argument("--quiet", action="store_true")
    s.add_argument("--jobs", type=_positive(int), default=None,
                   help="with --policy all: policies simulated in parallel (default: one per CPU)")

    g = sub.add_parser("gen", help="generate traces")
    gsub = g.add_subparsers(dest="kind", metavar="placement|serving|azure", required=True)
    gp = gsub.add_parser("placement", help="Dilu's instance mix as a placement event file")
    gp.add_argument("--instances", type=_positive(int), required=True)
    gp.add_argument("--train-fraction", type=_nonneg_float, default=0.2)
    gp.add_argument("--llm-fraction", type=_nonneg_float, default=0.2)
    gp.add_argument("--seed", type=int, default=1)
    gp.add_argument("--out", type=Path, required=True)
    gs = gsub.add_parser("serving", help="a synthetic serving trace (dilu-serving-trace)")
    gs.add_argument("--pattern", choices=PATTERNS, required=True)
    gs.add_argument("--functions", type=_positive(int), default=10)
    gs.add_argument("--duration", type=_positive(float), default=3600.0, help="seconds")
    gs.add_argument("--rate", type=_nonneg_float, default=10.0, help="mean total requests/second")
    gs.add_argument("--cv", type=_positive(float), default=2.0, help="gamma: inter-arrival coefficient of variation")
    gs.add_argument("--burst-factor", type=_positive(float), default=5.0, help="bursty: burst rate / calm rate")
    gs.add_argument("--period", type=_positive(float), default=600.0, help="periodic: period (s)")
    gs.add_argument("--profiles", type=Path, default=None, help="take profile names from this profiles file")
    gs.add_argument("--profile-names", default=None, help="comma-separated inference profile names")
    gs.add_argument("--training-jobs", type=int, default=0)
    gs.add_argument("--training-profile", default=None)
    gs.add_argument("--training-duration", type=_positive(float), default=None, help="seconds per job")
    gs.add_argument("--slo-ms", type=_positive(float), default=None)
    gs.add_argument("--seed", type=int, default=1)
    gs.add_argument("--out", type=Path, required=True)
    ga = gsub.add_parser("azure", help="self-made functions written in the Azure Functions 2019 schema")
    ga.add_argument("--functions", type=_positive(int), default=4)
    ga.add_argument("--rate", type=_nonneg_float, default=2.0, help="mean total requests/second")
    ga.add_argument("--minutes", type=_positive(int), default=1440)
    ga.add_argument("--day", type=_positive(int), default=1)
    ga.add_argument("--seed", type=int, default=1)
    ga.add_argument("--out", type=Path, required=True, help="directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.what == "placement":
            return _placement(args)
        if args.what == "serving":
            return _serving(args)
        return _gen(args)
    except CliError as exc:
        print(f"dilu-invoker simulate: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        # Parse errors of input files (EventError, TraceError, ProfileError) are ValueErrors.
        print(f"dilu-invoker simulate: error: {exc}", file=sys.stderr)
        return 2


# -- placement -----------------------------------------------------------------------------------


def _placement(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dilu_invoker.policy.live_compaction import live_compaction_config
    from dilu_invoker.sim import report
    from dilu_invoker.sim.events import load_events
    from dilu_invoker.sim.placement import (
        PLACEMENT_POLICIES,
        SIM_COMPACTION,
        TIMESERIES_COLUMNS,
        PlacementResult,
        PlacementSimConfig,
        live_placement_config,
        simulate_placement,
    )
    from dilu_invoker.sim.progress import Progress

    events = load_events(args.events)
    out: Path = args.out or DEFAULT_OUT / "placement"
    policies = list(PLACEMENT_POLICIES) if args.policy == "all" else [args.policy]
    results: dict[str, PlacementResult] = {}
    configs: dict[str, PlacementSimConfig] = {}
    if args.as_live:
        given = [flag for flag, value in (
            ("--compact-max-sources", args.compact_max_sources),
            ("--compact-max-instances", args.compact_max_instances),
        ) if value is not None]
        if given:
            raise CliError(f"--as-live takes the live balancer's settings; not with {', '.join(given)}")
    max_sources = 8 if args.compact_max_sources is None else args.compact_max_sources
    for policy in policies:
        every = args.compact_every
        if policy == "dilu" and args.as_live:
            live: dict[str, Any] = {} if every is None else {"compact_every_s": every}
            if args.llm_split_parts is not None:
                live["llm_split_parts"] = args.llm_split_parts
            live["split_node_fit"] = args.split_node_fit
            # --no-compact-pieces: the balancer's --balancer-compaction-stages false
            settings = {"max_request": args.compact_max_request, "merges": args.compact_merges,
                        "memory_merges": args.compact_memory_merges, "repacks": args.compact_repacks,
                        "stages": False if args.no_compact_pieces else None}
            live["compaction"] = live_compaction_config(**{k: v for k, v in settings.items() if v is not None})
            configs[policy] = live_placement_config(gpu_memory_gib=args.gpu_memory_gib, gpus=args.gpus,
                                                    gpus_per_node=args.gpus_per_node, gamma=args.gamma, **live)
            continue
        if every is None:
            every = DILU_COMPACT_EVERY_S if policy == "dilu" else 0.0
        configs[policy] = PlacementSimConfig(
            policy=policy,
            gpu_memory_gib=args.gpu_memory_gib,
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gamma=args.gamma,
            llm_split_parts=4 if args.llm_split_parts is None else args.llm_split_parts,
            split_node_fit=args.split_node_fit and policy == "dilu",
            compact_every_s=every,
            # The simulator's compaction with the flags' fields: every other field (merging, resizing,
            # memory merges, their gates) is `SIM_COMPACTION`'s, so a change of the default reaches the CLI.
            compaction=replace(
                SIM_COMPACTION,
                source_max_request=min(1.0, 1.0 if args.compact_max_request is None else args.compact_max_request),
                max_sources=max_sources,
                source_max_instances=3 if args.compact_max_instances is None else args.compact_max_instances,
                max_moves=max(64, max_sources),
                move_pieces=not args.no_compact_pieces,
                merges=SIM_COMPACTION.merges if args.compact_merges is None else args.compact_merges,
                memory_merges=(SIM_COMPACTION.memory_merges if args.compact_memory_merges is None
                               else args.compact_memory_merges),
                repacks=SIM_COMPACTION.repacks if args.compact_repacks is None else args.compact_repacks,
            ),
        )

    def run_one(policy: str, bar: Progress | None) -> PlacementResult:
        def on_progress(done: int, total: int) -> None:
            if bar is not None:
                bar.update(done)

        return simulate_placement(events, configs[policy], progress=on_progress)

    for policy, result in _run_policies(run_one, policies, args.jobs, "placement", len(events), args.quiet):
        results[policy] = result
        where = out / policy if len(policies) > 1 else out
        report.write_json(where / "summary.json", result.summary)
        report.write_json(where / "details.json", result.details)
        report.write_csv(where / "timeseries.csv", TIMESERIES_COLUMNS, [s.row() for s in result.samples])
        if result.rejections:
            (where / "rejections.txt").write_text("\n".join(result.rejections) + "\n", encoding="utf-8")
        if not args.no_plots:
            _placement_plots(where, {policy: result}, report)
    rows = _placement_rows(results)
    columns = [
        "policy",
        "gpus_peak",
        "bound_peak",
        "peak/bound",
        "gpus_mean",
        "bound_mean",
        "mean/bound",
        "int_peak",
        "peak/int",
        "int_mean",
        "mean/int",
        "sm_frag",
        "mem_frag",
        "rejected",
        "splits",
        "moves",
        "wall_s",
    ]
    first = next(iter(results.values()))
    print(
        f"{len(events)} events, {first.summary['instances']} instances, "
        f"{first.details['cluster_gpus']} GPUs of {args.gpu_memory_gib:g} GiB, "
        f"lower bound on lit GPUs: peak {first.details['lower_bound_peak']}, "
        f"time-mean {first.details['lower_bound_mean']:.1f}; integral bound (a GPU per training slot "
        f"over half a GPU): peak {first.details['integral_bound_peak']}, "
        f"time-mean {first.details['integral_bound_mean']:.1f}"
    )
    print(report.plain_table(columns, rows))
    if len(policies) > 1:
        report.write_csv(out / "comparison.csv", columns, rows)
        (out / "comparison.md").write_text(report.markdown_table(columns, rows) + "\n", encoding="utf-8")
        if not args.no_plots:
            _placement_plots(out, results, report)
    print(f"wrote {out}/")
    return 0


_WORKER: Callable[[str, Any], Any] | None = None


def _in_worker(policy: str) -> tuple[str, Any, float]:
    assert _WORKER is not None
    t0 = time.perf_counter()
    return policy, _WORKER(policy, None), time.perf_counter() - t0


def _run_policies(
    run: Callable[[str, Any], Any], policies: list[str], jobs: int | None, what: str, total: float, quiet: bool
) -> Iterator[tuple[str, Any]]:
    """Run each policy's simulation: one after another with a progress bar, or in `jobs` forked
    processes (results in policy order either way; the simulations share nothing)."""
    from dilu_invoker.sim.progress import Progress

    n = min(len(policies), jobs if jobs is not None else (os.cpu_count() or 1))
    if n <= 1:
        for policy in policies:
            bar = Progress(f"{what} {policy}", total, enabled=not quiet)
            result = run(policy, bar)
            bar.close()
            yield policy, result
        return
    global _WORKER
    _WORKER = run
    try:
        with multiprocessing.get_context("fork").Pool(n) as pool:
            done: dict[str, Any] = {}
            # dilu (splitting, compaction, the vertical policy) is the slowest: started first, it no longer
            # waits behind the others at the end of the run.
            for policy, result, seconds in pool.imap_unordered(_in_worker, sorted(policies, key=lambda p: p != "dilu")):
                done[policy] = result
                if not quiet:
                    print(f"{what} {policy}: done in {seconds:.1f} s", file=sys.stderr, flush=True)
    finally:
        _WORKER = None
    for policy in policies:
        yield policy, done[policy]


def _placement_rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for policy, r in results.items():
        s, d = r.summary, r.details
        rows.append(
            [
                policy,
                s["gpus_peak"],
                d["lower_bound_peak"],
                d["peak_vs_bound"] or math.nan,
                d["gpus_mean"],
                d["lower_bound_mean"],
                d["mean_vs_bound"] or math.nan,
                d["integral_bound_peak"],
                d["peak_vs_integral"] or math.nan,
                d["integral_bound_mean"],
                d["mean_vs_integral"] or math.nan,
                s["sm_fragmentation_mean"],
                s["mem_fragmentation_mean"],
                s["rejected"],
                d["split_instances"],
                d["compaction_moves"],
                d["wall_s"],
            ]
        )
    return rows


def _placement_plots(where: Path, results: dict[str, Any], report: Any) -> None:
    series: dict[str, tuple[list[float], list[float]]] = {}
    frag: dict[str, tuple[list[float], list[float]]] = {}
    first = next(iter(results.values()))
    ts = [s.t / 60.0 for s in first.samples]
    series["lower bound"] = report.downsample(ts, [s.lower_bound for s in first.samples])
    for policy, r in results.items():
        xs = [s.t / 60.0 for s in r.samples]
        series[policy] = report.downsample(xs, [s.lit_gpus for s in r.samples])
        frag[policy] = report.downsample(xs, [s.sm_fragmentation for s in r.samples])
    report.plot_series(
        where / "lit_gpus.png",
        series,
        title="Lit GPUs over time",
        xlabel="trace time (min)",
        ylabel="lit GPUs",
        styles={"lower bound": "--"},
    )
    report.plot_series(
        where / "sm_fragmentation.png",
        frag,
        title="SM fragmentation (mean over lit GPUs of 1 − Σ sm_request)",
        xlabel="trace time (min)",
        ylabel="SM fragmentation",
    )


# -- serving -------------------------------------------------------------------------------------


def _serving(args: argparse.Namespace) -> int:
    from dilu_invoker.policy import PlacementConfig
    from dilu_invoker.policy.vertical_slo import SloConfig, StaticConfig
    from dilu_invoker.sim import report
    from dilu_invoker.sim.profiles import load_profiles
    from dilu_invoker.sim.progress import Progress
    from dilu_invoker.sim.serving import (
        SERVING_POLICIES,
        SERVING_TIMESERIES_COLUMNS,
        ServingResult,
        ServingSimConfig,
        simulate_serving,
    )
    from dilu_invoker.sim.traces import load_trace

    profiles = load_profiles(args.profiles)
    trace = load_trace(
        args.trace,
        profiles,
        durations=args.durations,
        memory=args.memory,
        top=args.top,
        seed=args.seed,
        slo_ms=args.slo_ms,
    )
    out: Path = args.out or DEFAULT_OUT / "serving"
    policies = list(SERVING_POLICIES) if args.policy == "all" else [args.policy]
    placement = None
    if args.placement_strategy is not None:
        try:
            placement = PlacementConfig(strategy=args.placement_strategy, gamma=args.gamma)
        except ValueError as exc:
            print(f"dilu-invoker simulate serving: error: --placement-strategy: {exc}", file=sys.stderr)
            return 2
    results: dict[str, ServingResult] = {}
    if profiles.synthetic:
        print(f"NOTE: {args.profiles} is a SYNTHETIC profile set ({profiles.source}), not measurements")
    sconfigs: dict[str, ServingSimConfig] = {}
    for policy in policies:
        sconfigs[policy] = ServingSimConfig(
            policy=policy,
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_gib=args.gpu_memory_gib,
            cold_start_s=args.cold_start_s,
            preload_per_node=args.preload,
            **({} if args.preloaded_start_s is None else {"preloaded_start_s": args.preloaded_start_s}),
            **({} if args.preload_refill_s is None else {"preload_refill_s": args.preload_refill_s}),
            timeout_s=args.timeout_s,
            interference=args.interference,
            interference_training=args.interference_training,
            vertical_period_s=args.vertical_period,
            sample_every_s=args.sample_every,
            seed=args.seed,
            gamma=args.gamma,
            vertical={"slo": SloConfig, "static": StaticConfig}[args.vertical_policy](),
            placement=placement,
            capacity_share=args.capacity_share,
            compaction_period_s=args.compaction_period_s,
            compaction_max_moves=args.compaction_max_moves,
            compaction_max_request=args.compaction_max_request,
            compaction_merges=args.compaction_merges,
            compaction_memory_merges=args.compaction_memory_merges,
            compaction_repacks=args.compaction_repacks,
        )

    def run_serving(policy: str, bar: Progress | None) -> ServingResult:
        def on_time(t: float) -> None:
            if bar is not None:
                bar.update(t)

        return simulate_serving(trace, profiles, sconfigs[policy], progress=on_time)

    for policy, result in _run_policies(run_serving, policies, args.jobs, "serving", trace.duration_s, args.quiet):
        results[policy] = result
        where = out / policy if len(policies) > 1 else out
        report.write_json(where / "summary.json", result.summary)
        report.write_json(where / "functions.json", result.functions)
        report.write_json(where / "details.json", result.details)
        report.write_csv(where / "timeseries.csv", SERVING_TIMESERIES_COLUMNS, result.samples)
        if not args.no_plots:
            _serving_plots(where, {policy: result}, report)
    columns = [
        "policy",
        "requests",
        "completed",
        "throughput",
        "per_gpu",
        "slo_viol",
        "p50_ms",
        "p99_ms",
        "cold",
        "gpus_peak",
        "gpu_hours",
        "sm_frag",
        "train_sps",
        "wall_s",
    ]
    rows = [_serving_row(p, r) for p, r in results.items()]
    print(
        f"{len(trace.functions)} functions, {len(trace.jobs)} training jobs, {trace.requests} requests over "
        f"{trace.duration_s / 3600:.2f} h on {args.gpus} GPUs"
    )
    print(report.plain_table(columns, rows))
    if len(policies) > 1:
        report.write_csv(out / "comparison.csv", columns, rows)
        (out / "comparison.md").write_text(report.markdown_table(columns, rows) + "\n", encoding="utf-8")
        if not args.no_plots:
            _serving_plots(out, results, report)
    print(f"wrote {out}/")
    return 0


def _serving_row(policy: str, r: Any) -> list[Any]:
    s = r.summary
    return [
        policy,
        s["requests"],
        s["completed"],
        s["throughput"],
        s["throughput_per_gpu"],
        s["slo_violation_rate"],
        s["latency_p50_ms"],
        s["latency_p99_ms"],
        s["cold_starts"],
        s["gpus_peak"],
        s["gpu_seconds"] / 3600.0,
        s["sm_fragmentation_mean"],
        s["training_samples_per_s"],
        r.details["wall_s"],
    ]


def _serving_plots(where: Path, results: dict[str, Any], report: Any) -> None:
    lit: dict[str, tuple[list[float], list[float]]] = {}
    viol: dict[str, tuple[list[float], list[float]]] = {}
    for policy, r in results.items():
        xs = [row[0] / 3600.0 for row in r.samples]
        lit[policy] = report.downsample(xs, [row[1] for row in r.samples])
        viol[policy] = report.downsample(xs, [row[6] for row in r.samples])
    report.plot_series(where / "lit_gpus.png", lit, title="Lit GPUs", xlabel="time (h)", ylabel="lit GPUs")
    report.plot_series(
        where / "slo_violations.png",
        viol,
        title="SLO-violation rate per interval",
        xlabel="time (h)",
        ylabel="violations / requests",
    )
    if len(results) > 1:
        names = list(results)
        report.plot_bars(
            where / "throughput_per_gpu.png",
            names,
            {"requests per GPU-second": [results[n].summary["throughput_per_gpu"] for n in names]},
            title="Completed requests per GPU-second",
            ylabel="req / GPU-s",
        )


# -- gen -----------------------------------------------------------------------------------------


def _gen(args: argparse.Namespace) -> int:
    import numpy as np

    from dilu_invoker.sim import generate
    from dilu_invoker.sim.events import write_events

    if args.kind == "placement":
        events = generate.dilu_mix(
            args.instances, train_fraction=args.train_fraction, llm_fraction=args.llm_fraction, seed=args.seed
        )
        from dilu_invoker.sim.events import open_text

        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open_text(args.out, "w") as fh:
            n = write_events(events, fh)
        print(f"wrote {n} events ({args.instances} instances) to {args.out}")
        return 0
    if args.kind == "azure":
        from dilu_invoker.sim.traces import write_azure

        rng = np.random.default_rng(args.seed)
        fns = generate.azure_style_functions(args.functions, mean_rate=args.rate, rng=rng, minutes=args.minutes)
        paths = write_azure(fns, args.out, day=args.day)
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    names: list[str] = []
    training: list[str] = []
    if args.profiles is not None:
        from dilu_invoker.sim.profiles import load_profiles

        prof = load_profiles(args.profiles)
        names = prof.names(training=False)
        training = prof.names(training=True)
    if args.profile_names:
        names = [n.strip() for n in args.profile_names.split(",") if n.strip()]
    if args.training_profile:
        training = [args.training_profile]
    if not names:
        raise CliError("give --profiles FILE or --profile-names a,b to name the functions' profiles")
    trace = generate.serving_trace(
        args.pattern,
        functions=args.functions,
        duration_s=args.duration,
        rate=args.rate,
        profiles=names,
        seed=args.seed,
        cv=args.cv,
        burst_factor=args.burst_factor,
        period_s=args.period,
        slo_ms=args.slo_ms,
        training_profiles=training,
        training_jobs=args.training_jobs,
        training_duration_s=args.training_duration,
    )
    trace.write(args.out)
    print(f"wrote {len(trace.functions)} functions, {len(trace.jobs)} training jobs, {trace.requests} requests to {args.out}")
    return 0
