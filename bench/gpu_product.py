"""GPU sharing through the product: `dilu-invoker standalone`, actions created over the REST API exactly as
`wsk` creates them, real torch models with random weights, measured from the client.

    python3 bench/gpu_product.py [--modes noshim,shim,mps50] [--pairs resnet50+train,bert+train]
        [--scenarios cold,solo,share,paced,poisson,burst,idle] [--loads 0.5,0.7] [--seconds 6] [--trials 1]
        [--besides paced@0.5,poisson@0.3,bursty@0.7,burst] [--pair-modes 'bert+train=noshim,slo-ts']
        [--priority 'resnet50+train:noshim,slo-ts;...'] [--budget-s 500] [--deadline-s 500] [--plan-only]
        [--out docs/benchmarks/data/gpu_product.json] [--report R.md] [--matrix docs/benchmarks/gpu-product.md]
        [--from-json A.json.gz,B.json.gz] [--dry-run]

Modes (each a fresh standalone per model pair and trial, side by side in one run; `MODES` below has the
flags). Simple baselines: ``noshim`` (no shim, time-slicing: no control), ``mps50`` / ``mps70`` (static MPS
splits 50/50 and inference 70 / training 30 active threads, no shim), ``static30`` (the shim with the
``static`` policy: inference at 0.7, training at 0.3, time-slicing). The product's static default under MPS:
``spatial`` (the shim loaded but no token caps; MPS thread caps fixed at each client's start, MPS on).
Controllers: ``shim`` (the defaults as they are: ``--gpu-vertical-policy auto``, ``--gpu-mps auto``, process
isolation auto — on an MPS-capable GPU that is MPS and so ``spatial``; where auto picks time-slicing, slo),
``shim-lc50`` (the defaults with ``--gpu-vertical-spatial-lc-threads 0.5``: latency-critical MPS caps at
max(request, 0.5), where training's cap starts), ``shim-be`` (the defaults with
``--gpu-vertical-spatial-be-threads 1.0``: best-effort MPS caps up to their limit, inside the reserve, relying
on their below-normal priority), ``shim-noprio`` (the defaults without the best-effort MPS
priority), ``slo`` / ``slo-ts`` (the SLO controller under MPS / time-slicing). ``shim-mps`` / ``shim-ts`` are
the same as ``slo`` / ``slo-ts`` now, flags and annotations alike: they pinned the policy slo replaced
(docs/policies.md §1.2), and keep their names so that plans and past results still read. MPS modes pass
``--gpu-mps on`` with isolation on, as the defaults run: the MPS clients of a GPU share a uid, kept apart by
namespaces. Every cell records what the invoker actually ran
(``effective``: MPS or not and why, the policy, the shim) from its log and /metrics. Actions declare
``limits.memory`` 8192 MB (a GPU process with torch needs far more than the 256 MB default).

Pairs (``--pairs``): ``resnet50+train`` and ``bert+train`` (ResNet-50 or BERT-base inference beside ResNet-50
training), ``resnet50+membw`` (ResNet-50 inference beside a memory-bandwidth-bound best-effort job: large
device-to-device copies; issue 17's interference that an SM share cannot fix).

Scenarios per mode, pair and trial (training is ResNet-50 fp16 AMP batch 32; inference is batch 8 fp16):

* ``cold``: first invoke of both actions, at once (client-side: container start + init + first run).
* ``solo``: training alone (inference idle): it/s; inference alone, closed loop: p50/p99, capacity.
* ``share`` (controller modes only): inference alone at limit 0.5, 0.8 and 1.0 (extra actions) against
  the unlimited solo — the "never slowed more than 1/s" target.
* beside training, one training invocation for a group of them: ``<arrival>@<load>`` — arrivals ``paced``,
  ``poisson`` or ``bursty`` (a Markov-modulated Poisson process: 2x the mean rate in the first quarter of
  each second) at a fraction of the ``noshim`` solo capacity of the same trial (so every mode serves the
  same arrivals); ``burst``: 0.2 of capacity, 5x that for 2 s, 0.2 again (``burst@0.15``: a base of 0.15, a
  peak of 0.75). ``--besides`` lists them explicitly, else ``--arrivals`` (default: those named in
  ``--scenarios``) x ``--loads`` and ``burst``.
* ``alone``: each burst first against the inference instance alone (training idle; ``<burst> alone``): the
  reference that says whether the burst is within one instance's capacity at all.
* ``idle``: training with the inference instance warm and idle (after the other scenarios).

Measured: client latency p50/p99 per scenario and per second, in-action GPU time (CUDA events) and run
time, training it/s over each scenario's window (against its own solo and the ``noshim`` solo of the
trial), SLO violations (SLO = 2x the solo p99 of ``noshim`` in the same trial, else the mode's own),
cold-start times, the share/rate/capacity trace from the invoker's /metrics (every 0.25 s).

The matrix (issue 17): ``--trials`` fresh stacks per (pair, mode), trial by trial so that a run cut short
still has every column. The plan is printed first with its estimate (seconds measured on the H200 per stack,
`stack_estimate_s`); ``--budget-s`` leaves out whole (pair, mode) columns, least important first
(``--priority``), so that each column that runs has all its trials; ``--deadline-s`` skips a stack that would
end past it. The raw JSON is rewritten after every stack. ``--matrix PAGE`` writes the side-by-side tables
(median and worst over trials, the strongest static baseline per scenario and each controller's ratios to
it, the static modes that dominate a controller, issue 17's cell targets) into the generated block of PAGE;
``--from-json`` renders them again from raw files. `bench/h200_product.sh matrix OUT [1|2]` is the run sized
for one device call of 10 minutes.

``--dry-run`` runs everything without a GPU or torch: a simulated GPU (``--gpu-inventory``), the fake MPS
control binary of the tests, and actions that launch through the fake libcuda (`make -C cuda_shim test`
builds it; else they sleep) under the real shim, so shares, capacity learning and throttling act; it checks
the harness, not any speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from loadgen import invoke_result, put_gpu_action, stop_process_tree, wait_for_api

from dilu_invoker.sim.vertical_loop import PairModel, arrivals

FAKE_CUDA = ROOT / "cuda_shim/build/fake/libcuda.so.1"
FAKE_MPS = ROOT / "tests/gpu/fakes/nvidia-cuda-mps-control"
GUEST = "23bc46b1-71f6-4ed5-8c54-816aa4f8c502:123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP"

# -- the actions' code (what a user would write) ------------------------------------------------------------

#: the dry runs' launches through the fake libcuda, pasted into both actions' code (each is self-contained)
_FAKE_WORK = r'''
_cu = []

def _fake_work(args, blocks, step_sync=False):
    """Dry runs: launches through the fake libcuda (cuda_shim/tests/fake_libcuda.c) and a synchronize; the
    fake's timeline makes each block take FAKE_CUDA_BLOCK_NS, and the shim (if preloaded) admits them.
    ``step_sync``: a synchronize after each launch, so that launches spread over the step as a training
    loop's do on a GPU (the shim learns capacity only from periods whose launch windows are busy)."""
    if not _cu:
        import ctypes, os
        os.environ.setdefault("FAKE_CUDA_BLOCK_NS", str(int(args.get("block_ns", 1000))))
        lib = ctypes.CDLL(args["fake_cuda"], mode=ctypes.RTLD_GLOBAL)
        launch = lib.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        lib.cuInit(0)
        _cu.extend([launch, lib.cuCtxSynchronize])
    launch, sync = _cu
    for _ in range(8):
        launch(None, max(1, blocks // 8), 1, 1, 1, 1, 1, 0, 0x100, None, None)
        if step_sync:
            sync()
    sync()
'''

INFER_CODE = r'''
import time
DRY = False
try:
    import torch
except ImportError:
    torch = None
_model = None
_make = None

''' + _FAKE_WORK + r'''

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
        if args.get("fake_cuda"):  # the fake driver's timeline, under the shim when it is preloaded
            _fake_work(args, int(args.get("dry_blocks", 5000)))
        else:
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

#: The stack's floor on the same host: a CPU no-op (python:3) through the same standalone, closed loop.
NOOP_CODE = r'''
import time


def main(args):
    t0 = time.perf_counter()
    return {"gpu_ms": 0.0, "run_ms": (time.perf_counter() - t0) * 1000}
'''
NOOP_S = 1.0
NOOP_COLD_S = 1.5  # its cold start and warm-up

TRAIN_CODE = r'''
import time
try:
    import torch
except ImportError:
    torch = None
_state = {}

''' + _FAKE_WORK + r'''


def main(args):
    seconds = float(args.get("seconds", 5))
    dry = bool(args.get("dry")) or torch is None
    stamps = []
    if dry:
        end = time.time() + seconds
        while time.time() < end:
            if args.get("fake_cuda"):
                _fake_work(args, int(args.get("dry_blocks", 20000)), step_sync=True)
            else:
                time.sleep(float(args.get("dry_ms", 20)) / 1000)
            stamps.append(time.time())
        return {"stamps": stamps}
    end = time.time() + seconds
    if args.get("kind") == "membw":  # memory-bandwidth bound: large device-to-device copies, few SMs needed
        if not _state:
            n = int(args.get("membw_mb", 2048)) * 2**20 // 2  # fp16 elements
            _state["a"] = torch.empty(n, dtype=torch.half, device="cuda").normal_()
            _state["b"] = torch.empty_like(_state["a"])
        a, b = _state["a"], _state["b"]
        while time.time() < end:
            for _ in range(4):
                b.copy_(a)
                a.copy_(b)
            torch.cuda.synchronize()
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

NO_SHIM = ["--gpu-shim-path", "/nonexistent/libdilu_shim.so"]
MPS_ON = ["--gpu-mps", "on"]
"""MPS with process isolation on, as the defaults run it: an MPS daemon serves one uid at a time, so the MPS
clients of one GPU share a uid leased for it and PID and mount namespaces keep them apart (docs/invoker.md)."""
TS = ["--gpu-mps", "off"]
PLAIN_MPS = [*MPS_ON, "--no-gpu-mps-best-effort-priority"]
"""MPS as a static split runs it: every client at normal priority (the product's default gives a best-effort
client below-normal priority)."""
ISOLATION_OFF = ("--invoker-process-isolation", "off")
SHIM_ANN = {"infer": (0.5, 0.8), "train": (0.3, 0.7)}

MODES: dict[str, dict[str, Any]] = {
    "noshim": {"flags": [*NO_SHIM, *TS], **SHIM_ANN, "what": "no shim, time-slicing (no control)", "baseline": True},
    "mps50": {"flags": [*NO_SHIM, *PLAIN_MPS], "infer": (0.5, 0.5), "train": (0.5, 0.5),
              "what": "static MPS 50/50 (no shim; 50% active threads each, both at normal priority)", "baseline": True},
    "mps70": {"flags": [*NO_SHIM, *PLAIN_MPS], "infer": (0.7, 0.7), "train": (0.3, 0.3),
              "what": "static MPS 70/30 (no shim; inference 70%, training 30% active threads)", "baseline": True},
    "static30": {"flags": ["--gpu-vertical-policy", "static", *TS], "infer": (0.5, 0.7), "train": (0.3, 0.3),
                 "what": "static shim shares 70/30 (policy static: each at its limit), time-slicing", "baseline": True},
    "shim": {"flags": [], **SHIM_ANN,
             "what": "the defaults: shim, --gpu-vertical-policy auto (spatial under MPS, slo time-sliced), "
                     "--gpu-mps auto, isolation auto"},
    "shim-lc50": {"flags": ["--gpu-vertical-spatial-lc-threads", "0.5"], **SHIM_ANN,
                  "what": "the defaults with latency-critical MPS caps at max(request, 0.5): inference 50%, "
                          "training 50% of the SMs (the caps meet instead of overlapping)"},
    "shim-be": {"flags": ["--gpu-vertical-spatial-be-threads", "1.0"], **SHIM_ANN,
                "what": "the defaults with best-effort MPS caps reaching into the latency-critical reserve, up to "
                        "their limit (training 70% of the SMs instead of 50%), at below-normal priority"},
    "shim-noprio": {"flags": ["--no-gpu-mps-best-effort-priority"], **SHIM_ANN,
                    "what": "the defaults with every MPS client at normal priority (no below-normal best-effort)"},
    "spatial": {"flags": ["--gpu-vertical-policy", "spatial", *MPS_ON], **SHIM_ANN,
                "what": "shim + spatial policy (no token caps; MPS threads: inference its limit, training "
                        "min(limit, max(request, 1 - reserve 0.5))), MPS (--gpu-mps on)"},
    "slo": {"flags": ["--gpu-vertical-policy", "slo", *MPS_ON], **SHIM_ANN,
            "what": "shim + slo controller, MPS (best-effort clients at mps_best_effort_threads)"},
    "slo-ts": {"flags": ["--gpu-vertical-policy", "slo", *TS], **SHIM_ANN,
               "what": "shim + slo controller, time-slicing (--gpu-mps off)"},
}
MODES["shim-mps"] = {**MODES["slo"], "what": f"{MODES['slo']['what']}: the same as slo (docs/policies.md §1.2)"}
MODES["shim-ts"] = {**MODES["slo-ts"], "what": f"{MODES['slo-ts']['what']}: the same as slo-ts (docs/policies.md §1.2)"}
SLO_MODES = ("slo", "slo-ts", "shim-mps", "shim-ts")
"""Modes that run the slo controller: their inference action carries ``gpu-slo-ms`` (``--slo-ms``)."""
CONTROLLERS = ("slo", "slo-ts", "shim", "shim-lc50", "shim-be", "shim-noprio", "shim-mps", "shim-ts")
"""Modes whose shares a feedback policy sets (``shim`` runs slo where auto picks time-slicing); the modes marked
``baseline`` are the simple static ones; ``spatial`` is neither: static, but the product's own default under MPS."""
PAIRS = {"resnet50+train": "resnet50", "bert+train": "bert", "resnet50+membw": "resnet50"}
"""Pair → inference model. The best-effort side is ResNet-50 training, except in ``resnet50+membw``
(issue 17's interference that SM share cannot fix): a memory-bandwidth-bound job of large device-to-device
copies (2 × 2 GiB fp16 buffers, 8 copies per step; its 'it/s' are steps/s)."""
BEST_EFFORT_KIND = {"resnet50+membw": "membw"}


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
    #: why a failed request failed: its HTTP status and the start of its body (kept for the report)
    failure: str | None = None


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
        if getattr(self.args, "extra_flags", None) and ISOLATION_OFF[0] not in cmd:
            cmd += self.args.extra_flags
        if self.args.dry_run:
            # No GPU: a simulated one from an inventory file (the shim, the manager and the policy run; the
            # actions launch through the fake libcuda) and the fake MPS control binary of the tests.
            inventory = self.work / "inventory.json"
            inventory.write_text(json.dumps([{"uuid": "GPU-dry-run-0", "name": "dry-run GPU", "memory_mb": 143771}]))
            cmd += ["--gpu-inventory", str(inventory), "--gpu-mps-control", str(FAKE_MPS)]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=300))
        await wait_for_api(self.session, f"http://127.0.0.1:{self.api_port}/api/v1", self.proc,
                           what=f"standalone ({self.mode}; see {self.log_path})")
        self._trace_task = asyncio.create_task(self._poll_metrics())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._trace_task is not None:
            self._trace_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._trace_task
        if self.session is not None:
            await self.session.close()
        await stop_process_tree(self.proc, grace_s=30)
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
                        who = str(labels.get("action", labels.get("mode", labels.get("reason", "")))).strip('"')
                        self.trace.rows.append((now, m.group(1), who, float(m.group(3))))
            except (aiohttp.ClientError, ValueError):
                pass
            await asyncio.sleep(0.25)

    async def create(self, name: str, code: str, cls: str, request: float, limit: float, *,
                     slo_ms: float | None = None) -> None:
        assert self.session is not None
        annotations = [{"key": "gpu-class", "value": cls}, {"key": "gpu-sm-request", "value": request},
                       {"key": "gpu-sm-limit", "value": limit}, {"key": "gpu-memory-mb", "value": 16384}]
        if slo_ms:
            annotations.append({"key": "gpu-slo-ms", "value": slo_ms})
        await put_gpu_action(self.session, self.api, name, code, annotations, memory_mb=8192, auth=self.auth)

    async def create_cpu(self, name: str, code: str) -> None:
        assert self.session is not None
        body = {"exec": {"kind": "python:3", "code": code}, "limits": {"memory": 256}}
        async with self.session.put(f"{self.api}/{name}?overwrite=true", json=body, auth=self.auth) as r:
            if r.status != 200:
                raise RuntimeError(f"PUT {name}: {r.status} {await r.text()}")

    async def invoke(self, name: str, params: dict[str, Any]) -> tuple[float, dict[str, Any] | None, int]:
        assert self.session is not None
        ms, status, data = await invoke_result(self.session, self.api, name, params, auth=self.auth)
        return ms, data if isinstance(data, dict) else None, status


# -- load generators ----------------------------------------------------------------------------------------


async def one(stack: Stack, name: str, params: dict[str, Any], out: list[Sample]) -> None:
    sent = time.time()
    ms, data, status = await stack.invoke(name, params)
    ok = status == 200 and data is not None and "gpu_ms" in data
    failure = None if ok else f"{status} {json.dumps(data)[:200] if data is not None else '(no JSON body)'}"
    out.append(Sample(sent, ms, ok, data.get("gpu_ms") if ok and data else None,
                      data.get("run_ms") if ok and data else None, failure))


async def closed_loop(stack: Stack, name: str, params: dict[str, Any], seconds: float) -> list[Sample]:
    out: list[Sample] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await one(stack, name, params, out)
    return out


def arrival_times(kind: str, seconds: float, rate: float, rng: random.Random) -> list[float]:
    """Send times (s from the start) of one scenario at ``rate`` requests/s: the simulator's arrival processes
    (``dilu_invoker.sim.vertical_loop.arrivals``): ``paced`` (evenly spaced), ``poisson`` (exponential gaps)
    or ``bursty`` (a Markov-modulated Poisson process: in each second the first quarter at 2x the mean rate,
    the rest at 2/3 of it; the same mean, bursts of 2x). Each call draws its own seed from ``rng``."""
    return arrivals(kind, rate, _ONE_PER_S, seconds, rng.getrandbits(64))


#: a pair served at exactly 1 request/s alone: the simulator's load (a fraction of capacity) is then a rate
_ONE_PER_S = PairModel(name="rate", gpu_s=1.0, overhead_s=0.0, interference=0.0, free=0.0)


async def open_loop(stack: Stack, name: str, params: dict[str, Any], rates: list[tuple[float, float]],
                    poisson: bool | str, rng: random.Random) -> list[Sample]:
    """``rates``: (seconds, requests/s) segments; arrivals paced, Poisson or bursty (``poisson`` is True,
    False or an arrival process's name); never waits for answers."""
    kind = poisson if isinstance(poisson, str) else ("poisson" if poisson else "paced")
    out: list[Sample] = []
    tasks: list[asyncio.Task[None]] = []
    t0 = time.monotonic()
    offset = 0.0
    for seconds, rate in rates:
        for at in arrival_times(kind, seconds, rate, rng):
            await asyncio.sleep(max(0.0, t0 + offset + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(stack, name, params, out)))
        offset += seconds
    await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
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
    failures = Counter(s.failure.split(" ", 1)[0] for s in samples if s.failure)
    if failures:
        res["failures"] = dict(failures)  # HTTP status -> count
        res["first_failure"] = next(s.failure for s in samples if s.failure)
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


# -- the plan: what fits the time there is ---------------------------------------------------------------

# Seconds measured on the H200 (docs/benchmarks/gpu-product.md, runs 2-4): a standalone comes up in ~2 s and
# stops in ~3; a ResNet-50 instance's cold start (process, torch import, model build, CUDA context) ~3.5 s,
# BERT's ~9 s (transformers); the machine's first torch import ~6 s more; an MPS daemon ~1 s.
COLD_S = {"resnet50": 3.5, "bert": 9.0, "train": 3.5}
STACK_S = 5.0
MPS_S = 1.0
FIRST_IMPORT_S = 6.0
GAP_S = 0.3
WARMUP_S = 1.0
"""Inference's closed-loop warm-up before its solo measurement (capacity learning needs 3 busy periods)."""
LEAD_S = 0.5
"""Training runs this long before the first scenario beside it starts (its invoke reaches the warm process)."""
"""Inference's closed-loop warm-up before its solo measurement (capacity learning needs 3 busy periods)."""
IDLE_AFTER_S = 0.7
"""Inference idle this long counts as idle to the policies (0.6 s) before training's solo run."""
"""Between two scenarios beside one training invocation (the last answers arrive)."""
TRAIN_GROUP_S = 40.0
"""Scenarios beside one training invocation at most (a blocking invoke answers within OpenWhisk's 60 s)."""


def scenarios_of(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """(name, arrival process, load) of every scenario beside training, in the order they run."""
    want = set(args.scenarios)
    if args.besides:  # an explicit list, e.g. paced@0.5,poisson@0.3,burst
        out = []
        for item in args.besides:
            if item == "burst" or item.startswith("burst@"):
                out.append(burst_scenario(float(item.partition("@")[2] or BURST_BASE)))
            else:
                kind, _, load = item.partition("@")
                out.append((f"{kind}@{float(load):g}", kind, float(load)))
        return out
    out = [(f"{kind}@{load:g}", kind, load) for load in args.loads for kind in args.arrivals]
    if "burst" in want:
        out.append(burst_scenario(BURST_BASE))
    return out


BURST_BASE = 0.2
"""The 5x burst's base load: 0.2 of capacity, so that its 2 s at 5x offer inference its whole solo capacity."""
ALONE = " alone"
"""Suffix of a burst scenario measured with training idle (``--scenarios ...,alone``): the same arrivals against
the inference instance alone, the reference that says whether the burst is within what one instance serves."""


def burst_scenario(base: float) -> tuple[str, str, float]:
    """(name, process, base load) of a 5x burst; the issue's burst (base 0.2) keeps the name ``burst``."""
    return ("burst" if base == BURST_BASE else f"burst@{base:g}", "burst", base)


def burst_rates(seconds: float, base_rps: float) -> list[tuple[float, float]]:
    """(seconds, requests/s) segments of a 5x burst: half the window at the base, 2 s at 5x, half at the base."""
    return [(seconds / 2, base_rps), (2.0, 5 * base_rps), (seconds / 2, base_rps)]


def stack_estimate_s(args: argparse.Namespace, mode: str, pair: str, trial: int = 1) -> float:
    """Seconds one (mode, pair, trial) takes on the H200, by the figures above."""
    sec = args.seconds
    n = len(scenarios_of(args))
    besides = sum(sec + (2.0 if kind == "burst" else 0.0) + GAP_S for _, kind, _ in scenarios_of(args))
    groups = max(1, math.ceil(besides / TRAIN_GROUP_S)) if n else 0
    est = (STACK_S + max(COLD_S["train"], COLD_S[PAIRS[pair]]) + 0.5 + IDLE_AFTER_S + sec + WARMUP_S + sec
           + besides + groups * (LEAD_S + 0.5))
    if "idle" in args.scenarios:
        est += sec
    if "alone" in args.scenarios:
        est += sum(sec + 2.0 + GAP_S for _, kind, _ in scenarios_of(args) if kind == "burst")
    if trial == 0:
        est += NOOP_COLD_S + NOOP_S  # the first trial also measures the CPU no-op
    if "--gpu-mps" in MODES[mode]["flags"] and MODES[mode]["flags"][MODES[mode]["flags"].index("--gpu-mps") + 1] == "on":
        est += MPS_S
    if "share" in args.scenarios and mode in CONTROLLERS:
        est += STACK_S + 3 * (COLD_S[PAIRS[pair]] + 1.0 + sec)
    return est


def modes_for(args: argparse.Namespace, pair: str) -> list[str]:
    return list(args.pair_modes.get(pair, args.modes))


def sets_reference(ref: dict[str, Any], key: str, mode: str, pair_modes: list[str]) -> bool:
    """Whether a stack's solo measurement becomes its trial's reference (the SLO's solo p99 and the capacity that
    loads are fractions of): the unlimited `noshim` where the pair runs it, else the trial's first mode, so that
    the modes of a plan without `noshim` still serve the same arrivals and are judged by the same SLO."""
    if "noshim" in pair_modes:
        return mode == "noshim"
    return key not in ref


def plan(args: argparse.Namespace) -> tuple[list[tuple[int, str, str, float]], list[tuple[int, str, str, float]]]:
    """The stacks to run in order — trial by trial, each trial every pair and mode (the unlimited reference
    `noshim` first) — and the ones cut because the estimate passes ``--budget-s``."""
    combos = priority(args)
    per = {c: stack_estimate_s(args, c[1], c[0]) for c in combos}
    # Whole (pair, mode) columns, most important first, each with all its trials, while they fit the budget
    # (a column that does not fit is left out and the next ones are tried); a pair's unlimited reference
    # `noshim` comes with the pair's first other column.
    kept: list[tuple[str, str]] = []
    total = FIRST_IMPORT_S
    for c in combos:
        if c[1] == "noshim" and any(k[0] == c[0] and k[1] != "noshim" for k in combos):
            continue  # comes with its pair's first other column
        ref = (c[0], "noshim")
        need = [x for x in dict.fromkeys((ref, c)) if x in combos and x not in kept]
        cost = args.trials * sum(per[x] for x in need) + (NOOP_COLD_S + NOOP_S) * len(need) * (args.trials > 0)
        if args.budget_s and total + cost > args.budget_s:
            continue
        kept += need
        total += cost
    order = [c for p in args.pairs for c in sorted((k for k in kept if k[0] == p), key=lambda k: k[1] != "noshim")]
    keep = [(t, p, m, stack_estimate_s(args, m, p, t)) for t in range(args.trials) for p, m in order]
    cut = [(t, p, m, stack_estimate_s(args, m, p, t)) for t in range(args.trials) for p, m in combos
           if (p, m) not in kept]
    return keep, cut


def priority(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(pair, mode) columns, most important first: ``--priority`` ('pair:mode,mode;pair:mode'), then every
    other column of ``--pairs`` x ``--modes`` / ``--pair-modes`` in their order."""
    out: list[tuple[str, str]] = []
    for group in [g for g in args.priority.split(";") if g]:
        pair, _, modes = group.partition(":")
        out += [(pair, m) for m in modes.split(",") if m and (pair, m) not in out]
    for pair in args.pairs:
        out += [(pair, m) for m in modes_for(args, pair) if (pair, m) not in out]
    allowed = {(p, m) for p in args.pairs for m in modes_for(args, p)}
    return [c for c in out if c in allowed]


def print_plan(args: argparse.Namespace, keep: list[tuple[int, str, str, float]],
               cut: list[tuple[int, str, str, float]]) -> float:
    total = FIRST_IMPORT_S + sum(e for *_, e in keep)
    names = [n for n, _, _ in scenarios_of(args)]
    print(f"plan: {len(keep)} stacks, estimate {total:.0f} s on the H200 (budget {args.budget_s or 'none'} s); "
          f"{args.seconds:g} s scenarios: solo, {', '.join(names)}{', idle' if 'idle' in args.scenarios else ''}",
          flush=True)
    for pair, mode in priority(args):
        n = sum(1 for _, p, m, _ in keep if p == pair and m == mode)
        est = stack_estimate_s(args, mode, pair)
        print(f"  {pair:15s} {mode:9s} {n} trial(s) x {est:.0f} s" + ("" if n else "  CUT (over the budget)"), flush=True)
    return total


# -- one (mode, pair, trial) ----------------------------------------------------------------------------------


def effective_mode(log_text: str, trace: list[tuple[float, str, str, float]]) -> dict[str, Any]:
    """What the invoker actually ran, from its log: the sharing mode (MPS or time-slicing) and why, the vertical
    policy, whether the shim was loaded, and the MPS active-thread fraction each class's instances started with
    (``mps_threads``: class → the values logged by "instance added")."""
    out: dict[str, Any] = {"mps": None, "mps_reason": None, "policy": None, "shim": None, "gpu_attached": 0,
                           "mps_threads": {}}
    for line in log_text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        event = str(rec.get("event", ""))
        if event.startswith("GPU sharing mode"):
            out["mps_reason"] = rec.get("reason")
            mode = str(rec.get("mode", ""))
            out["mps"] = mode.lower() == "mps" if mode else out["mps"]
        elif event == "manager started" and rec.get("policy"):
            out["policy"] = rec.get("policy")
        elif event == "GPU attached":
            out["gpu_attached"] += 1
        elif event == "instance added" and rec.get("mps_threads") is not None:
            out["mps_threads"].setdefault(str(rec.get("cls")), []).append(rec["mps_threads"])
        elif "shim" in event.lower() and ("not found" in event.lower() or "without" in event.lower()):
            out["shim"] = False
    for _t, metric, who, v in trace:
        if metric == "dilu_gpu_mps_enabled":
            out["mps"], out["mps_reason"] = bool(v), out["mps_reason"] or who
        elif metric == "openwhisk_action_gpu_sm_quota_ratio" and out["shim"] is None:
            out["shim"] = True
    return out


def train_params(seconds: float, extra: dict[str, Any]) -> dict[str, Any]:
    return {"seconds": seconds, **extra}


async def run_cell(args: argparse.Namespace, mode: str, pair: str, trial: int, ref: dict[str, Any]) -> dict[str, Any]:
    model = PAIRS[pair]
    work = Path(tempfile.mkdtemp(prefix=f"dilu-gpu-product-{mode}-"))
    os.chmod(work, 0o711)  # isolated action uids traverse to their shim files below it, and list nothing
    rng = random.Random(1000 * trial + 7)
    spec = MODES[mode]
    dry: dict[str, Any] = {"dry": True} if args.dry_run else {}
    if args.dry_run and FAKE_CUDA.exists():
        dry["fake_cuda"] = str(FAKE_CUDA)
    iparams = {"model": model, "batch": 8, **dry}
    tdry = {**dry, **({"kind": BEST_EFFORT_KIND[pair]} if pair in BEST_EFFORT_KIND else {})}
    slo_ann = args.slo_ms if mode in SLO_MODES and args.slo_ms > 0 else None
    cell: dict[str, Any] = {"mode": mode, "what": spec["what"], "pair": pair, "trial": trial, "scenarios": {},
                            "annotations": {"inference": spec["infer"], "training": spec["train"],
                                            "inference_slo_ms": slo_ann},
                            "flags": spec["flags"], "estimate_s": rnd(stack_estimate_s(args, mode, pair, trial), 1)}
    t_start = time.time()
    async with Stack(args, mode, work) as st:
        await st.create("infer", INFER_CODE, "inference", *spec["infer"], slo_ms=slo_ann)
        await st.create("train", TRAIN_CODE, "training", *spec["train"])
        want = set(args.scenarios)
        # Cold starts of both at once (the GPU is barely used while processes start and models load), then
        # training alone (the inference instance exists and is idle), then inference alone.
        (tms, tdata, tstatus), (ims, idata, istatus) = await asyncio.gather(
            st.invoke("train", train_params(0.0, tdry)), st.invoke("infer", iparams))
        cell["cold_start_ms"] = {"train": rnd(tms), "infer": rnd(ims), "together": True}
        for what, status, data in (("training", tstatus, tdata), ("inference", istatus, idata)):
            if status != 200:
                # The standalone's log goes with the work directory: what went wrong in it comes with the error.
                problems = problem_lines(st.log_path.read_text(errors="replace"), most=5)
                raise RuntimeError(f"{mode}: {what} cold start answered {status}: {data}; the standalone's log: "
                                   f"{problems}")
        await asyncio.sleep(IDLE_AFTER_S)  # inference idle: the policy gives training the GPU
        tr = await st.invoke("train", train_params(args.seconds, tdry))
        stamps = (tr[1] or {}).get("stamps", [])
        solo_train = train_rate(stamps, stamps[0] if stamps else 0, stamps[-1] if stamps else 0) if stamps else None
        cell["solo_train_it_s"] = rnd(solo_train)
        await closed_loop(st, "infer", iparams, WARMUP_S)  # warm-up (and, without a profile, capacity learning)
        solo = await closed_loop(st, "infer", iparams, args.seconds)
        solo_ok = [s.latency_ms for s in solo if s.ok]
        own_p99 = pct(solo_ok, 0.99)
        key = f"{pair}:{trial}"
        sets_ref = bool(own_p99) and sets_reference(ref, key, mode, modes_for(args, pair))
        if sets_ref:
            ref[key] = {"p99": own_p99, "p50": pct(solo_ok, 0.5), "mode": mode}
            if mode == "noshim":
                ref[key]["train"] = solo_train  # training's reference is the unlimited solo only
        base = ref.get(key, {})
        slo = 2 * (base.get("p99") or own_p99 or 0) or None
        capacity_rps = len(solo_ok) / args.seconds
        cell["solo"] = summarize(solo, slo)
        if trial == 0:
            # The stack's own floor on this host, beside the GPU figures: a CPU no-op, warm, one at a time.
            await st.create_cpu("noop", NOOP_CODE)
            await closed_loop(st, "noop", {}, 0.5)
            cell["noop"] = summarize(await closed_loop(st, "noop", {}, NOOP_S), None)
        cell["capacity_rps"] = rnd(capacity_rps)
        cell["slo_ms"] = rnd(slo)
        cell["ref"] = {k: rnd(v) for k, v in base.items() if k != "mode"}
        cell["ref_mode"] = base.get("mode")
        # Loads are fractions of the unlimited (noshim) capacity of the same trial where there is one, else of
        # the trial's first mode's (`sets_reference`), so that every mode of a cell serves the same arrivals.
        ref_rps = base.get("rps") or capacity_rps
        if sets_ref:
            ref[key]["rps"] = capacity_rps

        def finish(name: str, samples: list[Sample], window: tuple[float, float], stamps: list[float]) -> None:
            res = summarize(samples, slo)
            rate = train_rate(stamps, *window)
            res["train_it_s"] = rnd(rate)
            res["train_vs_solo"] = rnd(rate / solo_train, 3) if rate and solo_train else None
            res["train_vs_ref"] = rnd(rate / base["train"], 3) if rate and base.get("train") else None
            res["p99_vs_solo"] = rnd(res["p99_ms"] / own_p99, 3) if res["p99_ms"] and own_p99 else None
            res["p99_vs_ref"] = rnd(res["p99_ms"] / base["p99"], 3) if res["p99_ms"] and base.get("p99") else None
            res["window"] = list(window)
            cell["scenarios"][name] = res

        if "alone" in want:
            # Each burst against inference alone (training idle), before the same burst beside training: the
            # reference that says whether the burst is within one instance's capacity at all. Its own generator,
            # so that the arrivals of the scenarios beside training are those of a run without it.
            alone_rng = random.Random(1000 * trial + 8)
            for name, kind, load in scenarios_of(args):
                if kind != "burst":
                    continue
                t0 = time.time()
                samples = await open_loop(st, "infer", iparams, burst_rates(args.seconds, load * ref_rps), "paced",
                                          alone_rng)
                finish(name + ALONE, samples, (t0, time.time()), [])
                await asyncio.sleep(GAP_S)
        todo = scenarios_of(args)
        while todo:  # groups of scenarios beside one training invocation
            group: list[tuple[str, str, float]] = []
            length = 0.0
            while todo and (not group or length + args.seconds + 2.3 <= TRAIN_GROUP_S):
                group.append(todo.pop(0))
                length += args.seconds + (2.0 if group[-1][1] == "burst" else 0.0) + GAP_S
            train_task = asyncio.create_task(st.invoke("train", train_params(LEAD_S + length + 0.5, tdry)))
            await asyncio.sleep(LEAD_S)  # training runs before inference starts
            results = []
            for name, kind, load in group:
                t0 = time.time()
                if kind == "burst":
                    samples = await open_loop(st, "infer", iparams, burst_rates(args.seconds, load * ref_rps), "paced",
                                              rng)
                else:
                    samples = await open_loop(st, "infer", iparams, [(args.seconds, load * ref_rps)], kind, rng)
                results.append((name, samples, (t0, time.time())))
                await asyncio.sleep(GAP_S)
            _, tdata, tstatus = await train_task
            stamps = (tdata or {}).get("stamps", [])
            if tstatus != 200:
                cell.setdefault("warnings", []).append(f"training beside {[g[0] for g in group]}: {tstatus}")
            for name, samples, window in results:
                finish(name, samples, window, stamps)
        if "idle" in want:
            t0 = time.time()
            _, tdata, _ = await st.invoke("train", train_params(args.seconds, tdry))
            stamps = (tdata or {}).get("stamps", [])
            rate = train_rate(stamps, stamps[0], stamps[-1]) if stamps else None
            cell["scenarios"]["idle"] = {"train_it_s": rnd(rate),
                                         "train_vs_solo": rnd(rate / solo_train, 3) if rate and solo_train else None,
                                         "train_vs_ref": rnd(rate / base["train"], 3) if rate and base.get("train") else None,
                                         "window": [t0, time.time()]}
        cell["trace"] = [(round(t - t_start, 3), m, w, v) for t, m, w, v in st.trace.rows]
    if "share" in want and mode in CONTROLLERS:
        # A stack of its own: beside the pair's instances the extra ones would not fit the GPU's budget. They
        # run one after the other, never together: γ 3 lets all three limits be placed on the one GPU.
        async with Stack(args, mode, work / "share", ("--gpu-gamma", "3.0")) as sh:
            for share in (0.5, 0.8, 1.0):
                name = f"infer-s{int(share * 100)}"
                await sh.create(name, INFER_CODE, "inference", 0.3, share)
                # A cold start the stack refuses (the balancer could not place the instance at that tick) is
                # tried again, a second apart, up to 10 times: this scenario measures a warm instance at its
                # share. Each refusal is kept in the cell's warnings (CI saw one under load, reason unknown).
                for attempt in range(10):
                    ms, body, status = await sh.invoke(name, iparams)
                    if status == 200:
                        break
                    cell.setdefault("warnings", []).append(
                        f"{name}'s cold start, try {attempt + 1}: {status} {json.dumps(body)[:300]}")
                    await asyncio.sleep(1.0)
                await closed_loop(sh, name, iparams, 1.0)
                s = await closed_loop(sh, name, iparams, args.seconds)
                res = summarize(s, slo)
                unl = base.get("p50") or pct(solo_ok, 0.5)
                res["cold_start_ms"] = rnd(ms)
                res["p50_vs_unlimited"] = rnd(res["p50_ms"] / unl, 3) if res["p50_ms"] and unl else None
                res["p99_vs_unlimited"] = (rnd(res["p99_ms"] / base["p99"], 3)
                                           if res["p99_ms"] and base.get("p99") else None)
                res["target_p50_ms"] = rnd(unl / share * 1.1) if unl else None
                cell["scenarios"][f"share@{share:g}"] = res
            cell["share_trace"] = [(round(t - t_start, 3), m, w, v) for t, m, w, v in sh.trace.rows]
        # What went wrong in the share stack, if anything did (its log is removed with the work directory).
        cell["share_log_problems"] = problem_lines(sh.log_path.read_text(errors="replace"))
    log_text = st.log_path.read_text(errors="replace")
    cell["effective"] = effective_mode(log_text, st.trace.rows)
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
    cell["log_problems"] = problem_lines(log_text)
    cell["log_mode_lines"] = [line[:300] for line in log_text.splitlines()
                              if "GPU sharing mode" in line or "capacity learnt" in line][:10]
    cell["wall_s"] = rnd(time.time() - t_start, 1)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return cell


def problem_lines(log_text: str, most: int = 20) -> list[str]:
    """The first ``most`` warning and error lines of a standalone's log (structlog JSON), cut to 300 characters;
    the warning every dry run logs for its inventory file is left out."""
    out = []
    for line in log_text.splitlines():
        if ('"level": "warning"' in line or '"level": "error"' in line) and "GPU inventory file" not in line:
            out.append(line[:300])
            if len(out) == most:
                break
    return out


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
    info["fsync_p50_ms"] = rnd(fsync_p50_ms(Path(tempfile.gettempdir())), 3)
    return info


def fsync_p50_ms(directory: Path, n: int = 100) -> float | None:
    """What one small synced append costs on the disk the embedded Redis writes to (its AOF syncs each write
    with the default ``--redis-appendfsync always``)."""
    with contextlib.suppress(OSError), tempfile.NamedTemporaryFile(dir=directory) as f:
        times = []
        for _ in range(n):
            f.write(b"x" * 512)
            f.flush()
            t = time.perf_counter()
            os.fsync(f.fileno())
            times.append((time.perf_counter() - t) * 1000)
        return statistics.median(times)
    return None


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    keep, cut = plan(args)
    estimate = print_plan(args, keep, cut)
    doc: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv), "dry_run": args.dry_run,
                           "seconds": args.seconds, "loads": args.loads, "arrivals": args.arrivals,
                           "scenarios": args.scenarios, "trials": args.trials, "estimate_s": rnd(estimate, 0),
                           "budget_s": args.budget_s, "cut": [{"trial": t, "pair": p, "mode": m} for t, p, m, _ in cut],
                           "skipped": [], "cells": [], "errors": []}
    ref: dict[str, Any] = {}
    started = time.monotonic()
    for trial, pair, mode, est in keep:
        elapsed = time.monotonic() - started
        if args.deadline_s and elapsed + est > args.deadline_s:
            # Stop by itself before the machine's limit, with everything so far written.
            doc["skipped"].append({"trial": trial, "pair": pair, "mode": mode, "at_s": rnd(elapsed, 0)})
            print(f"== skip {mode} {pair} trial {trial}: {elapsed:.0f} s + ~{est:.0f} s passes the deadline "
                  f"{args.deadline_s:.0f} s", flush=True)
            continue
        print(f"== {mode} {pair} trial {trial} (at {elapsed:.0f} s, estimate {est:.0f} s)", flush=True)
        try:
            cell = await run_cell(args, mode, pair, trial, ref)
        except Exception as exc:  # noqa: BLE001 - one broken cell must not lose the others
            doc["errors"].append({"mode": mode, "pair": pair, "trial": trial, "error": repr(exc)})
            print(f"   failed: {exc!r}", flush=True)
            if not (args.isolation_fallback and not args.extra_flags and ISOLATION_OFF[0] not in MODES[mode]["flags"]
                    and "cold start" in str(exc)):
                continue
            # GPU actions did not start with process isolation (its uid, mount view or memory cgroup): rather than
            # lose the run, every later stack runs without it, and the document says so.
            args.extra_flags = list(ISOLATION_OFF)
            doc["isolation_fallback"] = {"after": f"{mode} {pair} trial {trial}", "error": repr(exc)[:500]}
            print("   process isolation off from here on (--isolation-fallback); retrying", flush=True)
            try:
                cell = await run_cell(args, mode, pair, trial, ref)
            except Exception as exc2:  # noqa: BLE001
                doc["errors"].append({"mode": mode, "pair": pair, "trial": trial, "error": repr(exc2)})
                print(f"   failed again: {exc2!r}", flush=True)
                continue
        doc["cells"].append(cell)
        brief = {k: (cell["scenarios"][k].get("p99_ms"), cell["scenarios"][k].get("train_vs_ref"))
                 for k in cell["scenarios"]}
        eff = cell["effective"]
        print(f"   {cell['wall_s']} s; effective: mps={eff['mps']} policy={eff['policy']} shim={eff['shim']} "
              f"threads={eff.get('mps_threads')}; solo p50 "
              f"{cell['solo']['p50_ms']} p99 {cell['solo']['p99_ms']} ms, train {cell['solo_train_it_s']} it/s, "
              f"cold {cell['cold_start_ms']}; (p99 ms, training/ref) {brief}", flush=True)
        if args.out:  # progressively: a run cut short keeps every finished cell
            Path(args.out).write_text(json.dumps(doc, indent=1))
    doc["wall_s"] = rnd(time.monotonic() - started, 1)
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
                  "| overhead p50 (ms) | CPU no-op p50 (ms) | capacity (req/s) | solo training (it/s) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c in mine:
            s = c["solo"]
            noop = c.get("noop") or {}
            lines.append(f"| {c['mode']} (trial {c['trial']}) | {c['what']} | {f(c['cold_start_ms'].get('infer'))} / "
                         f"{f(c['cold_start_ms'].get('train'))} | {f(s['p50_ms'])} / {f(s['p99_ms'])} | "
                         f"{f(s.get('gpu_p50_ms'))} / {f(s.get('run_p50_ms'))} | {f(s.get('overhead_p50_ms'))} | "
                         f"{f(noop.get('p50_ms'))} | {f(c['capacity_rps'])} | {f(c['solo_train_it_s'])} |")
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


# -- the matrix: every cell side by side, median and worst over trials -------------------------------------

BEGIN, END = "<!-- matrix:begin (bench/gpu_product.py writes this block) -->", "<!-- matrix:end -->"


def _stat(values: list[float | None], worst: str) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.median(vals), (max(vals) if worst == "max" else min(vals))


def aggregate(cells: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(pair, scenario, mode) → medians and worsts over the trials."""
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in cells:
        for name, r in c["scenarios"].items():
            rows.setdefault((c["pair"], name, c["mode"]), []).append({**r, "_eff": c.get("effective", {})})
        rows.setdefault((c["pair"], "solo", c["mode"]), []).append(
            {**c["solo"], "train_it_s": c.get("solo_train_it_s"), "cold_infer_ms": c["cold_start_ms"].get("infer"),
             "_eff": c.get("effective", {})})
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for key, rs in rows.items():
        agg: dict[str, Any] = {"trials": len(rs)}
        for field_, worst in (("p99_ms", "max"), ("p99_vs_solo", "max"), ("p99_vs_ref", "max"),
                              ("slo_violations", "max"), ("train_vs_ref", "min"), ("train_vs_solo", "min"),
                              ("train_it_s", "min"), ("p50_ms", "max")):
            agg[field_] = _stat([r.get(field_) for r in rs], worst)
        agg["points"] = [(r["p99_ms"], r["train_vs_ref"]) for r in rs
                         if r.get("p99_ms") is not None and r.get("train_vs_ref") is not None]
        effs = {(r["_eff"].get("mps"), r["_eff"].get("policy")) for r in rs}
        agg["effective"] = "; ".join(f"{'MPS' if m else 'time-slicing' if m is False else '?'}"
                                     f"{', ' + p if p else ''}" for m, p in sorted(effs, key=str))
        out[key] = agg
    return out


def strongest_baseline(agg: dict[tuple[str, str, str], dict[str, Any]], pair: str, scenario: str,
                       slo_ok: float = 0.01) -> str | None:
    """The simple baseline (a static mode) of a scenario that gives training the most among those whose worst
    SLO violations stay within ``slo_ok``; where none does, the one with the lowest median p99."""
    bases = [(m, a) for (p, s, m), a in agg.items() if p == pair and s == scenario and MODES.get(m, {}).get("baseline")]
    if not bases:
        return None
    meeting = [(m, a) for m, a in bases if a["slo_violations"][1] is not None and a["slo_violations"][1] <= slo_ok
               and a["train_vs_ref"][0] is not None]
    if meeting:
        return max(meeting, key=lambda ma: ma[1]["train_vs_ref"][0])[0]
    with_p99 = [(m, a) for m, a in bases if a["p99_ms"][0] is not None]
    return min(with_p99, key=lambda ma: ma[1]["p99_ms"][0])[0] if with_p99 else None


def dominated_by(agg: dict[tuple[str, str, str], dict[str, Any]], pair: str, scenario: str, mode: str,
                 tolerance: float = 0.02) -> list[str]:
    """Static modes with a median p99 at or below ``mode``'s that give training more (by > ``tolerance`` of the
    unlimited solo training): issue 17's dominance test, on medians."""
    me = agg.get((pair, scenario, mode))
    if me is None or me["p99_ms"][0] is None or me["train_vs_ref"][0] is None:
        return []
    out = []
    for (p, s, m), a in agg.items():
        if p != pair or s != scenario or not MODES.get(m, {}).get("baseline") or a["p99_ms"][0] is None:
            continue
        if a["p99_ms"][0] <= me["p99_ms"][0] and (a["train_vs_ref"][0] or 0) > me["train_vs_ref"][0] + tolerance:
            out.append(m)
    return out


DOMINANCE_DRAWS = 2000
"""Bootstrap resamples behind `dominance_odds`."""
BEYOND_NOISE = 0.95
"""Odds from which a dominance counts as beyond the trials' noise (one-sided, 95%)."""


def dominance_odds(agg: dict[tuple[str, str, str], dict[str, Any]], pair: str, scenario: str, mode: str, other: str,
                   tolerance: float = 0.02, draws: int = DOMINANCE_DRAWS, seed: int = 17) -> float | None:
    """How sure the trials make `dominated_by`'s verdict that ``other`` dominates ``mode`` in a cell: the share of
    ``draws`` bootstrap resamples (each mode's trials drawn with replacement, independently; the median p99 and
    median training of each draw) in which ``other``'s p99 is at or below ``mode``'s and its training above by more
    than ``tolerance``. None without at least two trials of each with both figures."""
    me, them = agg.get((pair, scenario, mode)), agg.get((pair, scenario, other))
    if me is None or them is None:
        return None
    mine, theirs = me.get("points", []), them.get("points", [])
    if len(mine) < 2 or len(theirs) < 2:
        return None
    rng = random.Random(seed)
    hits = 0
    for _ in range(draws):
        a = [rng.choice(mine) for _ in mine]
        b = [rng.choice(theirs) for _ in theirs]
        if (statistics.median(p for p, _ in b) <= statistics.median(p for p, _ in a)
                and statistics.median(t for _, t in b) > statistics.median(t for _, t in a) + tolerance):
            hits += 1
    return hits / draws


def _pair(x: tuple[float | None, float | None], pctg: bool = False, suffix: str = "") -> str:
    med, worst = x
    if med is None or worst is None:
        return "–"
    if pctg:
        return f"{med * 100:.1f}% / {worst * 100:.1f}%"
    return f"{f(round(med, 3), suffix)} / {f(round(worst, 3), suffix)}"


def matrix_report(docs: list[dict[str, Any]]) -> str:
    cells = [c for d in docs for c in d["cells"]]
    agg = aggregate(cells)
    lines = [BEGIN, "", "## The workload matrix (generated)", ""]
    for d in docs:
        m = d["machine"]
        lines.append(f"* run: `{d['command']}` — {m.get('gpu') or 'no GPU'}, torch {m.get('torch', '–')}, "
                     f"{len(d['cells'])} stacks in {d.get('wall_s', '?')} s (estimate {d.get('estimate_s', '?')} s)"
                     + (" — **dry run** (fake driver, no GPU: checks the harness only, no figure means anything)"
                        if d.get("dry_run") else ""))
        for e in d.get("errors", []):
            lines.append(f"  * **failed**: {e['mode']} {e['pair']} trial {e['trial']}: `{e['error'][:200]}`")
        if d.get("isolation_fallback"):
            fb = d["isolation_fallback"]
            lines.append(f"  * **process isolation turned off** after {fb['after']} failed to cold-start under it: "
                         f"`{fb['error'][:200]}`")
        for k in ("cut", "skipped"):
            if d.get(k):
                lines.append(f"  * {k} ({'over the planned budget' if k == 'cut' else 'past the deadline'}): "
                             + ", ".join(f"{x['pair']} {x['mode']} t{x['trial']}" for x in d[k]))
    lines += ["", "Each entry is *median / worst* over the trials (fresh standalone and fresh action processes each). "
              "`p99/solo`: against the solo p99 of the same mode; `training/ref`: training it/s over the unlimited "
              "(`noshim`) solo it/s of the same trial; violations: requests over the SLO (2 × the `noshim` solo p99 of "
              "the trial) or failed; `training (it/s)`: absolute (the only training figure of a pair without `noshim`). "
              "Loads are fractions of the `noshim` capacity of the trial, so every mode serves the same arrivals; a "
              "pair without `noshim` takes the SLO and the capacity from the trial's first mode instead, and has no "
              "training reference. *Strongest baseline*: among the static modes, the one whose worst violations stay "
              "≤ 1% with the most training (else the lowest p99); the controller rows give their training and p99 as "
              "ratios to it. *Dominated by*: static modes with a median p99 at or below the mode's and more training "
              f"(+0.02); in brackets the odds of that verdict: the share of {DOMINANCE_DRAWS:,} bootstrap resamples of "
              "the trials (each mode's drawn with replacement) in which it holds."]
    tallies: dict[tuple[str, str], list[int]] = {}
    for pair in dict.fromkeys(c["pair"] for c in cells):
        scen = list(dict.fromkeys(s for (p, s, _m) in agg if p == pair))
        modes = list(dict.fromkeys(c["mode"] for c in cells if c["pair"] == pair))
        lines += ["", f"### {pair}", "",
                  "| mode | effective (log) | trials | solo p50 (ms) | solo p99 (ms) | solo training (it/s) | "
                  "idle training / ref |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for mode in modes:
            a = agg.get((pair, "solo", mode))
            idle = agg.get((pair, "idle", mode))
            if a is None:
                continue
            lines.append(f"| {mode} | {a['effective']} | {a['trials']} | {_pair(a['p50_ms'])} | {_pair(a['p99_ms'])} | "
                         f"{_pair(a['train_it_s'])} | {_pair(idle['train_vs_ref']) if idle else '–'} |")
        lines += ["", "| scenario | mode | p99 (ms) | p99 / solo | violations | training / ref | training (it/s) | "
                      "vs strongest baseline: p99 × / training × | dominated by |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name in scen:
            if name in ("solo", "idle") or name.startswith("share@") or name.endswith(ALONE):
                continue
            best = strongest_baseline(agg, pair, name)
            for mode in modes:
                a = agg.get((pair, name, mode))
                if a is None:
                    continue
                vs = "–"
                if best and mode != best and a["p99_ms"][0] and a["train_vs_ref"][0] is not None:
                    b = agg[(pair, name, best)]
                    if b["p99_ms"][0] and b["train_vs_ref"][0]:
                        vs = (f"{a['p99_ms'][0] / b['p99_ms'][0]:.2f} / {a['train_vs_ref'][0] / b['train_vs_ref'][0]:.2f}"
                              f" ({best})")
                elif mode == best:
                    vs = "**strongest baseline**"
                dom = dominated_by(agg, pair, name, mode) if mode in CONTROLLERS else []
                odds = {m: dominance_odds(agg, pair, name, mode, m) for m in dom}
                if mode in CONTROLLERS:
                    tally = tallies.setdefault((pair, mode), [0, 0, 0])
                    tally[0] += 1
                    tally[1] += bool(dom)
                    tally[2] += any(o is not None and o >= BEYOND_NOISE for o in odds.values())
                shown = ", ".join(m if odds[m] is None else f"{m} ({odds[m]:.2f})" for m in dom)
                lines.append(f"| {name} | {mode} | {_pair(a['p99_ms'])} | {_pair(a['p99_vs_solo'], suffix='x')} | "
                             f"{_pair(a['slo_violations'], pctg=True)} | {_pair(a['train_vs_ref'])} | "
                             f"{_pair(a['train_it_s'])} | {vs} | "
                             f"{shown if dom else ('none' if mode in CONTROLLERS else '')} |")
    if tallies:
        lines += ["", "Dominance, per controller (cells with a p99 and training; *beyond noise*: some dominance with odds "
                      f"≥ {BEYOND_NOISE:.2f}):", "",
                  "| pair | mode | cells | dominated (medians) | dominated beyond noise |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {p} | {m} | {n} | {d} | {b} |" for (p, m), (n, d, b) in tallies.items()]
    lines += bursts_alone(cells)
    lines += ["", "Issue 17's cell targets (ResNet/ResNet; medians over trials):", "",
              "| mode | paced 50%: p99 ≤ 1.25× solo | training ≥ 75% of solo | burst violations ≤ 1% | "
              "idle training ≥ 95% of solo |", "| --- | --- | --- | --- | --- |"]
    for mode in dict.fromkeys(c["mode"] for c in cells if c["pair"] == "resnet50+train"):
        a = agg.get(("resnet50+train", "paced@0.5", mode))
        bu = agg.get(("resnet50+train", "burst", mode))
        idle = agg.get(("resnet50+train", "idle", mode))

        def verdict(x: float | None, ok: bool) -> str:
            return "–" if x is None else f"{x:.2f} {'met' if ok else '**missed**'}"
        p = a["p99_vs_solo"][0] if a else None
        t = a["train_vs_solo"][0] if a else None
        v = bu["slo_violations"][0] if bu else None
        i = idle["train_vs_solo"][0] if idle else None
        lines.append(f"| {mode} | {verdict(p, p is not None and p <= 1.25)} | {verdict(t, t is not None and t >= 0.75)} | "
                     f"{'–' if v is None else f'{v * 100:.1f}% ' + ('met' if v <= 0.01 else '**missed**')} | "
                     f"{verdict(i, i is not None and i >= 0.95)} |")
    lines += ["", "First reaction (≤ 100 ms) is not measured here: the share trace is sampled from `/metrics` every "
                  "0.25 s. Under the defaults on an MPS GPU (`spatial`) there is no control reaction to time: the "
                  "thread caps and the best-effort client's priority are fixed at its start and the GPU's scheduler "
                  "applies the priority kernel by kernel. On a time-sliced GPU the `slo` policy reacts to a queue within one "
                  "50 ms period by design (docs/policies.md §1.1); no GPU run has timed it yet (bench/vertical timed the "
                  "policy it replaced, docs/benchmarks/vertical.md).", "", END]
    return "\n".join(lines) + "\n"


def bursts_alone(cells: list[dict[str, Any]]) -> list[str]:
    """The bursts measured alone and beside training, trial by trial: per (pair, burst, mode) the violations of
    each (median / worst) and the trials within 1% — with the burst alone, what one instance serves at all."""
    rows: dict[tuple[str, str, str], tuple[list[float], list[float]]] = {}
    for c in cells:
        for name, r in c["scenarios"].items():
            if not name.endswith(ALONE) or r.get("slo_violations") is None:
                continue
            beside = c["scenarios"].get(name[: -len(ALONE)], {}).get("slo_violations")
            alone_v, beside_v = rows.setdefault((c["pair"], name[: -len(ALONE)], c["mode"]), ([], []))
            alone_v.append(r["slo_violations"])
            if beside is not None:
                beside_v.append(beside)
    if not rows:
        return []

    def stat(v: list[float]) -> str:
        if not v:
            return "–"
        return f"{statistics.median(v) * 100:.1f}% / {max(v) * 100:.1f}% ({sum(x <= 0.01 for x in v)} of {len(v)} ≤ 1%)"
    out = ["", "Bursts alone and beside training (SLO violations, *median / worst*, and the trials within 1%; *alone*: "
               "the same arrivals against the inference instance with training idle, in the same stack):", "",
           "| pair | burst | mode | alone | beside training |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {p} | {b} | {m} | {stat(a)} | {stat(t)} |" for (p, b, m), (a, t) in rows.items()]
    return out


def write_matrix(path: Path, text: str) -> None:
    """Replace the generated block of ``path`` (keeping the hand-written text around it), or append it."""
    old = path.read_text() if path.exists() else "# GPU sharing through the product\n"
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + text.rstrip("\n") + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


ARRIVALS = ("paced", "poisson", "bursty")


def load_docs(spec: str) -> list[dict[str, Any]]:
    docs = []
    for name in [x for x in spec.split(",") if x]:
        path = Path(name)
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        docs.append(json.loads(raw))
    return docs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="noshim,shim,mps50")
    ap.add_argument("--pairs", default="resnet50+train,bert+train")
    ap.add_argument("--pair-modes", default="", help="other modes for some pairs: 'bert+train=noshim,slo-ts;...'")
    ap.add_argument("--priority", default="", help="(pair, mode) columns most important first, cut from the end "
                                                    "when over --budget-s: 'resnet50+train:noshim,slo-ts;bert+train:noshim'")
    ap.add_argument("--scenarios", default="cold,solo,share,paced,poisson,burst,idle")
    ap.add_argument("--arrivals", default=None,
                    help=f"arrival processes beside training, among {ARRIVALS} (default: those in --scenarios)")
    ap.add_argument("--loads", default="0.5,0.7")
    ap.add_argument("--besides", default="", help="the scenarios beside training, explicitly (instead of --arrivals x "
                                                  "--loads and burst): 'paced@0.5,poisson@0.3,bursty@0.7,burst'")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--slo-ms", type=float, default=0.0,
                    help="annotate the inference action of the slo modes with gpu-slo-ms (what a user who states an "
                         "objective writes); 0: none, the law derives its target")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="cut the stacks whose estimated H200 time passes this (0: no cut); the plan is printed")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="while running, skip a stack that would end past this many seconds (0: none)")
    ap.add_argument("--plan-only", action="store_true", help="print the plan and its estimate, run nothing")
    ap.add_argument("--isolation-fallback", action="store_true",
                    help="when a stack's GPU actions fail to cold-start under process isolation, run that stack again "
                         "and every later one with --invoker-process-isolation off (recorded in the results)")
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks/data/gpu_product.json"))
    ap.add_argument("--report", default=None, help="write the per-stack report here")
    ap.add_argument("--matrix", default=None,
                    help="write the matrix tables into this page's generated block (docs/benchmarks/gpu-product.md)")
    ap.add_argument("--from-json", default=None, help="only render the reports from results files (comma-separated, "
                                                      ".json or .json.gz)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep each stack's work directory (logs, data)")
    args = ap.parse_args()
    if args.from_json:
        docs = load_docs(args.from_json)
    else:
        args.modes = [m for m in args.modes.split(",") if m]
        args.pairs = [p for p in args.pairs.split(",") if p]
        args.pair_modes = {k: [m for m in v.split(",") if m] for k, _, v in
                           (x.partition("=") for x in args.pair_modes.split(";") if x)}
        every = set(args.modes) | {m for ms in args.pair_modes.values() for m in ms}
        bad = sorted(m for m in every if m not in MODES)
        if bad:
            ap.error(f"unknown modes {bad}; known: {list(MODES)}")
        if any(p not in PAIRS for p in [*args.pairs, *args.pair_modes]):
            ap.error(f"pairs must be among {list(PAIRS)}")
        args.scenarios = [s for s in args.scenarios.split(",") if s]
        args.arrivals = ([a for a in args.arrivals.split(",") if a] if args.arrivals is not None
                         else [a for a in ARRIVALS if a in args.scenarios])
        if any(a not in ARRIVALS for a in args.arrivals):
            ap.error(f"arrivals must be among {ARRIVALS}")
        args.loads = [float(x) for x in args.loads.split(",") if x]
        args.extra_flags = []
        args.besides = [x for x in args.besides.split(",") if x]
        for item in args.besides:
            kind, _, load = item.partition("@")
            if item != "burst" and (kind not in (*ARRIVALS, "burst") or not re.fullmatch(r"[0-9]+\.?[0-9]*|\.[0-9]+", load)):
                ap.error(f"--besides: {item!r} is not burst[@<base load>] or <arrival>@<load>, arrival among {ARRIVALS}")
        if args.plan_only:
            print_plan(args, *plan(args))
            return 0
        doc = asyncio.run(main_async(args))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=1))
        docs = [doc]
    text = "\n".join(report(d) for d in docs)
    if args.report:
        Path(args.report).write_text(text)
    if args.matrix:
        write_matrix(Path(args.matrix), matrix_report(docs))
    print(text)
    if args.matrix:
        print(matrix_report(docs))
    return 0 if any(d["cells"] for d in docs) else 1


if __name__ == "__main__":
    sys.exit(main())
