#!/usr/bin/env python3
"""Render docs/benchmarks/vertical.md from vertical_results.json (bench/vertical/h200.py merge).

    python3 bench/vertical/report.py vertical_results.json [--out docs/benchmarks/vertical.md]
        [--gpu-samples gpu_samples.csv]

Either file may be gzipped (`.gz`), as the runs kept in docs/benchmarks/data are.

Stdlib only. Every figure comes from the JSON; a missing step or scenario is shown as such, never invented.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import gzip
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

# Issue 4's anchor, measured before this manager existed (same models and load), for context only.
ANCHOR = [
    ("solo", "8.8", "30.9 it/s"),
    ("co-located, no control", "47 (5.4x solo)", "79% of solo"),
    ("MPS 50/50", "9.8 (1.12x)", "66%"),
    ("MPS 70/30", "9.2", "46%"),
]
TARGETS = {"p99_ratio": 1.25, "training_steady": 0.75, "burst_violations": 0.01, "reaction_ms": 100.0,
           "training_idle": 0.95}
MODES = ("Time-slicing", "MPS (100% threads each) + shim rates")
"""Long names of the `timeslice` and `mps` steps in the targets table (`mps_capped`'s is built from its run)."""


ARRIVALS = {"paced": "evenly spaced (paced, as in the issue's anchor)", "poisson": "Poisson"}
"""How each arrival process is named in the set-up (results before `--arrivals` existed were Poisson)."""


def f(x: Any, digits: int = 1, unit: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def pctf(x: Any, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("**met**" if ok else "**not met**")


def second_p99s(sc: dict[str, Any]) -> list[float]:
    """The p99 latency (ms) of each whole second of a scenario's requests (none when it kept no requests)."""
    per: dict[int, list[float]] = {}
    for arrival, latency in sc.get("requests") or []:
        per.setdefault(int(arrival), []).append(latency)
    full = [sorted(v) for k, v in sorted(per.items()) if len(v) >= 20]
    return [v[min(len(v) - 1, int(0.99 * len(v)))] for v in full]


def read_text(path: Path) -> str:
    """A file as text, gunzipped when its name ends in .gz (docs/benchmarks/data keeps runs compressed)."""
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def read_samples(path: Path, machine: str) -> list[tuple[float, dict[str, str]]]:
    """nvidia-smi's CSV (run_h200.sh's gpu_samples.csv) as (unix time, field → value); its timestamps are
    the machine's local time, whose offset the machine text's `date:` line gives."""
    m = re.search(r"^date: \S+?([+-]\d\d:\d\d|Z)$", machine, re.M)
    tz = dt.UTC
    if m and m.group(1) != "Z":
        sign = 1 if m.group(1)[0] == "+" else -1
        hours, minutes = (int(x) for x in m.group(1)[1:].split(":"))
        tz = dt.timezone(sign * dt.timedelta(hours=hours, minutes=minutes))
    rows = list(csv.reader(read_text(path).splitlines()))
    if not rows:
        return []
    head = [h.strip().split(" [")[0] for h in rows[0]]
    out = []
    for r in rows[1:]:
        if len(r) != len(head):
            continue  # an error line or a torn last line
        try:
            t = dt.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=tz).timestamp()
        except ValueError:
            continue
        out.append((t, {h: v.strip() for h, v in zip(head, r, strict=True)}))
    return out


def number(text: str | None) -> float | None:
    try:
        return float((text or "").split()[0])
    except (ValueError, IndexError):
        return None


def get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def variants_of(step: dict[str, Any], prefix: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for k, v in step.items():
        if isinstance(v, dict) and (k == prefix or k.startswith(prefix + "@")):
            out.append((k.partition("@")[2] or "default", v))
    return out


def reaction_ms(burst: dict[str, Any]) -> float | None:
    r = burst.get("reaction") or {}
    times = [t for t in (r.get("share_raised_ms"), r.get("first_cut_ms")) if t is not None]
    return min(times) if times else None


class Report:
    def __init__(self, doc: dict[str, Any], samples: list[tuple[float, dict[str, str]]] | None = None) -> None:
        self.doc = doc
        self.samples = samples or []
        self.steps: dict[str, Any] = doc.get("steps") or {}
        self.ts: dict[str, Any] = self.steps.get("timeslice") or {}
        self.lines: list[str] = []

    def w(self, line: str = "") -> None:
        self.lines.append(line)

    # -- reference figures ------------------------------------------------------------------------

    @property
    def ref(self) -> dict[str, Any]:
        """The step that measured the solo figures: the time-sliced one, else the MPS one (an MPS-only run)."""
        if get(self.ts, "solo_inference", "p99_ms"):
            return self.ts
        return self.steps.get("mps") or {}

    @property
    def solo_p99(self) -> float | None:
        return get(self.ref, "solo_inference", "p99_ms")

    @property
    def solo_it(self) -> float | None:
        return get(self.ref, "calibration", "training_solo_it_s")

    def shared_steps(self, long: bool = False) -> list[tuple[str, str]]:
        """(label, step) of every step where the manager shares the GPU, in run order."""
        out = [(MODES[0] if long else "time-slicing", "timeslice"), (MODES[1] if long else "MPS + shim", "mps")]
        capped = self.steps.get("mps_capped")
        if isinstance(capped, dict) and capped.get("mps_percentages"):
            pct = get(capped, "mps_percentages", "training")
            out.append((f"MPS (training ≤ {pct}% threads) + shim rates" if long else f"MPS ≤{pct}% + shim",
                        "mps_capped"))
        return out

    def p99_ratio(self, sc: dict[str, Any]) -> float | None:
        p99 = get(sc, "inference", "p99_ms")
        return p99 / self.solo_p99 if p99 and self.solo_p99 else None

    # -- sections ---------------------------------------------------------------------------------

    def header(self) -> None:
        d = self.doc
        self.w("# Vertical scaling on the H200")
        self.w()
        self.w(f"Generated {d.get('generated', '?')} by `bench/vertical/report.py` from `vertical_results.json`, "
               f"produced by `{d.get('command', '?')}` (run from the repository root; scale {d.get('scale')}).")
        self.w()
        if d.get("dry_run"):
            self.w("> **DRY RUN.** Stand-ins replaced the GPU workers (`bench/vertical/dry_run.sh`): the shim and the "
                   "manager were real, the numbers below are made up and prove only the pipeline.")
            self.w()
        opts = self.ts.get("options") or next((s.get("options") for s in self.steps.values() if isinstance(s, dict)
                                               and s.get("options")), {}) or {}
        inst = self.ref.get("instances") or {}
        workers = self.ref.get("workers") or {}
        torch_v = get(workers, "inference", "torch")
        self.w("**Set-up.** Two processes on one GPU, each under `libdilu_shim.so` with the control and stats blocks "
               "of a `GpuNode` attachment (process backend), driven by the node's `GpuManager` in the benchmark's "
               "process (the invoker's code, without Redis):")
        self.w()
        self.w(f"* inference: torchvision ResNet-50 (random weights), fp16, batch {opts.get('infer_batch')}, "
               f"open-loop {ARRIVALS.get(opts.get('arrivals', 'poisson'), '?')} arrivals with a FIFO queue, "
               f"latency = completion − arrival; class inference, "
               f"request {get(inst, 'inference', 'request')}, limit {get(inst, 'inference', 'limit')};")
        self.w(f"* training: ResNet-50 fp32, batch {opts.get('train_batch')}, SGD, synchronised steps; class training, "
               f"request {get(inst, 'training', 'request')}, limit {get(inst, 'training', 'limit')} "
               f"(the node admits Σ limit ≤ γ = {opts.get('gamma')});")
        cal = self.ref.get("calibration") or {}
        cap = cal.get("capacity_blocks_per_ms") or {}
        est = cal.get("estimator_blocks_per_ms") or {}
        self.w(f"* steady load: {pctf(opts.get('load'), 0)} of inference's closed-loop capacity "
               f"({f(get(cal, 'inference_closed', 'rps'))} requests/s alone) for {opts.get('seconds')} s; "
               f"manager period {opts.get('period_ms')} ms;")
        self.w(f"* capacities ({opts.get('capacity')}): inference {f(cap.get('inference'))} blocks/ms, training "
               f"{f(cap.get('training'))} blocks/ms measured alone (the online estimator had learnt "
               f"{f(est.get('inference'))} and {f(est.get('training'))});")
        variants = opts.get("variants") or {}
        default = variants.get("default") or {}
        for name, cfg in variants.items():
            if name == "default":
                continue
            diff = {k: v for k, v in cfg.items() if default.get(k) != v}
            what = (f"the defaults with {', '.join(f'`{k}={v}`' for k, v in diff.items())}" if diff
                    else "the defaults again (a repeat in the same run: how far two trials of one policy differ)")
            self.w(f"* policy variant `{name}`: {what};")
        # Runs before the time-sliced policy became slo measured variants of the one before it (docs/policies.md §1.2).
        if "run1-default" in variants:
            self.w("  (`run1-default` is the policy of the first H200 run; docs/policies.md §1.2);")
        if "run3-default" in variants:
            self.w("  (`run3-default` is the policy of the third H200 run; docs/policies.md §1.2);")
        mslo = next((s.get("manager_slo_ms") for s in self.steps.values() if isinstance(s, dict)
                     and s.get("manager_slo_ms")), None)
        told = (f"the manager is given the same SLO ({f(mslo)} ms) once the solo run has measured it" if mslo
                else "the manager is given a fixed 100 ms annotation")
        self.w(f"* torch {torch_v}, SLO = 2 × solo p99 = {f(2 * self.solo_p99 if self.solo_p99 else None)} ms; {told}.")
        self.w()

    def targets(self) -> None:
        self.w("## Targets (issue 4)")
        self.w()
        self.w("| mode | policy | steady: p99 / solo p99 (≤ 1.25) | steady: training / solo (≥ 75%) | burst: SLO "
               "violations (≤ 1%) | burst: reaction (≤ 100 ms) | idle: training / solo (≥ 95%) |")
        self.w("|---|---|---|---|---|---|---|")
        for label, key in self.shared_steps(long=True):
            step = self.steps.get(key) or {}
            if not step:
                continue
            dyns = dict(variants_of(step, "dynamic"))
            bursts = dict(variants_of(step, "burst"))
            idles = dict(variants_of(step, "idle"))
            names = list(dict.fromkeys([*dyns, *bursts])) or ["default"]
            for v in names:
                d, b, i = dyns.get(v, {}), bursts.get(v, {}), idles.get(v, {})
                ratio = self.p99_ratio(d)
                tr = get(d, "training", "vs_solo")
                viol = get(b, "inference_burst", "violations")
                react = reaction_ms(b) if b else None
                idle = get(i, "training", "vs_solo")
                self.w(f"| {label} | {v} | {f(ratio, 2)} {verdict(None if ratio is None else ratio <= 1.25)} | "
                       f"{pctf(tr)} {verdict(None if tr is None else tr >= 0.75)} | "
                       f"{pctf(viol, 2)} {verdict(None if viol is None else viol <= 0.01)} | "
                       f"{f(react, 0, ' ms')} {verdict(None if react is None else react <= 100)} | "
                       f"{pctf(idle)} {verdict(None if idle is None else idle >= 0.95)} |")
        self.w()
        self.w("Reaction: time from the burst's first arrival to the first manager decision that raised the "
               "inference share or cut training's (— when neither happened). It only means something when the "
               "manager was not already cutting before the burst: see the emergency ticks in the burst table.")
        self.w()

    def steady_table(self) -> None:
        self.w("## Steady load")
        self.w()
        self.w("| mode | scenario | inference p50 (ms) | p99 (ms) | p99 / solo | p99 of each second: median / worst "
               "(ms) | SLO violations | training it/s | training / solo | manager modes (ticks) | mean training share |")
        self.w("|---|---|---|---|---|---|---|---|---|---|---|")
        solo = self.ref.get("solo_inference") or {}
        alone = "time-slicing" if self.ref is self.ts else "MPS + shim"
        self.w(f"| {alone} | inference alone | {f(solo.get('p50_ms'), 2)} | {f(solo.get('p99_ms'), 2)} | 1.00 | "
               f"{self.seconds(solo)} | — | — | — | — | — |")
        self.w(f"| {alone} | training alone | — | — | — | — | — | {f(self.solo_it, 2)} | 100% | — | — |")
        for label, key in self.shared_steps():
            own = (self.steps.get(key) or {}).get("solo_inference")
            if isinstance(own, dict) and (self.steps.get(key) or {}) is not self.ref:
                # The same inference alone under this step's sharing (MPS client): the floor of its p99.
                self.w(f"| {label} | inference alone (this mode) | {f(own.get('p50_ms'), 2)} | "
                       f"{f(own.get('p99_ms'), 2)} | {f(self.p99_ratio({'inference': own}), 2)} | {self.seconds(own)} | "
                       f"— | — | — | — | — |")
        for label, key in self.shared_steps():
            step = self.steps.get(key) or {}
            for name in ("none", *(k for k in step if k == "static" or k.startswith("static@"))):
                if isinstance(step.get(name), dict):
                    self.row(label, self.scenario_label(name, step[name]), step[name])
            for v, d in variants_of(step, "dynamic"):
                self.row(label, f"dynamic manager ({v})", d)
        static = self.steps.get("mps_static") or {}
        splits = static.get("static_mps_splits") or {"50/50": static.get("static_mps_split")}
        for split, sc in splits.items():
            if isinstance(sc, dict):
                self.row(f"MPS {split}", f"static MPS split {split} (no shim limits)", sc)
        self.w()

    @staticmethod
    def scenario_label(name: str, sc: dict[str, Any]) -> str:
        pins = sc.get("pins") or {}
        if name == "none":
            return "co-located, no limits"
        if name == "static" or name.startswith("static@"):
            return f"static shim shares {pins.get('inference')}/{pins.get('training')}"
        raise ValueError(name)

    def row(self, mode: str, label: str, sc: dict[str, Any]) -> None:
        inf, tr, mgr = sc.get("inference") or {}, sc.get("training") or {}, sc.get("manager") or {}
        modes = ", ".join(f"{k} {v}" for k, v in (mgr.get("modes") or {}).items())
        share = get(mgr, "mean_share", "training")
        self.w(f"| {mode} | {label} | {f(inf.get('p50_ms'), 2)} | {f(inf.get('p99_ms'), 2)} | "
               f"{f(self.p99_ratio(sc), 2)} | {self.seconds(sc)} | {pctf(inf.get('violations'), 2)} | "
               f"{f(tr.get('it_s'), 2)} | "
               f"{pctf(tr.get('vs_solo'))} | {modes or '—'} | {f(share, 3)} |")

    @staticmethod
    def seconds(sc: dict[str, Any]) -> str:
        p99s = second_p99s(sc)
        return f"{statistics.median(p99s):.1f} / {max(p99s):.1f}" if p99s else "—"

    def gpu_table(self) -> None:
        """SM clock, power and clock-event reasons while each scenario ran (run_h200.sh's gpu_samples.csv)."""
        if not self.samples:
            return
        rows = []
        for label, key in [*self.shared_steps(), ("time-slicing", "timeslice")]:
            step = self.steps.get(key) or {}
            for name, sc in step.items():
                if not isinstance(sc, dict) or sc.get("t0_unix") is None or (label, name) in {r[:2] for r in rows}:
                    continue
                reqs = sc.get("requests") or []
                length = sum(sc["phases_s"]) if sc.get("phases_s") else (reqs[-1][0] if reqs else 0.0)
                t0 = sc["t0_unix"]
                got = [v for t, v in self.samples if t0 <= t <= t0 + length]
                if not got:
                    continue
                clocks = [x for x in (number(v.get("clocks.current.sm")) for v in got) if x is not None]
                watts = [x for x in (number(v.get("power.draw")) for v in got) if x is not None]
                reasons = sorted({v.get("clocks_event_reasons.active") or v.get("clocks_throttle_reasons.active")
                                  or "?" for v in got})
                rows.append((label, name, len(got), clocks, watts, reasons))
        if not rows:
            return
        self.w("## GPU during each scenario")
        self.w()
        self.w("From `gpu_samples.csv` (nvidia-smi every 100 ms, lined up by each scenario's start). A slow second that "
               "the clocks, the power and the clock-event reasons do not explain came from elsewhere.")
        self.w()
        self.w("| mode | scenario | samples | SM clock min–max (MHz) | power mean / max (W) | clock-event reasons |")
        self.w("|---|---|---|---|---|---|")
        for label, name, n, clocks, watts, reasons in rows:
            clock = f"{min(clocks):.0f}–{max(clocks):.0f}" if clocks else "—"
            power = f"{statistics.fmean(watts):.0f} / {max(watts):.0f}" if watts else "—"
            self.w(f"| {label} | {name} | {n} | {clock} | {power} | {', '.join(reasons)} |")
        self.w()

    def burst_table(self) -> None:
        self.w("## Burst")
        self.w()
        self.w("| mode | scenario | rate (req/s) | burst p99 (ms) | violations in the burst | violations, whole run | "
               "inference share before → raised (ms) | first training cut (ms) | emergency ticks in the second "
               "before | training it/s |")
        self.w("|---|---|---|---|---|---|---|---|---|---|")
        for label, key in self.shared_steps():
            step = self.steps.get(key) or {}
            items = [(f"dynamic ({v})", b) for v, b in variants_of(step, "burst")]
            if isinstance(step.get("burst_solo"), dict):
                items.append(("inference alone", step["burst_solo"]))
            for name, b in items:
                r = b.get("rates_rps") or {}
                re = b.get("reaction") or {}
                self.w(f"| {label} | {name} | {f(r.get('base'), 0)} → {f(r.get('burst'), 0)} | "
                       f"{f(get(b, 'inference_burst', 'p99_ms'), 2)} | {pctf(get(b, 'inference_burst', 'violations'), 2)} | "
                       f"{pctf(get(b, 'inference_all', 'violations'), 2)} | {f(re.get('share_before'), 2)} → "
                       f"{f(re.get('share_raised_to'), 2)} ({f(re.get('share_raised_ms'), 0)}) | "
                       f"{f(re.get('first_cut_ms'), 0)} | {f(re.get('emergency_ticks_in_second_before'))} | "
                       f"{f(get(b, 'training', 'it_s'), 2)} |")
        self.w()

    def idle_table(self) -> None:
        self.w("## Idle (inference stops)")
        self.w()
        self.w("| mode | policy | idle mode after (ms) | training it/s | training / solo |")
        self.w("|---|---|---|---|---|")
        for label, key in self.shared_steps():
            for v, i in variants_of(self.steps.get(key) or {}, "idle"):
                self.w(f"| {label} | {v} | {f(i.get('idle_mode_after_ms'), 0)} | {f(get(i, 'training', 'it_s'), 2)} | "
                       f"{pctf(get(i, 'training', 'vs_solo'))} |")
        self.w()

    def decisions(self) -> None:
        self.w("## What the manager did")
        self.w()
        for label, key in self.shared_steps():
            for v, d in variants_of(self.steps.get(key) or {}, "dynamic"):
                changes = get(d, "manager", "mode_changes") or []
                self.w(f"**{label}, dynamic ({v}):** {len(changes)} mode changes during the steady run"
                       f"{' (first shown)' if changes else ''}.")
                self.w()
                for c in changes[:4]:
                    self.w(f"* t={c.get('t')} s → {c.get('mode')}: {c.get('reason')}")
                if changes:
                    self.w()
        self.w("The full decision timelines (shares, rates, modes per tick) are in `vertical_results.json`.")
        self.w()

    def anchor(self) -> None:
        self.w("## Anchor from the issue (before this manager; same models and load)")
        self.w()
        self.w("| configuration | inference p99 (ms) | training |")
        self.w("|---|---|---|")
        for row in ANCHOR:
            self.w(f"| {row[0]} | {row[1]} | {row[2]} |")
        self.w()

    def problems(self) -> None:
        errs = []
        # Runs merged before `merge --steps` existed list unselected steps as missing: leave those out.
        chosen = re.search(r"DILU_BENCH_STEPS='([^']*)'", str(self.doc.get("command", "")))
        for name, step in self.steps.items():
            if not isinstance(step, dict) or (chosen and name not in chosen.group(1).split()):
                continue
            if step.get("error"):
                errs.append(f"* step `{name}`: {str(step['error']).strip().splitlines()[-1][:300]}")
            for sc, e in (step.get("errors") or {}).items():
                errs.append(f"* `{name}/{sc}`: {str(e)[:300]}")
        if errs:
            self.w("## Problems during the run")
            self.w()
            self.lines.extend(errs)
            self.w()

    def machine(self) -> None:
        self.w("## Machine")
        self.w()
        self.w("```")
        self.w(str(self.doc.get("machine", "")).rstrip())
        self.w("```")

    def render(self) -> str:
        self.header()
        self.targets()
        self.steady_table()
        self.burst_table()
        self.idle_table()
        self.gpu_table()
        self.decisions()
        self.anchor()
        self.problems()
        self.machine()
        return "\n".join(self.lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--out", default="docs/benchmarks/vertical.md")
    ap.add_argument("--gpu-samples", type=Path, help="run_h200.sh's gpu_samples.csv: adds the GPU's clocks per scenario")
    args = ap.parse_args()
    doc = json.loads(read_text(Path(args.results)))
    samples = read_samples(args.gpu_samples, str(doc.get("machine", ""))) if args.gpu_samples else None
    Path(args.out).write_text(Report(doc, samples).render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
