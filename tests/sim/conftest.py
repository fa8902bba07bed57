"""Fixtures of the simulator's tests. The profile set is SYNTHETIC (a formula, see
make_synthetic_profiles.py): tests check the simulator's mechanics, never model performance."""

from __future__ import annotations

from pathlib import Path

import pytest

from dilu_invoker.sim.profiles import ProfileSet, load_profiles

SYNTHETIC_PROFILES = Path(__file__).parent / "data" / "synthetic_profiles.json"


@pytest.fixture(scope="session")
def synthetic_profiles() -> ProfileSet:
    profiles = load_profiles(SYNTHETIC_PROFILES)
    assert profiles.synthetic, "the test fixture must stay labelled synthetic"
    return profiles
