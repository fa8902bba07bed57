"""Fit the serving simulator's co-location slowdown κ to the H200 product matrix, then rerun a reduced serving comparison.

The serving simulator (docs/simulator.md, "Performance model") slows a busy instance on a spatially shared GPU by
1 + κ·(Σ of the other busy instances' effective shares). The matrix's static MPS 50/50 cells (`mps50`: inference and
training each capped at 50% of the active threads, no shim) measure exactly that situation: in each trial the inference
instance is measured alone under its 50% cap (`solo`), then beside a training job that is always busy at its 50% cap,
at paced and Poisson loads. So, per scenario,

    κ = (p50 beside training / p50 solo − 1) / 0.5

The p50 is used, not the p99: the simulator's κ stretches the service time of every batch; the p99 of a 1.5 s window
is a handful of requests and is dominated by queueing behind arrival clumps, which the simulator produces itself from
its queue. The bursty and 5× burst scenarios are left out for the same reason (queueing, not service time). The GPU
time of the request (`gpu_p50_ms`, what the simulator's profile latency stands for) gives the fit; the client p50 (host
overhead and queueing included) is reported beside it as an upper bound.

Training: `train_it_s` beside inference over training alone in the same mode (`solo_train_it_s`); the model predicts
1 − d·(1 − 1/(1 + κ·u)) with d the inference's GPU-busy fraction (rate × GPU time) and u its share (≤ 0.5), and the
least-squares κ for training is reported. The `idle` scenario (inference present, no requests) gives the noise floor.

    PYTHONPATH=. python3 bench/fit_colocation.py               # fit only (seconds)
    PYTHONPATH=. python3 bench/fit_colocation.py --serving     # and the reduced serving comparison (minutes)
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = ROOT / "docs/benchmarks/data"
DEFAULT_INPUTS = sorted(p for p in DATA.glob("gpu_product_matrix_run*.json.gz") if "refused" not in p.name)
"""Every matrix run (run0 was refused before it measured anything); the fit picks the cells it needs."""
PROFILES = ROOT / "examples/profiles.json"
BOOTSTRAP = 2000
LOAD_SCENARIOS = ("paced@0.5", "poisson@0.3", "poisson@0.5", "poisson@0.7")
DEFAULT_KAPPA = 0.1
DEFAULT_GAMMA = 1.5
SERVING_POLICIES = ("exclusive", "mps-static", "dilu")
WHAT_IF = "dilu on infless-r"
"""A what-if, not a shipped policy: dilu's vertical policy and scaling on mps-static's placement (Σ request ≤ 1)."""


def load_cells(paths: list[Path]) -> list[dict[str, Any]]:
    """Every cell of every matrix file, tagged with its file's name and machine."""
    cells = []
    for path in paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        for c in doc.get("cells", []):
            cells.append({**c, "file": path.name, "machine": doc.get("machine", {})})
        for c in doc.get("cut", []):  # cells the run's time budget left out: recorded, not measured
            cells.append({**c, "file": path.name, "cut": True})
    return cells


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _kappa(ratio: float | None, other_share: float) -> float | None:
    return (ratio - 1.0) / other_share if ratio is not None else None


def _stats(xs: list[float | None] | list[float]) -> dict[str, Any]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(xs), "median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def fit_trial(cell: dict[str, Any], share: float = 0.5, scenarios: tuple[str, ...] = LOAD_SCENARIOS) -> dict[str, Any]:
    """One trial: per-scenario ratios and κ, then the trial's estimate (median over its scenarios)."""
    solo = cell["solo"]
    solo_train = cell.get("solo_train_it_s")
    rows = []
    for name in scenarios:
        sc = cell["scenarios"].get(name)
        if not sc or sc.get("gpu_p50_ms") is None:
            continue
        gpu_r = _ratio(sc["gpu_p50_ms"], solo["gpu_p50_ms"])
        client_r = _ratio(sc["p50_ms"], solo["p50_ms"])
        t0, t1 = sc.get("window", [0.0, 0.0])
        seconds = (t1 - t0) or None
        duty = min(1.0, sc["requests"] / seconds * sc["gpu_p50_ms"] / 1000.0) if seconds else None
        rows.append({
            "scenario": name,
            "gpu_ratio": round(gpu_r, 4) if gpu_r is not None else None,
            "kappa_gpu": _round(_kappa(gpu_r, share)),
            "client_ratio": round(client_r, 4) if client_r is not None else None,
            "kappa_client": _round(_kappa(client_r, share)),
            "train_factor": _round(_ratio(sc.get("train_it_s"), solo_train)),
            "inference_duty": _round(duty),
        })
    idle = cell["scenarios"].get("idle", {})
    # Training: (1 − f) = d·c with c = 1 − 1/(1 + κ·u): least squares for c over the trial's scenarios.
    pts = [(r["inference_duty"], r["train_factor"]) for r in rows if r["inference_duty"] and r["train_factor"] is not None]
    c = sum(d * (1.0 - f) for d, f in pts) / sum(d * d for d, _ in pts) if pts else None
    kappa_train = (1.0 / (1.0 - c) - 1.0) / share if c is not None and c < 1.0 else None
    return {
        "file": cell["file"],
        "trial": cell["trial"],
        "solo_gpu_p50_ms": solo["gpu_p50_ms"],
        "solo_p50_ms": solo["p50_ms"],
        "solo_train_it_s": solo_train,
        "scenarios": rows,
        "kappa_gpu": _stats([r["kappa_gpu"] for r in rows])["median"],
        "kappa_client": _stats([r["kappa_client"] for r in rows])["median"],
        "train_factor": _stats([r["train_factor"] for r in rows])["median"],
        "kappa_train": _round(kappa_train),
        "idle_train_factor": _round(_ratio(idle.get("train_it_s"), solo_train)),
        # The cap itself: this mode's solo against the same trial's time-sliced (noshim) solo, full GPU.
        "cap_inference_speed": _round(_ratio(cell.get("ref", {}).get("p50"), solo["p50_ms"])),
        "cap_training_speed": _round(_ratio(solo_train, cell.get("ref", {}).get("train"))),
    }


def _round(x: float | None, nd: int = 4) -> float | None:
    return round(x, nd) if x is not None else None


def _bootstrap(xs: list[float], n: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float] | None:
    """A 90% interval for the median of `xs`, resampling `xs` (trials) with replacement."""
    import random

    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return round(meds[int(0.05 * n)], 4), round(meds[int(0.95 * n) - 1], 4)


