#!/usr/bin/env python3
"""Steps of the vertical-scaling benchmark (issue 4) on the H200; run by bench/vertical/run_h200.sh.

    python3 bench/vertical/h200.py step {timeslice,mps,mps_capped,mps_static} --work DIR --results DIR --log FILE [options]
    python3 bench/vertical/h200.py merge --results DIR --out FILE [--machine FILE] [--command STR]

An inference worker (ResNet-50 fp16 batch 8, open-loop arrivals, evenly spaced
by default as in the issue's anchor, or Poisson) and a training worker (ResNet-50
fp32 batch 64, SGD) run as two processes under the shim, each with the control/stats blocks a GpuNode
attachment gives it (the same code as the invoker's, process backend). The node's GpuManager runs in this
process with the real vertical policy, without Redis. Scenarios: solo, co-located without limits, static
shares, the dynamic manager (steady load, then idle), a burst; `mps` repeats the co-located ones with both
workers as MPS clients; `mps_capped` repeats them with training's MPS client held to part of the SMs
(`--mps-capped`); `mps_static` runs static MPS splits without the shim's limits (`--mps-splits`).

Each step writes results/<step>.json after every scenario, so a step cut short by its time limit keeps what
it measured. Overrides for a dry run without a GPU: DILU_BENCH_WORKER (worker program), DILU_BENCH_PYTHON,
DILU_BENCH_MPS_CONTROL, DILU_BENCH_SCALE (shorten every duration), DILU_BENCH_DRY_RUN=1 (mark the results).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
try:
    import structlog

    REAL_STRUCTLOG = True
except ImportError:  # the GPU machine has torch but not the service's packages
    sys.path.insert(0, str(HERE / "_compat"))
    import structlog

    REAL_STRUCTLOG = False

from dilu_invoker.gpu.devices import GpuDevice
from dilu_invoker.gpu.manager import TickRecord
from dilu_invoker.gpu.node import GpuNode
from dilu_invoker.model import GpuClass, GpuNeeds
from dilu_invoker.policy.vertical import FeedbackMode
from dilu_invoker.policy.vertical_slo import SloConfig

sys.path.insert(0, str(HERE))
from schedule import PROCESSES  # the workers' own module, next to this file

SCALE = min(1.0, max(0.01, float(os.environ.get("DILU_BENCH_SCALE", "1"))))
WORKER = os.environ.get("DILU_BENCH_WORKER", str(HERE / "worker.py"))
PYTHON = os.environ.get("DILU_BENCH_PYTHON", sys.executable)
MPS_CONTROL = os.environ.get("DILU_BENCH_MPS_CONTROL", "nvidia-cuda-mps-control")
SHIM = REPO / "cuda_shim" / "build" / "libdilu_shim.so"
INF, TRAIN = "inference", "training"
log = logging.getLogger("bench")


def secs(x: float) -> float:
    return round(x * SCALE, 3)


def _die_with_parent() -> None:
    """In the child before exec: a worker must not outlive a killed orchestrator (it would hold the GPU)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


# -- workers ------------------------------------------------------------------------------------------


