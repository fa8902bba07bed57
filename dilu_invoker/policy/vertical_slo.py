"""The `slo` vertical policy: a feedback controller that holds latency-critical instances to their SLO and
gives best-effort instances the rest of the GPU. docs/policies.md §1.1 writes the law on one page.

* **Objective**: every active latency-critical instance's p99 latency at or below its target T: the
  `gpu-slo-ms` annotation (`slo_ms`), or else `slo_factor` × its solo latency at the current arrival rate.
* **Measurement**: the request spans the shim reports (`spans_s`; window cycles where a shim reports no
  spans), turned into a p99 latency estimate by Kingman's approximation (`p99_estimate`): the spans' median
  plus ln(100) × the mean queueing wait their busy fraction and the arrivals' variability predict. Next to
  them, where the invoker reports it (`queue_known`, `dilu_invoker.gpu.load`), the instance's own queue:
  the activations waiting for it and since when (`queue_latency_s`: a queue that will miss the annotated
  SLO clamps at once) and its activations' time in the instance (`occupancy`: the saturation clamp judges the
  instance's busy fraction, off-GPU time included, not only the GPU's).
* **Actuator**: the best-effort budget (Σ best-effort shares, launch-rate caps enforced by the shim), and
  under MPS the best-effort clients' active-thread fraction, chosen once at their start
  (`ShareDecision.mps_threads`).
* **State machine** (`FeedbackMode`): idle → measure → {hold, increase, decrease, emergency}; multiplicative
  decrease / additive increase of the budget on the SLO error e = estimate / T, a deadband in which nothing
  moves, a dwell between moves, and an emergency clamp to the floor.

Six knobs (`SloConfig`), each with a unit; everything else is a named constant below with the reason for
its value. The policy is pure: a frozen snapshot (with `now`) and the state it returned last time in, a
decision with reasons and the next state out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dilu_invoker.policy.fill import water_fill
from dilu_invoker.policy.types import EPS, InstanceClass
from dilu_invoker.policy.vertical import (
    FeedbackMode,
    ShareDecision,
    VerticalDecision,
    VerticalInstance,
    VerticalSnapshot,
)

VERTICAL_POLICIES = ("slo", "static")
"""Names of the vertical policies that divide SM share by token rates (the simulator's too): `slo` this
controller, `static` every instance at its limit (the static-share baseline the controller is measured
against)."""
GPU_VERTICAL_POLICIES = ("auto", *VERTICAL_POLICIES, "spatial")
"""The values of `--gpu-vertical-policy`: those above, `spatial` (no token gate: MPS's active-thread caps,
fixed at each client's start, are the split) and `auto`, the default: `spatial` on a GPU that runs MPS,
`slo` on one that time-slices (`resolve_vertical`)."""
REMOVED_VERTICAL_POLICIES = {
    "rckm": "slo replaced it as the time-sliced policy (docs/policies.md §1.2)",
}
"""Policy names that once existed, each with what replaced it: refused by name, never read as another."""


def check_policy_name(name: str, *, choices: tuple[str, ...] = GPU_VERTICAL_POLICIES,
                      flag: str = "--gpu-vertical-policy") -> None:
    """Raise ValueError unless `name` is one of `choices`; a removed policy's error says so and what replaced
    it, and names the policies there are."""
    if name in choices:
        return
    if name in REMOVED_VERTICAL_POLICIES:
        raise ValueError(f"{flag} {name} was removed: {REMOVED_VERTICAL_POLICIES[name]}; use one of "
                         f"{', '.join(choices)}")
    raise ValueError(f"{flag} must be one of {', '.join(choices)}, not {name!r}")

# -- constants of the law (not knobs: each follows from what it measures) --------------------------

IDLE_AFTER_S = 0.6
"""A latency-critical instance that launched nothing for this long is idle (Dilu: 120 windows of 5 ms)."""
FLOOR_FRACTION = 0.05
"""A best-effort instance keeps 5% of its request even at the floor, so its work keeps progressing."""
CLAMP_RATIO = 1.5
"""An estimate this far above the target is an emergency: one multiplicative step would not fix it in time."""
SATURATED_BUSY = 0.95
"""Spans covering this much of the last `SATURATION_PERIODS` periods: requests arrive as fast as they are
served, the queue grows whatever the stretch, so it is an emergency."""
SATURATION_PERIODS = 3
SURGE = 3.0
"""A period with this many times its usual spans is a surge (a burst beginning): the clamp then judges it at
its own busy fraction. Under Poisson arrivals of ≥ 2 a period, three times the mean in one period is rare."""
BUSY_TARGET = 0.9
REGULAR_CA2 = 0.5
"""With regular arrivals (c_a² below 0.5) the busy fraction ρ is held below 0.9 whatever the latency
estimate: Kingman's wait then stays ~0 right up to ρ = 1, where a queue grows without bound, so ρ / 0.9 is a
second SLO error. With random arrivals the estimate itself rises steeply before that cliff."""
RHO_CAP = 0.98
"""The busy fraction fed to Kingman's formula is capped below 1 (the estimate is infinite at 1)."""
BUSY_WINDOW = 20
"""Periods whose spans give the busy fraction ρ (0.5 s at 50 ms: ~50 requests at 100 requests/s)."""
COUNT_WINDOW = 40
"""Periods whose span counts give the arrivals' variability (1 s at 50 ms)."""
JUDGE_MAX_SPANS = 64
"""Spans kept for one judgement (since the last budget move)."""
MIN_SPANS = 3
"""Spans a judgement or a solo measurement needs."""
MEASURE_MAX_PERIODS = 20
"""A solo measurement that collects fewer than `MIN_SPANS` in this many periods uses what it has."""
SATURATED_THROTTLE_FRACTION = 0.1
"""An instance at its limit that waited for tokens this fraction of the period is saturated (horizontal)."""

QUIET_PERIODS = 2
"""Decisions at the floor before a period's spans count as solo: the first still runs work admitted before."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SloConfig:
    """The six knobs of the `slo` policy; units in the names' docstrings, reasons in docs/policies.md."""

    slo_factor: float = 2.0
    """×, dimensionless. Without a `gpu-slo-ms` annotation the target is this × the instance's solo latency
    (measured with best-effort at its floor) at the current arrival rate: the benchmark's SLO of 2 × solo p99."""
    deadband: float = 0.15
    """Fraction of the target. While the estimate lies in [(1 − deadband) × T, T] the budget does not move."""
    increase_per_s: float = 0.5
    """Share of the GPU per second: the additive increase of the best-effort budget (one step per dwell)."""
    decrease: float = 0.7
    """×, in (0, 1): the multiplicative decrease of the budget when the estimate is above the target."""
    dwell_s: float = 0.2
    """Seconds between two moves of the budget (an emergency does not wait): the spans since the last move
    are what the next one is judged on."""
    mps_best_effort_threads: float = 0.7
    """Fraction of the SMs (0, 1] a best-effort MPS client may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / 100),
    fixed when its process starts; latency-critical clients get no cap."""

    def __post_init__(self) -> None:
        checks = (
            ("slo_factor", self.slo_factor, lambda v: v >= 1.0, ">= 1"),
            ("deadband", self.deadband, lambda v: 0.0 < v < 1.0, "in (0, 1)"),
            ("increase_per_s", self.increase_per_s, lambda v: v > 0.0, "> 0"),
            ("decrease", self.decrease, lambda v: 0.0 < v < 1.0, "in (0, 1)"),
            ("dwell_s", self.dwell_s, lambda v: v > 0.0, "> 0"),
            ("mps_best_effort_threads", self.mps_best_effort_threads, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
        )
        for name, value, ok, what in checks:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
                raise ValueError(f"{name} must be {what}, got {value!r}")

    @property
    def idle_after_s(self) -> float:
        """What `VerticalInstance.active` asks of a config (a constant here, not a knob)."""
        return IDLE_AFTER_S

    @property
    def step(self) -> float:
        """The additive increase per move: increase_per_s × dwell_s."""
        return self.increase_per_s * self.dwell_s


# -- state -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SloTrack:
    """What the controller remembers of one latency-critical instance."""

    id: str
    solo_s: float | None = None
    """Solo span: the shortest per-period median span seen with best-effort at its floor (None: unmeasured)."""
    counts: tuple[int, ...] = ()
    """Spans completed per period, the last `COUNT_WINDOW` periods (arrival rate and variability)."""
    busy: tuple[float, ...] = ()
    """Σ spans / period, the last `BUSY_WINDOW` periods."""
    held: tuple[float, ...] = ()
    """Σ activations' time in the instance / period, the last `SATURATION_PERIODS` periods, where the invoker
    reports its queue: the instance's own busy fraction (its spans leave out the time off the GPU)."""
    judged: tuple[float, ...] = ()
    """Spans completed since the last budget move (the first period after it excluded)."""
    measured: tuple[float, ...] = ()
    """Spans collected during a solo measurement in progress."""


@dataclass(frozen=True, slots=True)
class SloState:
    """Carried from one call to the next for one GPU; start with `SloState()`."""

    mode: FeedbackMode = FeedbackMode.IDLE
    budget: float | None = None
    """Best-effort budget while latency-critical demand exists (None: idle)."""
    resume: float | None = None
    """The budget when latency-critical demand last ended: where it starts next time."""
    threshold: float | None = None
    """After an emergency: `decrease` × the budget before it; below it the budget doubles per move."""
    moved_at: float | None = None
    """When the budget last moved (or latency-critical demand began)."""
    floor_periods: int = 0
    """Consecutive decisions that left best-effort at its floor."""
    measuring: int = 0
    """Periods of the solo measurement in progress (0: none)."""
    tracks: tuple[SloTrack, ...] = ()

    def track(self, instance_id: str) -> SloTrack:
        for t in self.tracks:
            if t.id == instance_id:
                return t
        return SloTrack(id=instance_id)


# -- small helpers (each with its own table test) ---------------------------------------------------


def median(xs: tuple[float, ...]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def arrival_scv(cd2: float, *, rho: float, cs2: float) -> float:
    """The arrivals' squared coefficient of variation from the completions' (`cd2`): a server smooths what
    it serves, c_d² = ρ² c_s² + (1 − ρ²) c_a² (Whitt's linking equation), inverted; within [0, 4]."""
    r = min(max(rho, 0.0), RHO_CAP)
    return min(4.0, max(0.0, (cd2 - r * r * cs2) / (1.0 - r * r)))


def dispersion(counts: tuple[int, ...]) -> float:
    """Index of dispersion of per-period counts, var / mean: ≈ the squared coefficient of variation of the
    inter-event times (0 paced, 1 Poisson, > 1 bursty). 1 (Poisson) until three periods are known."""
    if len(counts) < 3:
        return 1.0
    mean = sum(counts) / len(counts)
    if mean <= 0:
        return 1.0
    # From successive differences (half their mean square), so a change of rate between periods — a burst
    # beginning — does not read as variability within either rate.
    var = sum((b - a) ** 2 for a, b in zip(counts, counts[1:], strict=False)) / (2 * (len(counts) - 1))  # noqa: RUF007 - stdlib imports are kept to the purity list
    return var / mean


def scv(spans: tuple[float, ...]) -> float:
    """Squared coefficient of variation of the service times (0 when fewer than two)."""
    if len(spans) < 2:
        return 0.0
    mean = sum(spans) / len(spans)
    if mean <= 0:
        return 0.0
    var = sum((s - mean) ** 2 for s in spans) / (len(spans) - 1)
    return var / (mean * mean)


def p99_estimate(span_s: float, *, rho: float, ca2: float, cs2: float) -> float:
    """A request's p99 latency from its service time. Kingman's G/G/1 mean wait is
    W = ρ / (1 − ρ) × (ca² + cs²) / 2 × span; a request waits with probability ≈ ρ, and then about
    exponentially with mean W / ρ, so the p99 wait is (W / ρ) × ln(100 ρ) (none when ρ ≤ 1%)."""
    r = min(max(rho, 0.0), RHO_CAP)
    if r <= 0.01:
        return span_s
    return span_s + (ca2 + cs2) / (2.0 * (1.0 - r)) * span_s * math.log(100.0 * r)


def queue_latency_s(queued: float, oldest_wait_s: float, service_s: float, *, open_run_s: float = 0.0) -> float:
    """A lower bound on the latency of the activations waiting for the instance now, each run taking
    `service_s`: the one running still needs what is left of its run (`open_run_s` into it); the oldest
    waiting has waited `oldest_wait_s` and needs that rest and its own run; the last waits behind the others:
    the larger of oldest wait + rest + one run and rest + queued runs (0 when none waits)."""
    if queued <= 0:
        return 0.0
    rest = max(0.0, service_s - open_run_s) if open_run_s > 0 else 0.0
    return rest + max(oldest_wait_s + service_s, queued * service_s)


def move_for(error: float, deadband: float) -> FeedbackMode:
    """The move an SLO error (estimate / target) asks for: emergency ≥ `CLAMP_RATIO`, decrease above 1,
    hold in [1 − deadband, 1], increase below."""
    if error >= CLAMP_RATIO:
        return FeedbackMode.EMERGENCY
    if error > 1.0:
        return FeedbackMode.DECREASE
    if error >= 1.0 - deadband:
        return FeedbackMode.HOLD
    return FeedbackMode.INCREASE


def next_budget(move: FeedbackMode, budget: float, *, floor: float, ceiling: float, threshold: float | None,
                config: SloConfig) -> tuple[float, float | None]:
    """(budget, threshold) after a move: emergency → the floor, remembering `decrease` × the budget as the
    threshold; decrease → × `decrease`; increase → doubled while below the threshold (a fast return to
    where the last emergency struck), else + `step`; always within [floor, ceiling]."""
    if move is FeedbackMode.EMERGENCY:
        return floor, max(floor, budget * config.decrease)
    if move is FeedbackMode.DECREASE:
        return max(floor, budget * config.decrease), None
    if move is FeedbackMode.INCREASE:
        if threshold is not None and budget < threshold - EPS:
            return min(ceiling, threshold, max(2.0 * budget, budget + config.step)), threshold
        return min(ceiling, budget + config.step), None
    return min(max(budget, floor), ceiling), threshold


# -- one instance's measurement ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reading:
    """One latency-critical instance this period: its estimate against its target."""

    track: SloTrack
    target_s: float | None
    """T (None: not known yet: a solo measurement is needed)."""
    error: float | None = None
    """Estimate / T over the spans since the last move (None: too few spans)."""
    period_error: float | None = None
    """Estimate / T over this period's spans alone (None: fewer than `MIN_SPANS`)."""
    saturated: bool = False
    open_over: bool = False
    """A span in progress is already longer than the target."""
    queue_over: bool = False
    """The activations waiting for the instance will miss its annotated SLO whatever happens next
    (`queue_latency_s` ≥ `gpu-slo-ms`): the invoker's queue, where it reports one."""
    note: str = ""


def _samples(inst: VerticalInstance) -> tuple[tuple[float, ...], float]:
    """Spans where the shim reports them, else its launch-window cycles (the old ABI, the simulator)."""
    if inst.spans_s or inst.open_span_s:
        return inst.spans_s, inst.open_span_s
    return inst.cycles_s, inst.open_cycle_s


def occupancy(inst: VerticalInstance, period_s: float) -> float:
    """The fraction of the period the instance held an activation (the invoker's view), within [0, 1]: the
    runs completed in it, plus the one still running, and 1 while activations wait for it."""
    if inst.queued > 0:
        return 1.0
    return min(1.0, (sum(inst.runs_s) + min(inst.open_run_s, period_s)) / period_s)


def observe(inst: VerticalInstance, prev: SloTrack, *, period_s: float, settled: bool, quiet: bool) -> SloTrack:
    """The track after this period's spans. `settled`: the budget did not move at the start of this period
    (so its spans are judged); `quiet`: best-effort has been at its floor for a full period."""
    spans, _ = _samples(inst)
    counts = (prev.counts + (len(spans),))[-COUNT_WINDOW:]
    busy = (prev.busy + (min(1.0, sum(spans) / period_s),))[-BUSY_WINDOW:]
    judged = (prev.judged + spans)[-JUDGE_MAX_SPANS:] if settled else ()
    held = (prev.held + (occupancy(inst, period_s),))[-SATURATION_PERIODS:] if inst.queue_known else ()
    solo, measured = prev.solo_s, (prev.measured + spans if quiet else ())
    # A period's median where it has enough spans; at low rates the spans of consecutive quiet periods.
    sample = spans if len(spans) >= MIN_SPANS else measured if len(measured) >= MIN_SPANS else ()
    if quiet and sample:
        m = median(sample)
        solo, measured = (m if solo is None else min(solo, m)), ()
    return SloTrack(id=inst.id, solo_s=solo, counts=counts, busy=busy, held=held, judged=judged,
                    measured=measured)


def target_s(inst: VerticalInstance, track: SloTrack, *, period_s: float, config: SloConfig) -> float | None:
    """T: `slo_factor` × the solo latency at the current arrival rate (the solo span put through the same
    queue estimate), and never above the annotated SLO; the SLO alone while the solo span is unmeasured;
    None without either."""
    slo = inst.slo_ms / 1000.0 if inst.slo_ms else None
    if track.solo_s is None:
        return slo
    rate = sum(track.counts) / (len(track.counts) * period_s) if track.counts else 0.0
    rho = sum(track.busy) / len(track.busy) if track.busy else 0.0
    cs2 = scv(track.judged)
    solo = p99_estimate(track.solo_s, rho=rate * track.solo_s,
                        ca2=arrival_scv(dispersion(track.counts), rho=rho, cs2=cs2), cs2=cs2)
    derived = config.slo_factor * solo
    return derived if slo is None else min(slo, derived)


def is_saturated(inst: VerticalInstance, track: SloTrack) -> bool:
    """Busy ≥ `SATURATED_BUSY` over the last `SATURATION_PERIODS` periods: the instance's own busy fraction
    with an activation waiting now where the invoker reports its queue (evenly spaced arrivals keep an
    instance 95% busy without a queue: simulated, paced 70% cut training for nothing), else its spans'."""
    recent = track.held if inst.queue_known else track.busy[-SATURATION_PERIODS:]
    busy = len(recent) == SATURATION_PERIODS and sum(recent) / SATURATION_PERIODS >= SATURATED_BUSY
    return busy and (not inst.queue_known or inst.queued > 0)


def waiting_latency_s(inst: VerticalInstance, track: SloTrack, spans: tuple[float, ...]) -> float:
    """`queue_latency_s` of the activations waiting now, each taking this period's median run (else the
    judged spans', else this period's, else the solo span); 0 where the invoker reports no queue."""
    if not inst.queue_known:
        return 0.0
    service = median(inst.runs_s) if inst.runs_s else median(track.judged) if len(track.judged) >= MIN_SPANS \
        else median(spans) if spans else (track.solo_s or 0.0)
    return queue_latency_s(inst.queued, inst.oldest_wait_s, service, open_run_s=inst.open_run_s)


def read(inst: VerticalInstance, track: SloTrack, *, period_s: float, config: SloConfig) -> Reading:
    """Estimate / target for one instance, over the spans since the last move and over this period's."""
    target = target_s(inst, track, period_s=period_s, config=config)
    if target is None:
        return Reading(track, None, note=f"{inst.id}: no SLO and no solo latency yet")
    spans, open_s = _samples(inst)
    rho = sum(track.busy) / len(track.busy) if track.busy else 0.0
    ca2 = arrival_scv(dispersion(track.counts), rho=rho, cs2=scv(track.judged))

    def error(xs: tuple[float, ...], busy: float) -> float | None:
        if len(xs) < MIN_SPANS:
            return None
        latency = p99_estimate(median(xs), rho=busy, ca2=ca2, cs2=scv(xs)) / target
        return max(latency, busy / BUSY_TARGET) if ca2 < REGULAR_CA2 else latency

    # One period alone clamps only once the arrivals' variability is known (before, ca² is a guess); in a
    # surge (SURGE × the usual spans in one period: a burst begins) at this period's busy fraction, which the
    # one-second average has not caught up with yet.
    before = track.counts[:-1]
    surge = bool(before) and len(spans) >= max(MIN_SPANS, SURGE * sum(before) / len(before))
    err = error(track.judged, rho)
    period_err = (error(spans, max(rho, (rho + track.busy[-1]) / 2) if surge else rho)
                  if len(track.counts) >= MIN_SPANS else None)
    saturated = is_saturated(inst, track)
    open_over = open_s >= target
    waiting = waiting_latency_s(inst, track, spans)
    # The queue is not an estimate: activations that will miss the objective the user gave are a fact. Only an
    # annotated SLO is such an objective: the derived T is the model's solo latency on GPU spans, which leaves
    # out the time off the GPU and the bursts within a second, so a real queue "misses" it all the time
    # (simulated: training at 0.13 where a static 0.6 held the SLO; docs/policies.md §1.1).
    queue_over = bool(inst.slo_ms) and waiting >= (inst.slo_ms or 0.0) / 1000.0
    bits = [f"{inst.id}: target {target * 1000:.1f} ms" + ("" if inst.slo_ms else " (derived)"),
            f"ρ {rho:.2f}", f"ca² {ca2:.2f}"]
    if err is not None:
        bits.append(f"error {err:.2f} over {len(track.judged)} spans")
    if period_err is not None and period_err >= CLAMP_RATIO:
        bits.append(f"this period {period_err:.2f}")
    if saturated:
        bits.append("saturated: requests fill its time")
    if open_over:
        bits.append(f"span in progress {open_s * 1000:.1f} ms past its target")
    if queue_over:
        bits.append(f"{inst.queued:g} waiting: {waiting * 1000:.1f} ms, past its SLO")
    return Reading(track, target, err, period_err, saturated, open_over, queue_over, ", ".join(bits))


# -- the decision ------------------------------------------------------------------------------------


def _plan(lc: list[VerticalInstance], readings: dict[str, Reading], state: SloState, *, now: float,
          floor: float, ceiling: float, start: float, config: SloConfig) -> tuple[FeedbackMode, float, SloState, str]:
    """The budget's state machine for one period with latency-critical and best-effort demand."""
    budget = start if state.budget is None else state.budget
    threshold = state.threshold
    moved_at = now if state.moved_at is None or state.budget is None else state.moved_at
    # Instances that report spans but whose solo span is not measured yet.
    unknown = [i.id for i in lc if readings[i.id].track.solo_s is None and any(readings[i.id].track.counts)]
    # Periods spent measuring while an instance's solo span is unknown; kept, so a measurement that cannot
    # collect enough spans (a very low rate) is given up after MEASURE_MAX_PERIODS instead of repeated.
    keep = state.measuring if unknown else 0
    if unknown and keep < MEASURE_MAX_PERIODS:
        why = f"measure: best-effort at its floor to measure the solo latency of {', '.join(unknown)}"
        return FeedbackMode.MEASURE, budget, _with(state, budget=budget, moved_at=moved_at,
                                                    measuring=keep + 1), why
    if state.mode is FeedbackMode.MEASURE:
        # Best-effort goes from its floor to the budget now: the spans after this are the ones to judge.
        return FeedbackMode.HOLD, budget, _with(state, budget=budget, moved_at=now, measuring=keep), \
            f"hold: solo latency measured, best-effort back to its budget {budget:.2f}"
    known = [readings[i.id] for i in lc if readings[i.id].target_s is not None]
    if not known:
        return FeedbackMode.HOLD, budget, _with(state, budget=budget, moved_at=moved_at, measuring=keep), \
            "hold: no latency-critical instance can be judged (no SLO, no spans)"
    if any(_clamps(r, config) for r in known):
        if budget <= floor + EPS:  # clamped already: stay at the floor until it drains, whatever the estimate
            return FeedbackMode.HOLD, budget, _with(state, budget=budget, moved_at=moved_at, measuring=keep), \
                f"hold: at the floor {budget:.2f} until the emergency is over"
        nb, threshold = next_budget(FeedbackMode.EMERGENCY, budget, floor=floor, ceiling=ceiling,
                                    threshold=threshold, config=config)
        return FeedbackMode.EMERGENCY, nb, _with(state, budget=nb, threshold=threshold, moved_at=now,
                                                 measuring=keep), f"emergency: best-effort to its floor {nb:.2f}"
    if any(_queueing(r, config) for r in known) and budget > floor + EPS:
        # Not worth the floor, but a queue is building now: decrease without waiting for the dwell.
        nb = max(floor, budget * config.decrease)
        return FeedbackMode.DECREASE, nb, _with(state, budget=nb, threshold=None, moved_at=now, measuring=keep), \
            f"decrease: requests fill its time near the target, budget ×{config.decrease} → {nb:.2f}"
    errors = [r.error for r in known if r.error is not None]
    if now - moved_at < config.dwell_s - EPS or not errors:
        what = "dwell" if errors else "too few spans since the last move"
        return FeedbackMode.HOLD, budget, _with(state, budget=budget, moved_at=moved_at, measuring=keep), \
            f"hold ({what}): budget {budget:.2f}"
    worst = max(errors)
    move = move_for(worst, config.deadband)
    nb, threshold = next_budget(move, budget, floor=floor, ceiling=ceiling, threshold=threshold, config=config)
    moved = abs(nb - budget) > EPS
    mode = move if moved or move is FeedbackMode.HOLD else FeedbackMode.HOLD
    why = {FeedbackMode.EMERGENCY: f"emergency: error {worst:.2f} ≥ {CLAMP_RATIO}, best-effort to its floor",
           FeedbackMode.DECREASE: f"decrease: error {worst:.2f} > 1, budget ×{config.decrease} → {nb:.2f}",
           FeedbackMode.INCREASE: f"increase: error {worst:.2f} < {1 - config.deadband:.2f}, budget → {nb:.2f}",
           FeedbackMode.HOLD: f"hold: error {worst:.2f} within the deadband, budget {nb:.2f}"}[move]
    if not moved and move is not FeedbackMode.HOLD:
        why = f"hold: error {worst:.2f} asks to {move.value} but the budget is at its bound {nb:.2f}"
    return mode, nb, _with(state, budget=nb, threshold=threshold, moved_at=now if moved else moved_at,
                           measuring=keep), why


def _clamps(r: Reading, config: SloConfig) -> bool:
    """An emergency: a span in progress past the target, a queue that will miss the annotated SLO, or this
    period's estimate ≥ `CLAMP_RATIO` × T."""
    return r.open_over or r.queue_over or (r.period_error or 0.0) >= CLAMP_RATIO


def _queueing(r: Reading, config: SloConfig) -> bool:
    """Spans filling the instance's time while the estimate is already near the target: a queue that matters
    (busy stretches alone are common under random arrivals at high load), answered by a decrease at once."""
    return r.saturated and r.error is not None and r.error >= 1.0 - config.deadband


def _with(state: SloState, **changes: object) -> SloState:
    return replace(state, **changes)  # type: ignore[arg-type]


def latency_shares(active: list[VerticalInstance], room: float) -> tuple[dict[str, float], str]:
    """The active latency-critical instances' shares and, where they were cut, why: their limits when those
    fit in `room` (a share caps the launch rate, and any cap below its limit stretches every request); else
    requests first, the rest in proportion to each one's headroom (limit − request); requests that do not fit
    either (a misconfigured GPU: admission keeps Σ request ≤ 1) are scaled down in proportion."""
    limits = sum(i.limit for i in active)
    if limits <= room + EPS:
        return {i.id: i.limit for i in active}, ""
    requests = sum(i.request for i in active)
    if requests > room + EPS:
        alloc = water_fill(room, [i.request for i in active], [i.request for i in active])
        why = f"Σ active requests {requests:.2f} exceed the {room:.2f} available: cut in proportion"
        return {i.id: a for i, a in zip(active, alloc, strict=True)}, why
    headroom = [i.limit - i.request for i in active]
    extra = water_fill(max(0.0, room - requests), headroom, headroom)
    why = f"Σ active limits {limits:.2f} exceed the {room:.2f} available: cut toward requests"
    return {i.id: i.request + e for i, e in zip(active, extra, strict=True)}, why


def _best_effort_shares(be: list[VerticalInstance], total: float) -> dict[str, float]:
    alloc = water_fill(total, [i.request for i in be], [i.limit for i in be])
    return {i.id: max(a, min(FLOOR_FRACTION * i.request, i.limit)) for i, a in zip(be, alloc, strict=True)}


def decide_slo(snapshot: VerticalSnapshot, state: SloState, config: SloConfig) -> VerticalDecision:
    """New shares for every instance on the GPU, with reasons, and the state for the next call."""
    now, period = snapshot.now, snapshot.period_s
    lc = [i for i in snapshot.instances if i.cls.latency_critical and i.active(now, config)]
    be = [i for i in snapshot.instances if not i.cls.latency_critical and i.active(now, config)]
    floor = min(1.0, sum(FLOOR_FRACTION * i.request for i in be))
    ceiling = max(floor, min(1.0, sum(i.limit for i in be)))
    quiet = state.floor_periods >= QUIET_PERIODS
    settled = state.moved_at is not None and now - state.moved_at > 1.5 * period
    tracks = {i.id: observe(i, state.track(i.id), period_s=period, settled=settled, quiet=quiet)
              for i in snapshot.instances if i.cls.latency_critical}
    lc_shares, lc_why = latency_shares(lc, 1.0) if lc else ({}, "")
    readings: dict[str, Reading] = {}

    if not lc:
        mode, total, why = FeedbackMode.IDLE, 1.0, "no latency-critical demand: best-effort may use the whole GPU"
        resume = state.budget if state.budget is not None else state.resume
        new = SloState(mode=mode, resume=resume, measuring=state.measuring, tracks=tuple(tracks.values()))
    elif not be:
        mode, total, why = FeedbackMode.HOLD, 0.0, "latency-critical demand, no best-effort demand"
        new = _with(state, mode=mode, tracks=tuple(tracks.values()), floor_periods=0)
        readings = {i.id: read(i, tracks[i.id], period_s=period, config=config) for i in lc if i.queue_known}
    else:
        readings = {i.id: read(i, tracks[i.id], period_s=period, config=config) for i in lc}
        start = state.resume if state.resume is not None else 1.0 - sum(i.request for i in lc)
        start = min(max(start, floor), ceiling)
        mode, budget, new, why = _plan(lc, readings, _with(state, tracks=tuple(tracks.values())), now=now,
                                       floor=floor, ceiling=ceiling, start=start, config=config)
        if state.budget is None:
            why = f"latency-critical demand began, best-effort start at {start:.2f}; {why}"
        total = floor if mode is FeedbackMode.MEASURE else budget
        notes = "; ".join(r.note for r in readings.values() if r.note)
        why = f"{why} (floor {floor:.2f}, ceiling {ceiling:.2f}; {notes})"
        new = _with(new, mode=mode, floor_periods=new.floor_periods + 1 if total <= floor + EPS else 0)
    if lc_why:
        why += f"; {lc_why}"
    shares = {**lc_shares, **(_best_effort_shares(be, total) if be else {})}
    # Best-effort at its floor (or absent) and activations still waiting that will miss: vertical scaling has
    # nothing left to give the instance — the horizontal scaler hears it as saturated.
    # (at the floor since the period before: the clamp that just took it there gets one period to drain).
    spent = not be or (state.floor_periods >= 1 and total <= floor + EPS)
    exhausted = {k for k, r in readings.items() if r.queue_over} if spent else set()
    decisions = tuple(_share_decision(i, shares, mode, total, period, config, exhausted=i.id in exhausted)
                      for i in snapshot.instances)
    active_total = sum(d.share for d in decisions if d.active)
    return VerticalDecision(
        now=now, gpu=snapshot.gpu, mode=mode, shares=decisions, budget=new.budget if be and lc else None,
        reason=f"{snapshot.gpu or 'gpu'} {mode.value}: {why}; Σ active shares {active_total:.2f}", state=new,
        active_total=active_total,
    )


def mps_start_threads(cls: InstanceClass, limit: float, config: AnyVerticalConfig, *, request: float = 0.0,
                      lc_requests: float = 0.0) -> float:
    """The active-thread fraction (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / 100) an instance's MPS client starts
    with — fixed for the life of its process, so chosen here, once, at container start. Every policy caps a
    client at its SM limit (a function never gets more than it declared); under `slo` a best-effort client is
    capped further, at `mps_best_effort_threads`, leaving the rest of the SMs to latency-critical clients that
    start while it runs; under `spatial` at `spatial_threads` (`request`: its SM request; `lc_requests`: Σ SM
    request of the latency-critical instances on its GPU when it starts). Within [0.01, 1]."""
    cap = limit
    if isinstance(config, SloConfig) and not cls.latency_critical:
        cap = min(limit, config.mps_best_effort_threads)
    elif isinstance(config, SpatialConfig):
        cap = spatial_threads(cls, limit, request=request, lc_requests=lc_requests, config=config)
    return min(1.0, max(0.01, cap))


def _share_decision(inst: VerticalInstance, shares: dict[str, float], mode: FeedbackMode, total: float,
                    period_s: float, config: SloConfig, *, exhausted: bool = False) -> ShareDecision:
    active = inst.id in shares
    mps = None if inst.cls.latency_critical else mps_start_threads(inst.cls, inst.limit, config)
    if inst.cls.latency_critical:
        share = shares.get(inst.id, inst.limit)
        why = (f"latency-critical with demand: {share:.2f} (limit {inst.limit:.2f})" if active
               else f"latency-critical, idle: standing cap at its limit {inst.limit:.2f}")
    elif active:
        share = shares[inst.id]
        why = f"best-effort: {share:.2f} of budget {total:.2f} split by request ({mode.value})"
    else:
        share = inst.request
        why = f"best-effort, idle: standing cap at its request {inst.request:.2f}"
    share = min(max(0.0, share), inst.limit)
    throttled = active and share >= inst.limit - EPS and inst.throttled_s >= SATURATED_THROTTLE_FRACTION * period_s
    if throttled:
        why += "; saturated (throttled at its limit)"
    elif exhausted:
        why += "; saturated (its queue misses its SLO with best-effort at its floor)"
    return ShareDecision(id=inst.id, share=share, previous=inst.share, active=active,
                         saturated=throttled or (active and exhausted), reason=why, mps_threads=mps)


# -- the static baseline -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StaticConfig:
    """The `static` policy: no knobs; each instance's annotated limit is its share."""

    @property
    def idle_after_s(self) -> float:
        return IDLE_AFTER_S


def decide_static(snapshot: VerticalSnapshot, state: SloState, config: StaticConfig) -> VerticalDecision:
    """Every instance at its limit, whatever happens: a static split set by the annotations (e.g. training
    at limit 0.3 beside inference), for comparison with the feedback policies."""
    now = snapshot.now
    active = {i.id for i in snapshot.instances if i.active(now, config)}
    lc = any(i.cls.latency_critical and i.id in active for i in snapshot.instances)
    mode = FeedbackMode.HOLD if lc else FeedbackMode.IDLE
    shares = tuple(
        ShareDecision(id=i.id, share=i.limit, previous=i.share, active=i.id in active,
                      saturated=i.id in active and i.throttled_s >= SATURATED_THROTTLE_FRACTION * snapshot.period_s,
                      reason=f"static: its limit {i.limit:.2f}")
        for i in snapshot.instances
    )
    total = sum(d.share for d in shares if d.active)
    return VerticalDecision(now=now, gpu=snapshot.gpu, mode=mode, shares=shares, budget=None,
                            reason=f"{snapshot.gpu or 'gpu'} static: every instance at its limit; Σ active shares "
                                   f"{total:.2f}", state=replace(state, mode=mode), active_total=total)


# -- the spatial split (MPS) --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SpatialConfig:
    """The `spatial` policy: no token gate; the split is MPS's active-thread caps, fixed at each client's
    start (`spatial_threads`). Measured on the H200 through the product (docs/benchmarks/gpu-product.md, M2):
    a static MPS 50/50 split without token caps kept inference's p99 at 0.86× its solo with training at 1.10
    of its unlimited solo, where the `slo` law's caps under MPS cut training to 0.48 (docs/policies.md §1.0)."""

    lc_reserve: float = 0.5
    """Fraction of the SMs, [0, 1]: kept free of a best-effort client's cap for latency-critical instances,
    at least Σ the SM requests of those on the GPU when it starts, this much when fewer (room for those that
    arrive later, since an MPS client's cap cannot change while it runs)."""

    lc_threads: float = 1.0
    """Fraction of the SMs, (0, 1]: the largest cap a latency-critical client starts with beyond its own SM
    request, min(limit, max(request, lc_threads)). 1.0: its limit. At `lc_reserve` the latency-critical and
    best-effort caps meet instead of overlapping (inference 0.5 / 0.8 and training 0.3 / 0.7 at 0.5: 50% and
    50% of the SMs, against 80% and 50% at 1.0)."""

    be_threads: float = 0.0
    """Fraction of the SMs, [0, 1]: the cap a best-effort client may start with even inside the reserve,
    min(limit, max(request, 1 − reserve, be_threads)), counting on its below-normal MPS priority
    (`--gpu-mps-best-effort-priority`) to run latency-critical kernels first where both wait. 0: the reserve
    stays out of its reach (training 0.3 / 0.7 beside inference requesting 0.5: 50% of the SMs; at 1.0: 70%,
    its limit)."""

    def __post_init__(self) -> None:
        v = self.lc_reserve
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"lc_reserve must be in [0, 1], got {v!r}")
        t = self.lc_threads
        if not (isinstance(t, (int, float)) and math.isfinite(t) and 0.0 < t <= 1.0):
            raise ValueError(f"lc_threads must be in (0, 1], got {t!r}")
        b = self.be_threads
        if not (isinstance(b, (int, float)) and math.isfinite(b) and 0.0 <= b <= 1.0):
            raise ValueError(f"be_threads must be in [0, 1], got {b!r}")

    @property
    def idle_after_s(self) -> float:
        return IDLE_AFTER_S


def spatial_threads(cls: InstanceClass, limit: float, *, request: float, lc_requests: float,
                    config: SpatialConfig) -> float:
    """An MPS client's active-thread fraction under `spatial`: a latency-critical instance gets
    min(limit, max(request, `lc_threads`)), its SM limit by default; a best-effort one min(limit, max(request,
    1 − reserve, `be_threads`)), reserve = max(`lc_requests`, `lc_reserve`): the SMs latency-critical work needs
    stay out of its reach (unless `be_threads` lets it in), never below its own request. Within [0.01, 1]."""
    if cls.latency_critical:
        cap = min(limit, max(request, config.lc_threads))
    else:
        reserve = max(lc_requests, config.lc_reserve)
        cap = min(limit, max(request, 1.0 - reserve, config.be_threads))
    return min(1.0, max(0.01, cap))


def _spatial_saturated(inst: VerticalInstance, track: SloTrack) -> tuple[bool, str]:
    """No share can grow under `spatial`: an instance whose own time is full while activations wait for it
    (`is_saturated`), or whose waiting activations will miss its annotated SLO, needs another instance."""
    if is_saturated(inst, track):
        return True, "saturated (requests fill its time with activations waiting)"
    spans, _ = _samples(inst)
    waiting = waiting_latency_s(inst, track, spans)
    if inst.slo_ms and waiting >= inst.slo_ms / 1000.0:
        return True, f"saturated ({inst.queued:g} waiting: {waiting * 1000:.1f} ms, past its SLO)"
    return False, ""


def decide_spatial(snapshot: VerticalSnapshot, state: SloState, config: SpatialConfig) -> VerticalDecision:
    """No instance is throttled: its share is its MPS thread cap (what it may use of the SMs, fixed at its
    start), which the shim does not enforce with tokens (`gates_launches` is False: the manager writes an
    unlimited rate). What is reported each period are the balancer's signals: active and saturated."""
    now, period = snapshot.now, snapshot.period_s
    active = {i.id for i in snapshot.instances if i.active(now, config)}
    lc = any(i.cls.latency_critical and i.id in active for i in snapshot.instances)
    mode = FeedbackMode.HOLD if lc else FeedbackMode.IDLE
    tracks = {i.id: observe(i, state.track(i.id), period_s=period, settled=False, quiet=False)
              for i in snapshot.instances}
    shares = []
    for i in snapshot.instances:
        threads = i.mps_threads if i.mps_threads is not None else i.limit
        saturated, why = _spatial_saturated(i, tracks[i.id]) if i.id in active else (False, "")
        src = "its MPS thread cap, fixed at its start" if i.mps_threads is not None else "its limit (no MPS cap known)"
        reason = f"spatial: no token cap; {threads:.2f} of the SMs = {src}" + (f"; {why}" if why else "")
        shares.append(ShareDecision(id=i.id, share=min(threads, i.limit), previous=i.share, active=i.id in active,
                                    saturated=saturated, reason=reason, mps_threads=i.mps_threads))
    total = sum(d.share for d in shares if d.active)
    return VerticalDecision(
        now=now, gpu=snapshot.gpu, mode=mode, shares=tuple(shares), budget=None,
        reason=f"{snapshot.gpu or 'gpu'} spatial: launches not throttled, MPS thread caps split the SMs; Σ active "
               f"shares {total:.2f}",
        state=SloState(mode=mode, tracks=tuple(tracks.values())), active_total=total)


# -- selection ---------------------------------------------------------------------------------------

AnyVerticalConfig = SloConfig | StaticConfig | SpatialConfig


@dataclass(frozen=True, slots=True)
class PerGpuVertical:
    """A policy chosen per GPU once its sharing mode is known (`--gpu-vertical-policy auto` or `spatial`):
    `mps` where the GPU runs its instances as MPS clients, `time_sliced` where it does not."""

    name: str
    """The flag's value: `auto` or `spatial`."""
    mps: AnyVerticalConfig
    time_sliced: AnyVerticalConfig


def resolve_vertical(config: AnyVerticalConfig | PerGpuVertical, *, mps: bool,
                     mps_reason: str = "") -> tuple[AnyVerticalConfig, str, bool]:
    """(the policy a GPU runs, why, whether that is a fallback worth a warning) given the configured one and
    whether the GPU runs MPS (`mps_reason`: the MPS decision's reason). `auto`: `spatial` under MPS (the
    split isolates; token caps only cost), `slo` when time-sliced (nothing divides the GPU but the shim).
    `spatial` on a time-sliced GPU falls back to `slo`: without MPS no cap would divide the SMs and every
    instance would run unthrottled."""
    how = f" ({mps_reason})" if mps_reason else ""
    if isinstance(config, PerGpuVertical):
        chosen = config.mps if mps else config.time_sliced
        name = policy_name(chosen)
        if config.name == "auto":
            return chosen, f"--gpu-vertical-policy auto: {name}, the GPU {'runs MPS' if mps else 'time-slices'}{how}", \
                False
        if mps:
            return chosen, f"--gpu-vertical-policy {config.name}: the GPU runs MPS{how}", False
        return chosen, (f"--gpu-vertical-policy {config.name} needs MPS, but the GPU time-slices{how}: {name} "
                        f"instead"), True
    return config, f"--gpu-vertical-policy {policy_name(config)}", False


def gates_launches(config: AnyVerticalConfig) -> bool:
    """Whether the policy's shares become token rates in the shim (False: `spatial`, whose caps are MPS's)."""
    return not isinstance(config, SpatialConfig)


def initial_state(config: AnyVerticalConfig) -> SloState:
    """The state a GPU starts with under `config`'s policy (every policy keeps an `SloState`)."""
    return SloState()


def decide_vertical(snapshot: VerticalSnapshot, state: SloState, config: AnyVerticalConfig) -> VerticalDecision:
    """Run the policy `config` belongs to (`SloConfig`: `slo`, `StaticConfig`: `static`, `SpatialConfig`:
    `spatial`)."""
    if isinstance(config, StaticConfig):
        return decide_static(snapshot, state, config)
    if isinstance(config, SpatialConfig):
        return decide_spatial(snapshot, state, config)
    return decide_slo(snapshot, state, config)


def policy_name(config: AnyVerticalConfig) -> str:
    if isinstance(config, SpatialConfig):
        return "spatial"
    return "static" if isinstance(config, StaticConfig) else "slo"


__all__ = [
    "GPU_VERTICAL_POLICIES",
    "REMOVED_VERTICAL_POLICIES",
    "VERTICAL_POLICIES",
    "PerGpuVertical",
    "SloConfig",
    "SloState",
    "SloTrack",
    "SpatialConfig",
    "StaticConfig",
    "check_policy_name",
    "decide_slo",
    "decide_spatial",
    "decide_static",
    "decide_vertical",
    "gates_launches",
    "initial_state",
    "is_saturated",
    "latency_shares",
    "mps_start_threads",
    "occupancy",
    "policy_name",
    "queue_latency_s",
    "resolve_vertical",
    "spatial_threads",
    "waiting_latency_s",
]
