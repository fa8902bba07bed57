"""Cold starts through the product: `dilu-invoker standalone` (process backend), actions created over the REST
API with `--kind python:3-gpu` as `wsk` creates them, measured at the client and inside the action.

    python3 bench/coldstart.py step NAME --out DIR [--preload N] [--model resnet50|bert] [--count 3]
        [--weights-file PATH] [--weights-gib 14] [--isolation on|off] [--dry-run]
    python3 bench/coldstart.py report --data DIR [--report docs/benchmarks/coldstart.md] [--command TEXT]

Steps (each writes DIR/<step>.json as soon as it has its figures; bench/h200_coldstart.sh runs them in order
of value, each under its own timeout):

* ``cold``: ``--count`` actions of one model (ResNet-50 fp16 torchvision, random weights; BERT-base from
  transformers' config, or a torch-only encoder of BERT-base's size without transformers), each invoked once
  cold (container start, /init, build, move to the GPU, first inference) and then warm; with ``--preload N``
  when the CLI has that flag (pre-loaded processes per kind), else pre-warming only (Tyche's baseline), which
  ``--preload 0`` also selects.
* ``weights``: a ~7B-parameter random fp16 weights file (``--weights-gib``, safetensors layout) loaded to the
  GPU inside actions: the plain path (one read, one copy) against ``models.read_weights`` (parallel reads into
  pinned buffers, async copies), from the page cache, from a pinned host cache (a second load in the warm
  container), and cold (``posix_fadvise(DONTNEED)`` after ``fsync``, done by the harness as root).
* ``share``: two instances of one function that ``models.load`` the weights file: the first holds them, the
  second maps them through CUDA IPC; GPU memory (NVML through nvidia-smi) before, after the first and after
  the second, and per process.
* ``staged``: staged exit time-sliced — a function with declared weights scaled to zero and invoked again,
  with ``--invoker-weights-grace-s 60`` (its weights kept, the new instance maps them) and ``0``.
* ``rewake``: ResNet-50 written with ``models.load``, pre-loading on, default sharing (MPS under isolation):
  cold, then ``--count`` cycles of scale-to-zero and a cold invoke on a pre-loaded container, with the
  weights kept (grace 60) and not (grace 0), side by side.
* ``first_after_put``: a function's very first request on the node, ResNet-50 written with ``models.load``
  at module level: PUT, wait until the invoker has pre-loaded the model (``--invoker-model-preload-mb``, the
  metric ``dilu_invoker_model_preloads_total{event="ready"}``) and a pre-loaded container is ready, invoke;
  ``--count`` functions, each invoked first once, with model pre-loading on and off (``0``), side by side.
* ``ipc``: the same two-instance exchange outside the product (two processes of one uid, a 1 GiB model), to
  tell a product-side failure from a driver-side one.

``--dry-run`` runs every step without a GPU or torch (small files, CPU paths, sleep-based models), as it is
checked on a CPU machine first.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from loadgen import invoke_result, put_gpu_action, stop_process_tree, wait_for_api

GUEST = "23bc46b1-71f6-4ed5-8c54-816aa4f8c502:123zO3xZCLrMN6v2BKK1dXYFpXlPkccOFqm12CdAsMgRU4VrNZ9lyGVCGuMDGIwP"


def instance_of(invoke: dict[str, Any]) -> str | None:
    """Which instance answered a share invoke: its token (older runs: its pid)."""
    res = invoke.get("result") or {}
    token = res.get("instance", res.get("pid"))
    return None if token is None else str(token)


# -- the actions' code (what a user would write) ------------------------------------------------------------

MODEL_CODE = r'''
import time
T_IMPORT0 = time.perf_counter()
try:
    import torch
except ImportError:
    torch = None
T_IMPORT = time.perf_counter() - T_IMPORT0
_model = None
_make = None
_stages = {}

def _bert_like():
    import torch.nn as nn
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30522, 768)
            self.pos = nn.Embedding(512, 768)
            layer = nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
        def forward(self, ids):
            pos = torch.arange(ids.shape[1], device=ids.device)
            return self.enc(self.emb(ids) + self.pos(pos))
    return Encoder()

def _build(name, batch, via_models=False):
    global _model, _make
    dev = "cuda"
    t = time.perf_counter()
    if name == "resnet50" and via_models:  # the models API: the first instance holds, the next ones map
        import torchvision
        from dilu_invoker.actions import models
        _stages["import_model_lib_s"] = time.perf_counter() - t
        t = time.perf_counter()
        torch.empty(1, device=dev)
        _stages["cuda_context_s"] = time.perf_counter() - t
        t = time.perf_counter()
        _model = models.load("resnet50", lambda: torchvision.models.resnet50(weights=None).half().eval(), device=dev)
        torch.cuda.synchronize()
        info = models.info("resnet50")
        _stages.update(load_s=time.perf_counter() - t, role=info.role, reason=info.reason)
        _make = lambda: torch.randn(batch, 3, 224, 224, dtype=torch.half, device=dev)
        return
    if name == "resnet50":
        import torchvision
        _stages["import_model_lib_s"] = time.perf_counter() - t
        t = time.perf_counter()
        m = torchvision.models.resnet50(weights=None)
        _make = lambda: torch.randn(batch, 3, 224, 224, dtype=torch.half, device=dev)
    else:
        try:
            from transformers import BertConfig, BertModel
            _stages["bert"] = "transformers"
            _stages["import_model_lib_s"] = time.perf_counter() - t
            t = time.perf_counter()
            m = BertModel(BertConfig())
        except ImportError:
            _stages["bert"] = "torch-only encoder of BERT-base's size"
            _stages["import_model_lib_s"] = time.perf_counter() - t
            t = time.perf_counter()
            m = _bert_like()
        _make = lambda: torch.randint(0, 30000, (batch, 128), device=dev)
    _stages["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    torch.cuda.init(); torch.empty(1, device=dev)
    _stages["cuda_context_s"] = time.perf_counter() - t
    t = time.perf_counter()
    _model = m.eval().half().to(dev)
    torch.cuda.synchronize()
    _stages["to_gpu_s"] = time.perf_counter() - t

def main(args):
    t0 = time.perf_counter()
    first = _model is None
    if args.get("dry") or torch is None:
        time.sleep(float(args.get("dry_ms", 5)) / 1000)
        return {"run_ms": (time.perf_counter() - t0) * 1000, "first": first, "import_torch_s": T_IMPORT}
    if first:
        _build(args.get("model", "resnet50"), int(args.get("batch", 8)), bool(args.get("via_models")))
    t = time.perf_counter()
    with torch.inference_mode():
        out = _model(_make())
        if not isinstance(out, torch.Tensor):
            out = out.last_hidden_state
        out.float().sum().item()
    res = {"run_ms": (time.perf_counter() - t0) * 1000, "infer_ms": (time.perf_counter() - t) * 1000,
           "first": first, "import_torch_s": T_IMPORT}
    if first:
        res.update(_stages)
    return res
'''

WEIGHTS_CODE = r'''
import gc, os, time
try:
    import torch
except ImportError:
    torch = None
from dilu_invoker.actions import models
_keep = {}

def main(args):
    path, how = args["path"], args.get("how", "fast")
    dev = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    _keep.clear(); gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.empty(1, device=dev); torch.cuda.synchronize()
    if how == "plain":
        w = models.plain_read(path, device=dev)
    elif how == "hostcache":
        w = models.read_weights(path, device=dev, host_cache=True)
    else:
        w = models.read_weights(path, device=dev, threads=int(args.get("threads", 0)) or None)
    probe = next(iter(w.tensors.values()))
    check = float(probe.reshape(-1)[:1024].float().sum()) if dev == "cuda" else float(probe.reshape(-1)[:1024].astype("float32").sum())
    check = check if abs(check) < 1e300 else None
    _keep["w"] = w
    res = {"how": how, "seconds": w.seconds, "gib": w.nbytes / 2**30, "gib_s": w.nbytes / 2**30 / w.seconds,
           "source": w.source, "threads": w.threads, "device": dev, "check": check}
    if args.get("free", True):
        _keep.clear(); gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return res
'''

SHARE_CODE = r'''
import os, time
try:
    import torch
except ImportError:
    torch = None
from dilu_invoker.actions import models

# Which instance answered (PIDs repeat across the PID namespaces of isolated containers)
INSTANCE = os.urandom(8).hex()

def main(args):
    t0 = time.perf_counter()
    dev = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.empty(1, device=dev); torch.cuda.synchronize()
    ctx_s = time.perf_counter() - t0
    w = models.load("weights", args["path"], device=dev)
    m = models.info("weights")
    probe = next(iter(w.values()))
    check = float(probe.reshape(-1)[:1024].float().sum()) if dev == "cuda" else float(probe.reshape(-1)[:1024].astype("float32").sum())
    check = check if abs(check) < 1e300 else None
    hold = float(args.get("hold_s", 0))
    if hold:
        time.sleep(hold)
    return {"pid": os.getpid(), "instance": INSTANCE, "role": m.role, "reason": m.reason, "load_s": m.seconds,
            "context_s": ctx_s, "gib": m.nbytes / 2**30, "check": check,
            "torch_allocated_gib": torch.cuda.memory_allocated() / 2**30 if dev == "cuda" else 0.0}
'''

# The model at module level, so that /init loads it — a model pre-load's /init too (docs/runtime.md, "Fast
# cold starts, what to write"); the first call reports how it came.
FIRST_AFTER_PUT_CODE = MODEL_CODE + r'''
_T_MODULE0 = time.perf_counter()
if torch is not None and torch.cuda.is_available():
    _build("resnet50", 8, True)
else:  # a dry run: a small array through the models API's CPU path (a memfd)
    import numpy as np
    from dilu_invoker.actions import models
    models.load("dry", lambda: {"w": np.zeros(1 << 16, dtype=np.float32)})
    _stages.update(role=models.info("dry").role, load_s=models.info("dry").seconds)
_stages["module_init_s"] = time.perf_counter() - _T_MODULE0
_module_main = main
_calls = []

def main(args):
    res = _module_main(args)
    if not _calls:
        res.update(_stages, first=True)
    _calls.append(1)
    return res
'''

# -- small helpers ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rnd(x: float | None, n: int = 3) -> float | None:
    return None if x is None else round(x, n)


def save(out: Path, name: str, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, out / f"{name}.json")


def cli_has_flag(flag: str) -> bool:
    r = subprocess.run([sys.executable, "-m", "dilu_invoker", "standalone", "--help-all"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return flag in r.stdout


def cli_has_preload() -> bool:
    r = subprocess.run([sys.executable, "-m", "dilu_invoker", "standalone", "--help-all"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return "--preload" in r.stdout


def gpu_memory() -> dict[str, Any] | None:
    """Used memory of GPU 0 and per compute process (MiB), from nvidia-smi (NVML)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
                                "-i", "0"], capture_output=True, text=True, timeout=20).stdout.strip()
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    used, tot = (float(x) for x in total.split(",")[:2])
    procs = {}
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            with contextlib.suppress(ValueError):
                procs[parts[0]] = float(parts[1])
    return {"used_mib": used, "total_mib": tot, "processes_mib": procs}