class Worker:
    """One worker process; JSON commands in, JSON answers out."""

    def __init__(self, role: str, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.role, self.proc, self.stderr = role, proc, stderr
        self.ready: dict[str, Any] = {}

    @classmethod
    async def start(cls, role: str, env: dict[str, str], work: Path, batch: int, timeout: float) -> Worker:
        stderr = work / f"{role}-{os.getpid()}-{time.monotonic_ns()}.err"
        cmd = [PYTHON, WORKER, role, "--batch", str(batch)]
        log.info("start %s: %s (LD_PRELOAD=%s, MPS=%s)", role, " ".join(cmd), env.get("LD_PRELOAD", "-"),
                 env.get("CUDA_MPS_PIPE_DIRECTORY", "-"))
        with stderr.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.PIPE, stderr=err,
                                                        limit=64 << 20, preexec_fn=_die_with_parent)
        w = cls(role, proc, stderr)
        w.ready = await w._answer(timeout)
        if not w.ready.get("ready"):
            raise RuntimeError(f"{role} worker did not start: {w.ready}")
        log.info("%s ready: %s", role, w.ready)
        return w

    async def _answer(self, timeout: float) -> dict[str, Any]:
        """The next JSON object the worker prints (a library printing to stdout is logged and skipped)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise RuntimeError(f"{self.role} worker did not answer within {timeout:.0f} s: {self.tail()}") from None
            if not line:
                await self.proc.wait()
                raise RuntimeError(f"{self.role} worker exited ({self.proc.returncode}): {self.tail()}")
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                answer = None
            if isinstance(answer, dict):
                return answer
            log.info("%s worker printed: %s", self.role, line[:300].decode(errors="replace").rstrip())

    async def call(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        answer = await self._answer(timeout)
        if not answer.get("ok"):
            raise RuntimeError(f"{self.role} worker failed {cmd.get('cmd')}: {answer.get('error')}")
        return answer

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.stderr.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    async def stop(self) -> None:
        if self.proc.returncode is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 10)
            except (TimeoutError, OSError, AssertionError):
                self.proc.kill()
                await self.proc.wait()


# -- measurements ---------------------------------------------------------------------------------------


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


def latency(res: dict[str, Any], *, slo_ms: float | None = None, window: tuple[float, float] | None = None,
            ) -> dict[str, Any]:
    arr, done = res["arrivals"], res["completions"]
    lat = [(d - a) * 1000 for a, d in zip(arr, done, strict=False)
           if window is None or window[0] <= a < window[1]]
    out: dict[str, Any] = {"n": len(lat), "p50_ms": pct(lat, 0.5), "p90_ms": pct(lat, 0.9),
                           "p99_ms": pct(lat, 0.99), "mean_ms": statistics.fmean(lat) if lat else None,
                           "max_ms": max(lat) if lat else None}
    if arr:
        span = (window[1] - window[0]) if window else (arr[-1] - res["start"])
        out["offered_rps"] = len(lat) / span if span > 0 else None
    if slo_ms:
        out["slo_ms"] = slo_ms
        out["violations"] = sum(x > slo_ms for x in lat) / len(lat) if lat else None
    return out


def rate(steps: list[float], t0: float, t1: float) -> float | None:
    if t1 <= t0:
        return None
    return sum(t0 <= s < t1 for s in steps) / (t1 - t0)


def requests(res: dict[str, Any], t0: float, t1: float) -> list[list[float]]:
    """Every request of a window (arrival relative to its start, latency ms), to line the tail up with the
    manager's ticks and the GPU's clock samples."""
    return [[round(a - t0, 4), round((d - a) * 1000, 2)]
            for a, d in zip(res["arrivals"], res["completions"], strict=False) if t0 <= a < t1]


def unix(t: float) -> float:
    """A monotonic instant (shared by every process on the machine) as wall-clock seconds, to line scenarios
    up with nvidia-smi's timestamps (gpu_samples.csv)."""
    return round(t + time.time() - time.monotonic(), 3)


def window(res: dict[str, Any], tr: dict[str, Any], d: float) -> tuple[float, float]:
    """From the first arrival to the last completion, but not past training's last step."""
    t0 = res["start"]
    t1 = res["completions"][-1] if res["completions"] else t0 + d
    if tr.get("steps"):
        t1 = min(t1, tr["steps"][-1])
    return t0, t1


def compact(r: TickRecord, t_ref: float) -> dict[str, Any]:
    return {
        "t": round(r.now - t_ref, 4), "mode": r.mode.value,
        "budget": round(r.budget, 4) if r.budget is not None else None,
        "shares": {s.id: round(s.share, 4) for s in r.instances},
        "rates": {s.id: round(s.rate_blocks_per_ms, 1) for s in r.instances},
        "active": [s.id for s in r.instances if s.active],
        "blocks": {s.id: s.blocks for s in r.instances},
        # What an interference signal could be built from: busy time, cycles, waiting for tokens.
        "busy_ms": {s.id: round(s.busy_s * 1000, 1) for s in r.instances},
        "cycles_ms": {s.id: [round(c * 1000, 1) for c in s.cycles_s] for s in r.instances},
        "open_ms": {s.id: round(s.open_cycle_s * 1000, 1) for s in r.instances},
        "spans_ms": {s.id: [round(x * 1000, 2) for x in s.spans_s] for s in r.instances},
        "open_span_ms": {s.id: round(s.open_span_s * 1000, 2) for s in r.instances},
        "throttled_ms": {s.id: round(s.throttled_s * 1000, 2) for s in r.instances},
        "reason": r.reason[:320],
    }


class Timeline:
    """The manager's decisions while a scenario runs."""

    def __init__(self) -> None:
        self.records: list[TickRecord] = []
        self.on = False


    def __call__(self, r: TickRecord) -> None:
        if self.on:
            self.records.append(r)

    def start(self) -> None:
        self.records, self.on = [], True

    def stop(self) -> list[TickRecord]:
        self.on = False
        return self.records


def summarize(records: list[TickRecord], t0: float, t1: float) -> dict[str, Any]:
    rs = [r for r in records if t0 <= r.now < t1]
    modes: dict[str, int] = {}
    for r in rs:
        modes[r.mode.value] = modes.get(r.mode.value, 0) + 1
    shares = {i: [r.status(i).share for r in rs if any(s.id == i for s in r.instances)] for i in (INF, TRAIN)}
    return {"ticks": len(rs), "modes": modes,
            "mean_share": {i: statistics.fmean(v) if v else None for i, v in shares.items()},
            "min_share": {i: min(v) if v else None for i, v in shares.items()},
            "mode_changes": [{"t": round(r.now - t0, 3), "mode": r.mode.value, "reason": r.reason[:240]}
                             for prev, r in itertools.pairwise(rs) if r.mode is not prev.mode][:20]}


