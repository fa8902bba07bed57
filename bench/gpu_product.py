"""GPU sharing through the product: `dilu-invoker standalone`, actions created over the REST API exactly as
`wsk` creates them, real torch models with random weights, measured from the client.

    python3 bench/gpu_product.py [--modes noshim,shim,mps50] [--pairs resnet50+train,bert+train]
        [--scenarios cold,solo,share,paced,poisson,burst,idle] [--loads 0.5,0.7] [--seconds 6] [--trials 1]
        [--out docs/benchmarks/data/gpu_product.json] [--report docs/benchmarks/gpu-product.md] [--dry-run]

Modes (each a fresh standalone per model pair and trial, side by side in one run):

* ``noshim``: no control: the shim is not loaded (``--gpu-shim-path`` to nothing) and ``--gpu-mps off``;
  the GPU time-slices between the processes.
* ``shim``: the defaults: the shim, the vertical manager, ``--gpu-mps auto``; annotations are a class, a
  request and a limit only (inference 0.5 / 0.8, training 0.3 / 0.7), no capacity profile.
* ``mps50``: static MPS 50/50: ``--gpu-mps on``, no shim, both actions at limit 0.5 (50% active threads).

Scenarios per mode and pair (training is ResNet-50 fp16 AMP batch 32; inference is batch 8 fp16):

* ``cold``: first invoke of each action (client-side, container start + init + first run).
* ``solo``: inference alone, closed loop: p50/p99, capacity in requests/s; training alone: it/s.
* ``share`` (``shim`` mode only): inference alone at limit 0.5 and at 0.8 (extra actions) against the
  unlimited solo — the "never slowed more than 1/s" target.
* ``paced``/``poisson``: inference at each load (fraction of its solo capacity) with fixed or exponential
  inter-arrival times, beside training.
* ``burst``: inference at 0.2 of capacity, 5x that for 2 s, then 0.2 again, beside training.
* ``idle``: training with the inference instance warm and idle (after the other scenarios).

Measured: client latency p50/p99 per scenario and per second, in-action GPU time (CUDA events) and run
time, training it/s over each scenario's window, SLO violations (SLO = 2x the solo p99 of the ``noshim``
mode, the unlimited reference, else the mode's own), cold-start times, and the share/rate/capacity trace
from the invoker's /metrics (every 0.25 s). ``--dry-run`` runs everything with sleep-based stand-ins for
the models (no torch, no GPU), to check the harness on any machine.

Issue 17 reuses this as its workload matrix: ``--pairs``, ``--loads``, ``--modes``, ``--trials`` and
``--scenarios`` select the cells; the JSON keeps every trial.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
GUEST = "23bc46b1-71f6-4ed5-8c54-816aa4f8c502:123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP"

# -- the actions' code (what a user would write) ------------------------------------------------------------

INFER_CODE = r'''
import time
DRY = False
try:
    import torch
except ImportError:
    torch = None
_model = None
_make = None

def _build(name, batch):
    global _model, _make
    dev = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    if name == "resnet50":
        import torchvision
        _model = torchvision.models.resnet50(weights=None).eval().half().to(dev)
        _make = lambda: torch.randn(batch, 3, 224, 224, dtype=torch.half, device=dev)
    else:
        from transformers import BertConfig, BertModel
        _model = BertModel(BertConfig()).eval().half().to(dev)
        _make = lambda: torch.randint(0, 30000, (batch, 128), device=dev)

def main(args):
    t0 = time.perf_counter()
    if args.get("dry") or torch is None:
        time.sleep(float(args.get("dry_ms", 5)) / 1000)
        ms = (time.perf_counter() - t0) * 1000
        return {"gpu_ms": ms, "run_ms": ms}
    if _model is None:
        _build(args.get("model", "resnet50"), int(args.get("batch", 8)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        x = _make()
        start.record()
        out = _model(x)
        if not isinstance(out, torch.Tensor):
            out = out.last_hidden_state
        end.record()
        out.float().sum().item()
    return {"gpu_ms": start.elapsed_time(end), "run_ms": (time.perf_counter() - t0) * 1000}
'''

TRAIN_CODE = r'''
import time
try:
    import torch
except ImportError:
    torch = None
_state = {}

def main(args):
    seconds = float(args.get("seconds", 5))
    dry = bool(args.get("dry")) or torch is None
    stamps = []
    if dry:
        end = time.time() + seconds
        while time.time() < end:
            time.sleep(float(args.get("dry_ms", 20)) / 1000)
            stamps.append(time.time())
        return {"stamps": stamps}
    if not _state:
        import torchvision
        model = torchvision.models.resnet50(weights=None).cuda()
        _state["m"] = model
        _state["opt"] = torch.optim.SGD(model.parameters(), lr=0.01)
        _state["scaler"] = torch.amp.GradScaler("cuda")
        b = int(args.get("batch", 32))
        _state["x"] = torch.randn(b, 3, 224, 224, device="cuda")
        _state["y"] = torch.randint(0, 1000, (b,), device="cuda")
    m, opt, scaler, x, y = _state["m"], _state["opt"], _state["scaler"], _state["x"], _state["y"]
    end = time.time() + seconds
    while time.time() < end:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        torch.cuda.synchronize()
        stamps.append(time.time())
    return {"stamps": stamps}
'''

MODES: dict[str, dict[str, Any]] = {
    "noshim": {"flags": ["--gpu-shim-path", "/nonexistent/libdilu_shim.so", "--gpu-mps", "off"],
               "infer": (0.5, 0.8), "train": (0.3, 0.7), "what": "no shim, time-slicing (no control)"},
    "shim": {"flags": [], "infer": (0.5, 0.8), "train": (0.3, 0.7),
             "what": "the defaults: shim + vertical manager, --gpu-mps auto"},
    "shim-ts": {"flags": ["--gpu-mps", "off"], "infer": (0.5, 0.8), "train": (0.3, 0.7),
                "what": "shim + vertical manager, time-slicing (--gpu-mps off)"},
    "mps50": {"flags": ["--gpu-shim-path", "/nonexistent/libdilu_shim.so", "--gpu-mps", "on"],
              "infer": (0.5, 0.5), "train": (0.5, 0.5), "what": "static MPS 50/50 (no shim)"},
}
PAIRS = {"resnet50+train": "resnet50", "bert+train": "bert"}


# -- small helpers ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rnd(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(x, n)


@dataclass
class Sample:
    sent: float  # wall clock
    latency_ms: float
    ok: bool
    gpu_ms: float | None = None
    run_ms: float | None = None


@dataclass
class Trace:
    rows: list[tuple[float, str, str, float]] = field(default_factory=list)


METRIC_RE = re.compile(r'^(openwhisk_action_gpu_sm_quota_ratio|dilu_gpu_rate_blocks_per_ms|'
                       r'dilu_gpu_capacity_blocks_per_ms|dilu_gpu_mps_enabled|dilu_gpu_vertical_mode)\{([^}]*)\} (\S+)$')


# -- one standalone ------------------------------------------------------------------------------------------


class Stack:
    """A standalone server of one mode, its actions, and a client session."""

    def __init__(self, args: argparse.Namespace, mode: str, work: Path, extra: tuple[str, ...] = ()) -> None:
        self.args, self.mode, self.work, self.extra = args, mode, work, extra
        self.api_port, self.inv_port = free_port(), free_port()
        self.api = f"http://127.0.0.1:{self.api_port}/api/v1/namespaces/_/actions"
        user, key = GUEST.split(":")
        self.auth = aiohttp.BasicAuth(user, key)  # what wsk sends
        self.proc: subprocess.Popen[bytes] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.trace = Trace()
        self._trace_task: asyncio.Task[None] | None = None
        self.log_path = work / f"standalone-{mode}.log"
        work.mkdir(parents=True, exist_ok=True)

    async def __aenter__(self) -> Stack:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "DILU_LOG_LEVEL": "info", "PYTHONUNBUFFERED": "1"}
        env.pop("LD_PRELOAD", None)
        cmd = [sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir", str(self.work / "data"),
               "--api-port", str(self.api_port), "--invoker-port", str(self.inv_port),
               "--invoker-user-memory-mb", "200000", "--gpu-shm-dir", str(self.work / "shm"),
               "--gpu-mps-dir", str(self.work / "mps"), *MODES[self.mode]["flags"], *self.extra]
        if self.args.dry_run:  # no GPU: no MPS daemon to start
            cmd = [("off" if prev == "--gpu-mps" else c) for prev, c in zip(["", *cmd[:-1]], cmd, strict=True)]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=300))
        deadline = time.monotonic() + 60
        while True:
            try:
                async with self.session.get(f"http://127.0.0.1:{self.api_port}/api/v1") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"standalone ({self.mode}) did not come up; see {self.log_path}")
            await asyncio.sleep(0.1)
        self._trace_task = asyncio.create_task(self._poll_metrics())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._trace_task is not None:
            self._trace_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._trace_task
        if self.session is not None:
            await self.session.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await asyncio.to_thread(self.proc.wait, 10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.proc is not None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything left of its tree
        self.log.close()

    async def _poll_metrics(self) -> None:
        assert self.session is not None
        url = f"http://127.0.0.1:{self.inv_port}/metrics"
        while True:
            try:
                async with self.session.get(url) as r:
                    text = await r.text()
                now = time.time()
                for line in text.splitlines():
                    m = METRIC_RE.match(line)
                    if m:
                        labels = dict(kv.split("=", 1) for kv in re.findall(r'\w+="[^"]*"', m.group(2)))
                        who = labels.get("action", labels.get("mode", labels.get("reason", ""))).strip('"')
                        self.trace.rows.append((now, m.group(1), who, float(m.group(3))))
            except (aiohttp.ClientError, ValueError):
                pass
            await asyncio.sleep(0.25)

    async def create(self, name: str, code: str, cls: str, request: float, limit: float) -> None:
        assert self.session is not None
        body = {"exec": {"kind": "python:3-gpu", "code": code},
                "annotations": [{"key": "gpu-class", "value": cls}, {"key": "gpu-sm-request", "value": request},
                                {"key": "gpu-sm-limit", "value": limit}, {"key": "gpu-memory-mb", "value": 16384}],
                "limits": {"timeout": 300000, "memory": 8192}}
        async with self.session.put(f"{self.api}/{name}?overwrite=true", auth=self.auth, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"PUT {name}: {r.status} {await r.text()}")

    async def invoke(self, name: str, params: dict[str, Any]) -> tuple[float, dict[str, Any] | None, int]:
        assert self.session is not None
        t = time.perf_counter()
        async with self.session.post(f"{self.api}/{name}?blocking=true&result=true", auth=self.auth,
                                     json=params) as r:
            text = await r.text()
            status = r.status
        ms = (time.perf_counter() - t) * 1000
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        return ms, data if isinstance(data, dict) else None, status


# -- load generators ----------------------------------------------------------------------------------------


async def one(stack: Stack, name: str, params: dict[str, Any], out: list[Sample]) -> None:
    sent = time.time()
    ms, data, status = await stack.invoke(name, params)
    ok = status == 200 and data is not None and "gpu_ms" in data
    out.append(Sample(sent, ms, ok, data.get("gpu_ms") if ok and data else None,
                      data.get("run_ms") if ok and data else None))


async def closed_loop(stack: Stack, name: str, params: dict[str, Any], seconds: float) -> list[Sample]:
    out: list[Sample] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await one(stack, name, params, out)
    return out


async def open_loop(stack: Stack, name: str, params: dict[str, Any], rates: list[tuple[float, float]],
                    poisson: bool, rng: random.Random) -> list[Sample]:
    """``rates``: (seconds, requests/s) segments; arrivals paced or Poisson; never waits for answers."""
    out: list[Sample] = []
    tasks: list[asyncio.Task[None]] = []
    t = time.monotonic()
    for seconds, rate in rates:
        end = t + seconds
        while True:
            gap = rng.expovariate(rate) if poisson else 1.0 / rate
            t += gap
            if t >= end:
                t = end
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.create_task(one(stack, name, params, out)))
    await asyncio.gather(*tasks)
    return out


def summarize(samples: list[Sample], slo_ms: float | None) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    lat = [s.latency_ms for s in ok]
    res: dict[str, Any] = {
        "requests": len(samples), "failed": len(samples) - len(ok),
        "p50_ms": rnd(pct(lat, 0.5)), "p99_ms": rnd(pct(lat, 0.99)), "mean_ms": rnd(statistics.fmean(lat)) if lat else None,
        "gpu_p50_ms": rnd(pct([s.gpu_ms for s in ok if s.gpu_ms is not None], 0.5)),
        "run_p50_ms": rnd(pct([s.run_ms for s in ok if s.run_ms is not None], 0.5)),
    }
    if res["p50_ms"] is not None and res["run_p50_ms"] is not None:
        res["overhead_p50_ms"] = rnd(res["p50_ms"] - res["run_p50_ms"])
    if slo_ms:
        res["slo_ms"] = rnd(slo_ms)
        res["slo_violations"] = rnd(sum(1 for s in samples if not s.ok or s.latency_ms > slo_ms) / max(1, len(samples)), 4)
    if ok:
        t0 = min(s.sent for s in ok)
        per: dict[int, list[float]] = {}
        for s in ok:
            per.setdefault(int(s.sent - t0), []).append(s.latency_ms)
        res["per_second"] = [{"s": k, "n": len(v), "p50_ms": rnd(pct(v, 0.5)), "p99_ms": rnd(pct(v, 0.99))}
                             for k, v in sorted(per.items())]
    return res


def train_rate(stamps: list[float], t0: float, t1: float) -> float | None:
    inside = [s for s in stamps if t0 <= s <= t1]
    if len(inside) < 2:
        return None
    return (len(inside) - 1) / (inside[-1] - inside[0])


# -- one (mode, pair, trial) ----------------------------------------------------------------------------------


async def run_cell(args: argparse.Namespace, mode: str, pair: str, trial: int, ref: dict[str, Any]) -> dict[str, Any]:
    model = PAIRS[pair]
    work = Path(tempfile.mkdtemp(prefix=f"dilu-gpu-product-{mode}-"))
    rng = random.Random(1000 * trial + 7)
    spec = MODES[mode]
    dry = {"dry": True} if args.dry_run else {}
    iparams = {"model": model, "batch": 8, **dry}
    cell: dict[str, Any] = {"mode": mode, "what": spec["what"], "pair": pair, "trial": trial, "scenarios": {},
                            "annotations": {"inference": spec["infer"], "training": spec["train"]}}
    t_start = time.time()
    async with Stack(args, mode, work) as st:
        await st.create("infer", INFER_CODE, "inference", *spec["infer"])
        await st.create("train", TRAIN_CODE, "training", *spec["train"])
        want = set(args.scenarios)
        # Cold starts: training first (its solo run is then without the inference instance), then inference.
        ms, data, status = await st.invoke("train", {"seconds": 0.0, **dry})
        cell["cold_start_ms"] = {"train": rnd(ms)}
        if status != 200:
            raise RuntimeError(f"{mode}: training cold start answered {status}: {data}")
        tr = await st.invoke("train", {"seconds": args.seconds, **dry})
        stamps = (tr[1] or {}).get("stamps", [])
        solo_train = train_rate(stamps, stamps[0] if stamps else 0, stamps[-1] if stamps else 0) if stamps else None
        cell["solo_train_it_s"] = rnd(solo_train)
        ms, data, status = await st.invoke("infer", iparams)
        cell["cold_start_ms"]["infer"] = rnd(ms)
        if status != 200:
            raise RuntimeError(f"{mode}: inference cold start answered {status}: {data}")
        await closed_loop(st, "infer", iparams, 1.0)  # warm-up (and, without a profile, capacity learning)
        solo = await closed_loop(st, "infer", iparams, args.seconds)
        solo_ok = [s.latency_ms for s in solo if s.ok]
        own_p99 = pct(solo_ok, 0.99)
        ref_p99 = ref.get(pair)
        slo = 2 * (ref_p99 if ref_p99 else own_p99 or 0) or None
        capacity_rps = len(solo_ok) / args.seconds
        cell["solo"] = summarize(solo, slo)
        cell["capacity_rps"] = rnd(capacity_rps)
        cell["slo_ms"] = rnd(slo)
        if mode == "noshim" and own_p99:
            ref[pair] = own_p99

        async def beside_training(name: str, rates: list[tuple[float, float]], poisson: bool) -> None:
            total = sum(s for s, _ in rates)
            train_task = asyncio.create_task(st.invoke("train", {"seconds": total + 2.0, **dry}))
            await asyncio.sleep(1.0)  # training runs before inference starts
            t0 = time.time()
            samples = await open_loop(st, "infer", iparams, rates, poisson, rng)
            t1 = time.time()
            _, tdata, _ = await train_task
            res = summarize(samples, slo)
            rate = train_rate((tdata or {}).get("stamps", []), t0, t1)
            res["train_it_s"] = rnd(rate)
            res["train_vs_solo"] = rnd(rate / solo_train, 3) if rate and solo_train else None
            res["p99_vs_solo"] = rnd(res["p99_ms"] / own_p99, 3) if res["p99_ms"] and own_p99 else None
            res["window"] = [t0, t1]
            cell["scenarios"][name] = res

        for load in args.loads:
            if "paced" in want:
                await beside_training(f"paced@{load:g}", [(args.seconds, load * capacity_rps)], False)
            if "poisson" in want:
                await beside_training(f"poisson@{load:g}", [(args.seconds, load * capacity_rps)], True)
        if "burst" in want:
            base = 0.2 * capacity_rps
            await beside_training("burst", [(args.seconds / 2, base), (2.0, 5 * base), (args.seconds / 2, base)], False)
        if "idle" in want:
            t0 = time.time()
            _, tdata, _ = await st.invoke("train", {"seconds": args.seconds, **dry})
            stamps = (tdata or {}).get("stamps", [])
            rate = train_rate(stamps, stamps[0], stamps[-1]) if stamps else None
            cell["scenarios"]["idle"] = {"train_it_s": rnd(rate),
                                         "train_vs_solo": rnd(rate / solo_train, 3) if rate and solo_train else None,
                                         "window": [t0, time.time()]}
        if mode == "noshim" and solo_ok:
            ref[f"{pair}:p50"] = pct(solo_ok, 0.5)
        cell["trace"] = [(round(t - t_start, 3), m, w, v) for t, m, w, v in st.trace.rows]
    if "share" in want and mode.startswith("shim"):
        # A stack of its own: beside the pair's instances the extra ones would not fit the GPU's budget. They
        # run one after the other, never together: γ 3 lets all three limits be placed on the one GPU.
        async with Stack(args, mode, work / "share", ("--gpu-gamma", "3.0")) as sh:
            for share in (0.5, 0.8, 1.0):
                name = f"infer-s{int(share * 100)}"
                await sh.create(name, INFER_CODE, "inference", 0.3, share)
                ms, _, status = await sh.invoke(name, iparams)
                await closed_loop(sh, name, iparams, 1.0)
                s = await closed_loop(sh, name, iparams, args.seconds)
                res = summarize(s, slo)
                unl = ref.get(f"{pair}:p50") or pct(solo_ok, 0.5)
                res["cold_start_ms"] = rnd(ms)
                res["p50_vs_unlimited"] = rnd(res["p50_ms"] / unl, 3) if res["p50_ms"] and unl else None
                res["p99_vs_unlimited"] = (rnd(res["p99_ms"] / ref[f"{pair}"], 3)
                                           if res["p99_ms"] and ref.get(pair) else None)
                res["target_p50_ms"] = rnd(unl / share * 1.1) if unl else None
                cell["scenarios"][f"share@{share:g}"] = res
            cell["share_trace"] = [(round(t - t_start, 3), m, w, v) for t, m, w, v in sh.trace.rows]
    log_text = st.log_path.read_text(errors="replace")
    cell["log_lines"] = log_text.count("\n")
    events: dict[str, int] = {}
    levels: dict[str, int] = {}
    for line in log_text.splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict):
                key = f"{rec.get('level', '?')}: {str(rec.get('event', '?'))[:80]}"
                events[key] = events.get(key, 0) + 1
                levels[str(rec.get("level", "?"))] = levels.get(str(rec.get("level", "?")), 0) + 1
    cell["log_levels"] = levels
    cell["log_info_lines"] = levels.get("info", 0)
    cell["log_events"] = dict(sorted(events.items(), key=lambda kv: -kv[1])[:20])
    cell["log_tail"] = log_text.splitlines()[-15:]
    cell["log_mode_lines"] = [line[:300] for line in log_text.splitlines()
                              if "GPU sharing mode" in line or "capacity learnt" in line][:10]
    cell["wall_s"] = rnd(time.time() - t_start, 1)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return cell


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    with contextlib.suppress(Exception):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_mode",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["gpu"] = r.stdout.strip()
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
    return info


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    doc: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv), "dry_run": args.dry_run,
                           "seconds": args.seconds, "loads": args.loads, "cells": [], "errors": []}
    ref: dict[str, Any] = {}
    modes = sorted(args.modes, key=lambda m: m != "noshim")  # the unlimited reference first
    for trial in range(args.trials):
        for pair in args.pairs:
            for mode in modes:
                print(f"== {mode} {pair} trial {trial}", flush=True)
                try:
                    cell = await run_cell(args, mode, pair, trial, ref)
                except Exception as exc:  # noqa: BLE001 - one broken cell must not lose the others
                    doc["errors"].append({"mode": mode, "pair": pair, "trial": trial, "error": repr(exc)})
                    print(f"   failed: {exc!r}", flush=True)
                    continue
                doc["cells"].append(cell)
                brief = {k: cell["scenarios"][k].get("p99_ms") for k in cell["scenarios"]}
                print(f"   solo p50 {cell['solo']['p50_ms']} p99 {cell['solo']['p99_ms']} ms, train "
                      f"{cell['solo_train_it_s']} it/s, cold {cell['cold_start_ms']}, p99s {brief}", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


# -- the report -----------------------------------------------------------------------------------------------


def f(x: Any, suffix: str = "") -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.3g}{suffix}" if abs(x) < 1000 else f"{x:.0f}{suffix}"
    return f"{x}{suffix}"


def report(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = ["# GPU sharing through the product", "",
             "Produced by `bench/gpu_product.py` (see its docstring for the modes and scenarios).", "",
             f"* machine: {m.get('gpu', 'no GPU')}; {m.get('cpus')} CPUs; Python {m.get('python')}; "
             f"torch {m.get('torch', '–')}; {m.get('platform')}",
             f"* command: `{doc['command']}`",
             f"* scenario length {doc['seconds']} s; loads {doc['loads']} of inference's solo closed-loop capacity"]
    if doc.get("dry_run"):
        lines.append("* **dry run**: sleep-based stand-ins for the models, no GPU — checks the harness only")
    for err in doc.get("errors", []):
        lines.append(f"* **failed**: {err['mode']} {err['pair']} trial {err['trial']}: `{err['error'][:300]}`")
    cells = doc["cells"]
    for pair in dict.fromkeys(c["pair"] for c in cells):
        mine = [c for c in cells if c["pair"] == pair]
        lines += ["", f"## {pair}", "",
                  "| mode | what | cold start infer / train (ms) | solo p50 / p99 (ms) | in-action GPU / run p50 (ms) "
                  "| overhead p50 (ms) | capacity (req/s) | solo training (it/s) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c in mine:
            s = c["solo"]
            lines.append(f"| {c['mode']} (trial {c['trial']}) | {c['what']} | {f(c['cold_start_ms'].get('infer'))} / "
                         f"{f(c['cold_start_ms'].get('train'))} | {f(s['p50_ms'])} / {f(s['p99_ms'])} | "
                         f"{f(s.get('gpu_p50_ms'))} / {f(s.get('run_p50_ms'))} | {f(s.get('overhead_p50_ms'))} | "
                         f"{f(c['capacity_rps'])} | {f(c['solo_train_it_s'])} |")
        names = list(dict.fromkeys(k for c in mine for k in c["scenarios"]))
        lines += ["", "| scenario | mode | p50 (ms) | p99 (ms) | p99 / solo | SLO (ms) | violations | failed | "
                      "training it/s | training / solo |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name in names:
            for c in mine:
                r = c["scenarios"].get(name)
                if r is None:
                    continue
                viol = r.get("slo_violations")
                lines.append(f"| {name} | {c['mode']} | {f(r.get('p50_ms'))} | {f(r.get('p99_ms'))} | "
                             f"{f(r.get('p99_vs_solo'), 'x')} | {f(r.get('slo_ms'))} | "
                             f"{f(round(viol * 100, 2) if viol is not None else None, '%')} | {f(r.get('failed'))} | "
                             f"{f(r.get('train_it_s'))} | {f(r.get('train_vs_solo'))} |")
        shares = [(c, k, r) for c in mine for k, r in c["scenarios"].items() if k.startswith("share@")]
        if shares:
            lines += ["", "Solo inference at a fixed limit (the shim's defaults, no capacity profile) against the "
                          "unlimited solo p50 of `noshim`:", "",
                      "| limit | mode | p50 (ms) | p99 (ms) | p50 / unlimited | p99 / unlimited p99 | "
                      "target p50 ≤ (1/s) × unlimited + 10% (ms) |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for c, k, r in shares:
                lines.append(f"| {k.split('@')[1]} | {c['mode']} | {f(r.get('p50_ms'))} | {f(r.get('p99_ms'))} | "
                             f"{f(r.get('p50_vs_unlimited'), 'x')} | {f(r.get('p99_vs_unlimited'), 'x')} | "
                             f"{f(r.get('target_p50_ms'))} |")
        lines += ["", "Share trace (from /metrics every 0.25 s): min / median / max SM share in force per action, "
                      "and the last capacity estimate:", ""]
        for c in mine:
            per: dict[str, list[float]] = {}
            cap: dict[str, float] = {}
            for _t, metric, who, v in c.get("trace", []):
                if metric == "openwhisk_action_gpu_sm_quota_ratio":
                    per.setdefault(who, []).append(v)
                elif metric == "dilu_gpu_capacity_blocks_per_ms" and v == v:
                    cap[who] = v
            if per:
                parts = [f"{w}: {min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f}"
                         + (f" (capacity {cap[w]:.0f} blocks/ms)" if w in cap else "") for w, v in per.items()]
                lines.append(f"* {c['mode']}: " + "; ".join(parts))
            else:
                lines.append(f"* {c['mode']}: no shares reported (no shim or no GPU)")
            lines.append(f"  log: {c.get('log_lines')} lines ({c.get('log_info_lines')} at info) in {c.get('wall_s')} s"
                         + ("; " + " | ".join(x[-160:] for x in c.get("log_mode_lines", [])[:2])
                            if c.get("log_mode_lines") else ""))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="noshim,shim,mps50")
    ap.add_argument("--pairs", default="resnet50+train,bert+train")
    ap.add_argument("--scenarios", default="cold,solo,share,paced,poisson,burst,idle")
    ap.add_argument("--loads", default="0.5,0.7")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks/data/gpu_product.json"))
    ap.add_argument("--report", default=None, help="write the markdown report here (e.g. docs/benchmarks/gpu-product.md)")
    ap.add_argument("--from-json", default=None, help="only render the report from a results file")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep each stack's work directory (logs, data)")
    args = ap.parse_args()
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
    else:
        args.modes = [m for m in args.modes.split(",") if m]
        bad = [m for m in args.modes if m not in MODES]
        if bad:
            ap.error(f"unknown modes {bad}; known: {list(MODES)}")
        args.pairs = [p for p in args.pairs.split(",") if p]
        if any(p not in PAIRS for p in args.pairs):
            ap.error(f"pairs must be among {list(PAIRS)}")
        args.scenarios = [s for s in args.scenarios.split(",") if s]
        args.loads = [float(x) for x in args.loads.split(",") if x]
        doc = asyncio.run(main_async(args))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=1))
    text = report(doc)
    if args.report:
        Path(args.report).write_text(text)
    print(text)
    return 0 if doc["cells"] else 1


if __name__ == "__main__":
    sys.exit(main())