def drop_cache(path: str) -> dict[str, Any]:
    """Evict a file from the page cache (fsync first: dirty pages are not dropped); measures how much stayed."""
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    res: dict[str, Any] = {"drop_s": rnd(time.perf_counter() - t)}
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            res["cached_kib_after"] = next(int(line.split()[1]) for line in f if line.startswith("Cached:"))
    return res


def make_weights_file(path: Path, gib: float, dry: bool) -> dict[str, Any]:
    """A ~7B-parameter random fp16 model as one safetensors file: 32 layers of 4 + 3 matrices (like a 7B
    decoder's attention and MLP), sized to ``gib``; random bytes (numpy), written once and reused."""
    import numpy as np

    from dilu_invoker.actions import models

    if path.exists() and path.stat().st_size > gib * 2**30 * 0.95:
        return {"path": str(path), "bytes": path.stat().st_size, "made_s": 0.0, "reused": True}
    t = time.perf_counter()
    hidden = 4096 if not dry else 256
    layers = 32
    per_layer = 4 * hidden * hidden + 3 * hidden * int(hidden * 2.6875)
    target = int(gib * 2**30 / 2)
    layers = max(1, round(target / per_layer))
    rng = np.random.default_rng(1)
    block = rng.integers(0, 2**15, size=hidden * hidden, dtype=np.uint16).view(np.float16)
    block[np.isnan(block) | np.isinf(block)] = 0
    tensors: dict[str, Any] = {}
    for layer in range(layers):
        for m in ("q", "k", "v", "o"):
            tensors[f"layers.{layer}.attn.{m}"] = block.reshape(hidden, hidden)
        mlp = int(hidden * 2.6875)
        big = np.resize(block, hidden * mlp).reshape(mlp, hidden)
        for m in ("gate", "up", "down"):
            tensors[f"layers.{layer}.mlp.{m}"] = big
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o755)
    part = path.with_name(path.name + ".part")
    size = models.save_file(str(part), tensors)
    os.chmod(part, 0o644)  # the action runs as its own uid
    os.replace(part, path)
    return {"path": str(path), "bytes": size, "params": sum(a.size for a in tensors.values()), "layers": layers,
            "made_s": rnd(time.perf_counter() - t), "reused": False}