# -- the scenario suite ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    work: Path
    results: Path
    load: float
    arrivals: str
    burst_base: float
    burst_mult: float
    seconds: float
    period_ms: float
    static: tuple[float, float]
    inference_share: tuple[float, float]
    training_share: tuple[float, float]
    gamma: float
    vertical: SloConfig
    variants: dict[str, SloConfig]
    static_caps: tuple[float, ...]
    mps_capped: tuple[int, int]
    mps_splits: tuple[tuple[int, int], ...]
    manager_slo: str
    capacity: str
    infer_batch: int
    train_batch: int
    start_timeout: float
    seed: int


class Suite:
    """Two workers under one GpuNode, and the scenarios run on them."""

    def __init__(self, o: Options, out: dict[str, Any], save: Callable[[], None], label: str,
                 extra_env: dict[str, str], reference: dict[str, Any],
                 percentages: tuple[int, int] | None = None) -> None:
        self.o, self.out, self.save, self.label = o, out, save, label
        self.reference = reference
        self.extra_env, self.percentages = extra_env, percentages
        self.timeline = Timeline()
        self.node: GpuNode | None = None
        self.workers: dict[str, Worker] = {}

    # -- set-up ------------------------------------------------------------------------------------

    def device(self) -> GpuDevice:
        uuid, name, mem = "GPU-bench-0", "unknown GPU", 143_771
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=uuid,name,memory.total", "--format=csv,noheader,nounits",
                                "-i", "0"], capture_output=True, text=True, timeout=20, check=True)
            u, n, m = (x.strip() for x in q.stdout.strip().splitlines()[0].split(","))
            uuid, name, mem = u, n, int(float(m))
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            log.info("nvidia-smi gave no GPU; the node uses a placeholder device")
        return GpuDevice(index=0, uuid=uuid, name=name, memory_mb=mem, sm_count=0)

    def env(self, attachment_env: Any, role: str) -> dict[str, str]:
        drop = ("DILU_SHIM_", "CUDA_MPS_", "LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env.update(attachment_env)
        env.update(self.extra_env)
        if self.percentages is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.percentages[0 if role == INF else 1])
        return env

    async def setup(self) -> None:
        o = self.o
        device = self.device()
        self.out["device"] = {"uuid": device.uuid, "name": device.name, "memory_mb": device.memory_mb}
        self.node = GpuNode(node=f"bench-{self.label}", devices=(device,), shm_dir=o.work / "shm",
                            shim_library=SHIM, gamma=o.gamma, period_s=o.period_ms / 1000,
                            vertical=o.vertical, observers=(self.timeline,))
        await self.node.start()
        # <request, limit>: inference may take the whole GPU (its share only rises above 1 - training's
        # request once feedback has cut training); training is guaranteed little and may take all when idle.
        (ir, il), (tr, tl) = o.inference_share, o.training_share
        needs = {
            # slo-ms as a user would annotate it: about 2x the solo p99 seen on the H200 (46-64 ms).
            INF: GpuNeeds(gpu_class=GpuClass.INFERENCE, sm_request=ir, sm_limit=il, memory_mb=30_000,
                          slo_ms=INFERENCE_SLO_MS),
            TRAIN: GpuNeeds(gpu_class=GpuClass.TRAINING, sm_request=tr, sm_limit=tl, memory_mb=60_000),
        }
        self.out["instances"] = {k: {"request": v.sm_request, "limit": v.sm_limit, "memory_mb": v.memory_mb,
                                     "class": v.gpu_class.value} for k, v in needs.items()}
        envs = {}
        for role, n in needs.items():
            a = await self.node.attach(role, f"bench/{role}", n)
            if a is None:
                raise RuntimeError(f"the node did not attach {role}")
            envs[role] = self.env(a.env, role)
            self.node.pin(role, 1.0)  # unlimited until a scenario says otherwise
        batches = {INF: o.infer_batch, TRAIN: o.train_batch}
        started = await asyncio.gather(*(Worker.start(r, envs[r], o.work, batches[r], o.start_timeout)
                                         for r in (INF, TRAIN)), return_exceptions=True)
        for role, w in zip((INF, TRAIN), started, strict=True):
            if isinstance(w, BaseException):
                raise RuntimeError(f"{role} worker: {w}")
            self.workers[role] = w
        self.out["workers"] = {r: w.ready for r, w in self.workers.items()}
        self.save()

    async def close(self) -> None:
        for w in self.workers.values():
            await w.stop()
        if self.node is not None:
            await self.node.close()

    # -- helpers -------------------------------------------------------------------------------------

    @property
    def inf(self) -> Worker:
        return self.workers[INF]

    @property
    def train(self) -> Worker:
        return self.workers[TRAIN]

    def pins(self, inf: float | None, train: float | None) -> None:
        assert self.node is not None
        self.node.pin(INF, inf)
        self.node.pin(TRAIN, train)

    def blocks(self, role: str) -> int:
        assert self.node is not None
        from dilu_invoker.gpu import abi

        with abi.StatsFile.open(self.o.work / "shm" / self.node.node / role / "stats") as f:
            return f.snapshot().blocks

    async def open_loop(self, phases: list[list[float]], seed: int) -> dict[str, Any]:
        total = sum(p[0] for p in phases)
        return await self.inf.call({"cmd": "open", "phases": phases, "seed": seed, "start_in": 0.3,
                                    "arrivals": self.o.arrivals},
                                   timeout=total * 3 + 60)

    async def with_training(self, before: float, run: Callable[[], Awaitable[dict[str, Any]]],
                            after: float, expected: float) -> tuple[dict[str, Any], dict[str, Any], float]:
        """Training for ``before`` + the inference run (``expected`` s) + ``after`` seconds."""
        total = before + expected + 0.3 + after
        t_task = asyncio.create_task(self.train.call({"cmd": "train", "seconds": total}, timeout=total + 120))
        await asyncio.sleep(before)
        try:
            res = await run()
        except BaseException:
            t_task.cancel()
            raise
        stopped = time.monotonic()
        tr = await t_task
        return res, tr, stopped

    # -- scenarios -----------------------------------------------------------------------------------

    def reuse_calibration(self) -> bool:
        """Take the time-sliced step's calibration (same workers, same GPU) instead of measuring again."""
        cal = self.reference.get("calibration")
        if not cal or self.node is None:
            return False
        self.out["calibration"] = {**cal, "from": "timeslice"}
        if self.o.capacity == "measured":
            for role, cap in (cal.get("capacity_blocks_per_ms") or {}).items():
                if cap:
                    self.node.set_capacity(role, cap)
        self.save()
        return True

    async def calibrate(self) -> None:
        o, node = self.o, self.node
        assert node is not None
        if self.reference.get("calibration") and self.reuse_calibration():
            return
        self.pins(1.0, 1.0)
        b0, t0 = self.blocks(INF), time.monotonic()
        closed = await self.inf.call({"cmd": "closed", "seconds": secs(3)}, timeout=120)
        inf_cap = (self.blocks(INF) - b0) / ((time.monotonic() - t0) * 1000)
        b0, t0 = self.blocks(TRAIN), time.monotonic()
        tr = await self.train.call({"cmd": "train", "seconds": secs(5)}, timeout=180)
        tr_cap = (self.blocks(TRAIN) - b0) / ((time.monotonic() - t0) * 1000)
        mgr = node.manager(0)
        learnt = {r: mgr.capacity_of(r).blocks_per_ms for r in (INF, TRAIN)}
        steps = tr["steps"]
        solo_it = rate(steps, steps[0], steps[-1]) if len(steps) > 2 else None
        self.out["calibration"] = {
            "inference_closed": {k: closed[k] for k in ("n", "rps", "p50_ms", "min_ms")},
            "training_solo_it_s": solo_it,
            "capacity_blocks_per_ms": {INF: inf_cap, TRAIN: tr_cap},
            "estimator_blocks_per_ms": learnt,
            "capacity_used": o.capacity,
        }
        if o.capacity == "measured":
            for role, cap in ((INF, inf_cap), (TRAIN, tr_cap)):
                if cap > 0:
                    node.set_capacity(role, cap)
        self.save()

    @property
    def capacity_rps(self) -> float:
        """Closed-loop requests/s of inference alone; the time-sliced step's when there is one, so every step
        offers the same load."""
        ref = self.reference.get("rps")
        return float(ref) if ref else float(self.out["calibration"]["inference_closed"]["rps"])

    @property
    def rps(self) -> float:
        return self.o.load * self.capacity_rps

    async def solo_inference(self) -> None:
        self.pins(1.0, 1.0)
        res = await self.open_loop([[secs(self.o.seconds), self.rps]], self.o.seed)
        lat = latency(res)
        lat["rate_rps"] = self.rps
        t1 = res["completions"][-1] if res["completions"] else res["start"]
        self.out["solo_inference"] = {**lat, "requests": requests(res, res["start"], t1), "t0_unix": unix(res["start"])}
        self.save()

    def slo_ms(self, reference: dict[str, Any] | None) -> float | None:
        p99 = (reference or self.out.get("solo_inference") or {}).get("p99_ms")
        return 2 * p99 if p99 else None

    def solo_it(self, reference: float | None) -> float | None:
        return reference or self.out.get("calibration", {}).get("training_solo_it_s")

    async def colocated(self, name: str, inf_pin: float | None, train_pin: float | None, *,
                        slo: float | None, solo_it: float | None) -> None:
        self.pins(inf_pin, train_pin)
        self.timeline.start()
        d = secs(self.o.seconds)
        res, tr, _ = await self.with_training(
            1.0, lambda: self.open_loop([[d, self.rps]], self.o.seed), 0.5, d)
        records = self.timeline.stop()
        t0, t1 = window(res, tr, d)
        it = rate(tr["steps"], t0, t1)
        self.out[name] = {
            "pins": {INF: inf_pin, TRAIN: train_pin},
            "inference": latency(res, slo_ms=slo),
            "training": {"it_s": it, "vs_solo": it / solo_it if it and solo_it else None},
            "manager": summarize(records, t0, t1),
            "requests": requests(res, t0, t1),
            "t0_unix": unix(t0),
        }
        self.save()

    def use(self, variant: str) -> SloConfig:
        """The policy configuration of a scenario variant (the manager's memory starts over)."""
        assert self.node is not None
        cfg = self.o.variants[variant]
        self.node.manager(0).set_vertical_config(cfg)
        return cfg

    async def dynamic_and_idle(self, *, slo: float | None, solo_it: float | None, variant: str = "default") -> None:
        cfg = self.use(variant)
        suffix = "" if variant == "default" else f"@{variant}"
        self.pins(None, None)
        self.timeline.start()
        d, idle_s = secs(self.o.seconds), max(3.0, secs(4))
        res, tr, stopped = await self.with_training(
            2.0, lambda: self.open_loop([[d, self.rps]], self.o.seed), idle_s, d)
        records = self.timeline.stop()
        t0, t1 = window(res, tr, d)
        steps = tr["steps"]
        it = rate(steps, t0, t1)
        alone = rate(steps, tr["t0"] + 0.7, t0 - 0.1)
        self.out[f"dynamic{suffix}"] = {
            "variant": variant,
            "inference": latency(res, slo_ms=slo),
            "training": {"it_s": it, "vs_solo": it / solo_it if it and solo_it else None,
                         "before_inference_it_s": alone},
            "manager": summarize(records, t0, t1),
            "timeline": [compact(r, t0) for r in records if r.now >= t0 - 0.5 and r.now < t1 + 0.2],
            "requests": requests(res, t0, t1),
            "t0_unix": unix(t0),
        }
        idle_at = next((r.now for r in records if r.now >= stopped and r.mode is FeedbackMode.IDLE), None)
        w0 = (idle_at or stopped + cfg.idle_after_s) + 0.3
        w1 = steps[-1] if steps else w0
        idle_it = rate(steps, w0, w1)
        self.out[f"idle{suffix}"] = {
            "idle_mode_after_ms": (idle_at - stopped) * 1000 if idle_at else None,
            "window_s": w1 - w0,
            "training": {"it_s": idle_it, "vs_solo": idle_it / solo_it if idle_it and solo_it else None},
            "manager": summarize(records, stopped, w1),
        }
        self.save()

    async def burst(self, *, slo: float | None, name: str = "burst", train: bool = True,
                    variant: str = "default") -> None:
        o = self.o
        if train:
            self.use(variant)
        cap = self.capacity_rps
        base, peak = o.burst_base * cap, o.burst_base * o.burst_mult * cap
        pre, during, post = secs(2.5), secs(2.5), secs(2)
        phases = [[pre, base], [during, peak], [post, base]]
        if train:
            self.pins(None, None)
        else:
            self.pins(1.0, 1.0)
        self.timeline.start()
        if train:
            res, tr, _ = await self.with_training(
                1.0, lambda: self.open_loop(phases, o.seed + 1), 0.5, pre + during + post)
        else:
            res, tr = await self.open_loop(phases, o.seed + 1), {"steps": []}
        records = self.timeline.stop()
        b0 = res["start"] + pre
        b1 = b0 + during
        before = [r for r in records if r.now < b0]
        share_before = before[-1].status(INF).share if before else None
        train_before = before[-1].status(TRAIN).share if before else None
        after = [r for r in records if r.now >= b0]
        raised = next((r for r in after if share_before is not None and r.status(INF).share > share_before + 1e-6),
                      None)
        cut = next((r for r in after if r.mode in (FeedbackMode.EMERGENCY, FeedbackMode.DECREASE)
                    or (train_before is not None and r.status(TRAIN).share < train_before - 1e-6)), None)
        end = res["completions"][-1] if res["completions"] else b1 + post
        self.out[name] = {
            "variant": variant if train else None,
            "rates_rps": {"base": base, "burst": peak, "multiplier": o.burst_mult},
            "phases_s": [pre, during, post],
            "t0_unix": unix(res["start"]),
            "inference_burst": latency(res, slo_ms=slo, window=(b0, b1)),
            "inference_all": latency(res, slo_ms=slo),
            "training": {"it_s": rate(tr["steps"], res["start"], min(end, tr["steps"][-1] if tr["steps"] else end))}
            if train else None,
            "reaction": {
                "share_before": share_before, "training_share_before": train_before,
                "share_raised_ms": (raised.now - b0) * 1000 if raised else None,
                "share_raised_to": raised.status(INF).share if raised else None,
                "first_cut_ms": (cut.now - b0) * 1000 if cut else None,
                # Emergencies already happening before the burst make a fast "reaction" meaningless.
                "emergency_ticks_in_second_before": sum(
                    1 for r in before if r.now >= b0 - 1.0 and r.mode is FeedbackMode.EMERGENCY),
                "decrease_ticks_in_second_before": sum(
                    1 for r in before if r.now >= b0 - 1.0 and r.mode is FeedbackMode.DECREASE),
                "period_ms": o.period_ms,
            },
            "manager": summarize(records, b0, b1 + 1.0),
            "timeline": [compact(r, b0) for r in records if b0 - 1.0 <= r.now < b1 + 1.0],
        }
        self.save()


