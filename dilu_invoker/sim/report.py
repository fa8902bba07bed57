"""Output files: JSON summaries, CSV time series, comparison tables, PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(columns)
        for row in rows:
            w.writerow([_fmt(v) for v in row])


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return ""
        return f"{v:.6g}"
    return v


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "–"
            return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}" if abs(v) >= 10000 else str(v)
        return str(v)

    head = "| " + " | ".join(columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join([head, sep, *body])


def plain_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_series(
    path: Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    step: bool = True,
    styles: Mapping[str, str] | None = None,
) -> None:
    """One line per named series (x, y); `step` draws values as held until the next sample."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, (xs, ys) in series.items():
        style = (styles or {}).get(name, "-")
        if step:
            ax.step(xs, ys, where="post", label=name, linestyle=style, linewidth=1.2)
        else:
            ax.plot(xs, ys, label=name, linestyle=style, linewidth=1.2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(
    path: Path, labels: Sequence[str], values: Mapping[str, Sequence[float]], *, title: str, ylabel: str
) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    n = len(values)
    width = 0.8 / max(1, n)
    for k, (name, ys) in enumerate(values.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, ys, width=width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    if n > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def downsample(xs: Sequence[float], ys: Sequence[float], max_points: int = 4000) -> tuple[list[float], list[float]]:
    """At most `max_points` points for a plot, keeping each window's maximum (peaks stay visible)."""
    n = len(xs)
    if n <= max_points:
        return list(xs), list(ys)
    step = math.ceil(n / max_points)
    ox, oy = [], []
    for i in range(0, n, step):
        ox.append(xs[i])
        oy.append(max(ys[i : i + step]))
    return ox, oy