def _noshim_of(cells: list[dict[str, Any]], cell: dict[str, Any]) -> dict[str, Any] | None:
    """The same run's, same trial's time-sliced cell without shim (the full-GPU reference)."""
    for c in cells:
        if (c["file"], c["pair"], c.get("trial"), c["mode"]) == (cell["file"], cell["pair"], cell["trial"], "noshim") \
                and c.get("solo") and not c.get("cut"):
            return c
    return None


def profile_cap_prediction(path: Path = PROFILES, inference: str = "resnet50", training: str = "train-resnet50",
                           share: float = 0.5, batch: int = 1) -> dict[str, Any]:
    """What the simulator's profiles say the 50% cap costs: speed at `share` over speed at the full GPU."""
    from dilu_invoker.sim.profiles import load_profiles

    profs = load_profiles(path)
    inf, tr = profs[inference], profs[training]
    tb = tr.recommended.batch
    return {
        "profiles": path.name,
        "inference": inference,
        "inference_batch": batch,
        "inference_speed_at_cap": round(inf.latency_ms(1.0, batch) / inf.latency_ms(share, batch), 4),
        "training": training,
        "training_batch": tb,
        "training_speed_at_cap": round(tr.throughput_rps(share, tb) / tr.throughput_rps(1.0, tb), 4),
    }


def time_sliced(cells: list[dict[str, Any]], pair: str) -> dict[str, Any]:
    """The `noshim` cells of `pair` (time slicing, no MPS, no shim): inference GPU p50 beside training over
    alone and training beside inference over alone. Not a κ (time slicing is not spatial sharing in the
    model), reported for what a second pairing measures."""
    chosen = [c for c in cells if c["mode"] == "noshim" and c["pair"] == pair and c.get("solo") and not c.get("cut")]
    gpu, train = [], []
    for c in chosen:
        g = [_ratio(c["scenarios"][n].get("gpu_p50_ms"), c["solo"]["gpu_p50_ms"]) for n in LOAD_SCENARIOS if n in c["scenarios"]]
        t = [_ratio(c["scenarios"][n].get("train_it_s"), c.get("solo_train_it_s")) for n in LOAD_SCENARIOS if n in c["scenarios"]]
        gpu.append(_stats(g)["median"])
        train.append(_stats(t)["median"])
    return {"pair": pair, "trials": len(chosen), "files": sorted({c["file"] for c in chosen}),
            "inference_gpu_p50_beside_over_solo": _stats(gpu), "training_beside_over_alone": _stats(train)}


def fit(cells: list[dict[str, Any]], mode: str = "mps50", pair: str = "resnet50+train", share: float = 0.5,
        profiles: Path = PROFILES) -> dict[str, Any]:
    chosen = [c for c in cells if c["mode"] == mode and c["pair"] == pair and c.get("solo") and not c.get("cut")]
    cut = sorted({c["file"] for c in cells if c["mode"] == mode and c["pair"] == pair and c.get("cut")})
    if not chosen:
        raise SystemExit(f"no {mode} cells of {pair} in the input")
    trials = []
    for c in chosen:
        t = fit_trial(c, share)
        ref = _noshim_of(cells, c)
        # The cap on GPU time: this mode's solo GPU p50 against the same trial's full-GPU (noshim) solo.
        t["cap_inference_gpu_speed"] = _round(_ratio(ref["solo"]["gpu_p50_ms"], c["solo"]["gpu_p50_ms"])) if ref else None
        trials.append(t)
    keys = ("kappa_gpu", "kappa_client", "train_factor", "kappa_train", "idle_train_factor",
            "cap_inference_speed", "cap_inference_gpu_speed", "cap_training_speed")
    summary = {k: _stats([t[k] for t in trials]) for k in keys}
    summary["kappa_gpu"]["ci90"] = _bootstrap([t["kappa_gpu"] for t in trials])
    summary["kappa_train"]["ci90"] = _bootstrap([t["kappa_train"] for t in trials])
    every = [r["kappa_gpu"] for t in trials for r in t["scenarios"]]
    pooled = {
        "every_scenario": {**_stats(every), "mean": _round(statistics.fmean(every)) if every else None},
        "by_scenario": {n: _stats([r["kappa_gpu"] for t in trials for r in t["scenarios"] if r["scenario"] == n])
                        for n in LOAD_SCENARIOS},
        "by_run": {f: _stats([t["kappa_gpu"] for t in trials if t["file"] == f]) for f in sorted({t["file"] for t in trials})},
        # Ratio of medians: every co-located GPU p50 against every solo GPU p50 (trial-to-trial clock noise
        # in the solo then averages out instead of entering each trial's ratio).
        "ratio_of_medians": _round(_kappa(_ratio(statistics.median([r["gpu_p50_ms"] for c in chosen for n in LOAD_SCENARIOS
                                                                      if (r := c["scenarios"].get(n)) and r.get("gpu_p50_ms")]),
                                                 statistics.median([c["solo"]["gpu_p50_ms"] for c in chosen])), share)),
        "trial_mean": _round(statistics.fmean([t["kappa_gpu"] for t in trials])),
        "trial_sem": _round(statistics.stdev([t["kappa_gpu"] for t in trials]) / len(trials) ** 0.5) if len(trials) > 1 else None,
    }
    kappa = summary["kappa_gpu"]["median"]
    others = sorted({c["pair"] for c in cells} - {pair})
    return {
        "mode": mode,
        "pair": pair,
        "other_share": share,
        "scenarios": list(LOAD_SCENARIOS),
        "trials": trials,
        "summary": summary,
        "pooled": pooled,
        "kappa": max(0.0, kappa) if kappa is not None else None,
        "kappa_train": max(0.0, summary["kappa_train"]["median"] or 0.0),
        "profile_cap": profile_cap_prediction(profiles),
        "time_sliced": [time_sliced(cells, p) for p in [pair, *others]],
        "other_pairs": {p: {"modes": sorted({c["mode"] for c in cells if c["pair"] == p and not c.get("cut")}),
                            "cut": sorted({f"{c['mode']} in {c['file']}" for c in cells if c["pair"] == p and c.get("cut")})}
                        for p in others},
        "machine": chosen[0]["machine"],
        "files": sorted({c["file"] for c in chosen}),
        "cut_in": cut,
    }


# -- the reduced serving comparison: every variant, both traces, several seeds ----------------------

