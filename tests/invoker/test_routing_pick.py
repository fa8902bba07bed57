"""Choosing an instance from a routing table: power of two choices on work per slot (tables)."""

from __future__ import annotations

import random

import pytest

from dilu_invoker.invoker.cluster.routing import instance_load, pick_instance
from dilu_invoker.wire import RouteEntry


def e(iid: str, inv: str = "invoker1", *, slots: int = 1, in_flight: int = 0, waiting: int = 0) -> RouteEntry:
    return RouteEntry(id=iid, invoker=inv, slots=slots, in_flight=in_flight, waiting=waiting)


@pytest.mark.parametrize(("entry", "outstanding", "expect"), [
    (e("a"), {}, 0.0),
    (e("a", in_flight=1, waiting=1, slots=4), {}, 0.5),
    (e("a", in_flight=1), {"a": 3}, 3.0),
    (e("a", in_flight=5, slots=2), {"a": 1}, 2.5),
], ids=["idle", "reported", "local-larger", "reported-larger"])
def test_instance_load(entry: RouteEntry, outstanding: dict[str, int], expect: float) -> None:
    assert instance_load(entry, outstanding) == expect


@pytest.mark.parametrize(("entries", "outstanding", "local", "expect"), [
    ([e("a")], {}, "invoker0", "a"),
    ([e("a"), e("b")], {"a": 1}, "invoker0", "b"),
    ([e("a", in_flight=3), e("b", in_flight=1)], {}, "invoker0", "b"),
    ([e("a", "invoker1"), e("b", "invoker0")], {}, "invoker0", "b"),
    ([e("a", "invoker1"), e("b", "invoker2")], {}, "invoker0", "a"),
    ([e("a", slots=4, in_flight=3), e("b", in_flight=1)], {}, "invoker0", "a"),
], ids=["only-one", "free-slot", "less-work", "tie-local", "tie-id", "per-slot"])
def test_pick_between_two(entries: list[RouteEntry], outstanding: dict[str, int], local: str, expect: str) -> None:
    for seed in range(5):
        assert pick_instance(entries, outstanding, random.Random(seed), local=local).id == expect


def test_instances_with_a_free_slot_come_first() -> None:
    entries = [e("busy1", in_flight=1), e("free"), e("busy2", waiting=2)]
    for seed in range(20):
        assert pick_instance(entries, {}, random.Random(seed), local="x").id == "free"


def test_when_all_are_full_the_less_loaded_of_two_wins() -> None:
    entries = [e(f"i{k}", in_flight=k + 1) for k in range(4)]
    rng = random.Random(1)
    picks = [pick_instance(entries, {}, rng, local="x").id for _ in range(400)]
    # The most loaded instance is never the lesser of two distinct samples; the least loaded wins whenever
    # it is sampled (half of the pairs).
    assert "i3" not in picks
    assert picks.count("i0") == pytest.approx(200, abs=40)


def test_no_instance_is_an_error() -> None:
    with pytest.raises(ValueError):
        pick_instance([], {}, random.Random(0), local="x")
