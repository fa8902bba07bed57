"""The manager's pure pieces by tables (reading the stats block, the capacity estimator, quotas), and its tick
against stats blocks written the way the shim writes them (no process, an injected clock)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dilu_invoker.gpu import abi
from dilu_invoker.gpu.load import LoadReading
from dilu_invoker.gpu.manager import (
    CapacityConfig,
    CapacityEstimate,
    CapacityObservation,
    Counters,
    GpuManager,
    InstanceSpec,
    TickRecord,
    estimate_capacity,
    quota_for,
    read_delta,
    ticks,
    vertical_instance,
)
from dilu_invoker.gpu.metrics import GpuMetrics
from dilu_invoker.policy.types import InstanceClass
from dilu_invoker.policy.vertical import FeedbackMode
from dilu_invoker.policy.vertical_slo import SloConfig, SloState, StaticConfig
from tests.gpu.support import StatsWriter, snapshot

# -- reading the stats block ---------------------------------------------------------------------

PREV = Counters(pid=100, launches=12, blocks=500, throttled_ns=3_000_000, windows=10, cycles=2,
                cycle_current_windows=1)


@pytest.mark.parametrize(
    ("prev", "snap", "expect"),
    [
        # expect: blocks, launches, throttled_s, windows, busy_windows, cycles_s, open_cycle_s, restarted
        (None, snapshot(blocks=500, launches=10, graph_launches=2, throttled_ns=3_000_000, windows=10, cycles=2,
                        recent_cycles=(3, 2), cycle_current_windows=1),
         (500, 12, 0.003, 10, 6, (0.015, 0.010), 0.005, False)),
        (PREV, snapshot(blocks=900, launches=20, throttled_ns=5_000_000, windows=20, cycles=3,
                        recent_cycles=(3, 2, 4), cycle_current_windows=2),
         (400, 8, 0.002, 10, 5, (0.020,), 0.010, False)),
        (replace(PREV, cycles=3, cycle_current_windows=2),
         snapshot(blocks=600, launches=12, throttled_ns=3_000_000, windows=15, cycles=3, recent_cycles=(3, 2, 4),
                  cycle_current_windows=7),
         (100, 0, 0.0, 5, 5, (), 0.035, False)),
        (PREV, snapshot(pid=200, blocks=50, launches=1, windows=2, cycles=0, cycle_current_windows=2),
         (50, 1, 0.0, 2, 2, (), 0.010, True)),
        (PREV, snapshot(blocks=100, launches=30, throttled_ns=3_000_000, windows=30, cycles=2,
                        recent_cycles=(3, 2)),
         (100, 30, 0.003, 30, 5, (0.015, 0.010), 0.0, True)),
        (replace(PREV, cycles=0, windows=0, cycle_current_windows=0),
         snapshot(blocks=600, launches=12, throttled_ns=3_000_000, windows=200, cycles=20,
                  recent_cycles=tuple(range(1, 17))),
         (100, 0, 0.0, 200, sum(range(1, 17)), tuple(c * 0.005 for c in range(1, 17)), 0.0, False)),
        (replace(PREV, cycles=0, cycle_current_windows=0),
         snapshot(blocks=600, launches=12, throttled_ns=3_000_000, windows=12, cycles=1, recent_cycles=(9,),
                  cycle_current_windows=3),
         (100, 0, 0.0, 2, 2, (0.045,), 0.015, False)),
    ],
    ids=["first-reading", "delta", "open-cycle-grows", "restart-new-pid", "counters-went-back",
         "ring-overflow-keeps-16", "busy-clamped-to-windows"],
)
def test_read_delta(prev: Counters | None, snap: abi.StatsSnapshot, expect: tuple[object, ...]) -> None:
    reading, counters = read_delta(prev, snap)
    blocks, launches, throttled, windows, busy, cycles, open_s, restarted = expect
    assert (reading.blocks, reading.launches, reading.windows, reading.busy_windows) == (
        blocks, launches, windows, busy)
    assert reading.throttled_s == pytest.approx(throttled)
    assert reading.cycles_s == pytest.approx(cycles)
    assert reading.open_cycle_s == pytest.approx(open_s)
    assert reading.restarted is restarted and reading.published
    assert counters == Counters.of(snap)


_SAME = {"blocks": 500, "launches": 12, "throttled_ns": 3_000_000, "windows": 10, "cycles": 2,
         "recent_cycles": (3, 2), "cycle_current_windows": 1}


@pytest.mark.parametrize(
    ("prev", "snap", "expect"),
    [
        # expect: spans, spans_s, open_span_s (read at 10 ms), restarted
        (None, snapshot(**_SAME, spans=3, recent_spans_us=(1000, 2000, 3500)), (3, (0.001, 0.002, 0.0035), 0.0, False)),
        (replace(PREV, spans=2), snapshot(**_SAME, spans=4, recent_spans_us=(1, 2, 3000, 4000), span_open_ns=9_000_000),
         (2, (0.003, 0.004), 0.001, False)),
        (replace(PREV, spans=4), snapshot(**_SAME, spans=4, recent_spans_us=(1, 2, 3000, 4000), span_open_ns=4_000_000),
         (0, (), 0.006, False)),
        (replace(PREV, spans=1), snapshot(**_SAME, spans=31, recent_spans_us=tuple(range(108, 132))),
         (30, tuple(us / 1e6 for us in range(108, 132)), 0.0, False)),
        (replace(PREV, spans=10), snapshot(**_SAME, spans=2, recent_spans_us=(500, 600)), (2, (0.0005, 0.0006), 0.0, True)),
    ],
    ids=["first-reading", "delta-and-open-span", "open-span-only", "ring-overflow-keeps-24", "spans-went-back"],
)
def test_read_delta_spans(prev: Counters | None, snap: abi.StatsSnapshot, expect: tuple[object, ...]) -> None:
    reading, counters = read_delta(prev, snap, now_ns=10_000_000)
    spans, spans_s, open_s, restarted = expect
    assert reading.spans == spans and reading.restarted is restarted
    assert reading.spans_s == pytest.approx(spans_s)
    assert reading.open_span_s == pytest.approx(open_s)
    assert counters is not None and counters.spans == snap.spans


def test_unpublished_block_reads_as_nothing() -> None:
    reading, counters = read_delta(PREV, snapshot(heartbeat_ns=0, blocks=10))
    assert not reading.published and reading.blocks == 0 and not reading.demand and counters is None


def test_vertical_instance_clips_throttling_to_the_period() -> None:
    spec = InstanceSpec(id="a", function="ns/f", cls=InstanceClass.TRAINING, request=0.2, limit=0.6, slo_ms=50)
    reading, _ = read_delta(None, snapshot(blocks=10, throttled_ns=400_000_000, cycles=1, recent_cycles=(4,),
                                           windows=10))
    inst = vertical_instance(spec, reading, period_s=0.05, last_active_at=3.0, share=0.4)
    assert inst.throttled_s == pytest.approx(0.05) and inst.blocks == 10 and inst.share == 0.4
    assert inst.cycles_s == pytest.approx((0.02,)) and inst.last_active_at == 3.0 and inst.slo_ms == 50
    assert not inst.queue_known and inst.mps_threads is None


# -- capacity --------------------------------------------------------------------------------------

BASE = CapacityObservation(blocks=1000, busy_windows=10, window_s=0.005, elapsed_s=0.05, throttled_s=0.0,
                           limited=True, at_limit=False, others_latency_active=False, windows=10,
                           now=100.0)  # busy rate 20 blocks/ms
THROTTLED = replace(BASE, throttled_s=0.01, at_limit=True)
KNOWN20 = CapacityEstimate(20.0, 20.0, learnt_blocks_per_ms=20.0)
TRUSTED_TWICE = CapacityEstimate(trusted_periods=2, peak_blocks_per_ms=15.0)


@pytest.mark.parametrize(
    ("est", "obs", "value", "peak", "why"),
    [
        (CapacityEstimate(override=50.0), BASE, 50.0, 0.0, "measured"),
        (CapacityEstimate(), BASE, None, 20.0, "trustworthy period 1/3"),
        (TRUSTED_TWICE, BASE, 20.0, 20.0, "learnt 20.0 blocks/ms from 3"),
        (TRUSTED_TWICE, replace(BASE, blocks=500), 15.0, 15.0, "learnt 15.0"),
        (CapacityEstimate(10.0, 10.0), BASE, 20.0, 20.0, "raised"),
        (CapacityEstimate(100.0, 100.0), replace(BASE, elapsed_s=600.0), 50.0, 100.0, "decayed"),
        (CapacityEstimate(100.0, 100.0), replace(BASE, elapsed_s=6000.0), 20.0, 100.0, "raised"),
        (KNOWN20, THROTTLED, 40.0, 20.0, "probe"),
        (KNOWN20, replace(THROTTLED, others_latency_active=True), 20.0, 20.0, "not its own"),
        (KNOWN20, replace(BASE, throttled_s=0.01), 20.0, 20.0, "not its own"),
        (CapacityEstimate(1270.0, 20.0, learnt_blocks_per_ms=20.0, probing=True), THROTTLED, 1280.0, 20.0, "probe"),
        (CapacityEstimate(1280.0, 20.0, learnt_blocks_per_ms=20.0, probing=True), THROTTLED, 1280.0, 20.0,
         "stopped"),
        (CapacityEstimate(1280.0, 20.0, learnt_blocks_per_ms=20.0, probing=True), replace(THROTTLED, blocks=32_000),
         2560.0, 20.0, "probe 1280.0 -> 2560.0"),
        (replace(KNOWN20, next_probe_at=101.0), THROTTLED, 20.0, 20.0, "next probe in 1.0 s"),
        (CapacityEstimate(80.0, 20.0, learnt_blocks_per_ms=20.0, probing=True), replace(BASE, blocks=3000), 60.0, 60.0,
         "probe found 60.0"),
        (CapacityEstimate(80.0, 20.0, learnt_blocks_per_ms=20.0, probing=True, probe_backoff_s=1.0), BASE, 20.0,
         20.0, "next probe in 1.0 s"),
        (CapacityEstimate(), replace(BASE, throttled_s=0.02), None, 0.0, "no estimate"),
        (CapacityEstimate(5.0, 5.0), replace(BASE, busy_windows=1), 5.0, 5.0, "no clean"),
        (CapacityEstimate(5.0, 5.0), replace(BASE, throttled_s=0.002), 5.0, 5.0, "no clean"),
        (CapacityEstimate(), replace(BASE, limited=False, throttled_s=0.02), None, 20.0, "trustworthy period 1"),
        (CapacityEstimate(), replace(BASE, blocks=0), None, 0.0, "no clean"),
        (CapacityEstimate(), replace(BASE, windows=40), None, 0.0, "idle-dominated (25%"),
        (TRUSTED_TWICE, replace(BASE, mem_grown_bytes=64 << 20), None, 15.0, "loading: device memory grew 64.0 MiB"),
        (KNOWN20, replace(BASE, blocks=100_000, mem_grown_bytes=1 << 20), 20.0, 20.0, "loading"),
    ],
    ids=["override-wins", "first-trustworthy-period-keeps-unlimited", "third-period-adopts-the-highest",
         "adopts-the-highest-of-the-streak", "higher-rate-raises", "decays-over-a-half-life",
         "decays-down-to-the-observation", "probe-when-throttled-at-limit-alone",
         "no-probe-beside-latency-critical-demand", "no-probe-below-the-limit", "probe-capped-at-64x-peak",
         "probe-stops-at-the-cap", "probe-cap-follows-the-consumed-quota", "probe-waits-for-its-backoff", "probe-that-finds-a-faster-rate-raises",
         "fruitless-probe-falls-back-and-backs-off", "throttled-without-estimate-teaches-nothing",
         "too-few-busy-windows", "partly-throttled-teaches-nothing", "unlimited-has-no-token-waits",
         "idle-teaches-nothing", "idle-dominated-teaches-nothing", "loading-restarts-the-streak",
         "loading-never-teaches"],
)
def test_estimate_capacity(est: CapacityEstimate, obs: CapacityObservation, value: float | None, peak: float,
                           why: str) -> None:
    new, reason = estimate_capacity(est, obs, CapacityConfig())
    assert new.value == (pytest.approx(value) if value is not None else None)
    assert new.peak_blocks_per_ms == pytest.approx(peak)
    assert why in reason
    if "loading-restarts" in why or "restarts the streak" in reason:
        assert new.trusted_periods == 0


def test_capacity_streak_restarts_after_loading() -> None:
    new, _ = estimate_capacity(TRUSTED_TWICE, replace(BASE, mem_grown_bytes=1), CapacityConfig())
    assert new.trusted_periods == 0 and new.value is None


def test_fruitless_probes_back_off_doubling_to_the_cap() -> None:
    cfg = CapacityConfig(probe_backoff_s=1.0, max_probe_backoff_s=4.0)
    est = CapacityEstimate(20.0, 20.0, learnt_blocks_per_ms=20.0, probe_backoff_s=1.0)
    waits = []
    now = 0.0
    for _ in range(4):
        est, why = estimate_capacity(est, replace(THROTTLED, now=now), cfg)
        assert est.probing and "probe" in why
        est, why = estimate_capacity(est, replace(BASE, now=now), cfg)  # quota no longer binds: same rate
        assert not est.probing and est.value == pytest.approx(20.0)
        waits.append(est.next_probe_at - now)
        now = est.next_probe_at
    assert waits == [1.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize(
    ("share", "capacity", "rate", "recorded"),
    [(1.0, 100.0, 0.0, 1.0), (0.5, None, 0.0, 0.5), (0.5, 100.0, 50.0, 0.5), (0.0, 100.0, 0.01, 0.0001),
     (1.3, 100.0, 0.0, 1.0), (0.25, 0.0, 0.0, 0.25)],
    ids=["whole-gpu-is-unlimited", "unknown-capacity-is-unlimited", "share-times-capacity",
         "zero-keeps-a-trickle", "over-one-is-clipped", "zero-capacity-is-unknown"],
)
def test_quota_for(share: float, capacity: float | None, rate: float, recorded: float) -> None:
    q = quota_for(share, capacity, mem_cap_bytes=1 << 30, stale_after_ns=7)
    assert q.rate_blocks_per_ms == pytest.approx(rate) and q.share == pytest.approx(recorded)
    assert q.mem_cap_bytes == 1 << 30 and q.stale_after_ns == 7


async def test_ticks_follow_the_schedule() -> None:
    seen = []
    async for n in ticks(0.005):
        seen.append(n)
        if len(seen) == 3:
            break
    assert seen == [0, 1, 2]
    with pytest.raises(ValueError):
        await anext(aiter(ticks(0.0)))


# -- ticks against written stats blocks -----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns

    def advance(self, s: float) -> None:
        self.ns += int(s * 1e9)


INF = InstanceSpec(id="inf", function="guest/classify", cls=InstanceClass.INFERENCE, request=0.4, limit=0.7,
                   memory_mb=100, capacity_blocks_per_ms=100.0)
TRAIN = InstanceSpec(id="train", function="guest/pkg/train", cls=InstanceClass.TRAINING, request=0.2, limit=0.8,
                     memory_mb=200, capacity_blocks_per_ms=100.0)


class Gpu:
    """A manager over instance files whose stats blocks the test writes."""

    def __init__(self, root: Path, *, metrics: GpuMetrics | None = None,
                 vertical: SloConfig | StaticConfig | None = None) -> None:
        self.clock = Clock()
        self.records: list[TickRecord] = []
        self.mgr = GpuManager(uuid="GPU-t", index=3, period_s=0.05, clock_ns=self.clock, metrics=metrics,
                              vertical=vertical or SloConfig(),
                              observers=(self.records.append,))
        self.root = root
        self.controls: dict[str, abi.ControlFile] = {}
        self.writers: dict[str, StatsWriter] = {}

    def add(self, spec: InstanceSpec) -> None:
        ctl, st = abi.create_instance_files(self.root, spec.id, self.mgr.initial_quota(spec))
        self.controls[spec.id] = ctl
        self.writers[spec.id] = StatsWriter(st.path)
        self.mgr.add(spec, ctl, st)

    def tick(self, **launched: int) -> TickRecord:
        """Advance one period; each named instance launched that many blocks in it."""
        self.clock.advance(0.05)
        for name, blocks in launched.items():
            w = self.writers[name]
            w.publish(blocks=w.block.blocks + blocks, launches=w.block.launches + 1,
                      windows=w.block.windows + 10, pid=4242)
        return self.mgr.tick()

    def control(self, name: str) -> abi.Quota:
        return self.controls[name].read().quota

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


@pytest.fixture
def gpu(tmp_path: Path) -> Iterator[Gpu]:
    g = Gpu(tmp_path)
    g.add(INF)
    g.add(TRAIN)
    yield g
    g.close()


def test_starting_quotas_are_the_standing_caps(gpu: Gpu) -> None:
    assert gpu.control("inf").share == 0.7 and gpu.control("inf").rate_blocks_per_ms == pytest.approx(70.0)
    assert gpu.control("train").share == 0.2 and gpu.control("train").mem_cap_bytes == 200 << 20


def test_training_alone_rises_to_its_limit_then_is_cut_when_inference_bursts(gpu: Gpu) -> None:
    first = gpu.tick(train=1000)
    assert first.mode is FeedbackMode.IDLE
    assert gpu.control("train").share == pytest.approx(0.8)
    assert gpu.control("train").rate_blocks_per_ms == pytest.approx(80.0)

    burst = gpu.tick(train=1000, inf=500)
    assert burst.status("inf").active and burst.status("inf").share == pytest.approx(0.7)
    # Latency-critical demand beside training: training starts at the room inference's request leaves, 1 - 0.4.
    assert gpu.control("train").share == pytest.approx(0.6)
    assert gpu.control("train").rate_blocks_per_ms == pytest.approx(60.0)
    assert burst.mode is not FeedbackMode.IDLE

    # Inference falls silent; after idle_after_s (0.6 s) training gets the GPU back.
    modes = [gpu.tick(train=1000).mode for _ in range(14)]
    assert modes[0] is not FeedbackMode.IDLE and modes[-1] is FeedbackMode.IDLE
    assert gpu.control("train").share == pytest.approx(0.8)
    assert gpu.control("inf").share == pytest.approx(0.7)  # standing cap: its next burst starts unthrottled


def test_reconfigured_policy_starts_over(gpu: Gpu) -> None:
    gpu.tick(train=1000, inf=500)
    assert gpu.control("train").share == pytest.approx(0.6)
    gpu.mgr.set_vertical_config(StaticConfig())  # from the next tick: every instance at its limit
    record = gpu.tick(train=1000, inf=500)
    assert record.mode is FeedbackMode.HOLD and gpu.control("train").share == pytest.approx(0.8)
    assert gpu.mgr._state == SloState(mode=FeedbackMode.HOLD)  # the slo policy's memory is gone


def test_the_slo_policy_runs_in_the_manager(tmp_path: Path) -> None:
    g = Gpu(tmp_path, vertical=SloConfig())
    g.add(replace(INF, slo_ms=20.0))
    g.add(TRAIN)
    try:
        assert isinstance(g.mgr._state, SloState)
        w = g.writers["inf"]
        modes, shares = [], []
        for _ in range(12):  # requests of 5 ms, well inside the 20 ms SLO: training grows
            w.publish(pid=4242, spans_us=(5000, 5000, 5000), span_open_ns=0)
            record = g.tick(inf=50, train=1000)
            modes.append(record.mode)
            shares.append(g.control("train").share)
        # Two periods at the floor measure inference's solo latency; training then starts at 1 − 0.4.
        assert modes[:3] == [FeedbackMode.MEASURE, FeedbackMode.MEASURE, FeedbackMode.HOLD]
        assert shares[0] == pytest.approx(0.01) and shares[2] == pytest.approx(0.6)
        assert FeedbackMode.INCREASE in modes and shares[-1] > 0.6
        assert g.control("inf").share == pytest.approx(0.7)
        w.publish(pid=4242, spans_us=(40000,), span_open_ns=time.monotonic_ns() - 30_000_000)
        record = g.tick(inf=50, train=1000)  # a request already past its SLO: clamp at once
        assert record.mode is FeedbackMode.EMERGENCY and g.control("train").share == pytest.approx(0.01)
        g.mgr.set_vertical_config(SloConfig())  # reconfigured: from scratch, the solo latency measured again
        assert g.mgr._state == SloState()
        w.publish(pid=4242, spans_us=(5000, 5000, 5000), span_open_ns=0)
        assert g.tick(inf=50, train=1000).mode is FeedbackMode.MEASURE
    finally:
        g.close()


@pytest.mark.parametrize(("annotations", "slo_ms"), [
    ({"gpu-slo-ms": 30}, 30.0),
    ({"slo-ms": 50}, 50.0),
    ({"gpu-slo-ms": 30, "slo-ms": 50}, 30.0),
    ({}, None),
], ids=["gpu-slo-ms", "slo-ms", "both", "none"])
def test_the_slo_annotation_is_gpu_slo_ms_with_slo_ms_its_older_name(annotations: dict[str, float],
                                                                      slo_ms: float | None) -> None:
    from dilu_invoker.model import GpuNeeds

    assert GpuNeeds.from_annotations(annotations).slo_ms == slo_ms


def test_the_node_builds_its_managers_with_the_configured_policy(tmp_path: Path) -> None:
    from dilu_invoker.config import Config, GpuConfig
    from dilu_invoker.gpu.node import GpuNode

    inventory = tmp_path / "inv.json"
    inventory.write_text('{"invokers": {"0": [{"uuid": "GPU-a"}]}}')
    for policy, kind in (("static", StaticConfig), ("slo", SloConfig)):
        node = GpuNode.from_config(Config(gpu=GpuConfig(inventory=str(inventory), vertical_policy=policy,
                                                        vertical_dwell_s=0.4, shm_dir=str(tmp_path / "shm"))))
        vertical = node.manager(0).vertical
        assert isinstance(vertical, kind)
        if isinstance(vertical, SloConfig):
            assert vertical.dwell_s == pytest.approx(0.4)


def test_heartbeat_every_tick_without_rewriting_an_unchanged_quota(gpu: Gpu) -> None:
    gpu.tick(train=1000)
    before = gpu.controls["train"].read()
    gpu.tick(train=1000)
    after = gpu.controls["train"].read()
    assert after.epoch == before.epoch  # same quota: no new epoch for the shim to apply
    assert after.manager_heartbeat_ns > before.manager_heartbeat_ns


def test_tick_records_carry_the_spans(gpu: Gpu) -> None:
    w = gpu.writers["inf"]
    # The shim's clock: an open span is aged against CLOCK_MONOTONIC, whatever clock the manager ticks by.
    w.publish(pid=4242, spans_us=(6000, 7200), span_open_ns=time.monotonic_ns() - 3_000_000)
    first = gpu.tick(inf=10).status("inf")
    assert first.spans_s == pytest.approx((0.006, 0.0072)) and first.open_span_s >= 0.003
    w.publish(spans_us=(6500,), span_open_ns=0)
    second = gpu.tick(inf=10).status("inf")
    assert second.spans_s == pytest.approx((0.0065,)) and second.open_span_s == 0.0
    third = gpu.tick(inf=10).status("inf")
    assert third.spans_s == () and third.open_span_s == 0.0
    assert gpu.records[-1].status("inf") == third


def test_pinned_share_overrides_the_policy(gpu: Gpu) -> None:
    gpu.mgr.pin("train", 0.5)
    record = gpu.tick(train=1000, inf=500)
    assert gpu.control("train").share == pytest.approx(0.5) and record.status("train").pinned
    assert gpu.control("inf").share == pytest.approx(0.7)
    gpu.mgr.pin("train", None)
    gpu.tick(train=1000, inf=500)
    assert gpu.control("train").share == pytest.approx(0.6)
    with pytest.raises(ValueError):
        gpu.mgr.pin("train", 0.0)


def test_the_instance_queue_the_invoker_reports_reaches_the_policy(tmp_path: Path) -> None:
    g = Gpu(tmp_path, vertical=SloConfig())
    g.add(replace(INF, slo_ms=30.0))
    g.add(TRAIN)
    reads: list[LoadReading] = []
    waiting = LoadReading(queued=9.0, oldest_wait_s=0.002, running=1, open_run_s=0.001, runs_s=(0.005,) * 4,
                          waits_s=(0.0,) * 4)

    def reader() -> LoadReading:
        reads.append(LoadReading(runs_s=(0.005,) * 4, waits_s=(0.0,) * 4) if len(reads) < 12 else waiting)
        return reads[-1]

    g.mgr.watch_load("inf", reader)
    seen: list[object] = []
    g.mgr.add_observer(lambda record: seen.append(record.mode))
    try:
        w = g.writers["inf"]
        for _ in range(12):  # requests of 5 ms, no queue: training is allowed to grow
            w.publish(pid=4242, spans_us=(4000,) * 4, span_open_ns=0)
            g.tick(inf=50, train=1000)
        assert FeedbackMode.EMERGENCY not in seen and g.control("train").share > 0.01
        w.publish(pid=4242, spans_us=(4000,) * 4, span_open_ns=0)
        record = g.tick(inf=50, train=1000)  # nine waiting, 5 ms each: the last one misses the 30 ms SLO
        assert len(reads) == 13
        assert record.mode is FeedbackMode.EMERGENCY and "9 waiting" in record.reason
        assert g.control("train").share == pytest.approx(0.01)
    finally:
        g.close()


def test_a_broken_queue_reader_is_dropped_and_the_tick_goes_on(gpu: Gpu) -> None:
    calls = []

    def broken() -> LoadReading:
        calls.append(1)
        raise RuntimeError("gone")

    gpu.mgr.watch_load("inf", broken)
    gpu.tick(inf=10)
    gpu.tick(inf=10)
    assert len(calls) == 1 and gpu.records[-1].status("inf").share == pytest.approx(0.7)


def test_vertical_instance_carries_the_queue_only_when_reported() -> None:
    reading = read_delta(None, snapshot(blocks=5, pid=1))[0]
    plain = vertical_instance(INF, reading, period_s=0.05, last_active_at=None, share=None)
    assert not plain.queue_known and plain.runs_s == ()
    load = LoadReading(queued=2.0, oldest_wait_s=0.01, running=1, open_run_s=0.003, runs_s=(0.006,), waits_s=(0.001,))
    inst = vertical_instance(INF, reading, period_s=0.05, last_active_at=None, share=None, load=load)
    assert inst.queue_known and (inst.queued, inst.oldest_wait_s, inst.open_run_s) == (2.0, 0.01, 0.003)
    assert (inst.runs_s, inst.waits_s) == ((0.006,), (0.001,))


def test_slo_learnt_later_reaches_the_policy(gpu: Gpu) -> None:
    gpu.mgr.set_slo("inf", 54.0)
    assert {s.id: s.slo_ms for s in gpu.mgr.instances()}["inf"] == pytest.approx(54.0)
    gpu.mgr.set_slo("inf", None)
    assert {s.id: s.slo_ms for s in gpu.mgr.instances()}["inf"] is None
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            gpu.mgr.set_slo("inf", bad)
    with pytest.raises(KeyError):
        gpu.mgr.set_slo("nobody", 10.0)


def test_unknown_capacity_runs_unlimited_until_measured(tmp_path: Path) -> None:
    g = Gpu(tmp_path)
    g.add(replace(TRAIN, capacity_blocks_per_ms=None))
    try:
        assert not g.control("train").limited  # nothing measured yet
        g.tick()
        w = g.writers["train"]
        # 10 windows of 5 ms, all busy (one open cycle): 1000 blocks in 50 ms = 20 blocks/ms, three periods in a
        # row (the first also allocates: loading, not learnt) before the estimate is used.
        for n in range(1, 5):
            g.clock.advance(0.05)
            w.publish(blocks=1000 * n, launches=10 * n, windows=10 * n, cycle_current_windows=10 * n, pid=7,
                      mem_peak_bytes=1 << 30)
            record = g.mgr.tick()
            if n < 4:
                assert record.status("train").capacity_blocks_per_ms is None, n
                assert not g.control("train").limited
        assert record.status("train").capacity_blocks_per_ms == pytest.approx(20.0)
        assert g.control("train").share == pytest.approx(0.8)
        assert g.control("train").rate_blocks_per_ms == pytest.approx(16.0)
        g.mgr.set_capacity("train", 50.0)  # measured later by the profiler: it wins over the estimate
        g.clock.advance(0.05)
        w.publish(blocks=9000, launches=60, windows=60, cycle_current_windows=60)
        assert g.mgr.tick().status("train").capacity_blocks_per_ms == pytest.approx(50.0)
        assert g.control("train").rate_blocks_per_ms == pytest.approx(40.0)
        with pytest.raises(ValueError):
            g.mgr.set_capacity("train", 0.0)
    finally:
        g.close()


def test_metrics_follow_the_counters_across_a_restart(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    g = Gpu(tmp_path, metrics=GpuMetrics(registry))
    g.add(TRAIN)
    labels = {"namespace": "guest", "action": "pkg/train", "instance": "train", "gpu": "3", "uuid": "GPU-t"}

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, labels)

    try:
        g.tick(train=1000)
        g.tick(train=500)
        assert value("openwhisk_action_gpu_tokens_granted_total") == 1500
        assert value("openwhisk_action_gpu_kernel_launches_total") == 2
        assert value("openwhisk_action_gpu_sm_quota_ratio") == pytest.approx(0.8)
        assert value("openwhisk_action_gpu_sm_request_ratio") == pytest.approx(0.2)
        assert value("openwhisk_action_gpu_sm_limit_ratio") == pytest.approx(0.8)
        g.clock.advance(0.05)
        g.writers["train"].publish(spans_us=(4_000, 30_000))  # two requests: 4 ms and 30 ms
        g.mgr.tick()
        assert value("openwhisk_action_gpu_request_spans_total") == 2
        assert value("openwhisk_action_gpu_request_span_seconds_count") == 2
        assert value("openwhisk_action_gpu_request_span_seconds_sum") == pytest.approx(0.034)
        assert registry.get_sample_value("openwhisk_action_gpu_request_span_seconds_bucket",
                                         {**labels, "le": "0.005"}) == 1
        # A new process claims the block: its counters start from zero and count whole.
        g.clock.advance(0.05)
        g.writers["train"].publish(blocks=300, launches=1, windows=2, pid=999, throttled_ns=2_000_000,
                                   mem_used_bytes=12345)
        g.mgr.tick()
        assert value("openwhisk_action_gpu_tokens_granted_total") == 1800
        assert value("openwhisk_action_gpu_kernel_throttled_seconds_total") == pytest.approx(0.002)
        assert value("openwhisk_action_gpu_memory_used_bytes") == 12345
        gpu_labels = {"gpu": "3", "uuid": "GPU-t"}
        assert registry.get_sample_value("openwhisk_invoker_gpu_fragmentation_ratio", gpu_labels) == pytest.approx(0.8)
        assert registry.get_sample_value("dilu_gpu_vertical_mode", {**gpu_labels, "mode": "idle"}) == 1
        modes = {s.labels["mode"]: s.value for f in registry.collect() if f.name == "dilu_gpu_vertical_mode"
                 for s in f.samples}
        # one series per mode the policies set, 1 for the current one (the removed rckm's modes are gone)
        assert modes == {"idle": 1, "measure": 0, "hold": 0, "increase": 0, "decrease": 0, "emergency": 0}
        assert registry.get_sample_value("dilu_gpu_vertical_decisions_total", {**gpu_labels, "mode": "idle"}) == 4
        g.mgr.remove("train")
        assert value("openwhisk_action_gpu_sm_quota_ratio") is None
        assert value("openwhisk_action_gpu_request_spans_total") is None
    finally:
        g.close()


async def test_publisher_never_blocks_the_tick(gpu: Gpu) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    calls: list[dict[str, float]] = []

    async def slow_publish(uuid: str, shares: dict[str, float]) -> None:
        calls.append(dict(shares))
        started.set()
        await release.wait()

    mgr = GpuManager(uuid="GPU-p", period_s=0.05, publish=slow_publish, clock_ns=gpu.clock)
    ctl, st = abi.create_instance_files(gpu.root, "solo", mgr.initial_quota(TRAIN))
    mgr.add(replace(TRAIN, id="solo"), ctl, st)
    try:
        mgr.tick()
        await started.wait()
        for _ in range(5):  # the publisher is stuck; ticks go on and do not pile up calls
            gpu.clock.advance(2.0)
            mgr.tick()
        assert len(calls) == 1 and calls[0] == {"solo": pytest.approx(0.2)}
        release.set()
        await asyncio.sleep(0)
        gpu.clock.advance(2.0)
        mgr.tick()
        await asyncio.sleep(0)
        assert len(calls) == 2
    finally:
        await mgr.stop()
        ctl.close()
        st.close()


def test_mode_changes_log_at_info_only_for_cuts_and_returns(tmp_path: Path) -> None:
    """Alternating modes every period (as one instance's spans come and go) stay at debug; a cut is info at
    most once per CUT_LOG_EVERY_S, and so is the return to the limits after it; /metrics counts them all."""
    from types import SimpleNamespace

    import structlog

    from dilu_invoker.gpu.manager import CUT_LOG_EVERY_S
    from dilu_invoker.gpu.manager import GpuLabel as Label

    registry = CollectorRegistry()
    metrics = GpuMetrics(registry)
    g = Gpu(tmp_path, metrics=metrics)
    seq = [FeedbackMode.HOLD, FeedbackMode.INCREASE] * 20 + [FeedbackMode.EMERGENCY, FeedbackMode.HOLD] * 5 \
        + [FeedbackMode.IDLE, FeedbackMode.HOLD] * 3
    try:
        with structlog.testing.capture_logs() as logs:
            now, old = 0.0, FeedbackMode.IDLE
            for mode in seq:
                now += 0.25
                g.mgr._log_mode_change(old, SimpleNamespace(mode=mode, reason="r"), now)  # type: ignore[arg-type]
                metrics.observe_gpu(Label(3, "GPU-t"), fragmentation=0.0, utilization=None, mode=mode, decided=True)
                old = mode
        info = [e for e in logs if e["log_level"] == "info"]
        assert [e["event"] for e in info] == ["best-effort cut", "best-effort back at its limits"]
        assert info[0]["cuts_since_last_line"] == 1
        assert sum(1 for e in logs if e["log_level"] == "debug") == len(seq) - 2
        assert CUT_LOG_EVERY_S > 5 * 0.5  # the five cuts fell inside one interval
        changes = registry.get_sample_value("dilu_gpu_vertical_mode_changes_total",
                                            {"gpu": "3", "uuid": "GPU-t", "from_mode": "hold",
                                             "to_mode": "increase"})
        assert changes == 20
    finally:
        g.close()