#: name -> how it differs from the shipped policy. `policy`: the serving policy; `gamma`: dilu's Σ-limit
#: oversubscription; `limit_gain`: the profiler's limit rule replayed over the measured points (a larger gain
#: stops the limit earlier: smaller limits); `capacity`: horizontal sizing at the request or the limit;
#: `strategy`: placement strategy instead of the policy's (a what-if, not a shipped combination).
VARIANTS: dict[str, dict[str, Any]] = {
    "exclusive": {"policy": "exclusive"},
    "mps-static": {"policy": "mps-static"},
    "dilu": {"policy": "dilu"},
    "dilu γ 2": {"policy": "dilu", "gamma": 2.0},
    "dilu γ 3": {"policy": "dilu", "gamma": 3.0},
    "dilu γ 4": {"policy": "dilu", "gamma": 4.0},
    "dilu γ 6": {"policy": "dilu", "gamma": 6.0},
    "dilu limit gain 0.3": {"policy": "dilu", "limit_gain": 0.3},
    "dilu limit gain 0.5": {"policy": "dilu", "limit_gain": 0.5},
    "dilu capacity at request": {"policy": "dilu", "capacity": "request"},
    WHAT_IF: {"policy": "dilu", "strategy": "infless-r"},
}
SENSITIVITY = ("mps-static", "dilu")
"""Run at the other κ values too (seed 1 only)."""


def _profiles_for(limit_gain: float | None) -> Any:
    from dilu_invoker.sim.profiler import replay
    from dilu_invoker.sim.profiles import load_profiles, parse_profiles

    if limit_gain is None:
        return load_profiles(PROFILES)
    doc = replay(json.loads(PROFILES.read_text()), limit_gain=limit_gain, slo_ms=50.0, echo=lambda _: None)
    return parse_profiles(doc, f"{PROFILES.name} replayed with limit_gain {limit_gain:g}")


def _serve(task: tuple[str, str, int, float, str, float, int]) -> dict[str, Any]:
    name, path, gpus, seconds, variant, kappa, seed = task
    from evaluation import _head  # bench/evaluation.py: the same trace truncation as its --quick

    from dilu_invoker.policy import PlacementConfig
    from dilu_invoker.sim.serving import ServingSimConfig, simulate_serving
    from dilu_invoker.sim.traces import load_trace

    v = VARIANTS[variant]
    profiles = _profiles_for(v.get("limit_gain"))
    trace = _head(load_trace(ROOT / path, profiles), seconds)
    gamma = v.get("gamma", DEFAULT_GAMMA)
    placement = PlacementConfig(strategy=v["strategy"], gamma=gamma) if "strategy" in v else None
    t0 = time.perf_counter()
    r = simulate_serving(trace, profiles, ServingSimConfig(
        policy=v["policy"], gpus=gpus, seed=seed, interference=kappa, gamma=gamma,
        placement=placement, capacity_share=v.get("capacity")))
    s = r.summary
    return {"trace": name, "policy": variant, "kappa": kappa, "seed": seed, "seconds": seconds, "gpus": gpus,
            "requests": trace.requests, "throughput_per_gpu": s["throughput_per_gpu"],
            "slo_violation_rate": s["slo_violation_rate"], "latency_p99_ms": s["latency_p99_ms"],
            "gpus_peak": s["gpus_peak"], "gpu_seconds": s["gpu_seconds"], "cold_starts": s["cold_starts"],
            "training_samples_per_s": s["training_samples_per_s"], "packing": r.details["packing"],
            "limits": {n: [f.recommended.request, f.recommended.limit] for n, f in profiles.functions.items()},
            "wall_s": round(time.perf_counter() - t0, 1)}


def serving(kappa: float, others: list[float], traces: list[tuple[str, str, int, float]], jobs: int,
            seeds: list[int], variants: list[str], partial: Path | None = None) -> list[dict[str, Any]]:
    """Every variant on every trace, seed by seed (the first seed with the other κ values too). Rows are
    appended to `partial` as they finish, and rows already there are not run again (resume a cut run)."""
    tasks = []
    for i, sd in enumerate(seeds):
        # `exclusive` has no co-location, so κ cannot change it: run at the fitted κ only.
        tasks += [(n, p, g, sec, v, kappa, sd) for n, p, g, sec in traces for v in variants]
        if i == 0:
            tasks += [(n, p, g, sec, v, k, sd) for n, p, g, sec in traces for k in others for v in SENSITIVITY if v in variants]
    key = {t[0]: t for t in traces}
    done: dict[tuple[Any, ...], dict[str, Any]] = {}
    if partial is not None and partial.exists():
        for line in partial.read_text().splitlines():
            r = json.loads(line)
            t = key.get(r["trace"])
            if t is not None and r["seconds"] == t[3]:
                done[(*t, r["policy"], r["kappa"], r["seed"])] = r
    todo = [t for t in tasks if t not in done]
    sys.path.insert(0, str(ROOT / "bench"))
    with multiprocessing.Pool(jobs) as pool:
        for r in pool.imap_unordered(_serve, todo):
            done[(*key[r["trace"]], r["policy"], r["kappa"], r["seed"])] = r
            if partial is not None:
                with partial.open("a") as f:
                    f.write(json.dumps(r) + "\n")
            print(f"[{len(done)}/{len(tasks)}] {r['trace']} {r['policy']} κ {r['kappa']:g} seed {r['seed']}: "
                  f"{r['throughput_per_gpu']:.3f} req/GPU-s, violations {100 * r['slo_violation_rate']:.2f}%, {r['wall_s']:.0f} s",
                  flush=True)
    return [done[t] for t in tasks if t in done]


# -- the report ------------------------------------------------------------------------------------