async def run_suite(o: Options, out: dict[str, Any], save: Callable[[], None], label: str,
                    scenarios: list[str], extra_env: dict[str, str], reference: dict[str, Any],
                    percentages: tuple[int, int] | None = None) -> None:
    suite = Suite(o, out, save, label, extra_env, reference, percentages)
    out["scenarios_planned"] = scenarios
    out["errors"] = {}
    try:
        await suite.setup()
        for name in scenarios:
            log.info("== scenario %s/%s", label, name)
            t = time.monotonic()
            try:
                slo = suite.slo_ms(reference.get("solo_inference"))
                solo_it = suite.solo_it(reference.get("training_solo_it_s"))
                if o.manager_slo == "solo" and slo and suite.node is not None:
                    # The manager works to the SLO the results are judged by (2 × solo p99).
                    suite.node.set_slo(INF, slo)
                    out["manager_slo_ms"] = slo
                if name == "calibrate":
                    await suite.calibrate()
                elif name == "solo_inference":
                    await suite.solo_inference()
                elif name == "none":
                    await suite.colocated("none", 1.0, 1.0, slo=slo, solo_it=solo_it)
                elif name == "static":
                    await suite.colocated("static", o.static[0], o.static[1], slo=slo, solo_it=solo_it)
                elif name.startswith("static@"):
                    # Inference uncapped, training capped: the frontier a fixed rate cap buys.
                    cap = float(name.partition("@")[2])
                    await suite.colocated(name, 1.0, cap, slo=slo, solo_it=solo_it)
                elif name.startswith("dynamic"):
                    _, _, variant = name.partition("@")
                    await suite.dynamic_and_idle(slo=slo, solo_it=solo_it, variant=variant or "default")
                elif name.startswith("burst") and name != "burst_solo":
                    _, _, variant = name.partition("@")
                    await suite.burst(slo=slo, name=name, variant=variant or "default")
                elif name == "burst_solo":
                    await suite.burst(slo=slo, name="burst_solo", train=False)
                else:
                    raise ValueError(f"unknown scenario {name}")
            except Exception as e:
                out["errors"][name] = repr(e)
                log.error("scenario %s failed: %s\n%s", name, e, traceback.format_exc())
                for w in suite.workers.values():
                    if w.proc.returncode is not None:
                        log.error("%s worker exited %s: %s", w.role, w.proc.returncode, w.tail())
                if name == "calibrate" or any(w.proc.returncode is not None for w in suite.workers.values()):
                    raise
            log.info("== scenario %s/%s took %.1f s", label, name, time.monotonic() - t)
            save()
    finally:
        await suite.close()