# -- one standalone ------------------------------------------------------------------------------------------


class Stack:
    def __init__(self, args: argparse.Namespace, work: Path, extra: list[str]) -> None:
        self.args, self.work, self.extra = args, work, extra
        self.api_port, self.inv_port = free_port(), free_port()
        self.api = f"http://127.0.0.1:{self.api_port}/api/v1/namespaces/_/actions"
        user, key = GUEST.split(":")
        token = base64.b64encode(f"{user}:{key}".encode()).decode()
        self.auth = {"Authorization": f"Basic {token}"}  # what wsk sends
        self.proc: subprocess.Popen[bytes] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.log_path = work / "standalone.log"
        self.started_s = 0.0
        work.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "dilu_invoker", "standalone", "--data-dir", str(self.work / "data"),
               "--api-port", str(self.api_port), "--invoker-port", str(self.inv_port),
               "--invoker-user-memory-mb", "200000", "--gpu-shm-dir", str(self.work / "shm"),
               "--gpu-mps-dir", str(self.work / "mps"), *self.extra]
        if self.args.isolation == "off":
            cmd += ["--invoker-process-isolation", "off"]
        if self.args.dry_run:
            cmd += ["--gpu-mps", "off"]
        return cmd

    async def __aenter__(self) -> Stack:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "DILU_LOG_LEVEL": "info", "PYTHONUNBUFFERED": "1"}
        env.pop("LD_PRELOAD", None)
        self.log = open(self.log_path, "wb")
        t = time.perf_counter()
        self.proc = subprocess.Popen(self.command(), env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=300))
        await wait_for_api(self.session, f"http://127.0.0.1:{self.api_port}/api/v1", self.proc,
                           what=f"standalone (see {self.log_path})")
        self.started_s = time.perf_counter() - t
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()
        await stop_process_tree(self.proc, grace_s=8)
        self.log.close()

    async def create(self, name: str, code: str, *, memory_mb: int = 8192, gpu_memory_mb: int = 16384,
                     sm_limit: float = 0.5, min_instances: int = 0, weights_mb: int = 0) -> None:
        """A GPU action; its SM limit is small enough that the step's actions (and a pre-loaded container's
        placeholder share) fit on one GPU together (Σ limit ≤ γ 1.5), else the later ones are refused."""
        assert self.session is not None
        annotations = [{"key": "gpu-class", "value": "inference"}, {"key": "gpu-sm-request", "value": sm_limit / 2},
                       {"key": "gpu-sm-limit", "value": sm_limit}, {"key": "gpu-memory-mb", "value": gpu_memory_mb}]
        if min_instances:
            annotations.append({"key": "min-instances", "value": min_instances})
        if weights_mb:  # read-only weights its instances on one GPU share: counted once in the GPU budget
            annotations.append({"key": "gpu-weights-mb", "value": weights_mb})
        await put_gpu_action(self.session, self.api, name, code, annotations, memory_mb=memory_mb, headers=self.auth)

    async def invoke(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        assert self.session is not None
        ms, status, data = await invoke_result(self.session, self.api, name, params, headers=self.auth)
        return {"client_ms": rnd(ms, 2), "status": status,
                "result": {"text": data[:500]} if isinstance(data, str) else data}

    async def metrics_text(self) -> str:
        assert self.session is not None
        try:
            async with self.session.get(f"http://127.0.0.1:{self.inv_port}/metrics") as r:
                return await r.text()
        except aiohttp.ClientError:
            return ""

    async def preload_lines(self) -> list[str]:
        return [line for line in (await self.metrics_text()).splitlines()
                if "preload" in line and not line.startswith("#")]

    async def wait_preloaded(self, least: float, most: float) -> dict[str, Any]:
        """At least ``least`` s (importing torch in a pre-loaded process takes seconds), then until a
        pre-loaded container is ready (``dilu_invoker_preload_containers{state="ready"}`` positive), at most
        ``most`` s in all. Only the ready gauge counts: a loading container already holds its GPU share."""
        t = time.perf_counter()
        seen: list[str] = []
        while time.perf_counter() - t < most:
            seen = await self.preload_lines()
            now = time.perf_counter() - t
            ready = [ln for ln in seen if ln.startswith("dilu_invoker_preload_containers")
                     and 'state="ready"' in ln and _value(ln) > 0]
            if ready and now >= least:
                return {"waited_s": rnd(now), "ready": ready}
            await asyncio.sleep(0.25)
        return {"waited_s": rnd(time.perf_counter() - t), "ready": None, "preload_lines": seen[:20]}


def _value(line: str) -> float:
    try:
        return float(line.split()[-1])
    except (ValueError, IndexError):
        return 0.0


def preload_flags(args: argparse.Namespace, has_flag: bool) -> list[str]:
    if not has_flag:
        return []
    return ["--preload", str(args.preload), *(args.extra.split() if args.preload else [])]


# -- steps ---------------------------------------------------------------------------------------------------


async def step_cold(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    has = cli_has_preload()
    if args.preload and not has:
        return {"step": "cold", "skipped": "this dilu-invoker has no --preload flag (pre-loading not built)",
                "preload": args.preload}
    res: dict[str, Any] = {"step": "cold", "model": args.model, "preload": args.preload if has else None,
                           "preload_flag": has, "cold": [], "warm": []}
    dry = {"dry": True} if args.dry_run else {}
    async with Stack(args, work, preload_flags(args, has)) as st:
        res["standalone_start_s"] = rnd(st.started_s)
        res["command"] = " ".join(st.command()[1:])
        names = [f"{args.model}-{i}" for i in range(args.count)]
        # every action and the pre-loaded placeholder (limit 0.5) on one GPU: Σ limit ≤ γ 1.5
        sm_limit = round(min(1.0, (1.5 - (0.5 if args.preload else 0.0)) / len(names)) - 0.005, 2)
        res["sm_limit"] = sm_limit
        for n in names:
            await st.create(n, MODEL_CODE, sm_limit=sm_limit)
        for i, n in enumerate(names):
            if args.preload and has:
                least = args.preload_min_wait_s if i == 0 else args.refill_min_wait_s
                most = args.preload_wait_s if i == 0 else args.refill_wait_s
                res.setdefault("preload_wait", []).append(await st.wait_preloaded(least, most))
            r = await st.invoke(n, {"model": args.model, "batch": 8, **dry})
            res["cold"].append(r)
            save(args.out, args.name, res)
        for _ in range(args.warm):
            res["warm"].append(await st.invoke(names[0], {"model": args.model, "batch": 8, **dry}))
        res["preload_metrics"] = await st.preload_lines()
    ok = [c["client_ms"] for c in res["cold"] if c["status"] == 200]
    warm = [c["client_ms"] for c in res["warm"] if c["status"] == 200]
    res["summary"] = {"cold_ok": len(ok), "cold_ms": ok, "cold_median_ms": rnd(statistics.median(ok), 1) if ok else None,
                      "warm_median_ms": rnd(statistics.median(warm), 2) if warm else None,
                      "warm_p90_ms": rnd(sorted(warm)[int(0.9 * (len(warm) - 1))], 2) if warm else None}
    return res


async def step_weights(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"step": "weights", "runs": []}
    wf = make_weights_file(Path(args.weights_file), args.weights_gib, args.dry_run)
    res["file"] = wf
    save(args.out, args.name, res)
    path = wf["path"]
    has = cli_has_preload()
    async with Stack(args, work, ["--preload", "0"] if has else []) as st:
        res["command"] = " ".join(st.command()[1:])
        mem = int(args.weights_gib * 1024 * 2.5) + 4096
        gmem = int(args.weights_gib * 1024 * 1.2) + 2048
        await st.create("w-plain", WEIGHTS_CODE, memory_mb=mem, gpu_memory_mb=gmem)
        await st.create("w-fast", WEIGHTS_CODE, memory_mb=mem, gpu_memory_mb=gmem)
        # a cold read in a process of its own: w-fast's process keeps the pinned host cache it filled
        await st.create("w-cold", WEIGHTS_CODE, memory_mb=mem, gpu_memory_mb=gmem)

        async def run(label: str, action: str, params: dict[str, Any]) -> None:
            r = await st.invoke(action, {"path": path, **params})
            r["label"] = label
            res["runs"].append(r)
            save(args.out, args.name, res)

        # From the page cache (the file was just written or read): cold invokes, then warm repeats.
        await run("fast, page cache, cold invoke", "w-fast", {"how": "fast"})
        await run("plain, page cache, cold invoke", "w-plain", {"how": "plain"})
        await run("fast, page cache, warm", "w-fast", {"how": "fast"})
        await run("plain, page cache, warm", "w-plain", {"how": "plain"})
        await run("fast, page cache, 16 threads", "w-fast", {"how": "fast", "threads": 16})
        await run("host cache fill (page cache -> pinned -> GPU)", "w-fast", {"how": "hostcache"})
        await run("fast, pinned host cache", "w-fast", {"how": "hostcache"})
        await run("fast, pinned host cache, again", "w-fast", {"how": "hostcache"})
        res["drop_fast"] = drop_cache(path)
        await run("fast, cold read (page cache dropped)", "w-cold", {"how": "fast"})
        res["drop_plain"] = drop_cache(path)
        await run("plain, cold read (page cache dropped)", "w-plain", {"how": "plain"})
    return res


async def step_share(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"step": "share"}
    wf = make_weights_file(Path(args.weights_file), args.weights_gib, args.dry_run)
    res["file"] = wf
    has = cli_has_preload()
    async with Stack(args, work, ["--preload", "0"] if has else []) as st:
        res["command"] = " ".join(st.command()[1:])
        res["gpu_before"] = gpu_memory()
        gmem = int(args.weights_gib * 1024 * 1.2) + 2048
        # min-instances 2: the balancer keeps two instances of the function, both on the one GPU
        await st.create("shared", SHARE_CODE, memory_mb=8192, gpu_memory_mb=gmem, min_instances=2,
                        weights_mb=min(gmem, int(wf["bytes"] / 2**20)))
        res["first"] = await st.invoke("shared", {"path": wf["path"]})
        await asyncio.sleep(0.5)
        res["gpu_after_first"] = gpu_memory()
        save(args.out, args.name, res)
        first_id = instance_of(res["first"])
        # Two held invokes at once: one of them lands on the instance that has not loaded yet.
        for _attempt in range(3):
            both = await asyncio.gather(*(st.invoke("shared", {"path": wf["path"], "hold_s": args.hold_s})
                                          for _ in range(2)))
            other = [r for r in both if instance_of(r) not in (None, first_id)]
            res.setdefault("attempts", []).append(both)
            if other:
                res["second"] = other[0]
                break
        res["gpu_after_second"] = gpu_memory()
        save(args.out, args.name, res)
    b, a1, a2 = res["gpu_before"], res["gpu_after_first"], res["gpu_after_second"]
    if b and a1 and a2 and res.get("second"):
        weights_mib = wf["bytes"] / 2**20
        res["summary"] = {"weights_mib": rnd(weights_mib, 1), "first_added_mib": a1["used_mib"] - b["used_mib"],
                          "second_added_mib": a2["used_mib"] - a1["used_mib"],
                          "second_added_fraction_of_weights": rnd((a2["used_mib"] - a1["used_mib"]) / weights_mib, 4)}
    return res


async def step_staged(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Staged exit through the product: a function with declared weights is scaled to zero, then invoked
    again. With ``--invoker-weights-grace-s 60`` its last process keeps the weights and the new instance maps
    them; with ``0`` (the baseline, same run) the new instance loads them again. Time-sliced (``--gpu-mps off``):
    between isolated MPS clients nothing is kept (docs/invoker.md)."""
    wf = make_weights_file(Path(args.weights_file), args.weights_gib, args.dry_run)
    res: dict[str, Any] = {"step": "staged", "file": wf, "arms": {}}
    gmem = int(args.weights_gib * 1024 * 1.2) + 2048
    for grace in ("60", "0"):
        arm: dict[str, Any] = {}
        res["arms"][grace] = arm
        extra = ["--preload", "0", "--gpu-mps", "off", "--invoker-weights-grace-s", grace,
                 "--balancer-scale-to-zero-after-s", "2", "--balancer-cooldown-s", "0.5"]
        if args.dry_run:  # no GPU here: a simulated one, so that the instances are placed and scaled in
            (work / "inventory.json").write_text(json.dumps([{"uuid": "GPU-dry-staged", "memory_mb": 81920}]))
            extra += ["--gpu-inventory", str(work / "inventory.json")]
        async with Stack(args, work / f"staged-{grace}", extra) as st:
            arm["command"] = " ".join(st.command()[1:])
            arm["gpu_before"] = gpu_memory()
            await st.create("staged", SHARE_CODE, memory_mb=8192, gpu_memory_mb=gmem,
                            weights_mb=min(gmem, int(wf["bytes"] / 2**20)))
            arm["first"] = await st.invoke("staged", {"path": wf["path"]})
            arm["gpu_after_first"] = gpu_memory()
            # Idle: the balancer scales the function to zero (2 s), then the instance is stopped.
            t = time.perf_counter()
            while time.perf_counter() - t < 30:
                text = await st.metrics_text()
                kept = any(line.startswith("dilu_invoker_weights_kept ") and not line.endswith(" 0.0")
                           for line in text.splitlines())
                stopped = 'dilu_invoker_containers{state="ready"} 0.0' in text
                if (kept if grace != "0" else stopped):
                    break
                await asyncio.sleep(0.2)
            arm["scaled_in_after_s"] = rnd(time.perf_counter() - t, 2)
            arm["kept_lines"] = [line for line in (await st.metrics_text()).splitlines()
                                 if line.startswith("dilu_invoker_weights_kept") and "_created" not in line]
            arm["gpu_scaled_in"] = gpu_memory()
            arm["second"] = await st.invoke("staged", {"path": wf["path"]})
            arm["gpu_after_second"] = gpu_memory()
            save(args.out, args.name, res)
    return res


async def step_rewake(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A function woken after it was scaled to zero, as most serverless cold starts are: ResNet-50 written
    with the models API, pre-loading on, the defaults' sharing (MPS under isolation). Each cycle: the
    function is idle until the balancer scales it to zero (2 s), a pre-loaded container is ready again, then
    one cold invoke. With ``--invoker-weights-grace-s 60`` the last process kept the weights (staged exit)
    and the new instance maps them; with ``0`` (same run, the baseline) it builds and loads them."""
    has = cli_has_preload()
    if not has:
        return {"step": "rewake", "skipped": "this dilu-invoker has no --preload flag"}
    res: dict[str, Any] = {"step": "rewake", "arms": {}, "model": "resnet50"}
    dry = {"dry": True} if args.dry_run else {}
    for grace in ("60", "0"):
        arm: dict[str, Any] = {"cold": [], "warm": [], "scale_in": []}
        res["arms"][grace] = arm
        extra = [*preload_flags(args, has), "--invoker-weights-grace-s", grace,
                 "--balancer-scale-to-zero-after-s", "2", "--balancer-cooldown-s", "0.5"]
        if args.dry_run:
            (work / "inventory.json").write_text(json.dumps([{"uuid": "GPU-dry-rewake", "memory_mb": 81920}]))
            extra += ["--gpu-inventory", str(work / "inventory.json")]
        async with Stack(args, work / f"rewake-{grace}", extra) as st:
            arm["command"] = " ".join(st.command()[1:])
            await st.create("rn", MODEL_CODE, sm_limit=0.5, gpu_memory_mb=4096, weights_mb=64)
            params = {"model": "resnet50", "batch": 8, "via_models": True, **dry}
            for cycle in range(args.count + 1):
                if cycle:  # idle: scaled to zero, the instance stopped (and its weights kept, or not)
                    t = time.perf_counter()
                    while time.perf_counter() - t < 30:
                        text = await st.metrics_text()
                        if 'dilu_invoker_containers{state="ready"} 0.0' in text:
                            break
                        await asyncio.sleep(0.2)
                    arm["scale_in"].append({"after_s": rnd(time.perf_counter() - t, 2), "kept": [
                        ln for ln in (await st.metrics_text()).splitlines()
                        if ln.startswith("dilu_invoker_weights_kept") and "_created" not in ln]})
                least = args.preload_min_wait_s if cycle == 0 else args.refill_min_wait_s
                most = args.preload_wait_s if cycle == 0 else args.refill_wait_s
                arm.setdefault("preload_wait", []).append(await st.wait_preloaded(least, most))
                arm["cold"].append(await st.invoke("rn", params))
                for _ in range(args.warm):
                    arm["warm"].append(await st.invoke("rn", params))
                save(args.out, args.name, res)
            arm["preload_metrics"] = await st.preload_lines()
        woken = [c["client_ms"] for c in arm["cold"][1:] if c["status"] == 200]
        warm = [c["client_ms"] for c in arm["warm"] if c["status"] == 200]
        arm["summary"] = {"first_ms": arm["cold"][0]["client_ms"], "woken_ms": woken,
                          "woken_median_ms": rnd(statistics.median(woken), 1) if woken else None,
                          "warm_median_ms": rnd(statistics.median(warm), 2) if warm else None}
        save(args.out, args.name, res)
    res["summary"] = {g: a.get("summary") for g, a in res["arms"].items()}
    return res


async def wait_model_preloads(st: Stack, done: float, most: float) -> dict[str, Any]:
    """Until ``done`` model pre-loads have ended (ready, failed, no_model or skipped), at most ``most`` s."""
    t = time.perf_counter()
    lines: list[str] = []
    while time.perf_counter() - t < most:
        lines = [ln for ln in (await st.metrics_text()).splitlines()
                 if ln.startswith("dilu_invoker_model_preload") and "_created" not in ln]
        ended = sum(_value(ln) for ln in lines if ln.startswith("dilu_invoker_model_preloads_total")
                    and any(f'event="{e}"' in ln for e in ("ready", "failed", "no_model", "skipped")))
        if ended >= done:
            break
        await asyncio.sleep(0.1)
    return {"waited_s": rnd(time.perf_counter() - t, 2), "metrics": lines}


async def step_first_after_put(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A function's first request on the node, after it was created: ResNet-50 through ``models.load`` at
    module level, pre-loaded processes on. With model pre-loading (``--invoker-model-preload-mb 32768``) the
    invoker loads the model on idle GPU room after the PUT and keeps only its weights (staged exit), and the
    first request's instance maps them; with ``0`` (same run, the baseline) the first request builds and loads
    it. Each of ``--count`` functions is created, waited for (its model pre-load, a pre-loaded container
    ready), then invoked once cold and ``--warm`` times warm."""
    if not cli_has_flag("--invoker-model-preload-mb"):
        return {"step": "first_after_put", "skipped": "this dilu-invoker has no --invoker-model-preload-mb flag"}
    has = cli_has_preload()
    res: dict[str, Any] = {"step": "first_after_put", "arms": {}, "model": "resnet50"}
    dry = {"dry": True} if args.dry_run else {}
    for cap in ("32768", "0"):
        arm: dict[str, Any] = {"first": [], "warm": [], "preload": [], "container_wait": []}
        res["arms"][cap] = arm
        extra = [*preload_flags(args, has), "--invoker-model-preload-mb", cap, "--invoker-weights-grace-s", "60"]
        if args.dry_run:
            (work / "inventory.json").write_text(json.dumps([{"uuid": "GPU-dry-fap", "memory_mb": 81920}]))
            extra += ["--gpu-inventory", str(work / "inventory.json")]
        async with Stack(args, work / f"first-after-put-{cap}", extra) as st:
            arm["command"] = " ".join(st.command()[1:])
            # The first pre-loaded container is ready before the first PUT (a model pre-load takes one).
            first_wait = await st.wait_preloaded(args.preload_min_wait_s if has and args.preload else 0.0,
                                                 args.preload_wait_s) if has and args.preload else {"ready": None}
            arm["container_wait"].append(first_wait)
            # none ever came (a dry run: the kind's libraries cannot be pre-imported here): no waiting for more
            refills = bool(first_wait.get("ready"))
            params = {"model": "resnet50", "batch": 8, **dry}
            for i in range(args.count):
                name = f"fap{i}"
                t = time.perf_counter()
                await st.create(name, FIRST_AFTER_PUT_CODE, sm_limit=0.5, gpu_memory_mb=4096, weights_mb=64)
                put_ms = (time.perf_counter() - t) * 1000
                if cap != "0":
                    wait = await wait_model_preloads(st, i + 1, args.preload_wait_s)
                    wait["put_ms"] = rnd(put_ms, 1)
                    arm["preload"].append(wait)
                if refills:  # the model pre-load (or the last first request) took a pre-loaded container
                    arm["container_wait"].append(await st.wait_preloaded(0.0, args.refill_wait_s))
                arm["first"].append(await st.invoke(name, params))
                for _ in range(args.warm):
                    arm["warm"].append(await st.invoke(name, params))
                save(args.out, args.name, res)
            arm["metrics"] = [ln for ln in (await st.metrics_text()).splitlines()
                              if ln.startswith(("dilu_invoker_model_preload", "dilu_invoker_weights_kept"))
                              and "_created" not in ln]
        with contextlib.suppress(OSError):  # each arm's standalone log (tail) beside the data
            (args.out / f"{args.name}.{cap}.standalone.log").write_bytes(st.log_path.read_bytes()[-20000:])
        firsts = [c["client_ms"] for c in arm["first"] if c["status"] == 200]
        warm = [c["client_ms"] for c in arm["warm"] if c["status"] == 200]
        arm["summary"] = {"first_ms": firsts, "first_median_ms": rnd(statistics.median(firsts), 1) if firsts else None,
                          "roles": [(c.get("result") or {}).get("role") for c in arm["first"]],
                          "warm_median_ms": rnd(statistics.median(warm), 2) if warm else None}
        save(args.out, args.name, res)
    res["summary"] = {cap: a.get("summary") for cap, a in res["arms"].items()}
    return res


IPC_CHILD = r'''
import json, os, sys, time
t0 = time.perf_counter()
import torch
print(f"torch imported in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
from dilu_invoker.actions import models
os.environ[models.ENV_KEY] = "bench-ipc-key"
t = time.perf_counter()
torch.empty(1, device="cuda"); torch.cuda.synchronize()
ctx = time.perf_counter() - t
before = torch.cuda.mem_get_info()[0]
if sys.argv[1] == "module":
    def build():
        import torchvision
        return torchvision.models.resnet50(weights=None).half().eval()
    net = models.load("ipc-module", build, device="cuda")
    m = models.info("ipc-module")
    with torch.inference_mode():
        y = net(torch.ones(2, 3, 224, 224, dtype=torch.half, device="cuda"))
    check = float(y.float().sum())
else:
    w = models.load("ipc", sys.argv[2], device="cuda")
    m = models.info("ipc")
    check = float(next(iter(w.values())).reshape(-1)[:1024].float().sum())
torch.cuda.synchronize()
print(f"loaded ({m.role}) after {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
print(json.dumps({"role": m.role, "reason": m.reason, "load_s": m.seconds, "context_s": ctx, "pid": os.getpid(),
                  "gib": m.nbytes / 2**30, "free_drop_mib": (before - torch.cuda.mem_get_info()[0]) / 2**20,
                  "check": check}), flush=True)
sys.stdin.readline()
'''


async def step_ipc(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Two processes of one uid outside the product: the first holds, the second maps (a 1 GiB file, then
    ResNet-50 as an nn.Module built on ``meta`` by the second)."""
    res: dict[str, Any] = {"step": "ipc"}
    if args.dry_run:
        try:
            import torch  # noqa: F401
        except ImportError:
            return {"step": "ipc", "skipped": "no torch (dry run)"}
    wf = make_weights_file(work / "ipc.safetensors", args.ipc_gib, args.dry_run)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for case in ("file", "module"):
        procs: list[subprocess.Popen[str]] = []
        try:
            res[f"{case}_gpu_before"] = gpu_memory()
            for label in ("first", "second"):
                with open(args.out / f"{args.name}_{case}_{label}.stderr", "w") as err:
                    p = subprocess.Popen([sys.executable, "-c", IPC_CHILD, case, wf["path"]], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
                procs.append(p)
                assert p.stdout is not None
                line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 60)
                res[f"{case}_{label}"] = json.loads(line) if line else {"error": f"exit {p.poll()}"}
                res[f"{case}_gpu_after_{label}"] = gpu_memory()
                save(args.out, args.name, res)
        finally:
            for p in procs:
                with contextlib.suppress(OSError):
                    p.kill()
                p.wait()
    return res


async def step_makefile(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    return {"step": "makefile", "file": make_weights_file(Path(args.weights_file), args.weights_gib, args.dry_run)}


STEPS = {"makefile": step_makefile, "cold": step_cold, "weights": step_weights, "share": step_share, "ipc": step_ipc,
         "staged": step_staged, "rewake": step_rewake, "first_after_put": step_first_after_put}


async def run_step(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix=f"dilu-coldstart-{args.step}-"))
    os.chmod(work, 0o755)
    t = time.perf_counter()
    meta = {"machine": machine(), "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    task = asyncio.ensure_future(STEPS[args.step](args, work))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # timeout(1): stop the standalone, keep the data
    try:
        res = await task
        res["ok"] = True
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - recorded, the next step still runs
        res = {"step": args.step, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if (args.out / f"{args.name}.json").exists():
            with contextlib.suppress(ValueError):
                res = {**json.loads((args.out / f"{args.name}.json").read_text()), **res}
    res["meta"] = meta
    res["wall_s"] = rnd(time.perf_counter() - t)
    log = work / "standalone.log"
    if log.exists():
        tail = log.read_bytes()[-20000:]
        (args.out / f"{args.name}.standalone.log").write_bytes(tail)
    save(args.out, args.name, res)
    print(json.dumps({k: v for k, v in res.items() if k in ("step", "ok", "error", "summary", "wall_s")}))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if res.get("ok") else 1


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "kernel": platform.release()}
    with contextlib.suppress(ImportError):
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                                 "--format=csv,noheader"], capture_output=True, text=True,
                                                timeout=20).stdout.strip()
    return info


# -- the report ----------------------------------------------------------------------------------------------


def load_data(data: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(data.glob("*.json"))}


def fmt(x: Any, n: int = 1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{n}f}"
    return str(x)


def report(data: dict[str, dict[str, Any]], command: str) -> str:
    machine_info = next((d["meta"]["machine"] for d in data.values() if "meta" in d), {})
    out = ["# Cold starts through the product", "",
           "What a user gets: the first request to a GPU function that has no warm container, through",
           "`dilu-invoker standalone` (REST API → balancer → invoker → process container → GPU), actions created",
           "over the REST API as `wsk` creates them (`--kind python:3-gpu`), measured at the client; the weight",
           "loader and sharing of `dilu_invoker.actions.models` (docs/runtime.md, \"models\") inside actions.", "",
           f"* **Machine**: {json.dumps(machine_info)}",
           f"* **Command**: `{command}` (each step: `python3 bench/coldstart.py step …`, argv in the raw data)",
           "* **Raw data**: `docs/benchmarks/data/coldstart/*.json` (every invoke's client time and in-action",
           "  stages), the standalone logs' tails beside them. This page is generated from them:",
           "  `python3 bench/coldstart.py report --data docs/benchmarks/data/coldstart`.", ""]
    out += ["## Cold invoke (client)", "",
            "| step | model | pre-loading | cold invokes (ms) | median | warm median (ms) | in-action stages of the first cold (s) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    failures: list[str] = []
    for name, d in data.items():
        if d.get("step") != "cold":
            continue
        if d.get("skipped"):
            out.append(f"| {name} | — | --preload {d.get('preload')} | skipped: {d['skipped']} | | | |")
            continue
        if not d.get("ok") and not d.get("cold"):
            out.append(f"| {name} | {d.get('model', '')} | | failed: {d.get('error')} | | | |")
            continue
        s = d.get("summary") or {}
        cold = d.get("cold") or []
        stages = {}
        if cold and isinstance(cold[0].get("result"), dict):
            stages = {k: rnd(v, 2) if isinstance(v, float) else v for k, v in cold[0]["result"].items()
                      if k.endswith("_s") or k == "bert"}
        pre = "off (pre-warming only)" if not d.get("preload") else f"--preload {d['preload']}"
        if not d.get("preload_flag"):
            pre = "not built (no --preload flag)"
        statuses = ", ".join(f"{c['client_ms']:.0f}" if c["status"] == 200 else f"{c['status']}" for c in cold)
        out.append(f"| {name} | {d.get('model')} | {pre} | {statuses} | {fmt(s.get('cold_median_ms'), 0)} | "
                   f"{fmt(s.get('warm_median_ms'), 2)} | {json.dumps(stages)} |")
        for c in cold:
            if c["status"] != 200:
                err = (c.get("result") or {}).get("error", c.get("result"))
                failures.append(f"* {name}: HTTP {c['status']}: {str(err)[:300]}")
    if failures:
        out += ["", "Cold invokes that did not answer 200:", "", *failures]
    w = data.get("weights")
    if w:
        f = w.get("file") or {}
        out += ["", "## Weights to the GPU (in an action)", "",
                f"File: {fmt(f.get('bytes', 0) / 2**30, 2)} GiB fp16 safetensors, {f.get('params', '—')} parameters "
                f"(random), written by the harness{' (reused)' if f.get('reused') else ''}. The cold rows ran after "
                f"`fsync` + `posix_fadvise(DONTNEED)`; page cache after the drop: {w.get('drop_fast', {})}.", "",
                "| run | client (ms) | load (s) | GiB/s | source | threads |", "| --- | --- | --- | --- | --- | --- |"]
        for r in w.get("runs", []):
            res = r.get("result") or {}
            source = res.get("source", res.get("error", r["status"]))
            if "cold read" in r["label"] and res.get("source") not in (None, "file"):
                source = f"{source} (NOT a cold read: served from the process's pinned host cache)"
            out.append(f"| {r['label']} | {fmt(r['client_ms'], 0)} | {fmt(res.get('seconds'), 3)} | "
                       f"{fmt(res.get('gib_s'), 1)} | {source} | {res.get('threads', '')} |")
        if not w.get("ok"):
            out.append(f"\nThe step stopped early: {w.get('error')}")
    sh = data.get("share")
    if sh:
        out += ["", "## A second instance with shared weights", ""]
        pids = {label: instance_of(sh.get(label) or {}) for label in ("first", "second", "first_again")}
        for label in ("first", "second", "first_again"):
            r = sh.get(label)
            if r:
                res = r.get("result") or {}
                out.append(f"* {label}: client {fmt(r.get('client_ms'), 0)} ms, role `{res.get('role')}`, load "
                           f"{fmt(res.get('load_s'), 3)} s, {fmt(res.get('gib'), 2)} GiB, reason "
                           f"`{res.get('reason', res.get('error', ''))}`, pid {res.get('pid')}")
        for label in ("gpu_before", "gpu_after_first", "gpu_after_second"):
            if sh.get(label):
                out.append(f"* {label}: {sh[label]['used_mib']:.0f} MiB used; per process {sh[label]['processes_mib']}")
        if pids["first"] is not None and pids["first"] in (pids["second"], pids["first_again"]) \
                and pids["second"] in (None, pids["first"]):
            out.append(f"\n**Not measured**: every invoke ran in the first instance's process ({pids['first']}): "
                       "no second instance of the function was started, so nothing was shared.")
        elif sh.get("summary"):
            s = sh["summary"]
            out.append(f"\n**Second instance added {s['second_added_mib']:.0f} MiB = "
                       f"{100 * s['second_added_fraction_of_weights']:.1f}% of the weights' {s['weights_mib']:.0f} MiB** "
                       f"(first instance: {s['first_added_mib']:.0f} MiB). Target: ≤ 10%.")
        if not sh.get("ok"):
            out.append(f"\nThe step stopped early: {sh.get('error')}")
    staged = data.get("staged")
    if staged:
        out += ["", "## Staged exit: the next instance after a scale to zero", "",
                "| `--invoker-weights-grace-s` | first: client ms, role, load s | after the scale-in | "
                "second: client ms, role, load s, reason |", "| --- | --- | --- | --- |"]
        for grace, arm in (staged.get("arms") or {}).items():
            r1 = (arm.get("first") or {}).get("result") or {}
            r2 = (arm.get("second") or {}).get("result") or {}
            out.append(f"| {grace} | {fmt((arm.get('first') or {}).get('client_ms'), 0)}, `{r1.get('role')}`, "
                       f"{fmt(r1.get('load_s'), 3)} | {fmt(arm.get('scaled_in_after_s'), 1)} s; "
                       f"{'; '.join(arm.get('kept_lines') or []) or '-'} | "
                       f"{fmt((arm.get('second') or {}).get('client_ms'), 0)}, `{r2.get('role')}`, "
                       f"{fmt(r2.get('load_s'), 3)}, `{r2.get('reason', r2.get('error', ''))}` |")
    rewake = data.get("rewake")
    if rewake and not rewake.get("skipped"):
        out += ["", "## Woken from zero: ResNet-50 through `models.load` on a pre-loaded container", "",
                "Each cycle: idle until the balancer scaled the function to zero, a pre-loaded container ready "
                "again, one cold invoke (client ms; in the action: the models API's role and load s, first "
                "inference ms).", "",
                "| `--invoker-weights-grace-s` | first cold (never ran here) | woken cold invokes | woken median "
                "| warm median (ms) |", "| --- | --- | --- | --- | --- |"]
        for grace, arm in (rewake.get("arms") or {}).items():
            def cell(c: dict[str, Any]) -> str:
                r = c.get("result") or {}
                return (f"{fmt(c.get('client_ms'), 0)} (`{r.get('role')}`, {fmt(r.get('load_s'), 3)} s, "
                        f"infer {fmt(r.get('infer_ms'), 0)})")
            colds = arm.get("cold") or []
            summ = arm.get("summary") or {}
            out.append(f"| {grace} | {cell(colds[0]) if colds else '-'} | "
                       f"{'; '.join(cell(c) for c in colds[1:]) or '-'} | {fmt(summ.get('woken_median_ms'), 0)} | "
                       f"{fmt(summ.get('warm_median_ms'), 2)} |")
        if not rewake.get("ok"):
            out.append(f"\nThe step stopped early: {rewake.get('error')}")
    fap = data.get("first_after_put")
    if fap and not fap.get("skipped"):
        out += ["", "## A function's first request after its PUT: model pre-loading", "",
                "Each function (ResNet-50 through `models.load` at module level) created, then — with model "
                "pre-loading on — waited for until the invoker had pre-loaded its model (PUT to ready), a "
                "pre-loaded container ready, and invoked once: its first request on the node (client ms; in the "
                "action: the models API's role and load s, first inference ms).", "",
                "| `--invoker-model-preload-mb` | PUT → pre-load ready (s) | first requests | median | warm median "
                "(ms) |", "| --- | --- | --- | --- | --- |"]
        for cap, arm in (fap.get("arms") or {}).items():
            def first_cell(c: dict[str, Any]) -> str:
                r = c.get("result") or {}
                if c.get("status") != 200:
                    return f"HTTP {c.get('status')}"
                return (f"{fmt(c.get('client_ms'), 0)} (`{r.get('role')}`, {fmt(r.get('load_s'), 3)} s, "
                        f"infer {fmt(r.get('infer_ms'), 0)})")
            summ = arm.get("summary") or {}
            waits = ", ".join(fmt(w.get("waited_s"), 2) for w in arm.get("preload") or []) or "— (off)"
            out.append(f"| {cap} | {waits} | {'; '.join(first_cell(c) for c in arm.get('first') or []) or '-'} | "
                       f"{fmt(summ.get('first_median_ms'), 0)} | {fmt(summ.get('warm_median_ms'), 2)} |")
        if not fap.get("ok"):
            out.append(f"\nThe step stopped early: {fap.get('error')}")
    ipc = data.get("ipc")
    if ipc and not ipc.get("skipped"):
        out += ["", "## The same exchange outside the product (two processes of one uid)", ""]
        for case in ("file", "module"):
            for label in ("first", "second"):
                if ipc.get(f"{case}_{label}"):
                    out.append(f"* {case}, {label}: {json.dumps(ipc[f'{case}_{label}'])}")
            for label in ("gpu_before", "gpu_after_first", "gpu_after_second"):
                if ipc.get(f"{case}_{label}"):
                    out.append(f"* {case}, {label}: {ipc[f'{case}_{label}']['used_mib']:.0f} MiB used")
            first, second = ipc.get(f"{case}_first") or {}, ipc.get(f"{case}_second") or {}
            a1, a2 = ipc.get(f"{case}_gpu_after_first") or {}, ipc.get(f"{case}_gpu_after_second") or {}
            if second.get("role") == "mapped" and a1 and a2 and first.get("gib"):
                own = (a2.get("processes_mib") or {}).get(str(second.get("pid")))
                out.append(f"* {case}: the second process mapped {first['gib'] * 1024:.0f} MiB of weights and added "
                           f"{a2['used_mib'] - a1['used_mib']:.0f} MiB of GPU memory in all (its own: {fmt(own, 0)} MiB, "
                           "which is its CUDA context and workspace; a copy would have added the weights' size too)")
        if not ipc.get("ok"):
            out.append(f"\nThe step stopped early: {ipc.get('error')}")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step")
    s.add_argument("step", choices=sorted(STEPS))
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--name", help="the JSON's name (default: the step's)")
    s.add_argument("--model", default="resnet50", choices=["resnet50", "bert"])
    s.add_argument("--preload", type=int, default=0)
    s.add_argument("--preload-wait-s", type=float, default=40.0)
    s.add_argument("--refill-wait-s", type=float, default=15.0)
    s.add_argument("--preload-min-wait-s", type=float, default=8.0)
    s.add_argument("--extra", default="", help="more standalone flags where pre-loading is on")
    s.add_argument("--refill-min-wait-s", type=float, default=5.0)
    s.add_argument("--count", type=int, default=3)
    s.add_argument("--warm", type=int, default=20)
    s.add_argument("--weights-file", default="/srv/dilu-coldstart/weights-7b.safetensors")
    s.add_argument("--weights-gib", type=float, default=14.0)
    s.add_argument("--ipc-gib", type=float, default=1.0)
    s.add_argument("--hold-s", type=float, default=6.0)
    s.add_argument("--isolation", choices=["auto", "off"], default="auto")
    s.add_argument("--dry-run", action="store_true")
    r = sub.add_parser("report")
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--report", type=Path)
    r.add_argument("--command", default="bench/h200_coldstart.sh OUT")
    args = ap.parse_args()
    if args.cmd == "report":
        text = report(load_data(args.data), args.command)
        reading = args.data / "READING.md"  # a person's reading of the run, kept beside its raw data
        if reading.exists():
            text += "\n## Reading this run\n\n" + reading.read_text()
        if args.report:
            args.report.write_text(text)
        else:
            print(text)
        return 0
    args.name = args.name or args.step
    return asyncio.run(run_step(args))


if __name__ == "__main__":
    raise SystemExit(main())
