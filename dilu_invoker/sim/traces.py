"""Serving traces: the native JSON-lines format, the Azure Functions 2019 schema, and arrivals.

Native format (`dilu-serving-trace`, written by `simulate gen serving`), JSON lines:

    {"format": "dilu-serving-trace", "version": 1, "duration_s": 86400, "source": "..."}
    {"function": "f001", "profile": "resnet50", "slo_ms": 50, "bin_s": 60, "start_s": 0, "counts": [3, 0, 7, ...]}
    {"function": "train-01", "profile": "train-resnet50", "class": "training", "start_s": 3600, "end_s": 7200}

An inference line gives the number of requests arriving in each bin of `bin_s` seconds from `start_s`
(`slo_ms` optional: the profile's SLO otherwise); a training line a job that runs from `start_s` to
`end_s` as long as it is placed. Within a bin, arrivals are uniform at random (a Poisson process
conditioned on its count), drawn from the run's `--seed`.

Azure Functions 2019 (Shahrad et al., ATC'20; CC-BY): `invocations_per_function_md.anon.dNN.csv`
(`HashOwner,HashApp,HashFunction,Trigger,1..1440`, invocations per minute), optionally
`function_durations_percentiles.anon.dNN.csv` (`HashOwner,HashApp,HashFunction,Average,Count,Minimum,
Maximum,percentile_Average_{0,1,25,50,75,99,100}`, ms) and a memory file, either the original per-app
`app_memory_percentiles.anon.dNN.csv` (`HashOwner,HashApp,SampleCount,AverageAllocatedMb,
AverageAllocatedMb_pct{1,5,25,50,75,95,99,100}`) or the per-function variant with an extra
`HashFunction` column. Azure functions run on CPUs, so a GPU profile is assigned to each: by the rank
of its average duration when durations are given (longer functions get slower models), else by a hash
of its name. Memory is read and checked and kept as each function's `host_memory_mb`; GPU memory comes
from the profile.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dilu_invoker.sim.events import open_text
from dilu_invoker.sim.profiles import ProfileSet

TRACE_FORMAT = "dilu-serving-trace"
AZURE_MINUTES = 1440
DURATION_PCTS = ("0", "1", "25", "50", "75", "99", "100")
MEMORY_PCTS = ("1", "5", "25", "50", "75", "95", "99", "100")


class TraceError(ValueError):
    """A malformed trace; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class FunctionTrace:
    name: str
    profile: str
    counts: np.ndarray
    """Requests arriving in each bin."""
    bin_s: float = 60.0
    start_s: float = 0.0
    slo_ms: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return int(self.counts.sum())

    @property
    def end_s(self) -> float:
        return self.start_s + self.bin_s * len(self.counts)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"function": self.name, "profile": self.profile}
        if self.slo_ms is not None:
            out["slo_ms"] = self.slo_ms
        out.update({"bin_s": self.bin_s, "start_s": self.start_s, "counts": [int(c) for c in self.counts]})
        if self.meta:
            out["meta"] = self.meta
        return out


@dataclass(frozen=True, slots=True)
class TrainingJob:
    name: str
    profile: str
    start_s: float
    end_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "function": self.name,
            "profile": self.profile,
            "class": "training",
            "start_s": self.start_s,
            "end_s": self.end_s,
        }