# -- steps ---------------------------------------------------------------------------------------------


def reference(results: Path) -> dict[str, Any]:
    """Solo figures of the time-sliced step, so the other steps judge against the same SLO and solo it/s."""
    p = results / "timeslice.json"
    try:
        ts = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {"solo_inference": ts.get("solo_inference"), "calibration": ts.get("calibration"),
            "training_solo_it_s": (ts.get("calibration") or {}).get("training_solo_it_s"),
            "rps": ((ts.get("calibration") or {}).get("inference_closed") or {}).get("rps")}


class Mps:
    def __init__(self, work: Path) -> None:
        self.pipe, self.logs = work / "mps_pipe", work / "mps_log"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}

    def start(self) -> None:
        if not shutil.which(MPS_CONTROL) and not Path(MPS_CONTROL).is_file():
            raise RuntimeError(f"{MPS_CONTROL} not found")
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([MPS_CONTROL, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True,
                           timeout=30, check=False)
        log.info("MPS daemon start rc=%s %s", r.returncode, (r.stdout + r.stderr).strip()[-300:])
        if r.returncode != 0:
            raise RuntimeError(f"MPS daemon did not start (rc {r.returncode})")
        time.sleep(1.0)

    def quit(self) -> None:
        try:
            r = subprocess.run([MPS_CONTROL], input="quit\n", env={**os.environ, **self.env}, capture_output=True,
                               text=True, timeout=30, check=False)
            log.info("MPS quit rc=%s", r.returncode)
        except (OSError, subprocess.SubprocessError) as e:
            log.error("MPS quit failed: %s", e)
        time.sleep(1.0)


async def step(name: str, o: Options, out: dict[str, Any], save: Callable[[], None]) -> None:
    ref = reference(o.results)
    if name == "timeslice":
        dyn = [f"dynamic@{v}" if v != "default" else "dynamic" for v in o.variants]
        bursts = [f"burst@{v}" if v != "default" else "burst" for v in o.variants]
        await run_suite(o, out, save, "ts", ["calibrate", "solo_inference", "none", "static", *dyn, *bursts,
                                             "burst_solo"], {}, {})
        return
    mps = Mps(o.work)
    mps.start()
    try:
        if name in ("mps", "mps_capped"):
            # Both processes as MPS clients; the shim's rates do the sharing. `mps`: 100% threads each;
            # `mps_capped`: training's MPS client is also held to a fixed part of the SMs (--mps-capped).
            pct = (100, 100) if name == "mps" else o.mps_capped
            out["mps_percentages"] = {INF: pct[0], TRAIN: pct[1]}
            dyn = [f"dynamic@{v}" if v != "default" else "dynamic" for v in o.variants]
            bursts = [f"burst@{v}" if v != "default" else "burst" for v in o.variants]
            caps = [f"static@{c:g}" for c in o.static_caps] if name == "mps" else []
            # Inference alone as an MPS client (training's client idle) in every MPS step: how much of the
            # co-located p99 is MPS itself, not training. The SLO stays 2 × the time-sliced solo p99.
            plan = ["calibrate", "solo_inference", "none", *caps, *dyn, *bursts]
            await run_suite(o, out, save, "mps" if name == "mps" else "mpsc", plan, mps.env, ref, percentages=pct)
        elif name == "mps_static":
            # Static MPS splits (no shim limits): the (b); the first is also `static_mps_split`.
            out["static_mps_splits"] = {}
            for split in o.mps_splits:
                plan = ["none"] if ref.get("rps") else ["calibrate", "none"]
                await run_suite(o, out, save, "mpss", plan, mps.env, ref, percentages=split)
                sc = out.pop("none", None)
                if isinstance(sc, dict):
                    sc["mps_percentages"] = {INF: split[0], TRAIN: split[1]}
                out["static_mps_splits"][f"{split[0]}/{split[1]}"] = sc
                out.setdefault("static_mps_split", sc)
                save()
        else:
            raise ValueError(name)
    finally:
        mps.quit()


STEPS = ("timeslice", "mps", "mps_capped", "mps_static")


def vertical_config(pairs: list[str], base: SloConfig | None = None) -> SloConfig:
    """``key=value`` overrides of the slo policy's knobs (`SloConfig`, each a number)."""
    base = base or SloConfig()
    fields = {f.name for f in dataclasses.fields(SloConfig)}
    overrides: dict[str, float] = {}
    for kv in pairs:
        k, _, v = kv.partition("=")
        if k not in fields:
            raise SystemExit(f"SloConfig has no field {k!r} (its knobs: {', '.join(sorted(fields))})")
        try:
            overrides[k] = float(v)
        except ValueError:
            raise SystemExit(f"{k}: {v!r} is not a number") from None
    try:
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


INFERENCE_SLO_MS = 100.0


def percent_pair(text: str, flag: str) -> tuple[int, int]:
    """``I,T``: MPS active-thread percentages of inference and training, each 1-100."""
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} wants two percentages I,T, got {text!r}") from None
    if not (1 <= a <= 100 and 1 <= b <= 100):
        raise SystemExit(f"{flag}: percentages must be within 1-100, got {text!r}")
    return a, b


