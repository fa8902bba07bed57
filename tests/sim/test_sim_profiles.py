"""profiles.json: parsing, errors, and the interpolation the simulator relies on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dilu_invoker.sim.profiles import ProfileError, load_profiles, parse_profiles


def doc(points: list[dict], **fn: object) -> dict:
    entry = {"class": "inference", "memory_mib": 1000, "slo_ms": 50, "points": points,
             "recommended": {"request": 0.2, "limit": 0.5, "batch": 2}}
    entry.update(fn)
    return {"format": "dilu-profiles", "version": 1, "synthetic": True, "source": "test", "functions": {"m": entry}}


def pt(share: float, batch: int, lat: float) -> dict:
    return {"sm_share": share, "batch": batch, "latency_ms": lat, "throughput_rps": batch * 1000 / lat}


POINTS = [pt(0.2, 1, 10.0), pt(0.4, 1, 5.0), pt(0.2, 4, 40.0), pt(0.4, 4, 20.0)]


def test_measured_points_are_returned_exactly() -> None:
    p = parse_profiles(doc(POINTS))["m"]
    assert p.latency_ms(0.2, 1) == pytest.approx(10.0)
    assert p.latency_ms(0.4, 4) == pytest.approx(20.0)
    assert p.throughput_rps(0.4, 4) == pytest.approx(200.0)


@pytest.mark.parametrize(
    ("share", "batch", "latency"),
    [
        (0.3, 1, 1 / ((0.1 + 0.2) / 2)),  # speed linear in share: (1/10 + 1/5) / 2
        (0.1, 1, 20.0),  # below the smallest share: speed ∝ share
        (0.9, 1, 5.0),  # above the largest: flat
        (0.2, 2, 10.0 + (40.0 - 10.0) / 3),  # latency linear in batch between 1 and 4
        (0.2, 8, 80.0),  # beyond the largest batch: time per request of the largest
    ],
    ids=["between-shares", "below", "above", "between-batches", "beyond-batches"],
)
def test_interpolation(share: float, batch: int, latency: float) -> None:
    assert parse_profiles(doc(POINTS))["m"].latency_ms(share, batch) == pytest.approx(latency)


def test_zero_share_never_finishes() -> None:
    p = parse_profiles(doc(POINTS))["m"]
    assert math.isinf(p.latency_ms(0.0, 1)) and p.throughput_rps(0.0, 1) == 0.0


def test_saturation_share() -> None:
    p = parse_profiles(doc(POINTS))["m"]
    assert p.saturation_share(1) == pytest.approx(0.4, abs=0.02)


def test_duplicate_measurements_keep_the_fastest() -> None:
    p = parse_profiles(doc([*POINTS, pt(0.2, 1, 12.0)]))["m"]
    assert p.latency_ms(0.2, 1) == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="other"), "format must be"),
        (lambda d: d.update(functions={}), "non-empty"),
        (lambda d: d["functions"]["m"].update(points=[]), "points must be"),
        (lambda d: d["functions"]["m"]["points"].append(pt(1.5, 1, 1.0)), "at most 1"),
        (lambda d: d["functions"]["m"]["points"].append({"sm_share": 0.5, "batch": 0, "latency_ms": 1, "throughput_rps": 1}), "batch must be"),
        (lambda d: d["functions"]["m"]["points"].append({"sm_share": 0.5, "batch": 1, "latency_ms": -1, "throughput_rps": 1}), "latency_ms must be > 0"),
        (lambda d: d["functions"]["m"].update(recommended={"request": 0.6, "limit": 0.5, "batch": 1}), "request <= limit"),
        (lambda d: d["functions"]["m"].update({"class": "batch"}), "unknown instance class"),
        (lambda d: d["functions"]["m"].update(memory_mib=0), "memory_mib must be > 0"),
    ],
    ids=["format", "no-functions", "no-points", "share", "batch", "latency", "recommended", "class", "memory"],
)
def test_errors(mutate: object, message: str) -> None:
    d = doc(list(POINTS))
    mutate(d)  # type: ignore[operator]
    with pytest.raises(ProfileError, match=message):
        parse_profiles(d, "p.json")


def test_roundtrip_and_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(parse_profiles(doc(POINTS)).to_json()))
    again = load_profiles(path)
    assert again["m"].latency_ms(0.3, 2) == pytest.approx(parse_profiles(doc(POINTS))["m"].latency_ms(0.3, 2))
    assert again.synthetic
    with pytest.raises(ProfileError, match="no profile named"):
        _ = again["other"]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profiles(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profiles(tmp_path / "missing.json")


def test_the_fixture_is_labelled_synthetic(synthetic_profiles: object) -> None:
    assert synthetic_profiles.synthetic  # type: ignore[attr-defined]
    assert "SYNTHETIC" in synthetic_profiles.source  # type: ignore[attr-defined]