def _f(x: float | None, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(result: dict[str, Any], command: str) -> str:
    f = result["fit"]
    m = f["machine"]
    s = f["summary"]
    L = [
        "# Co-location slowdown of the serving simulator, fitted to the H200 matrix",
        "",
        f"Generated by `{command}` from {', '.join(f'`docs/benchmarks/data/{x}`' for x in result.get('inputs', f['files']))} "
        f"(the matrix of docs/benchmarks/gpu-product.md, measured through the product on "
        f"{m.get('gpu', '?')}, {m.get('cpus', '?')} CPUs, torch {m.get('torch', '?')}); the fit itself runs in seconds "
        f"on any machine. The `{f['mode']}` cells are those of {', '.join(f'`{x}`' for x in f['files'])}"
        + (f" (cut by the run's time budget, not measured, in {', '.join(f'`{x}`' for x in f['cut_in'])})" if f.get("cut_in") else "")
        + ". Raw fit: `docs/benchmarks/data/colocation_fit.json`.",
        "",
        "## What is fitted",
        "",
        "The simulator slows a busy instance on a spatially shared GPU by 1 + κ·(Σ other busy instances' effective "
        f"shares) (docs/simulator.md). The `{f['mode']}` cells of `{f['pair']}` (static MPS 50/50, no shim) measure "
        "that: per trial, inference alone under its 50% cap, then beside training that is always busy at its 50% cap. "
        "So κ = (p50 beside / p50 solo − 1) / 0.5 per load scenario (paced 50%, Poisson 30/50/70% of capacity), a "
        "trial's estimate is the median over its scenarios. p50, not p99: κ stretches every batch's service time, "
        "the p99 of a 1.5 s window is a few requests and mostly queueing behind arrival clumps, which the simulator "
        "produces from its own queue (bursty and 5× burst scenarios left out for the same reason). The GPU time of "
        "the request (`gpu_p50_ms`) is what the profile latency L(s, b) stands for, so it gives the fit; the client "
        "p50 (host overhead, queueing) is an upper bound.",
        "",
        "| trial | solo GPU p50 ms | κ from GPU p50 (per scenario) | κ (GPU) | κ from client p50 | training beside / alone | κ (training) | training beside idle inference / alone | 50% cap: inference GPU speed / full | 50% cap: training speed / full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in f["trials"]:
        per = ", ".join(f"{r['scenario']} {_f(r['kappa_gpu'], 2)}" for r in t["scenarios"])
        L.append(f"| {t['file']} #{t['trial']} | {t['solo_gpu_p50_ms']:.2f} | {per} | {_f(t['kappa_gpu'], 2)} | "
                 f"{_f(t['kappa_client'], 2)} | {_f(t['train_factor'])} | {_f(t['kappa_train'], 2)} | {_f(t['idle_train_factor'])} | "
                 f"{_f(t.get('cap_inference_gpu_speed'))} | {_f(t['cap_training_speed'])} |")
    L += [
        "",
        "| quantity | median of trials | min | max | 90% interval of the median (bootstrap over trials) |",
        "| --- | --- | --- | --- | --- |",
    ]
    names = {
        "kappa_gpu": "κ (inference GPU p50) — the fitted value",
        "kappa_client": "κ (inference client p50, upper bound)",
        "train_factor": "training it/s beside inference / alone (same mode)",
        "kappa_train": "κ (training, least squares over the inference's busy fraction)",
        "idle_train_factor": "training it/s beside idle inference / alone (noise floor)",
        "cap_inference_speed": "inference at the 50% cap / full GPU (client p50, noshim solo of the trial)",
        "cap_inference_gpu_speed": "inference at the 50% cap / full GPU (GPU p50, noshim solo of the trial)",
        "cap_training_speed": "training at the 50% cap / full GPU (noshim solo of the trial)",
    }
    for k, label in names.items():
        if k not in s:
            continue
        ci = s[k].get("ci90")
        L.append(f"| {label} | {_f(s[k]['median'], 3)} | {_f(s[k]['min'], 3)} | {_f(s[k]['max'], 3)} | "
                 f"{f'{ci[0]:.3f} – {ci[1]:.3f}' if ci else '–'} |")
    po = f.get("pooled", {})
    pc = f.get("profile_cap", {})
    if po:
        L += [
            "",
            "Pooled κ (inference GPU p50): median over every (trial, scenario) estimate "
            f"{_f(po['every_scenario']['median'], 3)} (mean {_f(po['every_scenario']['mean'], 3)}, n {po['every_scenario']['n']}); "
            f"ratio of the medians (every co-located GPU p50 over every solo GPU p50) {_f(po['ratio_of_medians'], 3)}; "
            f"mean of trials {_f(po['trial_mean'], 3)} ± {_f(po['trial_sem'], 3)} (standard error). By scenario: "
            + ", ".join(f"{n} {_f(v['median'], 3)}" for n, v in po["by_scenario"].items())
            + ". By run (median of its 3 trials): "
            + ", ".join(f"`{n}` {_f(v['median'], 3)}" for n, v in po["by_run"].items()) + ".",
        ]
    if pc:
        L += [
            "",
            f"The 50% cap in the model is the profile's own curve (`examples/{pc['profiles']}`): {pc['inference']} at batch "
            f"{pc['inference_batch']} runs at {_f(pc['inference_speed_at_cap'], 3)}× its full-GPU speed at share 0.5, "
            f"{pc['training']} (batch {pc['training_batch']}) at {_f(pc['training_speed_at_cap'], 3)}×. The matrix measures "
            f"{_f(s['cap_inference_gpu_speed']['median'], 3)}× (inference GPU p50) and {_f(s['cap_training_speed']['median'], 3)}× "
            "(training it/s), medians of the trials above.",
        ]
    ts = f.get("time_sliced", [])
    if ts:
        L += [
            "",
            "Time slicing (the `noshim` cells: no MPS, no shim), for what each pairing measures — not a κ, the model's "
            "time-sliced policies do not co-run kernels:",
            "",
            "| pair | trials | inference GPU p50 beside training / alone (median, min–max) | training beside inference / alone |",
            "| --- | --- | --- | --- |",
        ]
        for t in ts:
            a, b = t["inference_gpu_p50_beside_over_solo"], t["training_beside_over_alone"]
            L.append(f"| {t['pair']} | {t['trials']} | {_f(a['median'])} ({_f(a['min'])}–{_f(a['max'])}) | "
                     f"{_f(b['median'])} ({_f(b['min'])}–{_f(b['max'])}) |")
    for p, o in f.get("other_pairs", {}).items():
        L += ["", f"`{p}`: measured in modes {', '.join(o['modes'])}; not measured (cut by the runs' time budgets): "
              f"{', '.join(o['cut']) or 'none'}. With no static-MPS cell it gives no κ: the pairing's spatial co-location "
              "slowdown is unmeasured, and the fit above is ResNet-50's alone."]
    L += [
        "",
        f"Fitted κ = **{_f(f['kappa'], 3)}** (median of {s['kappa_gpu']['n']} trials, clamped at 0), against the "
        f"assumed default {DEFAULT_KAPPA}. Pass it with `dilu-invoker simulate serving --interference {_f(f['kappa'], 3)}`.",
        "",
        "What the fit can say: on the H200, ResNet-50 inference beside ResNet-50 training under static MPS 50/50 runs "
        f"its GPU work a little slower than alone under the same cap ({100 * f['kappa'] * f['other_share']:.0f}% beside "
        f"the neighbour's {f['other_share']:g}); the per-trial estimates spread from {_f(s['kappa_gpu']['min'], 2)} to "
        f"{_f(s['kappa_gpu']['max'], 2)}, wider than the value; the 90% interval of the median is "
        + (f"{s['kappa_gpu']['ci90'][0]:.2f}–{s['kappa_gpu']['ci90'][1]:.2f}" if s["kappa_gpu"].get("ci90") else "–")
        + f" (the old default {DEFAULT_KAPPA} is inside it). Training beside inference is not "
        f"measurably slower than training alone (training κ {_f(s['kappa_train']['median'], 2)}, interval "
        + (f"{s['kappa_train']['ci90'][0]:.2f}–{s['kappa_train']['ci90'][1]:.2f}" if s["kappa_train"].get("ci90") else "–")
        + "; the noise floor, training beside idle inference, "
        "moves as much): the model's one κ, applied to training too, overstates training's loss. And the 50% cap "
        "itself costs neither side measurably against the full GPU: both jobs fit in half an H200 — the reason static "
        + (f"MPS is strong here (the profile's training curve says {100 * (1 - pc['training_speed_at_cap']):.0f}% at the cap; "
           f"the matrix's trials give {_f(s['cap_training_speed']['min'], 2)}–{_f(s['cap_training_speed']['max'], 2)}, "
           f"median {_f(s['cap_training_speed']['median'], 2)})." if pc else "MPS is strong here."),
        "",
        "What it cannot say: one model pair under MPS (BERT's MPS cells were cut), 1.5 s windows, one split "
        "(50/50), so κ's dependence on the neighbour's share (the model's linearity) is not tested; the solo is measured "
        "at capacity and the co-located scenarios at 30–70%, and GPU time per request falls from Poisson 30% to 70% in "
        "most trials (clocks, launch batching, with the neighbour unchanged), so the per-scenario κ falls with load "
        f"too and the low-load values overstate it (the scenario nearest the solo's load, Poisson 70%, gives a median of "
        f"{_f(_stats([r['kappa_gpu'] for t in f['trials'] for r in t['scenarios'] if r['scenario'] == 'poisson@0.7'])['median'], 2)}); "
        "no memory-bandwidth-bound neighbour (issue 17 part 4), which is where κ would be large; the time-sliced "
        "and shim modes are not spatial and have no κ in the model.",
        "",
    ]
    rows = result.get("serving")
    if rows:
        L += _serving_md(rows, result)
    return "\n".join(L) + "\n"


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _rows(rows: list[dict[str, Any]], trace: str, policy: str, kappa: float) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["trace"] == trace and r["policy"] == policy and r["kappa"] == kappa),
                  key=lambda r: r["seed"])


