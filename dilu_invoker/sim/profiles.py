"""`profiles.json`: measured (SM share, batch) → (latency, throughput) points per function.

    {
      "format": "dilu-profiles", "version": 1,
      "synthetic": false,
      "source": "how the points were obtained (the command, the device, the date)",
      "device": "NVIDIA H200",
      "functions": {
        "resnet50": {
          "class": "inference",                # inference | llm | training
          "memory_mib": 1900,                  # GPU memory one instance needs at its batch size
          "slo_ms": 50,                        # latency objective (inference); optional for training
          "points": [
            {"sm_share": 0.1, "batch": 1, "latency_ms": 9.8, "throughput_rps": 102.0},
            ...
          ],
          "recommended": {"request": 0.3, "limit": 0.5, "batch": 8}
        }
      }
    }

For training, `latency_ms` is one iteration and `throughput_rps` samples per second. The simulator
interpolates: for a batch size it has points for, speed (1 / latency) linearly in the share between
measured shares, proportional to the share below the smallest one and flat above the largest; for a
batch size between two measured ones, latency linearly in the batch size.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilu_invoker.policy import InstanceClass

FORMAT = "dilu-profiles"
VERSION = 1


class ProfileError(ValueError):
    """A malformed profiles file; the message names the file and the function."""


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    sm_share: float
    batch: int
    latency_ms: float
    throughput_rps: float

    def to_json(self) -> dict[str, Any]:
        return {
            "sm_share": round(self.sm_share, 4),
            "batch": self.batch,
            "latency_ms": round(self.latency_ms, 4),
            "throughput_rps": round(self.throughput_rps, 3),
        }


@dataclass(frozen=True, slots=True)
class Recommendation:
    request: float
    limit: float
    batch: int

    def to_json(self) -> dict[str, Any]:
        return {"request": round(self.request, 4), "limit": round(self.limit, 4), "batch": self.batch}


class FunctionProfile:
    """One function's measured points, with the interpolation the simulator uses."""

    def __init__(
        self,
        name: str,
        *,
        cls: InstanceClass,
        memory_mib: float,
        points: list[ProfilePoint],
        recommended: Recommendation,
        slo_ms: float | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if not points:
            raise ProfileError(f"profile {name}: no points")
        self.name = name
        self.cls = cls
        self.memory_mib = memory_mib
        self.slo_ms = slo_ms
        self.points = sorted(points, key=lambda p: (p.batch, p.sm_share))
        self.recommended = recommended
        self.extra = dict(extra or {})
        by_batch: dict[int, list[tuple[float, float]]] = {}
        for p in self.points:
            by_batch.setdefault(p.batch, []).append((p.sm_share, p.latency_ms))
        self.batches: list[int] = sorted(by_batch)
        self._curves: dict[int, tuple[list[float], list[float]]] = {}
        for b, pts in by_batch.items():
            # Several measurements of one (share, batch): keep the fastest (least disturbed).
            best: dict[float, float] = {}
            for s, lat in pts:
                best[s] = min(lat, best.get(s, math.inf))
            shares = sorted(best)
            self._curves[b] = (shares, [1.0 / best[s] for s in shares])

    # -- interpolation ----------------------------------------------------------------------

    def _speed(self, b: int, share: float) -> float:
        """Batches per millisecond at `share` for a measured batch size `b`."""
        shares, speeds = self._curves[b]
        if share <= shares[0]:
            return speeds[0] * max(share, 0.0) / shares[0]
        if share >= shares[-1]:
            return speeds[-1]
        i = bisect.bisect_right(shares, share)
        s0, s1 = shares[i - 1], shares[i]
        w = (share - s0) / (s1 - s0)
        return speeds[i - 1] * (1 - w) + speeds[i] * w

    def latency_ms(self, share: float, batch: int) -> float:
        """Latency of one batch of `batch` requests (or one training iteration) at `share`."""
        if batch < 1:
            raise ValueError("batch must be >= 1")
        if share <= 0:
            return math.inf
        bs = self.batches
        if batch in self._curves:
            return 1.0 / self._speed(batch, share)
        if batch < bs[0]:
            return 1.0 / self._speed(bs[0], share)
        if batch > bs[-1]:
            # Beyond the largest measured batch: time per request stays that of the largest.
            return batch / bs[-1] / self._speed(bs[-1], share)
        i = bisect.bisect_right(bs, batch)
        b0, b1 = bs[i - 1], bs[i]
        l0 = 1.0 / self._speed(b0, share)
        l1 = 1.0 / self._speed(b1, share)
        return l0 + (l1 - l0) * (batch - b0) / (b1 - b0)

    def throughput_rps(self, share: float, batch: int) -> float:
        lat = self.latency_ms(share, batch)
        return 0.0 if not math.isfinite(lat) else batch * 1000.0 / lat

    def saturation_share(self, batch: int, within: float = 0.05) -> float:
        """The smallest share whose speed is within `within` of the best at this batch size: more
        SM than this does not make the batch faster (it cannot use the extra SMs)."""
        best = 1.0 / self.latency_ms(1.0, batch)
        lo, hi = 0.01, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            if 1.0 / self.latency_ms(mid, batch) >= (1 - within) * best:
                hi = mid
            else:
                lo = mid
        return hi

    # -- JSON -----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"class": self.cls.value, "memory_mib": round(self.memory_mib, 1)}
        if self.slo_ms is not None:
            out["slo_ms"] = self.slo_ms
        out["points"] = [p.to_json() for p in self.points]
        out["recommended"] = self.recommended.to_json()
        out.update(self.extra)
        return out


@dataclass(frozen=True, slots=True)
class ProfileSet:
    functions: Mapping[str, FunctionProfile]
    synthetic: bool
    source: str
    device: str = ""

    def __getitem__(self, name: str) -> FunctionProfile:
        try:
            return self.functions[name]
        except KeyError:
            raise ProfileError(
                f"no profile named {name!r}; the profiles file has {sorted(self.functions)}"
            ) from None

    def names(self, *, training: bool | None = None) -> list[str]:
        out = []
        for name, p in sorted(self.functions.items()):
            is_train = p.cls is InstanceClass.TRAINING
            if training is None or training == is_train:
                out.append(name)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "synthetic": self.synthetic,
            "source": self.source,
            "device": self.device,
            "functions": {n: p.to_json() for n, p in sorted(self.functions.items())},
        }


