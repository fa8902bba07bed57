"""Turn a `bench/profile_h200.sh` run into docs/benchmarks/profiler.md.

    python3 bench/profiler_report.py RUN_DIR > docs/benchmarks/profiler.md

RUN_DIR holds the run's runs.json (every probe of the search and of the grid, per model) and
profiles.json. For each model: what the hybrid growth search recommends and how many points it
measured, the grid's optimum (the most throughput per SM share among points meeting the SLO), how
close the search's pick is to it, and the grid's latency table. Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _point(points: list[dict[str, Any]], share: float, batch: int) -> dict[str, Any] | None:
    for p in points:
        if abs(p["sm_share"] - share) < 1e-6 and p["batch"] == batch:
            return p
    return None


def _eff(p: dict[str, Any]) -> float:
    return float(p["throughput_rps"]) / float(p["sm_share"])


def model_section(name: str, run: dict[str, Any], slo_ms: float | None, training: bool) -> list[str]:
    out = [f"### {name}", ""]
    search, grid = run.get("search"), run.get("grid")
    if search is None or grid is None:
        out += ["(this run did not measure both the search and the grid)", ""]
        return out
    gpts = grid["points"]
    sb, gb = search["best"], grid["best"]
    rows = [
        ["", "hybrid growth search" if not training else "training search (binary)", "exhaustive grid"],
        ["points measured", str(search["probes"]), str(grid["probes"])],
        ["measuring time", f"{search['seconds']:.1f} s", f"{grid['seconds']:.1f} s"],
        ["request (SM share)", f"{search['request']:.2f}", f"{grid['request']:.2f}"],
        ["limit (SM share)", f"{search['limit']:.2f}", f"{grid['limit']:.2f}"],
        ["batch", str(search["batch"]), str(grid["batch"])],
    ]
    if sb and gb:
        rows.append(["latency at the pick", f"{sb['latency_ms']:.2f} ms", f"{gb['latency_ms']:.2f} ms"])
        rows.append(["throughput at the pick", f"{sb['throughput_rps']:.1f} /s", f"{gb['throughput_rps']:.1f} /s"])
        rows.append(["throughput per SM share", f"{sb['efficiency']:.1f}", f"{gb['efficiency']:.1f}"])
    out.append("| " + " | ".join(rows[0]) + " |")
    out.append("| --- | --- | --- |")
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    out.append("")
    if sb and gb:
        same = _point(gpts, sb["sm_share"], sb["batch"])
        saved = 1 - search["probes"] / grid["probes"]
        line = (
            f"The search measured **{search['probes']} of the grid's {grid['probes']} points "
            f"({_pct(saved)} fewer)**"
        )
        if search["seconds"] and grid["seconds"]:
            line += f" in {search['seconds']:.0f} s instead of {grid['seconds']:.0f} s"
        line += f". Its pick reaches **{_pct(sb['efficiency'] / gb['efficiency'])} of the grid optimum's throughput per share** as the search measured it"
        if same is not None:
            line += f", {_pct(_eff(same) / gb['efficiency'])} by the grid's own measurement of the same point (no run-to-run noise)"
        line += "."
        out += [line, ""]
        if training:
            full = _point(gpts, 1.0, search["batch"])
            if full is not None:
                want = 0.98 * full["throughput_rps"]
                first = min((p["sm_share"] for p in gpts if p["throughput_rps"] >= want), default=None)
                out += [
                    (f"Limit check: the grid's smallest share with ≥ 98% of the full-GPU throughput is "
                    f"{first:.2f}; the binary search chose {search['limit']:.2f}."),
                    "",
                ]
    # The grid's latency table.
    shares = sorted({p["sm_share"] for p in gpts})
    batches = sorted({p["batch"] for p in gpts})
    out.append("Grid latency (ms) by batch (rows) and SM share (columns)" + (f"; ✓ meets the {slo_ms:g} ms SLO" if slo_ms and not training else "") + ":")
    out.append("")
    out.append("| batch | " + " | ".join(f"{s:.1f}" for s in shares) + " |")
    out.append("| --- |" + " --- |" * len(shares))
    for b in batches:
        cells = []
        for s in shares:
            p = _point(gpts, s, b)
            if p is None:
                cells.append("–")
                continue
            mark = " ✓" if slo_ms and not training and p["latency_ms"] <= slo_ms else ""
            cells.append(f"{p['latency_ms']:.1f}{mark}")
        out.append(f"| {b} | " + " | ".join(cells) + " |")
    out.append("")
    return out


def report(run_dir: Path) -> str:
    runs = json.loads((run_dir / "runs.json").read_text())
    profiles = json.loads((run_dir / "profiles.json").read_text())
    env = runs.get("environment", {})
    lines = ["# Profiler: hybrid growth search against the exhaustive grid", ""]
    if runs.get("synthetic"):
        lines += ["> **SYNTHETIC dry run** — a latency formula stood in for the GPU. Not a measurement.", ""]
    lines += [
        (f"Measured on **{env.get('device', 'unknown device')}** (torch {env.get('torch')}, CUDA {env.get('cuda')}), "
        f"SM share held by **{runs.get('share_control')}**, {runs.get('workers_started')} worker processes, "
        f"{runs.get('wall_s')} s in all."),
        "",
        "Command (from `bench/profile_h200.sh`):",
        "",
        "```",
        str(runs.get("command", "")),
        "```",
        "",
        (f"Grid: SM shares {', '.join(f'{s:g}' for s in runs.get('shares', []))} × batches "
        f"{', '.join(str(b) for b in runs.get('batches', []))} (training: batch {runs.get('training_batch')}); "
        f"each point: {runs['measure']['warmup']} warm-up iterations, then at least {runs['measure']['min_iters']} "
        f"and at most {runs['measure']['max_iters']} timed iterations over ≥ {runs['measure']['min_time_s']} s; "
        "latency is the median iteration, throughput batch / mean iteration. SLO "
        f"{runs.get('slo_ms')} ms for inference. The grid's optimum is the point meeting the SLO with the "
        "most throughput per unit of SM share; the search's pick is its request and batch."),
        "",
        "## Summary",
        "",
        "| model | search points | grid points | fewer points | search pick (request, batch) | grid optimum | search / optimum (throughput per share) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    sections: list[str] = []
    for name, run in runs.get("models", {}).items():
        fn = profiles.get("functions", {}).get(name, {})
        training = fn.get("class") == "training"
        search, grid = run.get("search"), run.get("grid")
        if search and grid and search.get("best") and grid.get("best"):
            ratio = search["best"]["efficiency"] / grid["best"]["efficiency"]
            lines.append(
                f"| {name} | {search['probes']} | {grid['probes']} | {_pct(1 - search['probes'] / grid['probes'])} | "
                f"{search['request']:.1f}, {search['batch']} | {grid['best']['sm_share']:.1f}, {grid['best']['batch']} | {_pct(ratio)} |"
            )
        sections += model_section(name, run, fn.get("slo_ms"), training)
    lines += ["", "## Per model", ""] + sections
    lines += [
        "## Reproduce",
        "",
        ("On the GPU machine, from the repository root: `bench/profile_h200.sh` (writes `$OUT/profiles.json`, "
        "`runs.json`, `profile.log`, `worker.log`); then `python3 bench/profiler_report.py $OUT > "
        "docs/benchmarks/profiler.md` and `cp $OUT/profiles.json examples/profiles.json`."),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: profiler_report.py RUN_DIR", file=sys.stderr)
        return 2
    sys.stdout.write(report(Path(argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