def options(args: argparse.Namespace) -> Options:
    base = vertical_config(args.vertical or [])
    variants = {"default": base}
    for spec in args.variant or []:
        name, _, rest = spec.partition(":")
        variants[name] = vertical_config([kv for kv in rest.split(",") if kv], base)
    def pair(text: str, flag: str) -> tuple[float, float]:
        values = tuple(float(x) for x in text.split(","))
        if len(values) != 2:
            raise SystemExit(f"{flag} takes two numbers separated by a comma")
        return values[0], values[1]

    static = pair(args.static, "--static")
    return Options(
        work=Path(args.work), results=Path(args.results), load=args.load, arrivals=args.arrivals, burst_base=args.burst_base,
        burst_mult=args.burst_mult, seconds=args.seconds, period_ms=args.period_ms,
        static=static, inference_share=pair(args.inference_share, "--inference-share"),
        training_share=pair(args.training_share, "--training-share"), gamma=args.gamma, vertical=base, variants=variants,
        static_caps=tuple(float(x) for x in args.static_caps.split(",") if x.strip()), manager_slo=args.manager_slo,
        mps_capped=percent_pair(args.mps_capped, "--mps-capped"),
        mps_splits=tuple(percent_pair(x, "--mps-splits") for x in args.mps_splits.split(":") if x.strip()),
        capacity=args.capacity, infer_batch=args.infer_batch, train_batch=args.train_batch,
        start_timeout=args.start_timeout, seed=args.seed,
    )