def _num(obj: Mapping[str, Any], key: str, where: str, *, positive: bool = True) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ProfileError(f"{where}: {key} must be a finite number, got {v!r}")
    if positive and v <= 0:
        raise ProfileError(f"{where}: {key} must be > 0, got {v!r}")
    return float(v)


def parse_function(name: str, obj: Any, where: str) -> FunctionProfile:
    if not isinstance(obj, dict):
        raise ProfileError(f"{where}: a function's profile must be an object")
    try:
        cls = InstanceClass.parse(str(obj.get("class", "inference")))
    except ValueError as exc:
        raise ProfileError(f"{where}: {exc}") from None
    memory = _num(obj, "memory_mib", where)
    slo = obj.get("slo_ms")
    if slo is not None:
        slo = _num(obj, "slo_ms", where)
    raw = obj.get("points")
    if not isinstance(raw, list) or not raw:
        raise ProfileError(f"{where}: points must be a non-empty list")
    points = []
    for i, p in enumerate(raw):
        pw = f"{where}.points[{i}]"
        if not isinstance(p, dict):
            raise ProfileError(f"{pw}: must be an object")
        share = _num(p, "sm_share", pw)
        if share > 1.0 + 1e-9:
            raise ProfileError(f"{pw}: sm_share must be at most 1, got {share}")
        batch = p.get("batch")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ProfileError(f"{pw}: batch must be an integer >= 1, got {batch!r}")
        points.append(
            ProfilePoint(
                sm_share=share,
                batch=batch,
                latency_ms=_num(p, "latency_ms", pw),
                throughput_rps=_num(p, "throughput_rps", pw),
            )
        )
    rec = obj.get("recommended")
    if rec is None:
        b = min(p.batch for p in points)
        recommended = Recommendation(request=0.5, limit=1.0, batch=b)
    else:
        rw = f"{where}.recommended"
        if not isinstance(rec, dict):
            raise ProfileError(f"{rw}: must be an object")
        req = _num(rec, "request", rw)
        lim = _num(rec, "limit", rw)
        rb = rec.get("batch")
        if isinstance(rb, bool) or not isinstance(rb, int) or rb < 1:
            raise ProfileError(f"{rw}: batch must be an integer >= 1, got {rb!r}")
        if not (0 < req <= lim <= 1.0 + 1e-9):
            raise ProfileError(f"{rw}: need 0 < request <= limit <= 1, got {req}, {lim}")
        recommended = Recommendation(request=req, limit=min(1.0, lim), batch=rb)
    known = {"class", "memory_mib", "slo_ms", "points", "recommended"}
    extra = {k: v for k, v in obj.items() if k not in known}
    return FunctionProfile(
        name, cls=cls, memory_mib=memory, points=points, recommended=recommended, slo_ms=slo, extra=extra
    )


def parse_profiles(doc: Any, name: str = "<profiles>") -> ProfileSet:
    if not isinstance(doc, dict):
        raise ProfileError(f"{name}: must be a JSON object")
    if doc.get("format", FORMAT) != FORMAT:
        raise ProfileError(f"{name}: format must be {FORMAT!r}, got {doc.get('format')!r}")
    fns = doc.get("functions")
    if not isinstance(fns, dict) or not fns:
        raise ProfileError(f"{name}: 'functions' must be a non-empty object")
    functions = {fn: parse_function(fn, obj, f"{name}: {fn}") for fn, obj in fns.items()}
    return ProfileSet(
        functions=functions,
        synthetic=bool(doc.get("synthetic", False)),
        source=str(doc.get("source", "")),
        device=str(doc.get("device", "")),
    )


def load_profiles(path: str | Path) -> ProfileSet:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read {p}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return parse_profiles(doc, str(p))
