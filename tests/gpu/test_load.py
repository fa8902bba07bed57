"""An instance's own queue as the data plane counts it and the GPU manager reads it (gpu/load.py)."""

from __future__ import annotations

import pytest

from dilu_invoker.gpu.load import RECENT_MAX, InstanceLoad, KeyQueue, LoadReading


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_nothing_reads_as_an_empty_instance() -> None:
    assert InstanceLoad(KeyQueue(), clock=Clock()).read() == LoadReading()


def test_the_queue_reports_its_length_and_the_oldest_waiter_in_arrival_order() -> None:
    clock = Clock()
    q = KeyQueue()
    q.members = 1
    load = InstanceLoad(q, clock=clock)
    first, second = q.enter(99.0), q.enter(99.5)
    r = load.read()
    assert (r.queued, r.oldest_wait_s) == (2.0, pytest.approx(1.0))
    q.leave(first)
    assert load.read().oldest_wait_s == pytest.approx(0.5)
    q.leave(second)
    q.leave(second)  # leaving twice changes nothing
    assert (load.read().queued, load.read().oldest_wait_s) == (0.0, 0.0)


@pytest.mark.parametrize(("members", "waiting", "queued"), [(1, 3, 3.0), (2, 3, 1.5), (0, 2, 2.0)],
                         ids=["one-container", "two-share-the-key", "not-counted-yet"])
def test_waiters_of_a_key_are_shared_among_its_containers(members: int, waiting: int, queued: float) -> None:
    q = KeyQueue()
    q.members = members
    for k in range(waiting):
        q.enter(float(k))
    assert InstanceLoad(q, clock=Clock()).read().queued == queued


def test_runs_are_reported_once_with_their_waits_and_the_run_in_progress_is_aged() -> None:
    clock = Clock(10.0)
    load = InstanceLoad(KeyQueue(), clock=clock)
    a = load.started(9.0)
    b = load.started(9.5)
    load.finished(a, 9.006, waited_s=0.002)
    r = load.read()
    assert r.runs_s == pytest.approx((0.006,)) and r.waits_s == pytest.approx((0.002,))
    assert (r.running, r.open_run_s) == (1, pytest.approx(0.5))
    load.finished(b, 9.51, waited_s=-1.0)  # a clock step never reads as a negative wait
    again = load.read()
    assert again.runs_s == pytest.approx((0.01,)) and again.waits_s == (0.0,)
    assert (again.running, again.open_run_s) == (0, 0.0)
    assert load.read().runs_s == ()  # drained
    load.finished(b, 9.6, waited_s=0.0)  # finished twice: counted once
    assert load.read().runs_s == ()


def test_an_unread_instance_keeps_only_the_newest_runs() -> None:
    load = InstanceLoad(KeyQueue(), clock=Clock())
    for k in range(RECENT_MAX + 10):
        load.finished(load.started(0.0), float(k), waited_s=0.0)
    r = load.read()
    assert len(r.runs_s) == RECENT_MAX and r.runs_s[-1] == float(RECENT_MAX + 9)