@dataclass(frozen=True, slots=True)
class ServingTrace:
    duration_s: float
    functions: tuple[FunctionTrace, ...]
    jobs: tuple[TrainingJob, ...] = ()
    source: str = ""

    @property
    def requests(self) -> int:
        return sum(f.requests for f in self.functions)

    def check_profiles(self, profiles: ProfileSet) -> None:
        """Fail before simulating if the trace names a profile the profiles file lacks."""
        for f in self.functions:
            p = profiles[f.profile]
            if p.cls.value == "training":
                raise TraceError(f"function {f.name}: profile {f.profile} is a training profile")
            if f.slo_ms is None and p.slo_ms is None:
                raise TraceError(f"function {f.name}: no slo_ms in the trace nor in profile {f.profile}")
        for j in self.jobs:
            if profiles[j.profile].cls.value != "training":
                raise TraceError(f"training job {j.name}: profile {j.profile} is not a training profile")

    def write(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open_text(p, "w") as fh:
            header = {"format": TRACE_FORMAT, "version": 1, "duration_s": self.duration_s, "source": self.source}
            fh.write(json.dumps(header) + "\n")
            for f in self.functions:
                fh.write(json.dumps(f.to_json(), separators=(",", ":")) + "\n")
            for j in self.jobs:
                fh.write(json.dumps(j.to_json(), separators=(",", ":")) + "\n")


# -- arrivals ------------------------------------------------------------------------------------


def arrivals(fn: FunctionTrace, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival times (s) of one function: each bin's count spread uniformly within it."""
    counts = fn.counts.astype(np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, dtype=np.float64)
    starts = fn.start_s + fn.bin_s * np.arange(len(counts), dtype=np.float64)
    t = np.repeat(starts, counts) + rng.random(total) * fn.bin_s
    t.sort()
    return t


# -- the native format ---------------------------------------------------------------------------


def _num(obj: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    if key not in obj:
        if default is not None:
            return default
        raise TraceError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise TraceError(f"{where}: {key} must be a finite number, got {v!r}")
    return float(v)


def read_native(lines: Iterable[str], name: str) -> ServingTrace:
    it = iter(enumerate(lines, start=1))
    header: dict[str, Any] | None = None
    functions: list[FunctionTrace] = []
    jobs: list[TrainingJob] = []
    names: set[str] = set()
    for n, raw in it:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{name}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: each line must be a JSON object")
        if header is None:
            if obj.get("format") != TRACE_FORMAT:
                raise TraceError(f"{where}: the first line must be the header {{\"format\": \"{TRACE_FORMAT}\", ...}}")
            header = obj
            continue
        fname = obj.get("function")
        if not isinstance(fname, str) or not fname:
            raise TraceError(f"{where}: function must be a non-empty string")
        if fname in names:
            raise TraceError(f"{where}: function {fname!r} appears twice")
        names.add(fname)
        profile = obj.get("profile")
        if not isinstance(profile, str) or not profile:
            raise TraceError(f"{where}: profile must be a non-empty string")
        if obj.get("class", "inference") == "training":
            start = _num(obj, "start_s", where)
            end = _num(obj, "end_s", where)
            if not 0 <= start < end:
                raise TraceError(f"{where}: need 0 <= start_s < end_s, got {start}, {end}")
            jobs.append(TrainingJob(fname, profile, start, end))
            continue
        counts = obj.get("counts")
        if not isinstance(counts, list) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts
        ):
            raise TraceError(f"{where}: counts must be a list of integers >= 0")
        bin_s = _num(obj, "bin_s", where, 60.0)
        start = _num(obj, "start_s", where, 0.0)
        if bin_s <= 0 or start < 0:
            raise TraceError(f"{where}: need bin_s > 0 and start_s >= 0")
        slo = obj.get("slo_ms")
        if slo is not None:
            slo = _num(obj, "slo_ms", where)
            if slo <= 0:
                raise TraceError(f"{where}: slo_ms must be > 0")
        meta = obj.get("meta") or {}
        functions.append(
            FunctionTrace(fname, profile, np.asarray(counts, dtype=np.int64), bin_s, start, slo, dict(meta))
        )
    if header is None:
        raise TraceError(f"{name}: empty trace")
    if not functions and not jobs:
        raise TraceError(f"{name}: no functions")
    ends = [f.end_s for f in functions] + [j.end_s for j in jobs]
    duration = _num(header, "duration_s", f"{name}:header", max(ends))
    return ServingTrace(duration, tuple(functions), tuple(jobs), str(header.get("source", "")))


# -- Azure Functions 2019 ------------------------------------------------------------------------


def _read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not rows:
        raise TraceError(f"{path}: empty file")
    return [h.strip() for h in rows[0]], rows[1:]


def _need(header: list[str], cols: Sequence[str], path: Path) -> dict[str, int]:
    idx = {h: i for i, h in enumerate(header)}
    missing = [c for c in cols if c not in idx]
    if missing:
        raise TraceError(f"{path}: missing column(s) {missing}; header is {header[:8]}…")
    return idx


@dataclass(frozen=True, slots=True)
class AzureFunction:
    owner: str
    app: str
    function: str
    trigger: str
    counts: np.ndarray
    duration_ms: float | None = None
    host_memory_mb: float | None = None


def read_azure_invocations(path: Path) -> list[AzureFunction]:
    header, rows = _read_csv(path)
    idx = _need(header, ("HashOwner", "HashApp", "HashFunction", "Trigger"), path)
    minute_cols = [h for h in header if h.isdigit()]
    if not minute_cols:
        raise TraceError(f"{path}: no per-minute columns (1..1440)")
    mins = sorted(int(h) for h in minute_cols)
    if mins != list(range(1, len(mins) + 1)):
        raise TraceError(f"{path}: minute columns must be 1..N without gaps")
    mcols = [idx[str(m)] for m in mins]
    out = []
    for n, row in enumerate(rows, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) < len(header):
            raise TraceError(f"{path}:{n}: {len(row)} fields, the header has {len(header)}")
        try:
            counts = np.array([int(float(row[i] or 0)) for i in mcols], dtype=np.int64)
        except ValueError:
            raise TraceError(f"{path}:{n}: per-minute counts must be integers") from None
        if (counts < 0).any():
            raise TraceError(f"{path}:{n}: negative count")
        out.append(
            AzureFunction(
                owner=row[idx["HashOwner"]],
                app=row[idx["HashApp"]],
                function=row[idx["HashFunction"]],
                trigger=row[idx["Trigger"]],
                counts=counts,
            )
        )
    if not out:
        raise TraceError(f"{path}: no functions")
    return out


def read_azure_durations(path: Path) -> dict[tuple[str, str, str], float]:
    header, rows = _read_csv(path)
    idx = _need(header, ("HashOwner", "HashApp", "HashFunction", "Average"), path)
    out = {}
    for n, row in enumerate(rows, start=2):
        if not row:
            continue
        try:
            avg = float(row[idx["Average"]])
        except (ValueError, IndexError):
            raise TraceError(f"{path}:{n}: Average must be a number") from None
        if not math.isfinite(avg) or avg < 0:
            raise TraceError(f"{path}:{n}: Average must be >= 0")
        out[(row[idx["HashOwner"]], row[idx["HashApp"]], row[idx["HashFunction"]])] = avg
    return out


def read_azure_memory(path: Path) -> tuple[bool, dict[tuple[str, ...], float]]:
    """(per_function, key -> AverageAllocatedMb); key is (owner, app) or (owner, app, function)."""
    header, rows = _read_csv(path)
    idx = _need(header, ("HashOwner", "HashApp", "AverageAllocatedMb"), path)
    per_function = "HashFunction" in idx
    out: dict[tuple[str, ...], float] = {}
    for n, row in enumerate(rows, start=2):
        if not row:
            continue
        try:
            mb = float(row[idx["AverageAllocatedMb"]])
        except (ValueError, IndexError):
            raise TraceError(f"{path}:{n}: AverageAllocatedMb must be a number") from None
        if not math.isfinite(mb) or mb < 0:
            raise TraceError(f"{path}:{n}: AverageAllocatedMb must be >= 0")
        key: tuple[str, ...] = (row[idx["HashOwner"]], row[idx["HashApp"]])
        if per_function:
            key = key + (row[idx["HashFunction"]],)
        out[key] = mb
    return per_function, out


def _find_sibling(path: Path, patterns: Sequence[str]) -> Path | None:
    for pat in patterns:
        found = sorted(path.parent.glob(pat))
        if found:
            return found[0]
    return None


def _stable_hash(text: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{text}".encode()).digest()[:8], "big")


def read_azure(
    invocations: Path,
    profiles: ProfileSet,
    *,
    durations: Path | None = None,
    memory: Path | None = None,
    top: int | None = None,
    seed: int = 0,
    slo_ms: float | None = None,
) -> ServingTrace:
    """An Azure 2019 day as a serving trace; durations and memory are found beside the invocations
    file when not given (`function_durations_percentiles*.csv`, `app_memory_percentiles*.csv`,
    `memory*.csv`)."""
    fns = read_azure_invocations(invocations)
    durations = durations or _find_sibling(invocations, ("function_durations_percentiles*.csv", "durations*.csv"))
    memory = memory or _find_sibling(invocations, ("app_memory_percentiles*.csv", "memory*.csv"))
    dur = read_azure_durations(durations) if durations else {}
    per_fn, mem = read_azure_memory(memory) if memory else (False, {})
    fns = [f for f in fns if f.counts.sum() > 0]
    if top is not None:
        fns = sorted(fns, key=lambda f: (-int(f.counts.sum()), f.function))[:top]
    inference = profiles.names(training=False)
    if not inference:
        raise TraceError("the profiles file has no inference profile")
    # Slowest-first order of profiles by latency at their request share and batch 1.
    by_speed = sorted(
        inference,
        key=lambda n: (profiles[n].latency_ms(profiles[n].recommended.request, 1), n),
    )
    keyed = [(f, dur.get((f.owner, f.app, f.function))) for f in fns]
    out = []
    if dur and all(d is not None for _, d in keyed):
        ranked = sorted(keyed, key=lambda fd: (fd[1], fd[0].function))
        rank = {id(f): i for i, (f, _) in enumerate(ranked)}
    else:
        rank = {}
    for f, d in keyed:
        if rank:
            prof = by_speed[min(len(by_speed) - 1, rank[id(f)] * len(by_speed) // len(keyed))]
        else:
            prof = inference[_stable_hash(f.function, seed) % len(inference)]
        key = (f.owner, f.app, f.function) if per_fn else (f.owner, f.app)
        meta: dict[str, Any] = {"trigger": f.trigger}
        if d is not None:
            meta["duration_ms"] = d
        if key in mem:
            meta["host_memory_mb"] = mem[key]
        out.append(
            FunctionTrace(
                name=f.function[:16] if len(f.function) > 16 else f.function,
                profile=prof,
                counts=f.counts,
                bin_s=60.0,
                slo_ms=slo_ms,
                meta=meta,
            )
        )
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        # Short names collided: keep the full hashes.
        out = [
            FunctionTrace(fa.function, fn.profile, fn.counts, fn.bin_s, fn.start_s, fn.slo_ms, fn.meta)
            for fa, fn in zip(fns, out, strict=True)
        ]
    minutes = max(len(f.counts) for f in fns)
    return ServingTrace(
        duration_s=60.0 * minutes,
        functions=tuple(out),
        source=f"Azure Functions 2019 schema: {invocations.name}",
    )


def write_azure(
    functions: Sequence[AzureFunction],
    out_dir: Path,
    *,
    day: int = 1,
    per_function_memory: bool = True,
) -> list[Path]:
    """Write Azure 2019-schema files (invocations, durations, per-app memory and, optionally, the
    per-function memory variant) for self-made functions."""
    out_dir.mkdir(parents=True, exist_ok=True)
    d = f"d{day:02d}"
    paths = []
    inv = out_dir / f"invocations_per_function_md.anon.{d}.csv"
    minutes = max(len(f.counts) for f in functions)
    with inv.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["HashOwner", "HashApp", "HashFunction", "Trigger", *range(1, minutes + 1)])
        for f in functions:
            w.writerow([f.owner, f.app, f.function, f.trigger, *(int(c) for c in f.counts)])
    paths.append(inv)
    dur = out_dir / f"function_durations_percentiles.anon.{d}.csv"
    with dur.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(
            ["HashOwner", "HashApp", "HashFunction", "Average", "Count", "Minimum", "Maximum"]
            + [f"percentile_Average_{p}" for p in DURATION_PCTS]
        )
        for f in functions:
            avg = f.duration_ms or 100.0
            spread = [0.5, 0.6, 0.85, 1.0, 1.15, 2.0, 3.0]
            w.writerow(
                [f.owner, f.app, f.function, round(avg, 1), int(f.counts.sum()), round(avg * 0.4, 1), round(avg * 3.5, 1)]
                + [round(avg * s, 1) for s in spread]
            )
    paths.append(dur)
    apps: dict[tuple[str, str], float] = {}
    for f in functions:
        apps.setdefault((f.owner, f.app), f.host_memory_mb or 128.0)
    mem = out_dir / f"app_memory_percentiles.anon.{d}.csv"
    spread_m = [0.7, 0.8, 0.9, 1.0, 1.05, 1.2, 1.3, 1.5]
    with mem.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["HashOwner", "HashApp", "SampleCount", "AverageAllocatedMb"] + [f"AverageAllocatedMb_pct{p}" for p in MEMORY_PCTS])
        for (owner, app), mb in apps.items():
            w.writerow([owner, app, 1440, round(mb, 1)] + [round(mb * s, 1) for s in spread_m])
    paths.append(mem)
    if per_function_memory:
        memf = out_dir / "memory.csv"
        with memf.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(
                ["HashOwner", "HashApp", "HashFunction", "SampleCount", "AverageAllocatedMb"]
                + [f"AverageAllocatedMb_pct{p}" for p in MEMORY_PCTS]
            )
            for f in functions:
                mb = f.host_memory_mb or 128.0
                w.writerow([f.owner, f.app, f.function, 1440, round(mb, 1)] + [round(mb * s, 1) for s in spread_m])
        paths.append(memf)
    return paths


def load_trace(
    path: str | Path,
    profiles: ProfileSet,
    *,
    durations: str | Path | None = None,
    memory: str | Path | None = None,
    top: int | None = None,
    seed: int = 0,
    slo_ms: float | None = None,
) -> ServingTrace:
    """A serving trace from the native format or an Azure 2019 invocations CSV (by content)."""
    p = Path(path)
    try:
        with open_text(p) as fh:
            first = fh.readline()
    except (OSError, EOFError) as exc:
        raise TraceError(f"cannot read {p}: {getattr(exc, 'strerror', None) or exc}") from None
    if first.lstrip().startswith("{"):
        with open_text(p) as fh:
            trace = read_native(fh, str(p))
        if slo_ms is not None:
            trace = ServingTrace(
                trace.duration_s,
                tuple(
                    FunctionTrace(f.name, f.profile, f.counts, f.bin_s, f.start_s, slo_ms, f.meta)
                    for f in trace.functions
                ),
                trace.jobs,
                trace.source,
            )
        if top is not None:
            keep = sorted(trace.functions, key=lambda f: (-f.requests, f.name))[:top]
            trace = ServingTrace(trace.duration_s, tuple(keep), trace.jobs, trace.source)
    elif "HashOwner" in first or "HashFunction" in first:
        trace = read_azure(
            p,
            profiles,
            durations=Path(durations) if durations else None,
            memory=Path(memory) if memory else None,
            top=top,
            seed=seed,
            slo_ms=slo_ms,
        )
    else:
        raise TraceError(
            f"{p}: neither a {TRACE_FORMAT} file (JSON lines) nor an Azure 2019 invocations CSV"
        )
    trace.check_profiles(profiles)
    return trace