def cmd_step(args: argparse.Namespace) -> int:
    work, results = Path(args.work), Path(args.results)
    work.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=args.log, level=logging.INFO,
                        format="[%(asctime)s] %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if REAL_STRUCTLOG:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
                            logger_factory=structlog.stdlib.LoggerFactory())
    # Mode changes are in the results' timelines; the log keeps warnings from the manager.
    logging.getLogger("dilu_invoker.gpu.manager").setLevel(logging.WARNING)
    out: dict[str, Any] = {"scale": SCALE}
    t0 = time.monotonic()
    path = results / f"{args.name}.json"

    def save() -> None:
        out["step_seconds"] = round(time.monotonic() - t0, 1)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str))
        tmp.replace(path)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"killed by signal {signum} (step time limit)")

    signal.signal(signal.SIGTERM, on_term)
    log.info("step %s begins (scale %s)", args.name, SCALE)
    try:
        o = options(args)
        out["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(o).items()}
        asyncio.run(step(args.name, o, out, save))
    except BaseException as e:  # noqa: BLE001 - the step's result must be written whatever happened
        out["error"] = str(e) if isinstance(e, SystemExit) else traceback.format_exc()
        log.error("step %s stopped: %s", args.name, out["error"])
    save()
    log.info("step %s done in %s s", args.name, out["step_seconds"])
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    results = Path(args.results)
    steps: dict[str, Any] = {}
    chosen = args.steps.split() if args.steps else STEPS
    for name in STEPS:
        p = results / f"{name}.json"
        try:
            steps[name] = json.loads(p.read_text())
        except FileNotFoundError:
            if name in chosen:
                steps[name] = {"error": "step did not run or was killed (see vertical_log.txt)"}
        except (OSError, json.JSONDecodeError) as e:
            steps[name] = {"error": f"unreadable result: {e}"}
    machine = Path(args.machine).read_text() if args.machine and Path(args.machine).exists() else ""
    doc = {
        "schema": 1,
        "dry_run": os.environ.get("DILU_BENCH_DRY_RUN") == "1",
        "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": args.command,
        "scale": SCALE,
        "machine": machine,
        "steps": steps,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step")
    s.add_argument("name", choices=STEPS)
    s.add_argument("--work", required=True)
    s.add_argument("--results", required=True)
    s.add_argument("--log", required=True)
    s.add_argument("--load", type=float, default=0.5, help="steady load, fraction of closed-loop capacity")
    s.add_argument("--arrivals", choices=PROCESSES, default="paced",
                   help="arrival process of every open-loop run: paced (evenly spaced, the issue's anchor) or poisson")
    s.add_argument("--burst-base", type=float, default=0.1,
                   help="load before and after the burst (5x: up to the steady load, which inference alone keeps up with)")
    s.add_argument("--burst-mult", type=float, default=5.0, help="arrival rate multiplier of the burst")
    s.add_argument("--seconds", type=float, default=5.0, help="length of each steady run")
    s.add_argument("--period-ms", type=float, default=50.0, help="manager period")
    s.add_argument("--static", default="0.7,0.3", help="static shim shares inference,training")
    s.add_argument("--static-caps", default="",
                   help="MPS step: training rate caps to run beside uncapped inference (comma-separated, e.g. 0.5,0.75)")
    s.add_argument("--mps-capped", default="100,70",
                   help="MPS thread percentages inference,training of the mps_capped step (shim rates on top)")
    s.add_argument("--mps-splits", default="50,50",
                   help="static MPS splits of the mps_static step, inference,training; several separated by ':' (50,50:30,70)")
    s.add_argument("--manager-slo", choices=("solo", "fixed"), default="solo",
                   help="the inference SLO the manager is given: 2 x the measured solo p99 (the SLO the results are "
                        "judged by) once it is known, or a fixed 100 ms annotation throughout")
    s.add_argument("--inference-share", default="0.5,1.0", help="inference request,limit")
    s.add_argument("--training-share", default="0.2,1.0", help="training request,limit")
    s.add_argument("--gamma", type=float, default=2.0, help="the node's bound on Σ limit (the default limits sum to 2.0)")
    s.add_argument("--vertical", action="append",
                   help="override of one of the slo policy's knobs (SloConfig), key=value (repeatable)")
    s.add_argument("--variant", action="append",
                   help="extra slo policy variant name:key=value,key=value, run beside the defaults (dynamic and "
                        "burst run once per variant)")
    s.add_argument("--capacity", choices=("measured", "estimated"), default="measured",
                   help="capacities from the solo calibration (as the profiler would), or the online estimate")
    s.add_argument("--infer-batch", type=int, default=8)
    s.add_argument("--train-batch", type=int, default=64)
    s.add_argument("--start-timeout", type=float, default=150.0)
    s.add_argument("--seed", type=int, default=7)
    m = sub.add_parser("merge")
    m.add_argument("--results", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--machine")
    m.add_argument("--command", default="bench/vertical/run_h200.sh")
    m.add_argument("--steps", default="", help="the steps that were run (default: all); others are left out")
    args = ap.parse_args()
    return cmd_step(args) if args.cmd == "step" else cmd_merge(args)


if __name__ == "__main__":
    sys.exit(main())