def _wins(rows: list[dict[str, Any]], trace: str, policy: str, kappa: float) -> tuple[int, int]:
    """Seeds on which `policy` has throughput per GPU ≥ mps-static's and violations ≤ mps-static's."""
    mp = {r["seed"]: r for r in _rows(rows, trace, "mps-static", kappa)}
    mine = [r for r in _rows(rows, trace, policy, kappa) if r["seed"] in mp]
    won = sum(1 for r in mine if r["throughput_per_gpu"] >= mp[r["seed"]]["throughput_per_gpu"]
              and r["slo_violation_rate"] <= mp[r["seed"]]["slo_violation_rate"])
    return won, len(mine)


def _serving_md(rows: list[dict[str, Any]], result: dict[str, Any]) -> list[str]:
    kappa = result["kappa"]
    traces = [t[0] for t in result["traces"]]
    variants = result["variants"]
    seeds = sorted({r["seed"] for r in rows if r["kappa"] == kappa})
    L = [
        "## The serving comparison with the fitted κ (reduced)",
        "",
        "Every variant below is the serving simulator (docs/simulator.md) with the measured profiles "
        "(`examples/profiles.json`: resnet50 request 0.2 / limit 0.7, bert-base 0.1 / 0.5, train-resnet50 0.5 / 1.0) "
        f"at the fitted κ {kappa:g}, each trace truncated to its first "
        + ", ".join(f"{t[0]}: {t[3] / 60:g} min on {t[2]} GPUs" for t in result["traces"])
        + f" (docs/evaluation.md's tables are the full hour and day, with the shipped admission), arrival seeds "
        f"{', '.join(str(x) for x in seeds)} (a trace fixes the counts per bin, the seed draws the arrival times "
        f"within them). {len(rows)} runs, {result['jobs']} worker processes, "
        f"{result.get('serving_wall_s', 0) / 60:.0f} min. Training runs at the same κ as inference here (the fit's "
        "training κ ≈ 0 would raise every sharing policy's training figure alike; `--interference-training`). Variants:",
        "",
        "- `dilu`: Dilu's admission, the shipped default when this comparison was made (placement `dilu`: Σ request ≤ 1, "
        "Σ limit ≤ γ = 1.5, memory, then lit GPUs first, fragmentation, complementarity, spread; the default vertical "
        "policy of the run, `slo` since it replaced the one before (docs/policies.md §1.2); horizontal sizing at the limit). Since then the default admits by request (`--gpu-gamma` inf, "
        "docs/policies.md §2 \"Admission by request\"): what the `dilu γ 6` and `dilu on infless-r` rows do here.",
        "- `dilu γ N`: the same with Σ limit ≤ N (`--gpu-gamma`).",
        "- `dilu limit gain G`: limits from the profiler's own rule replayed over the measured points with a larger "
        "`limit_gain` (the limit stops where throughput grows less than G per step; 0.1 is the default), γ 1.5: "
        "limit gain 0.3 gives resnet50 0.3, bert-base 0.4; 0.5 gives 0.2 and 0.2 (the request); training keeps 1.0.",
        "- `dilu capacity at request`: horizontal sizing at the request's throughput instead of the limit's.",
        f"- `{WHAT_IF}` (what-if: not a shipped combination): dilu's vertical policy, sizing and scaling on "
        "mps-static's placement (`infless-r`: Σ request ≤ 1, memory, lit first, best fit on requests, no limit check) — "
        "admission by request, caps free to grow into idle neighbours' SMs up to the limit.",
        "",
    ]
    L += _why_md(rows, result)
    L += [
        f"### Every variant (κ {kappa:g}; mean over seeds, min–max in brackets)",
        "",
        "`wins`: seeds on which the variant's throughput per GPU is ≥ mps-static's and its SLO violations ≤ "
        "mps-static's on the same seed (the issue's target), compared unrounded."
        + "".join(f" On `{t}` every variant's throughput per GPU is the same on every seed (the seed moves arrivals "
                  "within a trace bin, which changes no scaling decision there); p99 and violations move in the third digit."
                  for t in traces if len(seeds) > 1 and all(
                      len({r["throughput_per_gpu"] for r in _rows(rows, t, v, kappa)}) == 1 for v in variants
                      if _rows(rows, t, v, kappa))),
        "",
        "| trace | variant | req per GPU-s | × mps-static | × exclusive | SLO violations | p99 ms | GPUs peak | training samples/s | wins |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tname in traces:
        mp = _mean([r["throughput_per_gpu"] for r in _rows(rows, tname, "mps-static", kappa)])
        ex = _mean([r["throughput_per_gpu"] for r in _rows(rows, tname, "exclusive", kappa)])
        for v in variants:
            rs = _rows(rows, tname, v, kappa)
            if not rs:
                continue
            tp = [r["throughput_per_gpu"] for r in rs]
            vi = [100 * r["slo_violation_rate"] for r in rs]
            w, n = _wins(rows, tname, v, kappa) if v not in ("mps-static", "exclusive") else (0, 0)
            L.append(f"| {tname} | {v} | {_mean(tp):.3f} ({min(tp):.3f}–{max(tp):.3f}) | {_mean(tp) / mp:.2f}× | "
                     f"{_mean(tp) / ex:.2f}× | {_mean(vi):.2f}% ({min(vi):.2f}–{max(vi):.2f}) | "
                     f"{_mean([r['latency_p99_ms'] for r in rs]):.1f} | {max(r['gpus_peak'] for r in rs)} | "
                     f"{_mean([r['training_samples_per_s'] for r in rs]):.0f} | {f'{w}/{n}' if n else '–'} |")
    others = [k for k in result["kappas"] if k != kappa]
    if others:
        L += ["", f"κ sensitivity (seed {seeds[0]}; the old default and the client-p50 upper bound):", "",
              "| trace | κ | policy | req per GPU-s | SLO violations | p99 ms | training samples/s |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for tname in traces:
            for k in sorted(result["kappas"]):
                for v in SENSITIVITY:
                    rs = [r for r in _rows(rows, tname, v, k) if r["seed"] == seeds[0]]
                    for r in rs:
                        L.append(f"| {tname} | {k:g} | {v} | {r['throughput_per_gpu']:.3f} | {100 * r['slo_violation_rate']:.2f}% | "
                                 f"{r['latency_p99_ms']:.1f} | {r['training_samples_per_s']:.0f} |")
    L += ["", *_verdict(rows, result), ""]
    return L


def _why_md(rows: list[dict[str, Any]], result: dict[str, Any]) -> list[str]:
    kappa = result["kappa"]
    seed = min(r["seed"] for r in rows)
    L = [
        f"### Why dilu lights more GPUs than mps-static (seed {seed}, κ {kappa:g})",
        "",
        "Time averages over lit GPU-seconds (`details.packing` of the simulator): instances, Σ request and Σ limit per "
        "lit GPU; instance-seconds (∫ instances dt, what horizontal sizing decides); and, for every placement that lit "
        "a GPU, the check that stopped the last lit GPU that came closest (`sm-limit-bound`: some lit GPU had room by "
        "Σ request and only Σ limit ≤ γ turned it down; `sm-request-bound`: every lit GPU was full by Σ request; "
        "`score`: some lit GPU passed every check and the scorer still chose an unlit one).",
        "",
        "| trace | variant | GPU-s | instance-s | instances per lit GPU | Σ request per lit GPU | Σ limit per lit GPU | GPUs lit because |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    facts = []
    same_instances = True

    def r_dur(r: dict[str, Any]) -> float:
        return float(r["seconds"])

    def n_fns(tname: str) -> str:
        return {"bursty": "10", "azure-day": "100", "bursty-heavy": "10"}.get(tname, "the")

    for tname in [t[0] for t in result["traces"]]:
        for v in result["variants"]:
            for r in [r for r in _rows(rows, tname, v, kappa) if r["seed"] == seed]:
                pk = r["packing"]
                L.append(f"| {tname} | {v} | {r['gpu_seconds']:.0f} | {pk['instance_seconds']:.0f} | "
                         f"{pk['instances_per_lit_gpu']:.2f} | {pk['request_per_lit_gpu']:.2f} | {pk['limit_per_lit_gpu']:.2f} | "
                         f"{', '.join(f'{k} {n}' for k, n in pk['lit_by'].items())} |")
        d = [r for r in _rows(rows, tname, "dilu", kappa) if r["seed"] == seed]
        m = [r for r in _rows(rows, tname, "mps-static", kappa) if r["seed"] == seed]
        c = [r for r in _rows(rows, tname, "dilu capacity at request", kappa) if r["seed"] == seed]
        if d and m:
            d0, m0 = d[0], m[0]
            lb = d0["packing"]["lit_by"]
            same_instances &= abs(d0["packing"]["instance_seconds"] / m0["packing"]["instance_seconds"] - 1) < 0.01
            lit = sum(n for k, n in lb.items() if k not in ("none-lit", "failed"))
            facts.append(
                f"{tname}: dilu holds {d0['packing']['instance_seconds'] / m0['packing']['instance_seconds']:.2f}× "
                f"mps-static's instance-seconds on {d0['gpu_seconds'] / m0['gpu_seconds']:.2f}× its GPU-seconds — "
                f"{d0['packing']['instances_per_lit_gpu']:.2f} instances per lit GPU against {m0['packing']['instances_per_lit_gpu']:.2f}, "
                f"at Σ limit {d0['packing']['limit_per_lit_gpu']:.2f} (γ {DEFAULT_GAMMA:g}) and Σ request "
                f"{d0['packing']['request_per_lit_gpu']:.2f} against mps-static's Σ request {m0['packing']['request_per_lit_gpu']:.2f}; "
                f"{lb.get('sm-limit-bound', 0)} of the {lit} GPUs dilu lit after its first were lit because Σ limit turned "
                f"down a GPU with request room, {lb.get('score', 0)} by the scorer"
                + f"; {d0['packing']['instance_seconds'] / r_dur(d0):.1f} instances on average for "
                f"{n_fns(tname)} functions and their training jobs"
                + (f"; sizing at the request instead changes instance-seconds by "
                   f"{100 * (c[0]['packing']['instance_seconds'] / d0['packing']['instance_seconds'] - 1):+.1f}% and GPU-seconds by "
                   f"{100 * (c[0]['gpu_seconds'] / d0['gpu_seconds'] - 1):+.1f}%" if c else ""))
    lim = next((r["limits"] for r in rows if r["policy"] == "dilu"), {})
    over = ", ".join(f"{lr[1] / lr[0]:.1f}× ({n})" for n, lr in lim.items() if lr[0])
    L += ["", "What binds: " + "; ".join(facts) + ". So it is the limit check at admission — Σ limit ≤ γ with limits "
          f"{over} the requests — "
          + ("not horizontal sizing (the same instance-seconds: at these loads most functions run one instance, the "
             "floor above scale-to-zero, whatever its capacity)" if same_instances else
             "not horizontal sizing (dilu, sized at the limit, runs fewer instance-seconds than mps-static here: sizing "
             "works in its favour)")
          + " and not the complementarity score (no GPU lit by the scorer).", ""]
    return L


COMPANIONS = (
    (DATA / "colocation_fit_bursty_hour.json", "docs/benchmarks/colocation-fit-bursty-hour.md", "The whole bursty hour"),
    (DATA / "colocation_fit_heavy.json", "docs/benchmarks/colocation-fit-heavy.md",
     "A heavy bursty trace (`examples/serving/bursty-heavy.jsonl.gz`: 5 min, 10 functions at 8,000 req/s, 5× bursts, "
     "so functions scale out)"),
)
"""Smaller runs of this script on other traces, summarised in the main document where they exist."""


def _hour_note(result: dict[str, Any]) -> str:
    out = ""
    for path, doc_path, what in COMPANIONS:
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        if doc.get("traces") == result.get("traces"):
            continue
        rows, k = doc["serving"], doc["kappa"]
        for t in [t[0] for t in doc["traces"]]:
            m = _rows(rows, t, "mps-static", k)
            mp = _mean([r["throughput_per_gpu"] for r in m])
            parts = [f"`{v}` {_mean([r['throughput_per_gpu'] for r in x]) / mp:.2f}× at "
                     f"{_mean([100 * r['slo_violation_rate'] for r in x]):.2f}% violations"
                     for v in doc["variants"] if v not in ("exclusive", "mps-static") and (x := _rows(rows, t, v, k))]
            out += (f" {what} (`{doc['command']}`, {doc_path}), against mps-static's "
                    f"{_mean([100 * r['slo_violation_rate'] for r in m]):.2f}% violations: " + ", ".join(parts) + ".")
    return out


def _verdict(rows: list[dict[str, Any]], result: dict[str, Any]) -> list[str]:
    kappa = result["kappa"]
    traces = [t[0] for t in result["traces"]]
    both = {}
    for v in result["variants"]:
        if v in ("mps-static", "exclusive"):
            continue
        ws = [_wins(rows, t, v, kappa) for t in traces]
        both[v] = all(n and w == n for w, n in ws)

    def ratio(t: str, v: str) -> float:
        return _mean([r["throughput_per_gpu"] for r in _rows(rows, t, v, kappa)]) / _mean(
            [r["throughput_per_gpu"] for r in _rows(rows, t, "mps-static", kappa)])

    winners = [v for v, ok in both.items() if ok]
    config_winners = [v for v in winners if v.startswith("dilu γ") or v.startswith("dilu limit gain")]
    gammas = sorted(float(v.split()[-1]) for v in config_winners if v.startswith("dilu γ"))
    L = [
        "### Where dilu stands against mps-static under the calibrated model",
        "",
        f"Target (issue 17 part 5): dilu's throughput per GPU ≥ mps-static's at equal or lower SLO violations on "
        f"{'both ' if len(traces) > 1 else 'the '}"
        f"{'traces' if len(traces) > 1 else 'trace'}. The shipped `dilu` at the fitted κ {kappa:g}: **{'met' if both.get('dilu') else 'not met'}** — "
        + ", ".join(f"{t} {ratio(t, 'dilu'):.2f}× mps-static" for t in traces)
        + f". Variants that meet it on every seed of {'both traces' if len(traces) > 1 else 'the trace'}: "
        + (", ".join(f"`{v}` ({', '.join(f'{t} {ratio(t, v):.2f}×' for t in traces)})" for v in winners) or "none")
        + ".",
        "",
    ]
    lo_v, hi_v = (0.0, ""), (0.0, "")
    for t in traces:  # the widest spread of violations among the sharing variants on one trace
        viol = sorted((_mean([100 * r["slo_violation_rate"] for r in _rows(rows, t, v, kappa)]), v)
                      for v in result["variants"] if v != "exclusive" and _rows(rows, t, v, kappa))
        if viol and viol[-1][0] - viol[0][0] > hi_v[0] - lo_v[0]:
            lo_v, hi_v = viol[0], viol[-1]
    lim = next((r["limits"] for r in rows if r["policy"] == "dilu"), {})
    vacuous = max((lr[1] / lr[0] for lr in lim.values() if lr[0]), default=float("nan"))

    def beside(v: str) -> str:
        out = []
        for t in traces:
            m = _rows(rows, t, "mps-static", kappa)
            x = _rows(rows, t, v, kappa)
            dv = max(100 * (a["slo_violation_rate"] - b["slo_violation_rate"]) for a, b in zip(x, m, strict=False))
            dvs = "equal" if abs(dv) < 0.0005 else f"{dv:+.3f} points at worst"
            out.append(f"{t}: p99 {_mean([r['latency_p99_ms'] for r in x]):.1f} vs {_mean([r['latency_p99_ms'] for r in m]):.1f} ms, "
                       f"training {_mean([r['training_samples_per_s'] for r in x]):.0f} vs "
                       f"{_mean([r['training_samples_per_s'] for r in m]):.0f} samples/s, violations {dvs}")
        return "; ".join(out)

    if gammas:
        lost = [v for v in both if v.startswith("dilu γ") and not both[v]]
        L += [f"A configuration default suffices: γ = {gammas[0]:g} (`--gpu-gamma`, `PlacementConfig.gamma`) meets the "
              f"target on every trace and seed here in the calibrated model ({beside(f'dilu γ {gammas[0]:g}')}, "
              "against mps-static). It works by making the limit check vacuous: with Σ request ≤ 1, Σ limit ≤ "
              f"max(limit / request) = {vacuous:.1f} for these profiles, so any γ ≥ {vacuous:.1f} admits by request alone; "
              + (f"{', '.join(f'`{v}`' for v in lost)}, where the check still binds, fall short on "
                 "throughput per GPU. " if lost else "")
              + "at equal density the vertical policy is what dilu adds over the static split: the p99 and training "
              "figures above."]
    elif config_winners:
        L += [f"A configuration default suffices: {', '.join(config_winners)}."]
    else:
        L += ["No configuration default of this policy (γ, limit gain) meets it on every seed of both traces."]
    L += [
        "",
        "The design change (the what-if row): admit by request, as mps-static does, and let the limit be a ceiling "
        "for the vertical policy instead of a reservation at placement. "
        + (f"`{WHAT_IF}` meets the target on every trace here ({', '.join(f'{t} {ratio(t, WHAT_IF):.2f}×' for t in traces)}; "
           f"{beside(WHAT_IF)})." if both.get(WHAT_IF) else
           f"`{WHAT_IF}` does not meet it on every seed ({', '.join(f'{t} {ratio(t, WHAT_IF):.2f}×' for t in traces)}).")
        + " Adopted: the `dilu` strategy now runs without its `sm-limit` filter by default (Σ request ≤ ω and memory; "
        "`PlacementConfig.gamma` and `--gpu-gamma` default to inf), the limit kept as the vertical policy's ceiling; "
        "docs/evaluation.md runs the full traces with it at the fitted κ.",
        "",
        "Limits: "
        + (f"here the reservation matters: the sharing variants' violations run from {lo_v[0]:.2f}% (`{lo_v[1]}`) to "
           f"{hi_v[0]:.2f}% (`{hi_v[1]}`), so admission by request trades burst protection for density; "
           if hi_v[0] - lo_v[0] >= 0.1 else
           "the traces here do not discriminate burst protection — every sharing variant's violations agree to "
           "a few hundredths of a point (most are requests waiting for the cold start of a function scaled to zero, the "
           "same horizontal policy for all), so the headroom that Σ limit ≤ γ reserves buys nothing measurable in them; ")
        + f"the first {' / '.join(f'{t[3] / 60:g} min' for t in result['traces'])} only; one model pair's κ; training's own κ not applied (it would raise every sharing "
        "policy's training figure alike)."
        + (" `dilu limit gain 0.5` (limits at the requests) stays short on bursty because training keeps its limit 1.0 "
           "(the training search), which Σ limit ≤ 1.5 still counts." if "dilu limit gain 0.5" in result["variants"] else "")
        + _hour_note(result),
    ]
    return L


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", type=Path, default=DEFAULT_INPUTS, help="matrix JSON files (.json or .json.gz)")
    ap.add_argument("--mode", default="mps50")
    ap.add_argument("--pair", default="resnet50+train")
    ap.add_argument("--share", type=float, default=0.5, help="the neighbour's share in the fitted cells")
    ap.add_argument("--out", type=Path, default=DATA / "colocation_fit.json")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks/colocation-fit.md")
    ap.add_argument("--serving", action="store_true", help="also run the reduced serving comparison (minutes)")
    ap.add_argument("--bursty-s", type=float, default=1800.0, help="bursty trace: simulate its first N seconds")
    ap.add_argument("--day-s", type=float, default=14400.0, help="day trace: simulate its first N seconds")
    ap.add_argument("--traces", default="bursty,azure-day", help="which serving traces (comma-separated)")
    ap.add_argument("--no-sensitivity", action="store_true", help="only the fitted κ (no other-κ runs)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--partial", type=Path, default=Path("out/colocation_fit.partial.jsonl"),
                    help="serving rows as they finish; rows already there are reused (resume)")
    ap.add_argument("--seeds", default="1,2", help="arrival seeds (the traces give counts per bin; a seed draws the times)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--doc-only", action="store_true", help="rewrite --doc from the --out JSON of an earlier run")
    args = ap.parse_args(argv)
    if args.doc_only:
        saved = json.loads(args.out.read_text())
        args.doc.write_text(markdown(saved, saved["command"]))
        return 0
    command = "PYTHONPATH=. python3 bench/fit_colocation.py" + (" " + shlex.join(argv if argv is not None else sys.argv[1:])).rstrip()
    cells = load_cells(list(args.inputs))
    result: dict[str, Any] = {"command": command, "generated_on": platform.platform(),
                              "inputs": [p.name for p in args.inputs],
                              "fit": fit(cells, args.mode, args.pair, args.share)}
    if args.serving:
        kappa = round(result["fit"]["kappa"], 3)
        upper = round(result["fit"]["summary"]["kappa_client"]["median"], 3)
        others = sorted({DEFAULT_KAPPA, upper} - {kappa})
        traces = [("bursty", "examples/serving/bursty.jsonl.gz", 16, args.bursty_s),
                  ("azure-day", "examples/serving/azure-day.jsonl.gz", 64, args.day_s)]
        # Not a default: 5 min, 10 functions at 8,000 req/s with 5× bursts (`dilu-invoker simulate gen serving
        # --pattern bursty --functions 10 --duration 300 --rate 8000 --burst-factor 5 --profiles
        # examples/profiles.json --training-jobs 2 --training-duration 300 --seed 7`): load that scales out.
        traces.append(("bursty-heavy", "examples/serving/bursty-heavy.jsonl.gz", 16, 300.0))
        traces = [t for t in traces if t[0] in args.traces.split(",")]
        if args.no_sensitivity:
            others = []
        seeds = [int(x) for x in args.seeds.split(",") if x]
        variants = [v for v in args.variants.split(",") if v]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
        t0 = time.perf_counter()
        args.partial.parent.mkdir(parents=True, exist_ok=True)
        result.update(kappa=kappa, kappas=[kappa, *others], traces=traces, jobs=args.jobs, seeds=seeds, variants=variants,
                      serving=serving(kappa, others, traces, args.jobs, seeds, variants, args.partial),
                      serving_wall_s=round(time.perf_counter() - t0, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.doc.write_text(markdown(result, command))
    s = result["fit"]["summary"]["kappa_gpu"]
    print(f"kappa {result['fit']['kappa']} (median of {s['n']} trials, {s['min']}..{s['max']}); wrote {args.out} and {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
